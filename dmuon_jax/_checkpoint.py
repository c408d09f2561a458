"""Mesh-independent checkpoints of dmuon optimizer states (orbax).

The Muon momentum of :func:`dmuon_jax.scale_by_dmuon` lives in flat owner
buffers whose layout depends on the mesh (the ownership plan). A portable
state replaces each :class:`dmuon_jax.ScaleByDMuonState` by a
:class:`PortableDMuonState` whose ``mu`` is a tree shaped like the Muon
params (one param-shaped array per Muon leaf, sharded like the param), and
leaves every other part of the state (counts, AdamW moments) as it is. A
portable state saved on one mesh restores on any other mesh, or on one
device: :func:`state_from_portable` packs the momentum into the owner
buffers of the optimizer it is given. Dedicated mode
(:func:`dmuon_jax.dedicated_muon`) works the same way with the
:class:`dmuon_jax.Dedication` passed along: its ``DedicatedMuonState``
becomes a :class:`PortableDMuonState` over the whole params tree
(``optax.MaskedNode`` for non-Muon leaves), and params are saved in param
layout.

The layouts are read by calling the optimizer's own ``init`` on the params
(eagerly, as in training) under ``_transform.recording_inits``, which
collects the owner layouts that ``scale_by_dmuon`` builds; so any
composition (``dmuon``, ``optax.chain``, ``optax.partition``, ...) works
without repeating its arguments.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dmuon_jax import _dedicated, _layout, _transform

COMMIT_MARKER = 'commit_success.txt'


class PortableDMuonState(NamedTuple):
  """Mesh-independent form of :class:`dmuon_jax.ScaleByDMuonState`."""
  count: jax.Array
  # The Muon targets' tree as scale_by_dmuon sees it (optax.MaskedNode for
  # leaves routed elsewhere), each target's momentum in its param's shape.
  mu: Any


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One ``ScaleByDMuonState``'s layout, as ``init`` built it."""
  layout: _layout.Layout
  treedef: Any                 # of the Muon subtree seen by scale_by_dmuon
  param_paths: tuple           # key path of each subtree leaf in params
  leaf_shapes: tuple           # full param shape of each subtree leaf
  split_dims: tuple            # per subtree leaf: TP-split dim or None
  buffer_shapes: tuple         # global mu buffer shapes
  tp_n: int


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_dmuon(x) -> bool:
  return isinstance(x, (_transform.ScaleByDMuonState, PortableDMuonState,
                        _dedicated.DedicatedMuonState))


def _need_dedication(dedication):
  if dedication is None:
    raise ValueError(
        'dmuon_jax checkpoint: this optimizer state holds a '
        'DedicatedMuonState (owner-stored momentum of dedicated_muon); pass '
        'the Dedication that laid it out as dedication=ded.')
  return dedication


def _portable_over_params(ded: _dedicated.Dedication, count, by_leaf):
  """A PortableDMuonState over the params tree: ``by_leaf[i]`` at each Muon
  target ``i``, ``optax.MaskedNode()`` at the other leaves."""
  leaves = [by_leaf.get(i, optax.MaskedNode())
            for i in range(ded.treedef.num_leaves)]
  return PortableDMuonState(count=count,
                            mu=jax.tree.unflatten(ded.treedef, leaves))


def _dedicated_to_portable(ded: _dedicated.Dedication,
                           st: _dedicated.DedicatedMuonState):
  """Owner-stored momentum -> params-shaped tree (MaskedNode elsewhere)."""
  ded.check_dedicated(_dedicated.DedicatedParams(owned=st.mu, rest=None),
                      'checkpoint')
  return _portable_over_params(
      ded, st.count, ded._unpack_targets(st.mu))  # pylint: disable=protected-access


def _dedicated_abstract(ded: _dedicated.Dedication,
                        st: _dedicated.DedicatedMuonState):
  return _portable_over_params(
      ded, st.count, ded._target_abstract(st.mu))  # pylint: disable=protected-access


