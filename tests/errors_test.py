"""Bad input raises a ValueError that names the leaf and the fix."""

import jax
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax


def params():
  return {'layers_0': {'w': jnp.zeros((4, 8)), 'b': jnp.zeros((8,))},
          'step_scale': jnp.zeros(()),
          'stack': jnp.zeros((2, 4, 8))}


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('1d_leaf', lambda path, x: path.endswith('b') or x.ndim == 2,
       r"layers_0/b.*AdamW"),
      ('0d_leaf', lambda path, x: path == 'step_scale' or x.ndim == 2,
       r"step_scale.*AdamW"),
  )
  def test_predicate_selecting_a_vector_or_scalar(self, predicate, pattern):
    opt = dmuon_jax.dmuon(0.1, predicate=predicate)
    with self.assertRaisesRegex(ValueError, pattern):
      opt.init(params())

  @parameterized.named_parameters(
      ('overlapping', MDN(1, (1, 2)), r'stack'),
      ('out_of_range', MDN(1, 3), r'stack'),
  )
  def test_bad_dimension_numbers(self, dims, pattern):
    tree = params()
    all_dims = {'layers_0': {'w': MDN(), 'b': None}, 'step_scale': None,
                'stack': dims}
    opt = dmuon_jax.dmuon(0.1, muon_weight_dimension_numbers=all_dims)
    with self.assertRaisesRegex(ValueError, pattern):
      opt.init(tree)

  def test_unknown_preset(self):
    with self.assertRaisesRegex(ValueError, r'polar.*jordan|jordan.*polar'):
      dmuon_jax.dmuon(0.1, ns_coeffs='polar')

  def test_ns_steps_inconsistent_with_coefficient_rows(self):
    rows = [(3.4445, -4.7750, 2.0315)] * 4
    with self.assertRaisesRegex(ValueError, r'4.*ns_steps'):
      dmuon_jax.dmuon(0.1, ns_coeffs=rows, ns_steps=5)
    with self.assertRaisesRegex(ValueError, r'ns_steps'):
      dmuon_jax.dmuon(0.1, ns_coeffs='you', ns_steps=3)
    # The consistent spellings are accepted.
    dmuon_jax.dmuon(0.1, ns_coeffs=rows, ns_steps=4)
    dmuon_jax.dmuon(0.1, ns_coeffs=rows)

  @parameterized.named_parameters(
      ('momentum', dict(momentum='adam'), r"momentum='adam'"),
      ('ns_algorithm', dict(ns_algorithm='svd'), r"ns_algorithm='svd'"),
      ('preconditioning', dict(preconditioning='l2'),
       r"preconditioning='l2'"),
  )
  def test_bad_static_options(self, kwargs, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      dmuon_jax.dmuon(0.1, **kwargs)



class MeshInputTest(absltest.TestCase):

  def test_mesh_without_the_named_axes(self):
    mesh = jax.make_mesh((8,), ('data',))
    with self.assertRaisesRegex(ValueError, r"replicate.*data|data.*replicate"):
      dmuon_jax.dmuon(0.1, mesh=mesh, axis_names=('replicate', 'shard'))

  def test_param_sharded_over_an_axis_dmuon_does_not_own(self):
    mesh = jax.make_mesh((2, 2, 2), ('replicate', 'shard', 'expert'))
    tree = {'layers_0': {'w': jnp.zeros((8, 16))}}
    tree = jax.device_put(tree, NamedSharding(mesh, P(None, 'expert')))
    opt = dmuon_jax.dmuon(0.1, mesh=mesh, axis_names=('replicate', 'shard'))
    with self.assertRaisesRegex(ValueError, r"layers_0/w.*'expert'"):
      opt.init(tree)

  def test_tensor_parallel_axis_on_a_stack_axis(self):
    mesh = jax.make_mesh((1, 4, 2), ('replicate', 'shard', 'model'))
    tree = {'layers': {'w': jnp.zeros((2, 8, 16))}}
    tree = jax.device_put(tree, NamedSharding(mesh, P('model')))
    opt = dmuon_jax.dmuon(
        0.1, mesh=mesh, predicate=lambda p, x: True,
        muon_weight_dimension_numbers=MDN(1, 2))
    with self.assertRaisesRegex(ValueError,
                                r"layers/w.*'model'.*stack \(batch\) axis"):
      state = opt.init(tree)
      jax.jit(opt.update)(tree, state, tree)

  def test_tensor_parallel_axis_with_another_axis_on_one_dim(self):
    mesh = jax.make_mesh((1, 4, 2), ('replicate', 'shard', 'model'))
    tree = {'layers_0': {'w': jnp.zeros((8, 16))}}
    tree = jax.device_put(tree, NamedSharding(mesh, P(None, ('shard',
                                                             'model'))))
    opt = dmuon_jax.dmuon(0.1, mesh=mesh)
    with self.assertRaisesRegex(ValueError, r"layers_0/w.*only axis"):
      state = opt.init(tree)
      jax.jit(opt.update)(tree, state, tree)

  def test_tensor_parallel_axis_among_owner_axes(self):
    mesh = jax.make_mesh((1, 4, 2), ('replicate', 'shard', 'model'))
    with self.assertRaisesRegex(ValueError, r"tensor-parallel axis 'model'"):
      dmuon_jax.dmuon(0.1, mesh=mesh, axis_names=('shard', 'model'))

  def test_leaf_added_after_init_is_named(self):
    tree = {'a': jnp.zeros((8, 16)), 'b': jnp.zeros((16,))}
    opt = dmuon_jax.dmuon(0.1)
    state = opt.init(tree)
    other = dict(tree, c=jnp.zeros((4,)))
    with self.assertRaisesRegex(ValueError, r"\['c'\].*new"):
      opt.update(other, state, other)

  def test_tree_at_update_differs_from_init_on_a_mesh(self):
    mesh = jax.make_mesh((1, 8), ('replicate', 'shard'))
    tree = {'a': jnp.zeros((8, 16)), 'b': jnp.zeros((16, 8))}
    opt = dmuon_jax.dmuon(0.1, mesh=mesh)
    state = opt.init(tree)
    other = {'a': jnp.zeros((8, 16)), 'b': jnp.zeros((16, 24))}
    with self.assertRaisesRegex(ValueError, 'does not match the one given'):
      opt.update(other, state, other)


if __name__ == '__main__':
  absltest.main()
