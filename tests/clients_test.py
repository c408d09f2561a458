"""Issue 52's client patterns, each dedicated with only the documented lines.

Our own small versions (not copies) of the programs users bring: Flax's
FSDP toy (params on the root module), the NNX MNIST tutorial (attribute
layers, BatchNorm, Dropout, ``MultiMetric``), Flax's scan-over-layers toy
(a ``(model, optimizer, x, y)`` step), Gemma (an Explicit ``(8, 1)`` mesh
and a functional ``nnx.split``/``nnx.merge`` + ``jax.jit`` step), nanodo (a
Linen trainer with an FSDP-boxed embedding tied to the head, per-layer param
metrics inside the step), an NNX GPT on an Auto mesh whose blocks constrain
activations to the batch sharding, and lm1b (Linen blocks named
``encoderdecoderblock_N``).

Each is dedicated with ``dflax.dedicate`` (``dedicate_linen``) and
``dflax.dedicated_muon`` (and ``dflax.train_step`` where the guide makes it
the step's compiler), the model and the step as the client writes them, and
compared with ``optax.contrib.muon`` (AdamW on the other leaves, the
guide's reference) on the same init over ``STEPS`` steps: the Muon leaves
within 1e-5, metrics, ``Rngs`` and BatchNorm statistics as under plain
``nnx.jit``. Each pattern's second test compares the optimizer state's
bytes on device 0: dedicated <= the drop-in ``dmuon_jax.dmuon``'s on the
params as the client places them.

The ``run_*`` functions take ``dedicate``'s keyword arguments and
``train_step``'s ``batch_argnums``, so that the documented workarounds can
be tried on the same programs (the tests use none).
"""

import contextlib
import functools
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx, traverse_util
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
import dmuon_jax.flax as dflax
from dmuon_jax import checkpoint

AXES = ('replicate', 'shard')
LR = 0.02
STEPS = 3
D, F, V = 16, 32, 32  # width, hidden width, vocabulary
BATCH, SEQ = 16, 8
# The guide's comparison: the Muon leaves after STEPS steps.
RTOL, ATOL = 1e-5, 1e-6

# -- shared helpers ---------------------------------------------------------------


def mesh_of(kind, shape=(2, 4), names=AXES):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def dims(params):
  """optax's dimension numbers for dmuon's Muon leaves (the guide's)."""
  return jax.tree.map(
    lambda x: dmuon_jax.MuonDimensionNumbers() if x == 'muon' else None,
    dmuon_jax.muon_labels(params),
  )


def stacked_dims(params):
  """``(L, m, n)`` kernels of an ``nnx.vmap`` stack: L matrices each."""
  return jax.tree.map(
    lambda x: dmuon_jax.MuonDimensionNumbers(1, 2) if x.ndim == 3 else None,
    params,
  )


def optax_muon(dimension_numbers=dims):
  return optax.contrib.muon(LR, muon_weight_dimension_numbers=dimension_numbers)


def flat(tree):
  return {
    '/'.join(map(str, k)): np.asarray(v)
    for k, v in traverse_util.flatten_dict(nn.unbox(tree)).items()
  }


def muon_paths(params, dimension_numbers=dims):
  numbers = traverse_util.flatten_dict(
    dimension_numbers(nn.unbox(params)), keep_empty_nodes=True
  )
  return sorted(
    '/'.join(map(str, k))
    for k, v in numbers.items()
    if isinstance(v, dmuon_jax.MuonDimensionNumbers)
  )


def assert_muon_close(test, got, want, dimension_numbers=dims):
  """The Muon leaves of two plain params trees, within the guide's 1e-5."""
  paths = muon_paths(want, dimension_numbers)
  test.assertNotEqual(paths, [])
  got, want = flat(got), flat(want)
  for path in paths:
    np.testing.assert_allclose(
      got[path], want[path], rtol=RTOL, atol=ATOL, err_msg=path
    )


def bytes_on_device0(tree) -> int:
  """Bytes of a tree's arrays held by device 0 (addressable shards)."""
  device = jax.devices()[0]
  return sum(
    shard.data.nbytes
    for leaf in jax.tree.leaves(tree)
    if isinstance(leaf, jax.Array)
    for shard in leaf.addressable_shards
    if shard.device == device
  )


def nnx_state_bytes(optimizer) -> int:
  return bytes_on_device0(nnx.state(optimizer, nnx.OptState))


