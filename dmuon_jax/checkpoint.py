"""Checkpoints of dmuon optimizer states that survive mesh and layout changes.

The Muon momentum lives in owner buffers whose layout (the
:class:`dmuon_jax.OwnerLayout` in the state) depends on the mesh and the
owner plan. Restoring such a state with plain orbax into a state of another
layout fails on its keys (they carry the layout's name: orbax lists both),
so momentum is never silently scrambled. To move a state between layouts,
this module converts it to a *portable* form: each
:class:`dmuon_jax.ScaleByDMuonState` (or dedicated mode's
``DedicatedMuonState``) becomes a :class:`PortableDMuonState` whose ``mu``
holds every Muon target's momentum in its param's shape (a nested dict by
param path), and everything else in the state stays as it is. The
conversions read the layouts from the states themselves: no optimizer
arguments, no params.

:func:`save` and :func:`restore` wrap orbax around this (params are saved in
param layout, also in dedicated mode); :func:`save_nnx` and
:func:`restore_nnx` do the same for a Flax ``nnx.Optimizer`` and its model.
orbax-checkpoint is needed for those (``pip install orbax-checkpoint``).

A checkpoint is never lost quietly: ``save`` rejects a step that is not a
non-negative integer (``restore`` would never find it) and, given ``opt=``
(always in ``save_nnx``), a state that is not that optimizer's, before
writing anything; ``restore`` raises ``FileNotFoundError`` for a path that
is not a directory (an empty directory is "no checkpoint yet": None), and
:class:`CheckpointDamagedError` for a step whose files cannot be read,
falling back to an older step only with ``if_damaged='older'``.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> import dmuon_jax
  >>> from dmuon_jax import checkpoint
  >>> params = {'layers_0': {'w': jnp.ones((4, 8))}, 'b': jnp.zeros(8)}
  >>> opt = dmuon_jax.dmuon(0.02)
  >>> state = opt.init(params)
  >>> portable = checkpoint.state_to_portable(state)
  >>> back = checkpoint.state_from_portable(portable, opt.init(params))
  >>> jax.tree.structure(back) == jax.tree.structure(state)
  True
"""

from __future__ import annotations

import functools
import os
import pathlib
import warnings
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checkpoint, _dedication, _mesh, _owner_update

_NO_DEVICES_MSG = (
  'dmuon_jax checkpoint: the abstract optimizer state of layout {name} '
  'does not say which devices its owner buffers live on (jax.eval_shape '
  'gives no sharding on Auto meshes and AbstractMesh ones on Explicit '
  'meshes), so the portable target cannot be placed. Pass the state made '
  'by opt.init(params_like) (params_like: ShapeDtypeStructs with the '
  'shardings wanted), or its abstract form with concrete shardings: '
  'jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, '
  'sharding=s), traced.out_info, traced.lower().compile().output_shardings)'
  ' with traced = jax.jit(opt.init).trace(params_like).'
)

COMMIT_MARKER = _checkpoint.COMMIT_MARKER
"""The file orbax writes into a step directory when its save is committed.

:func:`complete_steps` counts a step only if its directory holds it.
"""


def complete_steps(directory) -> list[int]:
  """Steps under ``directory`` whose save completed (sorted).

  A step counts only if its directory name is an integer and holds orbax's
  commit marker (``commit_success.txt``, written just before the atomic
  rename of the temporary directory, or as the last file on file systems
  without atomic rename). Temporary (``*.orbax-checkpoint-tmp-*``) or
  unfinished step directories are ignored.

  Args:
    directory: the checkpoint root directory (a ``str`` or ``os.PathLike``).

  Returns:
    The complete steps, ascending; ``[]`` if there are none or
    ``directory`` does not exist.

  Examples:
    >>> import pathlib, tempfile
    >>> from dmuon_jax import checkpoint
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   root = pathlib.Path(directory)
    ...   for step in (10, 2, 7):
    ...     (root / str(step)).mkdir()
    ...   for step in (10, 2):  # step 7's save never committed
    ...     _ = (root / str(step) / checkpoint.COMMIT_MARKER).write_text('')
    ...   checkpoint.complete_steps(directory)
    [2, 10]
  """
  path = pathlib.Path(directory)
  if not path.is_dir():
    return []
  return sorted(
    int(child.name) for child in path.iterdir() if _checkpoint.is_step(child)
  )