def _dedicated_from_portable(ded: _dedicated.Dedication, portable,
                             target: _dedicated.DedicatedMuonState):
  want = ded._target_abstract(target.mu)  # pylint: disable=protected-access
  leaves = ded.treedef.flatten_up_to(portable.mu)
  for i, spec in want.items():
    got = tuple(np.shape(leaves[i]))
    if got != spec.shape:
      raise ValueError(
          f'dmuon_jax checkpoint: momentum of {ded._leaf_paths[i]!r} has '  # pylint: disable=protected-access
          f'shape {got}, but the dedication expects {spec.shape}.')
  owned = ded._pack_targets(leaves)  # pylint: disable=protected-access
  mu = tuple(tuple(jax.device_put(b.astype(t.dtype), t.sharding)
                   for b, t in zip(bufs, tgt))
             for bufs, tgt in zip(owned, target.mu))
  return _dedicated.DedicatedMuonState(
      count=_like(portable.count, target.count), mu=mu)


def _params_key(params):
  leaves, treedef = jax.tree.flatten(params)
  return treedef, tuple(
      (tuple(x.shape), str(x.dtype), str(getattr(x, 'sharding', None)))
      for x in leaves)


def _record_init(opt, params):
  """Runs ``opt.init(params)``; returns the state and one entry per state.

  The entries are cached for :func:`_entries` (per optimizer and params
  shapes, dtypes and shardings).

  Entries are in the order of the dmuon state leaves of the state
  (``jax.tree.leaves(state, is_leaf=_is_dmuon)``); None for a
  ``DedicatedMuonState`` (its layout is the Dedication's).
  """
  with _transform.recording_inits() as made:
    state = opt.init(params)

  by_param_path = {jax.tree_util.keystr(p): x for p, x in
                   jax.tree_util.tree_flatten_with_path(params)[0]}
  entries = []
  for leaf in jax.tree.leaves(state, is_leaf=_is_dmuon):
    if not _is_dmuon(leaf):
      continue
    if isinstance(leaf, _dedicated.DedicatedMuonState):
      entries.append(None)
      continue
    found = [(t, lay) for t, lay, s in made
             if s is leaf or s.mu is leaf.mu]
    if len(found) != 1:
      raise ValueError(
          'dmuon_jax checkpoint: cannot tell which layout built a '
          'ScaleByDMuonState of this optimizer state.')
    tree, layout = found[0]
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = tuple(jax.tree_util.keystr(p) for p, _ in path_leaves)
    missing = [p for p in paths if p not in by_param_path]
    if missing:
      raise ValueError(
          f'dmuon_jax checkpoint: Muon leaves {missing} are not params '
          '(scale_by_dmuon must see a subtree of the params).')
    shapes = tuple(tuple(by_param_path[p].shape) for p in paths)
    splits = []
    for (_, sub), full in zip(path_leaves, shapes):
      dims = [d for d, (a, b) in enumerate(zip(sub.shape, full)) if a != b]
      splits.append(dims[0] if dims else None)
    total = sum(int(s.shape[0]) for s in layout.global_shapes())
    got = sum(int(m.shape[0]) for m in leaf.mu)
    entries.append(_Entry(
        layout=layout, treedef=treedef, param_paths=paths,
        leaf_shapes=shapes, split_dims=tuple(splits),
        buffer_shapes=tuple(tuple(m.shape) for m in leaf.mu),
        tp_n=max(1, got // max(1, total))))
  _CACHE.setdefault(opt.init, {})[_params_key(params)] = entries
  return state, entries


def _entries(opt, params):
  """The layout entries of ``opt`` for ``params`` (cached per optimizer)."""
  key = _params_key(params)
  per_opt = _CACHE.get(opt.init)
  if per_opt is not None and key in per_opt:
    return per_opt[key]
  return _record_init(opt, params)[1]


def _unpack(entry: _Entry, mu):
  """Owner buffers -> param-shaped momentum (subtree leaf order)."""
  layout, tp_n = entry.layout, entry.tp_n
  if tp_n == 1:
    leaves = layout.unpack_full(mu)
  else:
    shards = []
    for t in range(tp_n):
      bufs = [b.reshape(layout.num_slots, tp_n, -1)[:, t].reshape(-1)
              for b in mu]
      shards.append(layout.unpack_full(bufs))
    leaves = [
        shards[0][i] if d is None else jnp.concatenate(
            [s[i] for s in shards], axis=d)
        for i, d in enumerate(entry.split_dims)]
  out = [None] * len(leaves)
  for spec, x in zip(layout.plan.leaves, leaves):
    out[spec.leaf_index] = x
  return out


def _pack(entry: _Entry, leaves, dtypes):
  """Param-shaped momentum (subtree leaf order) -> owner buffers."""
  layout, tp_n = entry.layout, entry.tp_n
  ordered = [leaves[spec.leaf_index] for spec in layout.plan.leaves]
  if tp_n == 1:
    bufs = layout.pack_full(ordered)
    return tuple(b.astype(d) for b, d in zip(bufs, dtypes))
  per_t = []
  for t in range(tp_n):
    sliced = []
    for x, spec in zip(ordered, layout.plan.leaves):
      d = entry.split_dims[spec.leaf_index]
      if d is not None:
        size = x.shape[d] // tp_n
        x = jax.lax.slice_in_dim(x, t * size, (t + 1) * size, axis=d)
      sliced.append(x)
    per_t.append(layout.pack_full(sliced))
  return tuple(
      jnp.stack([p[g].reshape(layout.num_slots, -1) for p in per_t], axis=1)
      .reshape(-1).astype(dtypes[g]) for g in range(layout.num_groups))


def _param_shardings(params, entry: _Entry):
  by_path = {jax.tree_util.keystr(p): x for p, x in
             jax.tree_util.tree_flatten_with_path(params)[0]}
  return [getattr(by_path[p], 'sharding', None) for p in entry.param_paths]


def _replicated(xs, mesh=None):
  """Each array fully replicated on ``mesh`` (default: its own mesh).

  The conversion is a static gather/scatter of whole matrices; doing it on
  replicated copies keeps it valid under explicit-axis sharding types.
  ``mesh`` moves arrays that live elsewhere (e.g. params restored onto one
  device for an optimizer on a mesh) to the mesh of the output buffers.
  """
  out = []
  for x in xs:
    sharding = getattr(x, 'sharding', None)
    target = mesh if mesh is not None else getattr(sharding, 'mesh', None)
    if isinstance(target, jax.sharding.Mesh):
      x = jax.device_put(x, jax.sharding.NamedSharding(
          target, jax.sharding.PartitionSpec()))
    out.append(x)
  return out


def _map_dmuon(state, fn):
  """Replaces each (portable) dmuon state leaf ``x`` by ``fn(i, x)``."""
  leaves, treedef = jax.tree.flatten(state, is_leaf=_is_dmuon)
  out, i = [], 0
  for x in leaves:
    if _is_dmuon(x):
      x = fn(i, x)
      i += 1
    out.append(x)
  return jax.tree.unflatten(treedef, out)


def state_to_portable(opt: optax.GradientTransformation, params,
                      opt_state, *, dedication=None):
  """Returns ``opt_state`` with mesh-independent Muon momentum.

  Args:
    opt: the optimizer that made ``opt_state`` (its mesh is the current one).
    params: the params ``opt_state`` belongs to (placed as in training;
      :class:`dmuon_jax.DedicatedParams` for :func:`dmuon_jax.dedicated_muon`).
    opt_state: the optimizer state.
    dedication: the :class:`dmuon_jax.Dedication` of a
      :func:`dmuon_jax.dedicated_muon` state (None for ``dmuon``).

  Returns:
    ``opt_state`` with each :class:`dmuon_jax.ScaleByDMuonState` (or
    ``DedicatedMuonState``) replaced by a :class:`PortableDMuonState`: the
    momentum of each Muon target in its param's shape (sharded like the
    param for ``dmuon``, replicated for dedicated states). Everything else
    is unchanged.
  """
  has_scale = any(isinstance(x, _transform.ScaleByDMuonState)
                  for x in jax.tree.leaves(opt_state, is_leaf=_is_dmuon))
  entries = _entries(opt, params) if has_scale else None

  def one(i, st):
    if isinstance(st, _dedicated.DedicatedMuonState):
      return _dedicated_to_portable(_need_dedication(dedication), st)
    entry = entries[i]
    if tuple(tuple(m.shape) for m in st.mu) != entry.buffer_shapes:
      raise ValueError(
          'dmuon_jax checkpoint: opt_state does not belong to this optimizer '
          f'and params (momentum buffers {[m.shape for m in st.mu]}, '
          f'expected {entry.buffer_shapes}).')
    shardings = [s if isinstance(s, jax.sharding.Sharding) else None
                 for s in _param_shardings(params, entry)]
    devices = st.mu[0].sharding.device_set if st.mu else None
    # Unpacked where the buffers live, then moved to params elsewhere.
    outs = [s if s is not None and s.device_set == devices else None
            for s in shardings]
    leaves = jax.jit(lambda mu: _unpack(entry, mu), out_shardings=outs)(
        tuple(_replicated(st.mu)))
    leaves = [x if o is not None or s is None else jax.device_put(x, s)
              for x, o, s in zip(leaves, outs, shardings)]
    return PortableDMuonState(
        count=st.count, mu=jax.tree.unflatten(entry.treedef, leaves))

  return _map_dmuon(opt_state, one)


def state_from_portable(opt: optax.GradientTransformation, params,
                        portable, *, target_state=None, dedication=None):
  """Builds ``opt``'s state (for its mesh) from a portable state.

  Args:
    opt: the optimizer to continue with (possibly another mesh than the one
      that saved ``portable``).
    params: the params on that mesh (concrete arrays, placed as in training).
    portable: a tree from :func:`state_to_portable` (or :func:`restore`).
    target_state: optional ``opt.init(params)``, if already computed.
    dedication: for :func:`dmuon_jax.dedicated_muon`, the
      :class:`dmuon_jax.Dedication` on the target mesh (``params`` are then
      its :class:`dmuon_jax.DedicatedParams`).

  Returns:
    An optimizer state for ``opt``: momentum packed into its owner buffers
    (sharded as ``opt.init`` shards them), every other leaf placed with the
    sharding ``opt.init`` gives it.
  """
  if target_state is None:
    target_state, entries = _record_init(opt, params)
  else:
    entries = _entries(opt, params)
  targets = [x for x in jax.tree.leaves(target_state, is_leaf=_is_dmuon)
             if _is_dmuon(x)]

  def one(i, st):
    entry, target = entries[i], targets[i]
    if isinstance(target, _dedicated.DedicatedMuonState):
      return _dedicated_from_portable(_need_dedication(dedication), st,
                                      target)
    leaves = jax.tree.leaves(st.mu)
    shapes = tuple(tuple(x.shape) for x in leaves)
    if shapes != entry.leaf_shapes:
      raise ValueError(
          'dmuon_jax checkpoint: portable momentum shapes '
          f'{shapes} do not match the Muon params {entry.leaf_shapes}.')
    dtypes = [m.dtype for m in target.mu]
    outs = tuple(m.sharding for m in target.mu)
    mesh = getattr(outs[0], 'mesh', None) if outs else None
    mu = jax.jit(lambda xs: _pack(entry, xs, dtypes), out_shardings=outs)(
        _replicated(leaves, mesh))
    count = _like(st.count, target.count)
    return _transform.ScaleByDMuonState(count=count, mu=tuple(mu))

  converted = _map_dmuon(portable, one)
  # Non-dmuon leaves: onto the target's shardings and dtypes.
  conv_leaves = jax.tree.leaves(converted, is_leaf=_is_dmuon)
  tgt_leaves = jax.tree.leaves(target_state, is_leaf=_is_dmuon)
  if len(conv_leaves) != len(tgt_leaves):
    raise ValueError('dmuon_jax checkpoint: the portable state does not '
                     'match the structure of opt.init(params).')
  out = []
  for x, t in zip(conv_leaves, tgt_leaves):
    if not _is_dmuon(x):
      if tuple(np.shape(x)) != tuple(t.shape):
        raise ValueError(
            f'dmuon_jax checkpoint: state leaf of shape {np.shape(x)} where '
            f'the optimizer expects {t.shape}.')
      x = _like(x, t)
    out.append(x)
  return jax.tree.unflatten(jax.tree.structure(target_state,
                                               is_leaf=_is_dmuon), out)


def _like(x, target):
  """``x`` with ``target``'s dtype and placement (uncommitted if it is)."""
  if not getattr(target, 'committed', True):
    return jnp.asarray(np.asarray(x), target.dtype)
  return jax.device_put(jnp.asarray(x, target.dtype), target.sharding)


def _abstract(tree):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, 'sharding', None)),
      tree)


