"""The examples and benchmarks run end to end (shortened)."""

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_script(args, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout,
                        check=False)
  if proc.returncode:
    raise AssertionError(f'{args} failed:\n{proc.stdout}\n{proc.stderr}')
  return proc.stdout


class ExamplesTest(absltest.TestCase):

  def test_train_lm_short_run_prints_a_table(self):
    out = run_script(['examples/train_lm.py', '--steps', '6',
                      '--eval-every', '3', '--batch', '32', '--width', '64',
                      '--layers', '2', '--data-bytes', '200000'])
    rows = [line for line in out.splitlines() if line.startswith('| ')]
    names = [r.split('|')[1].strip() for r in rows[1:]]
    self.assertEqual(names, ['adamw', 'optax.contrib.muon', 'dmuon'])
    for row in rows[1:]:
      train, val = (float(v) for v in row.split('|')[2:4])
      self.assertTrue(0 < train < 6 and 0 < val < 6, row)

  def test_optimizer_step_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(['examples/benchmarks/optimizer_step.py', '--quick',
                '--out-dir', out_dir])
    lines = pathlib.Path(out_dir, 'optimizer_step_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    self.assertGreaterEqual(len(records), 6)
    self.assertTrue(pathlib.Path(out_dir, 'optimizer_step_quick.md').exists())

  def test_train_step_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(['examples/benchmarks/train_step.py', '--quick',
                '--out-dir', out_dir])
    lines = pathlib.Path(out_dir, 'train_step_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    configs = {r['config']: r for r in records if r['config'] != 'summary'}
    self.assertEqual(set(configs), {'adamw_fsdp', 'adamw_fsdp_reshard',
                                    'optax_muon_fsdp', 'dmuon_dropin_fsdp',
                                    'dedicated_z2', 'dedicated_z3'})
    for name, r in configs.items():
      for key in ('median_ms', 'compile_s', 'collective_bytes_total',
                  'final_loss'):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0, (name, key))
    self.assertTrue(pathlib.Path(out_dir, 'train_step_quick.md').exists())

  def test_gram_ns_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(['examples/benchmarks/gram_ns.py', '--quick',
                '--out-dir', out_dir])
    lines = pathlib.Path(out_dir, 'gram_ns_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    part_a = [r for r in records if r['part'] == 'A']
    part_b = [r for r in records if r['part'] == 'B']
    self.assertEqual([r['ratio'] for r in part_a], [1, 2, 4, 8])
    self.assertLen(part_b, 8)  # T in (2, 4) x (column, row) x (tp, gather)
    for r in part_a:
      for variant in ('direct', 'gram'):
        for key in ('median_ms', 'predicted_flops', 'gflop_per_s',
                    'rel_diff_vs_f64'):
          v = r[variant][key]
          self.assertTrue(math.isfinite(v) and v > 0, (r['config'], key))
        self.assertLess(r[variant]['rel_diff_vs_f64'], 1e-4)
      self.assertTrue(math.isfinite(r['speedup_measured']))
    for r in part_b:
      for key in ('median_ms', 'flops_per_device', 'collective_bytes_total'):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0,
                        (r['config'], key))
      self.assertLess(r['rel_diff_tp_vs_gather'], 1e-4)
      gathered = r['collective_bytes_by_kind'].get('all-gather', 0)
      if r['variant'] == 'tp':
        self.assertEqual(gathered, 0, r['config'])
        self.assertGreater(r['collective_bytes_by_kind']['all-reduce'], 0)
      else:
        self.assertGreater(gathered, 0, r['config'])
    self.assertTrue(pathlib.Path(out_dir, 'gram_ns_quick.md').exists())


if __name__ == '__main__':
  absltest.main()
