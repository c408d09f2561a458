"""The dedicated step under plain ``nnx.jit`` on every local device (GPU or CPU).

Compiles one train step of a small NNX decoder (tied embedding, blocks of
two Muon matrices) dedicated by ``dmuon_jax.flax.dedicate`` on an Explicit
``(1, N)`` mesh of ``('replicate', 'shard')``, Z2 and Z3, under the user's
own ``nnx.jit``: the reduced-gather route of the dedicated guide. Reported
per mode, from the compiled program: each collective kind's count and
bytes per device, the Muon traffic (all-gather + reduce-scatter) against
the plan's floor (2 or 3 · (N-1)/N · the gathered bytes), whether any
collective sits in a conditional, and the median step time.

The question it answers on a GPU: does XLA:GPU keep the custom backward's
reduce-scatter (and no all-reduce of a Muon gradient), as XLA:CPU does?

    python examples/benchmarks/gpu_route.py             # every local GPU
    python examples/benchmarks/gpu_route.py --cpu-smoke # 8 CPU devices

Writes ``<name>.json`` (one JSON object per line) and ``<name>.md`` under
``--out-dir`` (name ``gpu_route`` or ``gpu_route_cpu_smoke``). It needs at
least 2 devices; with fewer the rows are recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = pathlib.Path(__file__).resolve().parent
GPU_MODEL = {'d': 1024, 'f': 4096, 'vocab': 8192, 'layers': 4, 'batch': 32}
SMOKE_MODEL = {'d': 32, 'f': 64, 'vocab': 64, 'layers': 2, 'batch': 16}
AXES = ('replicate', 'shard')


def run(size, z3, reps):
  """One mode: the compiled step's collectives and its median time."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top
  import dmuon_jax.flax as dflax  # pylint: disable=g-import-not-at-top

  n = jax.device_count()
  mesh = jax.make_mesh((1, n), AXES)
  d, f, vocab = size['d'], size['f'], size['vocab']

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(d, f, use_bias=False, rngs=rngs)
      self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
      h = nnx.gelu(self.up(x, out_sharding=P(AXES, None, None)))
      return x + self.down(h, out_sharding=P(AXES, None, None))

  class Decoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, d, rngs=rngs)
      self.layers = nnx.List([Block(rngs) for _ in range(size['layers'])])

    def __call__(self, tokens):
      x = self.embed(tokens, out_sharding=P(AXES))
      for block in self.layers:
        x = block(x)
      return self.embed.attend(x, out_sharding=P(AXES))

  def step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]
      ).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  with jax.set_mesh(mesh):
    model = Decoder(nnx.Rngs(0))
    ded = dflax.dedicate(model, mesh, reshard_after_forward=z3)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=0.01), wrt=nnx.Param
    )
    batch = size['batch'] * max(1, n // 8)
    tokens = jax.random.randint(jax.random.key(1), (batch, 65), 0, vocab)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(AXES)))
    jitted = nnx.jit(step)
    compiled = jitted.lower(model, optimizer, tokens).compile()
    jitted(model, optimizer, tokens).block_until_ready()
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      jitted(model, optimizer, tokens).block_until_ready()
      times.append(time.perf_counter() - start)
  kinds = {}
  for c in dmuon_jax.diagnostics.hlo_collectives(compiled.as_text()):
    count, nbytes = kinds.get(c.kind, (0, 0.0))
    kinds[c.kind] = (count + c.executions, nbytes + c.bytes * c.executions)
  import hlo_tools  # pylint: disable=import-outside-toplevel

  nested = hlo_tools.collective_nesting(compiled)
  _, gathered = ded.dedication.gather_bytes()
  floor = (3 if z3 else 2) * (n - 1) / n * gathered
  muon = sum(
    kinds.get(k, (0, 0.0))[1] for k in ('all-gather', 'reduce-scatter')
  )
  return {
    'status': 'ok',
    'devices': n,
    'kinds': {k: {'count': c, 'bytes': b} for k, (c, b) in kinds.items()},
    'muon_bytes': muon,
    'floor_bytes': floor,
    'muon_over_floor': muon / floor,
    'in_conditional': sum('conditional' in c.context for c in nested),
    'median_ms': 1e3 * statistics.median(times),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=_common.HelpFormatter
  )
  parser.add_argument(
    '--cpu-smoke', action='store_true', help='8 simulated CPU devices'
  )
  parser.add_argument('--reps', type=int, default=5, help='timed steps')
  parser.add_argument(
    '--out-dir',
    default=str(HERE / 'results' / 'gpu'),
    help='where to write results',
  )
  args = parser.parse_args(argv)
  if args.cpu_smoke:
    _common.simulate_cpu_devices(8)
  import jax  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  name = 'gpu_route_cpu_smoke' if args.cpu_smoke else 'gpu_route'
  size = SMOKE_MODEL if args.cpu_smoke else GPU_MODEL
  rows = []
  for z3 in (False, True):
    row = {'mode': 'Z3' if z3 else 'Z2', 'backend': jax.default_backend()}
    if jax.device_count() < 2:
      row.update(status='skipped', devices=jax.device_count())
    else:
      row.update(run(size, z3, args.reps))
    rows.append(row)
    print(json.dumps(row), flush=True)
  lines = [
    f'# {name}: the dedicated step under plain nnx.jit',
    '',
    '| mode | devices | Muon bytes / floor | collectives (count, bytes/device)'
    ' | in a conditional | median ms |',
    '|---|---:|---:|---|---:|---:|',
  ]
  for r in rows:
    if r['status'] != 'ok':
      lines.append(f'| {r["mode"]} | {r["devices"]} | skipped | | | |')
      continue
    kinds = ', '.join(
      f'{k} {v["count"]} × {v["bytes"]:,.0f} B' for k, v in r['kinds'].items()
    )
    lines.append(
      f'| {r["mode"]} | {r["devices"]} | {r["muon_over_floor"]:.3f} | '
      f'{kinds} | {r["in_conditional"]} | {r["median_ms"]:.2f} |'
    )
  md = '\n'.join(lines)
  _common.write_results(
    args.out_dir, name, rows, md, time.perf_counter() - start
  )


if __name__ == '__main__':
  main()
