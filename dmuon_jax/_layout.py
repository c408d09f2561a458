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

  def __init__(self, plan: _planner.OwnershipPlan, dtypes: Sequence):
    """Builds the layout.

    Args:
      plan: the ownership plan.
      dtypes: the buffer dtype of each of ``plan.leaves``.
    """
    self.plan = plan
    self.num_slots = plan.num_slots
    names = [np.dtype(d).name for d in dtypes]
    self.dtypes = tuple(sorted(set(names)))
    pos = {spec.leaf_index: i for i, spec in enumerate(plan.leaves)}
    n = len(plan.units)
    self.unit_leaf = [pos[u.leaf_index] for u in plan.units]
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

  def padding_fraction(self) -> float:
    """Padding elements over payload elements, all groups together."""
    total = sum(self.num_slots * size for size in self.local_sizes)
    payload = int(self.slot_used.sum())
    return (total - payload) / max(payload, 1)

  def _unit_matrices(self, leaves: Sequence[jax.Array]) -> Callable:
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
    get = self._unit_matrices(leaves)
    out = []
    for g in range(self.num_groups):
      dt = dtype or self._promoted(leaves, g)
      out.append(jnp.concatenate(
          [self._flat_slot(get, g, s, dt) for s in range(self.num_slots)]))
    return tuple(out)

  def pack_slot(self, leaves: Sequence[jax.Array], slot: int, dtype=None
                ) -> tuple[jax.Array, ...]:
    """One slot's buffers, ``(local,)`` each, from full leaves."""
    get = self._unit_matrices(leaves)
    return tuple(
        self._flat_slot(get, g, slot, dtype or self._promoted(leaves, g))
        for g in range(self.num_groups))

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
      fn: maps a ``(count, m, n)`` stack to a stack of the same shape.

    Returns:
      The slot's flat buffers with every matrix replaced by ``fn``'s result
      and zero padding.
    """
    out = []
    for g, buf in enumerate(buffers):
      units = self.slot_units[g][slot]
      by_shape: dict[tuple[int, int], list[int]] = {}
      for u in units:
        by_shape.setdefault(self.plan.units[u].shape, []).append(u)
      results = {}
      for shape, group in by_shape.items():
        stack = jnp.stack([
            jax.lax.slice_in_dim(buf, self.unit_offset[u],
                                 self.unit_offset[u] + self.unit_size[u]
                                 ).reshape(shape) for u in group])
        for u, r in zip(group, fn(stack)):
          results[u] = r.reshape(-1)
      pieces = [results[u].astype(buf.dtype) for u in units]
      pad = self.local_sizes[g] - int(self.slot_used[g, slot])
      if pad or not pieces:
        pieces.append(jnp.zeros((pad,), buf.dtype))
      out.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
    return tuple(out)
