"""A hook boundary's call on its gather group's matrices: the NNX boundary
modules' hooks and the Linen method interceptor of ``ded.apply``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import unfreeze
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checks, _exchange, _gather, _mesh
from dmuon_jax.flax import _model
from dmuon_jax.flax._model import ModelDedication, OwnedBuffer, ScanIteration


def split_args(args, kwargs):
  """``(arrays, nodes, rebuild)``: the call's array leaves, the NNX graph
  nodes among its arguments (an ``nnx.Rngs`` or a module passed in: they
  flow through the gathered call as state, so what the call does to them
  is kept), and ``rebuild(arrays, nodes) -> (args, kwargs)``."""
  is_node = lambda x: isinstance(x, nnx.Pytree)
  is_array = lambda x: isinstance(x, (jax.Array, np.ndarray))
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
  arrays = [x for x in leaves if is_array(x)]
  nodes = tuple(x for x in leaves if is_node(x))

  def rebuild(arrs, new_nodes=()):
    arrs, new_nodes = iter(arrs), iter(new_nodes)
    full = [
      next(arrs) if is_array(x) else next(new_nodes) if is_node(x) else x
      for x in leaves
    ]
    return jax.tree.unflatten(treedef, full)

  return arrays, nodes, rebuild


def warn_once(md: ModelDedication, message: str, stacklevel: int) -> None:
  """Warns ``message`` unless this model warned already (``md.warned``)."""
  if not md.warned[0]:
    md.warned[0] = True
    warnings.warn(message, _checks.DMuonWarning, stacklevel=stacklevel + 1)


LIFTED_BOUNDARY_MSG = (
  'dmuon: the dedicated boundary {name!r} runs inside a transform of its '
  'own ({transforms} around the boundary module or its call: a trace of '
  'its own per block), so each of its gather group {group} blocks gathers '
  'the group again: the numbers are right, but the step moves one '
  'reduce-scatter (Z3: and all-gather) per block instead of one per group '
  "({blocks} blocks, up to {blocks}x the Muon gradient bytes of the plan's"
  ' floor). Apply the transform inside the block, to its submodules (e.g. '
  '{inside} in the block), rather than to the boundary module, or dedicate '
  'with layers_per_gather=1; for the memory of the gathered matrices, '
  'reshard_after_forward=True frees them after the forward and re-gathers '
  'each group once in the backward pass.'
)

# LIFTED_BOUNDARY_MSG's transforms and its fix, for NNX and for Linen.
_LIFTED_BY = (
  ('nnx.remat, nnx.jit, nnx.vmap ...', 'nnx.remat around its MLP'),
  (
    'a Flax lifted transform: nn.remat, nn.jit, nn.vmap ...',
    'nn.remat(nn.Dense)',
  ),
)


def gathered(
  md: ModelDedication,
  b: int,
  local,
  iteration,
  run,
  state,
  arrays,
  *,
  whole=None,
  remat: bool = False,
):
  """``run(mats, state, arrays)`` with boundary ``b``'s group gathered.

  Inside :func:`train_step` (manual owner axes; the TP axis, if any, stays
  automatic: the gathers run per TP shard, ``_gather.on_tp_shards``, each
  target sharded over it as the param was), or under plain ``jit`` on
  Explicit owner axes with the input split over them (typed ``reduced``,
  see ``_gather.materialize``): the owners' own route, the group gathered
  once per trace (see :func:`_trace_cache`). Z2 keeps the gathered group;
  Z3 re-gathers it once in the backward pass (token-tied) and
  reduce-scatters once (through a sink), except inside a rematerialization
  of the model's own (``remat``), which recomputes the gather. Elsewhere
  on a mesh: a sharding constraint gathers (GSPMD; warned once).

  Args:
    whole: the group's whole buffers (a Linen stack's, all its layers'),
      whose being tracers says whether the model runs under a
      transformation of the step (``jit``); None: ``local`` (an eager
      call's scan body traces its slices too).
    remat: whether the call runs inside a rematerialization of the model's
      own (a Flax ``nn.remat`` around the block or its stack), which
      recomputes the gather in the backward pass: the plain gather is then
      Z3's traffic (one all-gather forward, one in the backward pass, one
      reduce-scatter), and Z3's own re-gather would only add a third
      all-gather; Z2 warns that it is moving Z3's bytes.
  """
  ded = md.dedication
  g = _gather.group_of(ded, b)
  name = ded.boundaries.names[b]
  layout, n, z3 = ded.layout, ded.num_slots, ded.reshard_after_forward
  traced = any(isinstance(x, jax.core.Tracer) for x in whole or local)
  if remat and layout.distributed and not z3 and traced:
    warnings.warn(
      f'dmuon: the dedicated boundary {name!r} runs inside a Flax nn.remat '
      '(around the block or its nn.scan stack), which recomputes its '
      'gathered matrices in the backward pass: with '
      "reshard_after_forward=False (Z2) it moves Z3's bytes, "
      f'3({n}-1)/{n} x the Muon bytes per step instead of 2({n}-1)/{n}, '
      "and holds Z3's memory. Pass reshard_after_forward=True (what nn.remat "
      'gives: no third gather), or keep Z2 and take nn.remat off the block '
      '(remat inside it, e.g. nn.remat around its attention).',
      _checks.DMuonWarning,
      stacklevel=4,
    )
  if ded.boundaries.scanned[b]:  # one layer per iteration: drop its axis
    run_layer = run
    run = lambda mats, *a: run_layer({i: m[0] for i, m in mats.items()}, *a)
  owners = set(ded.buffer_axes)
  manual = layout.distributed and owners <= _gather.manual_axes()
  routed, reduce_on = manual, None
  if layout.distributed and not manual and traced:
    # The reduced gather's cotangent is a per-device partial sum: jax types
    # a weight ``reduced`` only where the contraction forming its gradient
    # runs over exactly the owner axes, so an input must be split over
    # every one of them on dimensions that contraction sums: not on a float
    # input's last (feature) dimension, which a layer contracts with its
    # weight in the forward pass and keeps in the weight's gradient (jax:
    # "unreduced axes should be equal to the contracting specs").
    xs = [x for x in jax.tree.leaves(arrays) if np.ndim(x) >= 1]
    summed = lambda x: (
      x.ndim - 1
      if x.ndim > 1 and jnp.issubdtype(x.dtype, jnp.inexact)
      else x.ndim
    )
    split = lambda x: _mesh.sharded_axes(
      [P(*tuple(_mesh.type_spec(x))[: summed(x)])]
    )
    reduced = _exchange.reduced_route(ded, f'the dedicated boundary {name!r}')
    over = set(ded.reduced_axes)  # (an owner axis of size 1 splits nothing)
    hits = [split(x) for x in xs if over <= split(x)] if reduced else []
    routed = bool(hits)
    # Typed reduced over the owner axes that split the input, so over every
    # owner axis of more than one device, and over the axes of size 1 that
    # the input's type spells there (jax compares the contraction's axes as
    # spelled: a (1, 8) mesh's 'replicate' in a batch split over
    # ('replicate', 'shard'), an owner axis or not).
    spelled, sizes = (hits[0] if hits else set()), ded.mesh.shape
    ones = [a for a in sizes if sizes[a] == 1 and a not in ded.buffer_axes]
    reduce_on = tuple(a for a in (*ded.buffer_axes, *ones) if a in spelled)
    if not routed:
      message = _unrouted(ded, name, reduced, xs)
      warn_once(md, message, stacklevel=4 if reduced else 3)
  if not routed:
    # The boundaries of a group constrain the same buffers: XLA gathers them
    # once and keeps them (Z2 memory: a re-gather per boundary would move
    # the group again for each of its blocks).
    if layout.distributed:
      local = [_mesh.place(x, ded.mesh, P()) for x in local]
    return run(layout.unpack_group(g, local, iteration), state, arrays)

  entry, store = _trace_cache(md, g, b, local, iteration, manual)
  mode = 'tp' if manual else 'reduced'
  if manual and entry is None:  # the group's first block
    local = _gather.after_inputs(local, arrays)
  on = None if manual else reduce_on  # (the reduced gather's axes)
  gather = lambda x, it, s=None: _gather.materialize(
    ded, g, x, it, s, mode, reduced=on
  )
  first = lambda: _gather.gather_replicate(ded, local, mode)
  if not z3 or remat:
    if entry is None:
      entry = gather(first(), iteration)
      store(entry)
    return run(entry, state, arrays)
  sink = lambda: _gather.gather_sink(ded, g, local, iteration, mode, reduced=on)
  x, s, token = entry or (first(), sink(), _gather.new_token())
  run_z3 = lambda x, s, it, *args: run(gather(x, it, s), *args)
  last = b == ded.groups[g][-1] or ded.boundaries.scanned[b]
  # (jax's errors on the reduced types surface in the re-gather's backward)
  explain = functools.partial(
    explain_annotation, axes=on, mesh=ded.mesh, boundary=name
  )
  tied = _gather.regather_group_in_backward(
    run_z3,
    ded.remat_policy,
    last=last,
    blocks=[name],
    routed=True,
    explain=None if manual else explain,
  )
  out, token = tied(x, token, s, iteration, state, arrays)
  store((x, s, token))
  return out


def _unrouted(ded, name: str, reduced: bool, xs) -> str:
  """The warning of a boundary that ran under plain ``jit`` gathering with
  GSPMD: its input not split over the owner axes (``reduced``: the route
  applies there; ``xs``: its arrays), or not on the owners' route at all."""
  n, z3 = ded.num_slots, ded.reshard_after_forward
  if reduced:
    typed = str(jax.typeof(xs[0])) if xs else 'no array'
    message = (
      f'dmuon: the dedicated boundary {name!r} ran under jax.jit/nnx.jit '
      f'on an input typed {typed}, not split over the owner axes '
      f'{ded.reduced_axes} on its batch dimensions (an owner axis on the '
      'feature dimension does not count: the weight gradients keep it): '
      'its matrices were gathered with GSPMD, and a gradient '
      'through them is all-reduced (3(N-1)/N x the Muon bytes instead of '
      'the reduce-scatter floor). Shard the batch over the owner axes, '
      'e.g. jax.device_put(batch, NamedSharding(mesh, P(ded.axes))), or '
      'use dmuon_jax.flax.train_step(ded), which does (evaluation on a '
      'replicated batch is otherwise fine).'
    )
  else:
    message = (
      'dmuon: a dedicated model ran under plain jax.jit/nnx.jit (outside '
      'dmuon_jax.flax.train_step). It computes the same numbers, but XLA '
      'reduces the Muon gradients with an all-reduce rather than the '
      "owners' reduce-scatter: an all-gather forward and an all-reduce "
      f'backward, 3({n}-1)/{n} x the Muon bytes per step'
      + (
        " (the Z3 floor's bytes), but the gathered weights are kept for "
        'the backward (Z2 memory) and every device holds all Muon gradients'
        if z3
        else f' instead of the Z2 floor 2({n}-1)/{n}'
      )
      + '. Decorate the train step with @dmuon_jax.flax.train_step('
      'dedication) instead of jax.jit/nnx.jit to get the floor (evaluation '
      'outside it is fine).'
    )
  return message


