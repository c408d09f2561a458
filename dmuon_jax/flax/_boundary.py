"""A hook boundary's call on its gather group's matrices (NNX and Linen),
and the NNX boundary modules' hooks."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from dmuon_jax import _checks, _exchange, _gather, _mesh
from dmuon_jax.flax import _model
from dmuon_jax.flax._model import ModelDedication, OwnedBuffer, ScanIteration


def split_args(args, kwargs):
  """``(arrays, nodes, rebuild)``: the call's array leaves, the NNX graph
  nodes among its arguments (an ``nnx.Rngs`` or a module passed in: they
  flow through the gathered call as state, so what the call does to them
  is kept), and ``rebuild(arrays, nodes) -> (args, kwargs)``."""
  leaves, treedef = jax.tree.flatten(
    (args, kwargs), is_leaf=lambda x: isinstance(x, nnx.Pytree)
  )
  kind = [
    'array'
    if isinstance(x, (jax.Array, np.ndarray))
    else 'node'
    if isinstance(x, nnx.Pytree)
    else None
    for x in leaves
  ]
  arrays = [x for x, k in zip(leaves, kind) if k == 'array']
  nodes = tuple(x for x, k in zip(leaves, kind) if k == 'node')
  static = [None if k else x for x, k in zip(leaves, kind)]

  def rebuild(arrs, new_nodes=()):
    it = {'array': iter(arrs), 'node': iter(new_nodes)}
    full = [next(it[k]) if k else s for s, k in zip(static, kind)]
    return jax.tree.unflatten(treedef, full)

  return arrays, nodes, rebuild


def gathered(
  md: ModelDedication,
  b: int,
  local,
  iteration,
  run,
  state,
  arrays,
  *,
  traced: bool | None = None,
  remat: bool = False,
):
  """``run(mats, state, arrays)`` with boundary ``b``'s group gathered.

  Inside :func:`train_step` (manual owner axes): Z2 gathers the group at
  its first call and reuses it; Z3 re-gathers in the backward pass once per
  group (token-tied) and reduce-scatters once (through a sink). Under plain
  ``jit`` on Explicit owner axes: the reduced gather (see
  :func:`_reduced_call`). Elsewhere on a mesh: a sharding constraint
  gathers (GSPMD; warned once).

  Args:
    traced: whether the model runs under a transformation of the step
      (``jit``); None: whether ``local`` are tracers (an eager call's scan
      body traces them too, so a Linen stack says).
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
  scanned = ded.boundaries.scanned[b]
  layout = ded.layout
  manual = layout.distributed and set(ded.buffer_axes) <= (
    _gather.manual_axes()
  )
  if traced is None:
    traced = any(isinstance(x, jax.core.Tracer) for x in local)
  cache = md.gathered_manual
  # Keyed by the trace and the buffers themselves (kept alive by the
  # entry): a tracer id of a finished trace (a scan body traced twice) may
  # come again, and a block under a lifted transform of its own (nn.remat)
  # runs in a trace of its own, where another block's gather is unknown.
  keys = (jax.extend.core.get_opaque_trace_state(convention='nnx'), *local)
  z3 = ded.reshard_after_forward
  if remat and layout.distributed and not z3 and traced:
    _warn_remat_z2(md, name)
  hit = cache.get(g)
  same = hit is not None and len(hit[0]) == len(keys) and hit[0][0] == keys[0]
  same = same and all(a is b for a, b in zip(hit[0][1:], keys[1:]))
  hit = hit[1:] if same else None
  if manual and hit is None:  # the group's first block
    local = _gather.after_inputs(local, arrays)
  if scanned:  # one layer per iteration: drop the group's layer axis
    run_layer = run
    run = lambda mats, *a: run_layer({i: m[0] for i, m in mats.items()}, *a)
  if not layout.distributed:
    mats = layout.unpack_group(g, local, iteration)
    return run(mats, state, arrays)
  # Inside train_step the TP axis (if any) stays automatic: the gathers
  # run per TP shard (``_gather.on_tp_shards``), each target sharded over
  # it as the param was.
  if manual and (not z3 or remat):
    if hit is not None:
      (mats,) = hit
    else:
      rep = _gather.gather_replicate(ded, local, 'tp')
      mats = _gather.materialize(ded, g, rep, iteration, mode='tp')
      cache[g] = (keys, mats)
    return run(mats, state, arrays)
  if manual:
    if hit is not None:
      rep, sink, token = hit
    else:
      rep = _gather.gather_replicate(ded, local, 'tp')
      sink = _gather.gather_sink(ded, g, local, mode='tp')
      token = _gather.new_token()
    out, token = _regathered(
      ded,
      b,
      lambda x, it, s: _gather.materialize(ded, g, x, it, s, 'tp'),
      run,
      (rep, token, sink, iteration, state, arrays),
    )
    cache[g] = (keys, rep, sink, token)
    return out
  if traced:
    _exchange.check_tp_axis_type(ded, f'the dedicated boundary {name!r}')
  if _exchange.reduced_route(ded) and traced:
    if _sharded_over(arrays, ded.buffer_axes):
      return _reduced_call(
        md, b, local, iteration, run, state, arrays, remat=remat
      )
    _warn_unsharded(md, name, arrays)
  else:
    _warn_bare(md, traced)

  # The boundaries of a group constrain the same buffers: XLA gathers them
  # once and keeps them (Z2 memory: a re-gather per boundary would move the
  # group again for each of its blocks).
  full = [_mesh.place(x, ded.mesh, P()) for x in local]
  return run(layout.unpack_group(g, full, iteration), state, arrays)


