"""Optimizer-step benchmark: dmuon vs optax.contrib.muon vs AdamW.

One run on simulated CPU devices (8 by default, mesh 1x8) of a Llama-like
parameter tree (per layer q, k, v, o: d x d; gate, up: d x d_ff; down:
d_ff x d; two norm scales; plus embedding, final norm and LM head; float32).
Each configuration times the optimizer step only (``opt.update`` plus
``optax.apply_updates``, jitted, fixed random gradients as inputs), with the
compile time measured apart from the steady-state median:

1. ``optax.adamw`` on FSDP-sharded params,
2. ``optax.contrib.muon`` on replicated params (every device orthogonalizes
   every matrix),
3. ``optax.contrib.muon`` on FSDP-sharded params (XLA decides),
4. ``dmuon`` drop-in on replicated params,
5. ``dmuon`` drop-in on FSDP-sharded params,
6. ``dmuon`` explicit path (per-device gradients in; the reduction to the
   owners is part of the measured step).

Configurations 1-5 get gradients that are already reduced over devices
(as plain ``jax.jit`` data parallelism delivers them); 6 gets per-device
gradients and reduces them itself. A second table routes the embedding and the
LM head to Muon too (every 2-D leaf) for dmuon vs optax on replicated params.

The machine's matmul rate (a batched ``512 x 1536`` Gram product, sharded over
all devices) gives the machine floor: total Newton-Schulz FLOPs of the plan
divided by that rate. Per configuration: compile time, median step time,
matmul FLOPs per device (``hlo_tools.dot_flops`` of the compiled step:
``while`` loops times their trip counts, the busiest ``lax.switch`` branch;
XLA's ``cost_analysis`` counts a loop body once, so it is only an extra JSON
field), collective bytes per device by kind and peak memory.

    python examples/benchmarks/optimizer_step.py            # ~10 min, 2 cores
    python examples/benchmarks/optimizer_step.py --quick    # < 1 min (CI)

Writes ``results/<name>.json`` (one JSON object per line) and
``results/<name>.md`` next to this file (or under ``--out-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

KIND_ABBREV = {
  'all-gather': 'AG',
  'reduce-scatter': 'RS',
  'all-reduce': 'AR',
  'all-to-all': 'A2A',
  'collective-permute': 'CP',
  'collective-broadcast': 'CB',
}

TARGET_VS_REPLICATED = 7.5
TARGET_VS_FSDP = 1.5
TARGET_VS_FLOOR = 1.3


class HelpFormatter(
  argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
  """Defaults in ``--help``; the description keeps its line breaks."""


def add_common_args(p, stem: str, quick_help: str) -> None:
  """The options every CPU benchmark here takes: --quick, --out-dir,
  --name (file stem: ``stem``, or ``stem_quick`` with --quick), --seed."""
  p.add_argument(
    '--quick',
    action='store_true',
    help=quick_help + '; options given explicitly override its settings',
  )
  p.add_argument(
    '--out-dir',
    default=None,
    help='where to write results (unset: results/ beside this script)',
  )
  p.add_argument(
    '--name',
    default=None,
    help=f'output file stem (unset: {stem}, or {stem}_quick with --quick)',
  )
  p.add_argument(
    '--seed', type=int, default=0, help='seed of the random inputs'
  )


def given_options(p, argv=None) -> set[str]:
  """The ``dest`` of every option of parser ``p`` given in ``argv``
  (``sys.argv[1:]`` if None), whatever its value."""
  saved = [(a, a.default) for a in p._actions]  # pylint: disable=protected-access
  try:
    for a, _ in saved:
      a.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))
  finally:
    for a, default in saved:
      a.default = default


def apply_quick(p, args, argv, settings: dict) -> None:
  """``--quick``: ``settings`` (dest -> value) for the options not given
  explicitly in ``argv``."""
  if not args.quick:
    return
  given = given_options(p, argv)
  for dest, value in settings.items():
    if dest not in given:
      setattr(args, dest, value)


QUICK = {
  'layers': 2,
  'd_model': 128,
  'd_ff': 384,
  'vocab': 1024,
  'reps': 3,
  'warmup': 1,
  'min_reps': 3,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=HelpFormatter,
  )
  p.add_argument(
    '--layers', type=int, default=8, help='transformer layers (--quick: 2)'
  )
  p.add_argument(
    '--d-model', type=int, default=512, help='model width (--quick: 128)'
  )
  p.add_argument(
    '--d-ff', type=int, default=1536, help='MLP width (--quick: 384)'
  )
  p.add_argument(
    '--vocab', type=int, default=8192, help='vocabulary (--quick: 1024)'
  )
  p.add_argument(
    '--mesh', default='1x8', help='replicate x shard, e.g. 1x8, 2x4, 8x1'
  )
  p.add_argument(
    '--reps',
    type=int,
    default=5,
    help='timed steps per configuration (median reported; --quick: 3)',
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
    default=75.0,
    help='per-configuration time budget for the timed steps: '
    'slow configurations (optax on replicated params) run '
    'fewer reps (never under --min-reps); reported as such',
  )
  p.add_argument(
    '--no-all-2d',
    action='store_true',
    help='skip the second table (embed and LM head on Muon)',
  )
  p.add_argument(
    '--no-breakdown',
    action='store_true',
    help='skip the 1-iteration dmuon runs that split the step '
    'time into Newton-Schulz and the rest',
  )
  p.add_argument(
    '--only',
    default=None,
    help='comma-separated config names to run (debugging; unset: all)',
  )
  add_common_args(
    p, 'optimizer_step', 'tiny model, few reps: a CI smoke run (< 60 s)'
  )
  args = p.parse_args(argv)
  apply_quick(p, args, argv, QUICK)
  if args.name is None:
    args.name = 'optimizer_step_quick' if args.quick else 'optimizer_step'
  if args.out_dir is None:
    args.out_dir = str(pathlib.Path(__file__).resolve().parent / 'results')
  return args


# ---------------------------------------------------------------------------
# Model and machine description.


def llama_shapes(layers: int, d: int, d_ff: int, vocab: int):
  """A Llama-like parameter tree of shapes (dicts and a list of layers)."""
  layer = {
    'attn': {k: {'kernel': (d, d)} for k in ('q', 'k', 'v', 'o')},
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


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return None


def cpu_sample() -> tuple[float, float | None, float]:
  """``(wall s, busy s of all CPUs from /proc/stat or None, own CPU s)``."""
  busy = None
  try:
    with open('/proc/stat', encoding='utf-8') as f:
      vals = [int(v) for v in f.readline().split()[1:]]
    # user, nice, system, irq, softirq, steal.
    busy = sum(vals[i] for i in (0, 1, 2, 5, 6, 7) if i < len(vals))
    busy /= os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError):
    pass
  t = os.times()
  return time.perf_counter(), busy, t.user + t.system


class CpuMeter:
  """Share of the machine's CPU time used by *other* processes.

  Reads the busy time of all CPUs from ``/proc/stat`` and subtracts this
  process's own CPU time (``os.times``), over the interval since
  construction. Hypervisor steal time counts as "other". None where
  ``/proc/stat`` is unavailable.
  """

  def __init__(self):
    self._start = cpu_sample()

  def other_share(self) -> float | None:
    (w0, b0, o0), (w1, b1, o1) = self._start, cpu_sample()
    # /proc/stat counts in clock ticks (10 ms): too coarse below ~0.5 s.
    if b0 is None or b1 is None or w1 - w0 < 0.5:
      return None
    share = ((b1 - b0) - (o1 - o0)) / ((w1 - w0) * (os.cpu_count() or 1))
    return round(min(max(share, 0.0), 1.0), 3)


def pyplot():
  """``matplotlib.pyplot`` on the non-interactive Agg backend, or None if
  matplotlib is not installed (the plots are optional)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return plt


