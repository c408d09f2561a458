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
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _checks,
  _dedication,
  _flax_boundary,
  _flax_linen,
  _flax_plan,
  _gather,
  _mesh,
  _owner_layout,
)
from dmuon_jax._flax_boundary import LIFTED_BOUNDARY_MSG as LIFTED_BOUNDARY_MSG
from dmuon_jax._flax_step import dedicated_muon as dedicated_muon
from dmuon_jax._flax_step import train_step as train_step

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

# Ids of the boundary modules (the merged copies) whose call is running:
# their other methods run as written inside it.
_RUNNING: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
  'dmuon_jax_flax_running', default=frozenset()
)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDedication:
  """What :func:`dedicate` did to an NNX model.

  Linen dedications (:func:`dedicate_linen`) compare equal by value, and so
  do their ``apply`` and the optimizers :func:`dedicated_muon` makes of
  them with equal arguments: a trainer's init that dedicates, traced by
  ``jax.eval_shape`` and again by ``jax.jit``, gives one ``TrainState``
  structure. An NNX dedication equals only itself (its boundary modules
  find it by its ``key``).

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
      (:class:`DedicatedWeight` in NNX, a zero-size array in Linen params:
      ``(num_layers, 0)`` in a scanned stack).
    boundary_paths: per boundary, the path of the Linen module whose call
      gathers: the boundary's own, or for an ``nn.scan`` stack the deepest
      module holding all its Muon targets (run once per layer).

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

  dedication: _dedication.Dedication
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

  # Equal by value (Linen): a trainer's init that dedicates, traced twice
  # (jax.eval_shape, then jax.jit in another context: Flax lm1b's and
  # MaxText's setup_initial_state), makes two dedications, and the
  # TrainState's apply_fn and tx, which hold them, are pytree metadata
  # that JAX compares with ==. The key and the replicated list are left
  # out: one names the dedication, the other depends on the logical axis
  # rules in effect (a trace outside them cannot know it). An NNX
  # dedication's key ties it to its model's boundary modules: kept.
  @functools.cached_property
  def _key(self) -> tuple[Any, ...]:
    return (
      self.dedication,
      self.buffer_paths,
      self.rest_paths,
      self.targets,
      self.linen_model,
      self.placeholder_paths,
      self.boundary_paths,
      self.key if self.linen_model is None else None,
    )

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if not isinstance(other, ModelDedication):
      return NotImplemented
    return hash(self) == hash(other) and self._key == other._key

  def __hash__(self) -> int:
    # The Linen module is compared, not hashed (its fields may not be).
    return hash((self.dedication, self.key if self.linen_model is None else 0))

  @property
  def apply(self) -> _flax_linen.LinenApply:
    """``linen_model.apply`` with the boundaries gathering (Linen only).

    Use it as the ``apply_fn`` of a ``TrainState`` (and for evaluation):
    ``ded.apply(variables, *args, **kwargs)`` takes what
    ``flax.linen.Module.apply`` takes, with the dedicated params of
    :func:`dedicate_linen` in ``variables['params']``, and returns what it
    returns; each boundary module's call gathers its group's matrices from
    the owned buffers. It compares equal for equal dedications (a
    ``TrainState`` made in ``jax.eval_shape`` and again in ``jax.jit``).
    """
    if self.linen_model is None:
      raise TypeError(
        'dmuon: ModelDedication.apply is for Linen models (from '
        'dmuon_jax.flax.dedicate_linen); an NNX model is called directly.'
      )
    return _flax_linen.LinenApply(self)

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
        _flax_plan.path(k): _mesh.unbox(x)
        for k, x in jax.tree_util.tree_flatten_with_path(
          model, is_leaf=_mesh.is_box
        )[0]
      }
    owned = [by_path[p] for p in self.buffer_paths]
    rest = [None if p is None else by_path[p] for p in self.rest_paths]
    ded = self.dedication
    return ded.to_params(
      _dedication.DedicatedParams(
        owned=_owner_layout.OwnerBuffers(owned, ded.layout),
        rest=jax.tree.unflatten(ded.treedef, rest),
      )
    )


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

  attrs = {
    name: hook(getattr(cls, name)) for name in _flax_plan.public_methods(cls)
  }
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


# The options dedicate and dedicate_linen hand to the planner as they are.
_PLANNED = frozenset(
  {
    'predicate',
    'muon_weight_dimension_numbers',
    'boundary_predicate',
    'strict',
    'reshard_after_forward',
    'axis_names',
    'replicate_axis',
    'remat_policy',
    'ns_algorithm',
    'owner_groups',
    'tensor_parallel_axis',
  }
)


def dedicate(
  model: nnx.Module,
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

  Tensor parallelism: on a mesh with a tensor-parallel axis (e.g.
  ``('replicate', 'shard', 'model')``), Muon targets sharded over it along a
  matrix dimension (by their sharding metadata, ``nnx.with_partitioning``,
  or placed so) are stored split: each TP shard of an owner holds its
  slice, and a boundary module sees each target sharded over the TP axis as
  the param was, so a model written for the partitioner (no ``psum`` of its
  own) runs unchanged. The gathers move the slices over the owner axes
  only, and :func:`dedicated_muon` orthogonalizes them by Gram
  Newton-Schulz over the TP axis. Under a plain ``jax.jit``/``nnx.jit``
  step every mesh axis must be Explicit (row-parallel layers then name
  their output's sharding, e.g. ``out_sharding=P(ded.axes, None, None)``);
  :func:`train_step` also takes an Auto TP axis.

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
    ns_algorithm: as for :func:`dmuon_jax.dedicate` (TP-split matrices
      always run Gram Newton-Schulz).
    owner_groups: as for :func:`dmuon_jax.dedicate`.
    tensor_parallel_axis: as for :func:`dmuon_jax.dedicate` (default
      ``'auto'``: the axis named ``'model'``, ``'tensor'`` or ``'tp'`` that
      the Muon params are sharded over, if any).

  Returns:
    A :class:`ModelDedication`, for :func:`dedicated_muon` and
    :func:`train_step`.

  Raises:
    ValueError: for a model dedicated already, a Muon target held by two
      modules (tied weights), a boundary that is not a module, or what
      :func:`dmuon_jax.dedicate` rejects (on a mesh with a tensor-parallel
      axis: a Muon target not split over it, or split together with
      another axis on one dimension); when the model runs under a plain
      ``jax.jit``/``nnx.jit`` on a mesh whose owner axes are Explicit and
      whose tensor-parallel axis is not (make it Explicit too, or use
      :func:`train_step`).

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
  kwargs = {k: v for k, v in locals().items() if k in _PLANNED}
  layers_per_gather, choice = _flax_plan.scan_layers_per_gather(
    params, kwargs, layers_per_gather, 'nnx.scan'
  )
  paths = [
    _flax_plan.path(keys) for keys, _ in jax.tree.flatten_with_path(params)[0]
  ]
  # What Flax's sharding tools say of each param (its out_sharding
  # metadata), also where a traced value on Auto axes says nothing.
  specs = [_mesh.leaf_spec(_flax_plan.node_at(model, p)) for p in paths]
  ded, placed, dp, replicated, moved = _flax_plan.plan(
    params,
    mesh,
    layers_per_gather,
    choice,
    kwargs,
    specs,
  )
  for i, x in moved.items():
    variable = _flax_plan.node_at(model, paths[i])
    variable.set_value(x)
    _mesh.without_axes(variable, ded.buffer_axes)

  targets_by_leaf = {t.index: t for t in ded.layout.leaves}
  _flax_plan.rules_free_names(model, paths, specs, ded, mesh, targets_by_leaf)
  _flax_plan.check_untied(model, paths, targets_by_leaf)
  boundary_paths = [_flax_plan.path(k) for k in ded.boundary_keys]
  _flax_plan.check_boundary_modules(model, ded, boundary_paths)

  key = f'dmuon{next(_COUNTER)}'
  owned_vars = _owned_variables(ded, dp)
  _hook_boundaries(model, ded, key, boundary_paths, owned_vars)
  _set_placeholders(model, ded, paths, targets_by_leaf)

  owned_state = nnx.to_flat_state(nnx.state(model, OwnedBuffer))
  where = {id(v): tuple(p) for p, v in owned_state}
  md = ModelDedication(
    dedication=ded,
    key=key,
    buffer_paths=tuple(where[id(v)] for v in owned_vars),
    rest_paths=tuple(
      None if i in targets_by_leaf else p for i, p in enumerate(paths)
    ),
    targets=_flax_plan.targets(ded, paths, boundary_paths),
    replicated=tuple(replicated),
  )
  _REGISTRY[key] = md
  return md


def _owned_variables(ded, dp) -> list[OwnedBuffer]:
  """Per owner buffer (layout order), its :class:`OwnedBuffer`."""
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
  return owned_vars


def _hook_boundaries(model, ded, key, boundary_paths, owned_vars) -> None:
  """Gives each boundary module its group's owned buffers (and a scanned
  stack its :class:`ScanIteration`), and hooks its class."""
  for b, bpath in enumerate(boundary_paths):
    module = _flax_plan.node_at(model, bpath) if bpath else model
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


def _set_placeholders(model, ded, paths, targets_by_leaf) -> None:
  """Puts a :class:`DedicatedWeight` where each Muon target was."""
  for i, t in targets_by_leaf.items():
    scanned = ded.boundaries.scanned[_flax_plan.boundary_of(ded, t)]
    _flax_plan.set_at(
      model,
      paths[i],
      DedicatedWeight(
        _placeholder(t.shape, t.dtype, scanned),
        dmuon_name=_flax_plan.text(paths[i]),
        dmuon_boundary=ded.boundaries.names[_flax_plan.boundary_of(ded, t)],
      ),
    )


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
  holes = {
    rel: _flax_plan.node_at(module, rel).get_raw_value() for _, rel in mine
  }
  full = [rel for rel, x in holes.items() if np.size(x)]
  holes = {rel: (tuple(x.shape), x.dtype) for rel, x in holes.items()}
  if full:
    raise ValueError(
      f'dmuon: the Muon target(s) {[name + "/" + _flax_plan.text(r) for r in full]} of '
      'this dedicated model hold whole arrays: a plain (not dedicated) '
      'state was written into it (e.g. a checkpoint of the model before '
      'dmuon_jax.flax.dedicate). Restore plain checkpoints into a plain '
      'model and dedicate it after, or save and restore the dedicated '
      'state (nnx.state(model)).'
    )
  # The owned buffers stay out of the state that flows through the call:
  # every boundary of a group then sees the same buffer values.
  owned_filter = (OwnedBuffer, ScanIteration)
  arrays, nodes, rebuild = _flax_boundary.split_args(args, kwargs)
  graphdef, fixed, state = nnx.split((module, nodes), owned_filter, ...)
  fixed = jax.tree.map(jax.lax.stop_gradient, fixed)

  def run(mats, state, arrays):
    m, new_nodes = nnx.merge(graphdef, fixed, state)
    for i, rel in mine:
      _flax_plan.node_at(m, rel).set_value(mats[i])
    a, kw = rebuild(arrays, new_nodes)
    running = _RUNNING.set(_RUNNING.get() | {id(m)})
    try:
      out = original(m, *a, **kw)
    finally:
      _RUNNING.reset(running)
    for _, rel in mine:
      _flax_plan.node_at(m, rel).set_value(jnp.zeros(*holes[rel]))
    return out, nnx.state((m, new_nodes), nnx.Not(owned_filter))

  out, new_state = _flax_boundary.gathered(
    md, b, local, iteration, run, state, arrays
  )
  nnx.update((module, nodes), new_state)
  return out


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
  params = _flax_linen.plain_dicts(params)
  if 'params' in params and isinstance(params['params'], dict):
    raise ValueError(
      "dmuon: dedicate_linen takes the 'params' collection; got a "
      "variables dict (it has a 'params' key): pass variables['params']."
    )
  params, boxes = _flax_linen.unbox_linen(params, mesh)
  kwargs = {k: v for k, v in locals().items() if k in _PLANNED}
  layers_per_gather, choice = _flax_plan.scan_layers_per_gather(
    params, kwargs, layers_per_gather, 'nn.scan'
  )
  specs = [None if box is None else _mesh.leaf_spec(box) for box in boxes]
  ded, placed, dp, replicated, moved = _flax_plan.plan(
    params, mesh, layers_per_gather, choice, kwargs, specs
  )
  flat = jax.tree.flatten_with_path(placed)[0]
  paths = [_flax_plan.path(k) for k, _ in flat]
  targets_by_leaf = {t.index: t for t in ded.layout.leaves}
  out = _flax_linen.plain_dicts(placed)
  for i, t in targets_by_leaf.items():
    scanned = ded.boundaries.scanned[_flax_plan.boundary_of(ded, t)]
    hole = _placeholder(t.shape, t.dtype, scanned)  # nn.scan slices it
    if mesh is not None:
      hole = jax.device_put(hole, NamedSharding(mesh, P()))
    _flax_linen.set_item(out, paths[i], hole)
  # A scanned stack gathers where its params hold one layer: in the module
  # nn.scan runs per layer, and its owned buffers are stored there too.
  boundary_paths = _flax_plan.gather_points(ded, paths)
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
      _flax_linen.set_item(out, buffer_paths[bi], buf)
  # Boxed params keep their boxes (Flax's sharding tools read them); those
  # replicated over the owner axes say so. Where every mesh axis (of more
  # than one device) is an owner axis, every AdamW param ends replicated:
  # a box whose logical names the rules in effect map says so whatever
  # the rules are (a jax.eval_shape of the init outside them, as Flax lm1b
  # runs it, gives the jax.jit inside them the same boxes).
  owned_mesh = mesh is not None and all(
    a in ded.buffer_axes or mesh.shape[a] == 1 for a in mesh.axis_names
  )
  for i, box in enumerate(boxes):
    if box is not None and i not in targets_by_leaf:
      if owned_mesh and _mesh.rules_decide(box):
        box = _flax_linen.replicated_box(box)
      elif i in moved:
        box = _mesh.without_axes(box, ded.buffer_axes)
      _flax_linen.set_item(
        out, paths[i], _mesh.rebox(box, _flax_linen.node_at_dict(out, paths[i]))
      )
  key = f'dmuon{next(_COUNTER)}'
  md = ModelDedication(
    dedication=ded,
    key=key,
    buffer_paths=tuple(buffer_paths),
    rest_paths=tuple(
      None if i in targets_by_leaf else p for i, p in enumerate(paths)
    ),
    targets=_flax_plan.targets(ded, paths, boundary_paths),
    replicated=tuple(replicated),
    linen_model=model,
    placeholder_paths=tuple(paths[i] for i in targets_by_leaf),
    boundary_paths=boundary_paths,
  )
  # No registry entry: ded.apply hands its dedication to the boundary
  # modules itself (the registry serves NNX modules' hooks).
  return md, out
