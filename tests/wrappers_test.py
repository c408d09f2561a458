"""dmuon inside every optax wrapper: update, state search and checkpoints.

Each wrapper (``chain``, ``named_chain``, ``partition``, ``masked``,
``MultiSteps``, ``apply_if_finite``, ``inject_hyperparams`` with
``static_args``, and ``nnx.Optimizer`` around one) gives the numbers of
the same wrapper around ``optax.contrib.muon`` on one device, and its state
survives a checkpoint saved on a 2x4 mesh and restored on 1x4. Tiny params
(two Muon matrices and a bias), a few steps, eager updates on one device
(cheaper here than compiling each wrapper's update).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import checkpoint
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py).
SLOW_CASES = (
  r'round_trip_onto_1x4_(chain|named_chain|apply_if_finite|inject)',
  r'update_matches_optax_(chain|named_chain)',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^UpdateTest::test_update_matches_optax_multi_steps$',
  r'^CheckpointTest::test_resumed_multi_steps_matches_the_saving_mesh$',
)

LR = 0.02
STEPS = 3


def params():
  rng = np.random.default_rng(0)
  n = lambda *shape: jnp.asarray(
    0.1 * rng.standard_normal(shape).astype(np.float32)
  )
  # Both matrices are Muon targets for dmuon's rule and optax's alike.
  return {
    'layers_0': {'w': n(16, 32)},
    'layers_1': {'w': n(32, 16)},
    'b': n(32),
  }


def frozen_layer_1(tree):
  """``optax.masked``'s mask: all but ``layers_1`` (whose updates pass
  through unchanged, as optax's masked leaves do)."""
  return {'layers_0': {'w': True}, 'layers_1': {'w': False}, 'b': True}


def labels(tree):
  return {'layers_0': {'w': 'opt'}, 'layers_1': {'w': 'frozen'}, 'b': 'opt'}


# name -> wrapper(muon, kw): muon(learning_rate=LR, **kw) makes the Muon
# optimizer (dmuon_jax.dmuon with kw={'mesh': ...}, or optax.contrib.muon).
WRAPPERS = {
  'chain': lambda muon, kw: optax.chain(
    optax.clip_by_global_norm(1.0), muon(learning_rate=LR, **kw)
  ),
  'named_chain': lambda muon, kw: optax.named_chain(
    ('clip', optax.clip_by_global_norm(1.0)),
    ('muon', muon(learning_rate=LR, **kw)),
  ),
  'partition': lambda muon, kw: optax.partition(
    {'opt': muon(learning_rate=LR, **kw), 'frozen': optax.set_to_zero()},
    labels,
  ),
  'masked': lambda muon, kw: optax.masked(
    muon(learning_rate=LR, **kw), frozen_layer_1
  ),
  'multi_steps': lambda muon, kw: optax.MultiSteps(
    muon(learning_rate=LR, **kw), 2
  ),
  'apply_if_finite': lambda muon, kw: optax.apply_if_finite(
    muon(learning_rate=LR, **kw), 2
  ),
  # A Mesh is callable: optax would take it for a schedule without
  # static_args (dmuon's error says so).
  'inject_hyperparams': lambda muon, kw: optax.inject_hyperparams(
    muon, static_args=tuple(kw)
  )(learning_rate=LR, **kw),
}
NAMES = tuple((name, name) for name in WRAPPERS)


def ours(name, mesh):
  """dmuon on ``mesh`` in wrapper ``name``."""
  return WRAPPERS[name](dmuon_jax.dmuon, {'mesh': mesh})


def theirs(name):
  """optax.contrib.muon in wrapper ``name``."""
  return WRAPPERS[name](optax.contrib.muon, {})


def run_eagerly(opt, tree, steps=STEPS):
  """``steps`` eager updates on :func:`support.grads_at`; final params."""
  state = opt.init(tree)
  for i in range(steps):
    updates, state = opt.update(support.grads_at(i, tree), state, tree)
    tree = optax.apply_updates(tree, updates)
  return jax.tree.map(np.asarray, tree), state


@functools.cache
def meshes():
  return support.make_mesh((2, 4)), support.make_mesh((1, 4))


def on(mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P()))


def abstract_on(mesh, tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, P())
    ),
    tree,
  )


def randomized(portable, seed=1):
  """A portable state with every leaf set to other values (floats random,
  integers 1 or 2, flags as they are): what a trained state holds."""
  rng = np.random.default_rng(seed)

  def one(x):
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
      return rng.standard_normal(x.shape).astype(x.dtype)
    if np.issubdtype(x.dtype, np.integer):
      return rng.integers(1, 3, x.shape).astype(x.dtype)
    return x

  return jax.tree.map(one, portable)


