"""The optimizer and the compiled train step of dmuon_jax.flax."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _alias,
  _gather,
  _mesh,
)
from dmuon_jax.flax import _boundary, _model
from dmuon_jax.flax._model import ModelDedication


def dedicated_muon(
  dedication: ModelDedication,
  learning_rate: optax.ScalarOrSchedule,
  **kwargs: Any,
) -> optax.GradientTransformation:
  """:func:`dmuon_jax.dedicated_muon` for a model dedicated by
  :func:`dedicate`, on its ``nnx.Param`` state.

  Use as ``nnx.Optimizer(model, dedicated_muon(ded, ...), wrt=nnx.Param)``:
  the :class:`OwnedBuffer` variables get the owners' Muon update (no
  communication), every other ``nnx.Param`` AdamW.

  Args:
    dedication: the :class:`ModelDedication`.
    learning_rate: as for :func:`dmuon_jax.dmuon`.
    **kwargs: every other argument of :func:`dmuon_jax.dedicated_muon`.

  Returns:
    A ``optax.GradientTransformation`` over the model's param state; two
    made with equal arguments (equal dedications) compare equal, as a
    ``TrainState``'s ``tx`` made in ``jax.eval_shape`` and again in
    ``jax.jit`` must.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> optimizer = nnx.Optimizer(
    ...     model, dflax.dedicated_muon(ded, learning_rate=0.02), wrt=nnx.Param)
    >>> import dmuon_jax
    >>> [layout.kind for layout in dmuon_jax.owner_layouts(optimizer.opt_state)]
    ['dedicated']
  """
  core = _alias.dedicated_muon(dedication.dedication, learning_rate, **kwargs)
  args = (learning_rate, tuple(sorted(kwargs.items())))
  return optax.GradientTransformation(
    *(_ModelMuon(m, dedication, args, core) for m in ('init', 'update'))
  )


def _same_leaf(x: Any, y: Any) -> bool:
  """Whether two leaves of factory arguments are the same value (concrete
  arrays by their contents; tracers, and anything ``==`` cannot tell, only
  where identical)."""
  if x is y:
    return True
  if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
    return False
  if hasattr(x, 'shape') or hasattr(y, 'shape'):
    # Unequal shapes: array_equal says False.
    return np.result_type(x) == np.result_type(y) and np.array_equal(x, y)
  try:
    return bool(x == y)
  except Exception:  # no verdict: not the same value
    return False


@dataclasses.dataclass(frozen=True, eq=False)
class _ModelMuon:
  """``init`` or ``update`` (``method``) of :func:`dedicated_muon`'s
  optimizer over a dedicated model's params.

  A callable equal for equal arguments (the dedication by value; a bound
  method would compare its ``self`` by identity): a trainer's init that
  builds it, traced twice (``jax.eval_shape``, then ``jax.jit``), gives
  one ``TrainState.tx``, which JAX compares as pytree metadata.
  """

  method: str
  md: ModelDedication
  args: tuple[Any, tuple[tuple[str, Any], ...]]  # learning rate, kwargs
  core: optax.GradientTransformation

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, _ModelMuon):
      return NotImplemented
    (a, tree_a), (b, tree_b) = map(jax.tree.flatten, (self.args, other.args))
    same = (self.method, self.md, tree_a) == (other.method, other.md, tree_b)
    return same and all(map(_same_leaf, a, b))

  def __hash__(self) -> int:
    return hash(self.md)

  def __call__(self, *args: Any) -> Any:
    return getattr(self, self.method)(*args)

  def init(self, params: Any) -> Any:
    # Linen boxes and nnx Variables kept (optax's moments keep them, the
    # owner momentum takes the owned buffers'), so that Flax's sharding
    # tools read the state's shardings as they read the params'
    # (nnx.Optimizer turns the Variables into OptVariables with their
    # metadata). Unboxed, an NNX trainer's out_shardings read from an
    # abstract optimizer (jax.eval_shape) replicated the momentum.
    return self.core.init(self.md.dedicated(params, 'init()', boxes=True))

  def update(self, updates: Any, state: Any, params: Any = None) -> Any:
    md = self.md
    u, new_state = self.core.update(
      md.dedicated(updates, 'update()'),
      jax.tree.map(_mesh.unbox, state, is_leaf=_mesh.is_box),
      None if params is None else md.dedicated(params, 'update()'),
    )
    # The updates by path, as they came in (boxes kept); the state's boxes
    # (from init) kept.
    new = dict(zip(md.rest_paths, md.dedication.treedef.flatten_up_to(u.rest)))
    new.update(zip(md.buffer_paths, u.owned.buffers))

    def pick(keys, x):
      p = _model.path(keys)
      if p in md.placeholder_paths:
        return jnp.zeros_like(_mesh.unbox(x))
      return _mesh.rebox(x, new[p]) if _mesh.is_box(x) else new[p]

    return (
      jax.tree_util.tree_map_with_path(pick, updates, is_leaf=_mesh.is_box),
      jax.tree.map(_mesh.rebox, state, new_state, is_leaf=_mesh.is_box),
    )


def _named(x: Any) -> NamedSharding | None:
  """``x``'s sharding if it is placed on a mesh (a ``NamedSharding``)."""
  sharding = getattr(x, 'sharding', None)
  return sharding if isinstance(sharding, NamedSharding) else None


