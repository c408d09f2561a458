"""Collectives to and from owners, inside ``jax.shard_map`` bodies.

Slot-indexed tables and loops (one program for every device, its share
read by its owner slot), the owner collectives, and dedicated mode's
gathers: a :class:`dmuon_jax.Dedication` (passed as ``ded``) and the local
view of :class:`dmuon_jax.DedicatedParams`. The forward pass all-gathers
one gather group's owner buffers just before its blocks run (on HSDP: over
the replicate axis, then over the shard axes); autodiff's transpose of
that gather reduce-scatters the gradients to the owners. Z3 gathers again
in the backward pass (:func:`regather_in_backward`), Z2 keeps the gathered
weights. Under plain ``jit`` (Explicit owner axes, no ``shard_map``) the
same gathers run as the *reduced gather* (``mode='reduced'``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _mesh

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
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def varying_axes(x) -> frozenset[str]:
  """Manual axes over which ``x`` differs between devices (its vma type)."""
  kind = getattr(jax.typeof(x), 'manual_axis_type', None)
  return frozenset(getattr(kind, 'varying', ()) or ())


def to_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` (a no-op where it already is)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to='varying') if missing else x


def invariant_over_size_one(x: jax.Array, keep: Sequence[str]) -> jax.Array:
  """``x`` summed over the manual axes of one device that it varies on and
  ``keep`` does not name: numerically the identity (a sum over one device
  is its value), it types ``x`` invariant there, as an ``out_specs`` entry
  that leaves such an axis out requires. An owner buffer's spec names only
  the owner axes (by default those of more than one device), while the
  gradients of a step run whole inside ``shard_map`` vary over every manual
  axis its batch splits (a ``(1, 8)`` ``('replicate', 'shard')`` mesh's
  ``'replicate'`` too)."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  one = [a for a in varying_axes(x) - set(keep) if sizes.get(a) == 1]
  return jax.lax.psum(x, tuple(sorted(one))) if one else x


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


# Offsets in owner buffers are read from slot-indexed tables as int32 (jax's
# index dtype without x64). Buffers at least this long keep static offsets.
INDEX_LIMIT = 2**31 - 1


def roll_slots(flat: jax.Array, shift, n: int, unreduced: bool = False):
  """A flat buffer's ``n`` slot blocks rolled by ``shift`` (an int or
  traced; block ``s`` goes to ``s + shift mod n``): scan iteration ``t``
  of a stacked group holds its layout rotated by ``t`` slots.

  ``unreduced``: for a value typed ``unreduced`` (jax has no unreduced
  rule for ``dynamic_slice``), rolled by one static roll per bit of
  ``shift``, each selected.
  """
  rows = flat.reshape(n, -1)
  if not unreduced:
    return jnp.roll(rows, shift, axis=0).reshape(-1)
  shift = shift % n
  for bit in (1 << b for b in range((n - 1).bit_length())):  # bit < n
    rolled = jnp.concatenate([rows[n - bit :], rows[: n - bit]])
    rows = jnp.where((shift & bit) > 0, rolled, rows)
  return rows.reshape(-1)


