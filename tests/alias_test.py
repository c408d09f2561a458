"""dmuon on one device against optax.contrib.muon and a plain reference loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import _muon as optax_muon
from absl.testing import absltest
from absl.testing import parameterized
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax

STEPS = 20


def make_params(seed=0):
  """A small tree with every kind of leaf dmuon has to route."""
  k = iter(jax.random.split(jax.random.key(seed), 16))
  n = lambda shape: 0.1 * jax.random.normal(next(k), shape, jnp.float32)
  return {
      'embed': {'embedding': n((32, 16))},
      'layers_0': {
          'attn': {'qkv': {'kernel': n((16, 2, 8))},  # (d, heads, head_dim)
                   'out': {'kernel': n((16, 16))}},
          'mlp': {'up': {'kernel': n((16, 40)), 'bias': n((40,))},
                  'down': {'kernel': n((40, 16))}},
          'norm': {'scale': 1 + n((16,))},
      },
      'stack': {'kernel': n((3, 16, 24))},  # scanned layers (L, m, n)
      'odd': {'kernel': n((7, 13))},
      'lm_head': {'kernel': n((16, 32))},
  }


def dim_numbers(params):
  """Explicit routing shared by dmuon and optax in the parity tests."""
  dims = jax.tree.map(lambda x: MDN() if x.ndim == 2 else None, params)
  dims['embed']['embedding'] = None
  dims['lm_head']['kernel'] = None
  if 'qkv' in params.get('layers_0', {}).get('attn', {}):
    dims['layers_0']['attn']['qkv']['kernel'] = MDN(0, (1, 2))
  if 'stack' in params:
    dims['stack']['kernel'] = MDN(1, 2)
  return dims


def grads_at(step, params):
  """Deterministic pseudo-gradients, different at every step."""
  key = jax.random.fold_in(jax.random.key(42), step)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      jax.random.normal(kk, x.shape, x.dtype) * (1 + 0.1 * step)
      for kk, x in zip(keys, leaves)])


def run(opt, params, steps=STEPS, grad_shardings=None):
  """Runs ``steps`` jitted updates; returns params after each step.

  ``grad_shardings`` (a tree of shardings) places the gradients as a
  sharded train step would produce them.
  """
  state = opt.init(params)

  @jax.jit
  def step(params, state, i):
    grads = grads_at(i, params)
    if grad_shardings is not None:
      grads = jax.tree.map(jax.reshard, grads, grad_shardings)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for i in range(steps):
    params, state = step(params, state, i)
    history.append(jax.tree.map(np.asarray, params))
  return history


def assert_trees_rel_close(test, actual, expected, rtol):
  for (path, a), b in zip(jax.tree.flatten_with_path(actual)[0],
                          jax.tree.leaves(expected)):
    err = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    ref = np.linalg.norm(np.asarray(b, np.float64))
    test.assertLessEqual(err, rtol * max(ref, 1e-30),
                         msg=f'{jax.tree_util.keystr(path)}: {err / ref:.3g}')


class OptaxParityTest(parameterized.TestCase):

  @parameterized.named_parameters(
      dict(testcase_name='nesterov_wd_mask', nesterov=True, wd=0.1,
           consistent_rms=None),
      dict(testcase_name='no_nesterov_consistent_rms', nesterov=False, wd=0.0,
           consistent_rms=0.2),
      dict(testcase_name='nesterov_consistent_rms_wd', nesterov=True, wd=0.05,
           consistent_rms=0.2),
  )
  def test_matches_optax_muon(self, nesterov, wd, consistent_rms):
    params = make_params()
    mask = jax.tree.map(lambda x: True, params)
    mask['odd']['kernel'] = False  # decay every Muon matrix but one
    kwargs = dict(learning_rate=0.02, weight_decay=wd,
                  weight_decay_mask=mask, nesterov=nesterov,
                  consistent_rms=consistent_rms, adam_weight_decay=0.01,
                  muon_weight_dimension_numbers=dim_numbers(params))
    ours = run(dmuon_jax.dmuon(**kwargs), params)
    ref = run(optax.contrib.muon(**kwargs), params)
    for i in (0, STEPS // 2, STEPS - 1):
      assert_trees_rel_close(self, ours[i], ref[i], rtol=1e-6)
    # The update moved every leaf: the comparison is not vacuous.
    for a, b in zip(jax.tree.leaves(ours[-1]), jax.tree.leaves(params)):
      self.assertGreater(np.abs(a - np.asarray(b)).max(), 1e-3)

  def test_default_routing_matches_optax_with_same_split(self):
    # Default predicate: embeddings, heads, norms and biases go to AdamW.
    params = make_params()
    del params['stack'], params['layers_0']['attn']['qkv']
    labels = dmuon_jax.muon_labels(params)
    self.assertEqual(labels['embed']['embedding'], 'adam')
    self.assertEqual(labels['lm_head']['kernel'], 'adam')
    self.assertEqual(labels['layers_0']['norm']['scale'], 'adam')
    self.assertEqual(labels['layers_0']['mlp']['up']['bias'], 'adam')
    self.assertEqual(labels['layers_0']['mlp']['up']['kernel'], 'muon')
    ours = run(dmuon_jax.dmuon(0.02), params, steps=5)
    ref = run(optax.contrib.muon(
        0.02, muon_weight_dimension_numbers=dim_numbers(params)), params,
              steps=5)
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=1e-6)

  @parameterized.named_parameters(('you_vs_dion', 'you', 'dion'),
                                  ('jordan_vs_standard', 'jordan', 'standard'))
  def test_presets_match_optax_presets(self, ours_name, optax_name):
    params = make_params()
    dims = dim_numbers(params)
    ours = run(dmuon_jax.dmuon(0.02, ns_coeffs=ours_name,
                               muon_weight_dimension_numbers=dims), params, 5)
    ref = run(optax.contrib.muon(0.02, ns_coeffs=optax_name,
                                 muon_weight_dimension_numbers=dims), params, 5)
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=1e-6)

  def test_adaptive_matches_optax_on_unstacked_leaves(self):
    # optax sums the dual norm over a whole leaf; dmuon per matrix. They agree
    # where a leaf is one matrix.
    params = make_params()
    del params['stack']
    dims = dim_numbers(params)
    kwargs = dict(learning_rate=0.01, adaptive=True,
                  muon_weight_dimension_numbers=dims)
    ours = run(dmuon_jax.dmuon(**kwargs), params, 5)
    ref = run(optax.contrib.muon(**kwargs), params, 5)
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=1e-6)

  def test_gram_algorithm_close_to_direct(self):
    params = make_params()
    dims = dim_numbers(params)
    ours = run(dmuon_jax.dmuon(0.02, ns_algorithm='gram',
                               muon_weight_dimension_numbers=dims), params, 5)
    ref = run(optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims),
              params, 5)
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=1e-4)


@functools.partial(jax.jit, static_argnums=2)
def _optax_ns(x, coeffs, dims):
  return optax_muon.orthogonalize_via_newton_schulz(x, coeffs, 5,
                                                    dimension_numbers=dims)


def reference_sgd_muon(params, dims, *, lr, beta, nesterov, wd, steps):
  """A plain loop of the DMuon/Moonlight rule, leaf by leaf.

  buf = beta * buf + g; u = g + beta * buf (Nesterov) or buf; Muon leaves get
  NS(u) (optax's Newton–Schulz) times Jordan's width factor, plus decoupled
  weight decay; AdamW leaves are left to optax.adamw.
  """
  labels = jax.tree.map(lambda d: 'adam' if d is None else 'muon', dims,
                        is_leaf=lambda d: d is None or isinstance(d, MDN))
  flat_dims = jax.tree.leaves(dims, is_leaf=lambda d: d is None
                              or isinstance(d, MDN))
  adam = optax.adamw(lr, eps=1e-8, weight_decay=0.0, nesterov=nesterov)
  adam_params = jax.tree.map(lambda p, l: p if l == 'adam' else None,
                             params, labels)
  adam_state = adam.init(adam_params)
  bufs = jax.tree.map(jnp.zeros_like, params)
  coeffs = jnp.asarray((3.4445, -4.7750, 2.0315))
  history = []
  for i in range(steps):
    grads = grads_at(i, params)
    adam_grads = jax.tree.map(lambda g, l: g if l == 'adam' else None,
                              grads, labels)
    adam_updates, adam_state = adam.update(adam_grads, adam_state,
                                           adam_params)
    leaves, treedef = jax.tree.flatten(params)
    new_leaves, new_bufs = [], []
    adam_flat = iter(jax.tree.leaves(adam_updates))
    for p, g, b, d in zip(leaves, jax.tree.leaves(grads),
                          jax.tree.leaves(bufs), flat_dims):
      if d is None:
        new_leaves.append(p + next(adam_flat))
        new_bufs.append(b)
        continue
      b = beta * b + g
      u = g + beta * b if nesterov else b
      o = _optax_ns(u, coeffs, d)
      red = (d.reduction_axis,) if isinstance(d.reduction_axis, int) else (
          d.reduction_axis)
      out = (d.output_axis,) if isinstance(d.output_axis, int) else (
          d.output_axis)
      fan_in = np.prod([p.shape[a] for a in red])
      fan_out = np.prod([p.shape[a] for a in out])
      scale = np.sqrt(max(1.0, fan_out / fan_in))
      new_leaves.append(p - lr * (scale * o + wd * p))
      new_bufs.append(b)
    params = jax.tree.unflatten(treedef, new_leaves)
    adam_params = jax.tree.map(lambda p, l: p if l == 'adam' else None,
                               params, labels)
    bufs = jax.tree.unflatten(treedef, new_bufs)
    history.append(jax.tree.map(np.asarray, params))
  return history


class SgdMomentumTest(parameterized.TestCase):

  @parameterized.named_parameters(('nesterov', True), ('plain', False))
  def test_matches_reference_loop(self, nesterov):
    params = make_params()
    dims = dim_numbers(params)
    ours = run(dmuon_jax.dmuon(
        0.02, beta=0.9, weight_decay=0.1, nesterov=nesterov, momentum='sgd',
        muon_weight_dimension_numbers=dims), params)
    ref = reference_sgd_muon(params, dims, lr=0.02, beta=0.9,
                             nesterov=nesterov, wd=0.1, steps=STEPS)
    for i in (0, STEPS - 1):
      assert_trees_rel_close(self, ours[i], ref[i], rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
