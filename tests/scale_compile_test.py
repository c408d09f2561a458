"""Compile-only at 64 simulated devices: eval_shape init, the update's routes;
the scale study's lone all-to-all rows on 8."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
from absl.testing import absltest

from tests import support

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


class EvalShapeAtScaleTest(absltest.TestCase):
  def test_abstract_state_compiles_to_the_predicted_routes(self):
    proc = subprocess.run(
      [
        sys.executable,
        str(ROOT / 'tests/workers/eval_shape_at_scale.py'),
        '--devices',
        '64',
        # One layer of 7 matrices at d=128 (the worker's default: 4 at
        # d=512): as many devices, a smaller program to compile.
        '--layers',
        '1',
        '--d-model',
        '128',
        '--d-ff',
        '384',
      ],
      capture_output=True,
      text=True,
      env=support.subprocess_env(),
      timeout=600,
      check=False,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    rows = [
      json.loads(line)
      for line in proc.stdout.splitlines()
      if line.startswith('{')
    ]
    self.assertLen(rows, 2)  # Explicit and Auto (with param_specs)
    for row in rows:
      print(row)
      self.assertTrue(row['param_entries_known'], row)
      kinds = row['bytes_by_kind']
      # The sharded gradients are never gathered whole: the owner routes
      # are all-to-alls over 'shard', and the results' way back ends with
      # an all-gather over 'replicate' (of the rows' blocks, whose devices
      # hold equal shards), as the layout predicts them.
      for kind in ('all-to-all', 'all-gather'):
        want = row['predicted'][kind]
        self.assertGreater(want, 0)
        self.assertBetween(kinds[kind] / want, 0.95, 1.05)
      # Besides them only scalar flags (non-finite policy) are reduced.
      self.assertLess(kinds.get('all-reduce', 0), 1024)
    explicit = rows[0]
    self.assertIn('Explicit', explicit['mesh_kind'])
    # On an Explicit mesh jax.eval_shape keeps the buffers' shardings:
    # those eager init gives.
    self.assertEqual(
      explicit['eval_shape_buffer_specs'], explicit['layout_buffer_specs']
    )


class LoneAllToAllTest(absltest.TestCase):
  def test_two_stages_equal_the_direct_all_to_all(self):
    # examples/benchmarks/scale.py's a2a rows (docs/benchmarks/scale.md):
    # on a 2 x 4 mesh the two-stage exchanges (over 'shard', then over
    # 'replicate') give the direct all-to-all's result; XLA:CPU compiles
    # the direct one to a kernel per peer.
    path = ROOT / 'examples/benchmarks/scale.py'
    spec = importlib.util.spec_from_file_location('scale_study', path)
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    row = scale.a2a_row(None, 8, 4)
    self.assertTrue(row['two_stage_equal'], row)
    # The update's way back: an all-to-all over 'shard' and an all-gather
    # over 'replicate' (devices of one 'shard' coordinate hold equal
    # shards), the same result.
    self.assertTrue(row['gather_equal'], row)
    self.assertEqual(row['direct_all_to_alls'], 1, row)
    self.assertEqual(row['two_stage_all_to_alls'], 2, row)
    self.assertEqual(row['gather_all_to_alls'], 1, row)
    self.assertGreaterEqual(row['direct_kernels'], 8, row)


if __name__ == '__main__':
  absltest.main()
