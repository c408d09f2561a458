"""Distributed Gram Newton–Schulz with every collective between stages.

Owner-group matrices (slices on several owners, see
``_plan.OwnerGroup``) and tensor-parallel ones (slices on the TP shards
of one owner) are orthogonalized together by their holders. Each device
runs its own matrices in loops of its own trip counts; a collective inside
such a loop (or a conditional) would be executed by only some of the
devices its replica groups list (NCCL matches collectives by order on each
communicator: a hazard on GPU). So the update runs in *stages*: every stage
computes fixed-shape local results (local Grams, factors, slices), and
between stages the collectives run on every device:

* ``pmax`` of per-matrix max-abs entries (the power-of-two rescaling of
  huge matrices, ``_newton_schulz.rescale_large``);
* per restart window, the local Grams summed: over the TP axis by ``psum``
  (every TP shard then iterates its matrix, as before); for owner groups
  each member's Gram goes to its group's iteration owner and the factor
  comes back, point to point (``ppermute`` rounds of
  :mod:`dmuon_jax._plan`: a group's traffic stays between its
  members), as packed triangles (:func:`pack_symmetric`);
* with ``adaptive``, the dual norms summed the same way.

Every slot runs one program: per type of slice, TP matrix or Gram (what
the loop body computes: shapes, sizes, what the finish reads) a loop over
the slot's items of that type; their offsets, a slice's group among the
slot's, its group's row position and its place in the exchange are read
from slot-indexed tables (``axis_index``), so the program's size follows
the model's shapes, not the number of devices. Plain (whole) matrices are
finished in the first stage.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _gather, _layout, _newton_schulz, _plan


def pack_symmetric(a: jax.Array, size: int = 0) -> jax.Array:
  """A symmetric ``g x g`` matrix as ``triangle_size(g)`` elements,
  zero-padded to ``size`` elements where that is more.

  With ``a = [[A, B], [B^T, C]]`` in halves (``g`` padded to even): ``B``,
  then one square holding ``A``'s upper triangle and ``C``'s strict lower
  one, then ``C``'s diagonal. Slices and selects only (no gather): the
  inverse is :func:`unpack_symmetric`.
  """
  g = a.shape[-1]
  if g % 2:
    a = jnp.pad(a, ((0, 1), (0, 1)))
  k = a.shape[-1] // 2
  a11, a12, a22 = a[:k, :k], a[:k, k:], a[k:, k:]
  i = jax.lax.broadcasted_iota(jnp.int32, (k, k), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (k, k), 1)
  q = jnp.where(j >= i, a11, a22)
  p = jnp.concatenate([a12.reshape(-1), q.reshape(-1), jnp.diagonal(a22)])
  return jnp.pad(p, (0, size - p.shape[0])) if p.shape[0] < size else p


def unpack_symmetric(v: jax.Array, g: int) -> jax.Array:
  """The ``g x g`` matrix of :func:`pack_symmetric` (from the leading
  ``triangle_size(g)`` elements of ``v``)."""
  k = (g + g % 2) // 2
  a12 = v[: k * k].reshape(k, k)
  q = v[k * k : 2 * k * k].reshape(k, k)
  d = v[2 * k * k : 2 * k * k + k]
  i = jax.lax.broadcasted_iota(jnp.int32, (k, k), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (k, k), 1)
  qt = q.T
  a11 = jnp.where(j >= i, q, qt)
  a22 = jnp.where(i > j, q, jnp.where(i < j, qt, d[:, None]))
  a = jnp.concatenate(
    [jnp.concatenate([a11, a12], 1), jnp.concatenate([a12.T, a22], 1)], 0
  )
  return a[:g, :g]


class _Type(NamedTuple):
  """A type of owner-group slices or of TP-split matrices (every TP shard
  iterates those), as a stage's loop body reads it."""

  unit: int  # a representative unit (the finish reads only its key)
  shape: tuple[int, int]
  split: int  # -1: columns split (Gram over rows), -2: rows split
  gram: int  # g, the Gram's size
  group: int  # dtype group of its buffer
  segments: tuple[tuple[int, int], ...]  # its restart windows
  key: Any  # what the finish reads of its unit (Stages' unit_keys)


