"""The ``scale_by_dmuon`` gradient transformation and its state."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
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
from dmuon_jax import _tensor_parallel

NsCoeffs = (str | tuple[float, float, float]
            | Sequence[tuple[float, float, float]])
WeightDimNumbers = (optax.contrib.MuonDimensionNumbers | Any
                    | Callable[[optax.Params], Any] | None)

_MOMENTUM_RULES = ('optax', 'sgd')
_NS_ALGORITHMS = ('auto', 'standard', 'gram')
_PRECONDITIONINGS = ('frobenius', 'spectral', 'aol', 'schatten')
_COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16', 'float64')
_NONFINITE = ('skip', 'propagate')

# Matrices whose largest entry exceeds this are divided by a power of two
# before Newton-Schulz (see rescale_large).
_LARGE = 2.0 ** 10

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


# Recorders of scale_by_dmuon inits in this thread (see recording_inits).
_RECORDERS = threading.local()


@contextlib.contextmanager
def recording_inits() -> Iterator[list]:
  """Collects what every ``scale_by_dmuon`` init in this thread builds.

  Within the block, each init appends ``(tree, layout, state)``: the Muon
  tree it planned (one TP shard's slices where TP splits a matrix), its
  owner :class:`~dmuon_jax._layout.Layout` and the state it returned.
  ``dmuon_jax.checkpoint`` reads the owner layouts of any optax composition
  this way, without repeating the optimizer's arguments.
  """
  made: list = []
  stack = getattr(_RECORDERS, 'stack', None)
  if stack is None:
    stack = _RECORDERS.stack = []
  stack.append(made)
  try:
    yield made
  finally:
    stack.remove(made)


def _record_init(tree, layout, state) -> None:
  for made in getattr(_RECORDERS, 'stack', ()):
    made.append((tree, layout, state))


def _validate_static_args(*, momentum: str, ns_algorithm: str,
                          preconditioning: str, compute_dtype,
                          nonfinite: str = 'skip') -> None:
  """Raises for bad static arguments when the factory is called."""
  if nonfinite not in _NONFINITE:
    raise ValueError(
        f'dmuon: nonfinite={nonfinite!r} is not one of {_NONFINITE}: '
        "'skip' drops a step with a NaN/Inf gradient (zero updates, state "
        "unchanged), 'propagate' lets it through as optax does.")
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


def rescale_large(stack: jax.Array, tp_axis: str | None = None) -> jax.Array:
  """Divides each matrix whose max-abs entry exceeds ``_LARGE`` by 2^k.

  Newton-Schulz normalizes in float32 through sums of squares (the Frobenius
  norm, the Gram matrix ``X X^T`` and, for ``'schatten'``, its squares),
  which overflow for entries above about 1e19 (1e9 for ``'schatten'``):
  the result is then zero (``'frobenius'``) or NaN (``'aol'``,
  ``'schatten'``). Newton-Schulz is scale invariant (up to ``eps``), so
  such matrices are brought to a max-abs entry in ``[0.5, 1)`` first. The
  factor is a power of two, so the scaling itself rounds nothing, and
  matrices at most ``_LARGE`` are left bitwise as they are.

  Args:
    stack: ``(..., m, n)`` matrices.
    tp_axis: the tensor-parallel axis over which the matrices are split
      (inside ``shard_map``): the factor is then taken over the whole matrix.

  Returns:
    The stack, each matrix scaled by an exact power of two (or by 1).
  """
  if not jnp.issubdtype(stack.dtype, jnp.floating) or (
      jnp.finfo(stack.dtype).max <= _LARGE):
    return stack
  amax = jnp.max(jnp.abs(stack), axis=(-2, -1), keepdims=True)
  if tp_axis is not None:
    amax = jax.lax.pmax(amax, tp_axis)
  _, exponent = jnp.frexp(amax)
  one = jnp.ones((), stack.dtype)
  scale = jnp.where(amax > _LARGE, jnp.ldexp(one, -exponent), one)
  return stack * scale.astype(stack.dtype)


def all_finite(*trees: Any) -> jax.Array:
  """Whether every leaf of ``trees`` is finite, on every device.

  Inside ``shard_map`` the flag is reduced (``pmin``) over the manual mesh
  axes, so that every device takes the same decision; under plain ``jit``
  the leaves are global arrays and the reduction is global already.
  """
  ok = jnp.array(True)
  for x in jax.tree.leaves(trees):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact) and x.size:
      ok = ok & jnp.all(jnp.isfinite(x))
  manual = _collectives.manual_axes()
  if manual:
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in mesh.axis_names if a in manual)
    ok = jax.lax.pmin(ok.astype(jnp.int32), axes) > 0
  return ok


def select_tree(ok: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``ok``, else ``old``, leaf by leaf (``jnp.where``)."""
  return jax.tree.map(
      lambda n, o: jnp.where(ok, n, o).astype(jnp.asarray(n).dtype),
      new, old)


def zeros_unless(ok: jax.Array, tree: Any) -> Any:
  """``tree`` where ``ok``, else zeros of its leaves' shapes and dtypes."""
  return jax.tree.map(
      lambda x: jnp.where(ok, x, jnp.zeros((), x.dtype)), tree)


def skip_nonfinite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """Skips the whole step of ``inner`` unless everything stays finite.

  A step is skipped when any gradient, any update or any new state leaf of
  ``inner`` is NaN or infinite (on any device, see :func:`all_finite`): the
  updates are then zero and ``inner``'s state (counts included) is the old
  one. ``jnp.where`` selects, so the step costs the same either way.

  Args:
    inner: the transformation to guard.

  Returns:
    A :class:`optax.GradientTransformation` with ``inner``'s state.
  """

  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = inner.update(updates, state, params,
                                          **extra_args)
    ok = all_finite(updates, new_updates, new_state)
    return zeros_unless(ok, new_updates), select_tree(ok, new_state, state)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


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
                ns_steps, mu_dtype, ns_algorithm='standard',
                tp_splits=None) -> _layout.Layout:
  """Plans owners for every leaf of ``tree`` and lays out owner buffers."""
  plan = _planner.plan_ownership(
      tree, mesh, axis_names=axis_names,
      predicate=lambda path, leaf: True,
      weight_dimension_numbers=weight_dimension_numbers, ns_steps=ns_steps,
      ns_algorithm=ns_algorithm)
  leaves = jax.tree.leaves(tree)
  dtypes = [mu_dtype if mu_dtype is not None
            else jnp.dtype(leaves[s.leaf_index].dtype) for s in plan.leaves]
  return _layout.Layout(plan, dtypes, tp_splits)