def _regathered(ded, b: int, materialize, run, operands):
  """``run(mats, *rest)`` on boundary ``b``'s group gathered by
  ``materialize(local, iteration, sink)`` and gathered again in the
  backward pass once per group (Z3); ``operands``: ``(local, token, sink,
  iteration, *rest)``. Returns ``(out, token)``."""
  g = _gather.group_of(ded, b)

  def run_z3(local, sink, iteration, *rest):
    return run(materialize(local, iteration, sink), *rest)

  return _gather.regather_group_in_backward(
    run_z3,
    ded.remat_policy,
    last=b == ded.groups[g][-1] or ded.boundaries.scanned[b],
    blocks=[ded.boundaries.names[b]],
    routed=True,
  )(*operands)


def _sharded_over(arrays, axes: Sequence[str]) -> bool:
  """Whether the boundary's array inputs are split over every owner axis
  (the reduced gather's cotangent is a per-device partial sum: jax types a
  weight ``reduced`` only where its contraction runs over those axes)."""

  named = lambda x: _mesh.sharded_axes([_mesh.type_spec(x)])
  leaves = jax.tree.leaves(arrays)
  return any(set(axes) <= named(x) for x in leaves if np.ndim(x) >= 1)


def _warn_unsharded(md: ModelDedication, name: str, arrays) -> None:
  if md.warned[0]:
    return
  md.warned[0] = True
  xs = [x for x in jax.tree.leaves(arrays) if np.ndim(x) >= 1]
  typed = str(jax.typeof(xs[0])) if xs else 'no array'
  warnings.warn(
    f'dmuon: the dedicated boundary {name!r} ran under jax.jit/nnx.jit on '
    f'an input typed {typed}, not split over the owner axes '
    f'{md.axes}: its matrices were gathered with GSPMD, and a gradient '
    'through them is all-reduced (3(N-1)/N x the Muon bytes instead of '
    'the reduce-scatter floor). Shard the batch over the owner axes, '
    'e.g. jax.device_put(batch, NamedSharding(mesh, P(ded.axes))), or '
    'use dmuon_jax.flax.train_step(ded), which does (evaluation on a '
    'replicated batch is otherwise fine).',
    _checks.DMuonWarning,
    stacklevel=5,
  )


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


def warn_lifted(md: ModelDedication, name: str, g: int, linen: bool) -> None:
  """The :data:`LIFTED_BOUNDARY_MSG` warning for group ``g``'s block
  ``name`` (Linen's or NNX's transforms named)."""
  warnings.warn(
    LIFTED_BOUNDARY_MSG.format(
      name=name,
      group=g,
      blocks=len(md.dedication.groups[g]),
      transforms=(
        'a Flax lifted transform: nn.remat, nn.jit, nn.vmap ...'
        if linen
        else 'nnx.remat, nnx.jit, nnx.vmap ...'
      ),
      inside='nn.remat(nn.Dense)' if linen else 'nnx.remat around its MLP',
    ),
    _checks.DMuonWarning,
    stacklevel=5,
  )


def _trace_cache(md: ModelDedication, g: int, b: int, local, iteration):
  """``(entry, store)``: group ``g``'s cached gather in the running trace
  (``None`` if its buffers were not gathered in it yet), and a function
  that records a new one (for block ``b``).

  Warns (once per model) where block ``b`` of a group of several blocks
  misses the group in its trace while another block of the group gathered
  it in the trace just before: a transform of its own around each block
  (``nnx.remat(lambda block, x: block(x))``), so the group is gathered and
  reduce-scattered per block.
  """
  trace = jax.extend.core.get_opaque_trace_state(convention='nnx')
  cache = md.gathered
  if cache.get('trace') != trace:
    previous = cache.get('blocks', {})
    cache.clear()
    cache.update(trace=trace, blocks={}, previous=previous)
  keys = (*local, iteration)
  hit = cache.get(g)
  entry = None
  if hit is not None and all(a is b for a, b in zip(hit[0], keys)):
    entry = hit[1]
  ded = md.dedication
  before = cache['previous'].get(g)
  if (
    entry is None
    and before is not None
    and before != b
    and len(ded.groups[g]) > 1
    and not md.warned[0]
  ):
    md.warned[0] = True
    warn_lifted(
      md, ded.boundaries.names[b], g, linen=md.linen_model is not None
    )

  def store(value):
    cache[g] = (keys, value)
    cache['blocks'][g] = b

  return entry, store


