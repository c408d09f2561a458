"""Hook boundary detection for dedicated mode."""

import jax
import jax.numpy as jnp
from absl.testing import absltest
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax

S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)


def block():
  return {
    'attn': {'q': {'kernel': S(16, 16)}, 'o': {'kernel': S(16, 16)}},
    'mlp': {'up': {'kernel': S(16, 32)}, 'down': {'kernel': S(32, 16)}},
    'norm': {'scale': S(16)},
  }


class HookBoundariesTest(absltest.TestCase):
  def test_linen_auto_names(self):
    params = {
      'params': {f'layers_{i}': block() for i in range(4)}
      | {'embed': {'embedding': S(64, 16)}}
    }
    hb = dmuon_jax.find_hook_boundaries(params)
    self.assertEqual(hb.names, tuple(f'params/layers_{i}' for i in range(4)))
    self.assertEqual(hb.scanned, (False,) * 4)
    self.assertEqual(
      set(hb.targets_of('params/layers_3')),
      {
        'params/layers_3/attn/q/kernel',
        'params/layers_3/attn/o/kernel',
        'params/layers_3/mlp/up/kernel',
        'params/layers_3/mlp/down/kernel',
      },
    )

  def test_nnx_list_of_layers(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.layers = nnx.List(
          [nnx.Linear(16, 16, rngs=rngs) for _ in range(4)]
        )

    state = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)
    hb = dmuon_jax.find_hook_boundaries(state)
    self.assertEqual(hb.names, tuple(f'layers/{i}' for i in range(4)))
    self.assertEqual(hb.targets_of('layers/3'), ('layers/3/kernel',))

  def test_scanned_stack(self):
    params = {
      'embed': S(64, 16),
      'layers': {'q': S(4, 16, 16), 'up': S(4, 16, 32), 'norm': S(4, 16)},
      'head': S(16, 64),
    }
    dims = {
      'embed': None,
      'head': None,
      'layers': {'q': MDN(1, 2), 'up': MDN(1, 2), 'norm': None},
    }
    hb = dmuon_jax.find_hook_boundaries(params, weight_dimension_numbers=dims)
    self.assertEqual(hb.names, ('layers',))
    self.assertEqual(hb.scanned, (True,))
    self.assertEqual(hb.targets_of('layers'), ('layers/q', 'layers/up'))

  def test_custom_predicate_for_a_vit(self):
    params = {
      'patch_embed': S(48, 16),
      'encoder': {f'unit{i}': block() for i in range(3)},
    }
    is_block = lambda path, sub: (
      isinstance(sub, dict) and {'attn', 'mlp'} <= set(sub)
    )
    with self.assertRaisesRegex(ValueError, 'encoder/unit0/attn/q/kernel'):
      dmuon_jax.find_hook_boundaries(params)
    hb = dmuon_jax.find_hook_boundaries(params, boundary_predicate=is_block)
    self.assertEqual(
      hb.names, ('encoder/unit0', 'encoder/unit1', 'encoder/unit2')
    )
    self.assertLen(hb.targets_of('encoder/unit1'), 4)
    # The root as one boundary: the whole model gathered at once.
    whole = dmuon_jax.find_hook_boundaries(
      params, boundary_predicate=lambda path, sub: path == ''
    )
    self.assertEqual(whole.names, ('',))

  def test_strict_names_every_target_without_a_boundary(self):
    params = {
      'proj_in': {'kernel': S(16, 16)},
      'layers_0': block(),
      'proj_out': {'kernel': S(16, 16)},
    }
    with self.assertRaisesRegex(
      ValueError,
      r"2 Muon target.*'proj_in/kernel', 'proj_out/kernel'.*strict=False",
    ):
      dmuon_jax.find_hook_boundaries(params)
    hb = dmuon_jax.find_hook_boundaries(params, strict=False)
    self.assertEqual(
      hb.names, ('layers_0', 'proj_in/kernel', 'proj_out/kernel')
    )


if __name__ == '__main__':
  absltest.main()
