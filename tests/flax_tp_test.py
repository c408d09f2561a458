"""dmuon_jax.flax on a tensor-parallel NNX model as written (GSPMD style).

Megatron-style layers sharded over ``'model'`` by their Flax metadata
(``nnx.with_partitioning``): ``wq``, ``wk`` and ``up`` column-parallel
(``up`` with a bias split likewise), ``wo`` and ``down`` row-parallel; the
model has no ``psum``: the partitioner inserts the TP collectives. The
embedding and the head are AdamW params. Dedicated with the three lines of
the guide on a ``('replicate', 'shard', 'model')`` mesh, under the user's
own ``nnx.jit`` step (every axis Explicit: the reduced gathers; the
row-parallel layers name their output's sharding, as Explicit meshes ask)
and under ``dmuon_jax.flax.train_step`` (Auto axes), held to the same model
on one device under ``nnx.jit`` with ``optax.contrib.muon`` (Frobenius
normalization, direct Newton-Schulz; dmuon's ``ns_algorithm='auto'`` runs
the TP matrices by Gram Newton-Schulz over ``'model'``, within fp32
rounding of it).
"""

import functools
import re

import chex
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

import dmuon_jax
import dmuon_jax.flax as dflax
from dmuon_jax import _staged
from tests import support

# Each route runs Z2 and Z3, one on each mesh (1x4x2: FSDP x TP, 2x2x2:
# HSDP x TP); Linen's train_step Z3 on 1x4x2. (Z2 of the plain-jit route
# and Z3 of train_step on 1x4x2 were dropped: 24 s of the suite's time.)
# The rest of the grid, for CI (see conftest.py): -m 'not slow' keeps Z3
# of the plain-jit route and Z2 of train_step (1x4x2), and Linen's Z3.
SLOW_CASES = (
  r'2x2x2',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^LinenTrainStepTest::test_z3_1x4x2$',
  r'^PlainJitTest::test_z3_1x4x2$',
  r'^TrainStepTest::test_z2_1x4x2$',
  r'^OutsideTheStepTest::test_plain_jit_on_an_auto_mesh_warns_and_computes_the_same$',
)

AXES = ('replicate', 'shard', 'model')
DP = AXES[:2]  # the owner (data-parallel) axes
MESHES = {'1x4x2': (1, 4, 2), '2x2x2': (2, 2, 2)}
# One block (one gather group) but in TrainStepTest's HSDP x TP Z3 run,
# two (two groups, ordered by their ties; see _Checks): what each run checks
# is per block, and a compile of two blocks costs 5 to 6 CPU s more.
D, F, V, LAYERS = 32, 64, 64, 1
BATCH, LENGTH = 16, 9
# At 0.01 AdamW amplifies fp32 summation-order noise in the embedding's
# smallest gradients (its m / sqrt(v) is near +-1 however small they are):
# measured 1.2e-5 from the reference after 20 HSDP (2x2x2) train_step
# steps (two blocks), with every Muon matrix within 5e-7. At 0.005 every
# leaf stays within 2.3e-6 on both meshes and both routes (2.7e-6 Linen's;
# losses within 4.6e-7).
STEPS, LR = 20, 0.005
COLUMN, ROW = (None, 'model'), ('model', None)
TP_SPECS = (COLUMN, COLUMN, ROW, COLUMN, ROW)  # wq, wk, wo, up, down


def linear(rngs, fan_in, fan_out, kernel=None, bias=None):
  """``nnx.Linear`` whose kernel (and bias, if any) is partitioned by
  ``kernel``/``bias`` (None: no metadata, the single-device reference)."""
  init = nnx.initializers.lecun_normal()
  kwargs = {'use_bias': bias is not None}
  if kernel is not None:
    kwargs['kernel_init'] = nnx.with_partitioning(init, kernel)
  if bias:
    kwargs['bias_init'] = nnx.with_partitioning(
      nnx.initializers.zeros_init(), bias
    )
  return nnx.Linear(fan_in, fan_out, rngs=rngs, **kwargs)


