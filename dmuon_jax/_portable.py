"""dmuon_jax.checkpoint helpers: trees by param path, placement, targets."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _dedication, _mesh, _owner_layout, _states


def is_abstract(st) -> bool:
  """Whether a dmuon state's buffers are shapes only (``jax.eval_shape``)."""
  return any(
    isinstance(b, jax.ShapeDtypeStruct) for b in jax.tree.leaves(st.mu)
  )


def nest(by_path: dict[str, Any]) -> dict:
  out: dict = {}
  for path, x in by_path.items():
    node = out
    parts = path.split('/') if path else ['<root>']
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = x
  return out


def flat(nested: Any) -> dict[str, Any]:
  out = {}
  for keys, x in jax.tree_util.tree_flatten_with_path(nested)[0]:
    path = '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in keys)
    out['' if path == '<root>' else path] = x
  return out


def concrete_mesh(xs) -> Any:
  """The concrete ``Mesh`` the first of ``xs`` placed by a ``NamedSharding``
  lives on, or None."""
  for x in xs:
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.Mesh
    ):
      return sharding.mesh
  return None


def param_shardings(layout: _owner_layout.OwnerLayout, mesh: Any) -> list:
  """Per target leaf, the sharding of its portable momentum."""
  if mesh is None:
    return [None] * len(layout.leaves)
  out = []
  for e in layout.param_entries:
    spec = _mesh.entries_spec(e) if e is not None else P()
    out.append(NamedSharding(mesh, spec))
  return out


def cast_like(x, target):
  """``x`` with ``target``'s dtype and placement (uncommitted if it is)."""
  sharding = getattr(target, 'sharding', None)
  if isinstance(target, jax.ShapeDtypeStruct):
    x = jnp.asarray(x, target.dtype)
    return x if sharding is None else jax.device_put(x, sharding)
  if not getattr(target, 'committed', True):
    return jnp.asarray(np.asarray(x), target.dtype)
  return jax.device_put(jnp.asarray(x, target.dtype), target.sharding)


def abstract_leaf(x) -> jax.ShapeDtypeStruct:
  dtype = getattr(x, 'dtype', None)
  return jax.ShapeDtypeStruct(
    np.shape(x),
    jnp.result_type(x) if dtype is None else dtype,
    sharding=getattr(x, 'sharding', None),
  )


def plain_params(params):
  if isinstance(params, _dedication.DedicatedParams):
    return _dedication.to_params(params)
  return params


def place_like(like):
  sharding = getattr(like, 'sharding', None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(np.shape(like), like.dtype, sharding=sharding)


def dedicated_like(dp_like: _dedication.DedicatedParams):
  """The plain params target of a DedicatedParams target."""
  layout = dp_like.owned.layout
  leaves, treedef = jax.tree_util.tree_flatten(
    dp_like.rest, is_leaf=lambda x: x is None
  )
  mesh = concrete_mesh(dp_like.owned.buffers)
  sharding = (
    NamedSharding(mesh, P())
    if mesh is not None
    else jax.sharding.SingleDeviceSharding(jax.devices()[0])
  )
  for t in layout.leaves:
    leaves[t.index] = jax.ShapeDtypeStruct(
      t.shape, jnp.dtype(t.dtype), sharding=sharding
    )
  return jax.tree.unflatten(treedef, leaves)


def to_dedicated_like(params, dp_like: _dedication.DedicatedParams):
  layout = dp_like.owned.layout
  leaves, treedef = jax.tree_util.tree_flatten(params)
  like_rest, _ = jax.tree_util.tree_flatten(
    dp_like.rest, is_leaf=lambda x: x is None
  )
  values = {t.index: leaves[t.index] for t in layout.leaves}
  owned = _dedication.pack_owned(
    layout,
    values,
    concrete_mesh(dp_like.owned.buffers),
    dtypes=[b.dtype for b in dp_like.owned.buffers],
    shardings=[getattr(b, 'sharding', None) for b in dp_like.owned.buffers],
  )
  rest = [
    None if like is None else cast_like(x, like)
    for x, like in zip(leaves, like_rest)
  ]
  return _dedication.DedicatedParams(
    owned=owned, rest=jax.tree.unflatten(treedef, rest)
  )


def _is_optimizer(opt) -> bool:
  """An optimizer (anything with ``init``: ``GradientTransformation``,
  ``GradientTransformationExtraArgs``, ``optax.MultiSteps``), not a state."""
  return callable(getattr(opt, 'init', None))


def _abstract_init(init, *args):
  """``init(*args)``'s shapes, dtypes and compiled shardings, jitted (a
  trace and a compile: nothing runs, nothing is allocated)."""
  traced = jax.jit(init).trace(*args)
  shardings = traced.lower().compile().output_shardings
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    traced.out_info,
    shardings,
  )


def _unknown_specs(state) -> bool:
  """Whether a dmuon state in ``state`` records params of unknown sharding."""
  states = jax.tree.leaves(state, is_leaf=_states.is_dmuon_state)
  return any(
    None in x.mu.layout.param_entries
    for x in states
    if _states.is_dmuon_state(x)
  )


def target_state(opt, params):
  """The state to restore into: ``opt`` itself if it is a state, else
  ``opt.init(params)``'s layouts, shapes, dtypes and shardings, abstractly.

  Nothing is allocated (a fresh state would double the optimizer's memory
  while the checkpoint is read). ``jax.eval_shape`` alone gives no devices
  (no shardings on Auto meshes, ``AbstractMesh`` ones on Explicit meshes),
  so the shardings come from compiling ``opt.init`` (not running it).

  The params are jit arguments there, so the state's other leaves (AdamW
  moments) are typed and placed from them, as a jitted init places them.
  But on Auto meshes such tracers carry no sharding, and the dmuon layouts
  would record the params as replicated (an all-gather where a fresh
  ``opt.init(params)`` routes an all-to-all). Then each dmuon state comes
  from a second trace with the params closed over instead: init reads the
  placed arrays' shardings, as eagerly (closed-over arrays are hoisted as
  arguments of the compiled program: nothing is copied or embedded).
  """
  if not _is_optimizer(opt):
    return opt
  mesh = concrete_mesh(jax.tree.leaves(params))
  # Explicit-mesh params type-check only inside their mesh's context.
  ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  with ctx:
    target = _abstract_init(opt.init, params)
    if not _unknown_specs(target):
      return target
    placed = _abstract_init(lambda: opt.init(params))
  leaves, treedef = jax.tree.flatten(target, is_leaf=_states.is_dmuon_state)
  found, found_def = jax.tree.flatten(placed, is_leaf=_states.is_dmuon_state)
  if found_def != treedef:  # an init that builds its tree from the values
    return target
  return jax.tree.unflatten(
    treedef,
    [y if _states.is_dmuon_state(y) else x for x, y in zip(leaves, found)],
  )
