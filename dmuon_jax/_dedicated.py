"""Dedicated ownership: Muon targets stored on their owners (DMuon proper)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
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
  _checks,
  _collectives,
  _cost,
  _gather,
  _hyperparams,
  _layout,
  _mesh,
  _owner_layout,
  _owner_update,
  _plan,
  _planner,
  _report,
  _routing,
  _states,
)

_UNSET = object()


class DedicatedParams(NamedTuple):
  """Params with the Muon targets stored in owner layout.

  Attributes:
    owned: the Muon targets as :class:`dmuon_jax.OwnerBuffers`: per gather
      group (see :class:`Dedication`) one flat buffer per dtype. A loop
      group's buffer is ``(num_slots * local,)``; a scanned stack's is
      ``(num_iterations, num_slots * local)``. They are sharded over the
      owner axes so that a device's block holds exactly the matrices it
      owns; their layout is the dedication's.
    rest: the params tree with every Muon target replaced by None.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> dp.owned  # doctest: +ELLIPSIS
    OwnerBuffers(dmuon_...: float32[32])
    >>> dp.rest['layers_0']['w'] is None, dp.rest['layers_0']['b'].shape
    (True, (8,))
    >>> back = ded.to_params(dp)
    >>> bool((back['layers_0']['w'] == params['layers_0']['w']).all())
    True
  """

  owned: _owner_layout.OwnerBuffers
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
    layout: the :class:`dmuon_jax.OwnerLayout` of the owned buffers (and of
      the momentum of :func:`dedicated_muon`).
    layers_per_gather: boundaries (or scanned layers) per gather.
    layers_per_gather_choice: how it was chosen: ``'given'`` (an int
      passed to :func:`dedicate`), ``'auto'`` (the smallest with padding at
      most 5%), ``'auto, least padding'`` (none reached 5%) or, from
      :func:`dmuon_jax.flax.dedicate`, ``'one layer per nnx.scan
      iteration'``.
    treedef: the params tree structure.
    mesh: the mesh.
    reshard_after_forward: Z3 (True) or Z2 (False), see :meth:`block`.
    buffer_axes: owner axes, major to minor in buffer order.
    replicate_axis: the HSDP replicate axis (gathered first, outside the
      Z3 re-gather), or None.
    remat_policy: the ``jax.checkpoint`` policy of a Z3 block.
    rest_specs: per leaf, the PartitionSpec of a non-target param (None for
      Muon targets).
    leaf_paths: per leaf, its normalized path.
    boundary_keys: per boundary, the key path of its subtree.
    abstract_params: the params tree as ``jax.ShapeDtypeStruct`` (whole
      shapes), e.g. for a ``weight_decay_mask`` callable.
    tensor_parallel_axis: the mesh axis that splits Muon matrices (None
      without tensor parallelism). With it, the layout holds one TP shard's
      slice of each split matrix; owned buffers are sharded over
      ``buffer_axes`` and then this axis.
    ns_algorithm: the Newton–Schulz form the plan's costs assume and
      :func:`dedicated_muon` runs for matrices not split by TP (``'auto'``:
      the cheaper per shape).

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> params = {f'layers_{i}': {'w': jnp.ones((8, 8)), 'b': jnp.zeros(8)}
    ...           for i in range(2)}
    >>> ded = dmuon_jax.dedicate(params, None, layers_per_gather=2)
    >>> ded.boundaries.names, ded.groups  # both blocks in one gather group
    (('layers_0', 'layers_1'), ((0, 1),))
    >>> ded.num_slots, ded.layers_per_gather_choice, ded.reshard_after_forward
    (1, 'given', True)
    >>> ded.gather_bytes()  # (payload, gathered): no padding on one slot
    (512, 512)
    >>> print(ded.summary().splitlines()[0])  # doctest: +ELLIPSIS
    Dedicated ownership (Z3) on 1 slots, buffer axes (), 2 layer(s) per ...
  """

  plan: _plan.OwnershipPlan
  boundaries: _boundaries.HookBoundaries
  groups: tuple[tuple[int, ...], ...]
  layout: _owner_layout.OwnerLayout
  layers_per_gather: int
  treedef: Any
  mesh: Any
  reshard_after_forward: bool
  buffer_axes: tuple[str, ...]
  replicate_axis: str | None
  remat_policy: Callable[..., Any]
  rest_specs: tuple[P | None, ...]
  leaf_paths: tuple[str, ...]
  boundary_keys: tuple[Any, ...]
  abstract_params: Any
  tensor_parallel_axis: str | None = None
  ns_algorithm: str = 'auto'
  layers_per_gather_choice: str = 'given'

  @property
  def num_slots(self) -> int:
    """The number of owner slots (devices of the owner axes)."""
    return self.plan.num_slots

  @property
  def layouts(self) -> tuple[_layout.Layout, ...]:
    """The owner layout of each gather group (one scan iteration's for a
    scanned stack)."""
    return self.layout.groups

  @property
  def num_iterations(self) -> tuple[int, ...]:
    """Per gather group, its scan iterations (0 for loop boundaries)."""
    return self.layout.iterations

  @property
  def shard_axes(self) -> tuple[str, ...]:
    """The owner axes but the replicate axis (where Z3 gathers again)."""
    return tuple(a for a in self.buffer_axes if a != self.replicate_axis)

  def specs(self) -> DedicatedParams:
    """PartitionSpecs of a :class:`DedicatedParams` (for ``shard_map``).

    Owned buffers are sharded over the owner axes; every other param keeps
    the sharding it had when :func:`dedicate` saw it (replicated if none).
    """
    return DedicatedParams(
      owned=_owner_layout.OwnerBuffers(self.layout.buffer_specs(), self.layout),
      rest=jax.tree.unflatten(self.treedef, list(self.rest_specs)),
    )

  @staticmethod
  def specs_of(tree: Any) -> Any:
    """PartitionSpecs of a tree of global arrays, e.g. the optimizer state.

    Leaves with a ``NamedSharding`` give its spec; any other leaf (a scalar
    step count, a single-device array) is replicated: ``P()``.
    """
    return jax.tree.map(
      lambda x: (
        x.sharding.spec
        if isinstance(getattr(x, 'sharding', None), NamedSharding)
        else P()
      ),
      tree,
    )

  # -- inside shard_map ------------------------------------------------------

  def gather_rest(self, dedicated: DedicatedParams) -> Any:
    """The non-target params inside ``shard_map``, sharded dims gathered.

    Call it in the loss for the params used outside the blocks (embedding,
    final norm, head); under ``jax.grad`` the gathers transpose to
    reduce-scatters, so their gradients arrive sharded like the params.

    Args:
      dedicated: the local view of :class:`DedicatedParams`.

    Returns:
      ``dedicated.rest`` with every leaf whole (Muon targets stay None).
    """
    return _gather.gather_rest(self, dedicated)

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
    return _gather.all_params(self, dedicated)

  def block(self, fn: Callable[..., Any], boundary: str) -> Callable[..., Any]:
    """Wraps one block so that its weights are gathered inside it.

    The owners' matrices of ``boundary`` are all-gathered just before ``fn``
    runs (on HSDP: over ``replicate``, then over the shard axes); under
    ``jax.grad`` the transpose reduce-scatters the gradients back to the
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
    return _gather.block(self, fn, boundary)

  def sequential(
    self, fn: Callable[[Any, Any], Any], boundaries: Sequence[str]
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
    return _gather.sequential(self, fn, boundaries)

  def scan(
    self, fn: Callable[[Any, Any], Any], boundary: str
  ) -> Callable[[DedicatedParams, Any], Any]:
    """Runs a scanned stack of blocks, gathering per scan iteration.

    The stacked params of ``boundary`` (leading layer axis) are sliced in a
    ``jax.lax.scan``; each iteration all-gathers ``layers_per_gather``
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
    return _gather.scan(self, fn, boundary)

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
    values = {t.index: leaves[t.index] for t in self.layout.leaves}
    owned = pack_owned(self.layout, values, self.mesh)
    rest = [
      None if spec is None else x for x, spec in zip(leaves, self.rest_specs)
    ]
    if self.mesh is not None:
      rest = [
        None if x is None else jax.device_put(x, NamedSharding(self.mesh, spec))
        for x, spec in zip(rest, self.rest_specs)
      ]
    return DedicatedParams(
      owned=owned, rest=jax.tree.unflatten(self.treedef, rest)
    )

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
    return to_params(dedicated)

  def _check_params(self, params: Any) -> None:
    """Raises unless ``params`` is the tree ``dedicate`` planned."""
    if isinstance(params, DedicatedParams):
      raise TypeError(
        'dmuon: to_dedicated() takes a plain params tree and got '
        'DedicatedParams (already in owner layout); use it as it is, or '
        'to_params() to go back.'
      )
    _checks.check_same_tree(
      params,
      jax.tree.unflatten(self.treedef, [0] * self.treedef.num_leaves),
      'to_dedicated()',
      made_by='dmuon_jax.dedicate()',
    )
    leaves = jax.tree.leaves(params)
    for t in self.layout.leaves:
      got = tuple(np.shape(leaves[t.index]))
      if got != t.shape:
        raise ValueError(
          f'dmuon: param {t.path!r} has shape {got}, but dedicate() '
          f'planned it with shape {t.shape}. Call dmuon_jax.dedicate '
          'again on the new params (and make a new optimizer state).'
        )

  def check_dedicated(self, dedicated: Any, what: str) -> None:
    """Raises unless ``dedicated`` fits this dedication's owner layout.

    Args:
      dedicated: a :class:`DedicatedParams` (or a gradient/update tree of
        that form) of global arrays, or local blocks inside ``shard_map``.
      what: the operation, for the message (e.g. ``'update()'``).

    Raises:
      TypeError: if it is not a :class:`DedicatedParams`.
      ValueError: naming both layouts, or the gather group whose buffers
        differ.
    """
    if not isinstance(dedicated, DedicatedParams):
      raise TypeError(
        f'dmuon: {what} takes the DedicatedParams made by '
        f'Dedication.to_dedicated(params); got {type(dedicated).__name__}.'
        ' Convert the params with ded.to_dedicated(params) first.'
      )
    check_owned(self.layout, dedicated.owned, what)

  # -- inspection ------------------------------------------------------------

  def gather_bytes(self) -> tuple[int, int]:
    """``(payload, gathered)`` bytes of one full materialization.

    ``payload`` is the Muon targets' bytes; ``gathered`` what the packed
    owner buffers hold (each gather pads every owner's share to the largest
    one in it).

    Returns:
      The two byte counts.
    """
    return _gather_bytes(self)

  def summary(self) -> str:
    """The gather groups, their padding, and the owner plan's summary."""
    return _summary(self)