def owner_axes(mesh, axis_names, tp_axis):
  """The owner axes: ``axis_names``, else every mesh axis but the TP one."""
  names, _ = _planner._mesh_axes(mesh, None)  # pylint: disable=protected-access
  if tp_axis is None or tp_axis not in names:
    return axis_names
  if axis_names is None:
    return tuple(n for n in names if n != tp_axis)
  chosen = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
  if tp_axis in chosen:
    raise ValueError(
        f'dmuon: axis_names {chosen} includes the tensor-parallel axis '
        f'{tp_axis!r}: owners range over data-parallel axes, and every TP '
        'shard of an owner holds its slice of the matrix. Leave it out of '
        'axis_names, or pass tensor_parallel_axis=None to use it for owners.')
  return chosen


def tp_size(mesh, tp_axis) -> int:
  """Size of the tensor-parallel axis (1 when the mesh has none)."""
  names, sizes = _planner._mesh_axes(mesh, None)  # pylint: disable=protected-access
  return int(dict(zip(names, sizes)).get(tp_axis, 1))


def split_tensor_parallel(leaf_specs, specs, tp_axis, sizes):
  """Separates the TP axis from each Muon leaf's sharding.

  Args:
    leaf_specs: the leaves' ``LeafSpec`` (matrix axes).
    specs: the leaves' PartitionSpecs on the whole mesh.
    tp_axis: the tensor-parallel axis name.
    sizes: mesh axis sizes by name.

  Returns:
    ``(owner_specs, tp_splits, local_shapes)``: the specs without the TP
    axis, per leaf None or the split matrix axis (-1 for a split output
    axis, i.e. columns; -2 for a split reduction axis, i.e. rows) and the
    shape of one TP shard's slice.

  Raises:
    ValueError: naming the leaf, for a TP axis on a stack (batch) axis,
      on two dimensions, or together with another axis on one dimension.
  """
  owner_specs, splits, shapes = [], [], []
  for leaf, spec in zip(leaf_specs, specs):
    entries = _collectives.spec_entries(spec)
    dims = [d for d, axes in enumerate(entries) if tp_axis in axes]
    if not dims:
      owner_specs.append(spec)
      splits.append(None)
      shapes.append(tuple(leaf.shape))
      continue
    dim = dims[0]
    if len(dims) > 1 or entries[dim] != (tp_axis,):
      raise ValueError(
          f'dmuon: param {leaf.path!r} is sharded as {spec}: the '
          f'tensor-parallel axis {tp_axis!r} must be the only axis of a '
          'single dimension (Megatron column- or row-parallel). Shard the '
          'other dimension over the data-parallel axes instead.')
    if dim in leaf.output_axes:
      splits.append(-1)
    elif dim in leaf.reduction_axes:
      splits.append(-2)
    else:
      raise ValueError(
          f'dmuon: param {leaf.path!r} of shape {leaf.shape} is sharded over '
          f'the tensor-parallel axis {tp_axis!r} on dim {dim}, a stack '
          f'(batch) axis of its MuonDimensionNumbers; TP must split a matrix '
          'dimension (a reduction or output axis). Shard another dimension, '
          'or replicate the stack axis.')
    entries[dim] = ()
    owner_specs.append(P(*[e if e else None for e in entries]))
    shape = list(leaf.shape)
    shape[dim] //= sizes[tp_axis]
    shapes.append(tuple(shape))
  return owner_specs, splits, shapes


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


