"""examples/multihost.py: 2 processes x 4 devices vs 1 process x 8 devices.

Every run is a fresh launcher process (its children call
``jax.distributed.initialize``), so nothing here touches this process's JAX.
Two launches (``--mode both``: each process trains drop-in, then dedicated)
serve all four comparisons; the model has 1 block of 8 Muon matrices (the
script's default: 4 blocks), so each mode's step compiles a smaller program.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import chex
import jax
import numpy as np
import pytest
from absl.testing import absltest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from tests import support

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'examples', 'multihost.py')
MODES = ('dropin', 'dedicated')
TOPOLOGIES = ((2, 4), (1, 8))  # (processes, local devices)
MESH = '2,4'  # the same global mesh in every run
# 3 steps, not the script's 10: the same checks (2 processes equal 1 after
# several steps, the loss falls, the checkpoints); the set-up's children
# took 27.2 s of CPU instead of 31.8 and 33.2 (side by side).
STEPS = 3
BLOCKS = 1
RTOL = 1e-6
FAIL_BOUND_S = 60


def launch(out_dir, processes, devices, mode, *extra):
  return subprocess.Popen(
    [
      sys.executable,
      SCRIPT,
      '--processes',
      str(processes),
      '--local-devices',
      str(devices),
      '--mode',
      mode,
      '--mesh',
      MESH,
      '--steps',
      str(STEPS),
      '--blocks',
      str(BLOCKS),
      '--out-dir',
      out_dir,
      '--timeout',
      '300',
      *extra,
    ],
    env=support.subprocess_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


class MultihostTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    # Both launches at once: the machine's cores are shared anyway, and
    # each run is mostly compilation.
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.results, start = {}, time.time()
    # One coordinator port per launch, both picked while both are held: two
    # launches that each asked the kernel for a free port could be handed
    # the same one, and the children of both then register at one
    # coordinator (seen once: "Aborted connect attempt as there is a
    # request from a newer incarnation", child 0 killed).
    held = [socket.socket() for _ in TOPOLOGIES]
    for s in held:
      s.bind(('127.0.0.1', 0))
    ports = [s.getsockname()[1] for s in held]
    for s in held:
      s.close()
    procs = {
      topo: launch(
        cls.out_dir(topo),
        *topo,
        'both',
        '--checkpoint-dir',
        os.path.join(cls.tmp.name, f'ckpt_p{topo[0]}'),
        '--port',
        str(port),
      )
      for topo, port in zip(TOPOLOGIES, ports)
    }
    for topo, proc in procs.items():
      out, err = proc.communicate(timeout=400)
      cls.results[topo] = (proc.returncode, out, err)
    cls.seconds = time.time() - start

  @classmethod
  def out_dir(cls, topo):
    return os.path.join(cls.tmp.name, f'p{topo[0]}')

  @classmethod
  def checkpoint_dir(cls, mode, topo):
    # --mode both saves each mode's checkpoint under its own name.
    return os.path.join(cls.tmp.name, f'ckpt_p{topo[0]}', mode)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def assert_launched(self, topo):
    code, out, err = self.results[topo]
    self.assertEqual(code, 0, f'{topo}:\n{out}\n{err[-3000:]}')
    # The parent's checks of both modes (the loss falls) passed.
    for mode in MODES:
      self.assertIn(f'{mode} loss falls', out)

  def load(self, mode, topo):
    self.assert_launched(topo)
    path = os.path.join(self.out_dir(topo), f'{mode}_p{topo[0]}xd{topo[1]}.npz')
    with np.load(path) as f:
      return {k: f[k] for k in f.files if k != 'seconds'}

  def check_mode(self, mode):
    multi, single = (self.load(mode, topo) for topo in TOPOLOGIES)
    self.assertEqual(sorted(multi), sorted(single))
    self.assertLen(multi['losses'], STEPS)
    self.assertLess(multi['losses'][-1], multi['losses'][0])  # it trains
    self.assertLen(multi, 1 + BLOCKS * (8 + 1) + 1)  # losses, all params
    diffs = {k: support.max_rel_diff(multi[k], single[k]) for k in multi}
    print(
      f'{mode}: max rel diff {max(diffs.values()):.3g} '
      f'(launches together {self.seconds:.0f} s)'
    )
    for k in multi:  # elementwise, each array in its own largest unit
      chex.assert_trees_all_close(
        multi[k],
        single[k],
        rtol=RTOL,
        atol=RTOL * np.max(np.abs(single[k])),
        custom_message=k,
      )

  def test_dropin_two_processes_match_one(self):
    self.check_mode('dropin')

  def test_dedicated_two_processes_match_one(self):
    self.check_mode('dedicated')

  def restore_on_1x8(self, mode, topo):
    """The run's checkpoint, restored in this (single) process on 1x8."""
    self.assert_launched(topo)
    spec = importlib.util.spec_from_file_location('multihost', SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    params = example.init_params(BLOCKS)
    mesh = jax.make_mesh((1, 8), ('replicate', 'shard'))
    like = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P())
      ),
      params,
    )
    ded = None
    if mode == 'dropin':
      opt = dmuon_jax.dmuon(example.LR, mesh=mesh)
    else:
      ded = dmuon_jax.dedicate(params, mesh)
      opt = dmuon_jax.dedicated_muon(ded, learning_rate=example.LR)
    step, params, state = dmuon_jax.checkpoint.restore(
      self.checkpoint_dir(mode, topo), like, opt, dedication=ded
    )
    self.assertEqual(step, STEPS)
    portable = dmuon_jax.checkpoint.state_to_portable(state)
    if ded is not None:
      params = ded.to_params(params)
    return params, portable

  def test_checkpoints_of_two_processes_restore_in_one(self):
    # Saved by 2 processes x 4 devices (each writing its shards), restored
    # in this process: the params are the run's final params, and params
    # and momentum equal those saved by the 1-process run.
    for topo in TOPOLOGIES:
      # Every process also restored each mode's checkpoint right after
      # saving it (onto the run's own mesh) and found it identical to its
      # trained state (else it exits nonzero: assert_launched).
      out = self.results[topo][1]
      self.assertEqual(
        out.count(f'checkpoint of step {STEPS} restored identical'),
        len(MODES) * topo[0],
        f'{topo}:\n{out}',
      )
    for mode in MODES:
      multi, single = (self.restore_on_1x8(mode, topo) for topo in TOPOLOGIES)
      final = self.load(mode, TOPOLOGIES[0])
      chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, multi[0]),
        jax.tree_util.tree_map_with_path(
          lambda path, _, final=final: final[
            'params' + jax.tree_util.keystr(path)
          ],
          multi[0],
        ),
      )
      leaves = jax.tree.leaves(multi)
      self.assertGreater(len(leaves), 2 * BLOCKS * 8)  # params + momentum
      diff = max(
        support.max_rel_diff(a, b)
        for a, b in zip(leaves, jax.tree.leaves(single))
      )
      print(f'{mode}: checkpoint of 2 processes vs 1: max rel diff {diff:.3g}')
      support.assert_trees_max_rel_close(multi, single, RTOL)

  def test_failed_child_shuts_down_cleanly(self):
    with tempfile.TemporaryDirectory() as out_dir:
      start = time.time()
      proc = launch(out_dir, 2, 4, 'dedicated', '--fail-at-start', '1')
      try:
        out, err = proc.communicate(timeout=FAIL_BOUND_S)
      except subprocess.TimeoutExpired:
        proc.kill()
        self.fail(f'launcher still running after {FAIL_BOUND_S} s')
      seconds = time.time() - start
      self.assertNotEqual(proc.returncode, 0)
      self.assertLess(seconds, FAIL_BOUND_S)
      self.assertIn('child 1 failed', err)
      self.assertIn('failing at start on request', err)  # its stderr tail
      with open(os.path.join(out_dir, 'pids.json')) as f:
        pids = json.load(f)
      self.assertLen(pids, 2)
      self.assertIn(f'child 0 pid {pids[0]}', out)
      for pid in pids:
        with self.assertRaises(ProcessLookupError, msg=f'pid {pid} alive'):
          os.kill(pid, 0)
      print(f'failed launch exited {proc.returncode} in {seconds:.1f} s')


if __name__ == '__main__':
  absltest.main()
