"""dmuon on 8 simulated devices: parity, zero redundancy, bytes and memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax
from tests import alias_test

AXES = ('replicate', 'shard')
STEPS = 20
MESHES = (('1x8', (1, 8)), ('2x4', (2, 4)), ('4x2', (4, 2)), ('8x1', (8, 1)))


def make_mesh(shape):
  if jax.device_count() < np.prod(shape):
    raise absltest.SkipTest(f'needs {np.prod(shape)} devices, found '
                            f'{jax.device_count()}')
  return jax.make_mesh(shape, AXES)


def llama_like(seed=0, d=32, f=48, vocab=64, layers=3):
  """Stacked, attention, odd, 1×n and n×1 leaves; 9 Muon matrices."""
  k = iter(jax.random.split(jax.random.key(seed), 16))
  n = lambda shape: 0.1 * jax.random.normal(next(k), shape, jnp.float32)
  params = {
      'embed': n((vocab, d)),
      'layers': {
          'qkv': n((d, 4, 8)),           # (d, heads, head_dim)
          'o': n((d, d)),
          'up': n((layers, d, f)),       # scanned (L, m, n)
          'down': n((f, d)),
          'norm': 1 + n((d,)),
      },
      'odd': n((7, 13)),
      'row': n((1, 24)),
      'col': n((24, 1)),
      'head': n((d, vocab)),
  }
  dims = {
      'embed': None,
      'layers': {'qkv': MDN(0, (1, 2)), 'o': MDN(), 'up': MDN(1, 2),
                 'down': MDN(), 'norm': None},
      'odd': MDN(), 'row': MDN(), 'col': MDN(), 'head': None,
  }
  return params, dims


def fsdp_shardings(params, mesh, axes=('shard',)):
  """Shards each leaf's first dim divisible by ``axes`` (else replicated)."""
  size = int(np.prod([mesh.shape[a] for a in axes]))

  def one(x):
    for dim in range(x.ndim):
      if size > 1 and x.shape[dim] % size == 0:
        spec = [None] * x.ndim
        spec[dim] = axes
        return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, params)


def place(params, mesh, layout):
  if layout == 'replicated':
    return jax.device_put(params, NamedSharding(mesh, P()))
  return jax.device_put(params, fsdp_shardings(params, mesh))


@functools.cache
def reference_history(momentum='optax'):
  params, dims = llama_like()
  if momentum == 'optax':
    return alias_test.run(optax.contrib.muon(
        0.02, weight_decay=0.01, muon_weight_dimension_numbers=dims), params)
  return alias_test.reference_sgd_muon(
      params, dims, lr=0.02, beta=0.95, nesterov=True, wd=0.01, steps=STEPS)


class ParityTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f'{name}_{layout}', shape, layout)
      for name, shape in MESHES for layout in ('replicated', 'fsdp'))
  def test_matches_single_device_optax_muon(self, shape, layout):
    mesh = make_mesh(shape)
    params, dims = llama_like()
    opt = dmuon_jax.dmuon(0.02, weight_decay=0.01,
                          muon_weight_dimension_numbers=dims, mesh=mesh)
    placed = place(params, mesh, layout)
    ours = alias_test.run(opt, placed, grad_shardings=jax.tree.map(
        lambda x: x.sharding, placed))
    ref = reference_history()
    for i in (0, STEPS - 1):
      alias_test.assert_trees_rel_close(self, ours[i], ref[i], rtol=1e-5)

  def test_sgd_momentum_matches_reference_loop_on_hsdp(self):
    mesh = make_mesh((2, 4))
    params, dims = llama_like()
    opt = dmuon_jax.dmuon(0.02, weight_decay=0.01, momentum='sgd',
                          muon_weight_dimension_numbers=dims, mesh=mesh)
    placed = place(params, mesh, 'fsdp')
    ours = alias_test.run(opt, placed, grad_shardings=jax.tree.map(
        lambda x: x.sharding, placed))
    ref = reference_history('sgd')
    alias_test.assert_trees_rel_close(self, ours[-1], ref[-1], rtol=1e-5)

  def test_momentum_lives_on_owners_only(self):
    mesh = make_mesh((1, 8))
    params, dims = llama_like()
    opt = dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=dims,
                          mesh=mesh)
    state = opt.init(place(params, mesh, 'replicated'))
    (muon_state,) = dmuon_states(state)
    self.assertNotEmpty(muon_state.mu)
    for mu in muon_state.mu:
      self.assertEqual(mu.sharding.spec, P(AXES))
      # Each device holds its own block only.
      self.assertLen(mu.addressable_shards, 8)
      self.assertEqual(mu.addressable_shards[0].data.shape[0] * 8,
                       mu.shape[0])


def dmuon_states(state):
  is_state = lambda x: isinstance(x, dmuon_jax.ScaleByDMuonState)
  return [x for x in jax.tree.leaves(state, is_leaf=is_state)
          if is_state(x)]


def mean_loss(params, batch):
  """A batch-mean loss whose gradient depends on the batch."""
  def per_example(b):
    return sum(jnp.sum(jnp.sin(p * b)) for p in jax.tree.leaves(params))
  return jnp.mean(jax.vmap(per_example)(batch))


def explicit_step_fn(opt, mesh, state, loss_fn=mean_loss, param_specs=P()):
  """A train step on the explicit path (default: params replicated, DDP)."""
  specs = dmuon_jax.Dedication.specs_of(state)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(param_specs, specs, P(AXES)),
                     out_specs=(param_specs, specs, P()))
  def step(params, state, batch):
    loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state,
            jax.lax.pmean(loss, AXES))

  return step


def drop_in_step_fn(opt):

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(mean_loss)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


class ExplicitPathTest(parameterized.TestCase):

  @parameterized.named_parameters(('1x8', (1, 8)), ('2x4', (2, 4)))
  def test_explicit_equals_drop_in(self, shape):
    mesh = make_mesh(shape)
    params, dims = llama_like()
    params = place(params, mesh, 'replicated')
    opt = dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=dims,
                          mesh=mesh)
    batch = jax.device_put(jnp.linspace(0.5, 1.5, 16),
                           NamedSharding(mesh, P(AXES)))
    state = opt.init(params)
    explicit = explicit_step_fn(opt, mesh, state)
    drop_in = drop_in_step_fn(opt)
    a, sa, b, sb = params, state, params, state
    for _ in range(5):
      a, sa, loss_a = explicit(a, sa, batch)
      b, sb, loss_b = drop_in(b, sb, batch)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    alias_test.assert_trees_rel_close(self, a, b, rtol=1e-5)


if __name__ == '__main__':
  absltest.main()
