"""Finding dmuon states in any optax state tree, and their layout stamp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dmuon_jax import _owner_layout

# The first word of a stamp: says "this array is a layout stamp", so that
# arithmetic on a whole state (``jax.tree.map(jnp.zeros_like, state)``)
# never reads as a stamp of another layout.
_MAGIC = 0x444D5531  # b'DMU1'

STAMP_MISMATCH_MSG = (
  'dmuon_jax: an optimizer state of owner layout {name} holds the layout '
  'stamp of layout {saved} (a layout name ends in its fingerprint): it was '
  'restored from a checkpoint saved by an optimizer laid out differently '
  '(another mesh, device count, TP split or owner plan), and only the '
  'leaves both layouts share were restored (orbax partial_restore=True), '
  "so its Muon momentum would be the target's zeros. Convert the momentum "
  'instead: save and restore with dmuon_jax.checkpoint.save/restore, or, '
  'with your own orbax CheckpointManager, save '
  'dmuon_jax.checkpoint.state_to_portable(opt_state), restore it into the '
  'target dmuon_jax.checkpoint.state_to_portable(opt.init(params_like)) and '
  'call dmuon_jax.checkpoint.state_from_portable(restored, opt_state) '
  '(docs/guides/checkpoints.md, "With your own orbax CheckpointManager").'
)


def is_dmuon_state(x: Any) -> bool:
  """Whether ``x`` is a dmuon optimizer state (``ScaleByDMuonState``,
  ``DedicatedMuonState``): a NamedTuple whose ``mu`` are owner buffers."""
  return isinstance(x, tuple) and isinstance(
    getattr(x, 'mu', None), _owner_layout.OwnerBuffers
  )


def find(
  tree: Any, is_node: Callable[[Any], bool]
) -> list[tuple[jax.tree_util.KeyPath, Any]]:
  """Every node of ``tree`` where ``is_node`` holds, with its key path.

  The one search through optimizer states: it descends into every pytree
  node, so it sees through every optax wrapper (``chain``, ``named_chain``,
  ``partition``, ``masked``, ``MultiSteps``, ``apply_if_finite``,
  ``inject_hyperparams``) and through ``nnx.Optimizer``'s ``opt_state``
  (its ``nnx.State`` and ``Variable``\\ s are pytrees too).

  Args:
    tree: any pytree (an optimizer state, a portable one, a whole train
      state).
    is_node: the predicate, e.g. :func:`is_dmuon_state`.

  Returns:
    ``[(key_path, node)]`` in tree order.
  """
  return [
    (path, x)
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[
      0
    ]
    if is_node(x)
  ]


def stamp_value(layout: _owner_layout.OwnerLayout) -> tuple[np.ndarray, ...]:
  """The stamp of ``layout`` as data: two ``uint32`` scalars (a marker and
  the layout's fingerprint; scalars are placed alike eagerly and by jit)."""
  return (
    np.asarray(_MAGIC, np.uint32),
    np.asarray(int(layout.fingerprint, 16), np.uint32),
  )


def _read(x: Any) -> np.ndarray | None:
  """``x``'s value on the host if it is there without waiting, else None.

  Host arrays, and jax arrays whose computation is done (restored ones);
  not tracers, donated arrays, other processes' shards, or a train step's
  outputs still being computed (reading those would wait for the step and
  stall asynchronous dispatch).
  """
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x)
  if (
    not isinstance(x, jax.Array)
    or isinstance(x, jax.core.Tracer)
    or x.is_deleted()
    or not x.is_fully_addressable
    or not x.is_ready()
  ):
    return None
  return np.asarray(x)


@jax.tree_util.register_pytree_with_keys_class
class LayoutStamp:
  """The owner layout a state's momentum was written by, as data.

  A pytree with two ``uint32`` scalar children, ``marker`` and ``value``
  (the layout's fingerprint), under layout-independent keys
  (``'stamp_marker'``, ``'stamp'``), and the name of the state's own layout
  as static metadata. The momentum buffers are keyed by the layout's name,
  so restoring a checkpoint of another layout with orbax fails on those
  keys; with ``partial_restore=True`` orbax restores the leaves both
  layouts share, this stamp among them, and keeps the target's zero
  momentum. Rebuilding the tree then finds a stamp of another layout and
  raises, naming the conversion to use.

  Attributes:
    marker: a constant saying that ``value`` is a stamp (arithmetic on a
      whole state, e.g. ``jax.tree.map(jnp.zeros_like, state)``, never reads
      as a stamp of another layout).
    value: the fingerprint of the layout that wrote the momentum.
    name: the name of the layout of the state holding it (it ends in the
      layout's fingerprint).
  """

  __slots__ = ('marker', 'value', 'name')

  def __init__(self, marker: Any, value: Any, name: str):
    self.marker = marker
    self.value = value
    self.name = name

  def tree_flatten_with_keys(self):
    keys = (
      jax.tree_util.DictKey('stamp_marker'),
      jax.tree_util.DictKey('stamp'),
    )
    return tuple(zip(keys, (self.marker, self.value))), self.name

  def tree_flatten(self):
    return (self.marker, self.value), self.name

  @classmethod
  def tree_unflatten(cls, name, children):
    marker, value = children
    check(marker, value, name)
    return cls(marker, value, name)

  def __eq__(self, other: object) -> bool:
    # As a tuple (name, marker, value) compares.
    if not isinstance(other, LayoutStamp):
      return NotImplemented
    return (self.name, self.marker, self.value) == (
      other.name,
      other.marker,
      other.value,
    )

  def __hash__(self) -> int:
    return hash((self.name, self.marker, self.value))

  def __repr__(self) -> str:
    return f'LayoutStamp({self.name})'


def check(marker: Any, value: Any, name: str) -> None:
  """Raises if ``(marker, value)`` is the stamp of a layout other than the
  one named ``name`` (values not readable without waiting, or not stamps
  at all, pass)."""
  got = [_read(x) for x in (marker, value)]
  if any(x is None or x.shape != () or x.dtype != np.uint32 for x in got):
    return
  fingerprint = int(name.rsplit('_', 1)[-1], 16)
  if int(got[0]) != _MAGIC or int(got[1]) == fingerprint:
    return
  raise ValueError(
    STAMP_MISMATCH_MSG.format(name=name, saved=f'..._{int(got[1]):08x}')
  )


def make_stamp(layout: _owner_layout.OwnerLayout, place=None) -> LayoutStamp:
  """The stamp of a fresh state of ``layout`` (``place`` puts it on the
  mesh, as the step count)."""
  values = [jax.numpy.asarray(x) for x in stamp_value(layout)]
  if place is not None:
    values = [place(x) for x in values]
  return LayoutStamp(*values, layout.name)
