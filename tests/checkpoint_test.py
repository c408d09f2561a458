"""Checkpoints that survive a mesh change, and a kill -9 mid-run."""

import functools
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from absl.testing import absltest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import checkpoint
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'resume_on_4x1',
  r'params_restore_without_the_dedication',
  r'params_only_restore',
  r'resume_on_one_device',
  r'DedicatedCheckpointTest.*resume_on_1x8',
  # compile-heavy: the README command runs it, the inner loop does not
  r'^MeshChangeTest::test_resume_on_1x8$',
)

AXES = ('replicate', 'shard')
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / 'examples' / 'checkpointed_train.py'


def make_opt(mesh, dims):
  return dmuon_jax.dmuon(
    0.02, weight_decay=0.01, muon_weight_dimension_numbers=dims, mesh=mesh
  )


@functools.cache
def step_fn(opt):
  # One trace per optimizer: a restored state has the trained one's types.

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch):
    grads = jax.grad(support.mean_loss)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def batch_at(i, mesh):
  batch = jnp.linspace(0.5, 1.5, 16) * (1 + 0.05 * i)
  if mesh is None:
    return jax.device_put(batch, jax.devices()[0])
  return jax.device_put(batch, NamedSharding(mesh, P()))


def train(opt, params, state, mesh, start, stop):
  step = step_fn(opt)
  for i in range(start, stop):
    params, state = step(params, state, batch_at(i, mesh))
  return params, state


def assert_resumed_close(test, actual, expected, label):
  """Per leaf max |a - b| / max |b| <= 1e-6 (printed: ``-s``)."""
  del test
  diff = max(
    support.max_rel_diff(a, b)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected))
  )
  print(f'{label}: max rel diff {diff:.3g}')
  support.assert_trees_max_rel_close(actual, expected, 1e-6)


def on_one_device(tree):
  """``tree`` committed to the first device, as a step's outputs are.

  Restored (like freshly initialized) one-device arrays are partly
  uncommitted; a jitted step's outputs are committed, so its second call
  would compile the program again.
  """
  return jax.device_put(tree, jax.devices()[0])


class MeshChangeTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    params, cls.dims = support.llama_like()
    cls.mesh = jax.make_mesh((2, 4), AXES)
    cls.opt = make_opt(cls.mesh, cls.dims)
    # From host memory: a transfer (from device 0, each leaf compiled a
    # reshard of its own).
    placed = jax.device_put(
      jax.tree.map(np.asarray, params),
      support.fsdp_shardings(params, cls.mesh),
    )
    state = cls.opt.init(placed)
    p10, s10 = train(cls.opt, placed, state, cls.mesh, 0, 10)
    cls.p10, cls.s10 = p10, s10
    checkpoint.save(cls.tmp.name, 10, p10, s10)
    p20, _ = train(cls.opt, p10, s10, cls.mesh, 10, 20)
    cls.expected = jax.tree.map(np.asarray, p20)
    cls.params_host = params

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_portable_round_trip_is_exact(self):
    portable = checkpoint.state_to_portable(self.s10)
    back = checkpoint.state_from_portable(portable, self.opt.init(self.p10))
    chex.assert_trees_all_equal(back, self.s10)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(self.s10)):
      if a.ndim:  # Scalars (counts) come back uncommitted, as from init.
        self.assertEqual(a.sharding, b.sharding)
    # Param-shaped momentum, sharded like the params.
    is_p = lambda x: isinstance(x, checkpoint.PortableDMuonState)
    (found,) = [x for x in jax.tree.leaves(portable, is_leaf=is_p) if is_p(x)]
    mu = found.mu
    self.assertEqual(mu['layers']['up'].shape, (3, 32, 48))
    self.assertTrue(
      mu['layers']['up'].sharding.is_equivalent_to(
        self.p10['layers']['up'].sharding, 3
      )
    )

  def _resume(self, shape, n_devices=None):
    if shape is None:
      mesh = None
      like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params_host
      )
    else:
      devices = jax.devices()[:n_devices] if n_devices else None
      mesh = jax.make_mesh(shape, AXES, devices=devices)
      like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=NamedSharding(mesh, P())
        ),
        self.params_host,
      )
    opt = make_opt(mesh, self.dims)
    step, params, state = checkpoint.restore(self.tmp.name, like, opt)
    self.assertEqual(step, 10)
    # The momentum itself is the same in param layout.
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state),
      checkpoint.state_to_portable(self.s10),
    )
    if mesh is None:
      params, state = on_one_device((params, state))
    params, _ = train(opt, params, state, mesh, 10, 20)
    assert_resumed_close(self, params, self.expected, f'resume on {shape}')

  # Saved on HSDP (2x4), resumed on pure FSDP (1x8), on DDP over 4 of the 8
  # devices (4x1: another device count) and on one device. (A 1x4 resume,
  # pure FSDP on 4 devices, ran the restore of 1x8 on 4x1's devices; it was
  # dropped, here and in DedicatedCheckpointTest: 7 s and 4 s of a compile
  # and 10 steps each. OrbaxManagerTest restores onto 1x4.)
  def test_resume_on_1x8(self):
    self._resume((1, 8))

  def test_resume_on_4x1(self):
    self._resume((4, 1), n_devices=4)

  def test_resume_on_one_device(self):
    self._resume(None)

  def test_params_only_restore(self):
    like = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params_host
    )
    step, params, state = checkpoint.restore(self.tmp.name, like, None)
    self.assertEqual(step, 10)
    self.assertIsNone(state)
    chex.assert_trees_all_equal(params, self.p10)


