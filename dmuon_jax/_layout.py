"""Where each matrix of a plan lives in its owner's flat buffers.

A :class:`Layout` places the matrices of one plan (one gather group of
dedicated mode, or all Muon targets of ``dmuon``) in per-slot flat buffers;
``_owner_layout.OwnerLayout`` combines them into a state's whole layout.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _gather, _plan, _routing


def to_matrices(x: jax.Array, spec: _routing.LeafSpec) -> jax.Array:
  """Reshapes a leaf to ``(num_matrices, fan_in, fan_out)`` (for a sliced
  spec: its slices, from the leaf in its own shape)."""
  perm = spec.batch_axes + spec.reduction_axes + spec.output_axes
  x = x.reshape(spec.shape)
  return jnp.transpose(x, perm).reshape(
    (spec.num_matrices,) + spec.matrix_shape
  )


def from_matrices(x: jax.Array, spec: _routing.LeafSpec) -> jax.Array:
  """Inverse of :func:`to_matrices`."""
  perm = spec.batch_axes + spec.reduction_axes + spec.output_axes
  x = x.reshape(tuple(spec.shape[a] for a in perm))
  return jnp.transpose(x, tuple(np.argsort(perm))).reshape(spec.leaf_shape)


def unit_table(per_slot: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
  """``(num_slots, 1 + columns * width)`` int table: per slot its count,
  then each column's values, padded to the most any slot has, and to at
  least two, with a value no slot reads in that column: a loop that reads
  the same value at every index (a one-entry column, or one whose entries
  are all equal) is invariant to XLA, which then hoists its work out of the
  loop, to run on every device whatever its trip count, 0 included.

  Args:
    per_slot: per slot, per column, the values (one per item).
  """
  cols = max((len(c) for c in per_slot), default=0)
  width = max([2] + [len(v) for c in per_slot for v in c])
  out = np.zeros((len(per_slot), 1 + cols * width), np.int64)
  for j in range(cols):  # Padding, never read, unlike every entry read.
    pad = max((max(c[j], default=-1) for c in per_slot if c), default=-1)
    out[:, 1 + j * width : 1 + (j + 1) * width] = pad + 1
  for s, columns in enumerate(per_slot):
    out[s, 0] = len(columns[0]) if columns else 0
    for j, values in enumerate(columns):
      out[s, 1 + j * width : 1 + j * width + len(values)] = values
  return out


def units_table(per_slot: Sequence[Sequence[int]], *columns) -> np.ndarray:
  """The :func:`unit_table` of each slot's units (``per_slot``), one column
  per ``columns`` entry (unit -> value: a list or a dict)."""
  return unit_table([[[c[u] for u in us] for c in columns] for us in per_slot])


def typed_table(per_slot: Sequence[Sequence[Sequence[int]]]):
  """``(table, trips)`` of one type of a slot's items: its
  :func:`unit_table`, and the items per slot where every slot holds
  equally many (a constant of the program; else None: a loop reads the
  count from the table)."""
  counts = {len(columns[0]) if columns else 0 for columns in per_slot}
  return unit_table(per_slot), (counts.pop() if len(counts) == 1 else None)


def table_columns(row, columns: int):
  """``(count, [column values])`` of one slot's row of a :func:`unit_table`
  (numpy or traced)."""
  width = max((row.shape[0] - 1) // max(columns, 1), 1)
  return row[0], [
    row[1 + j * width : 1 + (j + 1) * width] for j in range(columns)
  ]


def write_at(buf: jax.Array, row, get: Callable, back=False) -> jax.Array:
  """``buf`` with ``get(a)`` (in ``buf``'s dtype, flattened but for its
  leading dims) written at offset ``o`` of its last dim for each ``(a, o)``
  of a two-column :func:`unit_table` row (numpy or traced); ``back``: each
  ``(o, a)`` (the row of a forward copy, copied back)."""
  count, cols = table_columns(row, 2)

  def put(b, a, o):
    m = get(a).reshape(b.shape[:-1] + (-1,)).astype(b.dtype)
    return jax.lax.dynamic_update_slice_in_dim(b, m, o, b.ndim - 1)

  return _gather.for_each(count, cols[::-1] if back else cols, put, buf)


class SlotWork(NamedTuple):
  """Every slot's matrices by type (see :meth:`Layout.slot_work`).

  Attributes:
    buckets: per dtype group, one bucket per type, its ``units`` a
      representative unit repeated once per matrix of a chunk.
    offsets: per type (buckets in order), a :func:`unit_table` per slot:
      its count of chunks, then per matrix of a chunk the offsets.
    trips: per type, its chunks per slot where every slot holds equally
      many (a constant of the program), else None (read from the table).
  """

  buckets: list
  offsets: list
  trips: list


class Bucket(NamedTuple):
  """Matrices of one slot that are orthogonalized as one stack."""

  shape: tuple[int, int]  # (fan_in, fan_out) of one TP shard's slice
  tp_split: int | None  # -1 columns / -2 rows split over TP, or None
  dtype: str  # the params' dtype
  units: tuple[int, ...]  # unit indices, in buffer order
  grouped: bool = False  # slices of owner groups (see _plan.OwnerGroup)
  # A zero-padded leaf's (see Layout.crops): the rows and columns of its
  # padded matrices that hold the param, or None.
  crop: tuple[np.ndarray, np.ndarray] | None = None


def _crop(
  spec: _routing.LeafSpec,
  logical: tuple[int, ...] | None,
  tp_split: int | None,
) -> tuple[np.ndarray, np.ndarray] | None:
  """The rows and columns of a padded leaf's matrices that hold the param
  (flat indices into the padded fan-in and fan-out), or None.

  Newton–Schulz of a zero-padded matrix is the zero-padded Newton–Schulz of
  the matrix, but not bit for bit: orientation and the direct-vs-Gram
  choice follow the shape. The owner orthogonalizes the param's own rows
  and columns (these), so that the numbers are those of the unpadded
  matrix. TP-split leaves keep their padding (their slices are
  orthogonalized together, by Gram Newton–Schulz, whatever the shape).
  """
  if logical is None or tp_split is not None or spec.sliced:
    return None

  def flat(axes):
    padded = [spec.shape[a] for a in axes]
    grid = np.indices([logical[a] for a in axes]).reshape(len(axes), -1)
    return np.ravel_multi_index(grid, padded).astype(np.int32)

  return flat(spec.reduction_axes), flat(spec.output_axes)


def _index(idx: np.ndarray):
  """A slice for a prefix ``0..k-1``, else the index array."""
  if np.array_equal(idx, np.arange(len(idx))):
    return slice(0, len(idx))
  return jnp.asarray(idx)


def crop_stack(x: jax.Array, crop) -> jax.Array:
  """The param's own rows and columns of a ``(count, m, n)`` stack of
  padded matrices (``crop``: a :attr:`Bucket.crop`)."""
  rows, cols = crop
  return x[:, _index(rows)][:, :, _index(cols)]


def uncrop_stack(y: jax.Array, crop, shape: Sequence[int]) -> jax.Array:
  """Inverse of :func:`crop_stack`: ``y`` placed in zeros of ``shape``."""
  rows, cols = crop
  r, c = _index(rows), _index(cols)
  out = jnp.zeros(tuple(shape), y.dtype)
  if isinstance(r, slice) and isinstance(c, slice):
    return out.at[:, r, c].set(y)
  r = jnp.arange(len(rows)) if isinstance(r, slice) else r
  c = jnp.arange(len(cols)) if isinstance(c, slice) else c
  return out.at[:, r[:, None], c[None, :]].set(y)


class Layout:
  """Where each matrix of a plan lives in its owner's flat buffer.

  Matrices are grouped by buffer dtype. For each group every owner slot has
  one flat buffer of ``local_size`` elements holding its own matrices back to
  back (in plan order), then zero padding up to the largest slot's total. The
  global buffer is ``(num_slots * local_size,)``: sharded over the slot axes,
  each device's block is exactly its own matrices, with no per-shape padding.
  Layouts are equal (and hash equal) when their plans, dtypes and TP splits
  are.
  """

  def __init__(
    self,
    plan: _plan.OwnershipPlan,
    dtype_of: Mapping[int, Any],
    split_of: Mapping[int, int | None] | None = None,
    logical_of: Mapping[int, tuple[int, ...]] | None = None,
  ):
    """Builds the layout.

    Args:
      plan: the ownership plan.
      dtype_of: leaf index -> the buffer dtype of each of ``plan.leaves``.
      split_of: leaf index -> None, or the matrix axis (-1 columns, -2
        rows) that a tensor-parallel mesh axis splits; the plan then holds
        each TP shard's slice (see ``_staged``). Default: none split.
      logical_of: leaf index -> the param's own (whole) shape where the
        plan holds it zero-padded (an unevenly sharded leaf, padded to a
        multiple of its devices per sharded dimension).
    """
    self.plan = plan
    self.num_slots = plan.num_slots
    self.leaf_index = tuple(spec.leaf_index for spec in plan.leaves)
    names = tuple(np.dtype(dtype_of[i]).name for i in self.leaf_index)
    self.leaf_dtypes, self.dtypes = names, tuple(sorted(set(names)))
    self.tp_splits = tuple((split_of or {}).get(i) for i in self.leaf_index)
    self.logical = tuple((logical_of or {}).get(i) for i in self.leaf_index)
    pos = {i: k for k, i in enumerate(self.leaf_index)}
    self.unit_leaf = [pos[u.leaf_index] for u in plan.units]
    self.unit_group = [self.dtypes.index(names[i]) for i in self.unit_leaf]
    self.unit_size = [math.prod(u.shape) for u in plan.units]
    self.unit_batch = [
      int(np.ravel_multi_index(u.batch_index, plan.leaves[i].batch_shape))
      if u.batch_index
      else 0
      for u, i in zip(plan.units, self.unit_leaf)
    ]
    self.unit_offset = []
    # slot_units[g][s]: unit indices of group g owned by slot s, in order;
    # leaf_units[i]: unit indices of plan.leaves[i] by flat batch index.
    self.slot_units = [[[] for _ in range(self.num_slots)] for _ in self.dtypes]
    self.leaf_units = [[] for _ in plan.leaves]
    used = self.slot_used = np.zeros((len(self.dtypes), self.num_slots), int)
    for u, (g, owner) in enumerate(zip(self.unit_group, plan.owners)):
      self.leaf_units[self.unit_leaf[u]].append(u)
      self.slot_units[g][owner].append(u)
      self.unit_offset.append(int(used[g, owner]))
      used[g, owner] += self.unit_size[u]
    self.local_sizes = tuple(max(1, int(m)) for m in used.max(1))
    if self.num_slots > 1 and not self.dynamic:
      warnings.warn(
        f'dmuon: a device owns {max(self.local_sizes):,} elements of one '
        'dtype, past int32 offsets (2**31 - 1): the update reads each '
        "device's offsets as constants of its own lax.switch branch, so "
        'the compiled program grows with the number of devices (a branch '
        'body per device with distinct offsets). Spread the Muon matrices '
        'over more owner devices, so that each owns fewer than 2**31 '
        'elements per dtype, for one program on every device.',
        stacklevel=2,
      )
    self.crops = [
      _crop(spec, shape, split)
      for spec, shape, split in zip(plan.leaves, self.logical, self.tp_splits)
    ]
    self._key = (plan, names, self.tp_splits, self.logical)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Layout) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  @property
  def num_groups(self) -> int:
    return len(self.dtypes)

  def pack_full(self, leaves: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """All slots' buffers, concatenated: one ``(num_slots * local,)`` each
    (one slot's: its ``(local,)`` buffers), in the leaves' promoted dtype.

    Args:
      leaves: the full (unsharded) target leaves, in ``plan.leaves`` order.

    Returns:
      One flat buffer per dtype group.
    """
    # Each leaf's matrices, made where first read.
    mats = functools.cache(
      lambda i: to_matrices(leaves[i], self.plan.leaves[i])
    )
    get = lambda u: mats(self.unit_leaf[u])[self.unit_batch[u]]
    out = []
    for g, slots in enumerate(self.slot_units):
      dt = self.promoted(leaves, g)
      blocks = []
      for s, units in enumerate(slots):
        pieces = [get(u).reshape(-1).astype(dt) for u in units]
        pad = self.local_sizes[g] - int(self.slot_used[g, s])
        if pad:  # local_sizes >= 1: a slot without units is padding
          pieces.append(jnp.zeros((pad,), dt))
        blocks.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
      out.append(jnp.concatenate(blocks))
    return tuple(out)

  def promoted(self, leaves, g):
    """The promoted dtype of dtype group ``g``'s leaves."""
    name = self.dtypes[g]
    dts = [x.dtype for x, d in zip(leaves, self.leaf_dtypes) if d == name]
    return jnp.result_type(*dts)  # every dtype group holds a leaf

  def unpack_full(
    self, buffers: Sequence[jax.Array], leaves=None, sizes=None, offsets=None
  ) -> list[jax.Array]:
    """Full leaves from all slots' buffers (slot-major).

    Args:
      buffers: one per dtype group, every slot's block.
      leaves: the plan leaves to read (default all), in that order.
      sizes: per dtype group, a slot's block size (default
        ``local_sizes``).
      offsets: per unit, its offset in its slot's block (default
        ``unit_offset``).
    """
    sizes = self.local_sizes if sizes is None else sizes
    offsets = self.unit_offset if offsets is None else offsets
    out = []
    for i in range(len(self.plan.leaves)) if leaves is None else leaves:
      spec, mats = self.plan.leaves[i], []
      for u in self.leaf_units[i]:
        g = self.unit_group[u]
        start = self.plan.owners[u] * sizes[g] + offsets[u]
        flat = jax.lax.slice_in_dim(
          buffers[g], start, start + self.unit_size[u]
        )
        mats.append(flat.reshape(self.plan.units[u].shape))
      out.append(from_matrices(jnp.stack(mats), spec))
    return out

  def _unit_key(self, u: int) -> tuple:
    """What unit ``u`` shares with the others of its bucket: (shape, TP
    split, the params' dtype, grouped, the padding's crop as bytes)."""
    leaf, crop = self.unit_leaf[u], self.crops[self.unit_leaf[u]]
    return (
      self.plan.units[u].shape,
      self.tp_splits[leaf],
      self.plan.leaves[leaf].dtype,
      self.plan.units[u].group >= 0,
      None if crop is None else (crop[0].tobytes(), crop[1].tobytes()),
    )

  def buckets(self, g: int, slot: int) -> list[Bucket]:
    """A slot's matrices of dtype group ``g``, by (shape, TP split, the
    params' dtype, the padding)."""
    by_key: dict[tuple, list[int]] = {}
    for u in self.slot_units[g][slot]:
      by_key.setdefault(self._unit_key(u), []).append(u)
    return [
      Bucket(*key[:3], tuple(us), key[3], self.crops[self.unit_leaf[us[0]]])
      for key, us in by_key.items()
    ]

  @property
  def dynamic(self) -> bool:
    """Whether offsets into this layout's buffers fit in int32 (read from
    tables at run time; else they are constants of per-slot branches)."""
    return max(self.local_sizes, default=0) < _gather.INDEX_LIMIT

  def slot_work(self, unit_extra: Callable, keep: Callable) -> SlotWork:
    """The slots' matrices by type: one program for every slot, each
    slot's matrices of a type and their offsets read from a table.

    A type is what a bucket holds (shape, TP split, dtype, padding) plus
    ``unit_extra(u)`` (the facts the caller reads of a unit beyond its
    bucket, e.g. the whole matrix's shape): it follows the model, not the
    number of slots. Each slot runs a type's matrices in chunks (batches
    of equal-shape matrices) as large as the fewest any slot holds, as
    many as fit, then the rest one at a time: one chunk where the slots
    hold equally many.

    Args:
      unit_extra: ``unit_extra(u)``, hashable and orderable.
      keep: ``keep(bucket)``: whether to keep a bucket's units.
    """
    found: dict[tuple, tuple] = {}
    for s in range(self.num_slots):
      for g in range(self.num_groups):
        for b in filter(keep, self.buckets(g, s)):
          for u in b.units:
            key = repr(self._unit_key(u) + (unit_extra(u),))
            _, per = found.setdefault((g, key), (b, {}))
            per.setdefault(s, []).append(u)
    buckets: list[list[Bucket]] = [[] for _ in range(self.num_groups)]
    tables, trips = [], []
    for g, rkey in sorted(found):
      b, per = found[g, rkey]
      offsets = [
        sorted(self.unit_offset[u] for u in per.get(s, ()))
        for s in range(self.num_slots)
      ]
      rep = min(map(min, per.values()))
      # Chunks of the fewest any slot holds, then the rest one at a time.
      width = min(len(o) for o in offsets if o)
      cut = [len(o) - len(o) % width for o in offsets]
      split = [(width, [o[:c] for o, c in zip(offsets, cut)])]
      if any(len(o) > c for o, c in zip(offsets, cut)):
        split.append((1, [o[c:] for o, c in zip(offsets, cut)]))
      for size, parts in split:
        buckets[g].append(b._replace(units=(rep,) * size))
        table, trip = typed_table(
          [[o[j::size] for j in range(size)] for o in parts]
        )
        tables.append(table)
        trips.append(trip)
    return SlotWork(buckets, tables, trips)

  def matrix_at(self, buffer: jax.Array, offset, shape) -> jax.Array:
    """The ``shape`` matrix at ``offset`` (int or traced) of a flat buffer."""
    flat = jax.lax.dynamic_slice_in_dim(buffer, offset, shape[0] * shape[1])
    return flat.reshape(shape)

  def map_slot_at(
    self,
    operands: Sequence[Sequence[jax.Array]],
    work: SlotWork,
    rows: Sequence,
    fn: Callable[..., jax.Array],
  ) -> tuple[jax.Array, ...]:
    """Applies ``fn`` to one slot's matrices, a chunk of a type at a time.

    Args:
      operands: one or more tuples of the slot's flat buffers (``(local,)``
        each, one per dtype group), all laid out by this layout; the first
        gives the result dtype.
      work: the :meth:`slot_work`.
      rows: the slot's rows of ``work.offsets`` (numpy, or read at run
        time).
      fn: ``fn(stacks, bucket)``: ``stacks`` holds one ``(count, m, n)``
        stack per operand, for a chunk of ``bucket``'s type; returns a
        stack of the same shape.

    Returns:
      The slot's flat buffers with every matrix of ``work`` replaced by
      ``fn``'s result, zeros elsewhere.
    """
    # Made when the operands are (see _gather.zero_after), not at the
    # start of the step.
    tie = _gather.zero_after(*operands[0])
    out = [
      jnp.zeros((self.local_sizes[g],), buf.dtype) + tie.astype(buf.dtype)
      for g, buf in enumerate(operands[0])
    ]
    typed = [(g, b) for g, bs in enumerate(work.buckets) for b in bs]
    for (g, bucket), row, trips in zip(typed, rows, work.trips):
      count, cols = table_columns(row, len(bucket.units))

      def chunk(result, *offs, g=g, bucket=bucket):
        stacks = tuple(
          _gather.in_loop(
            jnp.stack([self.matrix_at(ops[g], o, bucket.shape) for o in offs]),
            result,
          )
          for ops in operands
        )
        for o, r in zip(offs, fn(stacks, bucket)):
          result = jax.lax.dynamic_update_slice_in_dim(
            result, r.reshape(-1).astype(result.dtype), o, 0
          )
        return result

      trips = count if trips is None else trips
      out[g] = _gather.for_each(trips, cols, chunk, out[g], like=operands)
    return tuple(out)

  def whole_tables(self, leaves: Sequence[int]) -> list[np.ndarray]:
    """Per leaf of ``leaves`` (plan leaf indices), a :func:`unit_table` of
    each slot's units of it: (batch index, offset in its buffer)."""
    owned = lambda i, s: [
      u for u in self.leaf_units[i] if self.plan.owners[u] == s
    ]
    return [
      units_table(
        [owned(i, s) for s in range(self.num_slots)],
        self.unit_batch,
        self.unit_offset,
      )
      for i in leaves
    ]

  def pack_whole_at(
    self,
    bufs: list[jax.Array],
    leaf_matrices: dict[int, jax.Array],
    leaves: Sequence[int],
    rows: Sequence,
  ) -> list[jax.Array]:
    """``bufs`` with a slot's units of whole ``leaves`` written in:
    ``leaf_matrices[i]`` holds leaf ``i``'s matrices (``to_matrices``),
    ``rows`` the slot's rows of :meth:`whole_tables`."""
    for i, row in zip(leaves, rows):
      g = self.unit_group[self.leaf_units[i][0]]
      take = functools.partial(
        jax.lax.dynamic_index_in_dim, leaf_matrices[i], keepdims=False
      )
      bufs[g] = write_at(bufs[g], row, take)
    return bufs


class MomentumSegments(NamedTuple):
  """Where a scanned stack's momentum keeps what each owner slot holds
  (see :attr:`OwnerLayout.momentum_segments`); the methods take a slot
  (an int, or traced: this device's inside ``shard_map``).

  Attributes:
    iterations: ``(num_slots, segments)``: per slot, the scan iteration of
      each of its segments (the stack's iterations for none).
    offsets: per dtype group, ``(num_slots, segments)``: where each segment
      starts in the slot's momentum.
    sizes: per dtype group, ``(num_slots, segments)``: its elements (the
      start of the iteration's row of the owned buffer).
    widths: per dtype group, the elements of a slot's momentum (the
      busiest slot's).
    length: the stack's scan iterations.
  """

  iterations: np.ndarray
  offsets: tuple[np.ndarray, ...]
  sizes: tuple[np.ndarray, ...]
  widths: tuple[int, ...]
  length: int

  def rows(self, x: jax.Array, slot) -> jax.Array:
    """A slot's rows ``(iterations, local)`` -> those of its segments'
    iterations ``(segments, local)`` (zeros for no segment)."""
    its = jnp.asarray(self.iterations)[slot]
    return jnp.take(x, its, 0, mode='fill', fill_value=0)

  def expand(self, rows: jax.Array, slot) -> jax.Array:
    """Inverse of :meth:`rows`: ``(iterations, local)``, zeros elsewhere."""
    its = jnp.asarray(self.iterations)[slot]
    shape = (self.length,) + rows.shape[1:]
    return jnp.zeros(shape, rows.dtype).at[its].set(rows, mode='drop')

  def _index(self, d: int, slot, local: int):
    cols = jnp.arange(local)
    off = jnp.asarray(self.offsets[d])[slot][:, None]
    valid = cols < jnp.asarray(self.sizes[d])[slot][:, None]
    return off + cols, valid

  def compact(self, d: int, rows: jax.Array, slot) -> jax.Array:
    """Dtype group ``d``'s segment rows ``(segments, local)`` -> the
    slot's momentum ``(width,)``: each segment's elements in turn."""
    idx, valid = self._index(d, slot, rows.shape[1])
    idx = jnp.where(valid, idx, self.widths[d])  # (out of range: dropped)
    flat = jnp.zeros((self.widths[d],), rows.dtype)
    return flat.at[idx].set(rows, mode='drop')

  def segment_rows(self, d: int, flat: jax.Array, slot, local: int):
    """Inverse of :meth:`compact`: ``(segments, local)``, zeros past each
    segment."""
    idx, valid = self._index(d, slot, local)
    got = jnp.take(flat, jnp.where(valid, idx, 0), 0)
    return jnp.where(valid, got, jnp.zeros((), flat.dtype))
