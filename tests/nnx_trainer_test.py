"""dmuon in a Flax NNX GSPMD trainer as it is written.

This suite's own small version of how an NNX trainer integrates its
optimizer (not a copy of any project): an NNX decoder whose kernels carry
FSDP metadata (``nnx.with_partitioning``), an activation sharding
constraint inside ``__call__`` (``out_sharding`` on Explicit meshes), the
optimizer wrapped in ``optax.MultiSteps`` inside
``nnx.Optimizer(model, tx, wrt=nnx.Param)``, model and optimizer made in
``nnx.jit`` and constrained to ``nnx.get_named_sharding`` of their own
state, the functional (split / merge) ``jax.jit`` train step with
``nnx.value_and_grad`` and ``optimizer.update``, and orbax's own
``CheckpointManager`` (``args`` API) across meshes.

The swap is one line: ``optax.contrib.muon(...)`` -> ``dmuon_jax.dmuon(...,
predicate='optax', mesh=mesh)``. Held to, on Auto and Explicit 2x4 meshes:
the owner buffers come out sharded as their layout says (1/8 of the
momentum per device), the compiled step moves AdamW's bytes plus only the
owner all-to-alls and the all-gather over 'replicate' the layout predicts,
the numbers equal
``optax.contrib.muon`` on one device, a checkpoint of the portable state
saved on 2x4 continues on 1x4 as the run it came from, and the native
state restored into another layout raises instead of zeroing momentum.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import checkpoint
from tests import support

SLOW_CASES = (
  r'_explicit',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^NnxTrainerTest::test_matches_optax_muon_auto$',
  r'^NnxCheckpointTest::test_native_state_into_another_layout_raises_auto$',
)

VOCAB, D, F, SEQ, BATCH = 32, 16, 64, 8, 16
LR = 0.01
EVERY_K = 2  # MultiSteps: one update every 2 micro-steps
STEPS = 20  # micro-steps
HALF = STEPS // 2  # where the checkpoint is taken
RTOL = 1e-5
AXES = ('replicate', 'shard')
KINDS = (('auto', AxisType.Auto), ('explicit', AxisType.Explicit))


def _kernel(names):
  return nnx.with_partitioning(nnx.initializers.normal(0.1), names)


def _activation_spec():
  """Batch over the data axes on Explicit meshes (as ``out_sharding``)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.are_all_axes_explicit:
    return None
  return P(AXES, None, None)


def _constrain_activation(h):
  """The activation annotation a GSPMD model carries on Auto meshes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.are_all_axes_explicit:
    return h  # the single-device reference; Explicit: out_sharding did it
  return jax.lax.with_sharding_constraint(h, P(AXES, None, None))


class Block(nnx.Module):
  """A norm and an MLP, residual."""

  def __init__(self, rngs):
    # The norm scale replicated: on Explicit meshes a scale over 'shard'
    # times activations batched over 'shard' is an illegal sharding.
    self.norm = nnx.LayerNorm(
      D,
      use_bias=False,
      scale_init=nnx.with_partitioning(nnx.initializers.ones, (None,)),
      rngs=rngs,
    )
    self.up = nnx.Linear(
      D, F, use_bias=False, kernel_init=_kernel(('shard', None)), rngs=rngs
    )
    self.down = nnx.Linear(
      F, D, use_bias=False, kernel_init=_kernel((None, 'shard')), rngs=rngs
    )

  def __call__(self, x):
    out = _activation_spec()
    h = nnx.gelu(self.up(self.norm(x), out_sharding=out))
    h = _constrain_activation(h)
    return x + self.down(h, out_sharding=out)


class Decoder(nnx.Module):
  """Embedding, two MLP blocks with a norm, an output head."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(
      VOCAB, D, embedding_init=_kernel((None, 'shard')), rngs=rngs
    )
    self.blocks = nnx.List([Block(rngs) for _ in range(2)])
    self.head = nnx.Linear(
      D, VOCAB, use_bias=False, kernel_init=_kernel(('shard', None)), rngs=rngs
    )

  def __call__(self, tokens):
    out = _activation_spec()
    x = self.embed(tokens, out_sharding=out)
    for block in self.blocks:
      x = block(x)
    return self.head(x, out_sharding=out)


tokens = functools.partial(support.token_batch, BATCH, SEQ + 1, VOCAB)


def loss_fn(model, batch):
  logits = model(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch[:, 1:]
  ).mean()


make_tx = functools.partial(
  support.multi_steps_tx, learning_rate=LR, every_k=EVERY_K
)


def pure_params(model):
  return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