def total_bytes(tree) -> int:
  """What a replicated copy of a tree holds on each device."""
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, 'nbytes'))


def plain_params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def nnx_reference(make, step, args, mesh, dimension_numbers=dims):
  """The plain model under ``nnx.jit`` with optax muon, replicated.

  ``make`` runs under ``jax.set_mesh(mesh)`` (sharding metadata needs a
  mesh), then every array is replicated; the step runs on ``mesh``."""
  model = replicated(make, mesh)
  compiled = nnx.jit(step)
  with jax.set_mesh(mesh):
    optimizer = nnx.Optimizer(
      model, optax_muon(dimension_numbers), wrt=nnx.Param
    )
    outs = [compiled(model, optimizer, *args(i)) for i in range(STEPS)]
  return {
    'model': model,
    'outs': outs,
    'bytes': total_bytes(nnx.state(optimizer, nnx.OptState)),
    'opt_state': nnx.as_pure(optimizer.opt_state),
  }


def replicated(make, mesh):
  with jax.set_mesh(mesh):
    model = make()
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, NamedSharding(mesh, P())))
  return model


def nnx_drop_in_bytes(make_placed, mesh, dimension_numbers=None):
  """The drop-in's optimizer state on the params as the client places them."""
  with jax.set_mesh(mesh):
    model = make_placed()
    tx = dmuon_jax.dmuon(
      LR, mesh=mesh, muon_weight_dimension_numbers=dimension_numbers
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx_state_bytes(optimizer)


def nnx_dedicated(make, mesh, **dedicate_kwargs):
  """The guide's first two lines on a model made under the mesh."""
  with jax.set_mesh(mesh):
    model = make()
    ded = dflax.dedicate(model, mesh, **dedicate_kwargs)
    optimizer = nnx.Optimizer(
      model, dflax.dedicated_muon(ded, learning_rate=LR), wrt=nnx.Param
    )
  return ded, model, optimizer


def tokens(seed=0, batch=BATCH, length=SEQ + 1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, V)


def next_token_loss(logits, toks):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, toks[:, 1:]
  ).mean()