def _typed(per_slot):
  """Types and their tables from ``per_slot[s]``: ``(type, rank, row)``
  items (``rank`` orders a slot's items of a type; ``row`` the values its
  loop body reads): the types in order, per type its
  :func:`_layout.typed_table` over slots (table and trip count)."""
  found: dict = {}
  for s, items in enumerate(per_slot):
    for typ, rank, row in items:
      per = found.setdefault(typ[1:], (typ, [[] for _ in per_slot]))[1]
      per[s].append((rank, row))
  out = []
  for key in sorted(found, key=repr):
    typ, per = found[key]
    rows = [
      [list(c) for c in zip(*(r for _, r in sorted(it, key=lambda e: e[0])))]
      for it in per
    ]
    width = max(map(len, rows))
    empty = [[] for _ in range(width)]
    out.append((typ, *_layout.typed_table([r or empty for r in rows])))
  return tuple(zip(*out)) or ((), (), ())


class Stages:
  """The static plan of a staged update of one layout group.

  Every slot runs one program: per *type* (of slices, TP matrices, Grams
  it iterates: their shapes, what the finish reads of them) a loop over
  the slot's items of that type, their offsets and places read from
  slot-indexed tables (``axis_index``). The types follow the model and
  the plan's few signatures, not the number of devices.

  ``unit_keys`` (per unit of the plan): what the finish reads of
  a unit (its whole matrix's shape, whether it decays): part of its type.

  Attributes:
    n: the number of owner slots.
    axes: the owner axes (the ``ppermute`` and tables run over them).
    group_axis: the axis a group's members share (its ``pmax``/``psum`` of
      per-matrix scalars).
    parts: per part (slices, TP matrices, each window's iterated groups)
      its types (a representative unit each; for the iterated groups,
      their Gram sizes), its tables, their static trip counts (or None) and
      their number of columns: a slice's (offset in the buffer, its group among the slot's
      held ones, its group's row position); a TP matrix's (offset, offset
      of its Gram in the TP block, position in the slot's TP vectors); an
      iterated group's position among the slot's of the window.
    held: per slot, the groups (plan indices) it holds slices of.
    iterated: per window, per slot, the groups it iterates.
    schedules: per window, the exchange's rounds
      (:mod:`dmuon_jax._plan`); reduce, broadcast: per window,
      their ``(send, receive)`` tables; own_gram, own_factor: per window,
      a slot's own slices' Grams and factors.
    group_windows: the groups' restart windows (0 without groups).
    windows: restart windows of the longest iteration.
    tp_block: elements of a slot's TP Grams; vec_tp, vec_groups: lengths
      of the per-matrix vectors.
  """

  def __init__(self, olayout, lay, ns_steps: int, unit_keys):
    plan, groups, k = lay.plan, lay.plan.groups, ns_steps
    self.lay, self.n = lay, lay.num_slots
    self.axes = tuple(olayout.buffer_axes)
    self.group_axis = plan.group_axis()
    self.tp_axis = olayout.tp_axis if olayout.tp_size > 1 else None
    self.group_segments = _newton_schulz.gram_windows(k)
    # Row positions of the groups (for the per-matrix vectors).
    rows: dict[int, list[int]] = {}
    for j, g in enumerate(groups):
      rows.setdefault(plan.group_row(g.iteration_owners[0]), []).append(j)
    pos = {j: i for js in rows.values() for i, j in enumerate(js)}
    self.vec_groups = max(map(len, rows.values()), default=0)
    self.iterated = [
      [
        [j for j, g in enumerate(groups) if g.iteration_owners[w] == s]
        for s in range(self.n)
      ]
      for w in range(_plan.windows(groups))
    ]
    self.held, slices, tps = [], [], []
    self.tp_block = self.vec_tp = 0
    for s in range(self.n):
      found, mine = [], []
      for gi in range(lay.num_groups):
        for bucket in lay.buckets(gi, s):
          for u in bucket.units:
            shape, key = plan.units[u].shape, unit_keys[u]
            if bucket.grouped:
              j = plan.units[u].group
              split = plan.leaves[lay.unit_leaf[u]].split_axis
              size = groups[j].gram_size
              typ = _Type(u, shape, split, size, gi, self.group_segments, key)
              found.append((j, typ))
            elif bucket.tp_split is not None:
              split = bucket.tp_split
              size, w = shape if split == -1 else shape[::-1]
              long_gram = size > w * olayout.tp_size
              segments = _newton_schulz.gram_windows(k, None, long_gram)
              mine.append(_Type(u, shape, split, size, gi, segments, key))
      held = sorted({j for j, _ in found})
      local = {j: i for i, j in enumerate(held)}
      self.held.append(held)
      slices.append(
        [
          (t, (local[j], t.unit), (lay.unit_offset[t.unit], local[j], pos[j]))
          for j, t in found
        ]
      )
      # A slot's TP Grams in canonical order, one block after another.
      mine.sort(key=lambda t: (repr(t[1:]), t.unit))
      starts = [0, *itertools.accumulate(t.gram**2 for t in mine)]
      tps.append(
        [
          (t, i, (lay.unit_offset[t.unit], starts[i], i))
          for i, t in enumerate(mine)
        ]
      )
      self.tp_block = max(self.tp_block, starts[-1])
      self.vec_tp = max(self.vec_tp, len(mine))
    # The stages' tables in the order _rows reads them: per part (slices,
    # TP matrices, each window's iterated groups) its types, tables, their
    # trip counts and their number of columns.
    self.parts = [(*_typed(slices), 3), (*_typed(tps), 3)]
    for per_slot in self.iterated:
      types, *part = _typed(
        [
          [((0, groups[j].gram_size), i, (i,)) for i, j in enumerate(js)]
          for js in per_slot
        ]
      )
      self.parts.append(([t[1] for t in types], *part, 1))
    self.m_held = max(map(len, self.held), default=0)
    self.m_iterated = max(
      (len(js) for per_slot in self.iterated for js in per_slot), default=0
    )
    self.block = max(
      (_plan.triangle_size(g.gram_size) for g in groups), default=0
    )
    # The groups' restart windows: the optimizer's, each with the plan's
    # iteration owners of that window (a plan places as many or more).
    self.group_windows = len(self.group_segments) if groups else 0
    self.windows = max(
      [self.group_windows] + [len(t.segments) for t in self.parts[1][0]]
    )
    self.schedules = [
      _plan.schedule(groups, plan.owners, w) for w in range(self.group_windows)
    ]
    # Per window and round, what each slot sends and where it adds what it
    # receives (indices into its held / iterated groups); per window and
    # slot, its own slices' Grams and factors (a member that iterates its
    # group in the window).
    held = [{j: i for i, j in enumerate(h)} for h in self.held]

    def tables(rounds, src_of, dst_of):
      send = np.zeros((self.n, max(len(rounds), 1)), np.int32)
      recv = np.zeros((self.n, max(len(rounds), 1)), np.int32)
      for r, messages in enumerate(rounds):
        for src, dst, j in messages:
          send[src, r] = src_of[src][j]
          recv[dst, r] = dst_of[dst][j]
      return send, recv

    self.reduce, self.broadcast, self.own_gram, self.own_factor = [], [], [], []
    for per_slot, sched in zip(self.iterated, self.schedules):
      it = [{j: i for i, j in enumerate(js)} for js in per_slot]
      self.reduce.append(tables(sched.reduce, held, it))
      self.broadcast.append(tables(sched.broadcast, it, held))
      # An iteration owner holding slices of its group: its own Gram (-1:
      # none).
      own_gram = np.full((self.n, max(self.m_iterated, 1)), -1, np.int32)
      own_factor = np.full((self.n, max(self.m_held, 1)), -1, np.int32)
      for s in range(self.n):
        for j, i in it[s].items():
          if j in held[s]:
            own_gram[s, i] = held[s][j]
            own_factor[s, held[s][j]] = i
      self.own_gram.append(own_gram)
      self.own_factor.append(own_factor)


