"""Hook boundary detection for dedicated mode: the rules on params trees,
and the models people write (blocks under any indexed name, a dict of
blocks, attribute layers, params on the root module) dedicated with the
documented lines alone, against single-device ``optax.contrib.muon``."""

import contextlib
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax
import dmuon_jax.flax as dflax
from tests import support

S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)


def block():
  return {
    'attn': {'q': {'kernel': S(16, 16)}, 'o': {'kernel': S(16, 16)}},
    'mlp': {'up': {'kernel': S(16, 32)}, 'down': {'kernel': S(32, 16)}},
    'norm': {'scale': S(16)},
  }


class HookBoundariesTest(absltest.TestCase):
  def test_linen_auto_names(self):
    params = {
      'params': {f'layers_{i}': block() for i in range(4)}
      | {'embed': {'embedding': S(64, 16)}}
    }
    hb = dmuon_jax.find_hook_boundaries(params)
    self.assertEqual(hb.names, tuple(f'params/layers_{i}' for i in range(4)))
    self.assertEqual(hb.scanned, (False,) * 4)
    self.assertEqual(
      set(hb.targets_of('params/layers_3')),
      {
        'params/layers_3/attn/q/kernel',
        'params/layers_3/attn/o/kernel',
        'params/layers_3/mlp/up/kernel',
        'params/layers_3/mlp/down/kernel',
      },
    )

  def test_nnx_list_of_layers(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.layers = nnx.List(
          [nnx.Linear(16, 16, rngs=rngs) for _ in range(4)]
        )

    state = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)
    hb = dmuon_jax.find_hook_boundaries(state)
    self.assertEqual(hb.names, tuple(f'layers/{i}' for i in range(4)))
    self.assertEqual(hb.targets_of('layers/3'), ('layers/3/kernel',))

  def test_scanned_stack(self):
    params = {
      'embed': S(64, 16),
      'layers': {'q': S(4, 16, 16), 'up': S(4, 16, 32), 'norm': S(4, 16)},
      'head': S(16, 64),
    }
    dims = {
      'embed': None,
      'head': None,
      'layers': {'q': MDN(1, 2), 'up': MDN(1, 2), 'norm': None},
    }
    hb = dmuon_jax.find_hook_boundaries(params, weight_dimension_numbers=dims)
    self.assertEqual(hb.names, ('layers',))
    self.assertEqual(hb.scanned, (True,))
    self.assertEqual(hb.targets_of('layers'), ('layers/q', 'layers/up'))

  def test_custom_predicate_for_a_vit(self):
    params = {
      'patch_embed': S(48, 16),
      'encoder': {f'unit_{c}': block() for c in 'abc'},
    }
    is_block = lambda path, sub: (
      isinstance(sub, dict) and {'attn', 'mlp'} <= set(sub)
    )
    # Blocks without an index look like no blocks: each Linear gathers.
    mine = dmuon_jax.find_hook_boundaries(params)
    self.assertLen(mine.names, 12)
    self.assertEqual(mine.names[0], 'encoder/unit_a/attn/o')  # (sorted)
    self.assertEqual(set(mine.how), {'parent module'})
    hb = dmuon_jax.find_hook_boundaries(params, boundary_predicate=is_block)
    self.assertEqual(
      hb.names, ('encoder/unit_a', 'encoder/unit_b', 'encoder/unit_c')
    )
    self.assertLen(hb.targets_of('encoder/unit_b'), 4)
    self.assertEqual(hb.chosen(), f'{", ".join(hb.names)} (boundary_predicate)')
    # The root as one boundary: the whole model gathered at once.
    whole = dmuon_jax.find_hook_boundaries(
      params, boundary_predicate=lambda path, sub: path == ''
    )
    self.assertEqual(whole.names, ('',))

  def test_strict_names_every_target_without_a_boundary(self):
    params = {
      'proj_in': {'kernel': S(16, 16)},
      'layers_0': block(),
      'proj_out': {'kernel': S(16, 16)},
    }
    with self.assertRaisesRegex(
      ValueError,
      r"2 Muon target.*'proj_in/kernel', 'proj_out/kernel'.*strict=False",
    ):
      dmuon_jax.find_hook_boundaries(params)
    hb = dmuon_jax.find_hook_boundaries(params, strict=False)
    self.assertEqual(hb.names, ('layers_0', 'proj_in', 'proj_out'))


# -- the models people write, dedicated with the documented lines -------------

