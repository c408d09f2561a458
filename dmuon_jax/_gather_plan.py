"""Dedicated mode's gather groups: owners per group of hook boundaries.

Within a gather group, matrices (and, where whole ones would pad the
gather, their slices: owner groups) go to owners so that the group's bytes
are even over the owners; owners are then swapped between slots to even out
the Newton–Schulz work over the model. Each group is placed as a group
plan (an ``OwnershipPlan`` over the buffer axes) by
:func:`dmuon_jax._assign.place` or :func:`~dmuon_jax._assign.assign`, the
placement of every plan. With ``bytes_only``, :func:`plan_gather_groups`
predicts each group's bytes without placing the whole model
(``layers_per_gather='auto'`` weighs them), counted by ``OwnershipPlan.gather_bytes`` as
``Dedication.gather_bytes`` counts a built one. The plan of all Muon
targets comes from :func:`dmuon_jax._assign.plan_ownership`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from dmuon_jax import _assign
from dmuon_jax._plan import (
  MIN_SLICE,
  GatherBytes,
  OwnershipPlan,
  group_rows,
  resliced,
  sliced_spec,
)
from dmuon_jax._routing import LeafSpec


def _split_views(plan, name, scanned, specs, *, split, k, rows, wide, memo):
  """The slicing of one gather group's matrices, whether its owner
  groups span every owner device, and its bytes placed alone (a scanned
  stack's: ``k`` layers per iteration).

  Whole matrices for a scanned stack, without ``split``, or if they pad
  at most ``SPLIT_PADDING_PERCENT``; else the coarsest slicing of
  :func:`byte_views` that does, placed as :func:`plan_gather_groups`
  places it, in rows of the group axis (else the one padding least);
  if none pads at most ``SPLIT_PADDING_PERCENT`` there and one matrix
  outweighs a row's share of the group's bytes (MNIST's 3136 x 256
  ``linear1`` on 2 x 4), the same over one row of every owner device,
  where that pads less and moves fewer bytes (``moved``: a large
  matrix's Gram exchange over every device can cost more than the
  padding it saves).
  Groups of equal shapes share one decision through ``memo`` (keyed on
  what placing reads of the leaves: not their paths).
  """
  n, split_here, k_here = plan.num_slots, split and not scanned, k * scanned
  shapes = tuple(dataclasses.replace(s, leaf_index=0, path='') for s in specs)
  key = (split_here, shapes, k_here, tuple(map(tuple, rows)))

  def moved(b):
    """Bytes a device sends per step for a group's bytes ``b``: its
    gathers' at the all-reduce floor (Z2's; Z3 moves 3/2 of them) and
    the owner groups' exchange, which spanning every device enlarges."""
    return 2 * b.gathered * (n - 1) / n + b.exchange

  def trial(sub, k, where):
    gp, iters = _place_gather_group(sub, name, k, where, np.zeros(n))
    return gp.gather_bytes(iters)

  views = lambda counts: {  # (position in specs -> slice count)
    specs[i].leaf_index: sliced_spec(specs[i], c, None, _min_slice(specs[i]))
    for i, c in counts.items()
  }
  if key not in memo:
    sub = resliced(plan, {}, _NS_STEPS, {s.leaf_index for s in specs})[0]
    best, counts, spans = trial(sub, k_here, rows), {}, False
    # (a row holds a split matrix whole: one that outweighs a row's share
    # of the group's bytes pads every other row)
    heaviest = max((u.nbytes for u in sub.units), default=0)
    dominant = wide and heaviest > best.payload / len(rows)
    for where in (rows, wide if dominant else None):
      if not split_here or where is None:
        continue
      if best.padding <= SPLIT_PADDING_PERCENT:
        break
      for c in byte_views(specs, best.payload / n):
        got = trial(resliced(sub, views(c), _NS_STEPS)[0], 0, where)
        if got.padding < best.padding - 1e-9 and (
          where is rows or moved(got) < moved(best)
        ):
          best, counts, spans = got, c, where is wide
        if got.padding <= SPLIT_PADDING_PERCENT:
          break
    memo[key] = (counts, spans, best)
  counts, spans, best = memo[key]
  return views(counts), spans, best