def _reduced_call(
  md: ModelDedication, b: int, local, iteration, run, *args, remat=False
):
  """:func:`gathered` under plain ``jit`` on Explicit owner axes: the
  group's buffers gathered typed ``reduced`` (see
  ``_gather.materialize``), once per trace; Z3 re-gathers once per group
  in the backward pass (inside a rematerialization of the model's own,
  ``remat``, that one recomputes the gather)."""
  ded = md.dedication
  g = _gather.group_of(ded, b)
  entry, store = _trace_cache(md, g, b, local, iteration)
  if not ded.reshard_after_forward or remat:
    if entry is None:
      entry = _gather.materialize(ded, g, local, iteration, mode='reduced')
      store(entry)
    return run(entry, *args)
  sink, token = entry or (
    _gather.gather_sink(ded, g, local, iteration, 'reduced'),
    _gather.new_token(),
  )
  out, token = _regathered(
    ded,
    b,
    lambda x, it, s: _gather.materialize(ded, g, x, it, s, 'reduced'),
    run,
    (local, token, sink, iteration, *args),
  )
  store((sink, token))
  return out


def _warn_remat_z2(md: ModelDedication, name: str) -> None:
  n = md.dedication.num_slots
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
    stacklevel=5,
  )


def _warn_bare(md: ModelDedication, traced: bool) -> None:
  if md.warned[0] or not traced:
    return
  md.warned[0] = True
  n = md.dedication.num_slots
  z3 = md.dedication.reshard_after_forward
  warnings.warn(
    'dmuon: a dedicated model ran under plain jax.jit/nnx.jit (outside '
    'dmuon_jax.flax.train_step). It computes the same numbers, but XLA '
    "reduces the Muon gradients with an all-reduce rather than the owners'"
    f' reduce-scatter: an all-gather forward and an all-reduce backward, '
    f'3({n}-1)/{n} x the Muon bytes per step'
    + (
      " (the Z3 floor's bytes), but the gathered weights are kept for the "
      'backward (Z2 memory) and every device holds all Muon gradients'
      if z3
      else f' instead of the Z2 floor 2({n}-1)/{n}'
    )
    + '. Decorate the train step with @dmuon_jax.flax.train_step(dedication)'
    ' instead of jax.jit/nnx.jit to get the floor (evaluation outside it '
    'is fine).',
    _checks.DMuonWarning,
    stacklevel=4,
  )


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
  """``cls`` whose ``__call__`` and public methods gather the boundary's
  matrices first (a method called inside another runs as written)."""
  if getattr(cls, '_dmuon_base', None) is not None:
    return cls

  def hook(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
      if self.dmuon_hook.running:
        return original(self, *args, **kwargs)
      return _boundary_call(self, original, args, kwargs)

    return method

  attrs = {
    name: hook(getattr(cls, name)) for name in _model.public_methods(cls)
  }
  return type(
    cls.__name__,
    (cls,),
    {
      **attrs,
      '__module__': cls.__module__,
      '__qualname__': cls.__qualname__,
      '_dmuon_base': cls,
    },
  )


def _boundary_call(module, original, args, kwargs):
  hook = module.dmuon_hook
  md, b = hook.md, hook.boundary
  ded = md.dedication
  g = _gather.group_of(ded, b)
  name = ded.boundaries.names[b]
  scanned = ded.boundaries.scanned[b]
  count = len(ded.layout.group_buffers(ded.layout.buffer_index, g))
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
  holes = {rel: _model.node_at(module, rel).get_raw_value() for _, rel in mine}
  full = [rel for rel, x in holes.items() if np.size(x)]
  holes = {rel: (tuple(x.shape), x.dtype) for rel, x in holes.items()}
  if full:
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
  owned_filter = (OwnedBuffer, ScanIteration)
  arrays, nodes, rebuild = split_args(args, kwargs)
  graphdef, fixed, state = nnx.split((module, nodes), owned_filter, ...)
  fixed = jax.tree.map(jax.lax.stop_gradient, fixed)

  def run(mats, state, arrays):
    m, new_nodes = nnx.merge(graphdef, fixed, state)
    for i, rel in mine:
      _model.node_at(m, rel).set_value(mats[i])
    a, kw = rebuild(arrays, new_nodes)
    m.dmuon_hook = dataclasses.replace(hook, running=True)  # this copy's
    out = original(m, *a, **kw)
    for _, rel in mine:
      _model.node_at(m, rel).set_value(jnp.zeros(*holes[rel]))
    return out, nnx.state((m, new_nodes), nnx.Not(owned_filter))

  out, new_state = gathered(md, b, local, iteration, run, state, arrays)
  nnx.update((module, nodes), new_state)
  return out
