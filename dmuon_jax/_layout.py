"""Static index maps between a param tree and per-shape owner buffers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _planner


@dataclasses.dataclass(frozen=True)
class Bucket:
  """All matrices of one ``(fan_in, fan_out)`` shape and dtype.

  The bucket's owner buffer has shape ``(num_slots * per_slot, m, n)``: rows
  ``[s * per_slot, (s + 1) * per_slot)`` belong to owner slot ``s``, so a
  buffer sharded over the slot axes puts every matrix on its owner. Slots with
  fewer matrices than ``per_slot`` hold zero padding rows.
  """

  shape: tuple[int, int]
  dtype: str
  per_slot: int
  leaf_ids: tuple[int, ...]  # positions in plan.leaves, in leaf order
  # For every buffer row: index into the concatenation of the bucket's
  # leaves' matrices, or -1 for a padding row.
  rows: tuple[int, ...]

  @property
  def num_rows(self) -> int:
    return len(self.rows)

  @property
  def num_padding(self) -> int:
    return sum(r < 0 for r in self.rows)


def _bucket_key(spec: _planner.LeafSpec, dtype) -> tuple:
  return (spec.matrix_shape, np.dtype(dtype).name)


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


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each matrix of a plan lives in the owner buffers."""

  plan: _planner.OwnershipPlan
  buckets: tuple[Bucket, ...]

  @classmethod
  def build(cls, plan: _planner.OwnershipPlan,
            dtypes: Sequence) -> Layout:
    """Groups the plan's matrices into owner buffers.

    Args:
      plan: the ownership plan.
      dtypes: the buffer dtype of each of ``plan.leaves``.

    Returns:
      A :class:`Layout`.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (spec, dtype) in enumerate(zip(plan.leaves, dtypes, strict=True)):
      groups.setdefault(_bucket_key(spec, dtype), []).append(i)
    leaf_pos = {spec.leaf_index: i for i, spec in enumerate(plan.leaves)}
    buckets = []
    for key in sorted(groups):
      leaf_ids = groups[key]
      # Offset of each leaf's first matrix in the bucket's concatenation.
      offsets, total = {}, 0
      for i in leaf_ids:
        offsets[i] = total
        total += plan.leaves[i].num_matrices
      per_owner: list[list[int]] = [[] for _ in range(plan.num_slots)]
      for unit, owner in zip(plan.units, plan.owners, strict=True):
        i = leaf_pos[unit.leaf_index]
        if i not in offsets:
          continue
        spec = plan.leaves[i]
        flat = int(np.ravel_multi_index(
            unit.batch_index, [spec.shape[a] for a in spec.batch_axes]
        )) if unit.batch_index else 0
        per_owner[owner].append(offsets[i] + flat)
      per_slot = max(1, max(len(u) for u in per_owner))
      rows = []
      for owned in per_owner:
        rows.extend(owned + [-1] * (per_slot - len(owned)))
      buckets.append(Bucket(shape=key[0], dtype=key[1], per_slot=per_slot,
                            leaf_ids=tuple(leaf_ids), rows=tuple(rows)))
    return cls(plan=plan, buckets=tuple(buckets))

  def buffer_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(
        jax.ShapeDtypeStruct((b.num_rows,) + b.shape, jnp.dtype(b.dtype))
        for b in self.buckets)

  def zeros(self) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros(s.shape, s.dtype) for s in self.buffer_shapes())

  def pack(self, leaves: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Gathers target leaves into owner buffers.

    Args:
      leaves: ``jax.tree.leaves`` of a tree shaped like the plan's params.

    Returns:
      One ``(num_rows, m, n)`` buffer per bucket, in the leaves' (promoted)
      dtype.
    """
    out = []
    for b in self.buckets:
      mats = [to_matrices(leaves[self.plan.leaves[i].leaf_index],
                          self.plan.leaves[i]) for i in b.leaf_ids]
      src = jnp.concatenate(mats, axis=0) if len(mats) > 1 else mats[0]
      rows = np.asarray(b.rows)
      if (rows >= 0).all() and (rows == np.arange(len(rows))).all():
        out.append(src)
        continue
      # Padding rows read an appended zero matrix.
      src = jnp.concatenate([src, jnp.zeros((1,) + b.shape, src.dtype)])
      out.append(jnp.take(src, np.where(rows < 0, src.shape[0] - 1, rows),
                          axis=0))
    return tuple(out)

  def unpack(self, buffers: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """Scatters owner buffers back to leaves.

    Args:
      buffers: one buffer per bucket, as returned by :meth:`pack`.

    Returns:
      A dict from leaf index (in ``jax.tree.leaves`` order) to the leaf-shaped
      array.
    """
    out = {}
    for b, buf in zip(self.buckets, buffers, strict=True):
      rows = np.asarray(b.rows)
      # inverse[j] = buffer row holding the bucket's j-th matrix.
      inverse = np.empty(int((rows >= 0).sum()), np.int64)
      inverse[rows[rows >= 0]] = np.nonzero(rows >= 0)[0]
      start = 0
      for i in b.leaf_ids:
        spec = self.plan.leaves[i]
        idx = inverse[start:start + spec.num_matrices]
        start += spec.num_matrices
        if (idx == np.arange(idx[0], idx[0] + len(idx))).all():
          mats = jax.lax.slice_in_dim(buf, int(idx[0]), int(idx[0]) + len(idx))
        else:
          mats = jnp.take(buf, idx, axis=0)
        out[spec.leaf_index] = from_matrices(mats, spec)
    return out


def num_elements(layout: Layout) -> int:
  """Total elements of all owner buffers, padding included."""
  return sum(b.num_rows * math.prod(b.shape) for b in layout.buckets)
