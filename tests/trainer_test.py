"""dmuon in GSPMD trainers as they are written (nanodo, MaxText styles).

Each trainer here is this suite's own small version of a pattern large
JAX models are trained with (not a copy of any): a Linen decoder whose
params are boxed for FSDP (``nn.with_partitioning``, or
``nn.with_logical_partitioning`` + ``nn.logical_axis_rules``), an activation
sharding constraint inside the model, the optimizer wrapped in
``optax.MultiSteps``, the state built abstractly (``jax.eval_shape`` ->
the trainer's sharding recipe -> ``jax.jit(init, out_shardings=...)``), a
plain ``jax.jit`` train step, and orbax's own ``CheckpointManager``.

The swap is one line: ``optax.contrib.muon(...)`` -> ``dmuon_jax.dmuon(...,
predicate='optax')``. Held to: the owner buffers come out of the recipe
sharded as their layout says (1/N of the momentum per device), the compiled
step moves AdamW's bytes plus only the owner all-to-alls and the
all-gather over 'replicate' the layout predicts, the numbers equal ``optax.contrib.muon`` on one device, and the
trainer's checkpoint resumes on another mesh through the documented
conversion (a plain ``partial_restore=True`` into another layout raises).
"""

import functools
import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import checkpoint
from tests import support

SLOW_CASES = (
  r'_maxtext',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^TrainerTest::test_matches_optax_muon_nanodo$',
)

VOCAB, D, F, SEQ, BATCH = 32, 16, 64, 8, 16
LR = 0.01
EVERY_K = 2  # MultiSteps: one update every 2 micro-steps
STEPS = 20  # micro-steps
AXES = ('replicate', 'shard')
# The trainer's logical axis rules (MaxText style); the nanodo style writes
# the mesh axes these map to into nn.with_partitioning directly.
RULES = (
  ('batch', AXES),
  ('embed', 'shard'),
  ('mlp', None),
  ('vocab', None),
)
MESH_AXES = {name: axes for name, axes in RULES}


def _part(style, names):
  init = nn.initializers.normal(0.1)
  if style == 'maxtext':
    return nn.with_logical_partitioning(init, names)
  return nn.with_partitioning(init, tuple(MESH_AXES[n] for n in names))


class Decoder(nn.Module):
  """Embedding, two MLP blocks with a norm, an output head."""

  style: str

  @nn.compact
  def __call__(self, tokens):
    s = self.style
    x = nn.Embed(VOCAB, D, embedding_init=_part(s, ('vocab', 'embed')))(tokens)
    for i in range(2):
      h = nn.LayerNorm(
        use_bias=False,
        scale_init=nn.with_partitioning(nn.initializers.ones, ('shard',))
        if s == 'nanodo'
        else nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
        name=f'norm_{i}',
      )(x)
      h = nn.Dense(F, use_bias=False, kernel_init=_part(s, ('embed', 'mlp')))(h)
      h = nn.gelu(h)
      # The activation annotation a GSPMD model carries: batch over the
      # data axes.
      if jax.sharding.get_abstract_mesh().empty:
        pass  # the single-device reference
      elif s == 'maxtext':
        h = nn.with_logical_constraint(h, ('batch', None, 'mlp'))
      else:
        h = jax.lax.with_sharding_constraint(h, P(AXES, None, None))
      x = x + nn.Dense(
        D, use_bias=False, kernel_init=_part(s, ('mlp', 'embed'))
      )(h)
    return nn.Dense(
      VOCAB, use_bias=False, kernel_init=_part(s, ('embed', 'vocab'))
    )(x)


tokens = functools.partial(support.token_batch, BATCH, SEQ + 1, VOCAB)


def loss_fn(model, params, batch):
  logits = model.apply({'params': params}, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch[:, 1:]
  ).mean()


make_tx = functools.partial(
  support.multi_steps_tx, learning_rate=LR, every_k=EVERY_K
)


def shardings_of(style, abstract, mesh):
  """The trainer's own recipe for the state's shardings."""
  if style == 'maxtext':
    return nn.logical_to_mesh_sharding(
      nn.get_partition_spec(abstract), mesh, RULES
    )
  return nn.get_sharding(abstract, mesh)


