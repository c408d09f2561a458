"""Saved-tree checks and damaged-step diagnosis of dmuon_jax.checkpoint."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np


def orbax_checkpoint():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover
    raise ImportError(
      'dmuon_jax checkpoints need orbax-checkpoint: '
      'pip install orbax-checkpoint'
    ) from e
  return ocp


def saved_tree(path):
  """The saved tree's array metadata (orbax), as nested containers.

  Asks the handler, not a checkpointer: ``Checkpointer.metadata`` logs and
  returns None for unreadable metadata, which would read as an empty tree.
  """
  ocp = orbax_checkpoint()
  from etils import epath  # pylint: disable=import-outside-toplevel

  handler = ocp.PyTreeCheckpointHandler()
  try:
    meta = handler.metadata(epath.Path(path))
  finally:
    handler.close()
  return getattr(meta, 'tree', meta)


def _path_str(path) -> str:
  """A key path as ``a/b/0``, the same for a NamedTuple and its dict."""
  names = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      names.append(str(k))
  return '/'.join(names)


def _shapes_by_path(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_path_str(p): tuple(getattr(x, 'shape', ())) for p, x in leaves}


def _is_empty_node(x) -> bool:
  """None, or a NamedTuple without fields (``EmptyState``, ``MaskedNode``)."""
  return x is None or (isinstance(x, tuple) and getattr(x, '_fields', 1) == ())


def sigs_by_path(tree) -> dict[str, str]:
  """Per leaf path: ``'(8, 16) float32'``, or the empty node's type.

  Empty nodes count as leaves, so ``adam`` and ``adamw`` (one more
  ``EmptyState``) or a leaf masked differently (``MaskedNode``) differ.
  Containers do not (an ``nnx.State`` and its pure dict agree).
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty_node)
  out = {}
  for p, x in leaves[0]:
    if _is_empty_node(x):
      out[_path_str(p)] = 'None' if x is None else f'{type(x).__name__}()'
    else:
      dtype = getattr(x, 'dtype', None)
      dtype = '' if dtype is None else f' {jnp.dtype(dtype).name}'
      out[_path_str(p)] = f'{tuple(np.shape(x))}{dtype}'
  return out


def diff_parts(
  have, want, *, what, have_name, want_name, only_want, only_have
) -> list[str]:
  """The differences of two ``path -> signature`` dicts (up to 8 each)."""
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  differ = sorted(
    f'{p}: {have_name} {have[p]}, {want_name} {want[p]}'
    for p in set(want) & set(have)
    if have[p] != want[p]
  )

  def first(items, sep):
    more = f' (and {len(items) - 8} more)' if len(items) > 8 else ''
    return sep.join(items[:8]) + more

  parts = []
  if differ:
    parts.append(f'different {what}: ' + first(differ, '; '))
  if missing:
    parts.append(f'{only_want}: ' + first(missing, ', '))
  if extra:
    parts.append(f'{only_have}: ' + first(extra, ', '))
  return parts


def check_saved(saved, wanted, step) -> None:
  """Raises unless every array of ``wanted`` was saved with its shape."""
  top = next(iter(wanted))
  have = _shapes_by_path(
    {top: saved.get(top)} if isinstance(saved, dict) else saved
  )
  have = {p: s for p, s in have.items() if p.split('/')[0] == top}
  parts = diff_parts(
    have,
    _shapes_by_path(wanted),
    what='shapes',
    have_name='saved',
    want_name='target',
    only_want='not in the checkpoint',
    only_have='in the checkpoint but not in the target',
  )
  if not parts:
    return
  what = (
    'params'
    if top == 'params'
    else 'optimizer state (in its mesh-independent form)'
  )
  fix = (
    'Build params_like from the model config the checkpoint was saved '
    'with (same tree, same shapes).'
    if top == 'params'
    else 'Make the optimizer as when saving (same Muon routing and '
    'transformations), or pass opt=None to restore the params only.'
  )
  raise ValueError(
    f'dmuon_jax checkpoint: step {step} does not fit the {what} it is '
    f'restored onto: {" | ".join(parts)}. {fix}'
  )


def partial_restore(path, abstract):
  """Restores the top-level items of ``abstract`` from a saved tree."""
  ocp = orbax_checkpoint()
  with ocp.PyTreeCheckpointer() as ckptr:
    return ckptr.restore(
      path,
      args=ocp.args.PyTreeRestore(
        item=abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True,
      ),
    )


# TensorStore's status codes for files that are missing, short or garbled.
_TS_DAMAGE = re.compile(
  r'\b(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|FAILED_PRECONDITION)\b'
)
_TS_FILE = re.compile(r'local file "([^"]+)"')
# The JSON files orbax reads back, relative to a step's item directory.
_JSON_FILES = ('_METADATA', '_sharding')


def _messages(e: BaseException) -> list[str]:
  out = []
  while e is not None and len(out) < 8:
    out.append(str(e))
    e = e.__cause__ or e.__context__
  return out


def damaged_file(step_dir: pathlib.Path, e: BaseException):
  """The file of ``step_dir`` that ``e`` shows is damaged, or None.

  None when nothing says the files are at fault (then ``e`` is not
  translated): a file under ``step_dir`` named in TensorStore's message, a
  required file missing, a JSON file that does not parse, or (naming the
  directory) a JSON error or a TensorStore data-loss status.
  """
  item = step_dir / 'default'
  texts = _messages(e)
  for text in texts:
    for name in reversed(_TS_FILE.findall(text)):
      p = pathlib.Path(name)
      if not name.endswith('/') and p.is_relative_to(step_dir):
        return p
  required = [item / '_METADATA']
  if (item / 'd').is_dir():
    required.append(item / 'manifest.ocdbt')
  for p in required:
    if not p.is_file():
      return p
  jsons = [item / n for n in _JSON_FILES]
  jsons += sorted((item / 'array_metadatas').glob('*'))
  for p in jsons:
    if p.is_file():
      try:
        json.loads(p.read_bytes())
      except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return p
  if isinstance(e, json.JSONDecodeError) or any(
    _TS_DAMAGE.search(t) for t in texts
  ):
    return item
  return None


def reason(e: BaseException) -> str:
  text = str(e).split(' [tensorstore_spec=')[0].splitlines()
  text = text[0] if text else ''
  text = text if len(text) <= 300 else text[:297] + '...'
  return f'{type(e).__name__}: {text}'