# Blocks of dedicated_test's model here (its default: 4): 2 blocks of 8
# Muon matrices, smaller programs for the five meshes' compiles.
BLOCKS = 2


def block_params():
  return support.block_params(blocks=BLOCKS)


def dedicated_setup(mesh, axis_names=None):
  """Dedicated Z3 (``dedicated_test``'s model, ``BLOCKS`` blocks) on
  ``mesh`` (None: 1 device), owners over ``axis_names`` (None: default).

  Returns the dedication, its optimizer and a train step
  ``step(dp, state) -> (dp, state)``.
  """
  ded = dmuon_jax.dedicate(block_params(), mesh, axis_names=axis_names)
  opt = dmuon_jax.dedicated_muon(ded, support.DEDICATED_LR, weight_decay=0.01)
  x = support.block_batch()

  def loss(dp, x):
    names = [f'layers_{i}' for i in range(BLOCKS)]
    x = ded.sequential(support.block_fn, names)(dp, x)
    return jnp.mean((x @ dp.rest['head']) ** 2)

  if mesh is None:

    @jax.jit
    @chex.assert_max_traces(n=1)
    def one_device(dp, state):
      grads = jax.grad(loss)(dp, x)
      updates, state = opt.update(grads, state, dp)
      return optax.apply_updates(dp, updates), state

    return ded, opt, one_device

  x = jax.device_put(x, NamedSharding(mesh, P(AXES)))
  step = support.explicit_step_fn(
    opt, mesh, opt.init(ded.to_dedicated(block_params())), loss, ded.specs()
  )
  return ded, opt, lambda dp, state: step(dp, state, x)[:2]


def run_steps(step, dp, state, n):
  for _ in range(n):
    dp, state = step(dp, state)
  return dp, state


