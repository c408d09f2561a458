"""The README's Flax recipes (examples/dedicated_*.py) train correctly."""

import chex
from absl.testing import absltest, parameterized
from flax import nnx

from examples import dedicated_nnx
from tests import support

# The rest of the grid, for CI and the README's command (see conftest.py);
# -m 'not slow' keeps one configuration per behaviour.
SLOW_CASES = (
  r'matches_optax_muon_scan',
  r'matches_optax_muon_loop',
)

STEPS = 10


def nnx_reference(scan):
  """The same NNX model trained on one device with optax.contrib.muon."""
  model = dedicated_nnx.Model(nnx.Rngs(0), scan=scan)
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  tokens = dedicated_nnx.make_tokens()

  def loss_fn(p):
    nnx.replace_by_pure_dict(state, p)
    return dedicated_nnx.cross_entropy(
      nnx.merge(graphdef, state)(tokens), tokens
    )

  opt = support.optax_muon(0.005, params, dims=dedicated_nnx.muon_dims(scan))
  return support.train_single_device(opt, params, loss_fn, STEPS)


class RecipesTest(parameterized.TestCase):
  @parameterized.named_parameters(('loop', False), ('scan', True))
  def test_nnx_recipe_matches_optax_muon(self, scan):
    losses, model = dedicated_nnx.main(STEPS, scan=scan)
    ref_params, ref_losses = nnx_reference(scan)
    self.assertLess(losses[-1], losses[0] - 0.3)
    chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5)
    params = nnx.to_pure_dict(nnx.state(model))
    support.assert_trees_rel_close(self, params, ref_params, rtol=1e-5)


if __name__ == '__main__':
  absltest.main()
