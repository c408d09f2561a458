"""Dedicated ownership: Muon targets stored on their owners (DMuon proper)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
    owned: one tuple of flat buffers (one per dtype) per hook boundary, each
      ``(num_slots * local,)`` and sharded over the owner axes: a device's
      block holds exactly the matrices of that boundary it owns.
    rest: the params tree with every Muon target replaced by None.
  """
  owned: tuple[tuple[jax.Array, ...], ...]
  rest: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Dedication:
  """Static description of a dedicated layout (build with :func:`dedicate`).

  Attributes:
    plan: the global owner plan.
    boundaries: the hook boundaries.
    layouts: one owner layout per boundary (the boundary's matrices only).
    treedef: the params tree structure.
    mesh: the mesh.
    reshard_after_forward: Z3 (True) or Z2 (False), see :meth:`block`.
  """
  plan: _planner.OwnershipPlan
  boundaries: _boundaries.HookBoundaries
  layouts: tuple[_layout.Layout, ...]
  treedef: Any
  mesh: Any
  reshard_after_forward: bool

  @property
  def axes(self) -> tuple[str, ...]:
    return self.plan.axis_names

  def specs(self) -> DedicatedParams:
    """PartitionSpecs of a :class:`DedicatedParams` (for ``shard_map``)."""
    return DedicatedParams(
        owned=tuple(tuple(P(self.axes) for _ in lay.dtypes)
                    for lay in self.layouts),
        rest=P())

  def _boundary_leaves(self, b: int) -> list[int]:
    return [s.leaf_index for s in self.layouts[b].plan.leaves]

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
      bufs = lay.pack_full([leaves[i] for i in self._boundary_leaves(b)])
      if self.plan.num_slots > 1:
        sharding = NamedSharding(self.mesh, P(self.axes))
        bufs = tuple(jax.device_put(x, sharding) for x in bufs)
      owned.append(tuple(bufs))
    targets = {s.leaf_index for s in self.plan.leaves}
    rest = jax.tree.unflatten(self.treedef, [
        None if i in targets else x for i, x in enumerate(leaves)])
    return DedicatedParams(owned=tuple(owned), rest=rest)

  def to_params(self, dedicated: DedicatedParams) -> Any:
    """The plain params tree (e.g. for export, evaluation, checkpoints)."""
    leaves = _full_leaves(dedicated.rest, self.treedef)
    for b, lay in enumerate(self.layouts):
      for i, x in zip(self._boundary_leaves(b),
                      lay.unpack_full(dedicated.owned[b])):
        leaves[i] = x
    return jax.tree.unflatten(self.treedef, leaves)

  def gather(self, owned_local: Sequence[jax.Array], b: int
             ) -> dict[int, jax.Array]:
    """Materializes boundary ``b`` inside ``shard_map`` (owner broadcast).

    One all-gather over the owner axes; under :func:`jax.grad` its transpose
    is the reduce-scatter of the gradients to the owners.

    Args:
      owned_local: this device's blocks of the boundary's buffers.
      b: the boundary index.

    Returns:
      A dict from leaf index to the full leaf.
    """
    lay = self.layouts[b]
    if self.plan.num_slots > 1:
      full = [jax.lax.all_gather(x, self.axes, tiled=True)
              for x in owned_local]
    else:
      full = list(owned_local)
    return dict(zip(self._boundary_leaves(b), lay.unpack_full(full)))

  def params(self, dedicated: DedicatedParams) -> Any:
    """The full params tree inside ``shard_map``: every boundary gathered.

    Each boundary is its own all-gather, so XLA can place it next to its
    use; wrap per-block computations with :meth:`block` to control the
    lifetime of the gathered weights (Z2/Z3).

    Args:
      dedicated: the local view of :class:`DedicatedParams`.

    Returns:
      The params tree.
    """
    leaves = _full_leaves(dedicated.rest, self.treedef)
    for b in range(len(self.layouts)):
      for i, x in self.gather(dedicated.owned[b], b).items():
        leaves[i] = x
    return jax.tree.unflatten(self.treedef, leaves)

  def block(self, fn: Callable[..., Any], boundary: str
            ) -> Callable[..., Any]:
    """Wraps one block so its weights are gathered inside it.

    ``fn(params, *args)`` receives the params tree with the boundary's
    matrices materialized. With ``reshard_after_forward=True`` (Z3) the
    block is rematerialized in the backward pass (``jax.checkpoint``), so
    the gathered weights are freed after the forward and gathered again for
    the backward: 3 (N-1)/N bytes per element. With False (Z2) they are kept:
    2 (N-1)/N, the all-reduce floor.

    Args:
      fn: the block's function ``(params, *args) -> out``.
      boundary: the boundary's name (see ``boundaries.names``).

    Returns:
      ``(dedicated, *args) -> out``.
    """
    b = self.boundaries.names.index(boundary)

    def run(owned_b, rest, *args):
      leaves = _full_leaves(rest, self.treedef)
      for i, x in self.gather(owned_b, b).items():
        leaves[i] = x
      return fn(jax.tree.unflatten(self.treedef, leaves), *args)

    if not self.reshard_after_forward:
      return lambda dedicated, *args: run(dedicated.owned[b],
                                          dedicated.rest, *args)

    # Z3: keep only the owner blocks for the backward pass and gather again
    # there. (jax.checkpoint expresses the same, but XLA:CPU drops its
    # optimization barriers and merges the two identical all-gathers, which
    # silently turns Z3 into Z2. Tying the backward gather to the cotangent
    # makes it a different value that XLA must compute after the forward.
    # The tie is 0 for a finite cotangent; a non-finite one poisons the
    # block's gradients, which it would do anyway.)
    @jax.custom_vjp
    def z3(owned_b, rest, *args):
      return run(owned_b, rest, *args)

    def z3_fwd(owned_b, rest, *args):
      return run(owned_b, rest, *args), (owned_b, rest, args)

    def z3_bwd(res, ct):
      owned_b, rest, args = res
      tie = sum(jnp.sum(c) for c in jax.tree.leaves(ct)) * 0
      owned_b = tuple(x + tie.astype(x.dtype) for x in owned_b)
      _, vjp = jax.vjp(run, owned_b, rest, *args)
      return vjp(ct)

    z3.defvjp(z3_fwd, z3_bwd)
    return lambda dedicated, *args: z3(dedicated.owned[b], dedicated.rest,
                                       *args)


