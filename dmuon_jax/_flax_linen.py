"""Linen boundary submodules' calls, intercepted to gather (dmuon_jax.flax)."""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend
import numpy as np
from jax.sharding import NamedSharding

from dmuon_jax import _flax_boundary, _flax_plan, _gather, _mesh

LINEN: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
  'dmuon_jax_flax_linen', default=None
)
# A scanned stack's layer indices, beside its owned buffers in the params
# (added by ModelDedication.apply; nn.scan slices them with the layers).
ITERATION = 'dmuon_iteration'


def unbox_linen(params: Any, mesh: Any) -> tuple[Any, list[Any]]:
  """Linen params with their Flax boxes (``nn.Partitioned``,
  ``nn.LogicallyPartitioned``) taken off, an unplaced value put on
  ``mesh`` as its box says; and per leaf its box (or None), to put back."""
  flat, treedef = jax.tree.flatten(params, is_leaf=_mesh.is_box)
  values, boxes = [], []
  for x in flat:
    if not _mesh.is_box(x):
      values.append(x)
      boxes.append(None)
      continue
    v = _mesh.unbox(x)
    spec = _mesh.leaf_spec(x)
    if (
      mesh is not None
      and spec is not None
      and not isinstance(getattr(v, 'sharding', None), NamedSharding)
    ):
      v = jax.device_put(v, NamedSharding(mesh, spec))
    values.append(v)
    boxes.append(x)
  return jax.tree.unflatten(treedef, values), boxes


def replicated_box(box: Any) -> Any:
  """``box`` naming no axis: its value replicated."""
  return box.replace(names=tuple(None for _ in box.names))


def plain_dicts(tree: Any) -> Any:
  """Nested dicts (FrozenDicts too) as plain dicts, leaves kept."""
  if hasattr(tree, 'items') and not hasattr(tree, 'shape'):
    return {k: plain_dicts(v) for k, v in tree.items()}
  return tree


def set_item(tree: dict, path: Sequence[Any], value: Any) -> None:
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def node_at_dict(tree: Any, path: Sequence[Any]) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _dense_general_call(next_fun, args, kwargs, context):
  """``next_fun`` of an ``nn.DenseGeneral`` whose kernel exists, with its
  kernel initializer's Flax box taken off for the call.

  DenseGeneral boxes its initializer's flat 2-D kernel and unboxes it with
  the kernel's N-D partition names before reshaping, and Flax runs that
  initializer again at every call to check the existing param's shape
  (flax issue #3676). Under a mesh context (``train_step``'s shard_map is
  one; so is ``jax.set_mesh``) the unboxing is a sharding constraint that
  fails: too many names for the flat kernel, or a manual owner axis. The
  param exists, so the initializer only serves that shape check: it runs
  unboxed (same shape) while the layer runs.
  """
  module = context.module
  init = module.kernel_init
  if not module.has_variable('params', 'kernel'):
    return next_fun(*args, **kwargs)

  def unboxed(*a, **k):
    return _mesh.unbox(init(*a, **k))

  # A Linen module is a frozen dataclass: its field is swapped for this
  # call only (the bound copy of this apply, not the user's module).
  object.__setattr__(module, 'kernel_init', unboxed)
  try:
    return next_fun(*args, **kwargs)
  finally:
    object.__setattr__(module, 'kernel_init', init)


def _batch_norm_call(next_fun, args, kwargs, context, axes):
  """``next_fun`` of an ``nn.BatchNorm`` without an ``axis_name`` inside
  ``train_step`` (manual owner ``axes``), with the owner axes as its
  ``axis_name`` for the call: its statistics are the global batch's (a
  pmean of the devices' equal shares), as under ``jax.jit``."""
  module = context.module
  object.__setattr__(module, 'axis_name', tuple(axes))
  try:
    return next_fun(*args, **kwargs)
  finally:
    object.__setattr__(module, 'axis_name', None)


