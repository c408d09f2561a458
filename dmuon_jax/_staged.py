"""Distributed Gram Newton–Schulz with every collective outside branches.

Owner-group matrices (slices on several owners, see
``_plan.OwnerGroup``) and tensor-parallel ones (slices on the TP shards
of one owner) are orthogonalized together by their holders. Each device
runs its own matrices in a ``lax.switch`` branch; a collective inside such
a branch would be executed by only some of the devices its replica groups
list (NCCL matches collectives by order on each communicator: a hazard on
GPU). So the update runs in *stages*: every stage is one ``switch`` whose
branches compute fixed-shape local results (local Grams, factors, slices),
and between stages the collectives run on every device:

* ``pmax`` of per-matrix max-abs entries (the power-of-two rescaling of
  huge matrices, as ``_owner_update.rescale_large``);
* per restart window, the local Grams summed: over the TP axis by ``psum``
  (every TP shard then iterates its matrix, as before); for owner groups
  each member's Gram goes to its group's iteration owner and the factor
  comes back, point to point (``ppermute`` rounds of
  :mod:`dmuon_jax._gram_exchange`: a group's traffic stays between its
  members), as packed triangles (:func:`pack_symmetric`);
* with ``adaptive``, the dual norms summed the same way.

Branch bodies are keyed by what they compute (the shapes of a slot's
slices, the sizes of the Grams it iterates), never by where things sit:
offsets in the buffers, a slice's group among the slot's, its Gram's place
in the exchange are read from slot-indexed tables (``axis_index``), so the
program's size follows the model's shapes and the plan's few signatures,
not the number of devices. Plain (whole) matrices are finished in the
first stage.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _collectives, _gram_exchange, _layout, _newton_schulz

# Matrices whose largest entry exceeds this are divided by a power of two
# before Newton-Schulz (see _owner_update.rescale_large).
LARGE = 2.0**10


def rescale_factor(amax: jax.Array, dtype) -> jax.Array:
  """The power of two that brings a matrix whose max-abs entry is ``amax``
  (above ``LARGE``) to a max-abs entry in ``[0.5, 1)``; 1 otherwise, and for
  dtypes whose range stays below ``LARGE`` (see
  ``_owner_update.rescale_large``)."""
  if not jnp.issubdtype(dtype, jnp.floating) or (jnp.finfo(dtype).max <= LARGE):
    return jnp.ones(jnp.shape(amax), dtype)
  # The factor is built from the IEEE 754 exponent field (as frexp reads
  # it): a few integer ops, where jnp.frexp + jnp.ldexp expand to ~60 ops
  # per call (a third of a small model's compiled update). Exact: float32
  # holds every bfloat16/float16 value.
  wide = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
  info = jnp.finfo(wide)
  ints = jnp.int64 if wide == jnp.float64 else jnp.int32
  bias = info.maxexp - 1  # 127 for float32
  a = amax.astype(wide)
  field = (jax.lax.bitcast_convert_type(a, ints) >> info.nmant) & (2 * bias + 1)
  # a = f * 2**e, f in [0.5, 1), e = field - bias + 1; 2**-e has the field
  # bias - e. At most 2**(1 - bias), the smallest normal (a >= 2**(bias -
  # 1), near float32's max: the result's max-abs entry is then in [1, 4)).
  scale_field = jnp.maximum(2 * bias - 1 - field, 1).astype(ints)
  factor = jax.lax.bitcast_convert_type(scale_field << info.nmant, wide)
  return jnp.where((a > LARGE) & (a < jnp.inf), factor, 1).astype(dtype)


def pack_symmetric(a: jax.Array) -> jax.Array:
  """A symmetric ``g x g`` matrix as ``triangle_size(g)`` elements.

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
  return jnp.concatenate([a12.reshape(-1), q.reshape(-1), jnp.diagonal(a22)])


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


class _Slice(NamedTuple):
  """A slot's slice of an owner group, as its branch body reads it."""

  unit: int  # this slot's unit (a representative for slots of equal keys)
  shape: tuple[int, int]
  split: int  # -1: columns split (Gram over rows), -2: rows split
  gram: int  # g, the Gram's size
  group: int  # dtype group of its buffer


