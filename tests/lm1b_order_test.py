"""A dedicated Linen trainer initialized in Flax lm1b's order.

Our own small version of ``examples/lm1b`` (``utils.setup_initial_state``,
``train.py``): params boxed by ``nn.with_logical_partitioning``, FSDP
logical rules on a one-axis ``('fsdp',)`` mesh; the train state made by an
``init_train_state(rng)`` that ``jax.eval_shape`` runs first, *outside*
``nn.logical_axis_rules`` and ``jax.set_mesh``, for the logical partition
specs, and then ``jax.jit(init_train_state, out_shardings=...)`` runs
inside both; the state unboxed, and the step compiled with ``jax.jit(...,
in_shardings=..., out_shardings=..., donate_argnums=0)``. Dedicated with
the documented lines inside ``init_train_state`` (``dedicate_linen``,
``apply_fn=ded.apply``, ``dedicated_muon``), it matches the same trainer
on one device with ``optax.contrib.muon``.

The two traces of ``init_train_state`` dedicate twice, and a
``TrainState``'s ``apply_fn`` and ``tx`` are pytree metadata that JAX
compares with ``==`` between the abstract state and the jitted one. Each
fails without its fix: the dedication, ``ded.apply`` and the optimizer of
``dedicated_muon`` compare equal by value (they compared by identity: JAX's
"different pytree metadata" at ``jax.jit``), and the boxes of the AdamW
params, which dedication replicates over the owner axes, say so whatever
logical axis rules are in effect (the abstract trace, outside the rules,
kept the FSDP names, and its out_shardings then sharded them).
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
import dmuon_jax.flax as dflax
from tests import support

# Compile-heavy: the README command runs these, the inner loop
# (-m 'not slow') does not (tests/conftest.py).
SLOW_CASES = (
  r'^Lm1bOrderTest::test_auto_fsdp_rules$',
  r'^Lm1bOrderTest::test_explicit$',
)

D, F, V, LAYERS = 32, 64, 64, 3
BATCH, LENGTH, STEPS, LR = 16, 9, 5, 0.01
# lm1b's FSDP rules, onto the one mesh axis. The owner buffers' boxes name
# the mesh axis itself, which Flax maps by the rules like any name: a
# one-axis mesh needs its identity rule for them (a tuple of several axes,
# what a multi-axis mesh gives them, passes the rules unchanged).
FSDP_RULES = (
  ('fsdp', 'fsdp'),
  ('batch', 'fsdp'),
  ('embed', 'fsdp'),
  ('mlp', None),
  ('vocab', None),
)
# On Explicit axes Flax's boxes assert their sharding when unboxed in
# model.init under jax.set_mesh, which an FSDP rule fails on the plain
# model as well (docs/guides/dedicated.md): data parallel there.
DP_RULES = (('fsdp', 'fsdp'), ('batch', 'fsdp'), ('embed', None))


def logical(init, names):
  return nn.with_logical_partitioning(init, names)


class Embed(nn.Module):
  """A lookup table (on Explicit axes ``nn.Embed``'s gather of sharded
  tokens needs an out_sharding it cannot pass)."""

  @nn.compact
  def __call__(self, tokens):
    table = self.param(
      'embedding',
      logical(nn.initializers.normal(1.0), ('vocab', 'embed')),
      (V, D),
    )
    if jax.sharding.get_abstract_mesh().empty:  # the eval_shape outside
      return table[tokens]
    out = P(*jax.typeof(tokens).sharding.spec, None)
    return table.at[tokens].get(out_sharding=out)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(
      use_bias=False, scale_init=logical(nn.initializers.ones, ('embed',))
    )(x)
    kernel = lambda names: logical(nn.initializers.lecun_normal(), names)
    h = nn.Dense(F, use_bias=False, kernel_init=kernel(('embed', 'mlp')))(h)
    return x + nn.Dense(
      D, use_bias=False, kernel_init=kernel(('mlp', 'embed'))
    )(jax.nn.gelu(h))


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = Embed(name='embed')(tokens)
    for i in range(LAYERS):
      x = Block(name=f'blocks_{i}')(x)
    # lm1b's final norm. Without it the head's AdamW update amplifies fp32
    # summation noise: plain optax.contrib.muon on 8 devices was 1.4e-3
    # (params, 5 steps) from one device; with it 6.3e-7.
    x = nn.LayerNorm(
      use_bias=False,
      scale_init=logical(nn.initializers.ones, ('embed',)),
      name='out_norm',
    )(x)
    return nn.Dense(
      V,
      use_bias=False,
      kernel_init=logical(nn.initializers.lecun_normal(), ('embed', 'vocab')),
      name='head',
    )(x)


# lm1b's step, calling the model through ``state.apply_fn``.
train_step = support.next_token_step


def unbox_logically_partitioned(state):
  """lm1b's ``unbox_logicallypartioned_trainstate``."""
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  return jax.tree.map(
    lambda x: x.unbox() if is_box(x) else x, state, is_leaf=is_box
  )


