"""The drop-in in the trainers people copy, in the order they write them.

Our own small versions of three upstream patterns:

- Flax lm1b / MaxText ``setup_initial_state``: ``jax.eval_shape(init)``
  *outside* the logical axis rules, ``nn.logical_to_mesh_sharding`` and
  ``jax.jit(init, out_shardings=...)`` *inside* them (Linen, and the NNX
  equivalent with ``nnx.eval_shape``); the train step jitted with the
  state's shardings as ``in_shardings``/``out_shardings`` and donated.
- A plain-JAX FSDP transformer: a dict of arrays with 3-D attention
  kernels (``muon_weight_dimension_numbers``), placed with
  ``jax.device_put`` and trained under ``jax.jit(step, in_shardings,
  out_shardings)``.

Each trains on an 8-device mesh and is held to one-device
``optax.contrib.muon`` (relative 1e-5 per leaf, ``support.OPTAX_F32_RTOL``)
and to optax's per-device optimizer state on the same sharding.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax
from tests import support

# Compile-heavy: the README command runs these, the inner loop
# (-m 'not slow') does not (tests/conftest.py).
SLOW_CASES = (
  r'^Lm1bOrderTest::test_linen_drop_in_matches_optax_with_optax_sized_state$',
  r'^PlainFsdpTest::test_3d_attention_fsdp_state_and_numbers_match_optax$',
)

D, F, V = 32, 64, 48
LAYERS, BATCH, LENGTH = 2, 16, 8
STEPS = 5
LR = 0.02
# lm1b's logical rules, FSDP flavour: 'embed' over the data axis.
RULES = (('batch', 'fsdp'), ('embed', 'fsdp'), ('mlp', None), ('vocab', None))


def _mesh():
  return support.make_mesh((8,), ('fsdp',), kind=AxisType.Auto)


def _dense(features, names, name):
  return nn.Dense(
    features,
    use_bias=False,
    name=name,
    kernel_init=nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), names
    ),
  )


class LinenLm(nn.Module):
  """Embedding, ``LAYERS`` MLP blocks, a head (lm1b-like names)."""

  @nn.compact
  def __call__(self, tokens):
    embed = self.param(
      'embed',
      nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ('vocab', 'embed')
      ),
      (V, D),
    )
    x = jnp.take(embed, tokens, axis=0)
    for i in range(LAYERS):
      h = _dense(F, ('embed', 'mlp'), f'encoderdecoderblock_{i}_up')(x)
      x = x + _dense(D, ('mlp', 'embed'), f'encoderdecoderblock_{i}_down')(
        jax.nn.gelu(h)
      )
    return _dense(V, ('embed', 'vocab'), 'logits')(x)


def _loss(apply_fn, params, tokens):
  logits = apply_fn({'params': params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def _train_step(state, tokens):
  grads = jax.grad(lambda p: _loss(state.apply_fn, p, tokens))(state.params)
  return state.apply_gradients(grads=grads)


def _tokens():
  return support.token_batch(BATCH, LENGTH, V)


def _per_device_elements(tree) -> int:
  """Elements of ``tree``'s arrays held by device 0."""
  total = 0
  for x in jax.tree.leaves(tree):
    shards = [s for s in x.addressable_shards if s.device.id == 0]
    total += sum(s.data.size for s in shards)
  return total


def _muon_state_elements(opt_state) -> int:
  """Device 0's elements of the Muon momentum (dmuon or optax)."""
  for st in jax.tree.leaves(
    opt_state, is_leaf=lambda x: hasattr(x, 'mu') and hasattr(x, 'count')
  ):
    mu = getattr(st, 'mu', None)
    if isinstance(mu, dmuon_jax.OwnerBuffers):
      return _per_device_elements(mu.buffers)
  raise AssertionError('no dmuon state')