def with_slot_rows(lay, body, tables: Sequence[np.ndarray], *operands, shift=0):
  """``body(rows, *operands)`` with this device's rows of ``tables``
  (``(num_slots, ...)`` int arrays), its owner slot's over the axes of
  ``lay`` (a ``_layout.Layout``: its ``plan.axis_names``), its outputs
  marked as varying over them.

  Where ``lay.dynamic`` the rows are read at run time (a dynamic index from
  ``axis_index``): one program for every slot. Else (buffers too long for
  int32 offsets, see :data:`INDEX_LIMIT`) a ``lax.switch`` on the slot
  holds one branch per distinct row (its rows constants): slots of equal
  rows share a branch body, picked through a constant table, so the
  program's size follows the distinct rows rather than the slots (one
  distinct: no conditional at all). With ``shift`` (an int or traced
  scalar) the slot is ``(slot - shift) mod num_slots``. A single slot
  reads its rows as constants, outside any ``shard_map`` axis.
  """
  axes, num_slots = lay.plan.axis_names, lay.num_slots
  if num_slots == 1:
    return body([np.asarray(t)[0] for t in tables], *operands)
  index = slot_index(axes, num_slots, shift)
  vary = lambda out: jax.tree.map(lambda y: to_varying(y, axes), out)
  if lay.dynamic:
    rows = [jnp.asarray(np.asarray(t, np.int32))[index] for t in tables]
    return vary(body(rows, *operands))
  keys = [
    tuple(np.asarray(t)[s].tobytes() for t in tables) for s in range(num_slots)
  ]
  first = {key: keys.index(key) for key in keys}  # distinct rows: 1st slot
  branches = [  # (lax.switch calls a lone branch without a conditional)
    lambda *ops, s=s: vary(body([np.asarray(t)[s] for t in tables], *ops))
    for s in first.values()
  ]
  ids = {key: j for j, key in enumerate(first)}
  which = jnp.asarray(np.asarray([ids[k] for k in keys], np.int32))[index]
  return jax.lax.switch(which, branches, *operands)


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
      got = (c[i] for c in columns)
      carry = body(
        carry, *(int(v) if isinstance(v, np.integer) else v for v in got)
      )
    return carry
  leaves = jax.tree.leaves((like, columns, count, carry))
  axes = sorted(set().union(*map(varying_axes, leaves)))
  carry = jax.tree.map(lambda x: to_varying(x, axes), carry)
  return jax.lax.fori_loop(
    0, count, lambda i, c: body(c, *(col[i] for col in columns)), carry
  )


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
  perm = renumber(np.asarray(pairs, np.int64), axes, ordered, sizes)
  return jax.lax.ppermute(x, ordered, perm=[tuple(map(int, p)) for p in perm])


def renumber(slots, axes: Sequence[str], order: Sequence[str], sizes):
  """Slots numbered row-major over ``axes`` (an int array), numbered
  row-major over ``order`` (the same axes, reordered); ``sizes``: axis
  name -> size."""
  coords = dict(zip(axes, np.unravel_index(slots, [sizes[a] for a in axes])))
  return np.ravel_multi_index(
    [coords[a] for a in order], [sizes[a] for a in order]
  )


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
  x = buf.reshape(tuple(sizes) + (-1,))
  # Reverse the axis order so that the innermost axis is the leading one.
  x = x.transpose(tuple(reversed(range(len(sizes)))) + (len(sizes),))
  x = x.reshape(-1)
  for axis, size in zip(reversed(axes), reversed(sizes)):
    if size > 1:
      x = jax.lax.psum_scatter(x, axis, tiled=True)
  return x


def gather_from_owners(local: jax.Array, axes: Sequence[str]) -> jax.Array:
  """All-gathers every slot's block, replicated on every device."""
  return jax.lax.all_gather(local, tuple(axes), tiled=True, to='invarying')


P = jax.sharding.PartitionSpec


def gather_leaf(ded, i: int, x: Any, layer_slice: bool = False) -> Any:
  """All-gathers a non-target leaf's sharded dims (inside ``shard_map``)."""
  spec = ded.rest_specs[i]
  if x is None or spec is None:
    return x
  for dim, axes in enumerate(_mesh.spec_entries(spec)[int(layer_slice) :]):
    # A TP-sharded param stays this TP shard's slice (as the matrices).
    axes = tuple(a for a in axes if a != ded.tensor_parallel_axis)
    if axes:
      x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
  return x


def gather_rest(ded, dedicated) -> Any:
  """The non-target params, sharded dims gathered (see
  :meth:`dmuon_jax.Dedication.gather_rest`)."""
  leaves = ded.treedef.flatten_up_to(dedicated.rest)
  return jax.tree.unflatten(
    ded.treedef, [gather_leaf(ded, i, x) for i, x in enumerate(leaves)]
  )


def after_inputs(local: Sequence[jax.Array], arrays: Sequence[Any]) -> list:
  """``local``, tied to a group's inputs: the group is gathered when its
  first block is about to run, not every group at the start of the step
  (XLA would otherwise hoist every forward gather, holding all gathered
  weights at once). The tie is 0 for finite inputs."""
  xs = [x for x in jax.tree.leaves(arrays) if _is_float(x)]
  if not xs:
    return list(local)
  tie = jnp.sum(xs[0]) * 0
  return [
    x + tie.astype(x.dtype) if varying_axes(tie) <= varying_axes(x) else x
    for x in local
  ]