@contextlib.contextmanager
def warned_ok():
  """The bytes tests measure; the warnings are the other tests' business
  (e.g. dedicate's 'replicated the AdamW params' one, which gives bytes)."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', dmuon_jax.DMuonWarning)
    yield


@contextlib.contextmanager
def plain_jit_on_auto():
  """A plain ``jit`` step on an Auto mesh warns, as the guide says, that XLA
  all-reduces the Muon gradients (true there: the floors need
  ``train_step``); the client's step is that step, so that warning is let
  through and every other one still fails the test."""
  with warnings.catch_warnings():
    warnings.filterwarnings(
      'ignore',
      message='dmuon: a dedicated model ran under plain jax.jit/nnx.jit',
      category=dmuon_jax.DMuonWarning,
    )
    yield


class BytesMixin:
  """The per-device optimizer state check shared by the patterns."""

  def check_bytes(self, dedicated, drop_in):
    self.assertLessEqual(dedicated, drop_in)


# -- 1. Flax's FSDP toy: params on the root module ----------------------------------


class RootParams(nnx.Module):
  """Matrices and biases as params of the root module, FSDP over 'shard'
  by their sharding metadata."""

  def __init__(self, rngs):
    w = nnx.initializers.lecun_normal()
    self.w1 = nnx.Param(w(rngs.params(), (D, F)), sharding=(None, 'shard'))
    self.b1 = nnx.Param(jnp.zeros((F,)), sharding=('shard',))
    self.w2 = nnx.Param(w(rngs.params(), (F, D)), sharding=('shard', None))
    self.b2 = nnx.Param(jnp.zeros((D,)), sharding=(None,))

  def __call__(self, x):
    return nnx.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def fsdp_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def fsdp_batch(i):
  x = jax.random.normal(jax.random.key(10 + i), (BATCH, D))
  return x, jnp.sin(x)


@functools.cache
def fsdp_reference():
  return nnx_reference(
    lambda: RootParams(nnx.Rngs(0)),
    fsdp_step,
    fsdp_batch,
    mesh_of(AxisType.Auto),
  )


def setup_fsdp(**dedicate_kwargs):
  mesh = mesh_of(AxisType.Auto)
  made = []

  @nnx.jit
  def create():  # the example's jitted init, with the three lines in it
    model = RootParams(nnx.Rngs(0))
    made.append(dflax.dedicate(model, mesh, **dedicate_kwargs))
    tx = dflax.dedicated_muon(made[-1], learning_rate=LR)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  with jax.set_mesh(mesh):
    model, optimizer = create()
  return mesh, made[-1], model, optimizer


def run_fsdp(batch_argnums=None, **dedicate_kwargs):
  mesh, ded, model, optimizer = setup_fsdp(**dedicate_kwargs)
  out = {'ded': ded, 'bytes': nnx_state_bytes(optimizer)}
  step = dflax.train_step(ded, batch_argnums=batch_argnums)(fsdp_step)
  batch = NamedSharding(mesh, P(AXES))
  for i in range(STEPS):
    step(model, optimizer, *jax.device_put(fsdp_batch(i), batch))
  out['params'] = ded.to_params(model)
  return out


class FsdpToyTest(BytesMixin, absltest.TestCase):
  """1: params on the root module, FSDP metadata, init in ``nnx.jit``."""

  def test_matches_optax(self):
    want = plain_params(fsdp_reference()['model'])
    assert_muon_close(self, run_fsdp()['params'], want)

  def test_state_bytes(self):
    drop_in = nnx_drop_in_bytes(
      lambda: RootParams(nnx.Rngs(0)), mesh_of(AxisType.Auto)
    )
    with warned_ok():
      optimizer = setup_fsdp()[-1]
    self.check_bytes(nnx_state_bytes(optimizer), drop_in)


# -- 2. the NNX MNIST tutorial: attribute layers, BatchNorm, Dropout, metrics ----


class Cnn(nnx.Module):
  """Conv, BatchNorm, Dropout, then two attribute layers ``linear1``,
  ``linear2`` (8x8 images, 10 classes)."""

  def __init__(self, rngs):
    # No conv bias: BatchNorm cancels it, so its gradient is rounding
    # noise whose sign AdamW's first steps follow (a biased conv moved the
    # running means 1.5e-4 apart between two float32 programs).
    self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.linear1 = nnx.Linear(4 * 4 * 8, F, rngs=rngs)
    self.linear2 = nnx.Linear(F, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm(self.conv(x)))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def mnist_loss(model, batch):
  logits = model(batch['image'])
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits, batch['label']
  ).mean()
  return loss, logits


def mnist_step(model, optimizer, metrics, batch):
  grad_fn = nnx.value_and_grad(mnist_loss, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])
  optimizer.update(model, grads)


def mnist_metrics():
  return nnx.MultiMetric(
    accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average('loss')
  )


def mnist_batch(i, mesh):
  key = jax.random.key(20 + i)
  batch = {
    'image': jax.random.normal(key, (BATCH, 8, 8, 1)),
    'label': jax.random.randint(key, (BATCH,), 0, 10),
  }
  return jax.device_put(batch, NamedSharding(mesh, P(AXES)))


def mnist_run(model, optimizer, mesh):
  metrics = mnist_metrics()
  step = nnx.jit(mnist_step)
  with jax.set_mesh(mesh):
    for i in range(STEPS):
      step(model, optimizer, metrics, mnist_batch(i, mesh))
  return {
    'metrics': {k: float(v) for k, v in metrics.compute().items()},
    'batch_stats': flat(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))),
    'rngs': flat(nnx.to_pure_dict(nnx.state(model, nnx.RngCount))),
  }


@functools.cache
def mnist_reference():
  mesh = mesh_of(AxisType.Auto)
  model = replicated(lambda: Cnn(nnx.Rngs(0)), mesh)
  with jax.set_mesh(mesh):
    optimizer = nnx.Optimizer(model, optax_muon(), wrt=nnx.Param)
  out = mnist_run(model, optimizer, mesh)
  return {
    **out,
    'params': plain_params(model),
    'bytes': total_bytes(nnx.state(optimizer, nnx.OptState)),
  }


def run_mnist(**dedicate_kwargs):
  mesh = mesh_of(AxisType.Auto)
  ded, model, optimizer = nnx_dedicated(
    lambda: Cnn(nnx.Rngs(0)), mesh, **dedicate_kwargs
  )
  out = {'ded': ded, 'bytes': nnx_state_bytes(optimizer)}
  out.update(mnist_run(model, optimizer, mesh))
  out['params'] = ded.to_params(model)
  return out


class MnistTest(BytesMixin, absltest.TestCase):
  """2: ``linear1``/``linear2`` attributes, BatchNorm, Dropout, a
  ``MultiMetric`` updated in the ``nnx.jit`` step."""

  def test_matches_optax_metrics_rngs_and_batch_stats(self):
    want = mnist_reference()
    with plain_jit_on_auto():
      got = run_mnist()
    assert_muon_close(self, got['params'], want['params'])
    for key, value in want['metrics'].items():
      self.assertAlmostEqual(got['metrics'][key], value, delta=1e-5, msg=key)
    self.assertEqual(got['rngs'].keys(), want['rngs'].keys())
    for key, value in want['rngs'].items():
      np.testing.assert_array_equal(got['rngs'][key], value, err_msg=key)
    for key, value in want['batch_stats'].items():
      np.testing.assert_allclose(
        got['batch_stats'][key], value, rtol=RTOL, atol=ATOL, err_msg=key
      )

  def test_state_bytes(self):
    mesh = mesh_of(AxisType.Auto)
    drop_in = nnx_drop_in_bytes(lambda: Cnn(nnx.Rngs(0)), mesh)
    with warned_ok():
      optimizer = nnx_dedicated(lambda: Cnn(nnx.Rngs(0)), mesh)[-1]
    self.check_bytes(nnx_state_bytes(optimizer), drop_in)


# -- 3. Flax's scan-over-layers toy: an nnx.vmap stack, a (x, y) step --------------


class ScanBlock(nnx.Module):
  def __init__(self, rngs):
    # No bias before the BatchNorm (see Cnn: with one, the two programs'
    # running means ended 1.0e-3 apart, the biases 0.078).
    self.linear = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(D, rngs=rngs)

  def __call__(self, x):
    return nnx.gelu(self.norm(self.linear(x)))


class ScanMlp(nnx.Module):
  def __init__(self, rngs, layers=2):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs):
      return ScanBlock(rngs)

    self.blocks = create_block(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return forward(x, self.blocks)


def scan_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def scan_batch(i):
  x = jax.random.normal(jax.random.key(30 + i), (BATCH, D))
  return x, jnp.tanh(x[:, ::-1])


@functools.cache
def scan_reference():
  out = nnx_reference(
    lambda: ScanMlp(nnx.Rngs(0)),
    scan_step,
    scan_batch,
    mesh_of(AxisType.Auto),
    stacked_dims,
  )
  out['batch_stats'] = flat(
    nnx.to_pure_dict(nnx.state(out['model'], nnx.BatchStat))
  )
  return out


def run_scan(batch_argnums=None, **dedicate_kwargs):
  mesh = mesh_of(AxisType.Auto)
  ded, model, optimizer = nnx_dedicated(
    lambda: ScanMlp(nnx.Rngs(0)),
    mesh,
    muon_weight_dimension_numbers=stacked_dims,
    **dedicate_kwargs,
  )
  out = {'ded': ded, 'bytes': nnx_state_bytes(optimizer)}
  step = dflax.train_step(ded, batch_argnums=batch_argnums)(scan_step)
  batch = NamedSharding(mesh, P(AXES))
  out['losses'] = [
    float(step(model, optimizer, *jax.device_put(scan_batch(i), batch)))
    for i in range(STEPS)
  ]
  out['params'] = ded.to_params(model)
  out['batch_stats'] = flat(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
  out['opt_state'] = nnx.as_pure(optimizer.opt_state)
  return out


class ScanTest(BytesMixin, absltest.TestCase):
  """3: ``nnx.scan`` over an ``nnx.vmap`` stack, ``step(model, optimizer,
  x, y)`` under ``dflax.train_step``."""

  def test_matches_optax_and_batch_stats(self):
    want, got = scan_reference(), run_scan()
    assert_muon_close(
      self, got['params'], plain_params(want['model']), stacked_dims
    )
    np.testing.assert_allclose(
      got['losses'], [float(x) for x in want['outs']], rtol=RTOL
    )
    for key, value in want['batch_stats'].items():
      np.testing.assert_allclose(
        got['batch_stats'][key], value, rtol=RTOL, atol=ATOL, err_msg=key
      )
    # The momentum (each device keeps only what it owns of each layer):
    # optax's in portable form, and back exactly.
    portable = checkpoint.state_to_portable(got['opt_state'])
    is_p = lambda x: isinstance(x, checkpoint.PortableDMuonState)
    (mine,) = [x for x in jax.tree.leaves(portable, is_leaf=is_p) if is_p(x)]
    np.testing.assert_allclose(
      mine.mu['blocks']['linear']['kernel'],
      want['opt_state']
      .inner_states['muon']
      .inner_state[0]
      .mu['blocks']['linear']['kernel'],
      rtol=RTOL,
      atol=ATOL,
    )
    back = checkpoint.state_from_portable(portable, got['opt_state'])
    jax.tree.map(np.testing.assert_array_equal, back, got['opt_state'])

  def test_state_bytes(self):
    # Each scanned layer's one 16 x 16 matrix sits on one of 8 owner slots
    # per iteration: a device's momentum keeps only the layers it owns.
    mesh = mesh_of(AxisType.Auto)
    drop_in = nnx_drop_in_bytes(
      lambda: ScanMlp(nnx.Rngs(0)), mesh, stacked_dims
    )
    with warned_ok():
      optimizer = nnx_dedicated(
        lambda: ScanMlp(nnx.Rngs(0)),
        mesh,
        muon_weight_dimension_numbers=stacked_dims,
      )[-1]
    self.check_bytes(nnx_state_bytes(optimizer), drop_in)


# -- 4. Gemma: an Explicit (8, 1) mesh, a functional split/merge step ------------

GEMMA_AXES = ('fsdp', 'tensor')


class GemmaBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.gate = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(F, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = self.norm(x)
    return x + self.down(nnx.gelu(self.gate(h)) * self.up(h))


class Gemma(nnx.Module):
  """Tied embedding (``attend`` for the logits; its width FSDP over
  ``'fsdp'``, as Gemma's ``emb_vd``), blocks in an ``nnx.List``."""

  def __init__(self, rngs):
    init = nnx.with_partitioning(nnx.initializers.normal(), (None, 'fsdp'))
    self.embedder = nnx.Embed(V, D, embedding_init=init, rngs=rngs)
    self.layers = nnx.List([GemmaBlock(rngs) for _ in range(2)])
    self.final_norm = nnx.RMSNorm(D, rngs=rngs)

  def __call__(self, toks):
    x = self.embedder(toks, out_sharding=P('fsdp'))
    for layer in self.layers:
      x = layer(x)
    return self.embedder.attend(self.final_norm(x))


def gemma_train_step(graphdef, state, toks):
  """Gemma's functional step: merge, ``jax.value_and_grad``, split back."""
  model, optimizer = nnx.merge(graphdef, state)
  model_def, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params):
    logits = nnx.merge(model_def, params, rest)(toks[:, :-1])
    return next_token_loss(logits, toks)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  optimizer.update(model, grads)
  return loss, nnx.state((model, optimizer))