class Block(nnx.Module):
  """Attention-like mixing (column ``wq``/``wk``, row ``wo``) and an MLP
  (column ``up`` with its bias, row ``down``). ``out``: the row-parallel
  outputs' sharding (Explicit meshes need it: the contraction runs over
  the TP axis), None elsewhere."""

  def __init__(self, rngs, tp, out):
    col, row = (COLUMN, ROW) if tp else (None, None)
    self.out = out
    self.norm1 = nnx.RMSNorm(D, rngs=rngs)
    self.wq = linear(rngs, D, D, col)
    self.wk = linear(rngs, D, D, col)
    self.wo = linear(rngs, D, D, row)
    self.norm2 = nnx.RMSNorm(D, rngs=rngs)
    self.up = linear(rngs, D, F, col, ('model',) if tp else ())
    self.down = linear(rngs, F, D, row)

  def __call__(self, x):
    h = self.norm1(x)
    x = x + self.wo(jnp.tanh(self.wq(h)) * self.wk(h), out_sharding=self.out)
    h = nnx.gelu(self.up(self.norm2(x)))
    return x + self.down(h, out_sharding=self.out)


class Model(nnx.Module):
  def __init__(self, rngs, tp=True, explicit=False, layers=LAYERS):
    out = P(DP, None, None) if explicit else None
    self.batch = P(DP) if explicit else None
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.layers = nnx.List([Block(rngs, tp, out) for _ in range(layers)])
    self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens, out_sharding=self.batch)
    for block in self.layers:
      x = block(x)
    return self.head(x)


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def train_step(model, optimizer, tokens):  # the user's step, unchanged
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  return loss


def token_batch():
  return support.token_batch(BATCH, LENGTH, V)


def make_mesh(name, kind):
  return support.make_mesh(MESHES[name], AXES, kind)


@functools.cache
def reference(layers=LAYERS):
  """One device, no mesh: ``optax.contrib.muon`` under ``nnx.jit``."""
  model = Model(nnx.Rngs(0), tp=False, layers=layers)
  tx = optax.contrib.muon(
    LR, muon_weight_dimension_numbers=support.same_routing_dims
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = nnx.jit(train_step)
  losses = [float(step(model, optimizer, token_batch())) for _ in range(STEPS)]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return np.array(losses), jax.tree.map(np.asarray, params)


@functools.cache
def run(mesh_name, route, z3, layers=LAYERS):
  """``STEPS`` dedicated steps: ``route`` ``'jit'`` (the user's
  ``nnx.jit`` on an all-Explicit mesh) or ``'train_step'`` (Auto mesh)."""
  explicit = route == 'jit'
  mesh = make_mesh(mesh_name, AxisType.Explicit if explicit else AxisType.Auto)
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0), explicit=explicit, layers=layers)
    sharding = model.layers[0].wq.kernel.get_value().sharding.spec
    ded = dflax.dedicate(model, mesh, reshard_after_forward=z3)
    tx = dflax.dedicated_muon(ded, learning_rate=LR)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = (nnx.jit if explicit else dflax.train_step(ded))(train_step)
    tokens = jax.device_put(token_batch(), NamedSharding(mesh, P(DP)))
    losses = [float(step(model, optimizer, tokens)) for _ in range(STEPS)]
    args = (model, optimizer, tokens)
    compiled = step.lower(*args).compile() if explicit else step.compile(*args)
    params = jax.tree.map(np.asarray, ded.to_params(model))
  return {
    'losses': np.array(losses),
    'params': params,
    'ded': ded,
    'mesh': mesh,
    'compiled': compiled,
    'sharding': sharding,
    'layers': layers,
  }


# -- the compiled step's collectives, by the mesh axes they span ---------------

_KINDS = (
  'all-gather',
  'all-reduce',
  'reduce-scatter',
  'all-to-all',
  'collective-permute',
)
_GROUPS = re.compile(
  r'replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\}|\[[\d,]+\]<=\[[\d,]+\]'
  r'(?:T\([\d,]+\))?)'
)


def collectives_by_axes(compiled, mesh):
  """``(kind, mesh axes its groups span, float elements)`` of every
  collective instruction (the step has no loops: each runs once)."""
  coords = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
  computations, *_ = dmuon_jax.diagnostics.parse_module(compiled.as_text())
  out = []
  for ins in (i for c in computations.values() for i in c):
    kind = ins.opcode.removesuffix('-start')
    if kind not in _KINDS:
      continue
    m = _GROUPS.search(ins.attrs)
    groups = dmuon_jax.diagnostics.parse_replica_groups(
      m[1] if m else '{}', num_devices=mesh.size
    )
    spans = {
      mesh.axis_names[k]
      for group in groups
      for k in range(len(mesh.axis_names))
      if len({coords[d][k] for d in group}) > 1
    }
    # Float elements (the flags of nonfinite='skip' aside).
    size = sum(
      int(np.prod(s))
      for t, s in dmuon_jax.diagnostics.elements(ins.shape)
      if t != 'pred'
    )
    out.append((kind, frozenset(spans), size))
  return out


