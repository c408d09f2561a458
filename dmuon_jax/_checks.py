"""The bottom layer's small parts: the cost model (Newton–Schulz FLOPs,
bytes against FLOPs, readable units), checks of hyperparameters, options
and trees when a factory or ``update`` is called, what dmuon tells the user
(the routing log line, :class:`DMuonWarning`), and hook boundaries."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dmuon_jax import _newton_schulz, _routing
from dmuon_jax._newton_schulz import is_int
from dmuon_jax._routing import normalize_path


def _scaled(n: float, base: int, units: Sequence[str], digits: int = 2) -> str:
  """``n`` in the largest of ``units`` (each ``base`` times the one
  before) it reaches: ``'512 B'``, ``'1.50 KiB'``."""
  i = 0
  while not abs(n) < base and i < len(units) - 1:
    n, i = n / base, i + 1
  return f'{n:.{digits}f} {units[i]}' if i else f'{n:.0f} {units[0]}'


def human_bytes(n: float, digits: int = 2) -> str:
  return _scaled(n, 1024, ('B', 'KiB', 'MiB', 'GiB', 'TiB'), digits)


def human_flops(n: float) -> str:
  return _scaled(n, 1000, ('FLOP', 'kFLOP', 'MFLOP', 'GFLOP', 'TFLOP', 'PFLOP'))


def ring_bytes(kind: str, group_size: int, full_bytes: float) -> float:
  """Per-device bytes of one collective on the ring model, the one model
  behind every prediction and measurement of this package: over
  ``group_size`` devices, with ``full_bytes`` the size of the whole array
  (an all-gather's result, a reduce-scatter's or all-to-all's operand),
  ``(g - 1) / g`` of it, twice that for an all-reduce; a point-to-point
  send moves its array. 0 over one device."""
  if group_size <= 1:
    return 0.0
  frac = (group_size - 1) / group_size
  if kind == 'all-reduce':
    return 2 * frac * full_bytes
  if kind in ('collective-permute', 'collective-broadcast'):
    return float(full_bytes)
  return frac * full_bytes


NS_ALGORITHMS = ('auto', 'standard', 'gram')


def check_ns_algorithm(ns_algorithm: Any) -> None:
  """Raises unless ``ns_algorithm`` is one of :data:`NS_ALGORITHMS`."""
  if ns_algorithm not in NS_ALGORITHMS:
    raise ValueError(
      f'dmuon: ns_algorithm={ns_algorithm!r} is not one of {NS_ALGORITHMS}.'
    )


def ns_cost(m: int, n: int, ns_steps: int, ns_algorithm: str) -> float:
  """Predicted matmul FLOPs of the Newton–Schulz form that will run.

  ``'standard'`` is the direct form; ``'gram'`` the Gram form with its
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
  if ns_algorithm == 'auto':  # (checked by its callers)
    ns_algorithm = _newton_schulz.cheaper_ns_algorithm(m, n, ns_steps)
  return float(_newton_schulz.matmul_flops(m, n, ns_steps, ns_algorithm))


# The planner's exchange rate between Gram bytes and NS FLOPs: a byte a
# device sends in a group's collectives counts as this many FLOPs (a GPU
# doing ~1e14 FLOP/s of float32 matmuls over ~1e12 bytes/s of NVLink).
FLOPS_PER_BYTE = 100.0


def gram_parts(
  s: int, l: int, ns_steps: int
) -> tuple[float, tuple[float, ...]]:
  """``(long-side work, g x g iteration per restart window)`` FLOPs of Gram
  Newton–Schulz on an ``s x l`` matrix (``s <= l``) with the default
  restarts.

  The long-side work (forming each window's Gram ``X X^T`` and applying
  its factor ``Q X``: ``4 p s^2 l`` for ``p`` windows) splits over slices
  of the long side; the iteration on the ``s x s`` Gram (``(8 k_j - 6)
  s^3`` in a window of ``k_j`` iterations, ``(8 k - 6 p) s^3`` in all)
  does not, but each window's starts from a Gram formed anew from the
  slices, so windows may run on different devices. Together they are
  :func:`dmuon_jax.matmul_flops` of the Gram form.
  """
  windows = _newton_schulz.gram_windows(ns_steps)
  work = 4.0 * len(windows) * s * s * l
  return work, tuple(float((8 * (b - a) - 6) * s**3) for a, b in windows)


_DECAY_WHY = (
  "at 1 the moment never forgets, as optax's bias correction 1 - beta**t"
  ' divides by zero; above 1 it grows without bound'
)
_LR_WHY = 'updates are subtracted: a negative rate would climb the loss'
# Per hyperparameter: its range ('' any real; '>' or '>=' 0 and finite; '<1'
# a moment decay rate in [0, 1)), an example value, and why that range.
_RANGES = {
  'learning_rate': ('>=', '0.02', _LR_WHY),
  'adam_learning_rate': ('>=', '0.02', _LR_WHY),
  'beta': ('<1', '0.95', _DECAY_WHY),
  'adam_b1': ('<1', '0.9', _DECAY_WHY),
  'adam_b2': ('<1', '0.999', _DECAY_WHY),
  'eps': (
    '>',
    '1e-8',
    'it keeps the normalization of a zero gradient, and AdamW of a zero'
    ' second moment, from dividing by zero',
  ),
  'consistent_rms': ('>=', '0.2', ''),
  'adam_eps_root': ('>=', '0.0', ''),
  'weight_decay': ('', '0.1', ''),
  'adam_weight_decay': ('', '0.1', ''),
}


def check_numbers(optional: Sequence[str] = (), **values: Any) -> None:
  """The one check of the numeric hyperparameters (by name, see
  ``_RANGES``): a real scalar, in its range where concrete. Run-time values
  (tracers), learning-rate schedules and None for a name in ``optional``
  pass.

  Raises:
    TypeError: for a str, None, a bool or anything but a real scalar.
    ValueError: for a concrete value out of its range, saying why.
  """
  for name, value in values.items():
    bound, example, why = _RANGES[name]
    lr = name.endswith('learning_rate')
    if (value is None and name in optional) or (
      lr and callable(value) and not isinstance(value, jax.Array)
    ):
      continue
    hint = f'Pass a number, e.g. {example}.'
    if lr:
      hint = (
        'Pass a number (e.g. 0.02) or a schedule, a callable step -> value'
        ' such as optax.cosine_decay_schedule(0.02, 1000).'
      )
    if isinstance(value, (str, bytes, bool)) or value is None:
      kind = 'None' if value is None else f'a {type(value).__name__}'
      raise TypeError(
        f'dmuon: {name}={value!r} is {kind}, not a number. {hint}'
      )
    if isinstance(value, jax.core.Tracer) or (
      isinstance(value, jax.Array) and not value.is_fully_addressable
    ):
      continue  # Only known at run time.
    try:
      arr = np.asarray(value)
    except (TypeError, ValueError):
      arr = np.asarray(None)  # not a number either
    if arr.shape != () or not (
      np.issubdtype(arr.dtype, np.floating)
      or np.issubdtype(arr.dtype, np.integer)
    ):
      raise TypeError(f'dmuon: {name}={value!r} is not a real scalar. {hint}')
    x = float(arr)
    if bound and not (
      math.isfinite(x) and {'>': x > 0, '>=': x >= 0, '<1': 0 <= x < 1}[bound]
    ):
      must, fix = f'a finite number {bound} 0', f'e.g. {example}'
      if bound == '<1':
        must, fix = 'in [0, 1)', f'a decay rate such as {example}'
      if lr:
        fix = 'its magnitude, e.g. 0.02, or a schedule'
      raise ValueError(
        f'dmuon: {name}={value!r} must be {must}'
        f'{f" ({why})" if why else ""}. Pass {fix}.'
      )


def check_option(
  owner_groups: Any,
  *,
  preconditioning: str = 'frobenius',
  ns_algorithm: str = 'auto',
  tp_axis: str | None = None,
  scanned: Sequence[str] = (),
) -> Any:
  """The one check of ``owner_groups`` against the options it meets.

  Every entry point (``dmuon``'s factory, its ``init`` once the mesh is
  known, ``plan_ownership``, ``dedicate``) calls this with what it knows.

  Args:
    owner_groups: ``'auto'``, None or an int ``k >= 2``.
    preconditioning: the Newton–Schulz preconditioning.
    ns_algorithm: ``'auto'``, ``'gram'`` or ``'standard'``.
    tp_axis: the tensor-parallel axis, when one of size > 1 is in use.
    scanned: paths of the scanned stacks (dedicated mode).

  Returns:
    What the planner takes: ``owner_groups``, or None where ``'auto'``
    cannot form groups (groups run Gram Newton–Schulz with the Frobenius
    preconditioning; TP matrices are split over their axis already).

  Raises:
    ValueError: for any other value, and for a forced ``k`` with an option
      that groups cannot run with (naming both and what to pass).
  """
  forced = owner_groups not in (None, 'auto')
  if forced and (not is_int(owner_groups) or owner_groups < 2):
    raise ValueError(
      f"dmuon: owner_groups={owner_groups!r} is not 'auto', None or an int "
      '>= 2 (the number of devices that share each matrix).'
    )
  given, wanted = [], []
  if preconditioning != 'frobenius':
    given.append(f'preconditioning={preconditioning!r}')
    wanted.append("preconditioning='frobenius'")
  if ns_algorithm == 'standard':
    given.append(f'ns_algorithm={ns_algorithm!r}')
    wanted.append("ns_algorithm='auto' or 'gram'")
  if forced and given:
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} runs Gram Newton-Schulz with '
      "preconditioning='frobenius' on the groups' matrices, but got "
      f'{" and ".join(given)}. Pass {" and ".join(wanted)}, or '
      'owner_groups=None.'
    )
  if forced and tp_axis is not None:
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} with the tensor-parallel axis '
      f'{tp_axis!r}: TP matrices are split over that axis already. Pass '
      'owner_groups=None (or the default).'
    )
  if forced and scanned:
    raise ValueError(
      f'dmuon: owner_groups={owner_groups} with scanned stacks (param '
      f'{scanned[0]!r}'
      + (f' and {len(scanned) - 1} more' if len(scanned) > 1 else '')
      + '): their owners rotate per scan iteration, which groups do not '
      "follow. Pass owner_groups='auto' (scanned stacks stay whole) or None."
    )
  return None if given or tp_axis is not None else owner_groups


