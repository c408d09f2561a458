"""Optimizer state per device: dmuon against optax.contrib.muon, FSDP params.

For each model and device count N (a separate process per N, abstract
inputs: nothing is allocated or compiled), the Muon momentum one device
holds under ``dmuon`` (the busiest device) as a multiple of the even share
(all Muon momentum / N, what ``optax.contrib.muon`` holds on params sharded
over all N devices), for the momentum kept in owner buffers (``'owners'``,
the only layout before the state followed the params) and for the layout
``init`` chooses; and the plan's busiest-device Newton-Schulz FLOPs over
their bound, max(total / N, the plan's largest unit (a matrix, or a slice
where owner groups split it), its largest owner-group iteration), total
being the whole matrices' (as ``scale.py`` counts it).

  python examples/benchmarks/state_memory.py            # N = 8, 64, 256
  python examples/benchmarks/state_memory.py --devices 8 --models toy12

Prints one JSON line per (model, N), then a markdown table.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
MODELS = ('toy12', 'llama3_8b', 'llama3_70b', 'deepseek_v3')


def toy12():
  """The issue's plain-JAX trainer: four 128x128 and eight 64x64 matrices
  (f32), abstract."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  shapes = [(128, 128)] * 4 + [(64, 64)] * 8
  return {
    f'w{i}': jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)
  }, None


def row(name, n):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, str(HERE))
  import scale  # pylint: disable=import-outside-toplevel

  params, dims = toy12() if name == 'toy12' else scale.model_params(name)
  if any(x.shape[-2] % n for x in jax.tree.leaves(params)):
    return None  # FSDP over N needs rows divisible by N (toy12 at 256)
  mesh = jax.make_mesh(
    (1, n),
    ('replicate', 'shard'),
    axis_types=(jax.sharding.AxisType.Explicit,) * 2,
  )
  placed = scale.fsdp(params, mesh)
  opt = dmuon_jax.dmuon(
    0.01,
    mesh=mesh,
    muon_weight_dimension_numbers=dims,
    mu_dtype=jnp.float32,
  )
  (layout,) = dmuon_jax.owner_layouts(jax.eval_shape(opt.init, placed))
  held, even = layout.momentum_share()
  owners, _ = dataclasses.replace(layout, momentum='owners').momentum_share()
  (plan,) = layout.plans
  # The bound of scale.py: the whole matrices' NS over N, or the largest
  # owner-group iteration (sliced units cost more in all than whole ones).
  plain = dmuon_jax.plan_ownership(
    params,
    dict(zip(layout.buffer_axes, layout.buffer_sizes)),
    weight_dimension_numbers=dims,
    owner_groups=None,
  )
  total = sum(u.cost for u in plain.units)
  iteration = max((g.iteration_cost for g in plan.groups), default=0.0)
  largest = max(u.cost for u in plan.units)  # a slice, where split
  return {
    'model': name,
    'devices': n,
    'matrices': len(plan.units),
    'momentum': layout.momentum,
    'even_share_bytes': even,
    'owners_over_even': owners / even,
    'chosen_over_even': held / even,
    'optax_over_even': 1.0,
    'ns_over_bound': plan.makespan / max(total / n, iteration, largest),
  }


def main():
  parser = argparse.ArgumentParser(
    description=__doc__,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    '--devices', default='8,64,256', help='device counts, one process each'
  )
  parser.add_argument(
    '--models', default=','.join(MODELS), help='comma-separated models'
  )
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    import jax  # pylint: disable=import-outside-toplevel

    jax.config.update('jax_num_cpu_devices', int(args.devices))
    for name in args.models.split(','):
      r = row(name, int(args.devices))
      if r is not None:
        print(json.dumps(r), flush=True)
    return
  rows = []
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  for n in args.devices.split(','):
    out = subprocess.run(
      [sys.executable, __file__, '--worker', '--devices', n]
      + ['--models', args.models],
      check=True,
      capture_output=True,
      text=True,
      env=env,
    ).stdout
    for line in out.splitlines():
      if line.startswith('{'):
        print(line)
        rows.append(json.loads(line))
  print()
  print(
    '| model | N | momentum | owner buffers / even | chosen / even '
    '| optax / even | NS / bound |'
  )
  print('|---|---:|---|---:|---:|---:|---:|')
  for r in rows:
    print(
      f'| {r["model"]} | {r["devices"]} | {r["momentum"]} '
      f'| {r["owners_over_even"]:.3f} | {r["chosen_over_even"]:.3f} '
      f'| {r["optax_over_even"]:.3f} | {r["ns_over_bound"]:.3f} |'
    )


if __name__ == '__main__':
  main()
