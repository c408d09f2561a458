"""A state's whole owner layout, and the pytree that carries it.

An :class:`OwnerLayout` is how an optimizer state's Muon buffers are laid
out: its groups (:class:`~dmuon_jax._layout.Layout`), the buffer axes, the
tensor-parallel split and the param shardings it was built for. It is
hashable and travels as the static metadata of :class:`OwnerBuffers`, so a
state always knows its layout: ``update``, checkpoints and diagnostics read
it from the state.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checks, _exchange, _mesh
from dmuon_jax._gather import INDEX_LIMIT, roll_slots
from dmuon_jax._layout import Layout, MomentumSegments


@dataclasses.dataclass(frozen=True)
class TargetLeaf:
  """A Muon target as the optimizer sees it.

  Attributes:
    index: leaf index in the tree given to ``init``/``update`` (the Muon
      subtree for ``scale_by_dmuon``, the whole params for dedicated mode).
    path: its normalized path (see ``_routing.normalize_path``).
    shape: the whole param's shape (not one TP shard's slice).
    dtype: the param's dtype name.
    group: the layout group holding its matrices.
    tp_dim: the dimension the TP axis splits, or None.
    padded: for a leaf sharded unevenly (a sharded dimension that does not
      divide by its devices), the shape its matrices are held at: each such
      dimension zero-padded up to a multiple of its devices; else None.
  """

  index: int
  path: str
  shape: tuple[int, ...]
  dtype: str
  group: int
  tp_dim: int | None = None
  padded: tuple[int, ...] | None = None

  @property
  def held_shape(self) -> tuple[int, ...]:
    """The shape the layout holds the leaf at (``padded`` or ``shape``)."""
    return self.shape if self.padded is None else self.padded


def pad_to(x: jax.Array, shape: Sequence[int]) -> jax.Array:
  """``x`` zero-padded at the end of each dimension up to ``shape``."""
  widths = [(0, n - m) for m, n in zip(np.shape(x), shape)]
  return jnp.pad(x, widths) if any(w for _, w in widths) else x


def unpad(x: jax.Array, shape: Sequence[int]) -> jax.Array:
  """Inverse of :func:`pad_to`: the leading ``shape`` block of ``x``."""
  if tuple(np.shape(x)) == tuple(shape):
    return x
  return x[tuple(slice(0, n) for n in shape)]


def _replicated(tree: Any, mesh: Any) -> Any:
  """``tree`` on every device of ``mesh`` if it is a concrete ``Mesh``
  (the conversions read across the owner slots)."""
  if not isinstance(mesh, jax.sharding.Mesh):
    return tree
  return jax.device_put(tree, jax.sharding.NamedSharding(mesh, P()))


# Owner buffers within this factor of the even share are kept for params
# whose sharding only logical axis rules decide (see OwnerLayout.placement).
OWNERS_SLACK = 1.10


@dataclasses.dataclass(frozen=True)
class OwnerLayout:
  """How an optimizer state's Muon buffers are laid out (static, hashable).

  Attributes:
    groups: one ``Layout`` per group of buffers (its owner ``plan``, the
      order of its matrices in the buffers, their dtypes and TP splits): the
      whole plan for ``dmuon``, one per gather group in dedicated mode.
    iterations: per group, 0, or the number of scan iterations of a scanned
      stack (buffers ``(iterations, num_slots * local)``; iteration ``t``
      holds the group's layout rotated by ``t`` slots).
    buffer_axes: the owner axes, major to minor in buffer (slot) order.
    buffer_sizes: their sizes.
    tp_axis: the tensor-parallel axis (None without TP).
    tp_size: its size (1 without TP).
    mesh: the ``AbstractMesh`` the buffers live on (None: one device).
    leaves: the Muon targets, in leaf order: ``TargetLeaf`` records with
      the leaf's ``index``, ``path``, whole ``shape``, ``dtype``, layout
      ``group`` and ``tp_dim`` (the dimension the TP axis splits, or None).
    param_entries: per target leaf, its sharding on the whole mesh as
      per-dimension axis tuples (size-1 axes dropped), or None where it was
      not known when the layout was built. The update's routes read it;
      layouts that differ only here compare equal (an ``init`` traced
      inside and outside ``nn.logical_axis_rules`` gives one tree).
    layers_per_iteration: per group, the layers of a scanned stack gathered
      per scan iteration (1 for loop groups).
    kind: ``'dmuon'`` (momentum of ``scale_by_dmuon``) or ``'dedicated'``
      (owner-stored params and their momentum).
    momentum: where a ``'dmuon'`` layout keeps the momentum: ``'owners'``
      (the flat owner buffers: each device holds its own matrices'), or
      ``'params'`` (one buffer per Muon leaf, sharded as the leaf, as
      ``optax.contrib.muon`` keeps it: each owner receives its matrices'
      momentum, not their gradients, by the same collectives), chosen at
      ``init`` where it holds fewer bytes per device (FSDP params).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
    >>> params = {'layers_0': {'w': jnp.ones((4, 8))},
    ...           'layers_1': {'w': jnp.ones((8, 8))}}
    >>> # (an axis of one device is an owner axis only where it is named)
    >>> tx = dmuon_jax.dmuon(0.02, mesh=mesh, axis_names=('data',))
    >>> (layout,) = dmuon_jax.owner_layouts(tx.init(params))
    >>> layout.kind, layout.buffer_axes, layout.num_slots
    ('dmuon', ('data',), 1)
    >>> [leaf.path for leaf in layout.leaves]
    ['layers_0/w', 'layers_1/w']
    >>> print(layout.summary().splitlines()[0])  # doctest: +ELLIPSIS
    OwnerLayout dmuon_data1_...: 2 Muon leaves, 1 owner slot(s) over ('data',)
  """

  groups: tuple[Layout, ...]
  iterations: tuple[int, ...]
  buffer_axes: tuple[str, ...]
  buffer_sizes: tuple[int, ...]
  tp_axis: str | None
  tp_size: int
  mesh: Any
  leaves: tuple[TargetLeaf, ...]
  # A routing hint, not part of the layout's identity (==, hash): the same
  # init traced where logical axis rules are in effect and where they are
  # not gives the same layout and buffers; only the routes of the update
  # differ (see _transform._update).
  param_entries: tuple[_mesh.Entries | None, ...] = dataclasses.field(
    compare=False
  )
  layers_per_iteration: tuple[int, ...] = ()
  kind: str = 'dmuon'
  momentum: str = 'owners'

  @classmethod
  def build(
    cls,
    plans: Sequence[Any],
    leaves: Sequence[TargetLeaf],
    *,
    dtype_of: Any,
    split_of: Any,
    buffer_axes: Sequence[str],
    buffer_sizes: Sequence[int],
    tp_axis: str | None,
    tp_size: int,
    mesh: Any,
    iterations: Sequence[int] | None = None,
    param_entries: Sequence[Any] | None = None,
    layers_per_iteration: Sequence[int] = (),
    kind: str = 'dmuon',
  ) -> OwnerLayout:
    """The one builder of a layout, for ``dmuon`` (one plan) and dedicated
    mode (one plan per gather group).

    Args:
      plans: per group of buffers, its owner plan over ``buffer_axes``.
      leaves: the Muon targets' records.
      dtype_of: ``{leaf index: buffer dtype}``.
      split_of: ``{leaf index: TP-split matrix axis or None}``.
      buffer_axes: the owner axes, major to minor.
      buffer_sizes: their sizes.
      tp_axis: the tensor-parallel axis (None without TP).
      tp_size: its size.
      mesh: the ``AbstractMesh`` of the buffers (kept only when more than
        one device holds them).
      iterations: per group, 0 or its scan iterations (default: all 0).
      param_entries: per target leaf, its sharding (default: unknown).
      layers_per_iteration: per group, the layers per scan iteration.
      kind: ``'dmuon'`` or ``'dedicated'``.

    Returns:
      The layout.
    """
    # A zero-padded leaf's layout holds it at ``padded``, crops to ``shape``.
    logical_of = {t.index: t.shape for t in leaves if t.padded is not None}
    groups = tuple(Layout(gp, dtype_of, split_of, logical_of) for gp in plans)
    return cls(
      groups=groups,
      iterations=tuple(iterations or (0,) * len(groups)),
      buffer_axes=tuple(buffer_axes),
      buffer_sizes=tuple(buffer_sizes),
      tp_axis=tp_axis if tp_size > 1 else None,
      tp_size=tp_size,
      mesh=mesh if math.prod(buffer_sizes) * tp_size > 1 else None,
      leaves=tuple(leaves),
      param_entries=tuple(param_entries or (None,) * len(leaves)),
      layers_per_iteration=tuple(layers_per_iteration),
      kind=kind,
    )

  @property
  def num_slots(self) -> int:
    """The number of owner slots (the product of ``buffer_sizes``, or 1)."""
    return int(np.prod(self.buffer_sizes)) if self.buffer_sizes else 1

  @property
  def distributed(self) -> bool:
    """Whether more than one device holds buffers."""
    return self.num_slots * self.tp_size > 1

  @property
  def per_leaf(self) -> bool:
    """Whether the buffers are one per Muon leaf, in the leaves' own
    shapes and shardings (``momentum='params'``)."""
    return self.momentum == 'params'

  @functools.cached_property
  def buffer_index(self) -> tuple[tuple[int, int], ...]:
    """``(group, dtype group)`` of each flat buffer, in buffer order
    (``(group, position in leaves)`` of each per-leaf buffer)."""
    if self.per_leaf:
      return tuple((t.group, k) for k, t in enumerate(self.leaves))
    return tuple(
      (g, j) for g, lay in enumerate(self.groups) for j in range(lay.num_groups)
    )

  def split_groups(self, blocks: Sequence[Any]) -> list[tuple]:
    """Flat owner blocks (one per group and dtype group, whatever
    ``momentum`` says), split by group, in group order."""
    ends = np.cumsum([0] + [lay.num_groups for lay in self.groups])
    return [tuple(blocks[a:b]) for a, b in zip(ends[:-1], ends[1:])]

  @functools.cached_property
  def probed(self) -> set[int]:
    """Buffers whose shardings a compile has reported (the update's
    Auto-mesh probe, see ``_steps._check_buffer_shardings``): later traces
    of this layout need no probe. A record of this object's use, not part
    of the layout (not compared or hashed)."""
    return set()

  @functools.cached_property
  def fingerprint(self) -> str:
    """8 hex digits naming what the buffers contain (stable across runs)."""
    key = (
      tuple(
        (
          lay.plan.leaves,
          lay.plan.units,
          lay.plan.owners,
          lay.leaf_dtypes,
          lay.tp_splits,
        )
        for lay in self.groups
      ),
      self.iterations,
      self.buffer_axes,
      self.buffer_sizes,
      self.tp_axis,
      self.tp_size,
      self.leaves,
    ) + ((self.momentum,) if self.per_leaf else ())
    return hashlib.sha1(repr(key).encode()).hexdigest()[:8]

  @functools.cached_property
  def name(self) -> str:
    """A readable name, e.g. ``dmuon_replicate2_shard4_3f2a91c0``.

    It is the prefix of the buffers' pytree keys: a checkpoint of one layout
    restored into a state of another fails on these keys (orbax names both),
    instead of silently scrambling the momentum.
    """
    parts = [f'{a}{s}' for a, s in zip(self.buffer_axes, self.buffer_sizes)]
    if self.tp_size > 1:
      parts.append(f'{self.tp_axis}{self.tp_size}')
    return '_'.join(['dmuon'] + parts + [self.fingerprint])

  @functools.cached_property
  def buffer_keys(self) -> tuple[jax.tree_util.DictKey, ...]:
    """The pytree key of each buffer: ``name``, group and dtype (``name``
    and the leaf's path for per-leaf buffers)."""
    if self.per_leaf:
      return tuple(
        jax.tree_util.DictKey(f'{self.name}/{t.path}') for t in self.leaves
      )
    return tuple(
      jax.tree_util.DictKey(f'{self.name}_g{g}_{self.groups[g].dtypes[j]}')
      for g, j in self.buffer_index
    )

  def buffer_spec(self, b: int) -> Any:
    """The PartitionSpec of flat buffer ``b`` on the mesh (None for a
    per-leaf buffer of a param whose sharding is unknown: it is held as
    the param is, e.g. as its logical names say)."""
    if self.per_leaf:
      e = self.param_entries[b]
      return None if e is None else _mesh.entries_spec(e)
    g, _ = self.buffer_index[b]
    axes = self.buffer_axes + ((self.tp_axis,) if self.tp_size > 1 else ())
    axes = axes or None
    spec = (None, axes) if self.iterations[g] else (axes,)
    return jax.sharding.PartitionSpec(*spec)

  def buffer_specs(self) -> tuple:
    """The ``PartitionSpec`` of each buffer (see :meth:`buffer_spec`)."""
    return tuple(self.buffer_spec(b) for b in range(len(self.buffer_index)))

  def buffer_shapes(
    self, dtypes: Sequence | None = None
  ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Global buffer shapes (``dtypes`` overrides the dtype of each)."""
    if self.per_leaf:
      shapes = [t.shape for t in self.leaves]
      own = [self.mu_dtype(t.index) for t in self.leaves]
    else:
      n = self.num_slots * self.tp_size
      shapes = [s[:-1] + (s[-1] * n,) for s in self.local_shapes()]
      own = [self.groups[g].dtypes[j] for g, j in self.buffer_index]
    dtypes = own if dtypes is None else dtypes
    return tuple(
      jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in zip(shapes, dtypes)
    )

  def local_shapes(self) -> tuple[tuple[int, ...], ...]:
    """Per buffer, the shape of one device's block."""
    if self.per_leaf:
      sizes = dict(self.mesh.shape) if self.mesh is not None else {}
      return tuple(
        _mesh.local_shape(t.shape, self.buffer_spec(b), sizes)
        for b, t in enumerate(self.leaves)
      )
    out = []
    for g, j in self.buffer_index:
      size = self.groups[g].local_sizes[j]
      out.append((self.iterations[g], size) if self.iterations[g] else (size,))
    return tuple(out)

  @functools.cached_property
  def momentum_segments(self) -> tuple[MomentumSegments | None, ...]:
    """Per group, where its momentum differs from the owned buffers: None
    (laid out as they are), or for a dedicated scanned stack whose
    iterations pad (an owner slot holds fewer elements than the busiest,
    none at all where an iteration has fewer matrices than slots) its
    :class:`MomentumSegments`.

    Iteration ``t`` holds base slot ``(slot - t) mod num_slots``'s
    matrices at the start of the slot's row; a slot's momentum keeps, one
    after the other, only those elements of each iteration (a segment), in
    one row ``(1, num_slots * width)`` of the busiest slot's width: about
    the stack's even share per device where its iterations pad (the owned
    params, which ``scan`` slices by layer, keep every iteration's row).
    """
    n, out = self.num_slots, []
    for lay, it in zip(self.groups, self.iterations):
      if not it or self.kind != 'dedicated' or self.tp_size > 1:
        out.append(None)
        continue
      used = lay.slot_used  # (dtype groups, base slots)
      base = lambda s, t: (s - t) % n
      iters = [
        [t for t in range(it) if used[:, base(s, t)].any()] for s in range(n)
      ]
      r = max(1, max(map(len, iters)))
      widths = tuple(
        max(
          1,
          max(
            sum(int(u[base(s, t)]) for t in ts) for s, ts in enumerate(iters)
          ),
        )
        for u in used
      )
      # None where no padding is left out, or where a width is past the
      # int32 offsets of the update's tables (then as the owned buffers).
      if all(w >= it * size for w, size in zip(widths, lay.local_sizes)) or (
        max(widths) >= INDEX_LIMIT
      ):
        out.append(None)
        continue
      table = np.full((n, r), it, np.int32)  # `it`: no segment
      offsets = [np.zeros((n, r), np.int32) for _ in used]
      sizes = [np.zeros((n, r), np.int32) for _ in used]
      for s, ts in enumerate(iters):
        table[s, : len(ts)] = ts
        for d, u in enumerate(used):
          got = np.array([u[base(s, t)] for t in ts], np.int64)
          sizes[d][s, : len(ts)] = got
          offsets[d][s, : len(ts)] = np.cumsum(got) - got
      out.append(
        MomentumSegments(table, tuple(offsets), tuple(sizes), widths, it)
      )
    return tuple(out)

  def _segments_of(self, b: int) -> tuple[MomentumSegments | None, int]:
    """The :attr:`momentum_segments` of buffer ``b``'s group and its dtype
    group."""
    if self.per_leaf:
      return None, 0
    g, d = self.buffer_index[b]
    return self.momentum_segments[g], d

  def momentum_shape(self, b: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of buffer ``b``'s momentum for an owned buffer of
    ``shape`` (global or one device's block; see
    :attr:`momentum_segments`)."""
    seg, d = self._segments_of(b)
    shape = tuple(shape)
    if seg is None:
      return shape
    g = self.buffer_index[b][0]
    slots = shape[-1] // self.groups[g].local_sizes[d]
    return (1, slots * seg.widths[d])

  def to_momentum(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
    """Global owned-shaped buffers -> the momentum's (see
    :attr:`momentum_segments`; buffers shaped so already are left)."""
    out = []
    for b, x in enumerate(buffers):
      seg, d = self._segments_of(b)
      if seg is None or tuple(x.shape) == self.momentum_shape(b, x.shape):
        out.append(x)
        continue
      n = self.num_slots
      x = x.reshape(x.shape[0], n, -1)
      one = lambda col, s, seg=seg, d=d: seg.compact(d, seg.rows(col, s), s)
      got = jax.vmap(one, (1, 0))(x, jnp.arange(n))  # (n, width)
      out.append(got.reshape(1, -1))
    return out

  def from_momentum(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
    """Inverse of :meth:`to_momentum` (owned-shaped buffers are left)."""
    out = []
    for b, x in enumerate(buffers):
      seg, d = self._segments_of(b)
      g = None if seg is None else self.buffer_index[b][0]
      if seg is None or tuple(x.shape) != self.momentum_shape(
        b, (self.iterations[g], self.num_slots * self.groups[g].local_sizes[d])
      ):
        out.append(x)
        continue
      n, size = self.num_slots, self.groups[g].local_sizes[d]
      one = lambda c, s, seg=seg, d=d, size=size: seg.expand(
        seg.segment_rows(d, c, s, size), s
      )
      got = jax.vmap(one, (0, 0), 1)(x.reshape(n, -1), jnp.arange(n))
      out.append(got.reshape(got.shape[0], -1))  # (iterations, n * local)
    return out

  def shardings(self, mesh: Any = None) -> tuple:
    """``NamedSharding`` of each buffer (``mesh`` default: the layout's)."""
    mesh = self.mesh if mesh is None else mesh
    return tuple(
      None if mesh is None or s is None else jax.sharding.NamedSharding(mesh, s)
      for s in self.buffer_specs()
    )

  def leaf(self, index: int) -> TargetLeaf:
    """The target leaf (an entry of ``leaves``) of a leaf index."""
    return self._by_index[index]

  @functools.cached_property
  def _by_index(self) -> dict[int, TargetLeaf]:
    return {t.index: t for t in self.leaves}

  def mu_dtype(self, index: int) -> str:
    """The buffer dtype of leaf ``index``'s matrices."""
    lay = self.groups[self.leaf(index).group]
    return lay.leaf_dtypes[lay.leaf_index.index(index)]

  def leaf_buffer(self, index: int) -> int:
    """The flat buffer (position in buffer order) holding a leaf's
    matrices."""
    if self.per_leaf:
      return [t.index for t in self.leaves].index(index)
    g = self.leaf(index).group
    j = self.groups[g].dtypes.index(self.mu_dtype(index))
    return self.buffer_index.index((g, j))

  def full_shape(self, lay: Layout, u: int) -> tuple[int, int]:
    """The whole matrix's ``(fan_in, fan_out)`` of unit ``u`` of ``lay``
    (of the param itself for a zero-padded one)."""
    i = lay.unit_leaf[u]
    spec, logical, split = lay.plan.leaves[i], lay.logical[i], lay.tp_splits[i]
    if logical is not None:  # never sliced or TP-split
      axes = (spec.reduction_axes, spec.output_axes)
      return tuple(math.prod(logical[a] for a in ax) for ax in axes)
    if spec.sliced:
      return spec.whole_matrix
    shape = list(lay.plan.units[u].shape)
    if split is not None:
      shape[split] *= self.tp_size
    return tuple(shape)

  # -- whole-array conversions (global arrays, outside jax.jit) ------------

  def pack(
    self,
    values: dict[int, jax.Array],
    dtypes: Sequence | None = None,
    mesh: Any = None,
    shardings: Sequence | None = None,
    momentum: bool = False,
  ) -> OwnerBuffers:
    """Owner buffers from whole arrays, one per Muon target (jitted once
    per layout).

    Args:
      values: leaf index -> the whole (unsplit) array of each target.
      dtypes: per buffer, its dtype (default: each group's promoted dtype).
      mesh: a concrete ``Mesh``: ``values`` are replicated on it first (the
        packing reads across owner slots) and the buffers placed as the
        layout says (default, or any other mesh: left where jit puts them).
      shardings: per buffer, its sharding (None: left), instead.
      momentum: the buffers of a momentum (see :attr:`momentum_segments`).

    Returns:
      The :class:`OwnerBuffers`.
    """
    dtypes = None if dtypes is None else tuple(jnp.dtype(d) for d in dtypes)
    bufs = self._pack(_replicated(dict(values), mesh), dtypes)
    bufs = self.to_momentum(bufs) if momentum else bufs
    if shardings is None and isinstance(mesh, jax.sharding.Mesh):
      shardings = self.shardings(mesh)
    # (Under jit, _mesh.place: device_put leaves an Auto mesh's unsharded.)
    put = lambda b, s: (
      b
      if s is None
      else _mesh.place(b, s.mesh, s.spec)
      if isinstance(b, jax.core.Tracer)
      else jax.device_put(b, s)
    )
    return OwnerBuffers(
      list(map(put, bufs, shardings or [None] * len(bufs))), self
    )

  def unpack(self, buffers: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """Inverse of :meth:`pack` (of owned buffers or a momentum's): leaf
    index -> whole array (replicated on the buffers' mesh)."""
    bufs = list(buffers)
    mesh = next(filter(None, map(_mesh.array_mesh, bufs)), None)
    return self._unpack(self.from_momentum(_replicated(bufs, mesh)))

  @functools.partial(jax.jit, static_argnums=(0, 2))
  def _pack(self, values, dtypes) -> tuple[jax.Array, ...]:
    """:meth:`pack`'s traced body: the flat buffers, in buffer order."""
    out = [values[t.index] for t in self.leaves] if self.per_leaf else []
    for g, lay in enumerate(() if self.per_leaf else self.groups):
      it = self.iterations[g]
      xs = [pad_to(values[i], self.leaf(i).held_shape) for i in lay.leaf_index]
      if it:  # scan iteration i rotated by i slots
        xs = [x.reshape((it, -1) + x.shape[1:]) for x in xs]
        pack = lambda i, xs, g=g: self.pack_group(g, xs, i)
        out += jax.vmap(pack)(jnp.arange(it), xs)
      else:
        out += self.pack_group(g, xs)
    if dtypes is not None:
      out = [b.astype(d) for b, d in zip(out, dtypes)]
    return tuple(out)

  def pack_group(self, g: int, xs: Sequence[jax.Array], iteration=None) -> list:
    """Inverse of :meth:`unpack_group` (``whole``): group ``g``'s flat
    buffers from its targets at their held shapes (``plan.leaves`` order),
    TP shard ``k``'s slices of slot ``s`` at block ``s * tp_size + k``."""
    lay, n, tp = self.groups[g], self.num_slots, self.tp_size
    dims = [self.leaf(i).tp_dim for i in lay.leaf_index]
    per_tp = [  # each TP shard's slices
      lay.pack_full(
        [x if d is None else jnp.split(x, tp, d)[k] for x, d in zip(xs, dims)]
      )
      for k in range(tp)
    ]
    out = [jnp.stack([b.reshape(n, -1) for b in bs], 1) for bs in zip(*per_tp)]
    if iteration is not None:
      out = [roll_slots(b, iteration, n) for b in out]
    return [b.reshape(-1) for b in out]

  @functools.partial(jax.jit, static_argnums=0)
  def _unpack(self, buffers) -> dict[int, jax.Array]:
    """:meth:`unpack`'s traced body."""
    if self.per_leaf:
      return {t.index: b for t, b in zip(self.leaves, buffers)}
    out = {}
    for g, bufs in enumerate(self.split_groups(buffers)):
      if self.iterations[g]:
        got = jax.vmap(lambda t, bs, g=g: self.unpack_group(g, bs, t))(
          jnp.arange(self.iterations[g]), list(bufs)
        )
        got = {i: x.reshape((-1,) + x.shape[2:]) for i, x in got.items()}
      else:
        got = self.unpack_group(g, bufs)
      out.update({i: unpad(x, self.leaf(i).shape) for i, x in got.items()})
    return out

  def unpack_group(
    self, g: int, bufs: Sequence[jax.Array], iteration=None, whole=True
  ) -> dict[int, jax.Array]:
    """Leaf index -> target (at its held shape) of group ``g``, from its
    gathered flat buffers (every slot's blocks, slot order).

    Args:
      g: the group.
      bufs: its buffers, one per dtype group.
      iteration: a scan iteration's buffers are rotated back by it (see
        :func:`~dmuon_jax._gather.roll_slots`); None for a loop group.
      whole: ``bufs`` hold every TP shard's slices (global arrays): each
        target's slices are joined along its TP dim; else they hold one TP
        shard's (or there is no TP), and so do the targets.
    """
    lay, n, tp = self.groups[g], self.num_slots, self.tp_size
    parts = []
    for k in range(tp if whole else 1):
      mine = list(bufs)
      if whole and tp > 1:  # TP shard k's slots (pack's interleave undone)
        mine = [x.reshape(x.shape[:-1] + (n, tp, -1))[..., k, :] for x in mine]
        mine = [x.reshape(x.shape[:-2] + (-1,)) for x in mine]
      if iteration is not None:
        mine = [roll_slots(x, -iteration, n) for x in mine]
      parts.append(lay.unpack_full(mine))
    out = {}
    for i, *xs in zip(lay.leaf_index, *parts):
      d = self.leaf(i).tp_dim
      out[i] = xs[0] if d is None else jnp.concatenate(xs, d)
    return out

  # -- inspection ----------------------------------------------------------

  @property
  def plans(self) -> tuple[Any, ...]:
    """The owner plan of each group (:class:`dmuon_jax.OwnershipPlan`)."""
    return tuple(lay.plan for lay in self.groups)

  def owner_entries(self, param_entries=None) -> list:
    """Per target leaf, its sharding over the owner axes (TP axis removed;
    unknown shardings as replicated)."""
    entries = self.param_entries if param_entries is None else param_entries
    out = []
    for t, e in zip(self.leaves, entries):
      e = e if e is not None else ((),) * len(t.shape)
      out.append(tuple(tuple(a for a in d if a != self.tp_axis) for d in e))
    return out

  def collective_bytes(self, param_entries=None) -> dict[str, float]:
    """Predicted per-device bytes of one drop-in update, by collective kind.

    From the routes for the params' shardings (default: the recorded ones;
    unknown ones replicated), on the ring model of
    :mod:`dmuon_jax.diagnostics`; rows padded to the largest owner's share.
    Tensor-parallel Gram all-reduces and the scalar flags are not included.

    Args:
      param_entries: per target leaf, per dimension the mesh axes it is
        sharded over (default: :attr:`param_entries`).

    Returns:
      ``{'all-to-all': bytes, 'all-gather': bytes}`` (zeros on one slot).
    """
    if self.kind != 'dmuon' or self.num_slots == 1:
      return {'all-to-all': 0.0, 'all-gather': 0.0}
    lay = self.groups[0]
    itemsizes = [jnp.dtype(d).itemsize for d in lay.dtypes]
    routes = _exchange.Exchange(lay, self.owner_entries(param_entries))
    return lay.plan.collective_bytes(*routes.byte_routes(itemsizes))

  def placement(self, specs: Sequence[Any], named: Sequence[bool]) -> str:
    """Where a ``'dmuon'`` state keeps the momentum (:attr:`momentum`):
    ``'params'`` where that holds fewer bytes per device than the owner
    buffers, else ``'owners'``.

    Args:
      specs: per target leaf, its spec where known whatever logical axis
        rules are in effect (the state's structure must not depend on
        them), else None.
      named: per target leaf, whether its box names a sharding (logical
        axes): such a leaf of unknown spec counts as sharded over every
        owner device, since its momentum is boxed with those names and
        sharded by the same rules as the param, unless owner buffers hold
        at most ``OWNERS_SLACK`` x the even share (those rules may shard it
        over fewer devices); an unknown unnamed one counts as replicated.

    Returns:
      ``'params'`` or ``'owners'``.
    """
    if (
      self.kind != 'dmuon'
      or not self.distributed
      or self.tp_size > 1
      or any(t.padded is not None for t in self.leaves)
    ):
      return 'owners'
    sizes = dict(zip(self.buffer_axes, self.buffer_sizes))
    owners, even = dataclasses.replace(self, momentum='owners').momentum_share()
    held, any_named = 0.0, False
    for t, spec, name in zip(self.leaves, specs, named):
      devices = 1
      if spec is not None:
        axes = [a for d in _mesh.spec_entries(spec) for a in d]
        devices = math.prod(sizes.get(a, 1) for a in axes)
      elif name:
        devices, any_named = self.num_slots, True
      itemsize = jnp.dtype(self.mu_dtype(t.index)).itemsize
      held += math.prod(t.shape) * itemsize / devices
    if any_named and owners <= OWNERS_SLACK * even:
      return 'owners'
    return 'params' if held < owners else 'owners'

  def momentum_share(self) -> tuple[float, float]:
    """``(bytes, even)``: the momentum one device holds (the busiest, for
    owner buffers), and the even share, all Muon momentum over the owner
    devices (what ``optax.contrib.muon`` holds on params sharded over all
    of them)."""
    held = sum(
      math.prod(local) * jnp.dtype(s.dtype).itemsize
      for local, s in zip(self.local_shapes(), self.buffer_shapes())
    )
    total = sum(
      math.prod(t.shape) * jnp.dtype(self.mu_dtype(t.index)).itemsize
      for t in self.leaves
    )
    return float(held), total / (self.num_slots * self.tp_size)

  def padding(self) -> tuple[list[TargetLeaf], int]:
    """The unevenly sharded leaves held zero-padded, and how many elements
    the padding adds."""
    padded = [t for t in self.leaves if t.padded is not None]
    extra = sum(math.prod(t.padded) - math.prod(t.shape) for t in padded)
    return padded, extra

  def summary(self) -> str:
    """The layout's name, param shardings, predicted bytes and plans."""
    human, tp = _checks.human_bytes, f', TP {self.tp_axis}={self.tp_size}'
    lines = [
      f'OwnerLayout {self.name}: {len(self.leaves)} Muon leaves, '
      f'{self.num_slots} owner slot(s) over {self.buffer_axes}'
      + (tp if self.tp_size > 1 else '')
    ]
    more = lambda xs: ' ...' if len(xs) > 4 else ''
    dmuon = self.kind == 'dmuon' and self.distributed
    known = [e for e in self.param_entries if e is not None]
    sharded = sum(1 for e in known if any(e))
    if dmuon and self.num_slots > 1:
      lines += [
        '  predicted update bytes per device: '
        + ', '.join(
          f'{k} {human(v)}' for k, v in self.collective_bytes().items()
        ),
        f'  param shardings read: {sharded} sharded, '
        f'{len(known) - sharded} replicated, '
        f'{len(self.param_entries) - len(known)} unknown',
      ]
    if dmuon:
      held, even = self.momentum_share()
      where = "as the params (one buffer per leaf, optax's layout)"
      where = where if self.per_leaf else 'in owner buffers'
      lines.append(
        f'  momentum {where}: {human(held)} per device'
        + ('' if self.per_leaf else ' (the busiest)')
        + f', {held / max(even, 1):.2f}x the even share {human(even)}'
      )
    padded, extra = self.padding()
    if padded:
      lines.append(
        f'  zero-padded for uneven sharding ({extra} elements): '
        + ', '.join(f'{t.path} {t.shape}->{t.padded}' for t in padded[:4])
        + more(padded)
      )
    unknown = [
      t.path for t, e in zip(self.leaves, self.param_entries) if e is None
    ]
    if unknown and dmuon:
      lines.append(
        f'  param shardings unknown for {len(unknown)} leaves '
        f'(treated as replicated): {unknown[:4]}' + more(unknown)
      )
    if len(self.groups) == 1:
      lines.append(self.groups[0].plan.summary(paths=self.kind != 'dmuon'))
    for g, lay in enumerate(self.groups if len(self.groups) > 1 else ()):
      it = self.iterations[g]
      lines.append(
        f'  group {g}: {len(lay.plan.units)} matrices'
        + (f', {it} scan iterations' if it else '')
      )
    return '\n'.join(lines)


@jax.tree_util.register_pytree_with_keys_class
class OwnerBuffers:
  """Flat owner buffers and the :class:`OwnerLayout` they are laid out by.

  A pytree: the children are the buffers (global arrays sharded over the
  owner axes, or one device's blocks inside ``shard_map``), the layout is
  static metadata. Two states of different layouts have different tree
  structures, and their buffers different keys (``layout.name``).

  When ``init`` gets Flax-boxed params (``nn.Partitioned``,
  ``nn.LogicallyPartitioned``, ``nnx.Variable``), each child is a box around
  its buffer that carries the buffer's sharding as Flax metadata
  (``nn.Partitioned`` names, ``nnx.Variable`` ``out_sharding``), so that
  ``nn.get_sharding``, ``nn.get_partition_spec`` and
  ``nnx.get_partition_spec`` of the state give the layout's shardings.
  ``buffers`` are always the arrays.

  Attributes:
    buffers: the flat buffers (arrays, unboxed), in the layout's buffer
      order.
    children: the buffers as stored: arrays, or the boxes holding them.
    layout: the :class:`OwnerLayout`.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> mu = dmuon_jax.scale_by_dmuon().init({'w': jnp.ones((4, 8))}).mu
    >>> mu  # doctest: +ELLIPSIS
    OwnerBuffers(dmuon_...: float32[32])
    >>> [b.shape for b in mu.buffers], mu.layout.num_slots
    ([(32,)], 1)
    >>> other = dmuon_jax.scale_by_dmuon().init({'w': jnp.ones((8, 4))}).mu
    >>> jax.tree.structure(mu) == jax.tree.structure(other)  # other layout
    False
  """

  __slots__ = ('children', 'layout')

  def __init__(self, buffers: Sequence[Any], layout: OwnerLayout):
    self.children = tuple(buffers)
    self.layout = layout

  @property
  def buffers(self) -> tuple[Any, ...]:
    return tuple(_mesh.unbox(c) for c in self.children)

  def rebox(self, buffers: Sequence[Any]) -> OwnerBuffers:
    """New buffers of the same layout, boxed as these children are."""
    return OwnerBuffers(
      [_mesh.rebox(c, b) for c, b in zip(self.children, buffers)], self.layout
    )

  def tree_flatten_with_keys(self):
    return tuple(zip(self.layout.buffer_keys, self.children)), self.layout

  def tree_flatten(self):
    return self.children, self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children, layout)

  def __iter__(self):
    return iter(self.buffers)

  def __eq__(self, other: object) -> bool:
    # As a tuple (layout, *children) compares.
    if not isinstance(other, OwnerBuffers):
      return NotImplemented
    return (self.layout, self.children) == (other.layout, other.children)

  def __hash__(self) -> int:
    return hash((self.layout, self.children))

  def __len__(self) -> int:
    return len(self.children)

  def __getitem__(self, i):
    return self.buffers[i]

  def __repr__(self) -> str:
    shapes = ', '.join(
      f'{getattr(b, "dtype", "?")}{list(np.shape(b))}' for b in self.buffers
    )
    return f'OwnerBuffers({self.layout.name}: {shapes})'
