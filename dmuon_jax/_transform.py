"""The ``scale_by_dmuon`` gradient transformation and its state."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _assign,
  _checks,
  _gather,
  _mesh,
  _owner_layout,
  _owner_update,
  _routing,
  _steps,
)

NsCoeffs = (
  str | tuple[float, float, float] | Sequence[tuple[float, float, float]]
)
WeightDimNumbers = (
  optax.contrib.MuonDimensionNumbers
  | Any
  | Callable[[optax.Params], Any]
  | None
)

PADDED_MSG = (
  'dmuon: Muon param(s) {leaves} are sharded unevenly (a sharded dimension '
  'does not divide by its devices); their momentum is held and exchanged '
  'zero-padded ({extra} more elements than the params, {pct:.1f}% of the '
  "layout's Muon elements). The numbers are unchanged. To avoid the "
  'padding, shard a dimension that divides by its devices, or replicate '
  'these params (layout.summary() lists them).'
)


# What a preconditioning other than Frobenius needs with a TP axis.
_NO_TP = 'tensor_parallel_axis=None'

# The options of scale_by_dmuon that make_config validates (by name).
_CONFIG = (
  'ns_coeffs ns_steps momentum nesterov adaptive preconditioning '
  'ns_algorithm compute_dtype mu_dtype nonfinite'
).split()


class ScaleByDMuonState(NamedTuple):
  """State for :func:`dmuon_jax.scale_by_dmuon`.

  The step count and the Muon momentum, laid out by owner: each device's
  block of ``mu`` holds the momentum of the matrices it owns only. The
  layout (owner plan, buffer order, tensor-parallel split, the params'
  shardings) is static metadata of ``mu``, so ``update``, checkpoints
  (:mod:`dmuon_jax.checkpoint`) and :func:`dmuon_jax.owner_layouts` read it
  from the state itself.

  Attributes:
    count: the number of updates applied, an ``int32`` scalar.
    mu: the momentum, a :class:`dmuon_jax.OwnerBuffers` (flat buffers, one
      per dtype, sharded over the owner axes, and their
      :class:`dmuon_jax.OwnerLayout`).
    stamp: the layout that wrote ``mu``, as data (two ``uint32`` scalars
      under layout-independent keys, ``'stamp_marker'`` and ``'stamp'``). A checkpoint of another
      layout restored with orbax's ``partial_restore=True`` restores the
      stamp but not the momentum (whose keys name the layout): the
      restored tree then raises a ``ValueError`` naming
      :mod:`dmuon_jax.checkpoint`, instead of training on zero momentum.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> tx = dmuon_jax.scale_by_dmuon()
    >>> state = tx.init({'w': jnp.ones((4, 8))})
    >>> type(state).__name__, int(state.count)
    ('ScaleByDMuonState', 0)
    >>> [b.shape for b in state.mu.buffers]  # one slot: all 32 elements
    [(32,)]
  """

  count: jax.Array  # shape=(), dtype=int32
  # The Muon momentum in owner buffers; their layout (owner plan, buffer
  # order, TP split, the params' shardings) is the buffers' static metadata.
  mu: _owner_layout.OwnerBuffers
  # Which layout wrote mu, as data (restored with the layout-independent
  # leaves, checked against mu's layout whenever the tree is rebuilt).
  stamp: _owner_update.LayoutStamp


@dataclasses.dataclass(frozen=True, eq=False)
class _Setup:
  """What ``scale_by_dmuon``'s arguments fix (validated once, at the call)."""

  cfg: _owner_update.OwnerConfig
  hp: _owner_update.Hyperparams
  mesh: Any
  axis_names: Any
  tensor_parallel_axis: str | None
  weight_dimension_numbers: Any
  param_specs: dict[str, P] | None
  owner_groups: Any


def _holders(params: Any) -> list[Any]:
  """Per array leaf, what holds it: its ``nnx.Variable`` or Linen box
  (``nn.Partitioned``, ``nn.LogicallyPartitioned``), else the leaf."""
  leaves = jax.tree.leaves(params)
  holders = jax.tree.leaves(params, is_leaf=_mesh.is_boxed)
  holders = [h for h in holders if not _mesh.is_boxed(h) or jax.tree.leaves(h)]
  if len(holders) != len(leaves):
    return leaves  # a box holding several arrays
  return holders


