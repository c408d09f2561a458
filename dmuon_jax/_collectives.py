"""Collectives and sharding helpers used inside ``jax.shard_map`` bodies."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def manual_axes() -> frozenset[str]:
  """Mesh axes that are manual here (i.e. we are inside ``shard_map``)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return frozenset()
  return frozenset(
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind == jax.sharding.AxisType.Manual)


def varying_axes(x) -> frozenset[str]:
  """Manual axes over which ``x`` differs between devices (its vma type)."""
  kind = getattr(jax.typeof(x), 'manual_axis_type', None)
  return frozenset(getattr(kind, 'varying', ()) or ())


def spec_entries(spec: P | None) -> list[tuple[str, ...]]:
  """The mesh axes of each dimension of a PartitionSpec, as tuples."""
  out = []
  for entry in tuple(spec or ()):
    if entry is None:
      out.append(())
    elif isinstance(entry, str):
      out.append((entry,))
    else:
      out.append(tuple(entry))
  return out


def spec_of(x, explicit: bool) -> P | None:
  """The PartitionSpec of an array or tracer, when it can be known.

  Args:
    x: an array or tracer.
    explicit: whether the mesh has explicit axes
      (``jax.sharding.AxisType.Explicit``), so that tracers carry their
      sharding in their type (an unsharded type then means replicated).

  Returns:
    The spec of a concrete array's ``NamedSharding``, a tracer's spec under
    an explicit mesh, else None (unknown).
  """
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    sharding = x.sharding
    return sharding.spec if isinstance(sharding, NamedSharding) else P()
  if not explicit:
    return None
  sharding = jax.typeof(x).sharding
  if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
    return P()
  return sharding.spec


def is_explicit(mesh) -> bool:
  """Whether a mesh has explicit axes (sharding in types)."""
  return mesh is not None and any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def to_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` (a no-op where it already is)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to='varying') if missing else x


def switch_by_slot(axes: Sequence[str], branches, *operands, shift=0):
  """``lax.switch`` on this device's owner slot, one branch per slot.

  Branch outputs are marked as varying over ``axes`` so that all branches
  have the same type under ``shard_map``'s replication checking. With
  ``shift`` (an int or traced scalar) the branch is
  ``(slot - shift) mod len(branches)``.
  """
  def wrap(branch):
    return lambda *ops: jax.tree.map(lambda y: to_varying(y, axes),
                                     branch(*ops))
  index = slot_index(axes)
  if not isinstance(shift, int) or shift:
    index = (index - shift) % len(branches)
  return jax.lax.switch(index, [wrap(b) for b in branches], *operands)


def slot_index(axes: Sequence[str]) -> jax.Array:
  """Row-major index of this device over ``axes`` (the owner slot)."""
  return jax.lax.axis_index(tuple(axes))


def reduce_scatter_to_owners(buf: jax.Array, axes: Sequence[str],
                             sizes: Sequence[int]) -> jax.Array:
  """Sums per-device buffers and leaves each device its own block.

  ``buf`` holds one block per slot, slot-major over ``axes`` (row-major). The
  reduction runs one ``psum_scatter`` per axis, innermost first: on a
  ``('replicate', 'shard')`` mesh, over ``'shard'`` and then over
  ``'replicate'`` (HSDP's two stages).

  Args:
    buf: ``(prod(sizes) * local,)``, varying over ``axes``.
    axes: the slot axes.
    sizes: their sizes.

  Returns:
    ``(local,)``: the sum over all devices of this device's block.
  """
  local = buf.shape[0] // math.prod(sizes)
  x = buf.reshape(tuple(sizes) + (local,))
  # Reverse the axis order so that the innermost axis is the leading one.
  x = x.transpose(tuple(reversed(range(len(sizes)))) + (len(sizes),))
  x = x.reshape(-1)
  for axis, size in zip(reversed(axes), reversed(sizes)):
    if size > 1:
      x = jax.lax.psum_scatter(x, axis, tiled=True)
    else:
      x = x.reshape(1, -1)[0]
  return x


def gather_from_owners(local: jax.Array, axes: Sequence[str]) -> jax.Array:
  """All-gathers every slot's block, replicated on every device."""
  return jax.lax.all_gather(local, tuple(axes), tiled=True, to='invarying')


def gather_shards(x: jax.Array, spec: P | None) -> jax.Array:
  """The full array from this device's shard (one all-gather per dim)."""
  for dim, axes in enumerate(spec_entries(spec)):
    if axes:
      x = jax.lax.all_gather(x, axes, axis=dim, tiled=True, to='invarying')
  return x


def local_shard(x: jax.Array, spec: P | None,
                mesh_sizes: dict[str, int]) -> jax.Array:
  """This device's shard of a full (replicated) array."""
  for dim, axes in enumerate(spec_entries(spec)):
    if axes:
      n = math.prod(mesh_sizes[a] for a in axes)
      size = x.shape[dim] // n
      x = jax.lax.dynamic_slice_in_dim(
          x, jax.lax.axis_index(axes) * size, size, axis=dim)
  return x


def check_spec(spec: P | None, shape: Sequence[int],
               mesh_sizes: dict[str, int], path: str) -> None:
  """Raises if a leaf's sharding does not fit the mesh."""
  entries = spec_entries(spec)
  for dim, axes in enumerate(entries):
    for a in axes:
      if a not in mesh_sizes:
        raise ValueError(
            f'dmuon: param {path!r} is sharded over mesh axis {a!r} (spec '
            f'{spec}), which is not one of the axes dmuon owns matrices over '
            f'{tuple(mesh_sizes)}. Shard it over those axes (or replicate '
            'it), or pass the mesh it lives on as mesh= / axis_names=.')
    n = math.prod(mesh_sizes[a] for a in axes) if axes else 1
    if dim < len(shape) and shape[dim] % n:
      raise ValueError(
          f'dmuon: param {path!r} has shape {tuple(shape)}; dim {dim} is not '
          f'divisible by the {n} devices of mesh axes {axes}. Pad it, or '
          'replicate it.')
  if len(entries) > len(shape):
    raise ValueError(
        f'dmuon: param {path!r} of rank {len(shape)} has a sharding spec '
        f'{spec} with more entries than dims.')