class Carry(NamedTuple):
  """What the stages of :func:`run` pass on, per device."""

  # Per kind (owner-group slices, TP matrices; see _Bodies._over):
  amax: tuple  # max |X| per group at its row position, per TP matrix
  dots: tuple  # <hat, NS(hat)> likewise (adaptive)
  # (held, block): local Grams, packed, per held group; the TP matrices'
  # Grams (then summed over TP).
  grams: tuple
  owned_grams: jax.Array  # (iterated, block): the summed Grams it iterates
  owned_factors: jax.Array  # (iterated, block): their factors
  factors: tuple  # (held, block): its held groups' factors; the TP ones'
  x: tuple[jax.Array, ...]  # the iterated slices, per dtype group
  out: tuple[jax.Array, ...]  # the results, per dtype group


def _zeros_like(x, tie):
  """Zeros like ``x``, made when ``tie`` (``_gather.zero_after``) is."""
  return jnp.zeros_like(x) + tie.astype(x.dtype)


def _put(bufs, gi, off, value):
  """``bufs`` with dtype group ``gi``'s region at ``off`` set to ``value``."""
  return bufs[:gi] + (_set_block(bufs[gi], off, value),) + bufs[gi + 1 :]


def _row(v, i):
  return jax.lax.dynamic_index_in_dim(v, i, 0, keepdims=False)