def check_preconditioning(
  preconditioning: str,
  *,
  tp_axis: str | None = None,
  groups: int = 0,
  otherwise: str = '',
) -> None:
  """Raises unless ``preconditioning`` is ``'frobenius'`` where matrices
  are split over devices: over a tensor-parallel axis ``tp_axis``, or
  ``groups`` matrices over owner groups. Their Gram Newton–Schulz
  normalizes by the Frobenius norm. ``otherwise``: what else the caller
  may pass instead (e.g. ``'owner_groups=None'``)."""
  if preconditioning == 'frobenius' or (tp_axis is None and not groups):
    return
  split = []
  if tp_axis is not None:
    split.append(f'the tensor-parallel axis {tp_axis!r} splits matrices')
  if groups:
    split.append(
      f'{groups} matrices are split over owners (owner groups; '
      "owner_groups='auto' splits a dedication's matrices where whole ones "
      'would pad a gather by more than 5%)'
    )
  raise ValueError(
    f'dmuon: preconditioning={preconditioning!r} is not available here: '
    f'{" and ".join(split)}, and their Gram Newton-Schulz normalizes by '
    "the Frobenius norm. Pass preconditioning='frobenius'"
    + (f', or {otherwise}.' if otherwise else '.')
  )


def check_same_tree(
  tree: Any,
  reference: Any,
  what: str,
  is_leaf: Callable[[Any], bool] | None = None,
  made_by: str = 'init()',
) -> None:
  """Raises if ``tree`` and ``reference`` differ in their leaf paths, or in
  the shapes of the reference leaves that have one (see
  :func:`check_same_leaves`).

  Args:
    tree: the tree given now (e.g. to ``update``).
    reference: a tree with the structure recorded earlier (e.g. a state
      made by ``init``); a leaf without a ``shape`` (``optax.MaskedNode()``,
      a Python number) matches any.
    what: the operation, for the message (e.g. ``'update()'``).
    is_leaf: leaf predicate for both trees (e.g. to keep
      ``optax.MaskedNode`` entries: a wrapper's ``optax.masked`` gives them
      to ``update`` where ``init`` had them too).
    made_by: the call that recorded ``reference``.
  """
  flat = lambda t: jax.tree_util.tree_flatten_with_path(t, is_leaf=is_leaf)[0]
  # (A leaf that is an empty node, as optax.MaskedNode(), has no shape.)
  got = [
    (normalize_path(k), None if isinstance(x, tuple) else tuple(np.shape(x)))
    for k, x in flat(tree)
  ]
  want = [
    (normalize_path(k), tuple(np.shape(r)) if hasattr(r, 'shape') else None)
    for k, r in flat(reference)
  ]
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