class _TP(NamedTuple):
  """A slot's TP-split matrix (every TP shard iterates it)."""

  unit: int
  shape: tuple[int, int]
  split: int
  gram: int
  group: int
  segments: tuple[tuple[int, int], ...]
  off: int  # its Gram's offset in the TP block (canonical order)


class Stages:
  """The static plan of a staged update of one layout group.

  Attributes:
    n: the number of owner slots.
    axes: the owner axes (the ``ppermute`` and ``switch`` run over them).
    group_axis: the axis a group's members share (its ``pmax``/``psum`` of
      per-matrix scalars).
    slices: per slot, its slices of owner groups in canonical order (by
      shape; that order indexes :attr:`slice_table`).
    slice_table: per slot: (count, buffer offsets, the slice's group among
      the slot's held ones, its group's position in the row's vectors).
    iterated: per slot, the Gram sizes of the groups it iterates.
    held: per slot, the groups (plan indices) it holds slices of.
    tps: per slot, its TP matrices (canonical order; offsets in
      :attr:`tp_table`).
    schedule: the exchange's rounds (:mod:`dmuon_jax._gram_exchange`).
    windows: restart windows of the longest iteration.
    tp_block: elements of a slot's TP Grams; vec_tp, vec_groups: lengths
      of the per-matrix vectors.
  """

  def __init__(self, olayout, lay, ns_steps: int):
    plan = lay.plan
    self.lay = lay
    self.n = lay.num_slots
    self.axes = tuple(olayout.buffer_axes)
    self.group_axis = plan.group_axis()
    self.tp_axis = olayout.tp_axis if olayout.tp_size > 1 else None
    self.tp_size = olayout.tp_size
    k = ns_steps
    self.group_segments = _newton_schulz.gram_segments(
      k, _newton_schulz.check_restart_iterations(None, k)
    )
    groups = plan.groups
    # Row positions of the groups (for the per-matrix vectors).
    rows: dict[int, list[int]] = {}
    for j, g in enumerate(groups):
      rows.setdefault(plan.group_row(g.iteration_owner), []).append(j)
    pos = {j: i for js in rows.values() for i, j in enumerate(js)}
    self.vec_groups = max((len(js) for js in rows.values()), default=0)
    self.iterated_groups = [
      [j for j, g in enumerate(groups) if g.iteration_owner == s]
      for s in range(self.n)
    ]
    self.iterated = [
      tuple(groups[j].gram_size for j in js) for js in self.iterated_groups
    ]
    self.held: list[list[int]] = []
    self.slices: list[list[_Slice]] = []
    self.tps: list[list[_TP]] = []
    slice_rows, tp_rows = [], []
    for s in range(self.n):
      found, tps = [], []
      for gi in range(lay.num_groups):
        for bucket in lay.buckets(gi, s):
          for u in bucket.units:
            if bucket.grouped:
              j = plan.units[u].group
              spec = plan.leaves[lay.unit_leaf[u]]
              found.append(
                (
                  j,
                  _Slice(
                    u,
                    plan.units[u].shape,
                    spec.split_axis,
                    groups[j].gram_size,
                    gi,
                  ),
                )
              )
            elif bucket.tp_split is not None:
              m, nn = plan.units[u].shape
              split = bucket.tp_split
              g_size, w = (m, nn) if split == -1 else (nn, m)
              # As _tensor_parallel: a Gram over the long side restarts
              # twice.
              long_gram = k >= 4 and g_size > w * self.tp_size
              restarts = _newton_schulz.check_restart_iterations(
                (1, 3) if long_gram else None, k
              )
              tps.append(
                _TP(
                  u,
                  (m, nn),
                  split,
                  g_size,
                  gi,
                  _newton_schulz.gram_segments(k, restarts),
                  0,
                )
              )
      held = sorted({j for j, _ in found})
      local = {j: i for i, j in enumerate(held)}
      found.sort(
        key=lambda e: (
          e[1].shape,
          e[1].split,
          e[1].gram,
          e[1].group,
          local[e[0]],
          e[1].unit,
        )
      )
      self.held.append(held)
      self.slices.append([sl for _, sl in found])
      slice_rows.append(
        (
          [lay.unit_offset[sl.unit] for _, sl in found],
          [local[j] for j, _ in found],
          [pos[j] for j, _ in found],
        )
      )
      tps.sort(key=lambda t: (t.shape, t.split, t.group, t.unit))
      placed, used = [], 0
      for t in tps:
        placed.append(t._replace(off=used))
        used += t.gram**2
      self.tps.append(placed)
      tp_rows.append(([lay.unit_offset[t.unit] for t in placed],))
    self.slice_table = _layout.unit_table(slice_rows)
    self.tp_table = _layout.unit_table(tp_rows)
    self.has_groups = bool(groups)
    self.tp_block = max(
      (sum(t.gram**2 for t in tps) for tps in self.tps), default=0
    )
    self.vec_tp = max((len(tps) for tps in self.tps), default=0)
    self.has_tp = self.tp_block > 0
    self.m_held = max((len(h) for h in self.held), default=0)
    self.m_iterated = max((len(i) for i in self.iterated), default=0)
    self.block = max(
      (_gram_exchange.triangle_size(g.gram_size) for g in groups), default=0
    )
    self.windows = max(
      [len(self.group_segments) if groups else 0]
      + [len(t.segments) for tps in self.tps for t in tps]
    )
    self.schedule = _gram_exchange.schedule(groups, plan.owners)
    self._exchange_tables()

  def _exchange_tables(self) -> None:
    """Per round, what each slot sends and where it adds what it receives
    (indices into its held / iterated groups); per slot, its own slices'
    Grams and factors (a member that iterates its group)."""
    held = [{j: i for i, j in enumerate(h)} for h in self.held]
    it = [{j: i for i, j in enumerate(js)} for js in self.iterated_groups]

    def tables(rounds, src_of, dst_of):
      send = np.zeros((self.n, max(len(rounds), 1)), np.int32)
      recv = np.zeros((self.n, max(len(rounds), 1)), np.int32)
      for r, messages in enumerate(rounds):
        for src, dst, j in messages:
          send[src, r] = src_of[src][j]
          recv[dst, r] = dst_of[dst][j]
      return send, recv

    self.reduce_send, self.reduce_recv = tables(self.schedule.reduce, held, it)
    self.bcast_send, self.bcast_recv = tables(self.schedule.broadcast, it, held)
    # An iteration owner holding slices of its group: its own Gram (-1: none).
    self.own_gram = np.full((self.n, max(self.m_iterated, 1)), -1, np.int32)
    self.own_factor = np.full((self.n, max(self.m_held, 1)), -1, np.int32)
    for s in range(self.n):
      for j, i in it[s].items():
        if j in held[s]:
          self.own_gram[s, i] = held[s][j]
          self.own_factor[s, held[s][j]] = i

  def slice_key(self, s: int) -> tuple:
    return tuple(sl[1:] for sl in self.slices[s])

  def tp_key(self, s: int) -> tuple:
    return tuple(t[1:] for t in self.tps[s])


