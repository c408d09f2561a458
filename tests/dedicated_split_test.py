"""Dedicated gathers at their byte floor: matrices split over owners.

Where whole matrices cannot balance a gather's bytes over the owners,
``dmuon_jax.dedicate`` splits some into slices (owner groups, orthogonalized
by their Gram exchange as the drop-in path's groups are): a 4-matrix model
on 8 devices and a 4-block GPT with fused qkv, out, up and down matrices
gather their bytes with at most 5% padding (from the plan and from the
compiled step's collectives) and train as single-device
``optax.contrib.muon`` does; ``layers_per_gather='auto'`` weighs the
gathered weights Z3 holds against the bytes a step moves. A matrix that
outweighs a row's share of its gather (MNIST's ``linear1`` on an HSDP
mesh) is split over every owner device: a device's Muon state is then
about total / N.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
import dmuon_jax.flax as dflax
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py).
SLOW_CASES = (
  r'four_z3_2x4',
  r'four_z2_8x1',
  r'k2',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^AutoTest::test_auto_weighs_memory$',
  r'^GptTest::test_trains_as_optax_at_the_byte_floor_auto$',
)

AXES = support.AXES
N = 8
STEPS = 10
LR = 0.01

# -- the 4-matrix model: two MLP blocks, 1 MiB of float32 Muon params --------

D4 = 128


def four_params():
  rng = np.random.RandomState(0)
  draw = lambda *s: jnp.asarray(rng.randn(*s) / np.sqrt(s[0]), jnp.float32)
  params = {
    f'layers_{i}': {'up': draw(D4, 4 * D4), 'down': draw(4 * D4, D4)}
    for i in range(2)
  }
  params['head'] = draw(D4, 8)  # AdamW
  return params


def four_block(layer, x):
  return x + jnp.tanh(x @ layer['up']) @ layer['down']


def four_loss(params, x):
  for i in range(2):
    x = four_block(params[f'layers_{i}'], x)
  return jnp.mean((x @ params['head']) ** 2)


def four_batch():
  return jax.random.normal(jax.random.key(1), (256, D4))


@functools.cache
def four_reference():
  params = four_params()
  return support.train_single_device(
    support.optax_muon(LR, params),
    params,
    lambda p: four_loss(p, four_batch()),
    STEPS,
  )


def gather_bytes(report):
  """The compiled step's Muon gathers and reduce-scatters per device (the
  owner groups' Gram exchange is point to point: collective-permutes, see
  ``test_exchange_is_the_programs_collective_permutes``)."""
  kinds = report.bytes_by_kind
  return kinds.get('all-gather', 0) + kinds.get('reduce-scatter', 0)


def seeds_model(ded, shape, z3):
  """The seeds' HSDP model of a dedicated step's gathers and
  reduce-scatters: ``(2|3) (S-1)/S`` of the gathered bytes plus ``2
  (R-1)/R`` of a shard's share."""
  r, s = shape
  _, gathered = ded.gather_bytes()
  return (3 if z3 else 2) * (s - 1) / s * gathered + 2 * (
    r - 1
  ) / r * gathered / s


@functools.cache
def four_run(shape, z3):
  mesh = support.make_mesh(shape)
  params = four_params()
  ded = dmuon_jax.dedicate(params, mesh, reshard_after_forward=z3)
  dp = ded.to_dedicated(jax.device_put(params, NamedSharding(mesh, P())))
  opt = dmuon_jax.dedicated_muon(ded, LR)
  state = opt.init(dp)

  def loss(dp, x):
    names = [f'layers_{i}' for i in range(2)]
    x = ded.sequential(four_block, names)(dp, x)
    return jnp.mean((x @ dp.rest['head']) ** 2)

  step = support.explicit_step_fn(opt, mesh, state, loss, ded.specs())
  x = jax.device_put(four_batch(), NamedSharding(mesh, P(AXES)))
  compiled = step.lower(dp, state, x).compile()
  return support.compiled_dedicated_run(ded, compiled, dp, state, x, STEPS)


