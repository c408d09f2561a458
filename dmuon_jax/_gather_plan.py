"""Dedicated mode's gather groups: owners per group of hook boundaries.

Within a gather group, matrices (and, where whole ones would pad the
gather, their slices: owner groups) go to owners so that the group's bytes
are even over the owners; owners are then swapped between slots to even out
the Newton–Schulz work over the model. :func:`gather_group_bytes` predicts
each group's bytes without placing the whole model (``layers_per_gather=
'auto'`` weighs them). The plan of all Muon targets comes from
:func:`dmuon_jax._planner.plan_ownership`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from dmuon_jax import _owner_groups
from dmuon_jax._cost import FLOPS_PER_BYTE
from dmuon_jax._plan import (
  MatrixUnit,
  OwnerGroup,
  OwnershipPlan,
  exchange_bytes_per_element,
  group_exchange_bytes,
)
from dmuon_jax._routing import LeafSpec


def _balance_work(
  planned: Sequence[_GatherGroup],
  n: int,
  row_of: Mapping[int, int],
  max_rounds: int = 10_000,
) -> None:
  """Evens out Newton–Schulz work by swapping owners inside loop groups.

  Swapping everything two slots own in one gather group keeps that group's
  bytes per slot (hence its padding) as they are, so only the work moves:
  repeatedly take the busiest slot and the swap, in any loop group, that
  lowers the larger of the two slots' work the most. Scanned stacks keep
  their rotation. Updates the base owners in ``planned`` in place.
  """
  per_group = []
  for entry in planned:
    w = np.zeros(n)
    for u, slot in zip(entry.base, entry.base_owner):
      for t in range(max(entry.iters, 1)):
        w[(slot + t) % n] += u.cost
    for g, grp in entry.ggroups:
      w[entry.iteration_owner[g]] += grp.iteration_cost
    per_group.append(w)
  total = sum(per_group, np.zeros(n))
  movable = [g for g, entry in enumerate(planned) if not entry.iters]
  for _ in range(max_rounds):
    a = int(np.argmax(total))
    best, best_max = None, total[a] * (1 - 1e-9)
    for g in movable:
      w = per_group[g]
      # A group with owner groups swaps within a row only (its slices and
      # iterations must share the row's collectives).
      rows = planned[g].rows
      candidates = rows[row_of[a]] if planned[g].ggroups else range(n)
      for b in candidates:
        if b != a and w[a] != w[b]:
          new_max = max(total[a] - w[a] + w[b], total[b] - w[b] + w[a])
          if new_max < best_max:
            best, best_max = (g, b), new_max
    if best is None:
      return
    g, b = best
    w = per_group[g]
    delta = w[a] - w[b]
    total[a] -= delta
    total[b] += delta
    w[a], w[b] = w[b], w[a]
    owners = planned[g].base_owner
    owners[:] = [b if s == a else a if s == b else s for s in owners]
    it_owner = planned[g].iteration_owner
    for j, s in it_owner.items():
      it_owner[j] = b if s == a else a if s == b else s


def _plan_slot(
  plan: OwnershipPlan, buffer_axes: Sequence[str], slot: int
) -> int:
  """The plan's (mesh-order) slot of a slot in ``buffer_axes`` order."""
  if not plan.axis_names:
    return 0
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  coords = dict(
    zip(buffer_axes, np.unravel_index(slot, [sizes[a] for a in buffer_axes]))
  )
  return int(
    np.ravel_multi_index(
      [int(coords[a]) for a in plan.axis_names], plan.mesh_shape
    )
  )