def _add_row(v, i, value):
  """``v[i] += value`` (``i`` traced or an int)."""
  new = _row(v, i) + value.astype(v.dtype)
  return jax.lax.dynamic_update_index_in_dim(v, new, i, 0)


def _set_block(v, start, value):
  return jax.lax.dynamic_update_slice_in_dim(
    v, value.reshape(-1).astype(v.dtype), start, 0
  )


def _rows(st: Stages, num_plain: int, rows):
  """One slot's rows of the tables (numpy, or read at run time): those of
  ``num_plain`` plain tables (the plain update's), then per part of
  ``st.parts`` (its columns: a slice's offset, held group and row
  position; a TP matrix's offset, Gram block offset and vector position;
  an iterated group's position) per type ``(type, trips, columns)``, the
  trip count a Python int where it is static."""
  rows = iter(rows)
  plain = [next(rows) for _ in range(num_plain)]
  parts = []
  for types, _, trips, cols in st.parts:
    read = [_layout.table_columns(next(rows), cols) for _ in trips]
    parts.append(
      [
        (ty, n if t is None else t, v)
        for ty, (n, v), t in zip(types, read, trips)
      ]
    )
  return plain, parts


def _each(like, part, fn, carry):
  """``carry = fn(carry, typ, *values)`` for each of the slot's items of
  each type of ``part`` (its :func:`_rows`; ``like``: what ``fn`` reads
  besides, see ``_gather.for_each``)."""
  for typ, trips, columns in part:
    carry = _gather.for_each(
      trips, columns, lambda c, *v, typ=typ: fn(c, typ, *v), carry, like
    )
  return carry