def latest_step(directory) -> int | None:
  """The latest complete step under ``directory``, or None.

  Args:
    directory: the checkpoint root directory (a ``str`` or ``os.PathLike``).

  Returns:
    The largest of :func:`complete_steps`, or None if there is none.

  Examples:
    >>> import tempfile, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> state = dmuon_jax.dmuon(0.02).init(params)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   print(checkpoint.latest_step(directory))
    ...   _ = checkpoint.save(directory, 5, params, state)
    ...   print(checkpoint.latest_step(directory))
    None
    5
  """
  return max(complete_steps(directory), default=None)


class CheckpointDamagedError(ValueError):
  """A complete checkpoint step whose files cannot be read back.

  Raised by :func:`restore` and :func:`restore_nnx` when orbax (or
  TensorStore under it) fails on a step's files: a truncated or deleted
  data file, a metadata file overwritten with something that is not what
  orbax wrote. The step was committed, so the damage came after the save
  (disk, copy, a person). It is a ``ValueError``, so ``except ValueError``
  still catches it, but it is never raised for a target that does not fit
  (those stay plain ``ValueError`` naming the leaves).

  Attributes:
    step: the damaged step.
    file: the file that could not be read (the step's directory where
      orbax does not say which file).
    directory: the checkpoint root directory.

  Examples:
    >>> import pathlib, tempfile, warnings, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> opt = dmuon_jax.dmuon(0.02)
    >>> state = opt.init(params)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   for step in (1, 2):
    ...     _ = checkpoint.save(directory, step, params, state, opt=opt)
    ...   metadata = pathlib.Path(directory, '2', 'default', '_METADATA')
    ...   _ = metadata.write_bytes(b'garbage')  # damaged after the save
    ...   try:
    ...     checkpoint.restore(directory, params, opt)
    ...   except checkpoint.CheckpointDamagedError as e:
    ...     print(e.step, e.file.name)
    ...   with warnings.catch_warnings(record=True):  # it warns, naming step 2
    ...     warnings.simplefilter('always')
    ...     step, _, _ = checkpoint.restore(directory, params, opt,
    ...                                     if_damaged='older')
    2 _METADATA
    >>> step
    1
  """

  def __init__(self, message: str, *, step: int, file, directory):
    super().__init__(message)
    self.step = step
    self.file = pathlib.Path(file)
    self.directory = pathlib.Path(directory)


class PortableDMuonState(NamedTuple):
  """Mesh-independent form of a dmuon state.

  Attributes:
    count: the step count.
    mu: each Muon target's momentum in its param's shape, as a nested dict
      by param path (``{'layers': {'0': {'w': ...}}}``).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8))}}
    >>> state = dmuon_jax.scale_by_dmuon().init(params)
    >>> portable = checkpoint.state_to_portable(state)
    >>> type(portable).__name__, int(portable.count)
    ('PortableDMuonState', 0)
    >>> jax.tree.map(jnp.shape, portable.mu)  # param shapes, by param path
    {'layers_0': {'w': (4, 8)}}
  """

  count: jax.Array
  mu: Any


def _is_state(x) -> bool:
  """A dmuon state (of any layout) or its portable form."""
  return _owner_update.is_dmuon_state(x) or isinstance(x, PortableDMuonState)


