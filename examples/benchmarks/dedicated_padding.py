"""Dedicated gathers' padding, whole matrices against split ones (plans only).

For each model and mesh, ``dmuon_jax.dedicate`` with its defaults
(``layers_per_gather='auto'``, ``owner_groups='auto'``: matrices split over
owners where whole ones would pad a gather by more than 5%) against the
same group size with every matrix whole (``owner_groups=None``): the
gathers' padding, the matrices split, the owner groups' Gram exchange per
device per step, the gathered bytes of the two largest groups (what Z3
holds at its peak) and the planned busiest device's Newton-Schulz work
against ``max(total / N, largest g x g iteration)`` (the drop-in plan's
bound, as the scale study computes it), split into its owner groups'
iterations and its matrices and slices, beside every device's mean of the
latter. Shapes only: nothing is compiled.

    python examples/benchmarks/dedicated_padding.py
    python examples/benchmarks/dedicated_padding.py --models four,gpt
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

import dmuon_jax

# Shared helpers of the benchmarks here (the --help formatter).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position

LLAMA = {
  'llama3_8b': (32, 4096, 14336, 1024),
  'llama3_70b': (80, 8192, 28672, 1024),
}


def model(name):
  """``(params, mesh shape, fixed layers per gather or None)``."""
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  if name == 'four':  # 4 Muon matrices, 1 MiB, on 8 devices
    return (
      {
        f'layers_{i}': {'up': f32(128, 512), 'down': f32(512, 128)}
        for i in range(2)
      },
      (1, 8),
      None,
    )
  if name.startswith('gpt'):  # 4 blocks: fused qkv, out, up, down
    d = 32
    params = {
      'blocks': {
        i: {
          'qkv': f32(d, 3 * d),
          'out': f32(d, d),
          'up': f32(d, 4 * d),
          'down': f32(4 * d, d),
        }
        for i in range(4)
      }
    }
    k = name.partition('_k')[2]
    return params, (1, 8), int(k) if k else None
  base, _, n = name.partition('@')
  layers, d, f, kv = LLAMA[base]
  params = {
    f'layers_{i}': {
      'q': bf16(d, d),
      'k': bf16(d, kv),
      'v': bf16(d, kv),
      'o': bf16(d, d),
      'gate': bf16(d, f),
      'up': bf16(d, f),
      'down': bf16(f, d),
    }
    for i in range(layers)
  }
  return params, (int(n) // 8, 8), None


def held(ded):
  """Gathered bytes of the two largest gather groups (one pass each)."""
  sizes = sorted(
    lay.num_slots
    * sum(
      size * jnp.dtype(d).itemsize
      for size, d in zip(lay.local_sizes, lay.dtypes)
    )
    for lay in ded.layouts
  )
  return sum(sizes[-2:])


def bound(params, sizes):
  """``max(total / N, largest iteration)`` of the drop-in plans."""
  plain = dmuon_jax.plan_ownership(params, sizes, owner_groups=None)
  plan = dmuon_jax.plan_ownership(params, sizes)
  total = sum(u.cost for u in plain.units)
  iteration = max((g.iteration_cost for g in plan.groups), default=0.0)
  return max(total / plain.num_slots, iteration)


def busiest(plan, b):
  """The busiest slot's Newton-Schulz work over ``b``, as ``iterations +
  units`` (its owner groups' ``g x g`` iterations, its matrices and
  slices), and every slot's mean unit work over ``b``."""
  units = [0.0] * plan.num_slots
  iters = [0.0] * plan.num_slots
  for u, slot in zip(plan.units, plan.owners):
    units[slot] += u.cost
  for g in plan.groups:
    for slot, cost in zip(g.iteration_owners, g.iteration_costs):
      iters[slot] += cost
  s = max(range(plan.num_slots), key=lambda i: (units[i] + iters[i], -i))
  mean = sum(units) / plan.num_slots
  return f'{iters[s] / b:.3f} + {units[s] / b:.3f} | {mean / b:.3f}'


def human(b):
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if b < 1024 or unit == 'TiB':
      return f'{b:.0f} {unit}' if unit == 'B' else f'{b:.1f} {unit}'
    b /= 1024
  raise AssertionError


def row(name):
  params, shape, k = model(name)
  sizes = {'replicate': shape[0], 'shard': shape[1]}
  per_gather = 'auto' if k is None else k
  t = time.perf_counter()
  ded = dmuon_jax.dedicate(params, sizes, layers_per_gather=per_gather)
  plan_s = time.perf_counter() - t
  whole = dmuon_jax.dedicate(
    params, sizes, layers_per_gather=ded.layers_per_gather, owner_groups=None
  )
  b = bound(params, sizes)
  pad = lambda d: 100 * (d.gather_bytes()[1] / d.gather_bytes()[0] - 1)
  return (
    f'| {name} | {shape[0]}x{shape[1]} | {ded.layers_per_gather} '
    f'({ded.layers_per_gather_choice}) | {pad(whole):.1f}% | '
    f'{pad(ded):.1f}% | {len(ded.plan.groups)} | '
    f'{human(ded.exchange_bytes())} | {human(held(ded))} | '
    f'{ded.plan.makespan / b:.3f} | {busiest(ded.plan, b)} | {plan_s:.1f} s |'
  )


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=_common.HelpFormatter
  )
  parser.add_argument(
    '--models',
    default='four,gpt,gpt_k2,gpt_k1,llama3_8b@64,llama3_70b@64',
    help='four, gpt, gpt_kK (K blocks per gather), llama3_8b@N, '
    'llama3_70b@N (N a multiple of 8)',
  )
  args = parser.parse_args()
  print(
    '| model | mesh | layers / gather | padding, whole | padding, split | '
    'split matrices | exchange / device | two largest groups | NS / bound '
    '(plan) | busiest: iterations + units | units, mean | plan time |'
  )
  print('|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
  for name in args.models.split(','):
    print(row(name), flush=True)


if __name__ == '__main__':
  main()
