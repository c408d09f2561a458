"""Dedicated DMuon for Flax models as they are written (optional: flax).

Three lines turn an ordinary NNX training loop into DMuon proper::

  ded = dmuon_jax.flax.dedicate(model, mesh)          # Muon matrices -> owners
  optimizer = nnx.Optimizer(
    model, dmuon_jax.flax.dedicated_muon(ded, learning_rate=0.02),
    wrt=nnx.Param)
  @dmuon_jax.flax.train_step(ded)                     # instead of @nnx.jit
  def train_step(model, optimizer, batch): ...        # unchanged

:func:`dedicate` stores each Muon target only on its owner (an
:class:`OwnedBuffer` per gather group, placeholders where the kernels were)
and makes every hook boundary module (``layers[3]``, a ``nnx.vmap`` stack
run by ``nnx.scan``) gather its group's matrices when the model calls it.
:func:`train_step` runs the user's step inside a ``shard_map`` whose only
manual axes are the owner (data-parallel) axes, so that autodiff's
transpose of those gathers is the reduce-scatter to the owners: Muon at
exactly the Z2/Z3 byte floors. The model's ``__call__`` and the step stay as
written. Linen models: :func:`dedicate_linen` returns the dedicated params
and ``ded.apply`` (the ``TrainState``'s ``apply_fn``) makes the boundary
submodules gather; the same :func:`train_step` and :func:`dedicated_muon`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _boundaries,
  _collectives,
  _dedicated,
  _gather,
  _mesh,
  _owner_layout,
  _report,
  _routing,
)

__all__ = (
  'DedicatedWeight',
  'ModelDedication',
  'OwnedBuffer',
  'ScanIteration',
  'dedicate',
  'dedicate_linen',
  'dedicated_muon',
  'train_step',
)


class OwnedBuffer(nnx.Param):
  """Owner-layout storage of one gather group's Muon matrices (one dtype).

  Sharded over the owner axes: a device's block holds the matrices it owns.
  Every boundary module of the group refers to the same variable. It is an
  ``nnx.Param``, so ``nnx.Optimizer(..., wrt=nnx.Param)`` and ``nnx.grad``
  see it.

  Attributes:
    value: the flat buffer, ``(num_slots * local,)`` for a loop group or
      ``(num_iterations, num_slots * local)`` for a scanned stack (as
      :class:`dmuon_jax.DedicatedParams` ``owned``).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> buffers = nnx.state(model, dflax.OwnedBuffer)
    >>> for path, buffer in nnx.to_flat_state(buffers):
    ...   print(path, buffer.shape)  # one 8 x 8 kernel each
    ('layers', 0, 'dmuon_owned_0') (64,)
    ('layers', 2, 'dmuon_owned_0') (64,)
  """


class DedicatedWeight(nnx.Variable):
  """Placeholder of a Muon target stored in an :class:`OwnedBuffer`.

  Holds a zero-size array (with the stack's layer axis for a scanned
  stack); the boundary module's call (or a call of one of its public
  methods, e.g. ``Embed.attend``) replaces it by the gathered matrix while
  the module runs. Reading its value elsewhere (``[...]``, ``get_value()``,
  ``jax.debug.visualize_array_sharding``, arithmetic) raises an error naming
  the param and ``ModelDedication.to_params`` (the whole arrays), so that no
  zero-size array reaches metrics or evaluation code; ``.shape`` is the
  placeholder's (Flax's ``nnx.get_named_sharding`` reads it).

  Attributes:
    value: the zero-size array, ``(0,)`` (``(num_layers, 0)`` in a scanned
      stack).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> kernel = model.layers[0].kernel
    >>> type(kernel).__name__, kernel.shape
    ('DedicatedWeight', (0,))
    >>> y = model(jnp.ones((2, 8)))  # the layer sees its gathered matrix
    >>> y.shape
    (2, 8)
    >>> kernel[...]  # outside the layer's call: an error naming it
    Traceback (most recent call last):
    ...
    ValueError: dmuon: 'layers/0/kernel' is a dedicated Muon weight...
  """

  @property
  def shape(self) -> tuple[int, ...]:
    """The placeholder's shape (Flax's sharding helpers read it)."""
    return tuple(self.get_raw_value().shape)

  def get_value(self, **kwargs: Any) -> Any:
    """The value; a clear error while this is the zero-size placeholder
    (outside its boundary module's call)."""
    if np.size(self.get_raw_value()) == 0:
      name = self.get_metadata().get('dmuon_name', '?')
      boundary = self.get_metadata().get('dmuon_boundary', '?')
      raise ValueError(
        f'dmuon: {name!r} is a dedicated Muon weight: its values are stored '
        'on their owner devices and gathered only while its hook boundary '
        f'{boundary!r} runs (call that module, or a method of it). For the '
        'whole array outside (metrics, sharding visualization, export), '
        'read ded.to_params(model).'
      )
    return super().get_value(**kwargs)


class ScanIteration(nnx.Variable):
  """Layer indices of a scanned stack.

  :func:`dedicate` adds one to each ``nnx.vmap`` stack of layers, as
  ``dmuon_iteration``; ``nnx.scan`` slices it with the layers, so each
  iteration knows which owners hold its matrices (they rotate by one slot
  per layer).

  Attributes:
    value: ``arange(num_layers)``, an ``int32`` array.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> class Stack(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.layers = nnx.vmap(lambda rngs: nnx.Linear(8, 8, rngs=rngs),
    ...                            in_axes=None, axis_size=3)(rngs)
    ...   def __call__(self, x):
    ...     step = lambda x, layer: (jnp.tanh(layer(x)), None)
    ...     return nnx.scan(step, in_axes=(nnx.Carry, 0))(x, self.layers)[0]
    >>> model = Stack(nnx.Rngs(0))
    >>> MDN = dmuon_jax.MuonDimensionNumbers  # (3, 8, 8): 3 matrices
    >>> dims = {'layers': {'kernel': MDN(1, 2), 'bias': None}}
    >>> ded = dflax.dedicate(model, None, muon_weight_dimension_numbers=dims)
    >>> model.layers.dmuon_iteration[...]
    Array([0, 1, 2], dtype=int32)
    >>> model(jnp.ones((2, 8))).shape
    (2, 8)
  """


_REGISTRY: dict[str, ModelDedication] = {}
_HOOKED: dict[type, type] = {}
_COUNTER = itertools.count()


@dataclasses.dataclass(eq=False)
class _StepContext:
  md: ModelDedication
  groups: dict[int, tuple] = dataclasses.field(default_factory=dict)


_LINEN: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
  'dmuon_jax_flax_linen', default=None
)
_ACTIVE: contextvars.ContextVar[_StepContext | None] = contextvars.ContextVar(
  'dmuon_jax_flax_step', default=None
)
# Ids of the boundary modules (the merged copies) whose call is running:
# their other methods run as written inside it.
_RUNNING: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
  'dmuon_jax_flax_running', default=frozenset()
)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDedication:
  """What :func:`dedicate` did to an NNX model.

  Attributes:
    dedication: the :class:`dmuon_jax.Dedication` of the model's params
      (plan, boundaries, gather groups, layout).
    key: the name under which the boundary modules find it.
    buffer_paths: per owned buffer (layout order), its path in
      ``nnx.state(model, nnx.Param)``.
    rest_paths: per param leaf of the plain params tree, its path (None for
      Muon targets).
    targets: per boundary, ``(leaf index, path inside the boundary module)``
      of its Muon targets.
    replicated: AdamW params that were sharded over an owner axis and are
      now replicated over the owner axes (inside :func:`train_step` every
      device runs the whole model on its own batch).
    warned: a one-element list: whether the GSPMD-gather warning of a call
      outside :func:`train_step` was given (once per model).
    gathered: under plain ``jit`` on Explicit owner axes, each gather
      group's gathered value in the trace that is running (so a group's
      blocks, and a block called twice, share one gather and one
      reduce-scatter); replaced when another trace starts.
    linen_model: the Linen module (from :func:`dedicate_linen`), or None
      for an NNX model.
    placeholder_paths: per Muon target, the path of its placeholder
      (:class:`DedicatedWeight` in NNX, a zero-size array in Linen params).
    boundary_paths: per boundary, its module path.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> ded.dedication.boundaries.names, ded.axes
    (('layers/0', 'layers/2'), ())
    >>> ded.buffer_paths  # one owned buffer per gather group
    (('layers', 0, 'dmuon_owned_0'), ('layers', 2, 'dmuon_owned_0'))
    >>> plain = ded.to_params(model)  # the params as before dedication
    >>> jax.tree.map(jnp.shape, plain['layers'][0])
    {'bias': (8,), 'kernel': (8, 8)}
  """

  dedication: _dedicated.Dedication
  key: str
  buffer_paths: tuple[tuple[Any, ...], ...]
  rest_paths: tuple[tuple[Any, ...] | None, ...]
  targets: tuple[tuple[tuple[int, tuple[Any, ...]], ...], ...]
  replicated: tuple[str, ...]
  warned: list[bool] = dataclasses.field(default_factory=lambda: [False])
  gathered: dict = dataclasses.field(default_factory=dict, repr=False)
  linen_model: Any = None
  placeholder_paths: tuple[tuple[Any, ...], ...] = ()
  boundary_paths: tuple[tuple[Any, ...], ...] = ()

  def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
    """``linen_model.apply`` with the boundaries gathering (Linen only).

    Use it as the ``apply_fn`` of a ``TrainState`` (and for evaluation):
    each boundary module's call gathers its group's matrices from the
    owned buffers in ``variables['params']``.

    Args:
      variables: as for ``flax.linen.Module.apply``, with the dedicated
        params of :func:`dedicate_linen`.
      *args: as for ``flax.linen.Module.apply``.
      **kwargs: as for ``flax.linen.Module.apply`` (``mutable``, ``rngs``,
        ``method`` ...).

    Returns:
      What ``linen_model.apply`` returns.
    """
    if self.linen_model is None:
      raise TypeError(
        'dmuon: ModelDedication.apply is for Linen models (from '
        'dmuon_jax.flax.dedicate_linen); an NNX model is called directly.'
      )
    # Flax boxes come off here: unboxing inside the model would constrain
    # each value to its names, which train_step's manual owner axes refuse
    # (the arrays are placed already).
    params = jax.tree.map(
      _mesh.unbox, variables['params'], is_leaf=_mesh.is_box
    )
    variables = {**variables, 'params': params}
    reset = _LINEN.set((self, params, {}))
    try:
      with nn.intercept_methods(_linen_interceptor):
        return self.linen_model.apply(variables, *args, **kwargs)
    finally:
      _LINEN.reset(reset)

  @property
  def axes(self) -> tuple[str, ...]:
    """The owner axes, :func:`train_step`'s manual (data-parallel) axes."""
    return self.dedication.buffer_axes

  def summary(self) -> str:
    """The dedication's summary (gather groups, padding, owner plan)."""
    text = self.dedication.summary()
    if self.replicated:
      text += (
        '\n  AdamW params replicated over the owner axes '
        f'{self.axes}: {list(self.replicated)}'
      )
    return text

  def to_params(self, model: Any) -> Any:
    """The model's plain params, Muon targets whole.

    Args:
      model: the dedicated NNX model, an ``nnx.State`` of its params (e.g.
        the gradients from ``nnx.value_and_grad``: logged gradient norms
        then mean what they mean on the plain model, without the owner
        buffers' padding), or (Linen) the dedicated params of
        :func:`dedicate_linen` (or their gradients).

    Returns:
      The params as a nested dict of arrays, as before dedication
      (``nnx.to_pure_dict`` form for NNX).
    """
    if isinstance(model, (nnx.Module, nnx.State)):
      params = model if isinstance(model, nnx.State) else None
      if params is None:
        params = nnx.state(model, nnx.Param)
      state = nnx.to_flat_state(params)
      by_path = {tuple(p): v.get_value() for p, v in state}
    else:
      by_path = {
        _path(k): _mesh.unbox(x)
        for k, x in jax.tree_util.tree_flatten_with_path(
          model, is_leaf=_mesh.is_box
        )[0]
      }
    owned = [by_path[p] for p in self.buffer_paths]
    rest = [None if p is None else by_path[p] for p in self.rest_paths]
    ded = self.dedication
    return ded.to_params(
      _dedicated.DedicatedParams(
        owned=_owner_layout.OwnerBuffers(owned, ded.layout),
        rest=jax.tree.unflatten(ded.treedef, rest),
      )
    )