class DMuonWarning(UserWarning):
  """A warning that dmuon does less than it could.

  Raised (with ``warnings.warn``) when the optimizer communicates more
  than needed (params sharded along a stack axis gathered whole, shardings
  ``init`` could not see treated as replicated) or routes no leaf to Muon.
  The message says why and what to pass instead. It is a ``UserWarning``;
  ``warnings.simplefilter('error', dmuon_jax.DMuonWarning)`` makes it an
  error, e.g. in tests.

  Attributes:
    args: a 1-tuple holding the message.

  Examples:
    >>> import warnings, jax.numpy as jnp, dmuon_jax
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   _ = dmuon_jax.dmuon(0.02).init({'bias': jnp.zeros(8)})  # no matrix
    >>> [w.category.__name__ for w in caught]
    ['DMuonWarning']
    >>> print(caught[0].message.args[0][:47])
    dmuon: no leaf goes to Muon, so every leaf is u
  """


def report_routing(routing: _routing.Routing) -> None:
  """Logs the routing summary at INFO; warns if no leaf goes to Muon."""
  logging.getLogger('dmuon_jax').info('%s', routing.summary)
  if all(s is None for s in routing.specs):
    rule = (
      'The default rule (dmuon_jax.default_muon_predicate) takes 2-D'
      ' matrices with both dims > 1 that are not embeddings, heads, norms'
      ' or biases. '
    ) * routing.default_rule
    warnings.warn(
      'dmuon: no leaf goes to Muon, so every leaf is updated by AdamW (at'
      ' adam_learning_rate, which defaults to learning_rate).'
      f" {rule}{routing.summary}. Pass predicate='optax' (every 2-D leaf,"
      ' as optax.contrib.muon), your own predicate, or'
      ' muon_weight_dimension_numbers (which stacked and attention leaves'
      ' need); if AdamW alone is meant, use optax.adamw.',
      DMuonWarning,
      stacklevel=4,
    )


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
    how: for each name, how it was chosen: ``'name pattern'`` (``layers/3``,
      ``layers_3``, ``blocks``, ``h`` ...), ``'repeated siblings'``
      (submodules of one structure under one name with an index:
      ``block0``, ``encoderdecoderblock_1``, ``stages/2``, or entries of a
      container that ``dmuon_jax.flax`` saw in the model: ``nnx.Dict``,
      ``dict``, ``nnx.List``), ``'scanned stack'``, ``'parent module'``
      (the module holding the targets, in a model without blocks, or with
      ``strict=False``), ``'target itself'`` (``strict=False``, a target
      whose module holds blocks too) or ``'boundary_predicate'``.

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
  how: tuple[str, ...] = ()

  def chosen(self) -> str:
    """The boundaries by how they were chosen, one phrase per way
    (``'layers/0, layers/1 (name pattern)'``); ``'<root>'`` for the root."""
    ways: dict[str, list[str]] = {}
    for name, how in zip(self.names, self.how or ('?',) * len(self.names)):
      ways.setdefault(how, []).append(name or '<root>')
    shown = lambda n: ', '.join(n if len(n) <= 6 else [*n[:3], '...', *n[-2:]])
    return '; '.join(f'{shown(n)} ({how})' for how, n in ways.items())

  def targets_of(self, name: str) -> tuple[str, ...]:
    """Paths of the Muon targets in boundary ``name``."""
    b = self.names.index(name)
    return tuple(p for p, i in zip(self.paths, self.of_target) if i == b)


