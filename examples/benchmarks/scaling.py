"""Scaling of dmuon's optimizer step with the device count and model size.

For every simulated device count ``N`` in ``--devices`` (mesh ``1 x N``, axes
``('replicate', 'shard')``) and every Llama-like model size in ``--sizes``
(per layer q, k, v, o: d x d; gate, up: d x d_ff; down: d_ff x d; norm
scales; embedding, final norm and LM head on AdamW; float32), the drop-in
``dmuon`` step (``opt.update`` plus ``optax.apply_updates``, jitted,
replicated params, fixed random gradients, default ``ns_algorithm='auto'``)
is compiled and timed, and compared with the owner plan's prediction:

- per-device FLOPs: the matmul FLOPs of the compiled step's per-device
  program (``hlo_tools.dot_flops``: each ``while`` loop body,
  such as the Newton-Schulz iterations, times its trip count; the busiest
  ``lax.switch`` branch, i.e. the busiest owner's Newton-Schulz) against
  the plan's makespan (``plan_ownership(params, mesh).makespan``) and the
  floor ``max(total / N, largest matrix)`` from ``plan.units[i].cost``
  (XLA's ``cost_analysis`` counts a loop body once: only an extra JSON
  field, ``xla_cost_analysis_flops``);
- step time: the median of the timed steps against the predicted time
  ``makespan / matmul rate`` (``N`` devices each as fast as the measured
  rate) and ``total / matmul rate`` (what ``N`` simulated devices sharing
  this machine's cores can do at best);
- collective bytes per device by kind, and the compile time.

The device count is fixed when jax starts, so each ``N`` runs in its own
subprocess (``jax.config.update('jax_num_cpu_devices', N)``) that writes its
rows as JSON; this process collects them. Each subprocess measures the
matmul rate of its devices once per model size (a batched Gram product
``X Xᵀ`` of ``d x d_ff`` matrices, sharded over all ``N`` devices).

    python examples/benchmarks/scaling.py            # ~5 min, 2 cores
    python examples/benchmarks/scaling.py --quick    # < 60 s (CI)

Writes ``results/<name>.json`` (one JSON object per line),
``results/<name>.md`` and ``results/<name>.png`` next to this file (or under
``--out-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

# Shared helpers (model shapes, machine description, CPU meter, timing).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position

# name: (layers, d_model, d_ff, vocab). d_ff = 4 d and 3 layers keep the
# owner plan within 7% of max(total / N, largest matrix) for every N up to
# 32 (21 matrices of two costs; other layer counts and ratios pack worse).
SIZES = {
  'small': (3, 128, 512, 1024),
  'medium': (3, 256, 1024, 2048),
  'large': (3, 512, 2048, 4096),
  'tiny': (3, 64, 256, 128),
  'mini': (3, 128, 512, 256),
}
FULL_SIZES = 'small,medium,large'
QUICK_SIZES = 'mini'
FULL_DEVICES = '1,2,4,8,16,32'
QUICK_DEVICES = '1,2,8'
FLOPS_TOLERANCE = 0.15


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=_common.HelpFormatter,
  )
  p.add_argument(
    '--devices',
    default=None,
    help=f'comma-separated device counts N (unset: '
    f'{FULL_DEVICES}; {QUICK_DEVICES} with --quick)',
  )
  p.add_argument(
    '--sizes',
    default=None,
    help='comma-separated model sizes: names from '
    f'{sorted(SIZES)} or [NAME=]LAYERSxDxD_FFxVOCAB, e.g. '
    'xl=2x1024x4096x1024'
    f' (unset: {FULL_SIZES}; {QUICK_SIZES} with --quick)',
  )
  p.add_argument(
    '--reps',
    type=int,
    default=5,
    help='timed steps per (size, N) (median reported; --quick: 3)',
  )
  p.add_argument(
    '--warmup', type=int, default=1, help='untimed steps after compilation'
  )
  p.add_argument(
    '--min-reps',
    type=int,
    default=3,
    help='fewest timed steps when --budget-s cuts reps',
  )
  p.add_argument(
    '--budget-s',
    type=float,
    default=10.0,
    help='per-(size, N) time budget of the timed steps',
  )
  _common.add_common_args(
    p, 'scaling', 'a small model, N up to 8, few reps: a CI smoke run (< 60 s)'
  )
  p.add_argument(
    '--timeout-s',
    type=float,
    default=900.0,
    help='time limit of one device-count subprocess',
  )
  # Internal: run one device count and write its rows to --worker-out.
  p.add_argument('--worker', type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument('--worker-out', default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  _common.apply_quick(p, args, argv, {'reps': 3, 'warmup': 1, 'min_reps': 3})
  if args.devices is None:
    args.devices = QUICK_DEVICES if args.quick else FULL_DEVICES
  if args.sizes is None:
    args.sizes = QUICK_SIZES if args.quick else FULL_SIZES
  args.devices = [int(v) for v in str(args.devices).split(',') if v]
  args.sizes = [parse_size(v) for v in str(args.sizes).split(',') if v]
  if args.name is None:
    args.name = 'scaling_quick' if args.quick else 'scaling'
  if args.out_dir is None:
    args.out_dir = str(pathlib.Path(__file__).resolve().parent / 'results')
  return args


def parse_size(text: str) -> dict:
  """A size name or ``LxDxFxV`` as a dict of the model's dimensions."""
  name, _, spec = text.strip().rpartition('=')
  if spec in SIZES:
    layers, d, d_ff, vocab = SIZES[spec]
    name = name or spec
  else:
    try:
      layers, d, d_ff, vocab = (int(v) for v in spec.lower().split('x'))
    except ValueError:
      raise SystemExit(
        f'unknown size {text!r}: use one of {sorted(SIZES)} '
        'or [NAME=]LAYERSxDxD_FFxVOCAB'
      ) from None
    name = name or f'L{layers}-d{d}-f{d_ff}'
  return {
    'size': name,
    'layers': layers,
    'd_model': d,
    'd_ff': d_ff,
    'vocab': vocab,
  }