def plan_gather_groups(
  plan: OwnershipPlan,
  groups: Sequence[tuple[str, bool, Sequence[LeafSpec]]],
  layers_per_gather: int,
  buffer_axes: Sequence[str],
  group_axis: str | None = None,
  *,
  split: bool = False,
  ns_steps: int = 5,
  memo: dict | None = None,
) -> tuple[OwnershipPlan, tuple[OwnershipPlan, ...], tuple[int, ...]]:
  """Owners for dedicated mode: matrices gathered per group of boundaries.

  Within a group, matrices (and slices) go to owners largest first, each to
  the owner holding the fewest bytes of that group (ties: the least
  Newton–Schulz work so far, then the slot index), so that a gather pads
  little; then owners are swapped between slots inside loop groups (bytes
  unchanged) to even out the work over the whole model. With ``split``, a
  loop group whose whole matrices would pad more than
  ``SPLIT_PADDING_PERCENT`` has matrices split into slices over owners of
  one row (owner groups, see :func:`_split_views`). A scanned stack is
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
    ns_steps: Newton–Schulz iterations, for the cost of split matrices.
    memo: (optional) a dict kept across calls for one set of params: the
      split chosen per group of equal shapes.

  Returns:
    ``(plan, group_plans, iterations)``: ``plan`` with every unit's owner
    (mesh-order slots; with ``split``, its leaves and units may be sliced
    views), per group a plan over ``buffer_axes`` of its base units (one
    iteration for a scanned stack), and per group the number of scan
    iterations (0 for loop groups).

  Raises:
    ValueError: for a scanned group whose leaves do not share the leading
      layer axis, or whose length ``layers_per_gather`` does not divide.
  """
  k = layers_per_gather
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  buffer_axes = tuple(buffer_axes)
  n = plan.num_slots
  rows = _group_rows(plan, buffer_axes, sizes, group_axis)
  row_of = {slot: r for r, slots in enumerate(rows) for slot in slots}
  if split:
    memo = {} if memo is None else memo
    views = {}
    for _, scanned, specs in groups:
      if not scanned:
        views.update(_split_views(plan, specs, rows, ns_steps, memo)[0])
    if views:
      plan = _owner_groups.resliced(plan, views, ns_steps)
      spec_of = {s.leaf_index: s for s in plan.leaves}
      groups = [
        (name, scanned, [spec_of[s.leaf_index] for s in specs])
        for name, scanned, specs in groups
      ]
  unit_ids = {
    (u.leaf_index, u.batch_index): i for i, u in enumerate(plan.units)
  }
  work = np.zeros(n)
  planned = [
    _place_gather_group(plan, name, scanned, specs, k, rows, work)
    for name, scanned, specs in groups
  ]
  _balance_work(planned, n, row_of)
  owners = [0] * len(plan.units)
  group_plans, iterations = [], []
  full_iteration = {}
  for entry in planned:
    local = {u: i for i, u in enumerate(entry.base_ids)}
    sub_groups = []
    for g, grp in entry.ggroups:
      full_iteration[g] = _plan_slot(
        plan, buffer_axes, entry.iteration_owner[g]
      )
      sub_groups.append(
        dataclasses.replace(
          grp,
          units=tuple(local[u] for u in grp.units),
          iteration_owner=entry.iteration_owner[g],
        )
      )
    remap = {g: j for j, (g, _) in enumerate(entry.ggroups)}
    base = [
      dataclasses.replace(u, group=remap[u.group]) if u.group >= 0 else u
      for u in entry.base
    ]
    iters = entry.iters
    for u, slot in zip(base, entry.base_owner):
      for t in range(max(iters, 1)):
        index = u.batch_index
        if iters:
          index = (t * k + index[0],) + index[1:]
        owners[unit_ids[(u.leaf_index, index)]] = _plan_slot(
          plan, buffer_axes, (slot + t) % n
        )
    group_plans.append(
      dataclasses.replace(
        plan,
        axis_names=buffer_axes,
        mesh_shape=tuple(sizes[a] for a in buffer_axes),
        leaves=tuple(entry.specs),
        units=tuple(base),
        owners=tuple(entry.base_owner),
        groups=tuple(sub_groups),
        group_axis_name=group_axis,
      )
    )
    iterations.append(iters)
  groups = tuple(
    dataclasses.replace(grp, iteration_owner=full_iteration.get(g, 0))
    for g, grp in enumerate(plan.groups)
  )
  return (
    dataclasses.replace(
      plan, owners=tuple(owners), groups=groups, group_axis_name=group_axis
    ),
    tuple(group_plans),
    tuple(iterations),
  )


class GatherBytes(NamedTuple):
  """One gather group's bytes as :func:`plan_gather_groups` places them
  (a scanned stack's: every iteration's)."""

  payload: int  # its matrices' bytes
  gathered: int  # what its gathers move per pass (N x the largest share)
  exchange: float  # its owner groups' Gram exchange per device per step
  iterations: int = 0  # scan iterations (0: a loop group)