def subtree(tree: Any, keys) -> Any:
  for key in keys:
    if isinstance(key, jax.tree_util.GetAttrKey):
      tree = getattr(tree, key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx]
    else:  # DictKey, FlattenedIndexKey
      tree = tree[key.key]
  return tree


@dataclasses.dataclass(frozen=True)
class ModelBlocks:
  """The default hook-boundary detection, told what a Flax model says of
  its params' modules (``dmuon_jax.flax.dedicate`` passes it as the
  ``boundary_predicate``).

  Attributes:
    containers: module paths of containers of submodules (``nnx.List``,
      ``nnx.Dict``, ``list``, ``dict``): their entries of one structure are
      repeated siblings whatever their names.
  """

  containers: frozenset[str] = frozenset()


def find_hook_boundaries(
  params: Any,
  *,
  predicate: Callable[[str, Any], bool] | None = None,
  weight_dimension_numbers: Any = None,
  boundary_predicate: BoundaryPredicate | None = None,
  strict: bool = True,
) -> HookBoundaries:
  """Assigns every Muon target to a hook boundary.

  Default detection, from the paths, the first that applies to a target:

  1. name pattern: the outermost block segment — ``layers/3`` (flax nnx
     lists), ``layers_3`` (flax linen auto-names), and likewise ``blocks``,
     ``block``, ``layer``, ``h``, ``encoderblock``, ``decoderblock``,
     ``resblocks``;
  2. scanned stack: for a stacked leaf ``(L, m, n)`` outside such a block,
     the stack it belongs to (its top-level module, e.g. the ``nn.scan``-ed
     ``'layers'``), gathered once per scan iteration;
  3. repeated siblings: the outermost module that is one of two or more
     siblings of one structure (the same params, shapes and dtypes) whose
     names carry an index on one stem (``block0``, ``block1``;
     ``encoderdecoderblock_0``, ``encoderdecoderblock_1``; ``stages/0``,
     ``stages/1``), all siblings of that stem alike;
  4. parent module, in a model where no target has a boundary by 1-3 (no
     blocks: an MLP's ``linear1``, ``linear2``; params on the root module):
     the module holding the target, or an enclosing one holding others
     (the root, for Flax's FSDP toy with ``w1``, ``w2`` on it and a
     ``nn.Linear`` beside them).

  A model with blocks and Muon targets outside them raises (``strict``),
  or (``strict=False``) gathers each such target with its parent module
  (the target alone where that module holds blocks too: the root).

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    predicate: Muon-target predicate, as for :func:`dmuon_jax.dmuon`.
    weight_dimension_numbers: as for :func:`dmuon_jax.dmuon`.
    boundary_predicate: optional ``(module_path, subtree) -> bool``; a target
      belongs to its lowest ancestor that satisfies it (e.g. a ViT block:
      ``lambda path, sub: 'attn' in sub and 'mlp' in sub``). Replaces the
      default detection.
    strict: if True, raise when a target has no boundary; if False, such a
      target is gathered with its parent module (see above).

  Returns:
    A :class:`HookBoundaries` (``how``: each boundary's way of choice).

  Raises:
    ValueError: in strict mode, naming every target without a boundary.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> params = {'embed': w, 'layers_0': {'q': w, 'o': w},
    ...           'layers_1': {'q': w, 'o': w}, 'mlp': {'w': w}}
    >>> dmuon_jax.find_hook_boundaries(params)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: dmuon: 1 Muon target(s) have no hook boundary: ['mlp/w'], ...
    >>> b = dmuon_jax.find_hook_boundaries(params, strict=False)
    >>> b.names
    ('layers_0', 'layers_1', 'mlp')
    >>> b.paths  # the embedding goes to AdamW
    ('layers_0/o', 'layers_0/q', 'layers_1/o', 'layers_1/q', 'mlp/w')
    >>> b.of_target
    (0, 0, 1, 1, 2)
    >>> b.chosen()
    'layers_0, layers_1 (name pattern); mlp (parent module)'

    Blocks under any name with an index, and a model without blocks:

    >>> lm = {'block0': {'q': w}, 'block1': {'q': w}}
    >>> dmuon_jax.find_hook_boundaries(lm).chosen()
    'block0, block1 (repeated siblings)'
    >>> mlp = {'linear1': {'kernel': w}, 'w2': w}  # w2 on the root module
    >>> dmuon_jax.find_hook_boundaries(mlp).chosen()
    '<root> (parent module)'

    A custom rule, e.g. for blocks named without an index:

    >>> vit = {'enc_a': {'attn': {'q': w}, 'mlp': {'up': w}},
    ...        'enc_b': {'attn': {'q': w}, 'mlp': {'up': w}}}
    >>> dmuon_jax.find_hook_boundaries(
    ...     vit, boundary_predicate=lambda path, sub: 'attn' in sub).names
    ('enc_a', 'enc_b')
  """
  specs = _routing.route(
    params,
    predicate=predicate,
    weight_dimension_numbers=weight_dimension_numbers,
  ).specs
  return hook_boundaries(params, specs, boundary_predicate, strict)