def size_arg(size: dict) -> str:
  return (
    f'{size["size"]}={size["layers"]}x{size["d_model"]}x'
    f'{size["d_ff"]}x{size["vocab"]}'
  )


# ---------------------------------------------------------------------------
# Worker: one device count, every size.


def run_worker(args):  # pylint: disable=too-many-locals
  n_dev = args.worker
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_num_cpu_devices', n_dev)
  jax.config.update('jax_platforms', 'cpu')
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top

  if jax.device_count() != n_dev:
    sys.exit(f'expected {n_dev} devices, got {jax.device_count()}')
  axes = ('replicate', 'shard')
  mesh = jax.make_mesh(
    (1, n_dev), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  replicated = NamedSharding(mesh, P())
  machine = _common.machine_info(jax, optax, dmuon_jax)
  rows = []

  def is_shape(x):
    return isinstance(x, tuple)

  for size in args.sizes:
    rng = np.random.default_rng(args.seed)
    shapes = _common.llama_shapes(
      size['layers'], size['d_model'], size['d_ff'], size['vocab']
    )
    host_params = jax.tree.map(
      lambda sh, r=rng: (0.02 * r.standard_normal(sh)).astype(np.float32),
      shapes,
      is_leaf=is_shape,
    )
    host_grads = jax.tree.map(
      lambda sh, r=rng: (1e-3 * r.standard_normal(sh)).astype(np.float32),
      shapes,
      is_leaf=is_shape,
    )
    n_params = sum(x.size for x in jax.tree.leaves(host_params))

    # --- The plan's prediction (shapes only). -----------------------------
    plan = dmuon_jax.plan_ownership(host_params, mesh)
    costs = [float(u.cost) for u in plan.units]
    total = sum(costs)
    largest = max(costs)
    floor = max(total / n_dev, largest)

    # --- Matmul rate: a batched Gram product of d x d_ff matrices, sharded
    # over all devices (at least 8 products in all, a multiple of N). -----
    m, k = size['d_model'], size['d_ff']
    batch = n_dev * max(1, math.ceil(8 / n_dev))
    mm_x = jax.device_put(
      rng.standard_normal((batch, m, k)).astype(np.float32),
      NamedSharding(mesh, P(axes)),
    )
    gram = jax.jit(lambda x: jnp.einsum('bik,bjk->bij', x, x))
    mm_flops = batch * 2.0 * m * m * k
    gram(mm_x).block_until_ready()
    mm_times = []
    meter = _common.CpuMeter()
    for _ in range(7):
      t0 = time.perf_counter()
      gram(mm_x).block_until_ready()
      mm_times.append(time.perf_counter() - t0)
    mm_rate = mm_flops / statistics.median(mm_times)
    mm_other = meter.other_share()
    del mm_x

    # --- The drop-in step on replicated params. ---------------------------
    opt = dmuon_jax.dmuon(0.02, adam_learning_rate=3e-3, mesh=mesh)
    params = jax.device_put(host_params, replicated)
    grads = jax.device_put(host_grads, replicated)
    state = _common.on_mesh(opt.init(params), replicated)

    def fn(params, opt_state, grads, opt=opt):
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
      fn,
      donate_argnums=(0, 1),
      out_shardings=(
        jax.tree.map(lambda x: x.sharding, params),
        jax.tree.map(lambda x: x.sharding, state),
      ),
    )
    t0 = time.perf_counter()
    lowered = step.lower(params, state, grads)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    report = dmuon_jax.analyze_compiled(compiled)
    flops = _common.flop_counts(compiled, report)
    per_device = flops['flops_per_device']
    times, first, other_cpu = _common.time_steps(
      compiled,
      params,
      state,
      grads,
      reps=args.reps,
      warmup=args.warmup,
      min_reps=args.min_reps,
      budget_s=args.budget_s,
      block=jax.block_until_ready,
    )
    bytes_by_kind, count_by_kind = _common.collective_summary(report)
    median_s = statistics.median(times)
    row = dict(size)
    row.update(
      {
        'config': f'{size["size"]}-N{n_dev}',
        'devices': n_dev,
        'mesh': f'1x{n_dev}',
        'params': 'replicated',
        'path': 'drop-in',
        'ns_algorithm': 'auto',
        'n_params': int(n_params),
        'matrices': len(costs),
        'ns_flops_total': total,
        'ns_flops_largest': largest,
        'ns_flops_floor': floor,
        'plan_makespan': float(plan.makespan),
        'plan_imbalance': float(plan.imbalance),
        'plan_over_floor': float(plan.makespan) / floor,
        **flops,
        'flops_ratio_vs_floor': per_device / floor,
        'flops_ratio_vs_makespan': per_device / plan.makespan,
        'matmul_shape': [batch, m, k],
        'matmul_flop_per_s': mm_rate,
        'matmul_other_processes_cpu_share': mm_other,
        'predicted_ms': 1e3 * plan.makespan / mm_rate,
        'predicted_shared_ms': 1e3 * total / mm_rate,
        'median_ms': 1e3 * median_s,
        'min_ms': 1e3 * min(times),
        'times_ms': [1e3 * t for t in times],
        'first_step_ms': 1e3 * first,
        'reps': len(times),
        'reps_requested': args.reps,
        'other_processes_cpu_share': other_cpu,
        'lower_s': t1 - t0,
        'compile_s': t2 - t1,
        'compile_total_s': t2 - t0,
        'collective_bytes_by_kind': bytes_by_kind,
        'collective_count_by_kind': count_by_kind,
        'collective_bytes_total': float(report.total_bytes()),
        'peak_bytes_per_device': report.peak_bytes,
        'load_average': _common.load_average(),
        'machine': machine,
      }
    )
    rows.append(row)
    print(
      f'N={n_dev:>2} {size["size"]:>6}: '
      f'{per_device / 1e9:8.3f} matmul GFLOP/device (floor '
      f'{floor / 1e9:.3f}, x{row["flops_ratio_vs_floor"]:.3f}; '
      f'x{row["flops_ratio_vs_makespan"]:.3f} of the makespan), '
      f'{row["median_ms"]:8.1f} ms median of {len(times)} (predicted '
      f'{row["predicted_ms"]:.1f}, shared cores '
      f'{row["predicted_shared_ms"]:.1f}), compile '
      f'{row["compile_total_s"]:5.1f} s, '
      f'{_common.fmt_collectives(bytes_by_kind)} MB; matmul '
      f'{mm_rate / 1e9:.1f} GFLOP/s; others used '
      f'{_common.fmt_share(other_cpu)} of the CPUs',
      flush=True,
    )
    del params, state, grads, compiled, lowered, step, opt
  with open(args.worker_out, 'w', encoding='utf-8') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')