def portable_abstract(opt: optax.GradientTransformation, params,
                      target_state=None, dedication=None):
  """``jax.ShapeDtypeStruct`` tree of the portable state for ``params``.

  Shapes, dtypes and shardings (on the params' mesh) that
  :func:`state_to_portable` would give; used as an orbax restore target.
  """
  if target_state is None:
    target_state, entries = _record_init(opt, params)
  else:
    entries = _entries(opt, params)

  def one(i, st):
    if isinstance(st, _dedicated.DedicatedMuonState):
      return _dedicated_abstract(_need_dedication(dedication), st)
    entry = entries[i]
    shardings = _param_shardings(params, entry)
    group_dtype = [None] * len(entry.leaf_shapes)
    for u, leaf in enumerate(entry.layout.unit_leaf):
      spec = entry.layout.plan.leaves[leaf]
      group_dtype[spec.leaf_index] = st.mu[entry.layout.unit_group[u]].dtype
    leaves = [jax.ShapeDtypeStruct(shape, dt, sharding=s) for shape, dt, s
              in zip(entry.leaf_shapes, group_dtype, shardings)]
    return PortableDMuonState(count=st.count,
                              mu=jax.tree.unflatten(entry.treedef, leaves))

  return _abstract(_map_dmuon(target_state, one)), target_state


