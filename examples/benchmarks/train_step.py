"""Train-step benchmark: FSDP AdamW vs Muon (optax, dmuon, dedicated Z2/Z3).

One full training step (forward + backward + optimizer update) of the same
small Llama-like language model (pure JAX; per layer q, k, v, o: d x d;
gate, up: d x d_ff; down: d_ff x d; two RMSNorm scales; plus embedding, final
norm and LM head; float32; causal attention with RoPE, SwiGLU MLP,
next-token cross-entropy on random tokens) on simulated CPU devices (mesh
1x8 by default, axes ``('replicate', 'shard')``), five configurations:

1. ``adamw_fsdp``: ``optax.adamw`` on FSDP-sharded params, written as an
   explicit ``jax.shard_map``: every leaf is stored sharded along its first
   dimension divisible by the device count, all-gathered inside the loss
   just before use (per layer), so that autodiff's transpose reduce-scatters
   the gradients; AdamW runs on the local shards. XLA keeps the gathered
   weights for the backward pass (2(N-1)/N*P bytes).
   ``adamw_fsdp_reshard``: the same, but each layer's weights are dropped
   after its forward and gathered again for its backward, as FSDP's default
   ``reshard_after_forward=True`` (3(N-1)/N*P; the same mechanism as
   dedicated Z3). This is the baseline of the byte targets.
2. ``optax_muon_fsdp``: ``optax.contrib.muon`` (its AdamW for the non-matrix
   leaves) under plain ``jax.jit``, params FSDP-sharded (same dimensions as
   1) on an Auto-axis mesh, batch sharded over both axes; XLA decides the
   collectives.
3. ``dmuon_dropin_fsdp``: ``dmuon_jax.dmuon`` in the same setting as 2.
4. ``dedicated_z2`` and 5. ``dedicated_z3``: dedicated ownership
   (``dmuon_jax.dedicate`` + ``dedicated_muon``), every Muon matrix stored
   only on its owner, gathered per group of ``--layers-per-gather`` layers
   inside the loss; Z2 keeps the gathered weights for the backward pass, Z3
   gathers them again. The other params (embedding, norms, head) keep the
   FSDP layout of 1 (``--dedicated-rest replicated``: replicated, gradients
   all-reduced). Explicit-axis mesh, ``shard_map`` train step.

All five start from the same params and train on the same batch (the same
number of steps), so their losses can be compared: 2-5 are the same
algorithm (Muon + AdamW) and agree closely; 1 is AdamW.

Per configuration: compile time, median step time (``block_until_ready``
after every step; the timed steps run round-robin over the configurations,
so that other processes on shared cores slow them alike), collective bytes
per device by kind (compiled HLO, ring model), peak memory per device (XLA's
memory analysis) and the loss. The JSON also has the matmul FLOPs per device
(``flops_per_device``: ``hlo_tools.dot_flops`` of the compiled step, forward,
backward and Newton-Schulz, each ``while`` loop body times its trip count, the
busiest ``lax.switch`` branch) and XLA's ``cost_analysis`` figure
(``xla_cost_analysis_flops``: elementwise work too, but a loop body counted
once).

    python examples/benchmarks/train_step.py            # ~2 min, 2 cores
    python examples/benchmarks/train_step.py --quick    # < 90 s (CI)

Writes ``results/<name>.json`` (one JSON object per line) and
``results/<name>.md`` next to this file (or under ``--out-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import pathlib
import statistics
import sys
import time

# Shared helpers (machine description, CPU meter, collective abbreviations).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position

KIND_ABBREV = _common.KIND_ABBREV

CONFIGS = (
  'adamw_fsdp',
  'adamw_fsdp_reshard',
  'adamw_fsdp_jit',
  'optax_muon_fsdp',
  'dmuon_dropin_fsdp',
  'dedicated_z2',
  'dedicated_z3',
)
# FSDP as FSDP2 runs it by default (reshard_after_forward=True): the design's
# 3(N-1)/N*P. Plain adamw_fsdp lets XLA keep the gathered weights instead.
BASELINE = 'adamw_fsdp_reshard'
# Targets: dedicated Z3's total collective bytes at most 1.10x FSDP AdamW's;
# dedicated Z2's strictly below FSDP AdamW's.
TARGET_Z3_VS_FSDP = 1.10
TARGET_Z2_VS_FSDP = 1.0
# Drop-in dmuon under plain jit moves the plain-jit AdamW row's bytes plus
# its owner all-to-alls, as the state's layout predicts them (within 5%).
TARGET_DROPIN_EXTRA = 0.05

MUON_LR = 0.02
ADAM_LR = 3e-3
QUICK = {
  'layers': 2,
  'd_model': 32,
  'd_ff': 128,
  'heads': 4,
  'vocab': 64,
  'seq': 16,
  'batch': 8,
  'reps': 2,
  'warmup': 1,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=_common.HelpFormatter,
  )
  p.add_argument(
    '--layers', type=int, default=4, help='transformer layers (--quick: 2)'
  )
  p.add_argument(
    '--d-model', type=int, default=256, help='model width (--quick: 32)'
  )
  p.add_argument(
    '--d-ff',
    type=int,
    default=1024,
    help='MLP width; 4 x d-model packs two layers per gather '
    '(8 d x d and 6 d x 4d matrices) onto 8 owners with no '
    'padding (--quick: 128)',
  )
  p.add_argument('--heads', type=int, default=4, help='attention heads')
  p.add_argument(
    '--vocab', type=int, default=512, help='vocabulary (--quick: 64)'
  )
  p.add_argument(
    '--seq', type=int, default=64, help='sequence length (--quick: 16)'
  )
  p.add_argument(
    '--batch',
    type=int,
    default=16,
    help='global batch (sequences), divisible by the devices (--quick: 8)',
  )
  p.add_argument(
    '--mesh', default='1,8', help='replicate,shard (or RxS), e.g. 1,8 2,4 8,1'
  )
  p.add_argument(
    '--layers-per-gather',
    type=int,
    default=2,
    help='dedicated configs: layers gathered together (K)',
  )
  p.add_argument(
    '--dedicated-rest',
    choices=('fsdp', 'replicated'),
    default='fsdp',
    help='dedicated configs: layout of the non-Muon params '
    '(embed, norms, head): FSDP-sharded like adamw_fsdp '
    '(gathered in the loss, gradients reduce-scattered) or '
    'replicated (gradients all-reduced)',
  )
  p.add_argument(
    '--reps',
    type=int,
    default=10,
    help='timed steps per configuration (median reported; --quick: 2)',
  )
  p.add_argument(
    '--warmup',
    type=int,
    default=2,
    help='untimed steps after compilation (--quick: 1)',
  )
  p.add_argument(
    '--only',
    default=None,
    help='comma-separated config names to run (debugging; unset: all)',
  )
  _common.add_common_args(
    p, 'train_step', 'tiny model, few reps: a CI smoke run (< 90 s)'
  )
  args = p.parse_args(argv)
  _common.apply_quick(p, args, argv, QUICK)
  if args.name is None:
    args.name = 'train_step_quick' if args.quick else 'train_step'
  if args.out_dir is None:
    args.out_dir = str(pathlib.Path(__file__).resolve().parent / 'results')
  return args


def parse_mesh(text: str) -> tuple[int, int]:
  sep = ',' if ',' in text else 'x'
  r, s = (int(v) for v in text.lower().split(sep))
  return r, s


# ---------------------------------------------------------------------------
# Model (pure JAX, functional).


def layer_name(i: int) -> str:
  return f'layers_{i}'


def param_shapes(layers: int, d: int, d_ff: int, vocab: int) -> dict:
  layer = {
    'q': (d, d),
    'k': (d, d),
    'v': (d, d),
    'o': (d, d),
    'gate': (d, d_ff),
    'up': (d, d_ff),
    'down': (d_ff, d),
    'norm1': (d,),
    'norm2': (d,),
  }
  shapes = {'embed': (vocab, d), 'norm': (d,), 'head': (d, vocab)}
  shapes.update({layer_name(i): dict(layer) for i in range(layers)})
  return shapes


def init_params(shapes: dict, seed: int):
  """Host (numpy) params: N(0, 0.02) matrices, unit norm scales."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)

  def one(path, shape):
    if len(shape) == 1:
      return np.ones(shape, np.float32)
    std = 0.02
    if path[-1] in ('o', 'down'):  # residual outputs, GPT-2 style
      std = 0.02 / math.sqrt(2 * sum(k.startswith('layers_') for k in shapes))
    return (std * rng.standard_normal(shape)).astype(np.float32)

  def walk(tree, path):
    return {
      k: walk(v, path + (k,)) if isinstance(v, dict) else one(path + (k,), v)
      for k, v in sorted(tree.items())
    }

  return walk(shapes, ())


