"""Owner plan: which device orthogonalizes which Muon matrix."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from dmuon_jax import _newton_schulz

Predicate = Callable[[str, Any], bool]
# predicate='optax': optax.contrib.muon's routing.
OPTAX_ROUTING = 'optax'
CostFn = Callable[[int, int], float]
# None, one MuonDimensionNumbers, a prefix tree of them, or a callable.
WeightDimNums = Any

_HINT_ADAMW = (
  'Route it to AdamW: make the predicate return False for it or set its'
  ' dimension numbers to None.'
)
_HINT_DIMS_TREE = (
  'Pass None, a single optax.contrib.MuonDimensionNumbers, a tree with the'
  ' structure of params (or a prefix of it) holding MuonDimensionNumbers or'
  ' None at its leaves, or a callable params -> such a tree.'
)

# Segments whose name contains one of these (lower-cased) are never Muon
# targets under the default predicate.
_EXCLUDED_SUBSTRINGS = (
  'embed',  # embed, embedding, tok_embeddings, unembed, pos_embedding
  'norm',  # norm, layernorm, rmsnorm_0, final_norm, norm1
  'logit',  # logits, logit_proj
  'lm_head',
  'wte',  # GPT-2 token embedding
  'wpe',  # GPT-2 position embedding
)
# Segments equal to one of these (lower-cased) are never Muon targets.
_EXCLUDED_NAMES = frozenset({'bias', 'scale', 'pos_emb', 'tok_emb', 'emb'})
# Segments equal to one of these are output heads, but only outside a
# transformer block: BERT's 'layer/0/attention/output/dense' is a projection
# inside block 0, whereas Llama's top-level 'output' is the LM head.
_HEAD_NAMES = frozenset({'head', 'output', 'classifier'})
# ln, ln_f, ln_1, ln1, lnf, ln_2 (GPT-2 style layer norms).
_LAYER_NORM_RE = re.compile(r'^ln(_|$|f|\d)')

# A block boundary is one of these segments followed by an integer segment
# ('layers/3'), or one segment like 'layers_3' (flax linen auto-naming).
_BLOCK_NAMES = frozenset(
  {
    'layers',
    'layer',
    'blocks',
    'block',
    'h',
    'encoderblock',
    'decoderblock',
    'resblocks',
  }
)
_BLOCK_SEGMENT_RE = re.compile(
  r'^(layers?|blocks?|h|encoderblock|decoderblock|resblocks)_\d+$'
)
# Leading segments that name a flax linen variable collection, not a module.
COLLECTION_NAMES = frozenset({'params'})


def normalize_path(path: jax.tree_util.KeyPath) -> str:
  """Spells a pytree key path as a '/'-joined string.

  ``DictKey`` contributes ``str(key)``, ``GetAttrKey`` its name and
  ``SequenceKey``/``FlattenedIndexKey`` the index. A trailing
  ``GetAttrKey('value')`` is dropped, so the flax nnx paths
  ``['layers'][0]['kernel'].value`` (seen by ``nnx.Optimizer`` at init) and
  ``['layers'][0]['kernel']`` (seen at update) both give ``'layers/0/kernel'``.

  Args:
    path: a key path, as given by ``jax.tree.flatten_with_path``.

  Returns:
    The normalized path string (``''`` for the root).
  """
  keys = list(path)
  if (
    keys
    and isinstance(keys[-1], jax.tree_util.GetAttrKey)
    and keys[-1].name == 'value'
  ):
    keys.pop()
  return '/'.join(_key_str(k) for k in keys)


def _key_str(key: Any) -> str:
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def _segments(path: str) -> list[str]:
  return [s for s in path.split('/') if s]


def block_boundary_end(segments: Sequence[str]) -> int | None:
  """Returns the end (exclusive) of the outermost block boundary, if any."""
  for i, seg in enumerate(segments):
    low = seg.lower()
    if _BLOCK_SEGMENT_RE.match(low):
      return i + 1
    if (
      low in _BLOCK_NAMES
      and i + 1 < len(segments)
      and segments[i + 1].isdigit()
    ):
      return i + 2
  return None


def default_muon_predicate(path: str, leaf: Any) -> bool:
  """Whether a leaf is a Muon matrix under the default rule.

  A leaf is a Muon target when it is a 2-D matrix with both dimensions > 1
  and it is not an embedding, an output head or logits layer, a norm or a
  bias. This is decided from the path: no segment (lower-cased) may

  - contain ``'embed'``, ``'norm'``, ``'logit'``, ``'lm_head'``, ``'wte'`` or
    ``'wpe'`` (embeddings, unembeddings, layer/RMS norms, logits, GPT-2);
  - equal ``'bias'``, ``'scale'``, ``'emb'``, ``'pos_emb'`` or ``'tok_emb'``;
  - match ``^ln(_|$|f|\\d)`` (``ln``, ``ln_f``, ``ln_1``, ``ln1``);
  - equal ``'head'``, ``'output'`` or ``'classifier'`` outside a transformer
    block (a path without a block boundary such as ``layers/3`` or
    ``layers_3``), so a top-level LM head is excluded while BERT's
    ``layer/0/attention/output/dense`` is kept.

  Names such as ``'attn_heads'``, ``'num_heads'``, ``'mlp'``, ``'kernel'``,
  ``'w_out'``, ``'o_proj'``, ``'out_proj'`` and ``'down_proj'`` are kept.
  Higher-rank leaves (stacked layers, attention kernels) are never selected
  by default: give them explicit ``MuonDimensionNumbers``.

  Args:
    path: the leaf's path, ``'/'``-joined (``'layers/0/attn/q/kernel'``;
      flax nnx's trailing ``.value`` dropped).
    leaf: the leaf (anything with a ``shape``).

  Returns:
    True if the leaf should be optimized with Muon.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> w = jnp.ones((8, 8))
    >>> dmuon_jax.default_muon_predicate('layers/0/mlp/up/kernel', w)
    True
    >>> dmuon_jax.default_muon_predicate('embed/embedding', w)
    False
    >>> dmuon_jax.default_muon_predicate('head/kernel', w)  # a top-level head
    False
    >>> dmuon_jax.default_muon_predicate('layers/0/attention/output/kernel', w)
    True
    >>> dmuon_jax.default_muon_predicate('layers/0/mlp/up/bias', jnp.ones(8))
    False
  """
  shape = np.shape(leaf)
  if len(shape) != 2 or min(shape) <= 1:
    return False
  segments = _segments(path)
  in_block = block_boundary_end(segments) is not None
  for seg in segments:
    low = seg.lower()
    if any(s in low for s in _EXCLUDED_SUBSTRINGS):
      return False
    if low in _EXCLUDED_NAMES or _LAYER_NORM_RE.match(low):
      return False
    if not in_block and low in _HEAD_NAMES:
      return False
  return True


def _is_dims_leaf(x: Any) -> bool:
  return x is None or isinstance(x, MuonDimensionNumbers)


def _one_level(x: Any) -> tuple[list[Any], Any, list[Any]]:
  """Flattens one level of a pytree: children, node structure and keys."""
  with_keys, treedef = jax.tree_util.tree_flatten_with_path(
    x, is_leaf=lambda y: y is not x
  )
  keys = [p[0] if p else None for p, _ in with_keys]
  return [c for _, c in with_keys], treedef, keys


def _align_dims(
  dims: Any,
  tree: Any,
  path: tuple[Any, ...],
  out: list[Any],
  arg: str = 'weight_dimension_numbers',
) -> None:
  """Appends one dimension-numbers entry per leaf of ``tree`` to ``out``.

  ``arg`` is the argument's name as the user spelled it, for messages.
  """
  if _is_dims_leaf(dims):
    out.extend([dims] * len(jax.tree.leaves(tree)))
    return
  num_leaves = len(jax.tree.leaves(tree))
  if num_leaves == 0:
    # None, MaskedNode() or an empty container (e.g. a subtree masked out by
    # optax.partition): no leaf to route, whatever the dims tree says here.
    return
  if isinstance(dims, optax.MaskedNode):
    raise ValueError(
      f'dmuon: {arg} has MaskedNode() at'
      f' {normalize_path(path) or "<root>"!r} where params has'
      f' {num_leaves} leaves. {_HINT_DIMS_TREE}'
    )
  dims_children, dims_def, _ = _one_level(dims)
  tree_children, tree_def, keys = _one_level(tree)
  if dims_def.num_nodes == 1 and dims_def.num_leaves == 1:
    # A leaf that is neither None nor MuonDimensionNumbers.
    raise ValueError(
      f'dmuon: {arg} has'
      f' {type(dims).__name__} {dims!r} at'
      f' {normalize_path(path) or "<root>"!r}; expected'
      f' optax.contrib.MuonDimensionNumbers or None. {_HINT_DIMS_TREE}'
    )
  if dims_def != tree_def:
    raise ValueError(
      f'dmuon: {arg} does not match the structure of'
      f' params at {normalize_path(path) or "<root>"!r}: got'
      f' {dims_def}, params have {tree_def}. {_HINT_DIMS_TREE}'
    )
  for key, d, t in zip(keys, dims_children, tree_children):
    _align_dims(d, t, path + (key,), out, arg)


def resolve_dimension_numbers(
  tree: Any,
  weight_dimension_numbers: WeightDimNums,
  arg: str = 'weight_dimension_numbers',
) -> list[MuonDimensionNumbers | None]:
  """Resolves Muon dimension numbers to one entry per leaf of ``tree``.

  Args:
    tree: a pytree (params or updates). ``None`` and ``optax.MaskedNode()``
      placeholders are not leaves, as in ``jax.tree.leaves``.
    weight_dimension_numbers: None (every entry None), a single
      ``optax.contrib.MuonDimensionNumbers`` (used for every leaf), a tree that
      is a prefix of ``tree`` with ``MuonDimensionNumbers`` or None at its
      leaves (None: not a Muon leaf; an entry covers the whole subtree of
      ``tree`` below it), or a callable ``tree -> such a value``.
    arg: the argument's name in the caller's API, for messages
      (``'muon_weight_dimension_numbers'`` for :func:`dmuon_jax.dmuon`).

  Returns:
    A list with one entry per leaf of ``jax.tree.leaves(tree)``.

  Raises:
    ValueError: if the dimension-numbers tree does not match ``tree``.
  """
  dims = weight_dimension_numbers
  if callable(dims) and not _is_dims_leaf(dims):
    dims = dims(tree)
  out: list[Any] = []
  _align_dims(dims, tree, (), out, arg)
  return out


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """A Muon-target leaf and how it splits into matrices.

  Attributes:
    leaf_index: index of the leaf in ``jax.tree.leaves(params)``.
    path: the leaf's path, see :func:`normalize_path`.
    shape: the full leaf shape.
    dtype: the numpy dtype name, e.g. ``'float32'``.
    batch_axes: sorted axes that index independent matrices.
    reduction_axes: axes flattened into the matrix rows (fan-in), in the order
      given by the dimension numbers.
    output_axes: axes flattened into the matrix columns (fan-out).
  """

  leaf_index: int
  path: str
  shape: tuple[int, ...]
  dtype: str
  batch_axes: tuple[int, ...]
  reduction_axes: tuple[int, ...]
  output_axes: tuple[int, ...]
  # Owner groups (see sliced_spec): the leaf's own shape when ``shape`` is a
  # view that splits each matrix's long side into slices, and the view's
  # slice axis, the split side of each slice (-1 columns, -2 rows) and the
  # whole matrix's (fan_in, fan_out).
  original_shape: tuple[int, ...] | None = None
  slice_axis: int | None = None
  split_axis: int | None = None
  whole_matrix: tuple[int, int] | None = None

  @property
  def sliced(self) -> bool:
    """Whether this spec views the leaf's matrices as slices."""
    return self.original_shape is not None

  @property
  def leaf_shape(self) -> tuple[int, ...]:
    """The shape of the leaf itself (``shape`` unless sliced)."""
    return self.shape if self.original_shape is None else self.original_shape

  @property
  def batch_shape(self) -> tuple[int, ...]:
    """Sizes of the batch axes (``()`` for a 2-D leaf)."""
    return tuple(self.shape[a] for a in self.batch_axes)

  @property
  def matrix_shape(self) -> tuple[int, int]:
    """``(fan_in, fan_out)``: products of the reduction and output dims."""
    return (
      math.prod(self.shape[a] for a in self.reduction_axes),
      math.prod(self.shape[a] for a in self.output_axes),
    )

  @property
  def num_matrices(self) -> int:
    """Number of matrices in the leaf (1 for a 2-D leaf)."""
    return math.prod(self.batch_shape)