def _portable(tree, abstract=False, placed=True) -> Any:
  """``tree`` with each dmuon state in portable form; ``abstract``: every
  leaf as a ``jax.ShapeDtypeStruct`` (a state's also where its buffers are:
  then, if ``placed``, raise unless they say which devices they are on)."""

  def one(x):
    if not _owner_update.is_dmuon_state(x):
      return _checkpoint.abstract_leaf(x) if abstract else x
    layout = x.mu.layout
    mesh = _checkpoint.concrete_mesh(x.mu.buffers)
    shapes = abstract or any(  # buffers from jax.eval_shape
      isinstance(b, jax.ShapeDtypeStruct) for b in jax.tree.leaves(x.mu)
    )
    if shapes and mesh is None and layout.distributed and placed:
      raise ValueError(_NO_DEVICES_MSG.format(name=layout.name))
    values = None if shapes else layout.unpack(x.mu.buffers)
    mu = {}
    for t, e in zip(layout.leaves, layout.param_entries):
      spec = P() if e is None else _mesh.entries_spec(e)
      s = None if mesh is None else NamedSharding(mesh, spec)
      dtype = x.mu.buffers[layout.leaf_buffer(t.index)].dtype
      mu[t.path] = jax.ShapeDtypeStruct(t.shape, dtype, sharding=s)
      if not shapes:
        mu[t.path] = _checkpoint.cast_like(values[t.index], mu[t.path])
    count = _checkpoint.abstract_leaf(x.count) if shapes else x.count
    return PortableDMuonState(count=count, mu=_checkpoint.nest(mu))

  return jax.tree.map(one, tree, is_leaf=_owner_update.is_dmuon_state)


def state_to_portable(opt_state: Any) -> Any:
  """Returns ``opt_state`` with mesh-independent Muon momentum.

  Args:
    opt_state: an optimizer state holding :class:`dmuon_jax.ScaleByDMuonState`
      (``dmuon``, ``scale_by_dmuon``) or ``DedicatedMuonState``
      (``dedicated_muon``) entries anywhere: inside any optax wrapper or
      composition (``chain``, ``named_chain``, ``partition``, ``masked``,
      ``MultiSteps``, ``apply_if_finite``, ``inject_hyperparams``), or a
      whole train state holding one. It may be abstract (``jax.eval_shape``
      of ``opt.init``): then the result is abstract too, the target to
      restore a portable checkpoint into with orbax.

  Returns:
    ``opt_state`` with each of those replaced by a
    :class:`PortableDMuonState`: the momentum of each Muon target in its
    param's shape, sharded like the param where the layout knows it (else
    replicated); ``jax.ShapeDtypeStruct``\\ s of it for an abstract state.
    Everything else is unchanged.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> state = dmuon_jax.dmuon(0.02).init(params)
    >>> portable = checkpoint.state_to_portable(state)
    >>> is_portable = lambda x: isinstance(x, checkpoint.PortableDMuonState)
    >>> (muon,) = [x for x in jax.tree.leaves(portable, is_leaf=is_portable)
    ...            if is_portable(x)]
    >>> jax.tree.map(jnp.shape, muon.mu)  # the Muon momentum, param-shaped
    {'layers_0': {'w': (4, 8)}}
  """
  return _portable(opt_state)


def _from_portable(portable: PortableDMuonState, target) -> Any:
  layout = target.mu.layout
  by_path = _checkpoint.flat(portable.mu)
  _checkpoint.check_fits(
    {p: tuple(np.shape(x)) for p, x in by_path.items()},
    {t.path: t.shape for t in layout.leaves},
    'dmuon_jax checkpoint: the portable momentum does not fit the optimizer '
    f'state of layout {layout.name}: {{}}. Make the optimizer as when saving '
    '(same Muon routing).',
    what='shapes',
    names=('portable', 'expected', 'missing', 'not Muon targets here'),
  )
  values = {t.index: by_path[t.path] for t in layout.leaves}
  # Boxed targets (Flax metadata on the buffers) get their boxes back.
  mu = target.mu.rebox(_checkpoint.pack_like(target.mu, values).buffers)
  count = _checkpoint.cast_like(portable.count, target.count)
  if isinstance(getattr(target, 'stamp', None), _owner_update.LayoutStamp):
    stamp = _owner_update.make_stamp(layout)
    stamp = jax.tree.map(_checkpoint.cast_like, stamp, target.stamp)
    target = target._replace(stamp=stamp)
  return target._replace(count=count, mu=mu)