D, V, BATCH, LENGTH, LR, STEPS = 16, 32, 16, 5, 0.02, 3


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class LmLike(nnx.Module):
  """Blocks as attributes named as Flax's lm1b names them, and more in an
  ``nnx.Dict`` under names without an index."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.encoderdecoderblock_0 = Block(rngs)
    self.encoderdecoderblock_1 = Block(rngs)
    self.blocks = nnx.Dict(first=Block(rngs), second=Block(rngs))
    self.logitdense = nnx.Linear(D, V, rngs=rngs)  # 'logit': AdamW

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = self.encoderdecoderblock_1(self.encoderdecoderblock_0(x))
    return self.logitdense(self.blocks['second'](self.blocks['first'](x)))


class MnistLike(nnx.Module):
  """Attribute layers, as the NNX MNIST tutorial: no blocks."""

  def __init__(self, rngs):
    self.linear1 = nnx.Linear(D, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.linear2 = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.linear2(self.dropout(self.bn(nnx.relu(self.linear1(x)))))


class RootParams(nnx.Module):
  """Flax's FSDP toy: its params directly on the root module."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.w1 = nnx.Param(init(rngs.params(), (D, 32)))
    self.b1 = nnx.Param(jnp.zeros(32))
    self.w2 = nnx.Param(init(rngs.params(), (32, 8)))

  def __call__(self, x):
    return nnx.relu(x @ self.w1[...] + self.b1[...]) @ self.w2[...]


lm_step = support.nnx_lm_step


def regression_step(model, optimizer, batch):
  x, y = batch
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)
  return loss


def regression_batch():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(BATCH, D)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.tanh(x[:, :8]))


def token_batch():
  return support.token_batch(BATCH, LENGTH, V)


@functools.cache
def run(make, dedicated, route):
  """``STEPS`` steps of ``make()``'s model: dedicated on 2x4 (``route``:
  ``'train_step'`` or plain ``'jit'``) with only ``dedicate`` and
  ``dedicated_muon``, or single-device ``optax.contrib.muon`` on the same
  leaves. Returns the losses, plain params, batch statistics, summary and
  the warnings given."""
  step_fn, batch = (
    (lm_step, token_batch())
    if issubclass(make, LmLike)
    else (regression_step, regression_batch())
  )
  mesh = support.make_mesh((2, 4)) if dedicated else None
  with (
    jax.set_mesh(mesh) if mesh else contextlib.nullcontext(),
    warnings.catch_warnings(record=True) as caught,
  ):
    warnings.simplefilter('always')
    model = make(nnx.Rngs(0))
    if dedicated:
      ded = dflax.dedicate(model, mesh)
      tx = dflax.dedicated_muon(ded, learning_rate=LR)
    else:
      tx = optax.contrib.muon(
        LR, muon_weight_dimension_numbers=support.same_routing_dims
      )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if dedicated and route == 'train_step':
      step = dflax.train_step(ded)(step_fn)
    else:
      step = nnx.jit(step_fn)
      if mesh:
        batch = jax.device_put(batch, NamedSharding(mesh, P(support.AXES)))
    losses = [float(step(model, optimizer, batch)) for _ in range(STEPS)]
    if route == 'jit':  # an evaluation step, traced on its own
      model.eval()
      nnx.jit(lambda m, b: m(b[0] if isinstance(b, tuple) else b))(model, batch)
    params = (
      ded.to_params(model)
      if dedicated
      else nnx.to_pure_dict(nnx.state(model, nnx.Param))
    )
    return {
      'losses': np.array(losses),
      'params': jax.tree.map(np.asarray, params),
      'stats': jax.tree.map(
        np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
      ),
      'summary': ded.summary() if dedicated else '',
      'warnings': [str(w.message) for w in caught],
    }


