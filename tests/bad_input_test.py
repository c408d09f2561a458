"""Bad input to every entry point: the error names the leaf and the fix.

Each case is a row of the README's "Bad input" table. Most raise while the
factory, plan or layout is built; the few that need the gradients' sharding
raise while ``update`` is traced (nothing is compiled).
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax

AXES = ('replicate', 'shard')


def tree(w_dtype=jnp.float32):
  return {'layers_0': {'w': jnp.zeros((8, 16), w_dtype),
                       'b': jnp.zeros((16,))}}


def resized():
  return {'layers_0': {'w': jnp.zeros((8, 24)), 'b': jnp.zeros((16,))}}


def place(x, mesh, spec=None):
  return jax.device_put(x, NamedSharding(mesh, spec or P()))


def half_meshes():
  """A 1x4 mesh on devices 0-3 and one on devices 4-7."""
  devices = np.array(jax.devices())
  return (jax.make_mesh((1, 4), AXES, devices=devices[:4]),
          jax.make_mesh((1, 4), AXES, devices=devices[4:]))


def init_and_update(opt, params):
  state = opt.init(params)
  jax.jit(opt.update).trace(params, state, params)


# -- the cases: each raises ----------------------------------------------


def predicate_selects_vector():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: True)
  opt.init(tree())


def predicate_selects_scalar():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: True)
  opt.init({'temperature': jnp.zeros(())})


def overlapping_dimension_numbers():
  dims = {'layers_0': {'w': MDN(0, (0, 1)), 'b': None}}
  dmuon_jax.dmuon(0.1, muon_weight_dimension_numbers=dims).init(tree())


def integer_leaf():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: x.ndim == 2)
  opt.init(tree(jnp.int32))


def complex_leaf():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: x.ndim == 2)
  opt.init(tree(jnp.complex64))


def mesh_missing_axis():
  dmuon_jax.dmuon(0.1, mesh=jax.make_mesh((8,), ('data',)),
                  axis_names=AXES)


def plan_with_unknown_axis():
  dmuon_jax.plan_ownership(tree(), {'replicate': 2, 'shard': 4},
                           axis_names=('data',))


def params_outside_the_mesh():
  mesh, other = half_meshes()
  dmuon_jax.dmuon(0.1, mesh=mesh).init(place(tree(), other))


def dedicate_params_outside_the_mesh():
  mesh, other = half_meshes()
  dmuon_jax.dedicate(place(tree(), other), mesh)


def sharded_over_axis_not_in_mesh():
  big = jax.make_mesh((2, 2, 2), AXES + ('expert',))
  params = tree()
  params['layers_0']['w'] = place(params['layers_0']['w'], big,
                                  P(None, 'expert'))
  opt = dmuon_jax.dmuon(0.1, mesh=jax.make_mesh((2, 4), AXES))
  init_and_update(opt, params)


def dedicate_sharded_over_axis_not_in_mesh():
  big = jax.make_mesh((2, 2, 2), AXES + ('expert',))
  params = tree()
  params['layers_0']['b'] = place(params['layers_0']['b'], big, P('expert'))
  dmuon_jax.dedicate(params, jax.make_mesh((2, 4), AXES))


def tensor_parallel_on_stack_axis():
  mesh = jax.make_mesh((1, 4, 2), AXES + ('model',))
  params = place({'layers': {'w': jnp.zeros((2, 8, 16))}}, mesh, P('model'))
  opt = dmuon_jax.dmuon(0.1, mesh=mesh, predicate=lambda p, x: True,
                        muon_weight_dimension_numbers=MDN(1, 2))
  init_and_update(opt, params)


def shapes_differ_between_init_and_update():
  opt = dmuon_jax.dmuon(0.1)
  state = opt.init(tree())
  opt.update(resized(), state, resized())


def to_dedicated_with_other_shapes():
  dmuon_jax.dedicate(tree(), None).to_dedicated(resized())


def to_dedicated_with_other_tree():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.to_dedicated({'layers_0': {'w': jnp.zeros((8, 16))}})


def to_params_of_a_plain_tree():
  dmuon_jax.dedicate(tree(), None).to_params(tree())


def no_hook_boundary_in_strict_mode():
  dmuon_jax.dedicate({'proj': jnp.zeros((8, 8))}, None)


def unknown_boundary():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.block(lambda p, x: x, 'layers_9')


def ns_steps_disagree_with_rows():
  dmuon_jax.dmuon(0.1, ns_coeffs='you', ns_steps=3)


def dedicated_ns_steps_disagree_with_rows():
  ded = dmuon_jax.dedicate(tree(), None)
  dmuon_jax.dedicated_muon(ded, 0.1, ns_coeffs='you', ns_steps=3)


def orthogonalize_a_vector():
  dmuon_jax.orthogonalize_via_newton_schulz(jnp.zeros((8,)))


def orthogonalize_integers():
  dmuon_jax.orthogonalize_via_gram_newton_schulz(jnp.zeros((8, 8),
                                                           jnp.int32))


def restore_after_save(like, opt_at_restore=None):
  """Saves ``tree()`` with dmuon, restores onto ``like``."""
  opt = dmuon_jax.dmuon(0.1)
  with tempfile.TemporaryDirectory() as d:
    dmuon_jax.checkpoint.save(d, 1, tree(), opt.init(tree()))
    dmuon_jax.checkpoint.restore(d, like, opt_at_restore)


def restore_onto_other_shapes():
  restore_after_save(resized())


def restore_onto_other_tree():
  restore_after_save({'layers_0': {'w': jnp.zeros((8, 16)),
                                   'bias': jnp.zeros((16,))}})


def restore_with_other_routing():
  # Saved with 'w' on Muon; the new optimizer routes it to AdamW.
  restore_after_save(tree(), dmuon_jax.dmuon(
      0.1, predicate=lambda path, x: False))



def inject_with_a_mesh():
  # A jax Mesh is callable (a context decorator): inject_hyperparams takes
  # it for a schedule and calls it.
  mesh = jax.make_mesh((2, 4), AXES)
  optax.inject_hyperparams(dmuon_jax.dmuon)(
      learning_rate=0.1, mesh=mesh).init(tree())


def inject_a_dtype():
  optax.inject_hyperparams(dmuon_jax.dmuon)(
      learning_rate=0.1, mu_dtype=jnp.float32).init(tree())


def inject_ns_steps():
  opt = optax.inject_hyperparams(dmuon_jax.dmuon)(learning_rate=0.1,
                                                  ns_steps=5)
  params = tree()
  jax.jit(opt.update).trace(params, opt.init(params), params)


def state_of_another_mesh():
  mesh_a, mesh_b = jax.make_mesh((1, 8), AXES), jax.make_mesh((8, 1), AXES)
  params = place(tree(), mesh_a)
  state = dmuon_jax.dmuon(0.1, mesh=mesh_a).init(params)
  opt = dmuon_jax.dmuon(0.1, mesh=mesh_b)
  jax.jit(opt.update).trace(params, state, params)


def params_on_one_device_of_the_mesh():
  params = jax.device_put(tree(), jax.devices()[0])
  dmuon_jax.dmuon(0.1, mesh=jax.make_mesh((1, 8), AXES)).init(params)

# (name, case, exception, regex: what was received, the leaf, the fix)
CASES = (
    ('predicate_selects_vector', predicate_selects_vector, ValueError,
     r"'layers_0/b' has shape \(16,\) \(ndim=1\).*Route it to AdamW"),
    ('predicate_selects_scalar', predicate_selects_scalar, ValueError,
     r"'temperature' has shape \(\) \(ndim=0\).*Route it to AdamW"),
    ('overlapping_dimension_numbers', overlapping_dimension_numbers,
     ValueError, r"'layers_0/w'.*overlapping.*axes \[0\].*Make them disjoint"),
    ('integer_leaf', integer_leaf, ValueError,
     r"'layers_0/w' has dtype int32.*floating-point.*Route it to AdamW"),
    ('complex_leaf', complex_leaf, ValueError,
     r"'layers_0/w' has dtype complex64.*Route it to AdamW"),
    ('mesh_missing_axis', mesh_missing_axis, ValueError,
     (r"includes \['replicate', 'shard'\], which are not axes of the mesh; "
     r"the mesh has axes \('data',\)\. Pass a subset")),
    ('plan_with_unknown_axis', plan_with_unknown_axis, ValueError,
     r"includes \['data'\].*Pass a subset of them"),
    ('params_outside_the_mesh', params_outside_the_mesh, ValueError,
     (r"'layers_0/w' is placed on devices \[4, 5, 6, 7\].*devices "
     r"\[0, 1, 2, 3\].*Place the params on that mesh")),
    ('dedicate_params_outside_the_mesh', dedicate_params_outside_the_mesh,
     ValueError, r"'layers_0/b' is placed on devices \[4, 5, 6, 7\].*Place"),
    ('sharded_over_axis_not_in_mesh', sharded_over_axis_not_in_mesh,
     ValueError, (r"'layers_0/w' is sharded over mesh axis 'expert'.*"
     r"Shard it over those axes")),
    ('dedicate_sharded_over_axis_not_in_mesh',
     dedicate_sharded_over_axis_not_in_mesh, ValueError,
     (r"'layers_0/b' is sharded over axes \['expert'\].*shard it over the "
     r"mesh given to dedicate")),
    ('tensor_parallel_on_stack_axis', tensor_parallel_on_stack_axis,
     ValueError, (r"'layers/w'.*'model' on dim 0, a stack \(batch\) axis.*"
     r"Shard another dimension")),
    ('shapes_differ_between_init_and_update',
     shapes_differ_between_init_and_update, ValueError,
     r"does not match the one given to init\(\).*Call init\(\) again"),
    ('to_dedicated_with_other_shapes', to_dedicated_with_other_shapes,
     ValueError, (r"'layers_0/w' has shape \(8, 24\), but dedicate\(\) "
     r"planned it with shape \(8, 16\).*dedicate again")),
    ('to_dedicated_with_other_tree', to_dedicated_with_other_tree,
     ValueError, (r"params \['layers_0/b'\] are missing.*"
     r"Call dmuon_jax\.dedicate\(\) again")),
    ('to_params_of_a_plain_tree', to_params_of_a_plain_tree, TypeError,
     r"takes the DedicatedParams.*got dict.*to_dedicated\(params\) first"),
    ('no_hook_boundary_in_strict_mode', no_hook_boundary_in_strict_mode,
     ValueError, (r"no hook boundary: \['proj'\].*boundary_predicate.*"
     r"strict=False")),
    ('unknown_boundary', unknown_boundary, ValueError,
     (r"no hook boundary 'layers_9'; the boundaries are \['layers_0'\]\. "
      r"Pass one of them")),
    ('ns_steps_disagree_with_rows', ns_steps_disagree_with_rows, ValueError,
     r"5 rows.*ns_steps=3\. Pass ns_steps=None or ns_steps=5"),
    ('dedicated_ns_steps_disagree_with_rows',
     dedicated_ns_steps_disagree_with_rows, ValueError,
     r"5 rows.*ns_steps=3\. Pass ns_steps=None"),
    ('orthogonalize_a_vector', orthogonalize_a_vector, ValueError,
     r"shape \(\.\.\., m, n\), got shape \(8,\)\. Reshape vectors"),
    ('orthogonalize_integers', orthogonalize_integers, TypeError,
     r"real floating dtype, got int32\. Cast it first"),
    ('restore_onto_other_shapes', restore_onto_other_shapes, ValueError,
     (r"step 1 does not fit the params.*params/layers_0/w: saved \(8, 16\), "
      r"target \(8, 24\).*same tree, same shapes")),
    ('restore_onto_other_tree', restore_onto_other_tree, ValueError,
     (r"not in the checkpoint: params/layers_0/bias \| in the checkpoint but "
      r"not in the target: params/layers_0/b\.")),
    ('restore_with_other_routing', restore_with_other_routing, ValueError,
     r"does not fit the optimizer state.*Make the optimizer as when saving"),
    ('inject_with_a_mesh', inject_with_a_mesh, TypeError,
     (r"mesh is a function wrapping a jax.sharding.Mesh.*"
      r"static_args=\('mesh',\).*jax.set_mesh")),
    ('inject_a_dtype', inject_a_dtype, TypeError,
     r"mu_dtype is an array.*as a string \('float32'\)"),
    ('inject_ns_steps', inject_ns_steps, TypeError,
     r"ns_steps is a traced value.*static_args=\('ns_steps',\)"),
    ('state_of_another_mesh', state_of_another_mesh, ValueError,
     (r"laid out as dmuon_replicate1_shard8_\w+.*runs on mesh "
      r"\{'replicate': 8, 'shard': 1\}.*state_from_portable")),
    ('params_on_one_device_of_the_mesh', params_on_one_device_of_the_mesh,
     ValueError, (r"'layers_0/\w' is placed on devices \[0\].*Place the "
                  r"params on that mesh")),
)


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_raises(self, case, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      case()


class NoMuonTargetsTest(absltest.TestCase):
  """A tree without Muon targets is valid: everything is AdamW."""

  def test_dmuon_on_a_mesh(self):
    mesh = jax.make_mesh((1, 8), AXES)
    params = {'norm': {'scale': jnp.ones((16,))}}
    opt = dmuon_jax.dmuon(0.1, mesh=mesh)
    state = opt.init(params)
    updates, _ = opt.update(params, state, params)
    self.assertEqual(updates['norm']['scale'].shape, (16,))
    state = opt.init({})
    self.assertEqual(opt.update({}, state, {})[0], {})

  def test_dedicate(self):
    mesh = jax.make_mesh((1, 8), AXES)
    params = {'norm': {'scale': jnp.ones((16,))}}
    ded = dmuon_jax.dedicate(params, mesh)
    self.assertIn('no Muon targets', ded.summary())
    self.assertIn('padding 0.0%', ded.summary())
    dp = ded.to_dedicated(params)
    self.assertEmpty(dp.owned.buffers)
    opt = dmuon_jax.dedicated_muon(ded, 0.1)
    state = opt.init(dp)
    updates, _ = opt.update(dp, state, dp)
    self.assertEqual(updates.rest['norm']['scale'].shape, (16,))
    np.testing.assert_array_equal(ded.to_params(dp)['norm']['scale'],
                                  params['norm']['scale'])


class CheckDedicatedTest(absltest.TestCase):
  """``Dedication.check_dedicated``, for trees given to the optimizer."""

  def test_other_dedication(self):
    ded = dmuon_jax.dedicate(tree(), None)
    ded.check_dedicated(ded.to_dedicated(tree()), 'update()')  # Fits.
    other = dmuon_jax.dedicate(resized(), None).to_dedicated(resized())
    # The error names both layouts and how to convert.
    with self.assertRaisesRegex(
        ValueError, rf"update\(\) got owner buffers laid out as "
        rf"{other.owned.layout.name}, but this dedication lays them out as "
        rf"{ded.layout.name}.*to_params\(\) and to_dedicated\(\)"):
      ded.check_dedicated(other, 'update()')


if __name__ == '__main__':
  absltest.main()