def state_from_portable(portable: Any, target_state: Any) -> Any:
  """Builds a state laid out as ``target_state`` from a portable state.

  Args:
    portable: a tree from :func:`state_to_portable` (or :func:`restore`),
      possibly saved on another mesh.
    target_state: a state of the optimizer to continue with, e.g.
      ``opt.init(params)`` on the new mesh, or its abstract form
      (``jax.eval_shape``); it gives the layouts, dtypes and shardings.

  Returns:
    ``target_state``'s structure with the portable values: Muon momentum
    packed into its owner buffers, every other leaf placed as the target's.

  Raises:
    ValueError: if the two trees differ (names the leaves).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8))}}
    >>> tx = dmuon_jax.scale_by_dmuon()
    >>> state = tx.init(params)
    >>> _, state = tx.update({'layers_0': {'w': jnp.eye(4, 8)}}, state, params)
    >>> portable = checkpoint.state_to_portable(state)

    Into a state of another layout (here: owners over the axis ``'data'``
    of a one-device mesh):

    >>> mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
    >>> tx = dmuon_jax.scale_by_dmuon(mesh=mesh, axis_names=('data',))
    >>> target = tx.init(params)
    >>> moved = checkpoint.state_from_portable(portable, target)
    >>> moved.mu.layout == target.mu.layout != state.mu.layout
    True
    >>> back = checkpoint.state_to_portable(moved)
    >>> bool((back.mu['layers_0']['w'] == portable.mu['layers_0']['w']).all())
    True
  """
  conv_leaves = jax.tree.leaves(portable, is_leaf=_is_state)
  tgt_leaves, treedef = jax.tree.flatten(target_state, is_leaf=_is_state)
  if len(conv_leaves) != len(tgt_leaves):
    raise ValueError(
      'dmuon_jax checkpoint: the portable state does not '
      'match the structure of the target optimizer state.'
    )
  out = []
  for x, t in zip(conv_leaves, tgt_leaves):
    if _is_state(t):
      if not isinstance(x, PortableDMuonState):
        raise ValueError(
          'dmuon_jax checkpoint: the portable state has '
          f'{type(x).__name__} where the target has {type(t).__name__}.'
        )
      out.append(_from_portable(x, t))
      continue
    if tuple(np.shape(x)) != tuple(np.shape(t)):
      raise ValueError(
        f'dmuon_jax checkpoint: state leaf of shape {np.shape(x)} where '
        f'the optimizer expects {np.shape(t)}.'
      )
    out.append(_checkpoint.cast_like(x, t))
  return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------- orbax


def _check_state_of(opt, params, portable) -> None:
  """Raises unless ``portable`` is the portable form of a state of ``opt``."""
  if not _checkpoint.is_optimizer(opt):
    raise TypeError(
      'dmuon_jax checkpoint.save: opt= takes the optimizer (an '
      f'optax.GradientTransformation) whose state is saved; got '
      f'{type(opt).__name__}. Pass the optimizer, or leave opt out to save '
      'without checking the state.'
    )
  try:
    abstract = jax.eval_shape(opt.init, params)
  except Exception as e:  # opt.init's own errors, whatever they are
    raise ValueError(
      'dmuon_jax checkpoint.save: opt.init(params) failed '
      f'({type(e).__name__}: {e}), so opt_state cannot be checked against '
      'opt. Pass the params opt was initialised with (the DedicatedParams '
      'in dedicated mode) and the optimizer that made opt_state.'
    ) from e
  _checkpoint.check_fits(
    _checkpoint.sigs_by_path({'opt_state': portable}),
    _checkpoint.sigs_by_path(
      {'opt_state': _portable(abstract, abstract=True, placed=False)}
    ),
    'dmuon_jax checkpoint.save: opt_state is not a state of opt (compared '
    'with jax.eval_shape(opt.init, params), both in mesh-independent '
    'form): {}. Nothing was written. Save the state returned by this '
    "optimizer's init/update, or pass as opt= the optimizer that made "
    'opt_state (same transformations, same Muon routing).',
    what='shapes/dtypes',
    names=(
      'opt_state',
      'opt.init(params)',
      'not in opt_state',
      'in opt_state but not in opt.init(params)',
    ),
  )