# How a gather runs: ``mode`` of :func:`gather_replicate`,
# :func:`materialize` and :func:`gather_sink`. ``'manual'``: inside a
# ``shard_map`` whose manual axes are the owner and TP axes (Dedication's
# explicit API); ``'tp'``: per TP shard (see :func:`on_tp_shards`: the TP
# axis left to the partitioner, dmuon_jax.flax.train_step), each target
# sharded over the TP axis as the param was; ``'reduced'``: under plain
# ``jit`` (the reduced gather, below).


def gather_replicate(
  ded, local: Sequence[jax.Array], mode: str = 'manual'
) -> list[jax.Array]:
  """Local owner buffers all-gathered over the replicate axis (HSDP's
  first stage; themselves without one, or for the reduced gather, which
  gathers over every owner axis at once in :func:`materialize`)."""

  def gather(xs):
    if ded.replicate_axis is None or mode == 'reduced':
      return list(xs)
    return [jax.lax.all_gather(x, ded.replicate_axis, tiled=True) for x in xs]

  return _per_tp_shard(ded, gather, local) if mode == 'tp' else gather(local)


def materialize(
  ded,
  g: int,
  rep_local,
  iteration=None,
  sink=None,
  mode: str = 'manual',
  reduced: Sequence[str] | None = None,
) -> dict[int, Any]:
  """Leaf index -> whole target, from :func:`gather_replicate`'s buffers.

  With ``sink`` (from :func:`gather_sink`), the targets' cotangents go to
  it rather than through this gather's own transpose. ``'reduced'``: the
  targets typed ``reduced`` over the owner axes ``reduced`` (those the
  boundary's input splits), their cotangents reduce-scattered back onto
  the owner buffers.
  """
  if mode == 'reduced':
    axes = tuple(reduced)
    whole = lambda l, i: _as_reduced(ded, _whole(ded, g, l, i), axes)
    if sink is None:
      return _owners_get_cotangents(ded, g, whole, rep_local, iteration, axes)
    mats = whole([jax.lax.stop_gradient(x) for x in rep_local], iteration)
    return {i: route(s, m) for s, (i, m) in zip(sink, mats.items())}

  def gather(full, iteration, sink):
    if sink is not None:
      full = [jax.lax.stop_gradient(x) for x in full]
    if ded.shard_axes:
      full = [jax.lax.all_gather(x, ded.shard_axes, tiled=True) for x in full]
    if sink is not None:
      full = [route(s, x) for s, x in zip(sink, full)]
    return ded.layout.unpack_group(g, full, iteration, whole=False)

  args = (list(rep_local), iteration, None if sink is None else list(sink))
  if mode != 'tp':
    return gather(*args)
  specs = (buffer_tp_specs(ded, rep_local), P())
  specs += (None if sink is None else buffer_tp_specs(ded, sink),)
  return on_tp_shards(ded, gather, specs, target_specs(ded, g))(*args)


def target_spec(ded, index: int) -> P:
  """The PartitionSpec of a gathered Muon target (leaf ``index``): the
  tensor-parallel axis on the dimension it splits, as the param was
  sharded; ``P()`` (whole on every device) without TP."""
  t = ded.layout.leaf(index)
  if t.tp_dim is None:  # (set only on a mesh with a TP axis)
    return P()
  tp = ded.tensor_parallel_axis
  return P(*(tp if d == t.tp_dim else None for d in range(len(t.shape))))


def target_specs(ded, g: int) -> dict[int, P]:
  """:func:`target_spec` of each target of group ``g``."""
  return {
    s.leaf_index: target_spec(ded, s.leaf_index)
    for s in ded.layout.groups[g].plan.leaves
  }


