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
from collections.abc import Sequence

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
  lay = st.lay
  vary = tuple(st.axes) + ((st.tp_axis,) if st.tp_axis else ())
  norm = (
    jnp.float64
    if any(jnp.dtype(b.dtype) == jnp.float64 for b in hat)
    else jnp.float32
  )

  def region(bufs, u):
    return lay.slot_matrix(bufs, u)

  def put(bufs, u, value):
    gi = lay.unit_group[u]
    b = bufs[gi]
    new = jax.lax.dynamic_update_slice_in_dim(
      b, value.reshape(-1).astype(b.dtype), lay.unit_offset[u], 0
    )
    return bufs[:gi] + (new,) + bufs[gi + 1 :]

  def zeros(size, dtype=norm):
    return jnp.zeros((max(size, 1),), dtype)

  def carry0():
    c = {
      'out': tuple(
        zeros(size, b.dtype) for size, b in zip(lay.local_sizes, hat)
      ),
      'x': tuple(zeros(size) for size in lay.local_sizes),
      'amax_g': zeros(st.vec_groups),
      'amax_t': zeros(st.vec_tp),
      'gram': zeros(st.row_size * st.block),
      'gram_in': zeros(st.block),
      'q_all': zeros(st.row_size * st.block),
      'tg': zeros(st.tp_block),
      'q': zeros(st.block),
      'qt': zeros(st.tp_block),
      'dot_g': zeros(st.vec_groups),
      'dot_t': zeros(st.vec_tp),
    }
    return c

  cdt = jnp.dtype(compute_dtype) if compute_dtype else None

  def cd(x):
    return x.astype(cdt or x.dtype)

  def set_vec(v, i, value):
    return v.at[i].set(value.astype(v.dtype))

  def set_block(v, start, value):
    return jax.lax.dynamic_update_slice_in_dim(
      v, value.reshape(-1).astype(v.dtype), start, 0
    )

  def send_gram(it, gram, tg, g):
    """Puts an item's local Gram where its reduction takes it: the
    iteration owner's block of the group payload, or the TP payload."""
    if it.kind == 'group':
      return set_block(gram, it.member * st.block + it.off, g), tg
    return gram, set_block(tg, it.off, g)

  def get_block(v, start, g):
    return jax.lax.slice_in_dim(v, start, start + g * g).reshape(g, g)

  # -- the stages, as per-slot branch bodies ----------------------------

  def stage_amax(s, c, hat, p):
    c = dict(c)
    c['out'] = plain_update(s, hat, p)
    for it in st.items[s]:
      if not it.holds:
        continue
      amax = functools.reduce(
        jnp.maximum,
        [jnp.max(jnp.abs(region(hat, u)), initial=0) for u in it.units],
      )
      name = 'amax_g' if it.kind == 'group' else 'amax_t'
      c[name] = set_vec(c[name], it.pos, amax)
    return c

  def stage_gram(s, c, hat, p):
    c = dict(c)
    gram = c['gram']
    tg = c['tg']
    x = c['x']
    for it in st.items[s]:
      if not it.holds:
        continue
      amax = c['amax_g' if it.kind == 'group' else 'amax_t'][it.pos]
      f = rescale_factor(amax, region(hat, it.units[0]).dtype)
      for u in it.units:
        raw = region(hat, u)
        x = put(x, u, (raw * f.astype(raw.dtype)).astype(norm))
      g = sum(
        (lambda m: m @ jnp.swapaxes(m, -1, -2))(_orient(region(x, u), it.split))
        for u in it.units
      )
      gram, tg = send_gram(it, gram, tg, g)
    c.update(gram=gram, tg=tg, x=x)
    return c

  def stage_iterate(w):
    def body(s, c, hat, p):
      c = dict(c)
      q = c['q']
      qt = c['qt']
      x = c['x']
      for it in st.items[s]:
        if w >= len(it.segments):
          continue
        start, end = it.segments[w]
        if it.kind == 'group':
          if not it.iterates:
            continue
          g = get_block(c['gram_in'], it.off, it.gram)
        else:
          g = get_block(c['tg'], it.off, it.gram)
        sc = jnp.ones((), norm)
        if w == 0:
          norm_sq = jnp.trace(g.astype(norm))
          nrm = jnp.sqrt(jnp.maximum(norm_sq, 0)) + eps
          sc = (1 / jnp.where(nrm > 0, nrm, 1)).astype(norm)
          r = cd((g.astype(norm) * sc**2))
        else:
          r = cd(g)
        fac = _newton_schulz.gram_factor(r, coeff_rows[start:end])
        if it.kind == 'group':
          q = set_block(q, it.off, fac.astype(norm) * sc if w == 0 else fac)
        else:
          if w == 0:
            for u in it.units:
              x = put(x, u, cd((region(x, u) * sc).astype(norm)))
          qt = set_block(qt, it.off, fac)
      c.update(q=q, qt=qt, x=x)
      return c

    return body

  def stage_apply(w):
    def body(s, c, hat, p):
      c = dict(c)
      gram = jnp.zeros_like(c['gram'])
      tg = jnp.zeros_like(c['tg'])
      x = c['x']
      dot_g, dot_t = c['dot_g'], c['dot_t']
      for it in st.items[s]:
        if w >= len(it.segments) or not it.holds:
          continue
        if it.kind == 'group':
          fac = get_block(c['q_all'], it.member * st.block + it.off, it.gram)
        else:
          fac = get_block(c['qt'], it.off, it.gram)
        fac = cd(fac)
        last = w + 1 == len(it.segments)
        new = []
        for u in it.units:
          m = fac @ cd(_orient(region(x, u), it.split))
          x = put(x, u, _orient(m, it.split).astype(norm))
          new.append(m)
        if not last:
          g = sum(m @ jnp.swapaxes(m, -1, -2) for m in new)
          gram, tg = send_gram(it, gram, tg, g)
        elif adaptive:
          d = sum(
            jnp.sum(region(hat, u).astype(norm) * region(x, u))
            for u in it.units
          )
          if it.kind == 'group':
            dot_g = set_vec(dot_g, it.pos, d)
          else:
            dot_t = set_vec(dot_t, it.pos, d)
      c.update(gram=gram, tg=tg, x=x, dot_g=dot_g, dot_t=dot_t)
      return c

    return body

  def stage_finish(s, c, hat, p):
    c = dict(c)
    out = c['out']
    for it in st.items[s]:
      if not it.holds:
        continue
      dot = None
      if adaptive:
        dot = (c['dot_g'] if it.kind == 'group' else c['dot_t'])[it.pos]
      for u in it.units:
        res = finish(
          u, region(c['x'], u), dot, None if p is None else region(p, u)
        )
        out = put(out, u, res)
    c['out'] = out
    return c

  # -- running them: switch per stage, collectives between ---------------

  def stage(body, c):
    def branch(s):
      def f(c, hat, p):
        out = body(s, c, hat, p)
        return jax.tree.map(lambda y: _vary(y, vary), out)

      return f

    branches = [branch(s) for s in range(st.n)]
    keys = None if slot_keys is None else item_keys
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

  def unit_facts(u):
    return (
      int(lay.unit_group[u]),
      int(lay.unit_offset[u]),
      int(lay.unit_size[u]),
      lay.plan.units[u].shape,
    )

  item_keys = None
  if slot_keys is not None:
    item_keys = [
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

  c = carry0()
  if iterations:
    c = jax.tree.map(lambda y: jnp.broadcast_to(y, (iterations,) + y.shape), c)
  c = jax.tree.map(lambda y: _vary(y, vary), c)
  c = stage(stage_amax, c)
  if st.has_groups:
    c['amax_g'] = jax.lax.pmax(c['amax_g'], st.group_axis)
  if st.has_tp:
    c['amax_t'] = jax.lax.pmax(c['amax_t'], st.tp_axis)
  c = stage(stage_gram, c)
  for w in range(st.windows):
    if st.has_groups:
      c['gram_in'] = jax.lax.psum_scatter(
        c['gram'],
        st.group_axis,
        scatter_dimension=c['gram'].ndim - 1,
        tiled=True,
      )
    if st.has_tp:
      c['tg'] = jax.lax.psum(c['tg'], st.tp_axis)
    c = stage(stage_iterate(w), c)
    if st.has_groups:
      c['q_all'] = jax.lax.all_gather(
        c['q'], st.group_axis, axis=c['q'].ndim - 1, tiled=True
      )
    c = stage(stage_apply(w), c)
  if adaptive:
    if st.has_groups:
      c['dot_g'] = jax.lax.psum(c['dot_g'], st.group_axis)
    if st.has_tp:
      c['dot_t'] = jax.lax.psum(c['dot_t'], st.tp_axis)
  c = stage(stage_finish, c)
  return c['out']


def _vary(y, axes):
  manual = _collectives.manual_axes()
  return _collectives.to_varying(y, [a for a in axes if a in manual])
