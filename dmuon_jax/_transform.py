"""The ``scale_by_dmuon`` gradient transformation and its state."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _collectives
from dmuon_jax import _layout
from dmuon_jax import _newton_schulz
from dmuon_jax import _planner

NsCoeffs = (str | tuple[float, float, float]
            | Sequence[tuple[float, float, float]])
WeightDimNumbers = (optax.contrib.MuonDimensionNumbers | Any
                    | Callable[[optax.Params], Any] | None)

_MOMENTUM_RULES = ('optax', 'sgd')
_NS_ALGORITHMS = ('standard', 'gram')
_PRECONDITIONINGS = ('frobenius', 'spectral', 'aol', 'schatten')
_COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16', 'float64')

TREE_MISMATCH_MSG = (
    'dmuon: the tree given to update() does not match the one given to '
    'init(): {detail}. Call init() again on the new params (a changed model '
    'needs a new optimizer state).')


class ScaleByDMuonState(NamedTuple):
  """State for :func:`dmuon_jax.scale_by_dmuon`."""
  count: jax.Array  # shape=(), dtype=int32
  # One owner buffer per (matrix shape, dtype) bucket, shaped
  # (num_slots * per_slot, m, n): each matrix's momentum sits in its owner's
  # rows only (see OwnershipPlan.summary()).
  mu: tuple[jax.Array, ...]


def _validate_static_args(*, momentum: str, ns_algorithm: str,
                          preconditioning: str, compute_dtype) -> None:
  """Raises for bad static arguments when the factory is called."""
  if momentum not in _MOMENTUM_RULES:
    raise ValueError(
        f"dmuon: momentum={momentum!r} is not one of {_MOMENTUM_RULES}: "
        "'optax' is optax.contrib.muon's bias-corrected EMA, 'sgd' is the "
        'DMuon/Moonlight rule buf = beta * buf + g.')
  if ns_algorithm not in _NS_ALGORITHMS:
    raise ValueError(
        f'dmuon: ns_algorithm={ns_algorithm!r} is not one of '
        f'{_NS_ALGORITHMS}.')
  if preconditioning not in _PRECONDITIONINGS:
    raise ValueError(
        f'dmuon: preconditioning={preconditioning!r} is not one of '
        f'{_PRECONDITIONINGS}.')
  if compute_dtype is not None and (
      jnp.dtype(compute_dtype).name not in _COMPUTE_DTYPES):
    raise ValueError(
        f'dmuon: compute_dtype={compute_dtype!r} is not one of '
        f'{_COMPUTE_DTYPES} (or None for the momentum dtype).')


def _resolve_mesh(mesh):
  """Returns the mesh to plan over: the argument, else the context mesh."""
  if mesh is not None:
    return mesh
  ctx = jax.sharding.get_abstract_mesh()
  if ctx is not None and not ctx.empty:
    return ctx
  return None


def _target_specs(tree, weight_dimension_numbers):
  """Leaf specs of a tree whose every leaf is a Muon target."""
  return _planner.muon_target_specs(
      tree, predicate=lambda path, leaf: True,
      weight_dimension_numbers=weight_dimension_numbers)


def _layout_for(tree, *, mesh, axis_names, weight_dimension_numbers,
                ns_steps, mu_dtype) -> _layout.Layout:
  """Plans owners for every leaf of ``tree`` and lays out owner buffers."""
  plan = _planner.plan_ownership(
      tree, mesh, axis_names=axis_names,
      predicate=lambda path, leaf: True,
      weight_dimension_numbers=weight_dimension_numbers, ns_steps=ns_steps)
  leaves = jax.tree.leaves(tree)
  dtypes = [mu_dtype if mu_dtype is not None
            else jnp.dtype(leaves[s.leaf_index].dtype) for s in plan.leaves]
  return _layout.Layout(plan, dtypes)


def momentum_update(grads, mus, count_inc, *, beta, nesterov, rule):
  """One momentum step on flat buffers.

  Returns:
    (new momentum, the momentum to orthogonalize).
  """
  if rule == 'optax':
    # Same operation order as optax.tree.update_moment, so that results
    # match optax.contrib.muon to rounding.
    new = tuple((1 - beta) * g + beta * m for m, g in zip(mus, grads))
    if nesterov:
      c_mu = 1 - beta ** optax.safe_increment(count_inc)
      c_g = 1 - beta ** count_inc
      hat = tuple(beta * (m / c_mu.astype(m.dtype))
                  + (1 - beta) * (g / c_g.astype(g.dtype))
                  for m, g in zip(new, grads))
    else:
      c_mu = 1 - beta ** count_inc
      hat = tuple(m / c_mu.astype(m.dtype) for m in new)
  else:
    new = tuple(beta * m + g for m, g in zip(mus, grads))
    hat = (tuple(g + beta * m for m, g in zip(new, grads)) if nesterov
           else new)
  return new, hat


def shape_scale(fan_in: int, fan_out: int,
                consistent_rms: jax.typing.ArrayLike | None):
  """Muon's shape factor for a ``(fan_in, fan_out)`` matrix (as optax)."""
  if consistent_rms is None:
    return np.sqrt(max(1.0, fan_out / fan_in))
  return np.sqrt(max(fan_in, fan_out)) * consistent_rms


