"""The examples and benchmarks run end to end (shortened)."""

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_script(args, timeout=600, executable=(sys.executable,)):
  """Runs a repo script in a fresh process (its own device count)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable)
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run(list(executable) + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout,
                        check=False)
  if proc.returncode:
    raise AssertionError(f'{args} failed:\n{proc.stdout}\n{proc.stderr}')
  return proc.stdout


class ExamplesTest(absltest.TestCase):

  def test_train_lm_short_run_prints_a_table(self):
    out_dir = pathlib.Path(tempfile.mkdtemp())
    out = run_script(['examples/train_lm.py', '--steps', '12',
                      '--eval-every', '4', '--batch', '16', '--context',
                      '16', '--width', '32', '--layers', '1', '--heads',
                      '2', '--eval-batch', '16', '--data-bytes', '200000',
                      '--out-dir', str(out_dir)])
    labels = ['adamw', 'optax.contrib.muon', 'dmuon (drop-in)',
              'dmuon dedicated Z3']
    rows = [line for line in out.splitlines() if line.startswith('| ')]
    self.assertEqual([r.split('|')[1].strip() for r in rows[1:]], labels)
    self.assertIn('checks: ', out)
    result = json.loads((out_dir / 'train_lm.json').read_text())
    logs = result['optimizers']
    self.assertEqual([log['label'] for log in logs.values()], labels)
    for name, log in logs.items():
      self.assertEqual(log['step'], [4, 8, 12], name)
      for key in ('train_loss', 'val_loss', 'time_s', 'step_losses'):
        self.assertTrue(all(math.isfinite(v) for v in log[key]), (name, key))
      self.assertLen(log['step_losses'], 12)
      self.assertGreater(log['train_loss'][0], log['train_loss'][-1], name)
      self.assertGreater(log['val_loss'][0], log['val_loss'][-1], name)
    self.assertLess(result['max_abs_diff_dmuon_optax_muon'], 1e-3)
    png = (out_dir / 'train_lm.png').read_bytes()
    self.assertGreater(len(png), 1000)
    self.assertEqual(png[:8], b'\x89PNG\r\n\x1a\n')
    table = (out_dir / 'train_lm.md').read_text()
    for label in labels:
      self.assertIn(f'| {label} |', table)

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
                                    'adamw_fsdp_jit', 'optax_muon_fsdp',
                                    'dmuon_dropin_fsdp', 'dedicated_z2',
                                    'dedicated_z3'})
    for name, r in configs.items():
      for key in ('median_ms', 'compile_s', 'collective_bytes_total',
                  'final_loss'):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0, (name, key))
    # Every byte target holds at this size too: dedicated Z2/Z3 against
    # FSDP AdamW, and drop-in dmuon = plain-jit AdamW + its predicted owner
    # all-to-alls (within 5%).
    (summary,) = [r for r in records if r['config'] == 'summary']
    for t in summary['targets']:
      self.assertTrue(t['met'], t)
    (dropin,) = [t for t in summary['targets']
                 if t['config'] == 'dmuon_dropin_fsdp']
    self.assertGreater(dropin['predicted']['all-to-all'], 0)
    # The Muon configs agree on the loss (the same algorithm).
    losses = [configs[c]['final_loss'] for c in (
        'optax_muon_fsdp', 'dmuon_dropin_fsdp', 'dedicated_z2',
        'dedicated_z3')]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-4)
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

  def test_scaling_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(['examples/benchmarks/scaling.py', '--quick',
                '--out-dir', out_dir], timeout=300)
    lines = pathlib.Path(out_dir, 'scaling_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    rows = [r for r in records if r['config'] != 'summary']
    self.assertEqual(sorted({r['devices'] for r in rows}), [1, 2, 4, 8])
    for r in rows:
      # Newton-Schulz (matmul) FLOPs of the busiest device vs the floor; the
      # XLA total adds elementwise work (large share at these tiny sizes).
      self.assertBetween(r['dot_flops_ratio_vs_floor'], 0.85, 1.15,
                         r['config'])
      self.assertBetween(r['flops_ratio_vs_floor'], 0.85, 1.35, r['config'])
      for key in ('flops_per_device', 'ns_flops_floor', 'plan_makespan',
                  'median_ms', 'predicted_ms', 'compile_total_s',
                  'matmul_flop_per_s'):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0,
                        (r['config'], key))
      self.assertTrue(all(math.isfinite(v)
                          for v in r['collective_bytes_by_kind'].values()))
    # Per-device work falls with N for the largest quick size.
    largest = max(rows, key=lambda r: r['ns_flops_total'])['size']
    flops = {r['devices']: r['flops_per_device'] for r in rows
             if r['size'] == largest}
    self.assertLess(flops[2], flops[1])
    self.assertLess(flops[4], flops[2])
    for ext in ('md', 'png'):
      self.assertTrue(pathlib.Path(out_dir, f'scaling_quick.{ext}').exists())


if __name__ == '__main__':
  absltest.main()
