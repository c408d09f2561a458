"""Paths of a Flax model's params, and their dedication (dmuon_jax.flax)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checks, _dedicated, _mesh, _routing


def _key(entry: Any) -> Any:
  for name in ('key', 'name', 'idx'):
    if hasattr(entry, name):
      return getattr(entry, name)
  return entry


def path(keys: Sequence[Any]) -> tuple[Any, ...]:
  return tuple(_key(k) for k in keys)


def text(path: Sequence[Any]) -> str:
  return '/'.join(str(k) for k in path)


def node_at(root: Any, path: Sequence[Any]) -> Any:
  node = root
  for k in path:
    node = node[k] if isinstance(k, int) else getattr(node, k)
  return node


def set_at(root: Any, path: Sequence[Any], value: Any) -> None:
  parent = node_at(root, path[:-1])
  if isinstance(path[-1], int):
    parent[path[-1]] = value
  else:
    setattr(parent, path[-1], value)


def plan(params, mesh, layers_per_gather, choice, kwargs, specs):
  """The dedication of a Flax model's params, and the params placed for it.

  Plans with :func:`dmuon_jax.dedicate`, checks what ``dmuon_jax.flax``
  cannot run, replicates AdamW params sharded over an owner axis (see
  :func:`_replicate_rest`; ``specs``: per leaf, the spec its Flax metadata
  gives, or None) and puts unplaced params on the mesh.

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
  scanned = [
    n for n, s in zip(ded.boundaries.names, ded.boundaries.scanned) if s
  ]
  if ded.tensor_parallel_axis is not None and scanned:
    raise ValueError(
      'dmuon: dmuon_jax.flax does not run tensor-parallel matrices inside '
      f'scanned stacks yet ({scanned}, over {ded.tensor_parallel_axis!r}). '
      'Use the explicit API (dmuon_jax.dedicate, Dedication.scan), run the '
      'layers as a Python loop, or pass tensor_parallel_axis=None with the '
      'stack replicated over it.'
    )
  params, ded, replicated, moved = _replicate_rest(
    ded, params, mesh, kwargs, specs
  )
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


def boundary_of(ded, target) -> int:
  return ded.boundaries.of_target[ded.boundaries.paths.index(target.path)]


def targets(ded, paths, boundary_paths) -> tuple:
  """Per boundary, ``(leaf index, path inside the boundary module)`` of its
  Muon targets."""
  targets: list[list[tuple[int, tuple]]] = [[] for _ in boundary_paths]
  for t in ded.layout.leaves:
    b = boundary_of(ded, t)
    targets[b].append((t.index, paths[t.index][len(boundary_paths[b]) :]))
  return tuple(tuple(t) for t in targets)


def _replicate_rest(ded, params, mesh, kwargs, specs):
  """AdamW params sharded over an owner axis, replicated over the owner
  axes (inside train_step every device runs the whole model on its own
  batch); the dedication planned again if any moved.

  A leaf's sharding is the one its Flax metadata gives (``specs``), where
  it has some: under an abstract or jitted init on Auto axes the traced
  values carry none, yet ``jit(init, out_shardings=...)`` would place them
  as their metadata says.
  """
  leaves = jax.tree.leaves(params)
  flat = jax.tree.flatten_with_path(params)[0]
  owner = set(ded.buffer_axes)
  replicated, moved, extra = [], {}, 0
  for i, (rest_spec, (keys, x)) in enumerate(zip(ded.rest_specs, flat)):
    if rest_spec is None:  # a Muon target
      continue
    spec = specs[i] if specs[i] is not None else rest_spec
    axes = {a for e in _mesh.spec_entries(spec) for a in e}
    if not axes & owner:
      continue
    kept = P(
      *(
        tuple(a for a in e if a not in owner) or None
        for e in _mesh.spec_entries(spec)
      )
    )
    moved[i] = leaves[i] = jax.device_put(x, NamedSharding(mesh, kept))
    replicated.append(text(path(keys)))
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
      _checks.DMuonWarning,
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
      if not boundary_predicate(prefix, _checks.subtree(params, keys[:depth])):
        continue
      if not any(t == prefix or t.startswith(prefix + '/') for t in targets):
        raise ValueError(
          f'dmuon: boundary_predicate names module {prefix!r}, which holds '
          'no Muon target (its params are AdamW params): its call would '
          'gather nothing. Leave it out of the predicate (the boundaries '
          f'with targets are {list(ded.boundaries.names)}).'
        )
      break


def scan_layers_per_gather(params, kwargs, layers_per_gather, scan: str):
  """``(layers_per_gather, choice)`` for a model with scanned stacks (one
  layer per ``scan`` iteration, so 1); unchanged without any. ``kwargs``:
  the dedication's keyword arguments (routing and boundary options)."""
  bounds = _checks.find_hook_boundaries(
    params,
    predicate=kwargs['predicate'] if kwargs['predicate'] != 'optax' else None,
    weight_dimension_numbers=kwargs['muon_weight_dimension_numbers'],
    boundary_predicate=kwargs['boundary_predicate'],
    strict=kwargs['strict'],
  )
  if not any(bounds.scanned):
    return layers_per_gather, None
  if layers_per_gather not in ('auto', 1):
    raise ValueError(
      f'dmuon: layers_per_gather={layers_per_gather!r}, but the scanned '
      f'stack(s) {[n for n, s in zip(bounds.names, bounds.scanned) if s]}'
      f' run one layer per {scan} iteration, so each gather holds one '
      'layer. Pass layers_per_gather=1 (or the default).'
    )
  return 1, f'one layer per {scan} iteration'