# A module name with an index: a stem, an optional '_', digits.
_INDEXED = re.compile(r'^(.*?)_?(\d+)$')


def _repeated(flat, containers: frozenset[str]) -> Callable[[tuple], bool]:
  """Whether a module (its path's segments) is one of repeated siblings
  (see :func:`find_hook_boundaries`, 3)."""
  below: dict[tuple, list] = {}  # module -> (rest of path, shape, dtype)
  for keys, x in flat:
    segs = tuple(_routing.segments(normalize_path(keys)))
    for d in range(1, len(segs)):
      below.setdefault(segs[:d], []).append(
        (segs[d:], tuple(np.shape(x)), str(getattr(x, 'dtype', '')))
      )
  sig = {m: tuple(sorted(v)) for m, v in below.items()}
  children: dict[tuple, list[str]] = {}
  for m in sig:
    children.setdefault(m[:-1], []).append(m[-1])

  @functools.cache
  def repeated(module: tuple) -> bool:
    parent, key = module[:-1], module[-1]
    if '/'.join(parent) in containers:
      kin = children[parent]
    else:
      stem = _INDEXED.match(key)
      if stem is None:
        return False
      same = lambda k: (m := _INDEXED.match(k)) and m[1] == stem[1]
      kin = [k for k in children[parent] if same(k)]
    return len(kin) > 1 and len({sig[(*parent, k)] for k in kin}) == 1

  return repeated