class FourMatrixTest(parameterized.TestCase):
  def test_whole_matrices_pad_100_percent_and_slices_none(self):
    mesh = {'replicate': 1, 'shard': N}
    params = four_params()
    whole = dmuon_jax.dedicate(params, mesh, owner_groups=None)
    payload = 4 * 4 * D4 * D4 * 4
    self.assertEqual(payload, 2**20)  # 1 MiB
    # The numbers: 1 MiB gathered as 2 MiB (two blocks per gather,
    # one matrix on each of 4 owners, 4 owners idle).
    self.assertEqual(whole.gather_bytes(), (payload, 2 * payload))
    ded = dmuon_jax.dedicate(params, mesh)
    self.assertEqual(ded.gather_bytes(), (payload, payload))
    summary = ded.summary()
    self.assertIn('(padding 0.0%)', summary)
    self.assertIn('4 matrices (4 split into 8 slices)', summary)
    # Each matrix is halved along its long side: 8 slices of 128 KiB, one
    # per owner; each group's Gram iteration on one of its row's owners.
    self.assertLen(ded.plan.groups, 4)
    self.assertEqual(
      sorted(ded.plan.slot_bytes()), [payload // N] * N, ded.summary()
    )
    # Deterministic.
    self.assertEqual(ded.plan, dmuon_jax.dedicate(params, mesh).plan)

  def test_other_preconditioning_is_refused_at_the_factory(self):
    mesh = {'replicate': 1, 'shard': N}
    ded = dmuon_jax.dedicate(four_params(), mesh)
    with self.assertRaisesRegex(
      ValueError, r"preconditioning='aol'.*4 matrices.*owner_groups=None"
    ):
      dmuon_jax.dedicated_muon(ded, LR, preconditioning='aol')
    whole = dmuon_jax.dedicate(four_params(), mesh, owner_groups=None)
    dmuon_jax.dedicated_muon(whole, LR, preconditioning='aol')

  @parameterized.named_parameters(
    ('four_z3_1x8', (1, 8), True),
    ('four_z3_2x4', (2, 4), True),
    ('four_z2_8x1', (8, 1), False),
  )
  def test_trains_as_optax_at_the_byte_floor(self, shape, z3):
    run = four_run(shape, z3)
    ded = run['ded']
    payload, gathered = ded.gather_bytes()
    self.assertLessEqual(gathered, 1.05 * payload, ded.summary())
    self.assertNotEmpty(ded.plan.groups)
    want, want_losses = four_reference()
    chex.assert_trees_all_close(run['losses'], want_losses, rtol=1e-5)
    support.assert_trees_rel_close(self, run['params'], want, rtol=1e-5)
    # From the compiled step: the gathers and reduce-scatters move the
    # seeds' model of the gathered bytes (2% for rounding of the model),
    # and those are within 5% of the same model on the payload.
    measured = gather_bytes(run['report'])
    model = seeds_model(ded, shape, z3)
    self.assertBetween(measured, 0.98 * model, 1.02 * model)
    r, s = shape
    floor = (3 if z3 else 2) * (s - 1) / s * payload + 2 * (
      r - 1
    ) / r * payload / s
    self.assertLessEqual(measured, 1.05 * floor)
    support.assert_no_collective_in_a_conditional(self, run['compiled'])

  def test_exchange_is_the_programs_collective_permutes(self):
    # The owner groups' Gram exchange: per restart window each member's
    # packed Gram triangle to its group's iteration owner and the factor
    # back, point to point (float32 collective-permutes), the bytes
    # ded.exchange_bytes() predicts; nothing else is permuted.
    run = four_run((1, 8), True)
    ded = run['ded']
    permutes = [
      c for c in run['report'].collectives if c.kind == 'collective-permute'
    ]
    self.assertNotEmpty(permutes)
    self.assertEqual({c.dtype for c in permutes}, {'f32'})
    self.assertGreater(ded.exchange_bytes(), 0)
    self.assertAlmostEqual(
      run['report'].bytes_by_kind['collective-permute'],
      ded.exchange_bytes(),
      delta=1,
    )
    self.assertIn('owner groups exchange per device per step', ded.summary())


# -- the 4-block GPT (NNX): fused qkv, out, up, down -------------------------

D, HEADS, VOCAB, SEQ, BATCH, BLOCKS = 32, 4, 64, 8, 16, 4


class GptBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1 = nnx.RMSNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.ln2 = nnx.RMSNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, 4 * D, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(4 * D, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    heads = lambda y: y.reshape(b, t, HEADS, D // HEADS)
    q, k, v = map(heads, jnp.split(self.qkv(self.ln1(x)), 3, axis=-1))
    att = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(D // HEADS)
    causal = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
    y = jnp.einsum('bhqk,bkhd->bqhd', att, v).reshape(b, t, D)
    x = x + self.out(y)
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Gpt(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([GptBlock(rngs) for _ in range(BLOCKS)])
    self.ln_f = nnx.RMSNorm(D, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.ln_f(x))


def gpt_model():
  abstract = nnx.eval_shape(lambda: Gpt(nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  std = lambda name, shape: shape[0] ** -0.5 if name == 'kernel' else 0.5
  return nnx.merge(graphdef, support.host_values(state, std))


def gpt_tokens():
  return jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)


def gpt_loss(model, tokens):
  logits = model(tokens)[:, :-1]
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def gpt_train_step(model, optimizer, tokens):  # the user's step
  loss, grads = nnx.value_and_grad(gpt_loss)(model, tokens)
  optimizer.update(model, grads)
  return loss


@functools.cache
def gpt_reference():
  model = gpt_model()
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def pure_loss(p):
    s = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(s, p)
    return gpt_loss(nnx.merge(graphdef, s), gpt_tokens())

  return support.train_single_device(
    support.optax_muon(LR, params), params, pure_loss, STEPS
  )


@functools.cache
def gpt_run(per_gather):
  mesh = support.make_mesh((1, N))
  model = gpt_model()
  ded = dflax.dedicate(model, mesh, layers_per_gather=per_gather)
  optimizer = nnx.Optimizer(
    model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
  )
  step = dflax.train_step(ded)(gpt_train_step)
  tokens = gpt_tokens()
  losses = [float(step(model, optimizer, tokens)) for _ in range(STEPS)]
  compiled = step.compile(model, optimizer, tokens)
  return {
    'ded': ded,
    'losses': losses,
    'params': jax.device_get(ded.to_params(model)),
    'report': dmuon_jax.analyze_compiled(compiled),
    'compiled': compiled,
  }


def gpt_abstract_params():
  return nnx.to_pure_dict(
    nnx.state(nnx.eval_shape(lambda: Gpt(nnx.Rngs(0))), nnx.Param)
  )


class GptTest(parameterized.TestCase):
  def test_whole_matrices_pad_16_7_percent_and_slices_none(self):
    mesh = {'replicate': 1, 'shard': N}
    params = gpt_abstract_params()
    # All four blocks in one gather: 16 matrices, 48 d^2 over 8 owners;
    # whole matrices give one owner 4 d^2 + 3 d^2 = 7 d^2 (16.7%).
    whole = dmuon_jax.dedicate(
      params, mesh, layers_per_gather=4, owner_groups=None
    )
    payload, gathered = whole.gather_bytes()
    self.assertEqual(payload, BLOCKS * 12 * D * D * 4)
    self.assertAlmostEqual(gathered / payload, 7 / 6)
    for per_gather in ('auto', 4):
      ded = dmuon_jax.dedicate(params, mesh, layers_per_gather=per_gather)
      payload, gathered = ded.gather_bytes()
      self.assertLessEqual(gathered, 1.05 * payload, ded.summary())
      self.assertNotEmpty(ded.plan.groups)

  def test_two_blocks_per_gather_balance_newton_schulz(self):
    # Each gather group is placed by the drop-in planner, seeing the work
    # of the group before it, each restart window's iteration a piece of
    # its own (every device holds its share of a gather's bytes, so no
    # device should also hold a whole iteration): 1.07x the bound (the
    # bytes-first placement this replaced: 1.19x, the same padding).
    mesh = {'replicate': 1, 'shard': N}
    params = gpt_abstract_params()
    ded = dmuon_jax.dedicate(params, mesh, layers_per_gather=2)
    payload, gathered = ded.gather_bytes()
    self.assertLessEqual(gathered, 1.05 * payload, ded.summary())
    plain = dmuon_jax.plan_ownership(params, mesh, owner_groups=None)
    iteration = max(g.iteration_cost for g in ded.plan.groups)
    total = sum(u.cost for u in plain.units)
    bound = max(total / N, iteration)
    self.assertLessEqual(ded.plan.makespan, 1.10 * bound, ded.summary())
    split = [g for g in ded.plan.groups if len(set(g.iteration_owners)) > 1]
    self.assertNotEmpty(split)

  @parameterized.named_parameters(('auto', 'auto'), ('k2', 2))
  def test_trains_as_optax_at_the_byte_floor(self, per_gather):
    run = gpt_run(per_gather)
    ded = run['ded'].dedication
    payload, gathered = ded.gather_bytes()
    self.assertLessEqual(gathered, 1.05 * payload, ded.summary())
    want, want_losses = gpt_reference()
    chex.assert_trees_all_close(run['losses'], want_losses, rtol=1e-5)
    support.assert_trees_rel_close(self, run['params'], want, rtol=1e-5)
    measured = gather_bytes(run['report'])
    floor = 3 * (N - 1) / N * payload
    self.assertBetween(measured, floor - 1, 1.05 * floor)
    support.assert_no_collective_in_a_conditional(self, run['compiled'])


# -- one matrix that dominates (MNIST's linear1): two Linears ---------------

# MNIST's CNN on its Muon side: linear1 3136 x 256 and linear2 256 x 10,
# here 512 x 32 and 32 x 10 (linear1 98% of the Muon bytes).
FEATURES, HIDDEN, CLASSES = 512, 32, 10


def dominant_params():
  rng = np.random.RandomState(0)
  draw = lambda *s: jnp.asarray(rng.randn(*s) / np.sqrt(s[0]), jnp.float32)
  return {
    'linear1': {'kernel': draw(FEATURES, HIDDEN), 'bias': draw(HIDDEN)},
    'linear2': {'kernel': draw(HIDDEN, CLASSES), 'bias': draw(CLASSES)},
  }


def dominant_linear(layer, x):
  return x @ layer['kernel'] + layer['bias']


def dominant_loss(params, x):
  h = jax.nn.relu(dominant_linear(params['linear1'], x))
  logits = dominant_linear(params['linear2'], h)
  labels = jnp.argmax(x[:, :CLASSES], axis=-1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def dominant_batch():
  return jax.random.normal(jax.random.key(2), (64, FEATURES))


DOMINANT_BOUNDARY = lambda path, sub: path in ('linear1', 'linear2')
DOMINANT_PAYLOAD = (FEATURES * HIDDEN + HIDDEN * CLASSES) * 4


def muon_bytes_per_device(ded, state=None, dp=None):
  """The Muon state one device holds, weights and momentum: from the
  plan, its owner buffers' bytes (the gathers pad every owner to the
  largest share); with ``dp`` and ``state``, device 0's shards of the
  owner buffers (``dmuon_jax.OwnerBuffers``: the weights and ``mu``)."""
  if dp is None:
    return 2 * sum(
      size * jnp.dtype(dtype).itemsize
      for lay in ded.layouts
      for size, dtype in zip(lay.local_sizes, lay.dtypes)
    )
  is_owned = lambda x: isinstance(x, dmuon_jax.OwnerBuffers)
  owned = [
    x for x in jax.tree.leaves((dp, state), is_leaf=is_owned) if is_owned(x)
  ]
  assert len(owned) == 2, owned  # the weights and the momentum
  return sum(
    x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(owned)
  )


@functools.cache
def dominant_run(shape):
  mesh = support.make_mesh(shape)
  params = dominant_params()
  ded = dmuon_jax.dedicate(
    params, mesh, boundary_predicate=DOMINANT_BOUNDARY, layers_per_gather=1
  )
  dp = ded.to_dedicated(jax.device_put(params, NamedSharding(mesh, P())))
  opt = dmuon_jax.dedicated_muon(ded, LR)
  state = opt.init(dp)

  def loss(dp, x):
    h = jax.nn.relu(ded.block(dominant_linear, 'linear1')(dp, x))
    logits = ded.block(dominant_linear, 'linear2')(dp, h)
    labels = jnp.argmax(x[:, :CLASSES], axis=-1)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  step = support.explicit_step_fn(opt, mesh, state, loss, ded.specs())
  x = jax.device_put(dominant_batch(), NamedSharding(mesh, P(AXES)))
  compiled = step.lower(dp, state, x).compile()
  per_device = muon_bytes_per_device(ded, state, dp)
  run = support.compiled_dedicated_run(ded, compiled, dp, state, x, 3)
  return {**run, 'per_device': per_device}


@functools.cache
def dominant_reference():
  params = dominant_params()
  return support.train_single_device(
    support.optax_muon(LR, params),
    params,
    lambda p: dominant_loss(p, dominant_batch()),
    3,
  )


class DominantMatrixTest(parameterized.TestCase):
  """One matrix outweighs a row's share of its gather (MNIST's linear1 on
  an HSDP or two-axis mesh): its owner groups span every owner device,
  not one row of the group axis, so a device's Muon state is about
  total / N (it was total / (row size): 2x on 2 x 4, 4x on 4 x 2)."""

  @parameterized.named_parameters(
    ('hsdp_2x4', {'replicate': 2, 'shard': 4}),
    ('hsdp_4x2', {'replicate': 4, 'shard': 2}),
    ('two_axes_2x4', {'data': 2, 'fsdp': 4}),
  )
  def test_state_per_device_near_total_over_n(self, mesh):
    params = dominant_params()
    for per_gather in ('auto', 1):
      ded = dmuon_jax.dedicate(
        params,
        mesh,
        boundary_predicate=DOMINANT_BOUNDARY,
        layers_per_gather=per_gather,
      )
      # Floor: linear1's 8 slices of 64 rows, one per device, and
      # linear2's share (its 32 x 10 splits at most in 2: slices keep 10
      # rows), 1.06x total / N.
      ideal = 2 * DOMINANT_PAYLOAD / N
      self.assertLessEqual(
        muon_bytes_per_device(ded), 1.1 * ideal, ded.summary()
      )
      (big,) = [g for g in ded.plan.groups if g.shape == (FEATURES, HIDDEN)]
      self.assertLen({ded.plan.owners[u] for u in big.units}, N)
      # Newton-Schulz: every device its slice of linear1; the floor with
      # equal slices is a slice's share plus the largest restart window's
      # 32 x 32 iteration (1.73x total / N here; with linear1's slices in
      # one row, 2.5x on 2 x 4 and 4.2x on 4 x 2).
      share = sum(ded.plan.units[u].cost for u in big.units) / N
      floor = share + max(big.iteration_costs)
      self.assertLessEqual(ded.plan.makespan, 1.05 * floor, ded.summary())

  def test_trains_as_optax_with_state_near_total_over_n(self):
    run = dominant_run((2, 4))
    ded = run['ded']
    self.assertLessEqual(
      run['per_device'], 1.1 * 2 * DOMINANT_PAYLOAD / N, ded.summary()
    )
    self.assertIn("along ('shard', 'replicate')", ded.summary())
    want, want_losses = dominant_reference()
    chex.assert_trees_all_close(run['losses'], want_losses, rtol=1e-5)
    support.assert_trees_rel_close(self, run['params'], want, rtol=1e-5)
    support.assert_no_collective_in_a_conditional(self, run['compiled'])


class AutoTest(parameterized.TestCase):
  def test_auto_weighs_memory(self):
    # Llama-3-70B's shapes on 64 devices: whole matrices balance their
    # gathers only in groups of 40 layers (half the model's weights
    # gathered at once: the old 'auto'); with matrices split, 'auto'
    # gathers a few layers at a time within 5%.
    params = support.llama3_matrices(80, 8192, 28672, 1024)
    mesh = {'replicate': 8, 'shard': 8}
    # Whole matrices: 16 layers per gather (weighing memory) pad 9.8%;
    # 40 (two groups) would pad 2%.
    whole = dmuon_jax.dedicate(params, mesh, owner_groups=None)
    payload, gathered = whole.gather_bytes()
    self.assertGreater(gathered, 1.05 * payload)
    ded = dmuon_jax.dedicate(params, mesh)
    payload, gathered = ded.gather_bytes()
    self.assertLessEqual(gathered, 1.05 * payload)
    self.assertLessEqual(ded.layers_per_gather, 10)
    largest = max(
      lay.num_slots * sum(lay.local_sizes) * 2 for lay in ded.layouts
    )
    # Two gather groups within half of an 80 GB device (bfloat16).
    self.assertLessEqual(2 * largest, 40 * 2**30)


if __name__ == '__main__':
  absltest.main()
