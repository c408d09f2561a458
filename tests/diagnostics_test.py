"""Tests for dmuon_jax.diagnostics (collective bytes and FLOPs from HLO) and
for the suite's HLO tooling, examples/benchmarks/hlo_tools.py."""

import doctest
import functools
import math
import types
import unittest

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import diagnostics
from tests import support

hlo_tools = support.hlo_tools

AXES = ('replicate', 'shard')
BOTH = ('replicate', 'shard')


def _mesh(shape):
  n = math.prod(shape)
  if jax.device_count() < n:
    raise unittest.SkipTest(f'needs {n} devices, found {jax.device_count()}')
  return jax.make_mesh(shape, AXES)


def _arg(mesh, shape, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _smap(f, mesh, in_specs, out_specs):
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _one(report, kind):
  found = [c for c in report.collectives if c.kind == kind]
  if len(found) != 1:
    raise AssertionError(f'expected one {kind}, got {report.collectives}')
  return found[0]


class CompiledCollectivesTest(parameterized.TestCase):
  def test_all_gather(self):
    mesh = _mesh((1, 8))
    f = _smap(
      lambda a: lax.all_gather(a, 'shard', tiled=True, to='invarying'),
      mesh,
      P('shard'),
      P(),
    )
    report = diagnostics.analyze(f, _arg(mesh, (64, 512), P('shard')))
    self.assertEqual([c.kind for c in report.collectives], ['all-gather'])
    c = report.collectives[0]
    self.assertEqual(c.dtype, 'f32')
    self.assertEqual(c.shape, (64, 512))
    self.assertEqual(c.group_size, 8)
    self.assertEqual((c.executions, c.in_loop), (1, False))
    self.assertEqual(c.bytes, 7 / 8 * 64 * 512 * 4)
    self.assertEqual(c.total_bytes, c.bytes)

  def test_bf16_collectives_run_in_f32_on_cpu(self):
    # XLA:CPU converts bf16 collectives to f32 (documented); a change here
    # means the CPU byte counts for bf16 changed too.
    mesh = _mesh((1, 8))
    f = _smap(
      lambda a: lax.all_gather(a, 'shard', tiled=True, to='invarying'),
      mesh,
      P('shard'),
      P(),
    )
    x = _arg(mesh, (64, 512), P('shard'), jnp.bfloat16)
    c = _one(diagnostics.analyze(f, x), 'all-gather')
    self.assertEqual(c.dtype, 'f32')
    self.assertEqual(c.bytes, 7 / 8 * 64 * 512 * 4)

  def test_psum(self):
    mesh = _mesh((1, 8))
    f = _smap(lambda a: lax.psum(a, 'shard'), mesh, P('shard'), P())
    report = diagnostics.analyze(f, _arg(mesh, (64, 512), P('shard')))
    c = _one(report, 'all-reduce')
    self.assertEqual((c.shape, c.group_size), ((8, 512), 8))
    self.assertEqual(c.bytes, 2 * 7 / 8 * 8 * 512 * 4)

  def test_psum_scatter(self):
    mesh = _mesh((1, 8))
    f = _smap(
      lambda a: lax.psum_scatter(a, 'shard', tiled=True),
      mesh,
      P(),
      P('shard'),
    )
    report = diagnostics.analyze(f, _arg(mesh, (64, 512), P()))
    c = _one(report, 'reduce-scatter')
    self.assertEqual((c.shape, c.group_size), ((64, 512), 8))
    self.assertEqual(c.bytes, 7 / 8 * 64 * 512 * 4)

  def test_all_to_all(self):
    mesh = _mesh((1, 8))
    f = _smap(
      lambda a: lax.all_to_all(a, 'shard', 1, 1, tiled=True),
      mesh,
      P('shard'),
      P('shard'),
    )
    report = diagnostics.analyze(f, _arg(mesh, (64, 512), P('shard')))
    c = _one(report, 'all-to-all')
    # XLA:CPU splits it into 8 operands of (8, 64): summed.
    self.assertEqual(math.prod(c.shape), 8 * 512)
    self.assertEqual(c.group_size, 8)
    self.assertEqual(c.bytes, 7 / 8 * 8 * 512 * 4)

  def test_ppermute(self):
    mesh = _mesh((1, 8))
    ring = [(i, (i + 1) % 8) for i in range(8)]
    f = _smap(
      lambda a: lax.ppermute(a, 'shard', ring), mesh, P('shard'), P('shard')
    )
    report = diagnostics.analyze(f, _arg(mesh, (64, 512), P('shard')))
    c = _one(report, 'collective-permute')
    self.assertEqual((c.shape, c.group_size), ((8, 512), 8))
    self.assertEqual(c.bytes, 8 * 512 * 4)

  @parameterized.named_parameters(
    ('shard', 'shard', 4),
    ('replicate', 'replicate', 2),
    ('both', BOTH, 8),
  )
  def test_group_size_on_2x4_mesh(self, axes, n):
    mesh = _mesh((2, 4))
    x = _arg(mesh, (64, 512), P(BOTH))  # local (8, 512)
    psum = _smap(lambda a: lax.psum(a, axes), mesh, P(BOTH), P(BOTH))
    c = _one(diagnostics.analyze(psum, x), 'all-reduce')
    self.assertEqual(c.group_size, n)
    self.assertEqual(c.bytes, 2 * (n - 1) / n * 8 * 512 * 4)
    # The gathered block still varies over the other axis, if any.
    out = {'shard': P('replicate'), 'replicate': P('shard')}.get(axes, P())
    gather = _smap(
      lambda a: lax.all_gather(a, axes, tiled=True, to='invarying'),
      mesh,
      P(BOTH),
      out,
    )
    c = _one(diagnostics.analyze(gather, x), 'all-gather')
    self.assertEqual((c.shape, c.group_size), ((8 * n, 512), n))
    self.assertEqual(c.bytes, (n - 1) / n * 8 * n * 512 * 4)

  @parameterized.named_parameters(('fori_loop', 'fori'), ('scan', 'scan'))
  def test_loop_multiplies_executions(self, loop):
    mesh = _mesh((2, 4))

    def body(c):
      return c + 0.5 * lax.psum(c, 'shard')

    def f(a):
      if loop == 'fori':
        return lax.fori_loop(0, 5, lambda i, c: body(c), a)
      return lax.scan(lambda c, _: (body(c), None), a, None, length=5)[0]

    report = diagnostics.analyze(
      _smap(f, mesh, P(BOTH), P(BOTH)), _arg(mesh, (64, 512), P(BOTH))
    )
    c = _one(report, 'all-reduce')
    self.assertEqual((c.executions, c.in_loop, c.group_size), (5, True, 4))
    self.assertEqual(c.bytes, 2 * 3 / 4 * 8 * 512 * 4)
    self.assertEqual(report.count_by_kind, {'all-reduce': 5})
    self.assertEqual(report.total_bytes(), 5 * c.bytes)

  def test_nested_loops_multiply(self):
    mesh = _mesh((1, 8))

    def f(a):
      inner = lambda j, d: d + 0.5 * lax.psum(d, 'shard')
      return lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 5, inner, c), a)

    report = diagnostics.analyze(
      _smap(f, mesh, P('shard'), P('shard')),
      _arg(mesh, (64, 512), P('shard')),
    )
    c = _one(report, 'all-reduce')
    self.assertEqual((c.executions, c.in_loop), (15, True))
    self.assertEqual(report.bytes_by_kind, {'all-reduce': 15 * c.bytes})

  def test_unknown_trip_count_counts_once(self):
    mesh = _mesh((1, 8))

    def f(a):
      cond = lambda c: c.sum() < 100.0
      return lax.while_loop(cond, lambda c: c + lax.psum(c, 'shard'), a)

    report = diagnostics.analyze(
      _smap(f, mesh, P('shard'), P('shard')),
      _arg(mesh, (64, 512), P('shard')),
    )
    c = _one(report, 'all-reduce')
    self.assertEqual((c.executions, c.in_loop), (1, True))

  def test_conditional_branch_counts_once(self):
    mesh = _mesh((1, 8))

    def f(a):
      i = lax.axis_index('shard') % 2
      return lax.switch(i, [lambda: a + lax.psum(a, 'shard'), lambda: 2 * a])

    report = diagnostics.analyze(
      _smap(f, mesh, P('shard'), P('shard')),
      _arg(mesh, (64, 512), P('shard')),
    )
    c = _one(report, 'all-reduce')
    self.assertEqual((c.executions, c.in_loop), (1, False))

  def test_tuple_all_reduce_sums_operands(self):
    mesh = _mesh((1, 8))
    f = _smap(
      lambda a, b: lax.psum((a, b), 'shard'),
      mesh,
      (P('shard'), P('shard')),
      (P(), P()),
    )
    report = diagnostics.analyze(
      f,
      _arg(mesh, (64, 128), P('shard')),
      _arg(mesh, (64, 256), P('shard')),
    )
    c = _one(report, 'all-reduce')  # XLA combined the two psums.
    self.assertEqual(c.shape, (8 * 128 + 8 * 256,))
    self.assertEqual(c.bytes, 2 * 7 / 8 * (8 * 128 + 8 * 256) * 4)

  def test_matmul_flops_per_device(self):
    mesh = _mesh((1, 8))
    f = _smap(lambda a, b: a @ b, mesh, (P('shard'), P()), P('shard'))
    report = diagnostics.analyze(
      f, _arg(mesh, (64, 128), P('shard')), _arg(mesh, (128, 32), P())
    )
    self.assertEqual(report.collectives, ())
    self.assertAlmostEqual(report.flops / (2 * 8 * 128 * 32), 1.0, delta=0.05)

  def test_cost_analysis_counts_loop_body_once(self):
    # Documented XLA behaviour: FLOPs of a while body are not multiplied by
    # its trip count.
    mesh = _mesh((1, 8))

    def f(a, b):
      return lax.scan(lambda c, _: (c @ b, None), a, None, length=5)[0]

    report = diagnostics.analyze(
      _smap(f, mesh, (P('shard'), P()), P('shard')),
      _arg(mesh, (64, 128), P('shard')),
      _arg(mesh, (128, 128), P()),
    )
    self.assertAlmostEqual(report.flops / (2 * 8 * 128 * 128), 1.0, delta=0.05)

  def test_report_totals_summary_and_memory(self):
    mesh = _mesh((1, 8))

    def f(a):
      g = lax.all_gather(a, 'shard', tiled=True, to='invarying')
      return g, lax.psum(a, 'shard')

    x = _arg(mesh, (64, 512), P('shard'))
    report = diagnostics.analyze(_smap(f, mesh, P('shard'), (P(), P())), x)
    gather = 7 / 8 * 64 * 512 * 4
    reduce = 2 * 7 / 8 * 8 * 512 * 4
    self.assertEqual(
      report.bytes_by_kind, {'all-gather': gather, 'all-reduce': reduce}
    )
    self.assertEqual(report.count_by_kind, {'all-gather': 1, 'all-reduce': 1})
    self.assertEqual(report.total_bytes('all-gather'), gather)
    self.assertEqual(
      report.total_bytes(['all-gather', 'reduce-scatter']), gather
    )
    self.assertEqual(report.total_bytes(), gather + reduce)
    with self.assertRaisesRegex(ValueError, 'allgather'):
      report.total_bytes('allgather')
    summary = report.summary()
    for word in ('all-gather', 'all-reduce', 'flops', '140.0 KiB'):
      self.assertIn(word, summary)
    self.assertEqual(report.argument_bytes, 8 * 512 * 4)
    # Two outputs, plus XLA's 16-byte table of pointers to them.
    self.assertEqual(report.output_bytes, (64 * 512 + 8 * 512) * 4 + 16)
    self.assertIsNotNone(report.temp_bytes)
    self.assertEqual(report.alias_bytes, 0)
    self.assertEqual(
      report.peak_bytes,
      report.argument_bytes + report.output_bytes + report.temp_bytes,
    )

  def test_analyze_accepts_plain_jitted_lowered_and_concrete(self):
    mesh = _mesh((1, 8))
    f = _smap(lambda a: lax.psum(a, 'shard'), mesh, P('shard'), P())
    x = jax.device_put(
      jnp.ones((64, 512), jnp.float32), NamedSharding(mesh, P('shard'))
    )
    lowered = jax.jit(f).lower(x)
    reports = [
      diagnostics.analyze(f, x),
      diagnostics.analyze(jax.jit(f), x),
      diagnostics.analyze_compiled(lowered),
      diagnostics.analyze_compiled(lowered.compile()),
    ]
    for report in reports:
      self.assertEqual(report.collectives, reports[0].collectives)
    with self.assertRaisesRegex(TypeError, 'Compiled'):
      diagnostics.analyze_compiled('HloModule m')


class ReplicaGroupsTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ('explicit', '{{0,1,2,3},{4,5,6,7}}', ((0, 1, 2, 3), (4, 5, 6, 7))),
    ('explicit_spaces', '{ {0, 4}, {1, 5} }', ((0, 4), (1, 5))),
    ('iota', '[2,4]<=[8]', ((0, 1, 2, 3), (4, 5, 6, 7))),
    ('iota_all', '[1,8]<=[8]', (tuple(range(8)),)),
    (
      'transposed_iota',
      '[4,2]<=[2,4]T(1,0)',
      ((0, 4), (1, 5), (2, 6), (3, 7)),
    ),
    (
      'transposed_iota_3d',
      '[2,4]<=[2,2,2]T(2,1,0)',
      ((0, 4, 2, 6), (1, 5, 3, 7)),
    ),
  )
  def test_forms(self, text, expected):
    self.assertEqual(diagnostics.parse_replica_groups(text), expected)

  # The named-axes form XLA prints with jax 0.10 (copied from compiled
  # HLO of 2x4 ('replicate', 'shard') meshes): a group per index of the
  # axes outside the braces.
  @parameterized.named_parameters(
    (
      'mesh_transposed_ids',
      "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
      "{'axis_0'}",
      ((0, 1, 2, 3), (4, 5, 6, 7)),
    ),
    (
      'mesh_middle_axis',
      "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
      "{'axis_1'}",
      ((0, 1, 2, 3), (4, 5, 6, 7)),
    ),
    (
      'mesh_iota_ids',
      "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4,'axis_3'=1] {'axis_2'}",
      ((0, 1, 2, 3), (4, 5, 6, 7)),
    ),
    (
      'mesh_outer_axis',
      "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}",
      ((0, 4), (1, 5), (2, 6), (3, 7)),
    ),
    (
      'mesh_all',
      "mesh['axis_0'=1,'axis_1'=8] {'axis_1'}",
      (tuple(range(8)),),
    ),
    (
      'mesh_two_axes',
      "mesh['a'=2,'b'=2,'c'=2] {'a','c'}",
      ((0, 1, 4, 5), (2, 3, 6, 7)),
    ),
  )
  def test_mesh_forms(self, text, expected):
    self.assertEqual(diagnostics.parse_replica_groups(text), expected)

  def test_mesh_form_group_size_in_compiled_program(self):
    # A sum over the 'shard'-sharded axis of a 2x4 mesh: one all-reduce
    # over 'shard', printed in the named-axes form (jax 0.10): groups of
    # 4, not all 8 devices.
    mesh = jax.make_mesh(
      (2, 4), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    x = _arg(mesh, (64, 32), P('shard'))
    compiled = jax.jit(lambda x: x.sum(0)).lower(x).compile()
    report = diagnostics.analyze_compiled(compiled)
    self.assertEqual(
      [(c.kind, c.group_size) for c in report.collectives],
      [('all-reduce', 4)],
    )

  def test_empty_means_all_devices(self):
    self.assertEqual(diagnostics.parse_replica_groups('{}'), ())
    self.assertEqual(
      diagnostics.parse_replica_groups('{}', num_devices=4),
      ((0, 1, 2, 3),),
    )

  @parameterized.named_parameters(
    ('bad_iota', '[3,4]<=[8]'),
    ('bad_perm', '[2,4]<=[2,4]T(0,0)'),
    ('garbage', 'all'),
  )
  def test_invalid(self, text):
    with self.assertRaisesRegex(ValueError, 'replica_groups'):
      diagnostics.parse_replica_groups(text)


# Hand-written compiled HLO in the GPU style: async pairs, inline operand
# shapes, an async-start wrapping an all-to-all, an iota-grouped all-reduce
# in a while loop, and a metadata string that mentions attributes.
_ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_all_to_all (p: f32[8,512]) -> f32[8,512] {
  %p = f32[8,512]{1,0} parameter(0)
  ROOT %a2a = f32[8,512]{1,0} all-to-all(%p), channel_id=5, \
replica_groups=[1,8]<=[8], dimensions={1}
}

%body (carry: (s32[], f32[8,512])) -> (s32[], f32[8,512]) {
  %carry = (s32[], f32[8,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %g = f32[8,512]{1,0} get-tuple-element(%carry), index=1
  %all-reduce-start = f32[8,512]{1,0} all-reduce-start(%g), channel_id=2, \
replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[8,512]{1,0} all-reduce-done(%all-reduce-start)
  ROOT %t = (s32[], f32[8,512]{1,0}) tuple(%i, %all-reduce-done)
}

%cond (carry.1: (s32[], f32[8,512])) -> pred[] {
  %carry.1 = (s32[], f32[8,512]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%carry.1), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (param.1: f32[8,512], param.2: bf16[64,512]) -> f32[8,512] {
  %param.1 = f32[8,512]{1,0} parameter(0), \
metadata={op_name="body=%add calls=%add"}
  %param.2 = bf16[64,512]{1,0} parameter(1)
  %all-gather-start = (f32[8,512]{1,0}, f32[64,512]{1,0}) \
all-gather-start(f32[8,512]{1,0} %param.1), channel_id=1, \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[64,512]{1,0} \
all-gather-done((f32[8,512]{1,0}, f32[64,512]{1,0}) %all-gather-start)
  %reduce-scatter-start = ((bf16[64,512]{1,0}), bf16[8,512]{1,0}) \
reduce-scatter-start(%param.2), channel_id=3, replica_groups={}, \
use_global_device_ids=true, dimensions={0}, to_apply=%add
  %reduce-scatter-done = bf16[8,512]{1,0} \
reduce-scatter-done(%reduce-scatter-start)
  %collective-permute-start = (f32[8,512]{1,0}, f32[8,512]{1,0}, u32[], \
/*index=3*/u32[]) collective-permute-start(/*index=0*/%param.1), channel_id=4, \
source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %collective-permute-done = f32[8,512]{1,0} \
collective-permute-done(%collective-permute-start)
  %async-start = ((f32[8,512]{1,0}), f32[8,512]{1,0}, s32[]) \
async-start(%collective-permute-done), calls=%wrapped_all_to_all
  %async-done = f32[8,512]{1,0} async-done(%async-start), \
calls=%wrapped_all_to_all
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,512]{1,0}) tuple(%zero, %async-done)
  %while = (s32[], f32[8,512]{1,0}) while(%init), condition=%cond, \
body=%body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %out = f32[8,512]{1,0} get-tuple-element(%while), index=1
}
"""


class HloTextTest(absltest.TestCase):
  def test_async_forms_loops_and_groups(self):
    got = diagnostics.hlo_collectives(_ASYNC_HLO)
    table = [
      (
        c.kind,
        c.name,
        c.dtype,
        c.shape,
        c.group_size,
        c.executions,
        c.in_loop,
        c.bytes,
      )
      for c in got
    ]
    self.assertEqual(
      table,
      [
        (
          'all-gather',
          'all-gather-start',
          'f32',
          (64, 512),
          8,
          1,
          False,
          7 / 8 * 64 * 512 * 4,
        ),
        (
          'reduce-scatter',
          'reduce-scatter-start',
          'bf16',
          (64, 512),
          8,
          1,
          False,
          7 / 8 * 64 * 512 * 2,
        ),
        (
          'collective-permute',
          'collective-permute-start',
          'f32',
          (8, 512),
          2,
          1,
          False,
          8 * 512 * 4,
        ),
        (
          'all-to-all',
          'a2a',
          'f32',
          (8, 512),
          8,
          1,
          False,
          7 / 8 * 8 * 512 * 4,
        ),
        (
          'all-reduce',
          'all-reduce-start',
          'f32',
          (8, 512),
          4,
          7,
          True,
          2 * 3 / 4 * 8 * 512 * 4,
        ),
      ],
    )

  def test_num_devices_overrides_empty_groups(self):
    got = diagnostics.hlo_collectives(_ASYNC_HLO, num_devices=4)
    rs = [c for c in got if c.kind == 'reduce-scatter']
    self.assertEqual([c.group_size for c in rs], [4])
    self.assertEqual(rs[0].bytes, 3 / 4 * 64 * 512 * 2)


def _hex_i64(rows):
  """MLIR's hex spelling of an i64 tensor (used for large attributes)."""
  return np.asarray(rows, dtype='<i8').tobytes().hex().upper()


class StableHloTest(absltest.TestCase):
  def test_cuda_lowering_on_cpu(self):
    mesh = _mesh((2, 4))

    def f(a, b, c):
      # a: f32[8, 512]{V:replicate,shard}  b: f32[64, 512]  c: bf16[8, 512]
      g = lax.all_gather(a, 'shard', tiled=True, to='invarying')
      s = lax.psum_scatter(b, BOTH, tiled=True)
      s = lax.fori_loop(0, 3, lambda i, x: x + lax.psum(x, 'replicate'), s)
      # A str axis name trips pbroadcast in jax 0.10.2: pass a tuple.
      t = lax.pbroadcast(s, ('shard',), source=1)
      h = lax.all_gather(c, BOTH, tiled=True, to='invarying')
      return g, t, h

    fn = jax.jit(
      _smap(f, mesh, (P(BOTH), P(), P(BOTH)), (P('replicate'), P(BOTH), P()))
    )
    args = (
      _arg(mesh, (64, 512), P(BOTH)),
      _arg(mesh, (64, 512), P()),
      _arg(mesh, (64, 512), P(BOTH), jnp.bfloat16),
    )
    text = fn.trace(*args).lower(lowering_platforms=('cuda',)).as_text()
    got = [
      (c.kind, c.dtype, c.shape, c.group_size, c.in_loop, c.bytes)
      for c in hlo_tools.stablehlo_collectives(text)
    ]
    self.assertCountEqual(
      got,
      [
        ('all-gather', 'f32', (32, 512), 4, False, 3 / 4 * 32 * 512 * 4),
        ('reduce-scatter', 'f32', (64, 512), 8, False, 7 / 8 * 64 * 512 * 4),
        ('all-reduce', 'f32', (8, 512), 2, True, 2 * 1 / 2 * 8 * 512 * 4),
        ('collective-broadcast', 'f32', (8, 512), 4, False, 8 * 512 * 4),
        ('all-gather', 'bf16', (64, 512), 8, False, 7 / 8 * 64 * 512 * 2),
      ],
    )

  def test_while_region_tuple_and_hex_pairs(self):
    text = """\
module @m attributes {mhlo.num_partitions = 4 : i32, \
mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<4xf32>) \
-> tensor<8xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %0:2 = stablehlo.while(%iterArg = %c, %iterArg_0 = %arg0) : \
tensor<i32>, tensor<8xf32>
    cond {
      %c_1 = stablehlo.constant dense<3> : tensor<i32>
      %1 = stablehlo.compare  LT, %iterArg, %c_1 : \
(tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %1:2 = "stablehlo.all_reduce"(%iterArg_0, %arg1) <{channel_handle = \
#stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<> : \
tensor<0x0xi64>, use_global_device_ids}> ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %2 = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %2 : tensor<f32>
      }) : (tensor<8xf32>, tensor<4xf32>) -> (tensor<8xf32>, tensor<4xf32>)
      stablehlo.return %iterArg, %1#0 : tensor<i32>, tensor<8xf32>
    }
    %3 = "stablehlo.collective_permute"(%0#1) <{channel_handle = \
#stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = \
dense<"0xPAIRS"> : tensor<4x2xi64>}> : (tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
}
""".replace('PAIRS', _hex_i64([[0, 1], [1, 0], [2, 3], [3, 2]]))
    got = hlo_tools.stablehlo_collectives(text)
    self.assertEqual(
      [(c.kind, c.shape, c.group_size, c.in_loop, c.bytes) for c in got],
      [
        ('all-reduce', (12,), 4, True, 2 * 3 / 4 * 12 * 4),
        ('collective-permute', (8,), 2, False, 8 * 4),
      ],
    )


# A layout's slots as with_slot_rows reads them: 8 over both axes, offsets
# past int32 (rows as constants of per-slot branches).
STATIC_8 = types.SimpleNamespace(
  plan=types.SimpleNamespace(axis_names=BOTH), num_slots=8, dynamic=False
)


class SharedBranchTest(absltest.TestCase):
  """Owner slots with equal rows share one branch body
  (``_gather.with_slot_rows``, static rows); ``dot_flops`` still counts
  each device's own branch, through the slot -> branch table."""

  def setUp(self):
    super().setUp()
    self.mesh = _mesh((1, 8))

  def compiled(self, keys_a, keys_b):
    from dmuon_jax import _gather  # pylint: disable=import-outside-toplevel

    def matmuls(rows, y, w):
      for _ in range(int(rows[0][0])):
        y = jnp.tanh(y @ w)
      return y

    def body(x, w):
      for keys in (keys_a, keys_b):
        table = np.asarray(keys)[:, None]
        x = _gather.with_slot_rows(STATIC_8, matmuls, [table], x, w)
      return x

    f = jax.jit(_smap(body, self.mesh, (P(BOTH), P()), P(BOTH)))
    x = jax.device_put(
      jnp.asarray(np.random.default_rng(0).normal(size=(128, 16)), jnp.float32),
      NamedSharding(self.mesh, P(BOTH)),
    )
    w = jnp.asarray(np.random.default_rng(1).normal(size=(16, 16)) / 4)
    return f.lower(x, w).compile(), f(x, w), x, w

  def test_equal_keys_share_a_body_and_devices_count_their_own(self):
    keys_a = [i % 3 for i in range(8)]
    keys_b = [2 - i % 3 for i in range(8)]  # every device: 2 matmuls in all
    compiled, out, x, w = self.compiled(keys_a, keys_b)
    text = compiled.as_text()
    branches = support.conditional_branches(text)
    self.assertEqual(sorted(branches), [3, 3])  # not 8 each
    one = 2 * 16 * 16 * 16  # a (16, 16) block times w
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=8), 2 * one
    )
    # Without the device mapping: each conditional's busiest branch.
    self.assertEqual(hlo_tools.dot_flops(compiled), 4 * one)
    # Each device ran its own branches.
    xs, got = (
      np.asarray(x).reshape(8, 16, 16),
      np.asarray(out).reshape(8, 16, 16),
    )
    wn = np.asarray(w)
    for i in range(8):
      y = xs[i]
      for _ in range(keys_a[i] + keys_b[i]):
        y = np.tanh(y @ wn)
      np.testing.assert_allclose(got[i], y, rtol=1e-5, atol=1e-6)

  def test_one_key_has_no_conditional(self):
    compiled, _, _, _ = self.compiled([1] * 8, [2] * 8)
    self.assertNotIn(' conditional(', compiled.as_text())
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=8), 3 * 2 * 16**3
    )


