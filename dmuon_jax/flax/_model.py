"""What dmuon_jax.flax records of a dedicated Flax model: its variables,
its :class:`ModelDedication`, and the paths and plan of its params."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _checks,
  _dedicated,
  _dedication,
  _gather,
  _mesh,
  _owner_layout,
  _routing,
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
  the module runs; inside :func:`train_step` it holds the whole matrix
  (metrics over the params read it). Reading its value elsewhere (``[...]``,
  ``get_value()``, ``jax.debug.visualize_array_sharding``, arithmetic)
  raises an error naming the param and ``ModelDedication.to_params`` (the
  whole arrays), so that no zero-size array reaches metrics or evaluation
  code; ``.shape`` is the placeholder's (Flax's ``nnx.get_named_sharding``
  reads it).

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
        f'dmuon: {name!r} is a dedicated Muon weight, stored on its owners '
        f'and gathered only while its hook boundary {boundary!r} runs (call '
        'that module or a method of it); for the whole array elsewhere '
        '(metrics, sharding visualization, export) read ded.to_params(model).'
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


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDedication:
  """What :func:`dedicate` did to an NNX model.

  Linen dedications (:func:`dedicate_linen`) compare equal by value, and so
  do their ``apply`` and the optimizers :func:`dedicated_muon` makes of
  them with equal arguments: a trainer's init that dedicates, traced by
  ``jax.eval_shape`` and again by ``jax.jit``, gives one ``TrainState``
  structure. An NNX dedication equals only itself (its boundary modules
  hold it).

  Attributes:
    dedication: the :class:`dmuon_jax.Dedication` of the model's params
      (plan, boundaries, gather groups, layout).
    buffer_paths: per owned buffer (layout order), its path in
      ``nnx.state(model, nnx.Param)``.
    rest_paths: per param leaf of the plain params tree, its path (None for
      Muon targets).
    targets: per boundary, ``(leaf index, path inside the boundary module)``
      of its Muon targets.
    warned: a one-element list: whether the GSPMD-gather warning of a call
      outside :func:`train_step` was given (once per model).
    gathered: under plain ``jit`` on Explicit owner axes, each gather
      group's gathered value in the trace that is running (so a group's
      blocks, and a block called twice, share one gather and one
      reduce-scatter); replaced when another trace starts.
    gathered_manual: the same inside :func:`train_step` (manual owner
      axes).
    reading_whole: a one-element list: whether :func:`train_step`'s step
      is running with the whole matrices in the placeholders (read as
      written there).
    linen_model: the Linen module (from :func:`dedicate_linen`), or None
      for an NNX model.
    placeholder_paths: per Muon target, the path of its placeholder
      (:class:`DedicatedWeight` in NNX, a zero-size array in Linen params:
      ``(num_layers, 0)`` in a scanned stack).
    boundary_paths: per boundary, the path of the Linen module whose call
      gathers: the boundary's own, or for an ``nn.scan`` stack the deepest
      module holding all its Muon targets (run once per layer).
    sharded: the AdamW params sharded over an owner axis (by their Flax
      metadata, else their placement): they stay so, their moments alike,
      and :func:`train_step` gathers them for the step.

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
  buffer_paths: tuple[tuple[Any, ...], ...]
  rest_paths: tuple[tuple[Any, ...] | None, ...]
  targets: tuple[tuple[tuple[int, tuple[Any, ...]], ...], ...]
  warned: list[bool] = dataclasses.field(default_factory=lambda: [False])
  gathered: dict = dataclasses.field(default_factory=dict, repr=False)
  gathered_manual: dict = dataclasses.field(default_factory=dict, repr=False)
  reading_whole: list[bool] = dataclasses.field(
    default_factory=lambda: [False], repr=False
  )
  linen_model: Any = None
  placeholder_paths: tuple[tuple[Any, ...], ...] = ()
  boundary_paths: tuple[tuple[Any, ...], ...] = ()
  sharded: tuple[str, ...] = ()

  # Equal by value (Linen): a trainer's init that dedicates, traced twice
  # (jax.eval_shape, then jax.jit in another context: Flax lm1b's and
  # MaxText's setup_initial_state), makes two dedications, and the
  # TrainState's apply_fn and tx, which hold them, are pytree metadata
  # that JAX compares with ==. The sharded list is left out: it depends on
  # the logical axis rules in effect (a trace outside them cannot know it).
  # An NNX dedication is its model's boundary modules' own: equal only to
  # itself.
  @functools.cached_property
  def _key(self) -> tuple[Any, ...]:
    skip = ('sharded', 'warned', 'gathered', 'gathered_manual', 'reading_whole')
    fields = [f.name for f in dataclasses.fields(self) if f.name not in skip]
    return tuple(getattr(self, name) for name in fields)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, ModelDedication):
      return NotImplemented
    linen = self.linen_model is not None  # (the model is in the key)
    return self is other or (linen and self._key == other._key)

  def __hash__(self) -> int:
    # The Linen module is compared, not hashed (its fields may not be).
    return id(self) if self.linen_model is None else hash(self.dedication)

  @classmethod
  def of(
    cls, ded, paths, modules, buffer_paths, specs, **kwargs
  ) -> ModelDedication:
    """The record of ``ded`` over a model whose param leaves lie at
    ``paths`` (their Flax metadata's specs: ``specs``, None where they have
    none) and whose boundaries' gathering modules at ``modules``."""
    owner = set(ded.buffer_axes)
    kwargs['sharded'] = tuple(
      p
      for p, rest, spec in zip(ded.leaf_paths, ded.rest_specs, specs)
      if rest is not None
      and _mesh.sharded_axes([rest if spec is None else spec]) & owner
    )
    targets: list[list[tuple[int, tuple]]] = [[] for _ in modules]
    for t in ded.layout.leaves:
      b = boundary_of(ded, t)
      targets[b].append((t.index, paths[t.index][len(modules[b]) :]))
    rest = [None if s is None else p for p, s in zip(paths, ded.rest_specs)]
    owned, mine = tuple(buffer_paths), tuple(map(tuple, targets))
    return cls(ded, owned, tuple(rest), mine, **kwargs)

  @property
  def apply(self) -> Callable[..., Any]:
    """``linen_model.apply`` with the boundaries gathering (Linen only).

    Use it as the ``apply_fn`` of a ``TrainState`` (and for evaluation):
    ``ded.apply(variables, *args, **kwargs)`` takes what
    ``flax.linen.Module.apply`` takes, with the dedicated params of
    :func:`dedicate_linen` in ``variables['params']``, and returns what it
    returns; each boundary module's call gathers its group's matrices from
    the owned buffers. It compares equal for equal dedications (a
    ``TrainState`` made in ``jax.eval_shape`` and again in ``jax.jit``).
    """
    raise TypeError(
      'dmuon: ModelDedication.apply is for Linen models (from '
      'dmuon_jax.flax.dedicate_linen); an NNX model is called directly.'
    )

  @property
  def axes(self) -> tuple[str, ...]:
    """The owner axes, :func:`train_step`'s manual (data-parallel) axes."""
    return self.dedication.buffer_axes

  def summary(self) -> str:
    """The dedication's summary (the hook boundaries and how each was
    found, gather groups, padding, owner plan) and the AdamW params stored
    sharded over the owner axes."""
    text = self.dedication.summary()
    if self.sharded:
      text += (
        f'\n  AdamW params sharded over the owner axes {self.axes}, their '
        'moments alike (train_step gathers them for the step): '
        f'{list(self.sharded)}'
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
      (``nnx.to_pure_dict`` form for NNX). Inside :func:`train_step` too
      (e.g. metrics over the params): each device's owner blocks are
      all-gathered there first.
    """
    if isinstance(model, nnx.Module):
      model = nnx.state(model, nnx.Param)
    dp = self.dedicated(model)
    manual = _gather.manual_axes()
    if manual & set(self.axes):  # inside train_step: this device's blocks

      def whole(x, spec):
        for dim, entry in enumerate(_mesh.spec_entries(spec)):
          if axes := tuple(a for a in entry if a in manual):
            x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
        return x

      specs = self.dedication.layout.buffer_specs()
      dp = dp._replace(owned=dp.owned.rebox(map(whole, dp.owned, specs)))
    return self.dedication.to_params(dp)

  def dedicated(self, tree: Any, what: str | None = None, boxes=False):
    """The :class:`dmuon_jax.DedicatedParams` of a params (or gradients)
    tree of the dedicated model, read by path; ``what`` names the caller
    in the error for a param the model did not have (None: ignored);
    ``boxes``: Linen boxes and NNX Variables kept on the leaves."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_mesh.is_boxed)
    found = {path(k): x if boxes else _mesh.unbox(x) for k, x in flat[0]}
    known = {*self.buffer_paths, *self.rest_paths, *self.placeholder_paths}
    for p in found:
      if p not in known and what is not None:
        raise ValueError(
          f'dmuon: {what} got param {text(p)!r}, which the dedicated model'
          ' did not have at dmuon_jax.flax.dedicate(); make the optimizer '
          'for this model with wrt=nnx.Param.'
        )
    wanted = [p for p in self.buffer_paths + self.rest_paths if p is not None]
    missing = [text(p) for p in wanted if p not in found]
    if missing:
      raise ValueError(
        f'dmuon: {what or "to_params()"} is missing params {missing[:5]} of '
        'the dedicated model; pass nnx.state(model, nnx.Param) '
        '(nnx.Optimizer with wrt=nnx.Param does).'
      )
    ded = self.dedication
    return _dedication.DedicatedParams(
      owned=_owner_layout.OwnerBuffers(
        [found[p] for p in self.buffer_paths], ded.layout
      ),
      rest=jax.tree.unflatten(ded.treedef, map(found.get, self.rest_paths)),
    )


def placeholder(ded, target) -> jax.Array:
  """The zero-size array that stands for Muon ``target`` (with the layer
  axis in a scanned stack: ``nn.scan``/``nnx.scan`` slice it)."""
  scanned = ded.boundaries.scanned[boundary_of(ded, target)]
  return jnp.zeros((target.shape[0], 0) if scanned else (0,), target.dtype)


# The options dedicate and dedicate_linen hand to the planner (dmuon_jax.
# dedicate's, but its params, mesh and deprecated spelling).
_OPTIONS = inspect.signature(_dedicated.dedicate).parameters
PLANNED = frozenset(_OPTIONS) - {'params', 'mesh', 'weight_dimension_numbers'}


def path(keys: Sequence[Any]) -> tuple[Any, ...]:
  """A key path's keys (a dict key, an attribute name, an index)."""
  get = getattr
  return tuple(get(k, 'key', get(k, 'name', get(k, 'idx', k))) for k in keys)


def leaf_paths(tree: Any) -> list[tuple[Any, ...]]:
  """Per leaf of ``tree``, its path."""
  return [path(keys) for keys, _ in jax.tree.flatten_with_path(tree)[0]]


def text(path: Sequence[Any]) -> str:
  return '/'.join(str(k) for k in path)


def _by_item(node: Any, k: Any) -> bool:
  """Whether ``node`` holds ``k`` as an item (a list index, a key of a
  mapping: Linen params) rather than an attribute (an NNX module's)."""
  return isinstance(k, int) or isinstance(node, Mapping)


def node_at(root: Any, path: Sequence[Any]) -> Any:
  node = root
  for k in path:
    node = node[k] if _by_item(node, k) else getattr(node, k)
  return node


def set_at(root: Any, path: Sequence[Any], value: Any) -> None:
  parent = node_at(root, path[:-1])
  if _by_item(parent, path[-1]):
    parent[path[-1]] = value
  else:
    setattr(parent, path[-1], value)


def containers(model: nnx.Module) -> frozenset[str]:
  """The paths of ``model``'s containers (``nnx.List``, ``nnx.Dict``,
  ``list``, ``dict``, ``tuple``) of two or more submodules of one class:
  their entries are repeated siblings whatever their names."""
  found = set()
  for keys, node in nnx.iter_graph(model):
    if isinstance(node, (nnx.List, nnx.Dict, list, dict, tuple)):
      items = node.values() if isinstance(node, (dict, nnx.Dict)) else node
      kinds = {type(x) for x in items if isinstance(x, nnx.Module)}
      if len(kinds) == 1 and sum(isinstance(x, nnx.Module) for x in items) > 1:
        found.add(text(keys))
  return frozenset(found)


def plan(params, mesh, scan: str, kwargs, blocks=frozenset()):
  """The dedication of a Flax model's params, and the params placed for it.

  Plans with :func:`dmuon_jax.dedicate` (``kwargs``: its options; one layer
  per gather in a model with ``scan``-ned stacks: one layer per ``scan``
  iteration), checks what ``dmuon_jax.flax`` cannot run and puts unplaced
  params on the mesh, replicated. AdamW params keep their sharding (over
  owner axes too: :func:`train_step` gathers them for the step).

  Without a ``boundary_predicate``, the boundaries are found by
  :func:`dmuon_jax.find_hook_boundaries`'s default rules, ``blocks`` (the
  model's containers of submodules, :func:`containers`) counting as
  repeated siblings.

  Returns:
    ``(dedication, placed params, DedicatedParams)``.
  """
  k, is_boundary = kwargs.pop('layers_per_gather'), kwargs['boundary_predicate']
  if is_boundary is None:
    kwargs['boundary_predicate'] = _checks.ModelBlocks(blocks)
  bounds = _checks.find_hook_boundaries(
    params,
    predicate=kwargs['predicate'],
    weight_dimension_numbers=kwargs['muon_weight_dimension_numbers'],
    boundary_predicate=kwargs['boundary_predicate'],
    strict=kwargs['strict'],
  )
  stacks = [n for n, s in zip(bounds.names, bounds.scanned) if s]
  if stacks and k not in ('auto', 1):
    raise ValueError(
      f'dmuon: layers_per_gather={k!r}, but the scanned '
      f'stack(s) {stacks} run one layer per {scan} iteration, so each '
      'gather holds one layer. Pass layers_per_gather=1 (or the default).'
    )
  ded = _dedicated.dedicate(
    params, mesh, layers_per_gather=1 if stacks else k, **kwargs
  )
  # A module the boundary predicate names (outermost matches) that holds no
  # Muon target: its call would gather nothing.
  # (prefix -> whether the predicate names it: asked once per module;
  # below a module it names, nothing is asked.)
  targets, named = [t.path for t in ded.layout.leaves], {}
  for keys, _ in jax.tree.flatten_with_path(params)[0] if is_boundary else ():
    for depth in range(1, len(keys)):
      prefix = _routing.normalize_path(keys[:depth])
      if prefix not in named:
        sub = _checks.subtree(params, keys[:depth])
        named[prefix] = bool(is_boundary(prefix, sub))
      if named[prefix]:
        if not any(t == prefix or t.startswith(prefix + '/') for t in targets):
          raise ValueError(
            f'dmuon: boundary_predicate names module {prefix!r}, which holds '
            'no Muon target (its params are AdamW params): its call would '
            'gather nothing. Leave it out of the predicate (the boundaries '
            f'with targets are {list(ded.boundaries.names)}).'
          )
        break
  leaves, treedef = jax.tree.flatten(params)
  choice = f'one layer per {scan} iteration' if stacks else None
  ded = dataclasses.replace(
    ded, layers_per_gather_choice=choice or ded.layers_per_gather_choice
  )
  if mesh is not None:  # unplaced params replicated on the mesh
    on_mesh = lambda x: isinstance(getattr(x, 'sharding', None), NamedSharding)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
    leaves = [x if on_mesh(x) else put(x) for x in leaves]
  params = jax.tree.unflatten(treedef, leaves)
  return ded, params, ded.to_dedicated(params)


def boundary_of(ded, target) -> int:
  return ded.boundaries.of_target[ded.boundaries.paths.index(target.path)]


def gather_points(ded, paths) -> tuple[tuple[Any, ...], ...]:
  """Per boundary, the module path whose call gathers (Linen): the
  boundary's own, and for a scanned stack the deepest module that holds
  all its Muon targets (the module ``nn.scan`` runs once per layer, or one
  inside it: its params are sliced to one layer there)."""
  points = [path(k) for k in ded.boundary_keys]
  for b, scanned in enumerate(ded.boundaries.scanned):
    if scanned:
      mine = [
        paths[t.index][:-1]
        for t in ded.layout.leaves
        if boundary_of(ded, t) == b
      ]
      points[b] = os.path.commonprefix(mine)
  return tuple(points)


def owned_mesh(ded, mesh) -> bool:
  """Whether every axis of ``mesh`` of more than one device is an owner
  axis (no Muon target is then split over a tensor-parallel axis, whatever
  the logical axis rules say)."""
  return mesh is not None and all(
    a in ded.buffer_axes or mesh.shape[a] == 1 for a in mesh.axis_names
  )


def check_model(model, paths, specs, ded, mesh, boundary_paths) -> None:
  """Checks an NNX model for dedication, in one walk of its params.

  Raises for a hook boundary that is not an ``nnx.Module``, a Muon target
  held by two modules (tied weights), or a Muon target whose sharding the
  logical axis rules in effect decide (below).

  A trainer's init that dedicates may be traced twice: by
  ``jax.eval_shape`` outside ``nn.logical_axis_rules`` (Flax lm1b's and
  MaxText's order), then by ``jax.jit(init, out_shardings=...)`` inside
  them; ``jax.jit`` takes the two states for one tree only where their
  ``out_sharding`` metadata agree, and places the params as the abstract
  one says. AdamW params keep their metadata and their sharding, whatever
  the rules map it to. On a mesh with an axis of more than one device that
  is no owner axis, a Muon target naming logical axes where no rules are
  in effect could be split over a tensor-parallel axis or not: an error
  naming it and the fix.
  """
  for b, bpath in enumerate(boundary_paths):
    module = node_at(model, bpath)
    if not isinstance(module, nnx.Module):
      name = ded.boundaries.names[b]
      how = (ded.boundaries.how or ('',) * (b + 1))[b]
      why = (
        f' (strict=False gathers a Muon target outside the blocks with its '
        f'module, but {name!r} lies on {text(bpath[:-1]) or "the root"!r}, '
        'which holds blocks too: its call would gather around theirs)'
        if how == 'target itself'
        else ''
      )
      raise ValueError(
        f'dmuon: hook boundary {name!r} is a {type(module).__name__}, not '
        f'an nnx.Module: its call cannot gather{why}. Route {name!r} to '
        'AdamW (predicate), or pass a boundary_predicate=(path, subtree) -> '
        'bool that names the modules that use it.'
      )
  targets = {t.index for t in ded.layout.leaves}
  held = {p: paths for paths in nnx.find_duplicates(model) for p in paths}
  axes = set(() if mesh is None else mesh.axis_names)
  owned = owned_mesh(ded, mesh)
  owners = ded.buffer_axes
  for i, p in enumerate(paths):
    # The target, or a module on its path, held by two parents: tied.
    holders = max((held.get(p[:d], []) for d in range(1, len(p) + 1)), key=len)
    if i in targets and len(holders) > 1:
      raise ValueError(
        f'dmuon: Muon target {text(p)!r} is held by '
        f'{[text(h) for h in holders]} (tied weights): one owner cannot '
        'serve two boundaries. Route it to AdamW (predicate) or untie it.'
      )
    variable = node_at(model, p)
    meta = variable.get_metadata()
    names = meta.get('out_sharding')
    # Names that are mesh axes, which no rules change, are read the same
    # in any context.
    if (
      mesh is None
      or owned
      or i not in targets
      or not names
      or _mesh.context_free_spec(variable, axes) is not None
    ):
      continue
    ruled = core_spmd.get_logical_axis_rules() or meta.get('sharding_rules')
    unmapped = sorted(_mesh.sharded_axes([specs[i]]) - axes)
    if unmapped and not ruled:  # (rules that leave a name out: as before)
      others = [a for a, n in mesh.shape.items() if n > 1 and a not in owners]
      raise ValueError(
        f'dmuon: dedicate cannot tell how param {text(p)!r} is sharded: its '
        f'out_sharding {tuple(names)} names logical axes {unmapped}, no '
        'logical axis rules are in effect to map them, and on this mesh (the '
        f'axes {others} are no owner axes) they decide whether its owners '
        'store it split over a tensor-parallel axis. An init '
        'traced by jax.eval_shape outside nn.logical_axis_rules and by jax.jit '
        'inside them would dedicate it two ways, which jax.jit refuses: run '
        'the eval_shape inside the rules too (with '
        'nn.logical_axis_rules(rules): abstract = jax.eval_shape(init)).'
      )
