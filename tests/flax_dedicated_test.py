"""Dedicated ownership on a Flax transformer: parity, HSDP, Z2/Z3."""

import functools

import jax
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from tests import alias_test
from tests import dedicated_test
from tests import distributed_test
from examples import dedicated_linen as tf

AXES = distributed_test.AXES
LR = 0.005
STEPS = 20


@functools.cache
def reference(scan):
  """Single-device optax.contrib.muon (+ its AdamW) on the Linen model."""
  params = tf.init(scan)
  model = tf.Transformer(scan=scan)
  return dedicated_test.train_single_device(
      dedicated_test.optax_muon(LR, params, tf.predicate), params,
      lambda p: tf.cross_entropy(model.apply(p, tf.tokens()), tf.tokens()),
      STEPS)


def train_step(ded, opt, state, scan):
  return tf.make_train_step(ded, opt, state, scan)


def setup(shape, scan, z3, per_gather=1, fsdp_rest=False):
  """Non-Muon params replicated, or FSDP-sharded (``fsdp_rest``)."""
  mesh = distributed_test.make_mesh(shape)
  params = tf.init(scan)
  params = (tf.fsdp(params, mesh) if fsdp_rest
            else jax.device_put(params, NamedSharding(mesh, P())))
  ded = dmuon_jax.dedicate(params, mesh, predicate=tf.predicate,
                            reshard_after_forward=z3,
                            layers_per_gather=per_gather)
  dp = ded.to_dedicated(params)
  opt = dmuon_jax.dedicated_muon(ded, LR)
  state = opt.init(dp)
  tokens = jax.device_put(tf.tokens(), NamedSharding(mesh, P(AXES)))
  return ded, dp, opt, state, tokens


@functools.cache
def dedicated_run(shape, scan, z3, per_gather=1, fsdp_rest=False):
  ded, dp, opt, state, tokens = setup(shape, scan, z3, per_gather, fsdp_rest)
  step = train_step(ded, opt, state, scan)
  losses = []
  for _ in range(STEPS):
    dp, state, loss = step(dp, state, tokens)
    losses.append(float(loss))
  return jax.device_get(ded.to_params(dp)), losses


CONFIGS = [(f'{"scan" if scan else "loop"}_{"z3" if z3 else "z2"}_'
            f'{shape[0]}x{shape[1]}', shape, scan, z3)
           for scan in (False, True) for z3 in (False, True)
           for shape in ((1, 8), (2, 4), (8, 1))]
# Two layers per gather (sequential / two layers per scan iteration).
CONFIGS += [('loop_z3_1x8_k2', (1, 8), False, True, 2),
            ('scan_z3_2x4_k2', (2, 4), True, True, 2)]
# Embedding, norms and head FSDP-sharded instead of replicated.
CONFIGS += [('loop_z3_2x4_fsdp_rest', (2, 4), False, True, 1, True),
            ('scan_z2_1x8_fsdp_rest', (1, 8), True, False, 1, True)]


class FlaxDedicatedTest(parameterized.TestCase):

  def test_boundaries(self):
    loop = dmuon_jax.dedicate(tf.init(False), None, predicate=tf.predicate)
    self.assertEqual(loop.boundaries.names,
                     tuple(f'params/layers_{i}' for i in range(tf.DEPTH)))
    self.assertEqual(loop.num_iterations, (0,) * tf.DEPTH)
    scan = dmuon_jax.dedicate(tf.init(True), None, predicate=tf.predicate)
    self.assertEqual(scan.boundaries.names, ('params/layers',))
    self.assertEqual(scan.num_iterations, (tf.DEPTH,))

  @parameterized.named_parameters(*CONFIGS)
  def test_matches_optax_muon(self, shape, scan, z3, per_gather=1,
                              fsdp_rest=False):
    params, losses = dedicated_run(shape, scan, z3, per_gather, fsdp_rest)
    ref_params, ref_losses = reference(scan)
    self.assertLess(losses[-1], losses[0] - 0.5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    alias_test.assert_trees_rel_close(self, params, ref_params, rtol=1e-5)

  @parameterized.parameters(False, True)
  def test_params_inside_shard_map(self, scan):
    ded, dp, _, _, _ = setup((2, 4), scan, True, 1 if scan else 2, True)
    # The gathered values are equal on every device (typed device-varying,
    # as all-gathers in a loss are), so the replication check is off here.
    gathered = jax.jit(jax.shard_map(
        ded.params, mesh=ded.mesh, in_specs=(ded.specs(),), out_specs=P(),
        check_vma=False))(dp)
    for got, want in zip(jax.tree.leaves(gathered),
                         jax.tree.leaves(ded.to_params(dp)), strict=True):
      np.testing.assert_array_equal(got, want)

  @parameterized.parameters(False, True)
  def test_hsdp_equals_shard_only(self, scan):
    # (Same cache keys as test_matches_optax_muon: positional, in full.)
    hsdp, hsdp_losses = dedicated_run((2, 4), scan, True, 1, False)
    fsdp, fsdp_losses = dedicated_run((1, 8), scan, True, 1, False)
    np.testing.assert_allclose(hsdp_losses, fsdp_losses, rtol=1e-6)
    alias_test.assert_trees_rel_close(self, hsdp, fsdp, rtol=1e-6)


def muon_bytes(report):
  by_kind = report.bytes_by_kind
  return by_kind.get('all-gather', 0) + by_kind.get('reduce-scatter', 0)


def predicted_muon_bytes(ded, shape, factor):
  """DMuon's model: shard group factor (S-1)/S, replicate 2 (R-1)/R / S."""
  r, s = shape
  _, gathered = ded.gather_bytes()
  return factor * (s - 1) / s * gathered + 2 * (r - 1) / r * gathered / s


def per_device_bytes(tree):
  return sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(tree))


