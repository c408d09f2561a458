"""The placement: which slot orthogonalizes which piece, for every plan.

:func:`plan_ownership` makes the drop-in plan; dedicated mode's gather
groups (:mod:`dmuon_jax._gather_plan`) are placed by the same functions.
A piece is a whole matrix, or an owner group: its slices (units of
:func:`dmuon_jax._plan.resliced`), which share the collectives of one row
of owners, and its ``g x g`` iteration. Every plan is made here, by
longest-processing-time first on the predicted Newton–Schulz work
(:func:`assign` for whole matrices, :func:`place` for pieces onto rows and
then members), with two optional inputs that dedicated mode's gather
groups supply:

- ``loads``: the work slots already carry. Dedicated mode places its
  gather groups one after another, each seeing the work of those before.
- :class:`Budget`: the bytes a slot may hold of the pieces placed (a gather
  pads every owner to the largest owner's bytes, per dtype).

The drop-in plan is one call with neither (owner groups' members still get
a bytes target: the update's routes pad every owner's rows to the largest).
Under a budget, each restart window of a split matrix's iteration is a
piece of its own (every owner holds its share of the bytes, so none should
also hold a whole iteration); without one, a matrix's windows stay on one
owner.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from dmuon_jax._checks import (
  FLOPS_PER_BYTE,
  check_ns_algorithm,
  check_option,
  gram_parts,
  ns_cost,
)
from dmuon_jax._mesh import check_devices, mesh_axes
from dmuon_jax._newton_schulz import is_int
from dmuon_jax._plan import (
  MIN_SLICE,
  MatrixUnit,
  OwnerGroup,
  OwnershipPlan,
  group_rows,
  matrix_units,
  resliced,
  sliced_spec,
)
from dmuon_jax._routing import (
  Predicate,
  WeightDimNums,
  route,
)

# 'auto' splits a matrix only when its Newton-Schulz costs at least this
# much: below it, the two extra collectives per restart window cost more
# than the work they spread (a 1024 x 4096 Gram NS is 6.4e10 FLOPs).
_MIN_GROUP_FLOPS = 1e10
# 'auto' looks for groups when the plain plan's makespan exceeds the ideal
# total / N by this factor, and keeps them when they lower the predicted
# time (FLOPs plus FLOPS_PER_BYTE per byte) by at least _GROUP_GAIN.
_GROUP_TRIGGER = 1.10
_GROUP_GAIN = 0.05
# 'auto' considers matrices costing more than this fraction of total / N:
# coarser pieces than that pack badly (70B's 3.1e13-FLOP MLP matrices on
# 256 devices, 3.9e13 each: the plain plan is 1.2x the ideal).
_COARSE = 0.25
# Slices per grouped matrix: each at most this fraction of the bound
# max(total / N, largest iteration), so slices fill owners finely.
_SLICE_FRACTION = 0.1
# Upper bound on partner checks in the layer-spreading repair pass, so that
# pathological trees (many thousands of matrices) still plan quickly.
_REPAIR_BUDGET = 500_000


class Budget(NamedTuple):
  """The bytes a slot may hold of the pieces placed (a gather group's).

  Attributes:
    key: per unit, its bytes bucket (an owner buffer: one per dtype).
    cap: per bucket, the most bytes one slot should hold.
  """

  key: Sequence[int]
  cap: Sequence[float]


def _room(held: np.ndarray, nbytes: float, cap: float) -> np.ndarray:
  """Per place (slot, row or member), whether ``nbytes`` more stay within
  ``cap``; where they fit nowhere, the places holding the fewest bytes."""
  ok = held + nbytes <= cap
  return ok if ok.any() else held == held.min()


def assign(
  units: Sequence[MatrixUnit],
  num_slots: int,
  *,
  loads: np.ndarray | None = None,
  budget: Budget | None = None,
) -> list[int]:
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
  repair pass never raises the makespan. With a ``budget``, a unit goes
  only to slots where its bytes fit (the least-filled where they fit
  nowhere), and the repair moves only what keeps them within it.

  Args:
    units: the matrices.
    num_slots: the number of owner slots.
    loads: (optional) per slot, the work it already carries; updated in
      place with the units'.
    budget: (optional) the bytes a slot may hold of these units.

  Returns:
    The owner slot of each unit.
  """
  sizes = collections.Counter(u.layer for u in units)
  cap = {layer: -(-n // num_slots) for layer, n in sizes.items()}
  counts = {layer: np.zeros(num_slots, dtype=np.int64) for layer in sizes}
  if loads is None:
    loads = np.zeros(num_slots, dtype=np.float64)
  bounded = budget is not None
  budget = budget or Budget([0] * len(units), [np.inf])  # one bucket, no cap
  held = np.zeros((len(budget.cap), num_slots))
  owners = [0] * len(units)
  on_slot: list[list[int]] = [[] for _ in range(num_slots)]

  def move(i, src, dst):
    """Unit ``i`` from slot ``src`` (-1: not placed yet) to ``dst``."""
    owners[i] = dst
    for slot, sign in ((src, -1), (dst, 1)):
      if slot >= 0:
        loads[slot] += sign * units[i].cost
        counts[units[i].layer][slot] += sign
        held[budget.key[i], slot] += sign * units[i].nbytes
        if sign > 0:
          on_slot[slot].append(i)
        else:
          on_slot[slot].remove(i)

  makespan = float(loads.max(initial=0.0))
  for i in sorted(range(len(units)), key=lambda i: (-units[i].cost, i)):
    unit = units[i]
    cost, key = unit.cost, budget.key[i]
    count, limit = counts[unit.layer], cap[unit.layer]
    ok = _room(held[key], unit.nbytes, budget.cap[key])
    g = int(np.argmin(np.where(ok, loads, np.inf)))  # ties: the lowest
    below = (count < limit) & ok
    a = int(np.argmin(np.where(below, loads, np.inf)))
    spread = below[a] and loads[a] + cost <= max(makespan, loads[g] + cost)
    move(i, -1, a if count[g] >= limit and spread else g)
    makespan = max(makespan, float(loads[owners[i]]))

  # The repair pass: a unit on a slot holding more than ``cap`` units of
  # its layer moves to a slot below the cap, or swaps with a unit there
  # whose layer has room on the first slot, when neither slot then exceeds
  # the current makespan (nor, with a ``budget``, its bytes: a move where
  # they fit, a swap of equal bytes). Every change lowers the total excess
  # by at least one, so this terminates; the search is deterministic
  # (units and slots in index order) and bounded by ``_REPAIR_BUDGET``
  # partner checks. (``makespan`` is loads.max(): costs are >= 0.)
  for units_on in on_slot:
    units_on.sort()
  checks = _REPAIR_BUDGET
  changed = True
  while changed and checks > 0:
    changed = False
    for i, unit in enumerate(units):
      s, layer, key = owners[i], unit.layer, budget.key[i]
      count, limit = counts[layer], cap[layer]
      if count[s] <= limit:
        continue
      for t in np.flatnonzero(count < limit).tolist():  # (fixed till a move)
        partner = None
        if (
          loads[t] + unit.cost <= makespan
          and held[key, t] + unit.nbytes <= budget.cap[key]
        ):
          partner = -1  # a plain move
        else:
          for j in on_slot[t]:
            checks -= 1
            other = units[j]
            if (
              other.layer == layer
              or counts[other.layer][s] >= cap[other.layer]
              # (under a budget, only a swap of equal bytes keeps it)
              or (
                bounded
                and (budget.key[j] != key or other.nbytes != unit.nbytes)
              )
            ):
              continue
            delta = other.cost - unit.cost
            if delta == 0 or (
              loads[s] + delta <= makespan and loads[t] - delta <= makespan
            ):
              partner = j
              break
        if partner is None:
          if checks <= 0:
            return owners
          continue
        move(i, s, t)
        if partner >= 0:
          move(partner, t, s)
        changed = True
        break
  return owners


# A piece of a row: (cost, order, ref, group, bytes). ``ref`` is a unit
# index (a whole matrix or a slice) or, for an iteration, ``(group,
# restart window)`` (window -1: every window); ``group`` is a slice's or
# an iteration's group, else -1.
Piece = tuple[float, int, int | tuple[int, int], int, int]


def place(
  items: Sequence[tuple[float, int, int]],
  groups: Sequence[OwnerGroup],
  units: Sequence[MatrixUnit],
  rows: Sequence[Sequence[int]],
  *,
  loads: np.ndarray | None = None,
  budget: Budget | None = None,
) -> tuple[list[int], list[OwnerGroup]]:
  """Owners of the units and of the groups' iterations.

  LPT of the pieces (a whole matrix, or a group with its slices) onto
  rows, then each row's pieces onto its members (see :func:`_distinct` and :func:`_fill`).
  With a ``budget``, a piece goes to the least-loaded row with room for
  its bytes (else the least filled), and a row's members to their share.

  Args:
    items: the pieces, ``(cost, order, whole unit index | -(group + 1))``.
    groups: the owner groups, their ``units`` indices into ``units``; with
      a ``budget`` each restart window's iteration is a piece of its own
      (without one a group's windows go to one slot); ``distinct``: every
      slice of a group on its own member (``owner_groups=k``).
    units: the units (whole matrices and slices).
    rows: the slots of each row.
    loads: (optional) per slot, the work it already carries; updated in
      place.
    budget: (optional) the bytes a slot may hold of these units.

  Returns:
    ``(owners, groups)``: a slot per unit, the groups with their
    ``iteration_owners``.
  """
  if loads is None:
    loads = np.zeros(sum(len(r) for r in rows))
  bounded = budget is not None
  budget = budget or Budget([0] * len(units), [np.inf])  # one bucket, no cap
  # The rows are the slots of one assign, each piece its own layer (no
  # spreading), its bytes those of its units (a group's in one bucket).
  items = sorted(items, key=lambda x: x[1])
  of = [[ref] if ref >= 0 else groups[-ref - 1].units for _, _, ref in items]
  on_row = assign(
    [
      MatrixUnit(
        -1, '', (), (0, 0), str(i), cost, sum(units[u].nbytes for u in us)
      )
      for i, ((cost, _, _), us) in enumerate(zip(items, of))
    ],
    len(rows),
    loads=np.array([loads[r].sum() for r in rows]),
    budget=Budget(
      [budget.key[u[0]] for u in of], [c * len(rows[0]) for c in budget.cap]
    ),
  )
  row_pieces: list[list[Piece]] = [[] for _ in rows]
  for i in sorted(range(len(items)), key=lambda i: (-items[i][0], i)):
    cost, order, ref = items[i]
    pieces = row_pieces[on_row[i]]
    if ref >= 0:
      pieces.append((cost, order, ref, -1, units[ref].nbytes))
      continue
    g = -ref - 1
    # Without a budget the members' slices follow their work, so an
    # iteration owner holds few slices; with one (a gather's bytes spread
    # evenly) it holds its share, and the windows' iterations are pieces
    # of their own, so that no device holds a whole iteration and a share.
    costs = groups[g].iteration_costs
    windows = enumerate(costs) if bounded else [(-1, sum(costs))]
    pieces += [(c, order, (g, w), g, 0) for w, c in windows]
    pieces += [
      (units[u].cost, order, u, g, units[u].nbytes) for u in groups[g].units
    ]
  owners = [0] * len(units)
  iteration_owners = [[0] * len(g.iteration_costs) for g in groups]
  members = _distinct if any(g.distinct for g in groups) else _fill
  for row, pieces in zip(rows, row_pieces):
    # One target for the row's members: a row's pieces share a bucket but
    # for mixed dtypes (then the caps' sum bounds it); inf without a budget.
    keys = {budget.key[p[2]] for p in pieces if not isinstance(p[2], tuple)}
    byte_cap = sum(budget.cap[k] for k in keys)
    for ref, m in members(pieces, loads[row], byte_cap).items():
      slot = row[m]
      if not isinstance(ref, tuple):
        owners[ref] = slot
        loads[slot] += units[ref].cost
        continue
      g, w = ref
      for v in range(len(iteration_owners[g])) if w < 0 else [w]:
        iteration_owners[g][v] = slot
        loads[slot] += groups[g].iteration_costs[v]
  return owners, [
    dataclasses.replace(g, iteration_owners=tuple(o))
    for g, o in zip(groups, iteration_owners)
  ]


def _distinct(
  pieces: list[Piece], loads: np.ndarray, byte_cap: float
) -> dict[int | tuple[int, int], int]:
  """One row's pieces onto its members (``loads``: their work so far) for
  ``owner_groups=k`` (distinct groups; else :func:`_fill`): LPT, each piece
  to the least-loaded member (ties: lowest) among those with room for its
  bytes (``byte_cap``; inf without a budget), a group's slices to members
  not yet holding one, its window iterations on them.
  """
  loads = np.array(loads, float)
  held = np.zeros(len(loads))
  heldby: dict[int, set[int]] = collections.defaultdict(set)
  out = {}
  # A distinct group's iteration goes to one of its k slice owners, so it
  # is placed after every slice.
  iteration_last = lambda p: (isinstance(p[2], tuple), -p[0], p[1])
  for cost, _, ref, group, b in sorted(pieces, key=iteration_last):
    fits = np.flatnonzero(_room(held, b, byte_cap))
    choice = int(fits[np.argmin(loads[fits])])
    if isinstance(ref, tuple):
      choice = min(heldby[group], key=lambda m: (loads[m], m))
    elif group >= 0:
      free = [m for m in fits if m not in heldby[group]]
      free = free or [m for m in range(len(loads)) if m not in heldby[group]]
      if free:
        choice = min(free, key=lambda m: (loads[m], m))
      heldby[group].add(int(choice))
    loads[choice] += cost
    held[choice] += b
    out[ref] = int(choice)
  return out


def _fill(
  pieces: list[Piece], loads0: np.ndarray, byte_cap: float
) -> dict[int | tuple[int, int], int]:
  """``'auto'``'s placement in a row.

  The groups' window iterations and the whole matrices at least as costly
  as a slice go first by LPT; then each group's slices (largest group
  first) fill few members: an iteration owner of the group (its largest
  window's) first, then the member that takes
  the most of them; then the smaller whole matrices by LPT. All within two
  targets per member: Newton–Schulz work ``max(busiest member after the
  first step, row total / members)`` and bytes (the update's routes pad
  every owner's rows to the largest owner's bytes; a gather group's
  ``byte_cap`` at most): the least bytes target for which every piece fits
  its bytes and the busiest member's work stays that of the placement
  without one (bisection; a slice whose work fits nowhere goes to the
  least-loaded member with room for its bytes). A group's slices then sit
  on few members and a member holds slices of few groups, which keeps the
  Gram exchange's rounds (messages per device, see
  :mod:`dmuon_jax._plan`) few: plain LPT spreads every group over
  the whole row (Llama-3-8B at 256 devices: 7 rounds each way instead of
  2, the same busiest device).

  Args:
    pieces: see :func:`place`.
    loads0: the members' work so far.
    byte_cap: the most bytes a member should hold (inf: no budget).
  """
  base = np.array(loads0, float)
  row_size = len(base)
  whole = []
  slices, windows = collections.defaultdict(list), collections.defaultdict(list)
  for p in pieces:
    if isinstance(p[2], tuple):
      windows[p[3]].append(p)
    elif p[3] >= 0:
      slices[p[3]].append(p)
    else:
      whole.append(p)
  # A group's windows but its largest go after its slices, each to the
  # least-loaded member holding some (which then sends no Gram in that
  # window: no message more than with one iteration owner).
  later = {}
  for g, ws in windows.items():
    ws.sort(key=lambda p: (-p[0], p[2]))
    whole.append(ws[0])
    later[g] = ws[1:]
  whole.sort(key=lambda p: (-p[0], p[1]))
  smallest = min((p[0] for ss in slices.values() for p in ss), default=0)
  large = [p for p in whole if p[0] >= smallest]
  small = [p for p in whole if p[0] < smallest]
  loads = base.copy()
  for p in large:
    loads[int(np.argmin(loads))] += p[0]
  total = sum(p[0] for p in pieces) + base.sum()
  target = max(loads.max(initial=0.0), total / row_size) * (1 + 1e-9)
  # Groups with more work first; under a budget, those of larger slices
  # first (first fit decreasing: small slices fill what large ones leave).
  order = sorted(
    slices,
    key=lambda g: (
      -max(p[4] for p in slices[g]) if byte_cap < np.inf else 0,
      -sum(p[0] for p in slices[g]),
      min(p[1] for p in slices[g]),
    ),
  )

  def fill(byte_target):
    """The placement within ``byte_target`` bytes per member, whether
    every piece fit its bytes, and the busiest member's work."""
    out, loads, held = {}, base.copy(), np.zeros(row_size)
    fit = True

    def put(m, piece):
      loads[m] += piece[0]
      held[m] += piece[4]
      out[piece[2]] = m

    def least_loaded(b):
      nonlocal fit
      spare = [m for m in range(row_size) if held[m] + b <= byte_target]
      fit = fit and bool(spare)
      if not spare:  # the least filled (only a budget keeps this placement)
        return min(range(row_size), key=lambda m: (held[m], loads[m], m))
      return min(spare, key=lambda m: (loads[m], m))

    def room(m, piece):
      """How many pieces like ``piece`` (work and bytes) fit on ``m``."""
      c, b = piece[0], piece[4]
      by_work = (target - loads[m]) // c if c > 0 else np.inf
      by_bytes = (byte_target - held[m]) // b if b > 0 else np.inf
      return max(min(by_work, by_bytes), 0)

    for p in large:
      put(least_loaded(p[4]), p)
    homes = {ref[0]: m for ref, m in out.items() if isinstance(ref, tuple)}
    for g in order:
      todo = sorted(slices[g], key=lambda p: (-p[0], p[1], p[2]))
      m = homes.get(g)  # first the group's iteration owner, if it has room
      while todo:
        if m is None or room(m, todo[0]) < 1:
          counts = [room(m, todo[0]) for m in range(row_size)]
          m = int(np.argmax(counts))  # ties: the lowest
          if counts[m] < 1:  # no room for its work
            m = least_loaded(todo[0][4])
        put(m, todo.pop(0))
        while todo and room(m, todo[0]):
          put(m, todo.pop(0))
      holders = {out[p[2]] for p in slices[g]}
      for p in later.get(g, ()):
        taken = {
          m for r, m in out.items() if isinstance(r, tuple) and r[0] == g
        }
        pool = (holders - taken) or holders
        put(min(pool, key=lambda m: (loads[m], m)), p)
    for p in small:
      put(least_loaded(p[4]), p)
    return out, fit, loads.max(initial=0.0)

  everything = sum(p[4] for p in pieces)
  lo = everything / row_size
  hi = max(min(everything, byte_cap), lo)
  best, _, busiest = fill(hi)
  for _ in range(20):  # bisection on the bytes target
    if hi - lo <= 0.01 * lo:
      break
    mid = (lo + hi) / 2
    out, fit, work = fill(mid)
    if fit and work <= busiest * (1 + 1e-6):  # the same busiest member
      best, hi = out, mid
    else:
      lo = mid
  return best


def plan_ownership(
  params: Any,
  mesh: Any = None,
  *,
  axis_names: str | Sequence[str] | None = None,
  predicate: Predicate | str | None = None,
  weight_dimension_numbers: WeightDimNums = None,
  ns_steps: int = 5,
  cost_fn: Callable[[int, int], float] | None = None,
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
  ns_steps = int(ns_steps)
  check_ns_algorithm(ns_algorithm)
  names, sizes = mesh_axes(mesh, axis_names)
  check_devices(params, mesh)
  routing = route(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
  )
  leaves = tuple(s for s in routing.specs if s is not None)
  units = []
  for spec in leaves:
    fan_in, fan_out = spec.matrix_shape
    if cost_fn is None:
      cost = ns_cost(fan_in, fan_out, ns_steps, ns_algorithm)
    else:
      cost = float(cost_fn(fan_in, fan_out))
      if not math.isfinite(cost) or cost < 0:
        raise ValueError(
          f'dmuon: cost_fn({fan_in}, {fan_out}) returned {cost} for param'
          f' {spec.path!r}; expected a finite, non-negative float.'
        )
    units += matrix_units(spec, cost)
  plan = OwnershipPlan(
    axis_names=names,
    mesh_shape=sizes,
    num_leaves=len(routing.specs),
    leaves=leaves,
    units=tuple(units),
    owners=tuple(assign(units, math.prod(sizes))),
    routing=routing.summary,
  )
  # Owner groups: ``plan`` with some matrices split over a row of owners,
  # unless 'auto' finds no gain (or nothing to group).
  owner_groups = check_option(owner_groups, ns_algorithm=ns_algorithm)
  if owner_groups is None or (owner_groups == 'auto' and cost_fn is not None):
    return plan
  row_size = sizes[-1] if sizes else 1
  forced = owner_groups != 'auto'
  if forced and owner_groups > row_size:  # (check_option: an int >= 2)
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} needs 2 <= k <= the size of the '
      f'innermost owner axis ({row_size}), along which a group of owners '
      "shares a matrix. Pass a smaller k, or owner_groups='auto'."
    )
  if row_size == 1:  # (one slot too)
    return plan
  ideal = float(np.sum(plan.slot_costs())) / plan.num_slots
  plain = plan.makespan
  if not forced and plain <= _GROUP_TRIGGER * ideal:
    return plan
  # The leaves whose matrices may be split: every groupable one when
  # forced, else those costly enough (see _MIN_GROUP_FLOPS, _COARSE).
  # (A leaf's matrices cost the same.)
  cost = {u.leaf_index: u.cost for u in plan.units}
  chosen = [
    s
    for s in plan.leaves
    if s.leaf_index not in ungroupable
    and min(s.matrix_shape) >= 2
    and (forced or _MIN_GROUP_FLOPS <= cost[s.leaf_index] > _COARSE * ideal)
  ]
  parts = {
    s.leaf_index: gram_parts(*sorted(s.matrix_shape), ns_steps) for s in chosen
  }
  bound = max([ideal] + [sum(p[1]) for p in parts.values()])
  views = {}
  for spec in chosen:
    # Forced: k slices, or an error. Else the fewest slices of at most
    # _SLICE_FRACTION * bound work each that divide and keep MIN_SLICE
    # rows/columns; else, if those would be too narrow, the most coarser
    # ones that do (none if none does).
    counts, narrowest = [owner_groups], 1
    if not forced:
      work = parts[spec.leaf_index][0]
      least = max(2, math.ceil(work / (_SLICE_FRACTION * bound)))
      counts = [*range(least, 4 * least + 1), *range(least - 1, 1, -1)]
      narrowest = MIN_SLICE
    stride = (shard_counts or {}).get(spec.leaf_index)
    for count in counts:
      view = sliced_spec(spec, count, stride, narrowest)
      if view is not None:
        views[spec.leaf_index] = view
        break
    if forced and spec.leaf_index not in views:
      raise ValueError(
        f'dmuon: owner_groups={owner_groups}: the long side of param '
        f'{spec.path!r} (matrices {spec.matrix_shape[0]}x'
        f'{spec.matrix_shape[1]}) does not split into {owner_groups} '
        'slices on a dimension divisible by that times its shard count. '
        "Pass a k that divides it, or owner_groups='auto'."
      )
  if not views:
    return plan
  sliced, pieces = resliced(plan, views, ns_steps, distinct=forced)
  owners, groups = place(
    pieces, sliced.groups, sliced.units, group_rows(sizes, -1)
  )
  grouped = dataclasses.replace(
    sliced, owners=tuple(owners), groups=tuple(groups)
  )
  predicted = grouped.makespan + FLOPS_PER_BYTE * grouped.group_exchange_bytes()
  if not forced and predicted > (1 - _GROUP_GAIN) * plain:
    return plan
  return grouped