def _layout(setup: _Setup, params, holders, specs, mesh):
  """The state's :class:`dmuon_jax.OwnerLayout`: the params' shardings read
  once (``specs``: under the logical axis rules in effect), their owner
  plan, and where the momentum is kept."""
  leaves = jax.tree.leaves(params)
  targets = _routing.route(
    params,
    predicate=lambda path, leaf: True,
    weight_dimension_numbers=setup.weight_dimension_numbers,
  ).specs
  paths = [t.path for t in targets]  # (every leaf is a Muon target)
  given = setup.param_specs or {}
  # The state's structure (plan, padding, TP splits) is read from the
  # specs that do not depend on the logical axis rules in effect, so that
  # jax.eval_shape(init) outside the rules and jax.jit(init) inside them
  # give equal trees; the rules' answer only steers the update's routes.
  axes = tuple(mesh.axis_names) if mesh is not None else ()
  free = [_mesh.context_free_spec(h, axes) for h in holders]
  known = [given.get(path, spec) for path, spec in zip(paths, free)]
  info = _mesh.resolve(
    mesh,
    setup.axis_names,
    setup.tensor_parallel_axis,
    sharded_axes=_mesh.sharded_axes(known),
  ) or _mesh.MeshInfo(None, {}, (), None)  # (no mesh: one slot, no axes)
  sizes, owner_axes, tp_axis = info.sizes, info.owner_axes, info.tp_axis
  tp_size = info.tp_size
  # (tp_axis: None unless the mesh splits matrices over more than one device)
  _checks.check_preconditioning(
    setup.cfg.preconditioning, tp_axis=tp_axis, otherwise=_NO_TP
  )
  # Per leaf: its sharding entries (None where its spec is unknown), TP
  # split and dim, the shape the layout holds (one TP shard's, zero-padded)
  # and its padded shape (None where even).
  rows = []
  for spec, leaf in zip(known, targets):
    if info.num_slots * tp_size == 1:
      spec = P()
    if spec is None:
      rows.append((None, None, None, tuple(leaf.shape), None))
      continue
    e, shape, split, dim, held = _steps.resolve_entries(
      leaf, spec, sizes, owner_axes, tp_axis, tp_size
    )
    # Uneven sharding (JAX accepts it): the layout holds the leaf
    # zero-padded to a multiple of its devices per sharded dimension.
    padded = None if shape == tuple(leaf.shape) else shape
    rows.append((e, split, dim, held, padded))
  entries, splits, dims, local, padded = tuple(zip(*rows)) or ((),) * 5
  plan = _assign.plan_ownership(
    jax.tree.unflatten(
      jax.tree.structure(params),
      [jax.ShapeDtypeStruct(s, x.dtype) for x, s in zip(leaves, local)],
    ),
    {a: sizes[a] for a in owner_axes},
    predicate=lambda path, leaf: True,
    weight_dimension_numbers=setup.weight_dimension_numbers,
    ns_steps=len(setup.cfg.coeffs),
    ns_algorithm=setup.cfg.ns_algorithm,
    owner_groups=_checks.check_option(setup.owner_groups, tp_axis=tp_axis),
    shard_counts={
      i: tuple(math.prod(sizes[a] for a in d) for d in e)
      for i, e in enumerate(entries)
      if e is not None
    },
    # A padded leaf is orthogonalized by one owner (on its own rows and
    # columns, see _layout.Layout.crops), never sliced over a group.
    ungroupable=[i for i, p in enumerate(padded) if p is not None],
  )
  records = [
    _owner_layout.TargetLeaf(
      index=i,
      path=paths[i],
      shape=tuple(x.shape),
      dtype=jnp.dtype(x.dtype).name,
      group=0,
      tp_dim=dims[i],
      padded=padded[i],
    )
    for i, x in enumerate(leaves)
  ]
  layout = _owner_layout.OwnerLayout.build(
    [plan],
    records,
    dtype_of={
      s.leaf_index: setup.cfg.mu_dtype or leaves[s.leaf_index].dtype
      for s in plan.leaves
    },
    split_of=dict(enumerate(splits)),
    buffer_axes=plan.axis_names,
    buffer_sizes=plan.mesh_shape,
    tp_axis=tp_axis,
    tp_size=tp_size,
    mesh=info.abstract,
    # The update routes each leaf from its context-free sharding where
    # known, else from the one the logical axis rules in effect here give.
    param_entries=[
      e
      if e is not None or info.abstract is None or paths[i] in given
      else _steps.fitting(records[i], specs[i], sizes, owner_axes)
      for i, e in enumerate(entries)
    ],
  )
  return dataclasses.replace(
    layout,
    momentum=layout.placement(
      [free[t.index] for t in layout.leaves],
      [_mesh.sharding_names(holders[t.index]) for t in layout.leaves],
    ),
  )


