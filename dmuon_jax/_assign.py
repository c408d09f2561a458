"""The assignment algorithm: which slot orthogonalizes which piece.

A piece is a whole matrix, or an owner group: its slices, which share the
collectives of one row of owners, and its ``g x g`` iteration. Every plan
is made here, by longest-processing-time first on the predicted
Newton–Schulz work (:func:`assign` for whole matrices, :func:`place` for
pieces onto rows and then members), with two optional inputs that
dedicated mode's gather groups supply:

- ``loads``: the work slots already carry. Dedicated mode places its
  gather groups one after another, each seeing the work of those before.
- :class:`Budget`: the bytes a slot may hold of the pieces placed (a gather
  pads every owner to the largest owner's bytes, per dtype).

The drop-in plan is one call with neither (owner groups' members still get
a bytes target: the update's routes pad every owner's rows to the largest).
Under a budget, each restart window of a split matrix's iteration is a
piece of its own (every owner holds its share of the bytes, so none should
also hold a whole iteration); without one, a matrix's windows stay on one
owner. When every gather group is placed, :func:`balance` permutes owners
inside gather groups, which keeps each group's bytes, to even out the work
over the model: rows first, then owners.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dmuon_jax._plan import MatrixUnit

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

  def held(self, n: int) -> np.ndarray:
    """Zero bytes held: per bucket, per slot."""
    return np.zeros((len(self.cap), n))

  def room(self, held: np.ndarray, unit: int, nbytes: int) -> np.ndarray:
    """Where ``unit`` may go (see :func:`_room`), by its bucket."""
    return _room(held[self.key[unit]], nbytes, self.cap[self.key[unit]])


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
  held = None if budget is None else budget.held(num_slots)
  owners = [0] * len(units)
  makespan = float(loads.max(initial=0.0))
  order = sorted(range(len(units)), key=lambda i: (-units[i].cost, i))
  for i in order:
    unit = units[i]
    cost = unit.cost
    count, limit = counts[unit.layer], cap[unit.layer]
    below = count < limit
    if budget is None:
      g = int(np.argmin(loads))  # argmin returns the lowest index on ties.
    else:
      ok = budget.room(held, i, unit.nbytes)
      g = int(np.argmin(np.where(ok, loads, np.inf)))
      below = below & ok
    choice = g
    if count[g] >= limit:
      a = int(np.argmin(np.where(below, loads, np.inf)))
      if below[a] and loads[a] + cost <= max(makespan, loads[g] + cost):
        choice = a
    loads[choice] += cost
    count[choice] += 1
    if held is not None:
      held[budget.key[i], choice] += unit.nbytes
    makespan = max(makespan, float(loads[choice]))
    owners[i] = choice
  _spread_layers(units, owners, loads, counts, cap, budget, held)
  return owners


def _spread_layers(
  units: Sequence[MatrixUnit],
  owners: list[int],
  loads: np.ndarray,
  counts: dict[str, np.ndarray],
  cap: dict[str, int],
  budget: Budget | None,
  held: np.ndarray | None,
) -> None:
  """Moves or swaps units, in place, to bring layers under their caps.

  A unit on a slot holding more than ``cap`` units of its layer moves to a
  slot below the cap, or swaps with a unit there whose layer has room on the
  first slot, when neither slot then exceeds the current makespan (nor,
  with a ``budget``, its bytes: a move where they fit, a swap of equal
  bytes). Every change lowers the total excess by at least one, so this
  terminates; the search is deterministic (units and slots in index order)
  and bounded by ``_REPAIR_BUDGET`` partner checks.

  Args:
    units: the matrices.
    owners: owner slot per unit, updated in place.
    loads: cost per slot, updated in place.
    counts: per layer, the number of its units on each slot (in place).
    cap: per layer, the most units it should have on one slot.
    budget: (optional) the bytes a slot may hold, ``held`` (in place).
    held: per bucket and slot, the bytes held.
  """
  num_slots = len(loads)
  makespan = float(loads.max(initial=0.0))
  on_slot: list[list[int]] = [[] for _ in range(num_slots)]
  for i, owner in enumerate(owners):
    on_slot[owner].append(i)

  def fits(i, t):
    if budget is None:
      return True
    key = budget.key[i]
    return held[key, t] + units[i].nbytes <= budget.cap[key]

  def same_bytes(i, j):
    return budget is None or (
      budget.key[i] == budget.key[j] and units[i].nbytes == units[j].nbytes
    )

  checks = _REPAIR_BUDGET
  changed = True
  while changed and checks > 0:
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
        if loads[t] + unit.cost <= makespan and fits(i, t):
          partner = -1  # a plain move
        else:
          for j in on_slot[t]:
            checks -= 1
            other = units[j]
            if (
              other.layer == layer
              or counts[other.layer][s] >= cap[other.layer]
              or not same_bytes(i, j)
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
            return
          continue
        _move(i, s, t, units, owners, loads, counts, on_slot, budget, held)
        if partner >= 0:
          _move(
            partner, t, s, units, owners, loads, counts, on_slot, budget, held
          )
        changed = True
        break


def _move(i, src, dst, units, owners, loads, counts, on_slot, budget, held):
  """Unit ``i`` from slot ``src`` to ``dst``, and the tallies with it."""
  unit = units[i]
  owners[i] = dst
  loads[src] -= unit.cost
  loads[dst] += unit.cost
  counts[unit.layer][src] -= 1
  counts[unit.layer][dst] += 1
  on_slot[src].remove(i)
  on_slot[dst].append(i)
  if budget is not None:
    held[budget.key[i], src] -= unit.nbytes
    held[budget.key[i], dst] += unit.nbytes


# A piece of a row: (cost, order, kind, ref, group). ``kind`` is 'unit' (a
# whole matrix or a slice, ``ref`` its unit index) or 'iteration' (``ref``
# ``(group, restart window)``); ``group`` is a slice's or an iteration's
# group, else -1.
Piece = tuple[float, int, str, int | tuple[int, int], int]


def place(
  items: Sequence[tuple[float, int, int]],
  iteration_costs: Sequence[Sequence[float]],
  group_units: Sequence[Sequence[int]],
  units: Sequence[MatrixUnit],
  rows: Sequence[Sequence[int]],
  distinct: bool,
  *,
  loads: np.ndarray | None = None,
  budget: Budget | None = None,
) -> tuple[list[int], list[tuple[int, ...]]]:
  """Owners of the units and of the groups' iterations.

  LPT of the pieces (a whole matrix, or a group with its slices) onto
  rows, then each row's pieces onto its members (see :func:`_members`).
  With a ``budget``, a piece goes to the least-loaded row with room for
  its bytes (else the least filled), and a row's members to their share.

  Args:
    items: the pieces, ``(cost, order, whole unit index | -(group + 1))``.
    iteration_costs: per group, its iteration's cost in each restart
      window (with a ``budget`` each window is a piece of its own; without
      one a group's windows go to one slot).
    group_units: per group, its slices' unit indices.
    units: the units (whole matrices and slices).
    rows: the slots of each row.
    distinct: every slice of a group on its own member (``owner_groups=
      k``).
    loads: (optional) per slot, the work it already carries; updated in
      place.
    budget: (optional) the bytes a slot may hold of these units.

  Returns:
    ``(owners, iteration_owners)``: a slot per unit, per group a slot per
    window.
  """
  n = sum(len(r) for r in rows)
  if loads is None:
    loads = np.zeros(n)
  row_load = np.array([loads[r].sum() for r in rows])
  row_pieces: list[list[Piece]] = [[] for _ in rows]
  if budget is not None:
    row_held = np.zeros((len(budget.cap), len(rows)))
    row_cap = np.outer(budget.cap, [len(r) for r in rows])
  for cost, order, ref in sorted(items, key=lambda x: (-x[0], x[1])):
    r = int(np.argmin(row_load))
    if budget is not None:
      if ref >= 0:
        key, nbytes = budget.key[ref], units[ref].nbytes
      else:
        key = budget.key[group_units[-ref - 1][0]]
        nbytes = sum(units[u].nbytes for u in group_units[-ref - 1])
      ok = _room(row_held[key], nbytes, row_cap[key])
      r = int(np.argmin(np.where(ok, row_load, np.inf)))
      row_held[key, r] += nbytes
    row_load[r] += cost
    if ref >= 0:
      row_pieces[r].append((cost, order, 'unit', ref, -1))
      continue
    g = -ref - 1
    # Without a budget the members' slices follow their work, so an
    # iteration owner holds few slices; with one (a gather's bytes spread
    # evenly) it holds its share, and the windows' iterations are pieces
    # of their own, so that no device holds a whole iteration and a share.
    windows = (
      enumerate(iteration_costs[g])
      if budget is not None
      else [(-1, sum(iteration_costs[g]))]
    )
    for w, c in windows:
      row_pieces[r].append((c, order, 'iteration', (g, w), g))
    for u in group_units[g]:
      row_pieces[r].append((units[u].cost, order, 'unit', u, g))
  owners = [0] * len(units)
  iteration_owners = [[0] * len(c) for c in iteration_costs]
  nbytes = [u.nbytes for u in units]
  for row, pieces in zip(rows, row_pieces):
    byte_cap = None
    if budget is not None and pieces:
      # One target for the row's members: a row's pieces share a bucket
      # but for mixed dtypes (then the caps' sum bounds it).
      keys = {budget.key[p[3]] for p in pieces if p[2] == 'unit'}
      byte_cap = sum(budget.cap[k] for k in keys)
    got = _members(pieces, len(row), distinct, nbytes, loads[row], byte_cap)
    for (kind, ref), m in got.items():
      slot = row[m]
      if kind == 'unit':
        owners[ref] = slot
        loads[slot] += units[ref].cost
      else:
        g, w = ref
        for v in range(len(iteration_owners[g])) if w < 0 else [w]:
          iteration_owners[g][v] = slot
          loads[slot] += iteration_costs[g][v]
  return owners, [tuple(o) for o in iteration_owners]


def _members(
  pieces: list[Piece],
  row_size: int,
  distinct: bool,
  nbytes: Sequence[int],
  loads: np.ndarray | None = None,
  byte_cap: float | None = None,
) -> dict[tuple[str, int], int]:
  """One row's pieces onto its members (``loads``: their work so far).

  ``distinct`` (``owner_groups=k``): LPT, each piece to the least-loaded
  member (ties: lowest; with a ``byte_cap``, among those with room for its
  bytes), a group's slices to members not yet holding one, its window
  iterations on them. Else see :func:`_fill` (``nbytes``: each unit's bytes).
  """
  if not distinct:
    return _fill(pieces, row_size, nbytes, loads, byte_cap)
  loads = np.zeros(row_size) if loads is None else np.array(loads, float)
  held = np.zeros(row_size)
  heldby: dict[int, set[int]] = collections.defaultdict(set)
  out = {}
  # A distinct group's iteration goes to one of its k slice owners, so it
  # is placed after every slice.
  ordered = sorted(
    pieces, key=lambda p: (p[2] == 'iteration' and p[4] >= 0, -p[0], p[1])
  )
  for cost, _, kind, ref, group in ordered:
    b = nbytes[ref] if kind == 'unit' else 0
    fits = np.arange(row_size)
    if byte_cap is not None:
      fits = fits[_room(held, b, byte_cap)]
    choice = int(fits[np.argmin(loads[fits])])
    if group >= 0 and kind == 'iteration':
      choice = min(heldby[group], key=lambda m: (loads[m], m))
    elif group >= 0:
      free = [m for m in fits if m not in heldby[group]]
      if not free:
        free = [m for m in range(row_size) if m not in heldby[group]]
      if free:
        choice = min(free, key=lambda m: (loads[m], m))
      heldby[group].add(int(choice))
    loads[choice] += cost
    held[choice] += b
    out[(kind, ref)] = int(choice)
  return out


def _fill(
  pieces: list[Piece],
  row_size: int,
  nbytes: Sequence[int],
  loads0: np.ndarray | None = None,
  byte_cap: float | None = None,
) -> dict[tuple[str, int], int]:
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
    row_size: the members of the row.
    nbytes: bytes of each unit (by unit index).
    loads0: (optional) the members' work so far.
    byte_cap: (optional) the most bytes a member should hold.
  """
  base = np.zeros(row_size) if loads0 is None else np.array(loads0, float)
  whole, slices = [], collections.defaultdict(list)
  # A group's windows but its largest go after its slices, each to the
  # least-loaded member holding some (which then sends no Gram in that
  # window: no message more than with one iteration owner).
  windows = collections.defaultdict(list)
  for cost, order, kind, ref, group in pieces:
    if kind == 'unit' and group >= 0:
      slices[group].append((cost, order, ref))
    elif kind == 'iteration':
      windows[group].append((cost, order, kind, ref))
    else:
      whole.append((cost, order, kind, ref))
  later = {}
  for g, ws in windows.items():
    ws.sort(key=lambda p: (-p[0], p[3]))
    whole.append(ws[0])
    later[g] = ws[1:]
  whole.sort(key=lambda p: (-p[0], p[1]))
  smallest = min((c for ss in slices.values() for c, _, _ in ss), default=0)
  large = [p for p in whole if p[0] >= smallest]
  small = [p for p in whole if p[0] < smallest]
  size = lambda kind, ref: nbytes[ref] if kind == 'unit' else 0
  loads = base.copy()
  for cost, _, _, _ in large:
    loads[int(np.argmin(loads))] += cost
  total = sum(p[0] for p in pieces) + base.sum()
  target = max(loads.max(initial=0.0), total / row_size) * (1 + 1e-9)
  # Groups with more work first; under a budget, those of larger slices
  # first (first fit decreasing: small slices fill what large ones leave).
  order = sorted(
    slices,
    key=lambda g: (
      -max(nbytes[r] for _, _, r in slices[g]) if byte_cap is not None else 0,
      -sum(c for c, _, _ in slices[g]),
      min(o for _, o, _ in slices[g]),
    ),
  )

  def fill(byte_target):
    """The placement within ``byte_target`` bytes per member, whether
    every piece fit its bytes, and the busiest member's work."""
    out, loads, held = {}, base.copy(), np.zeros(row_size)
    fit = True

    def put(m, cost, kind, ref):
      loads[m] += cost
      held[m] += size(kind, ref)
      out[(kind, ref)] = m

    def least_loaded(b):
      nonlocal fit
      spare = [m for m in range(row_size) if held[m] + b <= byte_target]
      fit = fit and bool(spare)
      if not spare:  # the least filled (only a budget keeps this placement)
        return min(range(row_size), key=lambda m: (held[m], loads[m], m))
      return min(spare, key=lambda m: (loads[m], m))

    def room(m, c, b):
      """How many pieces of cost ``c`` and ``b`` bytes fit on ``m``."""
      by_work = (target - loads[m]) // c if c > 0 else np.inf
      by_bytes = (byte_target - held[m]) // b if b > 0 else np.inf
      return max(min(by_work, by_bytes), 0)

    for cost, _, kind, ref in large:
      put(least_loaded(size(kind, ref)), cost, kind, ref)
    homes = {ref[0]: m for (kind, ref), m in out.items() if kind == 'iteration'}
    for g in order:
      todo = sorted(slices[g], key=lambda p: (-p[0], p[1], p[2]))
      home = homes.get(g)
      while todo:
        c, _, ref = todo[0]
        b = nbytes[ref]
        if home is not None and room(home, c, b) >= 1:
          m = home
        else:
          counts = [room(m, c, b) for m in range(row_size)]
          m = int(np.argmax(counts))  # ties: the lowest
          if counts[m] < 1:  # no room for its work
            m = least_loaded(b)
        home = None
        first = True
        while todo and (first or room(m, todo[0][0], nbytes[todo[0][2]])):
          c, _, ref = todo.pop(0)
          put(m, c, 'unit', ref)
          first = False
      holders = {out['unit', ref] for _, _, ref in slices[g]}
      for cost, _, kind, ref in later.get(g, ()):
        taken = {m for (k, r), m in out.items() if k == kind and r[0] == g}
        pool = (holders - taken) or holders
        put(min(pool, key=lambda m: (loads[m], m)), cost, kind, ref)
    for cost, _, kind, ref in small:
      put(least_loaded(size(kind, ref)), cost, kind, ref)
    return out, fit, loads.max(initial=0.0)

  everything = sum(size(p[2], p[3]) for p in pieces)
  lo, hi = everything / row_size, everything
  if byte_cap is not None:
    hi = max(min(hi, byte_cap), lo)
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


def balance(
  per_group: list[np.ndarray],
  movable: Sequence[bool],
  within_row: Sequence[bool],
  rows: Sequence[Sequence[int]],
  max_rounds: int = 10_000,
) -> list[tuple[int, dict[int, int]]]:
  """Moves that even out the work over gather groups.

  Permuting what slots own in one gather group keeps that group's bytes
  per slot (hence its padding) as they are, so only the work moves:
  repeatedly take the busiest slot ``a`` and the move, in any movable
  group, that leaves the busiest slot it touches lowest (then the sum of
  squares of their work), among those that raise no slot above ``a`` and
  lower that sum (so that moves which only even out work next to ``a``
  count: a row at the busiest slot's level takes several): a swap of
  everything ``a`` and another slot own in the group, or (a group whose
  owner groups share a row's collectives, which moves within a row only)
  an exchange of ``a``'s row with another row, each row's members taking
  the other's pieces busiest piece to least busy member.

  Args:
    per_group: per gather group, its work per slot (moved in place).
    movable: per group, whether its owners may move (a scanned stack's
      rotate instead).
    within_row: per group, whether its slots trade within a row only.
    rows: the slots of each row (all of one length).
    max_rounds: the most moves.

  Returns:
    The moves in order, ``(group, {slot: new slot})``: what ``slot`` owned
    in the group goes to ``new slot`` (slots not named keep theirs).
  """
  groups = [g for g, m in enumerate(movable) if m]
  if not groups:
    return []
  n = len(per_group[0])
  grid = np.asarray(rows)
  row_of = np.zeros(n, dtype=np.int64)
  for r, slots in enumerate(rows):
    row_of[slots] = r
  total = sum(per_group, np.zeros(n))
  moves = _balance_rows(per_group, groups, within_row, grid, total, max_rounds)
  for _ in range(max_rounds):
    a = int(np.argmax(total))
    top, ra = total[a], row_of[a]
    eps = 1e-12 * top * top
    # A move may not raise the busiest slot and must lower the sum of
    # squares (a strict order: this ends); the lowest busiest slot it
    # touches first, then the lowest sum of squares.
    best, best_key = None, (top * (1 + 1e-12), 0.0)
    for g in groups:
      w = per_group[g]
      pool = grid[ra] if within_row[g] else np.arange(n)
      ya = total[a] - w[a] + w[pool]
      yb = total[pool] - w[pool] + w[a]
      new = np.maximum(ya, yb)
      dsq = ya * ya + yb * yb - total[a] ** 2 - total[pool] ** 2
      ok = (pool != a) & (w[pool] != w[a]) & (dsq < -eps)
      if ok.any():
        i = np.flatnonzero(ok)
        j = int(i[np.lexsort((dsq[i], new[i]))[0]])
        if (new[j], dsq[j]) < best_key:
          best_key = (new[j], dsq[j])
          best = (g, {a: int(pool[j]), int(pool[j]): a})
      if not within_row[g] or len(grid) < 2:
        continue
      # Row exchanges: the rest of each member's work, least first, takes
      # the other row's pieces, largest first.
      rest = np.sort(total[grid] - w[grid], axis=1)
      pieces = -np.sort(-w[grid], axis=1)
      mine = rest[ra] + pieces  # row a's members with each row's pieces
      theirs = rest + pieces[ra]  # each row's members with row a's
      new = np.maximum(mine.max(axis=1), theirs.max(axis=1))
      held = (total[grid] ** 2).sum(axis=1)
      dsq = (mine**2).sum(axis=1) + (theirs**2).sum(axis=1) - held - held[ra]
      ok = dsq < -eps
      ok[ra] = False
      if ok.any():
        i = np.flatnonzero(ok)
        r = int(i[np.lexsort((dsq[i], new[i]))[0]])
        if (new[r], dsq[r]) < best_key:
          best_key = (new[r], dsq[r])
          best = (g, _exchange(grid[ra], grid[r], total, w))
    if best is None:
      break
    _apply(per_group, total, moves, *best)
  return moves


def _apply(per_group, total, moves, g, move) -> None:
  """Moves what slots own in group ``g`` (``move``: slot -> new slot),
  updating its work and the total (in place), and records the move."""
  w = per_group[g]
  old = {s: w[s] for s in move}
  for s, t in move.items():
    total[t] += old[s] - old[t]
  for s, t in move.items():
    w[t] = old[s]
  moves.append((g, move))


def _balance_rows(per_group, groups, within_row, grid, total, max_rounds):
  """The row exchanges of :func:`balance` that even out the rows' work
  (in place): repeatedly the busiest row and the exchange, in a group
  that moves within rows, that lowers the larger of the two rows' work
  the most. A row's content in a group is fixed by its bytes (a row holds
  a split matrix whole), so rows are evened out before their members."""
  moves = []
  rowed = [g for g in groups if within_row[g]]
  if len(grid) < 2 or not rowed:
    return moves
  for _ in range(max_rounds):
    rt = total[grid].sum(axis=1)
    a = int(np.argmax(rt))
    best, best_max = None, rt[a] * (1 - 1e-9)
    for g in rowed:
      rw = per_group[g][grid].sum(axis=1)
      new = np.maximum(rt[a] - rw[a] + rw, rt - rw + rw[a])
      new[(np.arange(len(grid)) == a) | (rw == rw[a])] = np.inf
      b = int(np.argmin(new))
      if new[b] < best_max:
        best, best_max = (g, b), new[b]
    if best is None:
      break
    g, b = best
    move = _exchange(grid[a], grid[b], total, per_group[g])
    _apply(per_group, total, moves, g, move)
  return moves


def _exchange(ra, rb, total, w) -> dict[int, int]:
  """Rows ``ra`` and ``rb`` trade what they own in one group: each row's
  members, least busy with the rest first, take the other row's pieces,
  largest first."""
  move = {}
  for mine, theirs in ((ra, rb), (rb, ra)):
    takers = mine[np.argsort(total[mine] - w[mine], kind='stable')]
    given = theirs[np.argsort(-w[theirs], kind='stable')]
    for src, dst in zip(given, takers):
      move[int(src)] = int(dst)
  return move
