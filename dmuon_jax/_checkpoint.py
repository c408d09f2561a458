"""dmuon_jax.checkpoint's machinery: steps, trees by path, placement, orbax."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _dedication, _owner_layout, _owner_update

# Documented as dmuon_jax.checkpoint.COMMIT_MARKER.
COMMIT_MARKER = 'commit_success.txt'


def orbax_checkpoint():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover
    raise ImportError(
      'dmuon_jax checkpoints need orbax-checkpoint: '
      'pip install orbax-checkpoint'
    ) from e
  return ocp


# ----------------------------------------------------------------- steps


def is_step(path: pathlib.Path) -> bool:
  """A committed step directory: named by an integer, with the marker."""
  return path.name.isdigit() and (path / COMMIT_MARKER).is_file()


def as_step(step, where: str) -> int:
  """``step`` as a Python int, or a TypeError/ValueError saying why not."""
  dtype = getattr(step, 'dtype', None)
  if dtype is None:
    ok = isinstance(step, int) and not isinstance(step, bool)
    what = type(step).__name__
  else:
    ok = np.shape(step) == () and jnp.issubdtype(dtype, jnp.integer)
    what = f'{jnp.dtype(dtype).name} array of shape {np.shape(step)}'
  if not ok:
    raise TypeError(
      f'dmuon_jax checkpoint.{where}: step={step!r} ({what}) is not an '
      'integer. Pass the training step as a '
      'non-negative int (or a 0-d integer array such as '
      'optimizer.step[...]): steps are directories named by the number, '
      'and restore only finds those named by non-negative integers.'
    )
  if (value := int(step)) < 0:
    raise ValueError(
      f'dmuon_jax checkpoint.{where}: step={value} is negative. Pass the '
      'non-negative training step (e.g. the number of updates applied so '
      'far): restore only finds step directories named by non-negative '
      'integers, so this checkpoint would be lost.'
    )
  return value


def check_directory(directory, where: str) -> pathlib.Path:
  """The absolute root, or FileNotFoundError if it is not a directory."""
  root = pathlib.Path(os.path.abspath(directory))
  if not root.exists():
    raise FileNotFoundError(
      f'dmuon_jax checkpoint.{where}: {str(directory)!r} does not exist, so '
      'there is no checkpoint to restore. Pass the directory given to save '
      '(check the path for a typo). If starting fresh is intended, create '
      'the directory first (os.makedirs(directory, exist_ok=True): an empty '
      'directory restores as None) or check os.path.isdir(directory) before '
      'restoring.'
    )
  if not root.is_dir():
    raise FileNotFoundError(
      f'dmuon_jax checkpoint.{where}: {str(directory)!r} is a file, not a '
      'checkpoint directory. Pass the directory given to save (it holds one '
      'directory per step), not a file in it.'
    )
  return root


# ------------------------------------------------------- trees by path


def _path_str(path) -> str:
  """A key path as ``a/b/0``, the same for a NamedTuple and its dict."""
  return jax.tree_util.keystr(path, simple=True, separator='/')


def nest(by_path: dict[str, Any]) -> dict:
  """A nested dict from ``{'a/b': x}`` (``flat``'s inverse)."""
  out: dict = {}
  for path, x in by_path.items():
    node = out
    parts = path.split('/') if path else ['<root>']
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = x
  return out


def flat(nested: Any) -> dict[str, Any]:
  """``{'a/b': x}`` from a nested dict (``nest``'s inverse)."""
  out = {}
  for keys, x in jax.tree_util.tree_flatten_with_path(nested)[0]:
    path = _path_str(keys)
    out['' if path == '<root>' else path] = x
  return out


def _is_empty_node(x) -> bool:
  """None, or a NamedTuple without fields (``EmptyState``, ``MaskedNode``)."""
  return x is None or (isinstance(x, tuple) and getattr(x, '_fields', 1) == ())


def sigs_by_path(tree, *, shapes_only: bool = False) -> dict[str, str]:
  """Per leaf path: ``'(8, 16) float32'``, or the empty node's type.

  Empty nodes count as leaves, so ``adam`` and ``adamw`` (one more
  ``EmptyState``) or a leaf masked differently (``MaskedNode``) differ.
  Containers do not (an ``nnx.State`` and its pure dict agree). With
  ``shapes_only``: ``'(8, 16)'``, and empty nodes are no leaves.
  """
  is_leaf = None if shapes_only else _is_empty_node
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  out = {}
  for p, x in leaves:
    dtype = None if shapes_only else getattr(x, 'dtype', None)
    if _is_empty_node(x):
      sig = 'None' if x is None else f'{type(x).__name__}()'
    else:
      sig = str(tuple(int(d) for d in np.shape(x)))
      sig += '' if dtype is None else f' {jnp.dtype(dtype).name}'
    out[_path_str(p)] = sig
  return out


def check_fits(have, want, message: str, *, what: str, names) -> None:
  """Raises ``ValueError(message)`` with ``{}`` in it replaced by the
  differences of two ``path -> signature`` dicts (up to 8 of each kind), if
  they differ. ``names``: of ``have`` and ``want`` in a difference, then the
  headings of the paths only ``want`` has and of those only ``have`` has."""
  have_name, want_name, only_want, only_have = names
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
  if parts:
    raise ValueError(message.replace('{}', ' | '.join(parts)))


# How check_saved names a saved item, and how to make a target fit it.
_ITEMS = {
  'params': (
    'params',
    'Build params_like from the model config the checkpoint was saved '
    'with (same tree, same shapes).',
  ),
  'opt_state': (
    'optimizer state (in its mesh-independent form)',
    'Make the optimizer as when saving (same Muon routing and '
    'transformations), or pass opt=None to restore the params only.',
  ),
}


def check_saved(saved, wanted, step) -> None:
  """Raises unless every array of ``wanted`` was saved with its shape."""
  top = next(iter(wanted))
  item, fix = _ITEMS[top]
  check_fits(
    sigs_by_path({top: saved.get(top)}, shapes_only=True),
    sigs_by_path(wanted, shapes_only=True),
    f'dmuon_jax checkpoint: step {step} does not fit the {item} it is '
    f'restored onto: {{}}. {fix}',
    what='shapes',
    names=(
      'saved',
      'target',
      'not in the checkpoint',
      'in the checkpoint but not in the target',
    ),
  )


# ------------------------------------------------------------ placement


def concrete_mesh(xs) -> Any:
  """The concrete ``Mesh`` the first of ``xs`` placed by a ``NamedSharding``
  lives on, or None."""
  for x in xs:
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.Mesh
    ):
      return sharding.mesh
  return None


