"""Dedicated ownership on a Flax transformer: parity, HSDP, Z2/Z3."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import _dedicated
from dmuon_jax import _planner
from tests import alias_test
from tests import distributed_test
from tests import transformer as tf

AXES = distributed_test.AXES
LR = 0.005
STEPS = 20


def optax_dims(params):
  """optax dimension numbers for the targets dmuon picks with the predicate."""
  specs = _planner.muon_target_specs(params, predicate=tf.predicate)
  dims = [None if s is None else optax.contrib.MuonDimensionNumbers(
      reduction_axis=s.reduction_axes, output_axis=s.output_axes)
          for s in specs]
  return jax.tree.unflatten(jax.tree.structure(params), dims)


@functools.cache
def reference(scan):
  """Single-device optax.contrib.muon (+ its AdamW) on the Linen model."""
  params = tf.init(scan)
  opt = optax.contrib.muon(LR, muon_weight_dimension_numbers=optax_dims(
      params))
  state = opt.init(params)
  model = tf.Transformer(scan=scan)

  @jax.jit
  def step(params, state):
    def loss_fn(p):
      return tf.cross_entropy(model.apply(p, tf.tokens()), tf.tokens())
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(STEPS):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return jax.device_get(params), losses


def dedicated_loss(ded, scan):
  block = tf.Block()
  apply = lambda block_params, x: block.apply({'params': block_params}, x)

  def loss(dp, tokens):
    p = dp.rest['params']
    x = jnp.take(p['embed']['embedding'], tokens, axis=0)
    if scan:
      x = ded.scan(apply, 'params/layers')(dp, x)
    elif ded.layers_per_gather > 1:
      x = ded.sequential(apply, [f'params/layers_{i}'
                                 for i in range(tf.DEPTH)])(dp, x)
    else:
      for i in range(tf.DEPTH):
        x = ded.block(apply, f'params/layers_{i}')(dp, x)
    return tf.cross_entropy(tf.head(p, x), tokens)

  return loss


def train_step(ded, opt, state, scan):
  specs = ded.specs()
  state_specs = ded.specs_of(state)
  loss_fn = dedicated_loss(ded, scan)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=ded.mesh,
                     in_specs=(specs, state_specs, P(AXES)),
                     out_specs=(specs, state_specs, P()))
  def step(dp, state, tokens):
    loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(dp, tokens)
    updates, state = opt.update(grads, state, dp)
    return optax.apply_updates(dp, updates), state, jax.lax.pmean(loss, AXES)

  return step


def setup(shape, scan, z3, per_gather=1):
  mesh = distributed_test.make_mesh(shape)
  params = tf.init(scan)
  ded = _dedicated.dedicate(params, mesh, predicate=tf.predicate,
                            reshard_after_forward=z3,
                            layers_per_gather=per_gather)
  dp = ded.to_dedicated(jax.device_put(params, NamedSharding(mesh, P())))
  opt = _dedicated.dedicated_muon(ded, LR)
  state = opt.init(dp)
  tokens = jax.device_put(tf.tokens(), NamedSharding(mesh, P(AXES)))
  return ded, dp, opt, state, tokens


@functools.cache
def dedicated_run(shape, scan, z3, per_gather=1):
  ded, dp, opt, state, tokens = setup(shape, scan, z3, per_gather)
  step = train_step(ded, opt, state, scan)
  losses = []
  for _ in range(STEPS):
    dp, state, loss = step(dp, state, tokens)
    losses.append(float(loss))
  return jax.device_get(ded.to_params(dp)), losses


CONFIGS = [(f'{"scan" if scan else "loop"}_{"z3" if z3 else "z2"}_'
            f'{shape[0]}x{shape[1]}', shape, scan, z3)
           for scan in (False, True) for z3 in (False, True)
           for shape in ((1, 8), (2, 4), (8, 1))]
# Two layers per gather (sequential / two layers per scan iteration).
CONFIGS += [(f'{"scan" if scan else "loop"}_z3_{shape[0]}x{shape[1]}_k2',
             shape, scan, True, 2)
            for scan in (False, True) for shape in ((1, 8), (2, 4))]


class FlaxDedicatedTest(parameterized.TestCase):

  def test_boundaries(self):
    loop = _dedicated.dedicate(tf.init(False), None, predicate=tf.predicate)
    self.assertEqual(loop.boundaries.names,
                     tuple(f'params/layers_{i}' for i in range(tf.DEPTH)))
    self.assertEqual(loop.num_iterations, (0,) * tf.DEPTH)
    scan = _dedicated.dedicate(tf.init(True), None, predicate=tf.predicate)
    self.assertEqual(scan.boundaries.names, ('params/layers',))
    self.assertEqual(scan.num_iterations, (tf.DEPTH,))

  @parameterized.named_parameters(*CONFIGS)
  def test_matches_optax_muon(self, shape, scan, z3, per_gather=1):
    params, losses = dedicated_run(shape, scan, z3, per_gather)
    ref_params, ref_losses = reference(scan)
    self.assertLess(losses[-1], losses[0] - 0.5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    alias_test.assert_trees_rel_close(self, params, ref_params, rtol=1e-5)

  @parameterized.parameters(False, True)
  def test_hsdp_equals_shard_only(self, scan):
    hsdp, hsdp_losses = dedicated_run((2, 4), scan, True)
    fsdp, fsdp_losses = dedicated_run((1, 8), scan, True)
    np.testing.assert_allclose(hsdp_losses, fsdp_losses, rtol=1e-6)
    alias_test.assert_trees_rel_close(self, hsdp, fsdp, rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