def _init(setup: _Setup, params: optax.Params) -> ScaleByDMuonState:
  with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  # Names a leaf that is not an array (an unfiltered Equinox model's
  # function) before anything reads shapes or devices.
  _routing.check_array_leaves(with_path)
  holders = _holders(params)
  # Each leaf's spec as the logical axis rules in effect here give it.
  specs = [_mesh.leaf_spec(h) for h in holders]
  mesh = setup.mesh if setup.mesh is not None else _mesh.context_mesh()
  if mesh is None:
    found = (_mesh.array_mesh(x) for _, x in with_path)
    mesh = next((m for m in found if m is not None), None)
  _mesh.check_devices(params, mesh)
  layout = _layout(setup, params, holders, specs, mesh)
  uneven, extra = layout.padding()
  if uneven:  # warned once per layout
    total = sum(math.prod(t.shape) for t in layout.leaves)
    _steps.warn_once(
      PADDED_MSG.format(
        leaves=', '.join(f'{t.path} {t.shape}->{t.padded}' for t in uneven),
        extra=extra,
        pct=100 * extra / max(total, 1),
      ),
    )
  count = jnp.zeros([], jnp.int32)
  replicate = None
  if layout.distributed:  # replicated on the mesh, eagerly as under jit
    replicate = functools.partial(_mesh.place, mesh=mesh, spec=P())
    count = replicate(count)
  # Boxed params (Linen boxes, nnx Variables) give boxed buffers: Flax's
  # sharding tools (nn.get_sharding, nnx.get_partition_spec, ...) then read
  # the buffers' layout from the state as they read the params'.
  template = next((h for h in holders if _mesh.is_boxed(h)), None)
  buffers = []
  for b, shape in enumerate(layout.buffer_shapes()):
    buf = jnp.zeros(shape.shape, shape.dtype)
    spec = layout.buffer_spec(b)  # None: a per-leaf buffer of unknown spec
    if layout.distributed and spec is not None:
      buf = _mesh.place(buf, mesh, spec)
    if layout.per_leaf:
      # Each Muon leaf's momentum, sharded and boxed as the leaf (Flax's
      # sharding tools map its logical names by the same rules).
      buf = _mesh.rebox(holders[layout.leaves[b].index], buf)
    elif template is not None:
      buf = _mesh.box_like(template, buf, spec)
    buffers.append(buf)
  return ScaleByDMuonState(
    count=count,
    mu=_owner_layout.OwnerBuffers(buffers, layout),
    stamp=_owner_update.make_stamp(layout, replicate),
  )