def on_tp_shards(ded, fn: Callable[..., Any], in_specs, out_specs):
  """``fn`` run on each tensor-parallel shard's slices.

  Inside a ``shard_map`` whose manual axes are the owner axes only
  (:func:`dmuon_jax.flax.train_step`), the TP axis is left to the
  partitioner: a local owner buffer holds every TP shard's slices. ``fn``
  (a gather written for TP-local blocks, as the explicit API runs it) then
  runs in a ``shard_map`` over the TP axis; its specs name the TP axis
  (``None`` entries: replicated). Where the TP axis is manual already, or
  there is none, ``fn`` itself.
  """
  tp = ded.tensor_parallel_axis
  if tp is None or tp in manual_axes():
    return fn

  def call(*args):
    # Replication types as the enclosing shard_map has them: none inside
    # one with check_vma=False (train_step's shape probe), where no value
    # varies over the manual axes (owner buffers otherwise do).
    typed = any(varying_axes(x) for x in jax.tree.leaves(args))
    return jax.shard_map(
      fn,
      in_specs=in_specs,
      out_specs=out_specs,
      axis_names={tp},
      check_vma=typed,
    )(*args)

  return call


def buffer_tp_specs(ded, local: Sequence[jax.Array]) -> list[P]:
  """Specs of local owner buffers over the TP axis (its last dimension:
  TP shard ``t`` of a slot at block ``t``, see the layout's buffer
  spec)."""
  tp = ded.tensor_parallel_axis
  return [P(*([None] * (jnp.ndim(x) - 1)), tp) for x in local]


def _per_tp_shard(ded, fn, local: Sequence[jax.Array]) -> list[jax.Array]:
  """``fn(list of local buffers)``, per TP shard (see :func:`on_tp_shards`),
  its outputs shaped and sharded as its inputs."""
  specs = buffer_tp_specs(ded, local)
  return on_tp_shards(ded, fn, (specs,), specs)(list(local))


def group_of(ded, b: int) -> int:
  return next(g for g, bs in enumerate(ded.groups) if b in bs)


def regather_in_backward(
  run: Callable[..., Any],
  policy: Callable[..., Any],
  blocks: Sequence[str] = (),
) -> Callable[..., Any]:
  """``run(local, *args)`` that gathers ``local`` again in the backward pass.

  ``run`` all-gathers the list of arrays ``local`` and computes with the
  result. It runs under ``jax.checkpoint`` with ``policy`` (e.g. save the
  outputs of matmuls, recompute the rest), so the gathered arrays are not
  saved and the backward pass gathers them again from ``local``. XLA:CPU
  would otherwise merge the backward all-gather with the identical forward
  one (it drops the checkpoint's optimization barriers), silently keeping
  the gathered arrays (Z2); tying the backward gather's input to the
  cotangent makes it a different value that XLA must compute after the
  forward. The tie is 0 for a finite cotangent; a non-finite one poisons the
  block's gradients, which it would do anyway.

  Args:
    run: ``(local, *args) -> out``.
    policy: a ``jax.checkpoint`` policy that does not save the gathered
      arrays.
    blocks: the hook boundaries ``run`` gathers, for messages.

  Returns:
    A function like ``run``.
  """
  tied = regather_group_in_backward(run, policy, last=True, blocks=blocks)
  return lambda local, *args: tied(local, new_token(), *args)[0]


def new_token(shape=(), dtype=jnp.float32) -> jax.Array:
  """A group's first token: a scalar 0, varying over the manual axes (its
  cotangent, the backward tie, varies like the cotangents it comes from);
  zeros of ``shape`` and ``dtype`` so typed."""
  return to_varying(jnp.zeros(shape, dtype), tuple(sorted(manual_axes())))