def build_model(jnp, jax, heads: int):
  """(block_fn, lm_loss) closures over the jax modules."""

  def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

  def rope(x):
    t, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

  def block_fn(p, x):
    """One pre-norm Llama block: causal attention (RoPE) + SwiGLU MLP."""
    b, t, d = x.shape
    h = rms_norm(x, p['norm1'])
    q, k, v = ((h @ p[n]).reshape(b, t, heads, d // heads) for n in 'qkv')
    q, k = rope(q), rope(k)
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    a = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(s, -1), v)
    x = x + a.reshape(b, t, d) @ p['o']
    h = rms_norm(x, p['norm2'])
    return x + (jax.nn.silu(h @ p['gate']) * (h @ p['up'])) @ p['down']

  def lm_loss(get, blocks, tokens):
    """Next-token cross-entropy.

    Args:
      get: ``name -> array`` for the top-level leaves (embed, norm, head).
      blocks: ``x -> x``, all transformer blocks.
      tokens: ``(batch, seq + 1)`` int tokens.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = jnp.take(get('embed'), inputs, axis=0)
    x = blocks(x)
    logits = rms_norm(x, get('norm')) @ get('head')
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

  return block_fn, lm_loss


# ---------------------------------------------------------------------------
# Measurement.


class CpuShare:
  """Share of all CPUs other processes used, over a config's steps only.

  Accumulates ``/proc/stat`` busy time minus this process's CPU time over
  the intervals between ``start()`` and ``stop()`` (the steps of one
  configuration, interleaved with the others'). None where ``/proc/stat``
  is unavailable or the steps took under 0.5 s in all.
  """

  def __init__(self):
    self._wall = self._other = 0.0
    self._ok = True

  def start(self):
    return _common.cpu_sample()

  def stop(self, sample):
    (w0, b0, o0), (w1, b1, o1) = sample, _common.cpu_sample()
    if b0 is None or b1 is None:
      self._ok = False
      return
    self._wall += w1 - w0
    self._other += (b1 - b0) - (o1 - o0)

  def share(self) -> float | None:
    if not self._ok or self._wall < 0.5:
      return None
    share = self._other / (self._wall * (os.cpu_count() or 1))
    return round(min(max(share, 0.0), 1.0), 3)


# ---------------------------------------------------------------------------
# Formatting.


def fmt_collectives(bytes_by_kind: dict, digits: int = 2) -> str:
  parts = [
    f'{KIND_ABBREV.get(k, k)} {v / 1e6:.{digits}f}'
    for k, v in sorted(bytes_by_kind.items())
    if v
  ]
  return ', '.join(parts) if parts else '–'


def fmt_count(count_by_kind: dict) -> str:
  parts = [
    f'{KIND_ABBREV.get(k, k)} {v}'
    for k, v in sorted(count_by_kind.items())
    if v
  ]
  return ', '.join(parts) if parts else '–'


# ---------------------------------------------------------------------------
# Main.


def main(argv=None):  # pylint: disable=too-many-locals,too-many-statements
  args = parse_args(argv)
  wall_start = time.perf_counter()
  r, s = parse_mesh(args.mesh)
  n_dev = r * s
  if args.batch % n_dev:
    sys.exit(f'--batch {args.batch} must be divisible by {n_dev} devices')

  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_num_cpu_devices', n_dev)
  jax.config.update('jax_platforms', 'cpu')
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top

  # The Z3 re-gather of dedicated mode, reused for the FSDP baseline.
  from dmuon_jax._gather import regather_in_backward  # pylint: disable=g-import-not-at-top

  if jax.device_count() != n_dev:
    sys.exit(f'expected {n_dev} devices, got {jax.device_count()}')
  axes = ('replicate', 'shard')
  # Configs 1-3: Auto axes (XLA chooses the shardings inside the jitted
  # step). Configs 4-5: Explicit axes, as dedicated ownership is tested.
  auto_mesh = jax.make_mesh(
    (r, s), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  explicit_mesh = jax.make_mesh((r, s), axes)
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
  machine = _common.machine_info(jax, optax, dmuon_jax)
  load_start = _common.load_average()
  model = {
    'layers': args.layers,
    'd_model': args.d_model,
    'd_ff': args.d_ff,
    'heads': args.heads,
    'vocab': args.vocab,
    'seq': args.seq,
    'global_batch': args.batch,
    'dtype': 'float32',
    'mesh': f'{r}x{s}',
    'layers_per_gather': args.layers_per_gather,
    'dedicated_rest': args.dedicated_rest,
  }

  shapes = param_shapes(args.layers, args.d_model, args.d_ff, args.vocab)
  host_params = init_params(shapes, args.seed)
  rng = np.random.default_rng(args.seed + 1)
  host_tokens = rng.integers(
    0, args.vocab, (args.batch, args.seq + 1), dtype=np.int32
  )
  block_fn, lm_loss = build_model(jnp, jax, args.heads)
  names = [layer_name(i) for i in range(args.layers)]

  labels = dmuon_jax.muon_labels(host_params)
  leaf_bytes = {'muon': 0, 'adam': 0}
  for lbl, x in zip(
    jax.tree.leaves(labels), jax.tree.leaves(host_params), strict=True
  ):
    leaf_bytes[lbl] += x.nbytes
  n_muon = sum(lbl == 'muon' for lbl in jax.tree.leaves(labels))
  p_all = leaf_bytes['muon'] + leaf_bytes['adam']
  p_muon, p_rest = leaf_bytes['muon'], leaf_bytes['adam']
  n_params = sum(x.size for x in jax.tree.leaves(host_params))
  if n_muon != 7 * args.layers:
    print(f'warning: {n_muon} Muon matrices, expected {7 * args.layers}')

  # --- FSDP layout: first dimension divisible by the device count ----------
  def fsdp_dim(x):
    # -1: no dimension divides, the leaf stays replicated.
    return next((i for i, n in enumerate(np.shape(x)) if n % n_dev == 0), -1)

  dims = jax.tree.map(fsdp_dim, host_params)

  def fsdp_spec(dim):
    if dim < 0:
      return P()
    return P(*([None] * dim + [axes]))

  fsdp_specs = jax.tree.map(fsdp_spec, dims)

  def place_fsdp(mesh):
    return jax.tree.map(
      lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
      host_params,
      fsdp_specs,
    )

  def on_mesh(tree, mesh):
    """Optimizer state on the mesh (scalars from init sit on one device)."""

    def put(x):
      if isinstance(x, jax.Array) and len(x.sharding.device_set) < n_dev:
        return jax.device_put(x, NamedSharding(mesh, P()))
      return x

    return jax.tree.map(put, tree)

  def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)

  def muon_dims(lbls):
    return jax.tree.map(
      lambda lbl: dmuon_jax.MuonDimensionNumbers() if lbl == 'muon' else None,
      lbls,
    )

  def plain_loss(params, tokens):
    def blocks(x):
      for name in names:
        x = block_fn(params[name], x)
      return x

    return lm_loss(lambda k: params[k], blocks, tokens)

  # --- 1. adamw_fsdp: explicit shard_map, gather per layer -----------------
  def make_adamw_fsdp(reshard):
    mesh = auto_mesh
    opt = optax.adamw(ADAM_LR)
    params = place_fsdp(mesh)
    state = on_mesh(opt.init(params), mesh)
    state_specs = dmuon_jax.Dedication.specs_of(state)

    def gather(x, dim):
      if dim < 0:
        return x
      return jax.lax.all_gather(x, axes, axis=dim, tiled=True)

    def run_layer(name, local, x):
      tree = jax.tree.structure(params[name])
      layer = jax.tree.map(gather, jax.tree.unflatten(tree, local), dims[name])
      return block_fn(layer, x)

    def loss_fn(params, tokens):
      def blocks(x):
        for name in names:
          run = functools.partial(run_layer, name)
          if reshard:  # drop the gathered layer, gather again in backward
            run = regather_in_backward(
              run, jax.checkpoint_policies.dots_saveable
            )
          x = run(jax.tree.leaves(params[name]), x)
        return x

      return lm_loss(lambda k: gather(params[k], dims[k]), blocks, tokens)

    def body(params, state, tokens):
      loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(params, tokens)
      # Sharded leaves: the all-gather's transpose summed the per-device
      # gradients into the owner's shard. Replicated ones: per device.
      grads = jax.tree.map(
        lambda g, dim: g / n_dev if dim >= 0 else jax.lax.pmean(g, axes),
        grads,
        dims,
      )
      updates, state = opt.update(grads, state, params)
      return (
        optax.apply_updates(params, updates),
        state,
        jax.lax.pmean(loss, axes),
      )

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(fsdp_specs, state_specs, P(axes)),
        out_specs=(fsdp_specs, state_specs, P()),
      ),
      donate_argnums=(0, 1),
    )
    tokens = jax.device_put(host_tokens, NamedSharding(mesh, P(axes)))
    return step, params, state, tokens, {}

  # --- 2./3. plain jit on FSDP-placed params -------------------------------
  def make_plain(family):
    mesh = auto_mesh
    if family == 'adamw':
      opt = optax.adamw(ADAM_LR)
    elif family == 'optax':
      opt = optax.contrib.muon(
        MUON_LR,
        adam_learning_rate=ADAM_LR,
        muon_weight_dimension_numbers=muon_dims(labels),
      )
    else:
      opt = dmuon_jax.dmuon(MUON_LR, adam_learning_rate=ADAM_LR, mesh=mesh)
    params = place_fsdp(mesh)
    state = on_mesh(opt.init(params), mesh)  # eager: records shardings

    def fn(params, state, tokens):
      loss, grads = jax.value_and_grad(plain_loss)(params, tokens)
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    step = jax.jit(
      fn,
      out_shardings=(
        shardings_of(params),
        shardings_of(state),
        NamedSharding(mesh, P()),
      ),
      donate_argnums=(0, 1),
    )
    tokens = jax.device_put(host_tokens, NamedSharding(mesh, P(axes)))
    info = {}
    if family == 'dmuon':
      # The owner all-to-alls the state's layout predicts (from the params'
      # shardings it recorded at init).
      (layout,) = dmuon_jax.owner_layouts(state)
      info = {
        'predicted_update_bytes': layout.collective_bytes(),
        'layout': layout.name,
      }
    return step, params, state, tokens, info

  # --- 4./5. dedicated ownership -------------------------------------------
  def make_dedicated(z3):
    mesh = explicit_mesh
    k = args.layers_per_gather
    # The non-Muon params keep the layout they have here (dedicate reads
    # it); the Muon targets move to their owners.
    if args.dedicated_rest == 'fsdp':
      placed = place_fsdp(mesh)
    else:
      placed = jax.device_put(host_params, NamedSharding(mesh, P()))
    ded = dmuon_jax.dedicate(
      placed, mesh, reshard_after_forward=z3, layers_per_gather=k
    )
    dp = ded.to_dedicated(placed)
    del placed
    opt = dmuon_jax.dedicated_muon(ded, MUON_LR, adam_learning_rate=ADAM_LR)
    state = opt.init(dp)
    run_blocks = ded.sequential(block_fn, names)

    def loss_fn(dp, tokens):
      rest = ded.gather_rest(dp)  # embed, final norm, head (whole)
      return lm_loss(
        lambda name: rest[name], lambda x: run_blocks(dp, x), tokens
      )

    def body(dp, state, tokens):
      loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(dp, tokens)
      updates, state = opt.update(grads, state, dp)
      return (
        optax.apply_updates(dp, updates),
        state,
        jax.lax.pmean(loss, axes),
      )

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(ded.specs(), ded.specs_of(state), P(axes)),
        out_specs=(ded.specs(), ded.specs_of(state), P()),
      ),
      donate_argnums=(0, 1),
    )
    tokens = jax.device_put(host_tokens, NamedSharding(mesh, P(axes)))
    payload, gathered = ded.gather_bytes()
    info = {
      'summary': ded.summary(),
      'gather_payload_bytes': payload,
      'gather_gathered_bytes': gathered,
      'padding': gathered / max(payload, 1) - 1,
      'groups': [[ded.boundaries.names[b] for b in g] for g in ded.groups],
    }
    return step, dp, state, tokens, info

  makers = {
    'adamw_fsdp': lambda: make_adamw_fsdp(False),
    'adamw_fsdp_reshard': lambda: make_adamw_fsdp(True),
    'adamw_fsdp_jit': lambda: make_plain('adamw'),
    'optax_muon_fsdp': lambda: make_plain('optax'),
    'dmuon_dropin_fsdp': lambda: make_plain('dmuon'),
    'dedicated_z2': lambda: make_dedicated(False),
    'dedicated_z3': lambda: make_dedicated(True),
  }
  descriptions = {
    'adamw_fsdp': 'optax.adamw, FSDP params, shard_map (gather per layer '
    'in the loss)',
    'adamw_fsdp_reshard': 'optax.adamw, FSDP params, shard_map, layer '
    'weights gathered again in backward',
    'adamw_fsdp_jit': 'optax.adamw, FSDP params, plain jit (XLA reduces '
    'the gradients)',
    'optax_muon_fsdp': 'optax.contrib.muon, FSDP params, plain jit',
    'dmuon_dropin_fsdp': 'dmuon drop-in, FSDP params, plain jit',
    'dedicated_z2': 'dedicated ownership Z2 (keep gathered weights), '
    f'shard_map, non-Muon params {args.dedicated_rest}',
    'dedicated_z3': 'dedicated ownership Z3 (re-gather in backward), '
    f'shard_map, non-Muon params {args.dedicated_rest}',
  }
  configs = list(CONFIGS)
  if args.only:
    wanted = set(args.only.split(','))
    configs = [c for c in configs if c in wanted]

  print(
    f'machine: {machine["cpu_count"]} CPUs ({machine["cpu_model"]}), '
    f'{n_dev} simulated devices (mesh {r}x{s}), jax {machine["jax"]}; '
    f'load average {load_start}'
  )
  print(
    f'model: {args.layers} layers, d {args.d_model}, d_ff {args.d_ff}, '
    f'heads {args.heads}, vocab {args.vocab}, seq {args.seq}, global '
    f'batch {args.batch}; {n_params / 1e6:.2f}M params '
    f'(P = {p_all / 1e6:.2f} MB), {n_muon} Muon matrices '
    f'(P_M = {p_muon / 1e6:.2f} MB), rest {p_rest / 1e6:.2f} MB'
  )

  # Phase 1: build and compile every config. Phase 2: warm-up steps.
  # Phase 3: timed steps interleaved round-robin over the configs, so that
  # other processes on the shared cores slow all of them alike. Phase 4: the
  # loss at the final params.
  runs = {}
  dedicated_info = {}
  dropin_info = {}
  for name in configs:
    step, a, b, tokens, info = makers[name]()
    if 'predicted_update_bytes' in info:
      dropin_info[name] = info
      print(
        f'{name}: layout {info["layout"]} predicts update bytes '
        f'{info["predicted_update_bytes"]}'
      )
    elif info:
      dedicated_info[name] = info
      print(info['summary'])
      print(
        f'gather_bytes(): payload {info["gather_payload_bytes"]}, '
        f'gathered {info["gather_gathered_bytes"]} (padding '
        f'{100 * info["padding"]:.1f}%)'
      )
    t0 = time.perf_counter()
    lowered = step.lower(a, b, tokens)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    report = dmuon_jax.analyze_compiled(compiled)
    runs[name] = {
      'compiled': compiled,
      'a': a,
      'b': b,
      'tokens': tokens,
      'report': report,
      'flops': _common.flop_counts(compiled, report),
      'lower_s': t1 - t0,
      'compile_s': t2 - t1,
      'losses': [],
      'times': [],
      'cpu': CpuShare(),
    }
    print(f'{name:>18}: compiled in {t2 - t0:.1f} s', flush=True)
    del step, lowered

  def one_step(run, timed):
    t = time.perf_counter()
    sample = run['cpu'].start()
    run['a'], run['b'], loss = run['compiled'](
      run['a'], run['b'], run['tokens']
    )
    jax.block_until_ready((run['a'], run['b'], loss))
    run['cpu'].stop(sample)
    if timed:
      run['times'].append(time.perf_counter() - t)
    else:
      run.setdefault('first_ms', 1e3 * (time.perf_counter() - t))
    run['losses'].append(float(loss))

  for run in runs.values():
    for _ in range(max(args.warmup, 1)):
      one_step(run, timed=False)
  for _ in range(args.reps):
    for run in runs.values():
      one_step(run, timed=True)

  results = {}
  for name, run in runs.items():
    # The loss at the params after all the steps above (one more forward,
    # its update discarded).
    _, _, final = run['compiled'](run['a'], run['b'], run['tokens'])
    final_loss = float(final)
    report, times, losses = run['report'], run['times'], run['losses']
    other_cpu = run['cpu'].share()
    bytes_by_kind = {k: float(v) for k, v in report.bytes_by_kind.items()}
    count_by_kind = {k: int(v) for k, v in report.count_by_kind.items()}
    res = {
      'config': name,
      'description': descriptions[name],
      'median_ms': 1e3 * statistics.median(times),
      'min_ms': 1e3 * min(times),
      'times_ms': [1e3 * t for t in times],
      'first_step_ms': run['first_ms'],
      'other_processes_cpu_share': other_cpu,
      'reps': len(times),
      'warmup': max(args.warmup, 1),
      'lower_s': run['lower_s'],
      'compile_s': run['compile_s'],
      **run['flops'],
      'collective_bytes_by_kind': bytes_by_kind,
      'collective_count_by_kind': count_by_kind,
      'collective_bytes_total': float(report.total_bytes()),
      'peak_bytes_per_device': report.peak_bytes,
      'argument_bytes': report.argument_bytes,
      'output_bytes': report.output_bytes,
      'temp_bytes': report.temp_bytes,
      'alias_bytes': report.alias_bytes,
      'initial_loss': losses[0],
      'losses': losses,
      'final_loss': final_loss,
      'steps_before_final_loss': len(losses),
    }
    results[name] = res
    peak = report.peak_bytes
    print(
      f'{name:>18}: {res["median_ms"]:8.1f} ms median of {len(times)}, '
      f'compile {res["lower_s"] + res["compile_s"]:5.1f} s, collectives '
      f'{fmt_collectives(bytes_by_kind)} MB (total '
      f'{res["collective_bytes_total"] / 1e6:.2f} MB; '
      f'{fmt_count(count_by_kind)} ops), peak '
      f'{"n/a" if peak is None else f"{peak / 2**20:.1f} MiB"}, loss '
      f'{losses[0]:.4f} -> {final_loss:.4f}; others used '
      f'{_common.fmt_share(other_cpu)} of the CPUs',
      flush=True,
    )
  del runs

  # --- Predictions and targets ----------------------------------------------
  ring = (n_dev - 1) / n_dev
  gathered_m = p_muon
  if dedicated_info:
    gathered_m = next(iter(dedicated_info.values()))['gather_gathered_bytes']
  predicted = {
    'adamw_fsdp': {'regather': 3 * ring * p_all, 'keep': 2 * ring * p_all},
    'dedicated_z2': 2 * ring * p_muon + 2 * ring * p_rest,
    'dedicated_z3': 3 * ring * p_muon + 2 * ring * p_rest,
    'dedicated_z2_padded': 2 * ring * gathered_m + 2 * ring * p_rest,
    'dedicated_z3_padded': 3 * ring * gathered_m + 2 * ring * p_rest,
  }

  def total(name):
    return results[name]['collective_bytes_total'] if name in results else None

  targets = []

  def target(label, name, goal, strict):
    base, val = total(BASELINE), total(name)
    ratio = None if base is None or val is None or not base else val / base
    met = None
    if ratio is not None:
      met = ratio < goal if strict else ratio <= goal
    targets.append(
      {
        'target': label,
        'config': name,
        'ratio': ratio,
        'goal': goal,
        'strict': strict,
        'met': met,
      }
    )

  target(
    f'dedicated Z3 total collective bytes / {BASELINE}',
    'dedicated_z3',
    TARGET_Z3_VS_FSDP,
    False,
  )
  target(
    f'dedicated Z2 total collective bytes / {BASELINE}',
    'dedicated_z2',
    TARGET_Z2_VS_FSDP,
    True,
  )
  if 'dmuon_dropin_fsdp' in results and 'adamw_fsdp_jit' in results:
    # What drop-in dmuon adds to plain-jit AdamW: its owner all-to-alls
    # (all-gathers for replicated params), against the layout's prediction.
    ours = results['dmuon_dropin_fsdp']['collective_bytes_by_kind']
    base = results['adamw_fsdp_jit']['collective_bytes_by_kind']
    pred = dropin_info['dmuon_dropin_fsdp']['predicted_update_bytes']
    extra = {
      k: ours.get(k, 0.0) - base.get(k, 0.0) for k in set(ours) | set(base)
    }
    moved = extra.get('all-to-all', 0.0) + extra.get('all-gather', 0.0)
    want = sum(pred.values())
    ratio = moved / want if want else None
    # Besides the routes, only scalars may differ: the non-finite policy's
    # "all finite?" flags (a few all-reduces of single values).
    others = {
      k: v
      for k, v in extra.items()
      if k not in ('all-to-all', 'all-gather') and abs(v) > 1024
    }
    met = (
      ratio is not None and abs(ratio - 1) <= TARGET_DROPIN_EXTRA and not others
    )
    targets.append(
      {
        'target': "dmuon_dropin_fsdp - adamw_fsdp_jit bytes / the layout's "
        'predicted owner all-to-alls',
        'config': 'dmuon_dropin_fsdp',
        'ratio': ratio,
        'goal': 1 + TARGET_DROPIN_EXTRA,
        'strict': False,
        'met': met,
        'extra_bytes_by_kind': extra,
        'predicted': pred,
      }
    )
  for t in targets:
    rel = '<' if t['strict'] else '≤'
    mark = {True: 'PASS', False: 'MISS', None: 'not measured'}[t['met']]
    val = '–' if t['ratio'] is None else f'{t["ratio"]:.4f}x'
    print(
      f'target: {t["target"]} = {val} (goal {rel} {t["goal"]:.2f}x): {mark}'
    )
  print(
    f'predicted bytes / device (ring model, N={n_dev}): FSDP AdamW '
    f'3(N-1)/N*P = {predicted["adamw_fsdp"]["regather"] / 1e6:.2f} MB '
    f'(2(N-1)/N*P = {predicted["adamw_fsdp"]["keep"] / 1e6:.2f} MB if '
    f'the gathered weights are kept); Z2 2(N-1)/N*P_M + rest = '
    f'{predicted["dedicated_z2"] / 1e6:.2f} MB; Z3 3(N-1)/N*P_M + rest = '
    f'{predicted["dedicated_z3"] / 1e6:.2f} MB (rest: the AdamW leaves, '
    f'2(N-1)/N*{p_rest / 1e6:.2f} MB: all-gather + reduce-scatter if '
    'sharded, all-reduce if replicated)'
  )

  wall_s = time.perf_counter() - wall_start
  machine.update(
    {
      'load_average_start': load_start,
      'load_average_end': _common.load_average(),
    }
  )
  sizes = {
    'params': n_params,
    'param_bytes': p_all,
    'muon_matrices': n_muon,
    'muon_bytes': p_muon,
    'rest_bytes': p_rest,
  }

  md = render_markdown(
    args,
    date,
    machine,
    model,
    sizes,
    results,
    dedicated_info,
    predicted,
    targets,
    wall_s,
  )
  common = {
    'date': date,
    'machine': machine,
    'model': model,
    'benchmark': 'train_step',
    'quick': args.quick,
  }
  lines = [
    dict(common, **res, dedication=dedicated_info.get(res['config']))
    for res in results.values()
  ]
  lines.append(
    dict(
      common,
      config='summary',
      wall_s=wall_s,
      sizes=sizes,
      predicted_bytes=predicted,
      targets=targets,
    )
  )
  _common.write_results(args.out_dir, args.name, lines, md, wall_s)
  return lines


def render_markdown(
  args,
  date,
  machine,
  model,
  sizes,
  results,
  dedicated_info,
  predicted,
  targets,
  wall_s,
) -> str:
  """The table, targets and notes as markdown."""
  base = results.get(BASELINE)
  out = ['# Train step: FSDP AdamW vs Muon (optax, dmuon, dedicated Z2/Z3)', '']
  out.append(
    f'- date: {date}; wall time of the run {wall_s:.0f} s'
    f'{" (--quick)" if args.quick else ""}'
  )
  out.append(
    f'- machine: {machine["platform"]}, {machine["cpu_count"]} CPUs '
    f'({machine["cpu_model"]}), {machine["devices"]} simulated XLA:CPU '
    f'devices (mesh {model["mesh"]}, replicate x shard); load average at '
    f'start {machine["load_average_start"]}, at end '
    f'{machine["load_average_end"]}'
  )
  if args.quick:
    out.append(
      '- **--quick**: a tiny model for a CI smoke run; times and '
      'PASS/MISS here mean little'
    )
  out.append(
    f'- software: python {machine["python"]}, jax {machine["jax"]}, '
    f'jaxlib {machine["jaxlib"]}, optax {machine["optax"]}, dmuon_jax '
    f'{machine["dmuon_jax"]}'
  )
  out.append(
    f'- model: Llama-like, {model["layers"]} layers, d_model '
    f'{model["d_model"]}, d_ff {model["d_ff"]} (SwiGLU), {model["heads"]} '
    f'heads (RoPE), vocab {model["vocab"]}, seq {model["seq"]}, global '
    f'batch {model["global_batch"]}, float32; {sizes["params"] / 1e6:.3f}M '
    f'params, P = {sizes["param_bytes"] / 1e6:.2f} MB; '
    f'{sizes["muon_matrices"]} Muon matrices (default routing), P_M = '
    f'{sizes["muon_bytes"] / 1e6:.2f} MB; AdamW leaves (embed, head, norms)'
    f' {sizes["rest_bytes"] / 1e6:.2f} MB'
  )
  out.append(
    f'- optimizers: Muon lr {MUON_LR}, AdamW lr {ADAM_LR} (AdamW for the '
    'non-Muon leaves in 2-5, for everything in 1)'
  )
  out.append(
    f'- timing: median of {args.reps} steps after {max(args.warmup, 1)} '
    'warm-up step(s), `block_until_ready` after each, the timed steps '
    'interleaved round-robin over the configs (other processes on the '
    'shared cores slow them alike); compile = lower + compile; params and '
    'optimizer state donated and fed back; same batch every step. '
    '"others\' CPU": share of all CPUs used by other processes during the '
    "config's own steps (/proc/stat busy time minus this process's; "
    'n/a under 0.5 s)'
  )
  if dedicated_info:
    info = next(iter(dedicated_info.values()))
    groups = '; '.join(', '.join(g) for g in info['groups'])
    out.append(
      '- dedicated: non-Muon params (embed, norms, head) '
      + (
        'FSDP-sharded as in `adamw_fsdp` (gathered in the loss with '
        '`ded.gather_rest` and inside the blocks; gradients '
        'reduce-scattered)'
        if args.dedicated_rest == 'fsdp'
        else 'replicated (gradients all-reduced)'
      )
      + f'; {args.layers_per_gather} layer(s) per gather (groups: '
      f'{groups}); `gather_bytes()` = (payload '
      f'{info["gather_payload_bytes"]}, gathered '
      f'{info["gather_gathered_bytes"]}): padding '
      f'{100 * info["padding"]:.1f}%'
    )
  out.append('')
  out.append(
    "| config | median ms | others' CPU | compile s | "
    f'collective MB / device | total MB | ratio vs {BASELINE} | '
    'peak MiB / device | final loss |'
  )
  out.append('|---|---:|---:|---:|---|---:|---:|---:|---:|')
  for name, res in results.items():
    ratio = (
      '–'
      if base is None or not base['collective_bytes_total']
      else f'{res["collective_bytes_total"] / base["collective_bytes_total"]:.3f}x'
    )  # pylint: disable=line-too-long
    peak = res['peak_bytes_per_device']
    out.append(
      f'| `{name}` | {res["median_ms"]:.1f} | '
      f'{_common.fmt_share(res["other_processes_cpu_share"])} | '
      f'{res["lower_s"] + res["compile_s"]:.1f} | '
      f'{fmt_collectives(res["collective_bytes_by_kind"])} | '
      f'{res["collective_bytes_total"] / 1e6:.2f} | {ratio} | '
      f'{"–" if peak is None else f"{peak / 2**20:.1f}"} | '
      f'{res["final_loss"]:.4f} |'
    )
  out.append('')
  out.append(
    'Collective ops per step (executions): '
    + '; '.join(
      f'`{name}` {fmt_count(res["collective_count_by_kind"])}'
      for name, res in results.items()
    )
    + '.'
  )
  if results:
    first = next(iter(results.values()))
    out.append(
      f'Loss at the start {first["initial_loss"]:.4f} (every config); '
      f'final loss after {first["steps_before_final_loss"]} steps.'
    )
  muon_losses = [
    res['final_loss']
    for name, res in results.items()
    if not name.startswith('adamw')
  ]
  if len(muon_losses) > 1:
    out.append(
      f'Muon configs (2-5, same algorithm) final losses agree to '
      f'{max(muon_losses) - min(muon_losses):.1e} (max - min).'
    )
  for name in ('adamw_fsdp', 'adamw_fsdp_reshard'):
    if name not in results:
      continue
    ag = results[name]['collective_bytes_by_kind'].get('all-gather', 0.0)
    rs = results[name]['collective_bytes_by_kind'].get('reduce-scatter', 0.0)
    if rs:
      kept = abs(ag / rs - 1) < 0.05
      out.append(
        f'`{name}`: all-gather / reduce-scatter bytes = {ag / rs:.2f}, '
        + (
          'i.e. XLA kept the gathered weights for the backward pass (no '
          're-gather): it moves 2(N−1)/N·P, the bytes of dedicated Z2, '
          'not the 3(N−1)/N·P of FSDP that reshards after the forward.'
          if kept
          else 'i.e. the backward pass gathers the weights '
          'again (FSDP resharding after the forward).'
        )
      )
  out.append('')
  out.append('## Targets')
  out.append('')
  for t in targets:
    rel = '<' if t['strict'] else '≤'
    mark = {True: 'PASS', False: 'MISS', None: 'not measured'}[t['met']]
    val = '–' if t['ratio'] is None else f'{t["ratio"]:.4f}x'
    out.append(
      f'- {t["target"]}: {val} (goal {rel} {t["goal"]:.2f}x) — **{mark}**'
    )
  out.append('')
  out.append('## Predicted collective bytes per device (ring model)')
  out.append('')
  n = machine['devices']
  out.append(
    f'N = {n}. FSDP AdamW 3(N−1)/N·P = '
    f'{predicted["adamw_fsdp"]["regather"] / 1e6:.2f} MB (forward gather, '
    f'backward re-gather, gradient reduce-scatter; 2(N−1)/N·P = '
    f'{predicted["adamw_fsdp"]["keep"] / 1e6:.2f} MB if the gathered '
    f'weights are kept for the backward pass). Dedicated Z2 2(N−1)/N·P_M + '
    f'rest = {predicted["dedicated_z2"] / 1e6:.2f} MB, Z3 3(N−1)/N·P_M + '
    f'rest = {predicted["dedicated_z3"] / 1e6:.2f} MB, where rest is '
    f'2(N−1)/N·{sizes["rest_bytes"] / 1e6:.2f} MB for the AdamW leaves '
    '(all-gather + reduce-scatter when FSDP-sharded, all-reduce when '
    'replicated) (with the packing padding: Z2 '
    f'{predicted["dedicated_z2_padded"] / 1e6:.2f} MB, Z3 '
    f'{predicted["dedicated_z3_padded"] / 1e6:.2f} MB).'
  )
  if dedicated_info:
    out.append('')
    out.append('## Dedicated layout')
    out.append('')
    out.append('```')
    out.append(next(iter(dedicated_info.values()))['summary'])
    out.append('```')
  out.append('')
  out.append('## Notes')
  out.append('')
  out.append(
    '- Collective MB / device come from the compiled HLO '
    '(`dmuon_jax.analyze_compiled`, ring model; AG all-gather, RS '
    'reduce-scatter, AR all-reduce, A2A all-to-all, CP '
    'collective-permute), loop trip counts included; the loss `pmean` is '
    "in it. Peak memory is XLA's memory analysis of the step: arguments + "
    'outputs + temporaries − donated aliases, per device.'
  )
  out.append(
    '- The JSON has the matmul FLOPs per device too (`flops_per_device`: '
    "the `dot` instructions of the step's per-device program, "
    '`hlo_tools.dot_flops`, every `while` loop body times its '
    "trip count and the busiest `lax.switch` branch); XLA's "
    '`cost_analysis()` FLOPs (`xla_cost_analysis_flops`) count a loop '
    'body once, so they under-count the Newton-Schulz iterations.'
  )
  out.append(
    "- The simulated devices share the machine's cores (XLA:CPU runs "
    'every device program on one thread pool) and collectives are memory '
    'copies, so step times rank compute, not network time.'
  )
  return '\n'.join(out)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  main()