def _update(setup: _Setup, updates, state, params=None):
  del params
  if not isinstance(getattr(state, 'mu', None), _owner_layout.OwnerBuffers):
    raise TypeError(
      "dmuon: update() takes the state made by this transformation's "
      f'init(); got {type(state).__name__}.'
    )
  layout = state.mu.layout
  with_path, treedef = jax.tree_util.tree_flatten_with_path(updates)
  _checks.check_same_leaves(
    [(_routing.normalize_path(k), tuple(np.shape(x))) for k, x in with_path],
    [(t.path, t.shape) for t in layout.leaves],
    'update()',
  )
  # (Every leaf is a Muon target: layout.leaves are the leaves, in order.)
  targets = [x for _, x in with_path]
  count_inc = optax.safe_increment(state.count)
  mus = state.mu.buffers
  # The one dispatch of the drop-in transformation: one owner slot (no
  # routes), inside the caller's shard_map over the owner axes (explicit),
  # or global arrays under plain jit (drop-in; per-leaf momentum there).
  # (One slot packs directly: the explicit step's exchange there costs
  # temporary memory and FLOPs for no communication.)
  cfg, hp, lay = setup.cfg, setup.hp, layout.groups[0]
  if not layout.distributed:
    _steps.check_buffers(layout, mus, local=False)
    ortho, mu = _owner_update.owner_step(
      cfg, hp, layout, lay.pack_full(targets), mus, count_inc
    )
    new = lay.unpack_full(ortho)
  elif set(layout.buffer_axes) & _gather.manual_axes():
    new, mu = _steps.explicit_step(cfg, hp, layout, targets, mus, count_inc)
  else:
    # Per target the layout records no spec of, the one its update's Flax
    # holder gives now (boxed gradients under the logical axis rules).
    specs = None
    if any(e is None for e in layout.param_entries):
      holders = _holders(updates)
      specs = [
        _mesh.leaf_spec(holders[t.index]) if e is None else None
        for t, e in zip(layout.leaves, layout.param_entries)
      ]
    new, mu = _steps.drop_in_step(setup, layout, targets, mus, count_inc, specs)
  new, state = finish(state, count_inc, mu, new, targets, lay.leaf_dtypes)
  return jax.tree.unflatten(treedef, new), state


