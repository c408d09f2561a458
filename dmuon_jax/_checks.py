"""Checks that a tree matches the one an earlier call (init) recorded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dmuon_jax._routing import normalize_path


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
