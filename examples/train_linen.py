"""dmuon in a Flax Linen training loop (``TrainState``, data parallel).

A small byte-level transformer (vocab 256: embedding, two pre-norm blocks of
causal attention and MLP with bias-free ``nn.Dense`` matrices,
``nn.LayerNorm``, head) learns the Python standard library's own source
(found through ``sysconfig``, no download; train and validation split by
file). The loop has the shape of the usual Flax example: ``TrainState.create``
with ``tx=dmuon_jax.dmuon(...)``, a jitted ``train_step(state, batch)`` that
calls ``state.apply_gradients``, and an ``eval_step``. It runs data parallel
on 8 simulated CPU devices: params replicated, the batch split over both
mesh axes; ``dmuon`` gives each Muon matrix one owner device. At the end it
checks that the model learned (see ``checks``); if not, it prints a
``FAILED checks:`` line (stderr) and exits with status 1.

    python examples/train_linen.py                # < 2 min on 2 cores
    python examples/train_linen.py --steps 50 --mesh 1x8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument('--steps', type=int, default=200, help='training steps')
  p.add_argument(
    '--batch',
    type=int,
    default=32,
    help='sequences per step (divisible by the device count)',
  )
  p.add_argument('--seq', type=int, default=64, help='bytes per sequence')
  p.add_argument('--width', type=int, default=128, help='model width')
  p.add_argument('--heads', type=int, default=4, help='attention heads')
  p.add_argument(
    '--mesh', default='2x4', help='replicate x shard, e.g. 2x4, 1x8, 8x1'
  )
  p.add_argument(
    '--log-every',
    type=int,
    default=20,
    help='steps between printed losses (mean over the window)',
  )
  p.add_argument(
    '--data-bytes',
    type=int,
    default=2_000_000,
    help='bytes of standard-library source to read (train + validation)',
  )
  p.add_argument(
    '--seed', type=int, default=0, help='initialization and data order'
  )
  return p.parse_args(argv)


def checks(losses, train_loss, val_loss, floor):
  """``(text, ok)`` pairs: the run learned the data.

  Measured with the default flags (``python examples/train_linen.py``, 200
  steps) on a 2-core CPU VM: step-1 loss 5.99, final train loss 1.80, val
  loss 1.93 against a context-free floor of 3.09 nats (margin 1.16); the
  shortened run of tests/gpu_and_linen_examples_test.py (30 steps, width
  64): val loss 2.50 against a floor of 3.02 (margin 0.52). After 2 steps
  (val loss 4.82) the floor check fails.
  """
  yes_no = lambda ok: 'yes' if ok else 'no'
  finite = all(math.isfinite(v) for v in losses + [val_loss])
  # Any decrease: the first window (step 1) is the initialization's loss.
  learns = finite and train_loss < losses[0]
  # The floor is the entropy of the validation targets' byte frequencies:
  # the lowest loss any predictor that ignores the context can reach on
  # that sample. Below it, the model uses the context.
  uses_context = val_loss < floor
  return [
    (
      f'train loss {train_loss:.4f} < step-1 loss {losses[0]:.4f}, all '
      f'finite: {yes_no(learns)}',
      learns,
    ),
    (
      f'val loss {val_loss:.4f} < context-free floor {floor:.4f} (entropy '
      f'of the validation bytes): {yes_no(uses_context)}',
      uses_context,
    ),
  ]


def main(argv=None):  # pylint: disable=too-many-locals
  args = parse_args(argv)
  r, s = (int(v) for v in args.mesh.lower().split('x'))
  import jax  # pylint: disable=g-import-not-at-top

  # Before anything touches the devices.
  jax.config.update('jax_num_cpu_devices', r * s)
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    heads: int

    @nn.compact
    def __call__(self, x):
      b, t, d = x.shape
      dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)
      y = nn.LayerNorm(name='norm1')(x)
      q, k, v = (dense(d, n)(y).reshape(b, t, self.heads, -1) for n in 'qkv')
      att = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(d // self.heads)
      att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
      y = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(att), v)
      x = x + dense(d, 'o')(y.reshape(b, t, d))
      y = nn.LayerNorm(name='norm2')(x)
      return x + dense(d, 'down')(nn.gelu(dense(4 * d, 'up')(y)))

  class ByteTransformer(nn.Module):
    """Embedding (+ learned positions), two blocks, final norm, head."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, tokens):
      t = tokens.shape[1]
      x = nn.Embed(256, self.width, name='embed')(tokens)
      x = (
        x
        + self.param(
          'pos_embed', nn.initializers.normal(0.02), (args.seq, self.width)
        )[:t]
      )
      for i in range(2):
        x = Block(self.heads, name=f'layers_{i}')(x)
      x = nn.LayerNorm(name='final_norm')(x)
      return nn.Dense(256, use_bias=False, name='head')(x)

  mesh = jax.make_mesh(
    (r, s), ('replicate', 'shard'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  # The same data as train_lm.py (this directory is on sys.path when the
  # script runs).
  from train_lm import load_stdlib_text  # pylint: disable=g-import-not-at-top

  train, val = load_stdlib_text(args.data_bytes, args.seed)
  print(
    f'data: {len(train):,} train bytes, {len(val):,} validation bytes; '
    f'mesh {r}x{s} ({jax.device_count()} devices)',
    flush=True,
  )

  data_sharding = NamedSharding(mesh, P(('replicate', 'shard')))

  def get_batch(data, step, batch):
    """``batch`` random windows of ``seq + 1`` bytes, sharded by row."""
    rng = np.random.default_rng((args.seed, step))
    starts = rng.integers(0, len(data) - args.seq - 1, batch)
    idx = starts[:, None] + np.arange(args.seq + 1)
    return jax.device_put(data[idx].astype(np.int32), data_sharding)

  model = ByteTransformer(args.width, args.heads)
  params = model.init(
    jax.random.key(args.seed), jnp.zeros((1, args.seq), jnp.int32)
  )['params']
  # Replicated params, placed before the optimizer's init (inside create).
  params = jax.device_put(params, NamedSharding(mesh, P()))
  tx = dmuon_jax.dmuon(0.02, adam_learning_rate=3e-3, mesh=mesh)
  with jax.set_mesh(mesh):  # the optimizer's counters on the mesh too
    state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx
    )
    # create() starts `step` as the Python int 0: an array instead keeps
    # the second call of train_step from compiling it again.
    state = state.replace(step=jnp.zeros((), jnp.int32))
  labels = jax.tree.leaves(dmuon_jax.muon_labels(params))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f'model: {n_params:,} params, {labels.count("muon")} Muon matrices, '
    f'{labels.count("adam")} AdamW leaves',
    flush=True,
  )

  def loss_fn(params, apply_fn, batch):
    logits = apply_fn({'params': params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[:, 1:]
    ).mean()

  @jax.jit
  def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(
      state.params, state.apply_fn, batch
    )
    return state.apply_gradients(grads=grads), loss

  @jax.jit
  def eval_step(state, batch):
    return loss_fn(state.params, state.apply_fn, batch)

  val_batch = get_batch(val, 10**9, 256)  # a fixed validation sample
  start, losses = time.perf_counter(), []
  for step in range(args.steps):
    state, loss = train_step(state, get_batch(train, step, args.batch))
    losses.append(float(loss))
    if (step + 1) % args.log_every == 0 or step == 0:
      window = losses[-args.log_every :]
      print(
        f'step {step + 1:5d}  loss {np.mean(window):.4f}  '
        f'({time.perf_counter() - start:.1f} s)',
        flush=True,
      )
  train_loss = float(np.mean(losses[-args.log_every :]))
  val_loss = float(eval_step(state, val_batch))
  print(
    f'final: train loss {train_loss:.4f}  val loss {val_loss:.4f}  '
    f'({args.steps} steps, {time.perf_counter() - start:.1f} s)'
  )
  targets = np.asarray(val_batch)[:, 1:].ravel()
  freq = np.bincount(targets, minlength=256) / targets.size
  floor = float(-np.sum(freq[freq > 0] * np.log(freq[freq > 0])))
  check_list = checks(losses, train_loss, val_loss, floor)
  print('checks: ' + '; '.join(t for t, _ in check_list))
  failed = [t for t, ok in check_list if not ok]
  if failed:
    print('FAILED checks: ' + '; '.join(failed), file=sys.stderr)
    sys.exit(1)
  return train_loss, val_loss


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  main()
