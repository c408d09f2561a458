"""Linen boundary submodules' calls, intercepted to gather (dmuon_jax.flax)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checks, _exchange, _gather, _mesh
from dmuon_jax.flax import _boundary, _model
from dmuon_jax.flax._model import ModelDedication

# A scanned stack's layer indices, beside its owned buffers in the params
# (added by ModelDedication.apply; nn.scan slices them with the layers).
ITERATION = 'dmuon_iteration'


def unbox_linen(params: Any, mesh: Any) -> tuple[Any, list[Any]]:
  """Linen params with their Flax boxes (``nn.Partitioned``,
  ``nn.LogicallyPartitioned``) taken off, an unplaced value put on
  ``mesh`` as its box says; and per leaf its box (or None), to put back."""
  flat, treedef = jax.tree.flatten(params, is_leaf=_mesh.is_box)
  values, boxes = [], []
  for x in flat:
    if not _mesh.is_box(x):
      values.append(x)
      boxes.append(None)
      continue
    v = _mesh.unbox(x)
    spec = _mesh.leaf_spec(x)
    if (
      mesh is not None
      and spec is not None
      and not isinstance(getattr(v, 'sharding', None), NamedSharding)
    ):
      v = jax.device_put(v, NamedSharding(mesh, spec))
    values.append(v)
    boxes.append(x)
  return jax.tree.unflatten(treedef, values), boxes


def plain_dicts(tree: Any) -> Any:
  """Nested dicts (FrozenDicts too) as plain dicts, leaves kept."""
  if hasattr(tree, 'items') and not hasattr(tree, 'shape'):
    return {k: plain_dicts(v) for k, v in tree.items()}
  return tree


@dataclasses.dataclass(frozen=True)
class _Unboxed:
  """A Linen initializer whose Flax box is taken off (see
  :meth:`_Interceptor._fixed`)."""

  init: Callable[..., Any]

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return _mesh.unbox(self.init(*args, **kwargs))


@dataclasses.dataclass
class _Interceptor:
  """The method interceptor of one ``ded.apply`` call: runs a boundary
  module's method (``__call__`` or any other: a ``decode``, an ``attend``)
  on its group's gathered matrices.

  Attributes:
    md: the dedication.
    root: the call's (unboxed) params, where the owned buffers are read.
    traces: per gather group, the trace its first block ran in.
    inner: how many boundary calls are running (their blocks' own
      submodules run as written).
  """

  md: ModelDedication
  root: Any
  traces: dict[int, Any] = dataclasses.field(default_factory=dict)
  inner: int = 0

  def _fixed(self, module):
    """``module`` rebound to its scope with what the call needs, or None.

    ``nn.DenseGeneral`` whose kernel exists: its kernel initializer's Flax
    box taken off. DenseGeneral boxes its initializer's flat 2-D kernel and
    unboxes it with the kernel's N-D partition names before reshaping, and
    Flax runs that initializer again at every call to check the existing
    param's shape (flax issue #3676). Under a mesh context
    (``train_step``'s shard_map is one; so is ``jax.set_mesh``) the
    unboxing is a sharding constraint that fails: too many names for the
    flat kernel, or a manual owner axis. The param exists, so the
    initializer only serves that shape check: it runs unboxed (same shape).

    ``nn.BatchNorm`` without an ``axis_name`` inside ``train_step`` (manual
    owner axes): the owner axes as its ``axis_name``, so that its
    statistics are the global batch's (a pmean of the devices' equal
    shares), as under ``jax.jit``.
    """
    if isinstance(module, nn.DenseGeneral):
      if isinstance(module.kernel_init, _Unboxed) or not module.has_variable(
        'params', 'kernel'
      ):
        return None
      return module.clone(
        parent=module.scope, kernel_init=_Unboxed(module.kernel_init)
      )
    axes = self.md.axes
    if (
      isinstance(module, nn.BatchNorm)
      and module.axis_name is None
      and axes
      and set(axes) <= _gather.manual_axes()
    ):
      return module.clone(parent=module.scope, axis_name=tuple(axes))
    return None

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == 'setup':
      return next_fun(*args, **kwargs)
    fixed = self._fixed(module)
    if fixed is not None:
      return getattr(fixed, context.method_name)(*args, **kwargs)
    md = self.md
    path = tuple(module.path)
    if (
      isinstance(module, nn.DenseGeneral)
      or self.inner
      or path not in md.boundary_paths
    ):
      return next_fun(*args, **kwargs)
    b = md.boundary_paths.index(path)
    ded = md.dedication
    g = _gather.group_of(ded, b)
    cols = {c: plain_dicts(module.variables[c]) for c in module.variables}
    own = cols.pop('params', {})
    bufs = [k for k, (h, _) in enumerate(ded.layout.buffer_index) if h == g]
    scanned = ded.boundaries.scanned[b]
    if scanned:
      local, iteration = _one_layer(md, b, module, len(bufs))
    # The group's whole buffers (a scanned stack's: all its layers').
    whole = [
      _mesh.unbox(_model.node_at(self.root, md.buffer_paths[k])) for k in bufs
    ]
    if not scanned:
      local, iteration = whole, None
      _check_one_trace_per_group(md, g, path, local, self.traces)
    sub = {
      k: v
      for k, v in own.items()
      if not (str(k).startswith('dmuon_owned_') or k == ITERATION)
    }
    mutable = [c for c in cols if module.is_mutable_collection(c)]
    rngs = {name: module.make_rng(name) for name in module.scope.rngs}
    mine = md.targets[b]
    arrays, _, rebuild = _boundary.split_args(args, kwargs)
    method = context.method_name

    def run(mats, state, arrays):
      p, others, keys = state
      p = plain_dicts(p)
      for i, rel in mine:
        _model.set_at(p, rel, mats[i])
      a, kw = rebuild(arrays)
      self.inner += 1
      try:
        result = module.clone(parent=None).apply(
          {'params': p, **others},
          *a,
          rngs=keys,
          mutable=mutable or False,
          method=method,
          **kw,
        )
      finally:
        self.inner -= 1
      return result if mutable else (result, {})

    # The stack's whole buffers say whether the model runs under jit: an
    # eager call's nn.scan traces its body (and so the slices) too.
    out, updates = _boundary.gathered(
      md,
      b,
      local,
      iteration,
      run,
      (sub, cols, rngs),
      arrays,
      traced=any(isinstance(x, jax.core.Tracer) for x in whole),
      remat=_lifted(module, 'remat'),
    )
    for c, tree in updates.items():
      for name, value in tree.items():
        module.put_variable(c, name, value)
    return out


def _lifted(module, transform: str) -> bool:
  """Whether ``module`` runs inside the Flax lifted ``transform``
  (``'remat'``, ``'scan'``; around it or a parent): Flax's lifted
  transforms name themselves in their scopes' ``debug_path``
  (``('remat(scan(layers))',)`` for ``nn.scan(nn.remat(Block))``)."""
  path = getattr(module.scope, 'debug_path', ())
  return any(f'{transform}(' in str(s) for s in path)


def _one_layer(md, b: int, module, count: int) -> tuple[list, Any]:
  """A scanned stack's owned buffers and layer index as ``nn.scan`` sliced
  them for this iteration (one layer each); raises where they were not
  sliced (the module ran outside ``nn.scan``, or ``nn.scan`` broadcast its
  params instead of slicing them) or another transform sliced them."""
  name = md.dedication.boundaries.names[b]
  own = module.variables.get('params', {})
  local = [own.get(f'dmuon_owned_{j}') for j in range(count)]
  iteration = own.get(ITERATION)
  if any(x is None for x in local) or iteration is None:
    raise ValueError(
      f'dmuon: the scanned stack {name!r} ran without its owned buffers '
      f'(module {_model.text(md.boundary_paths[b])!r}): call the model'
      ' through ded.apply with the dedicated params of dedicate_linen.'
    )
  if np.ndim(iteration) != 0 or any(np.ndim(x) != 1 for x in local):
    raise ValueError(
      SCAN_SLICE_MSG.format(
        name=name,
        module=_model.text(md.boundary_paths[b]),
        shape=tuple(np.shape(local[0])),
      )
    )
  if not _lifted(module, 'scan'):
    raise ValueError(
      f'dmuon: the scanned stack {name!r} runs one layer at a time under '
      f'{"/".join(module.scope.debug_path)!r}, not nn.scan: dedicate_linen '
      'runs stacked layers made by nn.scan (one gather per iteration). '
      'Leave these matrices to AdamW (muon_weight_dimension_numbers None '
      'for them), or use the drop-in dmuon_jax.dmuon.'
    )
  return list(local), iteration


SCAN_SLICE_MSG = (
  'dmuon: the scanned stack {name!r} gathers in module {module!r} (the '
  'deepest one holding all its Muon matrices), which ran on all its '
  'layers at once (its owned buffer has shape {shape}, with the layer '
  'axis). dedicate_linen runs a stack one layer per iteration of the '
  "nn.scan that made it (variable_axes={{'params': 0}} slices its params):"
  ' call {module!r} through that nn.scan, as when its params were '
  'initialized. Two nn.scan stacks under one top-level module meet there:'
  ' give each a top-level module of its own, or leave one of them to '
  'AdamW (muon_weight_dimension_numbers None for its kernels).'
)


def _check_one_trace_per_group(md, g: int, path, local, traces) -> None:
  """Warns (once per model) where group ``g``'s blocks run under different
  traces in one ``ded.apply`` on the reduced route: a lifted transform
  around each boundary module, so the group is gathered per block."""
  ded = md.dedication
  if not _exchange.reduced_route(ded) or not any(
    isinstance(x, jax.core.Tracer) for x in local
  ):
    return
  trace = jax.extend.core.get_opaque_trace_state(convention='nnx')
  first = traces.setdefault(g, trace)
  if first == trace or md.warned[0]:
    return
  md.warned[0] = True
  _boundary.warn_lifted(md, _model.text(path), g, linen=True)


def with_iterations(ded, boundary_paths, params: Any) -> Any:
  """Linen ``params`` with each scanned stack's layer indices,
  ``dmuon_iteration = arange(num_layers)``, beside its owned buffers:
  ``nn.scan`` slices them with the layers (``variable_axes={'params':
  0}``), so each iteration knows which owners hold its matrices (they
  rotate by one slot per layer). Made in the step, they are no param of
  the ``TrainState``: nothing differentiates or updates them.

  Args:
    ded: the model's ``Dedication``.
    boundary_paths: each boundary's module path in the params.
    params: the (unboxed) Linen params.

  Returns:
    ``params``, with the indices where a stack is scanned.
  """
  scanned = [b for b, s in enumerate(ded.boundaries.scanned) if s]
  if not scanned:
    return params
  params = plain_dicts(params)
  for b in scanned:
    n = ded.layout.iterations[_gather.group_of(ded, b)]
    _model.set_at(
      params,
      boundary_paths[b] + (ITERATION,),
      jax.numpy.arange(n, dtype=jax.numpy.int32),
    )
  return params


@dataclasses.dataclass(frozen=True, eq=False)
class LinenDedication(ModelDedication):
  """A :class:`ModelDedication` of a Linen model (:func:`dedicate_linen`),
  with its ``apply``."""

  @property
  def apply(self) -> LinenApply:
    """``linen_model.apply`` with the boundaries gathering (see
    :attr:`ModelDedication.apply`)."""
    return LinenApply(self)


@dataclasses.dataclass(frozen=True, repr=False)
class LinenApply:
  """``ded.apply`` of a Linen ``ModelDedication``: ``linen_model.apply``
  with the boundaries gathering; a callable that compares (and hashes) as
  its dedication does, where a bound method would compare its dedication
  by identity."""

  md: ModelDedication

  def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
    md = self.md
    # Flax boxes come off here: unboxing inside the model would constrain
    # each value to its names, which train_step's manual owner axes refuse
    # (the arrays are placed already).
    params = jax.tree.map(
      _mesh.unbox, variables['params'], is_leaf=_mesh.is_box
    )
    variables = {
      **variables,
      'params': with_iterations(md.dedication, md.boundary_paths, params),
    }
    with nn.intercept_methods(_Interceptor(md, params)):
      return md.linen_model.apply(variables, *args, **kwargs)

  def __repr__(self) -> str:
    model = type(self.md.linen_model).__name__
    n = len(self.md.dedication.boundaries.names)
    return f'<ded.apply of a dedicated {model}, {n} boundaries>'


def dedicate_linen(
  model: nn.Module,
  params: Any,
  mesh: jax.sharding.Mesh | None,
  *,
  predicate: Callable[[str, Any], bool] | str | None = None,
  muon_weight_dimension_numbers: Any = None,
  boundary_predicate: _checks.BoundaryPredicate | None = None,
  strict: bool = True,
  reshard_after_forward: bool = True,
  layers_per_gather: int | str = 'auto',
  axis_names: Sequence[str] | None = None,
  replicate_axis: str | None = 'replicate',
  remat_policy: Callable[..., Any] | None = None,
  ns_algorithm: str = 'auto',
  owner_groups: int | str | None = 'auto',
  tensor_parallel_axis: str | None = 'auto',
) -> tuple[ModelDedication, Any]:
  """:func:`dedicate` for a Linen model: returns the dedicated params.

  The module's code does not change. Use ``ded.apply`` as the model's
  apply function (e.g. ``TrainState.create(apply_fn=ded.apply, ...)``):
  each hook boundary submodule (``layers_3``, ``blocks_0`` ...) gathers its
  group's matrices when it is called; other collections (``batch_stats``)
  pass through as without dedication.

  An ``nn.scan`` stack (``variable_axes={'params': 0}``; its Muon kernels
  ``(L, m, n)`` given dimension numbers, e.g. ``MuonDimensionNumbers(1,
  2)``) gathers one layer per iteration, inside the loop: its owner buffer
  ``(L, num_slots * local)`` is stored with the stack's params, so
  ``nn.scan`` slices it like them, and ``ded.apply`` adds the layer indices
  beside it (``dmuon_iteration``, sliced too), since the owners rotate by
  one slot per layer. Inside ``nn.remat`` (``nn.scan(nn.remat(Block))``)
  the gather is recomputed in the backward pass: that is Z3, and Z2 warns
  that it moves Z3's bytes.

  Args:
    model: the Linen module.
    params: its ``'params'`` collection (``variables['params']``), boxed
      (``nn.Partitioned``, ``nn.LogicallyPartitioned``: an unplaced value
      is placed as its box says) or not.
    mesh: as for :func:`dedicate`.
    predicate: as for :func:`dedicate`.
    muon_weight_dimension_numbers: as for :func:`dedicate`.
    boundary_predicate: as for :func:`dedicate`.
    strict: as for :func:`dedicate`.
    reshard_after_forward: as for :func:`dedicate`.
    layers_per_gather: as for :func:`dedicate`.
    axis_names: as for :func:`dedicate`.
    replicate_axis: as for :func:`dedicate`.
    remat_policy: as for :func:`dedicate`.
    ns_algorithm: as for :func:`dedicate`.
    owner_groups: as for :func:`dedicate`.
    tensor_parallel_axis: as for :func:`dedicate`: Muon kernels boxed
      over it (``nn.with_partitioning(init, (None, 'model'))``) are stored
      split and reach each layer sharded over it. Linen's ``nn.Dense``
      takes no ``out_sharding``, which a row-parallel layer needs on an
      all-Explicit mesh: run such models with :func:`train_step` on an
      Auto TP axis.

  Returns:
    ``(dedication, dedicated_params)``: the Muon targets replaced by
    zero-size placeholders (``(L, 0)`` in a scanned stack), each gather
    group's owner buffers stored as ``dmuon_owned_<j>`` under the group's
    first boundary (a scanned stack's: in the deepest module holding all
    its Muon targets). Boxed params
    keep their boxes, and the owner buffers are boxed with their layout's
    spec (``nn.get_sharding`` of the params gives the owners' sharding).

  Raises:
    ValueError: for a variables dict instead of its ``'params'``, a
      ``layers_per_gather`` other than 1 or
      ``'auto'`` with a scanned stack, or what :func:`dmuon_jax.dedicate`
      rejects; and from ``ded.apply``, for a scanned stack that does not
      run one layer per ``nn.scan`` iteration (called whole, two stacks
      under one top-level module, or layers stacked by ``nn.vmap``) or runs
      without its owner buffers (plain params).

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, dmuon_jax.flax as dflax
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     for i in range(2):
    ...       x = jnp.tanh(nn.Dense(8, name=f'layers_{i}')(x))
    ...     return x
    >>> model, x = MLP(), jnp.ones((2, 8))
    >>> params = model.init(jax.random.key(0), x)['params']
    >>> ded, dparams = dflax.dedicate_linen(model, params, None)
    >>> jax.tree.map(jnp.shape, dparams['layers_0'])
    {'bias': (8,), 'dmuon_owned_0': (64,), 'kernel': (0,)}
    >>> y = ded.apply({'params': dparams}, x)  # the TrainState's apply_fn
    >>> bool(jnp.allclose(y, model.apply({'params': params}, x)))
    True
  """
  if not isinstance(model, nn.Module):
    raise TypeError(
      'dmuon: dedicate_linen takes a flax.linen.Module; got '
      f'{type(model).__name__} (NNX models: dmuon_jax.flax.dedicate).'
    )
  params = plain_dicts(params)
  if 'params' in params and isinstance(params['params'], dict):
    raise ValueError(
      "dmuon: dedicate_linen takes the 'params' collection; got a "
      "variables dict (it has a 'params' key): pass variables['params']."
    )
  params, boxes = unbox_linen(params, mesh)
  kwargs = {k: v for k, v in locals().items() if k in _model.PLANNED}
  specs = [None if box is None else _mesh.leaf_spec(box) for box in boxes]
  ded, placed, dp, replicated, moved = _model.plan(
    params, mesh, layers_per_gather, 'nn.scan', kwargs, specs
  )
  flat = jax.tree.flatten_with_path(placed)[0]
  paths = [_model.path(k) for k, _ in flat]
  targets_by_leaf = {t.index: t for t in ded.layout.leaves}
  out = plain_dicts(placed)
  for i, t in targets_by_leaf.items():
    hole = _model.placeholder(ded, t)
    if mesh is not None:
      hole = jax.device_put(hole, NamedSharding(mesh, P()))
    _model.set_at(out, paths[i], hole)
  # A scanned stack gathers where its params hold one layer: in the module
  # nn.scan runs per layer, and its owned buffers are stored there too.
  boundary_paths = _model.gather_points(ded, paths)
  buffer_paths: list[tuple] = [()] * len(dp.owned.buffers)
  for g, group in enumerate(ded.groups):
    first = boundary_paths[group[0]]
    mine = [k for k, (h, _) in enumerate(ded.layout.buffer_index) if h == g]
    for j, bi in enumerate(mine):
      buffer_paths[bi] = first + (f'dmuon_owned_{j}',)
      buf = dp.owned.buffers[bi]
      template = next((b for b in boxes if b is not None), None)
      if template is not None:  # boxed params: boxed buffers (their spec)
        buf = _mesh.box_like(template, buf, ded.layout.buffer_specs()[bi])
      _model.set_at(out, buffer_paths[bi], buf)
  # Boxed params keep their boxes (Flax's sharding tools read them); those
  # replicated over the owner axes say so. Where every mesh axis (of more
  # than one device) is an owner axis, every AdamW param ends replicated:
  # a box whose logical names the rules in effect map says so whatever
  # the rules are (a jax.eval_shape of the init outside them, as Flax lm1b
  # runs it, gives the jax.jit inside them the same boxes).
  owned_mesh = _model.owned_mesh(ded, mesh)
  for i, box in enumerate(boxes):
    if box is not None and i not in targets_by_leaf:
      if owned_mesh and _mesh.rules_decide(box):
        box = box.replace(names=(None,) * len(box.names))  # replicated
      elif i in moved:
        box = _mesh.without_axes(box, ded.buffer_axes)
      _model.set_at(
        out, paths[i], _mesh.rebox(box, _model.node_at(out, paths[i]))
      )
  md = LinenDedication(
    dedication=ded,
    buffer_paths=tuple(buffer_paths),
    rest_paths=tuple(
      None if i in targets_by_leaf else p for i, p in enumerate(paths)
    ),
    targets=_model.targets(ded, paths, boundary_paths),
    replicated=tuple(replicated),
    linen_model=model,
    placeholder_paths=tuple(paths[i] for i in targets_by_leaf),
    boundary_paths=boundary_paths,
  )
  return md, out
