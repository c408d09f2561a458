"""Scale study: dmuon's update at 8 to 1024 devices, compiled, not run.

For Llama-3-8B, Llama-3-70B (the hidden matrices of every layer: q, k, v,
o, gate, up, down; bfloat16) and a DeepSeek-V3-like MoE stack (58 layers
of 256 routed experts ``(L, E, 7168, 2048)`` plus MLA projections), on HSDP
meshes ``(N / 8) x 8`` (axes ``('replicate', 'shard')``, params
FSDP-sharded over ``'shard'``), with abstract params
(``jax.ShapeDtypeStruct`` with shardings; nothing is allocated):

* the owner plan (``dmuon_jax.plan_ownership``, as ``init`` builds it):
  its time, the owner groups it chose, the predicted busiest device;
* the drop-in update (``opt.update`` under ``jax.jit``) and, for the Llama
  models, the dedicated Z3 train step (``dmuon_jax.dedicate``, one
  ``shard_map`` step: gathers, local gradients, owner update): lowering and
  compile time; per-device Newton–Schulz FLOPs from the compiled HLO
  (``hlo_tools.dot_flops`` with loop trip counts, those read from the
  program's tables evaluated for each device, and each owner-slot
  conditional's branch ``i`` counted for device ``i``) against the bound
  ``max(total / N, largest g x g iteration)`` (``total``: the single-owner
  plan's work); collective bytes per device by kind and by mesh axis (group
  size 8: ``'shard'``, N / 8: ``'replicate'``, N: both; at N = 64 both axes
  have 8 devices; bytes by kind from the program lowered for CUDA, since
  XLA:CPU runs bfloat16 all-to-alls in float32) against the model (drop-in: the layout's routes plus the
  groups' Gram exchange; dedicated: the seeds' HSDP model ``3 (S-1)/S``
  times the gathered bytes plus ``2 (R-1)/R`` of a shard's share); the
  compiled memory analysis per device.

The device count is fixed when jax starts, so every N runs in its own
subprocess (``--xla_force_host_platform_device_count``). A configuration
that fails or passes the time budget is recorded with its error.

    python examples/benchmarks/scale.py                 # all; see --budget
    python examples/benchmarks/scale.py --devices 8,64 --models llama3_8b
    python examples/benchmarks/scale.py --devices '' --append  # re-render

Writes ``results/scale.json`` (one JSON object per line), ``scale.md`` and
``scale.png`` (log-log: per-device NS FLOPs and compile time against N,
with the ideal lines) next to this file, or under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

# Shared helpers of the benchmarks here (the --help formatter).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = pathlib.Path(__file__).resolve().parent

# name: (layers, d_model, d_ff, kv width)
LLAMA = {
  'llama3_8b': (32, 4096, 14336, 1024),
  'llama3_70b': (80, 8192, 28672, 1024),
}
# DeepSeek-V3: 61 layers, the first 3 dense; 256 routed experts of
# d_ff 2048 (the shared expert and the dense layers' MLPs left out); MLA:
# q_a 7168x1536, q_b 1536x(128*192), kv_a 7168x576, kv_b 512x(128*256),
# o (128*128)x7168.
DEEPSEEK = dict(layers=58, experts=256, d=7168, f=2048)
MODELS = ('llama3_8b', 'llama3_70b', 'deepseek_v3')


def model_params(name):
  """``(abstract params without shardings, dimension numbers, fsdp spec)``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from optax.contrib import MuonDimensionNumbers as Dims  # pylint: disable=import-outside-toplevel

  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  base, _, cut = name.partition('_L')
  if base in LLAMA:
    layers, d, f, kv = LLAMA[base]
    layers = int(cut) if cut else layers
    params = {
      f'layers_{i}': {
        'q': s(d, d),
        'k': s(d, kv),
        'v': s(d, kv),
        'o': s(d, d),
        'gate': s(d, f),
        'up': s(d, f),
        'down': s(f, d),
      }
      for i in range(layers)
    }
    return params, None
  c = DEEPSEEK
  L, E, d, f = c['layers'], c['experts'], c['d'], c['f']
  params = {
    'moe': {'gate': s(L, E, d, f), 'up': s(L, E, d, f), 'down': s(L, E, f, d)},
    'attn': {
      'q_a': s(L, d, 1536),
      'q_b': s(L, 1536, 24576),
      'kv_a': s(L, d, 576),
      'kv_b': s(L, 512, 32768),
      'o': s(L, 16384, d),
    },
  }
  dims = {
    'moe': {k: Dims(2, 3) for k in params['moe']},
    'attn': {k: Dims(1, 2) for k in params['attn']},
  }
  return params, dims