def check_owned(
  layout: _owner_layout.OwnerLayout, owned: Any, what: str
) -> None:
  """Raises unless ``owned`` are buffers of ``layout`` (global or local)."""
  if not isinstance(owned, _owner_layout.OwnerBuffers):
    raise TypeError(
      f'dmuon: {what} takes owner buffers (DedicatedParams.owned); got '
      f'{type(owned).__name__}.'
    )
  if owned.layout != layout:
    raise ValueError(
      f'dmuon: {what} got owner buffers laid out as {owned.layout.name}, '
      f'but this dedication lays them out as {layout.name}: they were '
      'made by another dmuon_jax.dedicate call (another mesh, model or '
      'plan). Use the Dedication that made them, or convert with '
      'to_params() and to_dedicated().'
    )
  shapes = [tuple(np.shape(b)) for b in owned.buffers]
  glob = [s.shape for s in layout.buffer_shapes()]
  if shapes not in (glob, list(layout.local_shapes())):
    raise ValueError(
      f'dmuon: {what} got owner buffers of shapes {shapes}, but layout '
      f'{layout.name} has {glob} (global): the buffers were changed '
      'outside dmuon. Call dedicate and to_dedicated again.'
    )


def _replicated(mesh, xs):
  """``xs`` on every device (conversions index across the owner axes)."""
  if mesh is None:
    return list(xs)
  return [jax.device_put(x, NamedSharding(mesh, P())) for x in xs]


