"""Linen ``nn.scan`` stacks dedicated as written: ``dedicate_linen``.

Our own small Linen decoder whose blocks are an ``nn.scan`` stack (params
``layers/.../kernel`` of shape ``(L, m, n)``, Muon by dimension numbers),
with a one-hot embedding, a final norm and a head on AdamW, trained the
way Linen trainers do: a ``TrainState`` step, dedicated with three
changed lines (``dedicate_linen``, the optimizer and ``apply_fn``, the
step's decorator). ``nn.scan`` slices the owned buffers stored with the
stack, and the layer indices ``ded.apply`` adds beside them, one layer per
iteration: each iteration gathers its own layer's matrices inside the
loop, under ``dflax.train_step`` (Auto mesh) and under the trainer's own
plain ``jax.jit`` (Explicit mesh), and matches the same trainer on one
device with ``optax.contrib.muon``.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
import dmuon_jax.flax as dflax
from tests import support

# Compile-heavy: the README command runs these, the inner loop
# (-m 'not slow') does not (tests/conftest.py).
SLOW_CASES = (
  r'^ScannedLinenTest::test_plain_jit_z2$',
  r'^ScannedLinenTest::test_train_step_z2$',
  r'^ScannedLinenTest::test_train_step_z3$',
)

AXES = support.AXES
D, F, HEADS, V, LAYERS = 32, 64, 4, 64, 3
BATCH, LENGTH = 16, 9
STEPS = 20
LR = 0.01
N = 8


class Block(nn.Module):
  """Pre-norm causal attention and MLP, in ``nn.scan``'s ``(carry, x)``
  form."""

  @nn.compact
  def __call__(self, x, _):
    b, t, _ = x.shape
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)
    h = nn.LayerNorm(use_bias=False, name='attn_norm')(x)
    q, k, v = (dense(D, n)(h).reshape(b, t, HEADS, -1) for n in 'qkv')
    att = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D // HEADS)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(att), v)
    x = x + dense(D, 'o')(y.reshape(b, t, D))
    h = dense(F, 'up')(nn.LayerNorm(use_bias=False, name='mlp_norm')(x))
    return x + dense(D, 'down')(jax.nn.gelu(h)), None


class Decoder(nn.Module):
  """An embedding, ``LAYERS`` blocks scanned as ``layers`` (nanodo and
  MaxText write ``nn.scan(nn.remat(Block), ...)``: ``remat``), a head."""

  remat: bool = False

  @nn.compact
  def __call__(self, tokens):
    table = self.param('embed', nn.initializers.normal(1.0), (V, D))
    x = jax.nn.one_hot(tokens, V) @ table  # typed on Explicit axes too
    stack = nn.scan(
      nn.remat(Block) if self.remat else Block,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      length=LAYERS,
    )
    x, _ = stack(name='layers')(x, None)
    # No scale here: at init one entry of a final norm's scale gradient
    # was ~1e-8, where AdamW's first step g / (|g| + eps) turns fp32
    # summation-order noise into a 3e-4 difference (measured: plain
    # data-parallel optax.contrib.muon on 2x4 against one device, 3.3e-5
    # over 20 steps with it, 1.9e-7 without).
    x = nn.LayerNorm(use_bias=False, use_scale=False, name='out_norm')(x)
    return nn.Dense(V, use_bias=False, name='head')(x)


def dims(params):
  """The stack's kernels, ``(L, m, n)``: L matrices each (both runs)."""
  return jax.tree_util.tree_map_with_path(
    lambda p, x: (
      dmuon_jax.MuonDimensionNumbers(1, 2)
      if jax.tree_util.keystr(p).startswith("['layers']") and x.ndim == 3
      else None
    ),
    params,
  )


