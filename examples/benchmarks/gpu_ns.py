"""Newton-Schulz throughput and an 8B-shaped dmuon step on one GPU.

Part ``ns``: batched Newton-Schulz, direct
(``dmuon_jax.orthogonalize_via_newton_schulz``) and Gram
(``dmuon_jax.orthogonalize_via_gram_newton_schulz``, default restarts),
``'jordan'`` coefficients, 5 steps, for matrix shapes from 1024 x 1024 to
8192 x 28672 (Llama-3-8B: 4096 x 4096 q/o, 4096 x 1024 k/v, 4096 x 14336
gate/up, 14336 x 4096 down; 8192 x 28672 a 70B MLP), in bfloat16 and
float32 (input dtype = ``compute_dtype``). Each shape runs as a batch of
``--target-elems / (m n)`` matrices (at least 1). Reported: TFLOP/s from the
predicted matmul FLOPs (``dmuon_jax._newton_schulz.matmul_flops``), and that
rate as a fraction of a plain batched matmul's TFLOP/s measured in the same
run, same dtype and batch: ``(batch, s, s) @ (batch, s, l)`` with
``s = min(m, n)``, ``l = max(m, n)`` (the ``B X`` product of an iteration).

Part ``optimizer_step``: one ``dmuon_jax.dmuon(0.02)`` update +
``optax.apply_updates`` (jitted, params and state donated) on a
Llama-3-8B-shaped tree (32 layers of q, k, v, o, gate, up, down, norms;
embedding and head 128256 x 4096) in bfloat16 params, float32 momentum
(``mu_dtype``) and bfloat16 Newton-Schulz (``compute_dtype``). Reported: the
median step time and the Newton-Schulz FLOPs of a step (the form ``'auto'``
picks per shape) divided by it. If the tree does not fit, it falls back to
bfloat16 momentum, then to fewer layers, and records what ran.

Every measurement: jit, warm-up, ``block_until_ready``, the median of the
timed repetitions, which a per-configuration time budget may cut (at least
``--min-reps``). A total budget (``--budget-s``, default 440 s) keeps the run
inside ``gpu.sh``'s 8-minute timeout: what no longer fits is recorded as
skipped, and so are shapes that would not fit in device memory.

    bash examples/benchmarks/gpu.sh [out_dir]         # one CUDA GPU, < 8 min
    python examples/benchmarks/gpu_ns.py --cpu-smoke  # tiny shapes, < 30 s

On a backend other than GPU the run is the CPU smoke run automatically.
Writes ``<name>.json`` (one JSON object per line, written as the run goes)
and ``<name>.md`` under ``--out-dir`` (default: ``results/`` beside this
script; name ``gpu_ns`` or ``gpu_ns_cpu_smoke``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import pathlib
import statistics
import sys
import time

# Llama-3-8B: hidden 4096, 8 KV heads of 128, MLP 14336, vocab 128256.
LLAMA_8B = {
  'layers': 32,
  'd': 4096,
  'd_kv': 1024,
  'd_ff': 14336,
  'vocab': 128256,
}
# The CPU smoke run: one layer (its compile dominates the run).
TINY_TREE = {'layers': 1, 'd': 64, 'd_kv': 16, 'd_ff': 224, 'vocab': 256}
GPU_SHAPES = (
  (1024, 1024),
  (4096, 1024),
  (4096, 4096),
  (4096, 14336),
  (14336, 4096),
  (8192, 8192),
  (8192, 28672),
)
SMOKE_SHAPES = ((64, 64), (64, 256))
NS_COEFFS = 'jordan'
NS_STEPS = 5
# What a configuration that does not fit or compile raises (JaxRuntimeError
# is a RuntimeError).
FAILURES = (RuntimeError, ValueError, MemoryError)


class _Formatter(
  argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
  """Defaults in ``--help``; the description keeps its line breaks."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=_Formatter,
  )
  p.add_argument(
    '--out-dir',
    default=None,
    help='where to write results (unset: results/ beside this script)',
  )
  p.add_argument(
    '--name',
    default=None,
    help='output file stem (unset: gpu_ns, or '
    'gpu_ns_cpu_smoke for the smoke run)',
  )
  p.add_argument(
    '--cpu-smoke',
    action='store_true',
    help='tiny shapes and tree (< 30 s on CPU); automatic on '
    'a backend other than gpu',
  )
  p.add_argument(
    '--shapes',
    default=None,
    help='m x n list, e.g. 1024x1024,4096x14336 (unset: '
    'Llama shapes, or tiny ones for the smoke run)',
  )
  p.add_argument(
    '--dtypes',
    default='bfloat16,float32',
    help='Newton-Schulz dtypes (comma list)',
  )
  p.add_argument(
    '--target-elems',
    type=int,
    default=2**26,
    help='batch = max(1, round(target_elems / (m n)))',
  )
  p.add_argument(
    '--reps',
    type=int,
    default=20,
    help='timed calls per configuration (median reported)',
  )
  p.add_argument(
    '--min-reps',
    type=int,
    default=3,
    help='fewest timed calls when --config-budget-s cuts reps',
  )
  p.add_argument(
    '--warmup', type=int, default=2, help='untimed calls after compilation'
  )
  p.add_argument(
    '--config-budget-s',
    type=float,
    default=2.0,
    help='time budget of the timed calls of one configuration',
  )
  p.add_argument(
    '--budget-s',
    type=float,
    default=440.0,
    help='total budget: later work is recorded as skipped',
  )
  p.add_argument(
    '--ns-budget-s',
    type=float,
    default=230.0,
    help='no new Newton-Schulz shape starts after this',
  )
  p.add_argument(
    '--layers',
    type=int,
    default=None,
    help='optimizer step: layers (unset: 32, smoke 1)',
  )
  p.add_argument(
    '--mu-dtype',
    default='float32',
    help='optimizer step: momentum dtype (none: params dtype)',
  )
  p.add_argument(
    '--step-compute-dtype',
    default='bfloat16',
    help='optimizer step: Newton-Schulz dtype (none: the momentum dtype)',
  )
  p.add_argument(
    '--step-reps',
    type=int,
    default=5,
    help='optimizer step: timed steps (median reported)',
  )
  p.add_argument(
    '--step-budget-s',
    type=float,
    default=20.0,
    help='optimizer step: time budget of the timed steps',
  )
  p.add_argument(
    '--mem-fraction',
    type=float,
    default=0.85,
    help='skip what is estimated to need more than this share of device memory',
  )
  p.add_argument(
    '--mem-limit-gib',
    type=float,
    default=None,
    help="device memory to plan for (unset: the device's "
    'bytes_limit; none on CPU)',
  )
  p.add_argument('--parts', default='ns,step', help='comma list of ns, step')
  p.add_argument(
    '--seed', type=int, default=0, help='seed of the random inputs'
  )
  return p.parse_args(argv)