def needs_stages(olayout, lay) -> bool:
  """Whether a layout group has distributed matrices (groups or TP)."""
  if lay.plan.groups:
    return True
  return olayout.tp_size > 1 and any(s is not None for s in lay.tp_splits)


def _orient(x, split):
  return x if split == -1 else jnp.swapaxes(x, -1, -2)


class Carry(NamedTuple):
  """What the stages of :func:`run` pass on, per device."""

  group_amax: jax.Array  # max |X| per group, at its row position
  tp_amax: jax.Array  # max |X| per TP matrix of the slot
  group_dots: jax.Array  # <hat, NS(hat)> per group (adaptive)
  tp_dots: jax.Array  # <hat, NS(hat)> per TP matrix (adaptive)
  held_grams: jax.Array  # (held, block): local Grams, packed, per held group
  owned_grams: jax.Array  # (iterated, block): the summed Grams it iterates
  owned_factors: jax.Array  # (iterated, block): their factors
  held_factors: jax.Array  # (held, block): the factors of its held groups
  tp_grams: jax.Array  # the TP matrices' Grams (then summed over TP)
  tp_factors: jax.Array  # the TP matrices' factors
  x: tuple[jax.Array, ...]  # the iterated slices, per dtype group
  out: tuple[jax.Array, ...]  # the results, per dtype group


def _zeros(size, dtype):
  return jnp.zeros((max(size, 1),), dtype)