def linen_interceptor(next_fun, args, kwargs, context):
  """Runs a boundary module's method (``__call__`` or any other: a
  ``decode``, an ``attend``) on its group's gathered matrices."""
  if isinstance(context.module, nn.DenseGeneral):
    return _dense_general_call(next_fun, args, kwargs, context)
  step = _flax_boundary.ACTIVE.get()  # set by train_step
  if (
    step is not None
    and step.md.axes
    and isinstance(context.module, nn.BatchNorm)
    and context.module.axis_name is None
  ):
    return _batch_norm_call(next_fun, args, kwargs, context, step.md.axes)
  active = LINEN.get()
  if active is None or context.method_name == 'setup':
    return next_fun(*args, **kwargs)
  md, root, traces = active
  module = context.module
  path = tuple(module.path)
  if path not in md.boundary_paths:
    return next_fun(*args, **kwargs)
  b = md.boundary_paths.index(path)
  ded = md.dedication
  g = _gather.group_of(ded, b)
  cols = {c: plain_dicts(module.variables[c]) for c in module.variables}
  own = cols.pop('params', {})
  bufs = [k for k, (h, _) in enumerate(ded.layout.buffer_index) if h == g]
  if ded.boundaries.scanned[b]:
    local, iteration = _one_layer(md, b, module, len(bufs))
  else:
    local = [_mesh.unbox(node_at_dict(root, md.buffer_paths[k])) for k in bufs]
    iteration = None
    _check_one_trace_per_group(md, g, path, local, traces)
  sub = {
    k: v
    for k, v in own.items()
    if not (str(k).startswith('dmuon_owned_') or k == ITERATION)
  }
  mutable = [c for c in cols if module.is_mutable_collection(c)]
  rngs = {name: module.make_rng(name) for name in module.scope.rngs}
  mine = md.targets[b]
  arrays, _, rebuild = _flax_boundary.split_args(args, kwargs)
  method = context.method_name

  def run(mats, state, arrays):
    p, others, keys = state
    p = plain_dicts(p)
    for i, rel in mine:
      set_item(p, rel, mats[i])
    a, kw = rebuild(arrays)
    reset = LINEN.set(None)  # the block's own submodules run as written
    try:
      result = module.clone(parent=None).apply(
        {'params': p, **others},
        *a,
        rngs=keys,
        mutable=mutable or False,
        method=method,
        **kw,
      )
    finally:
      LINEN.reset(reset)
    return result if mutable else (result, {})

  # The stack's whole buffers say whether the model runs under jit: an
  # eager call's nn.scan traces its body (and so the slices) too.
  whole = [_mesh.unbox(node_at_dict(root, md.buffer_paths[k])) for k in bufs]
  out, updates = _flax_boundary.gathered(
    md,
    b,
    local,
    iteration,
    run,
    (sub, cols, rngs),
    arrays,
    traced=any(isinstance(x, jax.core.Tracer) for x in whole),
    remat=_in_remat(module),
  )
  for c, tree in updates.items():
    for name, value in tree.items():
      module.put_variable(c, name, value)
  return out


def _lifted(module, transform: str) -> bool:
  """Whether ``module`` runs inside the Flax lifted ``transform``
  (``'remat'``, ``'scan'``; around it or a parent): Flax's lifted
  transforms name themselves in their scopes' ``debug_path``
  (``('remat(scan(layers))',)`` for ``nn.scan(nn.remat(Block))``)."""
  path = getattr(module.scope, 'debug_path', ())
  return any(f'{transform}(' in str(s) for s in path)


def _in_remat(module) -> bool:
  return _lifted(module, 'remat')


def _one_layer(md, b: int, module, count: int) -> tuple[list, Any]:
  """A scanned stack's owned buffers and layer index as ``nn.scan`` sliced
  them for this iteration (one layer each); raises where they were not
  sliced (the module ran outside ``nn.scan``, or ``nn.scan`` broadcast its
  params instead of slicing them) or another transform sliced them."""
  name = md.dedication.boundaries.names[b]
  own = module.variables.get('params', {})
  local = [own.get(f'dmuon_owned_{j}') for j in range(count)]
  iteration = own.get(ITERATION)
  if any(x is None for x in local) or iteration is None:
    raise ValueError(
      f'dmuon: the scanned stack {name!r} ran without its owned buffers '
      f'(module {_flax_plan.text(md.boundary_paths[b])!r}): call the model'
      ' through ded.apply with the dedicated params of dedicate_linen.'
    )
  if np.ndim(iteration) != 0 or any(np.ndim(x) != 1 for x in local):
    raise ValueError(
      SCAN_SLICE_MSG.format(
        name=name,
        module=_flax_plan.text(md.boundary_paths[b]),
        shape=tuple(np.shape(local[0])),
      )
    )
  if not _lifted(module, 'scan'):
    raise ValueError(
      f'dmuon: the scanned stack {name!r} runs one layer at a time under '
      f'{"/".join(module.scope.debug_path)!r}, not nn.scan: dedicate_linen '
      'runs stacked layers made by nn.scan (one gather per iteration). '
      'Leave these matrices to AdamW (muon_weight_dimension_numbers None '
      'for them), or use the drop-in dmuon_jax.dmuon.'
    )
  return list(local), iteration


