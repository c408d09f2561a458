"""The state carries its layout: init under jit, nnx.Optimizer, orbax, specs.

Each case here failed before the owner layout moved into the state (see the
issue "One owner core, and a state that knows its own layout").
"""

import functools
import importlib
import tempfile
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import _owner_update
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'nnx_helpers_convert_between_layouts',
  r'injected_and_scheduled_match_optax_auto',
  r'orbax_round_trip_of_nnx_state',
  r'injected_and_scheduled_match_optax_explicit',
  r'route_like_plain_init_auto',
  # Sharding kinds beyond both dims sharded and columns sharded.
  r'all_to_all_as_predicted_(size1_axis_8x1|two_axes_one_dim|hsdp_rows)',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^NnxOptimizerTest::test_eager_and_jit_created_optimizers_route_like_plain_init_explicit$',
  r'^SharedBodiesTest::test_a_batch_then_the_rest_one_at_a_time$',
)

AXES = ('replicate', 'shard')
KINDS = (('explicit', AxisType.Explicit), ('auto', AxisType.Auto))


def make_mesh(shape, names=AXES, kind=AxisType.Explicit):
  n = int(np.prod(shape))
  if jax.device_count() < n:
    raise absltest.SkipTest(f'needs {n} devices, found {jax.device_count()}')
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def mlp_params(seed=0, layers=4, d_in=128, d_out=256):
  k = iter(jax.random.split(jax.random.key(seed), 2 * layers))
  return {
    f'layers_{i}': {
      'w': 0.1 * jax.random.normal(next(k), (d_in, d_out)),
      'b': 0.1 * jax.random.normal(next(k), (d_out,)),
    }
    for i in range(layers)
  }


SHARD = P('shard')


def fsdp(params, mesh, spec=SHARD):
  """Kernels sharded by ``spec``, biases replicated."""
  return jax.tree.map(
    lambda x: NamedSharding(mesh, spec if x.ndim == 2 else P()), params
  )


def muon_states(state):
  is_state = lambda x: isinstance(x, dmuon_jax.ScaleByDMuonState)
  return [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]


def assert_same_state(test, a, b):
  """Same tree (layouts included), values, and equivalent placements."""
  chex.assert_trees_all_equal_structs(a, b)
  chex.assert_trees_all_equal(a, b)
  for (path, x), y in zip(
    jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
  ):
    if x.ndim:  # (optax's own counts are uncommitted scalars eagerly)
      test.assertTrue(
        x.sharding.is_equivalent_to(y.sharding, x.ndim),
        (jax.tree_util.keystr(path), x.sharding, y.sharding),
      )


def owner_bytes(report):
  """All-to-all and all-gather bytes (the owner routes) of a report."""
  kinds = report.bytes_by_kind
  return kinds.get('all-to-all', 0.0), kinds.get('all-gather', 0.0)


