"""Bad input to every entry point: the error names the leaf and the fix.

Every row of the "Bad input" tables (``docs/reference/bad_input.md``) has a
case in ``CASES``; some have several (one per entry point or variant). Most
raise while the factory, plan or layout is built; the few that need the
gradients' sharding raise while ``update`` is traced (nothing is compiled).
Each regex asks for what was received, the leaf (or argument) and the fix
the message names.
"""

import functools
import pathlib
import re
import tempfile
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

import dmuon_jax
from tests import support

AXES = ('replicate', 'shard')
S = jax.ShapeDtypeStruct


def tree(w_dtype=jnp.float32):
  return {'layers_0': {'w': jnp.zeros((8, 16), w_dtype), 'b': jnp.zeros((16,))}}


def resized():
  return {'layers_0': {'w': jnp.zeros((8, 24)), 'b': jnp.zeros((16,))}}


def place(x, mesh, spec=None):
  return jax.device_put(x, NamedSharding(mesh, spec or P()))


def half_meshes():
  """A 1x4 mesh on devices 0-3 and one on devices 4-7."""
  devices = np.array(jax.devices())
  return (
    jax.make_mesh((1, 4), AXES, devices=devices[:4]),
    jax.make_mesh((1, 4), AXES, devices=devices[4:]),
  )


def init_and_update(opt, params):
  state = opt.init(params)
  jax.jit(opt.update).trace(params, state, params)


def stack_shapes():
  """One (4, 8, 16) leaf: a stack axis and two matrix axes to misname."""
  return {'blk': {'w': S((4, 8, 16), jnp.float32)}}


def tp_mesh():
  return jax.make_mesh((1, 4, 2), AXES + ('model',))


def in_pairs():
  """The block model, its blocks gathered two at a time."""
  return dmuon_jax.dedicate(support.block_params(), None, layers_per_gather=2)


def scanned_w(path, leaf):
  del leaf
  return path.endswith('/w')


def stacks(params):
  """Dimension numbers reading leaves of rank > 2 as stacks of matrices."""
  return jax.tree.map(lambda x: MDN(1, 2) if x.ndim == 3 else None, params)


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


def plan_with_dims(dims):
  dmuon_jax.plan_ownership(stack_shapes(), None, weight_dimension_numbers=dims)


def dmuon_with_dims(dims):
  dmuon_jax.dmuon(0.1, muon_weight_dimension_numbers=dims).init(tree())


def dimension_numbers_select_vector():
  dmuon_jax.plan_ownership(
    {'b': S((8,), jnp.float32)}, None, weight_dimension_numbers=MDN()
  )


def integer_leaf():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: x.ndim == 2)
  opt.init(tree(jnp.int32))


def complex_leaf():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: x.ndim == 2)
  opt.init(tree(jnp.complex64))


def bool_leaf():
  opt = dmuon_jax.dmuon(0.1, predicate=lambda path, x: x.ndim == 2)
  opt.init(tree(jnp.bool_))


def mesh_missing_axis():
  dmuon_jax.dmuon(0.1, mesh=jax.make_mesh((8,), ('data',)), axis_names=AXES)


def plan_with_unknown_axis():
  dmuon_jax.plan_ownership(
    tree(), {'replicate': 2, 'shard': 4}, axis_names=('data',)
  )


def plan(**kwargs):
  dmuon_jax.plan_ownership(tree(), **kwargs)


def dmuon_with(**kwargs):
  dmuon_jax.dmuon(0.1, **kwargs)


def tensor_parallel_axis_among_owner_axes():
  dmuon_jax.dmuon(
    0.1,
    mesh=tp_mesh(),
    axis_names=('shard', 'model'),
    tensor_parallel_axis='model',
  )


def owner_groups_with_tp_init():
  dmuon_jax.dmuon(
    0.1, mesh=tp_mesh(), tensor_parallel_axis='model', owner_groups=2
  ).init(place(tree(), tp_mesh()))


def dedicate_owner_groups_with_tp():
  w = place(jnp.zeros((16, 64)), tp_mesh(), P(None, 'model'))
  dmuon_jax.dedicate(
    {'layers_0': {'w': w}},
    tp_mesh(),
    tensor_parallel_axis='model',
    owner_groups=2,
  )


def dedicated_muon_aol_with_split_matrices():
  # 4 matrices of 1 MiB on 8 devices: 'auto' splits them (whole ones pad a
  # gather by 100%), and split matrices run Gram Newton-Schulz.
  params = {f'layers_{i}': {'up': S((128, 512), jnp.float32)} for i in range(4)}
  ded = dmuon_jax.dedicate(params, {'replicate': 1, 'shard': 8})
  assert ded.plan.groups
  dmuon_jax.dedicated_muon(ded, 0.1, preconditioning='aol')


def dedicate_owner_groups_with_scanned_stack():
  dmuon_jax.dedicate(
    {'layers': {'w': jnp.ones((8, 16, 64))}},
    support.make_mesh((1, 8)),
    predicate=scanned_w,
    muon_weight_dimension_numbers=stacks,
    owner_groups=2,
  )


def dedicate_tp_split_scanned_stack():
  w = place(jnp.ones((2, 16, 64)), tp_mesh(), P(None, None, 'model'))
  dmuon_jax.dedicate(
    {'layers': {'w': w}},
    tp_mesh(),
    predicate=scanned_w,
    muon_weight_dimension_numbers=stacks,
    tensor_parallel_axis='model',
  )


def params_outside_the_mesh():
  mesh, other = half_meshes()
  dmuon_jax.dmuon(0.1, mesh=mesh).init(place(tree(), other))


def dedicate_params_outside_the_mesh():
  mesh, other = half_meshes()
  dmuon_jax.dedicate(place(tree(), other), mesh)


def sharded_over_axis_not_in_mesh():
  big = jax.make_mesh((2, 2, 2), AXES + ('expert',))
  params = tree()
  params['layers_0']['w'] = place(
    params['layers_0']['w'], big, P(None, 'expert')
  )
  opt = dmuon_jax.dmuon(0.1, mesh=jax.make_mesh((2, 4), AXES))
  init_and_update(opt, params)