def finish(state, count_inc, mu, out, grads, mu_dtypes):
  """The one tail of an owner update (drop-in and dedicated): the updates
  in optax.contrib.muon's dtype, the momentum's (``mu_dtypes``: mu_dtype,
  else the params' dtype) promoted with the gradient's (e.g. float32
  updates for float32 params and bfloat16 gradients), and the state with
  the new count and momentum ``mu``, boxed as it came."""
  out = [
    x.astype(jnp.result_type(jnp.dtype(d), g.dtype))
    for x, g, d in zip(out, grads, mu_dtypes, strict=True)
  ]
  return out, state._replace(count=count_inc, mu=state.mu.rebox(mu))


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
    'frobenius', 'spectral', 'aol', 'schatten'
  ] = 'frobenius',
  weight_dimension_numbers: WeightDimNumbers = None,
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
  r"""Muon's momentum orthogonalization, each matrix owned by one device.

  The building block of :func:`dmuon_jax.dmuon` (see there), without shape
  scaling, weight decay or learning rate, like
  ``optax.contrib.scale_by_muon``. Every leaf it sees is a Muon target:
  route other leaves elsewhere (e.g. with ``optax.partition``).

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
  from :func:`dmuon_jax.plan_ownership`. The momentum lives in flat buffers
  (one per dtype) sharded over the owner axes: each device keeps its own
  matrices only. The state records its layout (owner plan, buffer order,
  tensor-parallel split and the params' shardings) as static metadata of
  its :class:`dmuon_jax.OwnerBuffers`, so ``update``, checkpoints and
  diagnostics read it from the state; ``init`` gives the same state eagerly
  and under ``jax.jit``.

  Sharding (with a mesh of N > 1 owner slots), per step:

  * gradients already reduced (drop-in, under plain ``jit``): one
    ``shard_map``. Replicated leaves need no communication to reach their
    owners and come back by one ``all_gather``. Leaves sharded along matrix
    dimensions (rows, columns or both, over any owner axes; size-1 axes are
    ignored) reach their owners by one ``all_to_all`` over their sharding
    axes and come back by the same all-to-all reversed, followed by one
    ``all_gather`` over the other owner axes (HSDP's ``'replicate'``; the
    bytes of one all-to-all over all owner axes). Leaves sharded along a
    stack axis are gathered whole (warned once).
  * per-device gradients (explicit path, inside the caller's ``shard_map``,
    see :func:`dmuon_jax.local_value_and_grad`): one ``psum_scatter`` per
    owner axis (innermost first) to the owners, divided by N, and one
    ``all_gather`` back.

  Newton–Schulz runs on each device for its own matrices only (one
  program: per matrix type a loop over the device's own matrices, read
  from tables by its slot), with no collective inside a conditional or such
  a loop: owner-group and tensor-parallel matrices run in stages, their
  collectives between the stages on every device.

  Owner groups: once devices outnumber the large matrices, a matrix alone
  sets the busiest device's work. Such matrices are split into slices of
  their long side owned by several devices of the innermost owner axis (an
  :class:`dmuon_jax.OwnerGroup`), which orthogonalize them together with
  Gram Newton–Schulz: one reduce-scatter over that axis per restart window
  brings the summed Gram to one device, which runs the small iteration
  alone, and one all-gather returns the factor.

  Where the params' shardings come from (for the routes above): their
  arrays at ``init`` (placed arrays, ``jax.ShapeDtypeStruct`` with a
  sharding, tracers on meshes with Explicit axes) or their Flax metadata
  (``nnx.Variable`` ``out_sharding``; Linen ``nn.Partitioned`` names and
  ``nn.LogicallyPartitioned`` names under its rules or the active
  ``nn.logical_axis_rules``; also under ``jax.jit`` and ``jax.eval_shape``),
  else ``param_specs``. Unboxed tracers on Auto meshes carry none: the
  state then records them as unknown, and the first ``update`` warns
  (:class:`dmuon_jax.DMuonWarning`) and treats them as replicated. On
  Explicit meshes the update reads the gradients' shardings from their
  types.

  Flax-boxed params give a boxed state: each owner buffer is then an
  ``nn.Partitioned`` (Linen boxes) or an ``nnx.Variable`` (with
  ``out_sharding``) holding its own sharding, so ``nn.get_sharding``,
  ``nn.get_partition_spec`` (+ ``nn.logical_to_mesh_sharding``) and
  ``nnx.get_partition_spec`` of the (abstract) state give the buffers their
  layout's sharding. ``update`` takes boxed or unboxed gradients and state
  and returns them boxed as they came. A state whose buffers arrive in
  another sharding (e.g. ``out_shardings`` forcing ``P()``) is warned about
  once, naming the bytes it costs.

  Tensor parallelism (drop-in path): on a mesh with a ``tensor_parallel_axis``
  (e.g. ``('replicate', 'shard', 'model')``), owners range over the other
  axes and a Muon leaf may be sharded over the TP axis along one matrix
  dimension (Megatron column-parallel: output axis; row-parallel: reduction
  axis). Every TP shard of the owner then keeps the momentum of its own
  slice, and the owner's TP shards orthogonalize the matrix together with
  Gram Newton–Schulz: one all-reduce over the TP axis of the Gram matrix of
  the unsplit dimension per restart window, no gather of the matrix.
  Matrices replicated over the TP axis are orthogonalized by each TP shard
  of their owner.

  Args:
    ns_coeffs: Newton–Schulz coefficients: a preset name (see
      :data:`dmuon_jax.NS_COEFF_PRESETS`), one ``(a, b, c)`` triple used at
      every iteration, or one triple per iteration. Static.
    ns_steps: number of iterations for a single triple (default 5); for a
      per-iteration array it must be None or equal its length. Static: not
      injectable with ``optax.inject_hyperparams``.
    beta: momentum decay rate (injectable).
    eps: added to the normalizing norm (injectable).
    mu_dtype: momentum dtype (default: the gradient's dtype); a dtype or its
      name.
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
      the matrices; if None, the mesh from ``jax.set_mesh``, else the
      mesh the params are placed on, else one device. Static.
    axis_names: mesh axes that owners range over (default: those of more
      than one device but ``tensor_parallel_axis``). Static.
    ns_algorithm: ``'auto'`` (per matrix shape, the form with fewer matmul
      FLOPs by the planner's cost model: Gram for aspect ratios above about
      1.5, direct otherwise), ``'standard'`` (direct iteration) or
      ``'gram'`` (Gram Newton–Schulz). TP-split matrices always use the
      Gram form. Static.
    compute_dtype: dtype of the Newton–Schulz matmuls (default: the
      momentum's); the normalization is always done in float32.
    tensor_parallel_axis: the mesh axis that splits matrices (tensor
      parallelism), if the mesh has it. ``'auto'`` (default): the axis named
      ``'model'``, ``'tensor'`` or ``'tp'`` (size > 1) that the Muon params
      are sharded over, decided at ``init``; an axis of those names that no
      Muon param is sharded over holds owners like any other, and two
      candidates raise a ``ValueError`` asking to choose. None: no TP axis.
      Static.
    nonfinite: what a NaN or Inf does. ``'skip'`` (default): if any
      gradient, new momentum or update is non-finite, on any device (the
      explicit path reduces the flag over the owner axes), the step is
      skipped: zero updates, momentum and count unchanged. ``'propagate'``:
      as optax, NaN/Inf flow into the updates and the momentum.
      ``optax.apply_if_finite`` (which checks the gradients itself)
      composes with both; under ``'skip'`` the steps it lets through after
      ``max_consecutive_errors`` still leave the state clean. Finite
      gradients never give NaN/Inf either way: matrices with entries above
      1024 are divided by a power of two before Newton–Schulz, so that its
      float32 norms cannot overflow. Static.
    param_specs: (optional) the params' shardings, for when ``init`` cannot
      see them (abstract values or tracers on a mesh with Auto axes): a
      tree like the params with ``PartitionSpec``, ``NamedSharding`` or
      None leaves (a prefix is not enough; leaves are matched by path).
    owner_groups: (optional, default ``'auto'``) ``'auto'`` lets the
      planner split matrices over owner groups where that lowers the
      predicted step (see :func:`dmuon_jax.plan_ownership`); an int ``k``
      splits every Muon matrix over ``k`` devices; None never splits. Not
      with a tensor-parallel axis ('auto' then never splits). Static.

  Returns:
    A ``optax.GradientTransformation`` whose state is a
    :class:`ScaleByDMuonState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import dmuon_jax
    >>> tx = optax.chain(dmuon_jax.scale_by_dmuon(),
    ...                  dmuon_jax.scale_by_shape(),
    ...                  optax.scale_by_learning_rate(0.02))
    >>> params = {'w': jnp.ones((4, 8))}
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.eye(4, 8)}
    >>> updates, state = tx.update(grads, state, params)
    >>> updates['w'].shape
    (4, 8)
  """
  return make_scale_by_dmuon(locals())