def save(
  directory,
  step: int,
  params,
  opt_state,
  *,
  opt: optax.GradientTransformation | None = None,
  max_to_keep: int | None = None,
  extra: dict | None = None,
) -> pathlib.Path:
  """Saves params and a portable optimizer state as step ``step``.

  Blocks until the checkpoint is committed (orbax writes into a temporary
  directory and renames it, so a killed save leaves no complete step).
  Nothing is written when an argument is rejected.

  Args:
    directory: the checkpoint root directory (created if missing).
    step: the training step: a non-negative int, or a numpy/jax integer
      scalar (a 0-d integer array such as an ``nnx.Optimizer``'s
      ``step[...]``).
    params: the params (any sharding; saved as global arrays), or the
      :class:`dmuon_jax.DedicatedParams` of dedicated mode (saved in param
      layout).
    opt_state: the optimizer state (saved in portable form, see
      :func:`state_to_portable`).
    opt: the optimizer that made ``opt_state``. When given, ``opt_state``
      is checked against ``jax.eval_shape(opt.init, params)`` (leaf paths,
      shapes and dtypes) before anything is written, so a state of another
      optimizer (or of other Muon routing) fails here and not at restore
      time. Without it the state is saved as given.
    max_to_keep: keep only this many latest checkpoints (None: all).
    extra: optional tree of small arrays saved too (e.g. a data RNG key).

  Returns:
    The step directory.

  Raises:
    TypeError: if ``step`` is not an integer (a bool, float or str), or
      ``opt`` is not an optimizer.
    ValueError: if ``step`` is negative, or ``opt_state`` is not a state of
      ``opt`` (names the first differing leaves).

  Examples:
    >>> import tempfile, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> opt = dmuon_jax.dmuon(0.02)
    >>> state = opt.init(params)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   path = checkpoint.save(directory, 3, params, state, opt=opt)
    ...   print(path.name, checkpoint.complete_steps(directory))
    3 [3]
  """
  step = _checkpoint.as_step(step, 'save')
  ocp = _checkpoint.orbax_checkpoint()
  directory = pathlib.Path(os.path.abspath(directory))
  portable = state_to_portable(opt_state)
  if opt is not None:
    _check_state_of(opt, params, portable)
  if isinstance(params, _dedication.DedicatedParams):
    params = _dedication.to_params(params)
  tree = {'params': params, 'opt_state': portable}
  if extra is not None:
    tree['extra'] = extra
  with ocp.CheckpointManager(
    directory,
    options=ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
    ),
  ) as manager:
    manager.save(step, args=ocp.args.StandardSave(tree), force=True)
    manager.wait_until_finished()
  return directory / str(step)


_IF_DAMAGED = ('raise', 'older')