def cast_like(x, target):
  """``x`` with ``target``'s dtype and placement (uncommitted if it is)."""
  if not getattr(target, 'committed', True):
    return jnp.asarray(np.asarray(x), target.dtype)
  x, sharding = jnp.asarray(x, target.dtype), getattr(target, 'sharding', None)
  return x if sharding is None else jax.device_put(x, sharding)


def abstract_leaf(x, placed: bool = False) -> jax.ShapeDtypeStruct:
  """``x`` as a ``ShapeDtypeStruct``; ``placed``: on the first device if
  ``x`` has no sharding."""
  dtype, sharding = getattr(x, 'dtype', None), getattr(x, 'sharding', None)
  if placed and sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  dtype = jnp.result_type(x) if dtype is None else dtype
  return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


def _rest_leaves(dp_like: _dedication.DedicatedParams):
  return jax.tree_util.tree_flatten(dp_like.rest, is_leaf=lambda x: x is None)


def dedicated_like(dp_like: _dedication.DedicatedParams):
  """The plain params target of a DedicatedParams target (Muon targets
  replicated on its mesh; without one, ``abstract_leaf(placed=True)`` puts
  them on the first device)."""
  leaves, treedef = _rest_leaves(dp_like)
  mesh = concrete_mesh(dp_like.owned.buffers)
  sharding = None if mesh is None else NamedSharding(mesh, P())
  for t in dp_like.owned.layout.leaves:
    leaves[t.index] = jax.ShapeDtypeStruct(
      t.shape, jnp.dtype(t.dtype), sharding=sharding
    )
  return jax.tree.unflatten(treedef, leaves)


def pack_like(like: _owner_layout.OwnerBuffers, values: dict[int, Any]):
  """Owner buffers of ``like``'s layout, dtypes, placement and shapes (a
  momentum's, see ``OwnerLayout.momentum_segments``), from whole arrays by leaf
  index."""
  layout = like.layout
  shapes = [tuple(np.shape(b)) for b in like.buffers]
  owned = [s.shape for s in layout.buffer_shapes()]
  return layout.pack(
    values,
    [b.dtype for b in like.buffers],
    concrete_mesh(like.buffers),
    [getattr(b, 'sharding', None) for b in like.buffers],
    momentum=shapes != owned,
  )