def make_scale_by_dmuon(
  options: dict[str, Any], shape_scaling: bool = False
) -> optax.GradientTransformation:
  """:func:`scale_by_dmuon` from ``options``, its arguments by name (with
  ``consistent_rms`` where the shape factor is applied on the owner:
  ``shape_scaling``, what :func:`dmuon_jax.dmuon` uses), validated once,
  here, into the frozen :class:`_Setup`."""
  o = options
  cfg, hp = owner_config(o, shape_scaling)
  mesh = o['mesh']
  # A function closing over a Mesh (a Mesh itself has no closure).
  if callable(mesh) and any(
    isinstance(getattr(c, 'cell_contents', None), jax.sharding.Mesh)
    for c in getattr(mesh, '__closure__', None) or ()
  ):
    raise TypeError(
      'dmuon: mesh is a function wrapping a jax.sharding.Mesh: '
      'optax.inject_hyperparams treats every callable argument as a '
      'schedule, and a Mesh is callable (it is a context decorator), so it '
      "was called with the step count. Pass static_args=('mesh',) to "
      'inject_hyperparams, or leave mesh out: dmuon then uses the mesh of '
      'jax.set_mesh(...) or the mesh the params are placed on.'
    )
  # (resolve raises a TypeError naming any other mesh it gets)
  info = _mesh.resolve(mesh, o['axis_names'], o['tensor_parallel_axis'])
  _checks.check_preconditioning(
    o['preconditioning'],
    tp_axis=None if info is None else info.tp_axis,
    otherwise=_NO_TP,
  )
  # The params' shardings given as a tree, as {path: spec}.
  param_specs = None
  if o['param_specs'] is not None:
    is_spec = lambda x: x is None or isinstance(x, (P, jax.sharding.Sharding))
    param_specs = {}
    for keys, x in jax.tree_util.tree_flatten_with_path(
      o['param_specs'], is_leaf=is_spec
    )[0]:
      if isinstance(x, jax.sharding.NamedSharding):
        x = x.spec
      elif isinstance(x, jax.sharding.Sharding):
        x = P()
      elif x is not None and not isinstance(x, P):
        raise TypeError(
          f'dmuon: param_specs has {x!r} at {_routing.normalize_path(keys)!r}'
          '; expected a PartitionSpec, a NamedSharding or None.'
        )
      param_specs[_routing.normalize_path(keys)] = x
  # A concrete array (optax.inject_hyperparams injects int arguments) is
  # read as its int; 'auto' becomes None where groups cannot run (other
  # preconditionings, the direct form only), a forced k there raises.
  owner_groups = o['owner_groups']
  if owner_groups is not None and not isinstance(owner_groups, str):
    owner_groups = _owner_update.static_int(owner_groups, 'owner_groups')
  setup = _Setup(
    cfg,
    hp,
    mesh,
    o['axis_names'],
    o['tensor_parallel_axis'],
    o['weight_dimension_numbers'],
    param_specs,
    _checks.check_option(
      owner_groups,
      preconditioning=o['preconditioning'],
      ns_algorithm=o['ns_algorithm'],
    ),
  )
  tx = optax.GradientTransformation(
    functools.partial(_init, setup), functools.partial(_update, setup)
  )
  # 'skip': the guard of dmuon and dedicated_muon's whole step, on this one.
  return _owner_update.skip_nonfinite(tx) if o['nonfinite'] == 'skip' else tx


