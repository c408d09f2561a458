"""Distributed Gram Newton–Schulz with every collective outside branches.

Owner-group matrices (slices on several owners, see
``_plan.OwnerGroup``) and tensor-parallel ones (slices on the TP shards
of one owner) are orthogonalized together by their holders. Each device
runs its own matrices in a ``lax.switch`` branch on its owner slot; a
collective inside such a branch would be executed by only some of the
devices its replica groups list (NCCL matches collectives by order on each
communicator: a hazard on GPU). So the update runs in *stages*: every stage
is one ``switch`` whose branches compute fixed-shape local results (local
Grams, factors, slices), and between stages one collective per kind runs on
every device:

* ``pmax`` of per-matrix max-abs entries (the power-of-two rescaling of
  huge matrices, as ``_owner_update.rescale_large``);
* per restart window, the local Grams summed: over the TP axis by ``psum``
  (every TP shard then iterates its matrix, as before), and for owner
  groups by one ``psum_scatter`` over the group axis that leaves each
  iteration owner the Grams of the matrices it iterates, alone; their
  factors return by one ``all_gather``;
* with ``adaptive``, the dual norms summed the same way.

Plain (whole) matrices are finished in the first stage, as before.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _collectives, _newton_schulz

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


@dataclasses.dataclass(frozen=True)
class _Item:
  """One distributed matrix as one slot sees it."""

  kind: str  # 'group' or 'tp'
  key: int  # group index, or the TP unit
  units: tuple[int, ...]  # this slot's slices (TP: the one unit)
  split: int  # -1: columns split (Gram over rows), -2: rows split
  gram: int  # g, the Gram's size
  segments: tuple[tuple[int, int], ...]
  pos: int  # index in the per-matrix vectors (amax, dual norm)
  off: int  # offset of its Gram / factor in its block
  member: int  # group: the iteration owner's coordinate on the group axis
  iterates: bool  # group: whether this slot runs the iteration
  holds: bool  # whether this slot holds slices


class Stages:
  """The static plan of a staged update of one layout group."""

  def __init__(self, olayout, lay, ns_steps: int):
    plan = lay.plan
    self.lay = lay
    self.n = lay.num_slots
    self.axes = tuple(olayout.buffer_axes)
    self.group_axis = plan.group_axis()
    self.row_size = (
      dict(zip(plan.axis_names, plan.mesh_shape))[self.group_axis]
      if self.group_axis
      else 1
    )
    self.tp_axis = olayout.tp_axis if olayout.tp_size > 1 else None
    self.tp_size = olayout.tp_size
    k = ns_steps
    group_restarts = _newton_schulz.check_restart_iterations(None, k)
    # Row positions of the groups (for the per-matrix vectors).
    rows: dict[int, list[int]] = {}
    for j, g in enumerate(plan.groups):
      rows.setdefault(plan.group_row(g.iteration_owner), []).append(j)
    pos = {j: i for js in rows.values() for i, j in enumerate(js)}
    self.vec_groups = max((len(js) for js in rows.values()), default=0)
    # Gram blocks: each iteration owner's groups back to back.
    off, used = {}, np.zeros(self.n, np.int64)
    for j, g in enumerate(plan.groups):
      off[j] = int(used[g.iteration_owner])
      used[g.iteration_owner] += g.gram_size**2
    self.block = int(used.max(initial=0))
    iterated: dict[int, set[int]] = {}
    for j, g in enumerate(plan.groups):
      iterated.setdefault(g.iteration_owner, set()).add(j)
    self.items: list[list[_Item]] = []
    tp_block, tp_vec = 0, 0
    for s in range(self.n):
      items = []
      held: dict[int, list[int]] = {}
      tp_used = 0
      for gi in range(lay.num_groups):
        for bucket in lay.buckets(gi, s):
          if bucket.grouped:
            for u in bucket.units:
              held.setdefault(plan.units[u].group, []).append(u)
          elif bucket.tp_split is not None:
            for u in bucket.units:
              m, nn = plan.units[u].shape
              split = bucket.tp_split
              g_size, w = (m, nn) if split == -1 else (nn, m)
              # As _tensor_parallel: a Gram over the long side restarts twice.
              long_gram = k >= 4 and g_size > w * self.tp_size
              restarts = _newton_schulz.check_restart_iterations(
                (1, 3) if long_gram else None, k
              )
              items.append(
                _Item(
                  kind='tp',
                  key=u,
                  units=(u,),
                  split=split,
                  gram=g_size,
                  segments=_newton_schulz.gram_segments(k, restarts),
                  pos=len([i for i in items if i.kind == 'tp']),
                  off=tp_used,
                  member=0,
                  iterates=True,
                  holds=True,
                )
              )
              tp_used += g_size**2
      mine = sorted(set(held) | iterated.get(s, set()))
      for j in mine:
        g = plan.groups[j]
        spec = plan.leaves[lay.unit_leaf[g.units[0]]]
        items.append(
          _Item(
            kind='group',
            key=j,
            units=tuple(held.get(j, ())),
            split=spec.split_axis,
            gram=g.gram_size,
            segments=_newton_schulz.gram_segments(k, group_restarts),
            pos=pos[j],
            off=off[j],
            member=plan.group_member(g.iteration_owner),
            iterates=g.iteration_owner == s,
            holds=j in held,
          )
        )
      tp_block = max(tp_block, tp_used)
      tp_vec = max(tp_vec, len([i for i in items if i.kind == 'tp']))
      self.items.append(items)
    self.tp_block = tp_block
    self.vec_tp = tp_vec
    self.windows = max(
      (len(i.segments) for items in self.items for i in items), default=0
    )
    self.has_groups = bool(plan.groups)
    self.has_tp = tp_block > 0


def needs_stages(olayout, lay) -> bool:
  """Whether a layout group has distributed matrices (groups or TP)."""
  if lay.plan.groups:
    return True
  return olayout.tp_size > 1 and any(s is not None for s in lay.tp_splits)


def _orient(x, split):
  return x if split == -1 else jnp.swapaxes(x, -1, -2)


class Carry(NamedTuple):
  """What the stages of :func:`run` pass on: flat vectors per device.

  The fields keep the order of the string-keyed dict this replaced (its
  sorted keys, noted after each field): the pytree flattens in this order,
  and the operands of every stage's ``switch`` follow it.
  """

  group_amax: jax.Array  # amax_g: max |X| per group, at its row position
  tp_amax: jax.Array  # amax_t: max |X| per TP matrix of the slot
  group_dots: jax.Array  # dot_g: <hat, NS(hat)> per group (adaptive)
  tp_dots: jax.Array  # dot_t: <hat, NS(hat)> per TP matrix (adaptive)
  group_grams: jax.Array  # gram: local Grams, by iteration owner's block
  owned_grams: jax.Array  # gram_in: the summed Grams this slot iterates
  out: tuple[jax.Array, ...]  # out: the results, per dtype group
  owned_factors: jax.Array  # q: the factors of those Grams
  group_factors: jax.Array  # q_all: every member's factors (all-gathered)
  tp_factors: jax.Array  # qt: the TP matrices' factors
  tp_grams: jax.Array  # tg: the TP matrices' Grams (then summed over TP)
  x: tuple[jax.Array, ...]  # x: the iterated slices, per dtype group


def _zeros(size, dtype):
  return jnp.zeros((max(size, 1),), dtype)


def _initial_carry(st: Stages, hat: Sequence[jax.Array], norm) -> Carry:
  """Zeros of the carry's sizes (created in the dict's creation order)."""
  lay = st.lay
  return Carry(
    out=tuple(_zeros(size, b.dtype) for size, b in zip(lay.local_sizes, hat)),
    x=tuple(_zeros(size, norm) for size in lay.local_sizes),
    group_amax=_zeros(st.vec_groups, norm),
    tp_amax=_zeros(st.vec_tp, norm),
    group_grams=_zeros(st.row_size * st.block, norm),
    owned_grams=_zeros(st.block, norm),
    group_factors=_zeros(st.row_size * st.block, norm),
    tp_grams=_zeros(st.tp_block, norm),
    owned_factors=_zeros(st.block, norm),
    tp_factors=_zeros(st.tp_block, norm),
    group_dots=_zeros(st.vec_groups, norm),
    tp_dots=_zeros(st.vec_tp, norm),
  )


def _put(lay, bufs, u, value):
  """``bufs`` with unit ``u``'s region set to ``value``."""
  gi = lay.unit_group[u]
  b = bufs[gi]
  new = jax.lax.dynamic_update_slice_in_dim(
    b, value.reshape(-1).astype(b.dtype), lay.unit_offset[u], 0
  )
  return bufs[:gi] + (new,) + bufs[gi + 1 :]