def _on_owner(layout, fn, buffers):
  """Runs ``fn`` on this device's own matrices (one branch per owner)."""
  return _collectives.switch_by_slot(
      layout.plan.axis_names,
      [functools.partial(layout.map_slot, slot=s, fn=fn)
       for s in range(layout.num_slots)], buffers)


def _leaf_specs(plan, targets, recorded, explicit):
  """Each target's PartitionSpec: from its type, else from init, else P()."""
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  specs = []
  for i, (spec, x) in enumerate(zip(plan.leaves, targets)):
    found = _collectives.spec_of(x, explicit)
    if found is None and recorded is not None:
      found = recorded[i]
    found = P() if found is None else found
    _collectives.check_spec(found, spec.shape, sizes, spec.path)
    specs.append(found)
  return specs


def _check_state(layout: _layout.Layout, mu: Sequence[jax.Array],
                 local: bool) -> None:
  if local:
    want = tuple(((size,), jnp.dtype(d))
                 for d, size in zip(layout.dtypes, layout.local_sizes))
  else:
    want = tuple((tuple(s.shape), s.dtype) for s in layout.global_shapes())
  got = tuple((tuple(m.shape), jnp.dtype(m.dtype)) for m in mu)
  if got == want:
    return
  if local and got == tuple(
      (tuple(s.shape), s.dtype) for s in layout.global_shapes()):
    raise ValueError(
        'dmuon: inside shard_map the momentum buffers must be split over the '
        f'owner axes {layout.plan.axis_names}: pass the optimizer state with '
        'in_specs=jax.tree.map(lambda x: x.sharding.spec, opt_state).')
  raise ValueError(TREE_MISMATCH_MSG.format(
      detail=f'init made momentum buffers {got}, this tree needs {want}'))