def restore(
  directory,
  params_like,
  opt=None,
  step: int | None = None,
  *,
  extra_like=None,
  dedication=None,
  if_damaged: Literal['raise', 'older'] = 'raise',
):
  """Restores the latest (or ``step``) complete checkpoint.

  Args:
    directory: the checkpoint root directory given to :func:`save`. It must
      exist: an empty one means no checkpoint yet (returns None).
    params_like: the target params: a tree of arrays or
      ``jax.ShapeDtypeStruct`` giving shapes, dtypes and shardings (any
      mesh, or one device: leaves without a sharding go to the first
      device), or the :class:`dmuon_jax.DedicatedParams` to restore into
      (their layout and placement).
    opt: what to restore the optimizer state into: an optimizer (anything
      with ``init``: an ``optax.GradientTransformation`` or any optax
      wrapper of one, ``optax.MultiSteps`` included; its state is laid out
      as ``opt.init`` lays it out on the restored params, abstractly: its
      dmuon layouts record ``params_like``'s shardings, on Auto meshes
      too), a state laid out as wanted
      (``opt.init(params)`` or ``jax.eval_shape`` of it), or None to
      restore the params only.
    step: the step to restore (default: the latest complete one). An
      explicit step is never replaced by another one.
    extra_like: the ``extra`` tree given to :func:`save`, as a target.
    dedication: for dedicated mode with a plain ``params_like``: the
      :class:`dmuon_jax.Dedication` on the target mesh; the params come back
      as its :class:`dmuon_jax.DedicatedParams`.
    if_damaged: what to do when the latest complete step is damaged (see
      :class:`CheckpointDamagedError`): ``'raise'`` (default) raises;
      ``'older'`` warns (naming the step and the file) and restores the
      newest undamaged complete step instead. Ignored with ``step``.

  Returns:
    None if ``directory`` holds no complete checkpoint, else
    ``(step, params, opt_state)`` (``opt_state`` None without ``opt``), plus
    ``extra`` as a fourth element when ``extra_like`` is given.

  Raises:
    FileNotFoundError: if ``directory`` does not exist or is not a
      directory, or ``step`` is given and not a complete checkpoint.
    CheckpointDamagedError: if the step's files cannot be read (with
      ``if_damaged='older'``: if no complete step can).
    ValueError: if ``params_like`` (or the optimizer state) differs from
      the saved tree: names the leaves missing, added, or of another shape;
      if ``directory`` is a step directory; if ``if_damaged`` is unknown.
    TypeError: if ``step`` is not an integer.

  Examples:
    >>> import tempfile, jax, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> opt = dmuon_jax.dmuon(0.02)
    >>> state = opt.init(params)

    Restored into an optimizer of another layout (owners over the axis
    ``'data'`` of a one-device mesh), the momentum is repacked for it:

    >>> mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
    >>> new_opt = dmuon_jax.dmuon(0.02, mesh=mesh, axis_names=('data',))
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   print(checkpoint.restore(directory, params, new_opt))  # no step yet
    ...   _ = checkpoint.save(directory, 3, params, state, opt=opt)
    ...   restored = checkpoint.restore(directory, params, new_opt)
    None
    >>> step, params, new_state = restored
    >>> step, params['layers_0']['w'].shape
    (3, (4, 8))
    >>> [layout.name[:12] for layout in dmuon_jax.owner_layouts(new_state)]
    ['dmuon_data1_']
  """
  targets = (params_like, opt, extra_like, dedication)
  return _restore('restore', directory, step, if_damaged, targets)


def _restore(where, directory, step, if_damaged, targets):
  """``restore`` (``where`` names the caller); ``targets`` are
  ``(params_like, opt, extra_like, dedication)``."""
  if if_damaged not in _IF_DAMAGED:
    raise ValueError(
      f'dmuon_jax checkpoint.{where}: {if_damaged=}; expected one of '
      f'{_IF_DAMAGED}.'
    )
  root = _checkpoint.check_directory(directory, where)
  steps = complete_steps(root)
  if step is not None:
    step = _checkpoint.as_step(step, where)
    if step not in steps:
      raise FileNotFoundError(
        f'dmuon_jax checkpoint.{where}: no complete step {step} under '
        f'{directory} (complete steps: {steps}).'
      )
  elif not steps:
    if _checkpoint.is_step(root):
      raise ValueError(
        f'dmuon_jax checkpoint.{where}: {str(root)!r} is the directory of '
        f'step {root.name}, not a checkpoint root. Pass its parent '
        f'{str(root.parent)!r} (the directory given to save), with '
        f'step={root.name} to restore this step.'
      )
    return None
  damaged = []  # An explicit step is never replaced by another one.
  for candidate in reversed(steps) if step is None else [step]:
    try:
      return _restore_step(root, candidate, steps, *targets)
    except CheckpointDamagedError as e:
      if if_damaged == 'raise' or step is not None:
        raise
      damaged.append(e)
      warnings.warn(
        f'dmuon_jax checkpoint.{where}: step {e.step} is damaged ({e.file} '
        'cannot be read); trying the next older complete step. Delete or '
        f'move {root / str(e.step)} once you no longer need it.',
        stacklevel=3,
      )
  raise CheckpointDamagedError(
    f'dmuon_jax checkpoint.{where}: every complete step under {root} is '
    'damaged: '
    + '; '.join(f'step {e.step}: {e.file}' for e in damaged)
    + '. There is nothing to restore: start from scratch (move the '
    'directory away first) or recover the files from a copy.',
    step=damaged[-1].step,
    file=damaged[-1].file,
    directory=root,
  ) from damaged[-1]


