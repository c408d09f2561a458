"""Routing a user can see: ``predicate='optax'``, the log line, the warning,
and the tensor-parallel axis by name."""

import logging
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax
from tests import support

AXES = ('replicate', 'shard')


def zoo():
  """Leaves the two routing rules disagree on, and some they agree on."""
  rng = np.random.default_rng(0)
  shapes = {
    'embed': {'embedding': (64, 16)},  # an embedding
    'up': {'kernel': (1, 32)},  # 1 x n (Flax's FSDP toy MLP)
    'down': {'kernel': (32, 1)},  # n x 1
    'layers_0': {
      'attn': {'q': (16, 2, 8)},  # (d_model, heads, head_dim)
      'mlp': {'kernel': (16, 24)},
      'norm': {'scale': (16,)},
    },
    'stack': {'w': (3, 16, 8)},  # scanned layers
    'head': {'kernel': (16, 64)},  # the LM head
    'bias': (64,),
  }
  return jax.tree.map(
    lambda s: jnp.asarray(rng.normal(size=s), jnp.float32),
    shapes,
    is_leaf=lambda x: (
      isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    ),
  )


def zoo_dims(params):
  """Dimension numbers for the stacked and attention leaves, the 2-D
  matrices, and None for the rest (the embedding on AdamW)."""

  def one(path, x):
    path = '/'.join(str(k.key) for k in path)
    if path == 'stack/w':
      return MDN(1, 2)
    if path == 'layers_0/attn/q':
      return MDN(0, (1, 2))
    if x.ndim == 2 and 'embed' not in path:
      return MDN()
    return None

  return jax.tree_util.tree_map_with_path(one, params)


def optax_labels(opt, params):
  """Where ``optax.contrib.muon`` sends each leaf, read from its state:
  Muon's momentum holds ``MaskedNode()`` at the leaves it does not own."""
  mu = optax.tree_utils.tree_get(opt.init(params).inner_states['muon'], 'mu')
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return jax.tree.map(
    lambda x: 'adam' if masked(x) else 'muon', mu, is_leaf=masked
  )


class OptaxRoutingTest(parameterized.TestCase):
  """``predicate='optax'`` routes exactly as ``optax.contrib.muon``."""

  @parameterized.named_parameters(('without_dims', False), ('with_dims', True))
  def test_labels_equal_optax(self, with_dims):
    params = zoo()
    dims = zoo_dims(params) if with_dims else None
    want = optax_labels(
      optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims), params
    )
    got = dmuon_jax.muon_labels(
      params, predicate='optax', muon_weight_dimension_numbers=dims
    )
    self.assertEqual(got, want)
    default = dmuon_jax.muon_labels(params, muon_weight_dimension_numbers=dims)
    if with_dims:
      # Given dimension numbers, the default rule is optax's.
      self.assertEqual(default, want)
    else:
      # Without, it differs (what the summary line points out).
      self.assertNotEqual(default, want)
      self.assertEqual(want['up']['kernel'], 'muon')
      self.assertEqual(default['up']['kernel'], 'adam')

  def test_updates_equal_optax(self):
    # The same leaves orthogonalized, so the same numbers: 1 x n and n x 1
    # kernels, the embedding and the head included (one device, 5 steps;
    # float32, 1e-5 relative as every parity test).
    params = zoo()
    ours = dmuon_jax.dmuon(0.02, predicate='optax')
    ref = optax.contrib.muon(0.02)
    p_ours, p_ref = params, params
    s_ours, s_ref = ours.init(params), ref.init(params)
    rng = np.random.default_rng(1)
    step = lambda opt: jax.jit(
      lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
        *opt.update(g, s, p)
      )
    )
    step_ours, step_ref = step(ours), step(ref)
    for _ in range(5):
      g = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params
      )
      p_ours, s_ours = step_ours(g, s_ours, p_ours)
      p_ref, s_ref = step_ref(g, s_ref, p_ref)
    chex.assert_trees_all_close(p_ours, p_ref, rtol=1e-5, atol=1e-6)


