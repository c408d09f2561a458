"""Checkpoints that survive a mesh change, and a kill -9 mid-run."""

import functools
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import _checkpoint
from tests import distributed_test

AXES = ('replicate', 'shard')
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / 'examples' / 'checkpointed_train.py'


def make_opt(mesh, dims):
  return dmuon_jax.dmuon(0.02, weight_decay=0.01,
                         muon_weight_dimension_numbers=dims, mesh=mesh)


@functools.cache
def step_fn(opt):

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(distributed_test.mean_loss)(params, batch)
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


def rel_diffs(actual, expected):
  """Per leaf: max |a - b| / max |b|."""
  return {jax.tree_util.keystr(p): float(
      np.max(np.abs(np.asarray(a) - np.asarray(b)))
      / max(np.max(np.abs(np.asarray(b))), 1e-30))
          for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                               jax.tree.leaves(expected))}


class MeshChangeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    params, cls.dims = distributed_test.llama_like()
    cls.mesh = jax.make_mesh((2, 4), AXES)
    cls.opt = make_opt(cls.mesh, cls.dims)
    placed = jax.device_put(
        params, distributed_test.fsdp_shardings(params, cls.mesh))
    state = cls.opt.init(placed)
    p10, s10 = train(cls.opt, placed, state, cls.mesh, 0, 10)
    cls.p10, cls.s10 = p10, s10
    _checkpoint.save(cls.tmp.name, 10, p10, s10, cls.opt)
    p20, _ = train(cls.opt, p10, s10, cls.mesh, 10, 20)
    cls.expected = jax.tree.map(np.asarray, p20)
    cls.params_host = params

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_portable_round_trip_is_exact(self):
    portable = _checkpoint.state_to_portable(self.opt, self.p10, self.s10)
    back = _checkpoint.state_from_portable(self.opt, self.p10, portable)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(self.s10)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      if a.ndim:  # Scalars (counts) come back uncommitted, as from init.
        self.assertEqual(a.sharding, b.sharding)
    # Param-shaped momentum, sharded like the params.
    is_p = lambda x: isinstance(x, _checkpoint.PortableDMuonState)
    (found,) = [x for x in jax.tree.leaves(portable, is_leaf=is_p)
                if is_p(x)]
    mu = found.mu
    self.assertEqual(mu['layers']['up'].shape, (3, 32, 48))
    self.assertEqual(mu['layers']['up'].sharding,
                     self.p10['layers']['up'].sharding)

  def _resume(self, shape, n_devices=None):
    if shape is None:
      mesh = None
      like = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params_host)
    else:
      devices = jax.devices()[:n_devices] if n_devices else None
      mesh = jax.make_mesh(shape, AXES, devices=devices)
      like = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=NamedSharding(mesh, P())),
          self.params_host)
    opt = make_opt(mesh, self.dims)
    step, params, state = _checkpoint.restore(self.tmp.name, like, opt)
    self.assertEqual(step, 10)
    # The momentum itself is the same in param layout.
    want = _checkpoint.state_to_portable(self.opt, self.p10, self.s10)
    got = _checkpoint.state_to_portable(opt, params, state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params, _ = train(opt, params, state, mesh, 10, 20)
    diffs = rel_diffs(params, self.expected)
    print(f'resume on {shape}: max rel diff {max(diffs.values()):.3g}')
    for path, d in diffs.items():
      self.assertLessEqual(d, 1e-6, path)

  def test_resume_on_1x8(self):
    self._resume((1, 8))

  def test_resume_on_1x4(self):
    self._resume((1, 4), n_devices=4)

  def test_resume_on_4x1(self):
    self._resume((4, 1), n_devices=4)

  def test_resume_on_one_device(self):
    self._resume(None)

  def test_params_only_restore(self):
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        self.params_host)
    step, params, state = _checkpoint.restore(self.tmp.name, like, None)
    self.assertEqual(step, 10)
    self.assertIsNone(state)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(self.p10)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class IncompleteCheckpointTest(absltest.TestCase):

  def test_unfinished_saves_are_never_picked(self):
    with tempfile.TemporaryDirectory() as d:
      params = {'w': jnp.ones((4, 8)), 'b': jnp.zeros((8,))}
      opt = dmuon_jax.dmuon(0.02)
      state = opt.init(params)
      _checkpoint.save(d, 3, params, state, opt)
      # A step directory without orbax's commit marker (a save killed on a
      # file system without atomic rename) and orbax's temporary directory
      # of a save killed before its rename.
      (pathlib.Path(d) / '9' / 'default').mkdir(parents=True)
      (pathlib.Path(d) / '12.orbax-checkpoint-tmp-1234').mkdir()
      self.assertEqual(_checkpoint.complete_steps(d), [3])
      like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          params)
      step, _, _ = _checkpoint.restore(d, like, opt)
      self.assertEqual(step, 3)
      with self.assertRaises(FileNotFoundError):
        _checkpoint.restore(d, like, opt, step=9)

  def test_no_checkpoint(self):
    with tempfile.TemporaryDirectory() as d:
      self.assertIsNone(_checkpoint.restore(d, {}, None))


def run_example(args, **kwargs):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.Popen(
      [sys.executable, str(EXAMPLE), *args], env=env, cwd=str(ROOT),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


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


class KillTest(absltest.TestCase):

  def test_resume_after_sigkill_matches_uninterrupted_run(self):
    with tempfile.TemporaryDirectory() as d:
      ref_dir, run_dir = os.path.join(d, 'ref'), os.path.join(d, 'run')
      common = ['--steps', '20', '--every', '3', '--slow-save', '0.5']
      ref = run_example([*common, '--dir', ref_dir, '--out',
                         os.path.join(d, 'ref.npz')])
      out, _ = ref.communicate(timeout=300)
      self.assertEqual(ref.returncode, 0, out)
      kills = []
      # Kill during the second save (inside the slow save: orbax's
      # temporary directory exists, the step is not committed), then in
      # the middle of training steps.
      for pattern in ('saving 6', 'step 11'):
        proc = run_example([*common, '--dir', run_dir])
        wait_for(proc, pattern)
        if pattern.startswith('saving'):
          time.sleep(0.2)
        tmp = [p.name for p in pathlib.Path(run_dir).iterdir()
               if 'tmp' in p.name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        kills.append((pattern, _checkpoint.complete_steps(run_dir), tmp))
      print('kills (when, complete steps, tmp dirs):', kills)
      self.assertEqual(kills[0][1], [3])
      final = run_example([*common, '--dir', run_dir, '--out',
                           os.path.join(d, 'run.npz')])
      out, _ = final.communicate(timeout=300)
      self.assertEqual(final.returncode, 0, out)
      self.assertIn('resumed from step', out)
      a, b = np.load(os.path.join(d, 'run.npz')), np.load(
          os.path.join(d, 'ref.npz'))
      self.assertEqual(sorted(a.files), sorted(b.files))
      for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=0, err_msg=k)
      print('max |resumed - uninterrupted|:',
            max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files))


if __name__ == '__main__':
  absltest.main()
