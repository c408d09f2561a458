"""The examples and benchmarks run end to end (shortened), fail loudly when
their checks fail, and show their defaults in ``--help``."""

import json
import math
import pathlib
import tempfile

import chex
import pytest
from absl.testing import absltest, parameterized

from tests.support import ROOT, read_rows, run_script, run_unchecked

pytestmark = pytest.mark.slow

# Every Python script under examples/ and examples/benchmarks/.
# Every runnable script (hlo_tools.py is a library the benchmarks and the
# tests import: no __main__, no command line).
SCRIPTS = sorted(
  str(path.relative_to(ROOT))
  for folder in ('examples', 'examples/benchmarks')
  for path in (ROOT / folder).glob('*.py')
  if "__name__ == '__main__'" in path.read_text()
)

# Runs each script named in argv[2:] as __main__ with --help (in one
# process: jax is imported once) and writes, per script, its help text and
# the options of the parser that printed it to the JSON file argv[1]: what
# the help must show comes from the script's own parser.
HELP_PROBE = r"""
import argparse, contextlib, io, json, os, runpy, sys

out, scripts = sys.argv[1], sys.argv[2:]
format_help = argparse.ArgumentParser.format_help
parsers = []


def recording_format_help(self):
  parsers.append(self)
  return format_help(self)


argparse.ArgumentParser.format_help = recording_format_help
results = {}
for script in scripts:
  parsers.clear()
  sys.argv = [script, '--help']
  sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
  text = io.StringIO()
  try:
    with contextlib.redirect_stdout(text):
      runpy.run_path(script, run_name='__main__')
    code = None
  except SystemExit as e:
    code = e.code
  finally:
    sys.path.pop(0)
  results[script] = {
    'exit': code,
    'parsers': len(parsers),
    'help': text.getvalue(),
    'options': [
      {
        'option': action.option_strings[-1],
        'default': str(action.default),
        'has_default': action.default not in (None, argparse.SUPPRESS),
        'suppressed': action.help == argparse.SUPPRESS,
      }
      for parser in parsers[-1:]
      for action in parser._actions
      if action.option_strings
    ],
  }
with open(out, 'w') as f:
  json.dump(results, f)
"""


