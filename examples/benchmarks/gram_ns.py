"""Gram vs direct Newton-Schulz, and the tensor-parallel Gram path vs gathering.

Part A (one device): a batch of ``--batch`` wide float32 matrices ``s x l``,
``l = r s`` for each aspect ratio ``r`` in ``--ratios``, orthogonalized by
direct Newton-Schulz (``dmuon_jax.orthogonalize_via_newton_schulz``) and by
Gram Newton-Schulz (``dmuon_jax.orthogonalize_via_gram_newton_schulz``,
default restart before iteration 2), ``'jordan'`` coefficients, 5 steps.
Per ratio: the predicted matmul FLOPs of both (``matmul_flops``) and those of
the compiled calls (``hlo_tools.dot_flops``: the ``dot`` instructions, each
``while`` loop body times its trip count), the median
times (jitted, measured side by side: every round runs both, alternating
which goes first), the achieved GFLOP/s, the measured and predicted speedup
direct / Gram, and each one's distance from a float64 NumPy reference of the
same iteration (max over the batch of the relative Frobenius difference).

Part B (``T`` simulated devices, one mesh axis ``'model'``, ``T`` in
``--tp``): a column-parallel ``d x f`` matrix split along ``f``
(``split_axis=-1``) and a row-parallel ``f x d`` matrix split along ``f``
(``split_axis=-2``), ``d = s``, ``f = --ff-mult * s``, inside
``jax.shard_map``:

1. ``tp``: ``dmuon_jax.orthogonalize_via_gram_newton_schulz_tp`` on the
   local slice (one all-reduce of the ``d x d`` Gram per restart window, the
   matrix never moves);
2. ``gather``: ``all_gather`` of the slices, direct Newton-Schulz of the
   whole matrix on every shard, each shard keeps its own slice.

Per variant: median time, collective bytes per device and counts by kind
(compiled HLO, ring model), per-device matmul FLOPs (``hlo_tools.dot_flops``
of the compiled program, loops times their trip counts; XLA's
``cost_analysis``, which counts a loop body once, is only an extra JSON field)
and the relative difference of the two results.

    python examples/benchmarks/gram_ns.py            # ~1 min, 2 idle cores
    python examples/benchmarks/gram_ns.py --quick    # < 40 s (CI)

Writes ``results/<name>.json`` (one JSON object per line) and
``results/<name>.md`` next to this file (or under ``--out-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
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
NS_COEFFS = 'jordan'


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=_common.HelpFormatter,
  )
  p.add_argument(
    '--short',
    type=int,
    default=512,
    help='short side s (Part A) and d (Part B) (--quick: 64)',
  )
  p.add_argument(
    '--ratios',
    default='1,2,4,8',
    help='Part A: aspect ratios r (matrices s x r*s)',
  )
  p.add_argument(
    '--batch',
    type=int,
    default=4,
    help='Part A: matrices per call (--quick: 2)',
  )
  p.add_argument(
    '--tp', default='2,4', help='Part B: tensor-parallel degrees T'
  )
  p.add_argument(
    '--ff-mult', type=int, default=4, help='Part B: f = ff-mult * d'
  )
  p.add_argument(
    '--reps',
    type=int,
    default=9,
    help='timed rounds per configuration (median reported; --quick: 5)',
  )
  p.add_argument(
    '--warmup',
    type=int,
    default=1,
    help='untimed calls of each function after compilation',
  )
  p.add_argument(
    '--min-reps',
    type=int,
    default=3,
    help='fewest timed rounds when --budget-s cuts reps',
  )
  p.add_argument(
    '--budget-s',
    type=float,
    default=20.0,
    help='per-configuration time budget of the timed rounds',
  )
  p.add_argument(
    '--parts',
    default='AB',
    choices=('AB', 'A', 'B'),
    help='which parts to run (debugging)',
  )
  _common.add_common_args(
    p, 'gram_ns', 'small matrices, few reps: a CI smoke run (< 40 s)'
  )
  args = p.parse_args(argv)
  _common.apply_quick(
    p,
    args,
    argv,
    {'short': 64, 'batch': 2, 'reps': 5, 'warmup': 1, 'min_reps': 3},
  )
  args.ratios = [int(v) for v in str(args.ratios).split(',')]
  args.tp = [int(v) for v in str(args.tp).split(',')]
  if args.name is None:
    args.name = 'gram_ns_quick' if args.quick else 'gram_ns'
  if args.out_dir is None:
    args.out_dir = str(pathlib.Path(__file__).resolve().parent / 'results')
  return args


# ---------------------------------------------------------------------------
# Reference, measurement, formatting.


def ns_reference(x, rows, eps=1e-8):
  """Direct Newton-Schulz in float64 NumPy (Frobenius normalization).

  The same iteration as ``orthogonalize_via_newton_schulz``:
  ``A = X X^T, B = b A + (c A) A, X <- a X + B X`` on the short side.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  x = np.asarray(x, np.float64)
  tall = x.shape[-2] > x.shape[-1]
  y = np.swapaxes(x, -1, -2) if tall else x
  norm = np.linalg.norm(y, axis=(-2, -1), keepdims=True)
  y = y / np.where(norm + eps > 0, norm + eps, 1)
  for a, b, c in rows:
    gram = y @ np.swapaxes(y, -1, -2)
    y = a * y + (b * gram + (c * gram) @ gram) @ y
  return np.swapaxes(y, -1, -2) if tall else y