def train(n, kind, rules, dedicated):
  """lm1b's ``setup_initial_state`` and train loop on ``n`` devices."""
  mesh = support.make_mesh((n,), ('fsdp',), kind=kind)
  model = Decoder()
  made = []
  tx = optax.contrib.muon(
    LR, muon_weight_dimension_numbers=support.same_routing_dims
  )

  def init_train_state(rng):
    params = model.init(rng, jnp.ones((2, LENGTH - 1), jnp.int32))['params']
    if not dedicated:
      return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx
      )
    ded, params = dflax.dedicate_linen(model, params, mesh)  # the changed
    made.append(ded)  # lines
    return train_state.TrainState.create(
      apply_fn=ded.apply,
      params=params,
      tx=dflax.dedicated_muon(ded, learning_rate=LR),
    )

  rng = jax.random.key(0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    abstract = jax.eval_shape(init_train_state, rng)
    specs = nn.get_partition_spec(abstract)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
      state = jax.jit(
        init_train_state, in_shardings=None, out_shardings=shardings
      )(rng)
    state = unbox_logically_partitioned(state)
    data = NamedSharding(mesh, P('fsdp'))
    step = jax.jit(
      train_step,
      in_shardings=(shardings, data),
      out_shardings=(shardings, None),
      donate_argnums=0,
    )
    tokens = jax.device_put(support.token_batch(BATCH, LENGTH, V), data)
    losses = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      for _ in range(STEPS):
        state, loss = step(state, tokens)
        losses.append(float(loss))
  ded = made[-1] if made else None
  params = ded.to_params(state.params) if dedicated else state.params
  return {
    'losses': np.array(losses),
    'params': jax.tree.map(np.asarray, nn.unbox(params)),
    'state': state,
    'ded': ded,
    'warnings': [str(w.message) for w in caught],
  }


@functools.cache
def run(kind, dedicated):
  rules = FSDP_RULES if kind == AxisType.Auto else DP_RULES
  return train(8 if dedicated else 1, kind, rules, dedicated)


def owner_buffers(tree):
  is_owner = lambda x: isinstance(x, dmuon_jax.OwnerBuffers)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_owner) if is_owner(x)]


class Lm1bOrderTest(absltest.TestCase):
  def check(self, kind):
    got, want = run(kind, True), run(kind, False)
    rel = np.max(np.abs(got['losses'] - want['losses']) / want['losses'])
    self.assertLess(rel, 1e-5)
    support.assert_trees_max_rel_close(got['params'], want['params'], 1e-5)
    # Stored on their owners: the owned buffers and their momentum sharded
    # over 'fsdp' as the layout says, by the recipe's out_shardings.
    state = got['state']
    (momentum,) = owner_buffers(state.opt_state)
    specs = momentum.layout.buffer_specs()
    self.assertEqual(specs, (P('fsdp'),))
    self.assertEqual([b.sharding.spec for b in momentum.buffers], list(specs))
    owned = state.params['blocks_0']['dmuon_owned_0']
    self.assertEqual(nn.unbox(owned).sharding.spec, P('fsdp'))
    return got

  def test_auto_fsdp_rules(self):
    got = self.check(AxisType.Auto)
    # The AdamW params the rules shard over 'fsdp' (the embedding, the
    # head, the norms) stay sharded so by the recipe's own out_shardings:
    # the abstract state's boxes, made outside the rules, keep their
    # logical names (before: replicated by dedicate, renamed, warned).
    for leaf in (
      got['state'].params['embed']['embedding'],
      got['state'].params['head']['kernel'],
      got['state'].params['blocks_2']['LayerNorm_0']['scale'],
    ):
      self.assertIn('fsdp', str(leaf.sharding.spec))
    said = got['warnings']
    self.assertLen([w for w in said if 'plain jax.jit' in w], 1)
    self.assertLen(said, 1)

  def test_explicit(self):
    got = self.check(AxisType.Explicit)
    self.assertEqual(got['warnings'], [])  # the reduced route, no warning

  def test_equal_dedications_are_one_static_value(self):
    model = Decoder()
    tokens = jnp.ones((2, LENGTH - 1), jnp.int32)
    mesh = support.make_mesh((8,), ('fsdp',), kind=AxisType.Auto)
    params = model.init(jax.random.key(0), tokens)['params']
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', dmuon_jax.DMuonWarning)
      first, _ = dflax.dedicate_linen(model, params, mesh)
      second, _ = dflax.dedicate_linen(model, params, mesh)
      z2, _ = dflax.dedicate_linen(
        model, params, mesh, reshard_after_forward=False
      )
    self.assertIsNot(first, second)
    self.assertEqual(first, second)
    self.assertEqual(hash(first), hash(second))
    self.assertEqual(first.apply, second.apply)
    self.assertEqual(hash(first.apply), hash(second.apply))
    self.assertNotEqual(first, z2)
    self.assertNotEqual(first.apply, z2.apply)
    tx = lambda ded, **kw: dflax.dedicated_muon(ded, learning_rate=LR, **kw)
    self.assertEqual(tx(first), tx(second))
    self.assertEqual(hash(tx(first)), hash(tx(second)))
    self.assertEqual(tx(first, beta=0.9), tx(second, beta=0.9))
    self.assertNotEqual(tx(first), tx(second, beta=0.9))
    self.assertNotEqual(tx(first), tx(z2))
    self.assertNotEqual(
      tx(first), dflax.dedicated_muon(first, learning_rate=2 * LR)
    )


if __name__ == '__main__':
  absltest.main()
