"""The dedicated layout: :class:`Dedication`, its owner buffers and the Muon
on them (:func:`scale_by_dedicated_muon`)."""

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
  _checks,
  _exchange,
  _gather,
  _layout,
  _mesh,
  _owner_layout,
  _owner_update,
  _plan,
  _routing,
  _transform,
)


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
  Dedications compare equal (and hash) by value: two dedications of the
  same params on the same mesh with the same options are one static value
  (e.g. in a ``TrainState`` traced by ``jax.eval_shape`` and by
  ``jax.jit``).

  Attributes:
    plan: the global owner plan (slots in mesh order, as
      :func:`dmuon_jax.plan_ownership`), for inspection.
    boundaries: the hook boundaries.
    groups: the boundary indices of each gather group.
    layout: the :class:`dmuon_jax.OwnerLayout` of the owned buffers (and of
      the momentum of :func:`dedicated_muon`, which keeps only what each
      slot holds of a scanned stack's iterations:
      ``layout.momentum_segments``).
    layers_per_gather: boundaries (or scanned layers) per gather.
    layers_per_gather_choice: how it was chosen: ``'given'`` (an int
      passed to :func:`dedicate`), ``'auto'`` (the least bytes moved and
      held, padding at most 5%), ``'auto, padding above 5%'`` (the least
      bytes moved and held, padding above 5%) or, from
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
  boundaries: _checks.HookBoundaries
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

  # Equal by value: a trainer's init traced twice (``jax.eval_shape``, then
  # ``jax.jit`` in another context: Flax lm1b's and MaxText's
  # ``setup_initial_state``) dedicates twice, and the two results must be
  # one static value where they end up in a pytree's metadata (a
  # ``TrainState``'s ``apply_fn`` and ``tx`` hold them).
  @functools.cached_property
  def _key(self) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(self.abstract_params)
    fields = tuple(
      getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name != 'abstract_params'
    )
    return (*fields, treedef, tuple(leaves))

  @functools.cached_property
  def _hash(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if not isinstance(other, Dedication):
      return NotImplemented
    return self._hash == other._hash and self._key == other._key

  def __hash__(self) -> int:
    return self._hash

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
  def reduced_axes(self) -> tuple[str, ...]:
    """The owner axes of more than one device: the axes a dedicated
    model's input must be split over (on its batch dimensions) under plain
    ``jit`` for the gathered weights to be typed ``reduced`` (their
    gradients ``unreduced``). The weights are typed ``reduced`` over these
    and any axis of size 1 that the input's type spells there (jax compares
    the weight gradient's contraction axes as spelled). By default every
    owner axis has more than one device; an owner axis of size 1 (named in
    ``axis_names``) that the input does not spell is left out."""
    sizes = dict(zip(self.layout.buffer_axes, self.layout.buffer_sizes))
    return tuple(a for a in self.buffer_axes if sizes.get(a, 1) > 1)

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

    Leaves with a ``NamedSharding`` (arrays, ``jax.ShapeDtypeStruct``s with
    one, or the shardings themselves, e.g. a compiled ``init``'s
    ``output_shardings``) give its spec; any other array (a scalar step
    count, a single-device array) is replicated: ``P()``.

    Raises:
      ValueError: for an abstract leaf of one or more dimensions without a
        sharding (e.g. from ``jax.eval_shape``): its spec cannot be told
        (replicated would be wrong for a sharded AdamW moment).
    """

    def one(path, x):
      if isinstance(x, NamedSharding):
        return x.spec
      sharding = getattr(x, 'sharding', None)
      if isinstance(sharding, NamedSharding):
        return sharding.spec
      if (
        sharding is None and np.ndim(x) and isinstance(x, jax.ShapeDtypeStruct)
      ):
        raise ValueError(
          f'dmuon: Dedication.specs_of: the leaf '
          f'{_routing.normalize_path(path)!r} of shape {tuple(x.shape)} is '
          'abstract with no sharding (as jax.eval_shape returns it), so its '
          'spec is unknown. Pass the state init() made, or its shardings '
          '(jax.jit(opt.init, out_shardings=...) or abstract leaves with '
          'sharding=...).'
        )
      return P()

    return jax.tree_util.tree_map_with_path(
      one, tree, is_leaf=lambda x: isinstance(x, NamedSharding)
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
    return _exchange.all_params(self, dedicated)

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
    return _exchange.block(self, fn, boundary)

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
    return _exchange.sequential(self, fn, boundaries)

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
    return _exchange.scan(self, fn, boundary)

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
    owned = self.layout.pack(
      {t.index: leaves[t.index] for t in self.layout.leaves}, mesh=self.mesh
    )
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
    return _gather_totals(self)[:2]

  def exchange_bytes(self) -> float:
    """Predicted bytes per device per step of the owner groups' Gram
    exchange (0 without owner groups).

    Each gather group's split matrices (see :func:`dmuon_jax.dedicate`'s
    ``owner_groups``) are orthogonalized by one staged update: per restart
    window a reduce-scatter of float32 Grams and an all-gather of the
    factors over the group axis (``group_exchange_bytes`` of the plan).

    Returns:
      The byte count.
    """
    return _gather_totals(self).exchange

  def summary(self) -> str:
    """The hook boundaries (and how each was found: see
    :func:`dmuon_jax.find_hook_boundaries`), the gather groups, their
    padding, and the owner plan's summary."""
    total = _gather_totals(self)
    mode = 'Z3' if self.reshard_after_forward else 'Z2'
    choice, rep = self.layers_per_gather_choice, self.replicate_axis
    if choice == 'auto':
      choice += f': padding <= {AUTO_PADDING_PERCENT:g}%'
    lines = [
      f'Dedicated ownership ({mode}) on {self.num_slots} slots, '
      f'buffer axes {self.buffer_axes}'
      + (f', replicate axis {rep!r}' if rep else '')
      + f', {self.layers_per_gather} layer(s) per gather ({choice}), '
      f'layout {self.layout.name}'
    ]
    if self.boundaries.names:
      lines.append(f'  hook boundaries: {self.boundaries.chosen()}')
    for g, lay in enumerate(self.layout.groups):
      got = lay.plan.gather_bytes()
      names = ', '.join(
        self.boundaries.names[b] or '<root>' for b in self.groups[g]
      )
      iters = self.layout.iterations[g]
      times = f' x {iters} iterations' if iters else ''
      split = len(lay.plan.groups)
      slices = sum(len(x.units) for x in lay.plan.groups)
      what = f'{len(lay.plan.units) - slices + split} matrices' + (
        f' ({split} split into {slices} slices)' if split else ''
      )
      lines.append(
        f'  gather {g}: {names}{times}: {what}, '
        f'{_checks.human_bytes(got.payload)} gathered as '
        f'{_checks.human_bytes(got.gathered)} (padding {got.padding:.1f}%)'
      )
      if (seg := self.layout.momentum_segments[g]) is not None:
        held = sum(
          w * jnp.dtype(d).itemsize for w, d in zip(seg.widths, lay.dtypes)
        )
        lines.append(
          f'    momentum per device: {_checks.human_bytes(held)}, what its '
          'slot holds of each iteration (the owned buffer: '
          f'{_checks.human_bytes(iters * got.gathered / lay.num_slots)})'
        )
    lines.append(
      f'  total: Muon params {_checks.human_bytes(total.payload)}, '
      f'gathered {_checks.human_bytes(total.gathered)} '
      f'(padding {total.padding:.1f}%)'
    )
    if total.exchange:
      lines.append(
        f'  owner groups exchange per device per step: '
        f'{_checks.human_bytes(total.exchange)} (float32 Grams and factors, one '
        'reduce-scatter and one all-gather per restart window in each gather '
        "group's update)"
      )
    if not self.plan.units:
      lines.append(
        '  no Muon targets: every param is an AdamW param (kept in rest)'
      )
    # The plan's own exchange line counts every group in one update; the
    # dedicated update runs one per gather group (the line above).
    plan_lines = [
      line
      for line in self.plan.summary().splitlines()
      if not line.startswith('  owner groups exchange per device per step')
    ]
    return '\n'.join(lines + plan_lines)


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
  local = list(layout.local_shapes())
  # One owner's block with the TP axis left automatic (every TP shard's
  # slices: dmuon_jax.flax.train_step's manual owner axes).
  owner = [s[:-1] + (s[-1] * layout.tp_size,) for s in local]
  if shapes not in (glob, local, owner):
    raise ValueError(
      f'dmuon: {what} got owner buffers of shapes {shapes}, but layout '
      f'{layout.name} has {glob} (global): the buffers were changed '
      'outside dmuon. Call dedicate and to_dedicated again.'
    )


