"""Checkpoints that cannot be lost quietly: each misuse raises, naming it.

Bad steps and another optimizer's state are rejected by ``save`` before
anything is written; ``restore`` tells a missing path (a typo) from an empty
directory (no checkpoint yet), and a damaged step from a target that does
not fit. One device, a tiny tree: each class saves once (``setUpClass``)
and corrupts copies of that directory.
"""

import gc
import glob
import os
import pathlib
import shutil
import tempfile
import time
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import absltest, parameterized
from flax import nnx

import dmuon_jax
from dmuon_jax import checkpoint

Damaged = checkpoint.CheckpointDamagedError

# When TensorStore fails on one array, orbax closes its event loop while the
# reads of the others are still in flight; their completions then raise
# "Event loop is closed" in TensorStore's threads (printed, not raised:
# orbax 0.12.8, tensorstore 0.1.86). Not an error of the restore.
pytestmark = pytest.mark.filterwarnings(
  'ignore::pytest.PytestUnraisableExceptionWarning'
)


def make_params(scale=1.0):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    'w': scale * jax.random.normal(k1, (8, 16), jnp.float32),
    'v': scale * jax.random.normal(k2, (16, 8), jnp.float32),
    'b': jnp.full((16,), 0.5 * scale, jnp.float32),
  }


OPT = dmuon_jax.dmuon(0.02)


def like(params):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def files_under(path):
  return sorted(
    os.path.relpath(p, path)
    for p in glob.glob(os.path.join(path, '**'), recursive=True)
    if os.path.isfile(p)
  )


class TempDirTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.tmp = pathlib.Path(tmp.name)


class SaveStepTest(TempDirTest):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = make_params()
    cls.state = OPT.init(cls.params)

  @parameterized.named_parameters(
    ('negative', -1, ValueError, 'step=-1 is negative'),
    ('float', 2.5, TypeError, 'step=2.5 (float)'),
    ('bool', True, TypeError, 'step=True (bool)'),
    ('str', '3', TypeError, "step='3' (str)"),
    ('numpy_float', np.float32(1.0), TypeError, 'float32 array of shape ()'),
    ('jax_float', jnp.asarray(1.0), TypeError, 'float32 array of shape ()'),
    ('vector', jnp.zeros((2,), jnp.int32), TypeError, 'shape (2,)'),
    ('numpy_bool', np.bool_(True), TypeError, 'bool array of shape ()'),
  )
  def test_bad_step_is_rejected_and_nothing_written(self, step, exc, says):
    fresh, existing = self.tmp / 'fresh', self.tmp / 'existing'
    existing.mkdir()
    for d in (fresh, existing):
      with self.assertRaises(exc) as cm:
        checkpoint.save(d, step, self.params, self.state)
      message = str(cm.exception)
      self.assertIn('checkpoint.save', message)
      self.assertIn(says, message)
      self.assertIn('non-negative', message)  # the fix
    self.assertFalse(fresh.exists())
    self.assertEqual(os.listdir(existing), [])

  @parameterized.named_parameters(
    ('numpy_int64', np.int64(3), 3),
    ('jax_int32_0d', jnp.asarray(4, jnp.int32), 4),
    ('jax_uint32_0d', jnp.asarray(5, jnp.uint32), 5),
    ('zero', 0, 0),
  )
  def test_integer_scalars_are_accepted(self, step, expected):
    out = checkpoint.save(self.tmp, step, self.params, self.state)
    self.assertEqual(out, self.tmp / str(expected))
    self.assertEqual(checkpoint.complete_steps(self.tmp), [expected])
    got, params, _ = checkpoint.restore(self.tmp, like(self.params), None)
    self.assertEqual(got, expected)
    self.assertIsInstance(got, int)
    chex.assert_trees_all_equal(params, self.params)

  def test_restore_rejects_a_bool_step(self):
    # True == 1: without the check it would pick step 1 as "step=True".
    checkpoint.save(self.tmp, 1, self.params, self.state)
    with self.assertRaisesRegex(TypeError, r'checkpoint.restore: step=True'):
      checkpoint.restore(self.tmp, like(self.params), None, step=True)


