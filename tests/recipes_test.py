"""The README's Flax recipes (examples/dedicated_*.py) train correctly."""

import jax
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from dmuon_jax import _planner
from examples import dedicated_nnx
from tests import alias_test

STEPS = 10


def nnx_reference(scan):
  """The same NNX model trained on one device with optax.contrib.muon."""
  model = dedicated_nnx.Model(nnx.Rngs(0), scan=scan)
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  specs = _planner.muon_target_specs(
      params, predicate=dedicated_nnx.predicate(scan))
  dims = jax.tree.unflatten(jax.tree.structure(params), [
      None if s is None else optax.contrib.MuonDimensionNumbers(
          s.reduction_axes, s.output_axes) for s in specs])
  opt = optax.contrib.muon(0.005, muon_weight_dimension_numbers=dims)
  opt_state = opt.init(params)
  tokens = dedicated_nnx.make_tokens()

  @jax.jit
  def step(params, opt_state):
    def loss_fn(p):
      nnx.replace_by_pure_dict(state, p)
      logits = nnx.merge(graphdef, state)(tokens)
      return dedicated_nnx.cross_entropy(logits, tokens)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(STEPS):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return params, losses


class RecipesTest(parameterized.TestCase):

  @parameterized.named_parameters(('loop', False), ('scan', True))
  def test_nnx_recipe_matches_optax_muon(self, scan):
    losses, model = dedicated_nnx.main(STEPS, scan=scan)
    ref_params, ref_losses = nnx_reference(scan)
    self.assertLess(losses[-1], losses[0] - 0.3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    params = nnx.to_pure_dict(nnx.state(model))
    alias_test.assert_trees_rel_close(self, params, ref_params, rtol=1e-5)


if __name__ == '__main__':
  absltest.main()