def _initial_carry(
  st: Stages, hat: Sequence[jax.Array], norm, tie: jax.Array
) -> Carry:
  """Zeros, made when ``tie`` (see ``_collectives.zero_after``) is."""
  lay = st.lay
  blocks = lambda m: jnp.zeros((max(m, 1), max(st.block, 1)), norm)
  carry = Carry(
    group_amax=_zeros(st.vec_groups, norm),
    tp_amax=_zeros(st.vec_tp, norm),
    group_dots=_zeros(st.vec_groups, norm),
    tp_dots=_zeros(st.vec_tp, norm),
    held_grams=blocks(st.m_held),
    owned_grams=blocks(st.m_iterated),
    owned_factors=blocks(st.m_iterated),
    held_factors=blocks(st.m_held),
    tp_grams=_zeros(st.tp_block, norm),
    tp_factors=_zeros(st.tp_block, norm),
    x=tuple(_zeros(size, norm) for size in lay.local_sizes),
    out=tuple(_zeros(size, b.dtype) for size, b in zip(lay.local_sizes, hat)),
  )
  return jax.tree.map(lambda z: z + tie.astype(z.dtype), carry)


def _put(bufs, gi, off, value):
  """``bufs`` with dtype group ``gi``'s region at ``off`` set to ``value``."""
  b = bufs[gi]
  new = jax.lax.dynamic_update_slice_in_dim(
    b, value.reshape(-1).astype(b.dtype), off, 0
  )
  return bufs[:gi] + (new,) + bufs[gi + 1 :]


def _row(v, i):
  return jax.lax.dynamic_index_in_dim(v, i, 0, keepdims=False)


def _add_row(v, i, value):
  """``v[i] += value`` (``i`` traced or an int)."""
  new = _row(v, i) + value.astype(v.dtype)
  return jax.lax.dynamic_update_index_in_dim(v, new, i, 0)


def _max_at(v, i, value):
  return v.at[i].max(value.astype(v.dtype))


def _add_at(v, i, value):
  return v.at[i].add(value.astype(v.dtype))


def _set_block(v, start, value):
  return jax.lax.dynamic_update_slice_in_dim(
    v, value.reshape(-1).astype(v.dtype), start, 0
  )


def _get_block(v, start, g):
  return jax.lax.slice_in_dim(v, start, start + g * g).reshape(g, g)


def _packed(m, block):
  """``m`` (symmetric) packed, zero-padded to ``block`` elements."""
  p = pack_symmetric(m)
  return jnp.pad(p, (0, block - p.shape[0])) if p.shape[0] < block else p


class _Rows(NamedTuple):
  """One slot's rows of the tables (ints, or read at run time)."""

  plain: Sequence  # the plain update's offsets, per dtype group
  offset: Any  # per slice: its buffer offset
  held: Any  # per slice: its group among the slot's held ones
  pos: Any  # per slice: its group's row position
  tp: Any  # per TP matrix: its buffer offset


def _rows(st: Stages, plain_tables: Sequence[np.ndarray], rows) -> _Rows:
  plain = rows[: len(plain_tables)]
  _, (offset, held, pos) = _layout.table_columns(rows[-2], 3)
  _, (tp,) = _layout.table_columns(rows[-1], 1)
  ix = _layout.index
  return _Rows(
    plain,
    [ix(offset[i]) for i in range(offset.shape[0])],
    [ix(held[i]) for i in range(held.shape[0])],
    [ix(pos[i]) for i in range(pos.shape[0])],
    [ix(tp[i]) for i in range(tp.shape[0])],
  )


