"""Compiled-HLO accounting of dmuon: NS FLOPs, collective bytes, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'replicated_is_one_all_gather',
  r'ns_flops_per_device_mesh_(2x4_embed_head|1x8_fsdp)',
  r'muon_state_per_device_is_an_eighth',
  r'moves_one_all_reduce_mesh_2x4',
  r'ns_flops_per_device_mesh_1x8$',
  r'fsdp_is_one_all_to_all_each_way',
)

AXES = support.AXES
make_mesh = support.make_mesh
llama = support.llama_shapes
materialize = support.materialize
muon_bytes = support.muon_bytes
without_finite_flags = support.without_finite_flags
ALL_2D = support.ALL_2D
PREDICATES = {'default': None, 'all_2d': ALL_2D}


def compiled_update(shape, predicate='default', layout='replicated'):
  """The compiled drop-in update of llama() (shared by the tests below)."""
  return _compiled_update(tuple(shape), predicate, layout)


@functools.cache
def _compiled_update(shape, predicate, layout):
  mesh = make_mesh(shape)
  shapes = llama()
  shardings = support.fsdp_shardings(shapes, mesh) if layout == 'fsdp' else None
  params = materialize(shapes, mesh, shardings)
  opt = dmuon_jax.dmuon(0.02, predicate=PREDICATES[predicate], mesh=mesh)
  state = opt.init(params)
  compiled = jax.jit(opt.update).lower(params, state, params).compile()
  return compiled, params, state


class CompiledUpdateTest(parameterized.TestCase):
  """NS FLOPs and collectives of compiled drop-in updates (one compile per
  configuration, shared by the FLOP and byte checks)."""

  @parameterized.named_parameters(
    ('mesh_1x8', (1, 8), 'default'),
    # HSDP owners with the embedding and head on Muon too: one program.
    ('mesh_2x4_embed_head', (2, 4), 'all_2d'),
    ('mesh_1x8_fsdp', (1, 8), 'default', 'fsdp'),
  )
  def test_ns_flops_per_device(self, shape, predicate, layout='replicated'):
    compiled, params, _ = compiled_update(shape, predicate, layout)
    report = dmuon_jax.analyze_compiled(compiled)
    plan = dmuon_jax.plan_ownership(
      params, make_mesh(shape), predicate=PREDICATES[predicate]
    )
    costs = [u.cost for u in plan.units]
    floor = max(sum(costs) / plan.num_slots, max(costs))
    # The matmuls of the most expensive owner branch (this device's work,
    # Newton-Schulz loops times their trip counts) are exactly the busiest
    # owner's Newton-Schulz...
    flops = support.hlo_tools.dot_flops(compiled)
    np.testing.assert_allclose(flops, plan.makespan, rtol=1e-6)
    # ... within 15% of the floor; redundant NS (every device every matrix)
    # would be ~N times more.
    self.assertLessEqual(
      flops, 1.15 * floor, msg=f'{flops:.3e} vs floor {floor:.3e}'
    )
    self.assertLess(flops, 0.3 * sum(costs))
    self.assertFalse([c for c in report.collectives if c.in_loop])

  def test_drop_in_update_replicated_is_one_all_gather(self):
    compiled, params, _ = compiled_update((1, 8))
    report = dmuon_jax.analyze_compiled(compiled)
    kinds, nbytes = without_finite_flags(self, report)
    self.assertEqual(kinds, {'all-gather': 1})
    expected = 7 / 8 * muon_bytes(params)
    self.assertLessEqual(nbytes, 1.02 * expected)
    self.assertGreaterEqual(nbytes, 0.98 * expected)

  def test_drop_in_update_fsdp_is_one_all_to_all_each_way(self):
    compiled, params, state = compiled_update((1, 8), layout='fsdp')
    report = dmuon_jax.analyze_compiled(compiled)
    kinds, nbytes = without_finite_flags(self, report)
    self.assertEqual(kinds, {'all-to-all': 2})
    expected = 2 * 7 / 8 * muon_bytes(params) / 8
    self.assertLessEqual(nbytes, 1.02 * expected)
    self.assertGreaterEqual(nbytes, 0.98 * expected)
    (layout,) = dmuon_jax.owner_layouts(state)
    self.assertEqual(nbytes, layout.collective_bytes()['all-to-all'])

  def test_muon_state_per_device_is_an_eighth(self):
    _, params, state = compiled_update((1, 8))
    (muon_state,) = support.dmuon_states(state)
    per_device = [0] * 8
    for mu in muon_state.mu:
      for shard in mu.addressable_shards:
        per_device[shard.device.id] += shard.data.nbytes
    self.assertLessEqual(max(per_device), 1.2 * muon_bytes(params) / 8)
    self.assertGreaterEqual(min(per_device), 0.8 * muon_bytes(params) / 8)


class CommunicationTest(parameterized.TestCase):
  # On HSDP (2x4): the owner axes are both axes (a 1x8 case, the same
  # program over one axis, was dropped: 9 s of the suite's time).
  @parameterized.named_parameters(('mesh_2x4', (2, 4)))
  def test_explicit_ddp_train_step_moves_one_all_reduce(self, shape):
    mesh = make_mesh(shape)
    shapes = llama()
    params = materialize(shapes, mesh)
    opt = dmuon_jax.dmuon(0.02, mesh=mesh)
    state = opt.init(params)
    n = mesh.size
    batch = jax.device_put(jnp.ones((n * 2, 128)), NamedSharding(mesh, P(AXES)))

    def loss_fn(params, x):
      for i in range(8):
        layer = params[f'layers_{i}']
        h = x @ layer['attn']['q'] @ layer['attn']['k'].T
        h = h @ layer['attn']['v'] @ layer['attn']['o']
        x = x + jnp.tanh(h) * layer['attn_norm']
        m = jax.nn.silu(x @ layer['mlp']['gate']) * (x @ layer['mlp']['up'])
        x = x + (m @ layer['mlp']['down']) * layer['mlp_norm']
      logits = (x * params['norm_f']) @ params['lm_head']
      return jnp.mean(logits**2) + jnp.mean(params['embed'] ** 2)

    step = support.explicit_step_fn(opt, mesh, state, loss_fn)
    report = dmuon_jax.analyze_hlo(step, params, state, batch)
    p_muon = muon_bytes(params)
    p_other = sum(x.size * 4 for x in jax.tree.leaves(params)) - p_muon
    floor = 2 * (n - 1) / n * p_muon
    by_kind = report.bytes_by_kind
    muon = by_kind.get('reduce-scatter', 0) + by_kind.get('all-gather', 0)
    self.assertLessEqual(muon, 1.02 * floor)
    self.assertGreaterEqual(muon, 0.98 * floor)
    # All-reduces carry the AdamW leaves and the loss only: no Muon gradient
    # is all-reduced.
    self.assertLessEqual(
      by_kind.get('all-reduce', 0), 2 * (n - 1) / n * (p_other + 64)
    )
    self.assertEqual(
      set(by_kind) - {'reduce-scatter', 'all-gather', 'all-reduce'}, set()
    )
    plan = dmuon_jax.plan_ownership(params, mesh)
    np.testing.assert_allclose(
      muon, plan.collective_bytes()['explicit'], rtol=1e-6
    )


if __name__ == '__main__':
  absltest.main()