class Trainer:
  """A trainer's whole set-up on ``mesh`` (compiled once per config)."""

  def __init__(self, style, kind, shape):
    self.mesh = mesh = support.make_mesh(
      shape, AXES, kind=jax.sharding.AxisType.Auto
    )
    self.model = model = Decoder(style)
    self.tx = tx = make_tx(kind, mesh)

    def init(rng):
      params = model.init(rng, jnp.zeros((1, SEQ), jnp.int32))['params']
      return {'params': params, 'opt_state': tx.init(params)}

    def step(state, batch):
      loss, grads = jax.value_and_grad(functools.partial(loss_fn, model))(
        state['params'], batch
      )
      updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
      params = optax.apply_updates(state['params'], updates)
      return {'params': params, 'opt_state': opt_state}, loss

    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
      abstract = jax.eval_shape(init, jax.random.key(0))
      self.shardings = shardings = shardings_of(style, abstract, mesh)
      self.state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
      self.batch_sharding = NamedSharding(mesh, P(AXES))
      self.batch = jax.device_put(tokens(), self.batch_sharding)
      self.step = (
        jax.jit(
          step,
          in_shardings=(shardings, self.batch_sharding),
          out_shardings=(shardings, NamedSharding(mesh, P())),
        )
        .lower(self.state, self.batch)
        .compile()
      )

  def run(self, steps, state=None):
    state, losses = self.state if state is None else state, []
    for _ in range(steps):
      state, loss = self.step(state, self.batch)
      losses.append(float(loss))
    return state, losses


@functools.cache
def trainer(style, kind='dmuon', shape=(2, 4)):
  return Trainer(style, kind, shape)


@functools.cache
def run(style, steps=STEPS):
  t = trainer(style)
  init = jax.device_get(nn.unbox(t.state['params']))
  state, losses = t.run(steps)
  return init, state, losses


@functools.cache
def reference(style, steps=STEPS):
  """optax.contrib.muon in the same MultiSteps on one device."""
  params0, _, _ = run(style)
  model, tx = Decoder(style), make_tx('muon')
  batch = tokens()

  @jax.jit
  def step(params, opt_state):
    with nn.logical_axis_rules(()):
      loss, grads = jax.value_and_grad(functools.partial(loss_fn, model))(
        params, batch
      )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state, losses = params0, tx.init(params0), []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return jax.device_get(params), losses


def owner_buffers(state):
  (st,) = support.dmuon_states(state['opt_state'])
  return st, jax.tree.leaves(st.mu)