def owner_config(
  options: dict[str, Any], shape_scaling: bool
) -> tuple[_owner_update.OwnerConfig, _owner_update.Hyperparams]:
  """The owner update's static config and numeric hyperparameters from a
  factory's arguments by name (``scale_by_dmuon``'s, or
  ``scale_by_dedicated_muon``'s with its dedication's ``ns_algorithm``),
  validated once, here."""
  rms = options.get('consistent_rms')
  hp = _owner_update.make_hyperparams(
    beta=options['beta'],
    eps=options['eps'],
    consistent_rms=rms,
    weight_decay=options.get('weight_decay'),
  )
  cfg = _owner_update.make_config(
    shape_scaling=shape_scaling,
    consistent_rms=rms is not None,
    **{k: options[k] for k in _CONFIG if k in options},
  )
  return cfg, hp


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
  :func:`dmuon_jax.dmuon` applies the same factor on the owners; this
  transformation is for chains built on :func:`scale_by_dmuon`.

  Args:
    weight_dimension_numbers: as for :func:`scale_by_dmuon`.
    consistent_rms: optional target RMS; None selects width scaling.

  Returns:
    A stateless ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> tx = dmuon_jax.scale_by_shape()
    >>> updates = {'tall': jnp.ones((8, 2)), 'wide': jnp.ones((2, 8))}
    >>> scaled, _ = tx.update(updates, tx.init(updates))
    >>> float(scaled['tall'][0, 0]), float(scaled['wide'][0, 0])  # sqrt(4)
    (1.0, 2.0)
    >>> tx = dmuon_jax.scale_by_shape(consistent_rms=0.2)
    >>> round(float(tx.update(updates, tx.init(updates))[0]['wide'][0, 0]), 4)
    0.5657
  """

  def update_fn(updates, state, params=None):
    del params
    specs = _routing.route(
      updates,
      predicate=lambda path, leaf: True,
      weight_dimension_numbers=weight_dimension_numbers,
    ).specs
    leaves, treedef = jax.tree.flatten(updates)
    out = [
      (
        _owner_update.shape_scale(*spec.matrix_shape, consistent_rms) * x
      ).astype(x.dtype)
      for x, spec in zip(leaves, specs, strict=True)
    ]
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def owner_layouts(opt_state: Any) -> list[_owner_layout.OwnerLayout]:
  """The owner layouts of every dmuon state in an optimizer state.

  Args:
    opt_state: any optimizer state (``dmuon``, ``dedicated_muon``, or any
      optax wrapper or composition holding them: ``chain``, ``named_chain``,
      ``partition``, ``masked``, ``MultiSteps``, ``apply_if_finite``,
      ``inject_hyperparams``; also ``nnx.Optimizer``'s ``opt_state``).

  Returns:
    One :class:`dmuon_jax.OwnerLayout` per owner-buffer tree, in tree order;
    ``layout.summary()`` and ``layout.plans`` describe each.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> state = dmuon_jax.dmuon(0.02).init({'layers_0': {'w': jnp.ones((4, 8))}})
    >>> [layout.num_slots for layout in dmuon_jax.owner_layouts(state)]
    [1]
  """
  is_buffers = lambda x: isinstance(x, _owner_layout.OwnerBuffers)
  found = jax.tree.leaves(opt_state, is_leaf=is_buffers)
  return [x.layout for x in found if is_buffers(x)]
