"""A Flax model with column/row-parallel layers on 3-axis meshes (8 devices).

Megatron-style tensor parallelism over ``'model'``: ``wq``, ``wk`` and
``up`` are column-parallel (output dim split), ``wo`` and ``down``
row-parallel (input dim split); ``up``/``down`` are also FSDP-sharded over
``'shard'`` on their other dim, and ``mix`` is a Muon matrix replicated over
``'model'`` (orthogonalized by every TP shard of its owner). The reference is
one device with ``optax.contrib.muon`` (Frobenius normalization, direct
Newton–Schulz: the same as dmuon's).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'mesh_1x4x2',
  r'momentum_is_split',
  r'dedicated_step_sends',
  r'test_dedicated_twenty_steps',
  r'update_reduces_only_grams',
  r'mesh_2x2x2',
)

AXES = ('replicate', 'shard', 'model')
D, F, VOCAB, BLOCKS, STEPS, LR = 32, 64, 64, 2, 20, 0.01
# TP 2 with 4 owners on one axis and on two; TP 4 is tested on whole
# matrices in tensor_parallel_test.py (Gram NS over 4 shards).
MESHES = {'1x4x2': (1, 4, 2), '2x2x2': (2, 2, 2)}
# Dedicated mode is checked on the two meshes the issue names.
DEDICATED_MESHES = ('1x4x2', '2x2x2')


def dense(features, partition, name):
  return nn.Dense(
    features,
    use_bias=False,
    name=name,
    kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), partition),
  )


class Block(nn.Module):
  """Attention-like mixing (column q, k; row o) and an MLP (column up, row
  down)."""

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(name='norm1')(x)
    a = jnp.tanh(dense(D, (None, 'model'), 'wq')(h))
    a = a * dense(D, (None, 'model'), 'wk')(h)
    x = x + dense(D, ('model', None), 'wo')(a)
    h = nn.RMSNorm(name='norm2')(x)
    h = nn.gelu(dense(F, ('shard', 'model'), 'up')(h))
    return x + dense(D, ('model', 'shard'), 'down')(h)


class Model(nn.Module):
  mix: bool = True  # a Muon matrix not split by TP

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D, name='embed')(tokens)
    for i in range(BLOCKS):
      x = Block(name=f'layers_{i}')(x)
    if self.mix:
      x = x + jnp.tanh(dense(3 * D, (None, 'shard'), 'mix')(x))[..., :D]
    return nn.Dense(VOCAB, use_bias=False, name='head')(x)


class MegatronBlock(nn.Module):
  """:class:`Block` on one TP shard's slices (dedicated mode's blocks).

  Column-parallel layers produce this shard's output features; row-parallel
  ones consume them and sum over the TP axis. With ``tp=1`` and no axis it
  is :class:`Block` itself (same names, shapes and arithmetic).
  """

  tp: int = 1
  tp_axis: str | None = None

  @nn.compact
  def __call__(self, x):
    def column(y, features, name):
      return nn.Dense(features // self.tp, use_bias=False, name=name)(y)

    def row(y, name):
      out = nn.Dense(D, use_bias=False, name=name)(y)
      return jax.lax.psum(out, self.tp_axis) if self.tp_axis else out

    h = nn.RMSNorm(name='norm1')(x)
    a = jnp.tanh(column(h, D, 'wq')) * column(h, D, 'wk')
    x = x + row(a, 'wo')
    h = nn.RMSNorm(name='norm2')(x)
    return x + row(nn.gelu(column(h, F, 'up')), 'down')


def cross_entropy(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def loss_fn(params, tokens, mix=True):
  return cross_entropy(
    Model(mix=mix).apply({'params': params}, tokens[:, :-1]), tokens
  )


def tokens():
  return jax.random.randint(jax.random.key(1), (16, 9), 0, VOCAB)


def init(mix=True):
  """Unboxed params and their PartitionSpecs (Flax's logical = mesh axes)."""
  boxed = Model(mix=mix).init(jax.random.key(0), tokens()[:, :-1])['params']
  return nn.unbox(boxed), nn.get_partition_spec(boxed)


def predicate(path, leaf):
  return dmuon_jax.default_muon_predicate(path, leaf) or path == 'mix/kernel'


@functools.cache
def reference(mix=True):
  params, _ = init(mix)
  opt = support.optax_muon(LR, params, predicate)
  return support.train_single_device(
    opt, params, lambda p: loss_fn(p, tokens(), mix), STEPS
  )


@functools.cache
def dedicated_run(mesh_name):
  """Dedicated Z3 (one block per gather) with Megatron blocks."""
  mesh = make_mesh(mesh_name)
  tp = mesh.shape['model']
  params, specs = init(mix=False)
  params = jax.device_put(
    params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  )
  ded = dmuon_jax.dedicate(params, mesh)
  dp = ded.to_dedicated(params)
  opt = dmuon_jax.dedicated_muon(ded, learning_rate=LR)
  opt_state = opt.init(dp)
  block = MegatronBlock(tp=tp, tp_axis='model')
  apply = lambda block_params, x: block.apply({'params': block_params}, x)
  dp_axes = ded.buffer_axes

  def loss(dp, toks):
    p = ded.gather_rest(dp)
    x = jnp.take(p['embed']['embedding'], toks[:, :-1], axis=0)
    x = ded.sequential(apply, [f'layers_{i}' for i in range(BLOCKS)])(dp, x)
    return cross_entropy(x @ p['head']['kernel'], toks)

  state_specs = ded.specs_of(opt_state)

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(ded.specs(), state_specs, P(dp_axes)),
    out_specs=(ded.specs(), state_specs, P()),
  )
  def step(dp, opt_state, toks):
    # Per device over the data-parallel axes only: autodiff still sums the
    # TP-replicated params' gradients over 'model'.
    value, grads = dmuon_jax.local_value_and_grad(loss, axis_names=dp_axes)(
      dp, toks
    )
    updates, opt_state = opt.update(grads, opt_state, dp)
    return (
      optax.apply_updates(dp, updates),
      opt_state,
      jax.lax.pmean(value, dp_axes),
    )

  data = tokens()
  losses = []
  for _ in range(STEPS):
    dp, opt_state, value = step(dp, opt_state, data)
    losses.append(float(value))
  return (
    jax.device_get(ded.to_params(dp)),
    np.array(losses),
    ded,
    step,
    (dp, opt_state, data),
  )