def sharded_over_axis_not_owned():
  mesh = jax.make_mesh((2, 2, 2), AXES + ('expert',))
  params = {
    'layers_0': {'w': place(jnp.zeros((8, 16)), mesh, P(None, 'expert'))}
  }
  dmuon_jax.dmuon(0.1, mesh=mesh, axis_names=AXES).init(params)


def dedicate_sharded_over_axis_not_in_mesh():
  big = jax.make_mesh((2, 2, 2), AXES + ('expert',))
  params = tree()
  params['layers_0']['b'] = place(params['layers_0']['b'], big, P('expert'))
  dmuon_jax.dedicate(params, jax.make_mesh((2, 4), AXES))


def tensor_parallel_on_stack_axis():
  mesh = jax.make_mesh((1, 4, 2), AXES + ('model',))
  params = place({'layers': {'w': jnp.zeros((2, 8, 16))}}, mesh, P('model'))
  opt = dmuon_jax.dmuon(
    0.1,
    mesh=mesh,
    predicate=lambda p, x: True,
    muon_weight_dimension_numbers=MDN(1, 2),
  )
  init_and_update(opt, params)


def tensor_parallel_with_another_axis_on_one_dim():
  mesh = tp_mesh()
  params = {
    'layers_0': {
      'w': place(jnp.zeros((8, 16)), mesh, P(None, ('shard', 'model')))
    }
  }
  init_and_update(dmuon_jax.dmuon(0.1, mesh=mesh), params)


def stack_param_sharded_along_the_layer_axis():
  mesh = support.make_mesh((1, 8))
  params = {
    'layers': {
      'w': jnp.ones((8, 16, 16)),
      'scale': place(jnp.ones((8, 16)), mesh, P('shard')),
    }
  }
  dmuon_jax.dedicate(
    params, mesh, predicate=scanned_w, muon_weight_dimension_numbers=stacks
  )


def shapes_differ_between_init_and_update(mesh=None):
  opt = dmuon_jax.dmuon(0.1, mesh=mesh)
  state = opt.init(tree())
  opt.update(resized(), state, resized())


def shapes_differ_between_init_and_update_on_a_mesh():
  shapes_differ_between_init_and_update(jax.make_mesh((1, 8), AXES))


def leaf_added_after_init():
  opt = dmuon_jax.dmuon(0.1)
  state = opt.init(tree())
  grown = dict(tree(), c=jnp.zeros((4,)))
  opt.update(grown, state, grown)


def to_dedicated_with_other_shapes():
  dmuon_jax.dedicate(tree(), None).to_dedicated(resized())


def to_dedicated_with_other_tree():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.to_dedicated({'layers_0': {'w': jnp.zeros((8, 16))}})


def to_params_of_a_plain_tree():
  dmuon_jax.dedicate(tree(), None).to_params(tree())


def no_hook_boundary_in_strict_mode():
  # A Muon target beside the model's blocks (a model without blocks
  # gathers each target with its own module).
  dmuon_jax.dedicate(tree() | {'proj': {'kernel': jnp.zeros((8, 8))}}, None)


def unknown_boundary():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.block(lambda p, x: x, 'layers_9')


def unknown_boundary_in_scan():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.scan(lambda p, x: x, 'layers_9')


def unknown_boundary_in_sequential():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.sequential(lambda p, x: x, ['layers_0', 'layers_9'])


def scan_an_unscanned_boundary():
  ded = dmuon_jax.dedicate(tree(), None)
  ded.scan(lambda p, x: x, 'layers_0')


def block_inside_a_gather_group():
  in_pairs().block(support.block_fn, 'layers_0')


def sequential_splitting_a_gather_group():
  in_pairs().sequential(support.block_fn, ['layers_1', 'layers_2'])


def layers_per_gather(n):
  params = {'layers': {'w': jnp.ones((3, 16, 16))}}
  dmuon_jax.dedicate(
    params,
    None,
    predicate=scanned_w,
    muon_weight_dimension_numbers=stacks,
    layers_per_gather=n,
  )


def remat_policy_saving_the_weights():
  mesh = support.make_mesh((1, 8))
  ded = dmuon_jax.dedicate(
    support.block_params(),
    mesh,
    remat_policy=jax.checkpoint_policies.everything_saveable,
  )
  dp = ded.to_dedicated(support.block_params())
  loss = lambda dp, x: jnp.sum(ded.block(support.block_fn, 'layers_0')(dp, x))
  step = jax.shard_map(
    lambda dp, x: dmuon_jax.local_value_and_grad(loss)(dp, x)[0],
    mesh=mesh,
    in_specs=(ded.specs(), P(AXES)),
    out_specs=P(AXES),
  )
  x = place(jnp.ones((8, support.WIDTH)), mesh, P(AXES))
  jax.jit(step).lower(dp, x)


ROWS_4 = ((3.4445, -4.7750, 2.0315),) * 4


def ns_steps_disagree_with_given_rows():
  dmuon_jax.dmuon(0.1, ns_coeffs=ROWS_4, ns_steps=5)


def ns_steps_disagree_with_rows():
  dmuon_jax.dmuon(0.1, ns_coeffs='you', ns_steps=3)


def dedicated_ns_steps_disagree_with_rows():
  ded = dmuon_jax.dedicate(tree(), None)
  dmuon_jax.dedicated_muon(ded, 0.1, ns_coeffs='you', ns_steps=3)


def orthogonalize_a_vector():
  dmuon_jax.orthogonalize_via_newton_schulz(jnp.zeros((8,)))


def orthogonalize_integers():
  dmuon_jax.orthogonalize_via_gram_newton_schulz(jnp.zeros((8, 8), jnp.int32))


def restore_after_save(like, opt_at_restore=None):
  """Saves ``tree()`` with dmuon, restores onto ``like``."""
  opt = dmuon_jax.dmuon(0.1)
  with tempfile.TemporaryDirectory() as d:
    dmuon_jax.checkpoint.save(d, 1, tree(), opt.init(tree()))
    dmuon_jax.checkpoint.restore(d, like, opt_at_restore)


def restore_onto_other_shapes():
  restore_after_save(resized())


def restore_onto_other_tree():
  restore_after_save(
    {'layers_0': {'w': jnp.zeros((8, 16)), 'bias': jnp.zeros((16,))}}
  )