# ---------------------------------------------------------------------------
# Parent: one subprocess per device count, then tables and plots.


def child_env() -> dict:
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # The device count comes from jax_num_cpu_devices in the child; a forced
  # host device count in XLA_FLAGS would override it.
  flags = [
    f
    for f in env.get('XLA_FLAGS', '').split()
    if 'xla_force_host_platform_device_count' not in f
  ]
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  else:
    env.pop('XLA_FLAGS', None)
  return env


def run_device_count(args, n_dev, tmp_dir) -> list[dict]:
  out = pathlib.Path(tmp_dir, f'n{n_dev}.json')
  cmd = [
    sys.executable,
    str(pathlib.Path(__file__).resolve()),
    '--worker',
    str(n_dev),
    '--worker-out',
    str(out),
    '--sizes',
    ','.join(size_arg(s) for s in args.sizes),
    '--reps',
    str(args.reps),
    '--warmup',
    str(args.warmup),
    '--min-reps',
    str(args.min_reps),
    '--budget-s',
    str(args.budget_s),
    '--seed',
    str(args.seed),
  ]
  proc = subprocess.run(
    cmd, env=child_env(), timeout=args.timeout_s, check=False
  )
  if proc.returncode or not out.exists():
    raise RuntimeError(
      f'device count {n_dev}: subprocess failed (exit {proc.returncode})'
    )
  return [json.loads(line) for line in out.read_text().splitlines() if line]