SCAN_SLICE_MSG = (
  'dmuon: the scanned stack {name!r} gathers in module {module!r} (the '
  'deepest one holding all its Muon matrices), which ran on all its '
  'layers at once (its owned buffer has shape {shape}, with the layer '
  'axis). dedicate_linen runs a stack one layer per iteration of the '
  "nn.scan that made it (variable_axes={{'params': 0}} slices its params):"
  ' call {module!r} through that nn.scan, as when its params were '
  'initialized. Two nn.scan stacks under one top-level module meet there:'
  ' give each a top-level module of its own, or leave one of them to '
  'AdamW (muon_weight_dimension_numbers None for its kernels).'
)


def _check_one_trace_per_group(md, g: int, path, local, traces) -> None:
  """Warns (once per model) where group ``g``'s blocks run under different
  traces in one ``ded.apply`` on the reduced route: a lifted transform
  around each boundary module, so the group is gathered per block."""
  ded = md.dedication
  if not _gather.reduced_route(ded) or not any(
    isinstance(x, jax.core.Tracer) for x in local
  ):
    return
  trace = jax.extend.core.get_opaque_trace_state(convention='nnx')
  first = traces.setdefault(g, trace)
  if first == trace or md.warned[0]:
    return
  md.warned[0] = True
  _flax_boundary.warn_lifted(md, _flax_plan.text(path), g, linen=True)


def with_iterations(ded, boundary_paths, params: Any) -> Any:
  """Linen ``params`` with each scanned stack's layer indices,
  ``dmuon_iteration = arange(num_layers)``, beside its owned buffers:
  ``nn.scan`` slices them with the layers (``variable_axes={'params':
  0}``), so each iteration knows which owners hold its matrices (they
  rotate by one slot per layer). Made in the step, they are no param of
  the ``TrainState``: nothing differentiates or updates them.

  Args:
    ded: the model's ``Dedication``.
    boundary_paths: each boundary's module path in the params.
    params: the (unboxed) Linen params.

  Returns:
    ``params``, with the indices where a stack is scanned.
  """
  scanned = [b for b, s in enumerate(ded.boundaries.scanned) if s]
  if not scanned:
    return params
  params = plain_dicts(params)
  for b in scanned:
    n = ded.layout.iterations[_gather.group_of(ded, b)]
    set_item(
      params,
      boundary_paths[b] + (ITERATION,),
      jax.numpy.arange(n, dtype=jax.numpy.int32),
    )
  return params


@dataclasses.dataclass(frozen=True, repr=False)
class LinenApply:
  """``ded.apply`` of a Linen ``ModelDedication``: ``linen_model.apply``
  with the boundaries gathering; a callable that compares (and hashes) as
  its dedication does, where a bound method would compare its dedication
  by identity."""

  md: Any  # the Linen ModelDedication

  def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
    md = self.md
    # Flax boxes come off here: unboxing inside the model would constrain
    # each value to its names, which train_step's manual owner axes refuse
    # (the arrays are placed already).
    params = jax.tree.map(
      _mesh.unbox, variables['params'], is_leaf=_mesh.is_box
    )
    variables = {
      **variables,
      'params': with_iterations(md.dedication, md.boundary_paths, params),
    }
    reset = LINEN.set((md, params, {}))
    try:
      with nn.intercept_methods(linen_interceptor):
        return md.linen_model.apply(variables, *args, **kwargs)
    finally:
      LINEN.reset(reset)

  def __repr__(self) -> str:
    model = type(self.md.linen_model).__name__
    n = len(self.md.dedication.boundaries.names)
    return f'<ded.apply of a dedicated {model}, {n} boundaries>'