class DedicatedCheckpointTest(absltest.TestCase):
  """Dedicated Z3 saved on 2x4 after 10 steps (params and momentum in param
  layout), restored on other meshes: 10 more steps equal 20 uninterrupted."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    mesh = jax.make_mesh((2, 4), AXES)
    ded, opt, step = dedicated_setup(mesh)
    dp = ded.to_dedicated(block_params())
    dp, state = run_steps(step, dp, opt.init(dp), 10)
    checkpoint.save(cls.tmp.name, 10, dp, state)
    cls.portable = jax.tree.map(np.asarray, checkpoint.state_to_portable(state))
    cls.ded, cls.opt, cls.dp, cls.state = ded, opt, dp, state
    dp, _ = run_steps(step, dp, state, 10)
    cls.expected = jax.tree.map(np.asarray, ded.to_params(dp))

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_portable_round_trip_is_exact(self):
    portable = checkpoint.state_to_portable(self.state)
    back = checkpoint.state_from_portable(portable, self.state)
    chex.assert_trees_all_equal(back, self.state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(self.state)):
      if a.ndim:
        self.assertEqual(a.sharding, b.sharding)
    is_p = lambda x: isinstance(x, checkpoint.PortableDMuonState)
    (found,) = [x for x in jax.tree.leaves(portable, is_leaf=is_p) if is_p(x)]
    self.assertEqual(
      found.mu['layers_0']['w3'].shape, (support.WIDTH, support.WIDTH)
    )
    # Only the Muon targets have momentum there.
    self.assertNotIn('scale', found.mu['layers_0'])

  def test_params_restore_without_the_dedication(self):
    # Params are saved in param layout: a drop-in run (or inference) reads
    # them with no dedication.
    like = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), block_params()
    )
    _, params, state = checkpoint.restore(self.tmp.name, like, None)
    self.assertIsNone(state)
    chex.assert_trees_all_equal(params, self.ded.to_params(self.dp))

  def test_restore_into_dedicated_params(self):
    # DedicatedParams as params_like give the layout, dtypes and placement
    # themselves (here of another mesh): no dedication= needed.
    ded, opt, _ = dedicated_setup(jax.make_mesh((1, 8), AXES))
    target = ded.to_dedicated(jax.tree.map(jnp.zeros_like, block_params()))
    got, dp, state = checkpoint.restore(self.tmp.name, target, opt)
    self.assertEqual(got, 10)
    self.assertEqual(dp.owned.layout, target.owned.layout)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(target)):
      self.assertEqual((a.dtype, a.sharding), (b.dtype, b.sharding))
    chex.assert_trees_all_equal(ded.to_params(dp), self.ded.to_params(self.dp))
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state), self.portable
    )

  def test_raw_state_of_the_old_size_one_layout_restores(self):
    # dmuon_jax 0.2's default owner axes on a (1, 8) mesh kept the size-1
    # 'replicate': layout dmuon_shard8_replicate1_751ae696 (its name, read
    # on that version), the keys of a state saved raw by orbax. The default
    # now leaves 'replicate' out (another layout, so orbax refuses the old
    # keys); axis_names naming it gives the old layout, whose raw state
    # restores and converts into the default one, bitwise.
    mesh = jax.make_mesh((1, 8), AXES)
    zeros = jax.tree.map(jnp.zeros_like, block_params())
    ded, opt, _ = dedicated_setup(mesh)
    old, old_opt, _ = dedicated_setup(mesh, axis_names=AXES)
    self.assertEqual(ded.buffer_axes, ('shard',))
    self.assertEqual(old.layout.name, 'dmuon_shard8_replicate1_751ae696')
    _, old_dp, old_state = checkpoint.restore(
      self.tmp.name, old.to_dedicated(zeros), old_opt
    )
    raw = {'dp': old_dp, 'state': old_state}
    with tempfile.TemporaryDirectory() as directory:
      with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(raw))
        mngr.wait_until_finished()
      like = abstract(raw)
      with ocp.CheckpointManager(directory) as mngr:
        raw = mngr.restore(1, args=ocp.args.StandardRestore(like))
    target = ded.to_dedicated(zeros)
    state = checkpoint.state_from_portable(
      checkpoint.state_to_portable(raw['state']), opt.init(target)
    )
    dp = ded.to_dedicated(old.to_params(raw['dp']))
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertEqual(layout, target.owned.layout)
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state), self.portable
    )
    chex.assert_trees_all_equal(ded.to_params(dp), self.ded.to_params(self.dp))

  def _resume(self, shape):
    mesh = (
      None
      if shape is None
      else jax.make_mesh(
        shape, AXES, devices=jax.devices()[: int(np.prod(shape))]
      )
    )
    ded, opt, step = dedicated_setup(mesh)
    like = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), block_params()
    )
    got, dp, state = checkpoint.restore(
      self.tmp.name, like, opt, dedication=ded
    )
    self.assertEqual(got, 10)
    self.assertIsInstance(dp, dmuon_jax.DedicatedParams)
    # The momentum in param layout is bitwise the saved one.
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state), self.portable
    )
    if mesh is None:
      dp, state = on_one_device((dp, state))
    dp, _ = run_steps(step, dp, state, 10)
    assert_resumed_close(
      self, ded.to_params(dp), self.expected, f'dedicated resume on {shape}'
    )

  # The meshes of MeshChangeTest's resumes (1x4: see there).
  def test_resume_on_1x8(self):
    self._resume((1, 8))

  def test_resume_on_4x1(self):
    self._resume((4, 1))

  def test_resume_on_one_device(self):
    self._resume(None)


def small_params():
  rng = np.random.default_rng(3)
  return {
    'layers_0': {'w': jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)},
    'layers_1': {'w': jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)},
    'b': jnp.zeros((32,), jnp.float32),
  }


def abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


class OrbaxManagerTest(absltest.TestCase):
  """A trainer's own ``ocp.CheckpointManager`` (legacy and ``args`` APIs)
  saves ``{'params', 'opt_state'}`` on 2x4 and restores on 1x4: exact
  through the portable form; a native state of another layout never comes
  back with zero momentum (orbax refuses it; ``partial_restore=True``
  raises, naming the conversion)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    mesh_2x4 = support.make_mesh((2, 4))
    cls.mesh_1x4 = support.make_mesh((1, 4))
    tree = jax.device_put(small_params(), NamedSharding(mesh_2x4, P()))
    opt = optax.MultiSteps(dmuon_jax.dmuon(0.02, mesh=mesh_2x4), 2)
    state = opt.init(tree)
    _, state = opt.update(support.grads_at(0, tree), state, tree)
    cls.state, cls.saved = state, checkpoint.state_to_portable(state)
    cls.native = {'params': tree, 'opt_state': state}
    cls.portable = {'params': tree, 'opt_state': cls.saved}
    cls.opt_1x4 = optax.MultiSteps(dmuon_jax.dmuon(0.02, mesh=cls.mesh_1x4), 2)
    cls.params_1x4 = abstract(
      jax.device_put(small_params(), NamedSharding(cls.mesh_1x4, P()))
    )
    # The state the trainer would start from (placed zeros).
    cls.target = cls.opt_1x4.init(cls.params_1x4)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def directory(self, name, tree, legacy):
    path = os.path.join(self.tmp.name, name)
    if legacy:
      with ocp.CheckpointManager(path, ocp.PyTreeCheckpointer()) as mngr:
        mngr.save(7, tree)
        mngr.wait_until_finished()
    else:
      with ocp.CheckpointManager(path) as mngr:
        mngr.save(7, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
    return path

  def check_exact(self, restored):
    opt_state = checkpoint.state_from_portable(
      restored['opt_state'], self.target
    )
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(opt_state), self.saved
    )
    (layout,) = dmuon_jax.owner_layouts(opt_state)
    self.assertEqual(layout.buffer_sizes, (4,))  # (the 1x4 mesh's 'shard')
    self.assertGreater(float(opt_state.mini_step), 0)  # MultiSteps' own
    return opt_state

  def test_portable_form_restores_exactly_args_api(self):
    path = self.directory('portable_args', self.portable, legacy=False)
    like = {
      'params': self.params_1x4,
      'opt_state': checkpoint.state_to_portable(self.target),
    }
    with ocp.CheckpointManager(path) as mngr:
      restored = mngr.restore(7, args=ocp.args.StandardRestore(like))
    self.check_exact(restored)

  def test_portable_form_restores_exactly_legacy_api(self):
    path = self.directory('portable_legacy', self.portable, legacy=True)
    like = {
      'params': self.params_1x4,
      'opt_state': checkpoint.state_to_portable(self.target),
    }
    with ocp.CheckpointManager(path, ocp.PyTreeCheckpointer()) as mngr:
      restored = mngr.restore(
        7,
        items=like,
        restore_kwargs={
          'restore_args': ocp.checkpoint_utils.construct_restore_args(like)
        },
      )
    self.check_exact(restored)

  def test_abstract_target_without_devices_is_refused(self):
    # jax.eval_shape keeps no devices: the portable target could not be
    # placed, so the conversion says what to pass instead.
    with self.assertRaisesRegex(ValueError, 'opt.init.params_like'):
      checkpoint.state_to_portable(
        jax.eval_shape(self.opt_1x4.init, self.params_1x4)
      )

  def test_native_state_into_another_layout_never_zero(self):
    fresh = {
      'params': self.params_1x4,
      'opt_state': self.opt_1x4.init(self.params_1x4),
    }
    (saved_layout,) = dmuon_jax.owner_layouts(self.state)
    (new_layout,) = dmuon_jax.owner_layouts(fresh['opt_state'])
    for legacy in (False, True):
      path = self.directory(f'native_{legacy}', self.native, legacy=legacy)
      # orbax itself refuses: the momentum keys name the layouts.
      with ocp.CheckpointManager(path) as mngr:
        with self.assertRaisesRegex(ValueError, saved_layout.name):
          mngr.restore(7, args=ocp.args.StandardRestore(fresh))
      # Following its hint restores the rest and not the momentum: the
      # stamp of the saved layout comes back and says so.
      for target in (fresh, abstract(fresh)):
        with ocp.CheckpointManager(path) as mngr:
          with self.assertRaisesRegex(
            ValueError,
            rf'(?s){new_layout.name}.*_{saved_layout.fingerprint}.*'
            r'dmuon_jax\.checkpoint.*state_from_portable',
          ):
            mngr.restore(
              7,
              args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(
                  target
                ),
                partial_restore=True,
              ),
            )


