"""Dedicated ownership: Muon targets stored on their owners (DMuon proper)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _assign,
  _checks,
  _gather_plan,
  _mesh,
  _owner_layout,
  _plan,
  _routing,
)
from dmuon_jax._dedication import (
  AUTO_PADDING_PERCENT,
  Dedication,
)

_UNSET = object()


def _tp_local(params, targets, mesh, axis_names, tensor_parallel_axis):
  """The owner and TP axes (``_mesh.resolve``), and the params with
  TP-split targets at one TP shard's shape.

  Returns:
    ``(info, params, (tp_dims, tp_splits))``: the mesh's axes (no axes
    without a mesh); the tree with
    ``jax.ShapeDtypeStruct`` slices for split targets (the non-targets keep
    their leaves, for their shardings); and per split target's leaf index
    its split dim and its matrix split axis (-1 or -2).
  """
  leaves, treedef = jax.tree.flatten(params)
  info = _mesh.resolve(
    mesh,
    axis_names,
    tensor_parallel_axis,
    sharded_axes=_mesh.sharded_axes(
      [_mesh.leaf_spec(leaves[t.leaf_index]) for t in targets]
    ),
  ) or _mesh.MeshInfo(None, {}, (), None)
  dims, splits, whole = {}, {}, []
  if info.tp_size == 1:
    return info, params, (dims, splits)
  for s in targets:
    x = leaves[s.leaf_index]
    entries = _mesh.normalize_entries(
      _mesh.leaf_spec(x) or P(), len(s.shape), info.sizes
    )
    split, dim, shape = _mesh.split_tensor_parallel(
      s, entries, info.tp_axis, info.tp_size
    )
    if split is None:
      whole.append(s.path)
      continue
    splits[s.leaf_index], dims[s.leaf_index] = split, dim
    leaves[s.leaf_index] = jax.ShapeDtypeStruct(shape, x.dtype)
  if whole:
    raise ValueError(
      f'dmuon: dedicated mode on a mesh with the tensor-parallel axis '
      f'{info.tp_axis!r} needs every Muon target split over it (column- or '
      f'row-parallel); these are not: {whole}. Shard them over '
      f'{info.tp_axis!r} along a matrix dimension, route them to AdamW, or '
      'use the drop-in dmuon_jax.dmuon (which orthogonalizes '
      'TP-replicated matrices on every TP shard of the owner).'
    )
  return info, jax.tree.unflatten(treedef, leaves), (dims, splits)


def _owner_axes(
  plan: _plan.OwnershipPlan, replicate_axis: str | None
) -> tuple[tuple[str, ...], str | None, str | None]:
  """``(buffer_axes, rep_axis, group_axis)``: the owner axes in buffer
  order (shard axes, then replicate); the replicate axis if it has more
  than one device; and the axis owner groups range over: the innermost
  owner axis of more than one device that is not ``rep_axis`` (a group's
  Grams then stay in a shard group), else the replicate axis (a DDP mesh,
  whose shard axis has one device)."""
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  buffer_axes, rep_axis = plan.axis_names, None
  if replicate_axis in sizes:
    buffer_axes = tuple(a for a in plan.axis_names if a != replicate_axis)
    buffer_axes += (replicate_axis,)
    rep_axis = replicate_axis if sizes[replicate_axis] > 1 else None
  axes = [a for a in plan.axis_names if a != rep_axis and sizes[a] > 1]
  if not axes:
    axes = [a for a in plan.axis_names if sizes[a] > 1] or list(plan.axis_names)
  return buffer_axes, rep_axis, axes[-1] if axes else None


def rest_spec(x: Any, path: str, mesh: Any, scanned_names) -> P:
  """The PartitionSpec a non-target param keeps in dedicated mode."""
  sharding = getattr(x, 'sharding', None)
  if mesh is None or not isinstance(sharding, NamedSharding):
    return P()
  spec = sharding.spec
  entries = _mesh.spec_entries(spec)
  unknown = sorted({a for e in entries for a in e} - set(mesh.axis_names))
  if unknown:
    raise ValueError(
      f'dmuon: param {path!r} is sharded over axes {unknown} that mesh '
      f'{dict(mesh.shape)} does not have (spec {spec}); shard it over the '
      'mesh given to dedicate (or replicate it), or pass the mesh it '
      'lives on.'
    )
  in_stack = any(path.startswith(n + '/') for n in scanned_names)
  if in_stack and entries and entries[0]:
    raise ValueError(
      f'dmuon: param {path!r} of a scanned stack is sharded along its '
      f'layer axis ({spec}); shard another dimension (the scan slices '
      'one layer per iteration) or replicate it.'
    )
  return spec


def dedicate(
  params: Any,
  mesh: jax.sharding.Mesh | None,
  *,
  predicate: Callable[[str, Any], bool] | None = None,
  muon_weight_dimension_numbers: Any = None,
  boundary_predicate: _checks.BoundaryPredicate | None = None,
  strict: bool = True,
  reshard_after_forward: bool = True,
  layers_per_gather: int | str = 'auto',
  axis_names: Sequence[str] | None = None,
  replicate_axis: str | None = 'replicate',
  remat_policy: Callable[..., Any] | None = None,
  tensor_parallel_axis: str | None = 'auto',
  ns_algorithm: str = 'auto',
  weight_dimension_numbers: Any = _UNSET,
  owner_groups: int | str | None = 'auto',
) -> Dedication:
  """Plans dedicated ownership: each Muon matrix stored only on its owner.

  Matrices are gathered per group of ``layers_per_gather`` hook boundaries
  (see :func:`dmuon_jax.find_hook_boundaries`) or scanned layers. Within a
  group they are assigned to owners by the planner of
  :func:`dmuon_jax.plan_ownership` (largest Newton–Schulz work first, to
  the least-loaded owner, counting the groups placed before) within a
  budget of bytes per owner (the group's mean share and 2%), so the packed
  gather pads little while NS work stays balanced over the whole model: a
  split matrix's iteration runs one restart window per owner where that
  evens the work, and rows, then owners, trade what they own in a group. A scanned stack is planned for one
  iteration; iteration ``t`` rotates those owners by ``t`` slots.

  A gather moves ``num_slots * (largest owner share)`` bytes: with whole
  matrices, a block with fewer, unequal matrices than devices pads (e.g. a
  transformer block of 4 ``d x d`` and 2 ``d x 2d`` matrices on 8 devices:
  100%). Where a loop group's whole matrices would pad more than 5%, some
  are split into slices of their long side over owners of one row of the
  owner-group axis (of every owner device where one matrix outweighs a
  row's share of the group) (owner groups, as ``owner_groups`` splits large
  matrices for the Newton–Schulz work; their Gram exchange is
  :meth:`Dedication.exchange_bytes`): the coarsest slicing that pads at
  most 5%, slices keeping at least ``min(128, short side)`` rows/columns.
  ``layers_per_gather='auto'`` (default) weighs the bytes a step moves
  (padding and the owner groups' exchange included) against the gathered
  weights Z3 holds (two groups; a byte held counts as two moved), so that
  neither whole-model gather groups nor tiny split ones are chosen (a
  model of four blocks gathers one at a time, even where two would pad
  less: two groups of two are the whole model held at Z3's peak);
  ``summary()`` reports the choice, the padding and the exchange.

  On an HSDP mesh, owners are global ``(replicate, shard)`` slots: a group
  is gathered over ``replicate`` and then over the shard axes, so that Z3's
  backward re-gather stays inside the shard group; gradients are
  reduce-scattered over the shard axes, then over ``replicate``.

  Tensor parallelism: on a mesh with ``tensor_parallel_axis`` (e.g.
  ``('replicate', 'shard', 'model')``), owners range over the other axes and
  a Muon target whose sharding (read from ``params``: arrays placed with a
  ``NamedSharding``) puts the TP axis on one matrix dimension is split:
  every TP shard of the owner stores its slice, a block receives each TP
  shard's slice (write the block Megatron-style: column-parallel matmuls on
  the local slice, a ``psum`` over the TP axis after row-parallel ones), and
  :func:`dedicated_muon` orthogonalizes with Gram Newton–Schulz over the TP
  axis (one Gram all-reduce per restart window, the matrix never gathered).
  Compute gradients with ``dmuon_jax.local_value_and_grad(loss,
  axis_names=<the owner axes>)`` so that autodiff still sums the
  TP-replicated params' gradients over the TP axis.

  Args:
    params: the params tree (shapes are enough).
    mesh: the mesh whose devices own the matrices (None: one device).
    predicate: Muon-target predicate, as for :func:`dmuon_jax.dmuon`.
    muon_weight_dimension_numbers: as for :func:`dmuon_jax.dmuon`.
    boundary_predicate: custom hook boundaries, see
      :func:`dmuon_jax.find_hook_boundaries`.
    strict: raise if a target lies outside the model's blocks; False:
      gather it with its own module (see
      :func:`dmuon_jax.find_hook_boundaries`).
    reshard_after_forward: True for Z3 (gather again in the backward pass),
      False for Z2 (keep the gathered weights).
    layers_per_gather: boundaries (or scanned layers) per gather; must
      divide the length of every scanned stack. ``'auto'`` (default): the
      number that minimizes the Muon bytes a step moves plus twice the
      gathered bytes Z3 holds at its peak.
    axis_names: the owner axes (default: the mesh axes of more than one
      device but ``tensor_parallel_axis``; an axis of one device is one
      only where named here).
    replicate_axis: the HSDP replicate axis name, if the mesh has it.
    remat_policy: for Z3, the ``jax.checkpoint`` policy of a block. The
      default ``jax.checkpoint_policies.dots_saveable`` keeps matmul outputs
      and recomputes the gathered weights and elementwise ops in the
      backward pass; ``nothing_saveable`` recomputes the whole block
      (activation checkpointing). It must not save the gathered weights
      (a block whose backward reads no weights at all, such as a lookup
      table's, keeps none under any policy).
    tensor_parallel_axis: the mesh axis that splits matrices, if the mesh
      has it. ``'auto'`` (default): the axis named ``'model'``, ``'tensor'``
      or ``'tp'`` that the (placed) Muon params are sharded over, if any,
      as for :func:`dmuon_jax.dmuon`. None: none.
    ns_algorithm: ``'auto'`` (per matrix shape, the cheaper of direct and
      Gram Newton–Schulz by the planner's cost model), ``'standard'`` or
      ``'gram'``; the plan balances that work and :func:`dedicated_muon`
      runs it. TP-split matrices always use the Gram form.
    weight_dimension_numbers: deprecated name of
      ``muon_weight_dimension_numbers``.
    owner_groups: ``'auto'`` (default), an int ``k`` or None: matrices
      split over a group of owners, as for :func:`dmuon_jax.dmuon` (their
      slices are stored on the group's devices and gathered like whole
      matrices); ``'auto'`` also splits matrices of a loop gather group
      whose whole matrices would pad more than 5% (see above); None keeps
      every matrix whole. Not for scanned stacks and TP matrices ('auto'
      leaves them whole; ``k`` raises). Split matrices run Gram
      Newton–Schulz with the Frobenius preconditioning.

  Returns:
    A :class:`Dedication`; move params with ``to_dedicated``.

  Raises:
    ValueError: for targets without a boundary (strict mode), a scanned
      stack whose leaves do not share a leading layer axis, or a
      ``layers_per_gather`` that does not divide a stack.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import dmuon_jax
    >>> params = {f'layers_{i}': {'w': jnp.ones((8, 8)), 'b': jnp.zeros(8)}
    ...           for i in range(2)}
    >>> ded = dmuon_jax.dedicate(params, None)
    >>> ded.boundaries.names
    ('layers_0', 'layers_1')
    >>> dp = ded.to_dedicated(params)
    >>> dp.rest['layers_0']['w'] is None
    True
    >>> bool((ded.to_params(dp)['layers_1']['w'] == 1).all())
    True
  """
  dims_numbers = _dims_numbers(
    muon_weight_dimension_numbers, weight_dimension_numbers
  )
  if layers_per_gather != 'auto' and (
    not isinstance(layers_per_gather, int)
    or isinstance(layers_per_gather, bool)
    or layers_per_gather < 1
  ):
    raise ValueError(
      f'dmuon: layers_per_gather={layers_per_gather!r} must be a positive'
      ' int (the number of consecutive hook boundaries gathered together:'
      " 1, 2, ...; dedicate(...).summary() shows the padding) or 'auto'."
    )
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params
  )
  routing = _routing.route(
    params,
    predicate=predicate,
    weight_dimension_numbers=dims_numbers,
    dims_arg='muon_weight_dimension_numbers',
  )
  _checks.report_routing(routing)
  bounds = _checks.hook_boundaries(
    params, routing.specs, boundary_predicate, strict
  )
  targets = [t for t in routing.specs if t is not None]
  leaves = jax.tree.leaves(params)
  info, local, tp = _tp_local(
    params, targets, mesh, axis_names, tensor_parallel_axis
  )
  of_target = dict(zip(bounds.paths, bounds.of_target))
  scanned = [t for t in targets if bounds.scanned[of_target[t.path]]]
  owner_groups = _checks.check_option(
    owner_groups,
    ns_algorithm=ns_algorithm,
    tp_axis=info.tp_axis,
    scanned=[t.path for t in scanned],
  )
  plan = _assign.plan_ownership(
    local,
    mesh,
    axis_names=info.owner_axes,
    predicate=predicate,
    weight_dimension_numbers=dims_numbers,
    ns_algorithm=ns_algorithm,
    owner_groups=owner_groups,
    ungroupable=[t.leaf_index for t in scanned],
  )
  buffer_axes, rep_axis, group_axis = _owner_axes(plan, replicate_axis)
  place = dict(split=owner_groups == 'auto', memo={})

  def place_with(k, bytes_only=False):
    """The owners (or, ``bytes_only``, the bytes) of the gather groups of
    ``k`` layers per gather."""
    groups = [
      (
        bounds.names[group[0]],
        bounds.scanned[group[0]],
        [s for s in plan.leaves if of_target[s.path] in group],
      )
      for group in _gather_groups(bounds, k)
    ]
    return _gather_plan.plan_gather_groups(
      plan, groups, k, buffer_axes, group_axis, bytes_only=bytes_only, **place
    )

  k, choice = layers_per_gather, 'given'
  if layers_per_gather == 'auto':
    k, choice = _auto_choice(
      plan,
      bounds,
      scanned,
      rep_axis,
      reshard_after_forward,
      functools.partial(place_with, bytes_only=True),
      functools.partial(_gather_floor, plan, bounds, scanned, of_target),
    )
  gathered = place_with(k)
  return Dedication(
    plan=gathered[0],
    boundaries=bounds,
    groups=_gather_groups(bounds, k),
    layout=_layout(*gathered, k, leaves, tp, info, buffer_axes),
    layers_per_gather=k,
    layers_per_gather_choice=choice,
    treedef=jax.tree.structure(params),
    mesh=mesh,
    reshard_after_forward=reshard_after_forward,
    buffer_axes=buffer_axes,
    replicate_axis=rep_axis,
    remat_policy=remat_policy or jax.checkpoint_policies.dots_saveable,
    **_rest(params, leaves, gathered[0], mesh, bounds),
    abstract_params=abstract,
    tensor_parallel_axis=info.tp_axis,
    ns_algorithm=ns_algorithm,
  )


def _layout(
  plan: _plan.OwnershipPlan,
  group_plans: Sequence[_plan.OwnershipPlan],
  iterations: Sequence[int],
  k: int,
  leaves: Sequence[Any],
  tp: tuple[dict[int, int], dict[int, int]],
  info: Any,
  buffer_axes: tuple[str, ...],
) -> _owner_layout.OwnerLayout:
  """The owner layout of the gather groups' plans (``leaves``: the whole
  params; ``k`` layers per scan iteration; ``tp``: per TP-split target's
  leaf index, its split dim and its matrix split axis)."""
  tp_dims, tp_splits = tp
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  group_of = {
    s.leaf_index: g for g, gp in enumerate(group_plans) for s in gp.leaves
  }
  # The owner update runs no TP Gram inside a scan over layers (yet).
  stacked = [
    s.path
    for s in plan.leaves
    if s.leaf_index in tp_splits and iterations[group_of[s.leaf_index]]
  ]
  if stacked:
    raise ValueError(
      f'dmuon: the Muon targets {stacked} are stacked layers (a scanned '
      f'stack) split over the tensor-parallel axis {info.tp_axis!r}, which '
      'dedicated mode does not run yet. Store the layers as separate params '
      '(a Python loop over layers), pass tensor_parallel_axis=None with the '
      'stack replicated over that axis, or use the drop-in dmuon_jax.dmuon.'
    )
  return _owner_layout.OwnerLayout.build(
    group_plans,
    [
      _owner_layout.TargetLeaf(
        index=s.leaf_index,
        path=s.path,
        shape=np.shape(leaves[s.leaf_index]),
        dtype=s.dtype,
        group=group_of[s.leaf_index],
        tp_dim=tp_dims.get(s.leaf_index),
      )
      for s in plan.leaves
    ],
    dtype_of={s.leaf_index: s.dtype for s in plan.leaves},
    split_of=tp_splits,
    buffer_axes=buffer_axes,
    buffer_sizes=tuple(sizes[a] for a in buffer_axes),
    tp_axis=info.tp_axis,
    tp_size=info.tp_size,
    mesh=info.abstract,
    iterations=iterations,
    layers_per_iteration=tuple(k if it else 1 for it in iterations),
    kind='dedicated',
  )


def _rest(params, leaves, plan, mesh, bounds) -> dict[str, tuple[Any, ...]]:
  """The :class:`Dedication` fields of the leaves' paths: ``rest_specs``
  (see :func:`rest_spec`), ``leaf_paths`` and ``boundary_keys``."""
  flat = jax.tree.flatten_with_path(params)[0]
  leaf_paths = tuple(_routing.normalize_path(keys) for keys, _ in flat)
  owned = {s.leaf_index for s in plan.leaves}
  scanned_names = [n for n, sc in zip(bounds.names, bounds.scanned) if sc]
  return dict(
    rest_specs=tuple(
      None if i in owned else rest_spec(x, path, mesh, scanned_names)
      for i, (x, path) in enumerate(zip(leaves, leaf_paths))
    ),
    leaf_paths=leaf_paths,
    boundary_keys=tuple(
      next(
        tuple(keys[: len([s for s in name.split('/') if s])])
        for (keys, _), path in zip(flat, leaf_paths)
        if not name or path == name or path.startswith(name + '/')
      )
      for name in bounds.names
    ),
  )


def _dims_numbers(muon_weight_dimension_numbers, weight_dimension_numbers):
  """The dimension numbers given, under their name or the deprecated one
  (which warns)."""
  if weight_dimension_numbers is _UNSET:
    return muon_weight_dimension_numbers
  warnings.warn(
    'As of dmuon_jax 0.2, dedicate(weight_dimension_numbers=...) is '
    'called muon_weight_dimension_numbers, as in dmuon_jax.dmuon; the '
    'old name will be removed.',
    DeprecationWarning,
    stacklevel=3,
  )
  if muon_weight_dimension_numbers is not None:
    raise TypeError(
      'dmuon: dedicate got both muon_weight_dimension_numbers and its '
      'deprecated name weight_dimension_numbers; pass only the first.'
    )
  return weight_dimension_numbers


def _gather_groups(
  bounds: _checks.HookBoundaries, k: int
) -> tuple[tuple[int, ...], ...]:
  """Consecutive loop boundaries by ``k``, each scanned stack alone."""
  groups, run = [], []
  for b, scanned in enumerate(bounds.scanned):
    if scanned:
      groups.append((b,))
      continue
    run.append(b)
    if len(run) == k:
      groups.append(tuple(run))
      run = []
  if run:
    groups.append(tuple(run))
  return tuple(groups)


def _gather_floor(plan, bounds, scanned, of_target, k):
  """Per gather group of ``k`` layers, bytes no placement goes below: its
  matrices' bytes gathered as they are (no padding, no exchange)."""
  out = []
  for group in _gather_groups(bounds, k):
    payload = sum(
      math.prod(s.shape) * np.dtype(s.dtype).itemsize
      for s in plan.leaves
      if of_target[s.path] in group
    )
    stack = [s.shape[0] for s in scanned if of_target[s.path] in group]
    iterations = stack[0] // k if stack else 0
    out.append(_plan.GatherBytes(payload, payload, 0.0, iterations))
  return out


def _auto_choice(
  plan, bounds, scanned, rep_axis, z3, group_bytes, group_floor
) -> tuple[int, str]:
  """``(k, choice)`` of ``layers_per_gather='auto'``.

  Of the group sizes that divide every scanned stack, the one whose plan
  (per gather group its bytes, ``group_bytes(k)``: the plans'
  :meth:`OwnershipPlan.gather_bytes`) minimizes, in bytes per device, the
  Muon bytes a step moves (the seeds' HSDP model of the gathers and
  reduce-scatters, ``(2 or 3) (S - 1) / S`` of the gathered bytes plus
  ``2 (R - 1) / R`` of a shard's share, and the owner groups' Gram
  exchange) plus twice the gathered bytes held at the peak: Z3 holds
  about two groups (measured: a group's regathered weights and their
  gradient in its backward pass), Z2 every group's weights. A byte held
  counts as two bytes moved (so a 70B model on 64 devices gathers 8
  layers at a time, not 17; ``HELD_WEIGHT``). Ties go to the smaller size.
  A size whose cost on ``group_floor(k)`` (its matrices' bytes, unpadded:
  the cost grows with every group's bytes) is already no better than the
  best so far is not placed.
  """
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  r = sizes.get(rep_axis, 1) if rep_axis else 1
  s = math.prod(sizes.values()) // r
  stacks = sorted({t.shape[0] for t in scanned})
  top = max([sum(1 for sc in bounds.scanned if not sc), *stacks, 1])

  def cost(got):
    moved = sum(
      (3 if z3 else 2) * _checks.ring_bytes('all-gather', s, b.gathered)
      + 2 * _checks.ring_bytes('all-gather', r, b.gathered / s)
      + b.exchange
      for b in got
    )
    if z3:
      held = sum(sorted(b.gathered / max(b.iterations, 1) for b in got)[-2:])
    else:
      held = sum(b.gathered for b in got)
    return moved + HELD_WEIGHT * held

  best = None
  for k in range(1, top + 1):
    if any(n % k for n in stacks):
      continue
    if best is not None and cost(group_floor(k)) >= best[0] * (1 - 1e-9):
      continue
    got = group_bytes(k)
    c = cost(got)
    if best is None or c < best[0] * (1 - 1e-9):
      best = (c, k, _plan.GatherBytes.total(got).padding)
  _, k, pad = best
  return k, 'auto' if pad <= AUTO_PADDING_PERCENT else 'auto, padding above 5%'


# What a byte of gathered weights held at Z3's peak counts for against a
# byte a step moves, in layers_per_gather='auto' (see _auto_choice).
HELD_WEIGHT = 2.0