gemma_step = jax.jit(gemma_train_step, static_argnums=0)


def gemma_mesh():
  return mesh_of(AxisType.Explicit, (8, 1), GEMMA_AXES)


def gemma_tokens(i, mesh):
  return jax.device_put(tokens(40 + i), NamedSharding(mesh, P('fsdp')))


def gemma_run(model, optimizer, mesh):
  graphdef, state = nnx.split((model, optimizer))
  losses = []
  with jax.set_mesh(mesh):
    for i in range(STEPS):
      loss, state = gemma_step(graphdef, state, gemma_tokens(i, mesh))
      losses.append(float(loss))
  model, optimizer = nnx.merge(graphdef, state)
  return model, optimizer, losses


@functools.cache
def gemma_reference():
  mesh = gemma_mesh()
  model = replicated(lambda: Gemma(nnx.Rngs(0)), mesh)
  with jax.set_mesh(mesh):
    optimizer = nnx.Optimizer(model, optax_muon(), wrt=nnx.Param)
  model, optimizer, losses = gemma_run(model, optimizer, mesh)
  return {
    'params': plain_params(model),
    'losses': losses,
    'bytes': total_bytes(nnx.state(optimizer, nnx.OptState)),
  }


def run_gemma(**dedicate_kwargs):
  mesh = gemma_mesh()
  ded, model, optimizer = nnx_dedicated(
    lambda: Gemma(nnx.Rngs(0)), mesh, **dedicate_kwargs
  )
  out = {'ded': ded, 'bytes': nnx_state_bytes(optimizer)}
  model, optimizer, out['losses'] = gemma_run(model, optimizer, mesh)
  out['params'] = ded.to_params(model)
  return out