class RunMeter:
  """Like ``optimizer_step.CpuMeter``, counting waited-for children as own.

  The parent spends its time waiting for the per-N subprocesses, whose CPU
  time ``os.times`` reports as children's time once they have exited.
  """

  def __init__(self):
    self._start = _common.cpu_sample()
    self._children = self._children_s()

  @staticmethod
  def _children_s() -> float:
    t = os.times()
    return t.children_user + t.children_system

  def other_share(self) -> float | None:
    (w0, b0, o0), (w1, b1, o1) = self._start, _common.cpu_sample()
    if b0 is None or b1 is None or w1 - w0 < 0.5:
      return None
    own = (o1 - o0) + (self._children_s() - self._children)
    share = ((b1 - b0) - own) / ((w1 - w0) * (os.cpu_count() or 1))
    return round(min(max(share, 0.0), 1.0), 3)


def flops_pass(row) -> bool:
  # Newton-Schulz FLOPs are the matmuls of the busiest device's program,
  # loops times their trip counts (the step's only matmuls are NS).
  r = row['flops_ratio_vs_floor']
  return math.isfinite(r) and 1 - FLOPS_TOLERANCE <= r <= 1 + FLOPS_TOLERANCE


def main(argv=None):
  args = parse_args(argv)
  if args.worker is not None:
    run_worker(args)
    return None
  wall_start = time.perf_counter()
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
  load_start = _common.load_average()
  meter = RunMeter()
  rows = []
  with tempfile.TemporaryDirectory() as tmp_dir:
    for n_dev in args.devices:
      rows += run_device_count(args, n_dev, tmp_dir)
  wall_s = time.perf_counter() - wall_start
  machine = dict(rows[0]['machine']) if rows else {}
  machine.pop('devices', None)
  machine.update(
    {
      'load_average_start': load_start,
      'load_average_end': _common.load_average(),
      'other_processes_cpu_share': meter.other_share(),
    }
  )
  for row in rows:
    row.pop('machine', None)
  ok = all(flops_pass(r) for r in rows)
  command = 'python examples/benchmarks/scaling.py ' + ' '.join(
    sys.argv[1:] if argv is None else argv
  )

  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  png_path = out_dir / f'{args.name}.png'
  plot(rows, args, png_path)
  md = render_markdown(
    args, rows, date, machine, command.strip(), wall_s, ok, png_path.name
  )
  print()
  print(md)
  common = {'date': date, 'benchmark': 'scaling', 'quick': args.quick}
  json_path = out_dir / f'{args.name}.json'
  with open(json_path, 'w', encoding='utf-8') as f:
    for row in rows:
      f.write(json.dumps(dict(common, **row)) + '\n')
    f.write(
      json.dumps(
        dict(
          common,
          config='summary',
          machine=machine,
          wall_s=wall_s,
          devices=args.devices,
          sizes=[s['size'] for s in args.sizes],
          flops_tolerance=FLOPS_TOLERANCE,
          flops_pass=ok,
          command=command.strip(),
        )
      )
      + '\n'
    )
  md_path = out_dir / f'{args.name}.md'
  md_path.write_text(md + '\n', encoding='utf-8')
  print(f'\nwrote {json_path}, {md_path} and {png_path} ({wall_s:.0f} s)')
  return rows