class IncompleteCheckpointTest(absltest.TestCase):
  def test_unfinished_saves_are_never_picked(self):
    with tempfile.TemporaryDirectory() as d:
      params = {'w': jnp.ones((4, 8)), 'b': jnp.zeros((8,))}
      opt = dmuon_jax.dmuon(0.02)
      state = opt.init(params)
      checkpoint.save(d, 3, params, state)
      # A step directory without orbax's commit marker (a save killed on a
      # file system without atomic rename) and orbax's temporary directory
      # of a save killed before its rename.
      (pathlib.Path(d) / '9' / 'default').mkdir(parents=True)
      (pathlib.Path(d) / '12.orbax-checkpoint-tmp-1234').mkdir()
      self.assertEqual(checkpoint.complete_steps(d), [3])
      like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
      )
      step, _, _ = checkpoint.restore(d, like, opt)
      self.assertEqual(step, 3)
      with self.assertRaises(FileNotFoundError):
        checkpoint.restore(d, like, opt, step=9)

  def test_no_checkpoint(self):
    with tempfile.TemporaryDirectory() as d:
      self.assertIsNone(checkpoint.restore(d, {}, None))


def run_example(args, **kwargs):
  return subprocess.Popen(
    [sys.executable, str(EXAMPLE), *args],
    env=support.subprocess_env(),
    cwd=str(ROOT),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    **kwargs,
  )