def machine_info(jax, optax, dmuon_jax) -> dict:
  return {
    'cpu_count': os.cpu_count(),
    'cpu_model': cpu_model(),
    'platform': platform.platform(),
    'python': platform.python_version(),
    'jax': jax.__version__,
    'jaxlib': getattr(jax.lib, '__version__', None)
    or __import__('jaxlib').__version__,
    'optax': optax.__version__,
    'dmuon_jax': dmuon_jax.__version__,
    'devices': jax.device_count(),
    'device_kind': jax.devices()[0].device_kind,
  }


# ---------------------------------------------------------------------------
# Measurement.


def time_steps(
  step,
  params,
  state,
  grads,
  *,
  reps,
  warmup,
  min_reps,
  budget_s,
  block,
  on_first=None,
):
  """Runs warm-up + timed steps, feeding outputs back.

  The first warm-up step's duration estimates the step time: if ``reps``
  steps would exceed ``budget_s``, fewer (at least ``min_reps``) are timed.
  ``on_first(params)``, if given, sees the params after the first step.

  Returns:
    (timed step durations in s, the first warm-up step's duration in s, the
    CPU share other processes used meanwhile or None).
  """
  first = None
  meter = CpuMeter()
  for i in range(max(warmup, 1)):
    t0 = time.perf_counter()
    params, state = step(params, state, grads)
    block((params, state))
    if i == 0:
      first = time.perf_counter() - t0
      if on_first is not None:
        on_first(params)
  n = reps
  if first * reps > budget_s:
    n = max(min_reps, int(budget_s // first))
    n = min(n, reps)
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    params, state = step(params, state, grads)
    block((params, state))
    times.append(time.perf_counter() - t0)
  return times, first, meter.other_share()


def on_mesh(tree, replicated):
  """``tree`` with arrays on fewer devices than ``replicated`` (the scalars
  of an optimizer's init sit on one device) replicated over the mesh."""
  import jax  # pylint: disable=g-import-not-at-top

  n_dev = len(replicated.device_set)

  def put(x):
    if isinstance(x, jax.Array) and len(x.sharding.device_set) < n_dev:
      return jax.device_put(x, replicated)
    return x

  return jax.tree.map(put, tree)


def collective_summary(report) -> tuple[dict, dict]:
  return (
    {k: float(v) for k, v in report.bytes_by_kind.items()},
    {k: int(v) for k, v in report.count_by_kind.items()},
  )


def flop_counts(compiled, report) -> dict:
  """The per-device FLOP fields of a JSON row, from ``compiled`` and its
  ``dmuon_jax.analyze_compiled`` report.

  ``flops_per_device``: the matmul FLOPs of one device's program
  (``hlo_tools.dot_flops``: ``2 * out * contracted`` per ``dot``, each
  ``while`` body times its trip count, the busiest branch of each
  ``lax.switch``, i.e. the busiest owner's Newton-Schulz). Both dmuon and
  optax.contrib.muon run their Newton-Schulz iterations in a loop, so this
  is the figure every ratio here uses. ``xla_cost_analysis_flops``: XLA's
  ``cost_analysis()['flops']`` (``report.flops``), kept for reference only:
  it adds elementwise work but counts a loop body once, so it under-counts
  the iterations.
  """
  import hlo_tools  # pylint: disable=g-import-not-at-top

  return {
    'flops_per_device': hlo_tools.dot_flops(compiled),
    'xla_cost_analysis_flops': float(report.flops),
  }


def fmt_share(share: float | None) -> str:
  return 'n/a' if share is None else f'{100 * share:.0f}%'


def fmt_collectives(bytes_by_kind: dict) -> str:
  parts = [
    f'{KIND_ABBREV.get(k, k)} {v / 1e6:.1f}'
    for k, v in sorted(bytes_by_kind.items())
    if v
  ]
  return ', '.join(parts) if parts else '–'


# ---------------------------------------------------------------------------
# Main.


def main(argv=None):  # pylint: disable=too-many-locals,too-many-statements
  args = parse_args(argv)
  wall_start = time.perf_counter()
  r, s = (int(v) for v in args.mesh.lower().split('x'))
  n_dev = r * s

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
  # Auto axes: XLA chooses the shardings inside the jitted step (optax's NS
  # on FSDP-sharded matrices would be ambiguous under Explicit axes).
  mesh = jax.make_mesh(
    (r, s), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  replicated = NamedSharding(mesh, P())
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
  machine = machine_info(jax, optax, dmuon_jax)
  load_start = load_average()
  model = {
    'layers': args.layers,
    'd_model': args.d_model,
    'd_ff': args.d_ff,
    'vocab': args.vocab,
    'dtype': 'float32',
    'mesh': args.mesh,
  }

  shapes = llama_shapes(args.layers, args.d_model, args.d_ff, args.vocab)

  def is_shape(x):
    return isinstance(x, tuple)

  rng = np.random.default_rng(args.seed)
  host_params = jax.tree.map(
    lambda sh: (0.02 * rng.standard_normal(sh)).astype(np.float32),
    shapes,
    is_leaf=is_shape,
  )
  host_grads = jax.tree.map(
    lambda sh: (1e-3 * rng.standard_normal(sh)).astype(np.float32),
    shapes,
    is_leaf=is_shape,
  )
  n_params = sum(x.size for x in jax.tree.leaves(host_params))

  def fsdp_sharding(x):
    # FSDP (HSDP when replicate > 1): dim 0 over 'shard' where it divides.
    if x.ndim >= 1 and x.shape[0] % s == 0:
      return NamedSharding(mesh, P('shard'))
    return replicated

  def place(tree, layout):
    if layout == 'replicated':
      return jax.tree.map(lambda x: jax.device_put(x, replicated), tree)
    return jax.tree.map(lambda x: jax.device_put(x, fsdp_sharding(x)), tree)

  def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)

  def spec_of(x):
    sh = getattr(x, 'sharding', None)
    return sh.spec if isinstance(sh, NamedSharding) else P()

  def muon_dims(labels):
    return jax.tree.map(
      lambda lbl: dmuon_jax.MuonDimensionNumbers() if lbl == 'muon' else None,
      labels,
    )

  def all_2d(path, x):
    del path
    return np.ndim(x) == 2

  routings = {'default': None, 'all-2d': all_2d}

  def plan_for(routing):
    return dmuon_jax.plan_ownership(
      host_params, mesh, predicate=routings[routing]
    )

  def make_optimizer(family, routing, ns_steps=None):
    labels = dmuon_jax.muon_labels(host_params, predicate=routings[routing])
    if family == 'adamw':
      return optax.adamw(3e-3)
    if family == 'optax.contrib.muon':
      return optax.contrib.muon(
        0.02,
        adam_learning_rate=3e-3,
        muon_weight_dimension_numbers=muon_dims(labels),
      )
    return dmuon_jax.dmuon(
      0.02,
      adam_learning_rate=3e-3,
      mesh=mesh,
      predicate=routings[routing],
      ns_steps=ns_steps,
    )

  def make_step(opt, path, param_sh, state_sh, state):
    if path == 'explicit':
      state_specs = jax.tree.map(spec_of, state)

      def body(params, opt_state, grads):
        # Per-device (unreduced) gradients, as local_value_and_grad gives.
        grads = jax.tree.map(
          lambda g: jax.lax.pcast(g, axes, to='varying'), grads
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), state_specs, P()),
        out_specs=(P(), state_specs),
      )
    else:

      def fn(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(
      fn, out_shardings=(param_sh, state_sh), donate_argnums=(0, 1)
    )

  # --- Matmul rate of this machine ---------------------------------------
  mm_m, mm_k = args.d_model, args.d_ff
  per_dev = 4
  # A batched Gram product X Xᵀ of the model's typical Muon shape
  # (d_model x d_ff), `per_dev` products on each device, all devices at
  # once: the aggregate rate the simulated devices get from the shared
  # cores. Measured before and after the configurations; the floor uses the
  # faster of the two (the machine at its least disturbed).
  mm_x = jax.device_put(
    rng.standard_normal((n_dev * per_dev, mm_m, mm_k)).astype(np.float32),
    NamedSharding(mesh, P(axes)),
  )
  gram = jax.jit(lambda x: jnp.einsum('bik,bjk->bij', x, x))
  mm_flops = n_dev * per_dev * 2.0 * mm_m * mm_m * mm_k

  def matmul_rate():
    gram(mm_x).block_until_ready()
    mm_times = []
    meter = CpuMeter()
    for _ in range(max(args.reps, 7)):
      t0 = time.perf_counter()
      gram(mm_x).block_until_ready()
      mm_times.append(time.perf_counter() - t0)
    med = statistics.median(mm_times)
    return {
      'median_ms': 1e3 * med,
      'flop_per_s': mm_flops / med,
      'other_processes_cpu_share': meter.other_share(),
    }

  print(
    f'machine: {machine["cpu_count"]} CPUs ({machine["cpu_model"]}), '
    f'{n_dev} simulated devices, jax {machine["jax"]}; load average '
    f'{load_start}'
  )
  mm_start = matmul_rate()
  print(
    f'matmul rate: {mm_start["flop_per_s"] / 1e9:.1f} GFLOP/s aggregate '
    f'({n_dev}x{per_dev} products {mm_m}x{mm_k} @ {mm_k}x{mm_m}; '
    'other processes used '
    f'{fmt_share(mm_start["other_processes_cpu_share"])} of the CPUs)'
  )

  plans = {k: plan_for(k) for k in routings}
  plan_info = {}
  for k, plan in plans.items():
    total = sum(u.cost for u in plan.units)
    plan_info[k] = {
      'matrices': len(plan.units),
      'ns_flops_total': total,
      'ns_flops_largest': max(u.cost for u in plan.units),
      'makespan': plan.makespan,
      'imbalance': plan.imbalance,
    }
  default_total = plan_info['default']['ns_flops_total']
  print(
    f'model: {n_params / 1e6:.1f}M params, '
    f'{plan_info["default"]["matrices"]} Muon matrices (default routing), '
    f'NS {default_total / 1e9:.1f} GFLOP per step; machine floor '
    f'{1e3 * default_total / mm_start["flop_per_s"]:.0f} ms at this rate'
  )

  configs = [
    # name, optimizer family, param layout, update path, routing
    ('adamw-fsdp', 'adamw', 'fsdp', 'drop-in', 'default'),
    (
      'optax-muon-replicated',
      'optax.contrib.muon',
      'replicated',
      'drop-in',
      'default',
    ),
    ('optax-muon-fsdp', 'optax.contrib.muon', 'fsdp', 'drop-in', 'default'),
    ('dmuon-replicated', 'dmuon', 'replicated', 'drop-in', 'default'),
    ('dmuon-fsdp', 'dmuon', 'fsdp', 'drop-in', 'default'),
    ('dmuon-explicit', 'dmuon', 'replicated', 'explicit', 'default'),
  ]
  if not args.no_all_2d:
    configs += [
      (
        'optax-muon-replicated-all2d',
        'optax.contrib.muon',
        'replicated',
        'drop-in',
        'all-2d',
      ),
      ('dmuon-replicated-all2d', 'dmuon', 'replicated', 'drop-in', 'all-2d'),
    ]
  if not args.no_breakdown:
    # Diagnostics: the same steps with one Newton-Schulz iteration instead of
    # five. 5/4 of the difference is the time of the NS iterations; the rest
    # of the 5-step time is everything else (momentum, packing, collectives,
    # AdamW, apply_updates).
    configs += [
      ('dmuon-replicated-ns1', 'dmuon', 'replicated', 'drop-in', 'default', 1),
      ('dmuon-fsdp-ns1', 'dmuon', 'fsdp', 'drop-in', 'default', 1),
    ]
  configs = [c + (None,) * (6 - len(c)) for c in configs]
  if args.only:
    wanted = set(args.only.split(','))
    configs = [c for c in configs if c[0] in wanted]

  results = {}
  reference_deltas = {}
  for name, family, layout, path, routing, ns_steps in configs:
    opt = make_optimizer(family, routing, ns_steps)
    params = place(host_params, layout)
    # Explicit path: gradients come in replicated and are made per-device.
    grads = place(host_grads, 'replicated' if path == 'explicit' else layout)
    state = on_mesh(opt.init(params), replicated)
    step = make_step(
      opt, path, shardings_of(params), shardings_of(state), state
    )
    t0 = time.perf_counter()
    lowered = step.lower(params, state, grads)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    report = dmuon_jax.analyze_compiled(compiled)
    flops = flop_counts(compiled, report)
    first_params = {}

    def keep_first(p, store=first_params):
      store['params'] = jax.tree.map(np.asarray, p)

    # Diagnostic rows are cheap and feed a difference: twice the reps.
    reps = 2 * args.reps if ns_steps is not None else args.reps
    times, first, other_cpu = time_steps(
      compiled,
      params,
      state,
      grads,
      reps=reps,
      warmup=args.warmup,
      min_reps=args.min_reps,
      budget_s=args.budget_s,
      block=jax.block_until_ready,
      on_first=keep_first if family != 'adamw' else None,
    )
    bytes_by_kind, count_by_kind = collective_summary(report)
    res = {
      'config': name,
      'optimizer': family,
      'params': layout,
      'path': path,
      'routing': routing,
      'ns_steps': (None if family == 'adamw' else ns_steps or 5),
      'diagnostic': ns_steps is not None,
      'median_ms': 1e3 * statistics.median(times),
      'min_ms': 1e3 * min(times),
      'times_ms': [1e3 * t for t in times],
      'first_step_ms': 1e3 * first,
      'other_processes_cpu_share': other_cpu,
      'reps': len(times),
      'reps_requested': reps,
      'warmup': max(args.warmup, 1),
      'lower_s': t1 - t0,
      'compile_s': t2 - t1,
      **flops,
      'collective_bytes_by_kind': bytes_by_kind,
      'collective_count_by_kind': count_by_kind,
      'collective_bytes_total': report.total_bytes(),
      'peak_bytes_per_device': report.peak_bytes,
      'grads': ('per-device (unreduced)' if path == 'explicit' else 'reduced'),
    }
    # Same numbers as optax? The first step's update of every Muon config is
    # compared with optax.contrib.muon's on replicated params (same routing,
    # same start): max over leaves of |d - d_ref| / |d_ref| (Frobenius).
    if family != 'adamw' and ns_steps is None:
      deltas = jax.tree.map(
        lambda a, b: a - b, first_params['params'], host_params
      )
      ref_name = (
        'optax-muon-replicated'
        if routing == 'default'
        else 'optax-muon-replicated-all2d'
      )
      if name == ref_name:
        reference_deltas[routing] = deltas
      elif routing in reference_deltas:
        res['first_update_rel_diff_vs_optax'] = float(
          max(
            np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
            for a, b in zip(
              jax.tree.leaves(deltas),
              jax.tree.leaves(reference_deltas[routing]),
              strict=True,
            )
          )
        )
    first_params.clear()
    results[name] = res
    reduced_note = (
      f' (reps cut to {len(times)} by --budget-s)' if len(times) < reps else ''
    )
    print(
      f'{name:>28}: {res["median_ms"]:9.1f} ms median of {len(times)}'
      f'{reduced_note}, compile {t1 - t0 + t2 - t1:5.1f} s, '
      f'{flops["flops_per_device"] / 1e9:7.2f} matmul GFLOP/device, '
      f'{fmt_collectives(bytes_by_kind)} MB; others used '
      f'{fmt_share(other_cpu)} of the CPUs'
      + (
        f'; update vs optax {res["first_update_rel_diff_vs_optax"]:.1e}'
        if 'first_update_rel_diff_vs_optax' in res
        else ''
      ),
      flush=True,
    )
    del params, state, grads, compiled, lowered, step

  mm_end = matmul_rate()
  rate = max(mm_start['flop_per_s'], mm_end['flop_per_s'])
  print(
    f'matmul rate at the end: {mm_end["flop_per_s"] / 1e9:.1f} GFLOP/s '
    '(other processes used '
    f'{fmt_share(mm_end["other_processes_cpu_share"])} of the CPUs); the '
    f'floor uses {rate / 1e9:.1f} GFLOP/s'
  )
  matmul = {
    'config': 'matmul_rate',
    'shape': [mm_m, mm_k],
    'products_per_device': per_dev,
    'flops': mm_flops,
    'start': mm_start,
    'end': mm_end,
    'flop_per_s': rate,
  }
  for info in plan_info.values():
    info['machine_floor_ms'] = 1e3 * info['ns_flops_total'] / rate

  # --- Ratios and targets --------------------------------------------------
  def ms(name):
    return results[name]['median_ms'] if name in results else None

  def ratio(a, b):
    return a / b if a is not None and b is not None else None

  floor_ms = plan_info['default']['machine_floor_ms']
  targets = []

  def target(label, value, goal, higher_is_better, detail):
    if value is None:
      met = None
    else:
      met = value >= goal if higher_is_better else value <= goal
    targets.append(
      {
        'target': label,
        'value': value,
        'goal': goal,
        'higher_is_better': higher_is_better,
        'met': met,
        'detail': detail,
      }
    )

  target(
    'dmuon (replicated) speedup vs optax.contrib.muon replicated',
    ratio(ms('optax-muon-replicated'), ms('dmuon-replicated')),
    TARGET_VS_REPLICATED,
    True,
    'optax-muon-replicated / dmuon-replicated (ms / ms)',
  )
  target(
    'dmuon (FSDP) speedup vs optax.contrib.muon FSDP',
    ratio(ms('optax-muon-fsdp'), ms('dmuon-fsdp')),
    TARGET_VS_FSDP,
    True,
    'optax-muon-fsdp / dmuon-fsdp (ms / ms)',
  )
  target(
    'dmuon (replicated) time / machine floor',
    ratio(ms('dmuon-replicated'), floor_ms),
    TARGET_VS_FLOOR,
    False,
    'dmuon-replicated ms / (NS FLOPs / matmul rate)',
  )

  ratios = []
  for name in ('dmuon-replicated', 'dmuon-fsdp', 'dmuon-explicit'):
    if name in results:
      ratios.append(
        {
          'config': name,
          'speedup_vs_optax_replicated': ratio(
            ms('optax-muon-replicated'), ms(name)
          ),
          'speedup_vs_optax_fsdp': ratio(ms('optax-muon-fsdp'), ms(name)),
          'time_over_machine_floor': ratio(ms(name), floor_ms),
        }
      )

  # Fastest steps, not medians: a difference of two noisy times (8 device
  # threads on shared cores) is steadiest at the least disturbed steps.
  breakdown = []
  for name in ('dmuon-replicated', 'dmuon-fsdp'):
    if name not in results or name + '-ns1' not in results:
      continue
    t5, t1 = results[name]['min_ms'], results[name + '-ns1']['min_ms']
    ns_ms = 1.25 * (t5 - t1)
    breakdown.append(
      {
        'config': name,
        'step_ms': t5,
        'step_ns1_ms': t1,
        'ns_iterations_ms': ns_ms,
        'outside_ns_ms': t5 - ns_ms,
        'ns_flop_per_s': (
          plan_info['default']['ns_flops_total'] / ns_ms * 1e3
          if ns_ms > 0
          else None
        ),
        'ns_over_machine_floor': ns_ms / floor_ms,
      }
    )

  all2d = plan_info['all-2d']
  ideal_all2d = max(all2d['ns_flops_total'] / n_dev, all2d['ns_flops_largest'])

  wall_s = time.perf_counter() - wall_start
  load_end = load_average()
  machine.update(
    {'load_average_start': load_start, 'load_average_end': load_end}
  )

  # --- Output ---------------------------------------------------------------
  md = render_markdown(
    args,
    date,
    machine,
    model,
    n_params,
    matmul,
    plan_info,
    results,
    ratios,
    targets,
    ideal_all2d,
    breakdown,
    wall_s,
  )
  common = {
    'date': date,
    'machine': machine,
    'model': model,
    'benchmark': 'optimizer_step',
    'quick': args.quick,
  }
  lines = [dict(common, **matmul)]
  for res in results.values():
    lines.append(
      dict(
        common,
        **res,
        plan=plan_info[res['routing']] if res['optimizer'] != 'adamw' else None,
      )
    )
  lines.append(
    dict(
      common,
      config='summary',
      wall_s=wall_s,
      machine_floor_ms=floor_ms,
      ratios=ratios,
      breakdown=breakdown,
      targets=targets,
      all_2d_ideal_flops_per_device=ideal_all2d,
      plans=plan_info,
    )
  )
  write_results(args.out_dir, args.name, lines, md, wall_s)
  return lines


def simulate_cpu_devices(count: int = 8) -> None:
  """Runs the benchmark on ``count`` simulated CPU devices (the GPU
  scripts' ``--cpu-smoke``); call it before jax is imported."""
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '')
    + f' --xla_force_host_platform_device_count={count}'
  )
  os.environ['JAX_PLATFORMS'] = 'cpu'