class SummaryTest(absltest.TestCase):
  """The routing line: logged once at INFO, and the same in
  ``routing_summary`` and ``plan.summary()``."""

  def test_logged_once_on_first_init(self):
    params = zoo()
    opt = dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=zoo_dims)
    with self.assertLogs('dmuon_jax', logging.INFO) as logs:
      opt.init(params)
      opt.init(params)  # Not again.
    (line,) = logs.output
    labels = dmuon_jax.muon_labels(
      params, muon_weight_dimension_numbers=zoo_dims
    )
    sizes = {'muon': 0, 'adam': 0}
    for x, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels)):
      sizes[label] += x.size
    self.assertEqual(jax.tree.leaves(labels).count('muon'), 6)
    self.assertEqual(
      line,
      'INFO:dmuon_jax:dmuon routing: Muon 6 leaves'
      f' ({sizes["muon"] / 1e3:.3g}K elements,'
      f' {100 * sizes["muon"] / sum(sizes.values()):.1f}%), AdamW 3 leaves'
      f' ({sizes["adam"] / 1e3:.3g}K elements); the same leaves as'
      ' optax.contrib.muon',
    )
    self.assertEqual(
      line.split(':', 2)[2],
      dmuon_jax.routing_summary(params, muon_weight_dimension_numbers=zoo_dims),
    )

  def test_names_what_optax_would_orthogonalize(self):
    params = zoo()
    text = dmuon_jax.routing_summary(params)
    self.assertIn(
      'optax.contrib.muon would orthogonalize 4 of the AdamW leaves:', text
    )
    for leaf in (
      "'down/kernel' (32, 1)",
      "'embed/embedding' (64, 16)",
      "'head/kernel' (16, 64)",
      "'up/kernel' (1, 32)",
    ):
      self.assertIn(leaf, text)
    self.assertIn("predicate='optax'", text)
    # The line docs/reference/routing.md shows for this tree.
    self.assertEqual(
      text,
      'dmuon routing: Muon 1 leaf (384 elements, 11.9%), AdamW 8 leaves'
      ' (2.83K elements); optax.contrib.muon would orthogonalize 4 of the'
      " AdamW leaves: 'down/kernel' (32, 1), 'embed/embedding' (64, 16),"
      " 'head/kernel' (16, 64), 'up/kernel' (1, 32) (predicate='optax'"
      ' routes as optax); 2 AdamW leaves of rank > 2 (scanned layers,'
      ' attention kernels) would go to Muon only with dimension numbers:'
      " 'layers_0/attn/q' (16, 2, 8), 'stack/w' (3, 16, 8)",
    )
    # The plan of the same tree says the same.
    plan = dmuon_jax.plan_ownership(params, {'shard': 2})
    self.assertIn(text, plan.summary())
    # Optax's routing: no difference to point out (the stacks still need
    # dimension numbers, under optax too).
    same = dmuon_jax.routing_summary(params, predicate='optax')
    self.assertIn('; the same leaves as optax.contrib.muon; 2 AdamW', same)

  def test_flax_fsdp_toy_mlp_warns(self):
    # Flax's FSDP example MLP: (1, 32) and (32, 1) kernels only.
    params = {
      'dense1': {'kernel': jnp.ones((1, 32)), 'bias': jnp.zeros((32,))},
      'dense2': {'kernel': jnp.ones((32, 1)), 'bias': jnp.zeros((1,))},
    }
    with self.assertWarnsRegex(
      dmuon_jax.DMuonWarning,
      r"no leaf goes to Muon.*default rule.*both dims > 1.*'dense1/kernel'"
      r" \(1, 32\).*'dense2/kernel' \(32, 1\).*predicate='optax'",
    ):
      dmuon_jax.dmuon(0.02).init(params)
    # Dimension numbers that route every leaf to AdamW: the warning does not
    # blame the default rule, which did not choose.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      dmuon_jax.dmuon(
        0.02, muon_weight_dimension_numbers=jax.tree.map(lambda _: None, params)
      ).init(params)
    (warning,) = caught
    self.assertIn('no leaf goes to Muon', str(warning.message))
    self.assertNotIn('default rule', str(warning.message))
    # With optax's routing the kernels are orthogonalized: no warning.
    state = dmuon_jax.dmuon(0.02, predicate='optax').init(params)
    self.assertLen(dmuon_jax.owner_layouts(state)[0].leaves, 2)


class TensorParallelAxisTest(parameterized.TestCase):
  """``'model'``, ``'tensor'`` and ``'tp'`` are tensor parallel when the
  Muon params are sharded over them, owner axes otherwise."""

  def _layout(self, name, spec):
    mesh = support.make_mesh((1, 4, 2), AXES + (name,))
    params = {'layers_0': {'w': jnp.ones((16, 32)), 'b': jnp.zeros((32,))}}
    params = jax.device_put(params, NamedSharding(mesh, P()))
    params['layers_0']['w'] = jax.device_put(
      params['layers_0']['w'], NamedSharding(mesh, spec)
    )
    state = dmuon_jax.dmuon(0.02, mesh=mesh).init(params)
    return dmuon_jax.owner_layouts(state)[0]

  @parameterized.named_parameters(
    ('model', 'model'), ('tensor', 'tensor'), ('tp', 'tp')
  )
  def test_sharded_over_it(self, name):
    layout = self._layout(name, P(None, name))
    self.assertEqual((layout.tp_axis, layout.tp_size), (name, 2))
    # (the size-1 'replicate' axis owns nothing: no owner axis)
    self.assertEqual(layout.buffer_axes, ('shard',))

  @parameterized.named_parameters(('tensor', 'tensor'), ('tp', 'tp'))
  def test_not_sharded_over_it(self, name):
    layout = self._layout(name, P('shard'))
    self.assertIsNone(layout.tp_axis)
    self.assertEqual(layout.buffer_axes, ('shard', name))

  def test_two_candidates(self):
    mesh = support.make_mesh((2, 2, 2), ('shard', 'model', 'tensor'))
    w = jax.device_put(
      jnp.ones((16, 32)), NamedSharding(mesh, P('model', 'tensor'))
    )
    with self.assertRaisesRegex(
      ValueError,
      r"sharded over the mesh axes \['model', 'tensor'\].*"
      r"tensor_parallel_axis='model'",
    ):
      dmuon_jax.dmuon(0.02, mesh=mesh).init({'layers_0': {'w': w}})


if __name__ == '__main__':
  absltest.main()