def restore_with_other_routing():
  # Saved with 'w' on Muon; the new optimizer routes it to AdamW (and says
  # so: no leaf goes to Muon).
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', 'dmuon: no leaf goes to Muon')
    restore_after_save(
      tree(), dmuon_jax.dmuon(0.1, predicate=lambda path, x: False)
    )


def inject_with_a_mesh():
  # A jax Mesh is callable (a context decorator): inject_hyperparams takes
  # it for a schedule and calls it.
  mesh = jax.make_mesh((2, 4), AXES)
  optax.inject_hyperparams(dmuon_jax.dmuon)(learning_rate=0.1, mesh=mesh).init(
    tree()
  )


def inject_a_dtype():
  optax.inject_hyperparams(dmuon_jax.dmuon)(
    learning_rate=0.1, mu_dtype=jnp.float32
  ).init(tree())


def inject_ns_steps():
  opt = optax.inject_hyperparams(dmuon_jax.dmuon)(learning_rate=0.1, ns_steps=5)
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


# -- hyperparameters, checked when the factory is called ----------------------


def hyper(factory='dmuon', **kwargs):
  """Only builds the optimizer: the factory call itself must raise."""
  if factory == 'dmuon':
    dmuon_jax.dmuon(**{'learning_rate': 0.02, **kwargs})
  elif factory == 'scale_by_dmuon':
    dmuon_jax.scale_by_dmuon(**kwargs)
  else:
    ded = dmuon_jax.dedicate(tree(), None)
    if factory == 'dedicated_muon':
      dmuon_jax.dedicated_muon(ded, **{'learning_rate': 0.02, **kwargs})
    else:
      dmuon_jax.scale_by_dedicated_muon(ded, **kwargs)


def predicate_a_string():
  dmuon_jax.dmuon(0.02, predicate='2d')


# -- shapes -------------------------------------------------------------------


def stack_without_dims(where='dmuon'):
  params = {'layers': {'w': jnp.ones((3, 8, 16))}}
  if where == 'dmuon':
    dmuon_jax.dmuon(0.02, predicate=scanned_w).init(params)
  elif where == 'dedicate':
    dmuon_jax.dedicate(params, None, predicate=scanned_w)
  else:
    dmuon_jax.plan_ownership(params, None, predicate=scanned_w)


def adamw_leaf_shape_differs(mesh=None):
  opt = dmuon_jax.dmuon(0.1, mesh=mesh)
  params = tree() if mesh is None else place(tree(), mesh)
  state = opt.init(params)
  grads = {'layers_0': {'w': params['layers_0']['w'], 'b': jnp.zeros((12,))}}
  jax.jit(opt.update).trace(grads, state, params)


def explicit_adamw_leaf_shape_differs():
  # The explicit path: per-device gradients inside the user's shard_map.
  mesh = support.make_mesh((1, 8))
  opt = dmuon_jax.dmuon(0.1, mesh=mesh)
  state = opt.init(place(tree(), mesh))
  grown = {'layers_0': {'w': jnp.zeros((8, 16)), 'b': jnp.zeros((12,))}}
  loss = lambda p, b: sum(jnp.sum(q**2) for q in jax.tree.leaves(p)) * b.mean()
  step = support.explicit_step_fn(opt, mesh, state, loss_fn=loss)
  batch = place(jnp.ones((8, 4)), mesh, P(AXES))
  step.trace(place(grown, mesh), state, batch)


def dedicated_adamw_leaf_shape_differs():
  ded = dmuon_jax.dedicate(support.block_params(), None)
  dp = ded.to_dedicated(support.block_params())
  opt = dmuon_jax.dedicated_muon(ded, 0.1)
  state = opt.init(dp)
  rest = dict(dp.rest, head=jnp.zeros((17, 8)))
  grads = dmuon_jax.DedicatedParams(owned=dp.owned, rest=rest)
  jax.jit(opt.update).trace(grads, state, dp)


def two_tensor_parallel_candidates():
  mesh = support.make_mesh((2, 2, 2), ('shard', 'model', 'tp'))
  w = place(jnp.ones((16, 32)), mesh, P('model', 'tp'))
  dmuon_jax.dmuon(0.02, mesh=mesh).init({'layers_0': {'w': w}})


def slot_out_of_range():
  dmuon_jax.plan_ownership(tree(), {'shard': 4}).slot_coords(4)