class ExamplesTest(absltest.TestCase):
  def test_optimizer_step_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(
      # Every configuration on the default 1x8 mesh, but one layer at
      # d=64 and one timed step (compiles dominate: 8 of them), without
      # the one-iteration diagnostics (the NS share of a step; two more
      # compiles). At the benchmark's sizes the FLOPs per device and the
      # all-to-all-only FSDP route are tests/cost_test.py's
      # (CompiledUpdateTest).
      [
        'examples/benchmarks/optimizer_step.py',
        '--quick',
        '--layers',
        '1',
        '--d-model',
        '64',
        '--d-ff',
        '192',
        '--vocab',
        '256',
        '--reps',
        '1',
        '--min-reps',
        '1',
        '--no-breakdown',
        '--out-dir',
        out_dir,
      ]
    )
    records = read_rows(pathlib.Path(out_dir, 'optimizer_step_quick.json'))
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
      },
    )
    for name, r in configs.items():
      for key in (
        'median_ms',
        'compile_s',
        'xla_cost_analysis_flops',
        'peak_bytes_per_device',
      ):
        self.assertTrue(math.isfinite(r[key]) and r[key] > 0, (name, key))
      # Per-device FLOPs are the step's matmuls, loops times their trip
      # counts: Newton-Schulz only (none for AdamW).
      if r['optimizer'] == 'adamw':
        self.assertEqual(r['flops_per_device'], 0, name)
      else:
        self.assertGreater(r['flops_per_device'], 0, name)
    dmuon = [c for c in configs if c.startswith('dmuon')]
    for name in dmuon:
      r = configs[name]
      if not r['diagnostic']:
        # The first update equals optax.contrib.muon's (fp32 noise).
        self.assertLess(r['first_update_rel_diff_vs_optax'], 1e-5, name)
      # Each device runs the busiest owner's Newton-Schulz, all 5
      # iterations: exactly the plan's makespan ...
      self.assertAlmostEqual(
        r['flops_per_device'] / r['plan']['makespan'], 1, delta=1e-6, msg=name
      )
      # ... about 1/8 of optax's on replicated params (every device all of
      # it, its iterations a loop too; measured 0.16 and 0.12 (all-2d) at
      # this size: 7 matrices of two costs do not pack evenly on 8 owners).
      optax_name = (
        'optax-muon-replicated-all2d'
        if 'all2d' in name
        else 'optax-muon-replicated'
      )
      ratio = r['flops_per_device'] / configs[optax_name]['flops_per_device']
      self.assertLess(ratio, (0.2 if r['ns_steps'] == 5 else 0.1), name)
      self.assertGreater(ratio, 1 / 8 - 0.01, name)
    # Sharded params: the owner routes are all-to-alls, nothing is
    # gathered whole; the explicit path reduce-scatters what it gathers.
    for name in ('dmuon-fsdp',):
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
      # --quick with one layer (one layer per gather) on a 1x4 mesh: every
      # configuration, a smaller program each (7 compiles dominate). The
      # byte targets hold here too (measured: Z3 / FSDP 0.999, Z2 0.71);
      # at 1x8 one layer's 7 matrices pad the owner slots and they do not.
      [
        'examples/benchmarks/train_step.py',
        '--quick',
        '--layers',
        '1',
        '--layers-per-gather',
        '1',
        '--mesh',
        '1,4',
        '--out-dir',
        out_dir,
      ]
    )
    records = read_rows(pathlib.Path(out_dir, 'train_step_quick.json'))
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
    chex.assert_trees_all_close(
      losses, [losses[0]] * len(losses), rtol=1e-4, atol=0
    )
    self.assertTrue(pathlib.Path(out_dir, 'train_step_quick.md').exists())

  def test_gram_ns_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(
      ['examples/benchmarks/gram_ns.py', '--quick', '--out-dir', out_dir]
    )
    records = read_rows(pathlib.Path(out_dir, 'gram_ns_quick.json'))
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
          'xla_cost_analysis_flops',
        ):
          v = r[variant][key]
          self.assertTrue(math.isfinite(v) and v > 0, (r['config'], key))
        self.assertLess(r[variant]['rel_diff_vs_f64'], 1e-4)
        # The compiled call's matmuls (the direct iteration's loop times
        # its trip count) are the FLOP model's.
        self.assertAlmostEqual(
          r[variant]['flops'] / r[variant]['predicted_flops'],
          1,
          delta=1e-6,
          msg=(r['config'], variant),
        )
      self.assertTrue(math.isfinite(r['speedup_measured']))
    for r in part_b:
      for key in ('median_ms', 'flops_per_device', 'collective_bytes_total'):
        self.assertTrue(
          math.isfinite(r[key]) and r[key] > 0, (r['config'], key)
        )
      # Per-device matmul FLOPs (loops times their trip counts) as predicted.
      self.assertAlmostEqual(
        r['flops_per_device'] / r['predicted_flops_per_device'],
        1,
        delta=1e-6,
        msg=r['config'],
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
      # One layer (7 matrices, as in --quick's 'mini' at d=64): the three
      # device counts, each a subprocess with one compile, a smaller one.
      [
        'examples/benchmarks/scaling.py',
        '--quick',
        '--sizes',
        'smoke=1x64x256x128',
        '--out-dir',
        out_dir,
      ],
      timeout=300,
    )
    records = read_rows(pathlib.Path(out_dir, 'scaling_quick.json'))
    rows = [r for r in records if r['config'] != 'summary']
    self.assertEqual(sorted({r['devices'] for r in rows}), [1, 2, 8])
    for r in rows:
      # Newton-Schulz FLOPs of the busiest device (its program's matmuls,
      # the iterations' loop times its trip count) are the plan's makespan,
      # within 15% of the floor (measured 1.000 at N = 1, 2, 8).
      self.assertAlmostEqual(
        r['flops_ratio_vs_makespan'], 1, delta=1e-6, msg=r['config']
      )
      self.assertBetween(r['flops_ratio_vs_floor'], 0.85, 1.15, r['config'])
      for key in (
        'flops_per_device',
        'xla_cost_analysis_flops',
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


class PeersTest(absltest.TestCase):
  def test_peers_benchmark_quick(self):
    # Every strategy (optax replicated and on FSDP, the levanter-style
    # constraint, same-shape stacks, dmuon drop-in with owners over both
    # axes and over 'shard', dedicated Z2/Z3) three steps on the small
    # float32 tree on a 2x4 mesh against single-device optax.contrib.muon,
    # then timed: the script exits nonzero if a check fails; here each row
    # is read back.
    out_dir = tempfile.mkdtemp()
    run_script(
      [
        'examples/benchmarks/peers.py',
        '--quick',
        '--reps',
        '1',
        '--out-dir',
        out_dir,
      ]
    )
    rows = read_rows(pathlib.Path(out_dir, 'peers_quick.json'))
    checks = {r['strategy']: r for r in rows if r['mode'] == 'check'}
    self.assertEqual(
      sorted(checks),
      sorted(
        (
          'replicated',
          'gspmd_fsdp',
          'gspmd_constraint',
          'stacked',
          'dmuon',
          'dmuon_shard',
          'dedicated_z2',
          'dedicated_z3',
        )
      ),
    )
    for name, row in checks.items():
      self.assertNotIn('error', row, name)
      self.assertTrue(row['passed'], name)
      self.assertLessEqual(row['max_rel_diff'], 1e-5, name)
      self.assertGreater(row['median_ms'], 0, name)
    self.assertTrue(pathlib.Path(out_dir, 'peers_quick.md').exists())


class TrainLmTest(absltest.TestCase):
  def test_dedicated_route_benchmark_quick(self):
    out_dir = tempfile.mkdtemp()
    run_script(
      [
        'examples/benchmarks/dedicated_route.py',
        '--quick',
        '--out-dir',
        out_dir,
      ]
    )
    rows = {
      r['config']: r
      for r in read_rows(pathlib.Path(out_dir, 'dedicated_route_quick.json'))
    }
    plain = rows['plain_jit']
    # Muon bytes against the Z2 floor 2(N-1)/N * P_M, from the compiled
    # HLO: route R's Z2 at it, Z3 one re-gather more (1.5x), no all-reduce;
    # the same as a scan over layers (one gather and one scatter per
    # iteration); HSDP with a shard_map gather over 'shard' at it too.
    floor = 2 * 7 / 8 * plain['model']['muon_bytes']
    for name, want in (
      ('route_z2', 1.0),
      ('route_z3', 1.5),
      ('route_scan_z2', 1.0),
      ('route_hsdp_sm', 1.0),
    ):
      muon = rows[name]['collectives']['muon']
      if name == 'route_hsdp_sm':
        self.assertEqual(muon['all-gather']['group_sizes'], [4])
      else:
        self.assertNotIn('all-reduce', muon, name)
      got = sum(c['bytes'] for c in muon.values())
      self.assertAlmostEqual(got / floor, want, delta=0.01, msg=name)
      # Plain-jit semantics: the same gradient, metric and RNG counts.
      self.assertLess(rows[name]['grad_max_rel_diff'], 1e-5, name)
      for key in ('metric_count', 'rngs_count'):
        self.assertEqual(rows[name][key], plain[key], (name, key))
    scan = rows['route_scan_z2']['collectives']['muon']
    self.assertEqual(scan['all-gather']['ops'], 1)  # in the while body
    self.assertEqual(scan['all-gather']['count'], 3)  # trip count 3
    self.assertIn('Explicit', rows['route_auto']['error'])

  def test_crippled_muon_exits_nonzero_naming_the_check(self):
    # The command (--steps 40 --muon-lr 0.0002: Muon's learning
    # rate cut 100x) on a smaller model: AdamW wins (measured 3.198
    # against 3.364 val loss), so the "beats AdamW" check of every Muon
    # variant fails, while the others (every optimizer learns, the three
    # Muon variants agree to 1e-5: 4.8e-7) still hold. The same run checks
    # the report: table, JSON, plot (one run of the four optimizers serves
    # both; compiles dominate it, two per optimizer).
    out_dir = pathlib.Path(tempfile.mkdtemp())
    proc = run_unchecked(
      [
        'examples/train_lm.py',
        '--steps',
        '40',
        '--muon-lr',
        '0.0002',
        '--width',
        '32',
        '--layers',
        '1',
        '--heads',
        '2',
        '--context',
        '16',
        '--batch',
        '8',
        '--eval-batch',
        '8',
        '--eval-every',
        '10',
        '--data-bytes',
        '300000',
        '--out-dir',
        str(out_dir),
      ]
    )
    output = f'{proc.stdout}\n{proc.stderr}'
    self.assertEqual(proc.returncode, 1, output)
    failed = [
      line
      for line in proc.stderr.splitlines()
      if line.startswith('FAILED checks: ')
    ]
    self.assertLen(failed, 1, output)
    for key in ('optax_muon', 'dmuon', 'dedicated'):
      self.assertIn(f'{key} val ', failed[0])
    self.assertEqual(failed[0].count('< adamw val'), 3, failed[0])
    self.assertNotIn('learns', failed[0])
    self.assertNotIn('max |', failed[0])
    self.assertNotIn('checks passed', proc.stdout)
    # The report is written before the exit, the failure recorded in it.
    labels = [
      'adamw',
      'optax.contrib.muon',
      'dmuon (drop-in)',
      'dmuon dedicated Z3',
    ]
    rows = [line for line in proc.stdout.splitlines() if line.startswith('| ')]
    self.assertEqual([r.split('|')[1].strip() for r in rows[1:]], labels)
    result = json.loads((out_dir / 'train_lm.json').read_text())
    self.assertFalse(result['checks_passed'])
    self.assertLen(result['checks'], 10)  # 4 learn, 3 vs adamw, 3 pairs
    self.assertEqual(sum(not ok for ok in result['checks'].values()), 3)
    # The dedicated run is compared too: every pair of Muon variants.
    self.assertEqual(
      sorted(result['max_abs_diffs']),
      ['dmuon vs dedicated', 'optax_muon vs dedicated', 'optax_muon vs dmuon'],
    )
    self.assertLess(max(result['max_abs_diffs'].values()), 1e-5)
    logs = result['optimizers']
    self.assertEqual([log['label'] for log in logs.values()], labels)
    for name, log in logs.items():
      self.assertEqual(log['step'][-1], 40, name)
      for key in ('train_loss', 'val_loss', 'time_s', 'step_losses'):
        self.assertTrue(all(math.isfinite(v) for v in log[key]), (name, key))
      self.assertLen(log['step_losses'], 40)
      self.assertGreater(log['step_losses'][0], log['train_loss'][-1], name)
    png = (out_dir / 'train_lm.png').read_bytes()
    self.assertGreater(len(png), 1000)
    self.assertEqual(png[:8], b'\x89PNG\r\n\x1a\n')
    table = (out_dir / 'train_lm.md').read_text()
    for label in labels:
      self.assertIn(f'| {label} |', table)


class HelpTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with tempfile.TemporaryDirectory() as d:
      out = pathlib.Path(d, 'help.json')
      proc = run_unchecked(['-c', HELP_PROBE, str(out), *SCRIPTS], timeout=300)
      assert proc.returncode == 0, proc.stderr
      cls.probes = json.loads(out.read_text())

  @parameterized.named_parameters(
    (script.replace('/', '_').removesuffix('.py'), script) for script in SCRIPTS
  )
  def test_help_shows_every_default(self, script):
    probe = self.probes[script]
    self.assertIn(probe['exit'], (0, None))
    self.assertEqual(probe['parsers'], 1, 'one parser printed the help')
    # Whitespace left out: argparse wraps help lines and breaks a word longer
    # than a line (a default path under a long checkout directory).
    text = ''.join(probe['help'].split())
    shown = [
      o for o in probe['options'] if o['has_default'] and not o['suppressed']
    ]
    self.assertNotEmpty(shown)
    # Each option adds one "(default: ...)": count them, so that one
    # option's cannot stand in for another's with the same default.
    wanted = {}
    for o in shown:
      key = ''.join(f'(default: {o["default"]})'.split())
      wanted.setdefault(key, []).append(o['option'])
    for key, options in wanted.items():
      self.assertGreaterEqual(
        text.count(key), len(options), f'{script} {options}: no {key}'
      )


if __name__ == '__main__':
  absltest.main()
