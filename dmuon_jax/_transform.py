"""The ``scale_by_dmuon`` gradient transformation and its state."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def _leaf_dtype(x):
  return jnp.dtype(x.dtype)


def _layout_for(tree, *, mesh, axis_names, weight_dimension_numbers,
                ns_steps, mu_dtype) -> _layout.Layout:
  """Plans owners for every leaf of ``tree`` and lays out owner buffers."""
  plan = _planner.plan_ownership(
      tree, mesh, axis_names=axis_names,
      predicate=lambda path, leaf: True,
      weight_dimension_numbers=weight_dimension_numbers, ns_steps=ns_steps)
  leaves = jax.tree.leaves(tree)
  dtypes = [mu_dtype if mu_dtype is not None
            else _leaf_dtype(leaves[s.leaf_index]) for s in plan.leaves]
  return _layout.Layout.build(plan, dtypes)


def _check_state(layout: _layout.Layout, mu: Sequence[jax.Array]) -> None:
  expected = layout.buffer_shapes()
  got = tuple((tuple(m.shape), jnp.dtype(m.dtype)) for m in mu)
  want = tuple((tuple(s.shape), s.dtype) for s in expected)
  if got != want:
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
  from :func:`dmuon_jax.plan_ownership`; the momentum is stored in owner
  buffers, one per matrix shape, whose rows belong to their owner slot.

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

  def init_fn(params):
    layout = layout_for(params)
    return ScaleByDMuonState(count=jnp.zeros([], jnp.int32),
                             mu=layout.zeros())

  def update_fn(updates, state, params=None):
    del params
    layout = layout_for(updates)
    _check_state(layout, state.mu)
    leaves, treedef = jax.tree.flatten(updates)
    grads = layout.pack(leaves)
    count_inc = optax.safe_increment(state.count)
    if momentum == 'optax':
      # Same operation order as optax.tree.update_moment, so that results
      # match optax.contrib.muon to rounding.
      mu = tuple((1 - beta) * g + beta * m for m, g in zip(state.mu, grads))
      if nesterov:
        c_mu = 1 - beta ** optax.safe_increment(count_inc)
        c_g = 1 - beta ** count_inc
        mu_hat = tuple(beta * (m / c_mu.astype(m.dtype))
                       + (1 - beta) * (g / c_g.astype(g.dtype))
                       for m, g in zip(mu, grads))
      else:
        c_mu = 1 - beta ** count_inc
        mu_hat = tuple(m / c_mu.astype(m.dtype) for m in mu)
    else:
      mu = tuple(beta * m + g for m, g in zip(state.mu, grads))
      if nesterov:
        mu_hat = tuple(g + beta * m for m, g in zip(mu, grads))
      else:
        mu_hat = mu
    ortho = tuple(orthogonalize(m) for m in mu_hat)
    if adaptive:
      ortho = tuple(
          jnp.sum(m * o, axis=(-2, -1), keepdims=True) * o
          for m, o in zip(mu_hat, ortho))
    new = layout.unpack(ortho)
    out = [new[i].astype(x.dtype) if i in new else x
           for i, x in enumerate(leaves)]
    mu = tuple(m.astype(s.dtype) for m, s in zip(mu, state.mu))
    return (jax.tree.unflatten(treedef, out),
            ScaleByDMuonState(count=count_inc, mu=mu))

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
      fan_in, fan_out = spec.matrix_shape
      if consistent_rms is None:
        scale = np.sqrt(max(1.0, fan_out / fan_in))
      else:
        scale = np.sqrt(max(fan_in, fan_out)) * consistent_rms
      out.append((scale * x).astype(x.dtype))
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
