"""The distributed paths of ``scale_by_dmuon``'s update, explicit and
drop-in, and the explicit path's gradient helpers (train steps written
inside ``shard_map``)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _checks,
  _exchange,
  _gather,
  _mesh,
  _owner_layout,
  _owner_update,
)

UNKNOWN_SPECS_MSG = (
  'dmuon: the optimizer state {name} was made without knowing how '
  '{count} Muon param(s) are sharded ({paths}): init saw unboxed tracers '
  'or abstract values on a mesh with Auto axes, which carry no sharding '
  '(or nn.LogicallyPartitioned boxes with no logical axis rules in '
  'effect). The update treats them as replicated, so if they are sharded '
  '(FSDP), their gradients are all-gathered whole instead of sent to the '
  'owners by all-to-all. Under jax.jit / jax.eval_shape, give init the '
  'params boxed as Flax makes them (nn.Partitioned from '
  'nn.with_partitioning, nnx.Variables with out_sharding; '
  'nn.LogicallyPartitioned inside `with nn.logical_axis_rules(rules):`): '
  'init reads their sharding metadata. Or pass param_specs= specs known '
  'before tracing, e.g. param_specs=nn.get_partition_spec(boxed_params) '
  '(mapped by nn.logical_to_mesh(..., rules) for logical names), or '
  'jax.tree.map(lambda x: x.sharding, params) taken outside the jitted '
  'function (x.sharding raises on tracers). Or use a mesh with Explicit '
  'axes.{momentum}'
)

UNKNOWN_MOMENTUM_MSG = (
  ' Not knowing the shardings, init also kept the momentum in owner '
  'buffers: {held} on the busiest device, {ratio:.2f}x the even share '
  "({even}) that optax.contrib.muon's momentum holds on params sharded "
  'over all {devices} devices; with their shardings known, init keeps it '
  'as the params are sharded where that is smaller.'
)

FORCED_MSG = (
  'dmuon: momentum buffer {buffer} of {name} reaches update() sharded as '
  '{got}, not as its layout says ({want}): each device holds {held} of '
  'it instead of {owned} ({extra} more per device, {total} over the '
  '{devices} devices), and a train step that keeps it in that sharding '
  'all-gathers the new momentum every step ({extra} per device). Its '
  'sharding was forced, e.g. by out_shardings derived from rules that do '
  'not know the owner buffers. Derive the state shardings from a state '
  'made by init: give init the params boxed (nn.Partitioned, '
  'nn.LogicallyPartitioned, nnx.Variable) and nn.get_sharding / '
  'nn.get_partition_spec / nnx.get_named_sharding of the (abstract) state '
  'read the layout from the boxed buffers; on Explicit meshes '
  'jax.tree.map(lambda x: x.sharding, jax.eval_shape(opt.init, params)); '
  'for placed states jax.tree.map(lambda x: x.sharding, opt_state); or '
  'dmuon_jax.owner_layouts(opt_state)[i].shardings(mesh) for the buffers.'
)

GATHERED_MSG = (
  'dmuon: Muon param(s) {paths} are sharded along a stack (batch) axis of '
  'their dimension numbers; the update gathers them whole before '
  'Newton-Schulz (one all-gather of each). Shard a matrix dimension '
  'instead (rows or columns) to send them to their owners by all-to-all.'
)


def warn_once(message: str) -> None:
  """Warns with ``message`` as a :class:`dmuon_jax.DMuonWarning`, once per
  message under Python's default warning filters: the ``'default'`` action
  shows a warning once per text and location, and the location is the
  dmuon_jax line calling this; ``warnings.simplefilter('always')`` shows it
  every time."""
  warnings.warn(message, _checks.DMuonWarning, stacklevel=2)


def check_buffers(
  layout: _owner_layout.OwnerLayout, mu: Sequence[jax.Array], local: bool
) -> None:
  glob = tuple(s.shape for s in layout.buffer_shapes())
  want = layout.local_shapes() if local else glob
  got = tuple(tuple(np.shape(m)) for m in mu)
  if got == want:
    return
  if local and got == glob:
    raise ValueError(
      'dmuon: inside shard_map the momentum buffers must be split over the '
      f'owner axes {layout.buffer_axes}: pass the optimizer state with '
      'in_specs=jax.tree.map(lambda x: x.sharding.spec, opt_state).'
    )
  raise ValueError(
    f'dmuon: momentum buffers of shapes {got} do not fit their layout '
    f'{layout.name} ({want}); the state was changed outside the optimizer.'
  )


def explicit_step(cfg, hp, layout, targets, mus, count_inc):
  """Inside the caller's ``shard_map`` (replicated params, DDP)."""
  if layout.tp_size > 1:
    raise ValueError(
      'dmuon: update() inside shard_map (the explicit path) does not '
      f'support the tensor-parallel axis {layout.tp_axis!r}: call '
      'it under jit on the sharded gradients (drop-in), or use '
      'dmuon_jax.dedicate.'
    )
  if layout.per_leaf:
    raise ValueError(
      'dmuon: update() inside shard_map (the explicit path) takes '
      'replicated params, but the optimizer state keeps the momentum of '
      f"{layout.name} in the params' own sharding (init saw them sharded). "
      'Call init() on the params as the explicit step holds them '
      '(replicated).'
    )
  check_buffers(layout, mus, local=True)
  padded = [t.path for t in layout.leaves if t.padded is not None]
  if padded:
    raise ValueError(
      'dmuon: update() inside shard_map (the explicit path) takes '
      'replicated params, but the optimizer state was made for params '
      f'{padded} sharded unevenly (padded at init). Call init() on the '
      'params as the explicit step holds them (replicated).'
    )
  lay = layout.groups[0]
  axes, sizes = lay.plan.axis_names, lay.plan.mesh_shape
  unreduced = any(_gather.varying_axes(x) & set(axes) for x in targets)
  if unreduced:
    # Per-device gradients, reduced straight to the owners (reduce-scatter),
    # results all-gathered: one all-reduce's bytes.
    grads = tuple(
      _gather.reduce_scatter_to_owners(b, axes, sizes) / lay.num_slots
      for b in lay.pack_full(targets)
    )
  else:
    # Already reduced (the same on every device): each owner reads its own,
    # as the drop-in path reads replicated leaves.
    ex = _exchange.Exchange(lay, layout.owner_entries([None] * len(targets)))
    grads = ex.to_owners(targets)
  # (Summed over the manual axes of one device that are no owner axes.)
  grads = tuple(_gather.invariant_over_size_one(g, axes) for g in grads)
  ortho, mu = _owner_update.owner_step(cfg, hp, layout, grads, mus, count_inc)
  new = lay.unpack_full([_gather.gather_from_owners(o, axes) for o in ortho])
  return new, mu