class InitTest(parameterized.TestCase):
  """``init`` gives the same state eagerly and under jit."""

  @parameterized.named_parameters(*KINDS)
  def test_jit_init_equals_eager_init(self, kind):
    mesh = make_mesh((2, 4), kind=kind)
    params = mlp_params()
    shardings = fsdp(params, mesh)
    placed = jax.device_put(params, shardings)
    # On Auto meshes tracers carry no sharding: give the specs (Explicit
    # meshes read them from the types).
    specs = shardings if kind == AxisType.Auto else None
    opt = dmuon_jax.dmuon(0.02, mesh=mesh, param_specs=specs)
    eager = opt.init(placed)
    jitted = jax.jit(opt.init)(placed)
    assert_same_state(self, jitted, eager)
    (layout,) = dmuon_jax.owner_layouts(jitted)
    self.assertEqual(layout.param_entries[0], (('shard',), ()))
    (st,) = muon_states(jitted)
    for buf in st.mu:
      self.assertEqual(buf.sharding.spec, P(AXES))
    grads = support.grads_at(0, placed)
    step = jax.jit(opt.update)
    with warnings.catch_warnings():
      warnings.simplefilter('error', dmuon_jax.DMuonWarning)
      u_jit, _ = step(grads, jitted, placed)
    u_eager, _ = step(grads, eager, placed)
    chex.assert_trees_all_equal(u_jit, u_eager)

  def test_unknown_shardings_are_recorded_and_warned(self):
    # jit-init on an Auto mesh, no param_specs: the state says the
    # shardings are unknown and the first update warns, naming the fix.
    mesh = make_mesh((1, 8), kind=AxisType.Auto)
    params = mlp_params(layers=1)
    params = jax.device_put(params, fsdp(params, mesh))
    opt = dmuon_jax.dmuon(0.02, mesh=mesh)
    state = jax.jit(opt.init)(params)
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertEqual(layout.param_entries, (None,))
    self.assertIn('param shardings unknown', layout.summary())
    with self.assertWarnsRegex(
      dmuon_jax.DMuonWarning, r'layers_0/w.*param_specs='
    ):
      report = dmuon_jax.analyze_hlo(opt.update, params, state, params)
    # It then gathers the sharded gradients (what the warning says).
    self.assertGreater(owner_bytes(report)[1], 0)

  @parameterized.named_parameters(*KINDS)
  def test_eval_shape_init_compiles_to_the_all_to_all_path(self, kind):
    # How large models are set up: the state from jax.eval_shape on
    # abstract, sharded params; the update compiled from it (no arrays).
    mesh = make_mesh((2, 4), kind=kind)
    params = mlp_params()
    shardings = fsdp(params, mesh)
    abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      params,
      shardings,
    )
    specs = shardings if kind == AxisType.Auto else None
    opt = dmuon_jax.dmuon(0.02, mesh=mesh, param_specs=specs)
    state_abs = jax.eval_shape(opt.init, abstract)
    eager = opt.init(jax.device_put(params, shardings))
    chex.assert_trees_all_equal_structs(state_abs, eager)
    chex.assert_trees_all_equal_shapes_and_dtypes(state_abs, eager)
    (st_abs,), (st,) = muon_states(state_abs), muon_states(eager)
    if kind == AxisType.Explicit:  # eval_shape keeps Explicit shardings
      for a, b in zip(st_abs.mu, st.mu):
        self.assertEqual(a.sharding.spec, b.sharding.spec)
    (layout,) = dmuon_jax.owner_layouts(state_abs)
    # Placed as eager init places them (optax's scalar counts: anywhere).
    state_like = jax.tree.map(
      lambda a, b: jax.ShapeDtypeStruct(
        a.shape,
        a.dtype,
        sharding=b.sharding if isinstance(b.sharding, NamedSharding) else None,
      ),
      state_abs,
      eager,
    )
    report = dmuon_jax.analyze_hlo(opt.update, abstract, state_like, abstract)
    a2a, gather = owner_bytes(report)
    want = layout.collective_bytes()
    self.assertGreater(want['all-to-all'], 0)
    self.assertBetween(a2a / want['all-to-all'], 0.95, 1.05)
    # FSDP over 'shard' of 2 x 4: the results' way back ends with an
    # all-gather over 'replicate' (the row's blocks, not whole params).
    self.assertGreater(want['all-gather'], 0)
    self.assertBetween(gather / want['all-gather'], 0.95, 1.05)


