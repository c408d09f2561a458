"""GSPMD trainers' state recipes keep the momentum on its owners (issue 25).

Trainers derive the optimizer state's shardings with Flax's tools (or from
``jax.eval_shape`` on Explicit meshes) and force them with
``jax.jit(init, out_shardings=...)``. Each recipe here is what a trainer
writes: nanodo (``nn.get_sharding``), MaxText (``nn.LogicallyPartitioned``,
logical axis rules, ``nn.logical_to_mesh_sharding``), Flax NNX
(``nnx.get_named_sharding`` inside ``nnx.jit``) and Explicit meshes. The
owner buffers come out sharded as their layout says, each device holds
1/N of them, the update gathers no Muon gradient whole (it moves the
all-to-alls and the all-gather its layout predicts), and the numbers are
``optax.contrib.muon``'s. Before the owner buffers carried Flax metadata,
every recipe replicated them (or, on Auto meshes, did not see the Linen
params' shardings).
"""

import functools
import math
import re
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import _checks, _mesh
from tests import support

# One configuration per recipe runs in the inner loop; the Explicit-mesh
# variants of the Auto recipes are the rest of the grid.
SLOW_CASES = (
  r'nanodo_explicit',
  r'nnx_explicit',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^WarningTest::test_forced_replication_warns_once_explicit$',
)

AXES = ('replicate', 'shard')
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
KINDS = (('auto', AUTO), ('explicit', EXPLICIT))
LR = 0.02
STEPS = 3
RTOL = 1e-5  # relative, per leaf and step (as the parity tests elsewhere)
RULES = (('embed', 'shard'), ('mlp', None))
KEY = jax.random.key(0)
X = jnp.zeros((1, 16))


@functools.cache
def mesh(shape=(2, 4), kind=AUTO):
  return support.make_mesh(shape, AXES, kind)


class Mlp(nn.Module):
  """Two Dense layers, 16x32 and 32x16, FSDP over 'shard'; a bias for
  AdamW. ``logical``: logical axis names (MaxText), else mesh axes."""

  logical: bool = False

  @nn.compact
  def __call__(self, x):
    if self.logical:
      box = nn.with_logical_partitioning
      up, down, bias = ('embed', 'mlp'), ('mlp', 'embed'), ('mlp',)
    else:
      box = nn.with_partitioning
      up, down, bias = ('shard', None), (None, 'shard'), (None,)
    kernel = nn.initializers.lecun_normal()
    h = nn.Dense(
      32,
      kernel_init=box(kernel, up),
      bias_init=box(nn.initializers.zeros_init(), bias),
      name='up',
    )(x)
    return nn.Dense(
      16, use_bias=False, kernel_init=box(kernel, down), name='down'
    )(jnp.tanh(h))


def optimizer(m):
  return dmuon_jax.dmuon(LR, predicate='optax', mesh=m)


def linen_init(tx, logical=False):
  """A trainer's init: boxed params and the optimizer state."""

  def init(key):
    params = Mlp(logical).init(key, X)['params']
    return {'params': params, 'opt_state': tx.init(params)}

  return init


def linen_step(tx):
  def step(state, grads):
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    return {'params': params, 'opt_state': opt_state}

  return step


def train(state, step, shardings, grad_shardings, pure=nn.unbox):
  """``STEPS`` steps of ``step`` jitted with ``out_shardings=shardings``:
  the compiled step, the final state and the params after each step."""
  params = lambda s: s['params']
  grads = lambda i: jax.device_put(
    support.grads_at(i, params(state)), grad_shardings
  )
  compiled = (
    jax.jit(step, out_shardings=shardings).lower(state, grads(0)).compile()
  )
  history = []
  for i in range(STEPS):
    state = compiled(state, grads(i))
    history.append(jax.tree.map(np.asarray, pure(params(state))))
  return compiled, state, history


REFERENCE = optax.contrib.muon(LR)


@jax.jit
def reference_step(params, state, grads):
  updates, state = REFERENCE.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def reference(start):
  """``optax.contrib.muon`` from ``start`` (host arrays), one device."""
  params = jax.tree.map(jnp.asarray, start)
  state = REFERENCE.init(params)
  history = []
  for i in range(STEPS):
    params, state = reference_step(params, state, support.grads_at(i, params))
    history.append(jax.tree.map(np.asarray, params))
  return history