@functools.cache
def _table_loops(tables, mapped=False, rows=False, shifted=False):
  """A compiled program with one ``fori_loop(0, table[slot], ...)`` per
  table, each iteration two (16, 16) @ (16, 16) matmuls; ``mapped`` runs
  the loops on each of 3 blocks (``lax.map``), else on one; ``rows`` reads
  the count from a row per slot, other columns after it (as dmuon's
  ``_layout.table_columns`` does); ``shifted``: block ``t`` reads the row
  of slot ``(slot - t) mod 8`` (as dmuon's scanned stacks do)."""
  from dmuon_jax import _gather  # pylint: disable=import-outside-toplevel

  mesh = _mesh((1, 8))

  def run(y, w, slot, t=0):
    if shifted:
      slot = (slot - t) % 8
    for table in tables:
      table = np.array(table, np.int32)
      if rows:
        table = np.stack([table, np.arange(8), 7 - np.arange(8)], axis=1)
      count = jnp.asarray(table)[slot]
      count = count[0] if rows else count
      y = lax.fori_loop(0, count, lambda _, y: jnp.tanh(y @ w) @ w, y)
    return y

  def f(x, w):
    # x: f32[k, 16, 16]{V:replicate,shard}
    slot = _gather.slot_index(BOTH)
    if mapped:
      return lax.map(lambda a: run(a[1], w, slot, a[0]), (jnp.arange(3), x))
    return run(x[0], w, slot)[None]

  k = 3 if mapped else 1
  return (
    jax.jit(_smap(f, mesh, (P(BOTH), P()), P(BOTH)))
    .lower(_arg(mesh, (8 * k, 16, 16), P(BOTH)), _arg(mesh, (16, 16), P()))
    .compile()
  )