class TrainerTest(parameterized.TestCase):
  @parameterized.named_parameters(('nanodo', 'nanodo'), ('maxtext', 'maxtext'))
  def test_momentum_sharded_as_its_layout(self, style):
    t = trainer(style)
    st, buffers = owner_buffers(t.state)
    (layout,) = dmuon_jax.owner_layouts(t.state['opt_state'])
    self.assertGreater(layout.num_slots, 1)
    mesh = buffers[0].sharding.mesh
    for buf, spec in zip(buffers, layout.buffer_specs(), strict=True):
      want = NamedSharding(mesh, spec)
      self.assertTrue(buf.sharding.is_equivalent_to(want, buf.ndim), spec)
      # Owner buffers over all 8 devices; per-leaf momentum (the logical
      # names' trainer: see OwnerLayout.momentum) as its param, over 'shard'.
      devices = 4 if layout.per_leaf else 8
      shard_sizes = {s.data.size for s in buf.addressable_shards}
      self.assertEqual(shard_sizes, {buf.size // devices})
    self.assertEqual(layout.per_leaf, style == 'maxtext')

  @parameterized.named_parameters(('nanodo', 'nanodo'), ('maxtext', 'maxtext'))
  def test_step_bytes_are_adamw_plus_the_owner_all_to_alls(self, style):
    t = trainer(style)
    adamw = dmuon_jax.analyze_compiled(trainer(style, 'adamw').step)
    mine = dmuon_jax.analyze_compiled(t.step)
    (layout,) = dmuon_jax.owner_layouts(t.state['opt_state'])
    predicted = layout.collective_bytes()
    # Each kind is AdamW's plus the layout's prediction: the update's
    # all-to-alls, and on this 2x4 mesh (params sharded over 'shard') the
    # all-gather over 'replicate' that ends the way back. No Muon gradient
    # is all-gathered whole (that would be 7/8 of its bytes per device):
    # the way back moves (N - 1) rows of the largest owner's share, the
    # bytes of one all-to-all over all 8 devices.
    self.assertGreater(predicted['all-gather'], 0)
    for kind, extra in predicted.items():
      want = adamw.total_bytes(kind) + extra
      self.assertBetween(mine.total_bytes(kind), 0.95 * want, 1.05 * want)
    want = adamw.total_bytes() + sum(predicted.values())
    self.assertBetween(mine.total_bytes(), 0.95 * want, 1.05 * want)

  @parameterized.named_parameters(('nanodo', 'nanodo'), ('maxtext', 'maxtext'))
  def test_matches_optax_muon(self, style):
    _, state, losses = run(style)
    ref_params, ref_losses = reference(style)
    chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5)
    support.assert_trees_rel_close(
      self, jax.device_get(nn.unbox(state['params'])), ref_params, rtol=1e-5
    )


def abstract(tree):
  """Shapes, dtypes and shardings of ``tree`` (boxes kept)."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


class TrainerCheckpointTest(parameterized.TestCase):
  """The trainer's own orbax ``CheckpointManager`` (legacy API): saved on
  2x4 after 10 micro-steps, restored on 1x4 through the documented
  conversion (``checkpoint.state_to_portable`` / ``state_from_portable``);
  10 more micro-steps equal 20 uninterrupted ones. The state as it is
  (not converted) with orbax's ``partial_restore=True`` hint raises."""

  def setUp(self):
    super().setUp()
    self.tmp = support.temp_dir(self)

  def save(self, name, items):
    path = os.path.join(self.tmp, name)
    with ocp.CheckpointManager(path, ocp.PyTreeCheckpointer()) as mngr:
      mngr.save(10, items)
      mngr.wait_until_finished()
    return path

  @parameterized.named_parameters(('nanodo', 'nanodo'), ('maxtext', 'maxtext'))
  def test_resume_on_1x4_matches_uninterrupted(self, style):
    t = trainer(style)
    half, _ = t.run(STEPS // 2)
    path = self.save(
      'portable',
      {
        'params': half['params'],
        'opt_state': checkpoint.state_to_portable(half['opt_state']),
      },
    )
    # The 1x4 trainer as it starts: its fresh state is the target.
    small = trainer(style, shape=(1, 4))
    target = small.state['opt_state']
    like = {
      'params': abstract(small.state['params']),
      'opt_state': checkpoint.state_to_portable(target),
    }
    with ocp.CheckpointManager(path, ocp.PyTreeCheckpointer()) as mngr:
      restored = mngr.restore(
        10,
        items=like,
        restore_kwargs={
          'restore_args': ocp.checkpoint_utils.construct_restore_args(like)
        },
      )
    opt_state = checkpoint.state_from_portable(restored['opt_state'], target)
    # The trainer's tree as it was: boxed params, boxed owner buffers.
    chex.assert_trees_all_equal_structs(opt_state, target)
    (layout,) = dmuon_jax.owner_layouts(opt_state)
    # (the size-1 'replicate' axis owns nothing: no owner axis)
    self.assertEqual(layout.buffer_sizes, (4,))
    # ... with the momentum sharded as the new layout says (1/4 each).
    _, buffers = owner_buffers({'opt_state': opt_state})
    for buf, spec in zip(buffers, layout.buffer_specs(), strict=True):
      self.assertEqual(buf.sharding.spec, spec)
      self.assertEqual(
        {s.data.size for s in buf.addressable_shards}, {buf.size // 4}
      )
    resumed, _ = small.run(
      STEPS // 2, {'params': restored['params'], 'opt_state': opt_state}
    )
    _, whole, _ = run(style)
    support.assert_trees_rel_close(
      self,
      jax.device_get(nn.unbox(resumed['params'])),
      jax.device_get(nn.unbox(whole['params'])),
      rtol=1e-5,
    )

  @parameterized.named_parameters(('nanodo', 'nanodo'), ('maxtext', 'maxtext'))
  def test_partial_restore_into_another_layout_raises(self, style):
    t = trainer(style)
    path = self.save('native', {'opt_state': t.state['opt_state']})
    target = {
      'opt_state': abstract(trainer(style, shape=(1, 4)).state)['opt_state']
    }
    with ocp.CheckpointManager(path, ocp.PyTreeCheckpointer()) as mngr:
      with self.assertRaisesRegex(
        ValueError, r'dmuon_jax\.checkpoint.*state_from_portable'
      ):
        mngr.restore(
          10,
          items=target,
          restore_kwargs={
            'restore_args': ocp.checkpoint_utils.construct_restore_args(target),
            'partial_restore': True,
          },
        )


if __name__ == '__main__':
  absltest.main()