@dataclasses.dataclass(frozen=True, eq=False)
class _Bodies:
  """The stages as one program for every slot, ``(rows, carry, hat,
  params) -> carry`` (``rows``: :func:`_rows`'s); ``iterate`` and ``apply``
  take the restart window first. The fields are :func:`run`'s arguments
  (``norm``: the dtype of the norms, Grams and iterated slices)."""

  st: Stages
  cfg: Any
  eps: Any
  finish: Callable
  plain_update: Callable
  norm: Any

  def cd(self, x):
    return x.astype(self.cfg.compute_dtype or x.dtype)

  def _over(self, kind, r, c: Carry, hat, p, fn, carry):
    """``carry = fn(carry, kind, type, offset, at, position)`` for each of
    the slot's owner-group slices (``kind`` 0; ``at``: its held group) or
    TP matrices (1; ``at``: its Gram's offset in the TP block); position:
    its place in the per-matrix vectors (amax, dots)."""
    return _each(
      (hat, p, c),
      r[1][kind],
      lambda v, typ, off, at, i: fn(v, kind, typ, off, at, i),
      carry,
    )

  def _put_gram(self, kind, v, at, gram):
    """A slice's Gram packed and added to its held group's row; a TP
    matrix's set at its block."""
    if kind == 0:
      return _add_row(v, at, pack_symmetric(gram, self.st.block))
    return _set_block(v, at, gram)

  def amax(self, r, c: Carry, hat, p) -> Carry:
    c = c._replace(out=self.plain_update(r[0], hat, p))
    lay = self.st.lay

    def one(v, kind, t, off, at, i):
      x = lay.matrix_at(hat[t.group], off, t.shape)
      return v.at[i].max(jnp.max(jnp.abs(x), initial=0).astype(v.dtype))

    amax = tuple(self._over(k, r, c, hat, p, one, c.amax[k]) for k in (0, 1))
    return c._replace(amax=amax)

  def gram(self, r, c: Carry, hat, p) -> Carry:
    def one(carry, kind, t, off, at, i):
      """The matrix rescaled (its max-abs entry at ``amax[i]``), in the
      norm dtype (read in the loop, see ``_gather.in_loop``); its Gram."""
      grams, x = carry
      raw = _gather.in_loop(
        self.st.lay.matrix_at(hat[t.group], off, t.shape), carry
      )
      xi = _newton_schulz.rescale_large(raw, _row(c.amax[kind], i))
      xi = xi.astype(self.norm)
      m = _newton_schulz.split_last(xi, t.split)
      grams = self._put_gram(kind, grams, at, m @ m.T)
      return grams, _put(x, t.group, off, xi)

    grams, x = list(c.grams), c.x
    for k in (0, 1):
      grams[k], x = self._over(k, r, c, hat, p, one, (grams[k], x))
    return c._replace(grams=tuple(grams), x=x)

  def _factor(self, w, segments, g):
    """The window's factor of Gram ``g`` and the scale it applied (the
    Frobenius normalization, in window 0; else None)."""
    start, end = segments[w]
    rows = np.asarray(self.cfg.coeffs)[start:end]
    dtype = self.cfg.compute_dtype or self.norm
    return _newton_schulz.window_factor(g, rows, w == 0, self.eps, dtype)

  def iterate(self, w, r, c: Carry, hat, p) -> Carry:
    st, lay, norm, cd = self.st, self.st.lay, self.norm, self.cd

    def one_group(q, g, i):
      gram = unpack_symmetric(_gather.in_loop(_row(c.owned_grams, i), q), g)
      fac, sc = self._factor(w, st.group_segments, gram)
      fac = fac.astype(norm) * sc if w == 0 else fac
      packed = pack_symmetric(fac.astype(norm), st.block)
      return jax.lax.dynamic_update_index_in_dim(q, packed, i, 0)

    def one_tp(carry, kind, t, off, block, i):
      qt, x = carry
      if w >= len(t.segments):
        return carry
      gram = lay.matrix_at(c.grams[1], block, (t.gram,) * 2)
      fac, sc = self._factor(w, t.segments, _gather.in_loop(gram, qt))
      if w == 0:
        xi = lay.matrix_at(x[t.group], off, t.shape)
        x = _put(x, t.group, off, cd((xi * sc).astype(norm)))
      return _set_block(qt, block, fac), x

    q = c.owned_factors
    if w < st.group_windows:
      q = _each((hat, p, c), r[1][2 + w], one_group, q)
    qt, x = self._over(1, r, c, hat, p, one_tp, (c.factors[1], c.x))
    return c._replace(owned_factors=q, factors=(c.factors[0], qt), x=x)

  def apply(self, w, r, c: Carry, hat, p) -> Carry:
    """One window of each slice and TP matrix: ``x`` left-multiplied by the
    window's factor; then the next window's Gram, or (last window,
    adaptive) the dual norm's term."""
    st, lay, norm, cd = self.st, self.st.lay, self.norm, self.cd

    def one(carry, kind, t, off, at, i):
      if w >= len(t.segments):
        return carry
      if kind == 0:
        factor = unpack_symmetric(_row(c.factors[0], at), t.gram)
      else:
        factor = lay.matrix_at(c.factors[1], at, (t.gram,) * 2)
      xs, grams, dot = carry
      xi = lay.matrix_at(xs[t.group], off, t.shape)
      m = cd(factor) @ cd(_newton_schulz.split_last(xi, t.split))
      new = _newton_schulz.split_last(m, t.split).astype(norm)
      xs = _put(xs, t.group, off, new)
      if w + 1 < len(t.segments):
        grams = self._put_gram(kind, grams, at, m @ m.T)
      elif self.cfg.adaptive:
        h = lay.matrix_at(hat[t.group], off, t.shape)
        d = jnp.sum(h.astype(norm) * new).astype(dot.dtype)
        dot = dot.at[i].set(d) if kind else dot.at[i].add(d)
      return xs, grams, dot

    # The next window's Grams, made when this window's factors are (see
    # _gather.zero_after), not at the start of the step.
    tie = _gather.zero_after(*c.factors)
    x, grams, dots = c.x, list(c.grams), list(c.dots)
    for k in (0, 1):
      grams[k] = _zeros_like(grams[k], tie)
      if k or w < st.group_windows:
        x, grams[k], dots[k] = self._over(
          k, r, c, hat, p, one, (x, grams[k], dots[k])
        )
    return c._replace(grams=tuple(grams), x=x, dots=tuple(dots))

  def finish_all(self, r, c: Carry, hat, p) -> Carry:
    lay = self.st.lay

    def one(out, kind, t, off, at, i):
      res = self.finish(
        t.unit,
        lay.matrix_at(c.x[t.group], off, t.shape),
        _row(c.dots[kind], i) if self.cfg.adaptive else None,
        None if p is None else lay.matrix_at(p[t.group], off, t.shape),
      )
      return _put(out, t.group, off, res)

    out = c.out
    for k in (0, 1):
      out = self._over(k, r, c, hat, p, one, out)
    return c._replace(out=out)