# (name, case, exception, regex: what was received, the leaf, the fix)
CASES = (
  (
    'predicate_selects_vector',
    predicate_selects_vector,
    ValueError,
    r"'layers_0/b' has shape \(16,\) \(ndim=1\).*Route it to AdamW",
  ),
  (
    'predicate_selects_scalar',
    predicate_selects_scalar,
    ValueError,
    r"'temperature' has shape \(\) \(ndim=0\).*Route it to AdamW",
  ),
  (
    'dimension_numbers_select_vector',
    dimension_numbers_select_vector,
    ValueError,
    (
      r"'b' has shape \(8,\) \(ndim=1\).*Route it to AdamW: .*"
      r'set its dimension numbers to None'
    ),
  ),
  (
    'overlapping_dimension_numbers',
    overlapping_dimension_numbers,
    ValueError,
    r"'layers_0/w'.*overlapping.*axes \[0\].*Make them disjoint",
  ),
  (
    'dimension_numbers_overlap_negative',
    functools.partial(plan_with_dims, MDN(-3, 0)),
    ValueError,
    (
      r"'blk/w' with shape \(4, 8, 16\) has overlapping dimension numbers.*"
      r'axes \[0\] are both reduction and output axes.*Make them disjoint'
    ),
  ),
  (
    'dimension_numbers_out_of_range',
    functools.partial(plan_with_dims, MDN(0, 3)),
    ValueError,
    (
      r"'blk/w' with shape \(4, 8, 16\) \(ndim=3\) has output_axis=3; axes "
      r'\[3\] are out of range \[-3, 3\)\. Fix its MuonDimensionNumbers'
    ),
  ),
  (
    'dimension_numbers_out_of_range_negative',
    functools.partial(plan_with_dims, MDN(-4, 1)),
    ValueError,
    (
      r"'blk/w' with shape \(4, 8, 16\) \(ndim=3\) has reduction_axis=-4; "
      r'axes \[-4\] are out of range \[-3, 3\)\. Fix its '
      r'MuonDimensionNumbers'
    ),
  ),
  (
    'dimension_numbers_empty',
    functools.partial(plan_with_dims, MDN((), 1)),
    ValueError,
    (
      r"'blk/w' with shape \(4, 8, 16\) has an empty reduction_axis; a "
      r'matrix needs at least one reduction and one output axis\. Fix its '
      r'MuonDimensionNumbers'
    ),
  ),
  (
    'dimension_numbers_repeat_an_axis',
    functools.partial(plan_with_dims, MDN(0, (1, 1))),
    ValueError,
    (
      r"'blk/w' with shape \(4, 8, 16\) has output_axis=\(1, 1\), which "
      r'repeats an axis\. List each axis once in its MuonDimensionNumbers'
    ),
  ),
  (
    'dimension_numbers_not_int',
    functools.partial(plan_with_dims, MDN(0.0, 1)),
    ValueError,
    (
      r"'blk/w' has reduction_axis=0\.0; expected an int or a sequence of "
      r'ints\. Fix its MuonDimensionNumbers'
    ),
  ),
  (
    'dimension_numbers_not_a_prefix',
    functools.partial(dmuon_with_dims, {'layers_0': {'w': None, 'c': None}}),
    ValueError,
    (
      r"does not match the structure of params at 'layers_0': got "
      r"PyTreeDef\(\{'c': \*, 'w': \*\}\), params have PyTreeDef\(\{'b': \*, "
      r"'w': \*\}\)\. Pass None, a single optax\.contrib\.MuonDimensionNumbers"
      r', a tree with the structure of params \(or a prefix of it\)'
    ),
  ),
  (
    'dimension_numbers_leaf_not_mdn',
    functools.partial(dmuon_with_dims, {'layers_0': {'w': 0, 'b': None}}),
    ValueError,
    (
      r"has int 0 at 'layers_0/w'; expected "
      r'optax\.contrib\.MuonDimensionNumbers or None\. Pass None, '
      r'a single optax\.contrib\.MuonDimensionNumbers'
    ),
  ),
  (
    'integer_leaf',
    integer_leaf,
    ValueError,
    r"'layers_0/w' has dtype int32.*floating-point.*Route it to AdamW",
  ),
  (
    'complex_leaf',
    complex_leaf,
    ValueError,
    r"'layers_0/w' has dtype complex64.*Route it to AdamW",
  ),
  (
    'bool_leaf',
    bool_leaf,
    ValueError,
    r"'layers_0/w' has dtype bool.*floating-point.*Route it to AdamW",
  ),
  (
    'mesh_missing_axis',
    mesh_missing_axis,
    ValueError,
    (
      r"includes \['replicate', 'shard'\], which are not axes of the mesh; "
      r"the mesh has axes \('data',\)\. Pass a subset"
    ),
  ),
  (
    'plan_with_unknown_axis',
    plan_with_unknown_axis,
    ValueError,
    (
      r"axis_names \('data',\) includes \['data'\], which are not axes of the "
      r"mesh; the mesh has axes \('replicate', 'shard'\)\. Pass a subset of "
      r'them'
    ),
  ),
  (
    'plan_axis_names_without_a_mesh',
    functools.partial(plan, mesh=None, axis_names=('shard',)),
    ValueError,
    (
      r"axis_names \('shard',\) names mesh axes, but no mesh was given.*"
      r'Pass the mesh too'
    ),
  ),
  (
    'tensor_parallel_axis_among_owner_axes',
    tensor_parallel_axis_among_owner_axes,
    ValueError,
    (
      r"axis_names \('shard', 'model'\) includes the tensor-parallel axis "
      r"'model'.*Leave it out of axis_names, or pass "
      r'tensor_parallel_axis=None'
    ),
  ),
  (
    'plan_mesh_an_int',
    functools.partial(plan, mesh=8),
    TypeError,
    (
      r'mesh must be None, a jax\.sharding\.Mesh or AbstractMesh, or a '
      r'mapping \{axis_name: size\}; got int'
    ),
  ),
  (
    'plan_mesh_axis_of_size_zero',
    functools.partial(plan, mesh={'shard': 0}),
    ValueError,
    r"mesh axis 'shard' has size 0; expected a positive int",
  ),
  # owner_groups against the options it meets: one check
  # (_checks.check_option) behind every entry point.
  (
    'owner_groups_one',
    functools.partial(dmuon_with, owner_groups=1),
    ValueError,
    r"owner_groups=1 is not 'auto', None or an int >= 2",
  ),
  (
    'plan_owner_groups_a_bool',
    functools.partial(plan, mesh={'shard': 8}, owner_groups=True),
    ValueError,
    r"owner_groups=True is not 'auto', None or an int >= 2",
  ),
  (
    'owner_groups_with_aol',
    functools.partial(dmuon_with, owner_groups=2, preconditioning='aol'),
    ValueError,
    (
      r'owner_groups=2 runs Gram Newton-Schulz with preconditioning='
      r"'frobenius' on the groups' matrices, but got preconditioning='aol'\. "
      r"Pass preconditioning='frobenius', or owner_groups=None"
    ),
  ),
  (
    'owner_groups_with_aol_and_standard',
    functools.partial(
      dmuon_with,
      owner_groups=2,
      preconditioning='aol',
      ns_algorithm='standard',
    ),
    ValueError,
    (
      r"but got preconditioning='aol' and ns_algorithm='standard'\. Pass "
      r"preconditioning='frobenius' and ns_algorithm='auto' or 'gram', or "
      r'owner_groups=None'
    ),
  ),
  (
    'plan_owner_groups_with_standard',
    functools.partial(
      plan, mesh={'shard': 8}, owner_groups=2, ns_algorithm='standard'
    ),
    ValueError,
    (
      r"owner_groups=2 .* but got ns_algorithm='standard'\. Pass "
      r"ns_algorithm='auto' or 'gram', or owner_groups=None"
    ),
  ),
  (
    'owner_groups_with_tp_init',
    owner_groups_with_tp_init,
    ValueError,
    (
      r"owner_groups=2 with the tensor-parallel axis 'model': TP matrices "
      r'are split over that axis already\. Pass owner_groups=None'
    ),
  ),
  (
    'dedicate_owner_groups_with_tp',
    dedicate_owner_groups_with_tp,
    ValueError,
    r"owner_groups=2 with the tensor-parallel axis 'model'.*owner_groups=None",
  ),
  # Matrices split over devices (TP, owner groups) against the
  # preconditioning: one check (_checks.check_preconditioning).
  (
    'tp_with_aol',
    functools.partial(
      dmuon_with,
      mesh=tp_mesh(),
      tensor_parallel_axis='model',
      preconditioning='aol',
    ),
    ValueError,
    (
      r"preconditioning='aol' is not available here: the tensor-parallel "
      r"axis 'model' splits matrices.*Pass preconditioning='frobenius', or "
      r'tensor_parallel_axis=None\.'
    ),
  ),
  (
    'dedicated_muon_aol_with_split_matrices',
    dedicated_muon_aol_with_split_matrices,
    ValueError,
    (
      r"preconditioning='aol' is not available here: 4 matrices are split "
      r"over owners.*Pass preconditioning='frobenius', or dedicate\(\.\.\., "
      r'owner_groups=None\) to keep every matrix whole\.'
    ),
  ),
  (
    'dedicate_owner_groups_with_scanned_stack',
    dedicate_owner_groups_with_scanned_stack,
    ValueError,
    (
      r"owner_groups=2 with scanned stacks \(param 'layers/w'\).*Pass "
      r"owner_groups='auto' \(scanned stacks stay whole\) or None"
    ),
  ),
  (
    'dedicate_tp_split_scanned_stack',
    dedicate_tp_split_scanned_stack,
    ValueError,
    r"targets \['layers/w'\] are stacked layers.*axis 'model'.*"
    r'tensor_parallel_axis=None',
  ),
  (
    'plan_ns_steps_zero',
    functools.partial(plan, ns_steps=0),
    ValueError,
    r'ns_steps=0 must be a positive int',
  ),
  (
    'plan_ns_algorithm_unknown',
    functools.partial(plan, ns_algorithm='svd'),
    ValueError,
    r"ns_algorithm='svd' is not one of \('auto', 'standard', 'gram'\)",
  ),
  (
    'plan_cost_fn_negative',
    functools.partial(plan, cost_fn=lambda m, n: -1.0),
    ValueError,
    (
      r"cost_fn\(8, 16\) returned -1\.0 for param 'layers_0/w'; expected a "
      r'finite, non-negative float'
    ),
  ),
  (
    'params_outside_the_mesh',
    params_outside_the_mesh,
    ValueError,
    (
      r"'layers_0/w' is placed on devices \[4, 5, 6, 7\].*devices "
      r'\[0, 1, 2, 3\].*Place the params on that mesh'
    ),
  ),
  (
    'dedicate_params_outside_the_mesh',
    dedicate_params_outside_the_mesh,
    ValueError,
    (
      r"'layers_0/b' is placed on devices \[4, 5, 6, 7\].*Place "
      r'the params on that mesh.*or pass the mesh they live on'
    ),
  ),
  (
    'sharded_over_axis_not_in_mesh',
    sharded_over_axis_not_in_mesh,
    ValueError,
    (
      r"'layers_0/w' is sharded over mesh axis 'expert'.*"
      r'Shard it over those axes'
    ),
  ),
  (
    'sharded_over_axis_not_owned',
    sharded_over_axis_not_owned,
    ValueError,
    (
      r"'layers_0/w' is sharded over mesh axis 'expert' \(spec P\(None, "
      r"'expert'\)\), which is not one of the axes dmuon owns matrices over "
      r"\('replicate', 'shard'\)\. Shard it over those axes"
    ),
  ),
  (
    'dedicate_sharded_over_axis_not_in_mesh',
    dedicate_sharded_over_axis_not_in_mesh,
    ValueError,
    (
      r"'layers_0/b' is sharded over axes \['expert'\].*shard it over the "
      r'mesh given to dedicate'
    ),
  ),
  (
    'tensor_parallel_on_stack_axis',
    tensor_parallel_on_stack_axis,
    ValueError,
    (
      r"'layers/w'.*'model' on dim 0, a stack \(batch\) axis.*"
      r'Shard another dimension'
    ),
  ),
  (
    'tensor_parallel_with_another_axis_on_one_dim',
    tensor_parallel_with_another_axis_on_one_dim,
    ValueError,
    (
      r"'layers_0/w' is sharded as P\(None, \('shard', 'model'\)\): the "
      r"tensor-parallel axis 'model' must be the only axis of a single "
      r'dimension.*Shard the other dimension over the data-parallel axes'
    ),
  ),
  (
    'stack_param_sharded_along_the_layer_axis',
    stack_param_sharded_along_the_layer_axis,
    ValueError,
    (
      r"'layers/scale' of a scanned stack is sharded along its layer axis "
      r"\(P\('shard',\)\); shard another dimension.*or replicate it"
    ),
  ),
  (
    'shapes_differ_between_init_and_update',
    shapes_differ_between_init_and_update,
    ValueError,
    (
      r"does not match the one given to init\(\): 'layers_0/w' has shape "
      r'\(8, 24\), init\(\) saw \(8, 16\)\. Call init\(\) again'
    ),
  ),
  (
    'shapes_differ_between_init_and_update_on_a_mesh',
    shapes_differ_between_init_and_update_on_a_mesh,
    ValueError,
    (
      r"does not match the one given to init\(\): 'layers_0/w' has shape "
      r'\(8, 24\), init\(\) saw \(8, 16\)\. Call init\(\) again'
    ),
  ),
  (
    'leaf_added_after_init',
    leaf_added_after_init,
    ValueError,
    (
      r"does not match the one given to init\(\): params \['c'\] are new\. "
      r'Call init\(\) again'
    ),
  ),
  (
    'to_dedicated_with_other_shapes',
    to_dedicated_with_other_shapes,
    ValueError,
    (
      r"'layers_0/w' has shape \(8, 24\), but dedicate\(\) "
      r'planned it with shape \(8, 16\).*dedicate again'
    ),
  ),
  (
    'to_dedicated_with_other_tree',
    to_dedicated_with_other_tree,
    ValueError,
    (
      r"params \['layers_0/b'\] are missing.*"
      r'Call dmuon_jax\.dedicate\(\) again'
    ),
  ),
  (
    'to_params_of_a_plain_tree',
    to_params_of_a_plain_tree,
    TypeError,
    r'takes the DedicatedParams.*got dict.*to_dedicated\(params\) first',
  ),
  (
    'no_hook_boundary_in_strict_mode',
    no_hook_boundary_in_strict_mode,
    ValueError,
    (
      r"no hook boundary: \['proj/kernel'\], outside the blocks found \("
      r"\['layers_0'\]\).*boundary_predicate.*strict=False to gather each "
      r"of them with its own module \(\['proj'\]\)"
    ),
  ),
  (
    'unknown_boundary',
    unknown_boundary,
    ValueError,
    (
      r"no hook boundary 'layers_9'; the boundaries are \['layers_0'\]\. "
      r'Pass one of them'
    ),
  ),
  (
    'unknown_boundary_in_scan',
    unknown_boundary_in_scan,
    ValueError,
    (
      r"no hook boundary 'layers_9'; the boundaries are \['layers_0'\]\. "
      r'Pass one of them'
    ),
  ),
  (
    'unknown_boundary_in_sequential',
    unknown_boundary_in_sequential,
    ValueError,
    (
      r"no hook boundary 'layers_9'; the boundaries are "
      r"\['layers_0'\]\. Pass one of them"
    ),
  ),
  (
    'scan_an_unscanned_boundary',
    scan_an_unscanned_boundary,
    ValueError,
    (
      r"boundary 'layers_0' is not scanned; use Dedication\.block or "
      r'sequential'
    ),
  ),
  (
    'block_inside_a_gather_group',
    block_inside_a_gather_group,
    ValueError,
    (
      r"boundary 'layers_0' is gathered together with \['layers_0', "
      r"'layers_1'\] \(layers_per_gather=2\); run them with "
      r'Dedication\.sequential'
    ),
  ),
  (
    'sequential_splitting_a_gather_group',
    sequential_splitting_a_gather_group,
    ValueError,
    (
      r"boundaries \['layers_1', 'layers_2'\] split the gather group "
      r"\['layers_0', 'layers_1'\]; pass whole groups, in order"
    ),
  ),
  (
    'layers_per_gather_not_dividing_the_stack',
    functools.partial(layers_per_gather, 2),
    ValueError,
    (
      r'layers_per_gather=2 does not divide the 3 layers of scanned stack '
      r"'layers'"
    ),
  ),
  (
    'layers_per_gather_zero',
    functools.partial(layers_per_gather, 0),
    ValueError,
    r'layers_per_gather=0 must be a positive int',
  ),
  (
    'remat_policy_saving_the_weights',
    remat_policy_saving_the_weights,
    ValueError,
    (
      r"with this remat_policy the Z3 block \['layers_0'\] saves its "
      r'gathered weights.*Use a policy that does not save them, e\.g\. '
      r'jax\.checkpoint_policies\.dots_saveable.*or '
      r'reshard_after_forward=False'
    ),
  ),
  (
    'momentum_unknown',
    functools.partial(dmuon_with, momentum='adam'),
    ValueError,
    r"momentum='adam' is not one of \('optax', 'sgd'\)",
  ),
  (
    'ns_algorithm_unknown',
    functools.partial(dmuon_with, ns_algorithm='svd'),
    ValueError,
    r"ns_algorithm='svd' is not one of \('auto', 'standard', 'gram'\)",
  ),
  (
    'preconditioning_unknown',
    functools.partial(dmuon_with, preconditioning='l2'),
    ValueError,
    (
      r"preconditioning='l2' is not one of \('frobenius', 'spectral', 'aol', "
      r"'schatten'\)"
    ),
  ),
  (
    'ns_coeffs_unknown_preset',
    functools.partial(dmuon_with, ns_coeffs='polar'),
    ValueError,
    (
      r"ns_coeffs: unknown preset 'polar'\. Known presets: 'jordan', .*Or "
      r'pass the coefficients themselves'
    ),
  ),
  (
    'ns_steps_disagree_with_rows',
    ns_steps_disagree_with_rows,
    ValueError,
    r'5 rows.*ns_steps=3\. Pass ns_steps=None or ns_steps=5',
  ),
  (
    'ns_steps_disagree_with_given_rows',
    ns_steps_disagree_with_given_rows,
    ValueError,
    (
      r'ns_coeffs has 4 rows \(one per iteration\) but '
      r'ns_steps=5\. Pass ns_steps=None or ns_steps=4'
    ),
  ),
  (
    'dedicated_ns_steps_disagree_with_rows',
    dedicated_ns_steps_disagree_with_rows,
    ValueError,
    r'5 rows.*ns_steps=3\. Pass ns_steps=None or ns_steps=5',
  ),
  (
    'orthogonalize_a_vector',
    orthogonalize_a_vector,
    ValueError,
    r'shape \(\.\.\., m, n\), got shape \(8,\)\. Reshape vectors',
  ),
  (
    'orthogonalize_integers',
    orthogonalize_integers,
    TypeError,
    r'real floating dtype, got int32\. Cast it first',
  ),
  (
    'restore_onto_other_shapes',
    restore_onto_other_shapes,
    ValueError,
    (
      r'step 1 does not fit the params.*params/layers_0/w: saved \(8, 16\), '
      r'target \(8, 24\).*same tree, same shapes'
    ),
  ),
  (
    'restore_onto_other_tree',
    restore_onto_other_tree,
    ValueError,
    (
      r'not in the checkpoint: params/layers_0/bias \| in the checkpoint but '
      r'not in the target: params/layers_0/b\. Build params_like from the '
      r'model config the checkpoint was saved with'
    ),
  ),
  (
    'restore_with_other_routing',
    restore_with_other_routing,
    ValueError,
    (
      r'does not fit the optimizer state.*not in the checkpoint: '
      r'opt_state/\S*/adam/\S*/mu/layers_0/w.*Make the optimizer as when '
      r'saving.*or pass opt=None'
    ),
  ),
  (
    'inject_with_a_mesh',
    inject_with_a_mesh,
    TypeError,
    (
      r'mesh is a function wrapping a jax.sharding.Mesh.*'
      r"static_args=\('mesh',\).*jax.set_mesh"
    ),
  ),
  (
    'inject_a_dtype',
    inject_a_dtype,
    TypeError,
    r"mu_dtype is an array.*as a string \('float32'\)",
  ),
  (
    'inject_ns_steps',
    inject_ns_steps,
    TypeError,
    r"ns_steps is a traced value.*static_args=\('ns_steps',\)",
  ),
  (
    'state_of_another_mesh',
    state_of_another_mesh,
    ValueError,
    (
      r'laid out as dmuon_shard8_\w+.*runs on mesh '
      r"\{'replicate': 8, 'shard': 1\}.*state_from_portable"
    ),
  ),
  (
    'params_on_one_device_of_the_mesh',
    params_on_one_device_of_the_mesh,
    ValueError,
    (
      r"'layers_0/w' is placed on devices \[0\].*Place the "
      r'params on that mesh'
    ),
  ),
  (
    'learning_rate_a_string',
    functools.partial(hyper, learning_rate='0.02'),
    TypeError,
    r"learning_rate='0.02' is a str, not a number.*or a schedule",
  ),
  (
    'learning_rate_none',
    functools.partial(hyper, learning_rate=None),
    TypeError,
    r'learning_rate=None is None, not a number.*Pass a number',
  ),
  (
    'learning_rate_negative',
    functools.partial(hyper, learning_rate=-0.02),
    ValueError,
    r'learning_rate=-0.02 must be a finite number >= 0.*Pass its magnitude',
  ),
  (
    'learning_rate_nan',
    functools.partial(hyper, learning_rate=float('nan')),
    ValueError,
    r'learning_rate=nan must be a finite number >= 0',
  ),
  (
    'adam_learning_rate_negative',
    functools.partial(hyper, adam_learning_rate=-1e-3),
    ValueError,
    r'adam_learning_rate=-0.001 must be a finite number >= 0',
  ),
  (
    'beta_above_one',
    functools.partial(hyper, beta=1.5),
    ValueError,
    r'beta=1.5 must be in \[0, 1\).*grows without bound.*such as 0.95',
  ),
  (
    'beta_one',
    functools.partial(hyper, beta=1.0),
    ValueError,
    r'beta=1.0 must be in \[0, 1\).*divides by zero',
  ),
  (
    'beta_a_jax_array_above_one',
    functools.partial(hyper, beta=jnp.asarray(1.25)),
    ValueError,
    r'beta=Array\(1.25.*must be in \[0, 1\)',
  ),
  (
    'eps_zero',
    functools.partial(hyper, eps=0.0),
    ValueError,
    r'eps=0.0 must be a finite number > 0.*zero gradient.*e\.g\. 1e-8',
  ),
  (
    'adam_b1_one',
    functools.partial(hyper, adam_b1=1.0),
    ValueError,
    r'adam_b1=1.0 must be in \[0, 1\).*such as 0.9',
  ),
  (
    'adam_b2_negative',
    functools.partial(hyper, adam_b2=-0.1),
    ValueError,
    r'adam_b2=-0.1 must be in \[0, 1\).*such as 0.999',
  ),
  (
    'adam_eps_root_negative',
    functools.partial(hyper, adam_eps_root=-1.0),
    ValueError,
    r'adam_eps_root=-1.0 must be a finite number >= 0',
  ),
  (
    'weight_decay_a_string',
    functools.partial(hyper, weight_decay='0.1'),
    TypeError,
    r"weight_decay='0.1' is a str, not a number",
  ),
  (
    'consistent_rms_negative',
    functools.partial(hyper, consistent_rms=-0.2),
    ValueError,
    r'consistent_rms=-0.2 must be a finite number >= 0',
  ),
  (
    'scale_by_dmuon_beta',
    functools.partial(hyper, 'scale_by_dmuon', beta=2.0),
    ValueError,
    r'beta=2.0 must be in \[0, 1\)',
  ),
  (
    'dedicated_muon_learning_rate_negative',
    functools.partial(hyper, 'dedicated_muon', learning_rate=-1.0),
    ValueError,
    r'learning_rate=-1.0 must be a finite number >= 0',
  ),
  (
    'scale_by_dedicated_muon_eps',
    functools.partial(hyper, 'scale_by_dedicated_muon', eps=-1e-8),
    ValueError,
    r'eps=-1e-08 must be a finite number > 0',
  ),
  (
    'predicate_a_string',
    predicate_a_string,
    TypeError,
    r"predicate='2d' is not a routing rule.*'optax' \(every 2-D leaf",
  ),
  (
    'stack_without_dimension_numbers',
    stack_without_dims,
    ValueError,
    (
      r"'layers/w' has shape \(3, 8, 16\) \(ndim=3\) and was selected as a"
      r' Muon target without dimension numbers.*stack of 3 matrices 8x16.*'
      r'MuonDimensionNumbers\(reduction_axis=1, output_axis=2\).*one 3x128'
      r' matrix.*output_axis=\(1, 2\).*muon_weight_dimension_numbers'
    ),
  ),
  (
    'dedicate_stack_without_dimension_numbers',
    functools.partial(stack_without_dims, 'dedicate'),
    ValueError,
    r"'layers/w' has shape \(3, 8, 16\).*without dimension numbers",
  ),
  (
    'plan_stack_without_dimension_numbers',
    functools.partial(stack_without_dims, 'plan'),
    ValueError,
    r"'layers/w' has shape \(3, 8, 16\).*without dimension numbers.*in"
    r' weight_dimension_numbers',
  ),
  (
    'adamw_leaf_shape_differs',
    adamw_leaf_shape_differs,
    ValueError,
    r"update\(\) does not match.*'layers_0/b' has shape \(12,\), init\(\)"
    r' saw \(16,\)\. Call init\(\) again.*or pass gradients of the params',
  ),
  (
    'adamw_leaf_shape_differs_on_a_mesh',
    lambda: adamw_leaf_shape_differs(jax.make_mesh((2, 4), AXES)),
    ValueError,
    r"'layers_0/b' has shape \(12,\), init\(\) saw \(16,\)",
  ),
  (
    'explicit_adamw_leaf_shape_differs',
    explicit_adamw_leaf_shape_differs,
    ValueError,
    r"'layers_0/b' has shape \(12,\), init\(\) saw \(16,\)",
  ),
  (
    'dedicated_adamw_leaf_shape_differs',
    dedicated_adamw_leaf_shape_differs,
    ValueError,
    r"dedicated_muon update\(\) does not match.*'head' has shape \(17, 8\),"
    r' init\(\) saw \(16, 8\)',
  ),
  (
    'two_tensor_parallel_candidates',
    two_tensor_parallel_candidates,
    ValueError,
    r"sharded over the mesh axes \['model', 'tp'\].*Say which one.*"
    r"tensor_parallel_axis='model'",
  ),
  (
    'slot_out_of_range',
    slot_out_of_range,
    ValueError,
    r'slot 4 is out of range; the plan has 4 slots: pass 0 to 3',
  ),
)