def stop_point(rows) -> int | None:
  """Smallest N from which the floor is the largest matrix (per size)."""
  for r in sorted(rows, key=lambda r: r['devices']):
    if r['ns_flops_total'] / r['devices'] <= r['ns_flops_largest']:
      return r['devices']
  return None


def render_markdown(
  args, rows, date, machine, command, wall_s, ok, png_name
) -> str:
  """Table, summary line and notes as markdown."""
  sizes = [s['size'] for s in args.sizes]
  out = ['# dmuon optimizer step: scaling with devices and model size', '']
  out.append(
    f'- date: {date}; wall time of the run {wall_s:.0f} s'
    f'{" (--quick)" if args.quick else ""}'
  )
  out.append(f'- command: `{command}`')
  out.append(
    f'- machine: {machine.get("cpu_count")} CPUs '
    f'({machine.get("cpu_model")}), simulated XLA:CPU devices (one '
    f'subprocess per N, mesh 1xN, axes replicate x shard); load average '
    f'at start {machine.get("load_average_start")}, at end '
    f'{machine.get("load_average_end")}; other processes used '
    f'{_common.fmt_share(machine.get("other_processes_cpu_share"))} of '
    'the CPUs over the whole run ("others\' CPU" per row: during its '
    'warm-up and timed steps)'
  )
  out.append(
    f'- software: python {machine.get("python")}, jax {machine.get("jax")}'
    f', jaxlib {machine.get("jaxlib")}, optax {machine.get("optax")}, '
    f'dmuon_jax {machine.get("dmuon_jax")}'
  )
  for s in args.sizes:
    rs = [r for r in rows if r['size'] == s['size']]
    if not rs:
      continue
    r0, stop = rs[0], stop_point(rs)
    out.append(
      f'- size **{s["size"]}**: {s["layers"]} layers, d_model '
      f'{s["d_model"]}, d_ff {s["d_ff"]}, vocab {s["vocab"]}, float32, '
      f'{r0["n_params"] / 1e6:.2f}M params, {r0["matrices"]} Muon '
      f'matrices (embed and LM head on AdamW), NS '
      f'{r0["ns_flops_total"] / 1e9:.2f} GFLOP per step in all, largest '
      f'matrix {r0["ns_flops_largest"] / 1e9:.3f} GFLOP (total / largest '
      f'= {r0["ns_flops_total"] / r0["ns_flops_largest"]:.1f}: the floor '
      + (
        f'is the largest matrix from N = {stop} on)'
        if stop
        else 'is total / N for every N here)'
      )
    )
  out.append(
    f'- step: `dmuon(0.02, mesh=mesh)` drop-in (default '
    f"`ns_algorithm='auto'`, 5 NS steps) update + `optax.apply_updates`,"
    f' jitted, replicated params, fixed random gradients, params and state '
    f'donated and fed back; median of {args.reps} timed steps after '
    f'{args.warmup} warm-up step(s) (fewer when a step is slow: '
    f'`--budget-s {args.budget_s:g}`); compile = lower + compile'
  )
  out.append('')
  verdict = 'PASS' if ok else 'FAIL'
  worst = max(rows, key=lambda r: abs(r['flops_ratio_vs_floor'] - 1))
  out.append(
    f'**{verdict}**: measured per-device Newton-Schulz (matmul) FLOPs / '
    f'max(total / N, largest matrix) within [{1 - FLOPS_TOLERANCE:.2f}, '
    f'{1 + FLOPS_TOLERANCE:.2f}] for all {len(rows)} (size, N) '
    f'(furthest: {worst["config"]} at '
    f'{worst["flops_ratio_vs_floor"]:.3f})'
    if ok
    else f'**{verdict}**: measured per-device Newton-Schulz (matmul) FLOPs / '
    f'max(total / N, largest matrix) outside [{1 - FLOPS_TOLERANCE:.2f}, '
    f'{1 + FLOPS_TOLERANCE:.2f}] for '
    + ', '.join(
      f'{r["config"]} ({r["flops_ratio_vs_floor"]:.3f})'
      for r in rows
      if not flops_pass(r)
    )
  )
  out.append('')
  out.append(
    '| size | N | NS matmul GFLOP / device | plan makespan GFLOP | '
    'floor GFLOP | NS matmul FLOPs / floor | makespan / floor | '
    'NS matmul FLOPs / makespan | median ms '
    '| predicted ms | shared-cores ms | measured / shared | reps | '
    "others' CPU | compile s | collective MB / device | matmul "
    'GFLOP/s |'
  )
  out.append(
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|'
    '---:|---:|---:|---|---:|'
  )
  for size in sizes:
    for r in sorted(
      (r for r in rows if r['size'] == size), key=lambda r: r['devices']
    ):
      reps = str(r['reps']) + ('*' if r['reps'] < r['reps_requested'] else '')
      out.append(
        f'| {size} | {r["devices"]} | {r["flops_per_device"] / 1e9:.3f} | '
        f'{r["plan_makespan"] / 1e9:.3f} | '
        f'{r["ns_flops_floor"] / 1e9:.3f} | '
        f'{r["flops_ratio_vs_floor"]:.3f} | {r["plan_over_floor"]:.3f} | '
        f'{r["flops_ratio_vs_makespan"]:.3f} | '
        f'{r["median_ms"]:.1f} | {r["predicted_ms"]:.1f} | '
        f'{r["predicted_shared_ms"]:.1f} | '
        f'{r["median_ms"] / r["predicted_shared_ms"]:.2f} | {reps} | '
        f'{_common.fmt_share(r["other_processes_cpu_share"])} | '
        f'{r["compile_total_s"]:.1f} | '
        f'{_common.fmt_collectives(r["collective_bytes_by_kind"])} | '
        f'{r["matmul_flop_per_s"] / 1e9:.1f} |'
      )
  if any(r['reps'] < r['reps_requested'] for r in rows):
    out.append('')
    out.append(
      f'\\* fewer reps than the requested {args.reps} (the '
      f'per-(size, N) budget is {args.budget_s:g} s).'
    )
  out.append('')
  out.append(f'![scaling]({png_name})')
  out.append('')
  out.append('## Notes')
  out.append('')
  out.append(
    '- NS matmul GFLOP / device: the `dot` instructions of the compiled '
    "step's (update + apply_updates) per-device program "
    '(`hlo_tools.dot_flops`, `2 * output elements * '
    'contracted size` each), every `while` loop body times its trip count '
    '(the 5 Newton-Schulz steps run in a loop) and the most expensive '
    "branch of each `lax.switch` (dmuon runs each owner's Newton-Schulz "
    "in its own branch, so this is the busiest owner's work). The step's "
    'only matmuls are Newton-Schulz. NS matmul FLOPs / makespan = 1.000 '
    "means the plan's cost model is exactly what the busiest device "
    "multiplies. XLA's `cost_analysis()` FLOPs are in the JSON as "
    '`xla_cost_analysis_flops`, for reference only: they add the '
    'elementwise work (momentum, AdamW on the embedding and LM head, '
    'apply_updates) but count a loop body once.'
  )
  out.append(
    "- floor = max(total NS FLOPs / N, largest matrix's NS FLOPs), costs "
    'from `plan_ownership(params, mesh).units[i].cost` (the cost model of '
    'the form `auto` runs per shape: direct `20 m²n + 10 m³`, Gram '
    '`8 m²n + 28 m³`, m ≤ n). A matrix is never split across owners, so '
    'once N exceeds total / largest the busiest device holds one largest '
    'matrix and per-device work stops falling; the plan makespan can '
    'exceed the floor when whole matrices do not pack evenly (makespan / '
    'floor column).'
  )
  out.append(
    '- predicted ms = plan makespan / matmul rate: the step on N real '
    'devices each as fast as the measured rate. shared-cores ms = total '
    'NS FLOPs / matmul rate: the best the N simulated devices can do here, '
    "since they share the machine's cores (XLA:CPU runs every device "
    'program on one thread pool). **The measured step time at large N '
    'therefore reflects the total work (plus per-device overheads, which '
    'grow with N: every device repeats AdamW and apply_updates on the '
    'replicated params), not the per-device work**; compare it with '
    'the shared-cores column, and the per-device FLOPs with the floor.'
  )
  out.append(
    '- matmul GFLOP/s: aggregate rate of a batched `d x d_ff` Gram '
    'product (at least 8 products, a multiple of N, sharded over the N '
    'devices), measured once per size in each subprocess before the '
    'step.'
  )
  out.append(
    '- Collective MB / device come from the compiled HLO (ring model; AG '
    'all-gather). With replicated params the drop-in step all-gathers '
    "the owners' results: (N-1)/N of the Muon matrices' bytes, padded "
    'to the busiest slot.'
  )
  out.append(
    '- Simulated devices share 2 cores with other jobs: step times are '
    'noisy (see "others\' CPU"); FLOPs and collective bytes are exact.'
  )
  return '\n'.join(out)