def _drop(spec: P, axes: Sequence[str]) -> list[tuple[str, ...]]:
  """``spec``'s entries without ``axes``."""
  return [
    tuple(a for a in e if a not in axes) for e in _mesh.spec_entries(spec)
  ]


def _manual_spec(x: Any, axes: Sequence[str]) -> P:
  """The PartitionSpec ``x`` (or an array's) restricted to the manual
  ``axes``."""
  x = x if isinstance(x, P) else getattr(_named(x), 'spec', P())
  entries = [tuple(a for a in e if a in axes) for e in _mesh.spec_entries(x)]
  while entries and not entries[-1]:
    entries.pop()
  return _mesh.entries_spec(entries)


def _node_positions(args) -> tuple[int, ...]:
  """The positions of the NNX graph nodes among ``args``. Raises for graph
  nodes inside a container argument (a list or dict of metrics): those
  would be copied in and their updates lost."""
  is_node = lambda x: isinstance(x, nnx.Pytree)
  for k, a in enumerate(args):
    leaves = [] if is_node(a) else jax.tree.leaves(a, is_leaf=is_node)
    if nested := sorted({type(x).__name__ for x in leaves if is_node(x)}):
      raise TypeError(
        f'dmuon: argument {k} of the train step holds NNX graph nodes '
        f'({", ".join(nested)}) inside a {type(a).__name__}, whose updates '
        'train_step would lose (as nnx.jit, it updates graph nodes passed '
        'as arguments themselves): pass each one as an argument of its own.'
      )
  return tuple(k for k, a in enumerate(args) if is_node(a))


def _settle(x, spec: P, axes: Sequence[str], what: str):
  """``x`` varying only where ``spec`` shards it: averaged over the other
  manual axes (e.g. batch statistics computed on each device's batch)."""
  varying = _gather.varying_axes(x) - _mesh.sharded_axes([spec])
  extra = tuple(a for a in axes if a in varying)
  if not extra:
    return x
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jax.lax.pmean(x, extra)
  raise ValueError(
    f'dmuon: {what} differs between the devices of {extra} after the step '
    f'(an integer {x.dtype} value); train_step can only average floats. '
    'Compute it from values that are the same on every device.'
  )