def owner_buffers(test, opt_state, n=8):
  """Checks that each buffer is sharded as the layout says: owner buffers
  1/n per device, per-leaf momentum as its param (the Mlp's two kernels
  on 8 devices: 1/4 of each over 'shard' is less than a whole kernel on
  its owner, so init keeps the momentum as the params); returns the
  layout."""
  (layout,) = dmuon_jax.owner_layouts(opt_state)
  (st,) = support.dmuon_states(opt_state)
  test.assertEqual(layout.momentum, 'params')
  for buf, spec, t in zip(st.mu.buffers, layout.buffer_specs(), layout.leaves):
    want = NamedSharding(buf.sharding.mesh, spec)
    test.assertTrue(buf.sharding.is_equivalent_to(want, buf.ndim), spec)
    entries = tuple(spec) + (None,) * (len(t.shape) - len(spec))
    local = tuple(d // 4 if e else d for d, e in zip(t.shape, entries))
    test.assertEqual({s.data.shape for s in buf.addressable_shards}, {local})
  held, even = layout.momentum_share()
  test.assertEqual(held, 2 * even)  # over 'shard' (4) of the 8 devices
  return layout


def check_step(test, compiled, layout):
  """The update moves what its layout predicts, by kind: the owner
  all-to-alls over 'shard' (the kernels' axis) and the all-gather over
  'replicate' that ends the way back; no Muon gradient or momentum is
  gathered whole.

  The Mlp's 2 kernels (512 float32 each) sit on 2 of the 8 owners; each
  device holds 1/4 of each, so a row (what a device sends one owner) is
  b = 128 elements = 512 B: 2 (4 - 1) b = 3 KiB of all-to-alls and
  (2 - 1) 4 b = 2 KiB of all-gather. The way back's (N - 1) b is what one
  all-to-all over all 8 devices moved before; a whole gather of both
  gradients would be 7/8 of 4 KiB per device.
  """
  kinds = dmuon_jax.analyze_compiled(compiled).bytes_by_kind
  want = layout.collective_bytes()
  test.assertEqual(want, {'all-to-all': 3072.0, 'all-gather': 2048.0})
  for kind, predicted in want.items():
    test.assertBetween(kinds.get(kind, 0.0) / predicted, 0.95, 1.05, kinds)


def check_numbers(test, history, start):
  for got, want in zip(history, reference(start)):
    support.assert_trees_rel_close(test, got, want, RTOL)


def same_types(test, a, b):
  """Same tree (boxes and layouts included) and the same ``jax.typeof``."""
  chex.assert_trees_all_equal_structs(a, b)
  test.assertEqual(jax.tree.map(jax.typeof, a), jax.tree.map(jax.typeof, b))


@functools.cache
def nanodo(kind):
  """nanodo: eval_shape, nn.get_sharding, jit(init, out_shardings)."""
  m = mesh(kind=kind)
  tx = optimizer(m)
  init = linen_init(tx)
  abstract = jax.eval_shape(init, KEY)
  shardings = nn.get_sharding(abstract, m)
  state = jax.jit(init, out_shardings=shardings)(KEY)
  start = jax.tree.map(np.asarray, nn.unbox(state['params']))
  run = train(state, linen_step(tx), shardings, shardings['params'])
  return state, start, run


@functools.cache
def maxtext():
  """MaxText: logical names, rules, nn.logical_to_mesh_sharding."""
  m = mesh()
  tx = optimizer(m)
  init = linen_init(tx, logical=True)
  with nn.logical_axis_rules(RULES):
    abstract = jax.eval_shape(init, KEY)
    specs = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(specs, m, RULES)
    state = jax.jit(init, out_shardings=shardings)(KEY)
  start = jax.tree.map(np.asarray, nn.unbox(state['params']))
  run = train(state, linen_step(tx), shardings, shardings['params'])
  return state, start, run


class Net(nnx.Module):
  """``Mlp`` in NNX: kernels with ``out_sharding`` metadata."""

  def __init__(self, rngs):
    kernel = lambda names: nnx.with_partitioning(
      nnx.initializers.lecun_normal(), names
    )
    self.up = nnx.Linear(16, 32, kernel_init=kernel(('shard', None)), rngs=rngs)
    self.down = nnx.Linear(
      32, 16, use_bias=False, kernel_init=kernel((None, 'shard')), rngs=rngs
    )


@functools.cache
def flax_nnx(kind):
  """Flax NNX: model and optimizer made in nnx.jit, the optimizer state
  constrained to nnx.get_named_sharding of itself."""
  m = mesh(kind=kind)
  tx = optimizer(m)
  constrain = (
    jax.lax.with_sharding_constraint if kind == AUTO else jax.sharding.reshard
  )

  @nnx.jit
  def create():
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = nnx.state(opt)
    nnx.update(opt, constrain(state, nnx.get_named_sharding(state, m)))
    return model, opt

  with jax.set_mesh(m):
    model, opt = create()
    start = jax.tree.map(
      np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))
    )
    template = nnx.state(model, nnx.Param)
    grad_shardings = nnx.get_named_sharding(template, m)
    # The functional form of an NNX train step (split / merge): one compile.
    graphdef, first = nnx.split((model, opt))
    shardings = nnx.get_named_sharding(first, m)

    def step(state, grads):
      model, opt = nnx.merge(graphdef, state)
      opt.update(model, grads)
      return nnx.state((model, opt))

    grads = lambda i: jax.device_put(
      support.grads_at(i, template), grad_shardings
    )
    compiled = (
      jax.jit(step, out_shardings=shardings).lower(first, grads(0)).compile()
    )
    state, history = first, []
    for i in range(STEPS):
      state = compiled(state, grads(i))
      history.append(jax.tree.map(np.asarray, nnx.to_pure_dict(state[0])))
  return opt, start, (compiled, first, state, history)