def regather_group_in_backward(
  run: Callable[..., Any],
  policy: Callable[..., Any],
  *,
  last: bool,
  blocks: Sequence[str] = (),
  routed: bool = False,
  explain: Callable[[Exception], None] | None = None,
) -> Callable[..., Any]:
  """:func:`regather_in_backward` for one of several calls sharing a gather.

  The calls of one gather group (hook boundaries called one after another
  by the model) each gather the same ``local`` buffers. They pass a scalar
  *token* along: ``(out, token) = f(local, token, *args)``. In the backward
  pass the group's last call ties its re-gather to its own cotangent and
  hands that tie back through the token's cotangent to the earlier calls,
  which tie theirs to it: every call's re-gather is then the same value,
  which XLA computes once (when the last call's backward starts) and keeps
  until the first call's backward ends — Z3 for a group. The forward
  gathers are identical too, and are computed once.

  Args:
    run: ``(local, *args) -> out``.
    policy: a ``jax.checkpoint`` policy that does not save the gathered
      arrays.
    last: whether this is the group's last call (its backward runs first).
    blocks: the hook boundaries ``run`` gathers, for messages.
    routed: the first of ``args`` is a :func:`gather_sink` (zeros that only
      receive the gathered weights' cotangents): it is not saved for the
      backward pass (fresh zeros stand in for it there).
    explain: called with an error raised while transposing ``run`` in the
      backward pass (jax's, on the user's code), which it may restate
      (raise a clearer one from it); the error is raised as it is if not.

  Returns:
    ``(local, token, *args) -> (out, token)``.
  """
  remat = jax.checkpoint(run, policy=policy)
  # Set at trace time by the forward rule: the residuals' tree and the
  # positions of ``local`` among them.
  trace: dict[str, Any] = {}

  @jax.custom_vjp
  def regather(local, token, *args):
    return run(local, *args), token

  def fwd(local, token, *args):
    local = list(local)
    # Fresh zeros, so that the caller's sink is not kept alive.
    zeros = [jnp.zeros_like(z) for z in args[0]] if routed else []
    args = (zeros, *args[1:]) if routed else args
    out, vjp = jax.vjp(remat, local, *args)
    res, tree = jax.tree.flatten(vjp)
    tied = [k for k, r in enumerate(res) if any(r is x for x in local)]
    holes = {
      k: (r.shape, r.dtype)
      for k, r in enumerate(res)
      if any(r is z for z in zeros)
    }
    res = [r for k, r in enumerate(res) if k not in holes]
    # A transformation may trace this rule more than once (nnx.scan does,
    # with different residuals): the backward rule finds its trace by the
    # residuals' types.
    trace[_avals(res)] = (tree, tied, holes)
    trace['kinds'] = [varying_axes(x) for x in jax.tree.leaves((local, args))]
    if not tied and _backward_reads_weights(run, local, args):
      raise ValueError(
        f'dmuon: with this remat_policy the Z3 block {list(blocks)} saves'
        ' its gathered weights for the backward pass (Z2 memory and bytes).'
        ' Use a policy that does not save them, e.g. jax.checkpoint_policies.'
        'dots_saveable (the default), or reshard_after_forward=False.'
      )
    return (out, token), (res, token)

  def bwd(saved, cts):
    res, token = saved
    ct, tie = cts
    if last:  # else the token's cotangent: the last call's tie
      floats = [c for c in jax.tree.leaves(ct) if _is_float(c)]
      tie = sum((jnp.sum(c) for c in floats), jnp.zeros([])) * 0
      tie = to_varying(tie.astype(token.dtype), tuple(varying_axes(token)))
    tree, tied, holes = trace[_avals(res)]
    it = iter(res)
    res = [
      new_token(*holes[k]) if k in holes else next(it)
      for k in range(len(res) + len(holes))
    ]
    res = [
      r + tie.astype(r.dtype) if k in tied else r for k, r in enumerate(res)
    ]
    try:
      grads = jax.tree.unflatten(tree, res)(ct)
    except Exception as err:  # jax's, whatever it raises on the user's code
      if explain is not None:
        explain(err)
      raise
    leaves, treedef = jax.tree.flatten((grads[0], grads[1:]))
    # A cotangent varying where its input does not (an axis the input's
    # sharding dropped) is summed there: the transpose of the broadcast.
    leaves = (
      [_sum_to(c, kind) for c, kind in zip(leaves, trace['kinds'])]
      if len(leaves) == len(trace['kinds'])
      else leaves
    )
    local_ct, args_ct = jax.tree.unflatten(treedef, leaves)
    return (local_ct, tie, *args_ct)

  regather.defvjp(fwd, bwd)
  return regather


