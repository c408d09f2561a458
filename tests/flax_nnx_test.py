"""dmuon_jax.flax on NNX models written the ordinary way.

A Gemma-like decoder (grouped-query attention with ``nnx.Einsum`` kernels
and dimension numbers, RMSNorm, dropout, the embedding tied to the output
and trained by AdamW) and a scanned stack (``nnx.vmap`` blocks run by
``nnx.scan``), dedicated in three lines with the train step unchanged,
against single-device ``optax.contrib.muon`` + AdamW; bytes and memory from
the compiled step.
"""

import functools
import math
import pathlib
import re
import warnings

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
from dmuon_jax import MuonDimensionNumbers as MDN
from tests import support

D, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB, DEPTH, SEQ, BATCH = (
  32,
  4,
  2,
  8,
  64,
  64,
  4,
  8,
  16,
)
LR = 0.01
STEPS = 20

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'loop_z2_1x8_k1',  # Z2 in the inner loop: dedicated_test's z2_2x4
  r'_k1',
  r'_k4',
  r'_2x4',
  r'auto_mesh',
  r'temporaries',
  r'FlaxNnxGroupsTest',
  # Measured 10 s of the inner loop's 200 (its own 4-layer compile); the
  # full suite holds the padding bound.
  r'default_layers_per_gather_pads',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^NnxBehaviourTest::test_trailing_scalar_argument_is_not_the_batch$',
  r'^NnxParityTest::test_matches_single_device_optax_loop_z3_1x8$',
  r'^NnxBehaviourTest::test_graph_node_arguments_are_updated_as_under_nnx_jit$',
  r'^NnxBehaviourTest::test_bare_jit_warns_once_and_moves_what_it_says$',
)