@functools.lru_cache(maxsize=64)
def _packer(layout: _owner_layout.OwnerLayout, dtypes: tuple | None):
  return jax.jit(lambda values: layout.pack(values, dtypes))


@functools.lru_cache(maxsize=64)
def _unpacker(layout: _owner_layout.OwnerLayout):
  return jax.jit(layout.unpack)


def pack_owned(
  layout: _owner_layout.OwnerLayout,
  values: dict[int, Any],
  mesh: Any,
  dtypes=None,
  shardings=None,
) -> _owner_layout.OwnerBuffers:
  """Owner buffers (placed) from whole arrays, leaf index -> array."""
  keys = sorted(values)
  mesh_of = mesh if isinstance(mesh, jax.sharding.Mesh) else None
  full = dict(zip(keys, _replicated(mesh_of, [values[k] for k in keys])))
  dtypes = None if dtypes is None else tuple(jnp.dtype(d) for d in dtypes)
  bufs = _packer(layout, dtypes)(full)
  if shardings is None and mesh_of is not None:
    shardings = layout.shardings(mesh_of)
  if shardings is not None:
    bufs = [
      b if s is None else jax.device_put(b, s) for b, s in zip(bufs, shardings)
    ]
  return _owner_layout.OwnerBuffers(bufs, layout)


def unpack_owned(owned: _owner_layout.OwnerBuffers) -> dict[int, jax.Array]:
  """Whole (replicated) arrays from owner buffers: leaf index -> array."""
  bufs = list(owned.buffers)
  mesh = next(
    (
      b.sharding.mesh
      for b in bufs
      if isinstance(getattr(b, 'sharding', None), NamedSharding)
    ),
    None,
  )
  return _unpacker(owned.layout)(_replicated(mesh, bufs))


def _leaves_with_none(tree: Any) -> tuple[list[Any], Any]:
  return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)


def to_params(dedicated: DedicatedParams) -> Any:
  """The plain params tree of :class:`DedicatedParams` (from its layout)."""
  leaves, treedef = _leaves_with_none(dedicated.rest)
  for i, x in unpack_owned(dedicated.owned).items():
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _tp_local(params, info, predicate, weight_dimension_numbers):
  """Params with TP-split targets at one TP shard's shape.

  Returns:
    ``(params, tp_dims, tp_splits)``: the tree with
    ``jax.ShapeDtypeStruct`` slices for split targets (the non-targets keep
    their leaves, for their shardings), per leaf the split dim or None, and
    per split target's leaf index its matrix split axis (-1 or -2).
  """
  leaves, treedef = jax.tree.flatten(params)
  specs = _routing.muon_target_specs(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
  )
  dims = [None] * len(leaves)
  by_leaf = {}
  whole = []
  for s in specs:
    if s is None:
      continue
    x = leaves[s.leaf_index]
    spec = _mesh.leaf_spec(x) or P()
    entries = _mesh.normalize_entries(spec, len(s.shape), info.sizes)
    _, split, dim, shape = _mesh.split_tensor_parallel(
      s, entries, info.tp_axis, info.tp_size
    )
    if split is None:
      whole.append(s.path)
      continue
    by_leaf[s.leaf_index] = split
    dims[s.leaf_index] = dim
    leaves[s.leaf_index] = jax.ShapeDtypeStruct(shape, x.dtype)
  if whole:
    raise ValueError(
      f'dmuon: dedicated mode on a mesh with the tensor-parallel axis '
      f'{info.tp_axis!r} needs every Muon target split over it (column- or '
      f'row-parallel); these are not: {whole}. Shard them over '
      f'{info.tp_axis!r} along a matrix dimension, route them to AdamW, or '
      'use the drop-in dmuon_jax.dmuon (which orthogonalizes '
      'TP-replicated matrices on every TP shard of the owner).'
    )
  return jax.tree.unflatten(treedef, leaves), tuple(dims), by_leaf


def _buffer_axes(
  plan: _plan.OwnershipPlan, replicate_axis: str | None
) -> tuple[tuple[str, ...], str | None]:
  """Owner axes in buffer order (shard axes, then replicate) and the
  replicate axis if it has more than one device."""
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  if replicate_axis not in sizes:
    return plan.axis_names, None
  axes = tuple(a for a in plan.axis_names if a != replicate_axis)
  return axes + (replicate_axis,), (
    replicate_axis if sizes[replicate_axis] > 1 else None
  )


def _group_axis(plan: _plan.OwnershipPlan, rep_axis: str | None) -> str | None:
  """The axis owner groups range over: the innermost owner axis that is not
  the HSDP replicate axis (a group's Grams then stay in a shard group)."""
  axes = [a for a in plan.axis_names if a != rep_axis] or list(plan.axis_names)
  return axes[-1] if axes else None


def _rest_spec(x: Any, path: str, mesh: Any, scanned_names) -> P:
  """The PartitionSpec a non-target param keeps in dedicated mode."""
  sharding = getattr(x, 'sharding', None)
  if mesh is None or not isinstance(sharding, NamedSharding):
    return P()
  spec = sharding.spec
  entries = _mesh.spec_entries(spec)
  unknown = sorted({a for e in entries for a in e} - set(mesh.axis_names))
  if unknown:
    raise ValueError(
      f'dmuon: param {path!r} is sharded over axes {unknown} that mesh '
      f'{dict(mesh.shape)} does not have (spec {spec}); shard it over the '
      'mesh given to dedicate (or replicate it), or pass the mesh it '
      'lives on.'
    )
  in_stack = any(path.startswith(n + '/') for n in scanned_names)
  if in_stack and entries and entries[0]:
    raise ValueError(
      f'dmuon: param {path!r} of a scanned stack is sharded along its '
      f'layer axis ({spec}); shard another dimension (the scan slices '
      'one layer per iteration) or replicate it.'
    )
  return spec


