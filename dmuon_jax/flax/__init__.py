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

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import unfreeze
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checks, _gather, _mesh
from dmuon_jax.flax import _boundary, _model
from dmuon_jax.flax._boundary import LIFTED_BOUNDARY_MSG as LIFTED_BOUNDARY_MSG
from dmuon_jax.flax._model import DedicatedWeight as DedicatedWeight
from dmuon_jax.flax._model import ModelDedication as ModelDedication
from dmuon_jax.flax._model import OwnedBuffer as OwnedBuffer
from dmuon_jax.flax._model import ScanIteration as ScanIteration
from dmuon_jax.flax._step import dedicated_muon as dedicated_muon
from dmuon_jax.flax._step import train_step as train_step

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
  :func:`dmuon_jax.find_hook_boundaries`: ``layers[i]``, ``blocks[i]``,
  repeated submodules under an indexed name (``block0``) or in an
  ``nnx.List``/``nnx.Dict``, a ``nnx.vmap`` stack called through
  ``nnx.scan``, and in a model without blocks each Muon param's own module,
  the root for params set on it) gathers its gather
  group's matrices when it is called. Under :func:`train_step` that is an
  all-gather over the owner axes whose transpose reduce-scatters the
  gradients to the owners (Z3 gathers again in the backward pass, Z2 keeps
  the gathered weights). Every other variable (AdamW params, batch
  statistics, RNG state, sown values) stays as it was. Each boundary module
  is replaced in its parent by an instance of a subclass of its class (same
  name, same variables) whose ``__call__`` and public methods gather first
  (read it from the model after this call; a model that is its own only
  boundary changes class in place); it holds the dedication as
  ``dmuon_hook``.

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
    strict: as for :func:`dmuon_jax.dedicate`: False gathers a Muon
      target outside the model's blocks with its own module (an error
      naming it where that module holds blocks too).
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
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  kwargs = {k: v for k, v in locals().items() if k in _model.PLANNED}
  paths = _model.leaf_paths(params)
  # What Flax's sharding tools say of each param (its out_sharding
  # metadata), also where a traced value on Auto axes says nothing.
  specs = [_mesh.leaf_spec(_model.node_at(model, p)) for p in paths]
  ded, _, dp = _model.plan(
    params, mesh, 'nnx.scan', kwargs, _model.containers(model)
  )
  boundary_paths = [_model.path(k) for k in ded.boundary_keys]
  _model.check_model(model, paths, specs, ded, mesh, boundary_paths)

  # Each boundary module gets its group's owned buffers (a scanned stack
  # its ScanIteration too), each with its layout spec as its out_sharding
  # metadata: Flax's nnx.get_named_sharding (of the model, or of an
  # abstract one from nnx.eval_shape) gives the owners' sharding, and
  # nnx.Optimizer copies it into the momentum's variables.
  owned_vars = [
    _mesh.box_like(OwnedBuffer(x), x, spec)
    if ded.layout.distributed
    else OwnedBuffer(x)
    for x, spec in zip(dp.owned.buffers, ded.layout.buffer_specs())
  ]
  # Each boundary module becomes an instance of a subclass of its class
  # whose methods gather first (Python looks __call__ up on the type, and
  # NNX has no call hook of its own). Its parent holds the new instance,
  # built as nnx.merge builds a node: its attributes (the same Variables)
  # set on an empty one.
  for b, bpath in enumerate(boundary_paths):
    module = _model.node_at(model, bpath)
    g = _gather.group_of(ded, b)
    for j, v in enumerate(ded.layout.split_groups(owned_vars)[g]):
      setattr(module, f'dmuon_owned_{j}', v)
    if ded.boundaries.scanned[b]:
      n = ded.layout.iterations[g]
      module.dmuon_iteration = ScanIteration(jnp.arange(n))
    cls = _boundary.hooked_class(type(module))
    if bpath:
      hooked = cls._graph_node_create_empty(cls)
      vars(hooked).update(vars(module))
      _model.set_at(model, bpath, hooked)
    else:
      # A boundary that is the model itself (Flax's FSDP toy MLP): the
      # caller holds it, so no parent can hold a replacement; NNX offers no
      # other way to hook its __call__ than its type.
      module.__class__ = cls
  for t in ded.layout.leaves:  # a DedicatedWeight where each was
    boundary = ded.boundaries.names[_model.boundary_of(ded, t)]
    name = _model.text(paths[t.index])
    hole = _model.placeholder(ded, t)
    weight = DedicatedWeight(hole, dmuon_name=name, dmuon_boundary=boundary)
    _model.set_at(model, paths[t.index], weight)

  owned_state = nnx.to_flat_state(nnx.state(model, OwnedBuffer))
  where = {id(v): tuple(p) for p, v in owned_state}
  buffer_paths = [where[id(v)] for v in owned_vars]
  md = ModelDedication.of(ded, paths, boundary_paths, buffer_paths, specs)
  for b, bpath in enumerate(boundary_paths):  # the dedication each serves
    _model.node_at(model, bpath).dmuon_hook = _boundary.Hook(md, b)
  return md


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
  params = unfreeze(params)
  if 'params' in params and isinstance(params['params'], dict):
    raise ValueError(
      "dmuon: dedicate_linen takes the 'params' collection; got a "
      "variables dict (it has a 'params' key): pass variables['params']."
    )
  # Flax boxes (nn.Partitioned, nn.LogicallyPartitioned) come off, an
  # unplaced value put on the mesh as its box says; each leaf's box (or
  # None) is kept, to put back.
  flat, treedef = jax.tree.flatten(params, is_leaf=_mesh.is_box)
  boxes = [x if _mesh.is_box(x) else None for x in flat]
  specs = [None if box is None else _mesh.leaf_spec(box) for box in boxes]
  values = list(map(_mesh.unbox, flat))
  for i, spec in enumerate(specs):
    placed = isinstance(getattr(values[i], 'sharding', None), NamedSharding)
    if mesh is not None and spec is not None and not placed:
      values[i] = jax.device_put(values[i], NamedSharding(mesh, spec))
  params = jax.tree.unflatten(treedef, values)
  kwargs = {k: v for k, v in locals().items() if k in _model.PLANNED}
  ded, out, dp = _model.plan(params, mesh, 'nn.scan', kwargs)
  paths = _model.leaf_paths(params)
  for t in ded.layout.leaves:
    hole = _model.placeholder(ded, t)
    if mesh is not None:
      hole = jax.device_put(hole, NamedSharding(mesh, P()))
    _model.set_at(out, paths[t.index], hole)
  # A scanned stack gathers where its params hold one layer: in the module
  # nn.scan runs per layer, and its owned buffers are stored there too.
  boundary_paths = _model.gather_points(ded, paths)
  template = next((box for box in boxes if box is not None), None)
  buffer_paths: list[tuple] = [()] * len(dp.owned.buffers)
  groups = ded.layout.split_groups(range(len(buffer_paths)))
  for group, mine in zip(ded.groups, groups):
    for j, bi in enumerate(mine):
      buffer_paths[bi] = boundary_paths[group[0]] + (f'dmuon_owned_{j}',)
      buf = dp.owned.buffers[bi]
      if template is not None:  # boxed params: boxed buffers (their spec)
        buf = _mesh.box_like(template, buf, ded.layout.buffer_specs()[bi])
      _model.set_at(out, buffer_paths[bi], buf)
  # Boxed params keep their boxes (Flax's sharding tools read them), AdamW
  # params their sharding too.
  for i, box in enumerate(boxes):
    if box is not None and ded.rest_specs[i] is not None:  # AdamW params
      value = _model.node_at(out, paths[i])
      _model.set_at(out, paths[i], _mesh.rebox(box, value))
  return _boundary.LinenDedication.of(
    ded,
    paths,
    boundary_paths,
    buffer_paths,
    specs,
    linen_model=model,
    placeholder_paths=tuple(paths[t.index] for t in ded.layout.leaves),
    boundary_paths=boundary_paths,
  ), out