class NnxOptimizerTest(parameterized.TestCase):
  """``nnx.Optimizer`` on FSDP-sharded kernels: the all-to-all path."""

  @parameterized.named_parameters(*KINDS)
  def test_eager_and_jit_created_optimizers_route_like_plain_init(self, kind):
    mesh = make_mesh((1, 8), kind=kind)

    class Model(nnx.Module):
      def __init__(self, rngs):
        init = nnx.with_partitioning(
          nnx.initializers.lecun_normal(), ('shard', None)
        )
        self.layers = nnx.List(
          [
            nnx.Linear(
              128,
              256 if i % 2 == 0 else 128,
              kernel_init=init,
              use_bias=False,
              rngs=rngs,
            )
            for i in range(4)
          ]
        )

    with jax.set_mesh(mesh):
      model = Model(nnx.Rngs(0))
      tx = dmuon_jax.dmuon(0.02, mesh=mesh)
      eager = nnx.Optimizer(model, tx, wrt=nnx.Param)
      jitted = nnx.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)
      grads = nnx.state(model, nnx.Param)
      update = nnx.jit(lambda opt, m, g: opt.update(m, g))
      got = []
      for opt in (eager, jitted):
        compiled = update.lower(opt, model, grads).compile()
        got.append(owner_bytes(dmuon_jax.analyze_compiled(compiled)))
      # The plain tree: init on placed arrays, then jax.jit(update).
      params = nnx.to_pure_dict(grads)
      state = tx.init(params)
      plain = owner_bytes(
        dmuon_jax.analyze_hlo(tx.update, params, state, params)
      )
    (layout,) = dmuon_jax.owner_layouts(nnx.as_pure(jitted.opt_state))
    want = layout.collective_bytes()['all-to-all']
    # One all-to-all each way over 8 devices, rows of the largest matrix's
    # piece (128 x 256 / 8 float32).
    self.assertEqual(want, 2 * 7 * (128 * 256 // 8) * 4)
    self.assertEqual(got[0], got[1])
    self.assertEqual(got[0], plain)
    self.assertEqual(plain, (want, 0.0))


class CheckpointLayoutTest(absltest.TestCase):
  """orbax on ``nnx.state(optimizer)``: another layout fails loudly."""

  def test_orbax_round_trip_of_nnx_state(self):
    mesh_a = make_mesh((1, 8))
    mesh_b = make_mesh((8, 1))  # same buffer sizes, other owners

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.layers = nnx.List(
          [nnx.Linear(32, 48, rngs=rngs) for _ in range(3)]
        )

      def __call__(self, x):
        for layer in self.layers:
          x = jnp.tanh(layer(x))[..., :32]
        return x

    def trained(mesh, steps):
      model = Model(nnx.Rngs(0))
      nnx.update(
        model, jax.device_put(nnx.state(model), NamedSharding(mesh, P()))
      )
      opt = nnx.Optimizer(
        model, dmuon_jax.dmuon(0.02, mesh=mesh), wrt=nnx.Param
      )
      x = jnp.linspace(-1, 1, 8 * 32).reshape(8, 32)

      @nnx.jit  # one compile (eager updates: tests/contract_test.py)
      def train_step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)

      with jax.set_mesh(mesh):
        for _ in range(steps):
          train_step(model, opt)
      return model, opt

    model, opt_a = trained(mesh_a, 3)
    saved = nnx.state(opt_a)
    with tempfile.TemporaryDirectory() as d:
      with ocp.CheckpointManager(d) as manager:
        manager.save(3, args=ocp.args.StandardSave(saved))
        manager.wait_until_finished()
      name_a = dmuon_jax.owner_layouts(nnx.as_pure(opt_a.opt_state))[0].name
      _, opt_b = trained(mesh_b, 0)
      name_b = dmuon_jax.owner_layouts(nnx.as_pure(opt_b.opt_state))[0].name
      self.assertNotEqual(name_a, name_b)
      # Another layout of the same buffer sizes: orbax refuses, naming the
      # buffers of both layouts.
      with ocp.CheckpointManager(d) as manager:
        with self.assertRaisesRegex(
          ValueError, f'(?s){name_a}.*{name_b}|{name_b}.*{name_a}'
        ):
          manager.restore(3, args=ocp.args.StandardRestore(nnx.state(opt_b)))
      # The same layout: exact.
      _, opt_c = trained(mesh_a, 0)
      with ocp.CheckpointManager(d) as manager:
        restored = manager.restore(
          3, args=ocp.args.StandardRestore(nnx.state(opt_c))
        )
      nnx.update(opt_c, restored)
      chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(opt_c)), nnx.to_pure_dict(saved)
      )

  def test_nnx_helpers_convert_between_layouts(self):
    mesh_a, mesh_b = make_mesh((1, 8)), make_mesh((2, 4))

    def make(mesh):
      m = nnx.List([nnx.Linear(32, 48, rngs=nnx.Rngs(1))])
      nnx.update(m, jax.device_put(nnx.state(m), NamedSharding(mesh, P())))
      with jax.set_mesh(mesh):  # the optimizer's step counter on it too
        return m, nnx.Optimizer(
          m,
          dmuon_jax.dmuon(0.02, mesh=mesh, predicate=lambda p, x: x.ndim == 2),
          wrt=nnx.Param,
        )

    model_a, opt_a = make(mesh_a)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model_a, nnx.Param))
    # Jitted (eager updates: tests/contract_test.py): one compile per mesh.
    update = nnx.jit(chex.assert_max_traces(lambda o, m, g: o.update(m, g), 2))
    for _ in range(2):
      update(opt_a, model_a, grads)
    with tempfile.TemporaryDirectory() as d:
      dmuon_jax.checkpoint.save_nnx(d, 2, model_a, opt_a)
      model_b, opt_b = make(mesh_b)
      self.assertEqual(dmuon_jax.checkpoint.restore_nnx(d, model_b, opt_b), 2)
    self.assertEqual(int(opt_b.step[...]), 2)
    pure = lambda m: nnx.to_pure_dict(nnx.state(m))
    chex.assert_trees_all_equal(pure(model_a), pure(model_b))
    chex.assert_trees_all_equal(
      *(
        dmuon_jax.checkpoint.state_to_portable(nnx.as_pure(o.opt_state))
        for o in (opt_a, opt_b)
      )
    )
    # And they keep training alike.
    update(opt_a, model_a, grads)
    update(opt_b, model_b, jax.device_put(grads, NamedSharding(mesh_b, P())))
    chex.assert_trees_all_close(
      pure(model_a), pure(model_b), rtol=1e-6, atol=1e-7
    )

  def test_checkpoint_is_a_real_submodule(self):
    module = importlib.import_module('dmuon_jax.checkpoint')
    self.assertIs(module, dmuon_jax.checkpoint)
    self.assertTrue(callable(module.save))


