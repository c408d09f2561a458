"""Equinox models: a filtered model trains as with ``optax.contrib.muon``.

An ``eqx.Module`` holds arrays and other leaves (here an activation
function). ``optax`` takes the arrays only (``eqx.filter(model,
eqx.is_array)``); given the whole model, dmuon names the leaf that is not an
array and the filter. A dimension-numbers tree made from the params is an
``eqx.Module`` too, callable when the model is: it is read as a tree. An
FSDP trainer's checkpoint saved on 8 devices goes on on 4.
"""

import functools
import math
import re
import tempfile
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from absl.testing import absltest, parameterized
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax
from dmuon_jax import checkpoint
from tests import support

# Compile-heavy: the README command runs these, the inner loop
# (-m 'not slow') does not (tests/conftest.py).
SLOW_CASES = (
  r'^RestoreOnFourDevicesTest::test_restore_onto_4_devices_matches_optax_muon$',
  r'^TrainTest::test_matches_optax_muon_mesh_2x4$',
)

D, HEADS, HEAD_DIM, HIDDEN, VOCAB = 16, 2, 8, 32, 32
BATCH, SEQ = 8, 8
LR = 0.02
STEPS = 3
NOT_AN_ARRAY = r"dmuon: param 'blocks/0/act' is a function 'gelu', not an array"
FILTERED = r'eqx\.filter\(model, eqx\.is_array\)'


class Attention(eqx.Module):
  """Causal self-attention with 3-D projections, as many JAX LLMs store
  them: ``wq``/``wk``/``wv`` ``(d_model, heads, head_dim)``, ``wo``
  ``(heads, head_dim, d_model)``."""

  wq: jax.Array
  wk: jax.Array
  wv: jax.Array
  wo: jax.Array

  def __init__(self, key):
    kq, kk, kv, ko = jax.random.split(key, 4)
    qkv = lambda k: jax.random.normal(k, (D, HEADS, HEAD_DIM)) / math.sqrt(D)
    self.wq, self.wk, self.wv = qkv(kq), qkv(kk), qkv(kv)
    self.wo = jax.random.normal(ko, (HEADS, HEAD_DIM, D)) / math.sqrt(D)

  def __call__(self, x):  # x: (seq, d_model)
    q, k, v = (
      jnp.einsum('sd,dhk->hsk', x, w) for w in (self.wq, self.wk, self.wv)
    )
    causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    logits = jnp.where(causal, q @ k.swapaxes(1, 2) / math.sqrt(HEAD_DIM), -1e9)
    out = jax.nn.softmax(logits) @ v
    return jnp.einsum('hsk,hkd->sd', out, self.wo)


class Block(eqx.Module):
  norm: eqx.nn.LayerNorm
  attn: Attention
  up: eqx.nn.Linear
  down: eqx.nn.Linear
  act: Callable  # a leaf that is not an array

  def __init__(self, key):
    ka, ku, kd = jax.random.split(key, 3)
    self.norm = eqx.nn.LayerNorm(D)
    self.attn = Attention(ka)
    self.up = eqx.nn.Linear(D, HIDDEN, key=ku)
    self.down = eqx.nn.Linear(HIDDEN, D, use_bias=False, key=kd)
    self.act = jax.nn.gelu

  def __call__(self, x):
    x = x + self.attn(jax.vmap(self.norm)(x))
    return x + jax.vmap(self.down)(self.act(jax.vmap(self.up)(x)))


class Model(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: tuple[Block, ...]
  head: eqx.nn.Linear  # no bias: a field that is None

  def __init__(self, key):
    ke, kh, *kb = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=ke)
    self.blocks = tuple(Block(k) for k in kb)
    self.head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=kh)

  def __call__(self, tokens):  # tokens: (seq,)
    x = jax.vmap(self.embed)(tokens)
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(x)