def _set_vec(v, i, value):
  return v.at[i].set(value.astype(v.dtype))


def _set_block(v, start, value):
  return jax.lax.dynamic_update_slice_in_dim(
    v, value.reshape(-1).astype(v.dtype), start, 0
  )


def _get_block(v, start, g):
  return jax.lax.slice_in_dim(v, start, start + g * g).reshape(g, g)


def _send_gram(st: Stages, it: _Item, grams, tp_grams, g):
  """Puts an item's local Gram where its reduction takes it: the
  iteration owner's block of the group payload, or the TP payload."""
  if it.kind == 'group':
    return _set_block(grams, it.member * st.block + it.off, g), tp_grams
  return grams, _set_block(tp_grams, it.off, g)


@dataclasses.dataclass(frozen=True, eq=False)
class _Bodies:
  """The stages as per-slot branch bodies, ``(slot, carry, hat, params) ->
  carry``; ``iterate`` and ``apply`` take the restart window first. The
  fields are :func:`run`'s arguments (``norm``: the dtype of the norms,
  Grams and iterated slices)."""

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

  def amax(self, s, c: Carry, hat, p) -> Carry:
    c = c._replace(out=self.plain_update(s, hat, p))
    for it in self.st.items[s]:
      if not it.holds:
        continue
      amax = functools.reduce(
        jnp.maximum,
        [
          jnp.max(jnp.abs(self.st.lay.slot_matrix(hat, u)), initial=0)
          for u in it.units
        ],
      )
      if it.kind == 'group':
        c = c._replace(group_amax=_set_vec(c.group_amax, it.pos, amax))
      else:
        c = c._replace(tp_amax=_set_vec(c.tp_amax, it.pos, amax))
    return c

  def gram(self, s, c: Carry, hat, p) -> Carry:
    lay, norm = self.st.lay, self.norm
    grams, tp_grams, x = c.group_grams, c.tp_grams, c.x
    for it in self.st.items[s]:
      if not it.holds:
        continue
      amax = (c.group_amax if it.kind == 'group' else c.tp_amax)[it.pos]
      f = rescale_factor(amax, lay.slot_matrix(hat, it.units[0]).dtype)
      for u in it.units:
        raw = lay.slot_matrix(hat, u)
        x = _put(lay, x, u, (raw * f.astype(raw.dtype)).astype(norm))
      g = sum(
        (lambda m: m @ jnp.swapaxes(m, -1, -2))(
          _orient(lay.slot_matrix(x, u), it.split)
        )
        for u in it.units
      )
      grams, tp_grams = _send_gram(self.st, it, grams, tp_grams, g)
    return c._replace(group_grams=grams, tp_grams=tp_grams, x=x)

  def iterate(self, w, s, c: Carry, hat, p) -> Carry:
    lay, norm, cd = self.st.lay, self.norm, self.cd
    q, qt, x = c.owned_factors, c.tp_factors, c.x
    for it in self.st.items[s]:
      if w >= len(it.segments):
        continue
      start, end = it.segments[w]
      if it.kind == 'group':
        if not it.iterates:
          continue
        g = _get_block(c.owned_grams, it.off, it.gram)
      else:
        g = _get_block(c.tp_grams, it.off, it.gram)
      sc = jnp.ones((), norm)
      if w == 0:
        norm_sq = jnp.trace(g.astype(norm))
        nrm = jnp.sqrt(jnp.maximum(norm_sq, 0)) + self.eps
        sc = (1 / jnp.where(nrm > 0, nrm, 1)).astype(norm)
        r = cd((g.astype(norm) * sc**2))
      else:
        r = cd(g)
      fac = _newton_schulz.gram_factor(r, self.coeff_rows[start:end])
      if it.kind == 'group':
        q = _set_block(q, it.off, fac.astype(norm) * sc if w == 0 else fac)
      else:
        if w == 0:
          for u in it.units:
            x = _put(lay, x, u, cd((lay.slot_matrix(x, u) * sc).astype(norm)))
        qt = _set_block(qt, it.off, fac)
    return c._replace(owned_factors=q, tp_factors=qt, x=x)

  def apply(self, w, s, c: Carry, hat, p) -> Carry:
    st, lay, norm, cd = self.st, self.st.lay, self.norm, self.cd
    grams = jnp.zeros_like(c.group_grams)
    tp_grams = jnp.zeros_like(c.tp_grams)
    x = c.x
    dot_g, dot_t = c.group_dots, c.tp_dots
    for it in st.items[s]:
      if w >= len(it.segments) or not it.holds:
        continue
      if it.kind == 'group':
        start = it.member * st.block + it.off
        fac = _get_block(c.group_factors, start, it.gram)
      else:
        fac = _get_block(c.tp_factors, it.off, it.gram)
      fac = cd(fac)
      last = w + 1 == len(it.segments)
      new = []
      for u in it.units:
        m = fac @ cd(_orient(lay.slot_matrix(x, u), it.split))
        x = _put(lay, x, u, _orient(m, it.split).astype(norm))
        new.append(m)
      if not last:
        g = sum(m @ jnp.swapaxes(m, -1, -2) for m in new)
        grams, tp_grams = _send_gram(st, it, grams, tp_grams, g)
      elif self.adaptive:
        d = sum(
          jnp.sum(lay.slot_matrix(hat, u).astype(norm) * lay.slot_matrix(x, u))
          for u in it.units
        )
        if it.kind == 'group':
          dot_g = _set_vec(dot_g, it.pos, d)
        else:
          dot_t = _set_vec(dot_t, it.pos, d)
    return c._replace(
      group_grams=grams, tp_grams=tp_grams, x=x, group_dots=dot_g, tp_dots=dot_t
    )

  def finish_all(self, s, c: Carry, hat, p) -> Carry:
    lay = self.st.lay
    out = c.out
    for it in self.st.items[s]:
      if not it.holds:
        continue
      dot = None
      if self.adaptive:
        dot = (c.group_dots if it.kind == 'group' else c.tp_dots)[it.pos]
      for u in it.units:
        res = self.finish(
          u,
          lay.slot_matrix(c.x, u),
          dot,
          None if p is None else lay.slot_matrix(p, u),
        )
        out = _put(lay, out, u, res)
    return c._replace(out=out)


