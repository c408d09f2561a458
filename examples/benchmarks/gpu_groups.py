"""Owner groups and tensor parallelism on every local device (GPU or CPU).

Two cases of ``dmuon_jax.dmuon``'s drop-in update on a Llama-shaped tree
(layers of q, k, v, o, gate, up, down), FSDP-sharded, against
single-device ``optax.contrib.muon`` over ``--steps`` steps with fixed
random gradients:

* ``groups``: mesh ``(1, N)`` of ``('replicate', 'shard')``, every matrix
  split over ``k = 2`` devices (``owner_groups=2``);
* ``tp``: mesh ``(1, N / 2, 2)`` of ``('replicate', 'shard', 'model')``,
  q/k/v/gate/up column-parallel and o/down row-parallel over ``'model'``.

Reported per case: the largest relative error against optax, the median
step time, and from the compiled program the collectives nested in a
conditional (dmuon runs none there: NCCL needs every device of a replica
group to reach each collective) and the bytes by kind, beside the layout's
predictions: the routes' all-to-alls (and all-gathers) and the owner groups'
Gram exchange (collective-permutes: each member's Gram to its group's
iteration owner and the factor back).

On GPU it needs at least 2 (``tp``: 4) devices, else the case is recorded
as skipped. ``--cpu-smoke`` runs it on 8 simulated CPU devices with tiny
shapes (what ``gpu.sh`` does without a GPU).

    python examples/benchmarks/gpu_groups.py             # every local GPU
    python examples/benchmarks/gpu_groups.py --cpu-smoke # < 1 min

Writes ``<name>.json`` (one JSON object per line) and ``<name>.md`` under
``--out-dir`` (name ``gpu_groups`` or ``gpu_groups_cpu_smoke``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

# Shared helpers of the benchmarks here (the --help formatter).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = pathlib.Path(__file__).resolve().parent

GPU_TREE = {'layers': 4, 'd': 2048, 'd_kv': 512, 'd_ff': 7168}
# The CPU smoke run: one layer (the compiles dominate the run).
SMOKE_TREE = {'layers': 1, 'd': 64, 'd_kv': 16, 'd_ff': 128}


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__,
    formatter_class=_common.HelpFormatter,
  )
  parser.add_argument(
    '--cpu-smoke',
    action='store_true',
    help='8 simulated CPU devices, tiny shapes',
  )
  parser.add_argument(
    '--steps', type=int, default=5, help='steps compared with optax'
  )
  parser.add_argument('--reps', type=int, default=5, help='timed steps')
  parser.add_argument(
    '--out-dir',
    default=str(HERE / 'results' / 'gpu'),
    help='where to write results',
  )
  parser.add_argument(
    '--name',
    default=None,
    help='file stem (unset: gpu_groups, or gpu_groups_cpu_smoke)',
  )
  args = parser.parse_args(argv)
  if args.cpu_smoke:
    _common.simulate_cpu_devices(8)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  smoke = args.cpu_smoke or jax.default_backend() != 'gpu'
  cfg = SMOKE_TREE if smoke else GPU_TREE
  name = args.name or ('gpu_groups_cpu_smoke' if smoke else 'gpu_groups')
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  devices = jax.devices()
  n = len(devices)
  rows = []

  def record(row):
    row.update(
      backend=jax.default_backend(),
      devices=n,
      device_kind=devices[0].device_kind,
      smoke=smoke,
    )
    rows.append(row)
    print(json.dumps(row), flush=True)

  d, kv, f, layers = cfg['d'], cfg['d_kv'], cfg['d_ff'], cfg['layers']
  shapes = {
    'q': (d, d),
    'k': (d, kv),
    'v': (d, kv),
    'o': (d, d),
    'gate': (d, f),
    'up': (d, f),
    'down': (f, d),
  }
  column = {'q', 'k', 'v', 'gate', 'up'}
  key = iter(jax.random.split(jax.random.key(0), 4 * layers * len(shapes)))
  params = {
    f'layers_{i}': {
      k: 0.02 * jax.random.normal(next(key), s, jnp.float32)
      for k, s in shapes.items()
    }
    for i in range(layers)
  }
  grads = [
    jax.tree.map(lambda x: jax.random.normal(next(key), x.shape), params)
    for _ in range(2)
  ]

  # Single-device reference.
  ref = optax.contrib.muon(0.02)
  ref_state = ref.init(params)
  ref_step = jax.jit(
    lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *ref.update(g, s, p)
    )
  )
  want = params
  for t in range(args.steps):
    want, ref_state = ref_step(want, ref_state, grads[t % 2])
  want = jax.device_get(want)

  def case(label, mesh, spec_of, **kw):
    need = {'groups': 2, 'tp': 4}[label]
    if n < need:
      record(
        {
          'case': label,
          'status': 'skipped',
          'reason': f'needs {need} devices, found {n}',
        }
      )
      return
    shard = jax.tree.map(
      lambda s: NamedSharding(mesh, s),
      {
        layer: {k: spec_of(k) for k in shapes}
        for layer in params  # pylint: disable=cell-var-from-loop
      },
    )
    p = jax.device_put(params, shard)
    gs = [jax.device_put(g, shard) for g in grads]
    opt = dmuon_jax.dmuon(0.02, mesh=mesh, **kw)
    with jax.set_mesh(mesh):
      state = opt.init(p)
      step = jax.jit(
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
          *opt.update(g, s, p)
        ),
        donate_argnums=(0, 1),
      )
      compiled = step.lower(p, state, gs[0]).compile()
      for t in range(args.steps):
        p, state = compiled(p, state, gs[t % 2])
      got = jax.device_get(p)
      errors = [
        float(np.linalg.norm(a - b) / np.linalg.norm(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
      ]
      times = []
      for r in range(args.reps):
        t0 = time.perf_counter()
        p, state = compiled(p, state, gs[r % 2])
        jax.block_until_ready(p)
        times.append(time.perf_counter() - t0)
    import hlo_tools  # pylint: disable=import-outside-toplevel

    nesting = hlo_tools.collective_nesting(compiled)
    report = dmuon_jax.analyze_compiled(compiled)
    (layout,) = dmuon_jax.owner_layouts(state)
    record(
      {
        'case': label,
        'status': 'ok',
        'mesh': dict(mesh.shape),
        'groups': len(layout.plans[0].groups),
        # The owner groups' Gram exchange, point to point (ppermute rounds
        # of packed float32 triangles): the bytes the plan predicts.
        'predicted_group_exchange': layout.plans[0].group_exchange_bytes(),
        'predicted_routes': layout.collective_bytes(),
        'max_rel_error': max(errors),
        'median_ms': 1e3 * statistics.median(times),
        'collectives': len(nesting),
        'in_conditional': sum('conditional' in c.context for c in nesting),
        'in_loop': sum('while' in c.context for c in nesting),
        'bytes_by_kind': report.bytes_by_kind,
      }
    )

  case(
    'groups',
    jax.make_mesh((1, n), ('replicate', 'shard')),
    lambda k: P('shard', None),
    owner_groups=2,
  )
  if n >= 4 and n % 2 == 0:
    mesh = jax.make_mesh((1, n // 2, 2), ('replicate', 'shard', 'model'))
  else:
    mesh = None
  if mesh is None:
    record(
      {
        'case': 'tp',
        'status': 'skipped',
        'reason': f'needs an even number of at least 4 devices, found {n}',
      }
    )
  else:
    case(
      'tp',
      mesh,
      lambda k: P('shard', 'model') if k in column else P('model', 'shard'),
    )
  path = out_dir / f'{name}.json'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  lines = [
    f'# Owner groups and TP on {n} {rows[0]["device_kind"]} device(s)'
    + (' (CPU smoke run)' if smoke else ''),
    '',
    f'`python examples/benchmarks/gpu_groups.py{" --cpu-smoke" if args.cpu_smoke else ""}`;'
    f' {layers} layer{"s" if layers != 1 else ""}, d={d}, {args.steps} steps against optax.contrib.muon.',
    '',
    '| case | status | max rel. error | median step | collectives '
    '(in a conditional) | bytes by kind |',
    '|---|---|---:|---:|---|---|',
  ]
  for r in rows:
    if r['status'] != 'ok':
      lines.append(f'| {r["case"]} | {r["status"]}: {r["reason"]} | | | | |')
      continue
    lines.append(
      f'| {r["case"]} | ok | {r["max_rel_error"]:.2e} | '
      f'{r["median_ms"]:.2f} ms | {r["collectives"]} '
      f'({r["in_conditional"]}) | '
      + ', '.join(f'{k} {v:.3g} B' for k, v in r['bytes_by_kind'].items())
      + ' |'
    )
  (out_dir / f'{name}.md').write_text('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  bad = [
    r
    for r in rows
    if r['status'] == 'ok'
    and (r['max_rel_error'] > 1e-5 or r['in_conditional'])
  ]
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