class Trainer:
  """An NNX trainer's whole set-up on ``mesh`` (compiled once per config)."""

  def __init__(self, kind, opt, shape):
    self.mesh = mesh = support.make_mesh(shape, AXES, kind)
    tx = make_tx(opt, mesh)
    constrain = (
      jax.sharding.reshard
      if kind == AxisType.Explicit
      else jax.lax.with_sharding_constraint
    )

    @nnx.jit
    def create():
      model = Decoder(nnx.Rngs(0))
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      state = nnx.state(optimizer)
      nnx.update(
        optimizer, constrain(state, nnx.get_named_sharding(state, mesh))
      )
      return model, optimizer

    def step(state, batch):
      model, optimizer = nnx.merge(self.graphdef, state)
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    with jax.set_mesh(mesh):
      model, optimizer = create()
      self.graphdef, self.state = nnx.split((model, optimizer))
      shardings = nnx.get_named_sharding(self.state, mesh)
      self.batch = jax.device_put(tokens(), NamedSharding(mesh, P(AXES)))
      # The functional form of an NNX train step: one compile.
      self.step = (
        jax.jit(step, out_shardings=(shardings, NamedSharding(mesh, P())))
        .lower(self.state, self.batch)
        .compile()
      )

  def objects(self, state=None):
    """The model and optimizer of ``state`` (default: the initial one)."""
    return nnx.merge(self.graphdef, self.state if state is None else state)

  def run(self, state, steps):
    losses = []
    for _ in range(steps):
      state, loss = self.step(state, self.batch)
      losses.append(float(loss))
    return state, losses


@functools.cache
def trainer(kind, opt='dmuon', shape=(2, 4)):
  return Trainer(kind, opt, shape)


@functools.cache
def run(kind):
  """20 micro-steps on 2x4: the start, the state after 10, the final state
  and the losses."""
  t = trainer(kind)
  start = pure_params(t.objects()[0])
  half, first = t.run(t.state, HALF)
  final, second = t.run(half, STEPS - HALF)
  return start, half, final, first + second


@functools.cache
def reference(kind):
  """optax.contrib.muon in the same MultiSteps on one device (no mesh)."""
  start, _, _, _ = run(kind)
  with nnx.use_eager_sharding(False):  # no mesh to shard the variables over
    model = Decoder(nnx.Rngs(1))
  params = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, start))
  nnx.update(model, params)
  optimizer = nnx.Optimizer(model, make_tx('muon'), wrt=nnx.Param)
  batch = tokens()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(STEPS)]
  return pure_params(model), losses


def opt_state(t, state):
  """The optimizer state (pure arrays) of a trainer's state."""
  return nnx.as_pure(t.objects(state)[1].opt_state)