@dataclasses.dataclass(frozen=True, eq=False)
class _Bodies:
  """The stages as per-slot branch bodies, ``(slot, rows, carry, hat,
  params) -> carry`` (``rows``: :class:`_Rows`); ``iterate`` and ``apply``
  take the restart window first. The fields are :func:`run`'s arguments
  (``norm``: the dtype of the norms, Grams and iterated slices)."""

  st: Stages
  finish: Callable
  plain_update: Callable
  coeff_rows: np.ndarray
  compute_dtype: Any  # a jnp.dtype, or None
  eps: Any
  adaptive: bool
  norm: Any

  def cd(self, x):
    return x.astype(self.compute_dtype or x.dtype)

  def amax(self, s, r: _Rows, c: Carry, hat, p) -> Carry:
    c = c._replace(out=self.plain_update(s, r.plain, hat, p))
    lay = self.st.lay
    amax = c.group_amax
    for i, sl in enumerate(self.st.slices[s]):
      x = lay.matrix_at(hat[sl.group], r.offset[i], sl.shape)
      amax = _max_at(amax, r.pos[i], jnp.max(jnp.abs(x), initial=0))
    tp_amax = c.tp_amax
    for i, t in enumerate(self.st.tps[s]):
      x = lay.matrix_at(hat[t.group], r.tp[i], t.shape)
      tp_amax = _max_at(tp_amax, i, jnp.max(jnp.abs(x), initial=0))
    return c._replace(group_amax=amax, tp_amax=tp_amax)

  def gram(self, s, r: _Rows, c: Carry, hat, p) -> Carry:
    lay, norm, block = self.st.lay, self.norm, self.st.block
    grams, tp_grams, x = c.held_grams, c.tp_grams, c.x
    for i, sl in enumerate(self.st.slices[s]):
      raw = lay.matrix_at(hat[sl.group], r.offset[i], sl.shape)
      f = rescale_factor(_row(c.group_amax, r.pos[i]), raw.dtype)
      xi = (raw * f.astype(raw.dtype)).astype(norm)
      x = _put(x, sl.group, r.offset[i], xi)
      m = _orient(xi, sl.split)
      grams = _add_row(grams, r.held[i], _packed(m @ m.T, block))
    for i, t in enumerate(self.st.tps[s]):
      raw = lay.matrix_at(hat[t.group], r.tp[i], t.shape)
      f = rescale_factor(c.tp_amax[i], raw.dtype)
      xi = (raw * f.astype(raw.dtype)).astype(norm)
      x = _put(x, t.group, r.tp[i], xi)
      m = _orient(xi, t.split)
      tp_grams = _set_block(tp_grams, t.off, m @ m.T)
    return c._replace(held_grams=grams, tp_grams=tp_grams, x=x)

  def _factor(self, w, segments, g):
    """The window's factor of Gram ``g`` and the scale it applied (the
    Frobenius normalization, in window 0)."""
    norm, cd = self.norm, self.cd
    start, end = segments[w]
    sc = jnp.ones((), norm)
    if w == 0:
      norm_sq = jnp.trace(g.astype(norm))
      nrm = jnp.sqrt(jnp.maximum(norm_sq, 0)) + self.eps
      sc = (1 / jnp.where(nrm > 0, nrm, 1)).astype(norm)
      r = cd(g.astype(norm) * sc**2)
    else:
      r = cd(g)
    return _newton_schulz.gram_factor(r, self.coeff_rows[start:end]), sc

  def iterate(self, w, s, r: _Rows, c: Carry, hat, p) -> Carry:
    st, lay, norm, cd = self.st, self.st.lay, self.norm, self.cd
    q, qt, x = c.owned_factors, c.tp_factors, c.x
    if w < len(st.group_segments):
      for i, g in enumerate(st.iterated[s]):
        gram = unpack_symmetric(c.owned_grams[i], g)
        fac, sc = self._factor(w, st.group_segments, gram)
        fac = fac.astype(norm) * sc if w == 0 else fac
        q = q.at[i].set(_packed(fac.astype(norm), st.block))
    for i, t in enumerate(st.tps[s]):
      if w >= len(t.segments):
        continue
      fac, sc = self._factor(
        w, t.segments, _get_block(c.tp_grams, t.off, t.gram)
      )
      if w == 0:
        xi = lay.matrix_at(x[t.group], r.tp[i], t.shape)
        x = _put(x, t.group, r.tp[i], cd((xi * sc).astype(norm)))
      qt = _set_block(qt, t.off, fac)
    return c._replace(owned_factors=q, tp_factors=qt, x=x)

  def apply(self, w, s, r: _Rows, c: Carry, hat, p) -> Carry:
    st, lay, norm, cd = self.st, self.st.lay, self.norm, self.cd
    grams = jnp.zeros_like(c.held_grams)
    tp_grams = jnp.zeros_like(c.tp_grams)
    x = c.x
    dot_g, dot_t = c.group_dots, c.tp_dots
    if w < len(st.group_segments):
      last = w + 1 == len(st.group_segments)
      for i, sl in enumerate(st.slices[s]):
        fac = cd(unpack_symmetric(_row(c.held_factors, r.held[i]), sl.gram))
        xi = lay.matrix_at(x[sl.group], r.offset[i], sl.shape)
        m = fac @ cd(_orient(xi, sl.split))
        new = _orient(m, sl.split).astype(norm)
        x = _put(x, sl.group, r.offset[i], new)
        if not last:
          grams = _add_row(grams, r.held[i], _packed(m @ m.T, st.block))
        elif self.adaptive:
          h = lay.matrix_at(hat[sl.group], r.offset[i], sl.shape)
          dot_g = _add_at(dot_g, r.pos[i], jnp.sum(h.astype(norm) * new))
    for i, t in enumerate(st.tps[s]):
      if w >= len(t.segments):
        continue
      last = w + 1 == len(t.segments)
      fac = cd(_get_block(c.tp_factors, t.off, t.gram))
      xi = lay.matrix_at(x[t.group], r.tp[i], t.shape)
      m = fac @ cd(_orient(xi, t.split))
      new = _orient(m, t.split).astype(norm)
      x = _put(x, t.group, r.tp[i], new)
      if not last:
        tp_grams = _set_block(tp_grams, t.off, m @ m.T)
      elif self.adaptive:
        h = lay.matrix_at(hat[t.group], r.tp[i], t.shape)
        dot_t = dot_t.at[i].set(jnp.sum(h.astype(norm) * new).astype(norm))
    return c._replace(
      held_grams=grams, tp_grams=tp_grams, x=x, group_dots=dot_g, tp_dots=dot_t
    )

  def finish_all(self, s, r: _Rows, c: Carry, hat, p) -> Carry:
    lay = self.st.lay
    out = c.out
    items = [
      (sl, r.offset[i], r.pos[i], c.group_dots)
      for i, sl in enumerate(self.st.slices[s])
    ]
    items += [(t, r.tp[i], i, c.tp_dots) for i, t in enumerate(self.st.tps[s])]
    for it, off, pos, dots in items:
      dot = _row(dots, pos) if self.adaptive else None
      res = self.finish(
        it.unit,
        lay.matrix_at(c.x[it.group], off, it.shape),
        dot,
        None if p is None else lay.matrix_at(p[it.group], off, it.shape),
      )
      out = _put(out, it.group, off, res)
    return c._replace(out=out)