def _gather_groups(
  bounds: _boundaries.HookBoundaries, k: int
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
  muon_weight_dimension_numbers: Any = None,
  boundary_predicate: _boundaries.BoundaryPredicate | None = None,
  strict: bool = True,
  reshard_after_forward: bool = True,
  layers_per_gather: int | str = 'auto',
  axis_names: Sequence[str] | None = None,
  replicate_axis: str | None = 'replicate',
  remat_policy: Callable[..., Any] | None = None,
  tensor_parallel_axis: str | None = 'auto',
  ns_algorithm: str = 'auto',
  weight_dimension_numbers: Any = _UNSET,
  owner_groups: int | str | None = 'auto',
) -> Dedication:
  """Plans dedicated ownership: each Muon matrix stored only on its owner.

  Matrices are gathered per group of ``layers_per_gather`` hook boundaries
  (see :func:`dmuon_jax.find_hook_boundaries`) or scanned layers. Within a
  group they are assigned to owners largest first, each to the owner
  holding the fewest bytes of that group (ties: the least Newton–Schulz
  work so far), so the packed gather pads little while NS work stays
  balanced over the whole model (:func:`dmuon_jax.plan_ownership` and the
  planner's gather-group pass). A scanned stack is planned for one
  iteration; iteration ``t`` rotates those owners by ``t`` slots.

  A gather moves ``num_slots * (largest owner share)`` bytes: a block with
  fewer, unequal matrices than devices pads (e.g. a transformer block of 4
  ``d x d`` and 2 ``d x 2d`` matrices on 8 devices: 100%). Larger groups pad
  less (2 such blocks per gather: 0%) at the cost of Z3 memory (one group's
  weights). ``layers_per_gather='auto'`` (default) takes the smallest group
  size whose padding is at most 5% (or, if none is, the least padding);
  ``summary()`` reports the choice and the padding.

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
    muon_weight_dimension_numbers: as for :func:`dmuon_jax.dmuon`.
    boundary_predicate: custom hook boundaries, see
      :func:`dmuon_jax.find_hook_boundaries`.
    strict: raise if a target has no boundary.
    reshard_after_forward: True for Z3 (gather again in the backward pass),
      False for Z2 (keep the gathered weights).
    layers_per_gather: boundaries (or scanned layers) per gather; must
      divide the length of every scanned stack. ``'auto'`` (default): the
      smallest such number whose gathers pad at most
      ``AUTO_PADDING_PERCENT`` (5%) over the Muon params' bytes, else the
      one padding least.
    axis_names: the owner axes (default: all mesh axes but
      ``tensor_parallel_axis``).
    replicate_axis: the HSDP replicate axis name, if the mesh has it.
    remat_policy: for Z3, the ``jax.checkpoint`` policy of a block. The
      default ``jax.checkpoint_policies.dots_saveable`` keeps matmul outputs
      and recomputes the gathered weights and elementwise ops in the
      backward pass; ``nothing_saveable`` recomputes the whole block
      (activation checkpointing). It must not save the gathered weights.
    tensor_parallel_axis: the mesh axis that splits matrices, if the mesh
      has it. ``'auto'`` (default): the axis named ``'model'``, ``'tensor'``
      or ``'tp'`` that the (placed) Muon params are sharded over, if any,
      as for :func:`dmuon_jax.dmuon`. None: none.
    ns_algorithm: ``'auto'`` (per matrix shape, the cheaper of direct and
      Gram Newton–Schulz by the planner's cost model), ``'standard'`` or
      ``'gram'``; the plan balances that work and :func:`dedicated_muon`
      runs it. TP-split matrices always use the Gram form.
    weight_dimension_numbers: deprecated name of
      ``muon_weight_dimension_numbers``.
    owner_groups: ``'auto'`` (default), an int ``k`` or None: matrices
      split over a group of owners, as for :func:`dmuon_jax.dmuon` (their
      slices are stored on the group's devices and gathered like whole
      matrices). Not for scanned stacks and TP matrices ('auto' leaves them
      whole; ``k`` raises).

  Returns:
    A :class:`Dedication`; move params with ``to_dedicated``.

  Raises:
    ValueError: for targets without a boundary (strict mode), a scanned
      stack whose leaves do not share a leading layer axis, or a
      ``layers_per_gather`` that does not divide a stack.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import dmuon_jax
    >>> params = {f'layers_{i}': {'w': jnp.ones((8, 8)), 'b': jnp.zeros(8)}
    ...           for i in range(2)}
    >>> ded = dmuon_jax.dedicate(params, None)
    >>> ded.boundaries.names
    ('layers_0', 'layers_1')
    >>> dp = ded.to_dedicated(params)
    >>> dp.rest['layers_0']['w'] is None
    True
    >>> bool((ded.to_params(dp)['layers_1']['w'] == 1).all())
    True
  """
  if weight_dimension_numbers is not _UNSET:
    warnings.warn(
      'As of dmuon_jax 0.2, dedicate(weight_dimension_numbers=...) is '
      'called muon_weight_dimension_numbers, as in dmuon_jax.dmuon; the '
      'old name will be removed.',
      DeprecationWarning,
      stacklevel=2,
    )
    if muon_weight_dimension_numbers is not None:
      raise TypeError(
        'dmuon: dedicate got both muon_weight_dimension_numbers and its '
        'deprecated name weight_dimension_numbers; pass only the first.'
      )
    muon_weight_dimension_numbers = weight_dimension_numbers
  dims_numbers = muon_weight_dimension_numbers
  if layers_per_gather != 'auto' and (
    not isinstance(layers_per_gather, int)
    or isinstance(layers_per_gather, bool)
    or layers_per_gather < 1
  ):
    raise ValueError(
      f'dmuon: layers_per_gather={layers_per_gather!r} must be a positive'
      ' int (the number of consecutive hook boundaries gathered together:'
      " 1, 2, ...; dedicate(...).summary() shows the padding) or 'auto'."
    )
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params
  )
  routing = _routing.route(
    params,
    predicate=predicate,
    weight_dimension_numbers=dims_numbers,
    dims_arg='muon_weight_dimension_numbers',
  )
  _report.report_routing(routing)
  bounds = _boundaries.find_hook_boundaries(
    params,
    predicate=predicate,
    weight_dimension_numbers=dims_numbers,
    boundary_predicate=boundary_predicate,
    strict=strict,
  )
  param_leaves = jax.tree.leaves(params)
  info = _mesh.resolve(
    mesh,
    axis_names,
    tensor_parallel_axis,
    sharded_axes=_mesh.sharded_axes(
      [
        _mesh.leaf_spec(param_leaves[t.leaf_index])
        for t in routing.specs
        if t is not None
      ]
    ),
  )
  tp_n = info.tp_size if info is not None else 1
  tp_dims: tuple[int | None, ...] = (None,) * len(jax.tree.leaves(params))
  tp_splits_by_leaf: dict[int, int | None] = {}
  if tp_n > 1:
    params, tp_dims, tp_splits_by_leaf = _tp_local(
      params, info, predicate, dims_numbers
    )
  scanned_leaves = [
    t.leaf_index
    for t, path in zip(
      (t for t in routing.specs if t is not None),
      (t.path for t in routing.specs if t is not None),
    )
    if bounds.scanned[dict(zip(bounds.paths, bounds.of_target))[path]]
  ]
  _planner.check_owner_groups(owner_groups)
  if owner_groups not in (None, 'auto'):
    if tp_n > 1:
      raise ValueError(
        f'dmuon: owner_groups={owner_groups} with the tensor-parallel axis '
        f'{info.tp_axis!r}: TP matrices are split over it already. Pass '
        'owner_groups=None (or the default).'
      )
    if scanned_leaves:
      raise ValueError(
        f'dmuon: owner_groups={owner_groups} with scanned stacks: their '
        'owners rotate per scan iteration, which groups do not follow. Pass '
        "owner_groups='auto' (scanned stacks stay whole) or None."
      )
  base_plan = _planner.plan_ownership(
    params,
    mesh,
    axis_names=None if info is None else info.owner_axes,
    predicate=predicate,
    weight_dimension_numbers=dims_numbers,
    ns_algorithm=ns_algorithm,
    owner_groups=None if tp_n > 1 else owner_groups,
    ungroupable=scanned_leaves,
  )

  def build(k: int, choice: str) -> Dedication:
    plan = base_plan
    buffer_axes, rep_axis = _buffer_axes(plan, replicate_axis)
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    leaves = jax.tree.leaves(params)
    flat = jax.tree.flatten_with_path(params)[0]
    leaf_paths = tuple(_routing.normalize_path(keys) for keys, _ in flat)
    path_boundary = dict(zip(bounds.paths, bounds.of_target))
    groups = _gather_groups(bounds, k)
    scanned_names = [n for n, sc in zip(bounds.names, bounds.scanned) if sc]
    group_specs = [
      (
        bounds.names[group[0]],
        bounds.scanned[group[0]],
        [s for s in plan.leaves if path_boundary[s.path] in group],
      )
      for group in groups
    ]
    plan, group_plans, iterations = _planner.plan_gather_groups(
      plan, group_specs, k, buffer_axes, _group_axis(plan, rep_axis)
    )
    layouts = tuple(
      _layout.Layout(
        gp,
        [leaves[s.leaf_index].dtype for s in gp.leaves],
        [tp_splits_by_leaf.get(s.leaf_index) for s in gp.leaves],
      )
      for gp in group_plans
    )
    full_shapes = jax.tree.leaves(abstract)
    group_of_leaf = {
      s.leaf_index: g for g, gp in enumerate(group_plans) for s in gp.leaves
    }
    distributed = plan.num_slots * tp_n > 1
    layout = _owner_layout.OwnerLayout(
      groups=layouts,
      iterations=iterations,
      buffer_axes=buffer_axes,
      buffer_sizes=tuple(sizes[a] for a in buffer_axes),
      tp_axis=info.tp_axis if tp_n > 1 else None,
      tp_size=tp_n,
      mesh=info.abstract if distributed else None,
      leaves=tuple(
        _owner_layout.TargetLeaf(
          index=s.leaf_index,
          path=s.path,
          shape=tuple(full_shapes[s.leaf_index].shape),
          dtype=jnp.dtype(s.dtype).name,
          group=group_of_leaf[s.leaf_index],
          tp_dim=tp_dims[s.leaf_index],
        )
        for s in plan.leaves
      ),
      param_entries=(None,) * len(plan.leaves),
      layers_per_iteration=tuple(k if it else 1 for it in iterations),
      kind='dedicated',
    )
    targets = {s.leaf_index for s in plan.leaves}
    rest_specs = tuple(
      None if i in targets else _rest_spec(x, path, mesh, scanned_names)
      for i, (x, path) in enumerate(zip(leaves, leaf_paths))
    )
    boundary_keys = []
    for name in bounds.names:
      depth = len([s for s in name.split('/') if s])
      boundary_keys.append(
        next(
          tuple(keys[:depth])
          for keys, path in zip((keys for keys, _ in flat), leaf_paths)
          if not name or path == name or path.startswith(name + '/')
        )
      )
    return Dedication(
      plan=plan,
      boundaries=bounds,
      groups=tuple(groups),
      layout=layout,
      layers_per_gather=k,
      layers_per_gather_choice=choice,
      treedef=jax.tree.structure(params),
      mesh=mesh,
      reshard_after_forward=reshard_after_forward,
      buffer_axes=buffer_axes,
      replicate_axis=rep_axis,
      remat_policy=(
        remat_policy
        if remat_policy is not None
        else jax.checkpoint_policies.dots_saveable
      ),
      rest_specs=rest_specs,
      leaf_paths=leaf_paths,
      boundary_keys=tuple(boundary_keys),
      abstract_params=abstract,
      tensor_parallel_axis=info.tp_axis if tp_n > 1 else None,
      ns_algorithm=ns_algorithm,
    )

  if layers_per_gather != 'auto':
    return build(layers_per_gather, 'given')
  shape_of = {
    _routing.normalize_path(keys): np.shape(x)
    for keys, x in jax.tree.flatten_with_path(params)[0]
  }
  stacks = sorted(
    {
      shape_of[path][0]
      for path, b in zip(bounds.paths, bounds.of_target)
      if bounds.scanned[b] and shape_of[path]
    }
  )
  return _auto_layers_per_gather(bounds, stacks, build)


