"""Static routes between sharded params and owner buffers (all-to-all).

Used inside the drop-in update's ``shard_map``. A Muon leaf whose sharded
dimensions are all matrix dimensions (reduction or output axes: rows,
columns, several axes on one dimension, both dimensions) is *routed*:

* to the owners: every device sends each owner of its *axis group* (the
  devices that differ from it only on the leaf's sharding axes ``A``) its
  piece of the owner's matrices: one ``all_to_all`` over ``A`` per
  (axis set, dtype). The owner receives each piece exactly once (each device
  of the group holds a different block) and assembles whole matrices.
* back: each owner sends every device its block of the results: one
  ``all_to_all`` over all owner axes per dtype.

Both directions move what a device must receive and nothing more (plus the
padding of rows to the largest owner's share). Leaves that are replicated
need no communication to reach their owners; their results come back by one
``all_gather`` of compact per-owner buffers. Leaves sharded along a stack
(batch) axis are gathered whole first (see :attr:`Exchange.gathered`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _collectives, _layout, _mesh, _owner_groups


class _Routed:
  """One routed leaf: its axis set and how a matrix splits into pieces."""

  def __init__(self, spec, entries, sizes):
    # The leaf's own local shard shape, and that of the view (a sliced
    # spec's view splits one dimension; see _owner_groups.sliced_spec).
    self.leaf_local = tuple(
      n // math.prod(sizes[a] for a in e)
      for n, e in zip(spec.leaf_shape, entries)
    )
    entries = _owner_groups.view_entries(spec, entries)
    if spec.sliced:
      d = spec.slice_axis - 1
      shards = math.prod(sizes[a] for a in entries[d])
      if shards != spec.shape[d]:
        raise ValueError(
          f'dmuon: param {spec.path!r} is sharded {shards} ways along the '
          'dimension its owner group slices, but the optimizer state was '
          f'laid out for {spec.shape[d]}. Make the state again with init() '
          'on params sharded as in training.'
        )
    self.view_local = tuple(
      n // math.prod(sizes[a] for a in e) for n, e in zip(spec.shape, entries)
    )
    canon = spec.reduction_axes + spec.output_axes
    self.dim_axes = [tuple(entries[a]) for a in canon]
    axes = {a for e in self.dim_axes for a in e}
    self.axes = tuple(a for a in sizes if a in axes)  # mesh order
    self.axis_sizes = tuple(sizes[a] for a in self.axes)
    self.blocks = math.prod(self.axis_sizes)
    self.full = [spec.shape[a] for a in canon]
    self.piece = [
      n // math.prod(sizes[a] for a in e)
      for n, e in zip(self.full, self.dim_axes)
    ]
    self.piece_size = math.prod(self.piece)
    self.perm = spec.batch_axes + canon
    self.batch_shape = tuple(spec.shape[a] for a in spec.batch_axes)

  def member(self, coords: dict[str, int]) -> int:
    """Index of a device (by its coordinates) in its axis group."""
    if not self.axes:
      return 0
    return int(
      np.ravel_multi_index([coords[a] for a in self.axes], self.axis_sizes)
    )

  def assemble(self, pieces: jax.Array) -> jax.Array:
    """``(blocks, *piece)`` pieces (member order) -> the whole matrix
    in canonical (reduction, output) dims."""
    n = len(self.axes)
    x = pieces.reshape(self.axis_sizes + tuple(self.piece))
    perm = []
    for j, axes in enumerate(self.dim_axes):
      perm += [self.axes.index(a) for a in axes]
      perm.append(n + j)
    return jnp.transpose(x, perm).reshape(self.full)

  def split(self, full: jax.Array) -> jax.Array:
    """Inverse of :meth:`assemble`: ``(blocks, piece_size)``."""
    n = len(self.axes)
    shape, src = [], []
    for j, axes in enumerate(self.dim_axes):
      for a in axes:
        shape.append(self.axis_sizes[self.axes.index(a)])
        src.append(('axis', self.axes.index(a)))
      shape.append(self.piece[j])
      src.append(('dim', j))
    x = full.reshape(shape)
    order = [src.index(('axis', k)) for k in range(n)] + [
      src.index(('dim', j)) for j in range(len(self.piece))
    ]
    return jnp.transpose(x, order).reshape(self.blocks, self.piece_size)


class Exchange:
  """Routes of one owner layout for given param shardings.

  Attributes:
    routed: plan leaf index -> its route, for routed leaves.
    gathered: plan leaf indices gathered whole before Newton–Schulz (a
      sharded stack axis).
    classes: ``(axes, dtype group)`` of each forward all-to-all.
  """

  def __init__(self, layout: _layout.Layout, entries: Sequence[_mesh.Entries]):
    """Builds the routes.

    Args:
      layout: the owner layout (one group; owners range over its plan's
        axes).
      entries: each plan leaf's sharding over the owner axes (size-1 and
        tensor-parallel axes removed), per dimension.
    """
    plan = layout.plan
    self.layout = layout
    self.axes = plan.axis_names
    self.sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    n = plan.num_slots
    self.num_slots = n
    self.coords = [
      dict(zip(self.axes, np.unravel_index(s, plan.mesh_shape)))
      if self.axes
      else {}
      for s in range(n)
    ]
    self.entries = list(entries)
    self.routed: dict[int, _Routed] = {}
    self.gathered: set[int] = set()
    for i, spec in enumerate(plan.leaves):
      sharded = [
        d
        for d, axes in enumerate(_owner_groups.view_entries(spec, entries[i]))
        if axes
      ]
      if not sharded:
        continue
      matrix = set(spec.reduction_axes + spec.output_axes)
      if all(d in matrix for d in sharded):
        self.routed[i] = _Routed(spec, entries[i], self.sizes)
      else:
        self.gathered.add(i)
    groups = range(layout.num_groups)
    # Forward classes: (axes, dtype group) -> per owner its routed units.
    self.classes: list[tuple[tuple[str, ...], int]] = []
    self.fwd_units: dict[tuple, list[list[int]]] = {}
    for g in groups:
      for s in range(n):
        for u in layout.slot_units[g][s]:
          i = layout.unit_leaf[u]
          if i in self.routed:
            key = (self.routed[i].axes, g)
            if key not in self.fwd_units:
              self.classes.append(key)
              self.fwd_units[key] = [[] for _ in range(n)]
            self.fwd_units[key][s].append(u)
    self.fwd_off = {}
    self.fwd_size = {}
    for key, per_slot in self.fwd_units.items():
      used = []
      for units in per_slot:
        off = 0
        for u in units:
          self.fwd_off[u] = off
          off += self.routed[layout.unit_leaf[u]].piece_size
        used.append(off)
      self.fwd_size[key] = max(used)
    # Back: per dtype group, per owner its routed units (all classes).
    self.back_units = [
      [
        [
          u
          for u in layout.slot_units[g][s]
          if layout.unit_leaf[u] in self.routed
        ]
        for s in range(n)
      ]
      for g in groups
    ]
    self.back_off = {}
    self.back_size = []
    self.rep_units = [
      [
        [
          u
          for u in layout.slot_units[g][s]
          if layout.unit_leaf[u] not in self.routed
        ]
        for s in range(n)
      ]
      for g in groups
    ]
    self.rep_off = {}
    self.rep_size = []
    for g in groups:
      for units, offs, sizes, piece in (
        (self.back_units[g], self.back_off, self.back_size, True),
        (self.rep_units[g], self.rep_off, self.rep_size, False),
      ):
        used = []
        for per_slot in units:
          off = 0
          for u in per_slot:
            offs[u] = off
            off += (
              self.routed[layout.unit_leaf[u]].piece_size
              if piece
              else layout.unit_size[u]
            )
          used.append(off)
        sizes.append(max(used) if used else 0)

  # -- branch keys ---------------------------------------------------------
  # Hashables of what each per-slot stage reads about a slot: slots with
  # equal keys run equal programs and share one branch body
  # (``_collectives.switch_by_slot``).

  def _matrix_key(self, u: int) -> tuple:
    lay = self.layout
    return (
      int(lay.unit_group[u]),
      int(lay.unit_offset[u]),
      int(lay.unit_size[u]),
      tuple(lay.plan.units[u].shape),
    )

  def _route_key(self, u: int) -> tuple:
    r = self.routed[self.layout.unit_leaf[u]]
    return (
      r.axes,
      r.axis_sizes,
      tuple(r.piece),
      tuple(r.dim_axes),
      tuple(r.full),
    )

  def pack_key(self, slot: int) -> tuple:
    """What assembling ``slot``'s owner buffers from the received pieces
    reads (units taken from whole leaves make the key unique)."""
    lay = self.layout
    key = []
    for g in range(lay.num_groups):
      units = []
      for u in lay.slot_units[g][slot]:
        if lay.unit_leaf[u] in self.routed:
          # The route key holds the class's axes (the class is (axes, g)).
          units.append(
            (
              self.fwd_off[u],
              self._route_key(u),
              tuple(lay.plan.units[u].shape),
            )
          )
        else:
          units.append(('whole', u))
      key.append((tuple(units), int(lay.slot_used[g, slot])))
    return tuple(key)

  def back_key(self, g: int, slot: int) -> tuple:
    """What :meth:`send_back` reads of ``slot`` in dtype group ``g``."""
    return tuple(
      (self._route_key(u), self._matrix_key(u))
      for u in self.back_units[g][slot]
    )

  def rep_key(self, slot: int, groups: Sequence[int]) -> tuple:
    """What :meth:`rep_pack` reads of ``slot`` in dtype groups ``groups``."""
    return tuple(
      tuple(self._matrix_key(u) for u in self.rep_units[g][slot])
      for g in groups
    )

  # -- static helpers ------------------------------------------------------

  def _slot(self, coords: dict[str, int]) -> int:
    if not self.axes:
      return 0
    return int(
      np.ravel_multi_index(
        [coords[a] for a in self.axes], [self.sizes[a] for a in self.axes]
      )
    )

  @staticmethod
  def _row(pieces, size, dtype):
    used = sum(int(p.shape[0]) for p in pieces)
    if used < size or not pieces:
      pieces = list(pieces) + [jnp.zeros((size - used,), dtype)]
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]

  def _local_units(self, x: jax.Array, i: int) -> jax.Array:
    r = self.routed[i]
    x = x.reshape(r.view_local)
    # The count is explicit: a -1 cannot be inferred for an empty leaf.
    count = math.prod(r.batch_shape)
    return jnp.transpose(x, r.perm).reshape((count,) + tuple(r.piece))

  # -- forward: pieces to the owners --------------------------------------

  def send_to_owners(
    self, key, local_leaves: Sequence[jax.Array], dtype
  ) -> jax.Array:
    """This device's ``(group size, row)`` pieces for the owners of its
    axis group (class ``key``); rows in member order."""
    axes, g = key
    layout = self.layout
    routes = {
      layout.unit_leaf[u]: None for per in self.fwd_units[key] for u in per
    }
    units = {i: self._local_units(local_leaves[i], i) for i in routes}
    others = tuple(a for a in self.axes if a not in axes)
    other_sizes = [self.sizes[a] for a in others]
    group_sizes = [self.sizes[a] for a in axes]

    def rows_for(other_coords):
      rows = []
      for r in range(math.prod(group_sizes)):
        coords = dict(zip(others, other_coords))
        coords.update(zip(axes, np.unravel_index(r, group_sizes)))
        owner = self._slot({a: int(c) for a, c in coords.items()})
        pieces = [
          units[layout.unit_leaf[u]][layout.unit_batch[u]]
          .reshape(-1)
          .astype(dtype)
          for u in self.fwd_units[key][owner]
        ]
        rows.append(self._row(pieces, self.fwd_size[key], dtype))
      return jnp.stack(rows)

    if math.prod(other_sizes) == 1:
      return rows_for([0] * len(others))
    # Every coordinate off the class's axes sends to other owners. Each local
    # piece goes to exactly one owner, so the rows of all coordinates
    # together are this device's pieces once (a permutation, plus padding):
    # built for all, and this device's taken by a dynamic index, not one
    # switch branch per coordinate (which grew the program with N).
    every = jnp.stack([rows_for(c) for c in np.ndindex(*other_sizes)])
    index = jax.lax.axis_index(others)
    return _collectives.to_varying(
      jax.lax.dynamic_index_in_dim(every, index, 0, keepdims=False), self.axes
    )

  def assemble(self, key, recv: jax.Array, owner: int) -> dict[int, jax.Array]:
    """The owner's whole matrices of class ``key`` from the pieces."""
    layout = self.layout
    out = {}
    for u in self.fwd_units[key][owner]:
      r = self.routed[layout.unit_leaf[u]]
      off = self.fwd_off[u]
      pieces = recv[:, off : off + r.piece_size]
      out[u] = r.assemble(pieces).reshape(layout.plan.units[u].shape)
    return out

  # -- back: results to every device --------------------------------------

  def send_back(
    self, g: int, buffers: Sequence[jax.Array], owner: int
  ) -> jax.Array:
    """The owner's ``(num_slots, row)`` result pieces for every device."""
    layout = self.layout
    dtype = buffers[g].dtype
    cols = []
    for u in self.back_units[g][owner]:
      r = self.routed[layout.unit_leaf[u]]
      full = layout.slot_matrix(buffers, u).reshape(r.full)
      blocks = r.split(full)
      idx = np.array([r.member(self.coords[d]) for d in range(self.num_slots)])
      if not np.array_equal(idx, np.arange(len(idx))):
        blocks = blocks.at[idx].get(mode='promise_in_bounds')
      cols.append(blocks)
    used = sum(c.shape[1] for c in cols)
    if used < self.back_size[g] or not cols:
      cols.append(jnp.zeros((self.num_slots, self.back_size[g] - used), dtype))
    return jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]

  def local_leaf(self, i: int, recv: Sequence[jax.Array]) -> jax.Array:
    """This device's shard of routed leaf ``i`` from the results received."""
    layout = self.layout
    r = self.routed[i]
    units = layout.leaf_units[i]
    groups = {layout.unit_group[u] for u in units}
    if len(units) > 1 and len(groups) == 1:
      # One gather of the leaf's pieces (each at its owner's row and offset:
      # a table of the leaf's unit count), not a slice per unit (owner
      # groups cut a matrix into many units: Llama-3-8B at N = 1024 has
      # 1,664; compile 54.0 s -> 20.1 s).
      (g,) = groups
      where = np.array(
        [[layout.plan.owners[u], self.back_off[u]] for u in units], np.int32
      )
      buf = recv[g]
      mats = jax.vmap(
        lambda at: jax.lax.dynamic_slice(buf, at, (1, r.piece_size))[0]
      )(where)
    else:
      mats = jnp.stack(
        [
          recv[layout.unit_group[u]][
            layout.plan.owners[u],
            self.back_off[u] : self.back_off[u] + r.piece_size,
          ]
          for u in units
        ]
      )
    x = mats.reshape(r.batch_shape + tuple(r.piece))
    return jnp.transpose(x, tuple(np.argsort(r.perm))).reshape(r.leaf_local)

  # -- replicated (and gathered) leaves -----------------------------------

  def rep_pack(
    self, buffers: Sequence[jax.Array], slot: int, g: int
  ) -> jax.Array:
    """The slot's results of non-routed leaves, compactly, ``(rep,)``."""
    pieces = [
      self.layout.slot_matrix(buffers, u).reshape(-1)
      for u in self.rep_units[g][slot]
    ]
    return self._row(pieces, self.rep_size[g], buffers[g].dtype)

  def rep_unpack(self, gathered: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """Whole non-routed leaves from the all-gathered compact buffers."""
    layout = self.layout
    out = {}
    for i, spec in enumerate(layout.plan.leaves):
      if i in self.routed:
        continue
      mats = []
      for u in layout.leaf_units[i]:
        g = layout.unit_group[u]
        start = layout.plan.owners[u] * self.rep_size[g] + self.rep_off[u]
        flat = jax.lax.slice_in_dim(
          gathered[g], start, start + layout.unit_size[u]
        )
        mats.append(flat.reshape(layout.plan.units[u].shape))
      out[i] = _layout.from_matrices(jnp.stack(mats), spec)
    return out

  # -- the cost model ------------------------------------------------------

  def predicted_bytes(self, itemsizes: Sequence[int]) -> dict[str, float]:
    """Per-device bytes of one update by collective kind (ring model).

    Args:
      itemsizes: bytes per element of each dtype group's buffers.

    Returns:
      ``{'all-to-all': ..., 'all-gather': ...}``; rows are padded to the
      largest owner's share, as in the program.
    """
    n = self.num_slots
    a2a = 0.0
    for key in self.classes:
      axes, g = key
      size = math.prod(self.sizes[a] for a in axes)
      a2a += (size - 1) * self.fwd_size[key] * itemsizes[g]
    for g, size in enumerate(self.back_size):
      if size:
        a2a += (n - 1) * size * itemsizes[g]
    gather = sum(
      (n - 1) * size * itemsizes[g]
      for g, size in enumerate(self.rep_size)
      if size
    )
    layout = self.layout
    for i in self.gathered:
      spec = layout.plan.leaves[i]
      k = math.prod(self.sizes[a] for e in self.entries[i] for a in e)
      g = layout.unit_group[layout.leaf_units[i][0]]
      gather += (k - 1) / k * math.prod(spec.shape) * itemsizes[g]
    return {'all-to-all': a2a, 'all-gather': gather}


def gather_to_full(x: jax.Array, entries: _mesh.Entries) -> jax.Array:
  """The whole array from this device's shard (one all-gather per dim)."""
  for dim, axes in enumerate(entries):
    if axes:
      x = jax.lax.all_gather(x, axes, axis=dim, tiled=True, to='invarying')
  return x


def local_shard(
  x: jax.Array,
  entries: _mesh.Entries,
  sizes: dict[str, int],
  axis_index: Callable[..., jax.Array] = jax.lax.axis_index,
) -> jax.Array:
  """This device's shard of a whole (replicated) array."""
  for dim, axes in enumerate(entries):
    if axes:
      n = math.prod(sizes[a] for a in axes)
      size = x.shape[dim] // n
      x = jax.lax.dynamic_slice_in_dim(
        x, axis_index(axes) * size, size, axis=dim
      )
  return x