def parse_shapes(text):
  return tuple(
    tuple(int(v) for v in s.lower().split('x')) for s in text.split(',')
  )


def llama_shapes(layers, d, d_kv, d_ff, vocab):
  """A Llama-like tree of shapes (GQA: k and v are ``d x d_kv``)."""
  layer = {
    'attn': {
      'q': {'kernel': (d, d)},
      'k': {'kernel': (d, d_kv)},
      'v': {'kernel': (d, d_kv)},
      'o': {'kernel': (d, d)},
    },
    'attn_norm': {'scale': (d,)},
    'mlp': {
      'gate': {'kernel': (d, d_ff)},
      'up': {'kernel': (d, d_ff)},
      'down': {'kernel': (d_ff, d)},
    },
    'mlp_norm': {'scale': (d,)},
  }
  return {
    'embed': {'embedding': (vocab, d)},
    'layers': [layer] * layers,
    'final_norm': {'scale': (d,)},
    'lm_head': {'kernel': (d, vocab)},
  }


def is_oom(err: BaseException) -> bool:
  text = str(err).lower()
  return any(
    s in text
    for s in (
      'resource_exhausted',
      'out of memory',
      'failed to allocate',
      'allocation',
    )
  )


def short_error(err: BaseException) -> str:
  text = f'{type(err).__name__}: {err}'.strip().replace('\n', ' ')
  return text[:300]