def _stage(st, body, tables, keys, c: Carry, hat, params, vary, dynamic):
  """One stage: ``body`` of this device's slot (a ``switch`` over bodies
  keyed by ``keys``, the slot's rows of ``tables`` read inside)."""

  def branch(s):
    def f(rows, c, hat, p):
      out = body(s, _rows(st, tables[:-2], rows), c, hat, p)
      return jax.tree.map(lambda y: _vary(y, vary), out)

    return f

  if st.n == 1:
    return branch(0)([np.asarray(t)[0] for t in tables], c, hat, params)
  return _collectives.switch_with_tables(
    st.axes,
    [branch(s) for s in range(st.n)],
    tables,
    c,
    hat,
    params,
    keys=keys,
    dynamic=dynamic,
  )


def _exchange(
  st: Stages, slot, own, rounds, send, recv, blocks, like, vary, tie
):
  """One direction of the groups' exchange, into zeros like ``like`` (made
  when ``tie`` is): a slot's own ``blocks`` (``own``, see :func:`_own`),
  then per round each sender's ``blocks[send]`` to its peer, added to the
  receiver's ``[recv]``."""
  into = _own(own, slot, blocks, jnp.zeros_like(like) + tie.astype(like.dtype))
  send_row = jnp.asarray(send)[slot]
  recv_row = jnp.asarray(recv)[slot]
  for r, messages in enumerate(rounds):
    got = _collectives.ppermute_slots(
      _row(blocks, send_row[r]),
      st.axes,
      [(src, dst) for src, dst, _ in messages],
    )
    into = _add_row(into, recv_row[r], _vary(got, vary))
  return into


def _own(table, slot, blocks, into):
  """``into[i] += blocks[table[slot, i]]`` where that is not -1."""
  which = jnp.asarray(table)[slot]
  mine = jnp.take(blocks, jnp.maximum(which, 0), axis=0)
  return into + jnp.where((which >= 0)[:, None], mine, 0).astype(into.dtype)


