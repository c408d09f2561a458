"""Collectives and sharding helpers used inside ``jax.shard_map`` bodies."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The one ambient value, and why: dmuon_jax.flax.train_step runs the user's
# step function inside its shard_map, and that function (not dmuon) calls the
# optimizer's update, so no argument can carry "these gradients are sums over
# these axes" from the step to the update; JAX tracing offers no other
# channel (a tracer carries no such fact). Set only for that step's trace.
_SUMMED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
  'dmuon_gradients_summed_over', default=frozenset()
)


@contextlib.contextmanager
def gradients_summed_over(axes: Sequence[str]) -> Iterator[None]:
  """Declares that gradients computed here are *sums* over ``axes`` of
  per-device mean-loss gradients (a step run whole inside ``shard_map``,
  differentiated by plain autodiff), so the optimizer divides them."""
  reset = _SUMMED.set(frozenset(axes))
  try:
    yield
  finally:
    _SUMMED.reset(reset)


def summed_axes() -> frozenset[str]:
  """The axes of the enclosing :func:`gradients_summed_over` (or none)."""
  return _SUMMED.get()


def manual_axes() -> frozenset[str]:
  """Mesh axes that are manual here (i.e. we are inside ``shard_map``)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return frozenset()
  return frozenset(
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == jax.sharding.AxisType.Manual
  )


def varying_axes(x) -> frozenset[str]:
  """Manual axes over which ``x`` differs between devices (its vma type)."""
  kind = getattr(jax.typeof(x), 'manual_axis_type', None)
  return frozenset(getattr(kind, 'varying', ()) or ())