class Recorder:
  """Appends JSON rows (with the common fields) and keeps them."""

  def __init__(self, path, common):
    self.path = path
    self.common = common
    self.rows = []
    path.write_text('')

  def add(self, row):
    row = {**self.common, **row}
    self.rows.append(row)
    with self.path.open('a', encoding='utf-8') as f:
      f.write(json.dumps(row) + '\n')
    return row


def main(argv=None):  # pylint: disable=too-many-locals,too-many-statements
  args = parse_args(argv)
  wall_start = time.perf_counter()
  deadline = wall_start + args.budget_s
  command = ' '.join(
    ['python', 'examples/benchmarks/gpu_ns.py']
    + (sys.argv[1:] if argv is None else list(argv))
  )
  # Use most of the GPU's memory (JAX preallocates 75% by default).
  os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.92')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top
  from dmuon_jax import _newton_schulz  # pylint: disable=g-import-not-at-top

  ns_flops = _newton_schulz.matmul_flops
  cheaper = _newton_schulz.cheaper_ns_algorithm

  backend = jax.default_backend()
  smoke = args.cpu_smoke or backend != 'gpu'
  if smoke:
    args.reps, args.min_reps, args.warmup = min(args.reps, 5), 2, 1
    args.config_budget_s = min(args.config_budget_s, 0.3)
    args.step_reps, args.step_budget_s = 3, min(args.step_budget_s, 2.0)
    args.target_elems = min(args.target_elems, 2**14)
  shapes = (
    parse_shapes(args.shapes)
    if args.shapes
    else SMOKE_SHAPES
    if smoke
    else GPU_SHAPES
  )
  tree_cfg = dict(TINY_TREE if smoke else LLAMA_8B)
  if args.layers is not None:
    tree_cfg['layers'] = args.layers
  parts = set(args.parts.split(','))
  if args.name is None:
    args.name = 'gpu_ns_cpu_smoke' if smoke else 'gpu_ns'
  out_dir = (
    pathlib.Path(args.out_dir)
    if args.out_dir
    else (pathlib.Path(__file__).resolve().parent / 'results')
  )
  out_dir.mkdir(parents=True, exist_ok=True)

  dev = jax.devices()[0]
  mem_limit = (dev.memory_stats() or {}).get('bytes_limit')
  if args.mem_limit_gib is not None:
    mem_limit = args.mem_limit_gib * 2**30
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
  precision = jax.config.jax_default_matmul_precision or 'default'
  common = {
    'backend': backend,
    'device_kind': dev.device_kind,
    'jax': jax.__version__,
    'date': date,
    'smoke': smoke,
  }
  rec = Recorder(out_dir / f'{args.name}.json', common)
  print(
    f'backend {backend}, device {dev.device_kind} '
    f'({jax.device_count()} devices), jax {jax.__version__}, '
    f'memory limit '
    f'{"n/a" if mem_limit is None else f"{mem_limit / 2**30:.1f} GiB"}, '
    f'{"smoke run" if smoke else "full run"}',
    flush=True,
  )

  def fits(nbytes):
    return mem_limit is None or nbytes <= args.mem_fraction * mem_limit

  def block(x):
    jax.block_until_ready(x)

  def time_calls(fn, *xs, reps, min_reps, warmup, budget_s):
    """Compiles; warm-up calls; timed calls (cut by ``budget_s``)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*xs).compile()
    compile_s = time.perf_counter() - t0
    first = None
    for i in range(max(warmup, 1)):
      t0 = time.perf_counter()
      block(compiled(*xs))
      if i == 0:
        first = time.perf_counter() - t0
    n = reps
    if first * reps > budget_s:
      n = min(reps, max(min_reps, int(budget_s // max(first, 1e-9))))
    times = []
    for _ in range(n):
      t0 = time.perf_counter()
      block(compiled(*xs))
      times.append(time.perf_counter() - t0)
    return {
      'median_ms': 1e3 * statistics.median(times),
      'min_ms': 1e3 * min(times),
      'reps': len(times),
      'compile_s': compile_s,
      'first_call_ms': 1e3 * first,
    }

  rng = np.random.default_rng(args.seed)

  @functools.partial(jax.jit, static_argnums=(1, 2, 3))
  def device_normal(key, shape, dtype, scale):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

  def normal(key, shape, dtype, scale=1.0):
    """Random normal array on the device (host NumPy for the smoke run)."""
    if smoke:
      return jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
    return device_normal(key, shape, jnp.dtype(dtype), scale)

  # --- Part ns: Newton-Schulz throughput vs matmul --------------------------
  ns_fns = {
    'direct': (dmuon_jax.orthogonalize_via_newton_schulz, 'standard'),
    'gram': (dmuon_jax.orthogonalize_via_gram_newton_schulz, 'gram'),
  }
  dtypes = [jnp.dtype(d) for d in args.dtypes.split(',')]
  matmul_best = {}
  key = jax.random.key(args.seed)
  for m, n in shapes if 'ns' in parts else ():
    s, l = min(m, n), max(m, n)
    batch = max(1, round(args.target_elems / (m * n)))
    for dtype in dtypes:
      size = dtype.itemsize  # Input dtype = compute dtype.
      base = {
        'part': 'ns',
        'shape': f'{m}x{n}',
        'm': m,
        'n': n,
        'batch': batch,
        'dtype': dtype.name,
        'matmul_precision': precision,
      }
      # Input, float32 normalized copy, ~4 compute-dtype copies of X, and
      # a few s x s Grams; the matmul needs its two operands and output.
      need = batch * (m * n * (5 * size + 4) + 6 * s * s * size)
      over = time.perf_counter() > wall_start + min(
        args.ns_budget_s, args.budget_s
      )
      reason = (
        'time budget'
        if over
        else None
        if fits(need)
        else f'memory: needs ~{need / 2**30:.3g} GiB'
      )
      if reason:
        for algo in ('matmul', 'direct', 'gram'):
          rec.add(
            {
              **base,
              'algorithm': algo,
              'status': 'skipped',
              'skip_reason': reason,
            }
          )
        print(f'{m}x{n} {dtype.name}: skipped ({reason})', flush=True)
        continue
      timing = {
        'reps': args.reps,
        'min_reps': args.min_reps,
        'warmup': args.warmup,
        'budget_s': args.config_budget_s,
      }
      mm_flops = 2.0 * batch * s * s * l
      mm = None
      try:
        k1, k2, key = jax.random.split(key, 3)
        a = normal(k1, (batch, s, s), dtype)
        b = normal(k2, (batch, s, l), dtype)
        res = time_calls(jnp.matmul, a, b, **timing)
        del a, b
        mm = mm_flops / (res['median_ms'] / 1e3) / 1e12
        matmul_best[dtype.name] = max(matmul_best.get(dtype.name, 0.0), mm)
        rec.add(
          {
            **base,
            'algorithm': 'matmul',
            'status': 'ok',
            **res,
            'flops': mm_flops,
            'tflop_per_s': mm,
          }
        )
        line = [f'{m}x{n} x{batch} {dtype.name}: matmul {mm:.4g} TFLOP/s']
      except FAILURES as e:
        rec.add(
          {
            **base,
            'algorithm': 'matmul',
            'status': 'skipped',
            'skip_reason': ('memory: ' if is_oom(e) else 'error: ')
            + short_error(e),
          }
        )
        line = [f'{m}x{n} x{batch} {dtype.name}: matmul failed']
      gc.collect()
      k1, key = jax.random.split(key)
      x = None
      for algo, (fn, flop_algo) in ns_fns.items():
        flops = float(batch * ns_flops(m, n, NS_STEPS, flop_algo))
        try:
          if x is None:
            x = normal(k1, (batch, m, n), dtype)
          res = time_calls(
            lambda v, fn=fn, d=dtype: fn(v, NS_COEFFS, compute_dtype=d),
            x,
            **timing,
          )
          tf = flops / (res['median_ms'] / 1e3) / 1e12
          rec.add(
            {
              **base,
              'algorithm': algo,
              'status': 'ok',
              **res,
              'flops': flops,
              'tflop_per_s': tf,
              'matmul_tflop_per_s': mm,
              'fraction_of_matmul': None if mm is None else tf / mm,
            }
          )
          frac = '' if mm is None else f' ({tf / mm:.0%})'
          line.append(f'{algo} {tf:.4g}{frac} {res["median_ms"]:.3g} ms')
        except FAILURES as e:
          rec.add(
            {
              **base,
              'algorithm': algo,
              'status': 'skipped',
              'flops': flops,
              'skip_reason': ('memory: ' if is_oom(e) else 'error: ')
              + short_error(e),
            }
          )
          line.append(f'{algo} failed ({short_error(e)[:60]})')
      del x
      gc.collect()
      print(', '.join(line), flush=True)
  write_markdown(out_dir / f'{args.name}.md', rec.rows, common, command)

  # --- Part step: dmuon update on an 8B-shaped tree -------------------------
  if 'step' in parts:
    run_step(
      args,
      rec,
      tree_cfg,
      deadline,
      fits,
      matmul_best,
      normal,
      jax,
      jnp,
      optax,
      dmuon_jax,
      ns_flops,
      cheaper,
      block,
    )
  total_s = time.perf_counter() - wall_start
  rec.add(
    {'part': 'summary', 'status': 'ok', 'wall_s': total_s, 'command': command}
  )
  md_path = out_dir / f'{args.name}.md'
  write_markdown(md_path, rec.rows, common, command)
  print(f'\nwrote {rec.path} and {md_path} ({total_s:.1f} s)\n')
  print(md_path.read_text())
  return rec.rows


def run_step(
  args,
  rec,
  cfg,
  deadline,
  fits,
  matmul_best,
  normal,
  jax,
  jnp,
  optax,
  dmuon_jax,
  ns_flops,
  cheaper,
  block,
):
  """Times dmuon's update + apply_updates; falls back when it won't fit."""
  # pylint: disable=too-many-locals
  bf16 = jnp.dtype(jnp.bfloat16)
  mu = None if args.mu_dtype.lower() == 'none' else jnp.dtype(args.mu_dtype)
  cdt = (
    None
    if args.step_compute_dtype.lower() == 'none'
    else jnp.dtype(args.step_compute_dtype)
  )
  attempts = [(cfg['layers'], mu)]
  if mu is not None and mu != bf16:
    attempts.append((cfg['layers'], None))
  layers = cfg['layers'] // 2
  while layers >= 1:
    attempts.append((layers, None))
    layers //= 2
  failures = []
  for layers, mu_dtype in attempts:
    shapes = llama_shapes(
      layers, cfg['d'], cfg['d_kv'], cfg['d_ff'], cfg['vocab']
    )
    specs = jax.tree.map(
      lambda sh: jax.ShapeDtypeStruct(sh, bf16),
      shapes,
      is_leaf=lambda x: isinstance(x, tuple),
    )
    labels = jax.tree.leaves(dmuon_jax.muon_labels(specs))
    leaves = jax.tree.leaves(specs)
    n_params = sum(math.prod(x.shape) for x in leaves)
    n_muon = sum(
      math.prod(x.shape) for x, lb in zip(leaves, labels) if lb == 'muon'
    )
    n_adam = n_params - n_muon
    mom = 2 if mu_dtype is None else mu_dtype.itemsize
    # Resident: params, grads and state (Muon momentum; AdamW mu, nu). The
    # update's temporaries are not estimated: running out is caught below.
    need = 2 * 2 * n_params + mom * n_muon + (mom + 2) * n_adam
    flops = float(
      sum(
        ns_flops(*x.shape, NS_STEPS, cheaper(*x.shape, NS_STEPS))
        for x, lb in zip(leaves, labels)
        if lb == 'muon'
      )
    )
    base = {
      'part': 'optimizer_step',
      'layers': layers,
      'layers_requested': cfg['layers'],
      'd_model': cfg['d'],
      'd_kv': cfg['d_kv'],
      'd_ff': cfg['d_ff'],
      'vocab': cfg['vocab'],
      'params': n_params,
      'muon_params': n_muon,
      'muon_matrices': labels.count('muon'),
      'param_dtype': 'bfloat16',
      'mu_dtype': 'bfloat16' if mu_dtype is None else mu_dtype.name,
      'compute_dtype': ('momentum dtype' if cdt is None else cdt.name),
      'ns_flops': flops,
      'fallback': bool(failures),
      'fallback_reasons': list(failures),
    }
    if time.perf_counter() > deadline - 30:
      rec.add({**base, 'status': 'skipped', 'skip_reason': 'time budget'})
      print(f'optimizer step ({layers} layers): skipped (time budget)')
      return
    if not fits(need):
      failures.append(
        f'{layers} layers, mu {base["mu_dtype"]}: estimated '
        f'{need / 2**30:.3g} GiB'
      )
      print(f'optimizer step: {failures[-1]}, does not fit', flush=True)
      continue
    params = grads = state = None
    try:
      t0 = time.perf_counter()
      key = jax.random.key(args.seed)
      keys = iter(jax.random.split(key, 2 * len(leaves)))
      treedef = jax.tree.structure(specs)
      params = jax.tree.unflatten(
        treedef, [normal(next(keys), x.shape, bf16, 0.02) for x in leaves]
      )
      grads = jax.tree.unflatten(
        treedef, [normal(next(keys), x.shape, bf16, 1e-3) for x in leaves]
      )
      opt = dmuon_jax.dmuon(0.02, mu_dtype=mu_dtype, compute_dtype=cdt)
      state = jax.jit(opt.init)(params)
      block((params, grads, state))
      build_s = time.perf_counter() - t0

      def step(p, s, g, opt=opt):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

      t0 = time.perf_counter()
      compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, state, grads)
        .compile()
      )
      compile_s = time.perf_counter() - t0
      times, first = [], None
      n = args.step_reps
      for i in range(1 + n):
        if time.perf_counter() > deadline - 5 and len(times) >= 1:
          break
        t0 = time.perf_counter()
        params, state = compiled(params, state, grads)
        block((params, state))
        dt = time.perf_counter() - t0
        if i == 0:
          first = dt
          if first * n > args.step_budget_s:
            n = min(n, max(2, int(args.step_budget_s // first)))
        else:
          times.append(dt)
        if len(times) >= n:
          break
      if not times:
        times = [first]
      med = statistics.median(times)
      finite = bool(
        jnp.isfinite(
          params['layers'][0]['attn']['q']['kernel'].astype(jnp.float32)
        ).all()
      )
      tf = flops / med / 1e12
      ref = matmul_best.get('bfloat16')
      rec.add(
        {
          **base,
          'status': 'ok',
          'median_ms': 1e3 * med,
          'min_ms': 1e3 * min(times),
          'reps': len(times),
          'first_call_ms': 1e3 * first,
          'compile_s': compile_s,
          'build_s': build_s,
          'ns_tflop_per_s': tf,
          'bf16_matmul_tflop_per_s': ref,
          'fraction_of_matmul': None if not ref else tf / ref,
          'params_finite': finite,
        }
      )
      print(
        f'optimizer step: {layers} layers, {n_params / 1e9:.3g}B params '
        f'(mu {base["mu_dtype"]}): {1e3 * med:.4g} ms, NS '
        f'{flops / 1e12:.4g} TFLOP -> {tf:.4g} TFLOP/s '
        f'(compile {compile_s:.1f} s)',
        flush=True,
      )
      return
    except FAILURES as e:
      reason = ('memory: ' if is_oom(e) else 'error: ') + short_error(e)
      failures.append(f'{layers} layers, mu {base["mu_dtype"]}: {reason}')
      print(f'optimizer step: {failures[-1]}', flush=True)
      if not is_oom(e):
        rec.add({**base, 'status': 'skipped', 'skip_reason': reason})
        return
    finally:
      del params, grads, state
      gc.collect()
  rec.add(
    {
      'part': 'optimizer_step',
      'layers': 0,
      'layers_requested': cfg['layers'],
      'status': 'skipped',
      'skip_reason': 'does not fit',
      'fallback': True,
      'fallback_reasons': failures,
    }
  )


def fmt(v, spec='.3g'):
  return '–' if v is None else format(v, spec)


def write_markdown(path, rows, common, command):
  """A short report: NS throughput table, optimizer step table."""
  lines = [
    '# Newton-Schulz on one device',
    '',
    (
      f'{common["device_kind"]} ({common["backend"]}), jax '
      f'{common["jax"]}, {common["date"]}'
      f'{", CPU smoke run" if common["smoke"] else ""}.'
    ),
    f'`{command}`',
    '',
    (
      'TFLOP/s from predicted matmul FLOPs (5 Jordan iterations, Gram '
      'with its default restart); in parentheses the share of a batched '
      'matmul `(b,s,s)@(b,s,l)` of the same dtype.'
    ),
    '',
    (
      '| shape | batch | dtype | matmul TFLOP/s | direct TFLOP/s | '
      'gram TFLOP/s | direct ms | gram ms |'
    ),
    '|---|---|---|---|---|---|---|---|',
  ]
  ns = {}
  for r in rows:
    if r.get('part') == 'ns':
      ns.setdefault((r['shape'], r['dtype']), {})[r['algorithm']] = r
  for (shape, dtype), by in ns.items():
    cells = [shape, str(next(iter(by.values()))['batch']), dtype]
    mm = by.get('matmul', {})
    cells.append(
      fmt(mm.get('tflop_per_s'), '.4g')
      if mm.get('status') == 'ok'
      else 'skipped'
    )
    for algo in ('direct', 'gram'):
      r = by.get(algo, {})
      if r.get('status') != 'ok':
        cells.append('skipped: ' + str(r.get('skip_reason', ''))[:40])
        continue
      frac = r.get('fraction_of_matmul')
      cells.append(
        fmt(r['tflop_per_s'], '.4g')
        + ('' if frac is None else f' ({frac:.0%})')
      )
    for algo in ('direct', 'gram'):
      r = by.get(algo, {})
      cells.append(fmt(r.get('median_ms'), '.4g'))
    lines.append('| ' + ' | '.join(cells) + ' |')
  steps = [r for r in rows if r.get('part') == 'optimizer_step']
  if steps:
    lines += [
      '',
      (
        '`dmuon_jax.dmuon(0.02)` update + `optax.apply_updates`, bf16 '
        'params; NS TFLOP/s = Newton-Schulz FLOPs of a step / step time.'
      ),
      '',
      (
        '| layers | params | mu dtype | NS dtype | step ms | NS TFLOP | '
        'NS TFLOP/s | of bf16 matmul | note |'
      ),
      '|---|---|---|---|---|---|---|---|---|',
    ]
    for r in steps:
      note = (
        'fallback: ' + '; '.join(r.get('fallback_reasons', []))
        if r.get('fallback')
        else ''
      )
      if r['status'] != 'ok':
        note = f'skipped: {r.get("skip_reason")}. {note}'
      frac = r.get('fraction_of_matmul')
      lines.append(
        f'| {r["layers"]} | {fmt(r.get("params", 0) / 1e9, ".3g")}B | '
        f'{r.get("mu_dtype", "–")} | {r.get("compute_dtype", "–")} | '
        f'{fmt(r.get("median_ms"), ".4g")} | '
        f'{fmt(r.get("ns_flops", 0) / 1e12, ".4g")} | '
        f'{fmt(r.get("ns_tflop_per_s"), ".4g")} | '
        f'{"–" if frac is None else f"{frac:.0%}"} | {note[:200]} |'
      )
  path.write_text('\n'.join(lines) + '\n')


if __name__ == '__main__':
  main()
