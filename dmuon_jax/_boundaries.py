"""Hook boundaries: the module granularity at which matrices are gathered."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from dmuon_jax import _routing

BoundaryPredicate = Callable[[str, Any], bool]


@dataclasses.dataclass(frozen=True)
class HookBoundaries:
  """Which hook boundary each Muon target belongs to.

  A boundary is the unit of materialization in dedicated mode: all owners'
  matrices of one boundary are gathered together, just before that module
  runs. Boundaries are independent of the owner plan: the plan balances work
  over all matrices, the boundary only decides when a gather happens.

  Attributes:
    names: boundary names (module paths such as ``'layers/3'``), in order of
      first appearance in the params tree.
    scanned: for each name, whether it is a scanned stack (leaves stacked
      over a leading layer axis: one gather per scan iteration).
    paths: the Muon targets' paths, in leaf order.
    of_target: for each of ``paths``, the index of its boundary in ``names``.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> stack = jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)  # 3 layers
    >>> params = {'layers_0': {'q': w}, 'scan': {'q': stack}}
    >>> MDN = dmuon_jax.MuonDimensionNumbers
    >>> dims = {'layers_0': {'q': MDN()}, 'scan': {'q': MDN(1, 2)}}
    >>> b = dmuon_jax.find_hook_boundaries(
    ...     params, weight_dimension_numbers=dims)
    >>> b.names, b.scanned  # a loop block, and a stack gathered per layer
    (('layers_0', 'scan'), (False, True))
    >>> b.paths, b.of_target
    (('layers_0/q', 'scan/q'), (0, 1))
  """

  names: tuple[str, ...]
  scanned: tuple[bool, ...]
  paths: tuple[str, ...]
  of_target: tuple[int, ...]

  def targets_of(self, name: str) -> tuple[str, ...]:
    """Paths of the Muon targets in boundary ``name``."""
    b = self.names.index(name)
    return tuple(p for p, i in zip(self.paths, self.of_target) if i == b)


def subtree(tree: Any, keys) -> Any:
  for key in keys:
    if isinstance(key, jax.tree_util.DictKey):
      tree = tree[key.key]
    elif isinstance(key, jax.tree_util.GetAttrKey):
      tree = getattr(tree, key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx]
    else:
      tree = tree[key.key]
  return tree


def _custom_boundary(params, keys, boundary_predicate) -> str | None:
  """The lowest ancestor of a leaf whose (path, subtree) satisfies it.

  The root counts too (its path is ``''``): the whole model as one boundary.
  """
  for end in range(len(keys) - 1, -1, -1):
    prefix = keys[:end]
    if boundary_predicate(
      _routing.normalize_path(prefix), subtree(params, prefix)
    ):
      return _routing.normalize_path(prefix)
  return None


def _default_boundary(path: str, stacked: bool) -> tuple[str | None, bool]:
  """A block prefix (``layers/3``, ``layers_3``), else a scanned stack."""
  segments = [s for s in path.split('/') if s]
  end = _routing.block_boundary_end(segments)
  if end is not None:
    return '/'.join(segments[:end]), False
  if stacked:
    start = 0
    while (
      start < len(segments) - 1 and segments[start] in _routing.COLLECTION_NAMES
    ):
      start += 1
    return '/'.join(segments[: start + 1]), True
  return None, False


def find_hook_boundaries(
  params: Any,
  *,
  predicate: Callable[[str, Any], bool] | None = None,
  weight_dimension_numbers: Any = None,
  boundary_predicate: BoundaryPredicate | None = None,
  strict: bool = True,
) -> HookBoundaries:
  """Assigns every Muon target to a hook boundary.

  Default detection, from the path: the outermost block segment —
  ``layers/3`` (flax nnx lists), ``layers_3`` (flax linen auto-names), and
  likewise ``blocks``, ``block``, ``layer``, ``h``, ``encoderblock``,
  ``decoderblock``, ``resblocks`` — or, for a stacked leaf ``(L, m, n)``
  outside any such block, the scanned stack it belongs to (its top-level
  module, e.g. the ``nn.scan``-ed ``'layers'``), gathered once per scan
  iteration.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    predicate: Muon-target predicate, as for :func:`dmuon_jax.dmuon`.
    weight_dimension_numbers: as for :func:`dmuon_jax.dmuon`.
    boundary_predicate: optional ``(module_path, subtree) -> bool``; a target
      belongs to its lowest ancestor that satisfies it (e.g. a ViT block:
      ``lambda path, sub: 'attn' in sub and 'mlp' in sub``). Replaces the
      default detection.
    strict: if True, raise when a target has no boundary; if False, such a
      target is its own boundary (gathered alone).

  Returns:
    A :class:`HookBoundaries`.

  Raises:
    ValueError: in strict mode, naming every target without a boundary.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> params = {'embed': w, 'layers_0': {'q': w, 'o': w},
    ...           'layers_1': {'q': w, 'o': w}, 'mlp': {'w': w}}
    >>> dmuon_jax.find_hook_boundaries(params)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: dmuon: 1 Muon target(s) have no hook boundary: ['mlp/w']. ...
    >>> b = dmuon_jax.find_hook_boundaries(params, strict=False)
    >>> b.names
    ('layers_0', 'layers_1', 'mlp/w')
    >>> b.paths  # the embedding goes to AdamW
    ('layers_0/o', 'layers_0/q', 'layers_1/o', 'layers_1/q', 'mlp/w')
    >>> b.of_target
    (0, 0, 1, 1, 2)

    A custom rule, e.g. for blocks named without an index:

    >>> vit = {'enc_a': {'attn': {'q': w}, 'mlp': {'up': w}},
    ...        'enc_b': {'attn': {'q': w}, 'mlp': {'up': w}}}
    >>> dmuon_jax.find_hook_boundaries(
    ...     vit, boundary_predicate=lambda path, sub: 'attn' in sub).names
    ('enc_a', 'enc_b')
  """
  specs = _routing.muon_target_specs(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
  )
  flat = jax.tree.flatten_with_path(params)[0]
  names: list[str] = []
  scanned: list[bool] = []
  paths, of_target, missing = [], [], []
  for spec, (keys, _) in zip(specs, flat, strict=True):
    if spec is None:
      continue
    if boundary_predicate is not None:
      name, is_scan = _custom_boundary(params, keys, boundary_predicate), False
    else:
      name, is_scan = _default_boundary(spec.path, bool(spec.batch_axes))
    if name is None:
      missing.append(spec.path)
      if strict:
        continue
      name = spec.path
    if name not in names:
      names.append(name)
      scanned.append(is_scan)
    paths.append(spec.path)
    of_target.append(names.index(name))
  if strict and missing:
    raise ValueError(
      f'dmuon: {len(missing)} Muon target(s) have no hook boundary: '
      f'{missing}. Name blocks like layers/N or layers_N, pass '
      'boundary_predicate=(path, subtree) -> bool to mark your block '
      'modules, route these params to AdamW, or pass strict=False to '
      'gather each of them on its own.'
    )
  return HookBoundaries(
    names=tuple(names),
    scanned=tuple(scanned),
    paths=tuple(paths),
    of_target=tuple(of_target),
  )