def gram_elements(ded) -> int:
  """Elements of the TP Gram all-reduces of one update: per layout group,
  its stacked Grams per restart window and the max-abs entries."""
  layout = ded.dedication.layout
  total = 0
  for lay in layout.groups:
    st = _staged.Stages(layout, lay, 5, [None] * len(lay.plan.units))
    total += st.windows * st.tp_block + st.vec_tp
  return total


def muon_floor(ded, z3) -> float:
  """Bytes per device of the Muon gathers and reduce-scatters at the
  floor: 2 (N-1)/N of the (padded) gathered bytes, Z3 plus the backward
  re-gather over the shard axes (HSDP: not over ``'replicate'``)."""
  dedication = ded.dedication
  _, gathered = dedication.gather_bytes()
  n = dedication.num_slots
  sizes = dict(dedication.mesh.shape)
  s = int(np.prod([sizes[a] for a in dedication.shard_axes]))
  return (2 * (n - 1) / n + z3 * (s - 1) / s) * gathered


class _Checks(absltest.TestCase):
  def check(self, mesh_name, route, z3, layers=LAYERS):
    self.check_run(run(mesh_name, route, z3, layers), reference(layers), z3)

  def check_run(self, got, want, z3):
    """``got`` (a run's dict) against ``want`` (reference losses and
    params), and its compiled step's collectives."""
    want_losses, want_params = want
    ded, mesh, layers = got['ded'], got['mesh'], got['layers']
    self.assertEqual(got['sharding'], P(*COLUMN))  # TP as the model made it
    self.assertEqual(ded.dedication.tensor_parallel_axis, 'model')
    rel = np.max(np.abs(got['losses'] - want_losses) / want_losses)
    self.assertLess(rel, 1e-5)
    self.assertLess(want_losses[-1], want_losses[0] - 1)  # it trains
    support.assert_trees_max_rel_close(got['params'], want_params, 1e-5)

    found = collectives_by_axes(got['compiled'], mesh)
    owner = {a for a in DP if mesh.shape[a] > 1}
    # The owner buffers move over the owner axes only, by all-gather and
    # reduce-scatter; nothing moves by all-to-all or permutes.
    moved = [(k, a) for k, a, _ in found if k not in ('all-reduce',)]
    for kind, axes in moved:
      self.assertIn(kind, ('all-gather', 'reduce-scatter'))
      self.assertTrue(axes and axes <= owner, (kind, axes))
    kinds = support.collectives_of(got['compiled'])
    muon = kinds['all-gather'][1] + kinds['reduce-scatter'][1]
    floor = muon_floor(ded, z3)
    self.assertLessEqual(muon, 1.05 * floor)
    self.assertGreaterEqual(muon, floor - 1)
    # Over 'model': all-reduces only, of the Gram stacks and of whole
    # activations (the row-parallel outputs forward, the column-parallel
    # layers' input gradients backward: 5 per block); no matrix travels
    # over it.
    tp = [(k, n) for k, a, n in found if a == {'model'}]
    self.assertEqual({k for k, _ in tp}, {'all-reduce'})
    activation = BATCH // ded.dedication.num_slots * (LENGTH - 1) * D
    rest = sum(n for _, n in tp) - gram_elements(ded) - 5 * layers * activation
    # (and the scalar ties that order a group's gathers: at most two each)
    self.assertBetween(rest, 0, 2 * len(ded.dedication.groups))
    # No Muon gradient in an all-reduce over the owner axes: only AdamW's
    # (embedding, head, norms, the TP bias's slice) and scalars.
    adamw = 2 * V * D + 2 * layers * D + layers * F // 2
    over_owners = sum(n for k, a, n in found if k == 'all-reduce' and a & owner)
    self.assertLessEqual(over_owners, adamw + 8)


class PlainJitTest(_Checks):
  """The user's own ``nnx.jit`` step on an all-Explicit mesh: each TP
  matrix gathered typed ``reduced`` over the owner axes and sharded over
  ``'model'`` as the param was."""

  def test_z3_1x4x2(self):
    self.check('1x4x2', 'jit', True)

  def test_z2_2x2x2(self):
    self.check('2x2x2', 'jit', False)