def _item_keys(st: Stages, slot_keys: Sequence) -> list:
  """Per slot, its key and its items with units as the facts a branch
  body reads of them: slots of equal keys share one body."""
  lay = st.lay

  def unit_facts(u):
    return (
      int(lay.unit_group[u]),
      int(lay.unit_offset[u]),
      int(lay.unit_size[u]),
      lay.plan.units[u].shape,
    )

  return [
    (
      slot_keys[s],
      tuple(
        dataclasses.replace(
          it, key=0, units=tuple(unit_facts(u) for u in it.units)
        )
        for it in st.items[s]
      ),
    )
    for s in range(st.n)
  ]


def _stage(st: Stages, body, c: Carry, hat, params, iterations, vary, keys):
  """One stage: ``body`` of this device's slot (a ``switch`` over slots,
  mapped over the scan iterations when there are any)."""

  def branch(s):
    def f(c, hat, p):
      out = body(s, c, hat, p)
      return jax.tree.map(lambda y: _vary(y, vary), out)

    return f

  branches = [branch(s) for s in range(st.n)]
  if st.n == 1:
    if iterations:
      return jax.lax.map(lambda a: branches[0](*a), (c, hat, params))
    return branches[0](c, hat, params)
  if iterations:
    return jax.lax.map(
      lambda a: _collectives.switch_by_slot(
        st.axes, branches, a[1], a[2], a[3], shift=a[0], keys=keys
      ),
      (jnp.arange(iterations), c, hat, params),
    )
  return _collectives.switch_by_slot(
    st.axes, branches, c, hat, params, keys=keys
  )