def to_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` (a no-op where it already is)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to='varying') if missing else x


def zero_after(*arrays: jax.Array) -> jax.Array:
  """A float32 0 that XLA computes from ``arrays`` (one entry of each), so
  that what it is added to waits for them: a buffer of zeros made as
  ``zeros + zero_after(x)`` is allocated when ``x`` is ready, not at the
  start of the program (XLA schedules a constant's copy, the start of an
  in-place buffer, as early as it likes, and the copy then stays live
  through the whole step). 0 whatever the arrays hold, NaN and infinity
  included (and for empty arrays)."""
  tie = jnp.zeros((), jnp.float32)
  for x in arrays:
    if x.size:
      tie = tie + jnp.isfinite(x.reshape(-1)[0]).astype(jnp.float32) * 0
  return tie


def in_loop(x: jax.Array, carry) -> jax.Array:
  """``x`` (read inside a loop from arrays the loop does not change) made
  to depend on the loop's ``carry`` (a pytree), adding
  :func:`zero_after` of it: XLA hoists work on loop-invariant values out of
  the loop, where it runs whatever the trip count (0 included: a device's
  loop over matrices it does not own), e.g. a read of a whole buffer at an
  offset that cannot but be 0."""
  return x + zero_after(*jax.tree.leaves(carry)).astype(x.dtype)


def switch_by_slot(
  axes: Sequence[str], branches, *operands, shift=0, keys=None
):
  """``lax.switch`` on this device's owner slot, one branch per slot.

  Branch outputs are marked as varying over ``axes`` so that all branches
  have the same type under ``shard_map``'s replication checking. With
  ``shift`` (an int or traced scalar) the branch is
  ``(slot - shift) mod len(branches)``.

  With ``keys`` (one hashable per branch: equal keys promise equal branch
  programs, e.g. a slot's shapes and offsets), slots whose keys are equal
  share one branch body: the program holds one branch per distinct key, and
  the slot picks its body through a constant table, so its size follows the
  distinct keys rather than the number of slots. One distinct key: no
  conditional at all.
  """

  def wrap(branch):
    return lambda *ops: jax.tree.map(
      lambda y: to_varying(y, axes), branch(*ops)
    )

  index = slot_index(axes, len(branches), shift)
  if keys is None:
    return jax.lax.switch(index, [wrap(b) for b in branches], *operands)
  if len(keys) != len(branches):
    raise ValueError(f'{len(keys)} keys for {len(branches)} branches')
  ids: dict = {}
  unique, table = [], []
  for key, branch in zip(keys, branches):
    if key not in ids:
      ids[key] = len(unique)
      unique.append(branch)
    table.append(ids[key])
  if len(unique) == 1:
    return wrap(unique[0])(*operands)
  which = jnp.asarray(np.asarray(table, np.int32))[index]
  return jax.lax.switch(which, [wrap(b) for b in unique], *operands)


# Offsets in owner buffers are read from slot-indexed tables as int32 (jax's
# index dtype without x64). Buffers at least this long keep static offsets.
INDEX_LIMIT = 2**31 - 1


def with_slot_rows(
  axes: Sequence[str],
  num_slots: int,
  body,
  tables: Sequence[np.ndarray],
  *operands,
  dynamic: bool = True,
  shift=0,
):
  """``body(rows, *operands)`` with this device's rows of ``tables``
  (``(num_slots, ...)`` int arrays), its owner slot's over ``axes``.

  With ``dynamic`` the rows are read at run time (a dynamic index from
  ``axis_index``): one program for every slot, its outputs marked as
  varying over ``axes``. Else (buffers too long for int32 offsets, see
  :data:`INDEX_LIMIT`) each slot's rows are constants of its own branch
  of a :func:`switch_by_slot`, slots of equal rows sharing one. With
  ``shift`` (an int or traced scalar) the slot is ``(slot - shift) mod
  num_slots``. A single slot reads its rows as constants, outside any
  ``shard_map`` axis.
  """
  if num_slots == 1:
    return body([np.asarray(t)[0] for t in tables], *operands)
  if not dynamic:
    branches = [
      lambda *ops, s=s: body([np.asarray(t)[s] for t in tables], *ops)
      for s in range(num_slots)
    ]
    keys = [
      tuple(np.asarray(t)[s].tobytes() for t in tables)
      for s in range(num_slots)
    ]
    return switch_by_slot(axes, branches, *operands, shift=shift, keys=keys)
  index = slot_index(axes, num_slots, shift)
  rows = [jnp.asarray(np.asarray(t, np.int32))[index] for t in tables]
  return jax.tree.map(lambda y: to_varying(y, axes), body(rows, *operands))


def for_each(count, columns, body, carry, like=()):
  """``carry = body(carry, *(c[i] for c in columns))`` for ``i <
  count``: a loop with a run-time trip count where ``count`` is traced
  (one body for every slot), unrolled where it is a Python int (the
  columns' entries then constants where they are numpy, else traced).

  ``like``: arrays (any pytree) the body reads besides the carry; under
  ``shard_map`` the carry is first marked as varying over every manual
  axis they and the columns vary over (a loop's carry keeps its type)."""
  if isinstance(count, (int, np.integer)):
    for i in range(int(count)):
      carry = body(carry, *(_entry(c, i) for c in columns))
    return carry
  axes = set()
  for x in jax.tree.leaves((like, columns, count, carry)):
    axes |= varying_axes(x)
  carry = jax.tree.map(lambda x: to_varying(x, sorted(axes)), carry)
  return jax.lax.fori_loop(
    0, count, lambda i, c: body(c, *(col[i] for col in columns)), carry
  )


def _entry(column, i):
  value = column[i]
  return int(value) if isinstance(value, (int, np.integer)) else value


def ppermute_slots(
  x: jax.Array, axes: Sequence[str], pairs: Sequence[tuple[int, int]]
) -> jax.Array:
  """``lax.ppermute`` of ``x`` from slot to slot (``(source, destination)``
  pairs of :func:`slot_index` values over ``axes``, row-major in that
  order). ``ppermute`` numbers devices row-major in the mesh's axis order
  whatever the order of ``axes`` (``axis_index`` follows ``axes``), so the
  pairs are renumbered."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  ordered = tuple(a for a in mesh.axis_names if a in axes)
  shape = [sizes[a] for a in axes]

  def renumber(slot):
    coords = dict(zip(axes, np.unravel_index(slot, shape)))
    return int(
      np.ravel_multi_index(
        [coords[a] for a in ordered], [sizes[a] for a in ordered]
      )
    )

  perm = [(renumber(a), renumber(b)) for a, b in pairs]
  return jax.lax.ppermute(x, ordered, perm=perm)


def slot_index(axes: Sequence[str], n: int = 1, shift=0) -> jax.Array:
  """Row-major index of this device over ``axes`` (the owner slot); with
  ``shift`` (an int or traced scalar), ``(slot - shift) mod n``: scan
  iteration ``t`` of a stacked group runs base slot ``slot - t``'s work."""
  index = jax.lax.axis_index(tuple(axes))
  if not isinstance(shift, int) or shift:
    index = (index - shift) % n
  return index


def reduce_scatter_to_owners(
  buf: jax.Array, axes: Sequence[str], sizes: Sequence[int]
) -> jax.Array:
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