def loss_fn(apply_fn, params, tokens):
  logits = apply_fn({'params': params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def train_step(state, tokens):
  """The trainer's step, as written for the plain model."""
  loss, grads = jax.value_and_grad(functools.partial(loss_fn, state.apply_fn))(
    state.params, tokens
  )
  return state.apply_gradients(grads=grads), loss


def batch_on(mesh):
  return jax.device_put(
    support.token_batch(BATCH, LENGTH, V), NamedSharding(mesh, P(AXES))
  )


@functools.cache
def initial_params():
  """The decoder's initial params on the host: one init (a compile) for
  every run, placed on each run's mesh."""
  tokens = support.token_batch(BATCH, LENGTH, V)
  init = jax.jit(Decoder().init)
  return jax.device_get(init(jax.random.key(0), tokens[:, :-1])['params'])


def train(shape, kind, dedicated, z3=False):
  """20 steps: losses, final plain params, the compiled step's
  collectives and the dedication (None for the plain model)."""
  mesh = support.make_mesh(shape, kind=kind)
  model = Decoder()
  tokens = batch_on(mesh)
  with jax.set_mesh(mesh):
    params = jax.device_put(initial_params(), NamedSharding(mesh, P()))
    ded, apply_fn, step = None, model.apply, jax.jit(train_step)
    tx = optax.contrib.muon(LR, muon_weight_dimension_numbers=dims)
    if dedicated:  # the three changed lines
      ded, params = dflax.dedicate_linen(
        model,
        params,
        mesh,
        muon_weight_dimension_numbers=dims,
        reshard_after_forward=z3,
      )
      apply_fn, tx = ded.apply, dflax.dedicated_muon(ded, learning_rate=LR)
      if kind == AxisType.Auto:  # Explicit: the plain jax.jit step
        step = dflax.train_step(ded)(train_step)
    create = functools.partial(
      train_state.TrainState.create, apply_fn=apply_fn, tx=tx
    )
    # Created under jit on the Explicit mesh, as trainers do (the step is
    # then an array: the train step compiles once). On the Auto mesh
    # eagerly: a jitted init there replicates the Muon momentum (GSPMD
    # does not keep zeros_like's sharding), which train_step refuses.
    explicit = kind == AxisType.Explicit
    state = (jax.jit(create) if explicit else create)(params=params)
    losses = []
    for _ in range(STEPS):
      state, loss = step(state, tokens)
      losses.append(float(loss))
    # Compiled already: these read the cached executable.
    compiled = (
      step.compile(state, tokens)
      if hasattr(step, 'compile')
      else step.lower(state, tokens).compile()
    )
    params = ded.to_params(state.params) if dedicated else state.params
  return {
    'losses': np.array(losses),
    'params': jax.tree.map(np.asarray, params),
    'hlo': compiled.as_text(),
    'ded': ded,
  }


@functools.cache
def reference():
  return train((1, 1), AxisType.Explicit, dedicated=False)


@functools.cache
def dedicated_run(kind, z3):
  return train((2, 4), kind, dedicated=True, z3=z3)


def muon_collectives(test, hlo):
  """kind -> (instructions, bytes per device per step) of the step's
  all-gathers and reduce-scatters, each checked to sit in the scan's
  while loop and run once per layer."""
  out = {'all-gather': [0, 0.0], 'reduce-scatter': [0, 0.0]}
  for c in dmuon_jax.diagnostics.hlo_collectives(hlo):
    if c.kind in out:
      test.assertTrue(c.in_loop, c)
      test.assertEqual(c.executions, LAYERS, c)
      out[c.kind][0] += 1
      out[c.kind][1] += c.bytes * c.executions
  return {k: tuple(v) for k, v in out.items()}


def adamw_all_reduce_bound():
  """Bytes per device of all-reducing the AdamW gradients (the embedding,
  the head, the norms) once, plus scalars: a Muon gradient does not fit."""
  adamw = (2 * V * D + 2 * LAYERS * D) * 4
  return 2 * (N - 1) / N * adamw + 64


class ScannedLinenTest(absltest.TestCase):
  """Each route and mode: the 20 steps of the reference, and per layer
  one gather (Z3: two) and one reduce-scatter of the layer's owner buffer
  inside the loop, no all-reduce of a Muon gradient."""

  def check(self, kind, z3):
    want, got = reference(), dedicated_run(kind, z3)
    rel = np.max(np.abs(got['losses'] - want['losses']) / want['losses'])
    self.assertLess(rel, 1e-5)
    support.assert_trees_max_rel_close(got['params'], want['params'], 1e-5)
    self.assertLess(got['losses'][-1], got['losses'][0])
    ded = got['ded']
    self.assertEqual(ded.dedication.boundaries.scanned, (True,))
    # Per layer's gather: N x the largest owner's share (the padding is
    # the summary's business, not the route's).
    gathered = ded.dedication.gather_bytes()[1]
    per_pass = (N - 1) / N * gathered
    counts = muon_collectives(self, got['hlo'])
    if kind == AxisType.Explicit:  # one gather over both owner axes
      ag, rs = (2 if z3 else 1, 2 * per_pass if z3 else per_pass), (1, per_pass)
    else:  # HSDP in train_step: over 'replicate', then over 'shard'; Z3
      # gathers again over 'shard' only (the replicate stage is kept).
      again = (4 - 1) / 4 * gathered
      ag = (3, per_pass + again) if z3 else (2, per_pass)
      rs = (2, per_pass)
    self.assertEqual(counts['all-gather'][0], ag[0])
    self.assertAlmostEqual(counts['all-gather'][1], ag[1], delta=1)
    self.assertEqual(counts['reduce-scatter'][0], rs[0])
    self.assertAlmostEqual(counts['reduce-scatter'][1], rs[1], delta=1)
    all_reduce = sum(
      c.bytes * c.executions
      for c in dmuon_jax.diagnostics.hlo_collectives(got['hlo'])
      if c.kind == 'all-reduce'
    )
    self.assertLessEqual(all_reduce, adamw_all_reduce_bound())

  def test_train_step_z2(self):
    self.check(AxisType.Auto, False)

  def test_train_step_z3(self):
    self.check(AxisType.Auto, True)

  def test_plain_jit_z2(self):
    self.check(AxisType.Explicit, False)

  def test_plain_jit_z3(self):
    self.check(AxisType.Explicit, True)


# -- nn.scan(nn.remat(Block)) ---------------------------------------------------


@functools.cache
def plain_grads():
  """The plain model's loss and gradients on one device."""
  mesh = support.make_mesh((1, 1))
  tokens = batch_on(mesh)
  with jax.set_mesh(mesh):
    params = jax.device_put(initial_params(), NamedSharding(mesh, P()))
    grad = jax.jit(jax.value_and_grad(loss_fn, argnums=1), static_argnums=0)
    loss, grads = grad(Decoder().apply, params, tokens)
  return float(loss), jax.tree.map(np.asarray, grads)


def remat_setup(kind, z3):
  """``Decoder(remat=True)`` (the same params) dedicated on 2x4, its
  loss-and-grad step (``dflax.train_step`` on Auto axes, plain ``jax.jit``
  on Explicit ones) and the batch."""
  mesh = support.make_mesh((2, 4), kind=kind)
  model = Decoder(remat=True)
  tokens = batch_on(mesh)
  with jax.set_mesh(mesh):
    ded, dparams = dflax.dedicate_linen(
      model,
      jax.device_put(initial_params(), NamedSharding(mesh, P())),
      mesh,
      muon_weight_dimension_numbers=dims,
      reshard_after_forward=z3,
    )
  grad = jax.value_and_grad(functools.partial(loss_fn, ded.apply))
  step = dflax.train_step(ded)(grad) if kind == AxisType.Auto else jax.jit(grad)
  return mesh, ded, dparams, tokens, step


class ScanOfRematTest(absltest.TestCase):
  """``nn.scan(nn.remat(Block))`` (nanodo, MaxText): the block's nn.remat
  recomputes its gather in the backward pass, so Z3 is that plain gather:
  per layer two all-gathers and one reduce-scatter (Z3's own re-gather
  would be a third); Z2 moves the same and says so."""

  def check(self, kind):
    want_loss, want = plain_grads()
    mesh, ded, dparams, tokens, step = remat_setup(kind, z3=True)
    with jax.set_mesh(mesh):
      loss, grads = step(dparams, tokens)
      compiled = (
        step.compile(dparams, tokens)
        if kind == AxisType.Auto
        else step.lower(dparams, tokens).compile()
      )
    # train_step's gradients are sums of the devices' mean-loss ones.
    n = N if kind == AxisType.Auto else 1
    grads = jax.tree.map(lambda g: np.asarray(g) / n, ded.to_params(grads))
    self.assertLess(abs(float(loss) - want_loss) / want_loss, 1e-6)
    support.assert_trees_max_rel_close(grads, want, 1e-5)
    per_pass = (N - 1) / N * ded.dedication.gather_bytes()[1]
    counts = muon_collectives(self, compiled.as_text())
    stages = 2 if kind == AxisType.Auto else 1  # HSDP: two stages
    self.assertEqual(counts['all-gather'][0], 2 * stages)
    self.assertAlmostEqual(counts['all-gather'][1], 2 * per_pass, delta=1)
    self.assertEqual(counts['reduce-scatter'][0], stages)
    self.assertAlmostEqual(counts['reduce-scatter'][1], per_pass, delta=1)

  def test_train_step_z3(self):
    self.check(AxisType.Auto)

  def test_plain_jit_z3(self):
    self.check(AxisType.Explicit)

  def test_z2_warns_it_moves_z3_bytes(self):
    mesh, _, dparams, tokens, step = remat_setup(AxisType.Explicit, z3=False)
    with jax.set_mesh(mesh):
      with self.assertWarnsRegex(
        dmuon_jax.DMuonWarning,
        r"boundary 'layers' runs inside a Flax nn.remat .* moves Z3's bytes",
      ):
        step.trace(dparams, tokens)


# -- mistakes -------------------------------------------------------------------


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    h = jax.nn.gelu(nn.Dense(F, use_bias=False, name='up')(x))
    return x + nn.Dense(D, use_bias=False, name='down')(h), None


def scanned(name):
  return nn.scan(
    Mlp, variable_axes={'params': 0}, split_rngs={'params': True}, length=3
  )(name=name)


class Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    return scanned('layers')(x, None)[0]


class TwoStacks(nn.Module):
  """Two nn.scan stacks under one top-level module (``body``)."""

  @nn.compact
  def __call__(self, x):
    class Body(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = scanned('encoder')(x, None)
        return scanned('decoder')(x, None)[0]

    return Body(name='body')(x)


class NestedStack(nn.Module):
  """An nn.scan stack inside a top-level module (``body/layers``, as
  MaxText's ``decoder/layers``), beside an AdamW projection."""

  @nn.compact
  def __call__(self, x):
    class Body(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(D, name='proj')(x)
        return scanned('layers')(x, None)[0]

    return Body(name='body')(x)


class VmappedStack(nn.Module):
  """Stacked layers made by nn.vmap (an ensemble), not nn.scan."""

  @nn.compact
  def __call__(self, x):
    ys, _ = nn.vmap(
      Mlp,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      in_axes=None,
      axis_size=3,
    )(name='layers')(x)
    return ys.mean(0)


def stacked_dims(params):
  return jax.tree.map(
    lambda x: dmuon_jax.MuonDimensionNumbers(1, 2) if x.ndim == 3 else None,
    params,
  )


def dedicated(model, mesh=None, **kwargs):
  x = jax.random.normal(jax.random.key(1), (2, D))
  params = model.init(jax.random.key(0), x)['params']
  ded, dparams = dflax.dedicate_linen(
    model, params, mesh, muon_weight_dimension_numbers=stacked_dims, **kwargs
  )
  return ded, dparams, params, x


class NestedStackTest(absltest.TestCase):
  def test_gathers_in_the_module_nn_scan_runs_per_layer(self):
    # The boundary is the top-level module 'body'; the gathers (and the
    # owner buffer) sit in 'body/layers', where nn.scan slices the params.
    mesh = support.make_mesh((2, 4))
    ded, dparams, params, x = dedicated(NestedStack(), mesh)
    self.assertEqual(ded.dedication.boundaries.names, ('body',))
    self.assertEqual(ded.boundary_paths, (('body', 'layers'),))
    self.assertEqual(
      dparams['body']['layers']['dmuon_owned_0'].shape[0], 3
    )  # (layers, num_slots * local)
    with jax.set_mesh(mesh):
      got = ded.apply({'params': dparams}, x)  # eager: one layer per slot
    want = NestedStack().apply({'params': params}, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


class GeneralMlp(nn.Module):
  """An Mlp whose input projection is an ``nn.DenseGeneral`` with a boxed
  initializer (flax issue #3676: its shape check at every call unboxes a
  flat kernel with the N-D names, which a mesh context refuses)."""

  @nn.compact
  def __call__(self, x, _=None):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None,) * 3)
    h = nn.DenseGeneral((2, F // 2), kernel_init=init, name='up')(x)
    h = jax.nn.gelu(h.reshape(*x.shape[:-1], F))
    return x + nn.Dense(D, use_bias=False, name='down')(h), None


class ScanOfRematGeneral(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(
      nn.remat(GeneralMlp),
      variable_axes={'params': 0},
      split_rngs={'params': True},
      length=3,
      metadata_params={nn.PARTITION_NAME: None},
    )
    return stack(name='layers')(x, None)[0]


class ScanOfRematGeneralTest(absltest.TestCase):
  def test_dense_general_runs_in_train_step(self):
    # ded.apply rebinds an nn.DenseGeneral to its scope with its
    # initializer unboxed for the call, inside nn.scan(nn.remat(...)) and
    # train_step's shard_map; the user's module is left as it was.
    mesh = support.make_mesh((2, 4), kind=AxisType.Auto)
    model = ScanOfRematGeneral()
    x = jax.random.normal(jax.random.key(1), (8, D))
    params = model.init(jax.random.key(0), x)['params']
    dims = lambda p: jax.tree_util.tree_map_with_path(
      lambda k, v: (
        dmuon_jax.MuonDimensionNumbers(1, 2)
        if jax.tree_util.keystr(k).endswith("['down']['kernel']")
        else None
      ),
      p,
    )
    ded, dparams = dflax.dedicate_linen(
      model, params, mesh, muon_weight_dimension_numbers=dims
    )
    loss = lambda p, x: jnp.mean(ded.apply({'params': p}, x) ** 2)
    got = dflax.train_step(ded)(loss)(dparams, x)
    want = jnp.mean(model.apply({'params': nn.unbox(params)}, x) ** 2)
    np.testing.assert_allclose(got, want, rtol=1e-5)


class ScannedMistakeTest(absltest.TestCase):
  def test_layers_per_gather_above_one(self):
    x = jax.ShapeDtypeStruct((2, D), jnp.float32)
    params = jax.eval_shape(Stack().init, jax.random.key(0), x)['params']
    with self.assertRaisesRegex(
      ValueError,
      r"layers_per_gather=3, but the scanned stack\(s\) \['layers'\] run "
      r'one layer per nn.scan iteration.*Pass layers_per_gather=1',
    ):
      dflax.dedicate_linen(
        Stack(),
        params,
        None,
        muon_weight_dimension_numbers=stacked_dims,
        layers_per_gather=3,
      )

  def test_two_stacks_under_one_top_level_module(self):
    ded, dparams, _, x = dedicated(TwoStacks())
    self.assertEqual(ded.dedication.boundaries.names, ('body',))
    with self.assertRaisesRegex(
      ValueError,
      r"stack 'body' gathers in module 'body' .* shape \(3, \d+\), with the "
      r'layer axis.*give each a top-level module of its own',
    ):
      ded.apply({'params': dparams}, x)

  def test_stack_not_made_by_nn_scan(self):
    ded, dparams, _, x = dedicated(VmappedStack())
    with self.assertRaisesRegex(
      ValueError,
      r"stack 'layers' runs one layer at a time under 'vmap\(layers\)', "
      r'not nn.scan.*Leave these matrices to AdamW',
    ):
      ded.apply({'params': dparams}, x)

  def test_plain_params(self):
    ded, _, params, x = dedicated(Stack())
    with self.assertRaisesRegex(
      ValueError,
      r"stack 'layers' ran without its owned buffers.*through ded.apply "
      'with the dedicated params',
    ):
      ded.apply({'params': params}, x)


if __name__ == '__main__':
  absltest.main()