def plan_gather_groups(
  plan: OwnershipPlan,
  groups: Sequence[tuple[str, bool, Sequence[LeafSpec]]],
  layers_per_gather: int,
  buffer_axes: tuple[str, ...],
  group_axis: str | None = None,
  *,
  split: bool = False,
  memo: dict,
  bytes_only: bool = False,
) -> (
  tuple[OwnershipPlan, tuple[OwnershipPlan, ...], tuple[int, ...]]
  | list[GatherBytes]
):
  """Owners for dedicated mode: matrices gathered per group of boundaries.

  Each group is placed by the assignment algorithm of every plan
  (:mod:`dmuon_jax._assign`: LPT on the Newton–Schulz work, starting from
  the work of the groups placed before, each restart window's iteration a
  piece of its own) within a budget of bytes per slot (the group's mean
  share and 2%, per dtype), so that a gather pads little; then owners are
  permuted inside loop groups (bytes unchanged) to even out the work over
  the whole model: rows first, then slots. With ``split``, a
  loop group whose whole matrices would pad more than
  ``SPLIT_PADDING_PERCENT`` has matrices split into slices over owners of
  one row (owner groups, see ``split_views`` below). A scanned stack is
  planned for one iteration of ``layers_per_gather`` layers; iteration
  ``t`` rotates those owners by ``t`` slots.

  Args:
    plan: the plan of all Muon targets (its units, costs and mesh).
    groups: per gather group, ``(name, scanned, leaf specs)``; a scanned
      group's leaves share a leading layer axis.
    layers_per_gather: layers of a scanned stack per iteration.
    buffer_axes: the owner axes in buffer order (major to minor).
    group_axis: the axis owner groups range over (default: the last buffer
      axis).
    split: whether loop groups may split matrices to even out their bytes.
    memo: a dict kept across calls for one set of params: the split chosen
      per group of equal shapes.
    bytes_only: return, per gather group, only its bytes as this placement
      would give them, each group placed alone (groups of equal shapes
      once, through ``memo``): what ``layers_per_gather='auto'`` weighs.

  Returns:
    ``(plan, group_plans, iterations)``: ``plan`` with every unit's owner
    (mesh-order slots; with ``split``, its leaves and units may be sliced
    views), per group a plan over ``buffer_axes`` of its base units (one
    iteration for a scanned stack), and per group the number of scan
    iterations (0 for loop groups). With ``bytes_only``, per group its
    :class:`GatherBytes`.

  Raises:
    ValueError: for a scanned group whose leaves do not share the leading
      layer axis, or whose length ``layers_per_gather`` does not divide.
  """
  k, n = layers_per_gather, plan.num_slots
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  shape = tuple(sizes[a] for a in buffer_axes)
  axis = buffer_axes.index(group_axis or buffer_axes[-1]) if buffer_axes else 0
  rows = group_rows(shape, axis)
  # Where a group's rows cannot even out its bytes (one matrix outweighs a
  # row's share), its owner groups may span every owner device instead:
  # one row over all the owner axes of more than one device.
  wide_axes = tuple(a for a in buffer_axes if sizes[a] > 1)
  wide = [list(range(n))] if len(rows) > 1 else None

  place = dict(split=split, k=k, rows=rows, wide=wide, memo=memo)
  got = [
    _split_views(plan, name, scanned, specs, **place)
    if bytes_only or (split and not scanned)
    else ({}, False, None)
    for name, scanned, specs in groups
  ]
  if bytes_only:
    return [b for _, _, b in got]
  views = {i: v for vs, _, _ in got for i, v in vs.items()}
  spans = [s for _, s, _ in got]
  if views:
    plan = resliced(plan, views, _NS_STEPS)[0]
  work, placed = np.zeros(n), []
  for (name, scanned, specs), span in zip(groups, spans):
    sub = resliced(plan, {}, _NS_STEPS, {s.leaf_index for s in specs})[0]
    placed.append(
      _place_gather_group(
        sub, name, k if scanned else 0, wide if span else rows, work
      )
    )
  # Even out the work over the model by swapping owners inside loop gather
  # groups (see balance; a scanned stack keeps its rotation, a group with
  # owner groups in rows swaps within a row); moved[g]: where each slot's
  # share in gather group g goes.
  per_group = [_add_work(np.zeros(n), gp, iters) for gp, iters in placed]
  moves = balance(
    per_group,
    [not iters for _, iters in placed],
    [bool(gp.groups) and not span for (gp, _), span in zip(placed, spans)],
    rows,
  )
  moved = [list(range(n)) for _ in placed]
  for g, move in moves:
    moved[g] = [move.get(s, s) for s in moved[g]]
  # A slot in buffer_axes order -> the plan's (mesh-order) slot.
  to_plan = np.arange(n).reshape(plan.mesh_shape)
  to_plan = to_plan.transpose([plan.axis_names.index(a) for a in buffer_axes])
  to_plan = to_plan.ravel().tolist()
  owners = [0] * len(plan.units)
  index_of = {
    (g.leaf_index, g.batch_index): i for i, g in enumerate(plan.groups)
  }
  plan_groups = list(plan.groups)
  group_plans = []
  for (gp, iters), move, span in zip(placed, moved, spans):
    sub_groups = []
    for grp in gp.groups:
      slots = tuple(move[s] for s in grp.iteration_owners)
      g = index_of[grp.leaf_index, grp.batch_index]
      plan_groups[g] = dataclasses.replace(
        plan.groups[g], iteration_owners=tuple(to_plan[s] for s in slots)
      )
      sub_groups.append(dataclasses.replace(grp, iteration_owners=slots))
    base_owner = [move[s] for s in gp.owners]
    for u, slot in zip(gp.units, base_owner):
      for t in range(max(iters, 1)):
        index = u.batch_index
        if iters:
          index = (t * k + index[0],) + index[1:]
        owners[plan.unit_index(u.leaf_index, index)] = to_plan[(slot + t) % n]
    group_plans.append(
      dataclasses.replace(
        gp,
        axis_names=buffer_axes,
        mesh_shape=shape,
        owners=tuple(base_owner),
        groups=tuple(sub_groups),
        group_axis_name=wide_axes if span else group_axis,
      )
    )
  return (
    dataclasses.replace(
      plan,
      owners=tuple(owners),
      groups=tuple(plan_groups),
      group_axis_name=wide_axes if any(spans) else group_axis,
    ),
    tuple(group_plans),
    tuple(iters for _, iters in placed),
  )