@functools.cache
def explicit_eval_shape():
  """Explicit meshes: shardings from the types of jax.eval_shape(init)."""
  m = mesh(kind=EXPLICIT)
  tx = optimizer(m)

  def init(key):
    boxed = Mlp().init(key, X)['params']
    params = jax.tree.map(
      lambda x, spec: jax.sharding.reshard(x, NamedSharding(m, spec)),
      nn.unbox(boxed),
      nn.get_partition_spec(boxed),
    )
    return {'params': params, 'opt_state': tx.init(params)}

  # (No jax.set_mesh: Linen boxes would constrain their values to their
  # names, which Explicit axes take as an assertion on the init's types.)
  abstract = jax.eval_shape(init, KEY)
  shardings = jax.tree.map(lambda x: x.sharding, abstract)
  state = jax.jit(init, out_shardings=shardings)(KEY)
  start = jax.tree.map(np.asarray, state['params'])
  placed = jax.tree.map(lambda x: x.sharding, state['params'])
  run = train(state, linen_step(tx), shardings, placed, pure=lambda p: p)
  return state, start, run


class RecipeTest(parameterized.TestCase):
  """Each recipe: sharded owner buffers, the predicted collectives,
  optax's numbers."""

  def check_linen(self, state, start, run):
    compiled, final, history = run
    layout = owner_buffers(self, state['opt_state'])
    owner_buffers(self, final['opt_state'])
    check_step(self, compiled, layout)
    check_numbers(self, history, start)
    same_types(self, final, state)

  @parameterized.named_parameters(*KINDS)
  def test_nanodo(self, kind):
    state, start, run = nanodo(kind)
    self.check_linen(state, start, run)
    # The params, their gradients and the owner buffers are boxed.
    (st,) = support.dmuon_states(state['opt_state'])
    self.assertIsInstance(st.mu.children[0], nn.Partitioned)
    self.assertIsInstance(state['params']['up']['kernel'], nn.Partitioned)
    grads = jax.eval_shape(
      jax.grad(lambda p: jnp.sum(Mlp().apply({'params': p}, X))),
      state['params'],
    )
    chex.assert_trees_all_equal_structs(grads, state['params'])

  def test_maxtext(self):
    state, start, run = maxtext()
    self.check_linen(state, start, run)
    (layout,) = dmuon_jax.owner_layouts(state['opt_state'])
    # Logical names mapped by the rules under jit init.
    self.assertEqual(layout.param_entries, (((), ('shard',)), (('shard',), ())))

  @parameterized.named_parameters(*KINDS)
  def test_nnx(self, kind):
    opt, start, (compiled, first, final, history) = flax_nnx(kind)
    layout = owner_buffers(self, nnx.as_pure(opt.opt_state))
    # What nnx.get_partition_spec / get_named_sharding read: the layout's.
    m = mesh(kind=kind)
    (st,) = support.dmuon_states(nnx.get_named_sharding(opt.opt_state, m))
    for got, spec in zip(st.mu.buffers, layout.buffer_specs()):
      self.assertTrue(got.is_equivalent_to(NamedSharding(m, spec), 2))
    check_step(self, compiled, layout)
    check_numbers(self, history, start)
    same_types(self, final, first)

  def test_eval_shape_types_explicit(self):
    state, start, run = explicit_eval_shape()
    self.check_linen(state, start, run)