def run(
  st: Stages,
  finish,
  plain_update,
  coeff_rows: np.ndarray,
  compute_dtype,
  eps,
  adaptive: bool,
  hat: Sequence[jax.Array],
  params: Sequence[jax.Array] | None,
  iterations: int,
  slot_keys: Sequence | None = None,
):
  """The staged update of one layout group.

  Args:
    st: its :class:`Stages`.
    finish: ``finish(unit, ns_out, dot, param) -> result`` for one
      distributed matrix slice (adaptive scaling, cast, shape factor,
      decay).
    coeff_rows: the Newton–Schulz coefficient rows.
    plain_update: ``plain_update(slot, hat, params) -> results`` of the
      slot's whole matrices (one flat buffer per dtype group, zeros at the
      distributed matrices' places).
    compute_dtype: dtype name of the iterations, or None.
    eps: added to the Frobenius norm.
    adaptive: whether dual norms scale the results.
    hat: this device's momentum buffers to orthogonalize.
    params: its param buffers (dedicated weight decay) or None.
    iterations: scan iterations of the group (0: none).
    slot_keys: (optional) per slot, a hashable of what ``plain_update`` and
      ``finish`` read of it: with the slot's items, slots of equal keys
      share one branch body per stage.

  Returns:
    The results, one flat buffer per dtype group.
  """
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
  keys = None if slot_keys is None else _item_keys(st, slot_keys)

  def stage(body, c):
    return _stage(st, body, c, hat, params, iterations, vary, keys)

  c = _initial_carry(st, hat, norm)
  if iterations:
    c = jax.tree.map(lambda y: jnp.broadcast_to(y, (iterations,) + y.shape), c)
  c = jax.tree.map(lambda y: _vary(y, vary), c)
  # Collectives run between the stages, on every device.
  c = stage(bodies.amax, c)
  if st.has_groups:
    c = c._replace(group_amax=jax.lax.pmax(c.group_amax, st.group_axis))
  if st.has_tp:
    c = c._replace(tp_amax=jax.lax.pmax(c.tp_amax, st.tp_axis))
  c = stage(bodies.gram, c)
  for w in range(st.windows):
    if st.has_groups:
      owned = jax.lax.psum_scatter(
        c.group_grams,
        st.group_axis,
        scatter_dimension=c.group_grams.ndim - 1,
        tiled=True,
      )
      c = c._replace(owned_grams=owned)
    if st.has_tp:
      c = c._replace(tp_grams=jax.lax.psum(c.tp_grams, st.tp_axis))
    c = stage(functools.partial(bodies.iterate, w), c)
    if st.has_groups:
      factors = jax.lax.all_gather(
        c.owned_factors,
        st.group_axis,
        axis=c.owned_factors.ndim - 1,
        tiled=True,
      )
      c = c._replace(group_factors=factors)
    c = stage(functools.partial(bodies.apply, w), c)
  if adaptive:
    if st.has_groups:
      c = c._replace(group_dots=jax.lax.psum(c.group_dots, st.group_axis))
    if st.has_tp:
      c = c._replace(tp_dots=jax.lax.psum(c.tp_dots, st.tp_axis))
  c = stage(bodies.finish_all, c)
  return c.out


def _vary(y, axes):
  manual = _collectives.manual_axes()
  return _collectives.to_varying(y, [a for a in axes if a in manual])