AUTO_PADDING_PERCENT = 5.0


def _auto_layers_per_gather(
  bounds: _boundaries.HookBoundaries,
  stacks: Sequence[int],
  build: Callable[[int, str], Dedication],
) -> Dedication:
  """The dedication of ``layers_per_gather='auto'``.

  Tries 1, 2, ... consecutive boundaries per gather (those dividing every
  scanned stack) and keeps the first whose gathers pad at most
  ``AUTO_PADDING_PERCENT`` over the payload; if none does, the one padding
  least (the smallest of equals).
  """
  loops = sum(1 for sc in bounds.scanned if not sc)
  top = max([loops] + stacks + [1])
  ks = [k for k in range(1, top + 1) if all(n % k == 0 for n in stacks)]
  best = None
  for k in ks:
    ded = build(k, 'auto')
    pad = _padding_percent(*ded.gather_bytes())
    if pad <= AUTO_PADDING_PERCENT:
      return ded
    if best is None or pad < best[0] - 1e-9:
      best = (pad, k)
  assert best is not None
  return build(best[1], 'auto, least padding')


def _gather_bytes(ded: Dedication) -> tuple[int, int]:
  payload = gathered = 0
  for g, lay in enumerate(ded.layout.groups):
    used, held = _group_bytes(lay)
    payload += max(ded.layout.iterations[g], 1) * used
    gathered += max(ded.layout.iterations[g], 1) * held
  return payload, gathered


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