INJECT_STEPS = 6


@functools.cache
def inject_references():
  """optax's runs of InjectHyperparamsTest (the same for both mesh kinds):
  the scheduled run's and a fixed-hyperparameter run's final params."""
  params = support.make_params()
  dims = support.dim_numbers(params)
  lr, beta = inject_schedules()
  ref = support.run(
    optax.inject_hyperparams(optax.contrib.muon)(
      learning_rate=lr,
      beta=beta,
      weight_decay=0.01,
      muon_weight_dimension_numbers=dims,
    ),
    params,
    steps=INJECT_STEPS,
  )
  fixed = support.run(
    optax.contrib.muon(
      0.02, muon_weight_dimension_numbers=dims, weight_decay=0.01
    ),
    params,
    steps=INJECT_STEPS,
  )
  return ref[-1], fixed[-1]


def inject_schedules():
  lr = optax.linear_schedule(0.02, 0.005, 4)
  beta = lambda count: 0.95 - 0.05 * jnp.minimum(count, 4) / 4
  return lr, beta


class InjectHyperparamsTest(parameterized.TestCase):
  """Injected numbers enter shard_map as arguments (both mesh kinds)."""

  @parameterized.named_parameters(*KINDS)
  def test_injected_and_scheduled_match_optax(self, kind):
    mesh = make_mesh((2, 4), kind=kind)
    params = support.make_params()
    dims = support.dim_numbers(params)
    lr, beta = inject_schedules()
    # No static_args: the mesh comes from jax.set_mesh.
    with jax.set_mesh(mesh):
      ours = optax.inject_hyperparams(dmuon_jax.dmuon)(
        learning_rate=lr,
        beta=beta,
        weight_decay=0.01,
        muon_weight_dimension_numbers=dims,
      )
      placed = jax.device_put(params, NamedSharding(mesh, P()))
      got = support.run(ours, placed, steps=INJECT_STEPS)
    ref, fixed = inject_references()
    support.assert_trees_rel_close(self, got[-1], ref, rtol=1e-5)
    # The schedules did change the steps.
    self.assertGreater(
      np.abs(fixed['odd']['kernel'] - ref['odd']['kernel']).max(), 1e-4
    )

  def test_mesh_argument_needs_static_args(self):
    mesh = make_mesh((2, 4))
    params = mlp_params(layers=1)
    with self.assertRaisesRegex(TypeError, r"static_args=\('mesh',\)"):
      optax.inject_hyperparams(dmuon_jax.dmuon)(
        learning_rate=0.02, mesh=mesh
      ).init(params)
    # With static_args it works on an Explicit mesh (the injected beta is an
    # argument of the update's shard_map), and equals the mesh of set_mesh.
    opt = optax.inject_hyperparams(dmuon_jax.dmuon, static_args=('mesh',))(
      learning_rate=0.02, beta=0.9, mesh=mesh
    )
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    u, _ = jax.jit(opt.update)(placed, opt.init(placed), placed)
    with jax.set_mesh(mesh):
      ctx = optax.inject_hyperparams(dmuon_jax.dmuon)(
        learning_rate=0.02, beta=0.9
      )
      v, _ = jax.jit(ctx.update)(placed, ctx.init(placed), placed)
    chex.assert_trees_all_equal(u, v)