def max_rel_diff(a, b) -> float:
  """Max over leading axes of ``||a - b||_F / ||b||_F`` (float64)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  a = np.asarray(a, np.float64).reshape((-1,) + np.shape(a)[-2:])
  b = np.asarray(b, np.float64).reshape(a.shape)
  num = np.linalg.norm(a - b, axis=(-2, -1))
  den = np.maximum(np.linalg.norm(b, axis=(-2, -1)), 1e-30)
  return float(np.max(num / den))


def time_side_by_side(fns, arg, *, reps, warmup, min_reps, budget_s, block):
  """Times several functions of the same argument in alternating rounds.

  Every round calls each function once (``block`` after each call); odd
  rounds run them in reverse order, so that a slow phase of the machine hits
  all of them alike. The warm-up calls estimate a round's duration: if
  ``reps`` rounds would exceed ``budget_s``, fewer (at least ``min_reps``)
  are timed.

  Returns:
    (per function, its timed durations in s; the first call's duration of
    each in s; the CPU share other processes used meanwhile or None).
  """
  first = [None] * len(fns)
  meter = _common.CpuMeter()
  for i in range(max(warmup, 1)):
    for j, fn in enumerate(fns):
      t0 = time.perf_counter()
      block(fn(arg))
      if i == 0:
        first[j] = time.perf_counter() - t0
  n = reps
  if sum(first) * reps > budget_s:
    n = min(reps, max(min_reps, int(budget_s // sum(first))))
  times = [[] for _ in fns]
  for i in range(n):
    order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
    for j in order:
      t0 = time.perf_counter()
      block(fns[j](arg))
      times[j].append(time.perf_counter() - t0)
  return times, first, meter.other_share()


def fmt_mb(bytes_by_kind: dict) -> str:
  parts = [
    f'{KIND_ABBREV.get(k, k)} {v / 1e6:.3g}'
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


def crossover(ratios, speedups):
  """First ratio where ``speedups`` crosses 1 (log-linear), or None."""
  pts = list(zip(ratios, speedups, strict=True))
  if pts and pts[0][1] >= 1:
    return pts[0][0]
  for (r0, s0), (r1, s1) in itertools.pairwise(pts):
    if s0 < 1 <= s1:
      t = (math.log(1) - math.log(s0)) / (math.log(s1) - math.log(s0))
      return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
  return None


# ---------------------------------------------------------------------------
# Main.


def main(argv=None):  # pylint: disable=too-many-locals,too-many-statements
  args = parse_args(argv)
  command = ' '.join(
    ['python', 'examples/benchmarks/gram_ns.py']
    + (sys.argv[1:] if argv is None else list(argv))
  )
  wall_start = time.perf_counter()
  n_dev = max(args.tp + [1])

  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_num_cpu_devices', n_dev)
  jax.config.update('jax_platforms', 'cpu')
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top
  from dmuon_jax import _newton_schulz  # pylint: disable=g-import-not-at-top

  # Private helpers: the FLOP model and the restart windows.
  ns_flops = _newton_schulz.matmul_flops
  tp_ns = dmuon_jax.orthogonalize_via_gram_newton_schulz_tp

  if jax.device_count() != n_dev:
    sys.exit(f'expected {n_dev} devices, got {jax.device_count()}')
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
  machine = _common.machine_info(jax, optax, dmuon_jax)
  load_start = _common.load_average()
  rows = dmuon_jax.resolve_ns_coeffs(NS_COEFFS)
  k = len(rows)
  default_restarts = tuple(w[0] for w in _newton_schulz.gram_windows(k)[1:])
  rng = np.random.default_rng(args.seed)
  s = args.short
  print(
    f'machine: {machine["cpu_count"]} CPUs ({machine["cpu_model"]}), '
    f'{n_dev} simulated devices, jax {machine["jax"]}; load average '
    f'{load_start}'
  )

  def compile_fn(fn, x):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(x).compile()
    return compiled, time.perf_counter() - t0

  def timing(times, first):
    return {
      'median_ms': 1e3 * statistics.median(times),
      'min_ms': 1e3 * min(times),
      'times_ms': [1e3 * t for t in times],
      'first_call_ms': 1e3 * first,
      'reps': len(times),
    }

  # --- Part A: one device, Gram vs direct ----------------------------------
  dev0 = jax.devices()[0]
  part_a = []
  for r in args.ratios if 'A' in args.parts else ():
    l = r * s
    host = rng.standard_normal((args.batch, s, l)).astype(np.float32)
    x = jax.device_put(host, dev0)
    fns = {
      'direct': lambda a: dmuon_jax.orthogonalize_via_newton_schulz(
        a, NS_COEFFS
      ),
      'gram': lambda a: dmuon_jax.orthogonalize_via_gram_newton_schulz(
        a, NS_COEFFS
      ),
    }
    compiled, compile_s, flops, errs = {}, {}, {}, {}
    ref = ns_reference(host, rows)
    for name, fn in fns.items():
      compiled[name], compile_s[name] = compile_fn(fn, x)
      flops[name] = _common.flop_counts(
        compiled[name], dmuon_jax.analyze_compiled(compiled[name])
      )
      errs[name] = max_rel_diff(compiled[name](x), ref)
    del ref
    times, first, other = time_side_by_side(
      [compiled['direct'], compiled['gram']],
      x,
      reps=args.reps,
      warmup=args.warmup,
      min_reps=args.min_reps,
      budget_s=args.budget_s,
      block=jax.block_until_ready,
    )
    pred = {
      'direct': args.batch * ns_flops(s, l, k, 'standard'),
      'gram': args.batch * ns_flops(s, l, k, 'gram'),
    }
    row = {
      'part': 'A',
      'config': f'r{r}',
      'ratio': r,
      'shape': [s, l],
      'batch': args.batch,
      'dtype': 'float32',
      'ns_coeffs': NS_COEFFS,
      'ns_steps': k,
      'gram_restarts': list(default_restarts),
      'other_processes_cpu_share': other,
      'reps_requested': args.reps,
    }
    for j, name in enumerate(('direct', 'gram')):
      t = timing(times[j], first[j])
      row[name] = dict(
        t,
        compile_s=compile_s[name],
        predicted_flops=pred[name],
        flops=flops[name]['flops_per_device'],
        xla_cost_analysis_flops=flops[name]['xla_cost_analysis_flops'],
        gflop_per_s=pred[name] / t['median_ms'] / 1e6,
        rel_diff_vs_f64=errs[name],
      )
    row['speedup_measured'] = (
      row['direct']['median_ms'] / row['gram']['median_ms']
    )
    row['speedup_predicted'] = pred['direct'] / pred['gram']
    part_a.append(row)
    print(
      f'A r={r} ({args.batch}x{s}x{l}): direct '
      f'{row["direct"]["median_ms"]:8.1f} ms, gram '
      f'{row["gram"]["median_ms"]:8.1f} ms, speedup '
      f'{row["speedup_measured"]:.2f}x (predicted '
      f'{row["speedup_predicted"]:.2f}x); vs f64 direct '
      f'{errs["direct"]:.1e}, gram {errs["gram"]:.1e}; others used '
      f'{_common.fmt_share(other)} of the CPUs',
      flush=True,
    )
    del x, compiled

  # Predicted crossover: both FLOP counts are affine in l.
  def affine(algorithm):
    f1 = ns_flops(s, s, k, algorithm)
    f2 = ns_flops(s, 2 * s, k, algorithm)
    return f2 - f1, 2 * f1 - f2  # (per s of l, constant)

  (ad, bd), (ag, bg) = affine('standard'), affine('gram')
  predicted_crossover = (bg - bd) / (ad - ag) if ad > ag else None
  measured_crossover = crossover(
    [row['ratio'] for row in part_a],
    [row['speedup_measured'] for row in part_a],
  )

  # --- Part B: tensor-parallel Gram vs gather ------------------------------
  d, f = s, args.ff_mult * s
  part_b = []
  for tp in args.tp if 'B' in args.parts else ():
    if f % tp:
      sys.exit(f'f = {f} is not divisible by T = {tp}')
    mesh = jax.make_mesh((tp,), ('model',), devices=jax.devices()[:tp])
    for layout in ('column', 'row'):
      if layout == 'column':
        shape, split_axis, dim, spec = (d, f), -1, 1, P(None, 'model')
      else:
        shape, split_axis, dim, spec = (f, d), -2, 0, P('model', None)
      host = rng.standard_normal(shape).astype(np.float32)
      x = jax.device_put(host, NamedSharding(mesh, spec))

      def tp_body(xl, split_axis=split_axis):
        return tp_ns(xl, NS_COEFFS, axis_name='model', split_axis=split_axis)

      def gather_body(xl, dim=dim):
        full = jax.lax.all_gather(xl, 'model', axis=dim, tiled=True)
        y = dmuon_jax.orthogonalize_via_newton_schulz(full, NS_COEFFS)
        n_loc = xl.shape[dim]
        start = jax.lax.axis_index('model') * n_loc
        return jax.lax.dynamic_slice_in_dim(y, start, n_loc, axis=dim)

      compiled, compile_s, reports, outs = {}, {}, {}, {}
      for name, body in (('tp', tp_body), ('gather', gather_body)):
        fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        compiled[name], compile_s[name] = compile_fn(fn, x)
        reports[name] = dmuon_jax.analyze_compiled(compiled[name])
        outs[name] = np.asarray(compiled[name](x))
      diff = max_rel_diff(outs['tp'], outs['gather'])
      ref = ns_reference(host, rows)
      errs = {name: max_rel_diff(o, ref) for name, o in outs.items()}
      times, first, other = time_side_by_side(
        [compiled['tp'], compiled['gather']],
        x,
        reps=args.reps,
        warmup=args.warmup,
        min_reps=args.min_reps,
        budget_s=args.budget_s,
        block=jax.block_until_ready,
      )
      # Predictions per device. TP: Gram iteration on d x d with the local
      # f / T columns (restarts as the TP function picks them); one
      # all-reduce of the d x d float32 Gram per restart window, ring
      # 2 (T-1)/T. Gather: (T-1)/T of the matrix arrives, then the direct
      # iteration on the whole d x f matrix.
      n_loc = f // tp
      restarts = (1, 3) if d > f and k >= 4 else default_restarts
      windows = len(restarts) + 1
      pred_flops = {
        'tp': 4 * windows * d * d * n_loc + (8 * k - 6 * windows) * d**3,
        'gather': ns_flops(d, f, k, 'standard'),
      }
      pred_bytes = {
        'tp': {'all-reduce': windows * 2 * (tp - 1) / tp * d * d * 4},
        'gather': {'all-gather': (tp - 1) / tp * d * f * 4},
      }
      for j, name in enumerate(('tp', 'gather')):
        rep = reports[name]
        row = {
          'part': 'B',
          'config': f'T{tp}-{layout}-{name}',
          'tp': tp,
          'layout': layout,
          'variant': name,
          'shape': list(shape),
          'split_axis': split_axis,
          'dtype': 'float32',
          'ns_coeffs': NS_COEFFS,
          'ns_steps': k,
          'restarts': list(restarts) if name == 'tp' else None,
          **timing(times[j], first[j]),
          'reps_requested': args.reps,
          'compile_s': compile_s[name],
          'other_processes_cpu_share': other,
          **_common.flop_counts(compiled[name], rep),
          'predicted_flops_per_device': pred_flops[name],
          'collective_bytes_by_kind': {
            kk: float(v) for kk, v in rep.bytes_by_kind.items()
          },
          'collective_count_by_kind': {
            kk: int(v) for kk, v in rep.count_by_kind.items()
          },
          'collective_bytes_total': rep.total_bytes(),
          'predicted_collective_bytes_by_kind': pred_bytes[name],
          'peak_bytes_per_device': rep.peak_bytes,
          'rel_diff_tp_vs_gather': diff,
          'rel_diff_vs_f64': errs[name],
        }
        part_b.append(row)
        print(
          f'B T={tp} {layout:>6} {name:>6} {shape[0]}x{shape[1]}: '
          f'{row["median_ms"]:8.1f} ms, '
          f'{row["flops_per_device"] / 1e9:6.3f} matmul GFLOP/device, '
          f'{fmt_mb(row["collective_bytes_by_kind"])} MB '
          f'({fmt_count(row["collective_count_by_kind"])}); tp vs '
          f'gather {diff:.1e}, vs f64 {errs[name]:.1e}; others used '
          f'{_common.fmt_share(other)} of the CPUs',
          flush=True,
        )
      del x, compiled

  wall_s = time.perf_counter() - wall_start
  machine.update(
    {
      'load_average_start': load_start,
      'load_average_end': _common.load_average(),
    }
  )
  summary = {
    'part': 'summary',
    'config': 'summary',
    'wall_s': wall_s,
    'predicted_crossover_ratio': predicted_crossover,
    'measured_crossover_ratio': measured_crossover,
    'tp_function': tp_ns.__name__,
    'command': command,
  }

  md = render_markdown(
    args, date, machine, command, part_a, part_b, summary, default_restarts
  )
  common = {
    'date': date,
    'machine': machine,
    'benchmark': 'gram_ns',
    'quick': args.quick,
  }
  lines = [dict(common, **row) for row in part_a + part_b]
  lines.append(dict(common, **summary))
  _common.write_results(args.out_dir, args.name, lines, md, wall_s)
  return lines


def render_markdown(
  args, date, machine, command, part_a, part_b, summary, restarts
) -> str:
  """The two tables and notes as markdown."""

  def reps(res):
    n = str(res['reps'])
    return n + '*' if res['reps'] < args.reps else n

  s = args.short
  steps = (part_a or part_b)[0]['ns_steps'] if part_a or part_b else 5
  out = ['# Newton-Schulz: Gram vs direct, tensor-parallel Gram vs gather', '']
  out.append(
    f'- date: {date}; wall time of the run {summary["wall_s"]:.0f} s'
    f'{" (--quick)" if args.quick else ""}'
  )
  out.append(f'- command: `{command}`')
  out.append(
    f'- machine: {machine["platform"]}, {machine["cpu_count"]} CPUs '
    f'({machine["cpu_model"]}), {machine["devices"]} simulated XLA:CPU '
    f'devices; load average at start {machine["load_average_start"]}, at '
    f'end {machine["load_average_end"]}. "Others\' CPU": share of all '
    'CPUs other processes used during the timed rounds (– under 0.5 s)'
  )
  if args.quick:
    out.append(
      '- **--quick**: tiny matrices for a CI smoke run; the times '
      'are dominated by overheads and mean little'
    )
  out.append(
    f'- software: python {machine["python"]}, jax {machine["jax"]}, '
    f'jaxlib {machine["jaxlib"]}, dmuon_jax {machine["dmuon_jax"]}'
  )
  out.append(
    f'- Newton-Schulz: `{NS_COEFFS}` coefficients, {steps} steps, '
    'Frobenius normalization, float32; Gram form restarts before '
    f'iteration(s) {", ".join(map(str, restarts)) or "none"}; random '
    'Gaussian inputs'
  )
  out.append(
    f'- timing: median of `reps` rounds after {args.warmup} warm-up '
    'call(s) of each; every round calls both variants of a row '
    '(alternating which goes first), `block_until_ready` after each call; '
    'compile time excluded'
  )
  out.append('')
  out.append(
    f'## A. Gram vs direct on one device ({args.batch} matrices '
    f'{s} x r·{s} per call)'
  )
  out.append('')
  out.append(
    '| r | shape | direct GFLOP | Gram GFLOP | predicted speedup | '
    'direct ms | Gram ms | measured speedup | direct GFLOP/s | '
    "Gram GFLOP/s | direct vs f64 | Gram vs f64 | reps | others' "
    'CPU |'
  )
  out.append(
    '|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|'
  )
  for row in part_a:
    dr, gr = row['direct'], row['gram']
    out.append(
      f'| {row["ratio"]} | {row["batch"]}×{row["shape"][0]}×'
      f'{row["shape"][1]} | {dr["predicted_flops"] / 1e9:.2f} | '
      f'{gr["predicted_flops"] / 1e9:.2f} | '
      f'{row["speedup_predicted"]:.2f}x | {dr["median_ms"]:.1f} | '
      f'{gr["median_ms"]:.1f} | {row["speedup_measured"]:.2f}x | '
      f'{dr["gflop_per_s"]:.1f} | {gr["gflop_per_s"]:.1f} | '
      f'{dr["rel_diff_vs_f64"]:.1e} | {gr["rel_diff_vs_f64"]:.1e} | '
      f'{reps(dr)} | '
      f'{_common.fmt_share(row["other_processes_cpu_share"])} |'
    )
  out.append('')
  pc, mc = (
    summary['predicted_crossover_ratio'],
    summary['measured_crossover_ratio'],
  )
  out.append(
    '- Gram becomes cheaper than direct, by predicted FLOPs, above '
    f'aspect ratio r = {pc:.2f}'
    if pc is not None
    else '- by predicted FLOPs, Gram is never cheaper'
  )
  out.append(
    '- measured: '
    + (
      f'Gram is faster from r ≈ {mc:.2f} (log-linear interpolation '
      'between the measured ratios; ≤ the first ratio when it is '
      'already faster there)'
      if mc is not None
      else 'Gram is not faster at any measured ratio'
    )
  )
  out.append(
    '- GFLOP: predicted matmul FLOPs of the batch (`matmul_flops`, 2 per '
    'multiply-add, normalization not counted); GFLOP/s = predicted FLOPs '
    '/ median time. "vs f64": max over the batch of ‖Y − Y₆₄‖_F / '
    '‖Y₆₄‖_F, Y₆₄ the same direct iteration in float64 NumPy. The '
    "compiled call's matmul FLOPs (`hlo_tools.dot_flops`, "
    'each `while` loop body times its trip count) are in the JSON as '
    "`flops`; XLA's `cost_analysis()` as `xla_cost_analysis_flops`, for "
    'reference only: it counts a loop body once (the direct iteration is '
    'a loop)'
  )
  out.append('')
  out.append(
    f'## B. Tensor-parallel Gram vs gather (d = {s}, f = '
    f'{args.ff_mult}·d = {args.ff_mult * s})'
  )
  out.append('')
  out.append(
    '| T | layout | matrix | variant | median ms | gather / TP '
    'time | matmul GFLOP / device (HLO) | GFLOP / device (predicted) | '
    'GFLOP/s (all T) | collective MB / device | collectives | TP vs '
    "gather | vs f64 | reps | others' CPU |"
  )
  out.append(
    '|---:|---|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|'
  )
  by_key = {(r['tp'], r['layout'], r['variant']): r for r in part_b}
  for row in part_b:
    tp_row = by_key[(row['tp'], row['layout'], 'tp')]
    ratio = (
      f'{row["median_ms"] / tp_row["median_ms"]:.2f}x'
      if row['variant'] == 'gather'
      else '1.00x'
    )
    split = 'cols' if row['split_axis'] == -1 else 'rows'
    rate = row['tp'] * row['flops_per_device'] / row['median_ms'] / 1e6
    out.append(
      f'| {row["tp"]} | {row["layout"]} | {row["shape"][0]}×'
      f'{row["shape"][1]}, {split} split | {row["variant"]} | '
      f'{row["median_ms"]:.1f} | {ratio} | '
      f'{row["flops_per_device"] / 1e9:.3f} | '
      f'{row["predicted_flops_per_device"] / 1e9:.3f} | {rate:.0f} | '
      f'{fmt_mb(row["collective_bytes_by_kind"])} | '
      f'{fmt_count(row["collective_count_by_kind"])} | '
      f'{row["rel_diff_tp_vs_gather"]:.1e} | '
      f'{row["rel_diff_vs_f64"]:.1e} | {reps(row)} | '
      f'{_common.fmt_share(row["other_processes_cpu_share"])} |'
    )
  out.append('')
  out.append(
    f"- `tp`: `{summary['tp_function']}` on each shard's slice: the d × d "
    "Gram of the unsplit dimension is the sum of the shards' local "
    'Grams, one all-reduce (AR) per restart window; the d × d iteration '
    'runs on every shard and each applies it to its own slice, so the '
    'matrix never moves. Predicted per device: 4·p·d²·(f/T) + (8k − '
    '6p)·d³ FLOPs (p restart windows, k steps) and p all-reduces of '
    'd²·4 bytes, 2(T−1)/T of that each (ring).'
  )
  out.append(
    '- `gather`: the gather baseline. `all_gather` (AG) of the slices '
    '((T−1)/T of the matrix arrives on each device), direct Newton-Schulz '
    'of the whole d × f matrix on every shard (the same work T times), '
    'then each shard keeps its slice (`dynamic_slice` at `axis_index`). '
    'Gathering to one shard and scattering the result back instead moves '
    'the same bytes per device (the root receives (T−1)/T of the matrix '
    'and sends as much back) and leaves T−1 shards idle during the '
    'iteration, so it is no faster than this.'
  )
  windows = len(restarts) + 1
  byte_ratio = args.ff_mult / (2 * windows)
  out.append(
    f'- Bytes: the TP path moves {windows}·2(T−1)/T·4d² bytes per device, '
    'the gather (T−1)/T·4df: fewer for TP only when f > '
    f'{2 * windows}·d. At f = {args.ff_mult}·d the gather moves '
    + (
      'the same bytes as TP'
      if byte_ratio == 1
      else f'{byte_ratio:.2g}x the TP bytes'
    )
    + '; what TP saves here is mostly the '
    'iteration on the whole matrix, which the gather baseline repeats on '
    'every shard. GFLOP/s (all T) = T × matmul GFLOP per device / median '
    'time: the rate the shared cores reached.'
  )
  out.append(
    '- Collective MB / device: compiled HLO, ring model (AG all-gather, '
    'AR all-reduce); collectives: executions per call. Matmul GFLOP / '
    'device (HLO): the `dot` instructions of the compiled per-device '
    'program (`hlo_tools.dot_flops`), each `while` loop body '
    "times its trip count; XLA's `cost_analysis()` FLOPs, which count a "
    'loop body once, are in the JSON as `xla_cost_analysis_flops`. "TP vs '
    'gather": '
    '‖Y_tp − Y_gather‖_F / ‖Y_gather‖_F over the whole matrix; "vs f64": '
    'against the float64 NumPy direct iteration.'
  )
  out.append(
    "- The T simulated devices share the machine's cores (XLA:CPU runs "
    'all device programs on one thread pool), so a time here is the '
    "total work of all T shards, not one shard's share of it."
  )
  return '\n'.join(out)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  main()