def to_dedicated_like(params, dp_like: _dedication.DedicatedParams):
  leaves, treedef = jax.tree_util.tree_flatten(params)
  owned = pack_like(
    dp_like.owned,
    {t.index: leaves[t.index] for t in dp_like.owned.layout.leaves},
  )
  rest = [
    None if like is None else cast_like(x, like)
    for x, like in zip(leaves, _rest_leaves(dp_like)[0])
  ]
  return _dedication.DedicatedParams(
    owned=owned, rest=jax.tree.unflatten(treedef, rest)
  )


def is_optimizer(opt) -> bool:
  """An optimizer (anything with ``init``: ``GradientTransformation``,
  ``GradientTransformationExtraArgs``, ``optax.MultiSteps``), not a state."""
  return callable(getattr(opt, 'init', None))


def _abstract_init(init, *args):
  """``init(*args)``'s shapes, dtypes and compiled shardings, jitted (a
  trace and a compile: nothing runs, nothing is allocated)."""
  traced = jax.jit(init).trace(*args)
  shardings = traced.lower().compile().output_shardings
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    traced.out_info,
    shardings,
  )


def target_state(opt, params):
  """The state to restore into: ``opt`` itself if it is a state, else
  ``opt.init(params)``'s layouts, shapes, dtypes and shardings, abstractly.

  Nothing is allocated (a fresh state would double the optimizer's memory
  while the checkpoint is read). ``jax.eval_shape`` alone gives no devices
  (no shardings on Auto meshes, ``AbstractMesh`` ones on Explicit meshes),
  so the shardings come from compiling ``opt.init`` (not running it).

  The params are jit arguments there, so the state's other leaves (AdamW
  moments) are typed and placed from them, as a jitted init places them.
  But on Auto meshes such tracers carry no sharding, and the dmuon layouts
  would record the params as replicated (an all-gather where a fresh
  ``opt.init(params)`` routes an all-to-all). Then each dmuon state comes
  from a second trace with the params closed over instead: init reads the
  placed arrays' shardings, as eagerly (closed-over arrays are hoisted as
  arguments of the compiled program: nothing is copied or embedded).
  """
  if not is_optimizer(opt):
    return opt
  is_state = _owner_update.is_dmuon_state
  mesh = concrete_mesh(jax.tree.leaves(params))
  # Explicit-mesh params type-check only inside their mesh's context.
  ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  with ctx:
    target = _abstract_init(opt.init, params)
    leaves, treedef = jax.tree.flatten(target, is_leaf=is_state)
    # Only where a dmuon state records params of unknown sharding.
    if not any(
      None in x.mu.layout.param_entries for x in leaves if is_state(x)
    ):
      return target
    placed = _abstract_init(lambda: opt.init(params))
  found, found_def = jax.tree.flatten(placed, is_leaf=is_state)
  if found_def != treedef:  # an init that builds its tree from the values
    return target
  return treedef.unflatten(
    [y if is_state(y) else x for x, y in zip(leaves, found)]
  )


# ---------------------------------------------------------- orbax reads


def read(path, name=None, abstract=None):
  """The saved tree's array metadata (orbax) as nested containers, or its
  top-level item ``name`` restored onto ``abstract``.

  The metadata comes from the handler, not a checkpointer:
  ``Checkpointer.metadata`` logs and returns None for unreadable metadata,
  which would read as an empty tree.
  """
  ocp = orbax_checkpoint()
  if name is None:
    from etils import epath  # pylint: disable=import-outside-toplevel

    handler = ocp.PyTreeCheckpointHandler()
    try:
      meta = handler.metadata(epath.Path(path))
    finally:
      handler.close()
    return getattr(meta, 'tree', meta)
  item = {name: abstract}
  with ocp.PyTreeCheckpointer() as ckptr:
    return ckptr.restore(
      path,
      args=ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
      ),
    )[name]


# TensorStore's status codes for files that are missing, short or garbled.
_TS_DAMAGE = re.compile(
  r'\b(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|FAILED_PRECONDITION)\b'
)
_TS_FILE = re.compile(r'local file "([^"]+)"')
# The JSON files orbax reads back, relative to a step's item directory.
_JSON_FILES = ('_METADATA', '_sharding')


def damaged_file(step_dir: pathlib.Path, e: BaseException):
  """The file of ``step_dir`` that ``e`` shows is damaged, or None.

  None when nothing says the files are at fault (then ``e`` is not
  translated): a file under ``step_dir`` named in TensorStore's message, a
  required file missing, a JSON file that does not parse, or (naming the
  directory) a JSON error or a TensorStore data-loss status.
  """
  item = step_dir / 'default'
  texts, cause = [], e
  while cause is not None and len(texts) < 8:
    texts.append(str(cause))
    cause = cause.__cause__ or cause.__context__
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