def _key(entry: Any) -> Any:
  for name in ('key', 'name', 'idx'):
    if hasattr(entry, name):
      return getattr(entry, name)
  return entry


def _path(keys: Sequence[Any]) -> tuple[Any, ...]:
  return tuple(_key(k) for k in keys)


def _text(path: Sequence[Any]) -> str:
  return '/'.join(str(k) for k in path)


def _node_at(root: Any, path: Sequence[Any]) -> Any:
  node = root
  for k in path:
    node = node[k] if isinstance(k, int) else getattr(node, k)
  return node


def _set_at(root: Any, path: Sequence[Any], value: Any) -> None:
  parent = _node_at(root, path[:-1])
  if isinstance(path[-1], int):
    parent[path[-1]] = value
  else:
    setattr(parent, path[-1], value)


def _references(model: nnx.Module) -> dict[int, list[tuple]]:
  """id(node) -> every path that holds it (modules and variables, shared
  ones under each of their parents)."""
  refs: dict[int, list[tuple]] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable):
      continue
    if isinstance(node, (list, tuple, nnx.List)):
      items = list(enumerate(node))
    elif hasattr(node, '__dict__'):
      items = list(vars(node).items())
    else:
      continue
    for name, value in items:
      if isinstance(value, (nnx.Variable, nnx.Module, nnx.List)):
        held = refs.setdefault(id(value), [])
        if tuple(path) + (name,) not in held:
          held.append(tuple(path) + (name,))
  return refs


def _methods(cls: type) -> list[str]:
  """``__call__`` and the public methods ``cls`` adds to ``nnx.Module``
  (``Embed.attend``, a block's helper): each may read the Muon targets."""
  names = []
  for klass in cls.__mro__:
    if klass is nnx.Module or not issubclass(klass, nnx.Module):
      break
    for name, fn in vars(klass).items():
      public = name == '__call__' or not (
        name.startswith('_') or hasattr(nnx.Module, name)
      )
      if public and inspect.isfunction(fn) and name not in names:
        names.append(name)
  return names