@dataclasses.dataclass(frozen=True)
class MatrixUnit:
  """One matrix, the unit of ownership.

  Attributes:
    leaf_index: the leaf holding it (see :attr:`LeafSpec.leaf_index`).
    path: the leaf's path.
    batch_index: multi-index over the leaf's batch axes, ``()`` for 2-D.
    shape: ``(fan_in, fan_out)``, the leaf's :attr:`LeafSpec.matrix_shape`.
    layer: grouping key; matrices with the same key are spread over
      different owners when that costs no makespan.
    cost: predicted Newton–Schulz FLOPs.
    nbytes: ``fan_in * fan_out * itemsize``.
  """

  leaf_index: int
  path: str
  batch_index: tuple[int, ...]
  shape: tuple[int, int]
  layer: str
  cost: float
  nbytes: int
  group: int = -1  # index into OwnershipPlan.groups for a slice, else -1

  @property
  def name(self) -> str:
    """The path, with the batch index appended for stacked leaves."""
    if not self.batch_index:
      return self.path
    return f'{self.path}[{",".join(str(i) for i in self.batch_index)}]'


@dataclasses.dataclass(frozen=True)
class OwnerGroup:
  """One matrix orthogonalized by a group of owners.

  Its long side is split into slices (units of the plan, on owners of one
  row of the group axis: the same coordinates on every other owner axis).
  Each slice owner forms its slices' Gram matrices; their sum reaches the
  iteration owner (one reduce-scatter over the group axis), which runs the
  small ``g x g`` iteration alone; the factor goes back to the slice owners
  (one all-gather), which apply it to their slices.

  Attributes:
    leaf_index: the leaf holding the matrix.
    batch_index: the matrix's index over the leaf's own batch axes.
    shape: the whole matrix's ``(fan_in, fan_out)``.
    units: the slices' unit indices.
    iteration_owner: the slot that runs the ``g x g`` iteration.
    iteration_cost: its predicted FLOPs.
    distinct: whether every slice has its own owner (``owner_groups=k``).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'w': jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    >>> plan = dmuon_jax.plan_ownership(params, {'data': 2}, owner_groups=2)
    >>> (group,) = plan.groups
    >>> group.shape, group.gram_size, group.units
    ((256, 64), 64, (0, 1))
    >>> [plan.units[u].shape for u in group.units]  # the long side halved
    [(128, 64), (128, 64)]
    >>> [plan.owners[u] for u in group.units], group.iteration_owner
    ([0, 1], 0)
  """

  leaf_index: int
  batch_index: tuple[int, ...]
  shape: tuple[int, int]
  units: tuple[int, ...]
  iteration_owner: int
  iteration_cost: float
  distinct: bool = False

  @property
  def gram_size(self) -> int:
    """The short side ``g``, the size of the Gram matrix."""
    return min(self.shape)