def resolve_entries(leaf, spec, sizes, owner_axes, tp_axis=None, tp_size=1):
  """The one reading of a Muon leaf's sharding ``spec`` (at init, at
  update, for routing hints): its entries (size-1 axes dropped), checked
  against the owner and TP axes; the shape the layout holds it at
  (zero-padded to a multiple of its devices per sharded dimension: JAX
  accepts uneven shardings); and its tensor-parallel split of that shape.

  Args:
    leaf: its ``LeafSpec`` (path, shape; matrix axes where ``tp_axis``).
    spec: a ``PartitionSpec``.
    sizes: the mesh's axis sizes.
    owner_axes: the owner axes (it may be sharded over them and TP).
    tp_axis: the tensor-parallel axis, or None.
    tp_size: its size.

  Returns:
    ``(entries, padded_shape, tp_split, tp_dim, local_shape)``, the last
    one TP shard's slice of the padded shape (see
    ``_mesh.split_tensor_parallel``).
  """
  allowed = {a: sizes[a] for a in owner_axes}
  if tp_axis is not None:
    allowed[tp_axis] = tp_size
  e = _mesh.normalize_entries(spec, len(leaf.shape), sizes)
  _mesh.check_entries(e, leaf.shape, allowed, leaf.path, spec)
  shape = _mesh.padded_shape(leaf.shape, e, sizes)
  split, dim, local = _mesh.split_tensor_parallel(
    dataclasses.replace(leaf, shape=shape), e, tp_axis, tp_size
  )
  return e, shape, split, dim, local