def loss_fn(model, tokens):
  logits = jax.vmap(model)(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def muon_dims(params):
  """Dimension numbers of the Muon leaves (None: AdamW). ``eqx.nn.Linear``
  stores ``(out, in)``: reduction axis 1. The result is a ``Model``."""

  def one(path, label):
    name = path[-1].name
    if name in ('wq', 'wk', 'wv'):  # d_model -> heads * head_dim
      return MDN(reduction_axis=0, output_axis=(1, 2))
    if name == 'wo':  # heads * head_dim -> d_model
      return MDN(reduction_axis=(0, 1), output_axis=2)
    return MDN(reduction_axis=1, output_axis=0) if label == 'muon' else None

  return jax.tree_util.tree_map_with_path(one, dmuon_jax.muon_labels(params))


@functools.cache
def setup():
  """The model, its array leaves and dimension numbers, and a batch."""
  model = Model(jax.random.key(0))
  params = eqx.filter(model, eqx.is_array)
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
  return model, params, muon_dims(params), tokens


def make_step(opt):
  """An Equinox train step: ``eqx.filter_jit``, ``filter_value_and_grad``."""

  @eqx.filter_jit
  def step(model, state, tokens):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
    params = eqx.filter(model, eqx.is_array)
    updates, state = opt.update(grads, state, params)
    return eqx.apply_updates(model, updates), state, loss

  return step


def run_steps(step, model, state, tokens, steps):
  """``steps`` calls of ``step``: the model, the state and the losses."""
  losses = []
  for _ in range(steps):
    model, state, loss = step(model, state, tokens)
    losses.append(float(loss))
  return model, state, losses


def train(opt, model, tokens, steps=STEPS):
  """An Equinox training loop (:func:`make_step`) from ``opt.init``.

  Returns the final model's arrays (on the host) and the losses.
  """
  state = opt.init(eqx.filter(model, eqx.is_array))
  model, _, losses = run_steps(make_step(opt), model, state, tokens, steps)
  return jax.device_get(eqx.filter(model, eqx.is_array)), losses


@functools.cache
def optax_reference_history():
  """``optax.contrib.muon`` on one device, with the same routing, for
  ``2 * STEPS`` steps: the arrays after each step (on the host) and the
  losses. optax calls a callable ``muon_weight_dimension_numbers`` (so it
  would call the ``Model`` of dimension numbers): a function returns it."""
  model, _, dims, tokens = setup()
  opt = optax.contrib.muon(LR, muon_weight_dimension_numbers=lambda _: dims)
  step, state = make_step(opt), opt.init(eqx.filter(model, eqx.is_array))
  history, losses = [], []
  for _ in range(2 * STEPS):
    model, state, loss = step(model, state, tokens)
    history.append(jax.device_get(eqx.filter(model, eqx.is_array)))
    losses.append(float(loss))
  return history, losses


def optax_reference(steps=STEPS):
  """``(arrays, losses)`` after ``steps`` (<= 2 * STEPS) of the reference."""
  history, losses = optax_reference_history()
  return history[steps - 1], losses[:steps]


class NotArraysTest(absltest.TestCase):
  """An unfiltered model: the error names the leaf and ``eqx.filter``."""

  def test_init_names_the_leaf(self):
    model, *_ = setup()
    mesh = support.make_mesh((2, 4), kind=AxisType.Auto)
    opt = dmuon_jax.dmuon(LR, mesh=mesh)
    with self.assertRaisesRegex(
      TypeError, rf'{NOT_AN_ARRAY}.*opt\.init\({FILTERED}\)'
    ):
      opt.init(model)
    with self.assertRaisesRegex(TypeError, NOT_AN_ARRAY):
      eqx.filter_jit(opt.init)(model)

  def test_update_names_the_leaf(self):
    model, params, *_ = setup()
    opt = dmuon_jax.dmuon(LR)
    state = opt.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    with self.assertRaisesRegex(
      TypeError, rf'{NOT_AN_ARRAY}.*opt\.update\(grads, state, {FILTERED}\)'
    ):
      opt.update(grads, state, model)

  def test_scale_by_dmuon_init_names_the_leaf(self):
    # scale_by_dmuon takes Muon leaves only: a matrix and the function.
    tree = {'w': jnp.ones((8, 8)), 'act': jax.nn.gelu}
    with self.assertRaisesRegex(TypeError, r"dmuon: param 'act' is a function"):
      dmuon_jax.scale_by_dmuon().init(tree)


class DimsTreeTest(parameterized.TestCase):
  """A dimension-numbers tree that is a (callable) ``eqx.Module``."""

  def test_callable_dims_tree_is_a_tree(self):
    _, params, dims, _ = setup()
    self.assertTrue(callable(dims))
    labels = dmuon_jax.muon_labels(params, muon_weight_dimension_numbers=dims)
    attn, mlp = labels.blocks[1].attn, labels.blocks[1].up
    self.assertEqual(
      (attn.wq, attn.wo, mlp.weight, mlp.bias), ('muon',) * 3 + ('adam',)
    )
    self.assertIsNone(labels.head.bias)  # None stays None
    plan = dmuon_jax.plan_ownership(params, None, weight_dimension_numbers=dims)
    wo = next(s for s in plan.leaves if s.path == 'blocks/0/attn/wo')
    self.assertEqual((wo.reduction_axes, wo.output_axes), ((0, 1), (2,)))
    # A function of the params is still called.
    same = dmuon_jax.muon_labels(
      params, muon_weight_dimension_numbers=muon_dims
    )
    self.assertEqual(jax.tree.leaves(same), jax.tree.leaves(labels))

  @parameterized.named_parameters(
    ('wo', 'wo', (2, 8, 16), 'an attention output projection'),
    ('wq', 'wq', (16, 2, 8), 'an input projection'),
  )
  def test_rank_3_without_dims_lists_the_readings(self, name, shape, hint):
    _, params, *_ = setup()
    # The three readings, then the one the name suggests.
    stack = r'MuonDimensionNumbers\(reduction_axis=1, output_axis=2\)'
    flat = r'MuonDimensionNumbers\(reduction_axis=0, output_axis=\(1, 2\)\)'
    out = r'MuonDimensionNumbers\(reduction_axis=\(0, 1\), output_axis=2\)'
    suggested = out if name == 'wo' else flat
    with self.assertRaisesRegex(
      ValueError,
      rf"'blocks/0/attn/{name}' has shape {re.escape(str(shape))} .*"
      rf'{stack}.*{flat}.*{out}\. The name {name!r} suggests {hint}.*'
      rf'{suggested} \(if it is one\)',
    ):
      dmuon_jax.muon_labels(
        params, predicate=lambda path, x: path.endswith(name)
      )


class TrainTest(parameterized.TestCase):
  """``eqx.filter_jit`` steps of dmuon equal ``optax.contrib.muon``'s."""

  @parameterized.named_parameters(('one_device', None), ('mesh_2x4', (2, 4)))
  def test_matches_optax_muon(self, shape):
    model, params, dims, tokens = setup()
    mesh = None
    if shape is not None:
      mesh = support.make_mesh(shape, kind=AxisType.Auto)
      # FSDP: each array sharded over 'shard' along a dimension it divides.
      placed = jax.device_put(params, support.fsdp_shardings(params, mesh))
      model = eqx.combine(placed, model)
      tokens = jax.device_put(tokens, NamedSharding(mesh, P(support.AXES)))
    opt = dmuon_jax.dmuon(LR, mesh=mesh, muon_weight_dimension_numbers=dims)
    got, losses = train(opt, model, tokens)
    want, want_losses = optax_reference()
    self.assertLess(losses[-1], losses[0])
    self.assertLess(max(abs(a - b) for a, b in zip(losses, want_losses)), 1e-5)
    support.assert_trees_rel_close(self, got, want, rtol=1e-5)


class RestoreOnFourDevicesTest(absltest.TestCase):
  """An FSDP trainer saved on 8 devices goes on from its checkpoint on 4."""

  def test_restore_onto_4_devices_matches_optax_muon(self):
    model, params, dims, tokens = setup()
    # 3 steps on 8 devices, FSDP over 'shard' as in TrainTest.
    mesh8 = support.make_mesh((2, 4), kind=AxisType.Auto)
    opt8 = dmuon_jax.dmuon(LR, mesh=mesh8, muon_weight_dimension_numbers=dims)
    model8 = eqx.filter_shard(model, support.fsdp_shardings(params, mesh8))
    params8 = eqx.filter(model8, eqx.is_array)
    tokens8 = jax.device_put(tokens, NamedSharding(mesh8, P(support.AXES)))
    model8, state8, losses = run_steps(
      make_step(opt8), model8, opt8.init(params8), tokens8, STEPS
    )
    # The restarted run: 4 devices, params_like ShapeDtypeStructs sharded
    # over 'batch', the optimizer on that mesh.
    mesh4 = support.make_mesh((4,), ('batch',), kind=AxisType.Auto)
    opt4 = dmuon_jax.dmuon(LR, mesh=mesh4, muon_weight_dimension_numbers=dims)
    shardings4 = support.fsdp_shardings(params, mesh4, ('batch',))
    params_like = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      params,
      shardings4,
    )
    with warnings.catch_warnings():
      # A layout that lost params_like's shardings warns at the update.
      warnings.simplefilter('error', dmuon_jax.DMuonWarning)
      with tempfile.TemporaryDirectory() as directory:
        checkpoint.save(
          directory, STEPS, eqx.filter(model8, eqx.is_array), state8, opt=opt8
        )
        step, params4, state4 = checkpoint.restore(directory, params_like, opt4)
      self.assertEqual(step, STEPS)
      self.assertEqual(jax.tree.map(lambda x: x.sharding, params4), shardings4)
      (restored,) = dmuon_jax.owner_layouts(state4)
      (fresh,) = dmuon_jax.owner_layouts(opt4.init(params4))
      # param_entries is compared on its own too: it may leave ==.
      self.assertEqual(restored.param_entries, fresh.param_entries)
      self.assertEqual(restored, fresh)
      self.assertEqual(restored.collective_bytes(), fresh.collective_bytes())
      # 3 more steps there.
      model4 = eqx.combine(params4, model)
      tokens4 = jax.device_put(tokens, NamedSharding(mesh4, P('batch')))
      model4, _, more = run_steps(
        make_step(opt4), model4, state4, tokens4, STEPS
      )
    want, want_losses = optax_reference(2 * STEPS)
    got_losses = losses + more
    self.assertLess(
      max(abs(a - b) for a, b in zip(got_losses, want_losses)), 1e-5
    )
    support.assert_trees_rel_close(
      self,
      jax.device_get(eqx.filter(model4, eqx.is_array)),
      want,
      support.OPTAX_F32_RTOL,
    )


if __name__ == '__main__':
  absltest.main()