class BadInputTest(parameterized.TestCase):
  @parameterized.named_parameters(*CASES)
  def test_raises(self, case, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      case()


class SuggestedFixTest(absltest.TestCase):
  """What an error tells the user to do is accepted."""

  def test_ns_steps_that_match_the_rows(self):
    # ns_steps_disagree_with_given_rows: pass ns_steps=None or ns_steps=4.
    dmuon_jax.dmuon(0.1, ns_coeffs=ROWS_4, ns_steps=4)
    dmuon_jax.dmuon(0.1, ns_coeffs=ROWS_4)

  def test_strict_false_gathers_a_target_without_boundary(self):
    # no_hook_boundary_in_strict_mode: pass strict=False.
    params = support.block_params() | {
      'proj': jnp.ones((support.WIDTH, support.WIDTH))
    }
    ded = dmuon_jax.dedicate(params, None, strict=False)
    self.assertIn('proj', ded.boundaries.names)

  def test_sequential_runs_a_whole_gather_group(self):
    # block_inside_a_gather_group: run them with Dedication.sequential.
    ded = in_pairs()
    self.assertEqual(ded.groups, ((0, 1), (2, 3)))
    params = support.block_params()
    x = jnp.ones((4, support.WIDTH))
    got = ded.sequential(support.block_fn, ['layers_0', 'layers_1'])(
      ded.to_dedicated(params), x
    )
    want = support.block_fn(
      params['layers_1'], support.block_fn(params['layers_0'], x)
    )
    chex.assert_trees_all_close(got, want, rtol=1e-6)


class NoMuonTargetsTest(absltest.TestCase):
  """A tree without Muon targets works (everything is AdamW) and warns once
  (a DMuonWarning naming what to do)."""

  def test_dmuon_on_a_mesh(self):
    mesh = jax.make_mesh((1, 8), AXES)
    params = {'norm': {'scale': jnp.ones((16,))}}
    opt = dmuon_jax.dmuon(0.1, mesh=mesh)
    with self.assertWarnsRegex(
      dmuon_jax.DMuonWarning,
      r"no leaf goes to Muon.*Muon 0 leaves.*AdamW 1 leaf.*predicate='optax'",
    ):
      state = opt.init(params)
    updates, _ = opt.update(params, state, params)
    self.assertEqual(updates['norm']['scale'].shape, (16,))
    state = opt.init({})  # The first init warned; this one does not.
    self.assertEqual(opt.update({}, state, {})[0], {})

  def test_dedicate(self):
    mesh = jax.make_mesh((1, 8), AXES)
    params = {'norm': {'scale': jnp.ones((16,))}}
    with self.assertWarnsRegex(dmuon_jax.DMuonWarning, 'no leaf goes to Muon'):
      ded = dmuon_jax.dedicate(params, mesh)
    self.assertIn('no Muon targets', ded.summary())
    self.assertIn('padding 0.0%', ded.summary())
    dp = ded.to_dedicated(params)
    self.assertEmpty(dp.owned.buffers)
    opt = dmuon_jax.dedicated_muon(ded, 0.1)
    state = opt.init(dp)
    updates, _ = opt.update(dp, state, dp)
    self.assertEqual(updates.rest['norm']['scale'].shape, (16,))
    np.testing.assert_array_equal(
      ded.to_params(dp)['norm']['scale'], params['norm']['scale']
    )


class CheckDedicatedTest(absltest.TestCase):
  """``Dedication.check_dedicated``, for trees given to the optimizer."""

  def test_other_dedication(self):
    ded = dmuon_jax.dedicate(tree(), None)
    ded.check_dedicated(ded.to_dedicated(tree()), 'update()')  # Fits.
    other = dmuon_jax.dedicate(resized(), None).to_dedicated(resized())
    # The error names both layouts and how to convert.
    with self.assertRaisesRegex(
      ValueError,
      rf'update\(\) got owner buffers laid out as '
      rf'{other.owned.layout.name}, but this dedication lays them out as '
      rf'{ded.layout.name}.*to_params\(\) and to_dedicated\(\)',
    ):
      ded.check_dedicated(other, 'update()')


class DocsTableTest(absltest.TestCase):
  """Every row of the "Bad input" tables (``docs/reference/bad_input.md``)
  names a test that exists: a case of :data:`CASES`, or ``Class.test`` of
  ``tests/checkpoint_misuse_test.py``."""

  def test_every_row_names_a_test(self):
    page = pathlib.Path(__file__).parents[1] / 'docs/reference/bad_input.md'
    text = page.read_text()
    named = re.findall(r'^\|.*\| `([\w.]+)` \|$', text, re.M)
    self.assertGreaterEqual(len(named), 40)
    self.assertLen(set(named), len(named))  # One row per test.
    cases = {name for name, *_ in CASES}
    misuse = _load_misuse_tests()
    for name in named:
      if '.' in name:
        cls, method = name.split('.')
        self.assertIn(method, misuse.get(cls, ()), name)
      else:
        self.assertIn(name, cases)


def _load_misuse_tests() -> dict[str, set[str]]:
  """Test method names per class of ``checkpoint_misuse_test`` (with the
  parameterized suffixes)."""
  from tests import checkpoint_misuse_test  # noqa: PLC0415

  out = {}
  for name in dir(checkpoint_misuse_test):
    cls = getattr(checkpoint_misuse_test, name)
    if isinstance(cls, type) and issubclass(cls, absltest.TestCase):
      out[name] = {m for m in dir(cls) if m.startswith('test')}
  return out


if __name__ == '__main__':
  absltest.main()
