"""Compare AdamW, optax.contrib.muon and dmuon on a small byte-level LM.

The text is the Python standard library's own source (found through
``sysconfig``, no download), split into train and validation by file. The
model is a small Flax NNX MLP language model over a window of previous
bytes; it runs data-parallel on 8 simulated CPU devices by default.

    python examples/train_lm.py            # defaults: a few minutes on 2 cores
    python examples/train_lm.py --steps 50 --mesh 1x8
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sysconfig
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--steps', type=int, default=300)
  p.add_argument('--batch', type=int, default=128)
  p.add_argument('--context', type=int, default=16)
  p.add_argument('--width', type=int, default=256)
  p.add_argument('--layers', type=int, default=3)
  p.add_argument('--mesh', default='2x4',
                 help='replicate x shard, e.g. 2x4, 1x8, 8x1')
  p.add_argument('--data-bytes', type=int, default=4_000_000)
  p.add_argument('--eval-every', type=int, default=100)
  p.add_argument('--seed', type=int, default=0)
  return p.parse_args(argv)


def load_stdlib_text(max_bytes: int, seed: int):
  """Train/validation bytes from the standard library's .py files."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = sorted(p for p in root.rglob('*.py')
                 if 'site-packages' not in p.parts and p.is_file())
  rng = np.random.default_rng(seed)
  rng.shuffle(files)
  train, val, size = [], [], 0
  for i, path in enumerate(files):
    data = path.read_bytes()
    (val if i % 10 == 0 else train).append(data)
    size += len(data)
    if size >= max_bytes:
      break
  to_array = lambda parts: np.frombuffer(b'\n'.join(parts), np.uint8)
  return to_array(train), to_array(val)


def main(argv=None):
  args = parse_args(argv)
  r, s = (int(v) for v in args.mesh.split('x'))
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_num_cpu_devices', max(r * s, 1))
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((r, s), ('replicate', 'shard'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  train, val = load_stdlib_text(args.data_bytes, args.seed)
  print(f'data: {len(train):,} train bytes, {len(val):,} validation bytes; '
        f'mesh {r}x{s} ({jax.device_count()} devices)')

  class ByteMlp(nnx.Module):
    """Predicts the next byte from the previous ``context`` bytes."""

    def __init__(self, rngs):
      self.embed = nnx.Embed(256, 32, rngs=rngs)
      widths = [32 * args.context] + [args.width] * args.layers
      self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                              for a, b in zip(widths[:-1], widths[1:])])
      self.norm = nnx.LayerNorm(args.width, rngs=rngs)
      self.head = nnx.Linear(args.width, 256, rngs=rngs)

    def __call__(self, window):
      x = self.embed(window).reshape(window.shape[0], -1)
      for layer in self.layers:
        x = jax.nn.gelu(layer(x))
      return self.head(self.norm(x))

  data_sharding = NamedSharding(mesh, P(('replicate', 'shard')))

  def batches(data, step, batch):
    rng = np.random.default_rng((args.seed, step))
    starts = rng.integers(0, len(data) - args.context - 1, batch)
    idx = starts[:, None] + np.arange(args.context + 1)
    chunk = data[idx].astype(np.int32)
    return jax.device_put(chunk, data_sharding)

  def loss_fn(model, chunk):
    logits = model(chunk[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, chunk[:, -1]).mean()

  optimizers = {
      'adamw': optax.adamw(3e-3),
      'optax.contrib.muon': optax.contrib.muon(
          0.02, adam_learning_rate=3e-3,
          muon_weight_dimension_numbers=lambda p: jax.tree.map(
              lambda lbl: (dmuon_jax.MuonDimensionNumbers()
                           if lbl == 'muon' else None),
              dmuon_jax.muon_labels(p))),
      'dmuon': dmuon_jax.dmuon(0.02, adam_learning_rate=3e-3, mesh=mesh),
  }
  val_batch = batches(val, 10**9, 1024)  # a fixed validation sample
  results = []
  for name, tx in optimizers.items():
    model = ByteMlp(nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, chunk):
      loss, grads = nnx.value_and_grad(loss_fn)(model, chunk)
      optimizer.update(model, grads)
      return loss

    eval_step = nnx.jit(loss_fn)
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
      losses.append(float(train_step(model, optimizer,
                                     batches(train, step, args.batch))))
      if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
        print(f'{name:>20} step {step + 1:5d}  train {np.mean(losses[-20:]):.4f}'
              f'  val {float(eval_step(model, val_batch)):.4f}', flush=True)
    results.append((name, np.mean(losses[-20:]),
                    float(eval_step(model, val_batch)),
                    time.perf_counter() - start))

  print('\n| optimizer | train loss (last 20) | val loss | time (s) |')
  print('|---|---|---|---|')
  for name, tr, va, secs in results:
    print(f'| {name} | {tr:.4f} | {va:.4f} | {secs:.1f} |')
  return results


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  main()