# A target leaf on the first device if it has no sharding.
_placed = functools.partial(_checkpoint.abstract_leaf, placed=True)


def _restore_step(root, step, steps, params_like, opt, extra_like, dedication):
  path = root / str(step) / 'default'

  def read(name=None, abstract=None):
    """The saved tree's metadata, or item ``name`` restored onto
    ``abstract``; orbax's failures on damaged files raise
    CheckpointDamagedError."""
    try:
      return _checkpoint.read(path, name, abstract)
    except Exception as e:  # orbax, TensorStore, json: whatever they raise
      _raise_if_damaged(root, step, steps, e)
      raise

  dp_like = params_like
  if isinstance(dp_like, _dedication.DedicatedParams):
    params_like = _checkpoint.dedicated_like(dp_like)
  saved = read()
  params_abs = jax.tree.map(_placed, params_like)
  _checkpoint.check_saved(saved, {'params': params_abs}, step)
  params = read('params', params_abs)
  if isinstance(dp_like, _dedication.DedicatedParams):
    params = _checkpoint.to_dedicated_like(params, dp_like)
  elif dedication is not None:
    params = dedication.to_dedicated(params)
  opt_state = None
  if opt is not None:
    target = _checkpoint.target_state(opt, params)
    abstract = _portable(target, abstract=True)
    _checkpoint.check_saved(saved, {'opt_state': abstract}, step)
    opt_state = state_from_portable(read('opt_state', abstract), target)
  if extra_like is None:
    return step, params, opt_state
  extra = read('extra', jax.tree.map(_placed, extra_like))
  return step, params, opt_state, extra


# ------------------------------------------------------------------ nnx


def save_nnx(
  directory,
  step: int,
  model,
  optimizer,
  *,
  max_to_keep: int | None = None,
  extra: dict | None = None,
) -> pathlib.Path:
  """Saves a Flax NNX model's params and its ``nnx.Optimizer`` state.

  The optimizer state is saved in portable form (restorable onto another
  mesh or layout with :func:`restore_nnx`), with ``optimizer.step``. It is
  checked against ``optimizer.tx`` first (as :func:`save` with ``opt=``).
  Nothing is written when an argument is rejected.

  Args:
    directory: the checkpoint root directory.
    step: the training step: a non-negative int, or an integer scalar such
      as ``optimizer.step[...]``.
    model: the ``nnx.Module``.
    optimizer: its ``nnx.Optimizer``.
    max_to_keep: keep only this many latest checkpoints (None: all).
    extra: optional tree of small arrays saved too.

  Returns:
    The step directory.

  Raises:
    TypeError: if ``step`` is not an integer (a bool, float or str).
    ValueError: if ``step`` is negative, or the optimizer's state is not a
      state of ``optimizer.tx`` on the model's params (names the leaves).

  Examples:
    >>> import tempfile, dmuon_jax
    >>> from flax import nnx
    >>> from dmuon_jax import checkpoint
    >>> model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, dmuon_jax.dmuon(0.02), wrt=nnx.Param)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   path = checkpoint.save_nnx(directory, 1, model, optimizer)
    ...   print(path.name, checkpoint.latest_step(directory))
    1 1
  """
  step = _checkpoint.as_step(step, 'save_nnx')
  _, params, opt_state, more = _nnx_tree(model, optimizer, extra)
  return save(
    directory,
    step,
    params,
    opt_state,
    opt=optimizer.tx,
    max_to_keep=max_to_keep,
    extra=more,
  )


def _nnx_tree(model, optimizer, extra):
  """What ``save_nnx`` saves (the targets of ``restore_nnx``): the model's
  params state, its pure dict, the pure optimizer state, and ``extra`` with
  ``optimizer.step``."""
  from flax import nnx  # flax is optional: lazily

  state = nnx.state(model, optimizer.wrt)
  more = {'optimizer_step': nnx.as_pure(optimizer.step)}
  if extra is not None:
    more['user'] = extra
  opt_state = nnx.as_pure(optimizer.opt_state)
  return state, nnx.to_pure_dict(state), opt_state, more