# Newton–Schulz iterations, for the cost of split matrices.
_NS_STEPS = 5

# Placing a loop gather group, a slot's bytes may exceed the group's mean
# per slot by this fraction before its Newton-Schulz work stops mattering.
_BYTE_SLACK = 0.02

# A loop gather group whose whole matrices would pad more than this (in
# percent of its bytes) has matrices split into slices (owner groups).
SPLIT_PADDING_PERCENT = 5.0


def _place_gather_group(
  plan: OwnershipPlan,
  name: str,
  k: int,
  rows: list[list[int]],
  work: np.ndarray,
) -> tuple[OwnershipPlan, int]:
  """Places one gather group's matrices, ``plan`` (its leaves and units:
  see :func:`dmuon_jax._plan.resliced`; see :func:`plan_gather_groups`),
  adding their Newton–Schulz work to ``work`` (per slot, in place);
  ``k``: a scanned stack's layers per iteration (0: a loop group).

  The assignment algorithm of every plan (:mod:`dmuon_jax._assign`), with
  ``work`` (the groups placed before) as its loads and a budget of bytes
  per slot: per dtype (an owner buffer), the group's mean share and
  ``_BYTE_SLACK``. Whole matrices by :func:`~dmuon_jax._assign.assign`;
  with owner groups, pieces onto rows and then members by
  :func:`~dmuon_jax._assign.place`. A scanned stack's one iteration is
  placed alone (iteration ``t`` rotates its owners by ``t`` slots) and its
  work added for every rotation.

  Returns:
    ``(group plan, scan iterations)``: ``plan`` placed (a scanned stack's:
    one iteration's leaves and units).
  """
  n = plan.num_slots
  specs, iters = plan.leaves, 0
  if k:  # a scanned stack: one iteration of k layers
    length = specs[0].shape[0]
    bad = [
      s.path for s in specs if 0 not in s.batch_axes or s.shape[0] != length
    ]
    if bad:
      raise ValueError(
        f'dmuon: scanned stack {name!r} needs every Muon target to have '
        f'the same leading layer axis (a batch axis of its dimension '
        f'numbers) of size {length}; these do not: {bad}.'
      )
    if length % k:
      fits = [d for d in range(1, length + 1) if length % d == 0]
      raise ValueError(
        f'dmuon: layers_per_gather={k} does not divide the {length} '
        f'layers of scanned stack {name!r}. Pass one of {fits}.'
      )
    specs = tuple(
      dataclasses.replace(s, shape=(k,) + s.shape[1:]) for s in specs
    )
    iters = length // k
    # (whole matrices: plan_ownership never splits a scanned stack's)
    units = tuple(u for u in plan.units if u.batch_index[0] < k)
    plan = dataclasses.replace(plan, leaves=specs, units=units)
  base, sub = plan.units, plan.groups
  dtypes = sorted({str(s.dtype) for s in specs})
  dtype_of = {s.leaf_index: dtypes.index(str(s.dtype)) for s in specs}
  key = [dtype_of[u.leaf_index] for u in base]
  cap = np.zeros(len(dtypes))  # (np.add.at: adds in order, as a loop)
  np.add.at(cap, key, [u.nbytes * (1 + _BYTE_SLACK) / n for u in base])
  budget = _assign.Budget(key, cap)
  if sub:
    items = [
      (sum(base[m].cost for m in grp.units) + grp.iteration_cost, j, -(j + 1))
      for j, grp in enumerate(sub)
    ]
    whole = [i for i, u in enumerate(base) if u.group < 0]
    items += [(base[i].cost, len(sub) + j, i) for j, i in enumerate(whole)]
    owners, sub = _assign.place(
      items, sub, base, rows, loads=work, budget=budget
    )
  else:  # a scanned stack's work added below, for every rotation
    owners = _assign.assign(
      base, n, loads=None if iters else work, budget=budget
    )
    if iters:
      owners = _spread_rotation(owners, base, n, iters)
  placed = dataclasses.replace(plan, owners=tuple(owners), groups=tuple(sub))
  if iters:
    _add_work(work, placed, iters)
  return placed, iters