class TrainStepTest(_Checks):
  """``dmuon_jax.flax.train_step`` on an Auto mesh: manual owner axes,
  ``'model'`` left to the partitioner (the gathers and the owners' update
  run per TP shard in a ``shard_map`` over it)."""

  def test_z2_1x4x2(self):
    self.check('1x4x2', 'train_step', False)

  def test_z3_2x2x2(self):
    self.check('2x2x2', 'train_step', True, layers=2)


# -- the same model in Linen ------------------------------------------------------


def dense(features, partition, name):
  return nn.Dense(
    features,
    use_bias=False,
    name=name,
    kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), partition),
  )


class LinenBlock(nn.Module):
  """:class:`Block` in Linen (no bias), its kernels boxed over ``'model'``
  by ``nn.with_partitioning``."""

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(name='norm1')(x)
    a = jnp.tanh(dense(D, COLUMN, 'wq')(h)) * dense(D, COLUMN, 'wk')(h)
    x = x + dense(D, ROW, 'wo')(a)
    h = nn.gelu(dense(F, COLUMN, 'up')(nn.RMSNorm(name='norm2')(x)))
    return x + dense(D, ROW, 'down')(h)


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D, name='embed')(tokens)
    for i in range(LAYERS):
      x = LinenBlock(name=f'layers_{i}')(x)
    return nn.Dense(V, use_bias=False, name='head')(x)