def run(
  st: Stages,
  finish,
  finish_key,
  plain_update,
  plain_work,
  coeff_rows: np.ndarray,
  compute_dtype,
  eps,
  adaptive: bool,
  hat: Sequence[jax.Array],
  params: Sequence[jax.Array] | None,
  iterations: int,
):
  """The staged update of one layout group.

  Args:
    st: its :class:`Stages`.
    finish: ``finish(unit, ns_out, dot, param) -> result`` for one
      distributed matrix slice (adaptive scaling, cast, shape factor,
      decay); it may read only what ``finish_key(unit)`` holds of
      ``unit`` (slots of equal keys share the body built for one of them).
    finish_key: ``finish_key(unit)``, hashable: what ``finish`` reads of
      it (its whole matrix's shape, whether it decays, its dtype group).
    plain_update: ``plain_update(slot, offsets, hat, params) -> results``
      of the slot's whole matrices (one flat buffer per dtype group, zeros
      at the distributed matrices' places), ``offsets`` its rows of
      ``plain_work.offsets``.
    plain_work: the plain update's ``_layout.SlotWork``.
    coeff_rows: the Newton–Schulz coefficient rows.
    compute_dtype: dtype name of the iterations, or None.
    eps: added to the Frobenius norm.
    adaptive: whether dual norms scale the results.
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
  norm = (
    jnp.float64
    if any(jnp.dtype(b.dtype) == jnp.float64 for b in hat)
    else jnp.float32
  )
  bodies = _Bodies(
    st,
    finish,
    plain_update,
    coeff_rows,
    jnp.dtype(compute_dtype) if compute_dtype else None,
    eps,
    adaptive,
    norm,
  )
  tables = list(plain_work.offsets) + [st.slice_table, st.tp_table]
  dynamic = st.lay.dynamic
  n = st.n
  held = [(st.slice_key(s), st.tp_key(s)) for s in range(n)]
  finish_keys = [
    (held[s], tuple(finish_key(it.unit) for it in st.slices[s] + st.tps[s]))
    for s in range(n)
  ]
  keys = {
    'amax': [(plain_work.keys[s], held[s]) for s in range(n)],
    'gram': held,
    'iterate': [(st.iterated[s], st.tp_key(s)) for s in range(n)],
    'apply': held,
    'finish': finish_keys,
  }

  def stage(name, body, c):
    return _stage(st, body, tables, keys[name], c, hat, params, vary, dynamic)

  # Buffers made from zeros wait for this group's inputs (else XLA may make
  # them at the start of the step and hold them through it).
  tie = _collectives.zero_after(*hat)
  c = _initial_carry(st, hat, norm, tie)
  c = jax.tree.map(lambda y: _vary(y, vary), c)
  slot = _collectives.slot_index(st.axes) if n > 1 else 0
  # Collectives run between the stages, on every device.
  c = stage('amax', bodies.amax, c)
  if st.has_groups:
    c = c._replace(group_amax=jax.lax.pmax(c.group_amax, st.group_axis))
  if st.has_tp:
    c = c._replace(tp_amax=jax.lax.pmax(c.tp_amax, st.tp_axis))
  c = stage('gram', bodies.gram, c)
  for w in range(st.windows):
    if st.has_groups:
      owned = _exchange(
        st,
        slot,
        st.own_gram,
        st.schedule.reduce,
        st.reduce_send,
        st.reduce_recv,
        c.held_grams,
        c.owned_grams,
        vary,
        tie,
      )
      c = c._replace(owned_grams=owned)
    if st.has_tp:
      c = c._replace(tp_grams=jax.lax.psum(c.tp_grams, st.tp_axis))
    c = stage('iterate', functools.partial(bodies.iterate, w), c)
    if st.has_groups:
      factors = _exchange(
        st,
        slot,
        st.own_factor,
        st.schedule.broadcast,
        st.bcast_send,
        st.bcast_recv,
        c.owned_factors,
        c.held_factors,
        vary,
        tie,
      )
      c = c._replace(held_factors=factors)
    c = stage('apply', functools.partial(bodies.apply, w), c)
  if adaptive:
    if st.has_groups:
      c = c._replace(group_dots=jax.lax.psum(c.group_dots, st.group_axis))
    if st.has_tp:
      c = c._replace(tp_dots=jax.lax.psum(c.tp_dots, st.tp_axis))
  c = stage('finish', bodies.finish_all, c)
  return c.out


def _vary(y, axes):
  manual = _collectives.manual_axes()
  return _collectives.to_varying(y, [a for a in axes if a in manual])