# The most (slots x slots x window) steps _spread_rotation takes.
_SPREAD_LIMIT = 20_000_000


def _spread_rotation(
  owners: Sequence[int], units: Sequence, n: int, iters: int
) -> list[int]:
  """A scanned stack's base owners relabelled so that the rotation spreads
  its bytes evenly over the slots.

  Slot ``s`` holds base slot ``(s - t) mod n``'s matrices in iteration
  ``t``, so over the stack it holds the bytes of a window of ``iters``
  consecutive base slots (wrapping): where an iteration pads (fewer
  matrices than slots, or unequal ones), which base slots hold what
  decides the busiest slot's bytes (its momentum,
  ``OwnerLayout.momentum_segments``, and its Newton–Schulz work). The
  base slots' contents are placed, largest first, each where the busiest
  window it joins stays lowest (then the emptiest window, then the lowest
  slot); the relabelling is kept where it lowers the busiest window
  (gathered bytes and padding are a permutation's: unchanged).
  """
  w = iters % n
  held = np.zeros(n)
  for u, slot in zip(units, owners):
    held[slot] += u.nbytes
  filled = [s for s in range(n) if held[s]]
  if not w or not filled or len(filled) * n * w > _SPREAD_LIMIT:
    return list(owners)  # (every window alike, or too large to search)
  windows = (np.arange(n)[:, None] + np.arange(w)[None, :]) % n  # p -> slots

  def busiest(at):  # the busiest slot's bytes of one window: base -> bytes
    per = np.zeros(n)
    for base, b in at.items():
      per[windows[base]] += b
    return per.max()

  total, free, move = np.zeros(n), np.ones(n, bool), {}
  for base in sorted(filled, key=lambda s: (-held[s], s)):
    joined = total[windows]  # (p, w): the slots a base at p adds to
    key = np.lexsort(
      (np.arange(n), joined.sum(1), np.where(free, joined.max(1), np.inf))
    )
    p = int(key[0])
    move[base], free[p] = p, False
    total[windows[p]] += held[base]
  if busiest({move[b]: held[b] for b in filled}) >= busiest(
    {b: held[b] for b in filled}
  ):
    return list(owners)
  # Empty base slots take the free labels in order.
  rest = iter(np.flatnonzero(free).tolist())
  move.update({s: next(rest) for s in range(n) if s not in move})
  return [move[s] for s in owners]


