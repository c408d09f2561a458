"""Dedicated DMuon (Z3) with a Flax NNX transformer: the train-step recipe.

Muon matrices live only on their owner devices; each block's matrices are
gathered just before the block runs (and again in the backward pass, Z3),
gradients are reduce-scattered straight to the owners, and the optimizer
update runs Newton–Schulz with no communication.

    python examples/dedicated_nnx.py [--steps 20] [--scan]

Runs on 8 simulated CPU devices (mesh 2x4: HSDP). ``--scan`` stacks the
blocks (``nnx.vmap``-created, run with ``Dedication.scan``) instead of a
Python loop over ``nnx.List``. Run as a script, it then checks that the
model trained (``checks``): if not, it prints a ``FAILED checks:`` line
(stderr) and exits with status 1.
"""

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import MuonDimensionNumbers

VOCAB, WIDTH, HEADS, DEPTH, SEQ = 64, 32, 4, 4, 16
AXES = ('replicate', 'shard')


class Block(nnx.Module):
  """Pre-norm causal attention + MLP; every matrix a 2-D ``nnx.Linear``."""

  def __init__(self, rngs: nnx.Rngs):
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
    self.norm1 = nnx.LayerNorm(WIDTH, use_bias=False, rngs=rngs)
    self.q, self.k, self.v, self.o = (dense(WIDTH, WIDTH) for _ in range(4))
    self.norm2 = nnx.LayerNorm(WIDTH, use_bias=False, rngs=rngs)
    self.up, self.down = dense(WIDTH, 2 * WIDTH), dense(2 * WIDTH, WIDTH)

  def __call__(self, x):
    b, t, d = x.shape
    y = self.norm1(x)
    q, k, v = (f(y).reshape(b, t, HEADS, -1) for f in (self.q, self.k, self.v))
    att = jnp.einsum('bqhd,bkhd->bhqk', q, k) / (d // HEADS) ** 0.5
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(att), v)
    x = x + self.o(y.reshape(b, t, d))
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Model(nnx.Module):
  """Embedding, ``DEPTH`` blocks (a list, or one stacked module), head."""

  def __init__(self, rngs: nnx.Rngs, scan: bool = False):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    if scan:
      self.layers = nnx.vmap(Block, in_axes=None, axis_size=DEPTH)(rngs)
    else:
      self.layers = nnx.List([Block(rngs) for _ in range(DEPTH)])
    self.norm = nnx.LayerNorm(WIDTH, use_bias=False, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)
    self.scan = scan

  def __call__(self, tokens):  # single-device reference forward
    x = self.embed(tokens)
    if self.scan:
      x = nnx.scan(lambda x, block: (block(x), None), in_axes=(nnx.Carry, 0))(
        x, self.layers
      )[0]
    else:
      for block in self.layers:
        x = block(x)
    return self.head(self.norm(x))


def cross_entropy(logits, tokens):
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def make_tokens():
  """A fixed batch of random tokens (the recipe's stand-in for data)."""
  return jax.random.randint(jax.random.key(1), (32, SEQ), 0, VOCAB)


def muon_dims(scan: bool):
  """Muon targets: the default routing, or (scanned model) the stacked
  block kernels ``(L, m, n)`` by dimension numbers: L matrices each."""
  if not scan:
    return None

  def one(path, leaf):
    names = [str(getattr(k, 'key', k)) for k in path]
    if names[-1] != 'kernel' or 'layers' not in names:
      return None
    return MuonDimensionNumbers(leaf.ndim - 2, leaf.ndim - 1)

  return lambda params: jax.tree_util.tree_map_with_path(one, params)