def _trace_cache(md: ModelDedication, g: int, b: int, local, iteration, manual):
  """``(entry, store)``: group ``g``'s cached gather in the running trace
  (``None`` if its buffers were not gathered in it yet), and a function
  that records a new one (for block ``b``).

  Keyed by the trace and the buffers themselves (kept alive by the entry):
  a tracer id of a finished trace (a scan body traced twice) may come
  again, and a block under a lifted transform of its own (nn.remat) runs
  in a trace of its own, where another block's gather is unknown. So that
  a group's blocks, and a block called twice, share one gather and one
  reduce-scatter.

  ``manual``: inside :func:`train_step` (``md.gathered_manual``); else
  (``md.gathered``) warns :data:`LIFTED_BOUNDARY_MSG` (once per model)
  where block ``b`` of a group of several blocks misses the group in its
  trace while another block of the group was the first to gather it in the
  trace just before: a transform of its own around each block
  (``nnx.remat(lambda block, x: block(x))``, a Flax ``nn.remat`` around the
  boundary module), so the group is gathered and reduce-scattered per
  block. A new trace of the whole model (an evaluation step, a step traced
  again) starts with the block that started the one before: no warning.
  """
  trace = jax.extend.core.get_opaque_trace_state(convention='nnx')
  cache = md.gathered_manual if manual else md.gathered
  if cache.get('trace') != trace:  # per group: (buffers, gather, block)
    old = {k: v[2] for k, v in cache.get('groups', {}).items()}
    cache.update(trace=trace, groups={}, previous=old)
  keys = (*local, iteration)
  hit = cache['groups'].get(g)
  entry = hit[1] if hit and all(x is y for x, y in zip(hit[0], keys)) else None
  # The block whose call gathered the group in this trace (Z3's later
  # blocks store the group again: the gatherer stays the first).
  first = b if entry is None else hit[2]
  ded = md.dedication
  blocks = len(ded.groups[g])
  previous = cache['previous'].get(g)
  if not manual and entry is None and blocks > 1 and previous not in (None, b):
    transforms, inside = _LIFTED_BY[md.linen_model is not None]
    name = ded.boundaries.names[b]
    message = LIFTED_BOUNDARY_MSG.format(
      name=name, group=g, blocks=blocks, transforms=transforms, inside=inside
    )
    warn_once(md, message, stacklevel=3)

  def store(value):
    cache['groups'][g] = (keys, value, first)

  return entry, store