def _add_work(work: np.ndarray, gp: OwnershipPlan, iters: int) -> np.ndarray:
  """``work`` (per slot, in place) with a placed gather group's
  Newton–Schulz work added: a scanned stack's for every rotation."""
  for u, slot in zip(gp.units, gp.owners):
    for t in range(max(iters, 1)):
      work[(slot + t) % len(work)] += u.cost
  for grp in gp.groups:
    for slot, cost in zip(grp.iteration_owners, grp.iteration_costs):
      work[slot] += cost
  return work


def _min_slice(spec: LeafSpec) -> int:
  """The fewest rows/columns of the long side a slice cut to even out a
  gather's bytes keeps: ``MIN_SLICE``, or the short side if smaller (a
  slice then holds at least as many elements as the Gram its group
  exchanges)."""
  return min(MIN_SLICE, min(spec.matrix_shape))


def byte_views(
  specs: Sequence[LeafSpec], per_slot: float
) -> Iterator[dict[int, int]]:
  """Ever finer slicings of one gather group's matrices, coarsest first.

  For a threshold ``q`` going down from ``per_slot`` (the group's bytes
  over its owners), every leaf not sliced yet whose matrices hold more than
  ``q`` bytes is cut into the fewest slices of at most ``q`` bytes that
  :func:`sliced_spec` allows with :func:`_min_slice` (or the finest it
  allows). Each distinct slicing is yielded once, until every leaf is at
  its finest.

  Args:
    specs: the gather group's leaves (sliced ones are left as they are).
    per_slot: the group's bytes divided by its number of owners.

  Yields:
    Dicts from a leaf's position in ``specs`` to its number of slices.
  """
  leaves = []  # (position, bytes of one of its matrices, slice counts)
  for i, s in enumerate(specs):
    if s.sliced or min(s.matrix_shape) < 2:
      continue
    # The slice counts (> 1, ascending) that sliced_spec accepts: those
    # dividing a long-side dimension that keep _min_slice.
    fi, fo = s.matrix_shape
    long_axes = s.output_axes if fo >= fi else s.reduction_axes
    ks = [
      k
      for k in range(2, max(fi, fo) // _min_slice(s) + 1)
      if any(s.shape[a] % k == 0 for a in long_axes)
    ]
    if ks:
      leaves.append((i, fi * fo * jnp.dtype(s.dtype).itemsize, ks))
  # The thresholds at which some leaf's slice count changes.
  steps = {per_slot} | {size / k for _, size, ks in leaves for k in [1] + ks}
  seen = set()
  for q in sorted((t for t in steps if t <= per_slot), reverse=True):
    chosen = tuple(
      (i, next((k for k in ks if size / k <= q), ks[-1]))
      for i, size, ks in leaves
      if size > q
    )
    if chosen not in seen:
      seen.add(chosen)
      yield dict(chosen)


# The most moves of each of balance's two passes.
_MAX_MOVES = 10_000


def balance(
  per_group: list[np.ndarray],
  movable: Sequence[bool],
  within_row: Sequence[bool],
  rows: Sequence[Sequence[int]],
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

  Returns:
    The moves in order, ``(group, {slot: new slot})``: what ``slot`` owned
    in the group goes to ``new slot`` (slots not named keep theirs).
  """
  groups = [g for g, m in enumerate(movable) if m]
  grid = np.asarray(rows)
  n = grid.size
  row_of = np.argsort(grid.ravel()) // grid.shape[1]
  total = sum(per_group, np.zeros(n))
  # First the rows: repeatedly the busiest row and the exchange, in a group
  # that moves within rows, that lowers the larger of the two rows' work
  # the most. A row's content in a group is fixed by its bytes (a row holds
  # a split matrix whole), so rows are evened out before their members.
  moves, rowed = [], [g for g in groups if within_row[g]]
  for _ in range(_MAX_MOVES):
    rt = total[grid].sum(axis=1)
    a = int(np.argmax(rt))
    best, best_max = None, rt[a] * (1 - 1e-9)
    for g in rowed:
      w = per_group[g]
      rw = w[grid].sum(axis=1)
      new = np.maximum(rt[a] - rw[a] + rw, rt - rw + rw[a])
      new[(np.arange(len(grid)) == a) | (rw == rw[a])] = np.inf
      b = int(np.argmin(new))
      if new[b] < best_max:
        best = (g, _exchange(grid[a], grid[b], total, w))
        best_max = new[b]
    if best is None:
      break
    _apply(per_group, total, moves, *best)
  # Then the slots.
  for _ in range(_MAX_MOVES):
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
      j, best_key = _better(
        best_key, (pool != a) & (w[pool] != w[a]) & (dsq < -eps), new, dsq
      )
      if j is not None:
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
      r, best_key = _better(
        best_key, (dsq < -eps) & (np.arange(len(grid)) != ra), new, dsq
      )
      if r is not None:
        best = (g, _exchange(grid[ra], grid[r], total, w))
    if best is None:
      break
    _apply(per_group, total, moves, *best)
  return moves


def _better(best_key, ok, new, dsq) -> tuple[int | None, tuple]:
  """The candidate of :func:`balance` (an index where ``ok``) with the
  lowest ``new``, then ``dsq``, and its key, if it beats ``best_key``;
  else ``(None, best_key)``."""
  if ok.any():
    i = np.flatnonzero(ok)
    j = int(i[np.lexsort((dsq[i], new[i]))[0]])
    if (new[j], dsq[j]) < best_key:
      return j, (new[j], dsq[j])
  return None, best_key


def _apply(per_group, total, moves, g, move) -> None:
  """Moves what slots own in group ``g`` (``move``: slot -> new slot),
  updating its work and the total (in place), and records the move."""
  w, src, dst = per_group[g], list(move), list(move.values())  # a permutation
  total[dst] += w[src] - w[dst]
  w[dst] = w[src]
  moves.append((g, move))


def _exchange(ra, rb, total, w) -> dict[int, int]:
  """Rows ``ra`` and ``rb`` trade what they own in one group: each row's
  members, least busy with the rest first, take the other row's pieces,
  largest first."""
  move = {}
  for mine, theirs in ((ra, rb), (rb, ra)):
    takers = mine[np.argsort(total[mine] - w[mine], kind='stable')]
    given = theirs[np.argsort(-w[theirs], kind='stable')]
    move.update(zip(given.tolist(), takers.tolist()))
  return move