# ----------------------------------------------------------------- orbax


def _ocp():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover
    raise ImportError('dmuon_jax checkpoints need orbax-checkpoint: '
                      'pip install orbax-checkpoint') from e
  return ocp


def complete_steps(directory) -> list[int]:
  """Steps under ``directory`` whose save completed (sorted).

  A step counts only if its directory name is an integer and holds orbax's
  commit marker (``commit_success.txt``, written just before the atomic
  rename of the temporary directory, or as the last file on file systems
  without atomic rename). Temporary (``*.orbax-checkpoint-tmp-*``) or
  unfinished step directories are ignored.
  """
  path = pathlib.Path(directory)
  if not path.is_dir():
    return []
  steps = []
  for child in path.iterdir():
    if child.is_dir() and child.name.isdigit() and (
        child / COMMIT_MARKER).is_file():
      steps.append(int(child.name))
  return sorted(steps)


def latest_step(directory) -> int | None:
  """The latest complete step under ``directory``, or None."""
  steps = complete_steps(directory)
  return steps[-1] if steps else None


def save(directory, step: int, params, opt_state,
         opt: optax.GradientTransformation, *, max_to_keep: int | None = None,
         extra: dict | None = None,
         dedication: _dedicated.Dedication | None = None) -> pathlib.Path:
  """Saves params and a portable optimizer state as step ``step``.

  Blocks until the checkpoint is committed (orbax writes into a temporary
  directory and renames it, so a killed save leaves no complete step).

  Args:
    directory: the checkpoint root directory (created if missing).
    step: the training step.
    params: the params (any sharding; saved as global arrays), or the
      :class:`dmuon_jax.DedicatedParams` of dedicated mode (saved in param
      layout, via ``dedication.to_params``).
    opt_state: ``opt``'s state for ``params``.
    opt: the optimizer.
    max_to_keep: keep only this many latest checkpoints (None: all).
    extra: optional tree of small arrays saved too (e.g. a data RNG key).
    dedication: the :class:`dmuon_jax.Dedication` of dedicated mode (with
      :func:`dmuon_jax.dedicated_muon`); None for ``dmuon``.

  Returns:
    The step directory.
  """
  ocp = _ocp()
  directory = pathlib.Path(os.path.abspath(directory))
  portable = state_to_portable(opt, params, opt_state, dedication=dedication)
  if isinstance(params, _dedicated.DedicatedParams):
    params = _need_dedication(dedication).to_params(params)
  tree = {'params': params, 'opt_state': portable}
  if extra is not None:
    tree['extra'] = extra
  with ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep, create=True,
          enable_async_checkpointing=False)) as manager:
    manager.save(step, args=ocp.args.StandardSave(tree), force=True)
    manager.wait_until_finished()
  return directory / str(step)