def main(
  steps: int = 20,
  scan: bool = False,
  z3: bool = True,
  mesh_shape: tuple[int, int] = (2, 4),
) -> tuple[list[float], Model]:
  """Trains with dedicated DMuon; returns the losses and the trained model."""
  mesh = jax.make_mesh(mesh_shape, AXES)
  model = Model(nnx.Rngs(0), scan=scan)
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)  # {'layers': {0: {'up': ...}}, ...}
  block_def = nnx.graphdef(Block(nnx.Rngs(0)))

  # 1. Plan: who owns each matrix; blocks 'layers/0'.. (or the 'layers'
  #    stack) are the hook boundaries. The stacked kernels of a scanned
  #    model are 3-D: dimension numbers say they are stacks of matrices.
  ded = dmuon_jax.dedicate(
    params,
    mesh,
    muon_weight_dimension_numbers=muon_dims(scan),
    reshard_after_forward=z3,
  )
  dp = ded.to_dedicated(jax.device_put(params, NamedSharding(mesh, P())))
  opt = dmuon_jax.dedicated_muon(ded, learning_rate=0.005)
  opt_state = opt.init(dp)

  def run_block(block_params, x):  # one block, weights materialized
    return nnx.merge(block_def, block_params)(x)

  def loss_fn(dp, tokens):
    rest = ded.gather_rest(dp)  # embedding, norm, head
    x = jnp.take(rest['embed']['embedding'], tokens, axis=0)
    if scan:
      x = ded.scan(run_block, 'layers')(dp, x)
    else:
      x = ded.sequential(run_block, [f'layers/{i}' for i in range(DEPTH)])(
        dp, x
      )
    x = nnx.merge(nnx.graphdef(model.norm), rest['norm'])(x)
    return cross_entropy(x @ rest['head']['kernel'], tokens)

  # 2. The train step: shard_map over the mesh, per-device gradients.
  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(ded.specs(), ded.specs_of(opt_state), P(AXES)),
    out_specs=(ded.specs(), ded.specs_of(opt_state), P()),
  )
  def train_step(dp, opt_state, tokens):
    loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(dp, tokens)
    updates, opt_state = opt.update(grads, opt_state, dp)
    return (
      optax.apply_updates(dp, updates),
      opt_state,
      jax.lax.pmean(loss, AXES),
    )

  tokens = jax.device_put(make_tokens(), NamedSharding(mesh, P(AXES)))
  losses = []
  for step in range(steps):
    dp, opt_state, loss = train_step(dp, opt_state, tokens)
    losses.append(float(loss))
    print(f'step {step:3d}  loss {losses[-1]:.4f}')

  # 3. Back to an ordinary NNX model (evaluation, export, checkpoints).
  nnx.replace_by_pure_dict(state, ded.to_params(dp))
  model = nnx.merge(graphdef, jax.device_get(state))
  print(ded.summary().splitlines()[0])
  return losses, model


def context_free_floor(tokens) -> float:
  """The entropy of the targets' token frequencies: the lowest loss any
  predictor that ignores the context can reach on this batch."""
  targets = np.asarray(tokens)[:, 1:].ravel()
  freq = np.bincount(targets, minlength=VOCAB) / targets.size
  return float(-np.sum(freq[freq > 0] * np.log(freq[freq > 0])))


def checks(losses: list[float], model: Model) -> list[tuple[str, bool]]:
  """``(text, ok)`` pairs: dedicated DMuon trained the model.

  Measured with the defaults (``python examples/dedicated_nnx.py``, 20
  steps, Z3, mesh 2x4) on a 2-core CPU VM: the loss falls from 4.634 to
  2.488; the trained model, evaluated by the ordinary NNX forward on one
  device, is at 2.396 against a context-free floor of 4.089 nats
  (``--scan``: 4.775 -> 2.990, model 2.914; ``--z2``: as Z3). Below the
  floor the model uses the context: it memorizes the fixed batch, which is
  what 20 steps can show. With ``--steps 1`` both checks fail.
  """
  yes_no = lambda ok: 'yes' if ok else 'no'
  tokens = make_tokens()
  final = float(cross_entropy(model(tokens), tokens))
  floor = context_free_floor(tokens)
  falls = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
  below = final < floor
  return [
    (
      f'loss falls ({losses[0]:.4f} -> {losses[-1]:.4f}), all finite: '
      f'{yes_no(falls)}',
      falls,
    ),
    (
      f'trained NNX model loss {final:.4f} < context-free floor '
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
    help='stacked blocks (nnx.vmap, Dedication.scan) instead of nnx.List',
  )
  parser.add_argument(
    '--z2',
    action='store_true',
    help='keep gathered weights (reshard_after_forward=False)',
  )
  args = parser.parse_args()
  jax.config.update('jax_num_cpu_devices', 8)
  losses, model = main(args.steps, args.scan, not args.z2)
  check_list = checks(losses, model)
  print('checks: ' + '; '.join(t for t, _ in check_list))
  failed = [t for t, ok in check_list if not ok]
  if failed:
    print('FAILED checks: ' + '; '.join(failed), file=sys.stderr)
    sys.exit(1)
