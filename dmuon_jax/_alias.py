"""Muon for matrices, AdamW for everything else: :func:`dmuon` and
:func:`dedicated_muon`, one composition (:func:`muon_adamw`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from dmuon_jax import (
  _checks,
  _gather,
  _mesh,
  _owner_update,
  _routing,
  _steps,
  _transform,
)
from dmuon_jax._dedication import (
  DedicatedParams,
  Dedication,
  scale_by_dedicated_muon,
)

# The options that dmuon and dedicated_muon forward, by name, from the one
# dict of their arguments: to their Muon transformation, and to AdamW.
_MUON = (
  'ns_coeffs ns_steps beta eps mu_dtype nesterov adaptive preconditioning '
  'momentum compute_dtype consistent_rms'
).split()
_ADAM = ('adam_b1', 'adam_b2', 'adam_eps_root', 'adam_weight_decay')
_DMUON = (
  'mesh axis_names ns_algorithm tensor_parallel_axis param_specs owner_groups'
).split()


def _route(params, predicate, dims) -> _routing.Routing:
  return _routing.route(
    params,
    predicate=predicate,
    weight_dimension_numbers=dims,
    dims_arg='muon_weight_dimension_numbers',
  )


def muon_labels(
  params: optax.Params,
  *,
  predicate: Callable[[str, Any], bool] | Literal['optax'] | None = None,
  muon_weight_dimension_numbers: _transform.WeightDimNumbers = None,
) -> optax.Params:
  """Labels each leaf ``'muon'`` or ``'adam'`` as :func:`dmuon` routes it.

  Args:
    params: a params tree (arrays or ``jax.ShapeDtypeStruct``).
    predicate: as for :func:`dmuon`.
    muon_weight_dimension_numbers: as for :func:`dmuon`.

  Returns:
    A tree of the structure of ``params`` with ``'muon'`` or ``'adam'``
    leaves.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> params = {'embed': jnp.ones((16, 8)), 'w': jnp.ones((8, 8)),
    ...           'norm': jnp.ones(8)}
    >>> dmuon_jax.muon_labels(params)
    {'embed': 'adam', 'norm': 'adam', 'w': 'muon'}
    >>> dmuon_jax.muon_labels(params, predicate='optax')  # optax's rule
    {'embed': 'muon', 'norm': 'adam', 'w': 'muon'}
  """
  specs = _route(params, predicate, muon_weight_dimension_numbers).specs
  return jax.tree.unflatten(
    jax.tree.structure(params), ['adam' if s is None else 'muon' for s in specs]
  )


def routing_summary(
  params: optax.Params,
  *,
  predicate: Callable[[str, Any], bool] | Literal['optax'] | None = None,
  muon_weight_dimension_numbers: _transform.WeightDimNumbers = None,
) -> str:
  """The one-line routing summary :func:`dmuon` logs on its first ``init``.

  It counts the leaves and elements that go to Muon and to AdamW (as
  :func:`muon_labels` labels them) and names the leaves that
  ``optax.contrib.muon`` with the same ``muon_weight_dimension_numbers``
  routes otherwise (e.g. embeddings, heads and ``1 x n`` kernels, which the
  default rule sends to AdamW).

  Args:
    params: a params tree (arrays or ``jax.ShapeDtypeStruct``).
    predicate: as for :func:`dmuon`.
    muon_weight_dimension_numbers: as for :func:`dmuon`.

  Returns:
    The summary line.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> params = {'embed': jnp.ones((64, 8)), 'w': jnp.ones((8, 8))}
    >>> print(dmuon_jax.routing_summary(params))  # doctest: +NORMALIZE_WHITESPACE
    dmuon routing: Muon 1 leaf (64 elements, 11.1%), AdamW 1 leaf (512
    elements); optax.contrib.muon would orthogonalize 1 of the AdamW leaves:
    'embed' (64, 8) (predicate='optax' routes as optax)
  """
  return _route(params, predicate, muon_weight_dimension_numbers).summary


def dmuon(
  learning_rate: optax.ScalarOrSchedule,
  ns_coeffs: _transform.NsCoeffs = 'jordan',
  ns_steps: int | None = None,
  beta: jax.typing.ArrayLike = 0.95,
  eps: jax.typing.ArrayLike = 1e-8,
  weight_decay: jax.typing.ArrayLike = 0.0,
  weight_decay_mask: Any | Callable[[optax.Params], Any] | None = None,
  mu_dtype: jax.typing.DTypeLike | None = None,
  *,
  nesterov: bool = True,
  adaptive: bool = False,
  preconditioning: Literal[
    'frobenius', 'spectral', 'aol', 'schatten'
  ] = 'frobenius',
  adam_b1: jax.typing.ArrayLike = 0.9,
  adam_b2: jax.typing.ArrayLike = 0.999,
  adam_eps_root: jax.typing.ArrayLike = 0.0,
  adam_weight_decay: jax.typing.ArrayLike = 0.0,
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  muon_weight_dimension_numbers: _transform.WeightDimNumbers = None,
  consistent_rms: jax.typing.ArrayLike | None = None,
  predicate: Callable[[str, Any], bool] | Literal['optax'] | None = None,
  momentum: Literal['optax', 'sgd'] = 'optax',
  mesh: jax.sharding.Mesh | None = None,
  axis_names: Sequence[str] | None = None,
  ns_algorithm: Literal['auto', 'standard', 'gram'] = 'auto',
  compute_dtype: jax.typing.DTypeLike | None = None,
  tensor_parallel_axis: str | None = 'auto',
  nonfinite: Literal['skip', 'propagate'] = 'skip',
  param_specs: Any = None,
  owner_groups: int | Literal['auto'] | None = 'auto',
) -> optax.GradientTransformation:
  r"""Muon with each weight matrix owned by one device of a mesh.

  A drop-in for ``optax.contrib.muon`` (same arguments, same meaning, same
  numbers on one device) that adds ownership: every Muon matrix is
  orthogonalized by exactly one device of ``mesh``, which alone keeps its
  momentum. Muon targets get

  .. math::
    W \leftarrow W - \eta \left( s \cdot \mathrm{NS}(\hat M) + \lambda W
    \right)

  where :math:`\hat M` is the (Nesterov) momentum of
  :func:`dmuon_jax.scale_by_dmuon`, :math:`s` the shape factor of
  :func:`dmuon_jax.scale_by_shape` (``consistent_rms``), :math:`\lambda` the
  ``weight_decay`` and :math:`\eta` the ``learning_rate``. All other leaves
  are updated by ``optax.adamw`` with the ``adam_*`` arguments.

  Which leaves are Muon targets:

  * ``predicate='optax'``: ``optax.contrib.muon``'s rule, leaf for leaf:
    every 2-D leaf (embeddings, heads and ``1 x n`` kernels included), or,
    with ``muon_weight_dimension_numbers``, the leaves whose entry is a
    ``MuonDimensionNumbers``.
  * a callable ``predicate``: leaves where ``predicate(path, leaf)`` is true
    (and, if ``muon_weight_dimension_numbers`` is given too, whose entry is
    not None). ``path`` is ``'/'``-joined, e.g. ``'layers/0/attn/q/kernel'``.
  * else ``muon_weight_dimension_numbers`` given: leaves whose entry is a
    ``MuonDimensionNumbers`` (optax's rule).
  * else (the default) :func:`dmuon_jax.default_muon_predicate`: 2-D
    matrices with both dimensions > 1 that are not embeddings, output heads,
    norms or biases (optax would also send embeddings, the LM head and
    ``1 x n`` kernels to Muon).

  A Muon target of rank > 2 needs dimension numbers (a stack of matrices and
  one flattened matrix are both possible readings). On its first ``init``
  the optimizer logs the routing (logger ``'dmuon_jax'``, level INFO, the
  line of :func:`dmuon_jax.routing_summary`: leaves and elements on Muon
  and AdamW, and the leaves optax would route otherwise) and warns
  (:class:`dmuon_jax.DMuonWarning`) when no leaf goes to Muon.

  Hyperparameters given as numbers are checked at the call (a
  ``ValueError``/``TypeError`` naming the argument): ``learning_rate`` and
  ``adam_learning_rate`` a number >= 0 or a schedule, ``0 <= beta < 1``,
  ``eps > 0``, ``0 <= adam_b1, adam_b2 < 1``, ``adam_eps_root >= 0``
  (optax accepts all of these and diverges or divides by zero later).
  Traced and injected values are used as given.

  Args:
    learning_rate: a scalar or schedule, see
      ``optax.scale_by_learning_rate``.
    ns_coeffs: Newton–Schulz coefficients: ``'jordan'`` (optax's
      ``'standard'``), ``'you'`` (optax's ``'dion'``),
      ``'polar_express_sf1.05'``, a triple, or one triple per iteration.
    ns_steps: iterations for a single triple (default 5); None or the number
      of rows for a per-iteration array. Static.
    beta: momentum decay rate.
    eps: added to normalizing denominators (Newton–Schulz and AdamW).
    weight_decay: decoupled weight decay of Muon targets, multiplied by the
      learning rate as in optax.
    weight_decay_mask: tree or callable of booleans selecting which Muon
      targets decay, as in ``optax.add_decayed_weights``.
    mu_dtype: dtype of the momentum accumulators.
    nesterov: whether to use Nesterov momentum (Muon and AdamW).
    adaptive: scale each orthogonalized matrix by
      :math:`\langle \hat M, \mathrm{NS}(\hat M) \rangle`.
    preconditioning: ``'frobenius'``, ``'spectral'``, ``'aol'`` or
      ``'schatten'``, as in optax.
    adam_b1: AdamW's first-moment decay.
    adam_b2: AdamW's second-moment decay.
    adam_eps_root: AdamW's epsilon inside the square root.
    adam_weight_decay: AdamW's weight decay.
    adam_learning_rate: AdamW's learning rate (default: ``learning_rate``).
    muon_weight_dimension_numbers: ``optax.contrib.MuonDimensionNumbers`` per
      leaf (a tree, a prefix tree, or a callable returning one); None entries
      go to AdamW. Needed for stacked ``(L, m, n)`` leaves
      (``MuonDimensionNumbers(1, 2)``: each of the L matrices is its own unit)
      and attention kernels such as ``(d, heads, head_dim)``.
    consistent_rms: if set, scale updates by
      :math:`\sqrt{\max(\mathrm{fan\_in}, \mathrm{fan\_out})}` times this
      value instead of Jordan's width scaling.
    predicate: (optional, default None: the default rule) ``'optax'`` or a
      ``(path, leaf) -> bool`` selecting Muon targets, see above. Static.
    momentum: ``'optax'`` (bias-corrected EMA, default) or ``'sgd'``
      (DMuon/Moonlight: ``buf = beta * buf + g``, Nesterov ``g + beta * buf``).
      Static.
    mesh: (optional, default None) ``jax.sharding.Mesh`` whose devices own
      the matrices; if None, the mesh from ``jax.set_mesh``, else the
      mesh the params are placed on, else one device. Static (with
      ``optax.inject_hyperparams``, leave it out or list it in
      ``static_args``: a Mesh is callable, so optax would take it for a
      schedule).
    axis_names: mesh axes the owners range over (default: every mesh axis
      of more than one device but the tensor-parallel one, whatever their
      names; an axis of one device is an owner axis only where named).
      Static.
    ns_algorithm: ``'auto'`` (the cheaper form per matrix shape by the
      planner's cost model), ``'standard'`` or ``'gram'`` Newton–Schulz.
      Static.
    compute_dtype: dtype of the Newton–Schulz matmuls (default: the
      momentum's); normalization is always float32.
    tensor_parallel_axis: mesh axis that splits Muon matrices (Megatron
      column/row-parallel layers), if the mesh has it; see
      :func:`dmuon_jax.scale_by_dmuon`. ``'auto'`` (default): the axis named
      ``'model'``, ``'tensor'`` or ``'tp'`` that the Muon params are sharded
      over, if any (such an axis the params are not sharded over holds
      owners like any other). None: no TP axis. Static.
    nonfinite: ``'skip'`` (default): if any gradient (Muon or AdamW leaf, on
      any device), any update or any new state entry is NaN or Inf, the
      whole step is skipped: all updates are zero and the whole state
      (momenta, AdamW moments, counts) stays as it was. This also catches
      AdamW's second moment overflowing float32 (``|g|`` above about 1e19).
      ``'propagate'``: as optax, NaN/Inf flow into updates and state.
      ``optax.apply_if_finite`` (which checks the gradients itself)
      composes with both: it skips and counts bad steps, and once it gives
      up after ``max_consecutive_errors``, ``'skip'`` still keeps the state
      clean. Static.
    param_specs: (optional) the params' shardings (a tree like the params of
      ``PartitionSpec``, ``NamedSharding`` or None), for when ``init`` cannot
      see them: abstract values or tracers on a mesh with Auto axes (see
      :func:`dmuon_jax.scale_by_dmuon`). Static.
    owner_groups: (optional, default ``'auto'``) split matrices that alone
      would set the busiest device's Newton–Schulz over a group of devices
      (see :func:`dmuon_jax.scale_by_dmuon`); an int ``k`` splits every Muon
      matrix over ``k`` devices; None: one owner per matrix. Static.

  Returns:
    A ``optax.GradientTransformation`` (an ``optax.partition`` of a
    Muon chain and AdamW, guarded by the ``nonfinite`` policy).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import dmuon_jax
    >>> params = {'w': jnp.ones((4, 8)), 'b': jnp.zeros((8,))}
    >>> opt = dmuon_jax.dmuon(learning_rate=0.02)
    >>> state = opt.init(params)
    >>> dmuon_jax.muon_labels(params)  # the bias goes to AdamW
    {'b': 'adam', 'w': 'muon'}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = opt.update(grads, state, params)
    >>> jax.tree.map(jnp.shape, updates)
    {'b': (8,), 'w': (4, 8)}

    On one device it computes what ``optax.contrib.muon`` computes:

    >>> ref = optax.contrib.muon(learning_rate=0.02)
    >>> ref_updates, _ = ref.update(grads, ref.init(params), params)
    >>> bool(jnp.allclose(updates['w'], ref_updates['w'], atol=1e-6))
    True
    >>> params = optax.apply_updates(params, updates)

  References:
    Jordan, `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  options = dict(locals())  # the arguments, as given
  _routing.check_predicate(predicate)

  def muon():
    # Checked here, as dedicated_muon's Muon checks it (make_hyperparams).
    _checks.check_numbers(weight_decay=weight_decay)
    return (
      _transform.make_scale_by_dmuon(
        {k: options[k] for k in _MUON + _DMUON}
        | {
          'weight_dimension_numbers': muon_weight_dimension_numbers,
          # The whole step (Muon and AdamW) is guarded by muon_adamw.
          'nonfinite': 'propagate',
        },
        # The owners apply the shape factor (as optax's scale_by_shape).
        shape_scaling=True,
      ),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
    )

  dims = muon_weight_dimension_numbers

  def combine(muon, adam):
    # optax.partition of ``muon`` and ``adam`` as :func:`muon_labels` labels
    # the params. ``init`` logs the routing on its first call (and warns if
    # no leaf goes to Muon), and places the whole state on the owners' mesh
    # (AdamW's counts too), eagerly as under ``jax.jit``. ``update`` names
    # the leaves added or removed since ``init`` (else optax fails on a bare
    # pytree mismatch), and a ``params`` leaf that is not an array (an
    # unfiltered Equinox model: optax.partition fails on its structure).
    inner = optax.partition(
      {'muon': muon, 'adam': adam},
      functools.partial(
        muon_labels, predicate=predicate, muon_weight_dimension_numbers=dims
      ),
    )
    reported = []  # whether init has logged the routing

    def init_fn(params):
      if not reported:
        _checks.report_routing(_route(params, predicate, dims))
        reported.append(True)
      state = inner.init(params)
      if not any(lay.distributed for lay in _transform.owner_layouts(state)):
        return state
      meshes = map(_mesh.array_mesh, jax.tree.leaves(state))
      mesh = next((m for m in meshes if isinstance(m, jax.sharding.Mesh)), None)
      return _mesh.replicate_uncommitted(state, mesh)

    def update_fn(updates, state, params=None):
      _routing.check_array_leaves(params)  # (None has no leaves)
      # The AdamW moments keep init's tree and shapes (Muon leaves as
      # MaskedNode; the Muon chain checks their shapes itself).
      _checks.check_same_tree(
        updates,
        optax.tree_utils.tree_get(state.inner_states['adam'], 'mu'),
        'update()',
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
      )
      return inner.update(updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)

  return muon_adamw(
    options,
    muon,
    # Explicit path: per-device gradients are averaged (pmean) first.
    _steps.mean_over_devices(),
    combine,
  )


def muon_adamw(
  options: dict[str, Any],
  muon: Callable[[], Sequence[optax.GradientTransformation]],
  mean: optax.GradientTransformation,
  combine: Callable[
    [optax.GradientTransformation, optax.GradientTransformation],
    optax.GradientTransformation,
  ],
) -> optax.GradientTransformation:
  """Muon + AdamW, as :func:`dmuon` and :func:`dedicated_muon` compose them.

  ``options``: the alias's arguments (its ``locals()`` at the call). Checks
  ``nonfinite``, the learning rates, ``weight_decay`` and the AdamW
  hyperparameters; then chains ``muon()`` (the Muon transformations, built
  after the checks) with the learning rate, and ``optax.adamw``
  (``adam_learning_rate``, default ``learning_rate``; ``eps``, ``mu_dtype``,
  ``nesterov`` and the ``adam_*`` arguments) after ``mean`` (per-device
  gradients averaged over devices); ``combine(muon, adam)`` joins the two,
  and the ``nonfinite`` policy guards the whole step.
  """
  lr, adam_lr = options['learning_rate'], options['adam_learning_rate']
  _owner_update.check_nonfinite(options['nonfinite'])
  _checks.check_numbers(
    ('adam_learning_rate',),
    learning_rate=lr,
    adam_learning_rate=adam_lr,
    **{k: options[k] for k in _ADAM},
  )
  # Muon first: its checks name a bad mu_dtype before optax.adamw trips on it.
  muon_chain = optax.chain(*muon(), optax.scale_by_learning_rate(lr))
  adam = optax.adamw(
    lr if adam_lr is None else adam_lr,
    **{k: options[k] for k in ('eps', 'mu_dtype', 'nesterov')},
    **{k.removeprefix('adam_'): options[k] for k in _ADAM},
  )
  opt = combine(muon_chain, optax.chain(mean, adam))
  if options['nonfinite'] == 'skip':
    return _owner_update.skip_nonfinite(opt)
  return opt


def _mean_rest(dedication: Dedication) -> optax.GradientTransformation:
  """Averages the non-target gradients over all devices (inside shard_map).

  A sharded param's gradient arrives summed over the manual axes of its
  sharding but the tensor-parallel one (the transpose of
  :meth:`Dedication.gather_rest`'s all-gather); it is divided by their size
  and averaged over the other axes it varies on (not over the TP axis of a
  TP-sharded param: each TP shard holds its own slice).
  """
  mesh, tp_axis = dedication.mesh, dedication.tensor_parallel_axis

  def mean(x, spec, path):
    spec_axes = _mesh.sharded_axes([spec])
    varying = _gather.varying_axes(x)
    if tp_axis in varying and tp_axis not in spec_axes:
      raise ValueError(
        f'dmuon: the gradient of {path!r} differs between the shards of '
        f'the tensor-parallel axis {tp_axis!r} (it is a partial sum '
        'there). Compute gradients with dmuon_jax.local_value_and_grad('
        f'loss, axis_names={dedication.buffer_axes}) so that autodiff '
        'sums TP-replicated params over the TP axis.'
      )
    # Summed over the manual axes its sharding names (the transpose of
    # gather_rest's all-gather), not over the TP axis (a TP-sharded
    # param stays each TP shard's slice) nor over automatic axes
    # (dmuon_jax.flax.train_step's TP axis: the partitioner's).
    summed = {a for a in spec_axes & _gather.manual_axes() if a != tp_axis}
    # Invariant over an axis of a step run whole inside shard_map
    # (dmuon_jax.flax.train_step): autodiff summed it there.
    summed |= _gather.summed_axes() - varying
    if summed:
      x = x / np.prod([mesh.shape[a] for a in summed])
    others = tuple(
      a for a in mesh.axis_names if a in varying - summed - spec_axes
    )
    return jax.lax.pmean(x, others) if others else x

  def update_fn(updates, state, params=None):
    del params
    if mesh is None or not _gather.manual_axes():
      return updates, state
    out = [
      x if x is None else mean(x, spec, path)
      for x, spec, path in zip(
        dedication.treedef.flatten_up_to(updates),
        dedication.rest_specs,
        dedication.leaf_paths,
      )
    ]
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
  options = dict(locals())  # the arguments, as given

  def combine(muon, adam):
    def init_fn(params):
      dedication.check_dedicated(params, 'dedicated_muon init()')
      state = (
        muon.init(params.owned),
        _place_rest(params.rest, adam.init(params.rest)),
      )
      # On the mesh (the step counts too), eagerly as under jax.jit.
      return _mesh.replicate_uncommitted(state, dedication.mesh)

    def _place_rest(rest, state):
      # AdamW's moments sharded as their params (under jax.jit too, where
      # zeros carry no sharding and XLA would replicate them). The rest's
      # tree may hold boxes (Flax's) around the leaves dedicate() saw.
      mesh = dedication.mesh
      if not isinstance(mesh, jax.sharding.Mesh) or mesh.size == 1:
        return state
      shardings = jax.tree.structure(rest).unflatten(
        NamedSharding(mesh, spec)
        for spec in dedication.rest_specs
        if spec is not None
      )
      return optax.tree_map_params(
        adam, lambda x, sh: _mesh.place(x, mesh, sh.spec), state, shardings
      )

    def update_fn(updates, state, params=None):
      dedication.check_dedicated(updates, 'dedicated_muon update()')
      _checks.check_same_tree(
        updates.rest,
        optax.tree_utils.tree_get(state[1], 'mu'),
        'dedicated_muon update()',
      )
      params = DedicatedParams(None, None) if params is None else params
      halves = zip((muon, adam), updates, state, params)  # (owned, rest)
      new = [t.update(u, s, p) for t, u, s, p in halves]
      return DedicatedParams(*(u for u, _ in new)), tuple(s for _, s in new)

    return optax.GradientTransformation(init_fn, update_fn)

  return muon_adamw(
    options,
    lambda: (
      scale_by_dedicated_muon(
        dedication,
        **{k: options[k] for k in _MUON},
        weight_decay=weight_decay,
        weight_decay_mask=weight_decay_mask,
      ),
    ),
    _mean_rest(dedication),
    combine,
  )