@functools.cache
def drop_in_run(mesh_name):
  mesh = make_mesh(mesh_name)
  params, specs = init()
  params = jax.device_put(
    params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  )
  data = jax.device_put(tokens(), NamedSharding(mesh, P(AXES[:2])))
  opt = dmuon_jax.dmuon(LR, mesh=mesh, predicate=predicate)
  state = opt.init(params)
  # Returned as they came in (support.pin_placement): one compile.
  params, state, pinned = support.pin_placement(params, state, 1)

  @functools.partial(jax.jit, **pinned)
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, data)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(STEPS):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return (jax.device_get(params), np.array(losses), step, opt, (params, state))


def make_mesh(mesh_name):
  # Auto axes: XLA shards the model's activations; dmuon reads the params'
  # shardings at init.
  return jax.make_mesh(
    MESHES[mesh_name], AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
  )


class DropInTensorParallelTest(parameterized.TestCase):
  @parameterized.named_parameters((f'mesh_{name}', name) for name in MESHES)
  def test_twenty_steps_equal_single_device_optax_muon(self, mesh_name):
    ref_params, ref_losses = reference()
    params, losses, *_ = drop_in_run(mesh_name)
    self.assertLess(support.rel_err(losses, ref_losses), 1e-5)
    self.assertLess(ref_losses[-1], ref_losses[0] - 0.1)  # it trains
    support.assert_trees_rel_close(self, params, ref_params, rtol=1e-5)

  def test_dedicated_twenty_steps_equal_single_device_optax_muon(self):
    ref_params, ref_losses = reference(mix=False)
    for mesh_name in DEDICATED_MESHES:
      params, losses, *_ = dedicated_run(mesh_name)
      self.assertLess(support.rel_err(losses, ref_losses), 1e-5, mesh_name)
      support.assert_trees_rel_close(self, params, ref_params, rtol=1e-5)

  def test_dedicated_step_sends_nothing_but_all_reduces_over_tp(self):
    *_, step, args = dedicated_run('1x4x2')
    compiled = step.lower(*args).compile()
    report = dmuon_jax.analyze_compiled(compiled)
    # Every collective runs on every device: none inside a conditional (the
    # owners' branches), none in a loop.
    support.assert_no_collective_in_a_conditional(self, compiled)
    tp = [c for c in report.collectives if c.group_size == 2]
    # The row-parallel psums of activations and the Gram all-reduces; the
    # owners' buffers move over the data-parallel axes only (group of 4).
    self.assertEqual({c.kind for c in tp}, {'all-reduce'})
    owner = {c.kind for c in report.collectives if c.group_size == 4}
    self.assertTrue({'all-gather', 'reduce-scatter'} <= owner, owner)

  def test_momentum_is_split_over_owners_and_tp_shards(self):
    *_, opt, (params, state) = drop_in_run('1x4x2')
    (muon_state,) = support.dmuon_states(state)
    self.assertNotEmpty(muon_state.mu)
    for buf in muon_state.mu:
      # Split 8 ways: each (owner, TP shard) keeps only its own slices.
      self.assertEqual(buf.sharding.shard_shape(buf.shape)[0] * 8, buf.shape[0])

  def test_update_reduces_only_grams_over_the_tp_axis(self):
    mesh = make_mesh('1x4x2')
    *_, opt, (params, state) = drop_in_run('1x4x2')
    update = jax.jit(opt.update)
    tp_units = 5 * BLOCKS  # wq, wk, up (column), wo, down (row)
    (layout,) = dmuon_jax.owner_layouts(state)
    lay = layout.groups[0]
    per_slot = [
      sum(
        len(b.units)
        for g in range(lay.num_groups)
        for b in lay.buckets(g, s)
        if b.tp_split is not None
      )
      for s in range(lay.num_slots)
    ]
    self.assertEqual(sum(per_slot), tp_units)
    # Before XLA combines them (StableHLO; the same program for CUDA): the
    # TP collectives run between the owner branches, on every device, on
    # payloads of one fixed size: one max of |X| per TP matrix (the
    # overflow-safe power-of-two rescaling), then one psum of the owner's
    # stacked D x D Grams per restart window (default restart before
    # iteration 2: two windows), sized by the owner with the most TP
    # matrices.
    text = (
      update.trace(params, state, params)
      .lower(lowering_platforms=('cuda',))
      .as_text()
    )
    tp = [
      c
      for c in support.hlo_tools.stablehlo_collectives(text)
      if c.group_size == mesh.shape['model']
    ]
    self.assertEqual({c.kind for c in tp}, {'all-reduce'})
    sizes = sorted(int(np.prod(c.shape)) for c in tp)
    self.assertEqual(sizes, [max(per_slot)] + [max(per_slot) * D * D] * 2)
    # Compiled: still only all-reduces over the TP axis (XLA may combine
    # them into tuples), of exactly those elements; the matrices never
    # travel over it.
    compiled = update.lower(params, state, params).compile()
    support.assert_no_collective_in_a_conditional(self, compiled)
    report = dmuon_jax.analyze_compiled(compiled)
    tp = [c for c in report.collectives if c.group_size == 2]
    self.assertEqual({c.kind for c in tp}, {'all-reduce'})
    # (besides the update's finiteness flags, pred: 20 of them, measured,
    # read over the TP axis since jax 0.10's named-axes replica groups are
    # parsed)
    tp = [c for c in tp if c.dtype != 'pred']
    self.assertEqual(
      sum(np.prod(c.shape) for c in tp), max(per_slot) * (2 * D * D + 1)
    )
    # Over the owner axes: the FSDP pieces of up/down/mix go to their owners
    # and back by all-to-all, replicated matrices come back by all-gather.
    # (and the finiteness flags, pred, all-reduced as everywhere)
    owner = {
      c.kind
      for c in report.collectives
      if c.group_size == 4 and c.dtype != 'pred'
    }
    self.assertEqual(owner, {'all-to-all', 'all-gather'})
    # (Over all 8 devices: at most the booleans of the nonfinite='skip'
    # check.)
    for c in report.collectives:
      if c.group_size == 8:
        self.assertEqual((c.kind, c.dtype), ('all-reduce', 'pred'))


if __name__ == '__main__':
  absltest.main()