def _hooked(cls: type) -> type:
  """``cls`` whose ``__call__`` and public methods gather the boundary's
  matrices first (a method called inside another runs as written)."""
  if cls in _HOOKED:
    return _HOOKED[cls]
  if getattr(cls, '_dmuon_base', None) is not None:
    return cls

  def hook(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
      if id(self) in _RUNNING.get():
        return original(self, *args, **kwargs)
      md = _REGISTRY.get(self.dmuon_key)
      if md is None:
        raise ValueError(
          f'dmuon: module {type(self).__name__} was dedicated by a '
          'dmuon_jax.flax.dedicate() of another process or session; call '
          'dedicate() again on a fresh model.'
        )
      return _boundary_call(md, self, original, args, kwargs)

    return method

  attrs = {name: hook(getattr(cls, name)) for name in _methods(cls)}
  sub = type(
    cls.__name__,
    (cls,),
    {
      **attrs,
      '__module__': cls.__module__,
      '__qualname__': cls.__qualname__,
      '_dmuon_base': cls,
    },
  )
  _HOOKED[cls] = sub
  return sub


def _placeholder(shape: tuple[int, ...], dtype: Any, scanned: bool):
  return jnp.zeros((shape[0], 0) if scanned else (0,), dtype)


def dedicate(
  model: nnx.Module,
  mesh: jax.sharding.Mesh | None,
  *,
  predicate: Callable[[str, Any], bool] | str | None = None,
  muon_weight_dimension_numbers: Any = None,
  boundary_predicate: _boundaries.BoundaryPredicate | None = None,
  strict: bool = True,
  reshard_after_forward: bool = True,
  layers_per_gather: int | str = 'auto',
  axis_names: Sequence[str] | None = None,
  replicate_axis: str | None = 'replicate',
  remat_policy: Callable[..., Any] | None = None,
  ns_algorithm: str = 'auto',
  owner_groups: int | str | None = 'auto',
) -> ModelDedication:
  """Stores an NNX model's Muon targets on their owners, in place.

  The model's code does not change: each hook boundary module (see
  :func:`dmuon_jax.find_hook_boundaries`: ``layers[i]``, ``blocks[i]``, a
  ``nnx.vmap`` stack called through ``nnx.scan``) gathers its gather
  group's matrices when it is called. Under :func:`train_step` that is an
  all-gather over the owner axes whose transpose reduce-scatters the
  gradients to the owners (Z3 gathers again in the backward pass, Z2 keeps
  the gathered weights). Every other variable (AdamW params, batch
  statistics, RNG state, sown values) stays as it was.

  Args:
    model: the NNX model (its params placed on ``mesh`` or not).
    mesh: the mesh whose owner axes own the matrices (None: one device).
    predicate: as for :func:`dmuon_jax.dedicate`.
    muon_weight_dimension_numbers: as for :func:`dmuon_jax.dedicate` (over
      the params as ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``).
    boundary_predicate: as for :func:`dmuon_jax.dedicate`; boundaries must
      be module paths.
    strict: as for :func:`dmuon_jax.dedicate`.
    reshard_after_forward: True for Z3, False for Z2.
    layers_per_gather: as for :func:`dmuon_jax.dedicate` (default
      ``'auto'``); a scanned stack gathers one layer per ``nnx.scan``
      iteration, so a model with one takes 1.
    axis_names: as for :func:`dmuon_jax.dedicate`.
    replicate_axis: as for :func:`dmuon_jax.dedicate`.
    remat_policy: as for :func:`dmuon_jax.dedicate`.
    ns_algorithm: as for :func:`dmuon_jax.dedicate`.
    owner_groups: as for :func:`dmuon_jax.dedicate`.

  Returns:
    A :class:`ModelDedication`, for :func:`dedicated_muon` and
    :func:`train_step`.

  Raises:
    ValueError: for a model dedicated already, a Muon target held by two
      modules (tied weights), a boundary that is not a module, a mesh with
      a tensor-parallel axis, or what :func:`dmuon_jax.dedicate` rejects.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> x = jnp.ones((2, 8))
    >>> before = model(x)
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> ded.dedication.boundaries.names  # nnx.Sequential's layers 0 and 2
    ('layers/0', 'layers/2')
    >>> type(model.layers[0].kernel).__name__  # stored in an OwnedBuffer
    'DedicatedWeight'
    >>> bool(jnp.allclose(model(x), before))  # the model runs as written
    True
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
      'dmuon: dmuon_jax.flax.dedicate takes an nnx.Module; got '
      f'{type(model).__name__}. For params trees use dmuon_jax.dedicate.'
    )
  if nnx.state(model, OwnedBuffer):
    raise ValueError(
      'dmuon: this model is dedicated already (it holds OwnedBuffer '
      'variables); dedicate a fresh model, or keep using its '
      'ModelDedication.'
    )
  state = nnx.state(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  kwargs = dict(
    predicate=predicate,
    muon_weight_dimension_numbers=muon_weight_dimension_numbers,
    boundary_predicate=boundary_predicate,
    strict=strict,
    reshard_after_forward=reshard_after_forward,
    axis_names=axis_names,
    replicate_axis=replicate_axis,
    remat_policy=remat_policy,
    ns_algorithm=ns_algorithm,
    owner_groups=owner_groups,
  )
  bounds = _boundaries.find_hook_boundaries(
    params,
    predicate=predicate if predicate != 'optax' else None,
    weight_dimension_numbers=muon_weight_dimension_numbers,
    boundary_predicate=boundary_predicate,
    strict=strict,
  )
  if any(bounds.scanned):
    if layers_per_gather not in ('auto', 1):
      raise ValueError(
        f'dmuon: layers_per_gather={layers_per_gather!r}, but the scanned '
        f'stack(s) {[n for n, s in zip(bounds.names, bounds.scanned) if s]}'
        ' run one layer per nnx.scan iteration, so each gather holds one '
        'layer. Pass layers_per_gather=1 (or the default).'
      )
    layers_per_gather = 1
  choice = 'one layer per nnx.scan iteration' if any(bounds.scanned) else None
  ded, placed, dp, replicated, moved = _plan(
    'dmuon_jax.flax.dedicate', params, mesh, layers_per_gather, choice, kwargs
  )
  flat = jax.tree.flatten_with_path(placed)[0]
  paths = [_path(keys) for keys, _ in flat]
  for i, x in moved.items():
    _node_at(model, paths[i]).set_value(x)

  refs = _references(model)
  targets_by_leaf = {t.index: t for t in ded.layout.leaves}
  for i in targets_by_leaf:
    # The target, or a module on its path, held by two parents: tied.
    holders = max(
      (
        refs.get(id(_node_at(model, paths[i][:d])), [])
        for d in range(1, len(paths[i]) + 1)
      ),
      key=len,
    )
    if len(holders) > 1:
      raise ValueError(
        f'dmuon: Muon target {_text(paths[i])!r} is held by '
        f'{[_text(h) for h in holders]} (tied weights): one owner cannot '
        'serve two boundaries. Route it to AdamW (predicate) or untie it.'
      )
  boundary_paths = [_path(k) for k in ded.boundary_keys]
  for b, bpath in enumerate(boundary_paths):
    module = _node_at(model, bpath) if bpath else model
    if not isinstance(module, nnx.Module):
      raise ValueError(
        f'dmuon: hook boundary {ded.boundaries.names[b]!r} is a '
        f'{type(module).__name__}, not an nnx.Module: its call cannot '
        'gather. Pass a boundary_predicate that names modules.'
      )

  key = f'dmuon{next(_COUNTER)}'
  buffers = list(dp.owned.buffers)
  # Each buffer's layout spec as its out_sharding metadata: Flax's
  # nnx.get_named_sharding (of the model, or of an abstract one from
  # nnx.eval_shape) gives the owners' sharding, and nnx.Optimizer copies
  # it into the momentum's variables.
  owned_vars = [
    _mesh.box_like(OwnedBuffer(x), x, spec)
    if ded.layout.distributed
    else OwnedBuffer(x)
    for x, spec in zip(buffers, ded.layout.buffer_specs())
  ]
  for b, bpath in enumerate(boundary_paths):
    module = _node_at(model, bpath) if bpath else model
    g = _gather.group_of(ded, b)
    for j, bi in enumerate(
      k for k, (h, _) in enumerate(ded.layout.buffer_index) if h == g
    ):
      setattr(module, f'dmuon_owned_{j}', owned_vars[bi])
    module.dmuon_key = key
    module.dmuon_boundary = b
    if ded.boundaries.scanned[b]:
      n = ded.layout.iterations[g]
      module.dmuon_iteration = ScanIteration(jnp.arange(n))
    module.__class__ = _hooked(type(module))
  for i, t in targets_by_leaf.items():
    scanned = ded.boundaries.scanned[_boundary_of(ded, t)]
    _set_at(
      model,
      paths[i],
      DedicatedWeight(
        _placeholder(t.shape, t.dtype, scanned),
        dmuon_name=_text(paths[i]),
        dmuon_boundary=ded.boundaries.names[_boundary_of(ded, t)],
      ),
    )

  owned_state = nnx.to_flat_state(nnx.state(model, OwnedBuffer))
  where = {id(v): tuple(p) for p, v in owned_state}
  md = ModelDedication(
    dedication=ded,
    key=key,
    buffer_paths=tuple(where[id(v)] for v in owned_vars),
    rest_paths=tuple(
      None if i in targets_by_leaf else p for i, p in enumerate(paths)
    ),
    targets=_targets(ded, paths, boundary_paths),
    replicated=tuple(replicated),
  )
  _REGISTRY[key] = md
  return md


def _plan(who, params, mesh, layers_per_gather, choice, kwargs):
  """The dedication of a Flax model's params, and the params placed for it.

  Plans with :func:`dmuon_jax.dedicate`, checks what ``dmuon_jax.flax``
  cannot run, replicates AdamW params sharded over an owner axis (see
  :func:`_replicate_rest`) and puts unplaced params on the mesh.

  Returns:
    ``(dedication, placed params, DedicatedParams, replicated paths, {leaf
    index: moved param})``.
  """
  ded = _dedicated.dedicate(
    params, mesh, layers_per_gather=layers_per_gather, **kwargs
  )
  if choice is not None:
    ded = dataclasses.replace(ded, layers_per_gather_choice=choice)
  _check_boundaries_hold_targets(params, ded, kwargs['boundary_predicate'])
  if ded.tensor_parallel_axis is not None:
    raise ValueError(
      f'dmuon: {who} does not split matrices over the tensor-parallel axis '
      f'{ded.tensor_parallel_axis!r}; use the explicit API '
      '(dmuon_jax.dedicate, Dedication.block/sequential/scan) for tensor '
      'parallelism, or pass tensor-parallel params replicated.'
    )
  params, ded, replicated, moved = _replicate_rest(ded, params, mesh, kwargs)
  placed = params
  if mesh is not None:
    placed = jax.tree.map(
      lambda x: (
        x
        if isinstance(getattr(x, 'sharding', None), NamedSharding)
        else jax.device_put(x, NamedSharding(mesh, P()))
      ),
      params,
    )
  return ded, placed, ded.to_dedicated(placed), replicated, moved


def _boundary_of(ded, target) -> int:
  return ded.boundaries.of_target[ded.boundaries.paths.index(target.path)]


def _targets(ded, paths, boundary_paths) -> tuple:
  """Per boundary, ``(leaf index, path inside the boundary module)`` of its
  Muon targets."""
  targets: list[list[tuple[int, tuple]]] = [[] for _ in boundary_paths]
  for t in ded.layout.leaves:
    b = _boundary_of(ded, t)
    targets[b].append((t.index, paths[t.index][len(boundary_paths[b]) :]))
  return tuple(tuple(t) for t in targets)


def _replicate_rest(ded, params, mesh, kwargs):
  """AdamW params sharded over an owner axis, replicated over the owner
  axes (inside train_step every device runs the whole model on its own
  batch); the dedication planned again if any moved."""
  leaves = jax.tree.leaves(params)
  flat = jax.tree.flatten_with_path(params)[0]
  owner = set(ded.buffer_axes)
  replicated, moved, extra = [], {}, 0
  for i, (spec, (keys, x)) in enumerate(zip(ded.rest_specs, flat)):
    axes = {a for e in _mesh.spec_entries(spec) for a in e} if spec else set()
    if not axes & owner:
      continue
    kept = P(
      *(
        tuple(a for a in e if a not in owner) or None
        for e in _mesh.spec_entries(spec)
      )
    )
    moved[i] = leaves[i] = jax.device_put(x, NamedSharding(mesh, kept))
    replicated.append(_text(_path(keys)))
    ways = lambda sp: math.prod(
      mesh.shape[a] for e in _mesh.spec_entries(sp) for a in e
    )
    nbytes = np.size(x) * jnp.dtype(x.dtype).itemsize
    extra += nbytes // ways(kept) - nbytes // ways(spec)
  if replicated:
    warnings.warn(
      f'dmuon: dedicate replicated the AdamW params {replicated} over the '
      f'owner axes {tuple(ded.buffer_axes)}, over which they were sharded: '
      f'+{extra:,} bytes per device (their AdamW moments likewise), since '
      'dmuon_jax.flax.train_step runs the whole model on each device. To '
      'keep them sharded, shard them over another mesh axis; '
      'ded.summary() lists them.',
      _report.DMuonWarning,
      stacklevel=4,
    )
    params = jax.tree.unflatten(jax.tree.structure(params), leaves)
    choice = ded.layers_per_gather_choice
    ded = _dedicated.dedicate(
      params, mesh, layers_per_gather=ded.layers_per_gather, **kwargs
    )
    ded = dataclasses.replace(ded, layers_per_gather_choice=choice)
  return params, ded, replicated, moved


def _check_boundaries_hold_targets(params, ded, boundary_predicate) -> None:
  """Raises for a module the boundary predicate names (outermost matches)
  that holds no Muon target: its call would gather nothing."""
  if boundary_predicate is None:
    return
  targets = [t.path for t in ded.layout.leaves]
  seen = set()
  for keys, _ in jax.tree.flatten_with_path(params)[0]:
    for depth in range(1, len(keys)):
      prefix = _routing.normalize_path(keys[:depth])
      if prefix in seen:
        break
      seen.add(prefix)
      if not boundary_predicate(
        prefix, _boundaries.subtree(params, keys[:depth])
      ):
        continue
      if not any(t == prefix or t.startswith(prefix + '/') for t in targets):
        raise ValueError(
          f'dmuon: boundary_predicate names module {prefix!r}, which holds '
          'no Muon target (its params are AdamW params): its call would '
          'gather nothing. Leave it out of the predicate (the boundaries '
          f'with targets are {list(ded.boundaries.names)}).'
        )
      break


def _split_args(args, kwargs):
  """``(arrays, nodes, rebuild)``: the call's array leaves, the NNX graph
  nodes among its arguments (an ``nnx.Rngs`` or a module passed in: they
  flow through the gathered call as state, so what the call does to them
  is kept), and ``rebuild(arrays, nodes) -> (args, kwargs)``."""
  leaves, treedef = jax.tree.flatten(
    (args, kwargs), is_leaf=lambda x: isinstance(x, nnx.Pytree)
  )
  kind = [
    'array'
    if isinstance(x, (jax.Array, np.ndarray))
    else 'node'
    if isinstance(x, nnx.Pytree)
    else None
    for x in leaves
  ]
  arrays = [x for x, k in zip(leaves, kind) if k == 'array']
  nodes = tuple(x for x, k in zip(leaves, kind) if k == 'node')
  static = [None if k else x for x, k in zip(leaves, kind)]

  def rebuild(arrs, new_nodes=()):
    it = {'array': iter(arrs), 'node': iter(new_nodes)}
    full = [next(it[k]) if k else s for s, k in zip(static, kind)]
    return jax.tree.unflatten(treedef, full)

  return arrays, nodes, rebuild


def _boundary_call(md: ModelDedication, module, original, args, kwargs):
  ded = md.dedication
  b = module.dmuon_boundary
  g = _gather.group_of(ded, b)
  name = ded.boundaries.names[b]
  scanned = ded.boundaries.scanned[b]
  count = len(ded.layout.group_buffers(ded.layout.buffer_index, g))
  local = [
    getattr(module, f'dmuon_owned_{j}').get_value() for j in range(count)
  ]
  if scanned and local[0].ndim != 1:
    raise ValueError(
      f'dmuon: the scanned stack {name!r} was called as a whole; call it '
      'through nnx.scan over its layer axis (one layer per iteration), as '
      'without dedication.'
    )
  iteration = module.dmuon_iteration.get_value() if scanned else None
  mine = md.targets[b]
  holes = {rel: _node_at(module, rel).get_raw_value() for _, rel in mine}
  full = [rel for rel, x in holes.items() if np.size(x)]
  holes = {rel: (tuple(x.shape), x.dtype) for rel, x in holes.items()}
  if full:
    raise ValueError(
      f'dmuon: the Muon target(s) {[name + "/" + _text(r) for r in full]} of '
      'this dedicated model hold whole arrays: a plain (not dedicated) '
      'state was written into it (e.g. a checkpoint of the model before '
      'dmuon_jax.flax.dedicate). Restore plain checkpoints into a plain '
      'model and dedicate it after, or save and restore the dedicated '
      'state (nnx.state(model)).'
    )
  # The owned buffers stay out of the state that flows through the call:
  # every boundary of a group then sees the same buffer values.
  owned_filter = (OwnedBuffer, ScanIteration)
  arrays, nodes, rebuild = _split_args(args, kwargs)
  graphdef, fixed, state = nnx.split((module, nodes), owned_filter, ...)
  fixed = jax.tree.map(jax.lax.stop_gradient, fixed)

  def run(mats, state, arrays):
    m, new_nodes = nnx.merge(graphdef, fixed, state)
    for i, rel in mine:
      _node_at(m, rel).set_value(mats[i])
    a, kw = rebuild(arrays, new_nodes)
    running = _RUNNING.set(_RUNNING.get() | {id(m)})
    try:
      out = original(m, *a, **kw)
    finally:
      _RUNNING.reset(running)
    for _, rel in mine:
      _node_at(m, rel).set_value(jnp.zeros(*holes[rel]))
    return out, nnx.state((m, new_nodes), nnx.Not(owned_filter))

  out, new_state = _gathered(md, b, local, iteration, run, state, arrays)
  nnx.update((module, nodes), new_state)
  return out


def _gathered(
  md: ModelDedication, b: int, local, iteration, run, state, arrays
):
  """``run(mats, state, arrays)`` with boundary ``b``'s group gathered.

  Inside :func:`train_step` (manual owner axes): Z2 gathers the group at
  its first call and reuses it; Z3 re-gathers in the backward pass once per
  group (token-tied) and reduce-scatters once (through a sink). Elsewhere
  on a mesh: a sharding constraint gathers (GSPMD; warned once).
  """
  ded = md.dedication
  g = _gather.group_of(ded, b)
  name = ded.boundaries.names[b]
  scanned = ded.boundaries.scanned[b]
  layout = ded.layout
  manual = layout.distributed and set(ded.buffer_axes) <= (
    _collectives.manual_axes()
  )
  ctx = _ACTIVE.get()
  cache = ctx.groups if ctx is not None and ctx.md is md else {}
  ids = tuple(id(x) for x in local)
  z3 = ded.reshard_after_forward
  hit = cache.get(g)
  hit = hit[1:] if hit is not None and hit[0] == ids else None
  if manual and hit is None:  # the group's first block
    local = _gather.after_inputs(local, arrays)
  if scanned:  # one layer per iteration: drop the group's layer axis
    run_layer = run
    run = lambda mats, *a: run_layer({i: m[0] for i, m in mats.items()}, *a)
  if not layout.distributed:
    mats = _gather.unpack_gathered(ded, g, local, iteration)
    return run(mats, state, arrays)
  if manual and not z3:
    if hit is not None:
      (mats,) = hit
    else:
      mats = _gather.materialize(
        ded, g, _gather.gather_replicate(ded, local), iteration
      )
      cache[g] = (ids, mats)
    return run(mats, state, arrays)
  if manual:
    if hit is not None:
      rep, sink, token = hit
    else:
      rep = _gather.gather_replicate(ded, local)
      sink = _gather.gather_sink(ded, local)
      token = _gather.new_token()

    def run_z3(rep_local, sink, iteration, state, arrays):
      mats = _gather.materialize(ded, g, rep_local, iteration, sink=sink)
      return run(mats, state, arrays)

    call = _gather.regather_group_in_backward(
      run_z3,
      ded.remat_policy,
      last=b == ded.groups[g][-1] or scanned,
      blocks=[name],
      routed=True,
    )
    out, token = call(rep, token, sink, iteration, state, arrays)
    cache[g] = (ids, rep, sink, token)
    return out
  if _gather.reduced_route(ded) and any(
    isinstance(x, jax.core.Tracer) for x in local
  ):
    if _sharded_over(arrays, ded.buffer_axes):
      return _reduced_call(md, b, local, iteration, run, state, arrays)
    _warn_unsharded(md, name, arrays)
  else:
    _warn_bare(md, local)

  def run_global(local, iteration, state, arrays):
    full = [_mesh.place(x, ded.mesh, P()) for x in local]
    return run(_gather.unpack_gathered(ded, g, full, iteration), state, arrays)

  # The boundaries of a group constrain the same buffers: XLA gathers them
  # once and keeps them (Z2 memory: a re-gather per boundary would move the
  # group again for each of its blocks).
  return run_global(local, iteration, state, arrays)


def _sharded_over(arrays, axes: Sequence[str]) -> bool:
  """Whether the boundary's array inputs are split over every owner axis
  (the reduced gather's cotangent is a per-device partial sum: jax types a
  weight ``reduced`` only where its contraction runs over those axes)."""

  def named(x):
    spec = getattr(jax.typeof(x).sharding, 'spec', None)
    return {a for e in _mesh.spec_entries(spec) for a in e}

  leaves = jax.tree.leaves(arrays)
  return any(set(axes) <= named(x) for x in leaves if np.ndim(x) >= 1)


def _warn_unsharded(md: ModelDedication, name: str, arrays) -> None:
  if md.warned[0]:
    return
  md.warned[0] = True
  xs = [x for x in jax.tree.leaves(arrays) if np.ndim(x) >= 1]
  typed = str(jax.typeof(xs[0])) if xs else 'no array'
  warnings.warn(
    f'dmuon: the dedicated boundary {name!r} ran under jax.jit/nnx.jit on '
    f'an input typed {typed}, not split over the owner axes '
    f'{md.axes}: its matrices were gathered with GSPMD, and a gradient '
    'through them is all-reduced (3(N-1)/N x the Muon bytes instead of '
    'the reduce-scatter floor). Shard the batch over the owner axes, '
    'e.g. jax.device_put(batch, NamedSharding(mesh, P(ded.axes))), or '
    'use dmuon_jax.flax.train_step(ded), which does (evaluation on a '
    'replicated batch is otherwise fine).',
    _report.DMuonWarning,
    stacklevel=5,
  )


def _trace_cache(md: ModelDedication, g: int, local, iteration):
  """``(entry, store)``: group ``g``'s cached gather in the running trace
  (``None`` if its buffers were not gathered in it yet), and a function
  that records a new one."""
  trace = jax.extend.core.get_opaque_trace_state(convention='nnx')
  cache = md.gathered
  if cache.get('trace') != trace:
    cache.clear()
    cache['trace'] = trace
  keys = (*local, iteration)
  hit = cache.get(g)
  entry = None
  if hit is not None and all(a is b for a, b in zip(hit[0], keys)):
    entry = hit[1]

  def store(value):
    cache[g] = (keys, value)

  return entry, store


def _reduced_call(md: ModelDedication, b: int, local, iteration, run, *args):
  """:func:`_gathered` under plain ``jit`` on Explicit owner axes: the
  group's buffers gathered typed ``reduced`` (see
  ``_gather.reduced_gather``), once per trace; Z3 re-gathers once per group
  in the backward pass."""
  ded = md.dedication
  g = _gather.group_of(ded, b)
  entry, store = _trace_cache(md, g, local, iteration)
  if not ded.reshard_after_forward:
    if entry is None:
      entry = _gather.materialize_reduced(ded, g, local, iteration)
      store(entry)
    return run(entry, *args)
  sink, token = entry or (
    _gather.reduced_sink(ded, g, local, iteration),
    _gather.new_token(),
  )
  scanned = ded.boundaries.scanned[b]

  def run_z3(local, sink, iteration, *args):
    mats = _gather.materialize_reduced(ded, g, local, iteration, sink=sink)
    return run(mats, *args)

  call = _gather.regather_group_in_backward(
    run_z3,
    ded.remat_policy,
    last=b == ded.groups[g][-1] or scanned,
    blocks=[ded.boundaries.names[b]],
    routed=True,
  )
  out, token = call(local, token, sink, iteration, *args)
  store((sink, token))
  return out


def dedicate_linen(
  model: nn.Module,
  params: Any,
  mesh: jax.sharding.Mesh | None,
  *,
  predicate: Callable[[str, Any], bool] | str | None = None,
  muon_weight_dimension_numbers: Any = None,
  boundary_predicate: _boundaries.BoundaryPredicate | None = None,
  strict: bool = True,
  reshard_after_forward: bool = True,
  layers_per_gather: int | str = 'auto',
  axis_names: Sequence[str] | None = None,
  replicate_axis: str | None = 'replicate',
  remat_policy: Callable[..., Any] | None = None,
  ns_algorithm: str = 'auto',
  owner_groups: int | str | None = 'auto',
) -> tuple[ModelDedication, Any]:
  """:func:`dedicate` for a Linen model: returns the dedicated params.

  The module's code does not change. Use ``ded.apply`` as the model's
  apply function (e.g. ``TrainState.create(apply_fn=ded.apply, ...)``):
  each hook boundary submodule (``layers_3``, ``blocks_0`` ...) gathers its
  group's matrices when it is called; other collections (``batch_stats``)
  pass through as without dedication.

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

  Returns:
    ``(dedication, dedicated_params)``: the Muon targets replaced by
    zero-size placeholders, each gather group's owner buffers stored as
    ``dmuon_owned_<j>`` under the group's first boundary. Boxed params
    keep their boxes, and the owner buffers are boxed with their layout's
    spec (``nn.get_sharding`` of the params gives the owners' sharding).

  Raises:
    ValueError: for a variables dict instead of its ``'params'``, a
      scanned stack (``nn.scan``: use the explicit API), a tensor-parallel
      axis, or what :func:`dmuon_jax.dedicate` rejects.

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
  params = _plain_dicts(params)
  if 'params' in params and isinstance(params['params'], dict):
    raise ValueError(
      "dmuon: dedicate_linen takes the 'params' collection; got a "
      "variables dict (it has a 'params' key): pass variables['params']."
    )
  params, boxes = _unbox_linen(params, mesh)
  kwargs = dict(
    predicate=predicate,
    muon_weight_dimension_numbers=muon_weight_dimension_numbers,
    boundary_predicate=boundary_predicate,
    strict=strict,
    reshard_after_forward=reshard_after_forward,
    axis_names=axis_names,
    replicate_axis=replicate_axis,
    remat_policy=remat_policy,
    ns_algorithm=ns_algorithm,
    owner_groups=owner_groups,
  )
  ded, placed, dp, replicated, _ = _plan(
    'dedicate_linen', params, mesh, layers_per_gather, None, kwargs
  )
  scanned = [
    n for n, sc in zip(ded.boundaries.names, ded.boundaries.scanned) if sc
  ]
  if scanned:
    raise ValueError(
      'dmuon: dedicate_linen does not run scanned stacks (nn.scan) yet: '
      f'{scanned}. Use the explicit API (dmuon_jax.dedicate, '
      'Dedication.scan).'
    )
  flat = jax.tree.flatten_with_path(placed)[0]
  paths = [_path(k) for k, _ in flat]
  targets_by_leaf = {t.index: t for t in ded.layout.leaves}
  out = _plain_dicts(placed)
  for i, t in targets_by_leaf.items():
    hole = jnp.zeros((0,), t.dtype)
    if mesh is not None:
      hole = jax.device_put(hole, NamedSharding(mesh, P()))
    _set_item(out, paths[i], hole)
  boundary_paths = tuple(_path(k) for k in ded.boundary_keys)
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
      _set_item(out, buffer_paths[bi], buf)
  # Boxed params keep their boxes (Flax's sharding tools read them).
  for i, box in enumerate(boxes):
    if box is not None and i not in targets_by_leaf:
      _set_item(out, paths[i], _mesh.rebox(box, _node_at_dict(out, paths[i])))
  key = f'dmuon{next(_COUNTER)}'
  md = ModelDedication(
    dedication=ded,
    key=key,
    buffer_paths=tuple(buffer_paths),
    rest_paths=tuple(
      None if i in targets_by_leaf else p for i, p in enumerate(paths)
    ),
    targets=_targets(ded, paths, boundary_paths),
    replicated=tuple(replicated),
    linen_model=model,
    placeholder_paths=tuple(paths[i] for i in targets_by_leaf),
    boundary_paths=boundary_paths,
  )
  _REGISTRY[key] = md
  return md, out


def _unbox_linen(params: Any, mesh: Any) -> tuple[Any, list[Any]]:
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


def _plain_dicts(tree: Any) -> Any:
  """Nested dicts (FrozenDicts too) as plain dicts, leaves kept."""
  if hasattr(tree, 'items') and not hasattr(tree, 'shape'):
    return {k: _plain_dicts(v) for k, v in tree.items()}
  return tree


def _set_item(tree: dict, path: Sequence[Any], value: Any) -> None:
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def _node_at_dict(tree: Any, path: Sequence[Any]) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _linen_interceptor(next_fun, args, kwargs, context):
  """Runs a boundary module's method (``__call__`` or any other: a
  ``decode``, an ``attend``) on its group's gathered matrices."""
  active = _LINEN.get()
  if active is None or context.method_name == 'setup':
    return next_fun(*args, **kwargs)
  md, root, traces = active
  module = context.module
  path = tuple(module.path)
  if path not in md.boundary_paths:
    return next_fun(*args, **kwargs)
  b = md.boundary_paths.index(path)
  ded = md.dedication
  g = _gather.group_of(ded, b)
  local = [
    _mesh.unbox(_node_at_dict(root, md.buffer_paths[k]))
    for k, (h, _) in enumerate(ded.layout.buffer_index)
    if h == g
  ]
  _check_one_trace_per_group(md, g, path, local, traces)
  cols = {c: _plain_dicts(module.variables[c]) for c in module.variables}
  sub = {
    k: v
    for k, v in cols.pop('params', {}).items()
    if not str(k).startswith('dmuon_owned_')
  }
  mutable = [c for c in cols if module.is_mutable_collection(c)]
  rngs = {name: module.make_rng(name) for name in module.scope.rngs}
  mine = md.targets[b]
  arrays, _, rebuild = _split_args(args, kwargs)
  method = context.method_name

  def run(mats, state, arrays):
    p, others, keys = state
    p = _plain_dicts(p)
    for i, rel in mine:
      _set_item(p, rel, mats[i])
    a, kw = rebuild(arrays)
    reset = _LINEN.set(None)  # the block's own submodules run as written
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
      _LINEN.reset(reset)
    return result if mutable else (result, {})

  out, updates = _gathered(md, b, local, None, run, (sub, cols, rngs), arrays)
  for c, tree in updates.items():
    for name, value in tree.items():
      module.put_variable(c, name, value)
  return out


LIFTED_BOUNDARY_MSG = (
  'dmuon: the dedicated boundary {name!r} runs inside a Flax lifted '
  'transform of its own (nn.remat, nn.jit, nn.vmap ... around the boundary '
  'module: a trace of its own per block), so each of its gather group '
  '{group} blocks gathers the group again: the numbers are right, but '
  'the step moves one reduce-scatter (Z3: and all-gather) per block '
  'instead of one per group ({blocks} blocks, up to {blocks}x the Muon '
  "gradient bytes of the plan's floor). Apply the transform inside the "
  'block, to its submodules (e.g. nn.remat(nn.Dense) in the block), '
  'rather than to the boundary module; for the memory of the gathered '
  'matrices, dedicate_linen(reshard_after_forward=True) frees them after '
  'the forward and re-gathers each group once in the backward pass.'
)


def _check_one_trace_per_group(md, g: int, path, local, traces) -> None:
  """Warns (once per model) where group ``g``'s blocks run under different
  traces in one ``ded.apply`` on the reduced route: a lifted transform
  around each boundary module, so the group is gathered per block."""
  ded = md.dedication
  if not _gather.reduced_route(ded) or not any(
    isinstance(x, jax.core.Tracer) for x in local
  ):
    return
  trace = jax.extend.core.get_opaque_trace_state(convention='nnx')
  first = traces.setdefault(g, trace)
  if first == trace or md.warned[0]:
    return
  md.warned[0] = True
  warnings.warn(
    LIFTED_BOUNDARY_MSG.format(
      name=_text(path), group=g, blocks=len(ded.groups[g])
    ),
    _report.DMuonWarning,
    stacklevel=4,
  )


def _warn_bare(md: ModelDedication, local) -> None:
  if md.warned[0] or not any(isinstance(x, jax.core.Tracer) for x in local):
    return
  md.warned[0] = True
  n = md.dedication.num_slots
  z3 = md.dedication.reshard_after_forward
  warnings.warn(
    'dmuon: a dedicated model ran under plain jax.jit/nnx.jit (outside '
    'dmuon_jax.flax.train_step). It computes the same numbers, but XLA '
    "reduces the Muon gradients with an all-reduce rather than the owners'"
    f' reduce-scatter: an all-gather forward and an all-reduce backward, '
    f'3({n}-1)/{n} x the Muon bytes per step'
    + (
      " (the Z3 floor's bytes), but the gathered weights are kept for the "
      'backward (Z2 memory) and every device holds all Muon gradients'
      if z3
      else f' instead of the Z2 floor 2({n}-1)/{n}'
    )
    + '. Decorate the train step with @dmuon_jax.flax.train_step(dedication)'
    ' instead of jax.jit/nnx.jit to get the floor (evaluation outside it '
    'is fine).',
    _report.DMuonWarning,
    stacklevel=4,
  )


def dedicated_muon(
  dedication: ModelDedication,
  learning_rate: optax.ScalarOrSchedule,
  **kwargs: Any,
) -> optax.GradientTransformation:
  """:func:`dmuon_jax.dedicated_muon` for a model dedicated by
  :func:`dedicate`, on its ``nnx.Param`` state.

  Use as ``nnx.Optimizer(model, dedicated_muon(ded, ...), wrt=nnx.Param)``:
  the :class:`OwnedBuffer` variables get the owners' Muon update (no
  communication), every other ``nnx.Param`` AdamW.

  Args:
    dedication: the :class:`ModelDedication`.
    learning_rate: as for :func:`dmuon_jax.dmuon`.
    **kwargs: every other argument of :func:`dmuon_jax.dedicated_muon`.

  Returns:
    A ``optax.GradientTransformation`` over the model's param state.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> optimizer = nnx.Optimizer(
    ...     model, dflax.dedicated_muon(ded, learning_rate=0.02), wrt=nnx.Param)
    >>> import dmuon_jax
    >>> [layout.kind for layout in dmuon_jax.owner_layouts(optimizer.opt_state)]
    ['dedicated']
  """
  md = dedication
  ded = md.dedication
  core = _dedicated.dedicated_muon(ded, learning_rate, **kwargs)
  buffer_of = {p: k for k, p in enumerate(md.buffer_paths)}
  leaf_of = {p: i for i, p in enumerate(md.rest_paths) if p is not None}
  holes = set(md.placeholder_paths)

  value = _mesh.unbox  # of an nnx.Variable or a Linen box

  def to_core(tree, what):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_mesh.is_boxed)[0]
    owned = [None] * len(md.buffer_paths)
    rest = [None] * len(md.rest_paths)
    for keys, x in flat:
      p = _path(keys)
      if p in buffer_of:
        owned[buffer_of[p]] = value(x)
      elif p in leaf_of:
        rest[leaf_of[p]] = value(x)
      elif p in holes:
        continue
      else:
        raise ValueError(
          f'dmuon: {what} got param {_text(p)!r}, which the dedicated model'
          ' did not have at dmuon_jax.flax.dedicate(); make the optimizer '
          'for this model with wrt=nnx.Param.'
        )
    missing = [_text(p) for p, k in buffer_of.items() if owned[k] is None] + [
      _text(p) for p, i in leaf_of.items() if rest[i] is None
    ]
    if missing:
      raise ValueError(
        f'dmuon: {what} is missing params {missing[:5]} of the dedicated '
        'model; pass nnx.state(model, nnx.Param) (nnx.Optimizer with '
        'wrt=nnx.Param does).'
      )
    return _dedicated.DedicatedParams(
      owned=_owner_layout.OwnerBuffers(owned, ded.layout),
      rest=jax.tree.unflatten(ded.treedef, rest),
    )

  def from_core(dp, like):
    rest = ded.treedef.flatten_up_to(dp.rest)

    def pick(keys, x):
      p = _path(keys)
      if p in holes:
        return jnp.zeros_like(value(x))
      new = (
        dp.owned.buffers[buffer_of[p]] if p in buffer_of else rest[leaf_of[p]]
      )
      return _mesh.rebox(x, new) if _mesh.is_box(x) else new

    return jax.tree_util.tree_map_with_path(pick, like, is_leaf=_mesh.is_box)

  def init_fn(params):
    return core.init(to_core(params, 'init()'))

  def update_fn(updates, state, params=None):
    u, state = core.update(
      to_core(updates, 'update()'),
      state,
      None if params is None else to_core(params, 'update()'),
    )
    return from_core(u, updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def _manual_spec(x: Any, axes: frozenset[str]) -> P:
  """``x``'s PartitionSpec restricted to the manual ``axes``."""
  sharding = getattr(x, 'sharding', None)
  if not isinstance(sharding, NamedSharding):
    return P()
  entries = []
  for e in _mesh.spec_entries(sharding.spec):
    kept = tuple(a for a in e if a in axes)
    entries.append(kept if len(kept) > 1 else (kept[0] if kept else None))
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _spec_axes(spec: P) -> set[str]:
  return {a for e in _mesh.spec_entries(spec) for a in e}


def _default_batch(args, positions) -> set[int]:
  """The default batch argument: the last one holding an array of rank 1
  or more (trailing scalars, e.g. a step number or a typed RNG key, are
  state), graph nodes aside."""
  for k in range(len(args) - 1, -1, -1):
    if k in positions:
      continue
    leaves = jax.tree.leaves(args[k])
    if any(
      np.ndim(x) >= 1
      and not jax.dtypes.issubdtype(
        getattr(x, 'dtype', None), jax.dtypes.prng_key
      )
      for x in leaves
    ):
      return {k}
  return set()


def _check_no_nested_nodes(args, positions) -> None:
  """Raises for NNX graph nodes inside a container argument (a list or
  dict of metrics): train_step updates graph nodes passed as arguments
  themselves, and those would be copied in and their updates lost."""
  for k, a in enumerate(args):
    if k in positions:
      continue
    nested = [
      x
      for x in jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, nnx.Pytree))
      if isinstance(x, nnx.Pytree)
    ]
    if nested:
      raise TypeError(
        f'dmuon: argument {k} of the train step holds NNX graph nodes '
        f'({", ".join(sorted({type(x).__name__ for x in nested}))}) inside '
        f'a {type(a).__name__}; train_step updates graph nodes passed as '
        'arguments themselves (as nnx.jit does for its arguments), so their '
        'state would be lost here. Pass each one as an argument of its own.'
      )


