"""The owner plan's data: matrices, owner groups, the plan itself, its
slicing and its byte prediction, with the owner groups' Gram exchange.

The exchange (see :class:`OwnerGroup`) runs point to point (``ppermute``
over the owner axes), so a group's traffic stays between its members (a
collective over the whole group axis pays every member's block on every
device). A round is one ``ppermute``: every slot sends at most one Gram
and receives at most one. The messages of all groups are packed into
rounds by a bipartite edge colouring: as many rounds as the busiest slot
has messages to send or to receive (König), which a placement that keeps
a group's slices on few members keeps small. Grams and factors travel as
packed triangles (:func:`triangle_size`). Pure NumPy: the planner
predicts the bytes from the same schedule the update runs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from dmuon_jax._checks import (
  gram_parts,
  human_bytes,
  human_flops,
  ring_bytes,
)
from dmuon_jax._routing import LeafSpec, layer_key, plural

# Slices of a split matrix keep at least this many rows/columns of the
# long side.
MIN_SLICE = 128


@dataclasses.dataclass(frozen=True)
class MatrixUnit:
  """One matrix, the unit of ownership.

  Attributes:
    leaf_index: the leaf holding it (see :attr:`LeafSpec.leaf_index`).
    path: the leaf's path.
    batch_index: multi-index over the leaf's batch axes, ``()`` for 2-D.
    shape: ``(fan_in, fan_out)``, the leaf's :attr:`LeafSpec.matrix_shape`.
    layer: grouping key; matrices with the same key are spread over
      different owners when that costs no makespan.
    cost: predicted Newton–Schulz FLOPs.
    nbytes: ``fan_in * fan_out * itemsize``.
  """

  leaf_index: int
  path: str
  batch_index: tuple[int, ...]
  shape: tuple[int, int]
  layer: str
  cost: float
  nbytes: int
  group: int = -1  # index into OwnershipPlan.groups for a slice, else -1

  @property
  def name(self) -> str:
    """The path, with the batch index appended for stacked leaves."""
    if not self.batch_index:
      return self.path
    return f'{self.path}[{",".join(str(i) for i in self.batch_index)}]'


@dataclasses.dataclass(frozen=True)
class OwnerGroup:
  """One matrix orthogonalized by a group of owners.

  Its long side is split into slices (units of the plan, on owners of one
  row of the group axis: the same coordinates on every other owner axis).
  In each restart window, each slice owner forms its slices' Gram
  matrices; their sum reaches the window's iteration owner (point to
  point within the row), which runs the window's small ``g x g``
  iteration alone; the factor goes back to the slice owners, which apply
  it to their slices. A window's Gram is formed anew from the slices, so
  each window may have its own iteration owner.

  Attributes:
    leaf_index: the leaf holding the matrix.
    batch_index: the matrix's index over the leaf's own batch axes.
    shape: the whole matrix's ``(fan_in, fan_out)``.
    units: the slices' unit indices.
    iteration_owners: per restart window, the slot that runs its ``g x g``
      iteration.
    iteration_costs: per restart window, that iteration's predicted FLOPs
      (:attr:`iteration_cost` is their sum).
    distinct: whether every slice has its own owner (``owner_groups=k``).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'w': jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    >>> plan = dmuon_jax.plan_ownership(params, {'data': 2}, owner_groups=2)
    >>> (group,) = plan.groups
    >>> group.shape, group.gram_size, group.units
    ((256, 64), 64, (0, 1))
    >>> [plan.units[u].shape for u in group.units]  # the long side halved
    [(128, 64), (128, 64)]
    >>> [plan.owners[u] for u in group.units], group.iteration_owners
    ([0, 1], (0, 0))
  """

  leaf_index: int
  batch_index: tuple[int, ...]
  shape: tuple[int, int]
  units: tuple[int, ...]
  iteration_owners: tuple[int, ...]
  iteration_costs: tuple[float, ...]
  distinct: bool = False

  @property
  def iteration_cost(self) -> float:
    """The ``g x g`` iterations' predicted FLOPs, every window's."""
    return float(sum(self.iteration_costs))

  @property
  def gram_size(self) -> int:
    """The short side ``g``, the size of the Gram matrix."""
    return min(self.shape)


class GatherBytes(NamedTuple):
  """A gather group's bytes in dedicated mode (:meth:`OwnershipPlan.gather_bytes`;
  a scanned stack's: every iteration's)."""

  payload: int  # its matrices' bytes
  gathered: int  # what its gathers move per pass (N x the largest share)
  exchange: float  # its owner groups' Gram exchange per device, an iteration's
  iterations: int = 0  # scan iterations (0: a loop group)

  @property
  def padding(self) -> float:
    """Gathered bytes beyond the payload, in percent (0 with no payload)."""
    return 100 * (self.gathered / self.payload - 1) if self.payload else 0.0

  @staticmethod
  def total(groups: Sequence[GatherBytes]) -> GatherBytes:
    """The bytes of all ``groups`` (the exchange of every iteration)."""
    return GatherBytes(
      sum(b.payload for b in groups),
      sum(b.gathered for b in groups),
      float(sum(max(b.iterations, 1) * b.exchange for b in groups)),
    )


@dataclasses.dataclass(frozen=True)
class OwnershipPlan:
  """Static assignment of every Muon matrix to one owner slot.

  A slot is a row-major flat index over ``mesh_shape``: on a
  ``('replicate', 'shard')`` mesh of shape ``(R, S)``, slot ``r * S + s`` is
  the device at ``replicate=r, shard=s``. The plan is built from shapes only,
  is deterministic and hashable, so it can be a static argument.

  Attributes:
    axis_names: mesh axes the owners range over, in mesh order.
    mesh_shape: the sizes of those axes.
    num_leaves: number of leaves of the params tree (targets or not).
    leaves: the Muon-target leaves, in leaf order.
    units: all matrices, in leaf order, then batch index row-major; each
      has a ``path``, ``batch_index``, ``shape`` ``(fan_in, fan_out)``,
      predicted Newton–Schulz ``cost`` (FLOPs) and ``nbytes``.
    owners: owner slot of each unit.
    groups: the owner groups (:class:`OwnerGroup`): matrices whose slices
      are units owned by several slots; empty when every unit is a whole
      matrix.
    group_axis_name: the owner axis the groups' slices range over, or a
      tuple of owner axes (a group then ranges over all their devices:
      dedicated mode's where one matrix outweighs a row's share of a
      gather); None means the innermost owner axis.
    routing: the one-line routing summary of the params tree the plan was
      built from (Muon and AdamW leaves and elements, and the leaves
      ``optax.contrib.muon`` routes otherwise), as :func:`dmuon_jax.dmuon`
      logs it on its first ``init``; empty when unknown. Not compared.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    >>> params = {f'layers_{i}': {'w': w} for i in range(3)}
    >>> plan = dmuon_jax.plan_ownership(params, {'replicate': 2, 'shard': 2})
    >>> plan.num_slots, plan.slot_coords(3)  # slot 3 is replicate=1, shard=1
    (4, (1, 1))
    >>> plan.owners, plan.units_of(2)  # one matrix each, slot 3 idle
    ((0, 1, 2), (2,))
    >>> print(plan.summary().splitlines()[0])
    OwnershipPlan: 3 matrices in 3 leaves on 4 slots, mesh replicate=2 shard=2
  """

  axis_names: tuple[str, ...]
  mesh_shape: tuple[int, ...]
  num_leaves: int
  leaves: tuple[LeafSpec, ...]
  units: tuple[MatrixUnit, ...]
  owners: tuple[int, ...]
  groups: tuple[OwnerGroup, ...] = ()
  group_axis_name: str | tuple[str, ...] | None = None
  routing: str = dataclasses.field(default='', compare=False, repr=False)

  def __hash__(self) -> int:
    # Plans are static arguments of jitted functions: hash the (large)
    # tuples once. Equality still compares every field.
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    fields = dataclasses.fields(self)
    return hash(tuple(getattr(self, f.name) for f in fields if f.compare))

  @property
  def num_slots(self) -> int:
    """Number of owner slots (product of ``mesh_shape``, 1 for no axes)."""
    return math.prod(self.mesh_shape)

  def slot_coords(self, slot: int) -> tuple[int, ...]:
    """Mesh coordinates of a slot, one per axis in ``axis_names``.

    Args:
      slot: a slot index in ``[0, num_slots)``.

    Returns:
      The coordinates, e.g. ``(r, s)``.
    """
    if not 0 <= slot < self.num_slots:
      raise ValueError(
        f'dmuon: slot {slot} is out of range; the plan has'
        f' {self.num_slots} slots: pass 0 to {self.num_slots - 1}.'
      )
    return tuple(int(c) for c in np.unravel_index(slot, self.mesh_shape))

  def slot_costs(self) -> tuple[float, ...]:
    """Predicted Newton–Schulz FLOPs per slot."""
    costs = [0.0] * self.num_slots
    for unit, owner in zip(self.units, self.owners):
      costs[owner] += unit.cost
    for group in self.groups:
      for slot, cost in zip(group.iteration_owners, group.iteration_costs):
        costs[slot] += cost
    return tuple(costs)

  def group_axis(self) -> str | tuple[str, ...] | None:
    """The owner axis (or axes) a group's slice owners range over
    (default: the innermost)."""
    return self.group_axis_name or (self.axis_names or (None,))[-1]

  def group_row(self, slot: int) -> int:
    """The row of a slot: its index over the owner axes but the group
    axis (or axes)."""
    axis = self.group_axis()
    if self.axis_names:
      names = axis if isinstance(axis, tuple) else (axis,)
      axis = tuple(self.axis_names.index(a) for a in names)
    else:
      axis = 0
    self.slot_coords(slot)  # raises for a slot out of range
    rows = group_rows(self.mesh_shape, axis)
    return next(r for r, row in enumerate(rows) if slot in row)

  def group_slots(self, g: int) -> tuple[int, ...]:
    """The slots holding a slice of group ``g`` or running an iteration."""
    group = self.groups[g]
    slots = {self.owners[u] for u in group.units} | set(group.iteration_owners)
    return tuple(sorted(slots))

  def slot_bytes(self) -> tuple[int, ...]:
    """Bytes of the matrices owned by each slot."""
    nbytes = [0] * self.num_slots
    for unit, owner in zip(self.units, self.owners):
      nbytes[owner] += unit.nbytes
    return tuple(nbytes)

  def units_of(self, slot: int) -> tuple[int, ...]:
    """Indices (into ``units``) of the matrices owned by a slot, ascending.

    Args:
      slot: a slot index in ``[0, num_slots)``.

    Returns:
      A tuple of unit indices.
    """
    return self._slot_units[slot]

  @functools.cached_property
  def _slot_units(self) -> tuple[tuple[int, ...], ...]:
    per_slot: list[list[int]] = [[] for _ in range(self.num_slots)]
    for i, owner in enumerate(self.owners):
      per_slot[owner].append(i)
    return tuple(tuple(u) for u in per_slot)

  @functools.cached_property
  def _leaf_offsets(self) -> dict[int, tuple[int, LeafSpec]]:
    starts = np.cumsum([0] + [s.num_matrices for s in self.leaves]).tolist()
    return {s.leaf_index: (a, s) for a, s in zip(starts, self.leaves)}

  def leaf_units(self, leaf_index: int) -> tuple[int, ...]:
    """Indices (into ``units``) of a leaf's matrices, row-major.

    Args:
      leaf_index: index in ``jax.tree.leaves(params)``.

    Returns:
      A tuple of unit indices; empty if the leaf is not a Muon target.
    """
    start, spec = self._leaf_offsets.get(leaf_index, (0, None))
    return tuple(range(start, start + spec.num_matrices)) if spec else ()

  def unit_index(self, leaf_index: int, batch_index: Sequence[int] = ()) -> int:
    """Index (into ``units``) of one matrix.

    Args:
      leaf_index: index in ``jax.tree.leaves(params)`` of a Muon target.
      batch_index: multi-index over the leaf's batch axes, ``()`` for 2-D.

    Returns:
      The unit index.
    """
    start, spec = self._leaf_offsets.get(leaf_index, (0, None))
    if spec is None:
      raise ValueError(
        f'dmuon: leaf {leaf_index} is not a Muon target of this plan.'
      )
    batch_index = tuple(int(i) for i in batch_index)
    try:  # (raises for a wrong length or an index out of range)
      return start + int(np.ravel_multi_index(batch_index, spec.batch_shape))
    except ValueError:
      raise ValueError(
        f'dmuon: batch_index {batch_index} is out of range for'
        f' {spec.path!r} with batch shape {spec.batch_shape}.'
      ) from None

  @property
  def makespan(self) -> float:
    """Largest predicted Newton–Schulz FLOPs of any slot."""
    return max(self.slot_costs(), default=0.0)

  @property
  def imbalance(self) -> float:
    """Max over mean of the per-slot costs; 1.0 when the total is 0."""
    costs = self.slot_costs()
    total = sum(costs)
    return max(costs) / (total / len(costs)) if total > 0 else 1.0

  def summary(self, paths: bool = True) -> str:
    """A human-readable, multi-line description of the plan.

    Args:
      paths: (optional, default True) whether to list the predicted bytes
        of each path (:meth:`collective_bytes`): a plan does not know the
        params' shardings; a state's layout, which does, leaves them out.

    Returns:
      A header (matrices, slots, mesh axes, total predicted Newton–Schulz
      FLOPs, imbalance) followed by one section per slot listing its
      coordinates, cost, bytes and matrices.
    """
    costs, nbytes = self.slot_costs(), self.slot_bytes()
    mesh = ' '.join(
      f'{n}={s}' for n, s in zip(self.axis_names, self.mesh_shape)
    )
    sliced = sum(u.group >= 0 for u in self.units)
    what = plural(
      len(self.units) - sliced + len(self.groups), 'matrix', 'matrices'
    )
    if self.groups:
      what += f' ({len(self.groups)} split into {sliced} slices)'
    lines = [
      f'OwnershipPlan: {what}'
      f' in {plural(len(self.leaves), "leaf", "leaves")} on'
      f' {plural(self.num_slots, "slot", "slots")},'
      f' mesh {mesh or "(single slot, no mesh axes)"}'
    ] + [f'  {self.routing}'] * bool(self.routing)
    by_shape: dict[tuple, list[int]] = {}
    for g, group in enumerate(self.groups):
      by_shape.setdefault((group.shape, len(group.units)), []).append(g)
    for (shape, slices), gs in by_shape.items():
      sizes = sorted({len(self.group_slots(g)) for g in gs})
      k = f'{sizes[0]}' if len(sizes) == 1 else f'{sizes[0]}-{sizes[-1]}'
      lines.append(
        f'  owner groups: {plural(len(gs), "matrix", "matrices")} '
        f'{shape[0]}x{shape[1]}, {slices} slices each on k={k} devices '
        f'along {self.group_axis()!r}; the {min(shape)}x{min(shape)} '
        f'iterations ({human_flops(self.groups[gs[0]].iteration_cost)} in '
        f'{len(self.groups[gs[0]].iteration_costs)} restart windows) on '
        'one or more of them'
      )
    if self.groups:
      lines.append(
        f'  owner groups exchange per device per step: '
        f'{human_bytes(self.group_exchange_bytes())} (float32 packed Grams '
        "and factors, point to point between each group's devices)"
      )
    lines += [
      f'  predicted NS FLOPs: total {human_flops(sum(costs))}, per slot'
      f' max {human_flops(max(costs))}, mean'
      f' {human_flops(sum(costs) / len(costs))}, imbalance (max/mean)'
      f' {self.imbalance:.3f}',
      f'  bytes: total {human_bytes(sum(nbytes))}, per slot max'
      f' {human_bytes(max(nbytes))}',
    ]
    if paths:
      lines.append('  predicted collective bytes per device per step:')
      lines += [
        f'    {path}: {human_bytes(b)}'
        for path, b in self.collective_bytes().items()
      ]
    for slot in range(self.num_slots):
      coords = ' '.join(
        f'{n}={c}' for n, c in zip(self.axis_names, self.slot_coords(slot))
      )
      unit_ids = self.units_of(slot)
      lines.append(
        f'slot {slot}'
        + (f' ({coords})' if coords else '')
        + f': {plural(len(unit_ids), "matrix", "matrices")},'
        f' {human_flops(costs[slot])},'
        f' {human_bytes(nbytes[slot])}'
      )
      for i in unit_ids:
        unit = self.units[i]
        what = '' if unit.group < 0 else f'  (slice of group {unit.group})'
        lines.append(f'  {unit.name}  {unit.shape[0]}x{unit.shape[1]}{what}')
      for g, group in enumerate(self.groups):
        for w, owner in enumerate(group.iteration_owners):
          if owner == slot:
            s = group.gram_size
            lines.append(f'  iteration of group {g}, window {w}  {s}x{s}')
    return '\n'.join(lines)

  def collective_bytes(
    self,
    routes: Sequence[tuple[int, float]] | None = None,
    whole: Sequence[tuple[int, float]] = (),
  ) -> dict[str, float]:
    """Predicted per-device collective bytes of one dmuon step (ring model):
    the package's one prediction of the drop-in and explicit paths (the
    dedicated gathers': :meth:`gather_bytes`).

    Without ``routes``, by path. Owner buffers are padded to the largest
    slot's bytes (``max``), so every figure scales with ``max`` rather than
    with the mean; with N slots and ``P`` the total bytes of all matrices
    (in the params' dtype):

    * ``'explicit'``: reduce-scatter of per-device gradients to the owners
      plus all-gather of the results: ``2 (N - 1) max`` (the all-reduce
      floor ``2 (N - 1) / N P`` when slots are balanced).
    * ``'drop-in, replicated params'``: one all-gather: ``(N - 1) max``.
    * ``'drop-in, sharded params'``: params sharded along one matrix dim
      over the innermost owner axis (FSDP, or HSDP's ``'shard'``) of size
      S: one all-to-all over that axis to the owners, ``(S - 1) max / S``,
      and back the same all-to-all reversed plus an all-gather over the
      other owner axes, ``(N - 1) max / S`` together. (A state's
      :meth:`dmuon_jax.OwnerLayout.collective_bytes` predicts the bytes for
      the params' actual shardings, through ``routes``.)
    * ``'all-reduce floor'``: ``2 (N - 1) / N P``, what data parallelism pays
      for these gradients anyway.

    With ``routes``, the drop-in update's bytes by collective kind: per
    class ``(g, b)`` of rows, ``b`` bytes per owner of an axis group of
    ``g`` devices, all-to-all to the owners over that group and back, then
    an all-gather over the other ``N / g`` coordinates: ``2 (g - 1) b``
    and ``(N - g) b`` (with the all-to-all back, the ``(N - 1) b`` of one
    all-to-all over all N devices); per ``(k, b)`` of ``whole``, an array
    of ``b`` bytes all-gathered over ``k`` devices.

    Args:
      routes: (optional) per class of rows, its group size and row bytes
        (padded to the largest owner's share, as in the program).
      whole: (optional, with ``routes``) per array gathered whole, its
        group size and bytes.

    Returns:
      A dict from path name to bytes; with ``routes``,
      ``{'all-to-all': ..., 'all-gather': ...}``.
    """
    n = self.num_slots
    if routes is not None:
      a2a = gather = 0.0
      for g, b in routes:
        a2a += 2 * ring_bytes('all-to-all', g, g * b)
        gather += ring_bytes('all-gather', n // g, n * b)
      for k, b in whole:
        gather += ring_bytes('all-gather', k, b)
      return {'all-to-all': a2a, 'all-gather': gather}
    biggest = max(self.slot_bytes())
    inner = self.mesh_shape[-1] if self.mesh_shape else 1
    routed = lambda g: sum(self.collective_bytes([(g, biggest / g)]).values())
    return {
      'explicit': ring_bytes('reduce-scatter', n, n * biggest)
      + ring_bytes('all-gather', n, n * biggest),
      'drop-in, replicated params': routed(1),
      'drop-in, sharded params': routed(inner),
      'all-reduce floor': ring_bytes('all-reduce', n, sum(self.slot_bytes())),
    }

  def gather_bytes(self, iterations: int = 0) -> GatherBytes:
    """Predicted bytes of dedicated mode's gathers of this plan (one gather
    group's), the one prediction that ``Dedication.gather_bytes`` and
    ``exchange_bytes`` and ``layers_per_gather='auto'`` read.

    Args:
      iterations: (optional) the group's scan iterations (0: a loop group,
        gathered once).

    Returns:
      A :class:`GatherBytes`: payload and gathered bytes times
      ``max(iterations, 1)``; gathered per dtype (an owner buffer each, of
      at least one element) ``num_slots`` times the largest owner's bytes.
    """
    n = self.num_slots
    held = {s.dtype: np.zeros(n, np.int64) for s in self.leaves}
    dtype_of = {s.leaf_index: s.dtype for s in self.leaves}
    for u, slot in zip(self.units, self.owners):
      held[dtype_of[u.leaf_index]][slot] += u.nbytes
    gathered = sum(
      n * max(int(h.max()), jnp.dtype(d).itemsize) for d, h in held.items()
    )
    times = max(iterations, 1)
    return GatherBytes(
      times * sum(u.nbytes for u in self.units),
      times * gathered,
      self.group_exchange_bytes(),
      iterations,
    )

  def group_exchange_bytes(self) -> float:
    """Predicted bytes the busiest device sends in the owner groups'
    exchange of one update, 0 without groups (ring model: one
    ``ppermute`` of a block per round): every restart window's rounds
    (``schedule``), each member's Gram to its group's iteration owner
    of the window and the factor back, float32 packed triangles of the
    largest Gram."""
    if not self.groups:
      return 0.0
    rounds = 0
    for w in range(windows(self.groups)):
      sched = schedule(self.groups, self.owners, w)
      rounds += len(sched.reduce) + len(sched.broadcast)
    block = max(triangle_size(g.gram_size) for g in self.groups)
    return float(rounds * block * 4)


# A message of the Gram exchange: (source slot, destination slot, group index).
Message = tuple[int, int, int]


def triangle_size(g: int) -> int:
  """Elements of a packed ``g x g`` symmetric matrix (see
  ``_staged.pack_symmetric``: odd sizes are padded by one)."""
  even = g + g % 2
  return even * (even + 1) // 2


class Schedule(NamedTuple):
  """The rounds of one restart window.

  Attributes:
    reduce: per round, the members' Grams to iteration owners.
    broadcast: per round, the factors back to the members.
  """

  reduce: tuple[tuple[Message, ...], ...]
  broadcast: tuple[tuple[Message, ...], ...]


def schedule(groups, owners: Sequence[int], window: int) -> Schedule:
  """The rounds of the groups' exchange in one restart window.

  Args:
    groups: the plan's ``OwnerGroup`` s.
    owners: the owner slot of each unit of the plan.
    window: the restart window (its iteration owners).
  """
  reduce = []
  for j, g in enumerate(groups):
    owner = g.iteration_owners[window]
    held = sorted({owners[u] for u in g.units})
    reduce += [(h, owner, j) for h in held if h != owner]
  back = [(o, h, j) for h, o, j in reduce]
  return Schedule(_rounds(reduce), _rounds(back))


def windows(groups) -> int:
  """The groups' restart windows (the same for every group)."""
  return max((len(g.iteration_owners) for g in groups), default=0)


def _rounds(edges: Sequence[Message]) -> tuple[tuple[Message, ...], ...]:
  """``edges`` coloured so that no slot sends or receives twice in one
  colour, in as many colours as the largest number of messages one slot
  sends or receives (alternating-path colouring of a bipartite multigraph);
  each colour's messages in input order."""
  if not edges:
    return ()
  ends = collections.Counter(x for u, v, _ in edges for x in ((0, u), (1, v)))
  colours = max(ends.values())
  # Per side (0: the sources, 1: the destinations): slot -> colour -> edge.
  at = (collections.defaultdict(dict), collections.defaultdict(dict))
  colour = [0] * len(edges)

  def put(e, c):
    colour[e] = c
    for side in (0, 1):
      at[side][edges[e][side]][c] = e

  for e, (u, v, _) in enumerate(edges):
    a = next(c for c in range(colours) if c not in at[0][u])
    b = next(c for c in range(colours) if c not in at[1][v])
    if a in at[1][v]:
      # Swap a and b on the path from v that alternates a, b, a, ...: it
      # cannot reach u (a is free there), and frees a at v.
      path, node, side, c = [], v, 1, a
      while c in at[side][node]:
        path.append(at[side][node][c])
        node, side, c = edges[path[-1]][1 - side], 1 - side, a + b - c
      for f in path:
        for side in (0, 1):
          del at[side][edges[f][side]][colour[f]]
      for f in path:
        put(f, a + b - colour[f])
    put(e, a)
  return tuple(
    tuple(edges[e] for e in range(len(edges)) if colour[e] == c)
    for c in range(colours)
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

  def remap(axes):  # d becomes (d, d + 1, d + 2), d + 1 a batch axis
    return tuple(
      b for a in axes for b in ((d, d + 2) if a == d else (a + 2 * (a > d),))
    )

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


def matrix_units(
  spec: LeafSpec, cost: float, first_group: int = -1
) -> list[MatrixUnit]:
  """The units of a leaf's matrices (of their slices, for a sliced view),
  row-major over its batch axes, each predicted to cost ``cost``; for a
  sliced view, a slice's group is ``first_group`` plus its matrix's
  number (in order of first slices)."""
  fi, fo = spec.matrix_shape
  nbytes = int(fi * fo * jnp.dtype(spec.dtype).itemsize)
  pos = spec.batch_axes.index(spec.slice_axis) if spec.sliced else -1
  units, groups = [], {}
  for index in np.ndindex(*spec.batch_shape):
    index = tuple(int(i) for i in index)
    whole, group = index, -1  # the matrix's index over the leaf's batch axes
    if pos >= 0:
      whole = index[:pos] + index[pos + 1 :]
      group = first_group + groups.setdefault(whole, len(groups))
    units.append(
      MatrixUnit(
        leaf_index=spec.leaf_index,
        path=spec.path,
        batch_index=index,
        shape=(fi, fo),
        layer=layer_key(spec.path, whole),
        cost=cost,
        nbytes=nbytes,
        group=group,
      )
    )
  return units


def resliced(
  plan: OwnershipPlan,
  views: Mapping[int, LeafSpec],
  ns_steps: int,
  only: Collection[int] | None = None,
  distinct: bool = False,
) -> tuple[OwnershipPlan, list[tuple[float, int, int]]]:
  """``plan`` with more of its leaves viewed as slices (owner groups).

  Its leaves (only those in ``only``, if given) with ``views`` (leaf index
  -> :func:`sliced_spec` view) applied: whole matrices kept, a sliced
  leaf's matrices as slice units of one group each (costs from the Gram
  form). Owners are left to the caller (all 0, iterations on slot 0); a
  group keeps the ``distinct`` it had in ``plan``, a new one takes
  ``distinct``.

  Returns:
    ``(plan, pieces)``: the pieces to place in leaf order, ``(cost,
    order, whole unit index | -(group + 1))``.
  """
  had = {(g.leaf_index, g.batch_index): g.distinct for g in plan.groups}
  leaves, units, pieces, meta, members = [], [], [], [], []
  for spec in plan.leaves:
    if only is not None and spec.leaf_index not in only:
      continue
    spec = views.get(spec.leaf_index, spec)
    leaves.append(spec)
    if not spec.sliced:  # whole matrices, as in plan
      for i in plan.leaf_units(spec.leaf_index):
        pieces.append((plan.units[i].cost, len(pieces), len(units)))
        units.append(plan.units[i])
      continue
    work, iteration = gram_parts(*sorted(spec.whole_matrix), ns_steps)
    pos = spec.batch_axes.index(spec.slice_axis)
    k = spec.shape[spec.slice_axis]
    for u in matrix_units(spec, work / k, len(meta)):
      if u.group == len(meta):  # a matrix's first slice: its group
        index = u.batch_index[:pos] + u.batch_index[pos + 1 :]
        meta.append((spec.leaf_index, index, spec.whole_matrix, iteration))
        members.append([])
        pieces.append((work + sum(iteration), len(pieces), -len(meta)))
      members[u.group].append(len(units))
      units.append(u)
  groups = tuple(
    OwnerGroup(
      leaf_index=leaf,
      batch_index=index,
      shape=shape,
      units=tuple(members[g]),
      iteration_owners=(0,) * len(iteration),
      iteration_costs=tuple(iteration),
      distinct=had.get((leaf, index), distinct),
    )
    for g, (leaf, index, shape, iteration) in enumerate(meta)
  )
  replaced = dataclasses.replace(
    plan,
    leaves=tuple(leaves),
    units=tuple(units),
    owners=(0,) * len(units),
    groups=groups,
  )
  return replaced, pieces


def group_rows(
  shape: Sequence[int], axis: int | Sequence[int]
) -> list[list[int]]:
  """The slots (row-major over ``shape``) of each row of owner groups: of
  one coordinate on every axis but ``axis`` (an axis, or several: a row
  then spans them all, row-major), rows in row-major order."""
  if not shape:
    return [[0]]
  axes = [axis] if isinstance(axis, int) else list(axis)
  axes = [a % len(shape) for a in axes]
  slots = np.arange(math.prod(shape)).reshape(shape)
  size = math.prod(shape[a] for a in axes)
  moved = np.moveaxis(slots, axes, range(len(shape) - len(axes), len(shape)))
  return moved.reshape(-1, size).tolist()