def _update_entries(layout, targets, sizes, update_specs):
  """Each target's sharding on the whole mesh: from its type (Explicit
  meshes), else from the layout, else from ``update_specs`` (per target, a
  spec read at update, or None); unknown ones are treated as replicated
  (warned once, after every target fits). Raises where one does not fit
  the layout (its padding or tensor-parallel split differ from init's).

  Returns:
    ``(entries, in_specs)``: the normalized entries (size-1 axes dropped)
    and the spec to give ``shard_map`` (an Explicit mesh's type as it is).
  """
  entries, specs, unknown = [], [], []
  explicit = _mesh.is_explicit(jax.sharding.get_abstract_mesh()) or (
    _mesh.is_explicit(layout.mesh)
  )
  lay = layout.groups[0]
  for t, x, e, leaf in zip(
    layout.leaves, targets, layout.param_entries, lay.plan.leaves
  ):
    spec = _mesh.type_spec(x) if explicit else None
    if spec is None:
      if e is None and update_specs:
        e = fitting(t, update_specs[len(entries)], sizes, layout.buffer_axes)
      if e is None:
        e = ((),) * len(t.shape)
        unknown.append(t.path)
      spec = _mesh.entries_spec(e)
    e, shape, split, _, _ = resolve_entries(
      dataclasses.replace(leaf, path=t.path, shape=t.shape),
      spec,
      sizes,
      layout.buffer_axes,
      layout.tp_axis,
      layout.tp_size,
    )
    if shape != t.held_shape:
      raise ValueError(
        f'dmuon: param {t.path!r} of shape {t.shape} is sharded as '
        f'{spec} at update, but the optimizer state holds it at shape '
        f'{t.held_shape} (padded for the sharding it had at init). Make '
        'the state again with init() on params sharded as in training.'
      )
    want = lay.tp_splits[len(entries)]
    if split != want:
      raise ValueError(
        f'dmuon: param {t.path!r} is sharded as {_mesh.entries_spec(e)} '
        'at update, but the optimizer state was laid out for '
        f'{"no tensor-parallel split" if want is None else "a split"} '
        f'over {layout.tp_axis!r}. Make the state again with init() '
        'on params sharded as in training.'
      )
    entries.append(e)
    specs.append(spec)
  if unknown:
    # The state-size sentence only where the owner buffers hold more than
    # 1.10x the even share.
    held, even = layout.momentum_share()
    momentum = ''
    if not layout.per_leaf and held > 1.10 * even:
      momentum = UNKNOWN_MOMENTUM_MSG.format(
        held=_checks.human_bytes(held),
        ratio=held / even,
        even=_checks.human_bytes(even),
        devices=layout.num_slots * layout.tp_size,
      )
    shown = unknown[:3] + (['...'] if len(unknown) > 3 else [])
    warn_once(
      UNKNOWN_SPECS_MSG.format(
        name=layout.name,
        count=len(unknown),
        paths=', '.join(shown),
        momentum=momentum,
      ),
    )
  return entries, specs


def fitting(t, spec, sizes, owner_axes):
  """``spec``'s entries for target ``t`` where the layout can route from
  them (owner axes only, even, no padding or TP split); else None."""
  if spec is None or t.padded is not None or t.tp_dim is not None:
    return None
  try:
    e, shape, *_ = resolve_entries(t, spec, sizes, owner_axes)
  except ValueError:  # sharded over other axes
    return None
  return e if shape == tuple(t.shape) else None


def _check_buffer_shardings(layout, mus, mesh) -> None:
  """Raises for a state laid out for another mesh; warns once per buffer
  whose sharding is not its layout's (:data:`FORCED_MSG`).

  Read where it is known: a concrete array's sharding (eager calls); a
  tracer's type on a mesh with Explicit axes; on Auto meshes, the sharding
  XLA gives it, reported at compile time by
  ``jax.debug.inspect_array_sharding`` (a jitted update's state arrives in
  the sharding its caller committed or forced). That probe's callback key
  makes the program's persistent-cache key unique, so it is only traced
  until one compile of the layout has reported.
  """
  sizes = dict(mesh.shape)
  if tuple(sizes[a] for a in layout.buffer_axes) != layout.buffer_sizes:
    raise ValueError(
      f'dmuon: the optimizer state is laid out as {layout.name} (owner axes '
      f'{dict(zip(layout.buffer_axes, layout.buffer_sizes))}), but this '
      f'optimizer runs on mesh {sizes}. Use a state made by this '
      "optimizer's init, or convert it with "
      'dmuon_jax.checkpoint.state_from_portable(state_to_portable(state), '
      'opt.init(params)).'
    )

  def warn(b, got):
    """Warns if buffer ``b`` arrives sharded as ``got`` (its spec, or a
    ``jax.sharding.Sharding``), not as its layout says."""
    want, buffer = layout.buffer_spec(b), layout.buffer_shapes()[b]
    if want is None:
      return
    shape = tuple(buffer.shape)  # the buffers' (check_buffers)
    if isinstance(got, jax.sharding.NamedSharding):
      got = got.spec
    if isinstance(got, jax.sharding.Sharding):
      local = tuple(got.shard_shape(shape))
    else:
      local = _mesh.local_shape(shape, got, sizes)
    owned = _mesh.local_shape(shape, want, sizes)
    if local == owned:
      return
    itemsize = jnp.dtype(buffer.dtype).itemsize
    extra = (math.prod(local) - math.prod(owned)) * itemsize
    hb, devices = _checks.human_bytes, math.prod(sizes.values())
    warn_once(
      FORCED_MSG.format(
        buffer=b,
        name=layout.name,
        got=got,
        want=want,
        held=hb(math.prod(local) * itemsize),
        owned=hb(math.prod(owned) * itemsize),
        extra=hb(extra),
        total=hb(devices * extra),
        devices=devices,
      ),
    )

  for b, x in enumerate(mus):
    if not isinstance(x, jax.core.Tracer):
      if getattr(x, 'sharding', None) is not None:
        warn(b, x.sharding)
    elif _mesh.is_explicit(mesh):
      warn(b, _mesh.type_spec(x))
    elif not layout.probed:

      def reported(sharding, b=b):
        """The Auto-mesh probe's callback (at compile time)."""
        layout.probed.add(b)
        warn(b, sharding)

      jax.debug.inspect_array_sharding(x, callback=reported)


