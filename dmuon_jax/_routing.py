"""Routing: which leaves are Muon matrices, how they read as matrices."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from optax.contrib import MuonDimensionNumbers

Predicate = Callable[[str, Any], bool]
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


def check_array_leaves(tree_or_flat: Any) -> None:
  """Raises unless every leaf is an array, ``jax.ShapeDtypeStruct``,
  tracer or Python/NumPy number: what optax's transformations take as a
  leaf.

  Args:
    tree_or_flat: a pytree, or its ``jax.tree_util.tree_flatten_with_path``
      list of ``(key path, leaf)``.

  Raises:
    TypeError: naming the first leaf that is not an array (an Equinox
      model's activation function, a string) and the filter to apply.
  """
  flat = tree_or_flat
  if not isinstance(flat, list):
    flat = jax.tree_util.tree_flatten_with_path(flat)[0]
  for key_path, x in flat:
    if (hasattr(x, 'shape') and hasattr(x, 'dtype')) or isinstance(
      x, (int, float, complex, np.generic)
    ):
      continue
    name = getattr(x, '__qualname__', None) or getattr(x, '__name__', None)
    what = f'a {type(x).__name__}'
    if callable(x):
      what = f'a function {name!r}' if name else what
    else:
      shown = repr(x)
      what += f' ({shown if len(shown) <= 40 else shown[:37] + "..."})'
    raise TypeError(
      f'dmuon: param {normalize_path(key_path) or "<root>"!r} is {what}, not'
      ' an array. The optimizer takes a tree of arrays (or'
      " jax.ShapeDtypeStruct): with Equinox, pass the model's arrays,"
      ' opt.init(eqx.filter(model, eqx.is_array)) and opt.update(grads,'
      ' state, eqx.filter(model, eqx.is_array)); with other pytree'
      ' libraries, leave such leaves out of the tree (None, or a static'
      ' field).'
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
_BLOCK_NAMES = 'layers layer blocks block h encoderblock decoderblock resblocks'
_BLOCK_SEGMENT_RE = re.compile(rf'^({_BLOCK_NAMES.replace(" ", "|")})_\d+$')


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
  keys = tuple(path)
  last = keys[-1] if keys else None
  if isinstance(last, jax.tree_util.GetAttrKey) and last.name == 'value':
    keys = keys[:-1]
  return jax.tree_util.keystr(keys, simple=True, separator='/')


def segments(path: str) -> list[str]:
  return [s for s in path.split('/') if s]


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
  in_block = layer_base(path)[0]
  for seg in segments(path):
    low = seg.lower()
    if any(s in low for s in _EXCLUDED_SUBSTRINGS):
      return False
    if low in _EXCLUDED_NAMES or _LAYER_NORM_RE.match(low):
      return False
    if not in_block and low in _HEAD_NAMES:
      return False
  return True


def _one_level(x: Any) -> tuple[Any, list[tuple[Any, Any]]]:
  """One level of a pytree: its node structure, and ``(key, child)``s."""
  with_keys, treedef = jax.tree_util.tree_flatten_with_path(
    x, is_leaf=lambda y: y is not x
  )
  return treedef, [(p[0] if p else None, c) for p, c in with_keys]


def _align_dims(dims: Any, tree: Any, path: tuple, arg: str) -> list[Any]:
  """One dimension-numbers entry per leaf of ``tree`` (``arg``: the
  argument's name as the user spelled it, for messages)."""
  num_leaves = len(jax.tree.leaves(tree))
  if dims is None or isinstance(dims, MuonDimensionNumbers):
    return [dims] * num_leaves
  if num_leaves == 0:
    # None, MaskedNode() or an empty container (e.g. a subtree masked out by
    # optax.partition): no leaf to route, whatever the dims tree says here.
    return []
  at = normalize_path(path) or '<root>'
  (dims_def, dims_children), (tree_def, children) = map(
    _one_level, (dims, tree)
  )
  if dims_def.num_nodes == 1 and dims_def.num_leaves == 1:
    # A leaf that is neither None nor MuonDimensionNumbers.
    raise ValueError(
      f'dmuon: {arg} has {type(dims).__name__} {dims!r} at {at!r}; expected'
      f' optax.contrib.MuonDimensionNumbers or None. {_HINT_DIMS_TREE}'
    )
  if dims_def != tree_def:
    raise ValueError(
      f'dmuon: {arg} does not match the structure of params at {at!r}: got'
      f' {dims_def}, params have {tree_def}. {_HINT_DIMS_TREE}'
    )
  return [
    entry
    for (key, t), (_, d) in zip(children, dims_children)
    for entry in _align_dims(d, t, path + (key,), arg)
  ]


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
      ``tree`` below it), or a callable ``tree -> such a value``. A
      callable pytree node of the type of ``tree``'s root (an ``eqx.Module``
      made from the params) is taken as a tree, not called.
    arg: the argument's name in the caller's API, for messages
      (``'muon_weight_dimension_numbers'`` for :func:`dmuon_jax.dmuon`).

  Returns:
    A list with one entry per leaf of ``jax.tree.leaves(tree)``.

  Raises:
    ValueError: if the dimension-numbers tree does not match ``tree``.
  """
  dims = weight_dimension_numbers
  if callable(dims):  # (MuonDimensionNumbers and None are not)
    # A callable pytree node of the type of tree's root is a tree: mapping
    # over dmuon_jax.muon_labels of an Equinox model's arrays gives an
    # eqx.Module with the model's __call__ (calling it would run the model
    # on the params); a mismatch below the root is then reported as one.
    node, root = (_one_level(x)[0].node_data() for x in (dims, tree))
    if node is None or root is None or node[0] is not root[0]:
      dims = dims(tree)
  return _align_dims(dims, tree, (), arg)


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
  # Owner groups (see _plan.sliced_spec): the leaf's own shape when
  # ``shape`` is a view that splits each matrix's long side into slices, and
  # the view's slice axis, the split side of each slice (-1 columns, -2 rows)
  # and the whole matrix's (fan_in, fan_out).
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


# Names of a projection's leaf or module (lower-cased), for the hint of
# _no_dims_message: q/k/v kernels (d_model, heads, head_dim) and output
# kernels (heads, head_dim, d_model), as Flax's attention and Llama/Gemma
# ports name them.
_INPUT_PROJECTION_NAMES = frozenset(
  {'wq', 'wk', 'wv', 'wqkv', 'q', 'k', 'v', 'qkv', 'query', 'key', 'value'}
  | {'q_proj', 'k_proj', 'v_proj', 'qkv_proj', 'in_proj', 'q_einsum'}
  | {'kv_einsum', 'qkv_einsum'}
)
_OUTPUT_PROJECTION_NAMES = frozenset(
  {'wo', 'o', 'o_proj', 'out', 'out_proj', 'output_proj', 'proj_out'}
  | {'attn_out', 'attn_vec_einsum'}
)
# Leaf names that say nothing about the role ('layers/0/attn/out/kernel').
_GENERIC_LEAF_NAMES = frozenset({'kernel', 'weight', 'w', 'value'})


def _no_dims_message(shown: str, shape: tuple[int, ...], arg: str) -> str:
  """The error for a >2-D Muon target without dimension numbers: the three
  readings of its axes as matrices, and which one its name suggests."""
  ndim = len(shape)
  stack = MuonDimensionNumbers(reduction_axis=ndim - 2, output_axis=ndim - 1)
  flat = MuonDimensionNumbers(
    reduction_axis=0, output_axis=tuple(range(1, ndim))
  )
  out = MuonDimensionNumbers(
    reduction_axis=tuple(range(ndim - 1)), output_axis=ndim - 1
  )
  count = math.prod(shape[:-2])
  # The last path segment that is not a generic leaf name.
  named = [g for g in segments(shown) if g.lower() not in _GENERIC_LEAF_NAMES]
  name = ([''] + named)[-1]
  hint = ''
  if name.lower() in _OUTPUT_PROJECTION_NAMES:
    hint = (
      f' The name {name!r} suggests an attention output projection: {out}'
      ' (if it is one).'
    )
  elif name.lower() in _INPUT_PROJECTION_NAMES:
    hint = (
      f' The name {name!r} suggests an input projection (query, key or'
      f' value): {flat} (if it is one).'
    )
  return (
    f'dmuon: param {shown!r} has shape {shape} (ndim={ndim}) and was'
    ' selected as a Muon target without dimension numbers, which say how'
    f' to read it as matrices. Either as a stack of {count} matrices'
    f' {shape[-2]}x{shape[-1]} (scanned layers, experts): {stack}; or as'
    f' one {shape[0]}x{math.prod(shape[1:])} matrix reducing over axis 0'
    ' (an input projection, e.g. an attention query/key/value kernel'
    f' (d_model, heads, head_dim)): {flat}; or as one'
    f' {math.prod(shape[:-1])}x{shape[-1]} matrix reducing over all axes'
    ' but the last (an output projection, e.g. an attention output kernel'
    f' (heads, head_dim, d_model)): {out}.{hint} Give the one you mean for'
    f' this leaf in {arg} (a tree like the params, None for AdamW leaves),'
    ' or route the leaf to AdamW.'
  )


def _make_leaf_spec(
  index: int, path: str, leaf: Any, dims, dims_arg
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
  dtype = np.dtype(leaf.dtype)  # (an array: a scalar is no matrix)
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
  normalized = []
  for what in ('reduction_axis', 'output_axis'):
    value = getattr(dims, what)
    try:
      axes = tuple((value,) if isinstance(value, (int, np.integer)) else value)
    except TypeError:  # not iterable
      axes = (None,)
    if not all(
      isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes
    ):
      raise ValueError(
        f'dmuon: param {shown!r} has {what}={value!r}; expected an int or a'
        ' sequence of ints. Fix its MuonDimensionNumbers.'
      )
    if not axes:
      raise ValueError(
        f'dmuon: param {shown!r} with shape {shape} has an empty {what}; a'
        ' matrix needs at least one reduction and one output axis. Fix its'
        f' MuonDimensionNumbers. {_HINT_ADAMW}'
      )
    bad = [a for a in axes if not -ndim <= a < ndim]
    if bad:
      raise ValueError(
        f'dmuon: param {shown!r} with shape {shape} (ndim={ndim}) has'
        f' {what}={value!r}; axes {bad} are out of range [-{ndim}, {ndim}).'
        ' Fix its MuonDimensionNumbers.'
      )
    normalized.append(tuple(int(a) % ndim for a in axes))
    if len(set(normalized[-1])) != len(axes):
      raise ValueError(
        f'dmuon: param {shown!r} with shape {shape} has {what}={value!r},'
        ' which repeats an axis. List each axis once in its'
        ' MuonDimensionNumbers.'
      )
  reduction, output = normalized
  overlap = sorted(set(reduction) & set(output))
  if overlap:
    raise ValueError(
      f'dmuon: param {shown!r} with shape {shape} has overlapping dimension'
      f' numbers {dims}: axes {overlap} are both reduction and output axes'
      ' (after normalizing negative axes). Make them disjoint.'
    )
  batch = tuple(sorted(set(range(ndim)) - set(reduction) - set(output)))
  return LeafSpec(
    leaf_index=index,
    path=path,
    shape=shape,
    dtype=dtype.name,
    batch_axes=batch,
    reduction_axes=reduction,
    output_axes=output,
  )


def check_predicate(predicate: Any) -> None:
  """Raises unless ``predicate`` is None, ``'optax'`` or a callable."""
  if predicate is None or callable(predicate) or predicate == 'optax':
    return
  raise TypeError(
    f'dmuon: predicate={predicate!r} is not a routing rule. Pass None (the'
    " default rule, see dmuon_jax.default_muon_predicate), 'optax' (every"
    ' 2-D leaf, or the leaves with dimension numbers, as'
    ' optax.contrib.muon), or a callable (path, leaf) -> bool.'
  )


def plural(n: int, one: str, many: str) -> str:
  return f'{n} {one if n == 1 else many}'


def _human_count(n: int) -> str:
  for unit, size in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= size:
      return f'{n / size:.3g}{unit}'
  return str(n)


class Routing(NamedTuple):
  """Where each leaf goes: see :func:`route`."""

  specs: list[LeafSpec | None]
  summary: str
  # Whether default_muon_predicate chose (no predicate, no dimension numbers).
  default_rule: bool


def route(
  params: Any,
  *,
  predicate: Predicate | str | None = None,
  weight_dimension_numbers: WeightDimNums = None,
  dims_arg: str = 'weight_dimension_numbers',
) -> Routing:
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
    A :class:`Routing`: ``specs``, one entry per leaf of
    ``jax.tree.leaves(params)``; ``summary``, one line counting the leaves
    and elements that go to Muon and to AdamW, naming the leaves that
    ``optax.contrib.muon`` with the same dimension numbers routes otherwise.

  Raises:
    ValueError: if a target is not a floating-point matrix of rank >= 2, has
      rank > 2 and no dimension numbers, or its dimension numbers are
      invalid for its shape.
    TypeError: if a leaf is not an array (e.g. an unfiltered Equinox
      model's activation function).
  """
  check_predicate(predicate)
  with_path, _ = jax.tree_util.tree_flatten_with_path(params)
  check_array_leaves(with_path)
  have_dims = weight_dimension_numbers is not None
  all_dims = resolve_dimension_numbers(
    params, weight_dimension_numbers, dims_arg
  )
  # Besides the dimension numbers: the predicate, else (without dimension
  # numbers) the default rule.
  rule = (
    default_muon_predicate if predicate is None and not have_dims else predicate
  )
  specs: list[LeafSpec | None] = []
  sizes = {True: [], False: []}  # elements of each leaf, by target
  only_optax, only_here, stacks = [], [], []
  for i, ((key_path, leaf), dims) in enumerate(zip(with_path, all_dims)):
    path = normalize_path(key_path)
    # optax.contrib.muon's rule (optax 0.2.8, contrib/_muon.py).
    optax_target = dims is not None if have_dims else np.ndim(leaf) == 2
    target = optax_target
    if not isinstance(predicate, str):
      target = (rule is None or bool(rule(path, leaf))) and (
        not have_dims or dims is not None
      )
    specs.append(
      _make_leaf_spec(i, path, leaf, dims, dims_arg) if target else None
    )
    sizes[target].append(math.prod(np.shape(leaf)))
    shown = f'{path or "<root>"!r} {tuple(np.shape(leaf))}'
    if optax_target != target:
      (only_here if target else only_optax).append(shown)
    elif not target and not have_dims and np.ndim(leaf) > 2:
      stacks.append(shown)
  muon, adam = sum(sizes[True]), sum(sizes[False])
  parts = [
    f'dmuon routing: Muon {plural(len(sizes[True]), "leaf", "leaves")}'
    f' ({_human_count(muon)} elements,'
    f' {100 * muon / max(1, muon + adam):.1f}%), AdamW'
    f' {plural(len(sizes[False]), "leaf", "leaves")}'
    f' ({_human_count(adam)} elements)'
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
      f'{plural(len(stacks), "AdamW leaf", "AdamW leaves")} of rank > 2'
      ' (scanned layers, attention kernels) would go to Muon only with'
      f' dimension numbers: {listed(stacks)}'
    )
  return Routing(
    specs,
    '; '.join(parts),
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
  block, base = layer_base(path)
  return f'{base}[{batch_index[0]}]' if batch_index and not block else base


@functools.lru_cache(maxsize=4096)
def layer_base(path: str) -> tuple[bool, str]:
  """``(whether the path has a block boundary, the key's path part)``:
  the outermost block (``layers/3``), else the first segment after a
  leading ``params`` collection (also a scanned stack's hook boundary)."""
  segs = segments(path)
  for i, low in enumerate(seg.lower() for seg in segs):
    if _BLOCK_SEGMENT_RE.match(low):
      return True, '/'.join(segs[: i + 1])
    # ('layers/3': a block name, then an integer segment)
    if low in _BLOCK_NAMES.split() and ''.join(segs[i + 1 : i + 2]).isdigit():
      return True, '/'.join(segs[: i + 2])
  start = 0
  # (A leading linen 'params' collection names no module.)
  while start < len(segs) - 1 and segs[start] == 'params':
    start += 1
  return False, '/'.join(segs[: start + 1])
