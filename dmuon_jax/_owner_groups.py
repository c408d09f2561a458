"""Owner groups: a large matrix split into slices over several owners."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from dmuon_jax._assign import place
from dmuon_jax._cost import FLOPS_PER_BYTE, gram_parts
from dmuon_jax._newton_schulz import is_int
from dmuon_jax._plan import (
  MatrixUnit,
  OwnerGroup,
  OwnershipPlan,
  group_exchange_bytes,
)
from dmuon_jax._routing import LeafSpec, layer_key

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
# Slices keep at least this many rows/columns of the long side.
_MIN_SLICE = 128


def check_option(
  owner_groups: Any,
  *,
  preconditioning: str = 'frobenius',
  ns_algorithm: str = 'auto',
  tp_axis: str | None = None,
  scanned: Sequence[str] = (),
) -> Any:
  """The one check of ``owner_groups`` against the options it meets.

  Every entry point (``dmuon``'s factory, its ``init`` once the mesh is
  known, ``plan_ownership``, ``dedicate``) calls this with what it knows.

  Args:
    owner_groups: ``'auto'``, None or an int ``k >= 2``.
    preconditioning: the Newton–Schulz preconditioning.
    ns_algorithm: ``'auto'``, ``'gram'`` or ``'standard'``.
    tp_axis: the tensor-parallel axis, when one of size > 1 is in use.
    scanned: paths of the scanned stacks (dedicated mode).

  Returns:
    What the planner takes: ``owner_groups``, or None where ``'auto'``
    cannot form groups (groups run Gram Newton–Schulz with the Frobenius
    preconditioning; TP matrices are split over their axis already).

  Raises:
    ValueError: for any other value, and for a forced ``k`` with an option
      that groups cannot run with (naming both and what to pass).
  """
  if owner_groups is None:
    return None
  if owner_groups != 'auto' and (not is_int(owner_groups) or owner_groups < 2):
    raise ValueError(
      f"dmuon: owner_groups={owner_groups!r} is not 'auto', None or an int "
      '>= 2 (the number of devices that share each matrix).'
    )
  forced = owner_groups != 'auto'
  given, wanted = [], []
  if preconditioning != 'frobenius':
    given.append(f'preconditioning={preconditioning!r}')
    wanted.append("preconditioning='frobenius'")
  if ns_algorithm == 'standard':
    given.append(f'ns_algorithm={ns_algorithm!r}')
    wanted.append("ns_algorithm='auto' or 'gram'")
  if given:
    if forced:
      raise ValueError(
        f'dmuon: owner_groups={owner_groups} runs Gram Newton-Schulz with '
        "preconditioning='frobenius' on the groups' matrices, but got "
        f'{" and ".join(given)}. Pass {" and ".join(wanted)}, or '
        'owner_groups=None.'
      )
    return None
  if tp_axis is not None:
    if forced:
      raise ValueError(
        f'dmuon: owner_groups={owner_groups} with the tensor-parallel axis '
        f'{tp_axis!r}: TP matrices are split over that axis already. Pass '
        'owner_groups=None (or the default).'
      )
    return None
  if forced and scanned:
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} with scanned stacks (param '
      f'{scanned[0]!r}'
      + (f' and {len(scanned) - 1} more' if len(scanned) > 1 else '')
      + '): their owners rotate per scan iteration, which groups do not '
      "follow. Pass owner_groups='auto' (scanned stacks stay whole) or None."
    )
  return owner_groups


def check_preconditioning(
  preconditioning: str,
  *,
  tp_axis: str | None = None,
  groups: int = 0,
  otherwise: str = '',
) -> None:
  """Raises unless ``preconditioning`` is ``'frobenius'`` where matrices
  are split over devices: over a tensor-parallel axis ``tp_axis``, or
  ``groups`` matrices over owner groups. Their Gram Newton–Schulz
  normalizes by the Frobenius norm. ``otherwise``: what else the caller
  may pass instead (e.g. ``'owner_groups=None'``)."""
  if preconditioning == 'frobenius' or (tp_axis is None and not groups):
    return
  split = []
  if tp_axis is not None:
    split.append(f'the tensor-parallel axis {tp_axis!r} splits matrices')
  if groups:
    split.append(
      f'{groups} matrices are split over owners (owner groups; '
      "owner_groups='auto' splits a dedication's matrices where whole ones "
      'would pad a gather by more than 5%)'
    )
  raise ValueError(
    f'dmuon: preconditioning={preconditioning!r} is not available here: '
    f'{" and ".join(split)}, and their Gram Newton-Schulz normalizes by '
    "the Frobenius norm. Pass preconditioning='frobenius'"
    + (f', or {otherwise}.' if otherwise else '.')
  )


def sliced_spec(
  spec: LeafSpec,
  slices: int,
  strides: Sequence[int] | None = None,
  min_slice: int = 1,
) -> LeafSpec | None:
  """A view of ``spec`` whose matrices are slices of the long side.

  A long-side dimension ``d`` of size ``T * slices * w`` (``T`` the number
  of shards of ``d``, from ``strides``) is viewed as ``(T, slices, w)``; the
  middle one is a batch axis, so slice ``j`` of a matrix takes the ``j``-th
  ``w`` rows/columns of every shard. A sharded leaf then holds a piece of
  every slice, as of every whole matrix: the view is a free reshape of the
  leaf and of each shard, and routes move exactly what they moved before.

  Args:
    spec: the leaf's spec.
    slices: the number of slices per matrix.
    strides: per leaf dimension, its number of shards (default all 1).
    min_slice: the fewest rows/columns of the long side a slice keeps.

  Returns:
    The view's spec, or None when no long-side dimension divides (or the
    slices would be narrower than ``min_slice``).
  """
  fi, fo = spec.matrix_shape
  columns = fo >= fi
  long_axes = spec.output_axes if columns else spec.reduction_axes
  strides = tuple(strides) if strides is not None else (1,) * len(spec.shape)
  d = next(
    (a for a in long_axes if spec.shape[a] % (strides[a] * slices) == 0),
    None,
  )
  if d is None or max(fi, fo) // slices < min_slice:
    return None
  stride = strides[d]
  w = spec.shape[d] // (stride * slices)
  shape = spec.shape[:d] + (stride, slices, w) + spec.shape[d + 1 :]

  def remap(axes):
    out = []
    for a in axes:
      out += [d, d + 2] if a == d else [a if a < d else a + 2]
    return tuple(out)

  return dataclasses.replace(
    spec,
    shape=shape,
    batch_axes=tuple(sorted(remap(spec.batch_axes) + (d + 1,))),
    reduction_axes=remap(spec.reduction_axes),
    output_axes=remap(spec.output_axes),
    original_shape=spec.shape,
    slice_axis=d + 1,
    split_axis=-1 if columns else -2,
    whole_matrix=(fi, fo),
  )


def view_entries(spec: LeafSpec, entries: Sequence[Any]) -> tuple | None:
  """A leaf's per-dimension sharding entries for the view of a sliced
  spec (the entries themselves for an unsliced one); None when the leaf's
  sharding of the split dimension is not the view's (another shard count
  than the state was laid out for)."""
  entries = tuple(tuple(e) for e in entries)
  if not spec.sliced:
    return entries
  d = spec.slice_axis - 1
  return entries[:d] + (entries[d], (), ()) + entries[d + 1 :]


def whole_batch_index(spec: LeafSpec, batch_index: Sequence[int]) -> tuple:
  """A unit's matrix index over the leaf's own batch axes (the slice index
  dropped for a sliced spec)."""
  batch_index = tuple(batch_index)
  if not spec.sliced:
    return batch_index
  pos = spec.batch_axes.index(spec.slice_axis)
  return batch_index[:pos] + batch_index[pos + 1 :]


def slice_index(spec: LeafSpec, batch_index: Sequence[int]) -> int:
  """A slice unit's index among its matrix's slices."""
  return int(batch_index[spec.batch_axes.index(spec.slice_axis)])


def plan_with_groups(
  leaves: Sequence[LeafSpec],
  units: Sequence[MatrixUnit],
  sizes: Sequence[int],
  owner_groups: Any,
  ns_steps: int,
  strides: Mapping[int, Sequence[int]],
  ungroupable: frozenset[int],
  plain_owners: Sequence[int],
) -> tuple[tuple, tuple, tuple, tuple] | None:
  """Leaves, units, owners and groups of a plan with owner groups, or None
  when ``'auto'`` finds no gain (or nothing to group)."""
  n = math.prod(sizes)
  row_size = sizes[-1] if sizes else 1
  forced = owner_groups != 'auto'
  if forced and not 2 <= owner_groups <= row_size:
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} needs 2 <= k <= the size of the '
      f'innermost owner axis ({row_size}), along which a group of owners '
      "shares a matrix. Pass a smaller k, or owner_groups='auto'."
    )
  if n == 1 or row_size == 1:
    return None
  costs = np.zeros(n)
  for u, o in zip(units, plain_owners):
    costs[o] += u.cost
  total = float(costs.sum())
  ideal = total / n
  plain = float(costs.max(initial=0.0))
  if not forced and plain <= _GROUP_TRIGGER * ideal:
    return None
  chosen = _candidates(leaves, units, ungroupable, forced, ideal)
  if not chosen:
    return None
  parts = {
    s.leaf_index: gram_parts(*sorted(s.matrix_shape), ns_steps) for s in chosen
  }
  bound = max([ideal] + [sum(p[1]) for p in parts.values()])
  views = {}
  for spec in chosen:
    view = _view(
      spec,
      owner_groups if forced else None,
      strides.get(spec.leaf_index),
      parts[spec.leaf_index][0],
      bound,
    )
    if view is not None:
      views[spec.leaf_index] = view
  if not views:
    return None
  new_leaves = tuple(views.get(s.leaf_index, s) for s in leaves)
  new_units, groups_meta, items, group_units = _sliced_units(
    new_leaves, units, parts
  )
  rows = [list(range(r, r + row_size)) for r in range(0, n, row_size)]
  owners, iteration_owners = place(
    items, [m[3] for m in groups_meta], group_units, new_units, rows, forced
  )
  groups = _owner_groups_of(
    groups_meta, group_units, iteration_owners, lambda leaf, index: forced
  )
  if not forced:
    loads = np.zeros(n)
    for u, o in zip(new_units, owners):
      loads[o] += u.cost
    for group in groups:
      for slot, cost in zip(group.iteration_owners, group.iteration_costs):
        loads[slot] += cost
    exchange = group_exchange_bytes(groups, owners)
    if loads.max() + FLOPS_PER_BYTE * exchange > (1 - _GROUP_GAIN) * plain:
      return None
  return new_leaves, tuple(new_units), tuple(owners), groups


def _candidates(
  leaves: Sequence[LeafSpec],
  units: Sequence[MatrixUnit],
  ungroupable: frozenset[int],
  forced: bool,
  ideal: float,
) -> list[LeafSpec]:
  """The leaves whose matrices may be split: every groupable one when
  ``forced``, else those costly enough (see ``_MIN_GROUP_FLOPS``,
  ``_COARSE``)."""
  first_cost = {}
  for u in units:
    first_cost.setdefault(u.leaf_index, u.cost)
  chosen = []
  for spec in leaves:
    s_, l_ = sorted(spec.matrix_shape)
    if spec.leaf_index in ungroupable or s_ < 2:
      continue
    if not forced and (
      first_cost[spec.leaf_index] < _MIN_GROUP_FLOPS
      or first_cost[spec.leaf_index] <= _COARSE * ideal
    ):
      continue
    chosen.append(spec)
  return chosen


def _view(
  spec: LeafSpec,
  k: int | None,
  stride: Sequence[int] | None,
  work: float,
  bound: float,
) -> LeafSpec | None:
  """The sliced view of a chosen leaf: into ``k`` slices (forced; raises
  when they do not divide), else (``k`` None) into the fewest slices of
  at most ``_SLICE_FRACTION * bound`` work each that divide and keep
  ``_MIN_SLICE`` rows/columns, or the most coarser ones that do (None if
  none does)."""
  if k is not None:
    view = sliced_spec(spec, k, stride)
    if view is None:
      raise ValueError(
        f'dmuon: owner_groups={k}: the long side of param '
        f'{spec.path!r} (matrices {spec.matrix_shape[0]}x'
        f'{spec.matrix_shape[1]}) does not split into {k} '
        'slices on a dimension divisible by that times its shard count. '
        "Pass a k that divides it, or owner_groups='auto'."
      )
    return view
  least = max(2, math.ceil(work / (_SLICE_FRACTION * bound)))
  view = None
  # The fewest slices that are fine enough; else, if slices of
  # _MIN_SLICE would be too narrow, the most that are not.
  for slices in list(range(least, 4 * least + 1)) + list(
    range(least - 1, 1, -1)
  ):
    view = sliced_spec(spec, slices, stride, _MIN_SLICE)
    if view is not None:
      break
  return view


def _sliced_units(
  new_leaves: Sequence[LeafSpec],
  units: Sequence[MatrixUnit],
  parts: Mapping[int, tuple[float, float]],
) -> tuple[list[MatrixUnit], list, list, list[list[int]]]:
  """The units of the leaves' views: the whole ones as they were, a
  sliced leaf's matrices as slice units of one group each.

  Returns:
    ``(units, groups_meta, items, group_units)``: per group ``(leaf_index,
    whole batch index, shape, iteration cost per window)``; the pieces to
    place,
    ``(cost, order, whole unit index | -(group + 1))``; per group its units.
  """
  new_units: list[MatrixUnit] = []
  groups_meta = []  # (leaf_index, whole batch index, shape, window costs)
  items = []  # (cost, order, whole unit index | -(group + 1))
  group_units: list[list[int]] = []
  by_leaf: dict[int, list[MatrixUnit]] = collections.defaultdict(list)
  for u in units:
    by_leaf[u.leaf_index].append(u)
  for spec in new_leaves:
    if not spec.sliced:
      for u in by_leaf[spec.leaf_index]:
        items.append((u.cost, len(items), len(new_units)))
        new_units.append(u)
      continue
    fi, fo = spec.whole_matrix
    work, iteration = parts[spec.leaf_index]
    k = spec.shape[spec.slice_axis]
    slice_shape = spec.matrix_shape
    nbytes = slice_shape[0] * slice_shape[1] * jnp.dtype(spec.dtype).itemsize
    index_of = {}
    for batch_index in np.ndindex(*spec.batch_shape):
      batch_index = tuple(int(i) for i in batch_index)
      whole = whole_batch_index(spec, batch_index)
      if whole not in index_of:
        index_of[whole] = len(groups_meta)
        groups_meta.append((spec.leaf_index, whole, (fi, fo), iteration))
        group_units.append([])
        items.append((work + sum(iteration), len(items), -len(groups_meta)))
      g = index_of[whole]
      group_units[g].append(len(new_units))
      new_units.append(
        MatrixUnit(
          leaf_index=spec.leaf_index,
          path=spec.path,
          batch_index=batch_index,
          shape=slice_shape,
          layer=layer_key(spec.path, whole),
          cost=work / k,
          nbytes=int(nbytes),
          group=g,
        )
      )
  return new_units, groups_meta, items, group_units


def _owner_groups_of(
  groups_meta, group_units, iteration_owners, distinct
) -> tuple[OwnerGroup, ...]:
  """The ``OwnerGroup`` s of :func:`_sliced_units`' groups: group ``g``'s
  window iterations on slots ``iteration_owners[g]``, its ``distinct``
  flag ``distinct(leaf_index, batch_index)``."""
  return tuple(
    OwnerGroup(
      leaf_index=leaf,
      batch_index=index,
      shape=shape,
      units=tuple(group_units[g]),
      iteration_owners=tuple(iteration_owners[g]),
      iteration_costs=tuple(iteration),
      distinct=distinct(leaf, index),
    )
    for g, (leaf, index, shape, iteration) in enumerate(groups_meta)
  )


def resliced(
  plan: OwnershipPlan,
  views: Mapping[int, LeafSpec],
  ns_steps: int,
  only: Collection[int] | None = None,
) -> OwnershipPlan:
  """``plan`` with more of its leaves viewed as slices (owner groups).

  Its leaves (only those in ``only``, if given) with ``views`` (leaf index
  -> :func:`sliced_spec` view) applied; their units built as
  :func:`plan_with_groups` builds them (whole matrices kept, a sliced
  leaf's matrices as slice units of one group each, costs from the Gram
  form). Owners are left to the caller (all 0, iterations on slot 0);
  existing groups keep their ``distinct``.
  """
  keep = [s for s in plan.leaves if only is None or s.leaf_index in only]
  leaves = tuple(views.get(s.leaf_index, s) for s in keep)
  held = {s.leaf_index for s in keep}
  whole = [u for u in plan.units if u.group < 0 and u.leaf_index in held]
  parts = {
    s.leaf_index: gram_parts(*sorted(s.whole_matrix), ns_steps)
    for s in leaves
    if s.sliced
  }
  units, groups_meta, _, group_units = _sliced_units(leaves, whole, parts)
  distinct = {(g.leaf_index, g.batch_index): g.distinct for g in plan.groups}
  groups = _owner_groups_of(
    groups_meta,
    group_units,
    [(0,) * len(meta[3]) for meta in groups_meta],
    lambda leaf, index: distinct.get((leaf, index), False),
  )
  return dataclasses.replace(
    plan,
    leaves=leaves,
    units=tuple(units),
    owners=(0,) * len(units),
    groups=groups,
  )


def min_byte_slice(spec: LeafSpec) -> int:
  """The fewest rows/columns of the long side a slice cut to even out a
  gather's bytes keeps: ``_MIN_SLICE``, or the short side if smaller (a
  slice then holds at least as many elements as the Gram its group
  exchanges)."""
  return min(_MIN_SLICE, min(spec.matrix_shape))


def _slice_counts(spec: LeafSpec) -> list[int]:
  """The slice counts (> 1, ascending) that :func:`sliced_spec` accepts
  for ``spec`` with :func:`min_byte_slice`."""
  fi, fo = spec.matrix_shape
  long_axes = spec.output_axes if fo >= fi else spec.reduction_axes
  divisors = {
    k
    for a in long_axes
    for k in range(2, spec.shape[a] + 1)
    if spec.shape[a] % k == 0
  }
  least = min_byte_slice(spec)
  return [
    k for k in sorted(divisors) if sliced_spec(spec, k, None, least) is not None
  ]


def byte_views(
  specs: Sequence[LeafSpec], per_slot: float
) -> Iterator[dict[int, LeafSpec]]:
  """Ever finer slicings of one gather group's matrices, coarsest first.

  For a threshold ``q`` going down from ``per_slot`` (the group's bytes
  over its owners), every leaf not sliced yet whose matrices hold more than
  ``q`` bytes is viewed as the fewest slices of at most ``q`` bytes that
  :func:`sliced_spec` allows with :func:`min_byte_slice` (or the finest it
  allows). Each distinct set of views (leaf index -> view) is yielded once,
  until every leaf is at its finest.

  Args:
    specs: the gather group's leaves (sliced ones are left as they are).
    per_slot: the group's bytes divided by its number of owners.

  Yields:
    Dicts from leaf index to its sliced view.
  """
  counts, sizes = {}, {}
  for s in specs:
    if s.sliced or min(s.matrix_shape) < 2:
      continue
    ks = _slice_counts(s)
    if ks:
      counts[s.leaf_index] = ks
      fi, fo = s.matrix_shape
      sizes[s.leaf_index] = fi * fo * jnp.dtype(s.dtype).itemsize
  by_index = {s.leaf_index: s for s in specs}
  # The thresholds at which some leaf's slice count changes.
  steps = {per_slot} | {
    sizes[i] / k for i, ks in counts.items() for k in [1] + ks
  }
  seen = set()
  for q in sorted((t for t in steps if t <= per_slot), reverse=True):
    views = {}
    for i, ks in counts.items():
      if sizes[i] <= q:
        continue
      k = next((k for k in ks if sizes[i] / k <= q), ks[-1])
      views[i] = sliced_spec(by_index[i], k, None, min_byte_slice(by_index[i]))
    key = tuple(sorted((i, v.shape) for i, v in views.items()))
    if key not in seen:
      seen.add(key)
      yield views