def drop_in_step(setup, layout, targets, mus, count_inc, specs):
  """Gradients already reduced, in the params' sharding (plain jit).

  ``mus``: the owner buffers, or (``momentum='params'``) one momentum per
  target, sharded as it: its step runs in the same per-device program as
  the routes, on each device's block (as a one-device program computes
  it). ``specs``: per target, a spec read at update (boxed gradients) for
  those the layout records none of (or None).
  """
  check_buffers(layout, mus, local=False)
  mesh = setup.mesh if setup.mesh is not None else layout.mesh
  sizes = dict(mesh.shape)
  _check_buffer_shardings(layout, mus, mesh)
  entries, in_specs = _update_entries(layout, targets, sizes, specs)
  # Per-leaf momentum enters as its gradient does.
  buffer_specs = list(in_specs if layout.per_leaf else layout.buffer_specs())
  given = None
  reshard = lambda xs, have, want: [
    x if h == w else jax.sharding.reshard(x, NamedSharding(mesh, w))
    for x, h, w in zip(xs, have, want)
  ]
  if _mesh.is_explicit(mesh):
    # A state forced into another sharding (warned above) enters the
    # owners' shard_map resharded (on Explicit axes its in_specs must be the
    # inputs' types) and leaves it in its own type: the state's types stay
    # those of its init, at the cost the warning names.
    given = [_mesh.type_spec(x) for x in mus]
    mus = reshard(mus, given, buffer_specs)
  lay = layout.groups[0]
  ex = _exchange.Exchange(lay, layout.owner_entries(entries))
  if ex.gathered:
    warn_once(
      GATHERED_MSG.format(
        paths=[lay.plan.leaves[i].path for i in sorted(ex.gathered)]
      ),
    )
  # Unevenly sharded leaves: zero-padded here, in the global (GSPMD)
  # domain, to the shape the layout holds them at (a multiple of their
  # devices per sharded dimension), and their results sliced back below.
  # (Only Auto axes hold uneven shardings: Explicit ones refuse them.)
  targets = [
    _owner_layout.pad_to(x, t.held_shape)
    for x, t in zip(targets, layout.leaves)
  ]

  def body(targets, mus, count_inc, dyn):
    """The per-device program: pieces to owners, owner update, results
    back."""
    hp = setup.hp._replace(**dyn)
    owner_mu = mus
    if layout.per_leaf:
      new_mu, targets = _owner_update.momentum_update(
        targets,
        mus,
        count_inc,
        beta=hp.beta,
        nesterov=setup.cfg.nesterov,
        rule=setup.cfg.momentum,
      )
      new_mu, owner_mu = [m.astype(b.dtype) for m, b in zip(new_mu, mus)], None
    grads = ex.to_owners(targets)
    ortho, mu = _owner_update.owner_step(
      setup.cfg, hp, layout, grads, owner_mu, count_inc
    )
    return ex.from_owners(ortho), list(new_mu if layout.per_leaf else mu)

  new, mu = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(in_specs, buffer_specs, P(), P()),
    out_specs=(in_specs, buffer_specs),
    # Results of sharded leaves arrive by all_to_all from every owner,
    # so their type says "varying" over axes they are replicated on
    # (HSDP's replicate peers receive equal pieces). Nothing here is
    # differentiated; the parity tests check the values.
    check_vma=False,
  )(list(targets), list(mus), count_inc, _owner_update.dynamic(setup.hp))
  if given is not None:
    mu = reshard(mu, buffer_specs, given)
  new = [_owner_layout.unpad(x, t.shape) for x, t in zip(new, layout.leaves)]
  return new, mu


def _mesh_axes(axis_names: Sequence[str] | None) -> tuple[str, ...]:
  if axis_names is not None:
    return tuple(axis_names)
  axes = _gather.manual_axes()
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a in mesh.axis_names if a in axes)