def restore_nnx(
  directory,
  model,
  optimizer,
  step: int | None = None,
  *,
  extra_like=None,
  if_damaged: Literal['raise', 'older'] = 'raise',
):
  """Restores :func:`save_nnx`'s checkpoint into a model and its optimizer.

  The model's params and the optimizer state are updated in place. The
  optimizer may be laid out differently from the one that saved (another
  mesh, TP setting or owner plan): its momentum is converted into this
  optimizer's layout.

  Args:
    directory: the checkpoint root directory given to :func:`save_nnx`. It
      must exist: an empty one means no checkpoint yet (returns None).
    model: the ``nnx.Module`` (its params give shapes and shardings).
    optimizer: its ``nnx.Optimizer``.
    step: the step to restore (default: the latest complete one). An
      explicit step is never replaced by another one.
    extra_like: the ``extra`` tree given to :func:`save_nnx`, as a target.
    if_damaged: ``'raise'`` (default) or ``'older'``: as in :func:`restore`.

  Returns:
    None if there is no complete checkpoint (nothing is updated), else the
    step restored (and ``extra`` when ``extra_like`` is given).

  Raises:
    FileNotFoundError: if ``directory`` does not exist or is not a
      directory, or ``step`` is given and not a complete checkpoint.
    CheckpointDamagedError: if the step's files cannot be read.
    ValueError: if the model or optimizer does not fit the checkpoint
      (names the leaves).
    TypeError: if ``step`` is not an integer.

  Examples:
    >>> import tempfile, jax.numpy as jnp, dmuon_jax
    >>> from flax import nnx
    >>> from dmuon_jax import checkpoint
    >>> model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, dmuon_jax.dmuon(0.02), wrt=nnx.Param)
    >>> saved = model.kernel[...]
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   _ = checkpoint.save_nnx(directory, 1, model, optimizer)
    ...   model.kernel[...] = jnp.zeros((4, 8))  # changed after the save
    ...   step = checkpoint.restore_nnx(directory, model, optimizer)
    >>> step, bool((model.kernel[...] == saved).all())
    (1, True)
  """
  from flax import nnx  # flax is optional: lazily

  state, *targets = _nnx_tree(model, optimizer, extra_like)
  got = _restore('restore_nnx', directory, step, if_damaged, (*targets, None))
  if got is None:
    return None
  step, params, opt_state, more = got
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  nnx.update(optimizer.opt_state, nnx.state(opt_state))
  optimizer.step.set_value(more['optimizer_step'])
  return step if extra_like is None else (step, more['user'])


# ------------------------------------------------------ damaged checkpoints


def _raise_if_damaged(root: pathlib.Path, step: int, steps: list[int], e):
  """Raises CheckpointDamagedError from orbax's failure ``e`` on the files
  of ``step``, unless nothing says the files are at fault."""
  step_dir = root / str(step)
  file = _checkpoint.damaged_file(step_dir, e)
  if file is None:
    return
  reason = (str(e).split(' [tensorstore_spec=')[0].splitlines() or [''])[0]
  reason = reason if len(reason) <= 300 else reason[:297] + '...'
  others = [s for s in steps if s != step]
  if not others:
    fix = (
      'There is no other complete step: recover the files from a copy or '
      'start from scratch'
    )
  else:
    fix = f'Restore another complete step ({others}) with step=N'
    if min(others) < step:
      fix += (
        ", or (without step=) pass if_damaged='older' to fall back to the "
        'newest undamaged one'
      )
  raise CheckpointDamagedError(
    f'dmuon_jax checkpoint: step {step} under {root} is damaged: {file} '
    f'cannot be read ({type(e).__name__}: {reason}). The step was '
    'committed, so its files changed after the save; this is not about '
    f'the targets it is restored onto. {fix}; delete or move {step_dir} '
    'so that later restores skip it.',
    step=step,
    file=file,
    directory=root,
  ) from e


__all__ = (
  'COMMIT_MARKER',
  'CheckpointDamagedError',
  'PortableDMuonState',
  'complete_steps',
  'latest_step',
  'restore',
  'restore_nnx',
  'save',
  'save_nnx',
  'state_from_portable',
  'state_to_portable',
)