def fsdp(params, mesh):
  """Each leaf's first matrix dimension sharded over 'shard'."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  def one(x):
    spec = [None] * x.ndim
    spec[x.ndim - 2] = 'shard'
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec))
    )

  return jax.tree.map(one, params)


def by_axis(report, n, s):
  r = n // s
  out = {}
  for c in report.collectives:
    if c.group_size == n:
      axis = 'all'
    elif c.group_size == s and s == r:
      axis = 'shard|replicate'
    elif c.group_size == s:
      axis = 'shard'
    elif c.group_size == r:
      axis = 'replicate'
    else:
      axis = f'group of {c.group_size}'
    key = f'{c.kind} over {axis}'
    out[key] = out.get(key, 0.0) + c.total_bytes
  return out


def gpu_bytes(traced, n):
  """Per-device bytes by kind of the program lowered for CUDA (StableHLO):
  what a GPU moves. XLA:CPU runs bfloat16 all-to-alls in float32, so the
  CPU program's own figures are 2x there."""
  import hlo_tools  # pylint: disable=import-outside-toplevel

  text = traced.lower(lowering_platforms=('cuda',)).as_text()
  out = {}
  for c in hlo_tools.stablehlo_collectives(text, n):
    out[c.kind] = out.get(c.kind, 0.0) + c.bytes
  return out


def branches_per_conditional(text: str) -> list[int]:
  """Branch bodies of each ``conditional`` in an HLO text, in text order:
  the owner stages (owners whose work is alike share one body)."""
  return [
    len([b for b in m.split(',') if b.strip()])
    for m in re.findall(r'branch_computations=\{([^}]*)\}', text)
  ]


def conditional_branches(text: str) -> int:
  """Branch bodies of all ``conditional``s in an HLO text."""
  return sum(branches_per_conditional(text))


def compile_timed(jitted, n, *args):
  """``(compiled, lower_s, compile_s, bytes by kind for CUDA)``."""
  t = time.perf_counter()
  traced = jitted.trace(*args)
  lowered = traced.lower()
  lower_s = time.perf_counter() - t
  cuda = gpu_bytes(traced, n)
  t = time.perf_counter()
  compiled = lowered.compile()
  return compiled, lower_s, time.perf_counter() - t, cuda


def memory(compiled):
  m = compiled.memory_analysis()
  fields = ('argument', 'output', 'temp', 'alias')
  got = {
    f'{f}_bytes': int(getattr(m, f'{f}_size_in_bytes', 0) or 0) for f in fields
  }
  got['peak_bytes'] = (
    got['argument_bytes']
    + got['output_bytes']
    + got['temp_bytes']
    - got['alias_bytes']
  )
  return got