def _backward_reads_weights(run, local, args) -> bool:
  """Whether the backward pass of ``run`` reads its (gathered) weights at
  all: whether ``local`` is among the residuals of a full
  rematerialization. A block whose weights' gradient needs only other
  inputs (a lookup table's: the indices) keeps no weights under any
  policy, so not finding ``local`` among its residuals does not mean that
  the policy saved the gathered copies. Traced on its own (``make_jaxpr``),
  so nothing of it enters the step's program."""
  remat = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)

  def residuals(local, *args):
    return jax.tree.leaves(jax.vjp(remat, local, *args)[1])

  jaxpr = jax.make_jaxpr(residuals)(local, *args).jaxpr
  weights = jaxpr.invars[: len(jax.tree.leaves(local))]
  return any(any(o is w for w in weights) for o in jaxpr.outvars)


def _avals(xs) -> tuple:
  return tuple((tuple(x.shape), str(x.dtype)) for x in xs)


def _is_float(x) -> bool:
  return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jnp.inexact)


def _sum_to(ct, kind: frozenset[str]):
  """``ct`` summed over the manual axes it varies on and ``kind`` not."""
  if not _is_float(ct):
    return ct
  extra = tuple(sorted(varying_axes(ct) - kind))
  return jax.lax.psum(ct, extra) if extra else ct


def gather_sink(
  ded,
  g: int,
  local: Sequence[jax.Array],
  iteration=None,
  mode='manual',
  reduced: Sequence[str] | None = None,
) -> list[jax.Array]:
  """Zeros that receive the cotangents of group ``g``'s gathered weights,
  their sum reduce-scattered onto ``local``: one reduce-scatter per gather
  group, however many calls route gradients to it (see :func:`route`).
  ``'manual'``/``'tp'``: shaped like ``local`` gathered over all owner
  axes, reduced over the shard axes, then the replicate axis (the
  transpose of :func:`gather_replicate` and :func:`materialize`'s gather).
  ``'reduced'``: shaped like the group's targets (a list, in
  ``OwnerLayout.unpack_group``'s order), typed ``reduced`` over the owner
  axes ``reduced``."""
  if mode == 'reduced':
    axes = tuple(reduced)
    shapes = jax.eval_shape(lambda l, i: _whole(ded, g, l, i), local, iteration)
    zeros = lambda l, i: _as_reduced(
      ded, {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}, axes
    )
    return list(
      _owners_get_cotangents(ded, g, zeros, local, iteration, axes).values()
    )
  if mode == 'tp':
    return _per_tp_shard(ded, lambda xs: gather_sink(ded, g, xs), local)

  @jax.custom_vjp
  def sink(local):
    # Varying over every manual axis, as the cotangents routed to it.
    return [
      new_token((x.shape[0] * ded.num_slots,) + x.shape[1:], x.dtype)
      for x in local
    ]

  kinds = [varying_axes(x) for x in local]

  def bwd(_, cts):
    out = []
    for c, kind in zip(cts, kinds):
      if ded.shard_axes:
        c = jax.lax.psum_scatter(c, ded.shard_axes, tiled=True)
      if ded.replicate_axis is not None:
        c = jax.lax.psum_scatter(c, ded.replicate_axis, tiled=True)
      # Where the buffer is the same on every device (an axis of size 1
      # that the sharding dropped), its cotangent is the sum there.
      out.append(_sum_to(c, kind))
    return (out,)

  sink.defvjp(lambda local: (sink(local), None), bwd)
  return sink(list(local))


@jax.custom_vjp
def route(grad_to: jax.Array, value: jax.Array) -> jax.Array:
  """``value``, with its cotangent sent to ``grad_to`` instead (no
  residuals: ``grad_to`` is only a destination)."""
  del grad_to
  return value


route.defvjp(lambda _, v: (v, None), lambda _, ct: (ct, jnp.zeros_like(ct)))


# The reduced gather: dedicated mode under plain jit (Explicit owner axes).
#
# Outside shard_map a gather's autodiff transpose is an all-reduce plus a
# slice on XLA:CPU (an all-gather's transpose in GSPMD). Typing the gathered
# weights ``reduced`` over the owner axes makes their cotangent
# ``unreduced`` there (jax's sharding-in-types: each device holds its own
# partial sum), and a custom backward reduce-scatters that partial sum onto
# the owners in a small shard_map: all-gather forward, reduce-scatter
# backward, the Z2 floor, with the user's step under plain jax.jit/nnx.jit.
# Measured in docs/benchmarks/dedicated_route.md (jax 0.10.2, 8 devices).