def _buffer_specs(axes, tp_axis, tp_n):
  """PartitionSpec of the momentum buffers: owners, then TP shards."""
  return P(tuple(axes) + ((tp_axis,) if tp_n > 1 else ()))


def _on_owner(layout, fn, buffers):
  """Runs ``fn`` on this device's own matrices (one branch per owner)."""
  return _collectives.switch_by_slot(
      layout.plan.axis_names,
      [functools.partial(layout.map_slot, slot=s, fn=fn)
       for s in range(layout.num_slots)], buffers)


def _leaf_specs(leaf_specs, targets, recorded, explicit, sizes):
  """Each target's PartitionSpec: from its type, else from init, else P()."""
  specs = []
  for i, (spec, x) in enumerate(zip(leaf_specs, targets)):
    found = _collectives.spec_of(x, explicit)
    if found is None and recorded is not None:
      found = recorded[i]
    found = P() if found is None else found
    _collectives.check_spec(found, spec.shape, sizes, spec.path)
    specs.append(found)
  return specs


def _global_shapes(layout: _layout.Layout, tp_n: int):
  """Momentum buffer shapes: every owner slot's block on each TP shard."""
  return tuple(jax.ShapeDtypeStruct((s.shape[0] * tp_n,), s.dtype)
               for s in layout.global_shapes())