def linen_loss(params, apply_fn, tokens):
  logits = apply_fn({'params': params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def linen_step(state, tokens):  # the ordinary Linen step, unchanged
  loss, grads = jax.value_and_grad(linen_loss)(
    state.params, state.apply_fn, tokens
  )
  return state.apply_gradients(grads=grads), loss


@functools.cache
def linen_init():
  """The boxed params (``nn.Partitioned`` over ``'model'``)."""
  return jax.jit(LinenModel().init)(jax.random.key(0), token_batch()[:, :-1])[
    'params'
  ]


@functools.cache
def linen_reference():
  params = nn.unbox(linen_init())
  apply_fn = LinenModel().apply
  params, losses = support.train_single_device(
    support.optax_muon(LR, params),
    params,
    lambda p: linen_loss(p, apply_fn, token_batch()),
    STEPS,
  )
  return np.array(losses), jax.tree.map(np.asarray, params)


@functools.cache
def linen_run(z3):
  """``STEPS`` steps of the Linen model from a ``TrainState``, dedicated
  by ``dedicate_linen`` (its boxes name the TP axis), under
  ``train_step`` on an Auto mesh."""
  mesh = make_mesh('1x4x2', AxisType.Auto)
  boxed = linen_init()
  ded, params = dflax.dedicate_linen(
    LinenModel(), boxed, mesh, reshard_after_forward=z3
  )
  state = train_state.TrainState.create(
    apply_fn=ded.apply,
    params=params,
    tx=dflax.dedicated_muon(ded, learning_rate=LR),
  )
  # Two traces (train_step's output probe, then its shard_map), once: the
  # returned TrainState's owner buffers come back as they went in (XLA
  # spells them without the size-1 'replicate': P(('shard', 'model'))), so
  # every call after the first runs the first call's executable (before:
  # the second call compiled the step again).
  chex.clear_trace_counter()
  step = dflax.train_step(ded)(chex.assert_max_traces(linen_step, n=2))
  tokens = jax.device_put(token_batch(), NamedSharding(mesh, P(DP)))
  losses = []
  for _ in range(STEPS):
    state, loss = step(state, tokens)
    losses.append(float(loss))
  return {
    'losses': np.array(losses),
    'params': jax.tree.map(np.asarray, ded.to_params(state.params)),
    'ded': ded,
    'mesh': mesh,
    'compiled': step.compile(state, tokens),
    'sharding': nn.get_partition_spec(boxed)['layers_0']['wq']['kernel'],
    'layers': LAYERS,
  }


class LinenTrainStepTest(_Checks):
  """The Linen model from a ``TrainState`` loop (Linen's ``nn.Dense``
  cannot name its output's sharding, which a row-parallel layer on an
  all-Explicit mesh needs: ``train_step`` on an Auto mesh)."""

  def test_z3_1x4x2(self):
    self.check_run(linen_run(True), linen_reference(), True)


class OutsideTheStepTest(absltest.TestCase):
  def test_eager_call_equals_the_plain_model(self):
    tokens = token_batch()[:, :-1]
    want = np.asarray(Model(nnx.Rngs(0), tp=False)(tokens))
    mesh = make_mesh('1x4x2', AxisType.Explicit)
    with jax.set_mesh(mesh):
      model = Model(nnx.Rngs(0))
      ded = dflax.dedicate(model, mesh)
      got = model(tokens)  # eagerly: every TP shard's slices joined
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    plain = ded.to_params(model)
    self.assertEqual(plain['layers'][0]['down']['kernel'].shape, (F, D))

  def test_plain_jit_on_an_auto_mesh_warns_and_computes_the_same(self):
    # GSPMD gathers (every TP shard's slices joined), all-reduced
    # gradients: train_step is the floor on Auto meshes.
    mesh = make_mesh('1x4x2', AxisType.Auto)
    with jax.set_mesh(mesh):
      model = Model(nnx.Rngs(0))
      ded = dflax.dedicate(model, mesh)
      optimizer = nnx.Optimizer(
        model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
      )
      tokens = jax.device_put(token_batch(), NamedSharding(mesh, P(DP)))
      with self.assertWarnsRegex(
        dmuon_jax.DMuonWarning, r'plain jax.jit/nnx.jit.*train_step'
      ):
        loss = float(nnx.jit(train_step)(model, optimizer, tokens))
    want = reference()[0][0]
    self.assertLess(abs(loss - want) / want, 1e-6)

  def test_auto_tp_axis_under_plain_jit_names_what_to_do(self):
    # Owner axes Explicit, 'model' Auto: jax types unreduced cotangents
    # only on all-Explicit meshes (0.10: an AssertionError in getu).
    # Flax's partitioning metadata refuses such a mesh: placed by hand.
    mesh = support.make_mesh(MESHES['1x4x2'], AXES, AxisType.Explicit)
    mesh = jax.make_mesh(
      MESHES['1x4x2'],
      AXES,
      axis_types=(AxisType.Explicit,) * 2 + (AxisType.Auto,),
      devices=mesh.devices.reshape(-1),
    )
    with jax.set_mesh(mesh):
      model = Model(nnx.Rngs(0), tp=False, explicit=True)
      for block in model.layers:
        for name, spec in zip(('wq', 'wk', 'wo', 'up', 'down'), TP_SPECS):
          kernel = getattr(block, name).kernel
          kernel.set_value(
            jax.device_put(kernel.get_value(), NamedSharding(mesh, P(*spec)))
          )
      ded = dflax.dedicate(model, mesh)
      self.assertEqual(ded.dedication.tensor_parallel_axis, 'model')
      optimizer = nnx.Optimizer(
        model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
      )
      tokens = jax.device_put(token_batch(), NamedSharding(mesh, P(DP)))
      with self.assertRaisesRegex(
        ValueError,
        r"boundary 'layers/0' ran under plain jax.jit.*tensor-parallel axis "
        r"'model' is not.*Make 'model' Explicit.*train_step",
      ):
        nnx.jit(train_step)(model, optimizer, tokens)

  def test_tp_matrices_in_a_scanned_stack_are_refused_by_name(self):
    # Not run yet (the scan's carry types differ between the TP shards'
    # per-layer gathers): refused at dedicate, naming the stack.
    class Layer(nnx.Module):
      def __init__(self, key):
        self.up = linear(nnx.Rngs(key), D, F, COLUMN)

      def __call__(self, x):
        return x + self.up(x)[..., :D]

    mesh = support.make_mesh(MESHES['1x4x2'], AXES, AxisType.Auto)
    with jax.set_mesh(mesh):
      stack = nnx.vmap(Layer, in_axes=0, out_axes=0)(
        jax.random.split(jax.random.key(0), 2)
      )
      model = nnx.Dict(layers=stack)
      dims = {
        'layers': {'up': {'kernel': dmuon_jax.MuonDimensionNumbers(1, 2)}}
      }
      with self.assertRaisesRegex(
        ValueError,
        r"targets \['layers/up/kernel'\] are stacked layers.*'model'",
      ):
        dflax.dedicate(model, mesh, muon_weight_dimension_numbers=dims)


if __name__ == '__main__':
  absltest.main()