def _output_sources(out, treedef, is_state, of: Sequence, default) -> list:
  """Per output leaf: ``of``'s entry (per argument leaf, ``treedef``'s:
  the graph nodes' state, then the other arguments) for the leaf of the
  state argument it has the structure of (a returned ``TrainState``),
  else ``default``."""
  rest_def = treedef.children()[1]
  first = treedef.num_leaves - rest_def.num_leaves
  by_structure = {}
  for arg in rest_def.unflatten(range(first, treedef.num_leaves)):
    leaves = jax.tree.leaves(arg)
    if leaves and is_state[leaves[0]]:
      by_structure.setdefault(jax.tree.structure(arg), [of[k] for k in leaves])
  sources = []
  for part in out if isinstance(out, (tuple, list)) else (out,):
    none = [default] * len(jax.tree.leaves(part))
    sources += by_structure.get(jax.tree.structure(part), none)
  n = len(jax.tree.leaves(out))
  return sources if len(sources) == n else [default] * n


def _respell(new: Any, old: Any) -> Any:
  """``new`` with ``old``'s sharding where the two are the same sharding
  spelled differently (no copy). XLA decides the sharding of a step's
  outputs over the automatic axes and spells it without size-1 axes
  (``P(('shard', 'model'))`` for an owner buffer placed as
  ``P(('shard', 'replicate', 'model'))`` on a mesh with one replica): the
  next call's specs, read from the state, would then differ from this
  call's, and the step would compile again. ``old`` None: ``new``."""
  s, t = _named(new), _named(old)
  if s is None or t is None or s == t or not s.is_equivalent_to(t, new.ndim):
    return new
  return jax.device_put(new, t)


