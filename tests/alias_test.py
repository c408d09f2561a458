"""dmuon on one device against optax.contrib.muon and a plain reference loop."""

import jax
import numpy as np
import optax
from absl.testing import absltest, parameterized

import dmuon_jax
from tests import support
from tests.support import (
  OPTAX_F32_RTOL,
  STEPS,
  assert_trees_rel_close,
  dim_numbers,
  make_params,
  run,
)

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'reference_loop_nesterov',
  r'you_vs_dion',
  r'nesterov_consistent_rms_wd',
  r'gram_algorithm_close_to_direct',
  r'jordan_vs_standard',
)


class OptaxParityTest(parameterized.TestCase):
  @parameterized.named_parameters(
    dict(
      testcase_name='nesterov_wd_mask',
      nesterov=True,
      wd=0.1,
      consistent_rms=None,
    ),
    dict(
      testcase_name='no_nesterov_consistent_rms',
      nesterov=False,
      wd=0.0,
      consistent_rms=0.2,
    ),
    dict(
      testcase_name='nesterov_consistent_rms_wd',
      nesterov=True,
      wd=0.05,
      consistent_rms=0.2,
    ),
  )
  def test_matches_optax_muon(self, nesterov, wd, consistent_rms):
    params = make_params()
    mask = jax.tree.map(lambda x: True, params)
    mask['odd']['kernel'] = False  # decay every Muon matrix but one
    kwargs = dict(
      learning_rate=0.02,
      weight_decay=wd,
      weight_decay_mask=mask,
      nesterov=nesterov,
      consistent_rms=consistent_rms,
      adam_weight_decay=0.01,
      muon_weight_dimension_numbers=dim_numbers(params),
    )
    ours = run(dmuon_jax.dmuon(**kwargs), params)
    ref = run(optax.contrib.muon(**kwargs), params)
    for i in (0, STEPS // 2, STEPS - 1):
      assert_trees_rel_close(self, ours[i], ref[i], rtol=OPTAX_F32_RTOL)
    # The update moved every leaf: the comparison is not vacuous.
    for a, b in zip(jax.tree.leaves(ours[-1]), jax.tree.leaves(params)):
      self.assertGreater(np.abs(a - np.asarray(b)).max(), 1e-3)

  def test_default_routing_matches_optax_with_same_split(self):
    # Default predicate: embeddings, heads, norms and biases go to AdamW.
    params = make_params()
    del params['stack'], params['layers_0']['attn']['qkv']
    labels = dmuon_jax.muon_labels(params)
    self.assertEqual(labels['embed']['embedding'], 'adam')
    self.assertEqual(labels['lm_head']['kernel'], 'adam')
    self.assertEqual(labels['layers_0']['norm']['scale'], 'adam')
    self.assertEqual(labels['layers_0']['mlp']['up']['bias'], 'adam')
    self.assertEqual(labels['layers_0']['mlp']['up']['kernel'], 'muon')
    ours = run(dmuon_jax.dmuon(0.02), params, steps=5)
    ref = run(
      optax.contrib.muon(
        0.02, muon_weight_dimension_numbers=dim_numbers(params)
      ),
      params,
      steps=5,
    )
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=OPTAX_F32_RTOL)

  @parameterized.named_parameters(
    ('you_vs_dion', 'you', 'dion'), ('jordan_vs_standard', 'jordan', 'standard')
  )
  def test_presets_match_optax_presets(self, ours_name, optax_name):
    params = make_params()
    dims = dim_numbers(params)
    ours = run(
      dmuon_jax.dmuon(
        0.02, ns_coeffs=ours_name, muon_weight_dimension_numbers=dims
      ),
      params,
      5,
    )
    ref = run(
      optax.contrib.muon(
        0.02, ns_coeffs=optax_name, muon_weight_dimension_numbers=dims
      ),
      params,
      5,
    )
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=OPTAX_F32_RTOL)

  def test_adaptive_matches_optax_on_unstacked_leaves(self):
    # optax sums the dual norm over a whole leaf; dmuon per matrix. They agree
    # where a leaf is one matrix.
    params = make_params()
    del params['stack']
    dims = dim_numbers(params)
    kwargs = dict(
      learning_rate=0.01, adaptive=True, muon_weight_dimension_numbers=dims
    )
    ours = run(dmuon_jax.dmuon(**kwargs), params, 5)
    ref = run(optax.contrib.muon(**kwargs), params, 5)
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=OPTAX_F32_RTOL)

  def test_gram_algorithm_close_to_direct(self):
    params = make_params()
    dims = dim_numbers(params)
    ours = run(
      dmuon_jax.dmuon(
        0.02, ns_algorithm='gram', muon_weight_dimension_numbers=dims
      ),
      params,
      5,
    )
    ref = run(
      optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims), params, 5
    )
    assert_trees_rel_close(self, ours[-1], ref[-1], rtol=1e-4)


class SgdMomentumTest(parameterized.TestCase):
  @parameterized.named_parameters(('nesterov', True), ('plain', False))
  def test_matches_reference_loop(self, nesterov):
    params = make_params()
    dims = dim_numbers(params)
    ours = run(
      dmuon_jax.dmuon(
        0.02,
        beta=0.9,
        weight_decay=0.1,
        nesterov=nesterov,
        momentum='sgd',
        muon_weight_dimension_numbers=dims,
      ),
      params,
    )
    ref = support.reference_sgd_muon(
      params, dims, lr=0.02, beta=0.9, nesterov=nesterov, wd=0.1, steps=STEPS
    )
    for i in (0, STEPS - 1):
      assert_trees_rel_close(self, ours[i], ref[i], rtol=OPTAX_F32_RTOL)


if __name__ == '__main__':
  absltest.main()
