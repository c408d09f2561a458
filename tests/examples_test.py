"""The examples and benchmarks run end to end (shortened)."""

import json
import math
import pathlib
import tempfile

import numpy as np
import pytest
from absl.testing import absltest

from tests.support import run_script

pytestmark = pytest.mark.slow


class ExamplesTest(absltest.TestCase):
  def test_train_lm_short_run_prints_a_table(self):
    out_dir = pathlib.Path(tempfile.mkdtemp())
    out = run_script(
      [
        'examples/train_lm.py',
        '--steps',
        '12',
        '--eval-every',
        '4',
        '--batch',
        '16',
        '--context',
        '16',
        '--width',
        '32',
        '--layers',
        '1',
        '--heads',
        '2',
        '--eval-batch',
        '16',
        '--data-bytes',
        '200000',
        '--out-dir',
        str(out_dir),
      ]
    )
    labels = [
      'adamw',
      'optax.contrib.muon',
      'dmuon (drop-in)',
      'dmuon dedicated Z3',
    ]
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
    run_script(
      ['examples/benchmarks/optimizer_step.py', '--quick', '--out-dir', out_dir]
    )
    lines = pathlib.Path(out_dir, 'optimizer_step_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    configs = {
      r['config']: r
      for r in records
      if r['config'] not in ('summary', 'matmul_rate')
    }
    self.assertEqual(
      set(configs),
      {
        'adamw-fsdp',
        'optax-muon-replicated',
        'optax-muon-fsdp',
        'dmuon-replicated',
        'dmuon-fsdp',
        'dmuon-explicit',
        'optax-muon-replicated-all2d',
        'dmuon-replicated-all2d',
        'dmuon-replicated-ns1',
        'dmuon-fsdp-ns1',
      },
    )
    for name, r in configs.items():
      for key in (
        'median_ms',
        'compile_s',
        'flops_per_device',
        'peak_bytes_per_device',
      ):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0, (name, key))
    dmuon = [c for c in configs if c.startswith('dmuon')]
    for name in dmuon:
      r = configs[name]
      if not r['diagnostic']:
        # The first update equals optax.contrib.muon's (fp32 noise).
        self.assertLess(r['first_update_rel_diff_vs_optax'], 1e-5, name)
      # Each device runs about 1/8 of optax's Newton-Schulz work (the
      # busiest owner: plan imbalance 1.19-1.22 at this size).
      optax_name = (
        'optax-muon-replicated-all2d'
        if 'all2d' in name
        else 'optax-muon-replicated'
      )
      ratio = r['flops_per_device'] / configs[optax_name]['flops_per_device']
      self.assertLess(ratio, (0.2 if r['ns_steps'] == 5 else 0.1), name)
    # Sharded params: the owner routes are all-to-alls, nothing is
    # gathered whole; the explicit path reduce-scatters what it gathers.
    for name in ('dmuon-fsdp', 'dmuon-fsdp-ns1'):
      kinds = configs[name]['collective_bytes_by_kind']
      self.assertNotIn('all-gather', kinds, name)
      self.assertGreater(kinds['all-to-all'], 0, name)
      self.assertLess(kinds.get('all-reduce', 0), 1024, name)
    kinds = configs['dmuon-explicit']['collective_bytes_by_kind']
    self.assertEqual(kinds['reduce-scatter'], kinds['all-gather'])
    (summary,) = [r for r in records if r['config'] == 'summary']
    self.assertEqual(
      {t['target'] for t in summary['targets']},
      {
        'dmuon (replicated) speedup vs optax.contrib.muon replicated',
        'dmuon (FSDP) speedup vs optax.contrib.muon FSDP',
        'dmuon (replicated) time / machine floor',
      },
    )
    table = pathlib.Path(out_dir, 'optimizer_step_quick.md').read_text()
    for name, r in configs.items():
      if not r['diagnostic']:
        self.assertIn(f'| {name} |', table)

  def test_train_step_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(
      ['examples/benchmarks/train_step.py', '--quick', '--out-dir', out_dir]
    )
    lines = pathlib.Path(out_dir, 'train_step_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    configs = {r['config']: r for r in records if r['config'] != 'summary'}
    self.assertEqual(
      set(configs),
      {
        'adamw_fsdp',
        'adamw_fsdp_reshard',
        'adamw_fsdp_jit',
        'optax_muon_fsdp',
        'dmuon_dropin_fsdp',
        'dedicated_z2',
        'dedicated_z3',
      },
    )
    for name, r in configs.items():
      for key in (
        'median_ms',
        'compile_s',
        'collective_bytes_total',
        'final_loss',
      ):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0, (name, key))
    # Every byte target holds at this size too: dedicated Z2/Z3 against
    # FSDP AdamW, and drop-in dmuon = plain-jit AdamW + its predicted owner
    # all-to-alls (within 5%).
    (summary,) = [r for r in records if r['config'] == 'summary']
    for t in summary['targets']:
      self.assertTrue(t['met'], t)
    (dropin,) = [
      t for t in summary['targets'] if t['config'] == 'dmuon_dropin_fsdp'
    ]
    self.assertGreater(dropin['predicted']['all-to-all'], 0)
    # The Muon configs agree on the loss (the same algorithm).
    losses = [
      configs[c]['final_loss']
      for c in (
        'optax_muon_fsdp',
        'dmuon_dropin_fsdp',
        'dedicated_z2',
        'dedicated_z3',
      )
    ]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-4)
    self.assertTrue(pathlib.Path(out_dir, 'train_step_quick.md').exists())

  def test_gram_ns_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(
      ['examples/benchmarks/gram_ns.py', '--quick', '--out-dir', out_dir]
    )
    lines = pathlib.Path(out_dir, 'gram_ns_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    part_a = [r for r in records if r['part'] == 'A']
    part_b = [r for r in records if r['part'] == 'B']
    self.assertEqual([r['ratio'] for r in part_a], [1, 2, 4, 8])
    self.assertLen(part_b, 8)  # T in (2, 4) x (column, row) x (tp, gather)
    for r in part_a:
      for variant in ('direct', 'gram'):
        for key in (
          'median_ms',
          'predicted_flops',
          'gflop_per_s',
          'rel_diff_vs_f64',
        ):
          v = r[variant][key]
          self.assertTrue(math.isfinite(v) and v > 0, (r['config'], key))
        self.assertLess(r[variant]['rel_diff_vs_f64'], 1e-4)
      self.assertTrue(math.isfinite(r['speedup_measured']))
    for r in part_b:
      for key in ('median_ms', 'flops_per_device', 'collective_bytes_total'):
        self.assertTrue(
          math.isfinite(r[key]) and r[key] > 0, (r['config'], key)
        )
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
    run_script(
      ['examples/benchmarks/scaling.py', '--quick', '--out-dir', out_dir],
      timeout=300,
    )
    lines = pathlib.Path(out_dir, 'scaling_quick.json').read_text()
    records = [json.loads(line) for line in lines.splitlines() if line]
    rows = [r for r in records if r['config'] != 'summary']
    self.assertEqual(sorted({r['devices'] for r in rows}), [1, 2, 8])
    for r in rows:
      # Newton-Schulz (matmul) FLOPs of the busiest device vs the floor; the
      # XLA total adds elementwise work (large share at these tiny sizes).
      self.assertBetween(r['dot_flops_ratio_vs_floor'], 0.85, 1.15, r['config'])
      self.assertBetween(r['flops_ratio_vs_floor'], 0.85, 1.35, r['config'])
      for key in (
        'flops_per_device',
        'ns_flops_floor',
        'plan_makespan',
        'median_ms',
        'predicted_ms',
        'compile_total_s',
        'matmul_flop_per_s',
      ):
        self.assertTrue(
          math.isfinite(r[key]) and r[key] > 0, (r['config'], key)
        )
      self.assertTrue(
        all(math.isfinite(v) for v in r['collective_bytes_by_kind'].values())
      )
    # Per-device work falls with N for the largest quick size.
    largest = max(rows, key=lambda r: r['ns_flops_total'])['size']
    flops = {
      r['devices']: r['flops_per_device'] for r in rows if r['size'] == largest
    }
    self.assertLess(flops[2], flops[1])
    self.assertLess(flops[8], flops[2])
    for ext in ('md', 'png'):
      self.assertTrue(pathlib.Path(out_dir, f'scaling_quick.{ext}').exists())


if __name__ == '__main__':
  absltest.main()