def _check_state(layout: _layout.Layout, mu: Sequence[jax.Array],
                 local: bool, tp_n: int = 1) -> None:
  if local:
    want = tuple(((size,), jnp.dtype(d))
                 for d, size in zip(layout.dtypes, layout.local_sizes))
  else:
    want = tuple((tuple(s.shape), s.dtype)
                 for s in _global_shapes(layout, tp_n))
  got = tuple((tuple(m.shape), jnp.dtype(m.dtype)) for m in mu)
  if got == want:
    return
  if local and got == tuple(
      (tuple(s.shape), s.dtype) for s in _global_shapes(layout, tp_n)):
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
    ns_algorithm: Literal['auto', 'standard', 'gram'] = 'auto',
    compute_dtype: jax.typing.DTypeLike | None = None,
    tensor_parallel_axis: str | None = 'model',
    nonfinite: Literal['skip', 'propagate'] = 'skip',
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

  Tensor parallelism (drop-in path): on a mesh with a ``tensor_parallel_axis``
  (e.g. ``('replicate', 'shard', 'model')``), owners range over the other
  axes and a Muon leaf may be sharded over the TP axis along one matrix
  dimension (Megatron column-parallel: output axis; row-parallel: reduction
  axis). Every TP shard of the owner then keeps the momentum of its own
  slice, and the owner's TP shards orthogonalize the matrix together with
  Gram Newton–Schulz: one all-reduce over the TP axis of the Gram matrix of
  the unsplit dimension per restart window (``1 + restarts`` per matrix
  shape), no gather of the matrix (see ``_tensor_parallel``). Matrices
  replicated over the TP axis are orthogonalized by each TP shard of their
  owner. The momentum buffers are sharded over the owner axes and the TP
  axis. TP needs the params' shardings: from their types (explicit-axis
  meshes) or from ``init`` on the sharded params (not under ``jit``).

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
    axis_names: mesh axes that owners range over (default: all but
      ``tensor_parallel_axis``). Static.
    ns_algorithm: ``'auto'`` (per matrix shape, the form with fewer matmul
      FLOPs by the planner's cost model: Gram for aspect ratios above about
      1.5, direct otherwise), ``'standard'`` (direct iteration) or
      ``'gram'`` (Gram Newton–Schulz). TP-split matrices always use the
      Gram form. Static.
    compute_dtype: dtype of the Newton–Schulz matmuls (default: the
      momentum's); the normalization is always done in float32.
    tensor_parallel_axis: the mesh axis that splits matrices (tensor
      parallelism), if the mesh has it; None: no TP axis. Static.
    nonfinite: what a NaN or Inf does. ``'skip'`` (default): if any
      gradient, new momentum or update is non-finite, on any device (the
      explicit path reduces the flag over the owner axes), the step is
      skipped: zero updates, momentum and count unchanged. ``'propagate'``:
      as optax, NaN/Inf flow into the updates and the momentum.
      :func:`optax.apply_if_finite` (which checks the gradients itself)
      composes with both; under ``'skip'`` the steps it lets through after
      ``max_consecutive_errors`` still leave the state clean. Finite
      gradients never give NaN/Inf either way: matrices with entries above
      1024 are divided by a power of two before Newton–Schulz, so that its
      float32 norms cannot overflow. Static.

  Returns:
    A :class:`optax.GradientTransformation` whose state is a
    :class:`ScaleByDMuonState`.
  """
  coeffs = _newton_schulz.resolve_ns_coeffs(ns_coeffs, ns_steps)
  _validate_static_args(momentum=momentum, ns_algorithm=ns_algorithm,
                        preconditioning=preconditioning,
                        compute_dtype=compute_dtype, nonfinite=nonfinite)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

  forms = {
      'gram': _newton_schulz.orthogonalize_via_gram_newton_schulz,
      'standard': _newton_schulz.orthogonalize_via_newton_schulz}
  forms = {k: functools.partial(
      f, ns_coeffs=coeffs, preconditioning=preconditioning, eps=eps,
      compute_dtype=compute_dtype) for k, f in forms.items()}

  def orthogonalize(stack, tp_split):
    stack = rescale_large(
        stack, tensor_parallel_axis if tp_split is not None else None)
    if tp_split is not None:
      return _tensor_parallel.orthogonalize_via_gram_newton_schulz_tp(
          stack, coeffs, axis_name=tensor_parallel_axis, split_axis=tp_split,
          eps=eps, compute_dtype=compute_dtype)
    algo = ns_algorithm
    if algo == 'auto':
      algo = _newton_schulz.cheaper_ns_algorithm(*stack.shape[-2:],
                                                 len(coeffs))
    return forms[algo](stack)

  mesh = _resolve_mesh(mesh)
  if mesh is not None:
    _planner._mesh_axes(mesh, axis_names)  # Raises for unknown axis names.
  axis_names = owner_axes(mesh, axis_names, tensor_parallel_axis)
  tp_n = tp_size(mesh, tensor_parallel_axis)
  if tp_n > 1 and preconditioning != 'frobenius':
    raise ValueError(
        f'dmuon: preconditioning={preconditioning!r} is not available with '
        f'the tensor-parallel axis {tensor_parallel_axis!r} (size {tp_n}): '
        "the TP Gram Newton-Schulz normalizes by the Frobenius norm. Use "
        "preconditioning='frobenius' or tensor_parallel_axis=None.")
  mesh_sizes = dict(mesh.shape) if mesh is not None else {}
  # Param shardings seen by init (concrete arrays), used by update when the
  # gradients' sharding cannot be read from their type (meshes with Auto
  # axes). Keyed by the tree's structure, shapes and dtypes.
  init_specs: dict[Any, tuple[P | None, ...]] = {}

  def tree_key(leaves, treedef):
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)

  def layout_for(tree, specs=None):
    """Owner layout of ``tree`` and the leaves' specs without the TP axis.

    With ``specs`` that split leaves over the TP axis, the plan holds one TP
    shard's slice of each such matrix.
    """
    splits = owner_specs = None
    if specs is not None and tp_n > 1:
      leaves, treedef = jax.tree.flatten(tree)
      owner_specs, splits, shapes = split_tensor_parallel(
          _target_specs(tree, weight_dimension_numbers), specs,
          tensor_parallel_axis, mesh_sizes)
      tree = jax.tree.unflatten(treedef, [
          jax.ShapeDtypeStruct(shape, x.dtype)
          for x, shape in zip(leaves, shapes)])
    layout = _layout_for(
        tree, mesh=mesh, axis_names=axis_names,
        weight_dimension_numbers=weight_dimension_numbers,
        ns_steps=len(coeffs), mu_dtype=mu_dtype, ns_algorithm=ns_algorithm,
        tp_splits=splits)
    return layout, (owner_specs if owner_specs is not None else specs), tree

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    specs = tuple(_collectives.spec_of(x, explicit=False) for x in leaves)
    init_specs[tree_key(leaves, treedef)] = specs
    layout, _, planned = layout_for(
        params, [P() if s is None else s for s in specs])
    plan = layout.plan
    mu = []
    for shape in _global_shapes(layout, tp_n):
      if plan.num_slots * tp_n > 1:
        # Each owner's block on its own device (a context mesh from
        # jax.set_mesh resolves a bare PartitionSpec).
        spec = _buffer_specs(plan.axis_names, tensor_parallel_axis, tp_n)
        sharding = (NamedSharding(mesh, spec)
                    if isinstance(mesh, jax.sharding.Mesh) else spec)
        zeros = functools.partial(jnp.zeros, shape.shape, shape.dtype)
        mu.append(jax.jit(zeros, out_shardings=sharding)())
      else:
        mu.append(jnp.zeros(shape.shape, shape.dtype))
    state = ScaleByDMuonState(count=jnp.zeros([], jnp.int32), mu=tuple(mu))
    _record_init(planned, layout, state)
    return state

  momentum_step = functools.partial(
      momentum_update, beta=beta, nesterov=nesterov, rule=momentum)

  def ortho_fn(stack, tp_split=None):
    out = orthogonalize(stack, tp_split)
    if adaptive:
      dot = jnp.sum(stack * out, axis=(-2, -1), keepdims=True)
      if tp_split is not None:
        dot = jax.lax.psum(dot, tensor_parallel_axis)
      out = dot * out
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
    layout, _, _ = layout_for(updates)
    plan = layout.plan
    leaves, treedef = jax.tree.flatten(updates)
    targets = [leaves[s.leaf_index] for s in plan.leaves]
    count_inc = optax.safe_increment(state.count)
    manual = _collectives.manual_axes()
    in_shard_map = bool(set(plan.axis_names) & manual)
    if in_shard_map and tp_n > 1:
      raise ValueError(
          'dmuon: update() inside shard_map (the explicit path) does not '
          f'support the tensor-parallel axis {tensor_parallel_axis!r}: call '
          'it under jit on the sharded gradients (drop-in), or use '
          'dmuon_jax.dedicate.')
    if plan.num_slots * tp_n == 1:
      _check_state(layout, state.mu, local=False)
      new, mu = owner_step(layout, targets, [None] * len(targets), state.mu,
                           count_inc, distributed=False, reduced=True)
    elif in_shard_map:
      # Called inside the user's shard_map: the leaves are gradients of
      # replicated params, per device (explicit path, device-varying) or
      # already summed (invariant).
      _check_state(layout, state.mu, local=True)
      unreduced = any(_collectives.varying_axes(x) & set(plan.axis_names)
                      for x in targets)
      new, mu = owner_step(layout, targets, [None] * len(targets), state.mu,
                           count_inc, distributed=True, reduced=not unreduced)
    else:
      allowed = dict(zip(plan.axis_names, plan.mesh_shape))
      if tp_n > 1:
        allowed[tensor_parallel_axis] = tp_n
      specs = _leaf_specs(plan.leaves, targets,
                          init_specs.get(tree_key(leaves, treedef)),
                          _collectives.is_explicit(
                              mesh or jax.sharding.get_abstract_mesh()),
                          allowed)
      layout, owner_specs, _ = layout_for(updates, specs)
      _check_state(layout, state.mu, local=False, tp_n=tp_n)
      buffer_spec = _buffer_specs(plan.axis_names, tensor_parallel_axis, tp_n)
      step = functools.partial(owner_step, layout, specs=owner_specs,
                               distributed=True, reduced=True)
      new, mu = jax.shard_map(
          lambda t, m, c: step(t, mus=m, count_inc=c), mesh=mesh,
          in_specs=(list(specs), buffer_spec, P()),
          out_specs=(list(specs), buffer_spec),
          # Results of sharded leaves arrive by all_to_all from every owner,
          # so their type says "varying" over axes they are replicated on
          # (HSDP's replicate peers receive equal pieces). Nothing here is
          # differentiated; the parity tests check the values.
          check_vma=False,
      )(targets, state.mu, count_inc)
    mu = tuple(mu)
    if nonfinite == 'skip':
      ok = all_finite(targets, new, mu)
      new = zeros_unless(ok, new)
      mu = select_tree(ok, mu, tuple(state.mu))
      count_inc = jnp.where(ok, count_inc, state.count)
    out = list(leaves)
    for spec, x in zip(plan.leaves, new):
      out[spec.leaf_index] = x
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
      scale = shape_scale(*spec.matrix_shape, consistent_rms)
      out.append((scale * x).astype(x.dtype))
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