def write_results(out_dir, name: str, lines: list, md: str, wall_s: float):
  """Prints the markdown table and writes ``name.json`` (one JSON object
  per line) and ``name.md`` into ``out_dir`` (made if missing)."""
  print()
  print(md)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  json_path = out_dir / f'{name}.json'
  with open(json_path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(line) + '\n' for line in lines)
  md_path = out_dir / f'{name}.md'
  md_path.write_text(md + '\n', encoding='utf-8')
  print(f'\nwrote {json_path} and {md_path} ({wall_s:.0f} s)')


def _speed_and_reps(res, base):
  """Table cells: speedup over ``base`` and reps (``*`` when cut short)."""
  speed = f'{base["median_ms"] / res["median_ms"]:.2f}x' if base else '–'
  reps = str(res['reps'])
  if res['reps'] < res['reps_requested']:
    reps += '*'
  return speed, reps


def render_markdown(
  args,
  date,
  machine,
  model,
  n_params,
  matmul,
  plan_info,
  results,
  ratios,
  targets,
  ideal_all2d,
  breakdown,
  wall_s,
) -> str:
  """The tables, ratios and targets as markdown."""
  base = results.get('optax-muon-replicated')
  floor_ms = plan_info['default']['machine_floor_ms']

  def diff(res):
    if 'first_update_rel_diff_vs_optax' not in res:
      return '–'
    return f'{res["first_update_rel_diff_vs_optax"]:.1e}'

  def pct(res):
    if res.get('other_processes_cpu_share') is None:
      return '–'
    return fmt_share(res['other_processes_cpu_share'])

  out = []
  out.append('# Optimizer step: dmuon vs optax.contrib.muon vs AdamW')
  out.append('')
  out.append(
    f'- date: {date}; wall time of the run {wall_s:.0f} s'
    f'{" (--quick)" if args.quick else ""}'
  )
  out.append(
    f'- machine: {machine["cpu_count"]} CPUs ({machine["cpu_model"]}), '
    f'{machine["devices"]} simulated XLA:CPU devices (mesh {args.mesh}, '
    f'replicate x shard); load average at start '
    f'{machine["load_average_start"]}, at end '
    f"{machine['load_average_end']} (this process's own device threads "
    'count in it). Other processes may share the cores: "others\' CPU" is '
    "the share of all CPUs they used during a configuration's warm-up "
    "and timed steps (/proc/stat busy time minus this process's CPU "
    'time; – when those took under 0.5 s)'
  )
  if args.quick:
    out.append(
      '- **--quick**: a tiny model for a CI smoke run; the targets '
      'are set for the default model, and millisecond steps on '
      'shared cores are noisy, so met/missed here means little'
    )
  out.append(
    f'- software: python {machine["python"]}, jax {machine["jax"]}, '
    f'jaxlib {machine["jaxlib"]}, optax {machine["optax"]}, dmuon_jax '
    f'{machine["dmuon_jax"]}'
  )
  out.append(
    f'- model: {model["layers"]} layers, d_model {model["d_model"]}, d_ff '
    f'{model["d_ff"]}, vocab {model["vocab"]}, float32, '
    f'{n_params / 1e6:.2f}M params; '
    f'{plan_info["default"]["matrices"]} Muon matrices by default '
    f'(embed and LM head on AdamW), NS '
    f'{plan_info["default"]["ns_flops_total"] / 1e9:.1f} GFLOP per step '
    f'(5 quintic steps), owner-plan imbalance '
    f'{plan_info["default"]["imbalance"]:.3f}'
  )
  out.append(
    f'- matmul rate: {matmul["flop_per_s"] / 1e9:.1f} GFLOP/s aggregate over'
    f' the machine ({machine["devices"]} devices x '
    f'{matmul["products_per_device"]} products {matmul["shape"][0]}x'
    f'{matmul["shape"][1]} @ {matmul["shape"][1]}x{matmul["shape"][0]};'
    f' the faster of {matmul["start"]["flop_per_s"] / 1e9:.1f} before and '
    f'{matmul["end"]["flop_per_s"] / 1e9:.1f} after the configurations);'
    f' machine floor = NS FLOPs / rate = {floor_ms:.0f} ms'
  )
  out.append(
    f'- timing: steady-state median of `reps` steps after '
    f'{args.warmup} warm-up step(s), `block_until_ready` after each; '
    'compile = lower + compile; optimizer step only (update + '
    'apply_updates), fixed random gradients, params and state donated and '
    'fed back'
  )
  out.append('')
  out.append('## Default routing (embed and LM head on AdamW)')
  out.append('')
  out.append(
    "| config | params | grads in | median ms | reps | others' "
    'CPU | compile s | matmul GFLOP / device | collective MB / device | '
    'speedup vs optax replicated | update vs optax |'
  )
  out.append('|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|')
  for name, res in results.items():
    if res['routing'] != 'default' or res['diagnostic']:
      continue
    speed, reps = _speed_and_reps(res, base)
    out.append(
      f'| {name} | {res["params"]} | {res["grads"]} | '
      f'{res["median_ms"]:.1f} | {reps} | {pct(res)} | '
      f'{res["lower_s"] + res["compile_s"]:.1f} | '
      f'{res["flops_per_device"] / 1e9:.2f} | '
      f'{fmt_collectives(res["collective_bytes_by_kind"])} | {speed} | '
      f'{diff(res)} |'
    )
  if any(r['reps'] < r['reps_requested'] for r in results.values()):
    out.append('')
    out.append(
      f'\\* fewer reps than the requested {args.reps}: the step is '
      f'slow and the per-configuration budget is {args.budget_s:.0f}'
      ' s (`--budget-s`); the model size is not reduced.'
    )
  out.append('')
  out.append('## Ratios')
  out.append('')
  out.append(
    '| dmuon config | speedup vs optax replicated | speedup vs optax '
    'FSDP | time / machine floor |'
  )
  out.append('|---|---:|---:|---:|')

  def fmt(v, suffix='x'):
    return '–' if v is None else f'{v:.2f}{suffix}'

  for row in ratios:
    out.append(
      f'| {row["config"]} | '
      f'{fmt(row["speedup_vs_optax_replicated"])} | '
      f'{fmt(row["speedup_vs_optax_fsdp"])} | '
      f'{fmt(row["time_over_machine_floor"])} |'
    )
  out.append('')
  out.append('## Targets')
  out.append('')
  for t in targets:
    mark = {True: 'met', False: 'missed', None: 'not measured'}[t['met']]
    rel = '≥' if t['higher_is_better'] else '≤'
    out.append(
      f'- {t["target"]}: {fmt(t["value"])} (target {rel} '
      f'{t["goal"]}x) — **{mark}** ({t["detail"]})'
    )
  if breakdown:
    out.append('')
    out.append("## Where dmuon's time goes")
    out.append('')
    out.append(
      'The same step with 1 Newton-Schulz iteration instead of 5 '
      '(`dmuon-*-ns1` in the JSON): 5/4 of the difference is the '
      'time of the 5 iterations, the rest is outside NS (momentum, '
      'packing to owners and back, collectives, AdamW for the '
      'non-Muon leaves, apply_updates). Fastest step of each, not '
      'the median: the difference of two times is steadiest at the '
      'least disturbed steps.'
    )
    out.append('')
    out.append(
      '| config | fastest step ms | fastest 1-iteration step ms | '
      'NS iterations ms '
      '| outside NS ms | NS GFLOP/s | NS ms / machine floor |'
    )
    out.append('|---|---:|---:|---:|---:|---:|---:|')
    for b in breakdown:
      rate_s = (
        '–' if b['ns_flop_per_s'] is None else f'{b["ns_flop_per_s"] / 1e9:.0f}'
      )
      out.append(
        f'| {b["config"]} | {b["step_ms"]:.0f} | {b["step_ns1_ms"]:.0f} | '
        f'{b["ns_iterations_ms"]:.0f} | {b["outside_ns_ms"]:.0f} | '
        f'{rate_s} | {b["ns_over_machine_floor"]:.2f}x |'
      )
  all2d = [r for r in results.values() if r['routing'] == 'all-2d']
  if all2d:
    info = plan_info['all-2d']
    base2 = results.get('optax-muon-replicated-all2d')
    out.append('')
    out.append('## Embed and LM head on Muon too (every 2-D leaf)')
    out.append('')
    out.append(
      f'{info["matrices"]} matrices, NS {info["ns_flops_total"] / 1e9:.1f}'
      f' GFLOP in all, largest matrix '
      f'{info["ns_flops_largest"] / 1e9:.1f} GFLOP; ideal per device = '
      f'max(total / N, largest) = {ideal_all2d / 1e9:.2f} GFLOP; plan '
      f'makespan {info["makespan"] / 1e9:.2f} GFLOP (imbalance '
      f'{info["imbalance"]:.3f}); machine floor '
      f'{info["machine_floor_ms"]:.0f} ms.'
    )
    out.append('')
    out.append(
      "| config | median ms | reps | others' CPU | compile s | "
      'matmul GFLOP / device | matmul GFLOP / device ÷ ideal | '
      'collective MB / device | speedup vs optax replicated | '
      'time / machine floor | update vs optax |'
    )
    out.append('|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|')
    for res in all2d:
      speed, reps = _speed_and_reps(res, base2)
      out.append(
        f'| {res["config"]} | {res["median_ms"]:.1f} | {reps} | '
        f'{pct(res)} | '
        f'{res["lower_s"] + res["compile_s"]:.1f} | '
        f'{res["flops_per_device"] / 1e9:.2f} | '
        f'{res["flops_per_device"] / ideal_all2d:.2f} | '
        f'{fmt_collectives(res["collective_bytes_by_kind"])} | {speed} | '
        f'{res["median_ms"] / info["machine_floor_ms"]:.2f}x | '
        f'{diff(res)} |'
      )
  out.append('')
  out.append('## Notes')
  out.append('')
  out.append(
    '- matmul GFLOP / device: the `dot` instructions of the compiled '
    "step's per-device program (`hlo_tools.dot_flops`: "
    '2 × output elements × contracted size each), every `while` loop '
    'body times its trip count (both libraries run the 5 NS steps in a '
    'loop) and the most expensive branch of each `lax.switch` (dmuon runs '
    "each owner's Newton-Schulz in its own branch, so this is the busiest "
    "owner's). The optimizer step's only matmuls are Newton-Schulz, so "
    "this is each device's NS work (0 for AdamW); ÷ ideal divides it by "
    "max(total / N, largest matrix). XLA's `cost_analysis()` FLOPs are "
    'in the JSON as `xla_cost_analysis_flops`, for reference only: they '
    'add elementwise work but count a loop body once.'
  )
  out.append(
    '- Collective MB / device come from the compiled HLO (ring model; AG '
    'all-gather, RS reduce-scatter, AR all-reduce, A2A all-to-all). '
    'Configurations 1-5 receive gradients already reduced over devices, '
    'so their all-reduce of the backward pass is not in the step; '
    '`dmuon-explicit` receives per-device gradients and its step includes '
    'the reduction (reduce-scatter to owners + all-gather for Muon '
    'matrices, all-reduce for the AdamW leaves).'
  )
  out.append(
    '- "update vs optax": the first step\'s parameter update compared '
    "with optax.contrib.muon's on replicated params (same start, same "
    'routing), max over leaves of ‖Δ − Δ_optax‖ / ‖Δ_optax‖.'
  )
  out.append(
    "- The simulated devices share the machine's cores (XLA:CPU runs "
    'every device program on one thread pool), so the machine floor is '
    'total NS FLOPs over the aggregate matmul rate, not the per-owner '
    'makespan.'
  )
  return '\n'.join(out)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  main()
