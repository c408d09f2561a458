"""Mesh axes in one place: owner axes, sizes, the TP axis, specs, placement."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax._routing import normalize_path

# Per dimension of an array, the mesh axes it is split over (major first).
Entries = tuple[tuple[str, ...], ...]


def context_mesh() -> Any:
  """The mesh of ``jax.set_mesh``: concrete outside ``jit``, abstract
  inside; None when there is none."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit: only the abstract mesh is available
    mesh = None
  if mesh is None or mesh.empty:
    mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def mesh_axes(
  mesh: Any, axis_names: Any = None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Owner axes (in mesh order) and their sizes."""
  # (a Mesh's or AbstractMesh's shape: {axis_name: size}, in mesh order)
  shape = {} if mesh is None else getattr(mesh, 'shape', mesh)
  if not isinstance(shape, Mapping):
    raise TypeError(
      f'dmuon: mesh must be None, a jax.sharding.Mesh or AbstractMesh, or a'
      f' mapping {{axis_name: size}}; got {type(mesh).__name__}.'
    )
  sizes = {str(k): v for k, v in shape.items()}
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(
        f'dmuon: mesh axis {name!r} has size {size!r}; expected a positive int.'
      )
  names = tuple(sizes) if axis_names is None else axis_names
  names = (names,) if isinstance(names, str) else tuple(names)
  missing = [n for n in names if n not in sizes]
  if missing:
    raise ValueError(
      f'dmuon: axis_names {names} names mesh axes, but no mesh was given'
      ' (one slot, no axes). Pass the mesh too, or leave axis_names None.'
      if mesh is None
      else f'dmuon: axis_names {names} includes {missing}, which are not'
      f' axes of the mesh; the mesh has axes {tuple(sizes)}. Pass a subset'
      ' of them, or None for all.'
    )
  if len(set(names)) != len(names):
    raise ValueError(f'dmuon: axis_names {names} repeats an axis.')
  chosen = tuple(n for n in sizes if n in names)
  return chosen, tuple(int(sizes[n]) for n in chosen)


def check_devices(params: Any, mesh: Any) -> None:
  """Raises if a placed param lives on devices outside ``mesh``.

  Only concrete, committed arrays are checked (tracers, shapes and
  uncommitted arrays can go anywhere), and only against a concrete
  ``jax.sharding.Mesh``.

  Args:
    params: the params tree.
    mesh: the mesh the optimizer was given (or None).

  Raises:
    ValueError: naming the first such param, its devices and the mesh's.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    return
  mesh_ids = {d.id for d in mesh.devices.flat}
  for keys, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not _concrete(x) or not getattr(x, 'committed', True):
      continue
    ids = sorted(d.id for d in x.sharding.device_set)
    if not set(ids) <= mesh_ids or (
      len(ids) == 1 < len(mesh_ids)
      and not isinstance(x.sharding, jax.sharding.NamedSharding)
    ):
      raise ValueError(
        f'dmuon: param {normalize_path(keys)!r} is placed on devices '
        f'{ids}, but the mesh it was given has devices '
        f'{sorted(mesh_ids)} (axes {dict(mesh.shape)}). Place the params '
        'on that mesh (jax.device_put(params, NamedSharding(mesh, spec))) '
        'or pass the mesh they live on as mesh=.'
      )


def _concrete(x: Any) -> bool:
  """Whether ``x`` is an array with values (not a tracer)."""
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _flax_type(x: Any, module: str, name: str) -> bool:
  """Whether ``x``'s type is or derives from Flax's class ``module.name``,
  read from its MRO: flax is optional and never imported here."""
  return any(
    c.__name__ == name and c.__module__ == module for c in type(x).__mro__
  )


def is_variable(x: Any) -> bool:
  """Whether ``x`` is a flax ``nnx.Variable``, of any subclass (e.g.
  ``dmuon_jax.flax.OwnedBuffer``)."""
  return _flax_type(x, 'flax.nnx.variablelib', 'Variable')


def is_box(x: Any) -> bool:
  """Whether ``x`` is a flax Linen metadata box (``nn.Partitioned``,
  ``nn.LogicallyPartitioned``, any ``flax.core.meta.AxisMetadata``)."""
  return _flax_type(x, 'flax.core.meta', 'AxisMetadata')


def is_boxed(x: Any) -> bool:
  """Whether ``x`` wraps a value with Flax metadata (a Linen box or an
  ``nnx.Variable``)."""
  return is_variable(x) or is_box(x)


def unbox(x: Any) -> Any:
  """The value inside Flax boxes and ``nnx.Variable``\\ s (``x`` itself
  otherwise), without applying their sharding constraints."""
  while True:
    if is_variable(x):
      x = x.get_value()
    elif is_box(x):
      partitioned = _flax_type(x, 'flax.core.meta', 'Partitioned')
      x = x.value if partitioned else x.unbox()
    else:
      return x


def rebox(box: Any, value: Any) -> Any:
  """``value`` in a box like ``box`` (same type and metadata); ``value``
  itself where ``box`` is not boxed."""
  if not is_boxed(box):
    return value
  return jax.tree.unflatten(jax.tree.structure(box), [value])


def box_like(template: Any, value: Any, spec: P) -> Any:
  """``value`` boxed as ``template`` is boxed, with sharding ``spec``.

  Linen boxes give an ``nn.Partitioned`` whose names are the spec's mesh
  axes (``nn.get_sharding`` and ``nn.logical_to_mesh_sharding`` both read
  them as they are: tuple entries pass logical rules unchanged); an
  ``nnx.Variable`` gives a Variable of its type with ``out_sharding`` the
  spec (what ``nnx.get_partition_spec`` reads) and eager sharding off, since
  ``value`` is placed already (``nnx.Optimizer`` copies the metadata into
  its ``OptVariable``).
  """
  names = tuple(spec)
  if is_variable(template):
    return template.replace(value, out_sharding=names, eager_sharding=False)
  from flax.core import meta  # loaded: template is a Linen box

  return meta.Partitioned(value, names, mesh=getattr(template, 'mesh', None))


def array_mesh(x: Any) -> Any:
  """The mesh a (possibly abstract or traced) array is placed on, or None."""
  x = unbox(x)
  tracer = isinstance(x, jax.core.Tracer)
  s = _type_sharding(x) if tracer else _on_mesh(getattr(x, 'sharding', None))
  return None if s is None else s.mesh


def _on_mesh(sharding: Any) -> NamedSharding | None:
  """``sharding`` if it is a ``NamedSharding`` on a non-empty mesh."""
  ok = isinstance(sharding, NamedSharding) and not sharding.mesh.empty
  return sharding if ok else None


def _type_sharding(x: Any) -> NamedSharding | None:
  """The ``NamedSharding`` in ``x``'s type, if on a non-empty mesh."""
  return _on_mesh(getattr(jax.typeof(x), 'sharding', None))


def _meta_spec(x: Any) -> P | None:
  """The mesh spec a Flax holder's sharding metadata gives, or None where
  it has none or it cannot be known.

  An ``nnx.Variable``'s ``out_sharding`` is mapped by its ``sharding_rules``
  and the active logical axis rules (as ``nnx.get_partition_spec`` maps
  it). ``nn.Partitioned`` names mesh axes. ``nn.LogicallyPartitioned``
  names logical axes, mapped by its own ``rules`` or else the active
  ``nn.logical_axis_rules`` (as its ``unbox`` maps them); without any rules
  its logical names say nothing about the mesh: None.
  """
  if is_variable(x):
    if not x.get_metadata().get('out_sharding'):
      return None
    from flax.nnx import spmd  # flax is optional: lazily

    return spmd.get_var_pspec(x)
  names = getattr(x, 'names', None)
  if not is_box(x) or names is None or not hasattr(x, 'get_partition_spec'):
    return None
  if not hasattr(x, 'rules'):
    return x.get_partition_spec()
  from flax.linen import spmd  # flax is optional: lazily

  rules = x.rules if x.rules is not None else spmd.get_logical_axis_rules()
  if not rules and any(isinstance(n, str) for n in names):
    return None
  return spmd.logical_to_mesh_axes(names, rules)


def _logical_names(x: Any) -> tuple | None:
  """The sharding names of a Flax holder that the logical axis rules in
  effect where it is read map (``nnx.Variable`` ``out_sharding``, the
  ``names`` of an ``nn.LogicallyPartitioned`` without rules of its own), as
  they are written; None for anything else."""
  if is_variable(x):
    return x.get_metadata().get('out_sharding') or None
  if is_box(x) and getattr(x, 'rules', False) is None:
    return getattr(x, 'names', None)
  return None


def sharding_names(x: Any) -> bool:
  """Whether a Flax holder names a sharding (mesh or logical axes) for any
  dimension of its value."""
  return any(spec_entries(_logical_names(x)))


def rules_decide(x: Any) -> bool:
  """Whether the logical axis rules in effect where a Linen box is read
  decide its mesh sharding: an ``nn.LogicallyPartitioned`` without rules
  of its own that has a string name (a logical axis, mesh axis names
  included: Flax maps each through the rules; tuples pass unchanged)."""
  names = _logical_names(x) if is_box(x) else None
  return any(isinstance(n, str) for n in names or ())


def context_free_spec(x: Any, mesh_axes: Sequence[str]) -> P | None:
  """The spec of a param as :func:`leaf_spec` reads it where that does not
  depend on the logical axis rules in effect; else None (unknown).

  ``nn.LogicallyPartitioned`` boxes without rules of their own and
  ``nnx.Variable``\\ s whose ``out_sharding`` names logical axes are mapped
  by the rules of the context they are read in: the same params read by
  ``jax.eval_shape`` outside ``nn.logical_axis_rules`` and by ``jax.jit``
  inside them (MaxText's and Flax lm1b's ``setup_initial_state``) give two
  answers. A state's static structure is built from this spec only, so
  that both traces give the same structure; :func:`leaf_spec` (the rules'
  answer) is kept beside it as a routing hint.
  """
  if rules_decide(x):
    return None
  spec = leaf_spec(x)
  names = _logical_names(x) if is_variable(x) else None
  if names is None or (
    spec == P(*names) and sharded_axes([names]) <= set(mesh_axes)
  ):
    return spec  # (written as mesh axis names, which no rules changed)
  return None


def leaf_spec(x: Any) -> P | None:
  """The PartitionSpec of a param, where it can be known; else None.

  Known for concrete arrays and ``jax.ShapeDtypeStruct`` with a sharding
  (their ``NamedSharding``; other shardings are one device: replicated),
  for tracers on meshes with Explicit axes (their type), for
  ``nnx.Variable``\\ s annotated with ``out_sharding`` and for Linen boxes:
  ``nn.Partitioned`` (mesh axis names) and ``nn.LogicallyPartitioned``
  (logical names, mapped by its rules or the active
  ``nn.logical_axis_rules``). A box's metadata comes before its value's
  sharding. Tracers on Auto meshes carry no sharding: None.
  """
  if is_boxed(x):
    spec = _meta_spec(x)
    inner = x.get_value() if is_variable(x) else unbox(x)
    return leaf_spec(inner) if spec is None else spec
  if isinstance(x, jax.core.Tracer):
    sharding = _type_sharding(x)
    ok = sharding is not None and is_explicit(sharding.mesh)
    return sharding.spec if ok else None
  sharding = getattr(x, 'sharding', None)
  if sharding is None:
    return None
  return sharding.spec if isinstance(sharding, NamedSharding) else P()


def type_spec(x: Any) -> P:
  """The spec in a traced value's type on a mesh with Explicit axes (an
  array not placed on the mesh is replicated there: ``P()``)."""
  sharding = _type_sharding(x)
  return P() if sharding is None else sharding.spec


def is_explicit(mesh: Any) -> bool:
  """Whether a mesh has Explicit axes (sharding in the types)."""
  types = getattr(mesh, 'axis_types', ())  # (none for None)
  return jax.sharding.AxisType.Explicit in types


def local_shape(
  shape: Sequence[int], spec: P | None, sizes: Mapping[str, int]
) -> tuple[int, ...]:
  """One device's block of an array of ``shape`` sharded by ``spec`` over
  axes of ``sizes`` (ceil division, as JAX pads uneven shards)."""
  return tuple(-(-n // k) for n, k in _shards(shape, spec_entries(spec), sizes))


def _shards(shape, entries, sizes) -> list[tuple[int, int]]:
  """Per dimension of ``shape``: its size and its number of shards."""
  entries = tuple(entries) + ((),) * len(shape)
  return [
    (n, math.prod(sizes.get(a, 1) for a in e)) for n, e in zip(shape, entries)
  ]


def spec_entries(spec: P | None) -> list[tuple[str, ...]]:
  """The mesh axes of each dimension of a PartitionSpec, as tuples."""
  return [
    () if e is None else (e,) if isinstance(e, str) else tuple(e)
    for e in tuple(spec or ())
  ]


def entries_spec(entries: Sequence[Sequence[str]]) -> P:
  """The PartitionSpec of per-dimension axis tuples."""
  return P(
    *[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
  )


def normalize_entries(
  spec: P | None, ndim: int, sizes: Mapping[str, int]
) -> Entries:
  """Per-dimension axes of ``spec`` with size-1 axes dropped, ``ndim`` long.

  Axes of size 1 shard nothing; dropping them first means that
  ``P('fsdp', 'tensor')`` on an 8x1 mesh is the same layout as ``P('fsdp')``.
  Axes not in ``sizes`` are kept (and reported by :func:`check_entries`).
  """
  entries = [
    tuple(a for a in e if sizes.get(a, 0) != 1) for e in spec_entries(spec)
  ]
  entries += [()] * (ndim - len(entries))
  return tuple(entries)


def check_entries(
  entries: Entries,
  shape: Sequence[int],
  sizes: Mapping[str, int],
  path: str,
  spec: P | None,
) -> None:
  """Raises if a leaf's sharding does not fit the mesh (names the leaf).

  A dimension need not divide by its devices (uneven sharding, which JAX
  accepts): the caller pads it (see :func:`padded_shape`).
  """
  if len(entries) > len(shape):
    raise ValueError(
      f'dmuon: param {path!r} of rank {len(shape)} has a sharding spec '
      f'{spec} with more entries than dims.'
    )
  for a in [a for axes in entries for a in axes if a not in sizes][:1]:
    raise ValueError(
      f'dmuon: param {path!r} is sharded over mesh axis {a!r} (spec '
      f'{spec}), which is not one of the axes dmuon owns matrices over '
      f'{tuple(sizes)}. Shard it over those axes (or replicate '
      'it), or pass the mesh it lives on as mesh= / axis_names=.'
    )


def padded_shape(
  shape: Sequence[int], entries: Entries, sizes: Mapping[str, int]
) -> tuple[int, ...]:
  """``shape`` with each sharded dimension rounded up to a multiple of its
  devices (what an unevenly sharded Muon leaf is padded to with zeros)."""
  return tuple(-(-n // k) * k for n, k in _shards(shape, entries, sizes))


def split_tensor_parallel(leaf, entries: Entries, tp_axis: str, tp_size: int):
  """Separates the TP axis from a Muon leaf's sharding.

  Args:
    leaf: the leaf's ``LeafSpec`` (matrix axes).
    entries: its normalized sharding (see :func:`normalize_entries`).
    tp_axis: the tensor-parallel axis name.
    tp_size: its size.

  Returns:
    ``(tp_split, tp_dim, local_shape)``: None or the split matrix axis (-1
    for a split output axis, i.e. columns; -2 for a split reduction axis,
    i.e. rows); the split dimension of the leaf (or None); the shape of one
    TP shard's slice.

  Raises:
    ValueError: naming the leaf, for a TP axis on a stack (batch) axis,
      on two dimensions, or together with another axis on one dimension.
  """
  dims = [d for d, axes in enumerate(entries) if tp_axis in axes]
  if not dims:
    return None, None, tuple(leaf.shape)
  dim = dims[0]
  if len(dims) > 1 or entries[dim] != (tp_axis,):
    raise ValueError(
      f'dmuon: param {leaf.path!r} is sharded as {entries_spec(entries)}: the '
      f'tensor-parallel axis {tp_axis!r} must be the only axis of a '
      'single dimension (Megatron column- or row-parallel). Shard the '
      'other dimension over the data-parallel axes instead.'
    )
  if dim in leaf.output_axes:
    split = -1
  elif dim in leaf.reduction_axes:
    split = -2
  else:
    raise ValueError(
      f'dmuon: param {leaf.path!r} of shape {leaf.shape} is sharded over '
      f'the tensor-parallel axis {tp_axis!r} on dim {dim}, a stack '
      f'(batch) axis of its MuonDimensionNumbers; TP must split a matrix '
      'dimension (a reduction or output axis). Shard another dimension, '
      'or replicate the stack axis.'
    )
  if leaf.shape[dim] % tp_size:
    raise ValueError(
      f'dmuon: param {leaf.path!r} of shape {leaf.shape} is sharded over '
      f'the tensor-parallel axis {tp_axis!r} on dim {dim}, which does not '
      f'divide by its {tp_size} devices. Dedicated mode stores each TP '
      "shard's slice of the matrix and does not pad: make that dim a "
      f'multiple of {tp_size}, or use the drop-in dmuon_jax.dmuon (which '
      'pads uneven shardings internally).'
    )
  shape = list(leaf.shape)
  shape[dim] //= tp_size
  return split, dim, tuple(shape)


@dataclasses.dataclass(frozen=True)
class MeshInfo:
  """The axes dmuon uses on one mesh, resolved once.

  Attributes:
    abstract: the mesh's ``AbstractMesh`` (hashable; what a layout
      records).
    sizes: every mesh axis and its size, in mesh order.
    owner_axes: the axes owners range over, in mesh order.
    tp_axis: the tensor-parallel axis if the mesh has it with size > 1,
      else None.
  """

  abstract: Any
  sizes: dict[str, int]
  owner_axes: tuple[str, ...]
  tp_axis: str | None

  @property
  def num_slots(self) -> int:
    return math.prod(self.sizes[a] for a in self.owner_axes)

  @property
  def tp_size(self) -> int:
    return self.sizes[self.tp_axis] if self.tp_axis else 1


# tensor_parallel_axis='auto': mesh axes with these names are tensor
# parallel when the Muon params are sharded over them.
TP_AXIS_NAMES = ('model', 'tensor', 'tp')
AUTO = 'auto'


def resolve(
  mesh: Any,
  axis_names: Any = None,
  tensor_parallel_axis: str | None = AUTO,
  sharded_axes: Collection[str] | None = None,
) -> MeshInfo | None:
  """Owner axes and the TP axis of ``mesh`` (None without a mesh).

  Args:
    mesh: a ``Mesh`` or ``AbstractMesh``, or None.
    axis_names: the owner axes (default: every axis of more than one
      device but the TP one). An axis of one device splits nothing: it
      owns nothing and is left out, so it is no part of the owner buffers'
      specs, the layout's name or ``ded.axes``. One named here is kept
      (the layout dmuon_jax 0.2 gave such a mesh by default).
    tensor_parallel_axis: the axis that splits matrices, if the mesh has it;
      ``'auto'``: the axis named ``'model'``, ``'tensor'`` or ``'tp'`` (of
      size > 1, not in ``axis_names``) that ``sharded_axes`` holds, if any.
    sharded_axes: the mesh axes the Muon params are sharded over; None when
      not known yet (then ``'auto'`` resolves to no TP axis: a factory-time
      check; ``init`` resolves again with the params).

  Returns:
    A :class:`MeshInfo`, or None if ``mesh`` is None.

  Raises:
    ValueError: for unknown ``axis_names``, ``axis_names`` naming the TP
      axis, or ``'auto'`` finding several TP axes.
  """
  if mesh is None:
    return None
  sizes = dict(zip(*mesh_axes(mesh)))
  # (mesh_axes raises for unknown names)
  chosen = () if axis_names is None else mesh_axes(mesh, axis_names)[0]
  tp = tensor_parallel_axis if tensor_parallel_axis in sizes else None
  if tensor_parallel_axis == AUTO:
    named = set(TP_AXIS_NAMES).intersection(sharded_axes or ()) - set(chosen)
    hits = [n for n in sizes if n in named and sizes[n] > 1]
    if len(hits) > 1:
      raise ValueError(
        f'dmuon: the Muon params are sharded over the mesh axes {hits}, and'
        f' each could be the tensor-parallel axis (axes named'
        f' {TP_AXIS_NAMES} are, when params are sharded over them). Say'
        f' which one splits the matrices with tensor_parallel_axis='
        f'{hits[0]!r} (the others then hold owners), or'
        ' tensor_parallel_axis=None for none.'
      )
    tp = hits[0] if hits else None
  if tp in chosen:
    raise ValueError(
      f'dmuon: axis_names {chosen} includes the tensor-parallel axis '
      f'{tp!r}: owners range over data-parallel axes, and every TP '
      'shard of an owner holds its slice of the matrix. Leave it out of '
      'axis_names, or pass tensor_parallel_axis=None to use it for '
      'owners.'
    )
  if axis_names is None:  # (an axis of one device owns nothing)
    chosen = tuple(n for n in sizes if n != tp and sizes[n] > 1)
  return MeshInfo(
    abstract=getattr(mesh, 'abstract_mesh', mesh),
    sizes=sizes,
    owner_axes=chosen,
    tp_axis=None if tp is None or sizes[tp] == 1 else tp,
  )


def sharded_axes(specs: Sequence[P | None]) -> set[str]:
  """The mesh axes that any of ``specs`` shards over."""
  return {a for spec in specs for e in spec_entries(spec) for a in e}


def place(x: jax.Array, mesh: Any, spec: P) -> jax.Array:
  """``x`` with sharding ``spec`` on ``mesh``, eagerly or under ``jit``.

  Explicit meshes take ``device_put`` (it sets the type); Auto meshes a
  sharding constraint (``device_put`` under ``jit`` leaves them unsharded).
  """
  sharding = NamedSharding(mesh, spec)
  if is_explicit(mesh):
    return jax.device_put(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def replicate_uncommitted(tree: Any, mesh: Any) -> Any:
  """Every uncommitted array of ``tree`` replicated on ``mesh``.

  Optimizer states hold scalars made by ``jnp.zeros`` (step counts) that
  sit uncommitted on one device when ``init`` runs eagerly, while under
  ``jax.jit`` on a mesh they come out replicated on it. Placing them on the
  mesh eagerly too gives one state either way (and the first train step
  then compiles once, not twice). Tracers and committed arrays are kept.
  """
  if not isinstance(mesh, jax.sharding.Mesh) or mesh.size == 1:
    return tree
  sharding = NamedSharding(mesh, P())

  def put(x):
    committed = not _concrete(x) or getattr(x, 'committed', True)
    return x if committed else jax.device_put(x, sharding)

  return jax.tree.map(put, tree)