@dataclasses.dataclass(frozen=True)
class OwnershipPlan:
  """Static assignment of every Muon matrix to one owner slot.

  A slot is a row-major flat index over ``mesh_shape``: on a
  ``('replicate', 'shard')`` mesh of shape ``(R, S)``, slot ``r * S + s`` is
  the device at ``replicate=r, shard=s``. The plan is built from shapes only,
  is deterministic and hashable, so it can be a static argument.

  Attributes:
    axis_names: mesh axes the owners range over, in mesh order.
    mesh_shape: the sizes of those axes.
    num_leaves: number of leaves of the params tree (targets or not).
    leaves: the Muon-target leaves, in leaf order.
    units: all matrices, in leaf order, then batch index row-major; each
      has a ``path``, ``batch_index``, ``shape`` ``(fan_in, fan_out)``,
      predicted Newton–Schulz ``cost`` (FLOPs) and ``nbytes``.
    owners: owner slot of each unit.
    groups: the owner groups (:class:`OwnerGroup`): matrices whose slices
      are units owned by several slots; empty when every unit is a whole
      matrix.
    group_axis_name: the owner axis the groups' slices range over; None
      means the innermost owner axis.
    routing: the one-line routing summary of the params tree the plan was
      built from (Muon and AdamW leaves and elements, and the leaves
      ``optax.contrib.muon`` routes otherwise), as :func:`dmuon_jax.dmuon`
      logs it on its first ``init``; empty when unknown. Not compared.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    >>> params = {f'layers_{i}': {'w': w} for i in range(3)}
    >>> plan = dmuon_jax.plan_ownership(params, {'replicate': 2, 'shard': 2})
    >>> plan.num_slots, plan.slot_coords(3)  # slot 3 is replicate=1, shard=1
    (4, (1, 1))
    >>> plan.owners, plan.units_of(2)  # one matrix each, slot 3 idle
    ((0, 1, 2), (2,))
    >>> print(plan.summary().splitlines()[0])
    OwnershipPlan: 3 matrices in 3 leaves on 4 slots, mesh replicate=2 shard=2
  """

  axis_names: tuple[str, ...]
  mesh_shape: tuple[int, ...]
  num_leaves: int
  leaves: tuple[LeafSpec, ...]
  units: tuple[MatrixUnit, ...]
  owners: tuple[int, ...]
  groups: tuple[OwnerGroup, ...] = ()
  group_axis_name: str | None = None
  routing: str = dataclasses.field(default='', compare=False, repr=False)

  def __hash__(self) -> int:
    # Plans are static arguments of jitted functions: hash the (large)
    # tuples once. Equality still compares every field.
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    return hash(
      (
        self.axis_names,
        self.mesh_shape,
        self.num_leaves,
        self.leaves,
        self.units,
        self.owners,
        self.groups,
      )
    )

  @property
  def num_slots(self) -> int:
    """Number of owner slots (product of ``mesh_shape``, 1 for no axes)."""
    return math.prod(self.mesh_shape)

  def slot_coords(self, slot: int) -> tuple[int, ...]:
    """Mesh coordinates of a slot, one per axis in ``axis_names``.

    Args:
      slot: a slot index in ``[0, num_slots)``.

    Returns:
      The coordinates, e.g. ``(r, s)``.
    """
    if not 0 <= slot < self.num_slots:
      raise ValueError(
        f'dmuon: slot {slot} is out of range; the plan has'
        f' {self.num_slots} slots: pass 0 to {self.num_slots - 1}.'
      )
    coords = []
    for size in reversed(self.mesh_shape):
      coords.append(slot % size)
      slot //= size
    return tuple(reversed(coords))

  def slot_costs(self) -> tuple[float, ...]:
    """Predicted Newton–Schulz FLOPs per slot."""
    costs = [0.0] * self.num_slots
    for unit, owner in zip(self.units, self.owners):
      costs[owner] += unit.cost
    for group in self.groups:
      costs[group.iteration_owner] += group.iteration_cost
    return tuple(costs)

  def group_axis(self) -> str | None:
    """The owner axis a group's slice owners range over (default: the
    innermost)."""
    if self.group_axis_name is not None:
      return self.group_axis_name
    return self.axis_names[-1] if self.axis_names else None

  def group_row(self, slot: int) -> int:
    """The row of a slot: its index over the owner axes but the group axis."""
    if not self.axis_names:
      return 0
    pos = self.axis_names.index(self.group_axis())
    coords = list(self.slot_coords(slot))
    del coords[pos]
    shape = list(self.mesh_shape)
    del shape[pos]
    return int(np.ravel_multi_index(coords, shape)) if shape else 0

  def group_member(self, slot: int) -> int:
    """A slot's coordinate on the group axis."""
    if not self.axis_names:
      return 0
    return self.slot_coords(slot)[self.axis_names.index(self.group_axis())]

  def group_slots(self, g: int) -> tuple[int, ...]:
    """The slots holding a slice of group ``g`` or running its iteration."""
    group = self.groups[g]
    slots = {self.owners[u] for u in group.units} | {group.iteration_owner}
    return tuple(sorted(slots))

  def slot_bytes(self) -> tuple[int, ...]:
    """Bytes of the matrices owned by each slot."""
    nbytes = [0] * self.num_slots
    for unit, owner in zip(self.units, self.owners):
      nbytes[owner] += unit.nbytes
    return tuple(nbytes)

  def units_of(self, slot: int) -> tuple[int, ...]:
    """Indices (into ``units``) of the matrices owned by a slot, ascending.

    Args:
      slot: a slot index in ``[0, num_slots)``.

    Returns:
      A tuple of unit indices.
    """
    return self._slot_units[slot]

  @functools.cached_property
  def _slot_units(self) -> tuple[tuple[int, ...], ...]:
    per_slot: list[list[int]] = [[] for _ in range(self.num_slots)]
    for i, owner in enumerate(self.owners):
      per_slot[owner].append(i)
    return tuple(tuple(u) for u in per_slot)

  @functools.cached_property
  def _leaf_offsets(self) -> dict[int, tuple[int, LeafSpec]]:
    offsets = {}
    start = 0
    for spec in self.leaves:
      offsets[spec.leaf_index] = (start, spec)
      start += spec.num_matrices
    return offsets

  def leaf_units(self, leaf_index: int) -> tuple[int, ...]:
    """Indices (into ``units``) of a leaf's matrices, row-major.

    Args:
      leaf_index: index in ``jax.tree.leaves(params)``.

    Returns:
      A tuple of unit indices; empty if the leaf is not a Muon target.
    """
    if leaf_index not in self._leaf_offsets:
      return ()
    start, spec = self._leaf_offsets[leaf_index]
    return tuple(range(start, start + spec.num_matrices))

  def unit_index(self, leaf_index: int, batch_index: Sequence[int] = ()) -> int:
    """Index (into ``units``) of one matrix.

    Args:
      leaf_index: index in ``jax.tree.leaves(params)`` of a Muon target.
      batch_index: multi-index over the leaf's batch axes, ``()`` for 2-D.

    Returns:
      The unit index.
    """
    if leaf_index not in self._leaf_offsets:
      raise ValueError(
        f'dmuon: leaf {leaf_index} is not a Muon target of this plan.'
      )
    start, spec = self._leaf_offsets[leaf_index]
    batch_index = tuple(int(i) for i in batch_index)
    batch_shape = spec.batch_shape
    if len(batch_index) != len(batch_shape) or not all(
      0 <= i < n for i, n in zip(batch_index, batch_shape)
    ):
      raise ValueError(
        f'dmuon: batch_index {batch_index} is out of range for'
        f' {spec.path!r} with batch shape {batch_shape}.'
      )
    offset = 0
    for i, n in zip(batch_index, batch_shape):
      offset = offset * n + i
    return start + offset

  @property
  def makespan(self) -> float:
    """Largest predicted Newton–Schulz FLOPs of any slot."""
    return max(self.slot_costs(), default=0.0)

  @property
  def imbalance(self) -> float:
    """Max over mean of the per-slot costs; 1.0 when the total is 0."""
    costs = self.slot_costs()
    total = sum(costs)
    if total <= 0:
      return 1.0
    return max(costs) / (total / len(costs))

  def summary(self) -> str:
    """A human-readable, multi-line description of the plan.

    Returns:
      A header (matrices, slots, mesh axes, total predicted Newton–Schulz
      FLOPs, imbalance) followed by one section per slot listing its
      coordinates, cost, bytes and matrices.
    """
    return '\n'.join(self._summary_lines())

  def collective_bytes(self) -> dict[str, float]:
    """Predicted per-device collective bytes of one dmuon step, by path.

    Owner buffers are padded to the largest slot's bytes (``max``), so every
    figure scales with ``max`` rather than with the mean; with N slots and
    ``P`` the total bytes of all matrices (in the params' dtype):

    * ``'explicit'``: reduce-scatter of per-device gradients to the owners
      plus all-gather of the results: ``2 (N - 1) max`` (the all-reduce
      floor ``2 (N - 1) / N P`` when slots are balanced).
    * ``'drop-in, replicated params'``: one all-gather: ``(N - 1) max``.
    * ``'drop-in, sharded params'``: params sharded along one matrix dim
      over the innermost owner axis (FSDP, or HSDP's ``'shard'``) of size
      S: one all-to-all over that axis to the owners, ``(S - 1) max / S``,
      and one over all owner axes back, ``(N - 1) max / S``. (A state's
      :meth:`dmuon_jax.OwnerLayout.collective_bytes` predicts the bytes for
      the params' actual shardings.)
    * ``'all-reduce floor'``: ``2 (N - 1) / N P``, what data parallelism pays
      for these gradients anyway.

    Returns:
      A dict from path name to bytes.
    """
    n = self.num_slots
    biggest = max(self.slot_bytes())
    inner = self.mesh_shape[-1] if self.mesh_shape else 1
    return {
      'explicit': 2 * (n - 1) * biggest,
      'drop-in, replicated params': (n - 1) * biggest,
      'drop-in, sharded params': (inner - 1 + n - 1) * biggest / inner,
      'all-reduce floor': 2 * (n - 1) / n * sum(self.slot_bytes()),
    }

  def _summary_lines(self) -> list[str]:
    """The lines of :meth:`summary`; sections are appended in order."""
    lines = self._summary_header_lines()
    lines.append('  predicted collective bytes per device per step:')
    lines.extend(
      f'    {path}: {human_bytes(b)}'
      for path, b in self.collective_bytes().items()
    )
    lines.extend(self._summary_slot_lines())
    return lines

  def group_exchange_bytes(self) -> float:
    """Predicted per-device bytes of the owner groups' collectives per step
    (see :func:`group_exchange_bytes`; 0 without groups)."""
    if not self.groups:
      return 0.0
    row = dict(zip(self.axis_names, self.mesh_shape))[self.group_axis()]
    return group_exchange_bytes(self.groups, self.num_slots, row)

  def group_lines(self) -> list[str]:
    """One line per shape of grouped matrices (empty without groups)."""
    by_shape: dict[tuple, list[int]] = {}
    for g, group in enumerate(self.groups):
      key = (group.shape, len(group.units))
      by_shape.setdefault(key, []).append(g)
    lines = []
    for (shape, slices), gs in by_shape.items():
      sizes = sorted({len(self.group_slots(g)) for g in gs})
      k = f'{sizes[0]}' if len(sizes) == 1 else f'{sizes[0]}-{sizes[-1]}'
      lines.append(
        f'  owner groups: {_plural(len(gs), "matrix", "matrices")} '
        f'{shape[0]}x{shape[1]}, {slices} slices each on k={k} devices '
        f'along {self.group_axis()!r}; the {min(shape)}x{min(shape)} '
        f'iteration ({human_flops(self.groups[gs[0]].iteration_cost)}) on '
        'one of them'
      )
    if self.groups:
      exchange = self.group_exchange_bytes()
      lines.append(
        f'  owner groups exchange per device per step: '
        f'{human_bytes(exchange)} (float32 Grams and factors, '
        f'reduce-scatter + all-gather over {self.group_axis()!r})'
      )
    return lines

  def _summary_header_lines(self) -> list[str]:
    costs = self.slot_costs()
    nbytes = self.slot_bytes()
    if self.axis_names:
      mesh = ' '.join(
        f'{n}={s}' for n, s in zip(self.axis_names, self.mesh_shape)
      )
    else:
      mesh = '(single slot, no mesh axes)'
    whole = sum(u.group < 0 for u in self.units) + len(self.groups)
    what = _plural(len(self.units), 'matrix', 'matrices')
    if self.groups:
      what = (
        f'{_plural(whole, "matrix", "matrices")} ({len(self.groups)} split '
        f'into {len(self.units) - whole + len(self.groups)} slices)'
      )
    return (
      [
        f'OwnershipPlan: {what}'
        f' in {_plural(len(self.leaves), "leaf", "leaves")} on'
        f' {_plural(self.num_slots, "slot", "slots")}, mesh {mesh}',
      ]
      + [f'  {self.routing}'] * bool(self.routing)
      + self.group_lines()
      + [
        f'  predicted NS FLOPs: total {human_flops(sum(costs))}, per slot'
        f' max {human_flops(max(costs))}, mean'
        f' {human_flops(sum(costs) / len(costs))}, imbalance (max/mean)'
        f' {self.imbalance:.3f}',
        f'  bytes: total {human_bytes(sum(nbytes))}, per slot max'
        f' {human_bytes(max(nbytes))}',
      ]
    )

  def _summary_slot_lines(self) -> list[str]:
    costs = self.slot_costs()
    nbytes = self.slot_bytes()
    lines = []
    for slot in range(self.num_slots):
      coords = ' '.join(
        f'{n}={c}' for n, c in zip(self.axis_names, self.slot_coords(slot))
      )
      unit_ids = self.units_of(slot)
      lines.append(
        f'slot {slot}'
        + (f' ({coords})' if coords else '')
        + f': {_plural(len(unit_ids), "matrix", "matrices")},'
        f' {human_flops(costs[slot])},'
        f' {human_bytes(nbytes[slot])}'
      )
      for i in unit_ids:
        unit = self.units[i]
        what = '' if unit.group < 0 else f'  (slice of group {unit.group})'
        lines.append(f'  {unit.name}  {unit.shape[0]}x{unit.shape[1]}{what}')
      for g, group in enumerate(self.groups):
        if group.iteration_owner == slot:
          s = group.gram_size
          lines.append(f'  iteration of group {g}  {s}x{s}')
    return lines


def _plural(n: int, one: str, many: str) -> str:
  return f'{n} {one if n == 1 else many}'


def human_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.2f} {unit}'
    n /= 1024
  raise AssertionError('unreachable')


def human_flops(n: float) -> str:
  for prefix in ('', 'k', 'M', 'G', 'T', 'P'):
    if abs(n) < 1000 or prefix == 'P':
      return f'{n:.0f} FLOP' if not prefix else f'{n:.2f} {prefix}FLOP'
    n /= 1000
  raise AssertionError('unreachable')


def ns_flops(m: int, n: int, ns_steps: int = 5) -> float:
  """Predicted FLOPs of Newton–Schulz on an ``m x n`` matrix.

  With ``s = min(m, n)`` and ``l = max(m, n)``, each quintic iteration forms
  ``A = X Xᵀ`` (``2 s² l``), ``A·A`` (``2 s³``) and ``B·X`` (``2 s² l``), so
  the total is ``ns_steps * (4 s² l + 2 s³)`` (about ``20 s² l + 10 s³`` for
  5 steps, see ../shared/DESIGN.md, "Performance model").

  Args:
    m: number of rows.
    n: number of columns.
    ns_steps: number of Newton–Schulz iterations.

  Returns:
    The FLOP count, as a float.
  """
  s, l = min(m, n), max(m, n)
  return float(ns_steps) * (4.0 * s * s * l + 2.0 * s**3)


_NS_ALGORITHMS = ('auto', 'standard', 'gram')


def ns_cost(
  m: int, n: int, ns_steps: int = 5, ns_algorithm: str = 'auto'
) -> float:
  """Predicted matmul FLOPs of the Newton–Schulz form that will run.

  ``'standard'`` is :func:`ns_flops`; ``'gram'`` the Gram form with its
  default restarts; ``'auto'`` the cheaper of the two for this shape (what
  :func:`dmuon_jax.dmuon` runs by default: Gram for aspect ratios above about
  1.5 with 5 iterations).

  Args:
    m: rows.
    n: columns.
    ns_steps: Newton–Schulz iterations.
    ns_algorithm: ``'auto'``, ``'standard'`` or ``'gram'``.

  Returns:
    The FLOP count, as a float.
  """
  if ns_algorithm not in _NS_ALGORITHMS:
    raise ValueError(
      f'dmuon: ns_algorithm={ns_algorithm!r} is not one of {_NS_ALGORITHMS}.'
    )
  if ns_algorithm == 'auto':
    ns_algorithm = _newton_schulz.cheaper_ns_algorithm(m, n, ns_steps)
  return float(_newton_schulz.matmul_flops(m, n, ns_steps, ns_algorithm))