def _summary(ded: Dedication) -> str:
  payload, gathered = _gather_bytes(ded)
  mode = 'Z3' if ded.reshard_after_forward else 'Z2'
  lines = [
    f'Dedicated ownership ({mode}) on {ded.num_slots} slots, '
    f'buffer axes {ded.buffer_axes}'
    + (f', replicate axis {ded.replicate_axis!r}' if ded.replicate_axis else '')
    + f', {ded.layers_per_gather} layer(s) per gather'
    + (
      f' ({ded.layers_per_gather_choice}: padding <= {AUTO_PADDING_PERCENT:g}%)'
      if ded.layers_per_gather_choice == 'auto'
      else f' ({ded.layers_per_gather_choice})'
    )
    + f', layout {ded.layout.name}'
  ]
  for g, lay in enumerate(ded.layout.groups):
    used, held = _group_bytes(lay)
    names = ', '.join(
      ded.boundaries.names[b] or '<root>' for b in ded.groups[g]
    )
    iters = ded.layout.iterations[g]
    times = f' x {iters} iterations' if iters else ''
    lines.append(
      f'  gather {g}: {names}{times}: {len(lay.plan.units)} '
      f'matrices, {_cost.human_bytes(used)} gathered as '
      f'{_cost.human_bytes(held)} '
      f'(padding {_padding_percent(used, held):.1f}%)'
    )
  lines.append(
    f'  total: Muon params {_cost.human_bytes(payload)}, '
    f'gathered {_cost.human_bytes(gathered)} '
    f'(padding {_padding_percent(payload, gathered):.1f}%)'
  )
  if not ded.plan.units:
    lines.append(
      '  no Muon targets: every param is an AdamW param (kept in rest)'
    )
  return '\n'.join(lines + [ded.plan.summary()])


class DedicatedMuonState(NamedTuple):
  """State of :func:`scale_by_dedicated_muon`.

  Attributes:
    count: the step count.
    mu: the momentum, laid out like ``DedicatedParams.owned`` (the same
      :class:`dmuon_jax.OwnerLayout`).
    stamp: the layout that wrote ``mu``, as data: a checkpoint of another
      layout restored with orbax's ``partial_restore=True`` raises instead
      of leaving zero momentum (see :class:`dmuon_jax.ScaleByDMuonState`).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> state = dmuon_jax.scale_by_dedicated_muon(ded).init(dp.owned)
    >>> int(state.count), state.mu.layout == dp.owned.layout
    (0, True)
  """

  count: jax.Array
  mu: _owner_layout.OwnerBuffers
  # Which layout wrote mu, as data (see dmuon_jax.ScaleByDMuonState).
  stamp: _states.LayoutStamp