SPEC_CASES = (
  # (name, mesh shape, axis names, spec of the kernels)
  ('size1_axis_8x1', (8, 1), ('fsdp', 'tensor'), P('fsdp', 'tensor')),
  ('both_dims_2x4', (2, 4), AXES, P('shard', 'replicate')),
  ('two_axes_one_dim_2x4', (2, 4), AXES, P(('replicate', 'shard'))),
  ('columns_1x8', (1, 8), AXES, P(None, 'shard')),
  ('hsdp_rows_2x4', (2, 4), AXES, P('shard')),
)


COVERAGE_STEPS = 3


@functools.cache
def coverage_reference():
  """Single-device optax.contrib.muon on ShardingCoverageTest's params."""
  return support.run(
    optax.contrib.muon(0.02), mlp_params(layers=3), steps=COVERAGE_STEPS
  )[-1]


class ShardingCoverageTest(parameterized.TestCase):
  """Shardings reach their owners by all-to-all, not whole gathers."""

  @parameterized.named_parameters(*SPEC_CASES)
  def test_all_to_all_as_predicted(self, shape, names, spec):
    mesh = make_mesh(shape, names)
    params = mlp_params(layers=3)
    shardings = fsdp(params, mesh, spec)
    placed = jax.device_put(params, shardings)
    opt = dmuon_jax.dmuon(0.02, mesh=mesh)
    state = opt.init(placed)
    (layout,) = dmuon_jax.owner_layouts(state)

    def step(params, state, grads):
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    # One program, analyzed and run: the update and apply_updates
    # (elementwise, no collective), gradients placed like the params.
    compiled = jax.jit(step).lower(placed, state, placed).compile()
    a2a, gather = owner_bytes(dmuon_jax.analyze_compiled(compiled))
    want = layout.collective_bytes()
    self.assertBetween(a2a / want['all-to-all'], 0.95, 1.05)
    # Sharded over a subset of the owner axes (HSDP rows), the results'
    # way back ends with an all-gather of the row's blocks over the others.
    partial = spec == P('shard')
    self.assertEqual(want['all-gather'] > 0, partial)
    if partial:
      self.assertBetween(gather / want['all-gather'], 0.95, 1.05)
    else:
      self.assertEqual(gather, 0.0)
    self.assertIn('all-to-all', layout.summary())
    # The numbers are optax's (and the compiled step takes back its own
    # outputs: the state keeps its layout).
    got = placed
    for i in range(COVERAGE_STEPS):
      grads = jax.device_put(support.grads_at(i, got), shardings)
      got, state = compiled(got, state, grads)
    support.assert_trees_rel_close(
      self, jax.device_get(got), coverage_reference(), rtol=1e-5
    )