def _within(name: str, module: str) -> bool:
  """Whether boundary ``name`` is ``module`` or lies inside it."""
  return not module or name == module or name.startswith(module + '/')


def hook_boundaries(
  params, specs, boundary_predicate, strict
) -> HookBoundaries:
  """:func:`find_hook_boundaries` of ``params`` routed as ``specs`` (per
  leaf, its ``_routing.route`` spec or None)."""
  flat = jax.tree.flatten_with_path(params)[0]
  given = boundary_predicate
  if isinstance(given, ModelBlocks) or given is None:
    containers = given.containers if given else frozenset()
    repeated, given = _repeated(flat, containers), None
  # Per target (leaf order): [path, (boundary, how, scanned) or None].
  found: list[list[Any]] = []
  for spec, (keys, _) in zip(specs, flat, strict=True):
    if spec is None:
      continue
    choice = None
    if given is not None:
      for end in range(len(keys) - 1, -1, -1):  # the lowest ancestor, or ''
        path = normalize_path(keys[:end])
        if given(path, subtree(params, keys[:end])):
          choice = (path, 'boundary_predicate', False)
          break
    else:  # A block prefix (layers/3, layers_3), a scanned stack, siblings.
      block, name = _routing.layer_base(spec.path)
      segs = tuple(_routing.segments(spec.path))
      if block:
        choice = (name, 'name pattern', False)
      elif spec.batch_axes:
        choice = (name, 'scanned stack', True)
      else:
        module = next(
          (segs[:d] for d in range(1, len(segs)) if repeated(segs[:d])), None
        )
        if module is not None:
          choice = ('/'.join(module), 'repeated siblings', False)
    found.append([spec.path, choice])
  blocks = [c[0] for _, c in found if c is not None]
  missing = [p for p, c in found if c is None]
  if missing and (strict and (blocks or given is not None)):
    raise ValueError(
      f'dmuon: {len(missing)} Muon target(s) have no hook boundary: '
      f'{missing}'
      + (
        '; the boundary_predicate names none of their modules. '
        if given is not None
        else f', outside the blocks found ({_shown(blocks)}). '
      )
      + 'Pass boundary_predicate=(path, subtree) -> bool to mark your block '
      'modules, route these params to AdamW (predicate), or pass '
      'strict=False to gather each of them with its own module ('
      f'{_shown(["/".join(p.split("/")[:-1]) or "<root>" for p in missing])}).'
    )
  # Without blocks (or strict=False): each target's own module, merged into
  # an enclosing one that holds other targets; a module that holds blocks
  # too cannot gather (its call would gather again around theirs): the
  # target alone then.
  modules = {p: p.rpartition('/')[0] for p in missing}
  free = [m for m in modules.values() if not any(_within(b, m) for b in blocks)]
  for target in found:
    if target[1] is None:
      m = modules[target[0]]
      if m in free:
        outer = min((o for o in free if _within(m, o)), key=len)
        target[1] = (outer, 'parent module', False)
      else:
        target[1] = (target[0], 'target itself', False)
  index: dict[str, int] = {}  # boundary name -> its index, in order
  scanned, how, of_target = [], [], []
  for _, (name, way, is_scan) in found:
    if name not in index:
      index[name] = len(index)
      scanned.append(is_scan)
      how.append(way)
    of_target.append(index[name])
  return HookBoundaries(
    tuple(index),
    tuple(scanned),
    tuple(p for p, _ in found),
    tuple(of_target),
    tuple(how),
  )


def _shown(names: Sequence[str]) -> str:
  """Up to five names, then how many more."""
  names = list(dict.fromkeys(names))
  more = f' and {len(names) - 5} more' if len(names) > 5 else ''
  return str(names[:5])[:-1] + more + ']' if more else str(names)