class FoundBoundariesTest(absltest.TestCase):
  """Each model dedicated with ``dedicate`` and ``dedicated_muon`` (and
  ``train_step`` or plain ``nnx.jit``) trains as single-device
  ``optax.contrib.muon``; the summary says which boundaries were found and
  how; no warning is given (there is no transform around a boundary)."""

  def check(self, make, route, chosen):
    want, got = run(make, False, route), run(make, True, route)
    np.testing.assert_allclose(got['losses'], want['losses'], rtol=1e-5)
    support.assert_trees_max_rel_close(got['params'], want['params'], 1e-5)
    stats = jax.tree.leaves(got['stats']), jax.tree.leaves(want['stats'])
    for a, b in zip(*stats, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    self.assertIn(f'hook boundaries: {chosen}', got['summary'])
    self.assertEqual(
      [w for w in got['warnings'] if 'dmuon' in w], [], got['summary']
    )

  def test_indexed_attribute_blocks_and_a_dict_of_blocks(self):  # lm1b
    self.check(
      LmLike,
      'train_step',
      'blocks/first, blocks/second, encoderdecoderblock_0, '
      'encoderdecoderblock_1 (repeated siblings)',
    )

  def test_attribute_layers_with_batchnorm_and_dropout(self):  # MNIST
    self.check(MnistLike, 'jit', 'linear1, linear2 (parent module)')

  def test_params_on_the_root_module(self):  # Flax's FSDP toy
    self.check(RootParams, 'jit', '<root> (parent module)')


class StrictTest(absltest.TestCase):
  """A Muon target beside the blocks: ``strict=True`` names it and the
  fixes; ``strict=False`` gathers it with its own module."""

  class Model(nnx.Module):
    def __init__(self, rngs, on_root=False):
      self.layers = nnx.List([Block(rngs) for _ in range(2)])
      if on_root:
        self.w = nnx.Param(jnp.eye(D))
      else:
        self.proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
      x = self.layers[1](self.layers[0](x))
      return x @ self.w[...] if hasattr(self, 'w') else self.proj(x)

  def test_strict_false_gathers_with_its_module(self):
    x = regression_batch()[0]
    want = np.asarray(self.Model(nnx.Rngs(0))(x))
    mesh = None  # one device: what is checked here is where it gathers
    with self.assertRaisesRegex(
      ValueError,
      r"no hook boundary: \['proj/kernel'\], outside the blocks found "
      r"\(\['layers/0', 'layers/1'\]\).*strict=False to gather each of "
      r"them with its own module \(\['proj'\]\)",
    ):
      dflax.dedicate(self.Model(nnx.Rngs(0)), mesh)
    model = self.Model(nnx.Rngs(0))
    ded = dflax.dedicate(model, mesh, strict=False)
    self.assertIn(
      'hook boundaries: layers/0, layers/1 (name pattern); proj (parent '
      'module)',
      ded.summary(),
    )
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-6)

  def test_a_target_on_a_module_holding_blocks_is_named(self):
    with self.assertRaisesRegex(
      ValueError,
      r"hook boundary 'w' is a Param, not an nnx.Module.*strict=False.*"
      r"'w' lies on 'the root', which holds blocks too.*Route 'w' to AdamW "
      r'\(predicate\), or pass a boundary_predicate',
    ):
      dflax.dedicate(
        self.Model(nnx.Rngs(0), on_root=True),
        None,
        strict=False,
      )


class LinenIndexedBlocksTest(absltest.TestCase):
  def test_lm1b_names(self):
    class Mlp(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x)))

    class Decoder(nn.Module):
      @nn.compact
      def __call__(self, x):
        for i in range(2):
          x = Mlp(name=f'encoderdecoderblock_{i}')(x)
        return x

    model, x = Decoder(), regression_batch()[0]
    params = model.init(jax.random.key(0), x)['params']
    ded, dparams = dflax.dedicate_linen(model, params, None)
    self.assertEqual(
      ded.dedication.boundaries.names,
      ('encoderdecoderblock_0', 'encoderdecoderblock_1'),
    )
    np.testing.assert_allclose(
      np.asarray(ded.apply({'params': dparams}, x)),
      np.asarray(model.apply({'params': params}, x)),
      rtol=1e-6,
    )


class LiftedWarningTest(absltest.TestCase):
  """The 'transform of its own' warning only where a transform wraps each
  boundary's call (its other direction: flax_route_test's
  RematAroundBlocksTest)."""

  def test_no_warning_for_a_train_and_an_eval_step(self):
    class Model(nnx.Module):
      def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs) for _ in range(2)])

      def __call__(self, x):
        return self.layers[1](self.layers[0](x))

    mesh = support.make_mesh((2, 4))
    with jax.set_mesh(mesh):
      model = Model(nnx.Rngs(0))
      ded = dflax.dedicate(model, mesh, layers_per_gather=2)  # Z3
      self.assertEqual(ded.dedication.groups, ((0, 1),))
      x = jax.device_put(
        regression_batch()[0], NamedSharding(mesh, P(support.AXES))
      )
      loss = lambda m: jnp.mean(m(x) ** 2)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        nnx.jit(lambda m: nnx.grad(loss)(m))(model)  # a train step
        nnx.jit(loss)(model)  # an evaluation step: a trace of its own
    self.assertEqual([str(w.message) for w in caught], [])


if __name__ == '__main__':
  absltest.main()