def local_value_and_grad(
  fun: Callable[..., Any],
  argnums: int = 0,
  has_aux: bool = False,
  *,
  axis_names: Sequence[str] | None = None,
) -> Callable[..., tuple[Any, Any]]:
  """Like ``jax.value_and_grad``, without reducing over devices.

  Inside ``jax.shard_map``, the gradient of a replicated (invariant) argument
  is summed over the devices by autodiff: an all-reduce. This wrapper marks
  the argument as device-varying first, so each device gets the gradient of
  its own loss only, and :func:`dmuon_jax.dmuon`'s update reduces the Muon
  targets straight to their owners (``psum_scatter``) and averages the rest
  (``pmean``): a data-parallel step then moves the bytes of one all-reduce
  for the Muon targets, and nothing more.

  Args:
    fun: the loss function.
    argnums: the argument to differentiate (an int).
    has_aux: as in ``jax.value_and_grad``.
    axis_names: mesh axes the devices differ over (default: every manual
      axis of the enclosing ``shard_map``).

  Returns:
    A function returning ``(value, grads)``, both per device. Average the
    value yourself (e.g. ``jax.lax.pmean(loss, axis_names)``) for logging.

  Examples:
    In a train step, ``opt.update(grads, ...)`` then reduces the per-device
    gradients itself. Here the per-device gradients come out of
    ``shard_map`` unreduced, one per device:

    >>> import functools, jax, jax.numpy as jnp, dmuon_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> devices = jax.devices()[:2]
    >>> mesh = jax.make_mesh((len(devices),), ('data',), devices=devices)
    >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> @functools.partial(jax.shard_map, mesh=mesh,
    ...                    in_specs=(P(), P('data')), out_specs=P('data'))
    ... def per_device_grads(w, x):
    ...   loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(w, x)
    ...   return grads[None]
    >>> w, data = jnp.ones((4, 2)), NamedSharding(mesh, P('data'))
    >>> x = jnp.arange(8.0 * len(devices)).reshape(-1, 4)  # 2 rows per device
    >>> grads = per_device_grads(w, jax.device_put(x, data))
    >>> grads.shape == (len(devices), 4, 2)
    True
    >>> bool(jnp.allclose(grads.mean(0), jax.grad(loss_fn)(w, x)))
    True
  """

  def wrapped(*args, **kwargs):
    axes = _mesh_axes(axis_names)
    if not axes:
      raise ValueError(
        'dmuon: local_value_and_grad must run inside jax.shard_map (no '
        'manual mesh axes found here). Outside shard_map use '
        'jax.value_and_grad.'
      )

    args = list(args)
    args[argnums] = jax.tree.map(
      lambda x: _gather.to_varying(x, axes), args[argnums]
    )
    return jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)

  return wrapped


def mean_over_devices(
  axis_names: Sequence[str] | None = None,
) -> optax.GradientTransformation:
  """Averages per-device gradients over the mesh (``pmean``), if needed.

  Outside ``shard_map``, or for leaves that are already the same on every
  device, it does nothing. :func:`dmuon_jax.dmuon` puts it in front of AdamW
  so that the explicit path (:func:`local_value_and_grad`) works unchanged.

  Args:
    axis_names: the axes to average over (default: every manual axis).

  Returns:
    A stateless ``optax.GradientTransformation``.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, dmuon_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> tx = dmuon_jax.mean_over_devices()
    >>> grads = {'b': jnp.arange(3.0)}
    >>> tx.update(grads, tx.init(grads))[0]  # outside shard_map: unchanged
    {'b': Array([0., 1., 2.], dtype=float32)}
    >>> devices = jax.devices()[:2]
    >>> mesh = jax.make_mesh((len(devices),), ('data',), devices=devices)
    >>> @functools.partial(jax.shard_map, mesh=mesh,
    ...                    in_specs=P('data'), out_specs=P())
    ... def averaged(b):
    ...   return tx.update({'b': b}, tx.init({'b': b}))[0]['b']
    >>> b = jnp.arange(3.0 * len(devices))  # device i holds b[3 i : 3 i + 3]
    >>> out = averaged(jax.device_put(b, NamedSharding(mesh, P('data'))))
    >>> bool(jnp.allclose(out, b.reshape(-1, 3).mean(0)))
    True
  """

  def update_fn(updates, state, params=None):
    del params
    if not _gather.manual_axes():
      return updates, state
    axes = _mesh_axes(axis_names)

    def mean(x):
      varying = tuple(a for a in axes if a in _gather.varying_axes(x))
      return jax.lax.pmean(x, varying) if varying else x

    return jax.tree.map(mean, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