def _normalize_axes(
  value: Any, ndim: int, what: str, path: str, shape: tuple[int, ...]
) -> tuple[int, ...]:
  axes = (value,) if isinstance(value, (int, np.integer)) else value
  try:
    axes = tuple(axes)
  except TypeError:
    axes = None
  if axes is None or not all(
    isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes
  ):
    raise ValueError(
      f'dmuon: param {path!r} has {what}={value!r}; expected an int or a'
      ' sequence of ints. Fix its MuonDimensionNumbers.'
    )
  if not axes:
    raise ValueError(
      f'dmuon: param {path!r} with shape {shape} has an empty {what}; a'
      ' matrix needs at least one reduction and one output axis. Fix its'
      f' MuonDimensionNumbers. {_HINT_ADAMW}'
    )
  bad = [a for a in axes if not -ndim <= a < ndim]
  if bad:
    raise ValueError(
      f'dmuon: param {path!r} with shape {shape} (ndim={ndim}) has'
      f' {what}={value!r}; axes {bad} are out of range [-{ndim}, {ndim}).'
      ' Fix its MuonDimensionNumbers.'
    )
  axes = tuple(int(a) % ndim for a in axes)
  if len(set(axes)) != len(axes):
    raise ValueError(
      f'dmuon: param {path!r} with shape {shape} has {what}={value!r},'
      ' which repeats an axis. List each axis once in its'
      ' MuonDimensionNumbers.'
    )
  return axes


def _no_dims_message(shown: str, shape: tuple[int, ...], arg: str) -> str:
  """The error for a >2-D Muon target without dimension numbers."""
  ndim = len(shape)
  stack = MuonDimensionNumbers(reduction_axis=ndim - 2, output_axis=ndim - 1)
  flat = MuonDimensionNumbers(
    reduction_axis=0, output_axis=tuple(range(1, ndim))
  )
  count = math.prod(shape[:-2])
  return (
    f'dmuon: param {shown!r} has shape {shape} (ndim={ndim}) and was'
    ' selected as a Muon target without dimension numbers, which say how'
    f' to read it as matrices. Either as a stack of {count} matrices'
    f' {shape[-2]}x{shape[-1]} (scanned layers, experts): {stack}; or as'
    f' one {shape[0]}x{math.prod(shape[1:])} matrix (e.g. an attention'
    f' kernel (d_model, heads, head_dim)): {flat}. Give the one you mean for'
    f' this leaf in {arg} (a tree like the params, None for AdamW leaves),'
    ' or route the leaf to AdamW.'
  )


def _make_leaf_spec(
  leaf_index: int,
  path: str,
  leaf: Any,
  dims: MuonDimensionNumbers | None,
  dims_arg: str = 'weight_dimension_numbers',
) -> LeafSpec:
  """Validates a Muon-target leaf and describes its matrices."""
  shape = tuple(int(d) for d in np.shape(leaf))
  ndim = len(shape)
  shown = path or '<root>'
  if ndim < 2:
    raise ValueError(
      f'dmuon: param {shown!r} has shape {shape} (ndim={ndim}) but was'
      ' selected as a Muon target, which needs a matrix (ndim >= 2).'
      f' {_HINT_ADAMW}'
    )
  dtype = getattr(leaf, 'dtype', None)
  dtype = np.dtype(np.result_type(leaf) if dtype is None else dtype)
  if not jax.dtypes.issubdtype(dtype, np.floating):
    raise ValueError(
      f'dmuon: param {shown!r} has dtype {dtype.name} but was selected as a'
      ' Muon target, which needs a real floating-point dtype (float32,'
      f' bfloat16, ...). {_HINT_ADAMW}'
    )
  if dims is None:
    if ndim > 2:
      raise ValueError(_no_dims_message(shown, shape, dims_arg))
    dims = MuonDimensionNumbers(reduction_axis=0, output_axis=1)
  reduction = _normalize_axes(
    dims.reduction_axis, ndim, 'reduction_axis', shown, shape
  )
  output = _normalize_axes(dims.output_axis, ndim, 'output_axis', shown, shape)
  overlap = sorted(set(reduction) & set(output))
  if overlap:
    raise ValueError(
      f'dmuon: param {shown!r} with shape {shape} has overlapping dimension'
      f' numbers {dims}: axes {overlap} are both reduction and output axes'
      ' (after normalizing negative axes). Make them disjoint.'
    )
  batch = tuple(sorted(set(range(ndim)) - set(reduction) - set(output)))
  return LeafSpec(
    leaf_index=leaf_index,
    path=path,
    shape=shape,
    dtype=dtype.name,
    batch_axes=batch,
    reduction_axes=reduction,
    output_axes=output,
  )


def check_predicate(predicate: Any) -> None:
  """Raises unless ``predicate`` is None, ``'optax'`` or a callable."""
  if predicate is None or callable(predicate) or predicate == OPTAX_ROUTING:
    return
  raise TypeError(
    f'dmuon: predicate={predicate!r} is not a routing rule. Pass None (the'
    " default rule, see dmuon_jax.default_muon_predicate), 'optax' (every"
    ' 2-D leaf, or the leaves with dimension numbers, as'
    ' optax.contrib.muon), or a callable (path, leaf) -> bool.'
  )


def _optax_target(leaf: Any, dims: Any, have_dims: bool) -> bool:
  """``optax.contrib.muon``'s rule: leaves with dimension numbers when they
  are given, else every 2-D leaf (optax 0.2.8, ``contrib/_muon.py``)."""
  return dims is not None if have_dims else np.ndim(leaf) == 2


def _is_target(
  path: str, leaf: Any, dims: Any, have_dims: bool, predicate: Any
) -> bool:
  if isinstance(predicate, str):
    return _optax_target(leaf, dims, have_dims)
  if predicate is not None:
    return bool(predicate(path, leaf)) and (not have_dims or dims is not None)
  if have_dims:
    return dims is not None
  return default_muon_predicate(path, leaf)


def muon_target_specs(
  params: Any,
  *,
  predicate: Predicate | str | None = None,
  weight_dimension_numbers: WeightDimNums = None,
  dims_arg: str = 'weight_dimension_numbers',
) -> list[LeafSpec | None]:
  """Routes every leaf to Muon (a :class:`LeafSpec`) or not (None).

  The rule, shared by the planner and the optimizer:

  - with ``predicate='optax'``: ``optax.contrib.muon``'s rule, the leaves
    whose dimension numbers are not None when ``weight_dimension_numbers``
    is given, else every 2-D leaf;
  - with a callable ``predicate``: a leaf is a target if
    ``predicate(path, leaf)`` and, when ``weight_dimension_numbers`` is
    given, its resolved entry is not None;
  - else with ``weight_dimension_numbers``: a leaf is a target if its resolved
    entry is not None;
  - else: :func:`default_muon_predicate`.

  A 2-D target without dimension numbers uses reduction axis 0 and output
  axis 1; a target of higher rank needs dimension numbers.

  Args:
    params: a pytree whose leaves have ``shape`` and ``dtype`` (arrays or
      ``jax.ShapeDtypeStruct``); None and ``optax.MaskedNode()`` are not
      leaves. Only shapes and dtypes are read.
    predicate: (optional) ``'optax'`` or ``(path, leaf) -> bool``, ``path``
      as given by :func:`normalize_path`.
    weight_dimension_numbers: (optional) ``MuonDimensionNumbers`` for
      every leaf, a tree (prefix) of them or a callable returning one, as
      ``muon_weight_dimension_numbers`` of :func:`dmuon_jax.dmuon`.
    dims_arg: the name of ``weight_dimension_numbers`` in the caller's API,
      for messages.

  Returns:
    One entry per leaf of ``jax.tree.leaves(params)``.

  Raises:
    ValueError: if a target is not a floating-point matrix of rank >= 2, has
      rank > 2 and no dimension numbers, or its dimension numbers are
      invalid for its shape.
  """
  return route(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
    dims_arg=dims_arg,
  ).specs


def _human_count(n: int) -> str:
  for unit, size in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= size:
      return f'{n / size:.3g}{unit}'
  return str(n)


class Routing(NamedTuple):
  """Where each leaf goes: see :func:`route`."""

  specs: list[LeafSpec | None]
  summary: str
  num_muon: int
  # Whether default_muon_predicate chose (no predicate, no dimension numbers).
  default_rule: bool


def route(
  params: Any,
  *,
  predicate: Predicate | str | None = None,
  weight_dimension_numbers: WeightDimNums = None,
  dims_arg: str = 'weight_dimension_numbers',
) -> Routing:
  """Routes the leaves (see :func:`muon_target_specs`) and summarizes it.

  The summary is one line counting the leaves and elements that go to Muon
  and to AdamW, naming the leaves that ``optax.contrib.muon`` with the same
  dimension numbers routes otherwise.
  """
  check_predicate(predicate)
  with_path, _ = jax.tree_util.tree_flatten_with_path(params)
  have_dims = weight_dimension_numbers is not None
  if have_dims:
    all_dims = resolve_dimension_numbers(
      params, weight_dimension_numbers, dims_arg
    )
  else:
    all_dims = [None] * len(with_path)
  specs: list[LeafSpec | None] = []
  counts = {True: [0, 0], False: [0, 0]}
  only_optax, only_here, stacks = [], [], []
  for i, ((key_path, leaf), dims) in enumerate(zip(with_path, all_dims)):
    path = normalize_path(key_path)
    target = _is_target(path, leaf, dims, have_dims, predicate)
    specs.append(
      _make_leaf_spec(i, path, leaf, dims, dims_arg) if target else None
    )
    counts[target][0] += 1
    counts[target][1] += math.prod(np.shape(leaf))
    shown = f'{path or "<root>"!r} {tuple(np.shape(leaf))}'
    if _optax_target(leaf, dims, have_dims) != target:
      (only_here if target else only_optax).append(shown)
    elif not target and not have_dims and np.ndim(leaf) > 2:
      stacks.append(shown)
  total = max(1, counts[True][1] + counts[False][1])
  parts = [
    f'dmuon routing: Muon {_plural(counts[True][0], "leaf", "leaves")}'
    f' ({_human_count(counts[True][1])} elements,'
    f' {100 * counts[True][1] / total:.1f}%), AdamW'
    f' {_plural(counts[False][0], "leaf", "leaves")}'
    f' ({_human_count(counts[False][1])} elements)'
  ]

  def listed(paths):
    more = f' and {len(paths) - 6} more' if len(paths) > 6 else ''
    return ', '.join(paths[:6]) + more

  if only_optax:
    parts.append(
      f'optax.contrib.muon would orthogonalize {len(only_optax)} of the'
      f" AdamW leaves: {listed(only_optax)} (predicate='optax' routes as"
      ' optax)'
    )
  if only_here:
    parts.append(
      f'optax.contrib.muon would send {len(only_here)} of the Muon leaves'
      f' to AdamW: {listed(only_here)}'
    )
  if not (only_optax or only_here):
    parts.append('the same leaves as optax.contrib.muon')
  if stacks:
    parts.append(
      f'{_plural(len(stacks), "AdamW leaf", "AdamW leaves")} of rank > 2'
      ' (scanned layers, attention kernels) would go to Muon only with'
      f' dimension numbers: {listed(stacks)}'
    )
  return Routing(
    specs,
    '; '.join(parts),
    counts[True][0],
    default_rule=predicate is None and not have_dims,
  )