def _exchange(st: Stages, w, direction, slot, blocks, like, vary, tie):
  """Window ``w``'s exchange (``direction``: ``'reduce'``, the Grams to
  their iteration owners, or ``'broadcast'``, the factors back), into
  zeros like ``like`` (made when ``tie`` is): a slot's own ``blocks``
  (``into[i] += blocks[own[slot, i]]`` where that is not -1), then per
  round each sender's ``blocks[send]`` to its peer, added to the
  receiver's ``[recv]``."""
  own = (st.own_gram if direction == 'reduce' else st.own_factor)[w]
  rounds = getattr(st.schedules[w], direction)
  send, recv = getattr(st, direction)[w]
  which = jnp.asarray(own)[slot]
  mine = jnp.take(blocks, jnp.maximum(which, 0), axis=0)
  into = _zeros_like(like, tie)
  into = into + jnp.where((which >= 0)[:, None], mine, 0).astype(into.dtype)
  send_row = jnp.asarray(send)[slot]
  recv_row = jnp.asarray(recv)[slot]
  for r, messages in enumerate(rounds):
    got = _gather.ppermute_slots(
      _row(blocks, send_row[r]),
      st.axes,
      [(src, dst) for src, dst, _ in messages],
    )
    into = _add_row(into, recv_row[r], _vary(got, vary))
  return into