def _build_step(md, fn, axes, key, names):
  """The step for one structure of its arguments (``key``, from
  :func:`train_step`'s ``prepare``): ``fn`` run inside a ``shard_map``
  whose manual axes are ``axes``, compiled with ``jax.jit``."""
  mesh = md.dedication.mesh
  graphdef, treedef, specs, is_state, positions, done, whole = key
  n = treedef.children()[0].num_leaves  # the graph nodes' state first

  def body(out_specs, leaves):
    # A fresh trace: the gathers of the last one are of no use.
    md.gathered_manual.clear()
    with _gather.gradients_summed_over(axes):
      state, args = jax.tree.unflatten(treedef, leaves)
      nodes = nnx.merge(graphdef, state)
      for k, node in zip(positions, nodes):
        args.insert(k, node)
      # A BatchNorm without an axis_name gets the owner axes (statistics
      # of the global batch, as under nnx.jit; the user's modules keep
      # their attributes: these are the step's own copies). Each device
      # draws its own random numbers (dropout masks of its batch): the RNG
      # keys folded with the device's index while the step runs; the
      # state keeps the keys as they were.
      index = jax.lax.axis_index(axes) if axes else None
      fold = functools.partial(jax.random.fold_in, data=index)
      saved = []
      for _, v in nnx.iter_graph(nodes):
        if axes and isinstance(v, nnx.BatchNorm) and v.axis_name is None:
          v.axis_name = axes
        elif axes and isinstance(v, nnx.RngKey):
          saved.append((v, k := v.get_value()))
          v.set_value(jax.vmap(fold)(k.reshape(-1)).reshape(k.shape))
      # A dedicated params tree among the other arguments (a TrainState's
      # params) reads the whole matrices at its placeholders for the step
      # (metrics over the params); returned, they are placeholders again.
      args, read = _whole_params(md, args)
      read = [False] * n + read if read else read
      # An NNX model's placeholders too, put back after the step.
      holes = _whole_weights(md, nodes)
      md.reading_whole[0] = bool(holes)
      try:
        out = fn(*args)
      except (ValueError, TypeError, NotImplementedError) as err:
        _boundary.explain_annotation(err, axes, mesh)
        raise
      finally:
        md.reading_whole[0] = False
      for var, value in holes:
        var.set_raw_value(value)
      if read:
        out_def = jax.tree.structure(out)
        olds = _output_sources(out, treedef, is_state, leaves, None)
        was = _output_sources(out, treedef, is_state, read, False)
        out = out_def.unflatten(
          [o if w else x for x, o, w in zip(jax.tree.leaves(out), olds, was)]
        )
      for v, k in saved:
        v.set_value(k)
      new_state = treedef.children()[0].flatten_up_to(nnx.split(nodes)[1])
    new_state = [
      _settle(x, s, axes, f'state {p!r}')
      for x, s, p in zip(new_state, specs, names)
    ]
    out_leaves, out_def = jax.tree.flatten(out)
    out_leaves = [
      _settle(x, sp, axes, 'an output of the step')
      for x, sp in zip(out_leaves, out_specs or [P()] * len(out_leaves))
    ]
    return new_state, jax.tree.unflatten(out_def, out_leaves)

  if not axes:
    return jax.jit(functools.partial(body, None))

  def mapped(leaf_specs, out_specs, **kw):
    return jax.shard_map(
      functools.partial(body, leaf_specs),
      mesh=mesh,
      in_specs=(list(specs),),
      out_specs=(list(specs[:n]), out_specs),
      axis_names=frozenset(axes),
      **kw,
    )

  def back(x, spec):
    """A state leaf the step ran whole: re-sharded as it came (``spec``;
    None: as it is)."""
    return x if spec is None else _mesh.place(x, mesh, spec)

  def step(leaves):
    # The batch (and any unplaced state) onto the specs shard_map expects.
    # Arrays placed on the mesh already (``done``, known before tracing:
    # traced values carry no sharding) keep their sharding: their specs
    # were read from it, and a constraint to the manual axes alone would
    # gather them over the others (an owner buffer's TP axis). State
    # sharded over the owner axes outside owner layout (AdamW params and
    # their moments) is gathered over them (``whole``: per leaf, its spec
    # without the owner axes and its own, or None) and re-sharded after.
    leaves = [
      _mesh.place(x, mesh, w[0]) if w else x if d else _mesh.place(x, mesh, s)
      for x, s, d, w in zip(leaves, specs, done, whole)
    ]
    own = [w and w[1] for w in whole]
    # Outputs like an argument (a returned TrainState) keep its specs;
    # the rest is averaged. With no state among the arguments that are not
    # graph nodes (an NNX step: model, optimizer, batch) every output is
    # averaged: P() for all of them, and the step is traced once.
    if not any(is_state[n:]):
      new_state, out = mapped(None, P())(leaves)
      return list(map(back, new_state, own)), out
    # Else the output's structure comes from a trace first. Shapes only
    # (eval_shape computes nothing): replication typing off so that P()
    # fits every output before its specs are known.
    out = jax.eval_shape(mapped(None, P(), check_vma=False), leaves)[1]
    leaf_specs = _output_sources(out, treedef, is_state, specs, P())
    out_specs = jax.tree.unflatten(jax.tree.structure(out), leaf_specs)
    new_state, out = mapped(leaf_specs, out_specs)(leaves)
    out_own = _output_sources(out, treedef, is_state, own, None)
    out_leaves, out_def = jax.tree.flatten(out)
    out = out_def.unflatten(list(map(back, out_leaves, out_own)))
    return list(map(back, new_state, own)), out

  return jax.jit(step)


def _whole_params(md: ModelDedication, args: list) -> tuple[list, list]:
  """``args`` with every dedicated params tree in them (found by the owner
  buffers' paths: a ``TrainState``'s ``params``, an EMA of them) holding
  the whole matrices at its placeholders (each device's owner blocks
  all-gathered, as :meth:`ModelDedication.to_params` does; XLA drops the
  gather where nothing reads them), and per argument leaf (``args``
  flattened, after the graph nodes' state) whether it is one of those."""
  flat, tdef = jax.tree_util.tree_flatten_with_path(
    args, is_leaf=_mesh.is_boxed
  )
  index = {_model.path(keys): i for i, (keys, _) in enumerate(flat)}
  values = [x for _, x in flat]
  paths = md.buffer_paths + md.rest_paths + md.placeholder_paths
  need = [p for p in paths if p is not None]
  first = md.buffer_paths[0] if md.placeholder_paths else None
  put = set()
  for p in [p for p in index if first and p[len(p) - len(first) :] == first]:
    pre = p[: len(p) - len(first)]
    if not all(pre + q in index for q in need):
      continue
    tree = {}
    for q in need:
      functools.reduce(lambda d, k: d.setdefault(k, {}), q[:-1], tree)[
        q[-1]
      ] = values[index[pre + q]]
    whole = md.to_params(tree)
    for q in md.placeholder_paths:
      value = _model.node_at(whole, q)
      values[index[pre + q]] = _mesh.rebox(values[index[pre + q]], value)
      put.add(id(value))
  args = tdef.unflatten(values)
  return args, [id(x) in put for x in jax.tree.leaves(args)] if put else []