def to_params(dedicated: DedicatedParams) -> Any:
  """The plain params tree of :class:`DedicatedParams` (from its layout)."""
  leaves, treedef = jax.tree_util.tree_flatten(
    dedicated.rest, is_leaf=lambda x: x is None
  )
  owned = dedicated.owned
  for i, x in owned.layout.unpack(owned.buffers).items():
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


AUTO_PADDING_PERCENT = 5.0


def _gather_totals(ded: Dedication) -> _plan.GatherBytes:
  """All gather groups' bytes, as their plans predict them."""
  return _plan.GatherBytes.total(
    [
      lay.plan.gather_bytes(it)
      for lay, it in zip(ded.layout.groups, ded.layout.iterations)
    ]
  )


class DedicatedMuonState(NamedTuple):
  """State of :func:`scale_by_dedicated_muon`.

  Attributes:
    count: the step count.
    mu: the momentum, laid out like ``DedicatedParams.owned`` (the same
      :class:`dmuon_jax.OwnerLayout`), except that a scanned stack's whose
      iterations pad keeps only what each owner slot holds of each
      iteration, in one row (``OwnerLayout.momentum_segments``).
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
  stamp: _owner_update.LayoutStamp


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
  cfg, hp = _transform.owner_config(
    dict(locals(), ns_algorithm=dedication.ns_algorithm), shape_scaling=True
  )
  _checks.check_preconditioning(
    preconditioning,
    tp_axis=dedication.tensor_parallel_axis,
    groups=len(dedication.plan.groups),
    otherwise=(
      'dedicate(..., owner_groups=None) to keep every matrix whole'
      if dedication.plan.groups and dedication.tensor_parallel_axis is None
      else ''
    ),
  )
  # The leaf indices of the Muon targets that decay (None: no decay;
  # make_hyperparams has rejected a bool weight_decay).
  decay, mask = None, weight_decay_mask
  if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
    mask = mask(dedication.abstract_params) if callable(mask) else mask
    flags = dedication.treedef.flatten_up_to(mask) if mask is not None else None
    indices = [t.index for t in dedication.layout.leaves]
    bad = [
      dedication.leaf_paths[i]
      for i in indices
      if flags is not None and not isinstance(flags[i], (bool, np.bool_))
    ]
    if bad:
      raise ValueError(
        f'dmuon: weight_decay_mask has non-boolean entries at {bad}; give a '
        'tree like the params (or a callable params -> tree) of True/False, '
        'as for optax.add_decayed_weights.'
      )
    decay = frozenset(i for i in indices if flags is None or flags[i])

  return optax.GradientTransformation(
    functools.partial(_muon_init, cfg, dedication),
    functools.partial(_muon_update, cfg, hp, decay, dedication),
  )


def _muon_init(cfg, ded, owned):
  check_owned(ded.layout, owned, 'dedicated_muon init()')
  layout = owned.layout
  # (A scanned stack's momentum keeps only what each slot holds of its
  # iterations: layout.momentum_segments.)
  mu = [
    jnp.zeros_like(b, dtype=cfg.mu_dtype)
    if layout.momentum_shape(i, b.shape) == b.shape
    else jnp.zeros(layout.momentum_shape(i, b.shape), cfg.mu_dtype or b.dtype)
    for i, b in enumerate(owned.buffers)
  ]
  # (A layout held by several devices has the dedication's mesh.)
  if layout.distributed and not set(layout.buffer_axes) & _gather.manual_axes():
    # Under jax.jit on Auto axes zeros_like keeps no sharding: the momentum
    # placed as its layout says, as eagerly.
    specs = layout.buffer_specs()
    mu = [_mesh.place(m, ded.mesh, s) for m, s in zip(mu, specs)]
  return DedicatedMuonState(
    count=jnp.zeros([], jnp.int32),
    # Boxed as the owned buffers are (Flax's sharding tools read the boxes).
    mu=owned.rebox(mu),
    stamp=_owner_update.make_stamp(owned.layout),
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
  manual = _gather.manual_axes()
  param_bufs = None if params is None or not decay else list(params.buffers)
  dyn = _owner_update.dynamic(hp)

  def body(g, mus, ps, count_inc, dyn):
    out, mu = _owner_update.owner_step(
      cfg,
      hp._replace(**dyn),
      layout,
      g,
      mus,
      count_inc,
      params=ps,
      decay=decay,
    )
    return list(out), list(mu)

  g = list(grads.buffers)
  if set(layout.buffer_axes) & manual or not layout.distributed:
    # The local blocks (inside shard_map, or one device).
    n = layout.num_slots if manual else 1
    g = [x / n for x in g] if n > 1 else g
    keep = layout.buffer_axes + (layout.tp_axis,)
    g = [_gather.invariant_over_size_one(x, keep) for x in g]
    specs = _gather.buffer_tp_specs(ded, g)
    # With the TP axis automatic (dmuon_jax.flax.train_step), each TP
    # shard's slices in a shard_map over it: the Gram all-reduces need it.
    wrap = functools.partial(_gather.on_tp_shards, ded)
  else:  # global arrays (plain jit): a shard_map over the whole mesh
    specs = list(layout.buffer_specs())
    wrap = lambda fn, i, o: jax.shard_map(
      fn, mesh=ded.mesh, in_specs=i, out_specs=o
    )
  run = wrap(
    body,
    (specs, specs, specs if decay else None, P(), P()),
    (specs, specs),
  )
  ortho, mu = run(g, list(state.mu.buffers), param_bufs, count_inc, dyn)
  dtypes = [m.dtype for m in state.mu.buffers]
  out, state = _transform.finish(state, count_inc, mu, ortho, g, dtypes)
  return grads.rebox(out), state