class SaveOptCheckTest(TempDirTest):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = make_params()

  def _rejected(self, state, opt):
    with self.assertRaises(ValueError) as cm:
      checkpoint.save(self.tmp / 'ck', 1, self.params, state, opt=opt)
    self.assertFalse((self.tmp / 'ck').exists())
    message = str(cm.exception)
    self.assertIn('opt_state is not a state of opt', message)
    self.assertIn('Nothing was written', message)
    return message

  def test_adam_state_is_rejected(self):
    message = self._rejected(optax.adam(1e-3).init(self.params), OPT)
    # Names leaves of both trees.
    self.assertIn('in opt_state but not in opt.init(params): ', message)
    self.assertIn('opt_state/0/mu/w', message)
    self.assertIn('not in opt_state: opt_state/inner_states/adam/', message)
    self.assertIn('(and 7 more)', message)

  def test_state_of_other_muon_routing_is_rejected(self):
    # Only 'w' on Muon there; OPT also routes 'v' to Muon.
    other = dmuon_jax.dmuon(0.02, predicate=lambda p, x: x.shape == (8, 16))
    message = self._rejected(other.init(self.params), OPT)
    self.assertIn(
      'opt_state/inner_states/adam/inner_state/1/0/mu/v: opt_state (16, 8) '
      'float32, opt.init(params) MaskedNode()',
      message,
    )
    self.assertIn(
      'not in opt_state: opt_state/inner_states/muon/inner_state/0/mu/v',
      message,
    )

  def test_adamw_state_for_adam_is_rejected(self):
    # Same leaves, one more EmptyState: only the empty nodes tell them apart.
    message = self._rejected(
      optax.adamw(1e-3).init(self.params), optax.adam(1e-3)
    )
    self.assertIn(
      'in opt_state but not in opt.init(params): opt_state/', message
    )

  def test_state_of_opt_is_accepted(self):
    state = OPT.init(self.params)
    checkpoint.save(self.tmp, 1, self.params, state, opt=OPT)
    _, _, back = checkpoint.restore(self.tmp, like(self.params), OPT)
    chex.assert_trees_all_equal(back, state)

  def test_dedicated_state_with_dedicated_params_is_accepted(self):
    params = {'layers_0': {'w': self.params['w']}, 'b': self.params['b']}
    ded = dmuon_jax.dedicate(params, None)
    opt = dmuon_jax.dedicated_muon(ded, 0.02)
    dp = ded.to_dedicated(params)
    checkpoint.save(self.tmp, 1, dp, opt.init(dp), opt=opt)
    self.assertEqual(checkpoint.complete_steps(self.tmp), [1])
    # Plain params for a dedicated optimizer: opt.init cannot take them.
    with self.assertRaisesRegex(ValueError, r'opt.init\(params\) failed'):
      checkpoint.save(self.tmp / 'x', 1, params, opt.init(dp), opt=opt)
    self.assertFalse((self.tmp / 'x').exists())

  def test_opt_that_is_not_an_optimizer(self):
    with self.assertRaisesRegex(TypeError, r'opt= takes the optimizer'):
      checkpoint.save(self.tmp, 1, self.params, OPT.init(self.params), opt=3)
    self.assertEqual(os.listdir(self.tmp), [])


class RestorePathTest(TempDirTest):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = make_params()

  def test_missing_path(self):
    missing = self.tmp / 'chekpoints'  # a typo
    with self.assertRaises(FileNotFoundError) as cm:
      checkpoint.restore(missing, like(self.params), OPT)
    message = str(cm.exception)
    self.assertIn(repr(str(missing)), message)
    self.assertIn('does not exist', message)
    self.assertIn('Pass the directory given to save', message)
    self.assertIn('os.makedirs', message)
    self.assertIn('os.path.isdir', message)
    self.assertFalse(missing.exists())

  def test_regular_file(self):
    f = self.tmp / 'ckpt.npz'
    f.write_bytes(b'not a checkpoint')
    with self.assertRaisesRegex(
      FileNotFoundError, r"ckpt.npz' is a file, not a checkpoint directory"
    ):
      checkpoint.restore(f, like(self.params), OPT)

  def test_empty_directory_is_no_checkpoint_yet(self):
    self.assertIsNone(checkpoint.restore(self.tmp, like(self.params), OPT))

  def test_directory_without_a_complete_step_is_no_checkpoint_yet(self):
    (self.tmp / '7.orbax-checkpoint-tmp-1').mkdir()
    (self.tmp / '9' / 'default').mkdir(parents=True)
    self.assertIsNone(checkpoint.restore(self.tmp, like(self.params), OPT))

  def test_step_directory_instead_of_root(self):
    step_dir = checkpoint.save(self.tmp, 4, self.params, OPT.init(self.params))
    with self.assertRaises(ValueError) as cm:
      checkpoint.restore(step_dir, like(self.params), OPT)
    self.assertIn('is the directory of step 4', str(cm.exception))
    self.assertIn(f'Pass its parent {str(self.tmp)!r}', str(cm.exception))

  def test_unknown_if_damaged(self):
    with self.assertRaisesRegex(ValueError, r"if_damaged='newest'"):
      checkpoint.restore(self.tmp, {}, None, if_damaged='newest')