def wait_for(proc, pattern, timeout=120):
  """Reads ``proc``'s output until a line starts with ``pattern``."""
  deadline = time.time() + timeout
  lines = []
  while time.time() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    lines.append(line)
    if line.startswith(pattern):
      return lines
  raise AssertionError(f'no {pattern!r} in output:\n' + ''.join(lines))


@pytest.mark.slow
class KillTest(absltest.TestCase):
  def test_resume_after_sigkill_matches_uninterrupted_run(self):
    with tempfile.TemporaryDirectory() as d:
      ref_dir, run_dir = os.path.join(d, 'ref'), os.path.join(d, 'run')
      common = ['--steps', '12', '--every', '3']
      ref = None
      kills = []
      # Kill inside the second save (after orbax created its temporary
      # directory and wrote into it, before the commit), then in the middle
      # of training steps.
      for patterns in (('step 1 ', 'saving 6', '  writing into'), ('step 8',)):
        proc = run_example([*common, '--slow-save', '0.5', '--dir', run_dir])
        for pattern in patterns:
          wait_for(proc, pattern)
          if ref is None:
            # The uninterrupted run (its own directory, no slow saves: they
            # only open a window for the kills), alongside the killed ones
            # once the first has compiled the step (the shared compilation
            # cache then has it).
            ref = run_example(
              [*common, '--dir', ref_dir, '--out', os.path.join(d, 'ref.npz')]
            )
        tmp = [
          p.name for p in pathlib.Path(run_dir).iterdir() if 'tmp' in p.name
        ]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        kills.append((patterns[-1], checkpoint.complete_steps(run_dir), tmp))
      print('kills (when, complete steps, tmp dirs):', kills)
      # Killed mid-save: step 6's temporary directory was there, only step
      # 3 is complete.
      self.assertEqual(kills[0][1], [3])
      self.assertTrue(
        any(name.startswith('6.') for name in kills[0][2]), kills[0]
      )
      # Killed between steps: the restarted run saved step 6 again.
      self.assertEqual(kills[1][1], [3, 6])
      out, _ = ref.communicate(timeout=300)
      self.assertEqual(ref.returncode, 0, out)
      final = run_example(
        [*common, '--dir', run_dir, '--out', os.path.join(d, 'run.npz')]
      )
      out, _ = final.communicate(timeout=300)
      self.assertEqual(final.returncode, 0, out)
      self.assertIn('resumed from step', out)
      a, b = (
        np.load(os.path.join(d, 'run.npz')),
        np.load(os.path.join(d, 'ref.npz')),
      )
      chex.assert_trees_all_close(dict(a), dict(b), rtol=1e-6, atol=0)
      print(
        'max |resumed - uninterrupted|:',
        max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files),
      )


if __name__ == '__main__':
  absltest.main()