def linen_lm1b(tx, mesh, unbox=True):
  """lm1b's ``setup_initial_state`` and train loop with ``tx``."""
  model = LinenLm()
  tokens = _tokens()

  def init_train_state(rng):
    params = model.init(rng, tokens[:, :-1])['params']
    return train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx
    )

  # eval_shape outside the rules, as lm1b and MaxText write it.
  abstract = jax.eval_shape(init_train_state, jax.random.key(0))
  logical = nn.get_partition_spec(abstract)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    state = jax.jit(init_train_state, out_shardings=shardings)(
      jax.random.key(0)
    )
  state = nn.meta.unbox(state) if unbox else state
  shardings = nn.meta.unbox(shardings) if unbox else shardings
  data = NamedSharding(mesh, P('fsdp'))
  step = jax.jit(
    _train_step,
    in_shardings=(shardings, data),
    out_shardings=shardings,
    donate_argnums=0,
  )
  batch = jax.device_put(tokens, data)
  opt_elements = _muon_state_elements(state.opt_state)
  for _ in range(STEPS):
    state = step(state, batch)
  return state, opt_elements


@functools.cache
def linen_reference():
  model = LinenLm()
  tokens = _tokens()
  params = nn.meta.unbox(model.init(jax.random.key(0), tokens[:, :-1]))
  tx = support.optax_muon(LR, params['params'])
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=params['params'], tx=tx
  )
  step = jax.jit(_train_step)
  for _ in range(STEPS):
    state = step(state, tokens)
  return state.params


