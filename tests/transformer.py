"""A small Flax Linen transformer (Python loop or nn.scan over blocks)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
      stack = nn.scan(ScanBlock, variable_axes={'params': 0},
                      split_rngs={'params': True}, length=DEPTH)
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
      jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


def predicate(path, leaf):
  """Muon targets: the blocks' kernels (2-D, or stacked ``(L, m, n)``)."""
  return 'layers' in path and path.endswith('kernel')


def tokens(batch=32):
  return jax.random.randint(jax.random.key(1), (batch, SEQ), 0, VOCAB)