def plot(rows, args, path):
  """Three panels: per-device NS matmul GFLOP, step time and compile time
  vs N."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axs = plt.subplots(1, 3, figsize=(17, 6.4))
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, s in enumerate(args.sizes):
    rs = sorted(
      (r for r in rows if r['size'] == s['size']), key=lambda r: r['devices']
    )
    if not rs:
      continue
    c = colors[i % len(colors)]
    n = [r['devices'] for r in rs]
    ax = axs[0]
    ax.plot(
      n,
      [r['flops_per_device'] / 1e9 for r in rs],
      'o-',
      color=c,
      label=f'{s["size"]}: measured (HLO matmuls)',
    )
    ax.plot(
      n,
      [r['ns_flops_floor'] / 1e9 for r in rs],
      's--',
      color=c,
      mfc='none',
      label=f'{s["size"]}: floor max(total/N, largest)',
    )
    ax.axhline(
      rs[0]['ns_flops_largest'] / 1e9,
      color=c,
      ls=':',
      lw=1,
      label=f'{s["size"]}: largest matrix',
    )
    ax = axs[1]
    ax.plot(
      n,
      [r['median_ms'] for r in rs],
      'o-',
      color=c,
      label=f'{s["size"]}: measured',
    )
    ax.plot(
      n,
      [r['predicted_ms'] for r in rs],
      's--',
      color=c,
      mfc='none',
      label=f'{s["size"]}: predicted makespan / rate',
    )
    ax.plot(
      n,
      [r['predicted_shared_ms'] for r in rs],
      '^:',
      color=c,
      mfc='none',
      label=f'{s["size"]}: total / rate (shared cores)',
    )
    axs[2].plot(
      n, [r['compile_total_s'] for r in rs], 'o-', color=c, label=s['size']
    )
  titles = (
    'Newton-Schulz work of the busiest device',
    'Optimizer step time (N devices share 2 cores)',
    'Compile time (lower + compile)',
  )
  ylabels = ('NS matmul GFLOP per device', 'step time (ms)', 'compile time (s)')
  for ax, title, ylabel in zip(axs, titles, ylabels, strict=True):
    ax.set_xscale('log', base=2)
    ax.set_xticks(args.devices)
    ax.set_xticklabels([str(v) for v in args.devices])
    ax.set_xlabel('simulated devices N (mesh 1 x N)')
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which='both', alpha=0.3)
  axs[0].set_yscale('log')
  axs[1].set_yscale('log')
  for ax in axs:  # Below the panels: the lines fill the axes.
    ax.legend(
      fontsize=7,
      loc='upper center',
      bbox_to_anchor=(0.5, -0.14),
      ncol=min(3, len(args.sizes))
      if ax is axs[2]
      else 1 + (len(args.sizes) > 1),
    )
  fig.suptitle(
    'dmuon drop-in optimizer step vs simulated device count'
    f'{" (--quick)" if args.quick else ""}'
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  main()