def _whole_weights(md: ModelDedication, nodes) -> list:
  """The NNX models among ``nodes`` with the whole matrices in their
  placeholders (:class:`DedicatedWeight`; all-gathered where something
  reads them), and per placeholder ``(variable, its value)`` to put back.
  A model whose placeholders hold arrays already (a plain state written
  into it, or the model seen through an earlier argument) is left as it
  is, and so is a graph node that is not the dedicated model's root (one of
  its submodules passed on its own: its boundaries gather as before)."""
  put = []
  for node in nodes:
    found = [
      (path, v)
      for path, v in nnx.iter_graph(node)
      if isinstance(v, _model.DedicatedWeight)
    ]
    if not found or any(np.size(v.get_raw_value()) for _, v in found):
      continue
    try:  # (only the dedicated model itself: a submodule of it is skipped)
      _model.node_at(node, md.buffer_paths[0])
    except (AttributeError, KeyError, IndexError, TypeError):
      continue
    whole = md.to_params(node)
    for path, v in found:
      put.append((v, v.get_raw_value()))
      v.set_raw_value(_model.node_at(whole, path))
  return put


def _default_batch(arg_of, leaves, batch_argnums) -> set[int]:
  """The batch arguments: ``batch_argnums``, or by default the last
  argument holding an array of rank 1 or more (trailing scalars, e.g. a
  step number or a typed RNG key, are state) and every other whose arrays
  all lead with its first array's leading dimension (inputs beside
  labels). ``arg_of``: per leaf its argument (None: graph-node state)."""
  if batch_argnums is not None:
    return set(batch_argnums)
  prng = lambda x: jax.dtypes.issubdtype(
    getattr(x, 'dtype', None), jax.dtypes.prng_key
  )
  leading = {}  # argument -> its arrays' leading dimensions
  for k, x in zip(arg_of, leaves):
    if k is not None:
      data = np.ndim(x) >= 1 and not prng(x)
      leading.setdefault(k, []).append(np.shape(x)[0] if data else None)
  last = [k for k, dims in leading.items() if any(d is not None for d in dims)]
  if not last:
    return set()
  size = next(d for d in leading[last[-1]] if d is not None)
  return {last[-1]} | {k for k, d in leading.items() if set(d) == {size}}


def _run_as_written(dedication, fn, plain, jitted, args, how='__call__'):
  """The step ``fn`` as written under plain ``nnx.jit`` (its arguments as
  given; ``plain``: :func:`train_step`'s cache, per manual step): where
  the model constrains its activations over the owner axes, which the
  manual step can't keep (on Explicit owner axes this is the plain-jit
  route at the floors; on Auto ones, GSPMD's gathers, warned once)."""
  ded = dedication.dedication
  if jitted not in plain:
    plain[jitted] = nnx.jit(fn)
    if not _mesh.is_explicit(ded.mesh):
      n = ded.num_slots
      _boundary.warn_once(
        dedication,
        'dmuon: the train step constrains activations over the owner axes '
        f'{dedication.axes}, which dmuon_jax.flax.train_step runs manually: '
        'it runs under plain nnx.jit instead, with the same numbers, but on '
        "the mesh's Auto owner axes XLA gathers the Muon matrices and "
        f'all-reduces their gradients, 3({n}-1)/{n} x the Muon bytes per '
        'step, every gathered weight kept for the backward. For the '
        'floors, make the owner axes Explicit (jax.make_mesh(..., '
        'axis_types=(AxisType.Explicit,) * n)) and dedicate on that mesh, '
        "or leave the owner axes out of the model's activation "
        'annotations.',
        stacklevel=4,
      )
  with jax.set_mesh(ded.mesh):  # (train_step's shard_map sets it too)
    if how == 'compile':
      return plain[jitted].lower(*args).compile()
    return plain[jitted](*args)