def _place_like(like):
  sharding = getattr(like, 'sharding', None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)


def restore(directory, params_like, opt: optax.GradientTransformation | None,
            step: int | None = None, *, extra_like=None,
            dedication: _dedicated.Dedication | None = None):
  """Restores the latest (or ``step``) complete checkpoint.

  Args:
    directory: the checkpoint root directory.
    params_like: tree of arrays or ``jax.ShapeDtypeStruct`` giving the target
      shapes, dtypes and shardings of the params (any mesh, or one device:
      leaves without a sharding go to the first device).
    opt: the optimizer to continue with, made for the target mesh; None to
      restore the params only.
    step: the step to restore (default: the latest complete one).
    extra_like: the ``extra`` tree given to :func:`save`, as a target.
    dedication: for dedicated mode, the :class:`dmuon_jax.Dedication` made
      on the target mesh (``params_like`` is still the plain params tree);
      the params come back as its :class:`dmuon_jax.DedicatedParams`.

  Returns:
    None if there is no complete checkpoint, else
    ``(step, params, opt_state)`` (``opt_state`` None without ``opt``), plus
    ``extra`` as a fourth element when ``extra_like`` is given.

  Raises:
    ValueError: if ``params_like`` (or ``opt``'s state) differs from the
      saved tree: names the leaves missing, added, or of another shape.
    FileNotFoundError: if ``step`` is given and not a complete checkpoint.
  """
  if step is None:
    step = latest_step(directory)
    if step is None:
      return None
  elif step not in complete_steps(directory):
    raise FileNotFoundError(
        f'dmuon_jax checkpoint: no complete step {step} under {directory}.')
  path = pathlib.Path(os.path.abspath(directory)) / str(step) / 'default'
  if isinstance(params_like, _dedicated.DedicatedParams):
    raise TypeError(
        'dmuon_jax checkpoint: restore() takes params_like as the plain '
        'params tree (checkpoints hold params in param layout); pass '
        'dedication= to get DedicatedParams back.')
  saved = _saved_tree(path)
  params_abs = jax.tree.map(_place_like, params_like)
  _check_saved(saved, {'params': params_abs}, step)
  # Params first: opt.init needs concrete, placed params.
  params = _partial_restore(path, {'params': params_abs})['params']
  if dedication is not None:
    params = dedication.to_dedicated(params)
  opt_state = None
  extra = None
  if opt is not None:
    abstract, target_state = portable_abstract(opt, params,
                                               dedication=dedication)
    _check_saved(saved, {'opt_state': abstract}, step)
    portable = _partial_restore(path, {'opt_state': abstract})['opt_state']
    opt_state = state_from_portable(opt, params, portable,
                                    target_state=target_state,
                                    dedication=dedication)
  if extra_like is not None:
    extra = _partial_restore(
        path, {'extra': jax.tree.map(_place_like, extra_like)})['extra']
    return step, params, opt_state, extra
  return step, params, opt_state