def _settle(x, spec: P, axes: Sequence[str], what: str):
  """``x`` varying only where ``spec`` shards it: averaged over the other
  manual axes (e.g. batch statistics computed on each device's batch)."""
  extra = tuple(
    a
    for a in axes
    if a in _collectives.varying_axes(x) and a not in _spec_axes(spec)
  )
  if not extra:
    return x
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jax.lax.pmean(x, extra)
  raise ValueError(
    f'dmuon: {what} differs between the devices of {extra} after the step '
    f'(an integer {x.dtype} value); train_step can only average floats. '
    'Compute it from values that are the same on every device.'
  )


def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
  """``jax.random.fold_in`` of every key in an array of keys (the stacked
  RNG streams of an ``nnx.vmap`` stack too)."""
  if key.ndim == 0:
    return jax.random.fold_in(key, data)
  flat = key.reshape(-1)
  folded = jax.vmap(lambda k: jax.random.fold_in(k, data))(flat)
  return folded.reshape(key.shape)


_MANUAL_AXIS_ERRORS = (
  'can only refer to Auto axes',
  'Manual axes',
  'manual axes',
  # reshard / out_sharding= (dot_general, ...) naming a manual axis:
  'of type Auto or Manual',
  'AxisType.Manual',
  # An annotation's NamedSharding over the concrete (Auto) mesh.
  '`manual_axis_type`',
)
# Errors that only a manual axis raises, whose text names no axis: jax's
# NotImplementedError for a Manual -> Auto/Explicit conversion (nnx.Embed's
# out_sharding= runs its lookup in jax.sharding.auto_axes).
_MANUAL_ONLY_ERRORS = ('from `Manual` AxisType',)