def gather_group_bytes(
  plan: OwnershipPlan,
  groups: Sequence[tuple[str, bool, Sequence[LeafSpec]]],
  layers_per_gather: int,
  buffer_axes: Sequence[str],
  group_axis: str | None = None,
  *,
  split: bool = False,
  ns_steps: int = 5,
  memo: dict | None = None,
) -> list[GatherBytes]:
  """Per gather group, its bytes as :func:`plan_gather_groups` (same
  arguments) would place them, without placing the whole model (groups of
  equal shapes are placed once, through ``memo``)."""
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  rows = _group_rows(plan, tuple(buffer_axes), sizes, group_axis)
  memo = {} if memo is None else memo
  out = []
  for name, scanned, specs in groups:
    if scanned:
      key = ('scanned', _signature(specs), layers_per_gather)
      if key not in memo:
        sub = _owner_groups.resliced(
          plan, {}, ns_steps, {s.leaf_index for s in specs}
        )
        memo[key] = _trial(sub, name, True, layers_per_gather, rows)
      out.append(memo[key])
    elif split:
      out.append(_split_views(plan, specs, rows, ns_steps, memo)[1])
    else:
      key = ('whole', _signature(specs))
      if key not in memo:
        sub = _owner_groups.resliced(
          plan, {}, ns_steps, {s.leaf_index for s in specs}
        )
        memo[key] = _trial(sub, name, False, 1, rows)
      out.append(memo[key])
  return out


# Placing a loop gather group, a slot's bytes may exceed the group's mean
# per slot by this fraction before its Newton-Schulz work stops mattering.
_BYTE_SLACK = 0.02

# A loop gather group whose whole matrices would pad more than this (in
# percent of its bytes) has matrices split into slices (owner groups).
SPLIT_PADDING_PERCENT = 5.0


def _signature(specs: Sequence[LeafSpec]) -> tuple:
  """What placing a group reads of its leaves (not their paths)."""
  return tuple(
    (
      s.shape,
      s.dtype,
      s.batch_axes,
      s.reduction_axes,
      s.output_axes,
      s.original_shape,
      s.slice_axis,
    )
    for s in specs
  )


def _trial(
  sub: OwnershipPlan,
  name: str,
  scanned: bool,
  k: int,
  rows: list[list[int]],
) -> GatherBytes:
  """The bytes of ``sub`` (one gather group's plan) placed alone."""
  entry = _place_gather_group(
    sub, name, scanned, sub.leaves, k, rows, np.zeros(sub.num_slots)
  )
  times = max(entry.iters, 1)
  owners = [0] * len(sub.units)
  for i, slot in zip(entry.base_ids, entry.base_owner):
    owners[i] = slot
  return GatherBytes(
    payload=times * sum(u.nbytes for u in entry.base),
    gathered=times * _gathered(entry, sub.num_slots),
    exchange=group_exchange_bytes(
      [
        dataclasses.replace(grp, iteration_owner=entry.iteration_owner[g])
        for g, grp in entry.ggroups
      ],
      owners,
    ),
    iterations=entry.iters,
  )


def _gathered(entry: _GatherGroup, n: int) -> int:
  """What one gather of a placed group moves: per dtype, ``n`` times the
  largest owner's bytes (the owner buffers are one per dtype)."""
  dtype_of = {s.leaf_index: s.dtype for s in entry.specs}
  held: dict[str, np.ndarray] = {}
  for u, slot in zip(entry.base, entry.base_owner):
    held.setdefault(dtype_of[u.leaf_index], np.zeros(n, np.int64))[slot] += (
      u.nbytes
    )
  return int(sum(n * h.max() for h in held.values()))


def _split_views(
  plan: OwnershipPlan,
  specs: Sequence[LeafSpec],
  rows: list[list[int]],
  ns_steps: int,
  memo: dict,
) -> tuple[dict[int, LeafSpec], GatherBytes]:
  """The slicing of one loop gather group's matrices, and its bytes.

  Whole matrices if they pad at most ``SPLIT_PADDING_PERCENT``; else the
  coarsest slicing of :func:`_owner_groups.byte_views` that does, placed
  as :func:`plan_gather_groups` places it (else the one padding least).
  Groups of equal shapes share one decision through ``memo``.
  """
  key = ('split', _signature(specs), tuple(map(tuple, rows)))
  if key not in memo:
    sub = _owner_groups.resliced(
      plan, {}, ns_steps, {s.leaf_index for s in specs}
    )
    best = _trial(sub, '', False, 1, rows)
    counts = {}
    if _padding(best) > SPLIT_PADDING_PERCENT:
      per_slot = best.payload / plan.num_slots
      for views in _owner_groups.byte_views(sub.leaves, per_slot):
        got = _trial(
          _owner_groups.resliced(sub, views, ns_steps), '', False, 1, rows
        )
        if _padding(got) < _padding(best) - 1e-9:
          best = got
          pos = {s.leaf_index: i for i, s in enumerate(sub.leaves)}
          counts = {pos[i]: v.shape[v.slice_axis] for i, v in views.items()}
        if _padding(got) <= SPLIT_PADDING_PERCENT:
          break
    memo[key] = (counts, best)
  counts, best = memo[key]
  views = {}
  for i, slices in counts.items():
    spec = specs[i]
    views[spec.leaf_index] = _owner_groups.sliced_spec(
      spec, slices, None, _owner_groups.min_byte_slice(spec)
    )
  return views, best