def gather_points(ded, paths) -> tuple[tuple[Any, ...], ...]:
  """Per boundary, the module path whose call gathers (Linen): the
  boundary's own, and for a scanned stack the deepest module that holds
  all its Muon targets (the module ``nn.scan`` runs once per layer, or one
  inside it: its params are sliced to one layer there)."""
  points = [path(k) for k in ded.boundary_keys]
  for b, scanned in enumerate(ded.boundaries.scanned):
    if not scanned:
      continue
    mine = [
      paths[t.index][:-1] for t in ded.layout.leaves if boundary_of(ded, t) == b
    ]
    common = mine[0]
    for p in mine[1:]:
      n = next((i for i, (x, y) in enumerate(zip(common, p)) if x != y), None)
      common = common[: min(len(common), len(p)) if n is None else n]
    points[b] = common
  return tuple(points)


def rules_free_names(model, paths, specs, ded, mesh, targets) -> None:
  """Makes what an NNX model's param metadata says of its sharding the
  same whatever logical axis rules are in effect where it is dedicated.

  A trainer's init that dedicates may be traced twice: by
  ``jax.eval_shape`` outside ``nn.logical_axis_rules`` (Flax lm1b's and
  MaxText's order), then by ``jax.jit(init, out_shardings=...)`` inside
  them; ``jax.jit`` takes the two states for one tree only where their
  ``out_sharding`` metadata agree, and places the params as the abstract
  one says. On a mesh whose axes of more than one device are all owner
  axes, every AdamW param ends replicated whatever the rules are: its
  logical names (those that are no mesh axis: what the rules map) are
  renamed None in place. On any other mesh, a param naming logical axes
  where no rules are in effect could be sharded over an owner axis or not:
  an error naming it and the fix.
  """
  if mesh is None:
    return
  axes = set(mesh.axis_names)
  logical = lambda e: isinstance(e, str) and e not in axes
  owned_mesh = all(
    a in ded.buffer_axes or mesh.shape[a] == 1 for a in mesh.axis_names
  )
  for i, p in enumerate(paths):
    variable = node_at(model, p)
    names = variable.get_metadata().get('out_sharding')
    if not isinstance(names, (tuple, list, P)):
      continue
    if not any(logical(e) for e in names):
      continue
    if owned_mesh:
      if i not in targets:  # Muon targets: placeholders
        variable.set_metadata(
          out_sharding=tuple(None if logical(e) else e for e in names)
        )
      continue
    ruled = core_spmd.get_logical_axis_rules() or variable.get_metadata().get(
      'sharding_rules'
    )
    unmapped = [
      a for e in _mesh.spec_entries(specs[i]) for a in e if a not in axes
    ]
    if unmapped and not ruled:  # (rules that leave a name out: as before)
      others = [
        a
        for a in mesh.axis_names
        if a not in ded.buffer_axes and mesh.shape[a] > 1
      ]
      decides = (
        'whether its owners store it split over a tensor-parallel axis'
        if i in targets
        else 'whether dedication replicates it over the owner axes '
        f'{ded.buffer_axes}'
      )
      raise ValueError(
        f'dmuon: dedicate cannot tell how param {text(p)!r} is sharded: its '
        f'out_sharding {tuple(names)} names logical axes {unmapped}, no '
        'logical axis rules are in effect to map them, and on this mesh (the '
        f'axes {others} are no owner axes) they decide {decides}. An init '
        'traced by jax.eval_shape outside nn.logical_axis_rules and by jax.jit '
        'inside them would dedicate it two ways, which jax.jit refuses: run '
        'the eval_shape inside the rules too (with '
        'nn.logical_axis_rules(rules): abstract = jax.eval_shape(init)).'
      )


def references(model: nnx.Module) -> dict[int, list[tuple]]:
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


def public_methods(cls: type) -> list[str]:
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


def check_untied(model, paths, targets_by_leaf) -> None:
  """Raises for a Muon target held by two modules (tied weights)."""
  refs = references(model)
  for i in targets_by_leaf:
    # The target, or a module on its path, held by two parents: tied.
    holders = max(
      (
        refs.get(id(node_at(model, paths[i][:d])), [])
        for d in range(1, len(paths[i]) + 1)
      ),
      key=len,
    )
    if len(holders) > 1:
      raise ValueError(
        f'dmuon: Muon target {text(paths[i])!r} is held by '
        f'{[text(h) for h in holders]} (tied weights): one owner cannot '
        'serve two boundaries. Route it to AdamW (predicate) or untie it.'
      )


def check_boundary_modules(model, ded, boundary_paths) -> None:
  """Raises for a hook boundary that is not an ``nnx.Module``."""
  for b, bpath in enumerate(boundary_paths):
    module = node_at(model, bpath) if bpath else model
    if not isinstance(module, nnx.Module):
      raise ValueError(
        f'dmuon: hook boundary {ded.boundaries.names[b]!r} is a '
        f'{type(module).__name__}, not an nnx.Module: its call cannot '
        'gather. Pass a boundary_predicate that names modules.'
      )