def train_step(
  dedication: ModelDedication,
  fn: Callable[..., Any] | None = None,
  *,
  batch_argnums: Sequence[int] | None = None,
) -> Any:
  """Compiles a train step so that Muon runs at the byte floors.

  Use it instead of ``@nnx.jit`` on the step, unchanged::

    @dmuon_jax.flax.train_step(ded)
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

  The step runs inside ``jax.shard_map`` whose manual axes are the owner
  axes (``ded.axes``; the other mesh axes stay automatic): each device runs
  the model on its share of the batch, a boundary's matrices are
  all-gathered from their owners when it is called, and the gradients come
  back to the owners by reduce-scatter (Z2: 2(N-1)/N of the Muon bytes per
  step, Z3: 3(N-1)/N). What differs from ``nnx.jit``:

  - The batch arguments (``batch_argnums``, default: the last argument
    holding an array of rank 1 or more, so that trailing scalars such as a
    step number are not taken for the batch, and every other argument
    whose arrays all lead with that argument's leading dimension: inputs
    beside labels) are split
    over the owner axes along their first axis unless their sharding splits
    them over those axes already (a batch placed replicated is split);
    other arguments are state: arrays placed on the mesh keep
    their sharding, unplaced ones are replicated, and an output with the
    structure of a state argument (a returned ``TrainState``) keeps its
    shardings. State sharded over the owner axes but the owner buffers
    and their momentum (FSDP-sharded AdamW params and their moments, in
    graph nodes or in an argument holding the owner buffers) is gathered
    over them for the step and re-sharded after: stored as it was given,
    run as replicated params are (their gradients all-reduced, AdamW run
    whole on every device).
  - Gradients are sums over devices of per-device mean-loss gradients; the
    optimizer of :func:`dedicated_muon` divides them (write the loss as a
    mean over the batch, as usual).
  - The placeholders of the Muon targets (an NNX model's
    :class:`DedicatedWeight` variables, the zero-size leaves of a Linen
    ``TrainState``'s ``params``) hold the whole matrices while the step
    runs, so metrics over the params read them as written (all-gathered
    where something reads them: (N-1)/N of those bytes per step); the
    state keeps its placeholders.
  - Every NNX graph node among the arguments (model, optimizer, metrics,
    ``nnx.Rngs``) is updated in place, as with ``nnx.jit``; graph nodes
    inside a container argument raise ``TypeError``.
  - Outputs, and float state that ends up differing between devices (e.g.
    batch statistics, a metric's total), are averaged over the owner axes
    (a metric summing over examples keeps one device's share in its
    ``total`` and ``count``; its ``compute()`` is the global one). A
    BatchNorm (``nnx.BatchNorm``, ``nn.BatchNorm``) without an
    ``axis_name`` gets the owner axes for the step, so its statistics are
    the global batch's, as under ``jit``.
  - Inside the step, sharding annotations (``with_sharding_constraint``,
    ``out_sharding=``) may name only the other mesh axes; an annotation
    naming an owner axis fails with an error that says so.

  Args:
    dedication: the model's :class:`ModelDedication`.
    fn: the step, e.g. ``(model, optimizer, batch) -> loss`` (NNX: graph
      nodes among the arguments are updated in place, as with ``nnx.jit``)
      or ``(state, batch) -> (state, metrics)`` (Linen ``TrainState``).
    batch_argnums: the positions of the batch arguments (default: the
      last argument holding an array of rank 1 or more, and every other
      whose arrays all share its leading dimension).

  Returns:
    The compiled step (or a decorator, without ``fn``).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax.flax as dflax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(8, 8, rngs=nnx.Rngs(1)))
    >>> ded = dflax.dedicate(model, None)  # None: one device
    >>> optimizer = nnx.Optimizer(
    ...     model, dflax.dedicated_muon(ded, learning_rate=0.02), wrt=nnx.Param)
    >>> @dflax.train_step(ded)
    ... def step(model, optimizer, x):
    ...   loss_fn = lambda model: jnp.mean(model(x) ** 2)
    ...   loss, grads = nnx.value_and_grad(loss_fn)(model)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> x = jnp.ones((4, 8))
    >>> losses = [float(step(model, optimizer, x)) for _ in range(3)]
    >>> losses[2] < losses[1] < losses[0]
    True
  """
  if fn is None:
    return functools.partial(
      train_step, dedication, batch_argnums=batch_argnums
    )
  ded = dedication.dedication
  axes = tuple(ded.buffer_axes) if ded.layout.distributed else ()
  compiled: dict[Any, Callable[..., Any]] = {}
  # Shapes and manual specs of the owner buffers (and their momentum), the
  # only state that may be sharded over the owner axes (size-1 axes
  # dropped: XLA's spelling omits them).
  sizes = dict(ded.mesh.shape) if axes else {}

  def lay(shape, spec):
    return tuple(shape), _mesh.normalize_entries(spec, len(shape), sizes)

  layout = ded.layout
  specs = layout.buffer_specs()
  owner_layout = {  # (a scanned stack's momentum may be shaped otherwise)
    lay(s, _manual_spec(specs[b], axes))
    for b, x in enumerate(layout.buffer_shapes())
    for s in (x.shape, layout.momentum_shape(b, x.shape))
  }

  def prepare(args):
    # Every NNX graph node among the arguments (model, optimizer, metrics,
    # nnx.Rngs, ...) is updated in place afterwards, as nnx.jit does.
    positions = _node_positions(args)
    nodes = tuple(args[k] for k in positions)
    rest_at = [k for k in range(len(args)) if k not in positions]
    graphdef, state = nnx.split(nodes)
    # Uncommitted state (step counts, RNG keys) onto the mesh, as the step
    # returns it: the second call then runs the first call's executable.
    state = _mesh.replicate_uncommitted(state, ded.mesh if axes else None)
    # One list of leaves: the graph nodes' state, then the other arguments
    # (state too, but for the batch).
    flat, treedef = jax.tree_util.tree_flatten_with_path(
      (state, [args[k] for k in rest_at])
    )
    # Per leaf its argument (None: the graph nodes' state). The batch
    # arguments by default: the last one holding an array of rank 1 or
    # more (trailing scalars, e.g. a step number or a typed RNG key, are
    # state), and every other whose arrays all lead with its first array's
    # leading dimension (inputs beside labels).
    arg_of = [rest_at[keys[1].idx] if keys[0].idx else None for keys, _ in flat]
    batch = _default_batch(arg_of, [x for _, x in flat], batch_argnums)
    is_state = tuple(k not in batch for k in arg_of)
    # Per leaf its name in messages (built only when one is needed).
    names = lambda: tuple(
      _model.text(
        (f'argument {k}', *_model.path(keys[2:]))
        if keys[0].idx
        else _model.path(keys[1:])
      )
      for k, (keys, _) in zip(arg_of, flat)
    )
    # The arguments holding owner buffers (a TrainState): their other
    # leaves sharded over the owner axes are the model's (AdamW params,
    # their moments).
    manual = [_manual_spec(x, axes) for _, x in flat]  # (P() if unplaced)
    owned = [
      _named(x) is not None and lay(x.shape, spec) in owner_layout
      for (_, x), spec in zip(flat, manual)
    ]
    holders = {k for k, o in zip(arg_of, owned) if k is not None and o}
    leaves, specs, whole = [], [], []
    for i, ((keys, x), state) in enumerate(zip(flat, is_state)):
      # Arrays placed on the mesh keep their specs; unplaced state arguments
      # (a TrainState's batch statistics) are replicated.
      if axes and keys[0].idx and state and _named(x) is None:
        x = jax.device_put(x, NamedSharding(ded.mesh, P()))
      spec = manual[i]
      # The batch is split over the owner axes along its first axis unless
      # its sharding splits it over them already: a batch placed replicated
      # (jnp arrays made under jax.set_mesh are) would have every device run
      # the whole batch.
      w = None
      if axes and not state and np.ndim(x) >= 1 and spec == P():
        spec = P(axes)
      # Inside the step each device runs the whole model: other state
      # sharded over an owner axis (AdamW params and their moments) is
      # gathered over the owner axes for the step and re-sharded after
      # (its own spec kept, so the step's outputs keep it too).
      elif state and spec != P() and not owned[i]:
        if keys[0].idx and arg_of[i] not in holders:  # a batch part?
          k, given = arg_of[i], sorted(batch)
          raise ValueError(
            f'dmuon: train_step got {names()[i]!r} sharded {spec} over the '
            f'owner axes {tuple(sorted(axes))}, and takes argument {k} for '
            f'state, not batch: the batch arguments are {given} ('
            + (
              'the last argument holding an array of rank 1 or more, and '
              'the others whose arrays share its leading dimension'
              if batch_argnums is None
              else 'batch_argnums'
            )
            + f'). If argument {k} is batch too (inputs beside labels), pass '
            f'batch_argnums={tuple(sorted({k, *given}))}; if it is state, '
            'place it replicated over those axes (each device runs the whole '
            'model on its share of the batch).'
          )
        own = _named(x).spec
        w = (_mesh.entries_spec(_drop(own, axes)), own)
        spec = P()
      leaves.append(x)
      specs.append(spec)
      whole.append(w)
    on_mesh = tuple(_named(x) is not None for x in leaves)
    key = (
      graphdef,
      treedef,
      tuple(specs),
      is_state,
      positions,
      on_mesh,
      tuple(whole),
    )
    if key not in compiled:
      compiled[key] = _build_step(dedication, fn, axes, key, names())
    return compiled[key], leaves, nodes, treedef, is_state

  plain = {}  # manual step -> its nnx.jit (_run_as_written)
  run_plain = functools.partial(_run_as_written, dedication, fn, plain)

  @functools.wraps(fn)
  def call(*args):
    jitted, leaves, nodes, treedef, is_state = prepare(args)
    if jitted in plain:
      return run_plain(jitted, args)
    try:
      new_state, out = jitted(leaves)
    except _boundary.OwnerAxisAnnotationError:
      return run_plain(jitted, args)
    new_state = list(map(_respell, new_state, leaves))
    nnx.update(nodes, jax.tree.unflatten(treedef.children()[0], new_state))
    if not any(is_state[len(new_state) :]):  # nothing returned is state
      return out
    # A returned state argument (a TrainState) too, as it came in.
    olds = _output_sources(out, treedef, is_state, leaves, None)
    out_leaves, out_def = jax.tree.flatten(out)
    return out_def.unflatten(list(map(_respell, out_leaves, olds)))

  def compile(*args):  # noqa: A001
    """The step compiled for these arguments (e.g. for
    :func:`dmuon_jax.analyze_compiled`; a compilation of its own)."""
    jitted, leaves, *_ = prepare(args)
    if jitted not in plain:  # (else, or if it raises: the nnx.jit step's)
      with contextlib.suppress(_boundary.OwnerAxisAnnotationError):
        return jitted.lower(leaves).compile()
    return run_plain(jitted, args, 'compile')

  call.compile = compile
  return call