def _explain_annotation(
  err: Exception, axes: Sequence[str], explicit: bool
) -> None:
  """Re-raises JAX's error for a sharding annotation naming a manual axis
  inside the step with what to do about it (``explicit``: whether the
  owner axes are Explicit on the dedication's mesh)."""
  text = str(err)
  if explicit:
    route = (
      'On this mesh the owner axes are Explicit: a plain nnx.jit/jax.jit '
      'step keeps every annotation (see the guide, "Your own jit step").'
    )
  else:
    route = (
      'To keep them, make the owner axes Explicit (jax.make_mesh(..., '
      'axis_types=(jax.sharding.AxisType.Explicit,) * n)), dedicate on that '
      'mesh and use a plain nnx.jit/jax.jit step (see the guide, "Your own '
      'jit step").'
    )
  names_axis = any(s in text for s in _MANUAL_AXIS_ERRORS) and any(
    a in text for a in axes
  )
  if names_axis or any(s in text for s in _MANUAL_ONLY_ERRORS):
    raise ValueError(
      f'dmuon: a sharding annotation inside the step names an owner axis '
      f'of {tuple(axes)}, which dmuon_jax.flax.train_step runs manually '
      '(each device runs the model on its own share of the batch). Leave '
      "those axes out of the model's activation annotations "
      '(with_sharding_constraint, out_sharding=, e.g. a sharding config '
      'without the data-parallel axis); annotations over the other mesh '
      f'axes keep working. {route} JAX said: {text.splitlines()[0]}'
    ) from err


