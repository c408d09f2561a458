"""The GPU benchmark (CPU smoke mode) and the Linen example run end to end."""

import math
import pathlib
import re
import tempfile

import pytest
from absl.testing import absltest

from tests.support import read_rows, run_script

pytestmark = pytest.mark.slow


class GpuBenchmarkTest(absltest.TestCase):
  def check_smoke_rows(self, rows):
    for r in rows:
      for key in ('backend', 'device_kind', 'jax', 'date'):
        self.assertIn(key, r)
      self.assertEqual(r['backend'], 'cpu')
    ns = [r for r in rows if r['part'] == 'ns']
    self.assertTrue(ns)
    for r in ns:
      self.assertEqual(r['status'], 'ok', r)
      for key in ('median_ms', 'flops', 'tflop_per_s'):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0, (r, key))
      if r['algorithm'] != 'matmul':
        self.assertTrue(
          math.isfinite(r['fraction_of_matmul'])
          and r['fraction_of_matmul'] > 0,
          r,
        )
    seen = {(r['algorithm'], r['dtype']) for r in ns}
    for algo in ('matmul', 'direct', 'gram'):
      for dtype in ('bfloat16', 'float32'):
        self.assertIn((algo, dtype), seen)
    steps = [r for r in rows if r['part'] == 'optimizer_step']
    self.assertLen(steps, 1)
    step = steps[0]
    self.assertEqual(step['status'], 'ok', step)
    self.assertEqual(step['layers'], 1)  # the smoke tree's
    self.assertTrue(step['params_finite'])
    for key in ('median_ms', 'ns_flops', 'ns_tflop_per_s'):
      self.assertTrue(math.isfinite(step[key]) and step[key] > 0, key)

  def test_gpu_sh_falls_back_to_smoke_on_cpu(self):
    out_dir = pathlib.Path(tempfile.mkdtemp())
    out = run_script(
      # One of the smoke run's two NS shapes (every algorithm and dtype):
      # gpu.sh passes the flags after out_dir on to gpu_ns.py.
      ['examples/benchmarks/gpu.sh', str(out_dir), '--shapes', '64x256'],
      executable=('bash',),
    )
    self.assertIn('smoke run', out)
    rows = read_rows(out_dir / 'gpu_ns_cpu_smoke.json')
    self.check_smoke_rows(rows)
    self.assertTrue(all(r['smoke'] for r in rows))
    md = (out_dir / 'gpu_ns_cpu_smoke.md').read_text()
    self.assertIn('| 64x256 | 1 | float32 |', md)
    # Owner groups (k = 2) and TP on 8 CPU devices: optax's numbers, no
    # collective inside a conditional.
    groups = {
      r['case']: r for r in read_rows(out_dir / 'gpu_groups_cpu_smoke.json')
    }
    self.assertEqual(set(groups), {'groups', 'tp'})
    for case, row in groups.items():
      self.assertEqual(row['status'], 'ok', row)
      self.assertEqual(row['devices'], 8)
      self.assertLess(row['max_rel_error'], 1e-5, case)
      self.assertGreater(row['collectives'], 0, case)
      self.assertEqual(row['in_conditional'], 0, case)
    # The groups' Gram exchange runs point to point within each group
    # (collective-permutes, no reduce-scatter over all of 'shard'), the
    # bytes the plan predicts; the routes' all-to-alls as the layout says.
    # Measured: 33,280 B (7 groups of 2 on 8 devices: one round each way
    # per restart window, 2 windows x 2 directions x the 64x64 Gram's
    # packed triangle, 2,080 float32).
    row = groups['groups']
    self.assertGreater(row['groups'], 0)
    kinds = row['bytes_by_kind']
    self.assertNotIn('reduce-scatter', kinds)
    self.assertEqual(row['predicted_group_exchange'], 2 * 2 * 2080 * 4)
    self.assertEqual(kinds['collective-permute'], 2 * 2 * 2080 * 4)
    for kind, want in row['predicted_routes'].items():
      self.assertAlmostEqual(kinds.get(kind, 0.0), want, delta=0.05 * want)
    # The dedicated step under plain nnx.jit: Muon bytes at the floor, one
    # reduce-scatter per gather group, none in a conditional.
    route = read_rows(out_dir / 'gpu_route_cpu_smoke.json')
    self.assertEqual([r['mode'] for r in route], ['Z2', 'Z3'])
    for row in route:
      self.assertEqual(row['status'], 'ok', row)
      self.assertAlmostEqual(row['muon_over_floor'], 1.0, delta=0.05)
      self.assertIn('reduce-scatter', row['kinds'])
      self.assertEqual(row['in_conditional'], 0)


class TrainLinenTest(absltest.TestCase):
  def test_short_run_learns(self):
    out = run_script(
      [
        'examples/train_linen.py',
        '--steps',
        '30',
        '--batch',
        '16',
        '--width',
        '64',
        '--seq',
        '32',
        '--data-bytes',
        '300000',
        '--log-every',
        '10',
      ]
    )
    losses = [
      float(v)
      for v in re.findall(r'^step +\d+ +loss ([\d.na]+)', out, re.MULTILINE)
    ]
    self.assertLen(losses, 4, out)  # steps 1, 10, 20, 30
    self.assertTrue(all(math.isfinite(v) for v in losses), losses)
    self.assertLess(losses[-1], losses[0])
    final = re.search(
      r'^final: train loss ([\d.]+) +val loss ([\d.]+)', out, re.MULTILINE
    )
    self.assertIsNotNone(final, out)
    self.assertTrue(all(0 < float(v) < 6 for v in final.groups()), out)
    # The script's own checks ran and held (it exits 1 if one fails): the
    # val loss is below the context-free floor (measured 2.50 against 3.02).
    (checks,) = re.findall(r'^checks: (.*)$', out, re.MULTILINE)
    self.assertIn('< context-free floor', checks)
    self.assertEqual(checks.count(': yes'), 2, checks)


if __name__ == '__main__':
  absltest.main()