# Files of a step written by save (orbax 0.12.8, OCDBT), relative to the
# step directory, and what is done to each.
CORRUPTIONS = (
  ('data_truncated', 'default/d/*', 'truncate'),
  ('data_garbage', 'default/d/*', 'garbage'),
  ('data_deleted', 'default/d/*', 'delete'),
  ('metadata_truncated', 'default/_METADATA', 'truncate'),
  ('metadata_garbage', 'default/_METADATA', 'garbage'),
  ('metadata_deleted', 'default/_METADATA', 'delete'),
  ('manifest_truncated', 'default/manifest.ocdbt', 'truncate'),
  ('manifest_garbage', 'default/manifest.ocdbt', 'garbage'),
  ('manifest_deleted', 'default/manifest.ocdbt', 'delete'),
  ('sharding_garbage', 'default/_sharding', 'garbage'),
  ('array_metadatas_garbage', 'default/array_metadatas/process_0', 'garbage'),
)


def corrupt(step_dir, pattern, how):
  """Corrupts the one file of ``step_dir`` matching ``pattern``."""
  (path,) = glob.glob(os.path.join(step_dir, pattern))
  data = pathlib.Path(path).read_bytes()
  if how == 'truncate':
    pathlib.Path(path).write_bytes(data[: len(data) // 2])
  elif how == 'garbage':
    pathlib.Path(path).write_bytes(b'\x00garbage{{{' * 3)
  else:
    os.remove(path)
  return pathlib.Path(path)


class DamagedCheckpointTest(TempDirTest):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.src = tempfile.TemporaryDirectory()
    cls.params = {1: make_params(1.0), 2: make_params(2.0)}
    state = OPT.init(cls.params[1])
    # Step 2's state: every leaf changed (the layout stamp, data that
    # says which layout wrote the momentum, then says none; a restore gives
    # the target's own stamp, so the states are compared in portable form).
    cls.states = {1: state, 2: jax.tree.map(lambda x: x + 1, state)}
    for step in (1, 2):
      checkpoint.save(cls.src.name, step, cls.params[step], cls.states[step])

  @classmethod
  def tearDownClass(cls):
    cls.src.cleanup()
    # The coroutines orbax never awaited (kept by the errors' tracebacks)
    # are reported when collected: here, not at the end of the session.
    gc.collect()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.dir = self.tmp / 'ckpt'
    shutil.copytree(self.src.name, self.dir)
    # Let the reads orbax left in flight end inside this test (see
    # pytestmark), not in a later one.
    self.addCleanup(time.sleep, 0.05)

  def restore(self, **kwargs):
    return checkpoint.restore(self.dir, like(self.params[1]), OPT, **kwargs)

  def test_the_files_corrupted_here_are_the_ones_save_writes(self):
    # If orbax changes its layout, CORRUPTIONS must follow.
    files = files_under(self.dir / '2')
    for _, pattern, _ in CORRUPTIONS:
      self.assertLen(glob.glob(str(self.dir / '2' / pattern)), 1, pattern)
    self.assertIn('_CHECKPOINT_METADATA', files)

  @parameterized.named_parameters(*CORRUPTIONS)
  def test_damaged_latest_step_raises(self, pattern, how):
    path = corrupt(self.dir / '2', pattern, how)
    with self.assertRaises(Damaged) as cm:
      self.restore()
    e = cm.exception
    self.assertIsInstance(e, ValueError)
    message = str(e)
    self.assertIn('step 2 ', message)
    self.assertIn('is damaged', message)
    self.assertIn(str(path), message)
    self.assertIn("if_damaged='older'", message)  # step 1 is there
    self.assertNotIn('params_like', message)
    self.assertNotIn('does not fit', message)
    self.assertEqual((e.step, e.file, e.directory), (2, path, self.dir))
    self.assertIsNotNone(e.__cause__)  # orbax's error, chained

  @parameterized.named_parameters(
    ('data_truncated', 'default/d/*', 'truncate'),
    ('metadata_garbage', 'default/_METADATA', 'garbage'),
    ('array_metadatas_garbage', 'default/array_metadatas/process_0', 'garbage'),
  )
  def test_older_falls_back_with_a_warning(self, pattern, how):
    path = corrupt(self.dir / '2', pattern, how)
    with self.assertWarnsRegex(UserWarning, r'step 2 is damaged') as cm:
      step, params, state = self.restore(if_damaged='older')
    self.assertIn(str(path), str(cm.warning))
    self.assertEqual(step, 1)
    chex.assert_trees_all_equal(params, self.params[1])
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state),
      checkpoint.state_to_portable(self.states[1]),
    )

  def test_older_restores_the_latest_when_it_is_intact(self):
    step, params, state = self.restore(if_damaged='older')
    self.assertEqual(step, 2)
    chex.assert_trees_all_equal(params, self.params[2])
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state),
      checkpoint.state_to_portable(self.states[2]),
    )

  def test_explicit_step_never_falls_back(self):
    corrupt(self.dir / '2', 'default/_METADATA', 'garbage')
    with self.assertRaisesRegex(Damaged, r'step 2 .* is damaged'):
      self.restore(step=2, if_damaged='older')
    step, _, _ = self.restore(step=1)
    self.assertEqual(step, 1)

  def test_older_raises_when_every_step_is_damaged(self):
    corrupt(self.dir / '2', 'default/_METADATA', 'garbage')
    corrupt(self.dir / '1', 'default/d/*', 'truncate')
    with self.assertWarns(UserWarning):
      with self.assertRaises(Damaged) as cm:
        self.restore(if_damaged='older')
    message = str(cm.exception)
    self.assertIn('every complete step', message)
    self.assertIn('step 2: ', message)
    self.assertIn('step 1: ', message)
    self.assertIn('_METADATA', message)

  def test_damaged_only_step_says_there_is_no_other(self):
    shutil.rmtree(self.dir / '1')
    corrupt(self.dir / '2', 'default/_METADATA', 'garbage')
    with self.assertRaisesRegex(Damaged, r'There is no other complete step'):
      self.restore()

  def test_a_target_that_does_not_fit_is_not_damage(self):
    wrong = dict(like(self.params[1]), w=jax.ShapeDtypeStruct((8, 24), 'f4'))
    with self.assertRaises(ValueError) as cm:
      checkpoint.restore(self.dir, wrong, OPT)
    self.assertNotIsInstance(cm.exception, Damaged)
    self.assertIn('does not fit the params', str(cm.exception))
    self.assertIn('params/w: saved (8, 16), target (8, 24)', str(cm.exception))

  def test_unread_step_metadata_is_not_damage(self):
    # orbax never reads a step's _CHECKPOINT_METADATA back for a restore
    # (nor for the next save): the data is intact, so it restores.
    (self.dir / '2' / '_CHECKPOINT_METADATA').write_bytes(b'garbage{{')
    step, params, state = self.restore()
    self.assertEqual(step, 2)
    chex.assert_trees_all_equal(params, self.params[2])
    chex.assert_trees_all_equal(
      checkpoint.state_to_portable(state),
      checkpoint.state_to_portable(self.states[2]),
    )