def _muon_elements_even_share(params, n) -> float:
  """Total Muon elements over ``n`` devices (all matrices but embed)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return sum(math.prod(x.shape) for k, x in flat if 'embed' not in str(k)) / n


class Lm1bOrderTest(absltest.TestCase):
  def test_linen_drop_in_matches_optax_with_optax_sized_state(self):
    mesh = _mesh()
    tx = dmuon_jax.dmuon(LR, mesh=mesh)
    state, elements = linen_lm1b(tx, mesh)
    support.assert_trees_rel_close(
      self,
      jax.tree.map(np.asarray, state.params),
      jax.tree.map(np.asarray, linen_reference()),
      support.OPTAX_F32_RTOL,
    )
    # Momentum per device: the even share of the Muon params, as optax's
    # FSDP-sharded momentum (the owner buffers held the busiest owner's
    # share: 1.5x here, one 48x32 head among 32x64 blocks).
    self.assertLessEqual(
      elements, _muon_elements_even_share(state.params, 8) * 1.0001
    )
    (layout,) = dmuon_jax.owner_layouts(state.opt_state)
    self.assertEqual(layout.momentum, 'params')
    self.assertIn('1.00x the even share', layout.summary())
    # The rules' shardings steer the routes: all-to-all, no all-gather.
    bytes_ = layout.collective_bytes()
    self.assertGreater(bytes_['all-to-all'], 0)
    self.assertEqual(bytes_['all-gather'], 0)

  def test_eval_shape_inside_and_outside_the_rules_give_one_tree(self):
    mesh = _mesh()
    tx = dmuon_jax.dmuon(LR, mesh=mesh)
    model = LinenLm()
    tokens = _tokens()

    def init(rng):
      return tx.init(model.init(rng, tokens[:, :-1])['params'])

    outside = jax.eval_shape(init, jax.random.key(0))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
      inside = jax.eval_shape(init, jax.random.key(0))
    self.assertEqual(jax.tree.structure(outside), jax.tree.structure(inside))
    (lo,) = dmuon_jax.owner_layouts(outside)
    (li,) = dmuon_jax.owner_layouts(inside)
    # Only the routing hint differs: unknown outside, the rules' inside.
    self.assertIn(None, lo.param_entries)
    self.assertNotIn(None, li.param_entries)

  def test_logical_names_that_are_mesh_axes_give_one_tree(self):
    """Logical names spelled as mesh axes ('shard', mapped to itself by the
    rules) are still the rules' to map: outside them an abstract init
    cannot read them, so the structure may not read them inside either
    (5 matrices on 8 devices: owner buffers hold 1.6x the even share, the
    params' 'shard' 1/4 of each: each reading chose another momentum
    layout)."""
    mesh = support.make_mesh((2, 4), kind=AxisType.Auto)
    tx = dmuon_jax.dmuon(LR, mesh=mesh, predicate='optax')

    def init(rng):
      keys = jax.random.split(rng, 5)
      params = {
        f'w{i}': nn.LogicallyPartitioned(
          jax.random.normal(k, (32, 32)), ('shard', None)
        )
        for i, k in enumerate(keys)
      }
      return tx.init(params)

    rules = (('shard', 'shard'),)
    outside = jax.eval_shape(init, jax.random.key(0))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      inside = jax.eval_shape(init, jax.random.key(0))
    self.assertEqual(jax.tree.structure(outside), jax.tree.structure(inside))
    (layout,) = dmuon_jax.owner_layouts(inside)
    self.assertEqual(layout.momentum, 'params')


class NnxLm(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.blocks = nnx.List(
      [
        nnx.Linear(
          D,
          F,
          use_bias=False,
          rngs=rngs,
          kernel_init=nnx.with_partitioning(
            init, ('embed', 'mlp'), eager_sharding=False
          ),
        )
        for _ in range(LAYERS)
      ]
    )
    self.proj = nnx.Linear(
      F,
      D,
      use_bias=False,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(
        init, ('mlp', 'embed'), eager_sharding=False
      ),
    )

  def __call__(self, x):
    for b in self.blocks:
      x = x + self.proj(jax.nn.gelu(b(x)))
    return x


def _nnx_loss(model, x):
  return jnp.mean((model(x) - jnp.roll(x, 1, axis=-1)) ** 2)


def _nnx_train(model, opt, x):
  """``STEPS`` ``nnx.jit`` steps; the params and the optimizer."""

  @nnx.jit
  def step(model, opt, x):
    opt.update(model, nnx.grad(_nnx_loss)(model, x))

  for _ in range(STEPS):
    step(model, opt, x)
  return nnx.state(model, nnx.Param), opt


class NnxOrderTest(absltest.TestCase):
  def run_nnx(self, tx, mesh):
    x = jax.random.normal(jax.random.key(1), (BATCH, D))

    def create():
      model = NnxLm(nnx.Rngs(0))
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def split():
      return nnx.split(create())

    # eval_shape outside the rules, the jitted init inside them.
    _, abstract = jax.eval_shape(split)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
      shardings = nnx.get_named_sharding(abstract, mesh)
      graphdef, state = jax.jit(split, out_shardings=(None, shardings))()
    model, opt = nnx.merge(graphdef, state)
    return _nnx_train(model, opt, x)

  def test_nnx_eval_shape_outside_the_rules(self):
    mesh = _mesh()
    got, opt = self.run_nnx(dmuon_jax.dmuon(LR, mesh=mesh), mesh)
    ref_model = NnxLm(nnx.Rngs(0))
    params = nnx.state(ref_model, nnx.Param)
    want, _ = self.run_nnx_ref(params)
    support.assert_trees_rel_close(
      self,
      jax.tree.map(np.asarray, nnx.to_pure_dict(got)),
      jax.tree.map(np.asarray, nnx.to_pure_dict(want)),
      support.OPTAX_F32_RTOL,
    )

  def run_nnx_ref(self, params):
    model = NnxLm(nnx.Rngs(0))
    tx = optax.contrib.muon(LR)  # every param is a Muon matrix
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return _nnx_train(
      model, opt, jax.random.normal(jax.random.key(1), (BATCH, D))
    )


class BoxesOutsideAnyContextTest(absltest.TestCase):
  def test_partitioned_boxes_read_as_the_boxes_say(self):
    """nanodo's order with ``dmuon(mesh=mesh)`` and no ``jax.set_mesh``:
    ``nn.Partitioned`` names (mesh axes) read as sharded, and the summary
    reports what was read (not a replicated-params figure)."""
    mesh = support.make_mesh((2, 4), kind=AxisType.Auto)
    model = LinenLm()
    boxed = model.init(jax.random.key(0), _tokens()[:, :-1])['params']
    # The same model with mesh axes as names: 'embed' -> 'shard'.
    boxed = jax.tree.map(
      lambda b: nn.Partitioned(
        b.value, tuple('shard' if n == 'embed' else None for n in b.names)
      ),
      boxed,
      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )
    opt = dmuon_jax.dmuon(LR, mesh=mesh)
    abstract = jax.eval_shape(opt.init, boxed)
    state = jax.jit(opt.init, out_shardings=nn.get_sharding(abstract, mesh))(
      boxed
    )
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertNotIn(None, layout.param_entries)
    summary = layout.summary()
    self.assertIn('4 sharded, 0 replicated, 0 unknown', summary)
    self.assertNotIn('replicated params', summary)
    # Sharded over 'shard' only (4 of 8 devices): optax's momentum would
    # be 2x the even share; the owner buffers hold no more.
    held, even = layout.momentum_share()
    self.assertEqual(layout.momentum, 'owners')
    self.assertLessEqual(held, 2 * even)


# A plain-JAX FSDP transformer: dict params, 3-D attention kernels.
HEADS, HD = 4, 8
ATTN_DIMS = {
  'wq': MDN(0, (1, 2)),  # (d, heads, head_dim): d -> heads x head_dim
  'wo': MDN((0, 1), 2),  # (heads, head_dim, d): heads x head_dim -> d
}


def plain_params():
  shapes = {}
  for i in range(LAYERS):
    shapes[f'l{i}'] = {
      'wq': (D, HEADS, HD),
      'wo': (HEADS, HD, D),
      'up': (D, F),
      'down': (F, D),
    }
  keys = iter(jax.random.split(jax.random.key(3), 4 * LAYERS))
  return jax.tree.map(
    lambda s: jax.random.normal(next(keys), s) / math.sqrt(s[0]),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def plain_dims(params):
  return {
    layer: {k: ATTN_DIMS.get(k, MDN()) for k in leaves}
    for layer, leaves in params.items()
  }


def plain_loss(params, x):
  for i in range(LAYERS):
    p = params[f'l{i}']
    q = jnp.einsum('bd,dhk->bhk', x, p['wq'])
    x = x + jnp.einsum('bhk,hkd->bd', jax.nn.tanh(q), p['wo'])
    x = x + jax.nn.gelu(x @ p['up']) @ p['down']
  return jnp.mean(x**2)


def plain_train(tx, params, shardings=None, mesh=None):
  x = jax.random.normal(jax.random.key(4), (BATCH, D))

  def step(params, opt_state, x):
    grads = jax.grad(plain_loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if mesh is None:
    opt_state = tx.init(params)
    jitted = jax.jit(step)
  else:
    params = jax.device_put(params, shardings)
    opt_state = tx.init(params)
    state_sh = jax.tree.map(lambda a: a.sharding, opt_state)
    data = NamedSharding(mesh, P('fsdp'))
    x = jax.device_put(x, data)
    jitted = jax.jit(
      step,
      in_shardings=(shardings, state_sh, data),
      out_shardings=(shardings, state_sh),
      donate_argnums=(0, 1),
    )
  elements = _per_device_elements(opt_state) if mesh is not None else None
  for _ in range(STEPS):
    params, opt_state = jitted(params, opt_state, x)
  return params, opt_state, elements


class PlainFsdpTest(absltest.TestCase):
  def test_3d_attention_fsdp_state_and_numbers_match_optax(self):
    mesh = _mesh()
    params = plain_params()
    dims = plain_dims(params)
    shardings = support.fsdp_shardings(params, mesh, axes=('fsdp',))
    got, state, elements = plain_train(
      dmuon_jax.dmuon(LR, mesh=mesh, muon_weight_dimension_numbers=dims),
      params,
      shardings,
      mesh,
    )
    tx = optax.contrib.muon(LR, muon_weight_dimension_numbers=dims)
    want, _, _ = plain_train(tx, params)
    support.assert_trees_rel_close(
      self,
      jax.tree.map(np.asarray, got),
      jax.tree.map(np.asarray, want),
      support.OPTAX_F32_RTOL,
    )
    # optax's state on the same sharding: its momentum mirrors the params
    # (sharded as they are), plus its scalars.
    with jax.set_mesh(mesh):
      optax_state = jax.jit(tx.init, out_shardings=None)(
        jax.device_put(params, shardings)
      )
    optax_mu = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) / 8
    self.assertLessEqual(elements, optax_mu + 8)
    del optax_state
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertEqual(layout.momentum, 'params')


if __name__ == '__main__':
  absltest.main()