class UpdateTest(parameterized.TestCase):
  @parameterized.named_parameters(*NAMES)
  def test_update_matches_optax(self, name):
    got, state = run_eagerly(ours(name, None), params())
    ref, _ = run_eagerly(theirs(name), params())
    support.assert_trees_rel_close(self, got, ref, rtol=1e-6)
    # The one search finds the dmuon state inside the wrapper.
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertEqual(layout.kind, 'dmuon')

  def test_masked_leaves_are_not_planned(self):
    for name in ('masked', 'partition'):
      state = ours(name, None).init(params())
      (layout,) = dmuon_jax.owner_layouts(state)
      self.assertEqual([t.path for t in layout.leaves], ['layers_0/w'], name)


class CheckpointTest(parameterized.TestCase):
  """Saved on 2x4 with every state leaf set, restored on 1x4 exactly."""

  def setUp(self):
    super().setUp()
    self.dir = support.temp_dir(self)

  def saved_state(self, opt, tree):
    """``opt``'s state on ``tree``, every leaf changed (see randomized)."""
    fresh = opt.init(tree)
    values = randomized(checkpoint.state_to_portable(fresh))
    return values, checkpoint.state_from_portable(values, fresh)

  @parameterized.named_parameters(*NAMES)
  def test_round_trip_onto_1x4(self, name):
    mesh_2x4, mesh_1x4 = meshes()
    opt = ours(name, mesh_2x4)
    tree = on(mesh_2x4, params())
    values, state = self.saved_state(opt, tree)
    checkpoint.save(self.dir, 5, tree, state, opt=opt)
    new_opt = ours(name, mesh_1x4)
    step, got_params, got = checkpoint.restore(
      self.dir, abstract_on(mesh_1x4, params()), new_opt
    )
    self.assertEqual(step, 5)
    chex.assert_trees_all_equal(got_params, params())
    # Every leaf (MultiSteps' accumulators and counters, apply_if_finite's,
    # the injected hyperparameters, the Muon momentum) is the saved one.
    chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, checkpoint.state_to_portable(got)), values
    )
    (layout,) = dmuon_jax.owner_layouts(got)
    self.assertEqual(layout.buffer_sizes, (4,))  # (the 1x4 mesh's 'shard')
    chex.assert_trees_all_equal_structs(got, new_opt.init(on(mesh_1x4, tree)))

  def test_resumed_multi_steps_matches_the_saving_mesh(self):
    # Restored on 1x4 in the middle of an accumulation (mini_step 1), the
    # next update applies the inner step as the 2x4 state would.
    mesh_2x4, mesh_1x4 = meshes()
    opt = ours('multi_steps', mesh_2x4)
    tree = on(mesh_2x4, params())
    state = opt.init(tree)
    _, state = jax.jit(opt.update)(support.grads_at(0, tree), state, tree)
    checkpoint.save(self.dir, 1, tree, state, opt=opt)
    grads = support.grads_at(1, tree)
    expected, _ = jax.jit(opt.update)(grads, state, tree)
    new_opt = ours('multi_steps', mesh_1x4)
    _, tree_b, state_b = checkpoint.restore(
      self.dir, abstract_on(mesh_1x4, params()), new_opt
    )
    self.assertEqual(int(state_b.mini_step), 1)
    got, _ = jax.jit(new_opt.update)(on(mesh_1x4, grads), state_b, tree_b)
    support.assert_trees_max_rel_close(got, expected, 1e-6)
    self.assertGreater(float(jnp.abs(got['layers_0']['w']).max()), 0)

  def test_nnx_optimizer_around_multi_steps(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    mesh_2x4, mesh_1x4 = meshes()

    def make(mesh):
      model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
      nnx.update(model, on(mesh, nnx.state(model)))
      tx = ours('multi_steps', mesh)
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = make(mesh_2x4)
    fresh = nnx.as_pure(optimizer.opt_state)
    values = randomized(checkpoint.state_to_portable(fresh))
    nnx.update(
      optimizer.opt_state,
      nnx.state(checkpoint.state_from_portable(values, fresh)),
    )
    checkpoint.save_nnx(self.dir, 2, model, optimizer)
    model_b, optimizer_b = make(mesh_1x4)
    self.assertEqual(checkpoint.restore_nnx(self.dir, model_b, optimizer_b), 2)
    got = nnx.as_pure(optimizer_b.opt_state)
    chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, checkpoint.state_to_portable(got)), values
    )
    (layout,) = dmuon_jax.owner_layouts(got)
    self.assertEqual(layout.buffer_sizes, (4,))  # (the 1x4 mesh's 'shard')


if __name__ == '__main__':
  absltest.main()