def layer_key(path: str, batch_index: tuple[int, ...] = ()) -> str:
  """Grouping key of a matrix, used to spread one layer over owners.

  If the path has a block boundary (a segment in ``layers``, ``layer``,
  ``blocks``, ``block``, ``h``, ``encoderblock``, ``decoderblock`` or
  ``resblocks`` followed by an integer segment, as in ``layers/3``, or one
  segment like ``layers_3``), the key is the path up to and including the
  outermost boundary. Otherwise it is the first path segment (skipping a
  leading linen ``params`` collection), with ``[i]`` appended for a stacked
  leaf, ``i`` being the first batch index (the scanned layer). A stacked leaf
  inside a block (e.g. experts ``(E, m, n)`` in ``layers/3``) keeps the
  block's key, so its matrices are spread together with the block's others.

  Args:
    path: the leaf's path, see :func:`normalize_path`.
    batch_index: the matrix's multi-index over the leaf's batch axes.

  Returns:
    The key.
  """
  block, base = _layer_base(path)
  if block:
    return base
  if batch_index:
    return f'{base}[{batch_index[0]}]'
  return base


@functools.lru_cache(maxsize=4096)
def _layer_base(path: str) -> tuple[bool, str]:
  """``(whether the path has a block boundary, the key's path part)``."""
  segments = _segments(path)
  end = block_boundary_end(segments)
  if end is not None:
    return True, '/'.join(segments[:end])
  start = 0
  while start < len(segments) - 1 and segments[start] in COLLECTION_NAMES:
    start += 1
  return False, '/'.join(segments[: start + 1])