class Attention(nnx.Module):
  """Grouped-query attention; kernels are einsum weights, not matrices."""

  def __init__(self, rngs):
    self.q = nnx.Einsum('btd,dnh->btnh', (D, HEADS, HEAD_DIM), rngs=rngs)
    self.kv = nnx.Einsum(
      'btd,cdkh->cbtkh', (2, D, KV_HEADS, HEAD_DIM), rngs=rngs
    )
    self.o = nnx.Einsum('btnh,nhd->btd', (HEADS, HEAD_DIM, D), rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    group = HEADS // KV_HEADS
    q = self.q(x).reshape(b, t, KV_HEADS, group, HEAD_DIM)
    k, v = self.kv(x)
    logits = jnp.einsum('btkgh,bskh->bkgts', q, k) / math.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    y = jnp.einsum('bkgts,bskh->btkgh', probs, v).reshape(b, t, HEADS, -1)
    return self.o(y)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.attn_norm = nnx.RMSNorm(D, rngs=rngs)
    self.attn = Attention(rngs)
    self.mlp_norm = nnx.RMSNorm(D, rngs=rngs)
    self.gate = nnx.Linear(D, FF, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(D, FF, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(FF, D, use_bias=False, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    h = self.mlp_norm(x)
    h = self.down(jax.nn.gelu(self.gate(h)) * self.up(h))
    return x + self.dropout(h)


class Decoder(nnx.Module):
  """Embed -> blocks -> norm -> logits through the (tied) embedding."""

  def __init__(self, rngs, scan=False, depth=DEPTH):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    if scan:
      self.layers = nnx.vmap(Block, in_axes=None, axis_size=depth)(rngs)
    else:
      self.layers = nnx.List([Block(rngs) for _ in range(depth)])
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.scan = scan

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.scan:
      x = nnx.scan(lambda x, blk: (blk(x), None), in_axes=(nnx.Carry, 0))(
        x, self.layers
      )[0]
    else:
      for block in self.layers:
        x = block(x)
    return self.embed.attend(self.norm(x))


def muon_dims(params):
  """Dimension numbers of the block kernels (a stacked leading axis for the
  scanned model); embedding and norms get None: AdamW."""

  def one(path, leaf):
    names = [str(getattr(k, 'key', k)) for k in path]
    if names[-1] != 'kernel' or 'layers' not in names:
      return None
    lead = leaf.ndim - {'q': 3, 'kv': 4, 'o': 3}.get(names[-2], 2)
    shift = lambda axes: tuple(a + lead for a in axes)
    if names[-2] == 'q':
      return MDN(shift((0,)), shift((1, 2)))
    if names[-2] == 'kv':  # (2, d, kv_heads, head_dim): k and v stacked
      return MDN(shift((1,)), shift((2, 3)))
    if names[-2] == 'o':
      return MDN(shift((0, 1)), shift((2,)))
    return MDN(shift((0,)), shift((1,)))

  return jax.tree_util.tree_map_with_path(one, params)


def tokens():
  return jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)


def loss_fn(model, toks):
  logits = model(toks)[:, :-1]
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, toks[:, 1:]
  ).mean()


def train_step(model, optimizer, toks):  # the user's step, unchanged
  loss, grads = nnx.value_and_grad(loss_fn)(model, toks)
  optimizer.update(model, grads)
  return loss


def make_model(scan, depth=DEPTH, cls=Decoder):
  """The model, its values drawn on the host (support.host_values: nnx's
  initializers run eagerly cost 4.4 s of compilation per model), dropout
  off (the reference's masks cannot be matched)."""
  abstract = nnx.eval_shape(lambda: cls(nnx.Rngs(0), scan=scan, depth=depth))
  graphdef, state = nnx.split(abstract)
  # LeCun's scale, as nnx's default kernel initializer: fan-in is every
  # axis but the last (and the stack's); the embedding's is its width.
  stacked = 1 if scan else 0
  std = lambda name, shape: (
    (math.prod(shape[stacked:-1]) if name == 'kernel' else shape[-1]) ** -0.5
  )
  model = nnx.merge(graphdef, support.host_values(state, std))
  model.eval()
  return model


@functools.cache
def reference(scan, depth=DEPTH):
  """Single-device optax.contrib.muon (+ its AdamW), the same model."""
  model = make_model(scan, depth)
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def pure_loss(p):
    s = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(s, p)
    return loss_fn(nnx.merge(graphdef, s), tokens())

  return support.train_single_device(
    support.optax_muon(LR, params, dims=muon_dims), params, pure_loss, STEPS
  )


def make_mesh(shape, auto=False):
  kind = jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit
  return jax.make_mesh(shape, support.AXES, axis_types=(kind, kind))


def initial_loss(model):
  """The loss at the model's params: the first loss a train step returns
  (the reference's first loss, for models without a reference run)."""
  return float(nnx.jit(loss_fn)(model, tokens()))


def dedicated(
  shape,
  scan,
  z3,
  auto=False,
  owner_groups='auto',
  per_gather='auto',
  depth=DEPTH,
):
  """The recipe: three lines added; 20 steps; the compiled step. One run
  per configuration (cached): every test of it reads the same run.

  The embedding starts sharded over 'shard' (an AdamW param sharded over an
  owner axis): it stays so, its moments alike, and train_step gathers it
  and them for the step.
  """
  return _dedicated(
    tuple(shape), scan, z3, auto, owner_groups, per_gather, depth
  )


@functools.cache
def _dedicated(shape, scan, z3, auto, owner_groups, per_gather, depth):
  mesh = make_mesh(shape, auto)
  model = make_model(scan, depth)
  table = model.embed.embedding
  table.set_value(
    jax.device_put(table.get_value(), NamedSharding(mesh, P('shard')))
  )
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', dmuon_jax.DMuonWarning)
    ded = dflax.dedicate(  # 1
      model,
      mesh,
      muon_weight_dimension_numbers=muon_dims,
      reshard_after_forward=z3,
      owner_groups=owner_groups,
      layers_per_gather=per_gather,
    )
  said = [str(w.message) for w in caught]
  embed_spec = model.embed.embedding.get_value().sharding.spec
  optimizer = nnx.Optimizer(  # 2
    model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
  )
  # dflax.train_step traces an NNX step once per compilation (no probe of
  # its outputs: no argument but the graph nodes and the batch): one
  # trace, so the 20 steps and the compiled program for the HLO below are
  # one executable. On an Auto mesh the second call retraces (the momentum
  # comes back as P('shard') instead of P(('shard', 'replicate'))): 2.
  chex.clear_trace_counter()
  user_step = chex.assert_max_traces(train_step, n=2 if auto else 1)
  step = dflax.train_step(ded)(user_step)  # 3
  toks = tokens()
  losses = [float(step(model, optimizer, toks)) for _ in range(STEPS)]
  compiled = step.compile(model, optimizer, toks)
  return {
    'ded': ded,
    'said': said,
    'embed_spec': embed_spec,
    'losses': losses,
    'params': jax.device_get(ded.to_params(model)),
    'report': dmuon_jax.analyze_compiled(compiled),
    'nesting': support.hlo_tools.collective_nesting(compiled),
    'memory': compiled.memory_analysis(),
    'model': model,
    'optimizer': optimizer,
  }


# (name, mesh, scanned, Z3, layers per gather): loop and scanned stacks, Z2
# and Z3, shard-only (1x8) and HSDP (2x4; the loop on HSDP: the owner-groups
# run, FlaxNnxGroupsTest, and flax_linen_test's z2_2x4). The default
# ('auto') loop gathers one block at a time (four groups: two groups of two
# would hold the whole model at Z3's peak; 11.1% padding with the gate, up,
# down and kv kernels split over owners, 77.8% whole), so that Z3 has gathered weights to
# free between groups (NnxMemoryTest); k4 gathers all four blocks at once
# (no padding, matrices whole). The loop's Z2 runs with one block per
# gather only (loop_z2_1x8_k1, which the memory test needs): a Z2 group
# differs from Z3's only by the backward regather.
CONFIGS = [
  ('loop_z3_1x8', (1, 8), False, True, 'auto'),
  ('scan_z3_1x8', (1, 8), True, True, 'auto'),
  ('loop_z3_1x8_k4', (1, 8), False, True, 4),
  ('loop_z2_1x8_k1', (1, 8), False, False, 1),
  ('scan_z2_2x4', (2, 4), True, False, 'auto'),
]


# (mesh, scanned, Z3, Auto axes, owner groups, layers per gather, depth):
# the loop on HSDP, every Muon kernel split over 2 devices, Auto mesh axes.
# Two blocks: what it checks (Auto axes, owner groups of 2, parity, no
# collective in a conditional) does not depend on depth, and its step
# compiles twice (see _dedicated). One block per gather (two groups), as
# 'auto' chose at four blocks ('auto' gathers both at two).
AUTO_GROUPS = ((2, 4), False, True, True, 2, 1, 2)


def muon_bytes(report):
  kinds = report.bytes_by_kind
  return kinds.get('all-gather', 0) + kinds.get('reduce-scatter', 0)


def sharded_adamw(run):
  """The AdamW params sharded over an owner axis (the embedding), as
  ``(array, devices it is split over)``."""
  ded = run['ded']
  leaves = nnx.to_flat_state(nnx.state(run['model'], nnx.Param))
  found = []
  for _, v in leaves:
    x = v.get_value()
    if isinstance(v, dflax.OwnedBuffer) or not isinstance(
      x.sharding, NamedSharding
    ):
      continue
    axes = set(jax.tree.leaves(tuple(x.sharding.spec))) & set(ded.axes)
    if axes:
      found.append((x, math.prod(x.sharding.mesh.shape[a] for a in axes)))
  return found


def adamw_gather_bytes(run):
  """What train_step's gathers of those params and their two AdamW
  moments move per device (all-gathers, once per step): each over the
  devices it is split over (measured on 2x4: the P('shard') embedding,
  replicated over 'replicate', in groups of 4), (n-1)/n of its bytes."""
  return sum(3 * (n - 1) / n * x.nbytes for x, n in sharded_adamw(run))


class NnxParityTest(parameterized.TestCase):
  @parameterized.named_parameters(*CONFIGS)
  def test_matches_single_device_optax(self, shape, scan, z3, per_gather):
    want_params, want_losses = reference(scan)
    run = dedicated(shape, scan, z3, per_gather=per_gather)
    # fp32: optax.contrib.muon is ~7e-6 from its own float64 run after 20
    # steps; measured here: each step's loss <= 4.6e-6 relative, params
    # <= 2.1e-6 (relative Frobenius per leaf; <= 3.1e-6 max-abs / max).
    chex.assert_trees_all_close(run['losses'], want_losses, rtol=1e-5)
    support.assert_trees_rel_close(self, run['params'], want_params, 1e-5)
    self.assertLess(run['losses'][-1], run['losses'][0] - 0.5)

  def test_auto_mesh_axes(self):
    # The owner-groups run (FlaxNnxGroupsTest) is on Auto axes: one
    # configuration for both, two blocks (measured: params <= 3.6e-6,
    # losses <= 4.2e-6; 1.3e-6 and 1.1e-6 at four blocks).
    want_params, want_losses = reference(False, AUTO_GROUPS[-1])
    run = dedicated(*AUTO_GROUPS)
    self.assertEqual(
      set(run['ded'].dedication.mesh.axis_types), {jax.sharding.AxisType.Auto}
    )
    chex.assert_trees_all_close(run['losses'], want_losses, rtol=1e-5)
    support.assert_trees_rel_close(self, run['params'], want_params, 1e-5)


class NnxBytesTest(parameterized.TestCase):
  """From the compiled HLO of the recommended step, the model unchanged."""

  @parameterized.named_parameters(*CONFIGS)
  def test_muon_bytes_at_the_floor(self, shape, scan, z3, per_gather):
    run = dedicated(shape, scan, z3, per_gather=per_gather)
    ded, report = run['ded'].dedication, run['report']
    r, s = shape
    payload, gathered = ded.gather_bytes()
    n = r * s
    floor = (3 if z3 else 2) * (n - 1) / n * payload
    # The seeds' HSDP model: shard stage (S-1)/S per gather/scatter of the
    # group, replicate stage 2 (R-1)/R of a shard's share.
    model = (3 if z3 else 2) * (s - 1) / s * gathered + 2 * (
      r - 1
    ) / r * gathered / s
    # Matrices split over owners (one block per gather: the gate, up, down
    # and kv kernels) exchange their Grams point to point, as predicted.
    # The FSDP embedding and its moments are gathered for the step besides.
    got = muon_bytes(report) - adamw_gather_bytes(run)
    self.assertAlmostEqual(
      report.bytes_by_kind.get('collective-permute', 0),
      ded.exchange_bytes(),
      delta=1,
    )
    self.assertAlmostEqual(got, model, delta=0.001 * model)
    # At the floor where the groups are not padded (the default groups of
    # blocks); scanned stacks gather one layer per nnx.scan iteration,
    # padded (stacks rotate whole matrices), and the k1 loops one block per
    # group: 9 x 4 KiB on 8 owners, 77.8% padding with whole matrices, 11.1%
    # with the gate, up, down and kv kernels split (the 32x32 q and o are
    # not: a slice keeps at least min(128, short side) columns).
    if gathered <= 1.05 * payload:
      self.assertLessEqual(got, 1.05 * floor)
    else:
      self.assertTrue(scan or ded.layers_per_gather == 1)
    if ded.layers_per_gather == 1 and not scan:
      self.assertNotEmpty(ded.plan.groups)
      self.assertLessEqual(gathered, 1.12 * payload)
    # No all-reduce moves Muon gradients: what is all-reduced is the AdamW
    # params' gradients (DDP for them), the loss and a finiteness flag.
    # Measured (1x8): 4385 elements for 2352 AdamW elements: the tied
    # embedding's two uses (lookup, logits) are summed separately.
    targets = {t.path for t in ded.layout.leaves}
    adam = sum(
      x.size
      for p, x in zip(ded.leaf_paths, jax.tree.leaves(ded.abstract_params))
      if p not in targets
    )
    all_reduced = sum(
      math.prod(c.shape) for c in report.collectives if c.kind == 'all-reduce'
    )
    self.assertLessEqual(all_reduced, 2 * adam + 8)
    self.assertLess(all_reduced, payload / 4 / 8)
    # Every collective runs on every device: none inside a conditional; in
    # loops (nnx.scan) only each layer's gathers and reduce-scatters and the
    # all-reduce of its AdamW params' gradients (autodiff sums the stack's
    # norm scales per iteration).
    nesting = run['nesting']
    self.assertEmpty([c for c in nesting if 'conditional' in c.context])
    looped = [c for c in nesting if 'while' in c.context]
    if scan:
      self.assertEqual(
        {c.kind for c in looped}, {'all-gather', 'reduce-scatter', 'all-reduce'}
      )
      stack_adam = sum(
        x.size // x.shape[0]
        for p, x in zip(ded.leaf_paths, jax.tree.leaves(ded.abstract_params))
        if p not in targets and p.startswith('layers/')
      )
      self.assertLessEqual(
        sum(c.elements for c in looped if c.kind == 'all-reduce'), stack_adam
      )
    else:
      self.assertEmpty(looped)

  def test_z3_regathers_once_per_group(self):
    run = dedicated((1, 8), False, True)
    ded = run['ded'].dedication
    self.assertLen(ded.groups, 4 // ded.layers_per_gather)
    gathers = [c for c in run['report'].collectives if c.kind == 'all-gather']
    scatters = [
      c for c in run['report'].collectives if c.kind == 'reduce-scatter'
    ]
    groups = len(ded.groups)
    # Forward + backward, and the FSDP embedding, its mu and nu gathered
    # for the step.
    self.assertLen(gathers, 2 * groups + 3)
    self.assertLen(scatters, groups)

  def test_scanned_stack_gathers_one_layer_per_iteration(self):
    summary = dedicated((1, 8), True, True)['ded'].summary()
    self.assertIn('1 layer(s) per gather (one layer per nnx.scan', summary)

  def test_default_layers_per_gather_weighs_the_weights_z3_holds(self):
    # Four blocks: 'auto' gathers one at a time (11.1% padding) rather than
    # two groups of two (the whole model gathered at Z3's peak); the
    # summary says that the padding is above 5%.
    ded = dedicated((1, 8), False, True)['ded']
    payload, gathered = ded.dedication.gather_bytes()
    self.assertEqual(ded.dedication.layers_per_gather, 1)
    self.assertLessEqual(gathered, 1.12 * payload)
    self.assertIn('(auto, padding above 5%)', ded.summary())


class NnxMemoryTest(absltest.TestCase):
  def test_owned_params_and_momentum_are_one_nth(self):
    run = dedicated((1, 8), False, True)
    ded = run['ded'].dedication
    payload, _ = ded.gather_bytes()
    per_device = lambda xs: sum(x.addressable_shards[0].data.nbytes for x in xs)
    owned = [
      v.get_value()
      for _, v in nnx.to_flat_state(nnx.state(run['model'], dflax.OwnedBuffer))
    ]
    # The Muon momentum: the optimizer state sharded over the owner axes
    # in owner layout (the FSDP embedding's AdamW moments are sharded over
    # them too: 1/8 each).
    sharded = [
      x
      for x in jax.tree.leaves(nnx.state(run['optimizer']))
      if isinstance(x.sharding, NamedSharding)
      and set(ded.buffer_axes) & set(jax.tree.leaves(tuple(x.sharding.spec)))
    ]
    shapes = {x.shape for x in owned}
    momentum = [x for x in sharded if x.shape in shapes]
    self.assertLen(momentum, len(owned))
    ((table, k),) = sharded_adamw(run)
    moments = [x for x in sharded if x.shape == table.shape]
    self.assertLen(moments, 2)
    self.assertEqual(per_device(moments), 2 * table.nbytes // k)
    self.assertLessEqual(per_device(owned), 1.2 * payload / 8)
    self.assertLessEqual(per_device(momentum), 1.2 * payload / 8)
    self.assertGreaterEqual(per_device(owned + momentum), 2 * payload / 8)

  def test_scanned_momentum_is_about_one_nth(self):
    # The scanned stack's 7 matrices per layer (36 KiB) pad its owned row
    # to 64 KiB per layer (8 KiB per device: 32 KiB over 4 layers); its
    # momentum keeps only what each device owns of each layer, the layers'
    # owners spread by the rotation: 20 KiB per device, 1.11x the even
    # share (before: the owned buffer's 32 KiB, 1.78x).
    run = dedicated((1, 8), True, True)
    ded = run['ded'].dedication
    payload, _ = ded.gather_bytes()
    ((table, _),) = sharded_adamw(run)
    momentum = [
      x
      for x in jax.tree.leaves(nnx.state(run['optimizer'], nnx.OptState))
      if isinstance(x.sharding, NamedSharding)
      and set(ded.buffer_axes) & set(jax.tree.leaves(tuple(x.sharding.spec)))
      and x.shape != table.shape
    ]
    self.assertLen(momentum, len(ded.layout.buffer_index))
    held = sum(x.addressable_shards[0].data.nbytes for x in momentum)
    self.assertLessEqual(held, 1.15 * payload / 8)
    self.assertIn('momentum per device: 20.00 KiB', ded.summary())

  def test_z3_temporaries_below_z2(self):
    # One gather per block (layers_per_gather=1: four groups), so that Z3
    # has gathered weights to free between groups: the k1 runs. Measured
    # (1x8): Z3 197,728 bytes of temporaries, Z2 277,280: 1.2 gathered
    # groups less (a group is 64 KiB here; on 2x4, 251,224 and 281,048:
    # 0.46 of a group). Each group's gather waits for its first block's
    # input; without that tie XLA hoisted every forward gather to the start
    # of the step (Z3 then peaked at 285,728, like Z2).
    z3 = dedicated((1, 8), False, True)
    z2 = dedicated((1, 8), False, False, per_gather=1)
    ded = z3['ded'].dedication
    self.assertEqual(ded.layers_per_gather, 1)  # 'auto' (see CONFIGS)
    group = ded.gather_bytes()[1] / len(ded.groups)
    temps = {
      z: run['memory'].temp_size_in_bytes for z, run in ((3, z3), (2, z2))
    }
    self.assertGreaterEqual(temps[2] - temps[3], 0.8 * group, temps)


class NnxBehaviourTest(absltest.TestCase):
  def test_dropout_draws_differ_by_device_and_rng_state_advances(self):
    # One block: what is checked (per-device masks, the RNG count advancing,
    # the key kept) does not depend on depth.
    mesh = make_mesh((1, 8))
    model = make_model(False, depth=1)
    model.train()  # dropout on
    ded = dflax.dedicate(model, mesh, muon_weight_dimension_numbers=muon_dims)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
    rngs = model.layers[0].dropout.rngs
    key = np.asarray(jax.random.key_data(rngs.key[...]))

    @dflax.train_step(ded)
    def masks(model, toks):
      del toks
      ones = jnp.ones((BATCH // 8, SEQ, D))
      return jax.lax.all_gather(model.layers[0].dropout(ones), ded.axes)

    got = np.asarray(masks(model, tokens()))
    self.assertFalse(np.array_equal(got[0], got[1]))
    count = int(rngs.count[...])
    loss = float(dflax.train_step(ded)(train_step)(model, optimizer, tokens()))
    self.assertGreater(int(rngs.count[...]), count)
    np.testing.assert_array_equal(
      np.asarray(jax.random.key_data(rngs.key[...])), key
    )
    self.assertTrue(np.isfinite(loss))

  def test_reading_a_dedicated_weight_inside_the_step_gives_it_whole(self):
    # Metrics over the params inside train_step read the Muon targets as
    # written (an attribute and the model's DedicatedWeight state): the
    # whole matrices, equal to the plain params; the placeholders are back
    # after the step (before: the placeholder's error naming to_params).
    mesh = make_mesh((1, 8))
    model = make_model(False, depth=1)
    plain = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ded = dflax.dedicate(model, mesh, muon_weight_dimension_numbers=muon_dims)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )

    @dflax.train_step(ded)
    def step(model, optimizer, toks):
      norms = jax.tree.map(
        lambda x: jnp.sqrt(jnp.sum(x * x)),
        nnx.to_pure_dict(nnx.state(model, dflax.DedicatedWeight)),
      )
      read = model.layers[0].up.kernel[...]
      return read, norms, train_step(model, optimizer, toks)

    read, norms, _ = step(model, optimizer, tokens())
    layer = plain['layers'][0]
    # (outputs are averaged over the owner axes: a mean of 8 equal copies
    # rounds by up to 1.5e-7 relative, measured)
    np.testing.assert_allclose(read, layer['up']['kernel'], rtol=1e-6)
    for path, norm in jax.tree_util.tree_leaves_with_path(norms):
      want = functools.reduce(lambda d, k: d[k.key], path, plain)
      np.testing.assert_allclose(norm, np.linalg.norm(want), rtol=1e-6)
    self.assertLen(jax.tree.leaves(norms), len(ded.dedication.layout.leaves))
    self.assertEqual(model.layers[0].up.kernel.shape, (0,))

    # A submodule passed before the model is no model of its own: the read
    # through it is the same whole matrix (before: to_params of the
    # submodule raised, missing the model's params).
    @dflax.train_step(ded)
    def read_block(block, model, toks):
      del model, toks
      return block.up.kernel[...]

    got = read_block(model.layers[0], model, tokens())
    np.testing.assert_allclose(
      got, ded.to_params(model)['layers'][0]['up']['kernel'], rtol=1e-6
    )

  def test_graph_node_arguments_are_updated_as_under_nnx_jit(self):
    # An nnx.MultiMetric and an nnx.Rngs passed to the step: updated as
    # nnx.jit updates them (before: copied in, their updates lost; the
    # metric's count stayed 0 and its loss NaN).
    def step(model, optimizer, metrics, rngs, toks):
      noise = jax.random.normal(rngs.noise(), ())  # draws from the Rngs
      loss, grads = nnx.value_and_grad(loss_fn)(model, toks)
      optimizer.update(model, grads)
      # A scalar and per-example values (the batch's first tokens).
      metrics.update(loss=loss + 0 * noise, first=toks[:, 0] * 1.0)
      return loss

    def run(make_step, make_tx):
      model = make_model(False, depth=1)
      params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
      optimizer = nnx.Optimizer(model, make_tx(model, params), wrt=nnx.Param)
      metrics = nnx.MultiMetric(
        loss=nnx.metrics.Average('loss'), first=nnx.metrics.Average('first')
      )
      rngs = nnx.Rngs(noise=3)
      run_step = make_step(model)
      losses = [
        float(run_step(model, optimizer, metrics, rngs, tokens()))
        for _ in range(2)
      ]
      state = nnx.state(metrics)
      computed = {k: float(v) for k, v in metrics.compute().items()}
      return (losses, float(state['loss']['total'][...]), computed), (
        int(state['loss']['count'][...]),
        int(rngs.noise.count[...]),
      )

    mesh = make_mesh((2, 4))
    dedicated_run = {}

    def dedicated_tx(model, params):
      del params
      ded = dedicated_run['ded'] = dflax.dedicate(
        model, mesh, muon_weight_dimension_numbers=muon_dims
      )
      return dflax.dedicated_muon(ded, learning_rate=LR)

    def dims(state):  # muon_dims of the nnx.State the optimizer passes
      flat = jax.tree.leaves(
        muon_dims(nnx.to_pure_dict(state)),
        is_leaf=lambda x: x is None or isinstance(x, MDN),
      )
      return jax.tree.unflatten(jax.tree.structure(state), flat)

    got = run(
      lambda m: dflax.train_step(dedicated_run['ded'])(step), dedicated_tx
    )
    want = run(
      lambda m: nnx.jit(step),
      # One device, plain nnx.jit (the drop-in is held to optax.contrib.muon
      # by NnxParityTest's reference and the distributed tests).
      lambda m, p: dmuon_jax.dmuon(LR, muon_weight_dimension_numbers=dims),
    )
    self.assertEqual(got[1], want[1])  # counts: metric 2, RNG draws 2
    # Losses, the loss metric's total and both metrics' values (the
    # per-example one's total and count hold one device's share, see the
    # train_step docs; its value is the global mean).
    chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)

  def test_trailing_scalar_argument_is_not_the_batch(self):
    # step(model, optimizer, toks, step_number): the batch is still split
    # over the devices (before: the scalar was taken for the batch, and
    # every device ran the whole batch), and the loss is nnx.jit's.
    model = make_model(False, depth=1)
    want = initial_loss(model)  # nnx.jit's, before dedication
    ded = dflax.dedicate(
      model, make_mesh((2, 4)), muon_weight_dimension_numbers=muon_dims
    )
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
    seen = []  # the batch's shape in the step, per device, as traced

    def step(model, optimizer, toks, i):
      seen.append(toks.shape)
      return train_step(model, optimizer, toks), i

    with_scalar = dflax.train_step(ded)(step)
    loss, i = with_scalar(model, optimizer, tokens(), jnp.int32(3))
    # Every trace of the step (two: the step probed, then compiled) saw
    # one device's 1/8 of the batch; no second program compiled for the
    # FLOPs of a step without the scalar.
    self.assertNotEmpty(seen)
    self.assertEqual(set(seen), {(BATCH // 8, SEQ)})
    self.assertEqual(int(i), 3)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)

  def test_a_sharded_batch_part_not_taken_for_the_batch_names_the_fix(self):
    # step(model, optimizer, x, y): x and y lead with the batch dimension,
    # so both are batch (before: y alone, and x, placed split over the
    # owner axes as a batch is, raised). An x of another leading dimension
    # is state by that rule: the error names its position and batch_argnums
    # (before the last session: "Place it as dmuon_jax.flax.dedicate left
    # it", naming neither).
    mesh = make_mesh((2, 4))
    model = make_model(False, depth=1)
    ded = dflax.dedicate(model, mesh, muon_weight_dimension_numbers=muon_dims)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
    seen = []
    step = dflax.train_step(ded)(
      lambda model, optimizer, x, y: seen.append((x.shape, y.shape))
    )
    x = jax.device_put(tokens(), NamedSharding(mesh, P(ded.axes)))
    step(model, optimizer, x, tokens())
    local = (tokens().shape[0] // 8, tokens().shape[1])
    self.assertEqual(seen, [(local, local)])  # each device's share of both
    with self.assertRaisesRegex(
      ValueError,
      r"'argument 2' sharded .*takes argument 2 for state.*batch arguments "
      r'are \[3\].*pass batch_argnums=\(2, 3\)',
    ):
      step(model, optimizer, x, tokens()[:4])

  def test_graph_nodes_inside_a_container_argument_are_refused(self):
    model = make_model(False, depth=1)
    ded = dflax.dedicate(model, None, muon_weight_dimension_numbers=muon_dims)

    @dflax.train_step(ded)
    def step(model, metrics, toks):
      metrics['loss'].update(loss=loss_fn(model, toks))

    metrics = {'loss': nnx.metrics.Average('loss')}
    with self.assertRaisesRegex(TypeError, r'argument 1 .*Average.*dict'):
      step(model, metrics, tokens())

  def test_adamw_params_sharded_over_owner_axes_stay_sharded(self):
    # Every run of dedicated() starts with the embedding sharded over
    # 'shard'; this one's 20 steps match the reference (NnxParityTest).
    # It stays sharded, its moments alike, with no warning (before:
    # replicated, with a warning of the bytes it cost).
    run = dedicated((1, 8), False, True)
    self.assertIn(
      "AdamW params sharded over the owner axes ('shard',), "
      'their moments alike (train_step gathers them for the step): '
      "['embed/embedding']",
      run['ded'].summary(),
    )
    self.assertEqual(run['embed_spec'], P('shard'))
    self.assertEqual(run['said'], [])
    table = run['model'].embed.embedding.get_value()
    self.assertEqual(table.sharding.spec, P('shard'))
    moments = [
      v.get_value().sharding.spec
      for p, v in nnx.to_flat_state(nnx.state(run['optimizer']))
      if 'embed' in p
    ]
    self.assertEqual(moments, [P('shard')] * 2)

  def test_bare_jit_warns_once_and_moves_what_it_says(self):
    # One block: the bytes checked below scale with the Muon payload, the
    # AdamW bound is absolute.
    mesh = make_mesh((1, 8), auto=True)  # the model indexes embeddings
    model = make_model(False, depth=1)
    want_loss = initial_loss(model)
    ded = dflax.dedicate(model, mesh, muon_weight_dimension_numbers=muon_dims)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
    toks = jax.device_put(tokens(), NamedSharding(mesh, P(support.AXES)))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      # Two traces of the step: its program compiled for analysis, then
      # the call (another nnx.jit of the same step, on the same state: the
      # same program, from the compilation cache; measured: one compile,
      # two before, when the analysis lowered it for the state the call
      # had started from after the call had placed it on the mesh).
      compiled = nnx.jit(train_step).lower(model, optimizer, toks).compile()
      loss = float(nnx.jit(train_step)(model, optimizer, toks))
    said = [w for w in caught if issubclass(w.category, dmuon_jax.DMuonWarning)]
    self.assertLen(said, 1)
    message = str(said[0].message)
    self.assertIn('all-gather forward and an all-reduce backward', message)
    self.assertIn('3(8-1)/8', message)
    self.assertIn('Z2 memory', message)
    self.assertLess(abs(loss - want_loss) / want_loss, 1e-5)

    kinds = dmuon_jax.analyze_compiled(compiled).bytes_by_kind
    payload, gathered = ded.dedication.gather_bytes()
    share = 7 / 8
    # What the warning says: one all-gather of the gathered group forward,
    # the Muon gradients in an all-reduce (2 (N-1)/N, with the AdamW
    # gradients: 4,193 elements of them at one block, the tied embedding
    # twice; 4,385 at four). The block's gate, up, down and kv kernels are
    # split over owners: their Gram exchange (collective-permutes) is the
    # update's.
    exchange = ded.dedication.exchange_bytes()
    self.assertGreater(exchange, 0)
    self.assertAlmostEqual(kinds['all-gather'], share * gathered, delta=1)
    self.assertNotIn('reduce-scatter', kinds)
    self.assertAlmostEqual(kinds['collective-permute'], exchange, delta=1)
    self.assertGreaterEqual(kinds['all-reduce'], 2 * share * payload)
    self.assertLessEqual(kinds['all-reduce'], 2 * share * (payload + 4 * 4400))


class NnxMistakeTest(absltest.TestCase):
  def test_hooks_carry_their_own_dedication(self):
    # Two models of one class dedicated apart: each boundary serves its
    # own model's dedication, with nothing registered by the library.
    models = [
      nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(i)), jnp.tanh)
      for i in range(2)
    ]
    x = jnp.ones((2, D))
    before = [m(x) for m in models]
    deds = [dflax.dedicate(m, None) for m in models]
    for m, ded, want in zip(models, deds, before):
      self.assertIs(m.layers[0].dmuon_hook.md, ded)
      np.testing.assert_allclose(m(x), want, rtol=1e-6)
    self.assertNotEqual(deds[0], deds[1])

  def test_tied_muon_target_is_named(self):
    class Tied(nnx.Module):
      def __init__(self, rngs):
        shared = nnx.Linear(D, D, rngs=rngs)
        self.layers = nnx.List([nnx.Sequential(shared), nnx.Sequential(shared)])

    with self.assertRaisesRegex(ValueError, r'layers/0.*kernel.*tied'):
      dflax.dedicate(Tied(nnx.Rngs(0)), make_mesh((1, 8)))

  def test_annotation_naming_an_owner_axis(self):
    mesh = make_mesh((1, 8), auto=True)
    # A spec, and (as nanodo writes it) a NamedSharding over the concrete
    # mesh, which raised JAX's "Axes mentioned in `manual_axis_type` ...".
    # train_step can't keep them in its manual step: it runs the step as
    # written under nnx.jit, warning what that costs on Auto owner axes
    # (before: an error asking to leave the axes out of the model).
    specs = (P(support.AXES), NamedSharding(mesh, P(support.AXES)))

    class Annotated(Decoder):
      def __call__(self, toks):
        x = self.embed(toks)
        for spec in specs:
          x = jax.lax.with_sharding_constraint(x, spec)
        for block in self.layers:
          x = block(x)
        return self.embed.attend(self.norm(x))

    model = make_model(False, depth=1, cls=Annotated)
    with jax.set_mesh(mesh):
      want = initial_loss(model)
    ded = dflax.dedicate(model, mesh, muon_weight_dimension_numbers=muon_dims)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
    with self.assertWarnsRegex(
      dmuon_jax.DMuonWarning,
      r'constrains activations over the owner axes.*plain nnx.jit instead, '
      r'with the same numbers.*all-reduces.*make the owner axes Explicit',
    ):
      got = dflax.train_step(ded)(train_step)(model, optimizer, tokens())
    self.assertAlmostEqual(float(got), want, delta=1e-5 * want)

  def test_explicit_annotations_naming_an_owner_axis(self):
    # On Explicit axes: jax.sharding.reshard, out_sharding= (here of a dot)
    # and jax.sharding.auto_axes (what nnx.Embed(...)(tokens,
    # out_sharding=...) runs) naming the owner axes raised JAX's "of type
    # Auto or Manual" / "Going from `Manual` AxisType to `Auto`". train_step
    # runs such a step under plain nnx.jit: on Explicit owner axes the
    # route at the floors, keeping every annotation, with no warning.
    annotate = (
      lambda x: jax.sharding.reshard(x, P(support.AXES)),
      lambda x: jnp.einsum(
        'bsd,de->bse', x, jnp.eye(D), out_sharding=P(support.AXES)
      ),
      lambda x: jax.sharding.auto_axes(
        lambda y: y * 1, out_sharding=P(support.AXES)
      )(x),
    )

    class Annotated(Decoder):
      def __call__(self, toks):
        x = self.embed(toks)
        for fn in annotate:
          x = fn(x)
        for block in self.layers:
          x = block(x)
        return self.embed.attend(self.norm(x))

    mesh = make_mesh((2, 4))
    model = make_model(False, depth=1, cls=Annotated)
    with jax.set_mesh(mesh):
      want = initial_loss(model)
    ded = dflax.dedicate(model, mesh, muon_weight_dimension_numbers=muon_dims)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
    with warnings.catch_warnings():
      warnings.simplefilter('error', dmuon_jax.DMuonWarning)
      got = dflax.train_step(ded)(train_step)(model, optimizer, tokens())
    self.assertAlmostEqual(float(got), want, delta=1e-5 * want)

  def test_eager_call_outside_any_mesh_context(self):
    # Evaluation outside train_step: the model gathers through the mesh it
    # was dedicated on, no warning (nothing is traced), same logits as the
    # plain model (jitted: it is the reference here). One block: the eager
    # ops are the same for every block.
    plain = make_model(False, depth=1)
    model = make_model(False, depth=1)
    dflax.dedicate(
      model, make_mesh((1, 8)), muon_weight_dimension_numbers=muon_dims
    )
    with warnings.catch_warnings():
      warnings.simplefilter('error', dmuon_jax.DMuonWarning)
      got = model(tokens())
    want = nnx.jit(lambda m, t: m(t))(plain, tokens())
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

  def test_boundary_without_muon_target(self):
    model = make_model(False)
    with self.assertRaisesRegex(ValueError, r"'embed'.*no Muon target"):
      dflax.dedicate(
        model,
        None,
        muon_weight_dimension_numbers=muon_dims,
        boundary_predicate=lambda path, _: (
          path == 'embed' or path.count('/') == 1 and path.startswith('layers/')
        ),
      )
    # A sibling below a module visited before (each block's mlp_norm, after
    # its attn): checked too.
    parts = ('attn', 'gate', 'up', 'down', 'mlp_norm')
    with self.assertRaisesRegex(ValueError, r"'layers/0/mlp_norm'.*no Muon"):
      dflax.dedicate(
        make_model(False),
        None,
        muon_weight_dimension_numbers=muon_dims,
        boundary_predicate=lambda path, _: (
          path.count('/') == 2 and path.split('/')[2] in parts
        ),
      )

  def test_dedicating_twice(self):
    model = make_model(False)
    dflax.dedicate(model, None, muon_weight_dimension_numbers=muon_dims)
    with self.assertRaisesRegex(ValueError, 'dedicated already'):
      dflax.dedicate(model, None, muon_weight_dimension_numbers=muon_dims)

  def test_scanned_stack_called_whole(self):
    model = make_model(True)
    dflax.dedicate(model, None, muon_weight_dimension_numbers=muon_dims)
    with self.assertRaisesRegex(ValueError, r"'layers'.*nnx.scan"):
      model.layers(jnp.ones((2, SEQ, D)))

  def test_scanned_stack_with_several_layers_per_gather(self):
    model = make_model(True)
    with self.assertRaisesRegex(ValueError, 'one layer per nnx.scan'):
      dflax.dedicate(
        model,
        None,
        muon_weight_dimension_numbers=muon_dims,
        layers_per_gather=2,
      )

  def test_optimizer_for_another_model(self):
    model = make_model(False)
    ded = dflax.dedicate(model, None, muon_weight_dimension_numbers=muon_dims)
    other = make_model(False)
    with self.assertRaisesRegex(ValueError, 'did not have at dmuon_jax.flax'):
      nnx.Optimizer(
        other, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
      )

  def test_plain_checkpoint_into_dedicated_model(self):
    plain = nnx.state(make_model(False), nnx.Param)
    model = make_model(False)
    dflax.dedicate(model, None, muon_weight_dimension_numbers=muon_dims)
    nnx.update(model, plain)  # the kernels' values land in the placeholders
    with self.assertRaisesRegex(ValueError, r'layers/0/attn/q/kernel.*plain'):
      model(tokens())


class DocsMistakeTableTest(absltest.TestCase):
  """Every row of ``docs/reference/dedicated_mistakes.md`` names tests that
  exist in this file, ``flax_linen_test.py``, ``flax_linen_scan_test.py``
  or the plain-jit route's ``flax_route_test.py``/
  ``flax_linen_route_test.py``, or ``boundaries_test.py``."""

  def test_every_row_names_tests_that_exist(self):
    root = pathlib.Path(__file__).resolve().parent
    table = (root.parent / 'docs/reference/dedicated_mistakes.md').read_text()
    sources = ''.join(
      (root / f).read_text()
      for f in (
        'flax_nnx_test.py',
        'flax_linen_test.py',
        'flax_linen_scan_test.py',
        'flax_route_test.py',
        'flax_linen_route_test.py',
        'boundaries_test.py',
      )
    )
    rows = [r for r in table.splitlines() if r.startswith('| ') and '::' in r]
    self.assertGreaterEqual(len(rows), 8)
    for row in rows:
      cls = None
      for name in re.findall(r'`(\w*)::(\w+)`', row.rsplit('|', 2)[1]):
        cls = name[0] or cls
        self.assertIn(f'class {cls}(', sources, row)
        self.assertIn(f'def {name[1]}(', sources, row)


class FlaxNnxGroupsTest(absltest.TestCase):
  def test_gemma_like_decoder_equals_single_device_optax(self):
    # Every Muon kernel split over 2 devices of 'shard' (owner groups), on
    # HSDP with Auto axes (NnxParityTest.test_auto_mesh_axes).
    want_params, want_losses = reference(False, AUTO_GROUPS[-1])
    run = dedicated(*AUTO_GROUPS)
    self.assertIn('k=2 devices', run['ded'].summary())
    nesting = run['nesting']
    self.assertEmpty([c for c in nesting if 'conditional' in c.context])
    chex.assert_trees_all_close(run['losses'], want_losses, rtol=1e-5)
    support.assert_trees_rel_close(self, run['params'], want_params, 1e-5)


if __name__ == '__main__':
  absltest.main()