def run(
  st: Stages,
  cfg,
  eps,
  finish,
  plain_update,
  plain_work,
  hat: Sequence[jax.Array],
  params: Sequence[jax.Array] | None,
  iterations: int,
):
  """The staged update of one layout group.

  Args:
    st: its :class:`Stages`.
    cfg: the ``_owner_update.OwnerConfig`` (coefficient rows, compute
      dtype, ``adaptive``).
    eps: added to the Frobenius norm.
    finish: ``finish(unit, ns_out, dot, param) -> result`` for one
      distributed matrix slice (adaptive scaling, cast, shape factor,
      decay); it may read only what ``st``'s unit key holds of ``unit``
      (a type's items share the body built for one of them).
    plain_update: ``plain_update(offsets, hat, params) -> results``
      of the slot's whole matrices (one flat buffer per dtype group, zeros
      at the distributed matrices' places), ``offsets`` its rows of
      ``plain_work.offsets``.
    plain_work: the plain update's ``_layout.SlotWork``.
    hat: this device's momentum buffers to orthogonalize.
    params: its param buffers (dedicated weight decay) or None.
    iterations: scan iterations of the group (must be 0: scanned stacks
      stay whole).

  Returns:
    The results, one flat buffer per dtype group.
  """
  if iterations:
    raise ValueError(
      'dmuon: internal: owner groups or TP matrices in a scanned stack.'
    )
  vary = tuple(st.axes) + ((st.tp_axis,) if st.tp_axis else ())
  f64 = any(jnp.dtype(b.dtype) == jnp.float64 for b in hat)
  norm = jnp.float64 if f64 else jnp.float32
  bodies = _Bodies(st, cfg, eps, finish, plain_update, norm)
  tables = list(plain_work.offsets)
  tables += [t for _, part, _, _ in st.parts for t in part]

  def stage(body, c):
    """One stage: ``body`` with this device's rows of ``tables`` (one
    program for every slot where they are read at run time)."""

    def f(rows, c, hat, p):
      out = body(_rows(st, len(plain_work.offsets), rows), c, hat, p)
      return jax.tree.map(lambda y: _vary(y, vary), out)

    return _gather.with_slot_rows(st.lay, f, tables, c, hat, params)

  def reduced(c, op, name):
    """The per-matrix vectors ``name`` reduced over each matrix's devices:
    a group's members, a TP matrix's shards."""
    has = (st.group_windows > 0, st.tp_block > 0)
    axes = (st.group_axis, st.tp_axis)
    v = zip(getattr(c, name), has, axes)
    return c._replace(**{name: tuple(op(a, x) if h else a for a, h, x in v)})

  # Buffers made from zeros wait for this group's inputs (else XLA may make
  # them at the start of the step and hold them through it).
  tie = _gather.zero_after(*hat)
  zeros = lambda size, dtype=norm: jnp.zeros((max(size, 1),), dtype)
  blocks = lambda m: jnp.zeros((max(m, 1), max(st.block, 1)), norm)
  c = Carry(
    amax=(zeros(st.vec_groups), zeros(st.vec_tp)),
    dots=(zeros(st.vec_groups), zeros(st.vec_tp)),
    grams=(blocks(st.m_held), zeros(st.tp_block)),
    owned_grams=blocks(st.m_iterated),
    owned_factors=blocks(st.m_iterated),
    factors=(blocks(st.m_held), zeros(st.tp_block)),
    x=tuple(zeros(size) for size in st.lay.local_sizes),
    out=tuple(zeros(n, b.dtype) for n, b in zip(st.lay.local_sizes, hat)),
  )
  c = jax.tree.map(lambda z: z + tie.astype(z.dtype), c)
  c = jax.tree.map(lambda y: _vary(y, vary), c)
  slot = _gather.slot_index(st.axes) if st.n > 1 else 0
  # Collectives run between the stages, on every device.
  c = reduced(stage(bodies.amax, c), jax.lax.pmax, 'amax')
  c = stage(bodies.gram, c)
  for w in range(st.windows):
    # The groups' windows (TP matrices may restart more often).
    grouped = w < st.group_windows
    if grouped:
      owned = _exchange(
        st, w, 'reduce', slot, c.grams[0], c.owned_grams, vary, tie
      )
      c = c._replace(owned_grams=owned)
    if st.tp_block:
      tp_grams = jax.lax.psum(c.grams[1], st.tp_axis)
      c = c._replace(grams=(c.grams[0], tp_grams))
    c = stage(functools.partial(bodies.iterate, w), c)
    if grouped:
      factors = _exchange(
        st, w, 'broadcast', slot, c.owned_factors, c.factors[0], vary, tie
      )
      c = c._replace(factors=(factors, c.factors[1]))
    c = stage(functools.partial(bodies.apply, w), c)
  if cfg.adaptive:
    c = reduced(c, jax.lax.psum, 'dots')
  c = stage(bodies.finish_all, c)
  return c.out


def _vary(y, axes):
  manual = _gather.manual_axes()
  return _gather.to_varying(y, [a for a in axes if a in manual])
