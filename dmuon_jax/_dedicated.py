"""Dedicated ownership: Muon targets stored on their owners (DMuon proper)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _boundaries
from dmuon_jax import _collectives
from dmuon_jax import _explicit
from dmuon_jax import _layout
from dmuon_jax import _newton_schulz
from dmuon_jax import _planner
from dmuon_jax import _transform


class DedicatedParams(NamedTuple):
  """Params with the Muon targets stored in owner layout.

  Attributes:
    owned: per hook boundary, one tuple of flat owner buffers (one per
      dtype). A loop boundary's buffer is ``(num_slots * local,)``; a scanned
      stack's is ``(num_layers, num_slots * local)``. Both are sharded over
      the owner axes so that a device's block holds exactly the matrices it
      owns.
    rest: the params tree with every Muon target replaced by None.
  """
  owned: tuple[tuple[jax.Array, ...], ...]
  rest: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Dedication:
  """Static description of a dedicated layout (build with :func:`dedicate`).

  Owner slots are numbered in buffer order: row-major over
  :attr:`buffer_axes` (the shard axes, then the replicate axis), so that a
  device's block of a gathered buffer is at its slot.

  Attributes:
    plan: the global owner plan (slots in mesh order, as
      :func:`dmuon_jax.plan_ownership`), for inspection.
    boundaries: the hook boundaries.
    layouts: one owner layout per boundary; for a scanned stack, the layout
      of one layer (layer ``l`` is the same layout rotated by ``l`` slots).
    num_layers: per boundary, the stack length (0 for a loop boundary).
    treedef: the params tree structure.
    mesh: the mesh.
    reshard_after_forward: Z3 (True) or Z2 (False), see :meth:`block`.
    buffer_axes: owner axes, major to minor in buffer order.
    replicate_axis: the HSDP replicate axis (gathered once, outside the
      Z3 re-gather), or None.
  """
  plan: _planner.OwnershipPlan
  boundaries: _boundaries.HookBoundaries
  layouts: tuple[_layout.Layout, ...]
  num_layers: tuple[int, ...]
  treedef: Any
  mesh: Any
  reshard_after_forward: bool
  buffer_axes: tuple[str, ...]
  replicate_axis: str | None
  _leaf_paths: tuple[str, ...]
  _boundary_keys: tuple[Any, ...]

  @property
  def num_slots(self) -> int:
    return self.layouts[0].num_slots if self.layouts else 1

  @property
  def _shard_axes(self) -> tuple[str, ...]:
    return tuple(a for a in self.buffer_axes if a != self.replicate_axis)

  def _spec(self, b: int) -> P:
    axes = self.buffer_axes or None
    return P(None, axes) if self.num_layers[b] else P(axes)

  def specs(self) -> DedicatedParams:
    """PartitionSpecs of a :class:`DedicatedParams` (for ``shard_map``)."""
    return DedicatedParams(
        owned=tuple(tuple(self._spec(b) for _ in lay.dtypes)
                    for b, lay in enumerate(self.layouts)),
        rest=P())

  @staticmethod
  def specs_of(tree: Any) -> Any:
    """PartitionSpecs of a tree of global arrays, e.g. the optimizer state.

    Leaves with a ``NamedSharding`` give its spec; any other leaf (a scalar
    step count, a single-device array) is replicated: ``P()``.
    """
    return jax.tree.map(
        lambda x: x.sharding.spec if isinstance(
            getattr(x, 'sharding', None), NamedSharding) else P(), tree)

  def _boundary_leaves(self, b: int) -> list[int]:
    return [s.leaf_index for s in self.layouts[b].plan.leaves]

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
      params: a params tree of global arrays (any sharding).

    Returns:
      The :class:`DedicatedParams`.
    """
    leaves = jax.tree.leaves(params)
    owned = []
    for b, lay in enumerate(self.layouts):
      targets = [leaves[i] for i in self._boundary_leaves(b)]
      if self.num_layers[b]:
        bufs = _pack_stack(self, lay, targets)
      else:
        bufs = jax.jit(lay.pack_full)(_replicated(self, targets))
      sharding = NamedSharding(self.mesh, self._spec(b))
      owned.append(tuple(jax.device_put(x, sharding) for x in bufs))
    targets = {s.leaf_index for s in self.plan.leaves}
    rest = jax.tree.unflatten(self.treedef, [
        None if i in targets else x for i, x in enumerate(leaves)])
    return DedicatedParams(owned=tuple(owned), rest=rest)

  def to_params(self, dedicated: DedicatedParams) -> Any:
    """The plain params tree (e.g. for export, evaluation, checkpoints).

    Args:
      dedicated: a :class:`DedicatedParams` of global arrays.

    Returns:
      The params tree, Muon targets as full (unsharded-layout) arrays.
    """
    leaves = _full_leaves(dedicated.rest, self.treedef)
    for b, lay in enumerate(self.layouts):
      if self.num_layers[b]:
        full = _unpack_stack(self, lay, dedicated.owned[b])
      else:
        full = jax.jit(lay.unpack_full)(
            _replicated(self, dedicated.owned[b]))
      for i, x in zip(self._boundary_leaves(b), full):
        leaves[i] = x
    return jax.tree.unflatten(self.treedef, leaves)

  # -- inside shard_map ------------------------------------------------------

  def _gather_replicate(self, local: Sequence[jax.Array]) -> list[jax.Array]:
    if self.replicate_axis is None:
      return list(local)
    return [jax.lax.all_gather(x, self.replicate_axis, tiled=True)
            for x in local]

  def _gather_shard(self, local: Sequence[jax.Array]) -> list[jax.Array]:
    if not self._shard_axes:
      return list(local)
    return [jax.lax.all_gather(x, self._shard_axes, tiled=True)
            for x in local]

  def _materialize(self, b: int, rep_local, layer=None) -> dict[int, Any]:
    """Leaf index -> full target, from replicate-gathered local buffers."""
    full = self._gather_shard(rep_local)
    if layer is not None:
      full = [self._roll(x, -layer) for x in full]
    return dict(zip(self._boundary_leaves(b),
                    self.layouts[b].unpack_full(full)))

  def _subtree(self, b: int, leaves: list[Any]) -> Any:
    tree = jax.tree.unflatten(self.treedef, leaves)
    return _boundaries._subtree(tree, self._boundary_keys[b])  # pylint: disable=protected-access

  def params(self, dedicated: DedicatedParams) -> Any:
    """The full params tree inside ``shard_map``: every boundary gathered.

    Handy for evaluation; in a train step use :meth:`block` / :meth:`scan`,
    which gather one boundary at a time and control Z2/Z3.

    Args:
      dedicated: the local view of :class:`DedicatedParams`.

    Returns:
      The params tree.
    """
    leaves = _full_leaves(dedicated.rest, self.treedef)
    for b in range(len(self.layouts)):
      rep = self._gather_replicate(dedicated.owned[b])
      if self.num_layers[b]:
        mats = jax.lax.map(
            lambda a: list(self._materialize(b, a[1], a[0]).values()),
            (jnp.arange(self.num_layers[b]), rep))
        got = dict(zip(self._boundary_leaves(b), mats))
      else:
        got = self._materialize(b, rep)
      for i, x in got.items():
        leaves[i] = x
    return jax.tree.unflatten(self.treedef, leaves)

  def _z3(self, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run(rep_local, *rest)`` that gathers again in the backward pass.

    ``jax.checkpoint`` expresses the same, but XLA:CPU drops its
    optimization barriers and merges the two identical all-gathers, which
    silently turns Z3 into Z2. Tying the backward gather to the cotangent
    makes it a different value that XLA must compute after the forward. The
    tie is 0 for a finite cotangent; a non-finite one poisons the block's
    gradients, which it would do anyway.
    """
    @jax.custom_vjp
    def z3(rep_local, *args):
      return run(rep_local, *args)

    def z3_fwd(rep_local, *args):
      return run(rep_local, *args), (rep_local, args)

    def z3_bwd(res, ct):
      rep_local, args = res
      tie = sum(jnp.sum(c) for c in jax.tree.leaves(ct)) * 0
      rep_local = [x + tie.astype(x.dtype) for x in rep_local]
      _, vjp = jax.vjp(run, rep_local, *args)
      return vjp(ct)

    z3.defvjp(z3_fwd, z3_bwd)
    return z3

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
    """
    b = self._boundary(boundary, scanned=False)
    sub = self._subtree_leaves(b)

    def run(rep_local, sub_rest, *args):
      leaves = [None] * len(self._leaf_paths)
      for i, x in zip(sub, sub_rest):
        leaves[i] = x
      for i, x in self._materialize(b, rep_local).items():
        leaves[i] = x
      return fn(self._subtree(b, leaves), *args)

    inner = self._z3(run) if self.reshard_after_forward else run

    def call(dedicated, *args):
      rest = _full_leaves(dedicated.rest, self.treedef)
      rep = self._gather_replicate(dedicated.owned[b])
      return inner(rep, [rest[i] for i in sub], *args)

    return call

  def scan(self, fn: Callable[[Any, Any], Any], boundary: str
           ) -> Callable[[DedicatedParams, Any], Any]:
    """Runs a scanned stack of blocks, gathering one layer per iteration.

    The stacked params of ``boundary`` (leading layer axis) are sliced per
    layer inside a :func:`jax.lax.scan`; each iteration all-gathers that
    layer's matrices from their owners (owners rotate by one slot per
    layer). Z2/Z3 as for :meth:`block`.

    Args:
      fn: ``(layer_params, carry) -> carry``; ``layer_params`` is the
        boundary's params subtree sliced at one layer.
      boundary: the name of a scanned boundary.

    Returns:
      ``(dedicated, carry) -> carry``, to call inside ``shard_map``.
    """
    b = self._boundary(boundary, scanned=True)
    sub = self._subtree_leaves(b)

    def run(rep_local, layer, sub_rest, carry):
      leaves = [None] * len(self._leaf_paths)
      for i, x in zip(sub, sub_rest):
        leaves[i] = x
      for i, x in self._materialize(b, rep_local, layer).items():
        leaves[i] = x
      return fn(self._subtree(b, leaves), carry)

    if self.reshard_after_forward:
      z3 = self._z3(lambda rep, sub_rest, carry, layer: run(
          rep, layer, sub_rest, carry))
      inner = lambda rep, layer, sub_rest, carry: z3(rep, sub_rest, carry,
                                                     layer)
    else:
      inner = run

    def call(dedicated, carry):
      rest = _full_leaves(dedicated.rest, self.treedef)

      def body(carry, xs):
        layer, owned_l, sub_l = xs
        rep = self._gather_replicate(owned_l)
        return inner(rep, layer, sub_l, carry), None

      xs = (jnp.arange(self.num_layers[b]), list(dedicated.owned[b]),
            [rest[i] for i in sub])
      return jax.lax.scan(body, carry, xs)[0]

    return call

  def _boundary(self, boundary: str, scanned: bool) -> int:
    if boundary not in self.boundaries.names:
      raise ValueError(
          f'dmuon: no hook boundary {boundary!r}; the boundaries are '
          f'{list(self.boundaries.names)}.')
    b = self.boundaries.names.index(boundary)
    if bool(self.num_layers[b]) != scanned:
      raise ValueError(
          f'dmuon: boundary {boundary!r} is '
          f'{"a scanned stack" if self.num_layers[b] else "not scanned"}; '
          f'use Dedication.{"scan" if self.num_layers[b] else "block"}.')
    return b

  # -- inspection ------------------------------------------------------------

  def gather_bytes(self) -> tuple[int, int]:
    """``(payload, gathered)`` bytes of one full materialization.

    ``payload`` is the Muon targets' bytes; ``gathered`` what the packed
    owner buffers hold (each boundary pads every owner's share to the
    largest one in it).
    """
    payload = gathered = 0
    for b, lay in enumerate(self.layouts):
      layers = self.num_layers[b] or 1
      for g, d in enumerate(lay.dtypes):
        item = np.dtype(d).itemsize
        payload += layers * int(lay.slot_used[g].sum()) * item
        gathered += layers * lay.num_slots * lay.local_sizes[g] * item
    return payload, gathered

  def summary(self) -> str:
    """Boundaries, padding of the packed owner buffers, predicted bytes."""
    n = self.num_slots
    payload, gathered = self.gather_bytes()
    lines = [f'Dedicated ownership on {n} slots '
             f'({"Z3" if self.reshard_after_forward else "Z2"}), buffer axes '
             f'{self.buffer_axes}' + (f', replicate axis '
                                      f'{self.replicate_axis!r}'
                                      if self.replicate_axis else '')]
    for b, name in enumerate(self.boundaries.names):
      lay = self.layouts[b]
      used = sum(int(lay.slot_used[g].sum()) for g in range(lay.num_groups))
      held = sum(n * s for s in lay.local_sizes)
      kind = (f'scanned x{self.num_layers[b]}' if self.num_layers[b]
              else 'block')
      lines.append(f'  {name or "<root>"} ({kind}): {len(lay.plan.units)} '
                   f'matrices/layer, padding {100 * (held / max(used, 1) - 1):.1f}%')
    lines.append(f'  Muon params {_planner._human_bytes(payload)}, gathered '  # pylint: disable=protected-access
                 f'{_planner._human_bytes(gathered)} '  # pylint: disable=protected-access
                 f'(padding {100 * (gathered / max(payload, 1) - 1):.1f}%)')
    return '\n'.join(lines + [self.plan.summary()])


def _full_leaves(rest: Any, treedef) -> list[Any]:
  """Leaves of ``rest`` with None placeholders kept (one per param)."""
  return treedef.flatten_up_to(rest)


def _replicated(ded: Dedication, xs):
  """``xs`` on every device (conversions index across the owner axes)."""
  if ded.mesh is None:
    return list(xs)
  return [jax.device_put(x, NamedSharding(ded.mesh, P())) for x in xs]


def _pack_stack(ded: Dedication, lay: _layout.Layout, targets):
  """(L, ...) targets -> per dtype (L, num_slots * local), rotated by layer."""
  targets = _replicated(ded, targets)

  def one(layer, xs):
    return tuple(ded._roll(x, layer) for x in lay.pack_full(xs))  # pylint: disable=protected-access
  return jax.jit(jax.vmap(one))(jnp.arange(targets[0].shape[0]), targets)


def _unpack_stack(ded: Dedication, lay: _layout.Layout, bufs):
  bufs = _replicated(ded, bufs)

  def one(layer, bs):
    return lay.unpack_full([ded._roll(x, -layer) for x in bs])  # pylint: disable=protected-access
  return jax.jit(jax.vmap(one))(jnp.arange(bufs[0].shape[0]), list(bufs))


def _layer_spec(spec: _planner.LeafSpec) -> _planner.LeafSpec:
  """The spec of one layer of a stacked leaf (leading axis removed)."""
  down = lambda axes: tuple(a - 1 for a in axes if a != 0)
  return dataclasses.replace(
      spec, shape=spec.shape[1:], batch_axes=down(spec.batch_axes),
      reduction_axes=down(spec.reduction_axes),
      output_axes=down(spec.output_axes))


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
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  coords = dict(zip(buffer_axes, np.unravel_index(
      slot, [sizes[a] for a in buffer_axes]))) if buffer_axes else {}
  return int(np.ravel_multi_index(
      [int(coords.get(a, 0)) for a in plan.axis_names], plan.mesh_shape)
             ) if plan.axis_names else 0


def dedicate(
    params: Any,
    mesh: jax.sharding.Mesh | None,
    *,
    predicate: Callable[[str, Any], bool] | None = None,
    weight_dimension_numbers: Any = None,
    boundary_predicate: _boundaries.BoundaryPredicate | None = None,
    strict: bool = True,
    reshard_after_forward: bool = True,
    axis_names: Sequence[str] | None = None,
    replicate_axis: str | None = 'replicate',
) -> Dedication:
  """Plans dedicated ownership: each Muon matrix stored only on its owner.

  Matrices are assigned to owners boundary by boundary: within a hook
  boundary (see :func:`dmuon_jax.find_hook_boundaries`), largest first, to
  the owner holding the fewest bytes of that boundary (ties: the least
  Newton–Schulz work so far), so that the packed per-boundary gather pads
  little while the NS work stays balanced over the whole model. A scanned
  stack is planned for one layer; layer ``l`` rotates those owners by ``l``
  slots, which spreads every matrix of the layer over all devices.

  On an HSDP mesh, owners are global ``(replicate, shard)`` slots: a
  boundary is gathered over ``replicate`` and then over the shard axes, so
  that Z3's backward re-gather stays inside the shard group, and gradients
  are reduce-scattered over the shard axes, then over ``replicate``.

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
    axis_names: the owner axes (default: all mesh axes).
    replicate_axis: the HSDP replicate axis name, if the mesh has it.

  Returns:
    A :class:`Dedication`; move params with ``to_dedicated``.

  Raises:
    ValueError: for targets without a boundary (strict mode) or a scanned
      stack whose leaves do not share a leading layer axis.
  """
  bounds = _boundaries.find_hook_boundaries(
      params, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers,
      boundary_predicate=boundary_predicate, strict=strict)
  plan = _planner.plan_ownership(
      params, mesh, axis_names=axis_names, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers)
  buffer_axes, rep_axis = _buffer_axes(plan, replicate_axis)
  n = plan.num_slots
  leaves = jax.tree.leaves(params)
  path_boundary = dict(zip(bounds.paths, bounds.of_target))
  unit_ids = {(u.leaf_index, u.batch_index): k
              for k, u in enumerate(plan.units)}
  owners = [0] * len(plan.units)
  work = np.zeros(n)
  layouts, num_layers = [], []
  for b, name in enumerate(bounds.names):
    specs = [s for s in plan.leaves if path_boundary[s.path] == b]
    layers = 0
    if bounds.scanned[b]:
      layers = specs[0].shape[0]
      bad = [s.path for s in specs
             if 0 not in s.batch_axes or s.shape[0] != layers]
      if bad:
        raise ValueError(
            f'dmuon: scanned stack {name!r} needs every Muon target to have '
            f'the same leading layer axis (a batch axis of its dimension '
            f'numbers) of size {layers}; these do not: {bad}.')
      specs = [_layer_spec(s) for s in specs]
    base = [dataclasses.replace(u, batch_index=u.batch_index[1:])
            if layers else u
            for u in plan.units
            if path_boundary.get(u.path) == b
            and (not layers or u.batch_index[0] == 0)]
    held = np.zeros(n)
    base_owner = [0] * len(base)
    # LPT by bytes inside the boundary (largest first, to the owner holding
    # the fewest bytes of it; ties by NS work so far, then slot index).
    for k in sorted(range(len(base)),
                    key=lambda k: (-base[k].nbytes, -base[k].cost, k)):
      u = base[k]
      slot = min(range(n), key=lambda s: (held[s], work[s], s))
      held[slot] += u.nbytes
      base_owner[k] = slot
      for layer in range(max(layers, 1)):
        key = (u.leaf_index,
               ((layer,) + u.batch_index) if layers else u.batch_index)
        owner = (slot + layer) % n
        work[owner] += u.cost
        owners[unit_ids[key]] = _to_plan_slot(plan, buffer_axes, owner)
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    sub = dataclasses.replace(
        plan, axis_names=buffer_axes,
        mesh_shape=tuple(sizes[a] for a in buffer_axes),
        leaves=tuple(specs), units=tuple(base), owners=tuple(base_owner))
    layouts.append(_layout.Layout(
        sub, [leaves[s.leaf_index].dtype for s in specs]))
    num_layers.append(layers)
  plan = dataclasses.replace(plan, owners=tuple(owners))
  flat = jax.tree.flatten_with_path(params)[0]
  leaf_paths = tuple(_planner.normalize_path(k) for k, _ in flat)
  boundary_keys = []
  for name in bounds.names:
    depth = len([s for s in name.split('/') if s])
    for keys, _ in flat:
      path = _planner.normalize_path(keys)
      if not name or path.startswith(name + '/'):
        boundary_keys.append(tuple(keys[:depth]))
        break
  return Dedication(plan=plan, boundaries=bounds, layouts=tuple(layouts),
                    num_layers=tuple(num_layers),
                    treedef=jax.tree.structure(params), mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    buffer_axes=buffer_axes, replicate_axis=rep_axis,
                    _leaf_paths=leaf_paths,
                    _boundary_keys=tuple(boundary_keys))


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

  def ortho(stack):
    out = _newton_schulz.orthogonalize_via_newton_schulz(
        stack, coeffs, eps=eps)
    scale = _transform.shape_scale(*stack.shape[-2:], consistent_rms)
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
      if dedication.num_layers[b]:
        # Layer l holds base slot (slot - l) mod n of the layer layout.
        res = jax.lax.map(
            lambda a, lay=lay: orthogonalize(lay, a[1], shift=a[0]),
            (jnp.arange(dedication.num_layers[b]), hat))
      else:
        res = orthogonalize(lay, hat)
      out.append(tuple(res))
      mus.append(tuple(m.astype(x.dtype) for m, x in zip(mu, state.mu[b])))
    return tuple(out), DedicatedMuonState(count=count_inc, mu=tuple(mus))

  return optax.GradientTransformation(init_fn, update_fn)


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
) -> optax.GradientTransformation:
  """:func:`dmuon_jax.dmuon` for :class:`DedicatedParams`, in ``shard_map``.

  Muon targets (``owned``) are updated on their owners with no
  communication; the other params (``rest``) by AdamW on gradients averaged
  over devices (``pmean``). Use with :func:`dmuon_jax.local_value_and_grad`
  inside ``jax.shard_map(..., in_specs=dedication.specs() ...)``.

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

  Returns:
    A :class:`optax.GradientTransformation` on :class:`DedicatedParams`.
  """
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  muon = optax.chain(
      scale_by_dedicated_muon(dedication, ns_coeffs, ns_steps, beta, eps,
                              mu_dtype, nesterov=nesterov,
                              consistent_rms=consistent_rms),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))
  adam = optax.chain(
      _explicit.mean_over_devices(),
      optax.adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                  weight_decay=adam_weight_decay, nesterov=nesterov))

  def init_fn(params):
    return (muon.init(params.owned), adam.init(params.rest))

  def update_fn(updates, state, params=None):
    owned_u, muon_state = muon.update(
        updates.owned, state[0], None if params is None else params.owned)
    rest_u, adam_state = adam.update(
        updates.rest, state[1], None if params is None else params.rest)
    return (DedicatedParams(owned=owned_u, rest=rest_u),
            (muon_state, adam_state))

  return optax.GradientTransformation(init_fn, update_fn)
