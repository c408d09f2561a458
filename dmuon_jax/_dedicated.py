"""Dedicated ownership: Muon targets stored on their owners (DMuon proper)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _boundaries,
  _collectives,
  _layout,
  _newton_schulz,
  _planner,
  _tensor_parallel,
  _transform,
)


class DedicatedParams(NamedTuple):
  """Params with the Muon targets stored in owner layout.

  Attributes:
    owned: per gather group (see :class:`Dedication`), one tuple of flat
      owner buffers (one per dtype). A loop group's buffer is
      ``(num_slots * local,)``; a scanned stack's is
      ``(num_iterations, num_slots * local)``. Both are sharded over
      the owner axes so that a device's block holds exactly the matrices it
      owns.
    rest: the params tree with every Muon target replaced by None.
  """
  owned: tuple[tuple[jax.Array, ...], ...]
  rest: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Dedication:
  """Static description of a dedicated layout (build with :func:`dedicate`).

  Matrices are gathered per *gather group*: ``layers_per_gather``
  consecutive loop boundaries, or ``layers_per_gather`` layers of a scanned
  stack per scan iteration. Owner slots are numbered in buffer order:
  row-major over :attr:`buffer_axes` (the shard axes, then the replicate
  axis), so that a device's block of a gathered buffer is at its slot.

  Attributes:
    plan: the global owner plan (slots in mesh order, as
      :func:`dmuon_jax.plan_ownership`), for inspection.
    boundaries: the hook boundaries.
    groups: the boundary indices of each gather group.
    layouts: one owner layout per group; for a scanned stack, the layout of
      one iteration (iteration ``t`` is the same layout rotated by ``t``
      slots).
    num_iterations: per group, the number of scan iterations (0 for loop
      boundaries).
    layers_per_gather: boundaries (or scanned layers) per gather.
    treedef: the params tree structure.
    mesh: the mesh.
    reshard_after_forward: Z3 (True) or Z2 (False), see :meth:`block`.
    buffer_axes: owner axes, major to minor in buffer order.
    replicate_axis: the HSDP replicate axis (gathered first, outside the
      Z3 re-gather), or None.
    remat_policy: the ``jax.checkpoint`` policy of a Z3 block.
    rest_specs: per leaf, the PartitionSpec of a non-target param (None for
      Muon targets).
    tensor_parallel_axis: the mesh axis that splits Muon matrices (None
      without tensor parallelism). With it, ``plan`` and ``layouts`` hold
      one TP shard's slice of each split matrix; owned buffers are sharded
      over ``buffer_axes`` and then this axis.
    ns_algorithm: the Newton–Schulz form the plan's costs assume and
      :func:`dedicated_muon` runs for matrices not split by TP (``'auto'``:
      the cheaper per shape).
  """
  plan: _planner.OwnershipPlan
  boundaries: _boundaries.HookBoundaries
  groups: tuple[tuple[int, ...], ...]
  layouts: tuple[_layout.Layout, ...]
  num_iterations: tuple[int, ...]
  layers_per_gather: int
  treedef: Any
  mesh: Any
  reshard_after_forward: bool
  buffer_axes: tuple[str, ...]
  replicate_axis: str | None
  remat_policy: Callable[..., Any]
  rest_specs: tuple[P | None, ...]
  _leaf_paths: tuple[str, ...]
  _boundary_keys: tuple[Any, ...]
  tensor_parallel_axis: str | None = None
  ns_algorithm: str = 'auto'
  # Per leaf: the dim the TP axis splits (None: not split).
  _tp_dims: tuple[int | None, ...] = ()
  _tp_size: int = 1

  @property
  def num_slots(self) -> int:
    return self.plan.num_slots

  @property
  def _shard_axes(self) -> tuple[str, ...]:
    return tuple(a for a in self.buffer_axes if a != self.replicate_axis)

  def _spec(self, g: int) -> P:
    axes = self.buffer_axes
    if self.tensor_parallel_axis is not None:
      axes = axes + (self.tensor_parallel_axis,)
    axes = axes or None
    return P(None, axes) if self.num_iterations[g] else P(axes)

  def specs(self) -> DedicatedParams:
    """PartitionSpecs of a :class:`DedicatedParams` (for ``shard_map``).

    Owned buffers are sharded over the owner axes; every other param keeps
    the sharding it had when :func:`dedicate` saw it (replicated if none).
    """
    return DedicatedParams(
        owned=tuple(tuple(self._spec(g) for _ in lay.dtypes)
                    for g, lay in enumerate(self.layouts)),
        rest=jax.tree.unflatten(self.treedef, list(self.rest_specs)))

  def _gather_leaf(self, i: int, x: Any, layer_slice: bool = False) -> Any:
    """All-gathers a non-target leaf's sharded dims (inside ``shard_map``)."""
    spec = self.rest_specs[i]
    if x is None or spec is None:
      return x
    entries = _collectives.spec_entries(spec)
    if layer_slice:
      entries = entries[1:]
    for dim, axes in enumerate(entries):
      # A TP-sharded param stays this TP shard's slice (as the matrices).
      axes = tuple(a for a in axes if a != self.tensor_parallel_axis)
      if axes:
        x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    return x

  def gather_rest(self, dedicated: DedicatedParams) -> Any:
    """The non-target params inside ``shard_map``, sharded dims gathered.

    Call it in the loss for the params used outside the blocks (embedding,
    final norm, head); under :func:`jax.grad` the gathers transpose to
    reduce-scatters, so their gradients arrive sharded like the params.

    Args:
      dedicated: the local view of :class:`DedicatedParams`.

    Returns:
      ``dedicated.rest`` with every leaf whole (Muon targets stay None).
    """
    leaves = _full_leaves(dedicated.rest, self.treedef)
    return jax.tree.unflatten(self.treedef, [
        self._gather_leaf(i, x) for i, x in enumerate(leaves)])

  @staticmethod
  def specs_of(tree: Any) -> Any:
    """PartitionSpecs of a tree of global arrays, e.g. the optimizer state.

    Leaves with a ``NamedSharding`` give its spec; any other leaf (a scalar
    step count, a single-device array) is replicated: ``P()``.
    """
    return jax.tree.map(
        lambda x: x.sharding.spec if isinstance(
            getattr(x, 'sharding', None), NamedSharding) else P(), tree)

  def _group_leaves(self, g: int) -> list[int]:
    return [s.leaf_index for s in self.layouts[g].plan.leaves]

  def _group_of(self, b: int) -> int:
    return next(g for g, bs in enumerate(self.groups) if b in bs)

  def _subtree_leaves(self, b: int) -> list[int]:
    """All leaves (targets or not) under boundary ``b``'s module path."""
    name = self.boundaries.names[b]
    if not name:
      return list(range(len(self._leaf_paths)))
    return [i for i, p in enumerate(self._leaf_paths)
            if p == name or p.startswith(name + '/')]

  def _roll(self, flat: jax.Array, shift) -> jax.Array:
    n = self.num_slots
    return jnp.roll(flat.reshape(n, -1), shift, axis=0).reshape(-1)

  # -- conversion (outside shard_map, on global arrays) --------------------

  def to_dedicated(self, params: Any) -> DedicatedParams:
    """Moves a plain params tree into owner layout.

    Args:
      params: a params tree of global arrays (any sharding; the Muon
        targets are gathered for packing).

    Returns:
      The :class:`DedicatedParams`.

    Raises:
      ValueError: if ``params`` differs from the tree given to ``dedicate``
        in structure or in a Muon target's shape.
    """
    self._check_params(params)
    leaves = jax.tree.leaves(params)
    owned = self._pack_targets(leaves)
    rest = [None if spec is None else x
            for x, spec in zip(leaves, self.rest_specs)]
    if self.mesh is not None:
      rest = [None if x is None else jax.device_put(
          x, NamedSharding(self.mesh, spec))
              for x, spec in zip(rest, self.rest_specs)]
    return DedicatedParams(owned=tuple(owned),
                           rest=jax.tree.unflatten(self.treedef, rest))

  def to_params(self, dedicated: DedicatedParams) -> Any:
    """The plain params tree (e.g. for export, evaluation, checkpoints).

    Args:
      dedicated: a :class:`DedicatedParams` of global arrays.

    Returns:
      The params tree; Muon targets are replicated full arrays.

    Raises:
      TypeError: if ``dedicated`` is not a :class:`DedicatedParams`.
      ValueError: if its owner buffers do not fit this dedication.
    """
    self.check_dedicated(dedicated, 'to_params()')
    leaves = _full_leaves(dedicated.rest, self.treedef)
    for i, x in self._unpack_targets(dedicated.owned).items():
      leaves[i] = x
    return jax.tree.unflatten(self.treedef, leaves)

  def _pack_targets(self, leaves: Sequence[Any]
                    ) -> tuple[tuple[jax.Array, ...], ...]:
    """Owner buffers of every gather group from full per-leaf arrays.

    ``leaves[i]`` is used for each Muon target ``i`` (others are ignored);
    buffers take the promoted dtype of their leaves (params, or momentum).
    """
    owned = []
    for g, lay in enumerate(self.layouts):
      idx = self._group_leaves(g)
      targets = _replicated(self, [leaves[i] for i in idx])
      per_tp = []
      for t in range(self._tp_size):
        sliced = [self._tp_slice(i, x, t) for i, x in zip(idx, targets)]
        if self.num_iterations[g]:
          per_tp.append(_pack_stack(self, g, sliced))
        else:
          per_tp.append(jax.jit(lay.pack_full)(sliced))
      bufs = tuple(_interleave_tp(self.num_slots, [b[j] for b in per_tp])
                   for j in range(len(lay.dtypes)))
      if self.mesh is not None:
        sharding = NamedSharding(self.mesh, self._spec(g))
        bufs = tuple(jax.device_put(x, sharding) for x in bufs)
      owned.append(tuple(bufs))
    return tuple(owned)

  def _unpack_targets(self, owned: Sequence[Sequence[jax.Array]]
                      ) -> dict[int, jax.Array]:
    """Inverse of :meth:`_pack_targets`: leaf index -> full array."""
    out = {}
    for g, lay in enumerate(self.layouts):
      bufs = _replicated(self, owned[g])
      per_tp = []
      for t in range(self._tp_size):
        mine = [_tp_part(self.num_slots, self._tp_size, x, t) for x in bufs]
        if self.num_iterations[g]:
          per_tp.append(_unpack_stack(self, g, mine))
        else:
          per_tp.append(jax.jit(lay.unpack_full)(mine))
      for j, i in enumerate(self._group_leaves(g)):
        parts = [full[j] for full in per_tp]
        dim = self._tp_dims[i] if self._tp_dims else None
        out[i] = parts[0] if dim is None else jnp.concatenate(parts, dim)
    return out

  def _target_abstract(self, owned: Sequence[Sequence[Any]]
                       ) -> dict[int, jax.ShapeDtypeStruct]:
    """Per Muon target: the full array :meth:`_unpack_targets` returns.

    Shape of the whole param, dtype of its buffer in ``owned``, replicated
    on the mesh (one device without a mesh).
    """
    sharding = (NamedSharding(self.mesh, P()) if self.mesh is not None
                else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    specs = {spec.leaf_index: spec for spec in self.plan.leaves}
    out = {}
    for g, lay in enumerate(self.layouts):
      for j, i in enumerate(self._group_leaves(g)):
        dtype = owned[g][lay.unit_group[lay.leaf_units[j][0]]].dtype
        out[i] = jax.ShapeDtypeStruct(self._full_shape(specs[i]), dtype,
                                      sharding=sharding)
    return out

  def _full_shape(self, spec: _planner.LeafSpec) -> tuple[int, ...]:
    """The whole param's shape (the plan holds one TP shard's slice)."""
    shape = list(spec.shape)
    dim = self._tp_dims[spec.leaf_index] if self._tp_dims else None
    if dim is not None:
      shape[dim] *= self._tp_size
    return tuple(shape)

  def _check_params(self, params: Any) -> None:
    """Raises unless ``params`` is the tree ``dedicate`` planned."""
    if isinstance(params, DedicatedParams):
      raise TypeError(
          'dmuon: to_dedicated() takes a plain params tree and got '
          'DedicatedParams (already in owner layout); use it as it is, or '
          'to_params() to go back.')
    _planner.check_same_tree(params, jax.tree.unflatten(
        self.treedef, [0] * self.treedef.num_leaves), 'to_dedicated()',
                              made_by='dmuon_jax.dedicate()')
    leaves = jax.tree.leaves(params)
    for spec in self.plan.leaves:
      want = self._full_shape(spec)
      got = tuple(np.shape(leaves[spec.leaf_index]))
      if got != want:
        raise ValueError(
            f'dmuon: param {spec.path!r} has shape {got}, but dedicate() '
            f'planned it with shape {tuple(want)}. Call dmuon_jax.dedicate '
            'again on the new params (and make a new optimizer state).')

  def check_dedicated(self, dedicated: Any, what: str) -> None:
    """Raises unless ``dedicated`` fits this dedication's owner layout.

    Args:
      dedicated: a :class:`DedicatedParams` (or a gradient/update tree of
        that form) of global arrays, or local blocks inside ``shard_map``.
      what: the operation, for the message (e.g. ``'update()'``).

    Raises:
      TypeError: if it is not a :class:`DedicatedParams`.
      ValueError: naming the gather group whose buffers differ.
    """
    if not isinstance(dedicated, DedicatedParams):
      raise TypeError(
          f'dmuon: {what} takes the DedicatedParams made by '
          f'Dedication.to_dedicated(params); got {type(dedicated).__name__}.'
          ' Convert the params with ded.to_dedicated(params) first.')
    if len(dedicated.owned) != len(self.layouts):
      raise ValueError(
          f'dmuon: {what} got DedicatedParams with {len(dedicated.owned)} '
          f'gather groups, but this dedication has {len(self.layouts)}: it '
          'was made by another dmuon_jax.dedicate call. Use the Dedication '
          'that made it, or call to_dedicated again.')
    for g, (lay, bufs) in enumerate(zip(self.layouts, dedicated.owned)):
      iters = max(self.num_iterations[g], 1)
      local = [iters * n for n in lay.local_sizes]
      sizes = [n * self.num_slots * self._tp_size for n in local]
      got = [int(np.prod(np.shape(b))) for b in bufs]
      if got not in (sizes, local):
        names = [self.boundaries.names[b] or '<root>'
                 for b in self.groups[g]]
        raise ValueError(
            f'dmuon: {what} got owner buffers of sizes {got} for gather '
            f'group {g} ({names}), but this dedication packs '
            f'{sizes} (global) there: the params changed since '
            'dmuon_jax.dedicate. Call dedicate and to_dedicated again on '
            'the new params (and make a new optimizer state).')

  def _tp_slice(self, i: int, x: jax.Array, t: int) -> jax.Array:
    """TP shard ``t``'s slice of target leaf ``i`` (the leaf without TP)."""
    dim = self._tp_dims[i] if self._tp_dims else None
    if dim is None:
      return x
    size = x.shape[dim] // self._tp_size
    return jax.lax.slice_in_dim(x, t * size, (t + 1) * size, axis=dim)

  # -- inside shard_map ------------------------------------------------------

  def _gather_replicate(self, local: Sequence[jax.Array]) -> list[jax.Array]:
    if self.replicate_axis is None:
      return list(local)
    return [jax.lax.all_gather(x, self.replicate_axis, tiled=True)
            for x in local]

  def _materialize(self, g: int, rep_local, iteration=None
                   ) -> dict[int, Any]:
    """Leaf index -> full target, from replicate-gathered local buffers."""
    full = list(rep_local)
    if self._shard_axes:
      full = [jax.lax.all_gather(x, self._shard_axes, tiled=True)
              for x in full]
    if iteration is not None:
      full = [self._roll(x, -iteration) for x in full]
    return dict(zip(self._group_leaves(g),
                    self.layouts[g].unpack_full(full)))

  def _fill(self, b: int, sub: list[int], sub_rest, mats) -> Any:
    """Boundary ``b``'s params subtree from its rest leaves and targets."""
    leaves = [None] * len(self._leaf_paths)
    for i, x in zip(sub, sub_rest):
      leaves[i] = mats.get(i, x)
    tree = jax.tree.unflatten(self.treedef, leaves)
    return _boundaries._subtree(tree, self._boundary_keys[b])  # pylint: disable=protected-access

  def params(self, dedicated: DedicatedParams) -> Any:
    """The full params tree inside ``shard_map``: every boundary gathered.

    Handy for evaluation; in a train step use :meth:`block`,
    :meth:`sequential` or :meth:`scan`, which gather one group at a time and
    control Z2/Z3. The values are the same on every device (typed as
    device-varying, like any all-gather result in a loss).

    Args:
      dedicated: the local view of :class:`DedicatedParams`.

    Returns:
      The params tree, every leaf whole.
    """
    leaves = _full_leaves(self.gather_rest(dedicated), self.treedef)
    for g in range(len(self.layouts)):
      iters = self.num_iterations[g]
      if iters:
        idx = self._group_leaves(g)

        def one(a, g=g, idx=idx):
          mats = self._materialize(g, self._gather_replicate(a[1]), a[0])
          return [mats[i] for i in idx]

        mats = jax.lax.map(one, (jnp.arange(iters), list(dedicated.owned[g])))
        got = {i: m.reshape((-1,) + m.shape[2:]) for i, m in zip(idx, mats)}
      else:
        got = self._materialize(g, self._gather_replicate(dedicated.owned[g]))
      for i, x in got.items():
        leaves[i] = x
    return jax.tree.unflatten(self.treedef, leaves)

  def _maybe_z3(self, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run(rep_local, *args)``, gathered again in the backward pass (Z3)."""
    if not self.reshard_after_forward:
      return run
    return _regather_in_backward(run, self.remat_policy)

  def block(self, fn: Callable[..., Any], boundary: str
            ) -> Callable[..., Any]:
    """Wraps one block so that its weights are gathered inside it.

    The owners' matrices of ``boundary`` are all-gathered just before ``fn``
    runs (on HSDP: over ``replicate``, then over the shard axes); under
    :func:`jax.grad` the transpose reduce-scatters the gradients back to the
    owners. With ``reshard_after_forward=True`` (Z3) the gathered weights
    are freed after the forward and gathered again (over the shard axes) in
    the backward pass: 3 (N-1)/N bytes per element. With False (Z2) they are
    kept: 2 (N-1)/N, the all-reduce floor.

    Args:
      fn: ``(block_params, *args) -> out``; ``block_params`` is the params
        subtree at the boundary's path (e.g. ``params['layers_3']``), with
        its Muon targets materialized.
      boundary: the boundary's name (see ``boundaries.names``).

    Returns:
      ``(dedicated, *args) -> out``, to call inside ``shard_map``.

    Raises:
      ValueError: for an unknown or scanned boundary, or one gathered
        together with others (``layers_per_gather > 1``: use
        :meth:`sequential`).
    """
    b = self._boundary(boundary, scanned=False)
    g = self._group_of(b)
    if len(self.groups[g]) > 1:
      raise ValueError(
          f'dmuon: boundary {boundary!r} is gathered together with '
          f'{[self.boundaries.names[i] for i in self.groups[g]]} '
          f'(layers_per_gather={self.layers_per_gather}); run them with '
          'Dedication.sequential.')
    return self._run_group(g, lambda trees, *args: fn(trees[0], *args))

  def _run_group(self, g: int, body: Callable[..., Any]) -> Callable[..., Any]:
    """``(dedicated, *args) -> body(block_params_list, *args)``, group ``g``
    gathered (Z2/Z3 as configured); one subtree per boundary of the group."""
    subs = [self._subtree_leaves(b) for b in self.groups[g]]

    def run(rep_local, sub_rests, *args):
      mats = self._materialize(g, rep_local)
      trees = [self._fill(b, sub, [self._gather_leaf(i, x)
                                   for i, x in zip(sub, sub_rest)], mats)
               for b, sub, sub_rest in zip(self.groups[g], subs, sub_rests)]
      return body(trees, *args)

    inner = self._maybe_z3(run)

    def call(dedicated, *args):
      rest = _full_leaves(dedicated.rest, self.treedef)
      return inner(self._gather_replicate(dedicated.owned[g]),
                   [[rest[i] for i in sub] for sub in subs], *args)

    return call

  def sequential(self, fn: Callable[[Any, Any], Any],
                 boundaries: Sequence[str]
                 ) -> Callable[[DedicatedParams, Any], Any]:
    """Runs blocks one after another: ``x = fn(block_params, x)`` each.

    Like :meth:`block` for each boundary, but one gather per group of
    ``layers_per_gather`` boundaries (fewer, larger gathers pad the packed
    owner buffers less; Z3 keeps one group's weights at a time).

    Args:
      fn: ``(block_params, x) -> x``, as for :meth:`block`.
      boundaries: loop boundary names, in order; whole gather groups.

    Returns:
      ``(dedicated, x) -> x``, to call inside ``shard_map``.

    Raises:
      ValueError: for unknown or scanned boundaries or a split group.
    """
    idx = [self._boundary(name, scanned=False) for name in boundaries]
    plan = []
    while idx:
      g = self._group_of(idx[0])
      size = len(self.groups[g])
      if tuple(idx[:size]) != self.groups[g]:
        raise ValueError(
            f'dmuon: boundaries {list(boundaries)} split the gather group '
            f'{[self.boundaries.names[i] for i in self.groups[g]]}; pass '
            'whole groups, in order.')
      plan.append(g)
      idx = idx[size:]

    def body(trees, x):
      for tree in trees:
        x = fn(tree, x)
      return x

    calls = [self._run_group(g, body) for g in plan]

    def call(dedicated, x):
      for c in calls:
        x = c(dedicated, x)
      return x

    return call

  def scan(self, fn: Callable[[Any, Any], Any], boundary: str
           ) -> Callable[[DedicatedParams, Any], Any]:
    """Runs a scanned stack of blocks, gathering per scan iteration.

    The stacked params of ``boundary`` (leading layer axis) are sliced in a
    :func:`jax.lax.scan`; each iteration all-gathers ``layers_per_gather``
    layers' matrices from their owners (owners rotate by one slot per
    iteration) and applies ``fn`` to each layer. Z2/Z3 as for
    :meth:`block`.

    Args:
      fn: ``(layer_params, carry) -> carry``; ``layer_params`` is the
        boundary's params subtree sliced at one layer.
      boundary: the name of a scanned boundary.

    Returns:
      ``(dedicated, carry) -> carry``, to call inside ``shard_map``.

    Raises:
      ValueError: for an unknown boundary or one that is not scanned.
    """
    b = self._boundary(boundary, scanned=True)
    g = self._group_of(b)
    sub = self._subtree_leaves(b)
    k, iters = self.layers_per_gather, self.num_iterations[g]

    def run(rep_local, sub_rest, carry, iteration):
      mats = self._materialize(g, rep_local, iteration)
      for j in range(k):
        layer_rest = [self._gather_leaf(i, None if x is None else x[j],
                                        layer_slice=True)
                      for i, x in zip(sub, sub_rest)]
        carry = fn(self._fill(b, sub, layer_rest,
                              {i: m[j] for i, m in mats.items()}), carry)
      return carry

    inner = self._maybe_z3(run)

    def call(dedicated, carry):
      rest = _full_leaves(dedicated.rest, self.treedef)

      def body(carry, xs):
        iteration, owned, sub_rest = xs
        return inner(self._gather_replicate(owned), sub_rest, carry,
                     iteration), None

      xs = (jnp.arange(iters), list(dedicated.owned[g]),
            [None if rest[i] is None
             else rest[i].reshape((iters, k) + rest[i].shape[1:])
             for i in sub])
      return jax.lax.scan(body, carry, xs)[0]

    return call

  def _boundary(self, boundary: str, scanned: bool) -> int:
    if boundary not in self.boundaries.names:
      raise ValueError(
          f'dmuon: no hook boundary {boundary!r}; the boundaries are '
          f'{list(self.boundaries.names)}. Pass one of them (the path of '
          'the block subtree, as dmuon_jax.find_hook_boundaries(params) '
          'shows).')
    b = self.boundaries.names.index(boundary)
    if self.boundaries.scanned[b] != scanned:
      raise ValueError(
          f'dmuon: boundary {boundary!r} is '
          f'{"a scanned stack" if not scanned else "not scanned"}; use '
          f'Dedication.{"scan" if not scanned else "block or sequential"}.')
    return b

  # -- inspection ------------------------------------------------------------

  def gather_bytes(self) -> tuple[int, int]:
    """``(payload, gathered)`` bytes of one full materialization.

    ``payload`` is the Muon targets' bytes; ``gathered`` what the packed
    owner buffers hold (each gather pads every owner's share to the largest
    one in it).

    Returns:
      The two byte counts.
    """
    payload = gathered = 0
    for g, lay in enumerate(self.layouts):
      used, held = _group_bytes(lay)
      payload += max(self.num_iterations[g], 1) * used
      gathered += max(self.num_iterations[g], 1) * held
    return payload, gathered

  def summary(self) -> str:
    """The gather groups, their padding, and the owner plan's summary."""
    payload, gathered = self.gather_bytes()
    mode = 'Z3' if self.reshard_after_forward else 'Z2'
    lines = [f'Dedicated ownership ({mode}) on {self.num_slots} slots, '
             f'buffer axes {self.buffer_axes}'
             + (f', replicate axis {self.replicate_axis!r}'
                if self.replicate_axis else '')
             + f', {self.layers_per_gather} layer(s) per gather']
    for g, lay in enumerate(self.layouts):
      used, held = _group_bytes(lay)
      names = ', '.join(self.boundaries.names[b] or '<root>'
                        for b in self.groups[g])
      times = (f' x {self.num_iterations[g]} iterations'
               if self.num_iterations[g] else '')
      lines.append(f'  gather {g}: {names}{times}: {len(lay.plan.units)} '
                   f'matrices, {_planner._human_bytes(used)} gathered as '  # pylint: disable=protected-access
                   f'{_planner._human_bytes(held)} '  # pylint: disable=protected-access
                   f'(padding {_padding_percent(used, held):.1f}%)')
    lines.append(f'  total: Muon params {_planner._human_bytes(payload)}, '  # pylint: disable=protected-access
                 f'gathered {_planner._human_bytes(gathered)} '  # pylint: disable=protected-access
                 f'(padding {_padding_percent(payload, gathered):.1f}%)')
    if not self.plan.units:
      lines.append('  no Muon targets: every param is an AdamW param '
                   '(kept in rest)')
    return '\n'.join(lines + [self.plan.summary()])


def _regather_in_backward(run: Callable[..., Any],
                          policy: Callable[..., Any]) -> Callable[..., Any]:
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

  Returns:
    A function like ``run``.
  """
  remat = jax.checkpoint(run, policy=policy)
  # Set at trace time by the forward rule: the residuals' tree and the
  # positions of ``local`` among them.
  trace: dict[str, Any] = {}

  @jax.custom_vjp
  def regather(local, *args):
    return run(local, *args)

  def fwd(local, *args):
    local = list(local)
    out, vjp = jax.vjp(remat, local, *args)
    res, trace['tree'] = jax.tree.flatten(vjp)
    trace['tied'] = [k for k, r in enumerate(res)
                     if any(r is x for x in local)]
    if not trace['tied']:
      raise ValueError(
          'dmuon: with this remat_policy the Z3 block saves its gathered '
          'weights for the backward pass (Z2 memory and bytes). Use a '
          'policy that does not save them, e.g. jax.checkpoint_policies.'
          'dots_saveable (the default), or reshard_after_forward=False.')
    return out, res

  def bwd(res, ct):
    tie = sum(jnp.sum(c) for c in jax.tree.leaves(ct)) * 0
    res = [r + tie.astype(r.dtype) if k in trace['tied'] else r
           for k, r in enumerate(res)]
    return jax.tree.unflatten(trace['tree'], res)(ct)

  regather.defvjp(fwd, bwd)
  return regather


def _padding_percent(used: int, held: int) -> float:
  """Gathered bytes beyond the payload, in percent (0 with no payload)."""
  return 100 * (held / used - 1) if used else 0.0


def _group_bytes(lay: _layout.Layout) -> tuple[int, int]:
  used = held = 0
  for g, d in enumerate(lay.dtypes):
    item = np.dtype(d).itemsize
    used += int(lay.slot_used[g].sum()) * item
    held += lay.num_slots * lay.local_sizes[g] * item
  return used, held


def _full_leaves(rest: Any, treedef) -> list[Any]:
  """Leaves of ``rest`` with None placeholders kept (one per param)."""
  return treedef.flatten_up_to(rest)


def _replicated(ded: Dedication, xs):
  """``xs`` on every device (conversions index across the owner axes)."""
  if ded.mesh is None:
    return list(xs)
  return [jax.device_put(x, NamedSharding(ded.mesh, P())) for x in xs]


def _interleave_tp(n: int, per_tp: Sequence[jax.Array]) -> jax.Array:
  """``(..., n * local)`` buffers of each TP shard -> ``(..., n * T * local)``
  with TP shard ``t`` of slot ``s`` at block ``s * T + t``."""
  if len(per_tp) == 1:
    return per_tp[0]
  x = jnp.stack([b.reshape(b.shape[:-1] + (n, -1)) for b in per_tp], -2)
  return x.reshape(x.shape[:-3] + (-1,))


def _tp_part(n: int, tp: int, x: jax.Array, t: int) -> jax.Array:
  """Inverse of :func:`_interleave_tp` for TP shard ``t``."""
  if tp == 1:
    return x
  x = x.reshape(x.shape[:-1] + (n, tp, -1))[..., t, :]
  return x.reshape(x.shape[:-2] + (-1,))


def _pack_stack(ded: Dedication, g: int, targets):
  """(L, ...) targets -> per dtype (iters, num_slots * local), rotated."""
  iters, lay = ded.num_iterations[g], ded.layouts[g]

  def one(iteration, xs):
    return tuple(ded._roll(x, iteration) for x in lay.pack_full(xs))  # pylint: disable=protected-access

  def pack(targets):
    targets = [x.reshape((iters, -1) + x.shape[1:]) for x in targets]
    return jax.vmap(one)(jnp.arange(iters), targets)

  return jax.jit(pack)(targets)


def _unpack_stack(ded: Dedication, g: int, bufs):
  iters, lay = ded.num_iterations[g], ded.layouts[g]

  def one(iteration, bs):
    return lay.unpack_full([ded._roll(x, -iteration) for x in bs])  # pylint: disable=protected-access

  def unpack(bufs):
    out = jax.vmap(one)(jnp.arange(iters), bufs)
    return [x.reshape((-1,) + x.shape[2:]) for x in out]

  return jax.jit(unpack)(list(bufs))


def _buffer_axes(plan: _planner.OwnershipPlan, replicate_axis: str | None
                 ) -> tuple[tuple[str, ...], str | None]:
  """Owner axes in buffer order (shard axes, then replicate) and the
  replicate axis if it has more than one device."""
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  if replicate_axis not in sizes:
    return plan.axis_names, None
  axes = tuple(a for a in plan.axis_names if a != replicate_axis)
  return axes + (replicate_axis,), (
      replicate_axis if sizes[replicate_axis] > 1 else None)


def _to_plan_slot(plan: _planner.OwnershipPlan, buffer_axes, slot: int
                  ) -> int:
  if not plan.axis_names:
    return 0
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  coords = dict(zip(buffer_axes, np.unravel_index(
      slot, [sizes[a] for a in buffer_axes])))
  return int(np.ravel_multi_index(
      [int(coords[a]) for a in plan.axis_names], plan.mesh_shape))


def _rest_spec(x: Any, path: str, mesh: Any, scanned_names) -> P:
  """The PartitionSpec a non-target param keeps in dedicated mode."""
  sharding = getattr(x, 'sharding', None)
  if mesh is None or not isinstance(sharding, NamedSharding):
    return P()
  spec = sharding.spec
  entries = _collectives.spec_entries(spec)
  unknown = sorted({a for e in entries for a in e} - set(mesh.axis_names))
  if unknown:
    raise ValueError(
        f'dmuon: param {path!r} is sharded over axes {unknown} that mesh '
        f'{dict(mesh.shape)} does not have (spec {spec}); shard it over the '
        'mesh given to dedicate (or replicate it), or pass the mesh it '
        'lives on.')
  in_stack = any(path.startswith(n + '/') for n in scanned_names)
  if in_stack and entries and entries[0]:
    raise ValueError(
        f'dmuon: param {path!r} of a scanned stack is sharded along its '
        f'layer axis ({spec}); shard another dimension (the scan slices '
        'one layer per iteration) or replicate it.')
  return spec


def _balance_work(planned, n: int, max_rounds: int = 10_000) -> None:
  """Evens out Newton–Schulz work by swapping owners inside loop groups.

  Swapping everything two slots own in one gather group keeps that group's
  bytes per slot (hence its padding) as they are, so only the work moves:
  repeatedly take the busiest slot and the swap, in any loop group, that
  lowers the larger of the two slots' work the most. Scanned stacks keep
  their rotation. Updates the base owners in ``planned`` in place.
  """
  per_group = []
  for _, iters, base, base_owner in planned:
    w = np.zeros(n)
    for u, slot in zip(base, base_owner):
      for t in range(max(iters, 1)):
        w[(slot + t) % n] += u.cost
    per_group.append(w)
  total = sum(per_group, np.zeros(n))
  movable = [g for g, (_, iters, _, _) in enumerate(planned) if not iters]
  for _ in range(max_rounds):
    a = int(np.argmax(total))
    best, best_max = None, total[a] * (1 - 1e-9)
    for g in movable:
      w = per_group[g]
      for b in range(n):
        if b != a and w[a] != w[b]:
          new_max = max(total[a] - w[a] + w[b], total[b] - w[b] + w[a])
          if new_max < best_max:
            best, best_max = (g, b), new_max
    if best is None:
      return
    g, b = best
    w = per_group[g]
    delta = w[a] - w[b]
    total[a] -= delta
    total[b] += delta
    w[a], w[b] = w[b], w[a]
    owners = planned[g][3]
    owners[:] = [b if s == a else a if s == b else s for s in owners]


def _gather_groups(bounds: _boundaries.HookBoundaries, k: int
                   ) -> list[tuple[int, ...]]:
  """Consecutive loop boundaries by ``k``; each scanned stack alone."""
  groups, run = [], []
  for b, scanned in enumerate(bounds.scanned):
    if scanned:
      groups.append((b,))
      continue
    run.append(b)
    if len(run) == k:
      groups.append(tuple(run))
      run = []
  if run:
    groups.append(tuple(run))
  return groups


def dedicate(
    params: Any,
    mesh: jax.sharding.Mesh | None,
    *,
    predicate: Callable[[str, Any], bool] | None = None,
    weight_dimension_numbers: Any = None,
    boundary_predicate: _boundaries.BoundaryPredicate | None = None,
    strict: bool = True,
    reshard_after_forward: bool = True,
    layers_per_gather: int = 1,
    axis_names: Sequence[str] | None = None,
    replicate_axis: str | None = 'replicate',
    remat_policy: Callable[..., Any] | None = None,
    tensor_parallel_axis: str | None = 'model',
    ns_algorithm: str = 'auto',
) -> Dedication:
  """Plans dedicated ownership: each Muon matrix stored only on its owner.

  Matrices are gathered per group of ``layers_per_gather`` hook boundaries
  (see :func:`dmuon_jax.find_hook_boundaries`) or scanned layers. Within a
  group they are assigned to owners largest first, each to the owner
  holding the fewest bytes of that group (ties: the least Newton–Schulz
  work so far), so the packed gather pads little while NS work stays
  balanced over the whole model. A scanned stack is planned for one
  iteration; iteration ``t`` rotates those owners by ``t`` slots.

  A gather moves ``num_slots * (largest owner share)`` bytes: a block with
  fewer, unequal matrices than devices pads (e.g. a transformer block of 4
  ``d x d`` and 2 ``d x 2d`` matrices on 8 devices: 100%). Larger groups pad
  less (2 such blocks per gather: 0%) at the cost of Z3 memory (one group's
  weights). ``summary()`` reports the padding.

  On an HSDP mesh, owners are global ``(replicate, shard)`` slots: a group
  is gathered over ``replicate`` and then over the shard axes, so that Z3's
  backward re-gather stays inside the shard group; gradients are
  reduce-scattered over the shard axes, then over ``replicate``.

  Tensor parallelism: on a mesh with ``tensor_parallel_axis`` (e.g.
  ``('replicate', 'shard', 'model')``), owners range over the other axes and
  a Muon target whose sharding (read from ``params``: arrays placed with a
  ``NamedSharding``) puts the TP axis on one matrix dimension is split:
  every TP shard of the owner stores its slice, a block receives each TP
  shard's slice (write the block Megatron-style: column-parallel matmuls on
  the local slice, a ``psum`` over the TP axis after row-parallel ones), and
  :func:`dedicated_muon` orthogonalizes with Gram Newton–Schulz over the TP
  axis (one Gram all-reduce per restart window, the matrix never gathered).
  Compute gradients with ``dmuon_jax.local_value_and_grad(loss,
  axis_names=<the owner axes>)`` so that autodiff still sums the
  TP-replicated params' gradients over the TP axis.

  Args:
    params: the params tree (shapes are enough).
    mesh: the mesh whose devices own the matrices (None: one device).
    predicate: Muon-target predicate, as for :func:`dmuon_jax.dmuon`.
    weight_dimension_numbers: as for :func:`dmuon_jax.dmuon`.
    boundary_predicate: custom hook boundaries, see
      :func:`dmuon_jax.find_hook_boundaries`.
    strict: raise if a target has no boundary.
    reshard_after_forward: True for Z3 (gather again in the backward pass),
      False for Z2 (keep the gathered weights).
    layers_per_gather: boundaries (or scanned layers) per gather; must
      divide the length of every scanned stack.
    axis_names: the owner axes (default: all mesh axes but
      ``tensor_parallel_axis``).
    replicate_axis: the HSDP replicate axis name, if the mesh has it.
    remat_policy: for Z3, the ``jax.checkpoint`` policy of a block. The
      default ``jax.checkpoint_policies.dots_saveable`` keeps matmul outputs
      and recomputes the gathered weights and elementwise ops in the
      backward pass; ``nothing_saveable`` recomputes the whole block
      (activation checkpointing). It must not save the gathered weights.
    tensor_parallel_axis: the mesh axis that splits matrices, if the mesh
      has it (None: none).
    ns_algorithm: ``'auto'`` (per matrix shape, the cheaper of direct and
      Gram Newton–Schulz by the planner's cost model), ``'standard'`` or
      ``'gram'``; the plan balances that work and :func:`dedicated_muon`
      runs it. TP-split matrices always use the Gram form.

  Returns:
    A :class:`Dedication`; move params with ``to_dedicated``.

  Raises:
    ValueError: for targets without a boundary (strict mode), a scanned
      stack whose leaves do not share a leading layer axis, or a
      ``layers_per_gather`` that does not divide a stack.
  """
  if (not isinstance(layers_per_gather, int)
      or isinstance(layers_per_gather, bool) or layers_per_gather < 1):
    raise ValueError(
        f'dmuon: layers_per_gather={layers_per_gather!r} must be a positive '
        'int.')
  k = layers_per_gather
  bounds = _boundaries.find_hook_boundaries(
      params, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers,
      boundary_predicate=boundary_predicate, strict=strict)
  axis_names = _transform.owner_axes(mesh, axis_names, tensor_parallel_axis)
  tp_n = _transform.tp_size(mesh, tensor_parallel_axis)
  tp_dims: tuple[int | None, ...] = ()
  tp_splits_by_leaf: dict[int, int | None] = {}
  if tp_n > 1:
    params, tp_dims, tp_splits_by_leaf = _tp_local(
        params, mesh, predicate, weight_dimension_numbers,
        tensor_parallel_axis)
  plan = _planner.plan_ownership(
      params, mesh, axis_names=axis_names, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers,
      ns_algorithm=ns_algorithm)
  buffer_axes, rep_axis = _buffer_axes(plan, replicate_axis)
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  n = plan.num_slots
  leaves = jax.tree.leaves(params)
  flat = jax.tree.flatten_with_path(params)[0]
  leaf_paths = tuple(_planner.normalize_path(keys) for keys, _ in flat)
  path_boundary = dict(zip(bounds.paths, bounds.of_target))
  unit_ids = {(u.leaf_index, u.batch_index): i
              for i, u in enumerate(plan.units)}
  work = np.zeros(n)
  groups = _gather_groups(bounds, k)
  scanned_names = [n for n, sc in zip(bounds.names, bounds.scanned) if sc]
  planned = []  # per group: (specs, iterations, base units, base owners)
  for group in groups:
    specs = [s for s in plan.leaves if path_boundary[s.path] in group]
    iters = 0
    if bounds.scanned[group[0]]:
      name = bounds.names[group[0]]
      length = specs[0].shape[0]
      bad = [s.path for s in specs
             if 0 not in s.batch_axes or s.shape[0] != length]
      if bad:
        raise ValueError(
            f'dmuon: scanned stack {name!r} needs every Muon target to have '
            f'the same leading layer axis (a batch axis of its dimension '
            f'numbers) of size {length}; these do not: {bad}.')
      if length % k:
        raise ValueError(
            f'dmuon: layers_per_gather={k} does not divide the {length} '
            f'layers of scanned stack {name!r}.')
      iters = length // k
      specs = [dataclasses.replace(s, shape=(k,) + s.shape[1:])
               for s in specs]
    in_group = {s.leaf_index for s in specs}
    base = [u for u in plan.units if u.leaf_index in in_group
            and (not iters or u.batch_index[0] < k)]
    held = np.zeros(n)
    base_owner = [0] * len(base)
    # LPT by bytes inside the group (largest first, to the owner holding
    # the fewest bytes of it; ties by NS work so far, then slot index).
    for i in sorted(range(len(base)),
                    key=lambda i: (-base[i].nbytes, -base[i].cost, i)):
      slot = min(range(n), key=lambda s: (held[s], work[s], s))
      held[slot] += base[i].nbytes
      base_owner[i] = slot
      for t in range(max(iters, 1)):
        work[(slot + t) % n] += base[i].cost
    planned.append((specs, iters, base, base_owner))
  _balance_work(planned, n)
  owners = [0] * len(plan.units)
  layouts, num_iterations = [], []
  for specs, iters, base, base_owner in planned:
    for u, slot in zip(base, base_owner):
      for t in range(max(iters, 1)):
        index = u.batch_index
        if iters:
          index = (t * k + index[0],) + index[1:]
        owners[unit_ids[(u.leaf_index, index)]] = _to_plan_slot(
            plan, buffer_axes, (slot + t) % n)
    sub = dataclasses.replace(
        plan, axis_names=buffer_axes,
        mesh_shape=tuple(sizes[a] for a in buffer_axes),
        leaves=tuple(specs), units=tuple(base), owners=tuple(base_owner))
    layouts.append(_layout.Layout(
        sub, [leaves[s.leaf_index].dtype for s in specs],
        [tp_splits_by_leaf.get(s.leaf_index) for s in specs]))
    num_iterations.append(iters)
  targets = {s.leaf_index for s in plan.leaves}
  rest_specs = tuple(
      None if i in targets else _rest_spec(x, path, mesh, scanned_names)
      for i, (x, path) in enumerate(zip(leaves, leaf_paths)))
  boundary_keys = []
  for name in bounds.names:
    depth = len([s for s in name.split('/') if s])
    boundary_keys.append(next(
        tuple(keys[:depth]) for keys, path in zip(
            (keys for keys, _ in flat), leaf_paths)
        if not name or path == name or path.startswith(name + '/')))
  return Dedication(plan=dataclasses.replace(plan, owners=tuple(owners)),
                    boundaries=bounds, groups=tuple(groups),
                    layouts=tuple(layouts),
                    num_iterations=tuple(num_iterations),
                    layers_per_gather=k,
                    treedef=jax.tree.structure(params), mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    buffer_axes=buffer_axes, replicate_axis=rep_axis,
                    remat_policy=(remat_policy if remat_policy is not None
                                  else jax.checkpoint_policies.dots_saveable),
                    rest_specs=rest_specs,
                    _leaf_paths=leaf_paths,
                    _boundary_keys=tuple(boundary_keys),
                    tensor_parallel_axis=(tensor_parallel_axis if tp_n > 1
                                          else None),
                    ns_algorithm=ns_algorithm,
                    _tp_dims=tp_dims, _tp_size=tp_n)


def _tp_local(params, mesh, predicate, weight_dimension_numbers, tp_axis):
  """Params with TP-split targets at one TP shard's shape.

  Returns:
    ``(params, tp_dims, tp_splits)``: the tree with
    ``jax.ShapeDtypeStruct`` slices for split targets (the non-targets keep
    their leaves, for their shardings), per leaf the split dim or None, and
    per split target's leaf index its matrix split axis (-1 or -2).
  """
  leaves, treedef = jax.tree.flatten(params)
  specs = _planner.muon_target_specs(
      params, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers)
  targets = [s for s in specs if s is not None]
  shardings = [_collectives.spec_of(leaves[s.leaf_index], explicit=False)
               or P() for s in targets]
  _, splits, shapes = _transform.split_tensor_parallel(
      targets, shardings, tp_axis, dict(mesh.shape))
  whole = [s.path for s, split in zip(targets, splits) if split is None]
  if whole:
    raise ValueError(
        f'dmuon: dedicated mode on a mesh with the tensor-parallel axis '
        f'{tp_axis!r} needs every Muon target split over it (column- or '
        f'row-parallel); these are not: {whole}. Shard them over '
        f'{tp_axis!r} along a matrix dimension, route them to AdamW, or use '
        'the drop-in dmuon_jax.dmuon (which orthogonalizes TP-replicated '
        'matrices on every TP shard of the owner).')
  dims = [None] * len(leaves)
  by_leaf = {}
  for s, split, shape in zip(targets, splits, shapes):
    by_leaf[s.leaf_index] = split
    if split is not None:
      dims[s.leaf_index] = next(
          d for d, (a, b) in enumerate(zip(s.shape, shape)) if a != b)
      leaves[s.leaf_index] = jax.ShapeDtypeStruct(shape,
                                                  leaves[s.leaf_index].dtype)
  return jax.tree.unflatten(treedef, leaves), tuple(dims), by_leaf


class DedicatedMuonState(NamedTuple):
  """State of :func:`scale_by_dedicated_muon`.

  Attributes:
    count: the step count.
    mu: the momentum, laid out like ``DedicatedParams.owned``.
  """
  count: jax.Array
  mu: tuple[tuple[jax.Array, ...], ...]


def scale_by_dedicated_muon(
    dedication: Dedication,
    ns_coeffs: Any = 'jordan',
    ns_steps: int | None = None,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    consistent_rms: jax.typing.ArrayLike | None = None,
) -> optax.GradientTransformation:
  """Muon on owner buffers: momentum and NS local, no communication.

  Runs inside ``shard_map`` on the local view of ``DedicatedParams.owned``.
  The gradients are those that :meth:`Dedication.block` / :meth:`~.scan`
  deliver to the owners: sums over all devices of per-device mean-loss
  gradients, divided here by the number of devices (DMuon's net divisor
  ``R * S``). Includes optax's shape scaling.

  Args:
    dedication: the :class:`Dedication`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: momentum decay (optax's bias-corrected EMA).
    eps: added to the normalizing norm.
    mu_dtype: momentum dtype (default: the buffers' dtype).
    nesterov: Nesterov momentum.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.

  Returns:
    A :class:`optax.GradientTransformation` on ``owned`` trees.
  """
  coeffs = _newton_schulz.resolve_ns_coeffs(ns_coeffs, ns_steps)
  n = dedication.num_slots
  axes = dedication.buffer_axes

  def init_fn(owned):
    return DedicatedMuonState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda x: jnp.zeros_like(x, dtype=mu_dtype), owned))

  tp_axis, tp_n = dedication.tensor_parallel_axis, dedication._tp_size  # pylint: disable=protected-access

  def ortho(stack, tp_split):
    shape = list(stack.shape[-2:])
    stack = _transform.rescale_large(
        stack, tp_axis if tp_split is not None else None)
    if tp_split is not None:
      out = _tensor_parallel.orthogonalize_via_gram_newton_schulz_tp(
          stack, coeffs, axis_name=tp_axis, split_axis=tp_split, eps=eps)
      shape[tp_split] *= tp_n  # the whole matrix's shape
    else:
      algo = dedication.ns_algorithm
      if algo == 'auto':
        algo = _newton_schulz.cheaper_ns_algorithm(*shape, len(coeffs))
      form = (_newton_schulz.orthogonalize_via_gram_newton_schulz
              if algo == 'gram'
              else _newton_schulz.orthogonalize_via_newton_schulz)
      out = form(stack, coeffs, eps=eps)
    scale = _transform.shape_scale(*shape, consistent_rms)
    return (scale * out).astype(out.dtype)

  def orthogonalize(lay, hat, shift=0):
    if n == 1:
      return lay.map_slot(hat, 0, ortho)
    return _collectives.switch_by_slot(
        axes, [functools.partial(lay.map_slot, slot=s, fn=ortho)
               for s in range(n)], hat, shift=shift)

  def update_fn(grads, state, params=None):
    del params
    count_inc = optax.safe_increment(state.count)
    out, mus = [], []
    for b, lay in enumerate(dedication.layouts):
      g = tuple(x / n for x in grads[b])
      mu, hat = _transform.momentum_update(
          g, state.mu[b], count_inc, beta=beta, nesterov=nesterov,
          rule='optax')
      hat = tuple(h.astype(x.dtype) for h, x in zip(hat, grads[b]))
      if dedication.num_iterations[b]:
        # Iteration t holds base slot (slot - t) mod n of the layout.
        res = jax.lax.map(
            lambda a, lay=lay: orthogonalize(lay, a[1], shift=a[0]),
            (jnp.arange(dedication.num_iterations[b]), hat))
      else:
        res = orthogonalize(lay, hat)
      out.append(tuple(res))
      mus.append(tuple(m.astype(x.dtype) for m, x in zip(mu, state.mu[b])))
    return tuple(out), DedicatedMuonState(count=count_inc, mu=tuple(mus))

  return optax.GradientTransformation(init_fn, update_fn)


def _mean_rest(dedication: Dedication) -> optax.GradientTransformation:
  """Averages the non-target gradients over all devices (inside shard_map).

  A sharded param's gradient arrives summed over its sharding axes (the
  transpose of :meth:`Dedication.gather_rest`'s all-gather); it is divided
  by their size and averaged over the other axes it varies on.
  """
  mesh = dedication.mesh

  def update_fn(updates, state, params=None):
    del params
    if mesh is None or not _collectives.manual_axes():
      return updates, state
    sizes = dict(mesh.shape)
    tp_axis = dedication.tensor_parallel_axis
    out = []
    for x, spec, path in zip(_full_leaves(updates, dedication.treedef),
                             dedication.rest_specs,
                             dedication._leaf_paths):  # pylint: disable=protected-access
      if x is not None and tp_axis in _collectives.varying_axes(x):
        raise ValueError(
            f'dmuon: the gradient of {path!r} differs between the shards of '
            f'the tensor-parallel axis {tp_axis!r} (it is a partial sum '
            'there). Compute gradients with dmuon_jax.local_value_and_grad('
            f'loss, axis_names={dedication.buffer_axes}) so that autodiff '
            'sums TP-replicated params over the TP axis.')
      if x is not None:
        summed = [a for e in _collectives.spec_entries(spec) for a in e]
        if summed:
          x = x / np.prod([sizes[a] for a in summed])
        others = tuple(a for a in mesh.axis_names if a not in summed
                       and a in _collectives.varying_axes(x))
        if others:
          x = jax.lax.pmean(x, others)
      out.append(x)
    return jax.tree.unflatten(dedication.treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def dedicated_muon(
    dedication: Dedication,
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = 'jordan',
    ns_steps: int | None = None,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    adam_weight_decay: jax.typing.ArrayLike = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
    nonfinite: str = 'skip',
) -> optax.GradientTransformation:
  """:func:`dmuon_jax.dmuon` for :class:`DedicatedParams`, in ``shard_map``.

  Muon targets (``owned``) are updated on their owners with no
  communication; the other params (``rest``) by AdamW on gradients averaged
  over devices, on the shards they are stored in. Use with
  :func:`dmuon_jax.local_value_and_grad` inside ``jax.shard_map(..., in_specs=dedication.specs() ...)``.

  Args:
    dedication: the :class:`Dedication`.
    learning_rate: as for :func:`dmuon_jax.dmuon`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: as for :func:`dmuon_jax.dmuon`.
    eps: as for :func:`dmuon_jax.dmuon`.
    weight_decay: as for :func:`dmuon_jax.dmuon` (all Muon targets).
    mu_dtype: as for :func:`dmuon_jax.dmuon`.
    nesterov: as for :func:`dmuon_jax.dmuon`.
    adam_b1: as for :func:`dmuon_jax.dmuon`.
    adam_b2: as for :func:`dmuon_jax.dmuon`.
    adam_weight_decay: as for :func:`dmuon_jax.dmuon`.
    adam_learning_rate: as for :func:`dmuon_jax.dmuon`.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.
    nonfinite: as for :func:`dmuon_jax.dmuon`: ``'skip'`` zeroes the
      updates and keeps the whole state when any gradient, update or new
      state entry is NaN/Inf on any device (the flag is reduced over the
      mesh axes); ``'propagate'`` lets them through.

  Returns:
    A :class:`optax.GradientTransformation` on :class:`DedicatedParams`.
  """
  _transform._validate_static_args(  # pylint: disable=protected-access
      momentum='optax', ns_algorithm='auto', preconditioning='frobenius',
      compute_dtype=None, nonfinite=nonfinite)
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  muon = optax.chain(
      scale_by_dedicated_muon(dedication, ns_coeffs, ns_steps, beta, eps,
                              mu_dtype, nesterov=nesterov,
                              consistent_rms=consistent_rms),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))
  adam = optax.chain(
      _mean_rest(dedication),
      optax.adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                  weight_decay=adam_weight_decay, nesterov=nesterov))

  def init_fn(params):
    return (muon.init(params.owned), adam.init(params.rest))

  def update_fn(updates, state, params=None):
    dedication.check_dedicated(updates, 'dedicated_muon update()')
    owned_u, muon_state = muon.update(
        updates.owned, state[0], None if params is None else params.owned)
    rest_u, adam_state = adam.update(
        updates.rest, state[1], None if params is None else params.rest)
    return (DedicatedParams(owned=owned_u, rest=rest_u),
            (muon_state, adam_state))

  opt = optax.GradientTransformation(init_fn, update_fn)
  if nonfinite == 'skip':
    opt = _transform.skip_nonfinite(opt)
  return opt