def _saved_tree(path):
  """The saved tree's array metadata (orbax), as nested containers."""
  ocp = _ocp()
  with ocp.PyTreeCheckpointer() as ckptr:
    meta = ckptr.metadata(path)
  meta = getattr(meta, 'item_metadata', meta)
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


def _check_saved(saved, wanted, step) -> None:
  """Raises unless every array of ``wanted`` was saved with its shape."""
  top = next(iter(wanted))
  have = _shapes_by_path({top: saved.get(top)} if isinstance(saved, dict)
                         else saved)
  have = {p: s for p, s in have.items() if p.split('/')[0] == top}
  want = _shapes_by_path(wanted)
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  shapes = sorted(f'{p}: saved {have[p]}, target {want[p]}'
                  for p in set(want) & set(have) if have[p] != want[p])
  if not (missing or extra or shapes):
    return
  what = ('params' if top == 'params' else
          "optimizer state (in its mesh-independent form)")
  parts = []
  if shapes:
    parts.append('different shapes: ' + '; '.join(shapes[:8]))
  if missing:
    parts.append('not in the checkpoint: ' + ', '.join(missing[:8]))
  if extra:
    parts.append('in the checkpoint but not in the target: '
                 + ', '.join(extra[:8]))
  fix = ('Build params_like from the model config the checkpoint was saved '
         'with (same tree, same shapes).' if top == 'params' else
         'Make the optimizer as when saving (same Muon routing and '
         'transformations), or pass opt=None to restore the params only.')
  raise ValueError(
      f'dmuon_jax checkpoint: step {step} does not fit the {what} it is '
      f'restored onto: {" | ".join(parts)}. {fix}')


def _partial_restore(path, abstract):
  """Restores the top-level items of ``abstract`` from a saved tree."""
  ocp = _ocp()
  with ocp.PyTreeCheckpointer() as ckptr:
    return ckptr.restore(
        path, args=ocp.args.PyTreeRestore(
            item=abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(
                abstract),
            partial_restore=True))