def _decayed_leaves(
  ded: Dedication, weight_decay, weight_decay_mask
) -> frozenset[int] | None:
  """Leaf indices of the Muon targets that decay (None: no decay)."""
  if (
    isinstance(weight_decay, (int, float))
    and not isinstance(weight_decay, bool)
    and weight_decay == 0
  ):
    return None
  indices = [t.index for t in ded.layout.leaves]
  if weight_decay_mask is None:
    return frozenset(indices)
  mask = weight_decay_mask
  if callable(mask):
    mask = mask(ded.abstract_params)
  flags = ded.treedef.flatten_up_to(mask)
  bad = [
    ded.leaf_paths[i]
    for i in indices
    if not isinstance(flags[i], (bool, np.bool_))
  ]
  if bad:
    raise ValueError(
      f'dmuon: weight_decay_mask has non-boolean entries at {bad}; give a '
      'tree like the params (or a callable params -> tree) of True/False, '
      'as for optax.add_decayed_weights.'
    )
  return frozenset(i for i in indices if flags[i])


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
  adaptive: bool = False,
  preconditioning: str = 'frobenius',
  momentum: str = 'optax',
  compute_dtype: Any = None,
  weight_decay: jax.typing.ArrayLike = 0.0,
  weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
  """Muon on owner buffers: momentum and NS local, no communication.

  The owner update of :func:`dmuon_jax.dmuon` (the same module, the same
  numbers), applied to :class:`DedicatedParams` ``owned`` buffers: momentum,
  Newton–Schulz (the dedication's ``ns_algorithm``), ``adaptive``, the shape
  factor and the masked weight decay, each owner on its own matrices.
  Inside ``shard_map`` it runs on the local blocks; the gradients are those
  that :meth:`Dedication.block` / :meth:`~.scan` deliver to the owners: sums
  over all devices of per-device mean-loss gradients, divided here by the
  number of owner slots (DMuon's net divisor ``R * S``). Under plain
  ``jax.jit`` (global arrays) it runs its own ``shard_map`` over the
  owner axes, on gradients already averaged.

  Args:
    dedication: the :class:`Dedication`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: as for :func:`dmuon_jax.dmuon`.
    eps: as for :func:`dmuon_jax.dmuon`.
    mu_dtype: momentum dtype (default: the buffers' dtype).
    nesterov: as for :func:`dmuon_jax.dmuon`.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.
    adaptive: as for :func:`dmuon_jax.dmuon`.
    preconditioning: as for :func:`dmuon_jax.dmuon`.
    momentum: as for :func:`dmuon_jax.dmuon`.
    compute_dtype: as for :func:`dmuon_jax.dmuon`.
    weight_decay: decoupled weight decay (not multiplied by the learning
      rate here: chain ``optax.scale_by_learning_rate`` after).
    weight_decay_mask: as for :func:`dmuon_jax.dmuon` (a tree like the plain
      params, or a callable of them).

  Returns:
    A ``optax.GradientTransformation`` on ``owned`` buffers.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> tx = dmuon_jax.scale_by_dedicated_muon(ded)
    >>> state = tx.init(dp.owned)
    >>> grads = jax.tree.map(jnp.ones_like, dp.owned)
    >>> updates, state = tx.update(grads, state, dp.owned)
    >>> updates  # doctest: +ELLIPSIS
    OwnerBuffers(dmuon_...: float32[32])
    >>> int(state.count)
    1
  """
  hp = _owner_update.make_hyperparams(
    beta=beta,
    eps=eps,
    consistent_rms=consistent_rms,
    weight_decay=weight_decay,
  )
  if dedication.tensor_parallel_axis is not None and (
    preconditioning != 'frobenius'
  ):
    raise ValueError(
      f'dmuon: preconditioning={preconditioning!r} is not available with '
      f'the tensor-parallel axis {dedication.tensor_parallel_axis!r}: the '
      'TP Gram Newton-Schulz normalizes by the Frobenius norm. Use '
      "preconditioning='frobenius'."
    )
  cfg = _owner_update.make_config(
    ns_coeffs=ns_coeffs,
    ns_steps=ns_steps,
    momentum=momentum,
    nesterov=nesterov,
    adaptive=adaptive,
    preconditioning=preconditioning,
    ns_algorithm=dedication.ns_algorithm,
    compute_dtype=compute_dtype,
    shape_scaling=True,
    consistent_rms=consistent_rms is not None,
    mu_dtype=mu_dtype,
  )
  decay = _decayed_leaves(dedication, weight_decay, weight_decay_mask)

  return optax.GradientTransformation(
    functools.partial(_muon_init, cfg, dedication),
    functools.partial(_muon_update, cfg, hp, decay, dedication),
  )


def _muon_init(cfg, ded, owned):
  check_owned(ded.layout, owned, 'dedicated_muon init()')
  dtype = cfg.mu_dtype
  mu = [jnp.zeros_like(b, dtype=dtype) for b in owned.buffers]
  return DedicatedMuonState(
    count=jnp.zeros([], jnp.int32),
    mu=_owner_layout.OwnerBuffers(mu, owned.layout),
    stamp=_states.make_stamp(owned.layout),
  )