class GemmaTest(BytesMixin, absltest.TestCase):
  """4: Explicit ``(8, 1)`` ``('fsdp', 'tensor')``, a ``jax.jit`` step
  that merges, takes ``jax.value_and_grad`` and splits back."""

  def test_matches_optax(self):
    want, got = gemma_reference(), run_gemma()
    assert_muon_close(self, got['params'], want['params'])
    np.testing.assert_allclose(got['losses'], want['losses'], rtol=RTOL)

  def test_state_bytes(self):
    mesh = gemma_mesh()
    drop_in = nnx_drop_in_bytes(lambda: Gemma(nnx.Rngs(0)), mesh)
    with warned_ok():
      optimizer = nnx_dedicated(lambda: Gemma(nnx.Rngs(0)), mesh)[-1]
    self.check_bytes(nnx_state_bytes(optimizer), drop_in)


# -- Linen trainers (5: nanodo, 7: lm1b) ----------------------------------------------


def boxed(axes):
  return nn.with_partitioning(nn.initializers.lecun_normal(), axes)


def linen_loss_step(state, toks):
  def loss(params):
    return next_token_loss(
      state.apply_fn({'params': params}, toks[:, :-1]), toks
    )

  value, grads = jax.value_and_grad(loss)(state.params)
  return state.apply_gradients(grads=grads), value