def mesh_axes(
  mesh: Any, axis_names: Any = None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Owner axes (in mesh order) and their sizes."""
  if mesh is None:
    sizes: dict[str, int] = {}
    order: tuple[str, ...] = ()
  elif isinstance(mesh, Mapping):
    sizes = {str(k): v for k, v in mesh.items()}
    order = tuple(sizes)
  elif hasattr(mesh, 'axis_names') and hasattr(mesh, 'shape'):
    sizes = dict(mesh.shape)
    order = tuple(mesh.axis_names)
  else:
    raise TypeError(
      f'dmuon: mesh must be None, a jax.sharding.Mesh or AbstractMesh, or a'
      f' mapping {{axis_name: size}}; got {type(mesh).__name__}.'
    )
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(
        f'dmuon: mesh axis {name!r} has size {size!r}; expected a positive int.'
      )
  if axis_names is None:
    chosen = order
  else:
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    missing = [n for n in names if n not in sizes]
    if missing and mesh is None:
      raise ValueError(
        f'dmuon: axis_names {names} names mesh axes, but no mesh was given'
        ' (one slot, no axes). Pass the mesh too, or leave axis_names None.'
      )
    if missing:
      raise ValueError(
        f'dmuon: axis_names {names} includes {missing}, which are not axes'
        f' of the mesh; the mesh has axes {order}. Pass a subset of them,'
        ' or None for all.'
      )
    if len(set(names)) != len(names):
      raise ValueError(f'dmuon: axis_names {names} repeats an axis.')
    chosen = tuple(n for n in order if n in names)
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
    if (
      not isinstance(x, jax.Array)
      or isinstance(x, jax.core.Tracer)
      or not getattr(x, 'committed', True)
    ):
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


def check_same_tree(
  tree: Any,
  reference: Any,
  what: str,
  is_leaf: Callable[[Any], bool] | None = None,
  made_by: str = 'init()',
  shapes: bool = False,
) -> None:
  """Raises if ``tree`` and ``reference`` differ in their leaf paths (and,
  with ``shapes``, in the shapes of the reference leaves that have one).

  Args:
    tree: the tree given now (e.g. to ``update``).
    reference: a tree with the structure recorded earlier (e.g. a state
      made by ``init``).
    what: the operation, for the message (e.g. ``'update()'``).
    is_leaf: leaf predicate for both trees (e.g. to keep
      ``optax.MaskedNode`` entries: a wrapper's ``optax.masked`` gives them
      to ``update`` where ``init`` had them too).
    made_by: the call that recorded ``reference``.
    shapes: also compare shapes (reference leaves without a ``shape``, such
      as ``optax.MaskedNode()``, match any).

  Raises:
    ValueError: listing the paths only in one of the two trees, or the
      leaves whose shapes differ.
  """
  got = [
    # (A leaf that is an empty node, as optax.MaskedNode(), has no shape.)
    (normalize_path(k), None if isinstance(x, tuple) else tuple(np.shape(x)))
    for k, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  ]
  want = [
    (normalize_path(k), tuple(np.shape(r)) if hasattr(r, 'shape') else None)
    for k, r in jax.tree_util.tree_flatten_with_path(
      reference, is_leaf=is_leaf
    )[0]
  ]
  if not shapes:
    got = [(p, None) for p, _ in got]
    want = [(p, None) for p, _ in want]
  check_same_leaves(got, want, what, made_by)


def check_same_leaves(
  got: Sequence[tuple[str, tuple[int, ...] | None]],
  want: Sequence[tuple[str, tuple[int, ...] | None]],
  what: str,
  made_by: str = 'init()',
) -> None:
  """Raises unless ``got`` has the paths of ``want``, in order, and its
  shapes (a ``want`` shape of None matches any).

  Args:
    got: ``(path, shape)`` of each leaf given now (e.g. to ``update``).
    want: ``(path, shape or None)`` of each leaf recorded by ``made_by``.
    what: the operation, for the message (e.g. ``'update()'``).
    made_by: the call that recorded ``want``.

  Raises:
    ValueError: naming the paths missing or new, else the leaves of
      another shape, else saying the leaves are reordered.
  """
  got_paths = [p for p, _ in got]
  want_paths = [p for p, _ in want]
  if got_paths == want_paths:
    differ = [
      f'{p or "<root>"!r} has shape {g}, {made_by} saw {w}'
      for (p, g), (_, w) in zip(got, want)
      if w is not None and g != w
    ]
    if not differ:
      return
    detail = '; '.join(differ[:8])
  else:
    missing = sorted(set(want_paths) - set(got_paths))
    extra = sorted(set(got_paths) - set(want_paths))
    detail = (
      '; '.join(
        [f'params {missing} are missing'] * bool(missing)
        + [f'params {extra} are new'] * bool(extra)
      )
      or 'the leaves are reordered'
    )
  grads = ', or pass gradients of the params the state was made for' * (
    'update' in what
  )
  raise ValueError(
    f'dmuon: the tree given to {what} does not match the one given to'
    f' {made_by}: {detail}. Call {made_by} again on the new params (a changed'
    f' model needs a new optimizer state){grads}.'
  )


# Upper bound on partner checks in the layer-spreading repair pass, so that
# pathological trees (many thousands of matrices) still plan quickly.
_REPAIR_BUDGET = 500_000


def _assign(units: Sequence[MatrixUnit], num_slots: int) -> list[int]:
  """LPT on cost, spreading the matrices of each layer over owners.

  A layer with ``n`` matrices may put ``cap = ceil(n / num_slots)`` of them on
  one slot (1 when the layer fits, i.e. distinct owners). Units go in order
  of decreasing cost (ties: lower unit index first). Plain LPT puts each on
  the least-loaded slot ``g`` (ties: lowest index). We instead take the
  least-loaded slot ``a`` still below the layer's cap, if adding the unit
  there leaves the makespan no larger than plain LPT's choice would:
  ``loads[a] + c <= max(makespan, loads[g] + c)``. A repair pass then
  removes remaining excess by moves and swaps that keep the makespan.

  Graham's bound still holds. Let ``W_k`` be the total cost placed before
  unit ``k``; ``loads[g] <= W_k / P``. After placing unit ``k`` the makespan
  is at most ``max(M_{k-1}, loads[g] + c_k)``, so by induction the final
  makespan is at most ``max_k (W_k / P + c_k) <= total / P + max cost``; the
  repair pass never raises the makespan.

  Args:
    units: the matrices.
    num_slots: the number of owner slots.

  Returns:
    The owner slot of each unit.
  """
  sizes = collections.Counter(u.layer for u in units)
  cap = {layer: -(-n // num_slots) for layer, n in sizes.items()}
  counts = {layer: np.zeros(num_slots, dtype=np.int64) for layer in sizes}
  loads = np.zeros(num_slots, dtype=np.float64)
  owners = [0] * len(units)
  makespan = 0.0
  order = sorted(range(len(units)), key=lambda i: (-units[i].cost, i))
  for i in order:
    unit = units[i]
    cost = unit.cost
    count, limit = counts[unit.layer], cap[unit.layer]
    g = int(np.argmin(loads))  # argmin returns the lowest index on ties.
    choice = g
    if count[g] >= limit:
      a = int(np.argmin(np.where(count < limit, loads, np.inf)))
      if count[a] < limit and loads[a] + cost <= max(makespan, loads[g] + cost):
        choice = a
    loads[choice] += cost
    count[choice] += 1
    makespan = max(makespan, float(loads[choice]))
    owners[i] = choice
  _spread_layers(units, owners, loads, counts, cap)
  return owners


def _spread_layers(
  units: Sequence[MatrixUnit],
  owners: list[int],
  loads: np.ndarray,
  counts: dict[str, np.ndarray],
  cap: dict[str, int],
) -> None:
  """Moves or swaps units, in place, to bring layers under their caps.

  A unit on a slot holding more than ``cap`` units of its layer moves to a
  slot below the cap, or swaps with a unit there whose layer has room on the
  first slot, when neither slot then exceeds the current makespan. Every
  change lowers the total excess by at least one, so this terminates; the
  search is deterministic (units and slots in index order) and bounded by
  ``_REPAIR_BUDGET`` partner checks.

  Args:
    units: the matrices.
    owners: owner slot per unit, updated in place.
    loads: cost per slot, updated in place.
    counts: per layer, the number of its units on each slot (in place).
    cap: per layer, the most units it should have on one slot.
  """
  num_slots = len(loads)
  makespan = float(loads.max(initial=0.0))
  on_slot: list[list[int]] = [[] for _ in range(num_slots)]
  for i, owner in enumerate(owners):
    on_slot[owner].append(i)
  budget = _REPAIR_BUDGET
  changed = True
  while changed and budget > 0:
    changed = False
    for i, unit in enumerate(units):
      s, layer = owners[i], unit.layer
      count, limit = counts[layer], cap[layer]
      if count[s] <= limit:
        continue
      for t in range(num_slots):
        if count[t] >= limit:
          continue
        partner = None
        if loads[t] + unit.cost <= makespan:
          partner = -1  # a plain move
        else:
          for j in on_slot[t]:
            budget -= 1
            other = units[j]
            if other.layer == layer or (
              counts[other.layer][s] >= cap[other.layer]
            ):
              continue
            delta = other.cost - unit.cost
            if delta == 0 or (
              loads[s] + delta <= makespan and loads[t] - delta <= makespan
            ):
              partner = j
              break
        if partner is None:
          if budget <= 0:
            return
          continue
        _move(i, s, t, units, owners, loads, counts, on_slot)
        if partner >= 0:
          _move(partner, t, s, units, owners, loads, counts, on_slot)
        changed = True
        break


def _move(
  i: int,
  src: int,
  dst: int,
  units: Sequence[MatrixUnit],
  owners: list[int],
  loads: np.ndarray,
  counts: dict[str, np.ndarray],
  on_slot: list[list[int]],
) -> None:
  unit = units[i]
  owners[i] = dst
  loads[src] -= unit.cost
  loads[dst] += unit.cost
  counts[unit.layer][src] -= 1
  counts[unit.layer][dst] += 1
  on_slot[src].remove(i)
  on_slot[dst].append(i)


def plan_ownership(
  params: Any,
  mesh: Any = None,
  *,
  axis_names: str | Sequence[str] | None = None,
  predicate: Predicate | str | None = None,
  weight_dimension_numbers: WeightDimNums = None,
  ns_steps: int = 5,
  cost_fn: CostFn | None = None,
  ns_algorithm: str = 'auto',
  owner_groups: int | str | None = 'auto',
  shard_counts: Mapping[int, Sequence[int]] | None = None,
  ungroupable: Sequence[int] = (),
) -> OwnershipPlan:
  """Assigns every Muon matrix of ``params`` to exactly one owner slot.

  Leaves are routed to Muon as :func:`dmuon_jax.dmuon` routes them
  (``predicate``, ``weight_dimension_numbers``); each matrix inside a
  stacked leaf (``(L, m, n)``, ``(L, E, m, n)``, ...) is its own unit. Units
  are balanced by longest-processing-time-first on the predicted
  Newton–Schulz cost, spreading matrices of one layer (the path up to its
  block boundary, such as ``layers/3``, or the scanned layer of a stack)
  over different owners whenever that does not increase the makespan. The
  makespan is at most ``total / num_slots + max cost`` (Graham's bound). No
  divisibility of shapes or counts by the mesh is needed.

  Args:
    params: a pytree whose leaves have ``shape`` and ``dtype`` (arrays or
      ``jax.ShapeDtypeStruct``); may hold None or ``optax.MaskedNode()``
      placeholders. Only shapes and dtypes are read.
    mesh: (optional, default None) a ``jax.sharding.Mesh``,
      ``jax.sharding.AbstractMesh`` or mapping ``{axis_name: size}``; None
      gives a single slot.
    axis_names: (optional, default None) the mesh axes that owners range
      over; None for all. They are kept in mesh order.
    predicate: (optional) ``(path, leaf) -> bool`` selecting Muon targets,
      or ``'optax'``, as for :func:`dmuon_jax.dmuon`.
    weight_dimension_numbers: (optional) ``MuonDimensionNumbers`` for
      every leaf, a tree (prefix) of them or a callable returning one, as
      ``muon_weight_dimension_numbers`` of :func:`dmuon_jax.dmuon`.
    ns_steps: Newton–Schulz iterations, for the default cost model.
    cost_fn: (optional) ``(fan_in, fan_out) -> float`` replacing the default
      cost model (the matmul FLOPs of the Newton–Schulz form that runs).
    ns_algorithm: (optional, default ``'auto'``) the Newton–Schulz form the
      optimizer runs, for the default cost model: ``'auto'`` (the cheaper
      form per shape, as :func:`dmuon_jax.dmuon`'s default), ``'standard'``
      or ``'gram'``.
    owner_groups: (optional, default ``'auto'``) owner groups (see
      :class:`OwnerGroup`): ``'auto'`` splits matrices that alone would set
      the makespan (each costs more than ``total / N`` and at least 1e10
      FLOPs) when that lowers the predicted time (FLOPs plus
      ``FLOPS_PER_BYTE`` per byte of the groups' collectives) by 5%; an int
      ``k`` splits every Muon matrix into ``k`` slices on ``k`` devices of
      the innermost owner axis; None never splits.
    shard_counts: (optional) leaf index -> per dimension its number of
      shards, so that slices take an equal part of every shard.
    ungroupable: (optional) leaf indices never split.

  Returns:
    An :class:`OwnershipPlan`.

  Raises:
    ValueError: for invalid targets (not a floating-point matrix of rank
      >= 2, of rank > 2 without dimension numbers, or with dimension numbers
      invalid for its shape), unknown
      ``axis_names`` or a negative or non-finite cost.

  Examples:
    Shapes only; a mapping stands in for the mesh:

    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {
    ...     'up': jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...     'down': jax.ShapeDtypeStruct((256, 64), jnp.float32),
    ...     'wide': jax.ShapeDtypeStruct((512, 512), jnp.float32),
    ...     'bias': jax.ShapeDtypeStruct((64,), jnp.float32)}
    >>> plan = dmuon_jax.plan_ownership(params, {'data': 2})
    >>> [unit.path for unit in plan.units]  # the bias goes to AdamW
    ['down', 'up', 'wide']
    >>> plan.owners  # LPT: the big matrix alone, the two small ones together
    (1, 1, 0)
    >>> plan.makespan == max(plan.slot_costs()) == plan.units[2].cost
    True
  """
  if (
    not isinstance(ns_steps, (int, np.integer))
    or isinstance(ns_steps, bool)
    or ns_steps < 1
  ):
    raise ValueError(
      f'dmuon: {ns_steps=} must be a positive int (the Newton-Schulz'
      ' iterations the cost model counts); pass e.g. 5, as the optimizer.'
    )
  if ns_algorithm not in _NS_ALGORITHMS:
    raise ValueError(
      f'dmuon: ns_algorithm={ns_algorithm!r} is not one of {_NS_ALGORITHMS}.'
    )
  names, sizes = mesh_axes(mesh, axis_names)
  check_devices(params, mesh)
  routing = route(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
  )
  all_specs = routing.specs
  leaves = tuple(s for s in all_specs if s is not None)
  units = []
  for spec in leaves:
    fan_in, fan_out = spec.matrix_shape
    if cost_fn is None:
      cost = ns_cost(fan_in, fan_out, int(ns_steps), ns_algorithm)
    else:
      cost = float(cost_fn(fan_in, fan_out))
      if not math.isfinite(cost) or cost < 0:
        raise ValueError(
          f'dmuon: cost_fn({fan_in}, {fan_out}) returned {cost} for param'
          f' {spec.path!r}; expected a finite, non-negative float.'
        )
    nbytes = fan_in * fan_out * jnp.dtype(spec.dtype).itemsize
    for batch_index in np.ndindex(*spec.batch_shape):
      batch_index = tuple(int(i) for i in batch_index)
      units.append(
        MatrixUnit(
          leaf_index=spec.leaf_index,
          path=spec.path,
          batch_index=batch_index,
          shape=(fan_in, fan_out),
          layer=layer_key(spec.path, batch_index),
          cost=cost,
          nbytes=int(nbytes),
        )
      )
  owners = _assign(units, math.prod(sizes))
  groups = ()
  check_owner_groups(owner_groups)
  if owner_groups is not None:
    if owner_groups != 'auto' and ns_algorithm == 'standard':
      raise ValueError(
        f'dmuon: owner_groups={owner_groups} runs Gram Newton-Schulz on '
        "the groups' matrices, but ns_algorithm='standard'. Pass "
        "ns_algorithm='auto' or 'gram', or owner_groups=None."
      )
    grouped = None
    if owner_groups != 'auto' or (
      ns_algorithm != 'standard' and cost_fn is None
    ):
      grouped = _plan_with_groups(
        leaves,
        units,
        sizes,
        owner_groups,
        int(ns_steps),
        dict(shard_counts or {}),
        frozenset(ungroupable),
        owners,
      )
    if grouped is not None:
      leaves, units, owners, groups = grouped
  return OwnershipPlan(
    axis_names=names,
    mesh_shape=sizes,
    num_leaves=len(all_specs),
    leaves=leaves,
    units=tuple(units),
    owners=tuple(owners),
    groups=groups,
    routing=routing.summary,
  )


def check_owner_groups(owner_groups: Any) -> None:
  """Raises unless ``owner_groups`` is ``'auto'``, None or an int >= 2."""
  if owner_groups is None or owner_groups == 'auto':
    return
  if (
    isinstance(owner_groups, (int, np.integer))
    and not isinstance(owner_groups, bool)
    and owner_groups >= 2
  ):
    return
  raise ValueError(
    f"dmuon: owner_groups={owner_groups!r} is not 'auto', None or an int "
    '>= 2 (the number of devices that share each matrix).'
  )


# ---------------------------------------------------------------------------
# Owner groups: a large matrix split into slices over several owners.

# 'auto' splits a matrix only when its Newton-Schulz costs at least this
# much: below it, the two extra collectives per restart window cost more
# than the work they spread (a 1024 x 4096 Gram NS is 6.4e10 FLOPs).
_MIN_GROUP_FLOPS = 1e10
# 'auto' looks for groups when the plain plan's makespan exceeds the ideal
# total / N by this factor, and keeps them when they lower the predicted
# time (FLOPs plus the bytes term below) by at least _GROUP_GAIN.
_GROUP_TRIGGER = 1.10
_GROUP_GAIN = 0.05
# 'auto' considers matrices costing more than this fraction of total / N:
# coarser pieces than that pack badly (70B's 3.1e13-FLOP MLP matrices on
# 256 devices, 3.9e13 each: the plain plan is 1.2x the ideal).
_COARSE = 0.25
# Slices per grouped matrix: each at most this fraction of the bound
# max(total / N, largest iteration), so slices fill owners finely.
_SLICE_FRACTION = 0.1
# Slices keep at least this many rows/columns of the long side.
_MIN_SLICE = 128
# The planner's exchange rate between Gram bytes and NS FLOPs: a byte a
# device sends in a group's collectives counts as this many FLOPs (a GPU
# doing ~1e14 FLOP/s of float32 matmuls over ~1e12 bytes/s of NVLink).
FLOPS_PER_BYTE = 100.0


def gram_parts(s: int, l: int, ns_steps: int) -> tuple[float, float]:
  """``(long-side work, g x g iteration)`` FLOPs of Gram Newton–Schulz on an
  ``s x l`` matrix (``s <= l``) with the default restarts.

  The long-side work (forming each segment's Gram ``X X^T`` and applying
  its factor ``Q X``: ``4 p s^2 l`` for ``p`` segments) splits over slices
  of the long side; the iteration on the ``s x s`` Gram
  (``(8 k - 6 p) s^3``) does not. Together they are
  :func:`dmuon_jax.matmul_flops` of the Gram form.
  """
  p = len(_newton_schulz.check_restart_iterations(None, ns_steps)) + 1
  work = 4.0 * p * s * s * l
  return work, float(_newton_schulz.matmul_flops(s, l, ns_steps, 'gram') - work)


def sliced_spec(
  spec: LeafSpec,
  slices: int,
  strides: Sequence[int] | None = None,
  min_slice: int = 1,
) -> LeafSpec | None:
  """A view of ``spec`` whose matrices are slices of the long side.

  A long-side dimension ``d`` of size ``T * slices * w`` (``T`` the number
  of shards of ``d``, from ``strides``) is viewed as ``(T, slices, w)``; the
  middle one is a batch axis, so slice ``j`` of a matrix takes the ``j``-th
  ``w`` rows/columns of every shard. A sharded leaf then holds a piece of
  every slice, as of every whole matrix: the view is a free reshape of the
  leaf and of each shard, and routes move exactly what they moved before.

  Args:
    spec: the leaf's spec.
    slices: the number of slices per matrix.
    strides: per leaf dimension, its number of shards (default all 1).
    min_slice: the fewest rows/columns of the long side a slice keeps.

  Returns:
    The view's spec, or None when no long-side dimension divides (or the
    slices would be narrower than ``min_slice``).
  """
  fi, fo = spec.matrix_shape
  columns = fo >= fi
  long_axes = spec.output_axes if columns else spec.reduction_axes
  strides = tuple(strides) if strides is not None else (1,) * len(spec.shape)
  d = next(
    (a for a in long_axes if spec.shape[a] % (strides[a] * slices) == 0),
    None,
  )
  if d is None or max(fi, fo) // slices < min_slice:
    return None
  stride = strides[d]
  w = spec.shape[d] // (stride * slices)
  shape = spec.shape[:d] + (stride, slices, w) + spec.shape[d + 1 :]

  def remap(axes):
    out = []
    for a in axes:
      out += [d, d + 2] if a == d else [a if a < d else a + 2]
    return tuple(out)

  return dataclasses.replace(
    spec,
    shape=shape,
    batch_axes=tuple(sorted(remap(spec.batch_axes) + (d + 1,))),
    reduction_axes=remap(spec.reduction_axes),
    output_axes=remap(spec.output_axes),
    original_shape=spec.shape,
    slice_axis=d + 1,
    split_axis=-1 if columns else -2,
    whole_matrix=(fi, fo),
  )


def view_entries(spec: LeafSpec, entries: Sequence[Any]) -> tuple | None:
  """A leaf's per-dimension sharding entries for the view of a sliced
  spec (the entries themselves for an unsliced one); None when the leaf's
  sharding of the split dimension is not the view's (another shard count
  than the state was laid out for)."""
  entries = tuple(tuple(e) for e in entries)
  if not spec.sliced:
    return entries
  d = spec.slice_axis - 1
  return entries[:d] + (entries[d], (), ()) + entries[d + 1 :]


def whole_batch_index(spec: LeafSpec, batch_index: Sequence[int]) -> tuple:
  """A unit's matrix index over the leaf's own batch axes (the slice index
  dropped for a sliced spec)."""
  batch_index = tuple(batch_index)
  if not spec.sliced:
    return batch_index
  pos = spec.batch_axes.index(spec.slice_axis)
  return batch_index[:pos] + batch_index[pos + 1 :]


def slice_index(spec: LeafSpec, batch_index: Sequence[int]) -> int:
  """A slice unit's index among its matrix's slices."""
  return int(batch_index[spec.batch_axes.index(spec.slice_axis)])


def _group_members(
  pieces: list[tuple[float, int, str, int, int]],
  row_size: int,
) -> dict[tuple[str, int], int]:
  """LPT of one row's pieces onto its members.

  Pieces are ``(cost, order, kind, ref, group)``: ``kind`` is ``'unit'``
  (a whole matrix or a slice, ``ref`` its unit index) or ``'iteration'``
  (``ref`` the group); ``group`` is the slice's group for distinct groups,
  else -1. Each piece goes to the least-loaded member (ties: lowest),
  a distinct group's slices to members not yet holding one.
  """
  loads = np.zeros(row_size)
  held: dict[int, set[int]] = collections.defaultdict(set)
  out = {}
  # A distinct group's iteration goes to one of its k slice owners, so it
  # is placed after every slice.
  ordered = sorted(
    pieces, key=lambda p: (p[2] == 'iteration' and p[4] >= 0, -p[0], p[1])
  )
  for cost, _, kind, ref, group in ordered:
    choice = int(np.argmin(loads))
    if group >= 0 and kind == 'iteration':
      choice = min(held[group], key=lambda m: (loads[m], m))
    elif group >= 0:
      free = [m for m in range(row_size) if m not in held[group]]
      if free:
        choice = min(free, key=lambda m: (loads[m], m))
      held[group].add(int(choice))
    loads[choice] += cost
    out[(kind, ref)] = int(choice)
  return out


def _plan_with_groups(
  leaves: Sequence[LeafSpec],
  units: Sequence[MatrixUnit],
  sizes: Sequence[int],
  owner_groups: Any,
  ns_steps: int,
  strides: Mapping[int, Sequence[int]],
  ungroupable: frozenset[int],
  plain_owners: Sequence[int],
) -> tuple[tuple, tuple, tuple, tuple] | None:
  """Leaves, units, owners and groups of a plan with owner groups, or None
  when ``'auto'`` finds no gain (or nothing to group)."""
  n = math.prod(sizes)
  row_size = sizes[-1] if sizes else 1
  forced = owner_groups != 'auto'
  if forced and not 2 <= owner_groups <= row_size:
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} needs 2 <= k <= the size of the '
      f'innermost owner axis ({row_size}), along which a group of owners '
      "shares a matrix. Pass a smaller k, or owner_groups='auto'."
    )
  if n == 1 or row_size == 1:
    return None
  costs = np.zeros(n)
  for u, o in zip(units, plain_owners):
    costs[o] += u.cost
  total = float(costs.sum())
  ideal = total / n
  plain = float(costs.max(initial=0.0))
  if not forced and plain <= _GROUP_TRIGGER * ideal:
    return None
  first_cost = {}
  for u in units:
    first_cost.setdefault(u.leaf_index, u.cost)
  chosen = []
  for spec in leaves:
    s_, l_ = sorted(spec.matrix_shape)
    if spec.leaf_index in ungroupable or s_ < 2:
      continue
    if not forced and (
      first_cost[spec.leaf_index] < _MIN_GROUP_FLOPS
      or first_cost[spec.leaf_index] <= _COARSE * ideal
    ):
      continue
    chosen.append(spec)
  if not chosen:
    return None
  parts = {
    s.leaf_index: gram_parts(*sorted(s.matrix_shape), ns_steps) for s in chosen
  }
  bound = max([ideal] + [p[1] for p in parts.values()])
  views = {}
  for spec in chosen:
    stride = strides.get(spec.leaf_index)
    work = parts[spec.leaf_index][0]
    if forced:
      view = sliced_spec(spec, owner_groups, stride)
      if view is None:
        raise ValueError(
          f'dmuon: owner_groups={owner_groups}: the long side of param '
          f'{spec.path!r} (matrices {spec.matrix_shape[0]}x'
          f'{spec.matrix_shape[1]}) does not split into {owner_groups} '
          'slices on a dimension divisible by that times its shard count. '
          "Pass a k that divides it, or owner_groups='auto'."
        )
    else:
      least = max(2, math.ceil(work / (_SLICE_FRACTION * bound)))
      view = None
      # The fewest slices that are fine enough; else, if slices of
      # _MIN_SLICE would be too narrow, the most that are not.
      for k in list(range(least, 4 * least + 1)) + list(
        range(least - 1, 1, -1)
      ):
        view = sliced_spec(spec, k, stride, _MIN_SLICE)
        if view is not None:
          break
      if view is None:
        continue
    views[spec.leaf_index] = view
  if not views:
    return None
  new_leaves = tuple(views.get(s.leaf_index, s) for s in leaves)
  new_units: list[MatrixUnit] = []
  groups_meta = []  # (leaf_index, whole batch index, shape, iteration cost)
  items = []  # (cost, order, whole unit index | -(group + 1))
  group_units: list[list[int]] = []
  for spec in new_leaves:
    if not spec.sliced:
      for u in units:
        if u.leaf_index == spec.leaf_index:
          items.append((u.cost, len(items), len(new_units)))
          new_units.append(u)
      continue
    fi, fo = spec.whole_matrix
    work, iteration = parts[spec.leaf_index]
    k = spec.shape[spec.slice_axis]
    slice_shape = spec.matrix_shape
    nbytes = slice_shape[0] * slice_shape[1] * jnp.dtype(spec.dtype).itemsize
    index_of = {}
    for batch_index in np.ndindex(*spec.batch_shape):
      batch_index = tuple(int(i) for i in batch_index)
      whole = whole_batch_index(spec, batch_index)
      if whole not in index_of:
        index_of[whole] = len(groups_meta)
        groups_meta.append((spec.leaf_index, whole, (fi, fo), iteration))
        group_units.append([])
        items.append((work + iteration, len(items), -len(groups_meta)))
      g = index_of[whole]
      group_units[g].append(len(new_units))
      new_units.append(
        MatrixUnit(
          leaf_index=spec.leaf_index,
          path=spec.path,
          batch_index=batch_index,
          shape=slice_shape,
          layer=layer_key(spec.path, whole),
          cost=work / k,
          nbytes=int(nbytes),
          group=g,
        )
      )
  rows = n // row_size
  row_load = np.zeros(rows)
  row_pieces: list[list] = [[] for _ in range(rows)]
  for cost, order, ref in sorted(items, key=lambda x: (-x[0], x[1])):
    r = int(np.argmin(row_load))
    row_load[r] += cost
    if ref >= 0:
      row_pieces[r].append((cost, order, 'unit', ref, -1))
      continue
    g = -ref - 1
    row_pieces[r].append(
      (groups_meta[g][3], order, 'iteration', g, g if forced else -1)
    )
    for u in group_units[g]:
      row_pieces[r].append(
        (new_units[u].cost, order, 'unit', u, g if forced else -1)
      )
  owners = [0] * len(new_units)
  iteration_owner = [0] * len(groups_meta)
  for r, pieces in enumerate(row_pieces):
    for (kind, ref), m in _group_members(pieces, row_size).items():
      if kind == 'unit':
        owners[ref] = r * row_size + m
      else:
        iteration_owner[ref] = r * row_size + m
  groups = tuple(
    OwnerGroup(
      leaf_index=leaf,
      batch_index=whole,
      shape=shape,
      units=tuple(group_units[g]),
      iteration_owner=iteration_owner[g],
      iteration_cost=iteration,
      distinct=forced,
    )
    for g, (leaf, whole, shape, iteration) in enumerate(groups_meta)
  )
  if not forced:
    loads = np.zeros(n)
    for u, o in zip(new_units, owners):
      loads[o] += u.cost
    for group in groups:
      loads[group.iteration_owner] += group.iteration_cost
    exchange = group_exchange_bytes(groups, n, row_size)
    if loads.max() + FLOPS_PER_BYTE * exchange > (1 - _GROUP_GAIN) * plain:
      return None
  return new_leaves, tuple(new_units), tuple(owners), groups


def group_exchange_bytes(
  groups: Sequence[OwnerGroup], num_slots: int, row_size: int, ns_steps=5
) -> float:
  """Predicted per-device bytes of the groups' collectives in one update.

  Per restart window one reduce-scatter of the Gram blocks over the group
  axis and one all-gather of the factors: ``2 (S - 1) B`` float32 elements,
  ``B`` the most Gram elements any slot iterates (ring model).
  """
  if not groups:
    return 0.0
  per_slot = np.zeros(num_slots)
  for group in groups:
    per_slot[group.iteration_owner] += group.gram_size**2
  windows = len(_newton_schulz.check_restart_iterations(None, ns_steps)) + 1
  return 2.0 * windows * (row_size - 1) * float(per_slot.max()) * 4


def _balance_work(
  planned, n: int, row_of: Mapping[int, int], max_rounds: int = 10_000
) -> None:
  """Evens out Newton–Schulz work by swapping owners inside loop groups.

  Swapping everything two slots own in one gather group keeps that group's
  bytes per slot (hence its padding) as they are, so only the work moves:
  repeatedly take the busiest slot and the swap, in any loop group, that
  lowers the larger of the two slots' work the most. Scanned stacks keep
  their rotation. Updates the base owners in ``planned`` in place.
  """
  per_group = []
  for _, iters, base, base_owner, _, ggroups, it_owner, _ in planned:
    w = np.zeros(n)
    for u, slot in zip(base, base_owner):
      for t in range(max(iters, 1)):
        w[(slot + t) % n] += u.cost
    for g, grp in ggroups:
      w[it_owner[g]] += grp.iteration_cost
    per_group.append(w)
  total = sum(per_group, np.zeros(n))
  movable = [g for g, entry in enumerate(planned) if not entry[1]]
  for _ in range(max_rounds):
    a = int(np.argmax(total))
    best, best_max = None, total[a] * (1 - 1e-9)
    for g in movable:
      w = per_group[g]
      # A group with owner groups swaps within a row only (its slices and
      # iterations must share the row's collectives).
      rows = planned[g][7]
      candidates = rows[row_of[a]] if planned[g][5] else range(n)
      for b in candidates:
        if b != a and w[a] != w[b]:
          new_max = max(total[a] - w[a] + w[b], total[b] - w[b] + w[a])
          if new_max < best_max:
            best, best_max = (g, b), new_max
    if best is None:
      return
    g, b = best
    w = per_group[g]
    delta = w[a] - w[b]
    total[a] -= delta
    total[b] += delta
    w[a], w[b] = w[b], w[a]
    owners = planned[g][3]
    owners[:] = [b if s == a else a if s == b else s for s in owners]
    it_owner = planned[g][6]
    for j, s in it_owner.items():
      it_owner[j] = b if s == a else a if s == b else s


def _plan_slot(
  plan: OwnershipPlan, buffer_axes: Sequence[str], slot: int
) -> int:
  """The plan's (mesh-order) slot of a slot in ``buffer_axes`` order."""
  if not plan.axis_names:
    return 0
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  coords = dict(
    zip(buffer_axes, np.unravel_index(slot, [sizes[a] for a in buffer_axes]))
  )
  return int(
    np.ravel_multi_index(
      [int(coords[a]) for a in plan.axis_names], plan.mesh_shape
    )
  )


def plan_gather_groups(
  plan: OwnershipPlan,
  groups: Sequence[tuple[str, bool, Sequence[LeafSpec]]],
  layers_per_gather: int,
  buffer_axes: Sequence[str],
  group_axis: str | None = None,
) -> tuple[OwnershipPlan, tuple[OwnershipPlan, ...], tuple[int, ...]]:
  """Owners for dedicated mode: matrices gathered per group of boundaries.

  Within a group, matrices go to owners largest first, each to the owner
  holding the fewest bytes of that group (ties: the least Newton–Schulz
  work so far, then the slot index), so that a gather pads little; then
  owners are swapped between slots inside loop groups (bytes unchanged) to
  even out the work over the whole model. A scanned stack is planned for
  one iteration of ``layers_per_gather`` layers; iteration ``t`` rotates
  those owners by ``t`` slots.

  Args:
    plan: the plan of all Muon targets (its units, costs and mesh).
    groups: per gather group, ``(name, scanned, leaf specs)``; a scanned
      group's leaves share a leading layer axis.
    layers_per_gather: layers of a scanned stack per iteration.
    buffer_axes: the owner axes in buffer order (major to minor).
    group_axis: the axis owner groups range over (default: the last buffer
      axis).

  Returns:
    ``(plan, group_plans, iterations)``: ``plan`` with every unit's owner
    (mesh-order slots), per group a plan over ``buffer_axes`` of its base
    units (one iteration for a scanned stack), and per group the number of
    scan iterations (0 for loop groups).

  Raises:
    ValueError: for a scanned group whose leaves do not share the leading
      layer axis, or whose length ``layers_per_gather`` does not divide.
  """
  k = layers_per_gather
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  buffer_axes = tuple(buffer_axes)
  n = plan.num_slots
  shape = tuple(sizes[a] for a in buffer_axes)
  probe = dataclasses.replace(
    plan,
    axis_names=buffer_axes,
    mesh_shape=shape,
    group_axis_name=group_axis,
    groups=(),
  )
  by_row: dict[int, list[int]] = {}
  for slot in range(n):
    by_row.setdefault(probe.group_row(slot), []).append(slot)
  rows = [by_row[r] for r in sorted(by_row)]
  row_of = {slot: r for r, slots in enumerate(rows) for slot in slots}
  unit_ids = {
    (u.leaf_index, u.batch_index): i for i, u in enumerate(plan.units)
  }
  work = np.zeros(n)
  planned = []  # per group: (specs, iterations, base units, base owners)
  for name, scanned, specs in groups:
    specs = list(specs)
    iters = 0
    if scanned:
      length = specs[0].shape[0]
      bad = [
        s.path for s in specs if 0 not in s.batch_axes or s.shape[0] != length
      ]
      if bad:
        raise ValueError(
          f'dmuon: scanned stack {name!r} needs every Muon target to have '
          f'the same leading layer axis (a batch axis of its dimension '
          f'numbers) of size {length}; these do not: {bad}.'
        )
      if length % k:
        fits = [d for d in range(1, length + 1) if length % d == 0]
        raise ValueError(
          f'dmuon: layers_per_gather={k} does not divide the {length} '
          f'layers of scanned stack {name!r}. Pass one of {fits}.'
        )
      iters = length // k
      specs = [dataclasses.replace(s, shape=(k,) + s.shape[1:]) for s in specs]
    in_group = {s.leaf_index for s in specs}
    base_ids = [
      i
      for i, u in enumerate(plan.units)
      if u.leaf_index in in_group and (not iters or u.batch_index[0] < k)
    ]
    base = [plan.units[i] for i in base_ids]
    held = np.zeros(n)
    base_owner = [0] * len(base)
    # Owner groups of this gather group: slices in one row, the iteration
    # on a member of that row (see OwnerGroup).
    local = {u: i for i, u in enumerate(base_ids)}
    ggroups = [
      (g, grp)
      for g, grp in enumerate(plan.groups)
      if grp.units and grp.units[0] in local
    ]
    if ggroups and iters:
      raise ValueError(
        f'dmuon: scanned stack {name!r} holds owner-group matrices; pass '
        'owner_groups=None (scanned stacks rotate whole matrices).'
      )
    iteration_owner = {}
    for g, grp in sorted(
      ggroups,
      key=lambda x: (-sum(plan.units[u].nbytes for u in x[1].units), x[0]),
    ):
      r = min(
        range(len(rows)),
        key=lambda r: (held[rows[r]].sum(), work[rows[r]].sum(), r),
      )
      members = rows[r]
      taken: list[int] = []
      for u in grp.units:
        free = [m for m in members if not grp.distinct or m not in taken]
        slot = min(free or members, key=lambda s: (held[s], work[s], s))
        taken.append(slot)
        held[slot] += plan.units[u].nbytes
        work[slot] += plan.units[u].cost
        base_owner[local[u]] = slot
      pool = taken if grp.distinct else list(members)
      slot = min(pool, key=lambda s: (work[s], s))
      work[slot] += grp.iteration_cost
      iteration_owner[g] = slot
    grouped_units = {u for _, grp in ggroups for u in grp.units}
    for i in sorted(
      range(len(base)), key=lambda i: (-base[i].nbytes, -base[i].cost, i)
    ):
      if base_ids[i] in grouped_units:
        continue
      slot = min(range(n), key=lambda s: (held[s], work[s], s))
      held[slot] += base[i].nbytes
      base_owner[i] = slot
      for t in range(max(iters, 1)):
        work[(slot + t) % n] += base[i].cost
    planned.append(
      (specs, iters, base, base_owner, base_ids, ggroups, iteration_owner, rows)
    )
  _balance_work(planned, n, row_of)
  owners = [0] * len(plan.units)
  group_plans, iterations = [], []
  full_iteration = {}
  for specs, iters, base, base_owner, base_ids, ggroups, it_owner, _ in planned:
    local = {u: i for i, u in enumerate(base_ids)}
    sub_groups = []
    for g, grp in ggroups:
      full_iteration[g] = _plan_slot(plan, buffer_axes, it_owner[g])
      sub_groups.append(
        dataclasses.replace(
          grp,
          units=tuple(local[u] for u in grp.units),
          iteration_owner=it_owner[g],
        )
      )
    remap = {g: j for j, (g, _) in enumerate(ggroups)}
    base = [
      dataclasses.replace(u, group=remap[u.group]) if u.group >= 0 else u
      for u in base
    ]
    for u, slot in zip(base, base_owner):
      for t in range(max(iters, 1)):
        index = u.batch_index
        if iters:
          index = (t * k + index[0],) + index[1:]
        owners[unit_ids[(u.leaf_index, index)]] = _plan_slot(
          plan, buffer_axes, (slot + t) % n
        )
    group_plans.append(
      dataclasses.replace(
        plan,
        axis_names=buffer_axes,
        mesh_shape=tuple(sizes[a] for a in buffer_axes),
        leaves=tuple(specs),
        units=tuple(base),
        owners=tuple(base_owner),
        groups=tuple(sub_groups),
        group_axis_name=group_axis,
      )
    )
    iterations.append(iters)
  groups = tuple(
    dataclasses.replace(grp, iteration_owner=full_iteration.get(g, 0))
    for g, grp in enumerate(plan.groups)
  )
  return (
    dataclasses.replace(plan, owners=tuple(owners), groups=groups),
    tuple(group_plans),
    tuple(iterations),
  )