def _muon_update(cfg, hp, decay, ded, grads, state, params=None):
  layout = state.mu.layout
  check_owned(layout, grads, 'dedicated_muon update()')
  if decay is not None and params is None:
    raise ValueError(
      'dmuon: dedicated_muon with weight_decay needs the params: call '
      'update(grads, state, params).'
    )
  count_inc = optax.safe_increment(state.count)
  manual = _collectives.manual_axes()
  param_bufs = None if params is None else params.buffers
  if set(layout.buffer_axes) & manual or not layout.distributed:
    n = layout.num_slots if manual else 1
    g = tuple(x / n for x in grads.buffers) if n > 1 else grads.buffers
    ortho, mu = _owner_update.owner_step(
      cfg,
      hp,
      layout,
      g,
      state.mu.buffers,
      count_inc,
      params=param_bufs if decay else None,
      decay=decay,
    )
  else:
    specs = list(layout.buffer_specs())
    mesh = ded.mesh if ded.mesh is not None else layout.mesh
    dyn = _owner_update.dynamic(hp)

    def body(g, mus, ps, count_inc, dyn):
      out, mu = _owner_update.owner_step(
        cfg,
        _owner_update.with_dynamic(hp, dyn),
        layout,
        g,
        mus,
        count_inc,
        params=ps,
        decay=decay,
      )
      return list(out), list(mu)

    ortho, mu = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, specs, specs if decay else None, P(), P()),
      out_specs=(specs, specs),
    )(
      list(grads.buffers),
      list(state.mu.buffers),
      list(param_bufs) if decay else None,
      count_inc,
      dyn,
    )
  # optax.contrib.muon's dtype: the momentum's promoted with the gradient's.
  out = [
    o.astype(jnp.result_type(m.dtype, g.dtype))
    for o, m, g in zip(ortho, state.mu.buffers, grads.buffers)
  ]
  return (
    _owner_layout.OwnerBuffers(out, layout),
    DedicatedMuonState(
      count=count_inc,
      mu=_owner_layout.OwnerBuffers(mu, layout),
      stamp=state.stamp,
    ),
  )


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
    for x, spec, path in zip(
      _gather.full_leaves(updates, dedication.treedef),
      dedication.rest_specs,
      dedication.leaf_paths,
    ):
      if x is not None and tp_axis in _collectives.varying_axes(x):
        raise ValueError(
          f'dmuon: the gradient of {path!r} differs between the shards of '
          f'the tensor-parallel axis {tp_axis!r} (it is a partial sum '
          'there). Compute gradients with dmuon_jax.local_value_and_grad('
          f'loss, axis_names={dedication.buffer_axes}) so that autodiff '
          'sums TP-replicated params over the TP axis.'
        )
      if x is not None:
        summed = [a for e in _mesh.spec_entries(spec) for a in e]
        # Invariant over an axis of a step run whole inside shard_map
        # (dmuon_jax.flax.train_step): autodiff summed it there.
        summed += [
          a
          for a in sorted(_collectives.summed_axes())
          if a not in summed and a not in _collectives.varying_axes(x)
        ]
        if summed:
          x = x / np.prod([sizes[a] for a in summed])
        others = tuple(
          a
          for a in mesh.axis_names
          if a not in summed and a in _collectives.varying_axes(x)
        )
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
  weight_decay_mask: Any = None,
  mu_dtype: Any = None,
  *,
  nesterov: bool = True,
  adaptive: bool = False,
  preconditioning: str = 'frobenius',
  adam_b1: jax.typing.ArrayLike = 0.9,
  adam_b2: jax.typing.ArrayLike = 0.999,
  adam_eps_root: jax.typing.ArrayLike = 0.0,
  adam_weight_decay: jax.typing.ArrayLike = 0.0,
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  consistent_rms: jax.typing.ArrayLike | None = None,
  momentum: str = 'optax',
  compute_dtype: Any = None,
  nonfinite: str = 'skip',
) -> optax.GradientTransformation:
  """:func:`dmuon_jax.dmuon` for :class:`DedicatedParams`.

  Muon targets (``owned``) are updated on their owners by the same owner
  update as :func:`dmuon_jax.dmuon` (same arguments, same numbers) with no
  communication; the other params (``rest``) by AdamW on gradients averaged
  over devices, on the shards they are stored in. Use with
  :func:`dmuon_jax.local_value_and_grad` inside
  ``jax.shard_map(..., in_specs=dedication.specs() ...)``. The arguments of
  :func:`dmuon_jax.dmuon` that decide routing and placement
  (``predicate``, ``muon_weight_dimension_numbers``, ``mesh``,
  ``axis_names``, ``tensor_parallel_axis``, ``ns_algorithm``) are
  :func:`dedicate`'s.

  Args:
    dedication: the :class:`Dedication`.
    learning_rate: as for :func:`dmuon_jax.dmuon`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: as for :func:`dmuon_jax.dmuon`.
    eps: as for :func:`dmuon_jax.dmuon`.
    weight_decay: as for :func:`dmuon_jax.dmuon`.
    weight_decay_mask: as for :func:`dmuon_jax.dmuon` (over the plain
      params tree).
    mu_dtype: as for :func:`dmuon_jax.dmuon` (Muon momentum and AdamW's).
    nesterov: as for :func:`dmuon_jax.dmuon`.
    adaptive: as for :func:`dmuon_jax.dmuon`.
    preconditioning: as for :func:`dmuon_jax.dmuon`.
    adam_b1: as for :func:`dmuon_jax.dmuon`.
    adam_b2: as for :func:`dmuon_jax.dmuon`.
    adam_eps_root: as for :func:`dmuon_jax.dmuon`.
    adam_weight_decay: as for :func:`dmuon_jax.dmuon`.
    adam_learning_rate: as for :func:`dmuon_jax.dmuon`.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.
    momentum: as for :func:`dmuon_jax.dmuon`.
    compute_dtype: as for :func:`dmuon_jax.dmuon`.
    nonfinite: as for :func:`dmuon_jax.dmuon`: ``'skip'`` zeroes the
      updates and keeps the whole state when any gradient, update or new
      state entry is NaN/Inf on any device (the flag is reduced over the
      mesh axes); ``'propagate'`` lets them through.

  Returns:
    A ``optax.GradientTransformation`` on :class:`DedicatedParams`.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> opt = dmuon_jax.dedicated_muon(ded, learning_rate=0.02)
    >>> state = opt.init(dp)
    >>> grads = jax.tree.map(jnp.ones_like, dp)  # gradients in owner layout
    >>> updates, state = opt.update(grads, state, dp)

    The same numbers as :func:`dmuon_jax.dmuon` on the plain params:

    >>> ref = dmuon_jax.dmuon(learning_rate=0.02)
    >>> ones = jax.tree.map(jnp.ones_like, params)
    >>> ref_updates, _ = ref.update(ones, ref.init(params), params)
    >>> plain = ded.to_params(updates)
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, plain, ref_updates))
    True
  """
  _owner_update.check_nonfinite(nonfinite)
  _hyperparams.check_adam(
    learning_rate=learning_rate,
    adam_learning_rate=adam_learning_rate,
    adam_b1=adam_b1,
    adam_b2=adam_b2,
    adam_eps_root=adam_eps_root,
    adam_weight_decay=adam_weight_decay,
  )
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  muon = optax.chain(
    scale_by_dedicated_muon(
      dedication,
      ns_coeffs,
      ns_steps,
      beta,
      eps,
      mu_dtype,
      nesterov=nesterov,
      consistent_rms=consistent_rms,
      adaptive=adaptive,
      preconditioning=preconditioning,
      momentum=momentum,
      compute_dtype=compute_dtype,
      weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask,
    ),
    optax.scale_by_learning_rate(learning_rate),
  )
  adam = optax.chain(
    _mean_rest(dedication),
    optax.adamw(
      adam_learning_rate,
      b1=adam_b1,
      b2=adam_b2,
      eps=eps,
      eps_root=adam_eps_root,
      weight_decay=adam_weight_decay,
      mu_dtype=mu_dtype,
      nesterov=nesterov,
    ),
  )

  def init_fn(params):
    dedication.check_dedicated(params, 'dedicated_muon init()')
    state = (muon.init(params.owned), adam.init(params.rest))
    # On the mesh (the step counts too), eagerly as under jax.jit.
    return _mesh.replicate_uncommitted(state, dedication.mesh)

  def update_fn(updates, state, params=None):
    dedication.check_dedicated(updates, 'dedicated_muon update()')
    _checks.check_same_tree(
      updates.rest,
      optax.tree_utils.tree_get(state[1], 'mu'),
      'dedicated_muon update()',
      made_by='init()',
      shapes=True,
    )
    owned_u, muon_state = muon.update(
      updates.owned, state[0], None if params is None else params.owned
    )
    rest_u, adam_state = adam.update(
      updates.rest, state[1], None if params is None else params.rest
    )
    return (
      DedicatedParams(owned=owned_u, rest=rest_u),
      (muon_state, adam_state),
    )

  opt = optax.GradientTransformation(init_fn, update_fn)
  if nonfinite == 'skip':
    opt = _owner_update.skip_nonfinite(opt)
  return opt