def _buffer_spec(ded) -> P:
  """The spec of a loop group's owner buffer (a scan iteration's): its
  layout's spec of the slot dimension (the owner axes, then the TP axis)."""
  return P(ded.layout.buffer_spec(0)[-1])


def _whole(ded, g: int, local, iteration) -> dict[int, Any]:
  """Group ``g``'s targets, all-gathered over the owner axes (plain types:
  whole, or sharded over the TP axis as the params were)."""
  axes = tuple(ded.buffer_axes)

  def gather(xs, it):
    # xs: this (owner, TP shard)'s blocks; full: the TP shard's slots.
    full = [gather_from_owners(x, axes) for x in xs]
    return ded.layout.unpack_group(g, full, it, whole=False)

  return jax.shard_map(
    gather,
    mesh=ded.mesh,
    in_specs=(_buffer_spec(ded), P()),
    out_specs=target_specs(ded, g),
  )(list(local), iteration)


def _as_reduced(ded, mats: dict[int, Any], axes) -> dict[int, Any]:
  owner = set(axes)
  sharding = lambda i: jax.sharding.NamedSharding(
    ded.mesh, P(*target_spec(ded, i), reduced=owner)
  )
  return {i: jax.reshard(m, sharding(i)) for i, m in mats.items()}


def _owners_get_cotangents(ded, g: int, forward, local, iteration, axes) -> Any:
  """``forward(local, iteration)`` (``{leaf: reduced target}``), its
  backward summing the targets' ``unreduced`` cotangents onto their owners:
  inside a shard_map over the owner axes each device packs its partial
  sums into group ``g``'s buffers (the transpose of
  ``OwnerLayout.unpack_group``, on plain local arrays) and one
  reduce-scatter per buffer adds them up on the owners. ``axes``: the
  owner axes the targets are typed ``reduced`` over (their cotangents
  ``unreduced``), and any axis of size 1 the boundary's input spells."""

  @jax.custom_vjp
  def f(local, iteration):
    return forward(local, iteration)

  def bwd(saved, cts):
    local, iteration = saved
    tp = ded.tensor_parallel_axis
    tp_size = ded.layout.tp_size
    # One TP shard's whole buffers (every slot's blocks of that TP shard).
    shapes = [((x.shape[0] // tp_size,) + x.shape[1:], x.dtype) for x in local]

    def pack(cts, it):
      # cts: this TP shard's slices, partial sums ({U: owner axes}). The
      # transpose of unpacking reduced values takes unreduced ones.
      zeros = [
        jax.lax.pcast(jnp.zeros(s, d), axes, to='reduced') for s, d in shapes
      ]
      if tp is not None:  # like the cotangents: one TP shard's slices
        zeros = [jax.lax.pcast(z, tp, to='varying') for z in zeros]
      unpack = lambda f: ded.layout.unpack_group(g, f, whole=False)
      (full,) = jax.vjp(unpack, zeros)[1](cts)
      if iteration is not None:  # unpack_group's rotation, undone
        full = [roll_slots(x, it, ded.num_slots, True) for x in full]
      return [jax.lax.psum_scatter(f, axes, tiled=True) for f in full]

    unreduced = {i: P(*target_spec(ded, i), unreduced=set(axes)) for i in cts}
    # The axes of size 1 that are no owner axes (spelled by the boundary's
    # input) in the spec too: the same layout as the buffer's, where a
    # psum over them to drop them would stay in the program (XLA keeps an
    # all-reduce over groups of one device).
    (slots,) = _buffer_spec(ded)
    extra = tuple(a for a in axes if a not in ded.buffer_axes)
    slots = slots if isinstance(slots, tuple) else (slots,)
    spec = P(slots + extra) if extra else _buffer_spec(ded)
    owners = jax.shard_map(
      pack,
      mesh=ded.mesh,
      in_specs=(unreduced, P()),
      out_specs=[spec] * len(local),
    )(cts, jnp.zeros([], jnp.int32) if iteration is None else iteration)
    if extra:
      owners = [jax.sharding.reshard(o, _buffer_spec(ded)) for o in owners]
    return owners, None

  f.defvjp(lambda l, i: (f(l, i), (l, i)), bwd)
  return f(list(local), iteration)
