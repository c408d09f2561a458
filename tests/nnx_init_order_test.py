"""A dedicated NNX trainer initialized in Flax lm1b's and MaxText's order.

``tests/init_order_test.py``'s NNX order, with the three changed lines of
dedicated mode inside ``create()``: the model (params annotated with
logical names by ``nnx.with_partitioning(..., eager_sharding=False)``) is
dedicated there and its optimizer made by ``dedicated_muon``. ``split()``
(``nnx.split(create())``) is traced by ``jax.eval_shape`` *outside*
``nn.logical_axis_rules`` and ``jax.set_mesh``, then by ``jax.jit(split,
out_shardings=(None, shardings))`` inside both, with the shardings that
``nnx.get_named_sharding`` reads from the abstract state; so the model is
dedicated twice, once in each trace.

The two traces gave trees that differed in two ways, each failing here
before its fix:

- the ``out_sharding`` metadata of the AdamW params named by logical axes
  (the norm's ``('embed',)``): outside the rules ``dedicate`` could not map
  them and kept them, inside it replicated the param over the owner axis
  and renamed it ``(None,)``, and ``jax.jit`` refused the out_shardings
  ("different pytree metadata"). AdamW params now keep their sharding and
  their metadata in both traces (the rules map them where the shardings
  are read: FSDP over the owner axis); on a mesh with another axis, a Muon
  target named by logical axes in the trace that cannot map them raises a
  ``dmuon:`` error naming the fix (run the ``eval_shape`` inside the
  rules).
- the optimizer state kept no sharding metadata (``dedicated_muon``'s init
  unwrapped the params' Variables), so the out_shardings replicated the
  owner momentum, and the first step failed inside ``train_step`` with
  JAX's "add got incompatible shapes for broadcasting: (1024,), (8192,)".

The graphdefs of the two traces still differ (each dedication names its
boundary modules by its own key); the recipe passes None for them and
merges the jitted one, as it must.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
import dmuon_jax.flax as dflax
from tests import support

# Compile-heavy: the README command runs these, the inner loop
# (-m 'not slow') does not (tests/conftest.py).
SLOW_CASES = (r'^NnxDedicatedOrderTest::test_auto_mesh_train_step$',)

D, F, LAYERS = 32, 64, 2
BATCH, STEPS, LR = 16, 5, 0.02
# lm1b's FSDP rules: 'embed' over the data axis (on an Explicit mesh the
# norm's scale, sharded so, would meet the batch's 'fsdp' in the model's
# own product, which JAX refuses without dmuon too: data-parallel rules
# there, as lm1b_order_test's).
RULES = (('batch', 'fsdp'), ('embed', 'fsdp'), ('mlp', None))
DP_RULES = (('batch', 'fsdp'), ('embed', None), ('mlp', None))


def logical(init, names):
  return nnx.with_partitioning(init, names, eager_sharding=False)


class Block(nnx.Module):
  def __init__(self, rngs):
    kernel = lambda names: logical(nnx.initializers.lecun_normal(), names)
    self.up = nnx.Linear(
      D, F, use_bias=False, kernel_init=kernel(('embed', 'mlp')), rngs=rngs
    )
    self.down = nnx.Linear(
      F, D, use_bias=False, kernel_init=kernel(('mlp', 'embed')), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))


class Model(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.norm = nnx.LayerNorm(  # an AdamW param named by a logical axis
      D,
      use_bias=False,
      scale_init=logical(nnx.initializers.ones, ('embed',)),
      rngs=rngs,
    )

  def __call__(self, x):
    for block in self.layers:
      x = block(x)
    return self.norm(x)


def loss_fn(model, x):
  return jnp.mean((model(x) - jnp.roll(x, 1, axis=-1)) ** 2)


def train_step(model, optimizer, x):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x)
  optimizer.update(model, grads)
  return loss


def batch():
  return jax.random.normal(jax.random.key(1), (BATCH, D))


def init(mesh, rules=RULES, **kwargs):
  """The NNX order: ``(model, optimizer, dedication, warnings)``."""
  made = []

  def create():
    model = Model(nnx.Rngs(0))
    ded = dflax.dedicate(model, mesh, **kwargs)  # the changed lines
    made.append(ded)
    tx = dflax.dedicated_muon(ded, learning_rate=LR)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  def split():
    return nnx.split(create())

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    _, abstract = jax.eval_shape(split)  # outside the rules and the mesh
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      shardings = nnx.get_named_sharding(abstract, mesh)
      graphdef, state = jax.jit(split, out_shardings=(None, shardings))()
  model, optimizer = nnx.merge(graphdef, state)
  return model, optimizer, made[-1], [str(w.message) for w in caught]


@functools.cache
def reference():
  """One device, ``optax.contrib.muon`` (AdamW on the norm's scale)."""
  model = Model(nnx.Rngs(0))
  dims = lambda params: jax.tree.map(
    lambda label: dmuon_jax.MuonDimensionNumbers() if label == 'muon' else None,
    dmuon_jax.muon_labels(params),
  )
  tx = optax.contrib.muon(LR, muon_weight_dimension_numbers=dims)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = nnx.jit(train_step)
  losses = [float(step(model, optimizer, batch())) for _ in range(STEPS)]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return np.array(losses), jax.tree.map(np.asarray, params)


def owner_momentum(optimizer):
  is_owner = lambda x: isinstance(x, dmuon_jax.OwnerBuffers)
  leaves = jax.tree.leaves(optimizer.opt_state, is_leaf=is_owner)
  (mu,) = [x for x in leaves if is_owner(x)]
  return mu


class NnxDedicatedOrderTest(absltest.TestCase):
  def check(self, kind, step_of):
    mesh = support.make_mesh((8,), ('fsdp',), kind=kind)
    fsdp = kind == AxisType.Auto
    model, optimizer, ded, said = init(mesh, RULES if fsdp else DP_RULES)
    step = step_of(ded)
    x = jax.device_put(batch(), NamedSharding(mesh, P('fsdp')))
    with jax.set_mesh(mesh):
      losses = [float(step(model, optimizer, x)) for _ in range(STEPS)]
    want_losses, want = reference()
    rel = np.max(np.abs(np.array(losses) - want_losses) / want_losses)
    self.assertLess(rel, 1e-5)
    got = jax.tree.map(np.asarray, ded.to_params(model))
    support.assert_trees_rel_close(self, got, want, support.OPTAX_F32_RTOL)
    # Stored on their owners: the owned buffers and their momentum sharded
    # over 'fsdp' as the layout says, by the recipe's out_shardings.
    spec = ded.dedication.layout.buffer_specs()[0]
    self.assertEqual(spec, P('fsdp'))
    (buffer_path,) = ded.buffer_paths
    buffer = dict(nnx.to_flat_state(nnx.state(model)))[buffer_path]
    self.assertEqual(buffer.get_value().sharding.spec, spec)
    mu = owner_momentum(optimizer)
    self.assertEqual([b.sharding.spec for b in mu.buffers], [spec])
    # The norm's scale, and its moments, as the rules shard it (FSDP on
    # the Auto mesh: train_step gathers them for the step), its logical
    # name kept (before: replicated and renamed (None,)).
    scale = model.norm.scale
    self.assertEqual(scale.get_metadata()['out_sharding'], ('embed',))
    want = P('fsdp') if fsdp else P(None)
    moments = [
      v.get_value().sharding.spec
      for p, v in nnx.to_flat_state(nnx.state(optimizer))
      if 'norm' in p
    ]
    self.assertEqual([scale.get_value().sharding.spec, *moments], [want] * 3)
    return said

  def test_auto_mesh_train_step(self):
    said = self.check(
      AxisType.Auto, lambda ded: dflax.train_step(ded)(train_step)
    )
    self.assertEqual(said, [])

  def test_explicit_mesh_plain_nnx_jit(self):
    said = self.check(AxisType.Explicit, lambda ded: nnx.jit(train_step))
    self.assertEqual(said, [])  # the reduced route

  def test_outside_the_rules_on_a_mesh_with_another_axis(self):
    # 'model' is no owner axis: only the rules tell whether a param named
    # by logical axes is sharded over the owner axis or over 'model', and
    # the abstract trace has none. Refused there, before jax.jit's error.
    mesh = support.make_mesh((4, 2), ('fsdp', 'model'), kind=AxisType.Auto)
    kwargs = {'axis_names': ('fsdp',)}
    with self.assertRaisesRegex(
      ValueError,
      r"dmuon: dedicate cannot tell how param 'layers/0/down/kernel'.*"
      r'jax.eval_shape outside nn.logical_axis_rules and by jax.jit.*'
      r'with nn.logical_axis_rules\(rules\): abstract = jax.eval_shape',
    ):
      init(mesh, **kwargs)
    # The fix: the eval_shape inside the rules too (MaxText's order).

    def split():
      model = Model(nnx.Rngs(0))
      ded = dflax.dedicate(model, mesh, **kwargs)
      tx = dflax.dedicated_muon(ded, learning_rate=LR)
      return nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

    with warnings.catch_warnings():
      warnings.simplefilter('ignore', dmuon_jax.DMuonWarning)
      with nn.logical_axis_rules(RULES):
        _, abstract = jax.eval_shape(split)
      with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        shardings = nnx.get_named_sharding(abstract, mesh)
        _, state = jax.jit(split, out_shardings=(None, shardings))()
    self.assertEqual(jax.tree.structure(state), jax.tree.structure(abstract))


if __name__ == '__main__':
  absltest.main()