def linen_reference(model, boxed_params, step, mesh):
  """Single-device-placed params (unboxed), optax muon, ``jax.jit``."""
  params = nn.unbox(boxed_params)
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_muon()
  )
  compiled = jax.jit(step)
  outs = []
  with jax.set_mesh(mesh):
    for i in range(STEPS):
      state, out = compiled(state, linen_tokens(i, mesh))
      outs.append(jax.tree.map(np.asarray, out))
  return {
    'params': state.params,
    'outs': outs,
    'bytes': total_bytes(state.opt_state),
  }


def linen_tokens(i, mesh):
  return jax.device_put(tokens(50 + i), NamedSharding(mesh, P(AXES)))


def linen_drop_in_bytes(boxed_params, mesh):
  specs = nn.get_partition_spec(boxed_params)
  placed = jax.device_put(  # unboxed outside the mesh: no constraint
    nn.unbox(boxed_params),
    jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs),
  )
  with jax.set_mesh(mesh):
    return bytes_on_device0(dmuon_jax.dmuon(LR, mesh=mesh).init(placed))


def linen_dedicated(model, boxed_params, mesh, **dedicate_kwargs):
  ded, owned = dflax.dedicate_linen(
    model, boxed_params, mesh, **dedicate_kwargs
  )
  state = train_state.TrainState.create(
    apply_fn=ded.apply,
    params=owned,
    tx=dflax.dedicated_muon(ded, learning_rate=LR),
  )
  return ded, state


# -- 5. nanodo: FSDP-boxed embedding/head, per-layer param metrics in the step -----


class NanoBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(use_bias=False)(x)
    h = nn.Dense(F, use_bias=False, kernel_init=boxed(('shard', None)))(h)
    return x + nn.Dense(D, use_bias=False, kernel_init=boxed(('shard', None)))(
      nn.gelu(h)
    )


class NanoModel(nn.Module):
  """Blocks made in ``setup`` as a list (``blocks_0``, ``blocks_1``), the
  FSDP-boxed embedding tied to the head (``attend``)."""

  def setup(self):
    self.embed = nn.Embed(V, D, embedding_init=boxed(('shard', None)))
    self.blocks = [NanoBlock() for _ in range(2)]
    self.out_ln = nn.LayerNorm(use_bias=False)

  def __call__(self, toks):
    x = self.embed(toks)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.out_ln(x))


def layer_metrics(params):
  """Each param's RMS by path, over its boxes (nanodo logs such stats)."""
  metrics = {}
  for path, value in jax.tree_util.tree_leaves_with_path(params):
    name = '/'.join(k.key for k in path if hasattr(k, 'key'))
    per_element = 1.0 / value.size
    metrics[name] = jnp.sqrt(jnp.sum(jnp.square(value)) * per_element)
  return metrics


def nanodo_step(state, toks):
  """nanodo's step: per-layer metrics over the params, then the update
  (dedicated under ``train_step``, ``state.params`` holds the whole
  matrices at the placeholders for the step; the dedicated params also
  hold the owner buffers, whose metrics the reference has not)."""
  metrics = layer_metrics(state.params)
  state, loss = linen_loss_step(state, toks)
  return state, {'loss': loss, **metrics}