class WarningTest(absltest.TestCase):
  """Forced replication warns once, naming its bytes; unknown specs' fix
  works where the warning fires (inside jit)."""

  def forced(self, m):
    """The nanodo recipe with every state leaf forced to P()."""
    tx = optimizer(m)
    init = linen_init(tx)
    abstract = jax.eval_shape(init, KEY)
    replicated = jax.tree.map(lambda _: NamedSharding(m, P()), abstract)
    state = jax.jit(init, out_shardings=replicated)(KEY)
    (st,) = support.dmuon_states(state['opt_state'])
    buf = st.mu.buffers[0]  # owner buffer, or the down kernel's momentum
    (layout,) = dmuon_jax.owner_layouts(state['opt_state'])
    owned = math.prod(layout.local_shapes()[0]) * buf.dtype.itemsize
    # Every device holds all of it.
    self.assertEqual(
      {s.data.shape for s in buf.addressable_shards}, {buf.shape}
    )
    grads = support.grads_at(0, state['params'])
    step = jax.jit(linen_step(tx), out_shardings=replicated)
    pattern = (
      rf'momentum buffer 0 .* sharded as .*each device holds '
      rf'{re.escape(_checks.human_bytes(buf.nbytes))} of it instead of '
      rf'{re.escape(_checks.human_bytes(owned))}.*per device'
    )
    return step, state, grads, pattern

  def test_forced_replication_warns_auto(self):
    # Auto mesh: the sharding XLA gives the buffer, read at compile time.
    step, state, grads, pattern = self.forced(mesh((1, 8)))
    with self.assertWarnsRegex(dmuon_jax.DMuonWarning, pattern):
      step.lower(state, grads).compile()

  def test_forced_replication_warns_once_explicit(self):
    # Explicit mesh: the buffer's type, read at trace time; once under
    # Python's default filter, every time under 'always'.
    step, state, grads, pattern = self.forced(mesh((8, 1), EXPLICIT))
    for action, times in (('default', 1), ('always', 2)):
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for _ in range(2):
          jax.clear_caches()  # traced again, not read from jit's cache
          step.trace(state, grads)
      got = [
        w for w in caught if issubclass(w.category, dmuon_jax.DMuonWarning)
      ]
      self.assertLen(got, times, action)
      self.assertRegex(str(got[0].message), pattern)

  def test_unknown_specs_fix_works_under_jit(self):
    m = mesh()
    tx = optimizer(m)

    def unboxed(key):  # what the warning is about: no metadata left
      return tx.init(nn.unbox(Mlp().init(key, X)['params']))

    state = jax.eval_shape(unboxed, KEY)
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertEqual(layout.param_entries, (None, None))
    params = nn.unbox(jax.eval_shape(Mlp().init, KEY, X)['params'])
    with self.assertWarnsRegex(
      dmuon_jax.DMuonWarning, r'param_specs=nn\.get_partition_spec'
    ):
      jax.eval_shape(tx.update, params, state, params)

    def suggested(key):  # the fix it names, inside the jitted init
      boxed = Mlp().init(key, X)['params']
      opt = dmuon_jax.dmuon(
        LR,
        predicate='optax',
        mesh=m,
        param_specs=nn.get_partition_spec(boxed),
      )
      return opt.init(nn.unbox(boxed))

    def boxed(key):  # or the boxes themselves
      return tx.init(Mlp().init(key, X)['params'])

    for fix in (suggested, boxed):
      (layout,) = dmuon_jax.owner_layouts(jax.jit(fix).eval_shape(KEY))
      self.assertEqual(
        layout.param_entries, (((), ('shard',)), (('shard',), ())), fix
      )


class BoxTest(absltest.TestCase):
  """Owner buffers boxed as Linen boxes pass Flax's sharding rules."""

  def test_buffer_boxes_through_flax_rules(self):
    m = mesh()
    template = nn.LogicallyPartitioned(jnp.zeros(4), ('mlp',))
    # A flat buffer and one with a leading scan-iterations dim.
    for spec, shape in ((P(AXES), (64,)), (P(None, AXES), (3, 64))):
      box = _mesh.box_like(
        template, jax.ShapeDtypeStruct(shape, jnp.float32), spec
      )
      self.assertIsInstance(box, nn.Partitioned)
      self.assertEqual(nn.get_sharding(box, m).spec, spec)
      logical = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(box), m, RULES
      )
      self.assertEqual(logical.spec, spec)
      self.assertEqual(_mesh.leaf_spec(box), spec)
      self.assertIs(_mesh.unbox(box), box.value)


if __name__ == '__main__':
  absltest.main()