class TableTripCountTest(absltest.TestCase):
  """``fori_loop(0, table[slot], ...)``: XLA knows no trip count, and
  ``dot_flops`` reads each slot's count from the constant table."""

  BODY = 2 * 2 * 16**3  # FLOPs of one iteration: two 16x16x16 matmuls

  def test_busiest_slot_runs_its_count(self):
    compiled = _table_loops(((1, 2, 3, 0, 1, 2, 3, 4),))
    self.assertNotIn('known_trip_count', compiled.as_text())
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=8), 4 * self.BODY
    )
    self.assertEqual(
      hlo_tools.dot_flops(compiled, loop_trip_counts=False), self.BODY
    )
    other = _table_loops(((0, 6, 1, 1, 1, 1, 1, 1),))  # busiest: slot 1
    self.assertEqual(
      hlo_tools.dot_flops(other, branches_per_device=8), 6 * self.BODY
    )

  def test_without_slots_counts_each_device(self):
    compiled = _table_loops(((1, 2, 3, 0, 1, 2, 3, 4),))
    self.assertEqual(hlo_tools.dot_flops(compiled), 4 * self.BODY)
    # Slots other than the devices: the longest run.
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=4), 4 * self.BODY
    )

  def test_loops_add_up_per_device(self):
    a, b = (4, 0, 0, 0, 0, 0, 0, 2), (0, 1, 0, 0, 0, 0, 0, 3)
    compiled = _table_loops((a, b))
    per_slot = max(i + j for i, j in zip(a, b))  # 5, on slot 7
    self.assertEqual(hlo_tools.dot_flops(compiled), per_slot * self.BODY)
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=8),
      per_slot * self.BODY,
    )
    # Slots other than the devices: each loop's longest run, an upper bound.
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=4),
      (max(a) + max(b)) * self.BODY,
    )

  def test_rows_shifted_by_the_outer_loop(self):
    table = (5, 0, 0, 1, 0, 0, 0, 2)
    compiled = _table_loops((table,), mapped=True, shifted=True)
    # Device s runs table[(s - t) mod 8] for t < 3: its sum, the busiest.
    want = max(sum(table[(s - t) % 8] for t in range(3)) for s in range(8))
    self.assertEqual(want, 7)  # slot 1: 5 + 2 + 0; not 3 * max = 15
    self.assertEqual(hlo_tools.dot_flops(compiled), want * self.BODY)

  def test_loop_in_a_known_loop_multiplies(self):
    compiled = _table_loops(((1, 2, 3, 0, 1, 2, 3, 4),), mapped=True)
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=8),
      3 * 4 * self.BODY,
    )

  def test_count_first_in_a_row_per_slot(self):
    compiled = _table_loops(((2, 0, 5, 1, 1, 0, 3, 3),), rows=True)
    self.assertEqual(
      hlo_tools.dot_flops(compiled, branches_per_device=8), 5 * self.BODY
    )
    self.assertEqual(hlo_tools.dot_flops(compiled), 5 * self.BODY)

  def test_bound_from_data_warns_and_counts_the_body_once(self):
    mesh = _mesh((1, 8))

    def f(x, w):
      count = (x[0, 0] > 0).astype(jnp.int32) * 3
      return lax.fori_loop(0, count, lambda _, y: jnp.tanh(y @ w) @ w, x)

    compiled = (
      jax.jit(_smap(f, mesh, (P(BOTH), P()), P(BOTH)))
      .lower(_arg(mesh, (128, 16), P(BOTH)), _arg(mesh, (16, 16), P()))
      .compile()
    )
    with self.assertWarnsRegex(UserWarning, 'lower bound'):
      got = hlo_tools.dot_flops(compiled, branches_per_device=8)
    self.assertEqual(got, self.BODY)