def plan_row(name, n, s):
  import dmuon_jax  # pylint: disable=import-outside-toplevel

  params, dims = model_params(name)
  mesh = {'replicate': n // s, 'shard': s}
  t = time.perf_counter()
  plan = dmuon_jax.plan_ownership(params, mesh, weight_dimension_numbers=dims)
  plan_s = time.perf_counter() - t
  again = dmuon_jax.plan_ownership(params, mesh, weight_dimension_numbers=dims)
  plain = dmuon_jax.plan_ownership(
    params, mesh, weight_dimension_numbers=dims, owner_groups=None
  )
  total = sum(u.cost for u in plain.units)
  iteration = max((g.iteration_cost for g in plan.groups), default=0.0)
  sizes = sorted({len(plan.group_slots(g)) for g in range(len(plan.groups))})
  return {
    'model': name,
    'devices': n,
    'mode': 'plan',
    'matrices': len(plain.units),
    'units': len(plan.units),
    'groups': len(plan.groups),
    'group_devices': sizes,
    'plan_s': plan_s,
    'deterministic': plan == again,
    'ns_flops_total': total,
    'largest_iteration': iteration,
    'bound': max(total / n, iteration),
    'plain_makespan': plain.makespan,
    'plan_makespan': plan.makespan,
    'plan_ratio': plan.makespan / max(total / n, iteration),
    'plain_ratio': plain.makespan / (total / n),
    'group_exchange_bytes': plan.group_exchange_bytes(),
  }


def drop_in_row(name, n, s):
  import hlo_tools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((n // s, s), ('replicate', 'shard'))
  params, dims = model_params(name)
  params = fsdp(params, mesh)
  opt = dmuon_jax.dmuon(
    0.02, mesh=mesh, muon_weight_dimension_numbers=dims, nonfinite='propagate'
  )
  with jax.set_mesh(mesh):
    t = time.perf_counter()
    state = jax.eval_shape(opt.init, params)
    init_s = time.perf_counter() - t
    update = jax.jit(lambda g, st, p: opt.update(g, st, p))
    compiled, lower_s, compile_s, cuda = compile_timed(
      update, n, params, state, params
    )
  (layout,) = dmuon_jax.owner_layouts(state)
  plan = layout.plans[0]
  report = dmuon_jax.analyze_compiled(compiled)
  flops = hlo_tools.dot_flops(
    compiled, loop_trip_counts=True, branches_per_device=n
  )
  nesting = hlo_tools.collective_nesting(compiled)
  text = compiled.as_text()
  branches = conditional_branches(text)
  predicted = layout.collective_bytes()
  predicted['gram exchange'] = plan.group_exchange_bytes()
  routes = cuda.get('all-to-all', 0.0) + cuda.get('all-gather', 0.0)
  return {
    'model': name,
    'devices': n,
    'mode': 'drop-in',
    'init_s': init_s,
    'lower_s': lower_s,
    'compile_s': compile_s,
    'ns_flops_per_device': flops,
    'conditional_branches': branches,
    'branches_per_conditional': branches_per_conditional(text),
    'plan_makespan': plan.makespan,
    # The whole update's bytes over its routes' (all-to-all and
    # all-gather: what the update moves without owner groups).
    'bytes_over_routes': sum(cuda.values()) / routes if routes else None,
    'bytes_by_kind': cuda,
    'cpu_bytes_by_kind': report.bytes_by_kind,
    'bytes_by_axis': by_axis(report, n, s),
    'predicted_bytes': predicted,
    'in_conditional': sum('conditional' in c.context for c in nesting),
    'in_loop': sum('while' in c.context for c in nesting),
    **memory(compiled),
  }


# Per-peer block of the lone all-to-all rows (elements; compile time on
# XLA:CPU depends on the number of peers, not on the block size).
A2A_BLOCK = 4096


def a2a_row(name, n, s):
  """The way back's exchange alone, compiled: every owner sends every
  device its block of the results (bfloat16). ``direct``: one all-to-all
  over all N devices (the update's way back before 2026-12-05); XLA:CPU's
  all-to-all decomposer turns an array all-to-all into one operand per
  peer (a slice kernel each, plus a float32 conversion for bfloat16), so
  its compile time grows with N whatever the program around it.
  ``two_stage``: all-to-all over ``'shard'``, then over ``'replicate'``
  (the same result, S + N / S peers, (S - 1) / S of the data more over
  ``'shard'``). ``gather`` (the update's way back now): HSDP devices of
  one ``'shard'`` coordinate hold equal shards, so an owner sends its S
  distinct blocks by an all-to-all over ``'shard'`` and every device
  all-gathers the row's blocks over ``'replicate'``: the direct one's
  result and bytes, ``(N - 1)`` blocks per device."""
  del name
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  r = n // s
  mesh = jax.make_mesh((r, s), ('replicate', 'shard'))
  axes = ('replicate', 'shard')

  def direct(x):  # row j: this device's block for (and then from) device j
    return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)

  def two_stage(x):
    m = x.shape[-1]
    y = jax.lax.all_to_all(x.reshape(r, s, m), 'shard', 1, 1, tiled=True)
    return jax.lax.all_to_all(y, 'replicate', 0, 0, tiled=True).reshape(n, m)

  def gather(x):  # the blocks for one 'shard' coordinate are equal: send S
    m = x.shape[-1]
    y = jax.lax.all_to_all(x[:s], 'shard', 0, 0, tiled=True)
    return jax.lax.all_gather(y, 'replicate', axis=0, tiled=True).reshape(n, m)

  spec = P(axes)
  row = {'model': 'all_to_all', 'devices': n, 'mode': 'a2a'}
  variants = (('direct', direct), ('two_stage', two_stage), ('gather', gather))
  for label, body in variants:
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.ShapeDtypeStruct(
      (n * n, A2A_BLOCK), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
    )
    t = time.perf_counter()
    compiled = f.lower(x).compile()
    row[f'{label}_compile_s'] = time.perf_counter() - t
    text = compiled.as_text()
    row[f'{label}_kernels'] = text.count(' fusion(')
    row[f'{label}_all_to_alls'] = text.count(' all-to-all(')
  if n <= 64:  # Same result (run on small blocks).
    # Device d's block for device j depends on d and on j's 'shard'
    # coordinate only (HSDP: equal shards over 'replicate').
    d, j = np.meshgrid(np.arange(n), np.arange(n), indexing='ij')
    blocks = (d * s + j % s)[..., None] * 4 + np.arange(4)
    small = jax.device_put(
      jnp.asarray(blocks.reshape(n * n, 4), jnp.float32),
      NamedSharding(mesh, spec),
    )
    run = lambda b: np.asarray(
      jax.jit(jax.shard_map(b, mesh=mesh, in_specs=spec, out_specs=spec))(small)
    )
    want = run(direct)
    row['two_stage_equal'] = bool(np.array_equal(want, run(two_stage)))
    row['gather_equal'] = bool(np.array_equal(want, run(gather)))
  return row


def dedicated_row(name, n, s, layers_per_gather='auto'):

  import hlo_tools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((n // s, s), ('replicate', 'shard'))
  params, dims = model_params(name)
  t = time.perf_counter()
  ded = dmuon_jax.dedicate(
    params,
    mesh,
    reshard_after_forward=True,
    layers_per_gather=layers_per_gather,
  )
  plan_s = time.perf_counter() - t
  opt = dmuon_jax.dedicated_muon(ded, 0.02, nonfinite='propagate')
  dp = jax.eval_shape(ded.to_dedicated, params)
  state = jax.eval_shape(opt.init, dp)
  axes = ded.buffer_axes
  tokens = 8 * n  # 8 per device

  def block(p, x):
    h = jnp.tanh(x @ p['q']) @ p['o'] + jnp.tanh(x @ p['k']) @ p['v'].T
    x = x + h
    return x + (jax.nn.silu(x @ p['gate']) * (x @ p['up'])) @ p['down']

  names = list(ded.boundaries.names)  # gather groups in boundary order

  def loss(dp, x):
    return jnp.mean(ded.sequential(block, names)(dp, x) ** 2)

  specs = ded.specs()
  state_specs = ded.specs_of(state)

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(specs, state_specs, P(axes)),
    out_specs=(specs, state_specs, P()),
  )
  def step(dp, state, x):
    value, grads = dmuon_jax.local_value_and_grad(loss)(dp, x)
    updates, state = opt.update(grads, state, dp)
    return optax.apply_updates(dp, updates), state, jax.lax.pmean(value, axes)

  d = LLAMA[name.partition('_L')[0]][1]
  x = jax.ShapeDtypeStruct(
    (tokens, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(axes))
  )
  compiled, lower_s, compile_s, cuda = compile_timed(step, n, dp, state, x)
  report = dmuon_jax.analyze_compiled(compiled)
  n_slots = ded.num_slots
  flops = hlo_tools.dot_flops(
    compiled, loop_trip_counts=True, branches_per_device=n_slots
  )
  nesting = hlo_tools.collective_nesting(compiled)
  branches = conditional_branches(compiled.as_text())
  payload, gathered = ded.gather_bytes()
  r = n // s
  model = 3 * (s - 1) / s * gathered + 2 * (r - 1) / r * gathered / s
  muon = cuda.get('all-gather', 0) + cuda.get('reduce-scatter', 0)
  return {
    'model': name,
    'devices': n,
    'mode': 'dedicated Z3'
    + (
      ''
      if layers_per_gather == 'auto'
      else f', {layers_per_gather} layer/gather'
    ),
    'layers_per_gather': ded.layers_per_gather,
    'plan_s': plan_s,
    'lower_s': lower_s,
    'compile_s': compile_s,
    # The step's dots include the model's forward and backward: the NS
    # part is the plan's prediction (below); this is the program's total.
    'step_dot_flops_per_device': flops,
    'conditional_branches': branches,
    'plan_makespan': ded.plan.makespan,
    'groups': len(ded.plan.groups),
    'bytes_by_kind': cuda,
    'cpu_bytes_by_kind': report.bytes_by_kind,
    'bytes_by_axis': by_axis(report, n, s),
    'muon_bytes': muon,
    'seeds_model_bytes': model,
    'gathered_bytes': gathered,
    'payload_bytes': payload,
    'in_conditional': sum('conditional' in c.context for c in nesting),
    'in_loop': sum('while' in c.context for c in nesting),
    **memory(compiled),
  }


def worker(args):
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '')
    + f' --xla_force_host_platform_device_count={args.worker}'
  )
  n, s = args.worker, 8
  for name in args.models.split(','):
    for mode in args.modes.split(','):
      if mode.startswith('dedicated') and name.partition('_L')[0] not in LLAMA:
        continue
      if mode == 'a2a' and name != args.models.split(',')[0]:
        continue  # not per model
      fn = {
        'plan': plan_row,
        'drop_in': drop_in_row,
        'dedicated': dedicated_row,
        # Z3 memory with one layer per gather (more padding, one layer's
        # weights gathered at a time):
        'dedicated1': functools.partial(dedicated_row, layers_per_gather=1),
        'a2a': a2a_row,
      }[mode]
      t = time.perf_counter()
      try:
        row = fn(name, n, s)
      except Exception as e:  # pylint: disable=broad-except
        row = {
          'model': name,
          'devices': n,
          'mode': mode,
          'error': f'{type(e).__name__}: {str(e)[:300]}',
        }
      row['wall_s'] = time.perf_counter() - t
      print(json.dumps(row), flush=True)


def run_worker(script, argv, timeout):
  """``(rows, exit status or 'timeout', stderr or 'timeout')`` of one
  subprocess ``script argv`` (its JSON rows: the lines of its stdout that
  start with ``{``), with the repository root on its ``PYTHONPATH``."""
  env = dict(os.environ)
  env['PYTHONPATH'] = (
    str(HERE.parent.parent) + os.pathsep + env.get('PYTHONPATH', '')
  )
  try:
    proc = subprocess.run(
      [sys.executable, script, *argv],
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env,
      check=False,
    )
    out, err, rc = proc.stdout, proc.stderr, proc.returncode
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ''
    err, rc = 'timeout', 'timeout'
  return [json.loads(l) for l in out.splitlines() if l.startswith('{')], rc, err


def run_all(args):
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  rows = []
  if args.append and (out_dir / 'scale.json').exists():
    rows = [
      json.loads(l) for l in (out_dir / 'scale.json').read_text().splitlines()
    ]
  start = time.perf_counter()
  for n in [int(x) for x in args.devices.split(',') if x]:
    left = min(args.budget - (time.perf_counter() - start), args.worker_timeout)
    if left < 30:
      rows.append(
        {
          'model': args.models,
          'devices': n,
          'mode': 'all',
          'error': 'time budget spent',
        }
      )
      continue
    got, rc, err = run_worker(
      __file__,
      ['--worker', str(n), '--models', args.models, '--modes', args.modes],
      left,
    )
    rows.extend(got)
    for row in got:
      print(json.dumps(row), flush=True)
    if rc != 0:
      rows.append(
        {
          'model': args.models,
          'devices': n,
          'mode': 'worker',
          'error': f'exit {rc} after {time.perf_counter() - start:.0f} s: '
          f'{err[-400:]}',
        }
      )
      print(rows[-1], flush=True)
  # Rows measured again replace the old ones (same model, N and mode).
  key = lambda r: (r.get('model'), r.get('devices'), r.get('mode'))
  latest = {}
  for row in rows:
    latest[key(row)] = row
  rows = list(latest.values())
  # A worker's failure is dropped once every model it ran has been measured
  # at that N since (a compiled row without error; a plan alone does not
  # count).
  measured = {
    (r.get('model'), r.get('devices'))
    for r in rows
    if 'error' not in r and r.get('mode') not in ('worker', 'all', 'plan')
  }
  rows = [
    r
    for r in rows
    if r.get('mode') != 'worker'
    or not all(
      (m, r.get('devices')) in measured for m in str(r['model']).split(',')
    )
  ]
  with open(out_dir / 'scale.json', 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  write_markdown(rows, out_dir / 'scale.md')
  plot(rows, out_dir / 'scale.png')


def _fmt_bytes(b):
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(b) < 1024 or unit == 'TiB':
      return f'{b:.1f} {unit}'
    b /= 1024
  return str(b)


def exponent(xs, ys):
  """Least-squares slope of log y against log x."""
  lx = [math.log(x) for x in xs]
  ly = [math.log(y) for y in ys]
  mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
  num = sum((a - mx) * (b - my) for a, b in zip(lx, ly))
  den = sum((a - mx) ** 2 for a in lx)
  return num / den if den else float('nan')


def write_markdown(rows, path):
  lines = [
    '# Scale study: dmuon at 8 to 1024 simulated devices (compile only)',
    '',
    'Produced by `python examples/benchmarks/scale.py` (see its docstring).',
    'XLA:CPU with `--xla_force_host_platform_device_count=N`, meshes',
    '(N/8) x 8, abstract bfloat16 params FSDP-sharded over `shard`.',
    '',
    '## Owner plans',
    '',
    '| model | N | matrices | groups (devices each) | plan time | '
    'single owner / (total/N) | groups / bound | bound |',
    '|---|---:|---:|---|---:|---:|---:|---:|',
  ]
  for r in rows:
    if r.get('mode') != 'plan' or 'error' in r:
      continue
    lines.append(
      f'| {r["model"]} | {r["devices"]} | {r["matrices"]} | '
      f'{r["groups"]} ({r["group_devices"]}) | {r["plan_s"]:.2f} s | '
      f'{r["plain_ratio"]:.3f} | {r["plan_ratio"]:.3f} | '
      f'{r["bound"]:.3g} |'
    )
  lines += [
    '',
    '## Compiled programs',
    '',
    '| model | mode | N | NS FLOPs / device (HLO) | / bound | lower | '
    'compile | bytes / device (measured vs model) | peak memory / device | '
    'collectives in a conditional |',
    '|---|---|---:|---:|---:|---:|---:|---|---:|---:|',
  ]
  bounds = {
    (r['model'], r['devices']): r['bound']
    for r in rows
    if r.get('mode') == 'plan' and 'error' not in r
  }
  for r in rows:
    if r.get('mode') != 'drop-in' and not r.get('mode', '').startswith(
      'dedicated Z3'
    ):
      continue
    if 'error' in r:
      continue
    bound = bounds.get((r['model'], r['devices']))
    if r['mode'] == 'drop-in':
      flops = r['ns_flops_per_device']
      ratio = f'{flops / bound:.3f}' if bound else '-'
      measured = sum(r['bytes_by_kind'].values())
      model = sum(r['predicted_bytes'].values())
    else:
      flops = r['plan_makespan']
      ratio = f'{flops / bound:.3f} (plan)' if bound else '-'
      measured = r['muon_bytes']
      model = r['seeds_model_bytes']
    lines.append(
      f'| {r["model"]} | {r["mode"]} | {r["devices"]} | {flops:.3g} | '
      f'{ratio} | {r["lower_s"]:.1f} s | {r["compile_s"]:.1f} s | '
      f'{_fmt_bytes(measured)} vs {_fmt_bytes(model)} | '
      f'{_fmt_bytes(r["peak_bytes"])} | {r["in_conditional"]} |'
    )
  sized = [
    r
    for r in rows
    if r.get('mode') == 'drop-in'
    and 'error' not in r
    and 'branches_per_conditional' in r
  ]
  if sized:
    lines += [
      '',
      "## Drop-in update: program size and the groups' exchange",
      '',
      'Branch bodies of each conditional in the compiled HLO (text order), '
      "and the update's bytes (CUDA program) over those of its routes "
      "(all-to-all and all-gather): the owner groups' Gram exchange and "
      'scalar reductions on top.',
      '',
      '| model | N | branch bodies | per conditional | compile | '
      "bytes / routes' bytes | by kind |",
      '|---|---:|---:|---|---:|---:|---|',
    ]
    for r in sorted(sized, key=lambda r: (r['model'], r['devices'])):
      per = r['branches_per_conditional']
      ratio = r.get('bytes_over_routes')
      kinds = ', '.join(
        f'{k} {_fmt_bytes(v)}' for k, v in sorted(r['bytes_by_kind'].items())
      )
      lines.append(
        f'| {r["model"]} | {r["devices"]} | {sum(per)} | {per} | '
        f'{r["compile_s"]:.1f} s | '
        + (f'{ratio:.3f}' if ratio else '-')
        + f' | {kinds} |'
      )
  lone = sorted(
    (r for r in rows if r.get('mode') == 'a2a' and 'error' not in r),
    key=lambda r: r['devices'],
  )
  if lone:
    updates = {
      r['devices']: r
      for r in rows
      if r.get('mode') == 'drop-in'
      and r.get('model') == 'llama3_8b'
      and 'error' not in r
    }
    lines += [
      '',
      "## The way back's exchange, compiled alone",
      '',
      f'bfloat16, {A2A_BLOCK} elements per peer. Direct: one all-to-all '
      'over all N devices. Two stages: over `shard`, then over `replicate`. '
      'Gather (the update now): an all-to-all over `shard` of the S '
      'distinct blocks, then an all-gather over `replicate` (HSDP devices '
      'of one `shard` coordinate hold equal shards): the direct result and '
      'bytes. All three give the same result (at N = 64 checked by running '
      'them). Kernels: fusions in the compiled HLO. Last column: the '
      'Llama-3-8B drop-in update of the table above.',
      '',
      '| N | direct: compile | kernels | two stages: compile | kernels | '
      'gather: compile | kernels | 8B drop-in update: compile |',
      '|---:|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for r in lone:
      u = updates.get(r['devices'])
      g = (
        f'{r["gather_compile_s"]:.1f} s | {r["gather_kernels"]}'
        if 'gather_compile_s' in r
        else '- | -'
      )
      lines.append(
        f'| {r["devices"]} | {r["direct_compile_s"]:.1f} s | '
        f'{r["direct_kernels"]} | {r["two_stage_compile_s"]:.1f} s | '
        f'{r["two_stage_kernels"]} | {g} | '
        + (f'{u["compile_s"]:.1f} s |' if u else '- |')
      )
  errors = [r for r in rows if 'error' in r]
  if errors:
    lines += ['', '## Not reached', '']
    for r in errors:
      lines.append(
        f'- {r.get("model", "")} {r.get("mode")} N={r["devices"]}: {r["error"]}'
      )
  # The layer sweep: models cut to fewer layers at one N, each with its plan
  # row (a run of one cut model over several N, or without plans, has none).
  plans = {
    (r['model'], r['devices']): r
    for r in rows
    if r.get('mode') == 'plan' and '_L' in r.get('model', '')
  }
  sweep = sorted(
    (
      r
      for r in rows
      if r.get('mode') == 'drop-in'
      and '_L' in r['model']
      and 'error' not in r
      and (r['model'], r['devices']) in plans
    ),
    key=lambda r: (r['devices'], r['model']),
  )
  sweep = [r for r in sweep if r['devices'] == sweep[0]['devices']]
  if len(sweep) > 1:
    xs = [plans[r['model'], r['devices']]['units'] for r in sweep]
    e = exponent(xs, [r['compile_s'] for r in sweep])
    lines += [
      '',
      '## Compile time against the number of units (matrices and slices)',
      '',
      f'Llama-3-8B shapes cut to fewer layers, drop-in update at N = '
      f'{sweep[0]["devices"]}: compile time ~ units^{e:.2f}',
      '',
      '| layers | matrices | units (groups) | lower | compile |',
      '|---:|---:|---:|---:|---:|',
    ]
    for r, m in zip(sweep, xs):
      p = plans[r['model'], r['devices']]
      lines.append(
        f'| {r["model"].partition("_L")[2]} | {p["matrices"]} | {m} '
        f'({p["groups"]}) | {r["lower_s"]:.1f} s | {r["compile_s"]:.1f} s |'
      )
  compiled = [
    r
    for r in rows
    if r.get('mode') == 'drop-in'
    and 'error' not in r
    and '_L' not in r['model']
  ]
  by_model = {}
  for r in compiled:
    by_model.setdefault(r['model'], []).append(r)
  if by_model:
    lines += ['', '## Compile time', '']
    for model, rs in by_model.items():
      if len(rs) > 1:
        e = exponent([r['devices'] for r in rs], [r['compile_s'] for r in rs])
        lines.append(
          f'- {model}, drop-in: compile time ~ N^{e:.2f} over N = '
          f'{", ".join(str(r["devices"]) for r in rs)}'
        )
  path.write_text('\n'.join(lines) + '\n')


def plot(rows, path):
  plt = _common.pyplot()
  if plt is None:
    return
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
  plans = [r for r in rows if r.get('mode') == 'plan' and 'error' not in r]
  drop = [r for r in rows if r.get('mode') == 'drop-in' and 'error' not in r]
  for model in MODELS:
    ps = sorted(
      (r for r in plans if r['model'] == model), key=lambda r: r['devices']
    )
    ds = sorted(
      (r for r in drop if r['model'] == model), key=lambda r: r['devices']
    )
    if not ps:
      continue
    (line,) = a.plot(
      [r['devices'] for r in ps],
      [r['ns_flops_total'] / r['devices'] for r in ps],
      '--',
      alpha=0.6,
    )
    a.plot(
      [r['devices'] for r in ps],
      [r['plain_makespan'] for r in ps],
      ':',
      color=line.get_color(),
      label=f'{model}: one owner per matrix (plan)',
    )
    if ds:
      a.plot(
        [r['devices'] for r in ds],
        [r['ns_flops_per_device'] for r in ds],
        'o-',
        color=line.get_color(),
        label=f'{model}: measured (HLO)',
      )
      b.plot(
        [r['devices'] for r in ds],
        [r['compile_s'] for r in ds],
        'o-',
        color=line.get_color(),
        label=model,
      )
  a.set(
    xscale='log',
    yscale='log',
    xlabel='devices N',
    ylabel='NS FLOPs per device (dashed: total / N)',
    title='Newton-Schulz work of the busiest device',
  )
  a.legend(fontsize=7)
  b.set(
    xscale='log',
    yscale='log',
    xlabel='devices N',
    ylabel='seconds',
    title='compile time of the drop-in update',
  )
  b.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(
    description=__doc__,
    formatter_class=_common.HelpFormatter,
  )
  parser.add_argument(
    '--devices',
    default='8,64,256,1024',
    help='device counts N, comma-separated',
  )
  parser.add_argument(
    '--models', default=','.join(MODELS), help='models, comma-separated'
  )
  parser.add_argument(
    '--modes',
    default='plan,drop_in,dedicated',
    help='plan, drop_in, dedicated (Z3), dedicated1 (Z3, one layer per '
    'gather), a2a (one all-to-all over all N devices alone, direct and in '
    'two stages)',
  )
  parser.add_argument(
    '--budget', type=float, default=5400.0, help='seconds for the whole run'
  )
  parser.add_argument(
    '--worker-timeout',
    type=float,
    default=3600.0,
    help='seconds for one device count (all its models and modes)',
  )
  parser.add_argument(
    '--append', action='store_true', help='add to an existing scale.json'
  )
  parser.add_argument(
    '--out-dir', default=str(HERE / 'results'), help='where to write results'
  )
  parser.add_argument(
    '--worker', type=int, default=0, help='(internal) run one device count'
  )
  args = parser.parse_args()
  if args.worker:
    worker(args)
  else:
    run_all(args)


if __name__ == '__main__':
  main()