def _full_leaves(rest: Any, treedef) -> list[Any]:
  """Leaves of ``rest`` with None placeholders kept (one per param)."""
  return treedef.flatten_up_to(rest)


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
) -> Dedication:
  """Plans dedicated ownership: each Muon matrix stored only on its owner.

  The owner plan balances Newton–Schulz work over all matrices (as
  :func:`dmuon_jax.plan_ownership`); each hook boundary (see
  :func:`dmuon_jax.find_hook_boundaries`) gets its own owner buffers, so a
  block's matrices are gathered together just before the block runs.

  Args:
    params: the params tree (shapes are enough).
    mesh: the mesh whose devices own the matrices.
    predicate: Muon-target predicate, as for :func:`dmuon_jax.dmuon`.
    weight_dimension_numbers: as for :func:`dmuon_jax.dmuon`.
    boundary_predicate: custom hook boundaries, see
      :func:`dmuon_jax.find_hook_boundaries`.
    strict: raise if a target has no boundary.
    reshard_after_forward: True for Z3 (gather again in the backward pass),
      False for Z2 (keep the gathered weights).
    axis_names: the owner axes (default: all mesh axes).

  Returns:
    A :class:`Dedication`; move params with ``to_dedicated``.
  """
  bounds = _boundaries.find_hook_boundaries(
      params, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers,
      boundary_predicate=boundary_predicate, strict=strict)
  if any(bounds.scanned):
    raise NotImplementedError(
        'dmuon: dedicated mode does not support scanned stacks yet '
        f'({[n for n, s in zip(bounds.names, bounds.scanned) if s]}); '
        'unstack the layers or use the drop-in dmuon(..., mesh=mesh).')
  plan = _planner.plan_ownership(
      params, mesh, axis_names=axis_names, predicate=predicate,
      weight_dimension_numbers=weight_dimension_numbers)
  leaves = jax.tree.leaves(params)
  path_boundary = dict(zip(bounds.paths, bounds.of_target))
  layouts = []
  for b in range(len(bounds.names)):
    keep = [i for i, s in enumerate(plan.leaves)
            if path_boundary[s.path] == b]
    kept = {plan.leaves[i].leaf_index for i in keep}
    unit_ids = [u for u, unit in enumerate(plan.units)
                if unit.leaf_index in kept]
    sub = dataclasses.replace(
        plan, leaves=tuple(plan.leaves[i] for i in keep),
        units=tuple(plan.units[u] for u in unit_ids),
        owners=tuple(plan.owners[u] for u in unit_ids))
    layouts.append(_layout.Layout(
        sub, [leaves[s.leaf_index].dtype for s in sub.leaves]))
  return Dedication(plan=plan, boundaries=bounds, layouts=tuple(layouts),
                    treedef=jax.tree.structure(params), mesh=mesh,
                    reshard_after_forward=reshard_after_forward)


