"""Dedicated DMuon with a Flax Linen transformer: the train-step recipe.

The model is ordinary Linen (a Python loop of ``layers_i`` blocks, or an
``nn.scan``-ed ``layers`` stack). For dedicated training the forward pass
runs each block through ``Dedication.block`` / ``sequential`` / ``scan``,
which gather the block's Muon matrices from their owners just before it
runs (and again in the backward pass with Z3).

    python examples/dedicated_linen.py [--steps 20] [--scan] [--z2]
        [--mesh 2,4] [--layers-per-gather 2]

Runs on 8 simulated CPU devices.
"""

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax

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


def predicate(path, leaf):
  """Muon targets: the blocks' kernels (2-D, or stacked ``(L, m, n)``)."""
  return 'layers' in path and path.endswith('kernel')


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
    elif ded.layers_per_gather > 1:  # one gather per group of blocks
      x = ded.sequential(apply, [f'params/layers_{i}' for i in range(DEPTH)])(
        dp, x
      )
    else:
      for i in range(DEPTH):
        x = ded.block(apply, f'params/layers_{i}')(dp, x)
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
    predicate=predicate,
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


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--scan', action='store_true')
  parser.add_argument('--z2', action='store_true')
  parser.add_argument('--mesh', default='2,4')
  parser.add_argument('--layers-per-gather', type=int, default=1)
  args = parser.parse_args()
  jax.config.update('jax_num_cpu_devices', 8)
  main(
    args.steps,
    args.scan,
    not args.z2,
    tuple(int(v) for v in args.mesh.split(',')),
    args.layers_per_gather,
  )
