"""Static index maps between a param tree and per-owner flat buffers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _planner


def to_matrices(x: jax.Array, spec: _planner.LeafSpec) -> jax.Array:
  """Reshapes a leaf to ``(num_matrices, fan_in, fan_out)``."""
  perm = spec.batch_axes + spec.reduction_axes + spec.output_axes
  return jnp.transpose(x, perm).reshape(
      (spec.num_matrices,) + spec.matrix_shape)


def from_matrices(x: jax.Array, spec: _planner.LeafSpec) -> jax.Array:
  """Inverse of :func:`to_matrices`."""
  perm = spec.batch_axes + spec.reduction_axes + spec.output_axes
  x = x.reshape(tuple(spec.shape[a] for a in perm))
  return jnp.transpose(x, tuple(np.argsort(perm)))


class Layout:
  """Where each matrix of a plan lives in its owner's flat buffer.

  Matrices are grouped by buffer dtype. For each group every owner slot has
  one flat buffer of ``local_size`` elements holding its own matrices back to
  back (in plan order), then zero padding up to the largest slot's total. The
  global buffer is ``(num_slots * local_size,)``: sharded over the slot axes,
  each device's block is exactly its own matrices, with no per-shape padding.
  """

  def __init__(self, plan: _planner.OwnershipPlan, dtypes: Sequence,
               tp_splits: Sequence[int | None] | None = None):
    """Builds the layout.

    Args:
      plan: the ownership plan.
      dtypes: the buffer dtype of each of ``plan.leaves``.
      tp_splits: per ``plan.leaves`` entry, None, or the matrix axis (-1
        columns, -2 rows) that a tensor-parallel mesh axis splits; the plan
        then holds each TP shard's slice (see ``_tensor_parallel``).
    """
    self.plan = plan
    self.num_slots = plan.num_slots
    names = [np.dtype(d).name for d in dtypes]
    self.dtypes = tuple(sorted(set(names)))
    pos = {spec.leaf_index: i for i, spec in enumerate(plan.leaves)}
    n = len(plan.units)
    self.unit_leaf = [pos[u.leaf_index] for u in plan.units]
    self.tp_splits = (tuple(tp_splits) if tp_splits is not None
                      else (None,) * len(plan.leaves))
    self.unit_group = [self.dtypes.index(names[i]) for i in self.unit_leaf]
    self.unit_offset = [0] * n
    self.unit_size = [u.shape[0] * u.shape[1] for u in plan.units]
    self.unit_batch = [0] * n
    for u, unit in enumerate(plan.units):
      spec = plan.leaves[self.unit_leaf[u]]
      if unit.batch_index:
        self.unit_batch[u] = int(np.ravel_multi_index(
            unit.batch_index, [spec.shape[a] for a in spec.batch_axes]))
    # slot_units[g][s]: unit indices of group g owned by slot s, in order.
    self.slot_units = [[[] for _ in range(self.num_slots)]
                       for _ in self.dtypes]
    used = np.zeros((len(self.dtypes), self.num_slots), np.int64)
    for u, owner in enumerate(plan.owners):
      g = self.unit_group[u]
      self.slot_units[g][owner].append(u)
      self.unit_offset[u] = int(used[g, owner])
      used[g, owner] += self.unit_size[u]
    self.slot_used = used
    self.local_sizes = tuple(max(1, int(used[g].max()))
                             for g in range(len(self.dtypes)))
    # leaf_units[i]: unit indices of plan.leaves[i] by flat batch index.
    self.leaf_units = [[] for _ in plan.leaves]
    for u in range(n):
      self.leaf_units[self.unit_leaf[u]].append(u)

  @property
  def num_groups(self) -> int:
    return len(self.dtypes)

  def global_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(
        jax.ShapeDtypeStruct((self.num_slots * size,), jnp.dtype(d))
        for d, size in zip(self.dtypes, self.local_sizes))

  def unit_getter(self, leaves: Sequence[jax.Array]) -> Callable:
    """Returns ``u -> (m, n)`` matrix of unit ``u`` from full leaves."""
    cache = {}

    def get(u):
      i = self.unit_leaf[u]
      if i not in cache:
        spec = self.plan.leaves[i]
        cache[i] = to_matrices(leaves[i], spec)
      return cache[i][self.unit_batch[u]]

    return get

  def _flat_slot(self, get, g: int, s: int, dtype) -> jax.Array:
    pieces = [get(u).reshape(-1).astype(dtype) for u in self.slot_units[g][s]]
    pad = self.local_sizes[g] - int(self.slot_used[g, s])
    if pad or not pieces:
      pieces.append(jnp.zeros((pad,), dtype))
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]

  def pack_full(self, leaves: Sequence[jax.Array], dtype=None
                ) -> tuple[jax.Array, ...]:
    """All slots' buffers, concatenated: one ``(num_slots * local,)`` each.

    Args:
      leaves: the full (unsharded) target leaves, in ``plan.leaves`` order.
      dtype: buffer dtype (default: the leaves' promoted dtype).

    Returns:
      One flat buffer per dtype group.
    """
    get = self.unit_getter(leaves)
    out = []
    for g in range(self.num_groups):
      dt = dtype or self._promoted(leaves, g)
      out.append(jnp.concatenate(
          [self._flat_slot(get, g, s, dt) for s in range(self.num_slots)]))
    return tuple(out)

  def pack_slot(self, leaves: Sequence[jax.Array], slot: int, dtype=None
                ) -> tuple[jax.Array, ...]:
    """One slot's buffers, ``(local,)`` each, from full leaves."""
    return self.pack_slot_from(self.unit_getter(leaves), slot,
                               [dtype or self._promoted(leaves, g)
                                for g in range(self.num_groups)])

  def pack_slot_from(self, get: Callable[[int], jax.Array], slot: int,
                     dtypes: Sequence) -> tuple[jax.Array, ...]:
    """One slot's buffers from ``get(unit) -> (m, n)`` matrices."""
    return tuple(self._flat_slot(get, g, slot, dtypes[g])
                 for g in range(self.num_groups))

  def slot_matrix(self, buffers: Sequence[jax.Array], u: int) -> jax.Array:
    """Unit ``u``'s ``(m, n)`` matrix from its owner's local buffers."""
    flat = jax.lax.slice_in_dim(buffers[self.unit_group[u]],
                                self.unit_offset[u],
                                self.unit_offset[u] + self.unit_size[u])
    return flat.reshape(self.plan.units[u].shape)

  def _promoted(self, leaves, g):
    dts = [leaves[self.unit_leaf[u]].dtype
           for slot in self.slot_units[g] for u in slot]
    return jnp.result_type(*dts) if dts else jnp.dtype(self.dtypes[g])

  def unpack_full(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
    """Full leaves (``plan.leaves`` order) from all slots' buffers."""
    out = []
    for i, spec in enumerate(self.plan.leaves):
      mats = []
      for u in self.leaf_units[i]:
        g = self.unit_group[u]
        start = (self.plan.owners[u] * self.local_sizes[g]
                 + self.unit_offset[u])
        flat = jax.lax.slice_in_dim(buffers[g], start,
                                    start + self.unit_size[u])
        mats.append(flat.reshape(self.plan.units[u].shape))
      out.append(from_matrices(jnp.stack(mats), spec))
    return out

  def map_slot(self, buffers: Sequence[jax.Array], slot: int,
               fn: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, ...]:
    """Applies ``fn`` to a slot's matrices, batched by shape.

    Args:
      buffers: the slot's flat buffers, ``(local,)`` each.
      slot: the (static) slot whose layout to use.
      fn: ``fn(stack, tp_split)`` maps a ``(count, m, n)`` stack of
        matrices whose leaves have the same ``tp_split`` (see ``__init__``)
        to a stack of the same shape.

    Returns:
      The slot's flat buffers with every matrix replaced by ``fn``'s result
      and zero padding.
    """
    out = []
    for g, buf in enumerate(buffers):
      units = self.slot_units[g][slot]
      by_shape: dict[tuple, list[int]] = {}
      for u in units:
        key = (self.plan.units[u].shape, self.tp_splits[self.unit_leaf[u]])
        by_shape.setdefault(key, []).append(u)
      results = {}
      for (shape, split), group in by_shape.items():
        stack = jnp.stack([
            jax.lax.slice_in_dim(buf, self.unit_offset[u],
                                 self.unit_offset[u] + self.unit_size[u]
                                 ).reshape(shape) for u in group])
        for u, r in zip(group, fn(stack, split)):
          results[u] = r.reshape(-1)
      pieces = [results[u].astype(buf.dtype) for u in units]
      pad = self.local_sizes[g] - int(self.slot_used[g, slot])
      if pad or not pieces:
        pieces.append(jnp.zeros((pad,), buf.dtype))
      out.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
    return tuple(out)


class Exchange:
  """Static routes for sharded leaves: pieces to owners and back.

  A leaf sharded along one matrix dimension (one of its reduction or output
  axes) over some owner axes travels by ``all_to_all``: every device sends
  each owner its piece of the owner's matrices (one designated sender per
  piece: the device that matches the owner's coordinates on the axes the leaf
  is replicated over), and after Newton–Schulz each owner sends every device
  its piece of the results. Rows of the ``(num_slots, row)`` send buffers are
  destinations; a row lists the owner's matrices (plan order) piece by piece.
  Other leaves (replicated, or sharded in ways this does not cover) are
  gathered whole (see ``gathered``) and their results all-gathered from a
  compact per-owner buffer (``rep_*``).
  """

  def __init__(self, layout: Layout, entries: Sequence):
    """Builds the routes.

    Args:
      layout: the owner layout.
      entries: each target leaf's PartitionSpec (``plan.leaves`` order) as
        a list of per-dimension mesh-axis tuples.
    """
    plan = layout.plan
    self.layout = layout
    self.axes = plan.axis_names
    self.sizes = plan.mesh_shape
    n = plan.num_slots
    self.coords = [np.unravel_index(s, self.sizes) if self.sizes else ()
                   for s in range(n)]
    self.routed = {}  # leaf -> (axes, k, c, local unit shape, perm)
    self.gathered = set()  # leaves gathered whole before packing
    for i, spec in enumerate(plan.leaves):
      dims = [d for d, axes in enumerate(entries[i]) if axes]
      if not dims:
        continue
      d = dims[0]
      matrix_axes = spec.reduction_axes + spec.output_axes
      if len(dims) == 1 and d in matrix_axes:
        axes = entries[i][d]
        k = int(np.prod([self.sizes[self.axes.index(a)] for a in axes]))
        c = matrix_axes.index(d)
        unit_shape = [spec.shape[a] for a in matrix_axes]
        unit_shape[c] //= k
        self.routed[i] = (tuple(axes), k, c, tuple(unit_shape))
      else:
        self.gathered.add(i)
    g_count = layout.num_groups
    self.row_units = [[[] for _ in range(n)] for _ in range(g_count)]
    self.rep_units = [[[] for _ in range(n)] for _ in range(g_count)]
    self.row_off, self.rep_off = {}, {}
    row_used = np.zeros((g_count, n), np.int64)
    rep_used = np.zeros((g_count, n), np.int64)
    for g in range(g_count):
      for s in range(n):
        for u in layout.slot_units[g][s]:
          i = layout.unit_leaf[u]
          if i in self.routed:
            self.row_units[g][s].append(u)
            self.row_off[u] = int(row_used[g, s])
            row_used[g, s] += layout.unit_size[u] // self.routed[i][1]
          else:
            self.rep_units[g][s].append(u)
            self.rep_off[u] = int(rep_used[g, s])
            rep_used[g, s] += layout.unit_size[u]
    self.row_sizes = [int(row_used[g].max()) if n else 0
                      for g in range(g_count)]
    self.rep_sizes = [int(rep_used[g].max()) if n else 0
                      for g in range(g_count)]
    self.rep_used = rep_used

  def _linear(self, coords) -> int:
    return int(np.ravel_multi_index(tuple(coords), self.sizes))

  def _axis_pos(self, axes) -> list[int]:
    return [self.axes.index(a) for a in axes]

  def _block(self, slot: int, axes) -> int:
    """Row-major index of a slot's coordinates on ``axes``."""
    pos = self._axis_pos(axes)
    c = [int(self.coords[slot][p]) for p in pos]
    return int(np.ravel_multi_index(c, [self.sizes[p] for p in pos]))

  def _local_units(self, x: jax.Array, i: int) -> jax.Array:
    spec = self.layout.plan.leaves[i]
    perm = spec.batch_axes + spec.reduction_axes + spec.output_axes
    unit_shape = self.routed[i][3]
    return jnp.transpose(x, perm).reshape((spec.num_matrices,) + unit_shape)

  def send_to_owners(self, g: int, local_leaves: Sequence[jax.Array],
                     axis_index: Callable[[str], jax.Array], dtype
                     ) -> jax.Array:
    """This device's ``(num_slots, row)`` pieces for every owner."""
    layout = self.layout
    units = {i: self._local_units(local_leaves[i], i) for i in self.routed
             if any(layout.unit_leaf[u] == i for s in self.row_units[g]
                    for u in s)}
    rows = []
    for o in range(layout.num_slots):
      pieces = []
      for u in self.row_units[g][o]:
        i = layout.unit_leaf[u]
        piece = units[i][layout.unit_batch[u]].reshape(-1).astype(dtype)
        # Send only if this device matches the owner on the axes the leaf is
        # replicated over (one designated sender per piece).
        keep = None
        for p, a in enumerate(self.axes):
          if a in self.routed[i][0] or self.sizes[p] == 1:
            continue
          same = axis_index(a) == int(self.coords[o][p])
          keep = same if keep is None else keep & same
        if keep is not None:
          piece = jnp.where(keep, piece, jnp.zeros_like(piece))
        pieces.append(piece)
      rows.append(self._row(pieces, self.row_sizes[g], dtype))
    return jnp.stack(rows)

  @staticmethod
  def _row(pieces, size, dtype):
    used = sum(int(p.shape[0]) for p in pieces)
    if used < size or not pieces:
      pieces = list(pieces) + [jnp.zeros((size - used,), dtype)]
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]

  def assemble(self, g: int, recv: jax.Array, owner: int
               ) -> dict[int, jax.Array]:
    """The owner's full matrices from the pieces it received."""
    layout = self.layout
    out = {}
    for u in self.row_units[g][owner]:
      i = layout.unit_leaf[u]
      axes, k, c, unit_shape = self.routed[i]
      size = layout.unit_size[u] // k
      pos = self._axis_pos(axes)
      pieces = []
      for p in range(k):
        coords = list(self.coords[owner])
        for q, val in zip(pos, np.unravel_index(p, [self.sizes[q]
                                                     for q in pos])):
          coords[q] = int(val)
        sender = self._linear(coords)
        off = self.row_off[u]
        pieces.append(recv[sender, off:off + size].reshape(unit_shape))
      full = jnp.concatenate(pieces, axis=c)
      out[u] = full.reshape(layout.plan.units[u].shape)
    return out

  def send_back(self, g: int, buffers: Sequence[jax.Array], owner: int
                ) -> jax.Array:
    """The owner's ``(num_slots, row)`` result pieces for every device."""
    layout = self.layout
    dtype = buffers[g].dtype
    canon = {}
    for u in self.row_units[g][owner]:
      i = layout.unit_leaf[u]
      spec = layout.plan.leaves[i]
      full_shape = [spec.shape[a]
                    for a in spec.reduction_axes + spec.output_axes]
      canon[u] = layout.slot_matrix(buffers, u).reshape(full_shape)
    rows = []
    for d in range(layout.num_slots):
      pieces = []
      for u in self.row_units[g][owner]:
        axes, k, c, unit_shape = self.routed[layout.unit_leaf[u]]
        blk = self._block(d, axes)
        piece = jax.lax.slice_in_dim(canon[u], blk * unit_shape[c],
                                     (blk + 1) * unit_shape[c], axis=c)
        pieces.append(piece.reshape(-1))
      rows.append(self._row(pieces, self.row_sizes[g], dtype))
    return jnp.stack(rows)

  def local_leaf(self, i: int, recv: Sequence[jax.Array]) -> jax.Array:
    """This device's shard of routed leaf ``i`` from the results received."""
    layout = self.layout
    spec = layout.plan.leaves[i]
    axes, k, c, unit_shape = self.routed[i]
    mats = []
    for u in layout.leaf_units[i]:
      g = layout.unit_group[u]
      off = self.row_off[u]
      size = layout.unit_size[u] // k
      mats.append(recv[g][layout.plan.owners[u], off:off + size]
                  .reshape(unit_shape))
    perm = spec.batch_axes + spec.reduction_axes + spec.output_axes
    batch_shape = tuple(spec.shape[a] for a in spec.batch_axes)
    x = jnp.stack(mats).reshape(batch_shape + unit_shape)
    return jnp.transpose(x, tuple(np.argsort(perm)))

  def rep_pack(self, buffers: Sequence[jax.Array], slot: int, g: int
               ) -> jax.Array:
    """The slot's results of non-routed leaves, compactly, ``(rep,)``."""
    pieces = [self.layout.slot_matrix(buffers, u).reshape(-1)
              for u in self.rep_units[g][slot]]
    return self._row(pieces, self.rep_sizes[g], buffers[g].dtype)

  def rep_unpack(self, gathered: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """Full non-routed leaves from the all-gathered compact buffers."""
    layout = self.layout
    out = {}
    for i, spec in enumerate(layout.plan.leaves):
      if i in self.routed:
        continue
      mats = []
      for u in layout.leaf_units[i]:
        g = layout.unit_group[u]
        start = layout.plan.owners[u] * self.rep_sizes[g] + self.rep_off[u]
        flat = jax.lax.slice_in_dim(gathered[g], start,
                                    start + layout.unit_size[u])
        mats.append(flat.reshape(layout.plan.units[u].shape))
      out[i] = from_matrices(jnp.stack(mats), spec)
    return out