class NnxTest(TempDirTest):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    cls.optimizer = nnx.Optimizer(cls.model, OPT, wrt=nnx.Param)

  def test_bad_step_is_rejected_and_nothing_written(self):
    with self.assertRaisesRegex(TypeError, r'checkpoint.save_nnx: step=2.5'):
      checkpoint.save_nnx(self.tmp, 2.5, self.model, self.optimizer)
    with self.assertRaisesRegex(ValueError, r'save_nnx: step=-2 is negative'):
      checkpoint.save_nnx(self.tmp, -2, self.model, self.optimizer)
    self.assertEqual(os.listdir(self.tmp), [])

  def test_missing_path(self):
    missing = self.tmp / 'nope'
    with self.assertRaisesRegex(
      FileNotFoundError, r'checkpoint.restore_nnx: .*nope.* does not exist'
    ):
      checkpoint.restore_nnx(missing, self.model, self.optimizer)

  def test_step_counter_as_step_and_the_state_check_passes(self):
    # optimizer.step[...] is a 0-d uint32 array; save_nnx checks the state
    # against optimizer.tx (nnx.State containers vs a pure dict).
    step = self.optimizer.step[...]
    checkpoint.save_nnx(self.tmp, step, self.model, self.optimizer)
    with warnings.catch_warnings(record=True) as caught:
      # (pyproject ignores flax's DeprecationWarnings; users may not.)
      warnings.simplefilter('always', DeprecationWarning)
      got = checkpoint.restore_nnx(self.tmp, self.model, self.optimizer)
    self.assertEqual(got, int(step))
    # No deprecated flax API (the '.value' setter of the step counter).
    self.assertEqual(
      [str(w.message) for w in caught if w.category is DeprecationWarning], []
    )

  def test_state_of_another_optimizer_is_rejected(self):
    other = nnx.Optimizer(self.model, optax.adam(1e-3), wrt=nnx.Param)
    other.tx = OPT  # the state of adam, saved as dmuon's
    with self.assertRaisesRegex(ValueError, r'opt_state is not a state of'):
      checkpoint.save_nnx(self.tmp, 1, self.model, other)
    self.assertEqual(os.listdir(self.tmp), [])


if __name__ == '__main__':
  absltest.main()
