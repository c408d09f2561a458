"""Dedicated DMuon with a Flax Linen transformer: the train-step recipe.

The model is ordinary Linen (a Python loop of ``layers_i`` blocks, or an
``nn.scan``-ed ``layers`` stack). For dedicated training the forward pass
runs each block through ``Dedication.block`` / ``sequential`` / ``scan``,
which gather the block's Muon matrices from their owners just before it
runs (and again in the backward pass with Z3).

    python examples/dedicated_linen.py [--steps 20] [--scan] [--z2]
        [--mesh 2,4] [--layers-per-gather 2]

Runs on 8 simulated CPU devices. Run as a script, it then checks that the
model trained (``checks``): if not, it prints a ``FAILED checks:`` line
(stderr) and exits with status 1.
"""

import argparse
import functools
import math
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import MuonDimensionNumbers

AXES = ('replicate', 'shard')

VOCAB, WIDTH, HEADS, DEPTH, SEQ = 64, 32, 4, 4, 16


class Block(nn.Module):
  """Pre-norm attention + MLP block."""

  width: int = WIDTH
  heads: int = HEADS

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)
    y = nn.LayerNorm(use_bias=False, name='norm1')(x)
    q, k, v = (dense(d, n)(y).reshape(b, t, self.heads, -1) for n in 'qkv')
    att = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(d // self.heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(att), v)
    x = x + dense(d, 'o')(y.reshape(b, t, d))
    y = nn.LayerNorm(use_bias=False, name='norm2')(x)
    return x + dense(d, 'down')(nn.gelu(dense(2 * d, 'up')(y)))


class ScanBlock(Block):
  def __call__(self, x, _):
    return super().__call__(x), None


class Transformer(nn.Module):
  """Embedding, ``DEPTH`` blocks (``layers_i``, or ``layers`` scanned), head."""

  scan: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH, name='embed')(tokens)
    if self.scan:
      stack = nn.scan(
        ScanBlock,
        variable_axes={'params': 0},
        split_rngs={'params': True},
        length=DEPTH,
      )
      x, _ = stack(name='layers')(x, None)
    else:
      for i in range(DEPTH):
        x = Block(name=f'layers_{i}')(x)
    x = nn.LayerNorm(use_bias=False, name='norm')(x)
    return nn.Dense(VOCAB, use_bias=False, name='head')(x)


def head(params, x):
  """Final norm and head of :class:`Transformer` (params: ``['params']``)."""
  x = nn.LayerNorm(use_bias=False).apply({'params': params['norm']}, x)
  return x @ params['head']['kernel']


def cross_entropy(logits, tokens):
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def init(scan):
  return Transformer(scan=scan).init(
    jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)
  )


def muon_dims(params):
  """Muon targets by dimension numbers (optax's rule): the blocks' kernels,
  2-D or stacked ``(L, m, n)`` (each of the L matrices its own unit); None
  (AdamW) for the rest."""

  def one(path, leaf):
    names = [str(getattr(k, 'key', k)) for k in path]
    if names[-1] != 'kernel' or not any(n.startswith('layers') for n in names):
      return None
    return MuonDimensionNumbers(leaf.ndim - 2, leaf.ndim - 1)

  return jax.tree_util.tree_map_with_path(one, params)


def tokens(batch=32):
  return jax.random.randint(jax.random.key(1), (batch, SEQ), 0, VOCAB)


def dedicated_loss(ded: dmuon_jax.Dedication, scan: bool):
  """The model's loss on :class:`dmuon_jax.DedicatedParams`."""
  block = Block()
  apply = lambda block_params, x: block.apply({'params': block_params}, x)

  def loss(dp, tokens):
    p = ded.gather_rest(dp)['params']  # embedding, final norm, head
    x = jnp.take(p['embed']['embedding'], tokens, axis=0)
    if scan:
      x = ded.scan(apply, 'params/layers')(dp, x)
    else:  # one gather per group of layers_per_gather blocks
      x = ded.sequential(apply, [f'params/layers_{i}' for i in range(DEPTH)])(
        dp, x
      )
    return cross_entropy(head(p, x), tokens)

  return loss


def make_train_step(
  ded: dmuon_jax.Dedication,
  opt: optax.GradientTransformation,
  opt_state,
  scan: bool,
):
  """The jitted train step: ``shard_map`` over the mesh, DMuon update."""
  specs, state_specs = ded.specs(), ded.specs_of(opt_state)
  loss_fn = dedicated_loss(ded, scan)
  axes = ded.mesh.axis_names

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=ded.mesh,
    in_specs=(specs, state_specs, P(axes)),
    out_specs=(specs, state_specs, P()),
  )
  def train_step(dp, opt_state, tokens):
    loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(dp, tokens)
    updates, opt_state = opt.update(grads, opt_state, dp)
    return (
      optax.apply_updates(dp, updates),
      opt_state,
      jax.lax.pmean(loss, axes),
    )

  return train_step