def scale_by_dmuon(
    ns_coeffs: NsCoeffs = 'jordan',
    ns_steps: int | None = None,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Literal[
        'frobenius', 'spectral', 'aol', 'schatten'] = 'frobenius',
    weight_dimension_numbers: WeightDimNumbers = None,
    momentum: Literal['optax', 'sgd'] = 'optax',
    mesh: jax.sharding.Mesh | None = None,
    axis_names: Sequence[str] | None = None,
    ns_algorithm: Literal['standard', 'gram'] = 'standard',
    compute_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformation:
  r"""Muon's momentum orthogonalization, each matrix owned by one device.

  The building block of :func:`dmuon_jax.dmuon` (see there), without shape
  scaling, weight decay or learning rate, like
  :func:`optax.contrib.scale_by_muon`. Every leaf it sees is a Muon target:
  route other leaves elsewhere (e.g. with :func:`optax.partition`).

  With ``momentum='optax'`` (bias-corrected EMA, as optax), for gradient
  :math:`G_t` and step :math:`t`:

  .. math::
    M_t = \beta M_{t-1} + (1 - \beta) G_t, \quad
    \hat M_t = \frac{\beta M_t}{1 - \beta^{t+1}}
      + \frac{(1 - \beta) G_t}{1 - \beta^t}, \quad
    U_t = \mathrm{NS}(\hat M_t)

  (without Nesterov, :math:`\hat M_t = M_t / (1 - \beta^t)`). With
  ``momentum='sgd'`` (DMuon/Moonlight): :math:`M_t = \beta M_{t-1} + G_t`,
  :math:`\hat M_t = G_t + \beta M_t` (Nesterov) or :math:`M_t`.

  Each matrix (each matrix inside a stacked leaf, too) gets one owner slot
  from :func:`dmuon_jax.plan_ownership`. The momentum lives in one flat
  buffer per dtype, ``(num_slots * local,)``, sharded over the owner axes:
  each device keeps its own matrices only (``local`` is the busiest slot's
  element count).

  Sharding (with a mesh of N > 1 owner slots), per step:

  * gradients already reduced (drop-in, under plain ``jit``): one
    ``shard_map``; replicated leaves need no communication to reach the
    owner and come back by one ``all_gather``; leaves sharded along one
    matrix dimension go to the owners by one ``all_to_all`` and come back by
    another; other shardings are gathered whole first.
  * per-device gradients (explicit path, inside the caller's ``shard_map``,
    see :func:`dmuon_jax.local_value_and_grad`): one ``psum_scatter`` per
    owner axis (innermost first) to the owners, divided by N, and one
    ``all_gather`` back.

  Newton–Schulz runs on each device for its own matrices only (one
  ``lax.switch`` branch per owner), with no collective inside.

  Args:
    ns_coeffs: Newton–Schulz coefficients: a preset name (see
      :data:`dmuon_jax.NS_COEFF_PRESETS`), one ``(a, b, c)`` triple used at
      every iteration, or one triple per iteration.
    ns_steps: number of iterations for a single triple (default 5); for a
      per-iteration array it must be None or equal its length. Static: not
      injectable with :func:`optax.inject_hyperparams`.
    beta: momentum decay rate.
    eps: added to the normalizing norm.
    mu_dtype: momentum dtype (default: the gradient's dtype).
    nesterov: whether to use Nesterov momentum.
    adaptive: scale each orthogonalized matrix by the dual norm
      :math:`\langle \hat M, U \rangle` (per matrix, also inside stacked
      leaves; optax sums over a whole stacked leaf).
    preconditioning: ``'frobenius'``, ``'spectral'``, ``'aol'`` or
      ``'schatten'``, as in optax.
    weight_dimension_numbers: ``optax.contrib.MuonDimensionNumbers`` for
      every leaf, a tree (prefix) of them, or a callable returning one; a
      None entry means the default: the last two axes are the matrix, leading
      axes are a stack of matrices.
    momentum: ``'optax'`` or ``'sgd'`` (static).
    mesh: (optional, default None) ``jax.sharding.Mesh`` whose devices own
      the matrices; if None, the mesh from :func:`jax.set_mesh`, else one
      device. Static.
    axis_names: mesh axes that owners range over (default: all). Static.
    ns_algorithm: ``'standard'`` (direct iteration) or ``'gram'`` (Gram
      Newton–Schulz, cheaper for wide matrices). Static.
    compute_dtype: dtype of the Newton–Schulz matmuls (default: the
      momentum's); the normalization is always done in float32.

  Returns:
    A :class:`optax.GradientTransformation` whose state is a
    :class:`ScaleByDMuonState`.
  """
  coeffs = _newton_schulz.resolve_ns_coeffs(ns_coeffs, ns_steps)
  _validate_static_args(momentum=momentum, ns_algorithm=ns_algorithm,
                        preconditioning=preconditioning,
                        compute_dtype=compute_dtype)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  layout_for = functools.partial(
      _layout_for, mesh=_resolve_mesh(mesh), axis_names=axis_names,
      weight_dimension_numbers=weight_dimension_numbers,
      ns_steps=len(coeffs), mu_dtype=mu_dtype)

  if ns_algorithm == 'gram':
    orthogonalize = functools.partial(
        _newton_schulz.orthogonalize_via_gram_newton_schulz, ns_coeffs=coeffs)
  else:
    orthogonalize = functools.partial(
        _newton_schulz.orthogonalize_via_newton_schulz, ns_coeffs=coeffs)
  orthogonalize = functools.partial(
      orthogonalize, preconditioning=preconditioning, eps=eps,
      compute_dtype=compute_dtype)

  mesh = _resolve_mesh(mesh)
  if mesh is not None:
    _planner._mesh_axes(mesh, axis_names)  # Raises for unknown axis names.
  # Param shardings seen by init (concrete arrays), used by update when the
  # gradients' sharding cannot be read from their type (meshes with Auto
  # axes). Keyed by the plan, i.e. by the tree's shapes.
  init_specs: dict[Any, tuple[P | None, ...]] = {}

  def init_fn(params):
    layout = layout_for(params)
    plan = layout.plan
    leaves = jax.tree.leaves(params)
    init_specs[plan] = tuple(
        _collectives.spec_of(leaves[s.leaf_index], explicit=False)
        for s in plan.leaves)
    mu = []
    for shape in layout.global_shapes():
      if plan.num_slots > 1:
        # Each owner's block on its own device (a context mesh from
        # jax.set_mesh resolves a bare PartitionSpec).
        sharding = (NamedSharding(mesh, P(plan.axis_names))
                    if isinstance(mesh, jax.sharding.Mesh)
                    else P(plan.axis_names))
        zeros = functools.partial(jnp.zeros, shape.shape, shape.dtype)
        mu.append(jax.jit(zeros, out_shardings=sharding)())
      else:
        mu.append(jnp.zeros(shape.shape, shape.dtype))
    return ScaleByDMuonState(count=jnp.zeros([], jnp.int32), mu=tuple(mu))

  momentum_step = functools.partial(
      momentum_update, beta=beta, nesterov=nesterov, rule=momentum)

  def ortho_fn(stack):
    out = orthogonalize(stack)
    if adaptive:
      out = jnp.sum(stack * out, axis=(-2, -1), keepdims=True) * out
    return out

  def owner_step(layout, targets, specs, mus, count_inc, *, distributed,
                 reduced):
    """The per-device program: gradients to owners, NS, results back.

    ``reduced`` says whether the gradients are already summed over devices
    (drop-in path); else (explicit path) they are per device.
    """
    plan = layout.plan
    axes, sizes = plan.axis_names, plan.mesh_shape
    if not distributed:
      grads = layout.pack_slot(targets, 0)
      new_mu, mu_hat = momentum_step(grads, mus, count_inc)
      ortho = layout.map_slot(mu_hat, 0, ortho_fn)
      out = layout.unpack_full(ortho)
    elif not reduced:
      # Explicit path: per-device gradients, reduced straight to the owners
      # (reduce-scatter), results all-gathered: one all-reduce's bytes.
      grads = tuple(
          _collectives.reduce_scatter_to_owners(b, axes, sizes)
          / plan.num_slots for b in layout.pack_full(targets))
      new_mu, mu_hat = momentum_step(grads, mus, count_inc)
      ortho = _on_owner(layout, ortho_fn, mu_hat)
      out = layout.unpack_full(
          [_collectives.gather_from_owners(o, axes) for o in ortho])
    else:
      out, new_mu = _drop_in(layout, targets, specs, mus, count_inc)
    new_mu = tuple(m.astype(old.dtype) for m, old in zip(new_mu, mus))
    return [x.astype(t.dtype) for x, t in zip(out, targets)], new_mu

  def _drop_in(layout, targets, specs, mus, count_inc):
    """Gradients already reduced, in the params' sharding."""
    plan = layout.plan
    axes, n = plan.axis_names, plan.num_slots
    entries = [_collectives.spec_entries(sp) for sp in specs]
    ex = _layout.Exchange(layout, entries)
    groups = range(layout.num_groups)
    dtypes = [jnp.result_type(*[targets[layout.unit_leaf[u]].dtype
                                for s in layout.slot_units[g] for u in s])
              for g in groups]
    # Sharded leaves: one all-to-all per dtype group brings every owner the
    # pieces of its matrices. Others are gathered whole (a no-op when
    # replicated) and each owner reads its own matrices.
    recv = {g: jax.lax.all_to_all(
        ex.send_to_owners(g, targets, jax.lax.axis_index, dtypes[g]),
        axes, 0, 0, tiled=True) for g in groups if ex.row_sizes[g]}
    full = [x if i in ex.routed else _collectives.gather_shards(x, specs[i])
            for i, x in enumerate(targets)]

    def pack(slot):
      from_full = layout.unit_getter(full)
      assembled = {}
      for g, r in recv.items():
        assembled.update(ex.assemble(g, r, slot))
      return layout.pack_slot_from(
          lambda u: assembled[u] if u in assembled else from_full(u),
          slot, dtypes)

    grads = _collectives.switch_by_slot(
        axes, [functools.partial(pack, s) for s in range(n)])
    new_mu, mu_hat = momentum_step(grads, mus, count_inc)
    ortho = _on_owner(layout, ortho_fn, mu_hat)
    out = [None] * len(targets)
    rep_groups = [g for g in groups if ex.rep_sizes[g]]
    if rep_groups:
      compact = _collectives.switch_by_slot(axes, [
          lambda b, s=s: tuple(ex.rep_pack(b, s, g) for g in rep_groups)
          for s in range(n)], ortho)
      gathered = [None] * layout.num_groups
      for g, c in zip(rep_groups, compact):
        gathered[g] = _collectives.gather_from_owners(c, axes)
      sizes_by_name = dict(zip(axes, plan.mesh_shape))
      for i, x in ex.rep_unpack(gathered).items():
        out[i] = _collectives.local_shard(x, specs[i], sizes_by_name)
    back = {}
    for g in recv:
      send = _collectives.switch_by_slot(axes, [
          lambda b, s=s, g=g: ex.send_back(g, b, s) for s in range(n)], ortho)
      back[g] = jax.lax.all_to_all(send, axes, 0, 0, tiled=True)
    for i in ex.routed:
      out[i] = ex.local_leaf(i, back)
    return out, new_mu

  def update_fn(updates, state, params=None):
    del params
    layout = layout_for(updates)
    plan = layout.plan
    leaves, treedef = jax.tree.flatten(updates)
    targets = [leaves[s.leaf_index] for s in plan.leaves]
    count_inc = optax.safe_increment(state.count)
    manual = _collectives.manual_axes()
    in_shard_map = bool(set(plan.axis_names) & manual)
    _check_state(layout, state.mu, local=in_shard_map)
    if plan.num_slots == 1:
      new, mu = owner_step(layout, targets, [None] * len(targets), state.mu,
                           count_inc, distributed=False, reduced=True)
    elif in_shard_map:
      # Called inside the user's shard_map: the leaves are gradients of
      # replicated params, per device (explicit path, device-varying) or
      # already summed (invariant).
      unreduced = any(_collectives.varying_axes(x) & set(plan.axis_names)
                      for x in targets)
      new, mu = owner_step(layout, targets, [None] * len(targets), state.mu,
                           count_inc, distributed=True, reduced=not unreduced)
    else:
      specs = _leaf_specs(plan, targets, init_specs.get(plan),
                          _collectives.is_explicit(
                              mesh or jax.sharding.get_abstract_mesh()))
      step = functools.partial(owner_step, layout, specs=specs,
                               distributed=True, reduced=True)
      new, mu = jax.shard_map(
          lambda t, m, c: step(t, mus=m, count_inc=c), mesh=mesh,
          in_specs=(list(specs), P(plan.axis_names), P()),
          out_specs=(list(specs), P(plan.axis_names)),
          # Results of sharded leaves arrive by all_to_all from every owner,
          # so their type says "varying" over axes they are replicated on
          # (HSDP's replicate peers receive equal pieces). Nothing here is
          # differentiated; the parity tests check the values.
          check_vma=False,
      )(targets, state.mu, count_inc)
    out = list(leaves)
    for spec, x in zip(plan.leaves, new):
      out[spec.leaf_index] = x
    return (jax.tree.unflatten(treedef, out),
            ScaleByDMuonState(count=count_inc, mu=tuple(mu)))

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_shape(
    weight_dimension_numbers: WeightDimNumbers = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
) -> optax.GradientTransformation:
  r"""Scales each Muon update by a factor of its matrix shape.

  For a matrix of shape ``(fan_in, fan_out)`` (after
  ``weight_dimension_numbers``), the factor is
  :math:`\sqrt{\max(1, \mathrm{fan\_out} / \mathrm{fan\_in})}` (Jordan's
  width scaling) or, with ``consistent_rms``,
  :math:`\sqrt{\max(\mathrm{fan\_in}, \mathrm{fan\_out})} \cdot
  \mathrm{consistent\_rms}` (Liu et al., 2025), as optax's Muon.

  Args:
    weight_dimension_numbers: as for :func:`scale_by_dmuon`.
    consistent_rms: optional target RMS; None selects width scaling.

  Returns:
    A stateless :class:`optax.GradientTransformation`.
  """

  def update_fn(updates, state, params=None):
    del params
    specs = _target_specs(updates, weight_dimension_numbers)
    leaves, treedef = jax.tree.flatten(updates)
    out = []
    for x, spec in zip(leaves, specs, strict=True):
      scale = shape_scale(*spec.matrix_shape, consistent_rms)
      out.append((scale * x).astype(x.dtype))
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