def nanodo_init():
  model = NanoModel()
  return model, model.init(jax.random.key(0), tokens()[:, :-1])['params']


@functools.cache
def nanodo_reference():
  model, params = nanodo_init()
  return linen_reference(model, params, nanodo_step, mesh_of(AxisType.Auto))


def run_nanodo(batch_argnums=None, **dedicate_kwargs):
  mesh = mesh_of(AxisType.Auto)
  model, params = nanodo_init()
  with jax.set_mesh(mesh):
    ded, state = linen_dedicated(model, params, mesh, **dedicate_kwargs)
  out = {'ded': ded, 'bytes': bytes_on_device0(state.opt_state), 'outs': []}
  step = dflax.train_step(ded, batch_argnums=batch_argnums)(nanodo_step)
  for i in range(STEPS):
    state, metrics = step(state, linen_tokens(i, mesh))
    out['outs'].append(jax.tree.map(np.asarray, metrics))
  out['params'] = ded.to_params(state.params)
  # (the step read whole matrices; the state keeps its placeholders)
  out['placeholders'] = [
    np.shape(functools.reduce(lambda d, k: d[k], p, state.params))
    for p in ded.placeholder_paths
  ]
  return out


class NanodoTest(BytesMixin, absltest.TestCase):
  """5: a Linen ``TrainState`` trainer on an Auto mesh, FSDP-boxed
  params, per-layer param metrics computed inside the step."""

  def test_matches_optax_and_metrics(self):
    want, got = nanodo_reference(), run_nanodo()
    assert_muon_close(self, got['params'], want['params'])
    self.assertEqual(got['placeholders'], [(0,)] * 4)
    for step, (g, w) in enumerate(zip(got['outs'], want['outs'])):
      for key, value in w.items():
        self.assertIn(key, g)
        np.testing.assert_allclose(
          g[key], value, rtol=RTOL, err_msg=f'step {step}: {key}'
        )

  def test_state_bytes(self):
    mesh = mesh_of(AxisType.Auto)
    model, params = nanodo_init()
    drop_in = linen_drop_in_bytes(params, mesh)
    with warned_ok(), jax.set_mesh(mesh):
      _, state = linen_dedicated(model, params, mesh)
    self.check_bytes(bytes_on_device0(state.opt_state), drop_in)


# -- 6. an NNX GPT on an Auto mesh, activations constrained to the batch -----------


class GptBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.fc = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(F, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    x = jax.lax.with_sharding_constraint(x, P(AXES))
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    scores = jnp.einsum('btd,bsd->bts', q, k) / math.sqrt(D)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + self.proj(jnp.einsum('bts,bsd->btd', att, v))
    x = x + self.out(nnx.gelu(self.fc(self.ln2(x))))
    return jax.lax.with_sharding_constraint(x, P(AXES))


class Gpt(nnx.Module):
  """Embedding and head FSDP over 'shard' (GSPMD style), blocks in a list."""

  def __init__(self, rngs):
    self.wte = nnx.Embed(
      V,
      D,
      embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(), ('shard', None)
      ),
      rngs=rngs,
    )
    self.blocks = nnx.List([GptBlock(rngs) for _ in range(2)])
    self.ln_f = nnx.LayerNorm(D, rngs=rngs)
    self.lm_head = nnx.Linear(
      D,
      V,
      use_bias=False,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), (None, 'shard')
      ),
      rngs=rngs,
    )

  def __call__(self, toks):
    x = self.wte(toks)
    for block in self.blocks:
      x = block(x)
    return self.lm_head(self.ln_f(x))


def gpt_step(model, optimizer, toks):
  def loss_fn(model):
    return next_token_loss(model(toks[:, :-1]), toks)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def gpt_tokens(i, mesh):
  return jax.device_put(tokens(60 + i), NamedSharding(mesh, P(AXES)))


@functools.cache
def gpt_reference():
  mesh = mesh_of(AxisType.Auto)
  return nnx_reference(
    lambda: Gpt(nnx.Rngs(0)), gpt_step, lambda i: (gpt_tokens(i, mesh),), mesh
  )


def run_gpt(**dedicate_kwargs):
  mesh = mesh_of(AxisType.Auto)
  ded, model, optimizer = nnx_dedicated(
    lambda: Gpt(nnx.Rngs(0)), mesh, **dedicate_kwargs
  )
  out = {'ded': ded, 'bytes': nnx_state_bytes(optimizer)}
  step = dflax.train_step(ded)(gpt_step)
  out['losses'] = [
    float(step(model, optimizer, gpt_tokens(i, mesh))) for i in range(STEPS)
  ]
  out['params'] = ded.to_params(model)
  return out