_MANUAL_AXIS_ERRORS = (
  'can only refer to Auto axes',
  'Manual axes',
  'manual axes',
  # reshard / out_sharding= (dot_general, ...) naming a manual axis:
  'of type Auto or Manual',
  'AxisType.Manual',
  # An annotation's NamedSharding over the concrete (Auto) mesh.
  '`manual_axis_type`',
)


# jax's rule for a weight typed ``reduced`` (the reduced gather): the
# contraction forming its gradient must run over exactly those axes.
_UNREDUCED_ERROR = 'unreduced axes should be equal to the contracting specs'


class OwnerAxisAnnotationError(ValueError):
  """A sharding annotation of the user's step names a manual owner axis
  (:func:`explain_annotation`): ``train_step`` runs that step under plain
  ``jit`` instead."""


def explain_annotation(
  err: Exception, axes: Sequence[str], mesh, boundary: str | None = None
) -> None:
  """Re-raises JAX's error for a sharding annotation that meets dmuon's
  own types with what to do about it; returns for any other error.

  Inside :func:`dmuon_jax.flax.train_step`: an annotation naming a manual
  owner axis (on ``mesh`` the owner ``axes`` are Explicit or not). Under
  plain ``jit`` (``boundary``: the dedicated boundary whose matrices are
  gathered typed ``reduced`` over ``axes``, the owner axes of more than
  one device): a weight's gradient contracted over other axes than those
  (an activation split over an owner axis on its feature dimension).
  """
  text = str(err)
  if _UNREDUCED_ERROR in text:
    raise ValueError(
      f'dmuon: the dedicated boundary {boundary!r} ran under plain '
      f'jax.jit/nnx.jit with its matrices gathered typed reduced over the '
      f'owner axes {tuple(axes)} (each device holds a partial sum of their '
      'gradients, reduce-scattered onto the owners), and jax needs the '
      "contraction forming each weight's gradient to run over exactly "
      'those axes; one ran over others. An activation inside the boundary '
      "split over an owner axis on a dimension the weight's gradient keeps "
      "(its feature dimension, e.g. P('data', None, 'seq') with 'seq' an "
      'owner axis) does this. Split activations over the owner axes on '
      'their batch (or sequence) dimensions only, as P(ded.axes) splits '
      'the batch, or leave that axis out of the owners (dedicate(..., '
      f'axis_names=...) without it). JAX said: {text.splitlines()[0]}'
    ) from err
  kinds = dict(zip(mesh.axis_names, mesh.axis_types)) if axes else {}
  explicit = axes and all(kinds[a].name == 'Explicit' for a in axes)
  route = (
    'On this mesh the owner axes are Explicit: a plain nnx.jit/jax.jit step'
    ' keeps every annotation'
    if explicit
    else 'To keep them, make the owner axes Explicit (jax.make_mesh(..., '
    'axis_types=(jax.sharding.AxisType.Explicit,) * n)), dedicate on that '
    'mesh and use a plain nnx.jit/jax.jit step'
  ) + ' (see the guide, "Your own jit step").'
  names_axis = any(s in text for s in _MANUAL_AXIS_ERRORS) and any(
    a in text for a in axes
  )
  # An error that only a manual axis raises, whose text names no axis:
  # jax's NotImplementedError for a Manual -> Auto/Explicit conversion
  # (nnx.Embed's out_sharding= runs its lookup in jax.sharding.auto_axes).
  if names_axis or 'from `Manual` AxisType' in text:
    raise OwnerAxisAnnotationError(
      f'dmuon: a sharding annotation inside the step names an owner axis '
      f'of {tuple(axes)}, which dmuon_jax.flax.train_step runs manually '
      '(each device runs the model on its own share of the batch). Leave '
      "those axes out of the model's activation annotations "
      '(with_sharding_constraint, out_sharding=, e.g. a sharding config '
      'without the data-parallel axis); annotations over the other mesh '
      f'axes keep working. {route} JAX said: {text.splitlines()[0]}'
    ) from err