def assert_on_owners(test, pure, n, exact=True):
  """Each owner buffer of ``pure`` is sharded as its layout says, 1/n of it
  per device; returns the layout. ``exact=False``: an equivalent sharding
  will do (XLA writes ``P(('replicate', 'shard'))`` as ``P('shard')`` when
  'replicate' has size 1)."""
  (layout,) = dmuon_jax.owner_layouts(pure)
  (st,) = support.dmuon_states(pure)
  buffers = jax.tree.leaves(st.mu)
  test.assertLen(buffers, len(layout.buffer_specs()))
  for buf, spec in zip(buffers, layout.buffer_specs(), strict=True):
    if exact:
      test.assertEqual(buf.sharding.spec, spec)
    want = NamedSharding(buf.sharding.mesh, spec)
    test.assertTrue(
      buf.sharding.is_equivalent_to(want, buf.ndim), (buf.sharding, spec)
    )
    test.assertEqual(
      {s.data.size for s in buf.addressable_shards}, {buf.size // n}
    )
  return layout


class NnxTrainerTest(parameterized.TestCase):
  @parameterized.named_parameters(*KINDS)
  def test_momentum_sharded_as_its_layout(self, kind):
    t = trainer(kind)
    _, half, _, _ = run(kind)
    for state in (t.state, half):
      layout = assert_on_owners(self, opt_state(t, state), 8)
      self.assertGreater(layout.num_slots, 1)

  @parameterized.named_parameters(*KINDS)
  def test_step_bytes_are_adamw_plus_the_owner_all_to_alls(self, kind):
    t = trainer(kind)
    adamw = dmuon_jax.analyze_compiled(trainer(kind, 'adamw').step)
    mine = dmuon_jax.analyze_compiled(t.step)
    (layout,) = dmuon_jax.owner_layouts(opt_state(t, t.state))
    predicted = layout.collective_bytes()
    self.assertGreater(predicted['all-to-all'], 0)
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

  @parameterized.named_parameters(*KINDS)
  def test_matches_optax_muon(self, kind):
    t = trainer(kind)
    _, _, final, losses = run(kind)
    ref_params, ref_losses = reference(kind)
    chex.assert_trees_all_close(losses, ref_losses, rtol=RTOL)
    support.assert_trees_rel_close(
      self, pure_params(t.objects(final)[0]), ref_params, RTOL
    )
    # The state these numbers come from kept its momentum on the owners.
    assert_on_owners(self, opt_state(t, final), 8)


class NnxCheckpointTest(parameterized.TestCase):
  """orbax's own ``CheckpointManager`` (``args`` API): 2x4 -> 1x4."""

  def setUp(self):
    super().setUp()
    self.root = support.temp_dir(self)

  def saved(self, kind, name, portable):
    """Saves the 2x4 run after 10 micro-steps; returns its directory."""
    t = trainer(kind)
    _, half, _, _ = run(kind)
    model, optimizer = t.objects(half)
    state = nnx.as_pure(optimizer.opt_state)
    if portable:
      tree = {
        'model': nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        'opt_state': checkpoint.state_to_portable(state),
      }
    else:
      tree = {'opt_state': state}
    path = f'{self.root}/{name}'
    with ocp.CheckpointManager(path) as mngr:
      mngr.save(HALF, args=ocp.args.StandardSave(tree))
      mngr.wait_until_finished()
    return path

  def check_continues(self, kind, t, model, optimizer):
    """10 more micro-steps on 1x4 equal the 2x4 run's last 10."""
    # The momentum lands on its new owners, 1/4 per device.
    layout = assert_on_owners(
      self, nnx.as_pure(optimizer.opt_state), 4, exact=False
    )
    # (the size-1 'replicate' axis owns nothing: no owner axis)
    self.assertEqual(layout.buffer_sizes, (4,))
    final, losses = t.run(nnx.state((model, optimizer)), STEPS - HALF)
    _, _, want, want_losses = run(kind)
    chex.assert_trees_all_close(losses, want_losses[HALF:], rtol=RTOL)
    support.assert_trees_rel_close(
      self,
      pure_params(t.objects(final)[0]),
      pure_params(trainer(kind).objects(want)[0]),
      RTOL,
    )

  @parameterized.named_parameters(*KINDS)
  def test_portable_state_continues_on_another_mesh(self, kind):
    path = self.saved(kind, 'portable', portable=True)
    t = trainer(kind, shape=(1, 4))
    model, optimizer = t.objects()  # the fresh 1x4 trainer
    params = nnx.state(model, nnx.Param)
    target = nnx.as_pure(optimizer.opt_state)
    like = {
      'model': nnx.to_pure_dict(params),
      'opt_state': checkpoint.state_to_portable(target),
    }
    with ocp.CheckpointManager(path) as mngr:
      restored = mngr.restore(HALF, args=ocp.args.StandardRestore(like))
    new_state = checkpoint.state_from_portable(restored['opt_state'], target)
    nnx.replace_by_pure_dict(params, restored['model'])
    nnx.update(model, params)
    nnx.update(optimizer.opt_state, nnx.state(new_state))
    self.check_continues(kind, t, model, optimizer)

  @parameterized.named_parameters(*KINDS)
  def test_save_nnx_continues_on_another_mesh(self, kind):
    # The documented NNX calls do the same conversion in one call each.
    t = trainer(kind)
    _, half, _, _ = run(kind)
    checkpoint.save_nnx(f'{self.root}/nnx', HALF, *t.objects(half))
    fresh = trainer(kind, shape=(1, 4))
    model, optimizer = fresh.objects()
    step = checkpoint.restore_nnx(f'{self.root}/nnx', model, optimizer)
    self.assertEqual(step, HALF)
    self.assertEqual(int(optimizer.step[...]), HALF)
    self.check_continues(kind, fresh, model, optimizer)

  @parameterized.named_parameters(*KINDS)
  def test_native_state_into_another_layout_raises(self, kind):
    path = self.saved(kind, 'native', portable=False)
    t = trainer(kind, shape=(1, 4))
    target = {'opt_state': opt_state(t, t.state)}
    with ocp.CheckpointManager(path) as mngr:
      with self.assertRaisesRegex(ValueError, r'dmuon_jax\.checkpoint'):
        mngr.restore(
          HALF,
          args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
          ),
        )


if __name__ == '__main__':
  absltest.main()