class HloToolsTest(absltest.TestCase):
  """examples/benchmarks/hlo_tools.py: its examples run, and the names it
  took from dmuon_jax.diagnostics still work there for one release."""

  def test_examples_pass(self):
    result = doctest.testmod(hlo_tools, optionflags=doctest.ELLIPSIS)
    self.assertEqual(result.failed, 0, result)
    self.assertGreater(result.attempted, 0)

  def test_moved_names_warn_and_work(self):
    a, b = jnp.ones((8, 16)), jnp.ones((16, 16))
    compiled = jax.jit(lambda a, b: (a @ b) @ b).lower(a, b).compile()
    with self.assertWarnsRegex(
      DeprecationWarning, 'examples/benchmarks/hlo_tools.py'
    ):
      dot_flops = diagnostics.dot_flops
    self.assertEqual(dot_flops(compiled), hlo_tools.dot_flops(compiled))
    self.assertEqual(dot_flops(compiled), 2 * 2 * 8 * 16 * 16)
    mesh = _mesh((1, 8))
    psum = jax.jit(_smap(lambda x: lax.psum(x, 'shard'), mesh, P(), P()))
    text = psum.trace(_arg(mesh, (8, 16), P())).lower().as_text()
    with self.assertWarnsRegex(DeprecationWarning, 'stablehlo_collectives'):
      from dmuon_jax.diagnostics import stablehlo_collectives  # noqa: PLC0415
    got = stablehlo_collectives(text)
    self.assertEqual(got, hlo_tools.stablehlo_collectives(text))
    self.assertEqual([(c.kind, c.group_size) for c in got], [('all-reduce', 8)])
    with self.assertWarnsRegex(DeprecationWarning, 'collective_nesting'):
      collective_nesting = diagnostics.collective_nesting
    with self.assertWarnsRegex(DeprecationWarning, 'NestedCollective'):
      nested = diagnostics.NestedCollective
    got = collective_nesting(psum.lower(_arg(mesh, (8, 16), P())).compile())
    self.assertEqual([(c.kind, c.context) for c in got], [('all-reduce', ())])
    self.assertEqual(type(got[0]).__name__, nested.__name__)
    with self.assertRaises(AttributeError):
      diagnostics.no_such_name  # noqa: B018
    for name in ('dot_flops', 'collective_nesting', 'NestedCollective'):
      self.assertNotIn(name, diagnostics.__all__)


if __name__ == '__main__':
  absltest.main()