@functools.cache
def compiled(shape, scan, z3, per_gather, fsdp_rest=False):
  """The train step, its inputs and its compiled HLO report (shared)."""
  ded, dp, opt, state, tokens = setup(shape, scan, z3, per_gather, fsdp_rest)
  step = train_step(ded, opt, state, scan)
  return (ded, dp, state, tokens, step,
          dmuon_jax.analyze_hlo(step, dp, state, tokens))


class FlaxDedicatedCostTest(parameterized.TestCase):
  """Compiled HLO of the whole train step: collectives and memory."""

  @parameterized.named_parameters(
      ('loop_z2_1x8', (1, 8), False, False, 2),
      ('loop_z3_1x8', (1, 8), False, True, 2),
      ('scan_z3_1x8', (1, 8), True, True, 2),
      ('loop_z3_2x4', (2, 4), False, True, 2),
      ('loop_z3_1x8_one_block_per_gather', (1, 8), False, True, 1))
  def test_collective_bytes(self, shape, scan, z3, per_gather):
    ded, dp, _, _, _, report = compiled(shape, scan, z3, per_gather)
    payload, gathered = ded.gather_bytes()
    factor = 3 if z3 else 2
    predicted = predicted_muon_bytes(ded, shape, factor)
    self.assertBetween(muon_bytes(report), 0.98 * predicted,
                       1.02 * predicted)
    n = 8
    floor = factor * (n - 1) / n * payload
    if per_gather == 2:
      # Two blocks per gather pack 8 owners evenly: no padding.
      self.assertEqual(gathered, payload)
      self.assertLessEqual(muon_bytes(report), 1.10 * floor)
    else:
      # One block (4 of 32x32, 2 of 32x64) on 8 owners pads to 2x; the
      # summary says so.
      self.assertEqual(gathered, 2 * payload)
      self.assertIn('(padding 100.0%)', ded.summary())
    # No all-reduce of Muon gradients: only the AdamW leaves and the loss.
    rest = per_device_bytes(dp.rest)
    self.assertLessEqual(report.bytes_by_kind.get('all-reduce', 0),
                         2 * (n - 1) / n * rest + 64)

  def test_fsdp_rest_is_gathered_and_scattered_not_all_reduced(self):
    ded, dp, state, _, _, report = compiled((1, 8), False, True, 2,
                                                 True)
    n = 8
    rest = sum(x.nbytes for x in jax.tree.leaves(dp.rest))
    # Stored and updated as 1/N shards: params and both Adam moments (and
    # Adam's step count).
    self.assertEqual(per_device_bytes((dp.rest, state[1])), 3 * rest // n + 4)
    # Only the loss is all-reduced; rest moves by all-gather and
    # reduce-scatter (forward, backward, and Z3's re-gather of the blocks'
    # norm scales).
    self.assertLessEqual(report.bytes_by_kind.get('all-reduce', 0), 64)
    predicted = predicted_muon_bytes(ded, (1, 8), 3)
    self.assertBetween(muon_bytes(report) - predicted,
                       0.98 * 2 * (n - 1) / n * rest,
                       1.02 * 3 * (n - 1) / n * rest)

  def test_cuda_program_has_the_same_collectives(self):
    ded, dp, state, tokens, step, report = compiled((1, 8), False, True,
                                                         2)
    text = step.trace(dp, state, tokens).lower(
        lowering_platforms=('cuda',)).as_text()
    cuda = {}
    for c in dmuon_jax.diagnostics.stablehlo_collectives(text):
      cuda[c.kind] = cuda.get(c.kind, 0) + c.bytes
    self.assertEqual(set(cuda), set(report.bytes_by_kind))
    for kind, nbytes in report.bytes_by_kind.items():
      self.assertAlmostEqual(cuda[kind], nbytes, delta=1e-6 * nbytes)

  @parameterized.parameters(False, True)
  def test_memory(self, scan):
    z2 = compiled((1, 8), scan, False, 2)
    z3 = compiled((1, 8), scan, True, 2)
    ded, dp, state, tokens, _, report = z3
    payload, gathered = ded.gather_bytes()
    # Resident Muon params + momentum per device: the compiled program's
    # argument bytes minus everything else it takes.
    other = per_device_bytes((dp.rest, state[1], state[0][0].count, tokens))
    muon = report.argument_bytes - other
    self.assertLessEqual(muon, 1.2 * 2 * payload / 8)
    self.assertGreaterEqual(muon, 2 * payload / 8)
    # Z2 keeps every group's gathered weights until the backward pass, Z3
    # one group at a time: Z2 needs about (groups - 1) gathered groups more.
    groups = len(ded.groups)
    self.assertGreaterEqual(z2[-1].temp_bytes - report.temp_bytes,
                            0.8 * gathered * (groups - 1) / groups)

  def test_update_has_no_collective_for_owned_params(self):
    ded, dp, state, _, _, _ = compiled((1, 8), True, True, 2)
    opt = dmuon_jax.dedicated_muon(ded, LR)
    specs = ded.specs()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=ded.mesh,
                       in_specs=(specs, ded.specs_of(state), specs),
                       out_specs=(specs, ded.specs_of(state)))
    def update(grads, state, dp):
      return opt.update(grads, state, dp)

    report = dmuon_jax.analyze_hlo(update, dp, state, dp)
    dedicated_test.assert_only_the_finite_flag(self, report)
    self.assertGreater(report.flops, 0)


if __name__ == '__main__':
  absltest.main()