class DedicatedMuonState(NamedTuple):
  """State of :func:`dedicated_muon`'s Muon part."""
  count: jax.Array
  mu: tuple[tuple[jax.Array, ...], ...]  # like DedicatedParams.owned


def scale_by_dedicated_muon(
    dedication: Dedication,
    ns_coeffs: Any = 'jordan',
    ns_steps: int | None = None,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    nesterov: bool = True,
    consistent_rms: jax.typing.ArrayLike | None = None,
) -> optax.GradientTransformation:
  """Muon on owner buffers: momentum and NS local, no communication.

  Runs inside ``shard_map`` on the local view of ``DedicatedParams.owned``
  (gradients as produced by :meth:`Dedication.gather`'s transpose: summed
  over devices, divided here by N). Includes optax's shape scaling.

  Args:
    dedication: the :class:`Dedication`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: momentum decay (optax's bias-corrected EMA).
    eps: added to the normalizing norm.
    nesterov: Nesterov momentum.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.

  Returns:
    A :class:`optax.GradientTransformation` on ``owned`` trees.
  """
  coeffs = _newton_schulz.resolve_ns_coeffs(ns_coeffs, ns_steps)
  n = dedication.plan.num_slots

  def init_fn(owned):
    return DedicatedMuonState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(jnp.zeros_like, owned))

  def ortho(stack):
    out = _newton_schulz.orthogonalize_via_newton_schulz(
        stack, coeffs, eps=eps)
    scale = _transform.shape_scale(*stack.shape[-2:], consistent_rms)
    return (scale * out).astype(out.dtype)

  def update_fn(grads, state, params=None):
    del params
    count_inc = optax.safe_increment(state.count)
    out, mus = [], []
    for b, lay in enumerate(dedication.layouts):
      g = tuple(x / n for x in grads[b])
      mu, hat = _transform.momentum_update(
          g, state.mu[b], count_inc, beta=beta, nesterov=nesterov,
          rule='optax')
      if n > 1:
        res = _collectives.switch_by_slot(
            dedication.axes,
            [functools.partial(lay.map_slot, slot=s, fn=ortho)
             for s in range(n)], hat)
      else:
        res = lay.map_slot(hat, 0, ortho)
      out.append(tuple(res))
      mus.append(mu)
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
  over devices (``pmean``).

  Args:
    dedication: the :class:`Dedication`.
    learning_rate: as for :func:`dmuon_jax.dmuon`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: as for :func:`dmuon_jax.dmuon`.
    eps: as for :func:`dmuon_jax.dmuon`.
    weight_decay: as for :func:`dmuon_jax.dmuon` (all Muon targets).
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
                              nesterov=nesterov,
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