@dataclasses.dataclass(frozen=True)
class Hook:
  """What a hooked NNX boundary module serves: a static attribute of the
  module (``dmuon_hook``), so that copies made by ``nnx.merge`` (inside a
  transform, a ``train_step``) serve it too (no registry).

  Attributes:
    md: the model's dedication.
    boundary: the boundary's index.
    running: True on the copy that a call of the boundary runs on: its
      methods called inside that call run as written.
  """

  md: ModelDedication
  boundary: int
  running: bool = False

  def __repr__(self) -> str:
    name = self.md.dedication.boundaries.names[self.boundary]
    return f'<dmuon hook of boundary {name!r}>'

  def __deepcopy__(self, memo: dict) -> Hook:
    # A deep copy of the model (copy.deepcopy) serves the same dedication.
    return self


@functools.cache
def hooked_class(cls: type) -> type:
  """``cls`` whose ``__call__`` and the public methods it adds to
  ``nnx.Module`` (``Embed.attend``, a block's helper: each may read the
  Muon targets) gather the boundary's matrices first (a method called
  inside another runs as written)."""
  if getattr(cls, '_dmuon_base', None) is not None:
    return cls

  def hook(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
      if self.dmuon_hook.running:
        return original(self, *args, **kwargs)
      return _boundary_call(self, original, args, kwargs)

    return method

  attrs = {}
  for klass in cls.__mro__:
    if klass is nnx.Module or not issubclass(klass, nnx.Module):
      break
    for name, fn in vars(klass).items():
      public = name == '__call__' or not (
        name.startswith('_') or hasattr(nnx.Module, name)
      )
      if public and inspect.isfunction(fn) and name not in attrs:
        attrs[name] = hook(fn)
  attrs.update(
    __module__=cls.__module__, __qualname__=cls.__qualname__, _dmuon_base=cls
  )
  return type(cls.__name__, (cls,), attrs)


def _boundary_call(module, original, args, kwargs):
  hook = module.dmuon_hook
  md, b = hook.md, hook.boundary
  ded = md.dedication
  name, scanned = ded.boundaries.names[b], ded.boundaries.scanned[b]
  count = ded.layout.groups[_gather.group_of(ded, b)].num_groups
  local = [
    getattr(module, f'dmuon_owned_{j}').get_value() for j in range(count)
  ]
  if scanned and local[0].ndim != 1:
    raise ValueError(
      f'dmuon: the scanned stack {name!r} was called as a whole; call it '
      'through nnx.scan over its layer axis (one layer per iteration), as '
      'without dedication.'
    )
  iteration = module.dmuon_iteration.get_value() if scanned else None
  mine = md.targets[b]
  full = [
    r for _, r in mine if np.size(_model.node_at(module, r).get_raw_value())
  ]
  if full and not md.reading_whole[0]:  # (train_step's: see _step.body)
    raise ValueError(
      f'dmuon: the Muon target(s) {[name + "/" + _model.text(r) for r in full]} of '
      'this dedicated model hold whole arrays: a plain (not dedicated) '
      'state was written into it (e.g. a checkpoint of the model before '
      'dmuon_jax.flax.dedicate). Restore plain checkpoints into a plain '
      'model and dedicate it after, or save and restore the dedicated '
      'state (nnx.state(model)).'
    )
  # The owned buffers stay out of the state that flows through the call:
  # every boundary of a group then sees the same buffer values.
  # The placeholders neither (the call sets the gathered matrices there):
  # where train_step put the whole matrices in them, those would be kept
  # alive as the call's inputs.
  owned_filter = (OwnedBuffer, ScanIteration)
  arrays, nodes, rebuild = split_args(args, kwargs)
  graphdef, fixed, holes, state = nnx.split(
    (module, nodes), owned_filter, _model.DedicatedWeight, ...
  )
  fixed = jax.tree.map(jax.lax.stop_gradient, fixed)
  holes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((0,), x.dtype), holes)

  def run(mats, state, arrays):
    # A copy: the module's own variables may belong to an outer trace (the
    # rest of a functional step's nnx.split, merged inside its jax.grad).
    empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), holes)
    m, new_nodes = nnx.merge(graphdef, fixed, empty, state, copy=True)
    for i, rel in mine:
      _model.node_at(m, rel).set_value(mats[i])
    a, kw = rebuild(arrays, new_nodes)
    m.dmuon_hook = dataclasses.replace(hook, running=True)  # this copy's
    out = original(m, *a, **kw)
    # Only what the call changed flows out and is written back (nnx.jit's
    # rule too): a variable of an outer trace can't be written from inside.
    old = {p: v.get_raw_value() for p, v in nnx.to_flat_state(state)}
    kept = nnx.Not((*owned_filter, _model.DedicatedWeight))  # (gathered)
    new = nnx.to_flat_state(nnx.state((m, new_nodes), kept))
    changed = [(p, v) for p, v in new if v.get_raw_value() is not old[p]]
    return out, nnx.from_flat_state(changed)

  out, new_state = gathered(md, b, local, iteration, run, state, arrays)
  nnx.update((module, nodes), new_state)
  return out