def _padding(b: GatherBytes) -> float:
  return 100 * (b.gathered / b.payload - 1) if b.payload else 0.0


class _GatherGroup(NamedTuple):
  """One gather group as :func:`plan_gather_groups` places it (slots in
  ``buffer_axes`` order)."""

  specs: list[LeafSpec]  # its leaves (a scanned stack's: one iteration)
  iters: int  # scan iterations (0: a loop group)
  base: list[MatrixUnit]  # its units (a scanned stack's: one iteration)
  base_owner: list[int]  # per base unit, its slot (balancing swaps them)
  base_ids: list[int]  # per base unit, its index in the plan
  ggroups: list[tuple[int, OwnerGroup]]  # its owner groups (plan index)
  iteration_owner: dict[int, int]  # per owner group, its iteration's slot
  rows: list[list[int]]  # the slots of each group row


def _group_rows(
  plan: OwnershipPlan,
  buffer_axes: tuple[str, ...],
  sizes: Mapping[str, int],
  group_axis: str | None,
) -> list[list[int]]:
  """The slots (in ``buffer_axes`` order) of each row of owner groups."""
  probe = dataclasses.replace(
    plan,
    axis_names=buffer_axes,
    mesh_shape=tuple(sizes[a] for a in buffer_axes),
    group_axis_name=group_axis,
    groups=(),
  )
  by_row: dict[int, list[int]] = {}
  for slot in range(plan.num_slots):
    by_row.setdefault(probe.group_row(slot), []).append(slot)
  return [by_row[r] for r in sorted(by_row)]


def _scanned_specs(
  name: str, specs: list[LeafSpec], k: int
) -> tuple[list[LeafSpec], int]:
  """A scanned stack's specs for one iteration of ``k`` layers, and its
  number of iterations; raises unless its leaves share a leading layer
  axis that ``k`` divides."""
  length = specs[0].shape[0]
  bad = [s.path for s in specs if 0 not in s.batch_axes or s.shape[0] != length]
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
  specs = [dataclasses.replace(s, shape=(k,) + s.shape[1:]) for s in specs]
  return specs, length // k