def fsdp(params, mesh):
  """Places params FSDP-style: the last dim divisible by ``'shard'``."""

  def place(x):
    size = mesh.shape['shard']
    dims = [d for d in range(x.ndim) if x.shape[d] % size == 0]
    spec = [None] * x.ndim
    if dims and size > 1:
      spec[dims[-1]] = 'shard'
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  return jax.tree.map(place, params)


def main(steps=20, scan=False, z3=True, mesh_shape=(2, 4), per_gather=1):
  """Trains with dedicated DMuon; returns the losses and plain params."""
  mesh = jax.make_mesh(mesh_shape, AXES)
  # Non-Muon params (embedding, norms, head) stay FSDP-sharded; Muon
  # matrices move to their owners.
  params = fsdp(init(scan), mesh)
  ded = dmuon_jax.dedicate(
    params,
    mesh,
    muon_weight_dimension_numbers=muon_dims,
    reshard_after_forward=z3,
    layers_per_gather=per_gather,
  )
  print(ded.summary())
  dp = ded.to_dedicated(params)
  opt = dmuon_jax.dedicated_muon(ded, learning_rate=0.005)
  opt_state = opt.init(dp)
  train_step = make_train_step(ded, opt, opt_state, scan)
  batch = jax.device_put(tokens(), NamedSharding(mesh, P(AXES)))
  losses = []
  for step in range(steps):
    dp, opt_state, loss = train_step(dp, opt_state, batch)
    losses.append(float(loss))
    print(f'step {step:3d}  loss {losses[-1]:.4f}')
  # An ordinary Linen params tree again: Transformer(scan).apply(params, x).
  return losses, ded.to_params(dp)


def context_free_floor(tokens) -> float:
  """The entropy of the targets' token frequencies: the lowest loss any
  predictor that ignores the context can reach on this batch."""
  targets = np.asarray(tokens)[:, 1:].ravel()
  freq = np.bincount(targets, minlength=VOCAB) / targets.size
  return float(-np.sum(freq[freq > 0] * np.log(freq[freq > 0])))


def checks(losses, params, scan=False):
  """``(text, ok)`` pairs: dedicated DMuon trained the model.

  Measured with the defaults (``python examples/dedicated_linen.py``, 20
  steps, Z3, mesh 2x4, one layer per gather) on a 2-core CPU VM: the loss
  falls from 4.600 to 2.422; the trained params, run by the ordinary Linen
  ``Transformer.apply`` on one device, reach 2.328 against a context-free
  floor of 4.089 nats (``--scan``: 4.831 -> 2.678, params 2.592; ``--z2``,
  ``--layers-per-gather 2`` and ``--mesh 1,8``: as the default). Below
  the floor the model uses the context: it memorizes the fixed batch,
  which is what 20 steps can show. With ``--steps 1`` both checks fail.
  """
  yes_no = lambda ok: 'yes' if ok else 'no'
  batch = tokens()
  plain = jax.device_get(params)  # host arrays: one device, no mesh
  final = float(
    cross_entropy(Transformer(scan=scan).apply(plain, batch), batch)
  )
  floor = context_free_floor(batch)
  falls = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
  below = final < floor
  return [
    (
      f'loss falls ({losses[0]:.4f} -> {losses[-1]:.4f}), all finite: '
      f'{yes_no(falls)}',
      falls,
    ),
    (
      f'trained Linen params loss {final:.4f} < context-free floor '
      f'{floor:.4f}: {yes_no(below)}',
      below,
    ),
  ]


if __name__ == '__main__':
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument('--steps', type=int, default=20, help='training steps')
  parser.add_argument(
    '--scan',
    action='store_true',
    help='an nn.scan-ed layers stack instead of layers_i blocks',
  )
  parser.add_argument(
    '--z2',
    action='store_true',
    help='keep gathered weights (reshard_after_forward=False)',
  )
  parser.add_argument(
    '--mesh', default='2,4', help='replicate,shard over the 8 devices'
  )
  parser.add_argument(
    '--layers-per-gather',
    type=int,
    default=1,
    help='blocks gathered together (Dedication.sequential)',
  )
  args = parser.parse_args()
  jax.config.update('jax_num_cpu_devices', 8)
  losses, params = main(
    args.steps,
    args.scan,
    not args.z2,
    tuple(int(v) for v in args.mesh.split(',')),
    args.layers_per_gather,
  )
  check_list = checks(losses, params, args.scan)
  print('checks: ' + '; '.join(t for t, _ in check_list))
  failed = [t for t, ok in check_list if not ok]
  if failed:
    print('FAILED checks: ' + '; '.join(failed), file=sys.stderr)
    sys.exit(1)
