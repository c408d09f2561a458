"""Owner plan: which device orthogonalizes which Muon matrix."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from dmuon_jax._assign import assign
from dmuon_jax._cost import NS_ALGORITHMS, ns_cost
from dmuon_jax._mesh import check_devices, mesh_axes
from dmuon_jax._newton_schulz import is_int
from dmuon_jax._owner_groups import check_option, plan_with_groups
from dmuon_jax._plan import (
  MatrixUnit,
  OwnershipPlan,
)
from dmuon_jax._routing import (
  Predicate,
  WeightDimNums,
  layer_key,
  route,
)

CostFn = Callable[[int, int], float]


def plan_ownership(
  params: Any,
  mesh: Any = None,
  *,
  axis_names: str | Sequence[str] | None = None,
  predicate: Predicate | str | None = None,
  weight_dimension_numbers: WeightDimNums = None,
  ns_steps: int = 5,
  cost_fn: CostFn | None = None,
  ns_algorithm: str = 'auto',
  owner_groups: int | str | None = 'auto',
  shard_counts: Mapping[int, Sequence[int]] | None = None,
  ungroupable: Sequence[int] = (),
) -> OwnershipPlan:
  """Assigns every Muon matrix of ``params`` to exactly one owner slot.

  Leaves are routed to Muon as :func:`dmuon_jax.dmuon` routes them
  (``predicate``, ``weight_dimension_numbers``); each matrix inside a
  stacked leaf (``(L, m, n)``, ``(L, E, m, n)``, ...) is its own unit. Units
  are balanced by longest-processing-time-first on the predicted
  Newton–Schulz cost, spreading matrices of one layer (the path up to its
  block boundary, such as ``layers/3``, or the scanned layer of a stack)
  over different owners whenever that does not increase the makespan. The
  makespan is at most ``total / num_slots + max cost`` (Graham's bound). No
  divisibility of shapes or counts by the mesh is needed.

  Args:
    params: a pytree whose leaves have ``shape`` and ``dtype`` (arrays or
      ``jax.ShapeDtypeStruct``); may hold None or ``optax.MaskedNode()``
      placeholders. Only shapes and dtypes are read.
    mesh: (optional, default None) a ``jax.sharding.Mesh``,
      ``jax.sharding.AbstractMesh`` or mapping ``{axis_name: size}``; None
      gives a single slot.
    axis_names: (optional, default None) the mesh axes that owners range
      over; None for all. They are kept in mesh order.
    predicate: (optional) ``(path, leaf) -> bool`` selecting Muon targets,
      or ``'optax'``, as for :func:`dmuon_jax.dmuon`.
    weight_dimension_numbers: (optional) ``MuonDimensionNumbers`` for
      every leaf, a tree (prefix) of them or a callable returning one, as
      ``muon_weight_dimension_numbers`` of :func:`dmuon_jax.dmuon`.
    ns_steps: Newton–Schulz iterations, for the default cost model.
    cost_fn: (optional) ``(fan_in, fan_out) -> float`` replacing the default
      cost model (the matmul FLOPs of the Newton–Schulz form that runs).
    ns_algorithm: (optional, default ``'auto'``) the Newton–Schulz form the
      optimizer runs, for the default cost model: ``'auto'`` (the cheaper
      form per shape, as :func:`dmuon_jax.dmuon`'s default), ``'standard'``
      or ``'gram'``.
    owner_groups: (optional, default ``'auto'``) owner groups (see
      :class:`OwnerGroup`): ``'auto'`` splits matrices that alone would set
      the makespan (each costs more than ``total / N`` and at least 1e10
      FLOPs) when that lowers the predicted time (FLOPs plus
      ``FLOPS_PER_BYTE`` per byte of the groups' collectives) by 5%; an int
      ``k`` splits every Muon matrix into ``k`` slices on ``k`` devices of
      the innermost owner axis; None never splits.
    shard_counts: (optional) leaf index -> per dimension its number of
      shards, so that slices take an equal part of every shard.
    ungroupable: (optional) leaf indices never split.

  Returns:
    An :class:`OwnershipPlan`.

  Raises:
    ValueError: for invalid targets (not a floating-point matrix of rank
      >= 2, of rank > 2 without dimension numbers, or with dimension numbers
      invalid for its shape), unknown
      ``axis_names`` or a negative or non-finite cost.

  Examples:
    Shapes only; a mapping stands in for the mesh:

    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {
    ...     'up': jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...     'down': jax.ShapeDtypeStruct((256, 64), jnp.float32),
    ...     'wide': jax.ShapeDtypeStruct((512, 512), jnp.float32),
    ...     'bias': jax.ShapeDtypeStruct((64,), jnp.float32)}
    >>> plan = dmuon_jax.plan_ownership(params, {'data': 2})
    >>> [unit.path for unit in plan.units]  # the bias goes to AdamW
    ['down', 'up', 'wide']
    >>> plan.owners  # LPT: the big matrix alone, the two small ones together
    (1, 1, 0)
    >>> plan.makespan == max(plan.slot_costs()) == plan.units[2].cost
    True
  """
  if not is_int(ns_steps) or ns_steps < 1:
    raise ValueError(
      f'dmuon: {ns_steps=} must be a positive int (the Newton-Schulz'
      ' iterations the cost model counts); pass e.g. 5, as the optimizer.'
    )
  if ns_algorithm not in NS_ALGORITHMS:
    raise ValueError(
      f'dmuon: ns_algorithm={ns_algorithm!r} is not one of {NS_ALGORITHMS}.'
    )
  names, sizes = mesh_axes(mesh, axis_names)
  check_devices(params, mesh)
  routing = route(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
  )
  all_specs = routing.specs
  leaves = tuple(s for s in all_specs if s is not None)
  units = []
  for spec in leaves:
    fan_in, fan_out = spec.matrix_shape
    if cost_fn is None:
      cost = ns_cost(fan_in, fan_out, int(ns_steps), ns_algorithm)
    else:
      cost = float(cost_fn(fan_in, fan_out))
      if not math.isfinite(cost) or cost < 0:
        raise ValueError(
          f'dmuon: cost_fn({fan_in}, {fan_out}) returned {cost} for param'
          f' {spec.path!r}; expected a finite, non-negative float.'
        )
    nbytes = fan_in * fan_out * jnp.dtype(spec.dtype).itemsize
    for batch_index in np.ndindex(*spec.batch_shape):
      batch_index = tuple(int(i) for i in batch_index)
      units.append(
        MatrixUnit(
          leaf_index=spec.leaf_index,
          path=spec.path,
          batch_index=batch_index,
          shape=(fan_in, fan_out),
          layer=layer_key(spec.path, batch_index),
          cost=cost,
          nbytes=int(nbytes),
        )
      )
  owners = assign(units, math.prod(sizes))
  groups = ()
  owner_groups = check_option(owner_groups, ns_algorithm=ns_algorithm)
  if owner_groups is not None:
    grouped = None
    if owner_groups != 'auto' or cost_fn is None:
      grouped = plan_with_groups(
        leaves,
        units,
        sizes,
        owner_groups,
        int(ns_steps),
        dict(shard_counts or {}),
        frozenset(ungroupable),
        owners,
      )
    if grouped is not None:
      leaves, units, owners, groups = grouped
  return OwnershipPlan(
    axis_names=names,
    mesh_shape=sizes,
    num_leaves=len(all_specs),
    leaves=leaves,
    units=tuple(units),
    owners=tuple(owners),
    groups=groups,
    routing=routing.summary,
  )