def _place_gather_group(
  plan: OwnershipPlan,
  name: str,
  scanned: bool,
  specs: Sequence[LeafSpec],
  k: int,
  rows: list[list[int]],
  work: np.ndarray,
) -> _GatherGroup:
  """Places one gather group's matrices (see :func:`plan_gather_groups`),
  adding their Newton–Schulz work to ``work`` (per slot, in place).

  Every unit (a whole matrix or a slice), largest first (then those of
  the largest matrices), goes to the slot
  holding the fewest bytes of its dtype in this group (ties: the least
  work, then the lowest slot); a slice to a slot of its owner group's row,
  chosen when the group's first slice is placed (the row holding the
  fewest bytes, then the least work). Then each group's ``g x g``
  iteration goes to the least-worked slot of its row (of its slice owners
  when ``distinct``).
  """
  n = plan.num_slots
  specs = list(specs)
  iters = 0
  if scanned:
    specs, iters = _scanned_specs(name, specs, k)
  in_group = {s.leaf_index for s in specs}
  base_ids = [
    i
    for i, u in enumerate(plan.units)
    if u.leaf_index in in_group and (not iters or u.batch_index[0] < k)
  ]
  base = [plan.units[i] for i in base_ids]
  local = {u: i for i, u in enumerate(base_ids)}
  # Owner groups of this gather group: slices in one row, the iteration
  # on a member of that row (see OwnerGroup).
  ggroups = [
    (g, grp)
    for g, grp in enumerate(plan.groups)
    if grp.units and grp.units[0] in local
  ]
  if ggroups and iters:
    raise ValueError(
      f'dmuon: scanned stack {name!r} holds owner-group matrices; pass '
      'owner_groups=None (scanned stacks rotate whole matrices).'
    )
  group_of = dict(ggroups)
  dtype_of = {s.leaf_index: s.dtype for s in specs}
  held: dict[str, np.ndarray] = {}
  # A loop group's slots may hold up to this many bytes per dtype before
  # work stops choosing among them (see _BYTE_SLACK).
  cap: dict[str, float] = collections.defaultdict(float)
  for u in base:
    cap[dtype_of[u.leaf_index]] += u.nbytes * (1 + _BYTE_SLACK) / n
  slots = np.arange(n)
  row_slots = [np.asarray(r) for r in rows]
  group_row: dict[int, int] = {}
  taken: dict[int, list[int]] = collections.defaultdict(list)
  iteration_owner: dict[int, int] = {}
  # Grams iterated per slot: the group exchange moves the largest of them
  # (group_exchange_bytes); a slot raising it pays FLOPS_PER_BYTE per byte.
  grams = np.zeros(n)
  rate = FLOPS_PER_BYTE * exchange_bytes_per_element(len(rows[0]))

  def place_iteration(g, pool):
    grp = group_of[g]
    top, gram = grams.max(), grp.gram_size**2
    slot = min(
      pool,
      key=lambda s: (work[s] + rate * max(0.0, grams[s] + gram - top), s),
    )
    work[slot] += grp.iteration_cost
    grams[slot] += gram
    iteration_owner[g] = int(slot)

  base_owner = [0] * len(base)
  # Pieces of equal size: those of larger matrices first (a group's row is
  # chosen at its first slice: rows then take groups largest first).
  whole = {
    g: sum(plan.units[u].nbytes for u in grp.units) for g, grp in ggroups
  }
  size = [whole[u.group] if u.group >= 0 else u.nbytes for u in base]
  for i in sorted(
    range(len(base)),
    key=lambda i: (-base[i].nbytes, -size[i], -base[i].cost, i),
  ):
    unit = base[i]
    dtype = dtype_of[unit.leaf_index]
    h = held.setdefault(dtype, np.zeros(n))
    pool = slots
    if unit.group >= 0:
      g = unit.group
      if g not in group_row:
        # The least-worked row that stays within the byte cap (a row's
        # share), if any, else the least-filled one.
        filled = [h[r].sum() for r in rows]
        fits = [
          r
          for r in range(len(rows))
          if filled[r] + whole[g] <= cap[dtype] * len(rows[r])
        ]
        group_row[g] = min(
          fits or range(len(rows)),
          key=lambda r: (
            (work[rows[r]].sum(), filled[r], r)
            if fits and not iters
            else (filled[r], work[rows[r]].sum(), r)
          ),
        )
        if not group_of[g].distinct:
          # Its iteration first (no bytes): the slices then go round it.
          place_iteration(g, rows[group_row[g]])
      pool = row_slots[group_row[g]]
      if group_of[g].distinct:
        free = pool[~np.isin(pool, taken[g])]
        pool = free if len(free) else pool
    slot = _least(h, work, pool)
    if not iters:
      # Bytes and work together: the least-worked slot that stays within
      # the byte cap, if any (else the least-filled, as LPT).
      fits = pool[h[pool] + unit.nbytes <= cap[dtype]]
      if len(fits):
        slot = _least(work, h, fits)
    if unit.group >= 0:
      taken[unit.group].append(slot)
    h[slot] += unit.nbytes
    base_owner[i] = slot
    for t in range(max(iters, 1)):
      work[(slot + t) % n] += unit.cost
  for g, grp in sorted(ggroups, key=lambda x: (-x[1].iteration_cost, x[0])):
    if grp.distinct:  # on one of its slice owners
      place_iteration(g, taken[g])
  return _GatherGroup(
    specs, iters, base, base_owner, base_ids, ggroups, iteration_owner, rows
  )


def _least(held: np.ndarray, work: np.ndarray, pool: np.ndarray) -> int:
  """The slot of ``pool`` (ascending) holding the fewest bytes (ties: the
  least work, then the lowest slot)."""
  h = held[pool]
  pool = pool[h == h.min()]
  if len(pool) > 1:
    w = work[pool]
    pool = pool[w == w.min()]
  return int(pool[0])