class SharedBodiesTest(absltest.TestCase):
  """Every owner runs one program in every per-slot stage of the drop-in
  update (packing, the owner update, results back): which matrices it
  takes, and how many, it reads from tables by its slot; no conditional."""

  def compiled_update(self, shape, layers):
    """The compiled update's HLO text; its one step checked against
    optax's (each owner ran its own work)."""
    mesh = make_mesh(shape)
    params = mlp_params(layers=layers)
    placed = jax.device_put(params, fsdp(params, mesh))
    opt = dmuon_jax.dmuon(0.02, mesh=mesh)
    state = opt.init(placed)
    update = jax.jit(opt.update)
    text = update.lower(placed, state, placed).compile().as_text()
    updates, _ = update(placed, state, placed)
    want, _ = optax.contrib.muon(0.02).update(
      params, optax.contrib.muon(0.02).init(params), params
    )
    support.assert_trees_rel_close(
      self, jax.device_get(updates), jax.device_get(want), rtol=1e-5
    )
    return text

  def test_unequal_owners_run_one_program(self):
    # 12 equal kernels on 8 owners: 4 owners hold two, 4 hold one (two
    # signatures: a 2-branch conditional per stage before the owners read
    # their counts from tables, 8 branches before the stages took keys).
    text = self.compiled_update((1, 8), layers=12)
    self.assertEqual(support.conditional_branches(text), [])
    self.assertIn(' while(', text)  # the owner's loop over its matrices

  def test_a_batch_then_the_rest_one_at_a_time(self):
    # 19 equal kernels on 8 owners: 3 hold three, 5 hold two. Each runs
    # one batch of two, then the owners of three one more alone: the
    # busiest device's matmuls are three kernels' Newton-Schulz, no more
    # (padding the batch to three would cost four on the owners of two).
    mesh = make_mesh((1, 8))
    params = mlp_params(layers=19)
    opt = dmuon_jax.dmuon(0.02, mesh=mesh)
    state = opt.init(params)
    (layout,) = dmuon_jax.owner_layouts(state)
    plan = layout.groups[0].plan
    self.assertEqual(sorted(np.bincount(plan.owners)), [2] * 5 + [3] * 3)
    work = _owner_update.slot_work(layout, layout.groups[0], None)
    self.assertEqual([len(b.units) for b in work.buckets[0]], [2, 1])
    self.assertEqual(work.trips, [1, None])  # one batch each; 1 or 0 more
    compiled = jax.jit(opt.update).lower(params, state, params).compile()
    self.assertEqual(support.conditional_branches(compiled.as_text()), [])
    np.testing.assert_allclose(
      support.hlo_tools.dot_flops(compiled), plan.makespan, rtol=1e-6
    )
    self.assertAlmostEqual(plan.makespan, 3 * plan.units[0].cost, delta=1)
    updates, _ = jax.jit(opt.update)(params, state, params)
    want, _ = optax.contrib.muon(0.02).update(
      params, optax.contrib.muon(0.02).init(params), params
    )
    support.assert_trees_rel_close(
      self, jax.device_get(updates), jax.device_get(want), rtol=1e-5
    )

  def test_hsdp_rows_are_indexed_not_switched(self):
    # 8 equal kernels sharded over 'shard' on 2 x 4: each of the 8 owners
    # holds one, and the forward all-to-all's rows (which differ by the
    # 'replicate' coordinate) are taken by a dynamic index, so the update
    # has no conditional at all (before: a 2-branch switch per coordinate).
    text = self.compiled_update((2, 4), layers=8)
    self.assertEqual(text.count(' conditional('), 0)

  def test_buffers_past_int32_offsets_warn(self):
    # A device owning 2**31 elements of one dtype cannot read its offsets
    # from int32 tables: the update keeps per-device branches, and says
    # so once, at the factory; one element fewer per matrix keeps one
    # program and no warning. Shapes only (eval_shape).
    mesh = support.make_mesh((1, 8))
    for cols, warns in ((32768, True), (32767, False)):
      params = {
        f'layers_{i}': {'w': jax.ShapeDtypeStruct((65536, cols), jnp.float32)}
        for i in range(8)
      }
      with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter('always')
        jax.eval_shape(dmuon_jax.dmuon(0.01, mesh=mesh).init, params)
      said = [str(w.message) for w in got if 'int32 offsets' in str(w.message)]
      self.assertLen(said, int(warns), said)
      if warns:
        self.assertIn('2,147,483,648 elements', said[0])
        self.assertIn('more owner devices', said[0])


if __name__ == '__main__':
  absltest.main()