class GptTest(BytesMixin, absltest.TestCase):
  """6: blocks constrain activations to ``P(('replicate', 'shard'))`` on an
  Auto mesh, under ``dflax.train_step``."""

  def test_matches_optax(self):
    # train_step can't keep an annotation over its manual owner axes: it
    # runs the step as written under nnx.jit, saying what that costs on
    # Auto axes (before: an error asking to change the model).
    want = gpt_reference()
    with self.assertWarnsRegex(
      dmuon_jax.DMuonWarning,
      r'constrains activations over the owner axes.*plain nnx.jit.*same '
      r'numbers.*Explicit',
    ):
      got = run_gpt()
    assert_muon_close(self, got['params'], plain_params(want['model']))
    np.testing.assert_allclose(
      got['losses'], [float(x) for x in want['outs']], rtol=RTOL
    )

  def test_state_bytes(self):
    mesh = mesh_of(AxisType.Auto)
    drop_in = nnx_drop_in_bytes(lambda: Gpt(nnx.Rngs(0)), mesh)
    with warned_ok():
      optimizer = nnx_dedicated(lambda: Gpt(nnx.Rngs(0)), mesh)[-1]
    self.check_bytes(nnx_state_bytes(optimizer), drop_in)


# -- 7. lm1b: Linen blocks named encoderdecoderblock_N -----------------------------


class EncoderDecoder1DBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.Dense(D, use_bias=False, kernel_init=boxed((None, 'shard')))(h)
    h = nn.LayerNorm()(x)
    h = nn.Dense(F, kernel_init=boxed((None, 'shard')))(h)
    return x + nn.Dense(D, kernel_init=boxed(('shard', None)))(nn.relu(h))


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, toks):
    x = nn.Embed(V, D, embedding_init=boxed(('shard', None)), name='embed')(
      toks
    )
    for lyr in range(2):
      x = EncoderDecoder1DBlock(name=f'encoderdecoderblock_{lyr}')(x)
    x = nn.LayerNorm(name='encoderdecoder_norm')(x)
    return nn.Dense(V, kernel_init=boxed((None, 'shard')), name='logitdense')(x)


class TransformerLM(nn.Module):
  @nn.compact
  def __call__(self, toks):
    return Decoder(name='decoder')(toks)


def lm1b_init():
  model = TransformerLM()
  return model, model.init(jax.random.key(0), tokens()[:, :-1])['params']


@functools.cache
def lm1b_reference():
  model, params = lm1b_init()
  return linen_reference(model, params, linen_loss_step, mesh_of(AxisType.Auto))


def run_lm1b(**dedicate_kwargs):
  mesh = mesh_of(AxisType.Auto)
  model, params = lm1b_init()
  with jax.set_mesh(mesh):
    ded, state = linen_dedicated(model, params, mesh, **dedicate_kwargs)
  out = {'ded': ded, 'bytes': bytes_on_device0(state.opt_state), 'losses': []}
  step = jax.jit(linen_loss_step)  # lm1b's own jit step
  with jax.set_mesh(mesh):
    for i in range(STEPS):
      state, loss = step(state, linen_tokens(i, mesh))
      out['losses'].append(float(loss))
  out['params'] = ded.to_params(state.params)
  return out


class Lm1bTest(BytesMixin, absltest.TestCase):
  """7: ``decoder/encoderdecoderblock_N`` blocks, lm1b's ``jax.jit`` step
  on an Auto mesh."""

  def test_matches_optax(self):
    want = lm1b_reference()
    with plain_jit_on_auto():
      got = run_lm1b()
    assert_muon_close(self, got['params'], want['params'])
    np.testing.assert_allclose(
      got['losses'], [float(x) for x in want['outs']], rtol=RTOL
    )

  def test_state_bytes(self):
    mesh = mesh_of(AxisType.Auto)
    model, params = lm1b_init()
    drop_in = linen_drop_in_bytes(params, mesh)
    with warned_ok(), jax.set_mesh(mesh):
      _, state = linen_dedicated(model, params, mesh)
    self.check_bytes(bytes_on_device0(state.opt_state), drop_in)


if __name__ == '__main__':
  absltest.main()
