"""Owner plan: which device orthogonalizes which Muon matrix."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

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

# Upper bound on partner checks in the layer-spreading repair pass, so that
# pathological trees (many thousands of matrices) still plan quickly.
_REPAIR_BUDGET = 500_000


def _assign(units: Sequence[MatrixUnit], num_slots: int) -> list[int]:
  """LPT on cost, spreading the matrices of each layer over owners.

  A layer with ``n`` matrices may put ``cap = ceil(n / num_slots)`` of them on
  one slot (1 when the layer fits, i.e. distinct owners). Units go in order
  of decreasing cost (ties: lower unit index first). Plain LPT puts each on
  the least-loaded slot ``g`` (ties: lowest index). We instead take the
  least-loaded slot ``a`` still below the layer's cap, if adding the unit
  there leaves the makespan no larger than plain LPT's choice would:
  ``loads[a] + c <= max(makespan, loads[g] + c)``. A repair pass then
  removes remaining excess by moves and swaps that keep the makespan.

  Graham's bound still holds. Let ``W_k`` be the total cost placed before
  unit ``k``; ``loads[g] <= W_k / P``. After placing unit ``k`` the makespan
  is at most ``max(M_{k-1}, loads[g] + c_k)``, so by induction the final
  makespan is at most ``max_k (W_k / P + c_k) <= total / P + max cost``; the
  repair pass never raises the makespan.

  Args:
    units: the matrices.
    num_slots: the number of owner slots.

  Returns:
    The owner slot of each unit.
  """
  sizes = collections.Counter(u.layer for u in units)
  cap = {layer: -(-n // num_slots) for layer, n in sizes.items()}
  counts = {layer: np.zeros(num_slots, dtype=np.int64) for layer in sizes}
  loads = np.zeros(num_slots, dtype=np.float64)
  owners = [0] * len(units)
  makespan = 0.0
  order = sorted(range(len(units)), key=lambda i: (-units[i].cost, i))
  for i in order:
    unit = units[i]
    cost = unit.cost
    count, limit = counts[unit.layer], cap[unit.layer]
    g = int(np.argmin(loads))  # argmin returns the lowest index on ties.
    choice = g
    if count[g] >= limit:
      a = int(np.argmin(np.where(count < limit, loads, np.inf)))
      if count[a] < limit and loads[a] + cost <= max(makespan, loads[g] + cost):
        choice = a
    loads[choice] += cost
    count[choice] += 1
    makespan = max(makespan, float(loads[choice]))
    owners[i] = choice
  _spread_layers(units, owners, loads, counts, cap)
  return owners


def _spread_layers(
  units: Sequence[MatrixUnit],
  owners: list[int],
  loads: np.ndarray,
  counts: dict[str, np.ndarray],
  cap: dict[str, int],
) -> None:
  """Moves or swaps units, in place, to bring layers under their caps.

  A unit on a slot holding more than ``cap`` units of its layer moves to a
  slot below the cap, or swaps with a unit there whose layer has room on the
  first slot, when neither slot then exceeds the current makespan. Every
  change lowers the total excess by at least one, so this terminates; the
  search is deterministic (units and slots in index order) and bounded by
  ``_REPAIR_BUDGET`` partner checks.

  Args:
    units: the matrices.
    owners: owner slot per unit, updated in place.
    loads: cost per slot, updated in place.
    counts: per layer, the number of its units on each slot (in place).
    cap: per layer, the most units it should have on one slot.
  """
  num_slots = len(loads)
  makespan = float(loads.max(initial=0.0))
  on_slot: list[list[int]] = [[] for _ in range(num_slots)]
  for i, owner in enumerate(owners):
    on_slot[owner].append(i)
  budget = _REPAIR_BUDGET
  changed = True
  while changed and budget > 0:
    changed = False
    for i, unit in enumerate(units):
      s, layer = owners[i], unit.layer
      count, limit = counts[layer], cap[layer]
      if count[s] <= limit:
        continue
      for t in range(num_slots):
        if count[t] >= limit:
          continue
        partner = None
        if loads[t] + unit.cost <= makespan:
          partner = -1  # a plain move
        else:
          for j in on_slot[t]:
            budget -= 1
            other = units[j]
            if other.layer == layer or (
              counts[other.layer][s] >= cap[other.layer]
            ):
              continue
            delta = other.cost - unit.cost
            if delta == 0 or (
              loads[s] + delta <= makespan and loads[t] - delta <= makespan
            ):
              partner = j
              break
        if partner is None:
          if budget <= 0:
            return
          continue
        _move(i, s, t, units, owners, loads, counts, on_slot)
        if partner >= 0:
          _move(partner, t, s, units, owners, loads, counts, on_slot)
        changed = True
        break


def _move(
  i: int,
  src: int,
  dst: int,
  units: Sequence[MatrixUnit],
  owners: list[int],
  loads: np.ndarray,
  counts: dict[str, np.ndarray],
  on_slot: list[list[int]],
) -> None:
  unit = units[i]
  owners[i] = dst
  loads[src] -= unit.cost
  loads[dst] += unit.cost
  counts[unit.layer][src] -= 1
  counts[unit.layer][dst] += 1
  on_slot[src].remove(i)
  on_slot[dst].append(i)


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
  owners = _assign(units, math.prod(sizes))
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