def _output_specs(
  out: Any,
  other_def: Any,
  other_specs: Sequence[P],
  other_state: Sequence[bool],
) -> list[P]:
  """Per output leaf: the specs of the state argument it has the structure
  of (a returned ``TrainState``), else ``P()``."""
  args = jax.tree.unflatten(other_def, list(range(other_def.num_leaves)))
  by_structure = {}
  for arg in args:
    leaves = jax.tree.leaves(arg)
    if not leaves or not other_state[leaves[0]]:
      continue
    by_structure.setdefault(
      jax.tree.structure(arg), [other_specs[k] for k in leaves]
    )
  parts = out if isinstance(out, (tuple, list)) else (out,)
  specs: list[P] = []
  for part in parts:
    known = by_structure.get(jax.tree.structure(part))
    specs.extend(
      known if known is not None else [P()] * len(jax.tree.leaves(part))
    )
  if len(specs) != len(jax.tree.leaves(out)):
    return [P()] * len(jax.tree.leaves(out))
  return specs


def train_step(
  dedication: ModelDedication,
  fn: Callable[..., Any] | None = None,
  *,
  batch_argnums: Sequence[int] | None = None,
) -> Any:
  """Compiles a train step so that Muon runs at the byte floors.

  Use it instead of ``@nnx.jit`` on the step, unchanged::

    @dmuon_jax.flax.train_step(ded)
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

  The step runs inside ``jax.shard_map`` whose manual axes are the owner
  axes (``ded.axes``; the other mesh axes stay automatic): each device runs
  the model on its share of the batch, a boundary's matrices are
  all-gathered from their owners when it is called, and the gradients come
  back to the owners by reduce-scatter (Z2: 2(N-1)/N of the Muon bytes per
  step, Z3: 3(N-1)/N). What differs from ``nnx.jit``:

  - The batch arguments (``batch_argnums``, default: the last argument
    holding an array of rank 1 or more, so that trailing scalars such as a
    step number are not taken for the batch) are split
    over the owner axes along their first axis unless placed on the mesh
    already; other arguments are state: arrays placed on the mesh keep
    their sharding, unplaced ones are replicated, and an output with the
    structure of a state argument (a returned ``TrainState``) keeps its
    shardings.
  - Gradients are sums over devices of per-device mean-loss gradients; the
    optimizer of :func:`dedicated_muon` divides them (write the loss as a
    mean over the batch, as usual).
  - Every NNX graph node among the arguments (model, optimizer, metrics,
    ``nnx.Rngs``) is updated in place, as with ``nnx.jit``; graph nodes
    inside a container argument raise ``TypeError``.
  - Outputs, and float state that ends up differing between devices (e.g.
    batch statistics, a metric's total), are averaged over the owner axes
    (a metric summing over examples keeps one device's share in its
    ``total`` and ``count``; its ``compute()`` is the global one). ``nnx.BatchNorm``
    with ``axis_name=None`` normalizes with the device's batch: set
    ``axis_name=ded.axes`` for the global batch statistics.
  - Inside the step, sharding annotations (``with_sharding_constraint``,
    ``out_sharding=``) may name only the other mesh axes; an annotation
    naming an owner axis fails with an error that says so.

  Args:
    dedication: the model's :class:`ModelDedication`.
    fn: the step, e.g. ``(model, optimizer, batch) -> loss`` (NNX: graph
      nodes among the arguments are updated in place, as with ``nnx.jit``)
      or ``(state, batch) -> (state, metrics)`` (Linen ``TrainState``).
    batch_argnums: the positions of the batch arguments (default: the
      last argument holding an array of rank 1 or more).

  Returns:
    The compiled step (or a decorator, without ``fn``).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> optimizer = nnx.Optimizer(
    ...     model, dflax.dedicated_muon(ded, learning_rate=0.02), wrt=nnx.Param)
    >>> @dflax.train_step(ded)
    ... def step(model, optimizer, x):
    ...   loss_fn = lambda model: jnp.mean(model(x) ** 2)
    ...   loss, grads = nnx.value_and_grad(loss_fn)(model)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> x = jnp.ones((4, 8))
    >>> losses = [float(step(model, optimizer, x)) for _ in range(3)]
    >>> losses[2] < losses[1] < losses[0]
    True
  """
  if fn is None:
    return functools.partial(
      train_step, dedication, batch_argnums=batch_argnums
    )
  md = dedication
  ded = md.dedication
  axes = tuple(ded.buffer_axes) if ded.layout.distributed else ()
  manual = frozenset(axes)
  kinds = dict(zip(ded.mesh.axis_names, ded.mesh.axis_types)) if axes else {}
  explicit = bool(axes) and all(
    kinds[a] == jax.sharding.AxisType.Explicit for a in axes
  )
  compiled: dict[Any, Callable[..., Any]] = {}

  def build(
    graphdef, treedef, specs, other_def, other_specs, other_state, paths
  ):
    def body(flat, other):
      ctx = _ACTIVE.set(_StepContext(md))
      try:
        with _collectives.gradients_summed_over(axes):
          nodes = nnx.merge(graphdef, jax.tree.unflatten(treedef, flat))
          rest = jax.tree.unflatten(other_def, other)
          args = _merge_args(nodes, rest)
          # Each device draws its own random numbers (dropout masks of its
          # batch): the RNG keys folded with the device's index while the
          # step runs; the state keeps the keys as they were.
          keys = [
            v for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.RngKey)
          ]
          saved = [v.get_value() for v in keys]
          if axes:
            index = jax.lax.axis_index(axes)
            for v, k in zip(keys, saved):
              v.set_value(_fold_in(k, index))
          try:
            out = fn(*args)
          except (ValueError, TypeError, NotImplementedError) as err:
            _explain_annotation(err, axes, explicit)
            raise
          for v, k in zip(keys, saved):
            v.set_value(k)
          new_flat = treedef.flatten_up_to(nnx.split(nodes)[1])
      finally:
        _ACTIVE.reset(ctx)
      new_flat = [
        _settle(x, s, axes, f'state {p!r}')
        for x, s, p in zip(new_flat, specs, paths)
      ]
      leaves, out_def = jax.tree.flatten(out)
      out_specs = cell.get('out') or [P()] * len(leaves)
      leaves = [
        _settle(x, sp, axes, 'an output of the step')
        for x, sp in zip(leaves, out_specs)
      ]
      return new_flat, jax.tree.unflatten(out_def, leaves)

    cell: dict[str, Any] = {}
    if not axes:
      return jax.jit(body)

    def mapped(flat, other):
      # Outputs like an argument (a returned TrainState) keep its specs;
      # the rest is averaged. The output's structure comes from a trace.
      # Shapes only (eval_shape computes nothing): replication typing off
      # so that P() fits every output before its specs are known.
      probe = jax.shard_map(
        body,
        mesh=ded.mesh,
        in_specs=(list(specs), list(other_specs)),
        out_specs=(list(specs), P()),
        axis_names=manual,
        check_vma=False,
      )
      out = jax.eval_shape(probe, flat, other)[1]
      cell['out'] = _output_specs(out, other_def, other_specs, other_state)
      return jax.shard_map(
        body,
        mesh=ded.mesh,
        in_specs=(list(specs), list(other_specs)),
        out_specs=(
          list(specs),
          jax.tree.unflatten(jax.tree.structure(out), cell['out']),
        ),
        axis_names=manual,
      )(flat, other)

    def place(x, spec):
      if (
        isinstance(getattr(x, 'sharding', None), NamedSharding)
        and _manual_spec(x, manual) == spec
      ):
        return x
      return _mesh.place(x, ded.mesh, spec)

    def placed(flat, other):
      # The batch (and any unplaced state) onto the specs shard_map expects.
      flat = [place(x, s) for x, s in zip(flat, specs)]
      other = [place(x, s) for x, s in zip(other, other_specs)]
      return mapped(flat, other)

    return jax.jit(placed)

  positions: list[int] = []

  def _merge_args(nodes, rest):
    args, it_nodes, it_rest = [], iter(nodes), iter(rest)
    for k in range(len(positions) + len(rest)):
      args.append(next(it_nodes) if k in positions else next(it_rest))
    return args

  def prepare(args):
    # Every NNX graph node among the arguments (model, optimizer, metrics,
    # nnx.Rngs, ...) is updated in place afterwards, as nnx.jit does.
    positions[:] = [k for k, a in enumerate(args) if isinstance(a, nnx.Pytree)]
    _check_no_nested_nodes(args, positions)
    nodes = tuple(args[k] for k in positions)
    rest = [a for k, a in enumerate(args) if k not in positions]
    graphdef, state = nnx.split(nodes)
    flat_paths = jax.tree_util.tree_flatten_with_path(state)[0]
    # Uncommitted state (step counts, RNG keys) onto the mesh, as the step
    # returns it: the second call then runs the first call's executable.
    flat = _mesh.replicate_uncommitted(
      [x for _, x in flat_paths], ded.mesh if axes else None
    )
    treedef = jax.tree.structure(state)
    specs = tuple(_manual_spec(x, manual) for x in flat)
    batch = (
      _default_batch(args, positions)
      if batch_argnums is None
      else set(batch_argnums)
    )
    other, other_def = jax.tree.flatten(rest)
    is_batch = []
    for k, a in enumerate(args):
      if k not in positions:
        is_batch += [k in batch] * len(jax.tree.leaves(a))
    # Arrays placed on the mesh keep their specs; unplaced batch arrays are
    # split over the owner axes along their first axis, unplaced state (a
    # TrainState's batch statistics) is replicated.
    other = [
      x
      if b
      or isinstance(getattr(x, 'sharding', None), NamedSharding)
      or not axes
      else jax.device_put(x, NamedSharding(ded.mesh, P()))
      for x, b in zip(other, is_batch)
    ]
    other_specs = tuple(
      _manual_spec(x, manual)
      if isinstance(getattr(x, 'sharding', None), NamedSharding)
      else (P(axes) if axes and b and np.ndim(x) >= 1 else P())
      for x, b in zip(other, is_batch)
    )
    other_state = tuple(not b for b in is_batch)
    key = (
      graphdef,
      treedef,
      specs,
      other_def,
      other_specs,
      other_state,
      tuple(positions),
    )
    if key not in compiled:
      paths = tuple(_text(_path(k)) for k, _ in flat_paths)
      compiled[key] = build(
        graphdef, treedef, specs, other_def, other_specs, other_state, paths
      )
    return compiled[key], flat, other, nodes, treedef

  @functools.wraps(fn)
  def call(*args):
    jitted, flat, other, nodes, treedef = prepare(args)
    new_flat, out = jitted(flat, other)
    nnx.update(nodes, jax.tree.unflatten(treedef, new_flat))
    return out

  def compile(*args):  # noqa: A001
    """The step compiled for these arguments (e.g. for
    :func:`dmuon_jax.analyze_compiled`; a compilation of its own)."""
    jitted, flat, other, _, _ = prepare(args)
    return jitted.lower(flat, other).compile()

  call.compile = compile
  return call
