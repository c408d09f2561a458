"""Dedicated ownership (owner-stored params, Z2/Z3) on 8 simulated devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import _planner
from tests import alias_test
from tests import distributed_test

AXES = distributed_test.AXES
BLOCKS, WIDTH, MATS = 4, 16, 8
LR = 0.002


def init_params():
  k = iter(jax.random.split(jax.random.key(0), 64))
  n = lambda *shape: 0.3 * jax.random.normal(next(k), shape, jnp.float32)
  params = {f'layers_{i}': {f'w{j}': n(WIDTH, WIDTH) for j in range(MATS)}
            | {'scale': 1 + n(WIDTH)} for i in range(BLOCKS)}
  params['head'] = n(WIDTH, 8)
  return params


def block_fn(layer, x):
  for j in range(MATS):
    x = x + jnp.tanh(x @ layer[f'w{j}']) * layer['scale']
  return x


def loss_fn(params, x):
  for i in range(BLOCKS):
    x = block_fn(params[f'layers_{i}'], x)
  return jnp.mean((x @ params['head']) ** 2)


def batch():
  # Many more examples than width: well-conditioned gradient matrices, so
  # Newton–Schulz (slope ~500 at small singular values) does not amplify
  # summation-order rounding.
  return jax.random.normal(jax.random.key(1), (512, WIDTH))


def assert_only_the_finite_flag(test, report):
  """The update's one collective: the all-devices "all finite?" flag of the
  default nonfinite='skip' policy (a scalar); no Muon data moves."""
  test.assertLessEqual(set(report.count_by_kind), {'all-reduce'})
  test.assertLessEqual(report.count_by_kind.get('all-reduce', 0), 1)
  for c in report.collectives:
    test.assertLessEqual(int(np.prod(c.shape)), 1, c)


def optax_muon(learning_rate, params, predicate=None):
  """optax.contrib.muon on the Muon targets dmuon picks (+ its AdamW)."""
  specs = _planner.muon_target_specs(params, predicate=predicate)
  dims = [None if s is None else optax.contrib.MuonDimensionNumbers(
      reduction_axis=s.reduction_axes, output_axis=s.output_axes)
          for s in specs]
  return optax.contrib.muon(
      learning_rate, muon_weight_dimension_numbers=jax.tree.unflatten(
          jax.tree.structure(params), dims))


def train_single_device(opt, params, loss_fn, steps):
  """The reference: ``steps`` of ``opt`` on ``loss_fn(params)``, one device.

  Returns:
    The final params (on the host) and the loss of every step.
  """
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return jax.device_get(params), losses


def reference(steps):
  params = init_params()
  return train_single_device(optax_muon(LR, params), params,
                             lambda p: loss_fn(p, batch()), steps)


def dedicated_step(ded, opt, state):
  def dedicated_loss(dp, x):
    for i in range(BLOCKS):
      x = ded.block(block_fn, f'layers_{i}')(dp, x)
    rest = dp.rest
    return jnp.mean((x @ rest['head']) ** 2)

  return distributed_test.explicit_step_fn(opt, ded.mesh, state,
                                           dedicated_loss, ded.specs())


def setup(shape, z3):
  mesh = distributed_test.make_mesh(shape)
  params = init_params()
  ded = dmuon_jax.dedicate(params, mesh, reshard_after_forward=z3)
  dp = ded.to_dedicated(jax.device_put(params, NamedSharding(mesh, P())))
  opt = dmuon_jax.dedicated_muon(ded, LR)
  state = opt.init(dp)
  x = jax.device_put(batch(), NamedSharding(mesh, P(AXES)))
  return ded, dp, opt, state, x


class DedicatedTest(parameterized.TestCase):

  def test_round_trip(self):
    mesh = distributed_test.make_mesh((1, 8))
    params = init_params()
    ded = dmuon_jax.dedicate(params, mesh)
    dp = ded.to_dedicated(params)
    self.assertEqual(ded.boundaries.names,
                     tuple(f'layers_{i}' for i in range(BLOCKS)))
    self.assertLen(dp.owned.buffers, BLOCKS)  # one per block (one dtype)
    for buf in dp.owned:
      self.assertEqual(buf.sharding.spec, P(('shard', 'replicate')))
      # 8 equal matrices per block on 8 owners: no padding.
      self.assertEqual(buf.size, MATS * WIDTH * WIDTH)
    self.assertIsNone(dp.rest['layers_0'].get('w0'))
    back = ded.to_params(dp)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, b)

  @parameterized.named_parameters(('z2_1x8', (1, 8), False),
                                  ('z3_1x8', (1, 8), True),
                                  ('z3_2x4', (2, 4), True))
  def test_matches_optax_muon(self, shape, z3):
    steps = 20
    ded, dp, opt, state, x = setup(shape, z3)
    step = dedicated_step(ded, opt, state)
    losses = []
    for _ in range(steps):
      dp, state, loss = step(dp, state, x)
      losses.append(float(loss))
    ref_params, ref_losses = reference(steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    alias_test.assert_trees_rel_close(self, ded.to_params(dp), ref_params,
                                      rtol=1e-5)

  @parameterized.parameters(False, True)
  def test_one_device_is_plain_muon(self, z3):
    # No mesh: no collectives, still the same algorithm.
    params = init_params()
    ded = dmuon_jax.dedicate(params, None, reshard_after_forward=z3)
    dp = ded.to_dedicated(params)
    opt = dmuon_jax.dedicated_muon(ded, LR)
    state = opt.init(dp)

    def loss(dp, x):
      for i in range(BLOCKS):
        x = ded.block(block_fn, f'layers_{i}')(dp, x)
      return jnp.mean((x @ dp.rest['head']) ** 2)

    @jax.jit
    def step(dp, state):
      value, grads = jax.value_and_grad(loss)(dp, batch())
      updates, state = opt.update(grads, state, dp)
      return optax.apply_updates(dp, updates), state, value

    losses = []
    for _ in range(5):
      dp, state, value = step(dp, state)
      losses.append(float(value))
    ref_params, ref_losses = reference(5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    alias_test.assert_trees_rel_close(self, ded.to_params(dp), ref_params,
                                      rtol=1e-6)

  @parameterized.named_parameters(('z2', False, 2), ('z3', True, 3))
  def test_collective_bytes(self, z3, factor):
    ded, dp, opt, state, x = setup((1, 8), z3)
    report = dmuon_jax.analyze_hlo(dedicated_step(ded, opt, state), dp,
                                   state, x)
    p_muon = BLOCKS * MATS * WIDTH * WIDTH * 4
    by_kind = report.bytes_by_kind
    muon = by_kind.get('all-gather', 0) + by_kind.get('reduce-scatter', 0)
    self.assertLessEqual(muon, 1.10 * factor * 7 / 8 * p_muon)
    self.assertGreaterEqual(muon, 0.98 * factor * 7 / 8 * p_muon)
    # All-reduces: the AdamW leaves (scales, head) and the loss only.
    p_other = (BLOCKS * WIDTH + WIDTH * 8) * 4
    self.assertLessEqual(by_kind.get('all-reduce', 0),
                         2 * 7 / 8 * (p_other + 64))


  def test_update_has_no_collective_for_owned_params(self):
    ded, dp, opt, state, _ = setup((1, 8), True)
    specs = ded.specs()
    state_specs = jax.tree.map(lambda x: getattr(x.sharding, 'spec', P()),
                               state)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=ded.mesh,
                       in_specs=(specs, state_specs, specs),
                       out_specs=(specs, state_specs))
    def update(grads, state, dp):
      # Owned gradients are already on their owners; rest is reduced too.
      return opt.update(grads, state, dp)

    report = dmuon_jax.analyze_hlo(update, dp, state, dp)
    assert_only_the_finite_flag(self, report)
    self.assertGreater(report.flops, 0)


def is_w(path, leaf):
  del leaf
  return path.endswith('/w')


class DedicatedPlanTest(absltest.TestCase):

  def test_gathers_pack_by_bytes_and_work_is_balanced(self):
    # Llama-like blocks: q, k, v, o (d x d) and gate, up, down (d x 4d).
    d = 256
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    params = {f'layers_{i}': {**{n: shape(d, d) for n in 'qkvo'},
                              'gate': shape(d, 4 * d), 'up': shape(d, 4 * d),
                              'down': shape(4 * d, d)} for i in range(4)}
    mesh = {'replicate': 1, 'shard': 8}
    one = dmuon_jax.dedicate(params, mesh, ns_algorithm='standard')
    two = dmuon_jax.dedicate(params, mesh, layers_per_gather=2,
                              ns_algorithm='standard')
    payload = 4 * 16 * d * d * 4
    # One block (16 d^2 in 7 matrices) on 8 owners: the largest share is a
    # 4 d^2 matrix, so the gather moves 2x; two blocks pack exactly.
    self.assertEqual(one.gather_bytes(), (payload, 2 * payload))
    self.assertEqual(two.gather_bytes(), (payload, payload))
    self.assertIn('(padding 0.0%)', two.summary())
    # Byte-balanced owners alone would give two slots eight d x d matrices
    # (4.03 GFLOP) and the others two d x 4d ones (3.02): imbalance 1.23.
    # Swapping owners inside a gather group (bytes unchanged) evens it out:
    # the busiest slot then holds one d x 4d and four d x d matrices per
    # two blocks (3.52 GFLOP against a mean of 3.27).
    for ded in (one, two):
      costs = ded.plan.slot_costs()
      self.assertLessEqual(max(costs) / np.mean(costs), 1.08)
    # With the default Gram form for the d x 4d matrices (60 d^3 against
    # 30 d^3 for a direct d x d), per two blocks a slot holds either one
    # d x 4d (60) or four d x d (120) matrices against a mean of 75: the best
    # the swaps can do over four blocks is 180 against 150, i.e. 1.2.
    auto = dmuon_jax.dedicate(params, mesh, layers_per_gather=2)
    self.assertEqual(auto.gather_bytes(), (payload, payload))
    costs = auto.plan.slot_costs()
    self.assertAlmostEqual(max(costs) / np.mean(costs), 1.2)


class DedicatedErrorsTest(parameterized.TestCase):

  def test_strict_mode_names_targets_without_boundary(self):
    params = init_params() | {'proj': jnp.ones((WIDTH, WIDTH))}
    with self.assertRaisesRegex(ValueError, r"no hook boundary: \['proj'\]"):
      dmuon_jax.dedicate(params, None)
    ded = dmuon_jax.dedicate(params, None, strict=False)
    self.assertIn('proj', ded.boundaries.names)

  def test_unknown_or_wrong_kind_of_boundary(self):
    ded = dmuon_jax.dedicate(init_params(), None)
    with self.assertRaisesRegex(ValueError, "no hook boundary 'layers_9'"):
      ded.block(block_fn, 'layers_9')
    with self.assertRaisesRegex(ValueError, 'not scanned; use .*block'):
      ded.scan(block_fn, 'layers_0')

  def test_block_inside_a_gather_group(self):
    ded = dmuon_jax.dedicate(init_params(), None, layers_per_gather=2)
    self.assertEqual(len(ded.groups), 2)
    with self.assertRaisesRegex(ValueError, 'gathered together with'):
      ded.block(block_fn, 'layers_0')
    with self.assertRaisesRegex(ValueError, 'split the gather group'):
      ded.sequential(block_fn, ['layers_1', 'layers_2'])

  def test_layers_per_gather_must_divide_the_stack(self):
    stacked = {'layers': {'w': jnp.ones((3, WIDTH, WIDTH))}}
    with self.assertRaisesRegex(ValueError, 'does not divide the 3 layers'):
      dmuon_jax.dedicate(stacked, None, predicate=is_w,
                          layers_per_gather=2)
    with self.assertRaisesRegex(ValueError, 'positive int'):
      dmuon_jax.dedicate(stacked, None, predicate=is_w,
                          layers_per_gather=0)

  def test_stack_param_sharded_along_the_layer_axis(self):
    mesh = distributed_test.make_mesh((1, 8))
    stacked = {'layers': {'w': jnp.ones((8, WIDTH, WIDTH)),
                          'scale': jax.device_put(
                              jnp.ones((8, WIDTH)),
                              NamedSharding(mesh, P('shard')))}}
    with self.assertRaisesRegex(ValueError,
                                "'layers/scale' of a scanned stack is sharded"
                                ' along its layer axis'):
      dmuon_jax.dedicate(stacked, mesh, predicate=is_w)

  def test_remat_policy_that_saves_the_weights(self):
    mesh = distributed_test.make_mesh((1, 8))
    ded = dmuon_jax.dedicate(
        init_params(), mesh,
        remat_policy=jax.checkpoint_policies.everything_saveable)
    dp = ded.to_dedicated(init_params())
    loss = lambda dp, x: jnp.sum(ded.block(block_fn, 'layers_0')(dp, x))
    step = jax.shard_map(
        lambda dp, x: dmuon_jax.local_value_and_grad(loss)(dp, x)[0],
        mesh=mesh, in_specs=(ded.specs(), P(AXES)), out_specs=P(AXES))
    x = jax.device_put(jnp.ones((8, WIDTH)), NamedSharding(mesh, P(AXES)))
    with self.assertRaisesRegex(ValueError, 'saves its gathered weights'):
      jax.jit(step).lower(dp, x)



def _decay_all_but_one(params):
  mask = jax.tree.map(lambda x: True, params)
  mask['layers_1']['w3'] = False
  return mask


# (name, dmuon/dedicated_muon arguments, param dtype)
OWNER_CASES = (
    ('sgd', dict(momentum='sgd'), jnp.float32),
    ('sgd_plain', dict(momentum='sgd', nesterov=False), jnp.float32),
    ('adaptive', dict(adaptive=True), jnp.float32),
    ('spectral', dict(preconditioning='spectral'), jnp.float32),
    ('aol', dict(preconditioning='aol'), jnp.float32),
    ('schatten', dict(preconditioning='schatten'), jnp.float32),
    ('compute_bf16', dict(compute_dtype=jnp.bfloat16), jnp.float32),
    ('wd_mask', dict(weight_decay=0.1,
                     weight_decay_mask=_decay_all_but_one), jnp.float32),
    ('consistent_rms', dict(consistent_rms=0.2, adam_eps_root=1e-8),
     jnp.float32),
    ('bf16_params_f32_mu', dict(mu_dtype=jnp.float32), jnp.bfloat16),
)


class OneOwnerUpdateTest(parameterized.TestCase):
  """Dedicated mode runs the drop-in path's owner update: same numbers.

  Both optimizers get the same gradients (in param layout for ``dmuon``, in
  owner layout for ``dedicated_muon``) on a 2x4 mesh, 10 steps, under plain
  ``jax.jit``.
  """

  @parameterized.named_parameters(*OWNER_CASES)
  def test_dedicated_equals_drop_in(self, kwargs, dtype):
    mesh = distributed_test.make_mesh((2, 4))
    params = jax.tree.map(lambda x: x.astype(dtype), init_params())
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    if callable(kwargs.get('weight_decay_mask')):
      kwargs = dict(kwargs, weight_decay_mask=kwargs['weight_decay_mask'](
          params))
    opt = dmuon_jax.dmuon(LR, mesh=mesh, **kwargs)
    ded = dmuon_jax.dedicate(placed, mesh)
    dopt = dmuon_jax.dedicated_muon(ded, LR, **kwargs)
    p, state = placed, opt.init(placed)
    dp = ded.to_dedicated(placed)
    dstate = dopt.init(dp)
    step = jax.jit(opt.update)
    dstep = jax.jit(dopt.update)
    for i in range(10):
      grads = jax.device_put(alias_test.grads_at(i, params),
                             NamedSharding(mesh, P()))
      u, state = step(grads, state, p)
      p = optax.apply_updates(p, u)
      du, dstate = dstep(ded.to_dedicated(grads), dstate, dp)
      dp = optax.apply_updates(dp, du)
    got = ded.to_params(dp)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
      self.assertEqual(a.dtype, b.dtype)
    alias_test.assert_trees_rel_close(self, got, p, rtol=1e-6)
    # The options changed the run (the comparison is not vacuous).
    self.assertGreater(
        float(np.abs(np.asarray(got['layers_0']['w0'], np.float32)
                     - np.asarray(params['layers_0']['w0'], np.float32)
                     ).max()), 1e-4)

  def test_old_keyword_is_deprecated(self):
    params = init_params()
    dims = jax.tree.map(lambda x: optax.contrib.MuonDimensionNumbers()
                        if x.ndim == 2 else None, params)
    dims['head'] = None
    with self.assertWarnsRegex(DeprecationWarning,
                               'muon_weight_dimension_numbers'):
      old = dmuon_jax.dedicate(params, None, weight_dimension_numbers=dims)
    new = dmuon_jax.dedicate(params, None, muon_weight_dimension_numbers=dims)
    self.assertEqual(old.layout, new.layout)

if __name__ == '__main__':
  absltest.main()