# A scanned stack's layer indices, beside its owned buffers in the params
# (added by ModelDedication.apply; nn.scan slices them with the layers).
ITERATION = 'dmuon_iteration'


@dataclasses.dataclass(frozen=True)
class _Unboxed:
  """A Linen initializer whose Flax box is taken off (see
  :meth:`_Interceptor._fixed`)."""

  init: Callable[..., Any]

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return _mesh.unbox(self.init(*args, **kwargs))


@dataclasses.dataclass
class _Interceptor:
  """The method interceptor of one ``ded.apply`` call: runs a boundary
  module's method (``__call__`` or any other: a ``decode``, an ``attend``)
  on its group's gathered matrices.

  Attributes:
    md: the dedication.
    root: the call's (unboxed) params, where the owned buffers are read.
    inner: how many boundary calls are running (their blocks' own
      submodules run as written).
  """

  md: ModelDedication
  root: Any
  inner: int = 0

  def _fixed(self, module):
    """``module`` rebound to its scope with what the call needs, or None.

    ``nn.DenseGeneral`` whose kernel exists: its kernel initializer's Flax
    box taken off. DenseGeneral boxes its initializer's flat 2-D kernel and
    unboxes it with the kernel's N-D partition names before reshaping, and
    Flax runs that initializer again at every call to check the existing
    param's shape (flax issue #3676). Under a mesh context
    (``train_step``'s shard_map is one; so is ``jax.set_mesh``) the
    unboxing is a sharding constraint that fails: too many names for the
    flat kernel, or a manual owner axis. The param exists, so the
    initializer only serves that shape check: it runs unboxed (same shape).

    ``nn.BatchNorm`` without an ``axis_name`` inside ``train_step`` (manual
    owner axes): the owner axes as its ``axis_name``, so that its
    statistics are the global batch's (a pmean of the devices' equal
    shares), as under ``jax.jit``.
    """
    axes, init = self.md.axes, getattr(module, 'kernel_init', None)
    if isinstance(module, nn.DenseGeneral) and not isinstance(init, _Unboxed):
      if module.has_variable('params', 'kernel'):
        return module.clone(parent=module.scope, kernel_init=_Unboxed(init))
    norm = isinstance(module, nn.BatchNorm) and module.axis_name is None
    if norm and axes and set(axes) <= _gather.manual_axes():
      return module.clone(parent=module.scope, axis_name=tuple(axes))
    return None

  def __call__(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if method == 'setup':
      return next_fun(*args, **kwargs)
    fixed = self._fixed(module)
    if fixed is not None:
      return getattr(fixed, method)(*args, **kwargs)
    md, path = self.md, tuple(module.path)
    skip = isinstance(module, nn.DenseGeneral) or self.inner
    if skip or path not in md.boundary_paths:
      return next_fun(*args, **kwargs)
    b = md.boundary_paths.index(path)
    ded = md.dedication
    bufs = ded.layout.split_groups(md.buffer_paths)[_gather.group_of(ded, b)]
    local, iteration = None, None
    if ded.boundaries.scanned[b]:
      local, iteration = _one_layer(md, b, module, len(bufs))
    # The group's whole buffers (a scanned stack's: all its layers'): they
    # say whether the model runs under jit (an eager call's nn.scan traces
    # its body, and so the slices, too).
    whole = [_mesh.unbox(_model.node_at(self.root, p)) for p in bufs]
    cols = {c: unfreeze(module.variables[c]) for c in module.variables}
    owned = lambda k: str(k).startswith('dmuon_owned_') or k == ITERATION
    sub = {k: v for k, v in cols.pop('params', {}).items() if not owned(k)}
    mutable = [c for c in cols if module.is_mutable_collection(c)]
    rngs = {name: module.make_rng(name) for name in module.scope.rngs}
    arrays, _, rebuild = split_args(args, kwargs)

    def run(mats, state, arrays):
      p, others, keys = state  # (p: the dict made below, rebuilt by jax)
      for i, rel in md.targets[b]:
        _model.set_at(p, rel, mats[i])
      a, kw = rebuild(arrays)
      self.inner += 1
      try:  # (mutable=[]: the output and no updates)
        return module.clone(parent=None).apply(
          {'params': p, **others},
          *a,
          rngs=keys,
          mutable=mutable,
          method=method,
          **kw,
        )
      finally:
        self.inner -= 1

    out, updates = gathered(
      md,
      b,
      local or whole,
      iteration,
      run,
      (sub, cols, rngs),
      arrays,
      whole=whole,
      remat=_lifted(module, 'remat'),
    )
    for c, tree in updates.items():
      for name, value in tree.items():
        module.put_variable(c, name, value)
    return out


def _lifted(module, transform: str) -> bool:
  """Whether ``module`` runs inside the Flax lifted ``transform``
  (``'remat'``, ``'scan'``; around it or a parent): Flax's lifted
  transforms name themselves in their scopes' ``debug_path``
  (``('remat(scan(layers))',)`` for ``nn.scan(nn.remat(Block))``)."""
  path = getattr(module.scope, 'debug_path', ())
  return any(f'{transform}(' in str(s) for s in path)


def _one_layer(md, b: int, module, count: int) -> tuple[list, Any]:
  """A scanned stack's owned buffers and layer index as ``nn.scan`` sliced
  them for this iteration (one layer each); raises where they were not
  sliced (the module ran outside ``nn.scan``, or ``nn.scan`` broadcast its
  params instead of slicing them) or another transform sliced them."""
  name = md.dedication.boundaries.names[b]
  where = _model.text(md.boundary_paths[b])
  own = module.variables.get('params', {})
  local = [own.get(f'dmuon_owned_{j}') for j in range(count)]
  iteration = own.get(ITERATION)
  if any(x is None for x in local) or iteration is None:
    raise ValueError(
      f'dmuon: the scanned stack {name!r} ran without its owned buffers '
      f'(module {where!r}): call the model through ded.apply with the '
      'dedicated params of dedicate_linen.'
    )
  if np.ndim(iteration) != 0 or any(np.ndim(x) != 1 for x in local):
    raise ValueError(
      f'dmuon: the scanned stack {name!r} gathers in module {where!r} (the '
      'deepest one holding all its Muon matrices), which ran on all its '
      'layers at once (its owned buffer has shape '
      f'{tuple(np.shape(local[0]))}, with the layer axis). dedicate_linen '
      'runs a stack one layer per iteration of the nn.scan that made it '
      "(variable_axes={'params': 0} slices its params): call "
      f'{where!r} through that nn.scan, as when its params were '
      'initialized. Two nn.scan stacks under one top-level module meet '
      'there: give each a top-level module of its own, or leave one of '
      'them to AdamW (muon_weight_dimension_numbers None for its kernels).'
    )
  if not _lifted(module, 'scan'):
    raise ValueError(
      f'dmuon: the scanned stack {name!r} runs one layer at a time under '
      f'{"/".join(module.scope.debug_path)!r}, not nn.scan: dedicate_linen '
      'runs stacked layers made by nn.scan (one gather per iteration). '
      'Leave these matrices to AdamW (muon_weight_dimension_numbers None '
      'for them), or use the drop-in dmuon_jax.dmuon.'
    )
  return local, iteration


@dataclasses.dataclass(frozen=True, eq=False)
class LinenDedication(ModelDedication):
  """A :class:`ModelDedication` of a Linen model (:func:`dedicate_linen`),
  with its ``apply``."""

  @property
  def apply(self) -> LinenApply:
    """``linen_model.apply`` with the boundaries gathering (see
    :attr:`ModelDedication.apply`)."""
    return LinenApply(self)


@dataclasses.dataclass(frozen=True, repr=False)
class LinenApply:
  """``ded.apply`` of a Linen ``ModelDedication``: ``linen_model.apply``
  with the boundaries gathering; a callable that compares (and hashes) as
  its dedication does, where a bound method would compare its dedication
  by identity."""

  md: ModelDedication

  def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
    md = self.md
    ded = md.dedication
    # Flax boxes come off here: unboxing inside the model would constrain
    # each value to its names, which train_step's manual owner axes refuse
    # (the arrays are placed already).
    params = unfreeze(
      jax.tree.map(_mesh.unbox, variables['params'], is_leaf=_mesh.is_box)
    )
    # Each scanned stack's layer indices, dmuon_iteration = arange(layers),
    # beside its owned buffers: nn.scan slices them with the layers, so
    # each iteration knows which owners hold its matrices (they rotate by
    # one slot per layer). Made here, they are no param of the TrainState:
    # nothing differentiates or updates them.
    for b, scanned in enumerate(ded.boundaries.scanned):
      if scanned:
        n = ded.layout.iterations[_gather.group_of(ded, b)]
        where = md.boundary_paths[b] + (ITERATION,)
        _model.set_at(params, where, jnp.arange(n, dtype=jnp.int32))
    with nn.intercept_methods(_Interceptor(md, params)):
      return md.linen_model.apply(
        {**variables, 'params': params}, *args, **kwargs
      )

  def __repr__(self) -> str:
    model = type(self.md.linen_model).__name__
    n = len(self.md.dedication.boundaries.names)
    return f'<ded.apply of a dedicated {model}, {n} boundaries>'
