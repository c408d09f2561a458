"""Muon on owner buffers: :func:`dedicated_muon` and its building block."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from dmuon_jax import (
  _checks,
  _collectives,
  _gather,
  _hyperparams,
  _mesh,
  _owner_layout,
  _owner_update,
  _plan,
)
from dmuon_jax._dedication import DedicatedParams, Dedication, check_owned


class DedicatedMuonState(NamedTuple):
  """State of :func:`scale_by_dedicated_muon`.

  Attributes:
    count: the step count.
    mu: the momentum, laid out like ``DedicatedParams.owned`` (the same
      :class:`dmuon_jax.OwnerLayout`).
    stamp: the layout that wrote ``mu``, as data: a checkpoint of another
      layout restored with orbax's ``partial_restore=True`` raises instead
      of leaving zero momentum (see :class:`dmuon_jax.ScaleByDMuonState`).

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> state = dmuon_jax.scale_by_dedicated_muon(ded).init(dp.owned)
    >>> int(state.count), state.mu.layout == dp.owned.layout
    (0, True)
  """

  count: jax.Array
  mu: _owner_layout.OwnerBuffers
  # Which layout wrote mu, as data (see dmuon_jax.ScaleByDMuonState).
  stamp: _owner_update.LayoutStamp


def _decayed_leaves(
  ded: Dedication, weight_decay, weight_decay_mask
) -> frozenset[int] | None:
  """Leaf indices of the Muon targets that decay (None: no decay)."""
  if (
    isinstance(weight_decay, (int, float))
    and not isinstance(weight_decay, bool)
    and weight_decay == 0
  ):
    return None
  indices = [t.index for t in ded.layout.leaves]
  if weight_decay_mask is None:
    return frozenset(indices)
  mask = weight_decay_mask
  if callable(mask):
    mask = mask(ded.abstract_params)
  flags = ded.treedef.flatten_up_to(mask)
  bad = [
    ded.leaf_paths[i]
    for i in indices
    if not isinstance(flags[i], (bool, np.bool_))
  ]
  if bad:
    raise ValueError(
      f'dmuon: weight_decay_mask has non-boolean entries at {bad}; give a '
      'tree like the params (or a callable params -> tree) of True/False, '
      'as for optax.add_decayed_weights.'
    )
  return frozenset(i for i in indices if flags[i])


def scale_by_dedicated_muon(
  dedication: Dedication,
  ns_coeffs: Any = 'jordan',
  ns_steps: int | None = None,
  beta: jax.typing.ArrayLike = 0.95,
  eps: jax.typing.ArrayLike = 1e-8,
  mu_dtype: Any = None,
  *,
  nesterov: bool = True,
  consistent_rms: jax.typing.ArrayLike | None = None,
  adaptive: bool = False,
  preconditioning: str = 'frobenius',
  momentum: str = 'optax',
  compute_dtype: Any = None,
  weight_decay: jax.typing.ArrayLike = 0.0,
  weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
  """Muon on owner buffers: momentum and NS local, no communication.

  The owner update of :func:`dmuon_jax.dmuon` (the same module, the same
  numbers), applied to :class:`DedicatedParams` ``owned`` buffers: momentum,
  Newton–Schulz (the dedication's ``ns_algorithm``), ``adaptive``, the shape
  factor and the masked weight decay, each owner on its own matrices.
  Inside ``shard_map`` it runs on the local blocks; the gradients are those
  that :meth:`Dedication.block` / :meth:`~.scan` deliver to the owners: sums
  over all devices of per-device mean-loss gradients, divided here by the
  number of owner slots (DMuon's net divisor ``R * S``). Under plain
  ``jax.jit`` (global arrays) it runs its own ``shard_map`` over the
  owner axes, on gradients already averaged.

  Args:
    dedication: the :class:`Dedication`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: as for :func:`dmuon_jax.dmuon`.
    eps: as for :func:`dmuon_jax.dmuon`.
    mu_dtype: momentum dtype (default: the buffers' dtype).
    nesterov: as for :func:`dmuon_jax.dmuon`.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.
    adaptive: as for :func:`dmuon_jax.dmuon`.
    preconditioning: as for :func:`dmuon_jax.dmuon`.
    momentum: as for :func:`dmuon_jax.dmuon`.
    compute_dtype: as for :func:`dmuon_jax.dmuon`.
    weight_decay: decoupled weight decay (not multiplied by the learning
      rate here: chain ``optax.scale_by_learning_rate`` after).
    weight_decay_mask: as for :func:`dmuon_jax.dmuon` (a tree like the plain
      params, or a callable of them).

  Returns:
    A ``optax.GradientTransformation`` on ``owned`` buffers.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> tx = dmuon_jax.scale_by_dedicated_muon(ded)
    >>> state = tx.init(dp.owned)
    >>> grads = jax.tree.map(jnp.ones_like, dp.owned)
    >>> updates, state = tx.update(grads, state, dp.owned)
    >>> updates  # doctest: +ELLIPSIS
    OwnerBuffers(dmuon_...: float32[32])
    >>> int(state.count)
    1
  """
  hp = _owner_update.make_hyperparams(
    beta=beta,
    eps=eps,
    consistent_rms=consistent_rms,
    weight_decay=weight_decay,
  )
  _plan.check_preconditioning(
    preconditioning,
    tp_axis=dedication.tensor_parallel_axis,
    groups=len(dedication.plan.groups),
    otherwise=(
      'dedicate(..., owner_groups=None) to keep every matrix whole'
      if dedication.plan.groups and dedication.tensor_parallel_axis is None
      else ''
    ),
  )
  cfg = _owner_update.make_config(
    ns_coeffs=ns_coeffs,
    ns_steps=ns_steps,
    momentum=momentum,
    nesterov=nesterov,
    adaptive=adaptive,
    preconditioning=preconditioning,
    ns_algorithm=dedication.ns_algorithm,
    compute_dtype=compute_dtype,
    shape_scaling=True,
    consistent_rms=consistent_rms is not None,
    mu_dtype=mu_dtype,
  )
  decay = _decayed_leaves(dedication, weight_decay, weight_decay_mask)

  return optax.GradientTransformation(
    functools.partial(_muon_init, cfg, dedication),
    functools.partial(_muon_update, cfg, hp, decay, dedication),
  )


def _muon_init(cfg, ded, owned):
  check_owned(ded.layout, owned, 'dedicated_muon init()')
  dtype = cfg.mu_dtype
  layout = owned.layout
  mu = [jnp.zeros_like(b, dtype=dtype) for b in owned.buffers]
  mesh = ded.mesh if ded.mesh is not None else layout.mesh
  if (
    layout.distributed
    and mesh is not None
    and not set(layout.buffer_axes) & _collectives.manual_axes()
  ):
    # Under jax.jit on Auto axes zeros_like keeps no sharding: the momentum
    # placed as its layout says, as eagerly.
    mu = [_mesh.place(m, mesh, s) for m, s in zip(mu, layout.buffer_specs())]
  return DedicatedMuonState(
    count=jnp.zeros([], jnp.int32),
    # Boxed as the owned buffers are (Flax's sharding tools read the boxes).
    mu=owned.rebox(mu),
    stamp=_owner_update.make_stamp(owned.layout),
  )


def _muon_update(cfg, hp, decay, ded, grads, state, params=None):
  layout = state.mu.layout
  check_owned(layout, grads, 'dedicated_muon update()')
  if decay is not None and params is None:
    raise ValueError(
      'dmuon: dedicated_muon with weight_decay needs the params: call '
      'update(grads, state, params).'
    )
  count_inc = optax.safe_increment(state.count)
  manual = _collectives.manual_axes()
  param_bufs = None if params is None or not decay else list(params.buffers)
  dyn = _owner_update.dynamic(hp)

  def body(g, mus, ps, count_inc, dyn):
    out, mu = _owner_update.owner_step(
      cfg,
      hp._replace(**dyn),
      layout,
      g,
      mus,
      count_inc,
      params=ps,
      decay=decay,
    )
    return list(out), list(mu)

  if set(layout.buffer_axes) & manual or not layout.distributed:
    # The local blocks (inside shard_map, or one device).
    n = layout.num_slots if manual else 1
    g = [x / n for x in grads.buffers] if n > 1 else list(grads.buffers)
    specs = _gather.buffer_tp_specs(ded, g)
    # With the TP axis automatic (dmuon_jax.flax.train_step), each TP
    # shard's slices in a shard_map over it: the Gram all-reduces need it.
    run = _gather.on_tp_shards(
      ded,
      body,
      (specs, specs, specs if decay else None, P(), P()),
      (specs, specs),
    )
  else:  # global arrays (plain jit): a shard_map over the whole mesh
    g = list(grads.buffers)
    specs = list(layout.buffer_specs())
    run = jax.shard_map(
      body,
      mesh=ded.mesh if ded.mesh is not None else layout.mesh,
      in_specs=(specs, specs, specs if decay else None, P(), P()),
      out_specs=(specs, specs),
    )
  ortho, mu = run(g, list(state.mu.buffers), param_bufs, count_inc, dyn)
  # optax.contrib.muon's dtype: the momentum's promoted with the gradient's.
  out = [
    o.astype(jnp.result_type(m.dtype, g.dtype))
    for o, m, g in zip(ortho, state.mu.buffers, grads.buffers)
  ]
  return (
    grads.rebox(out),
    DedicatedMuonState(
      count=count_inc, mu=state.mu.rebox(mu), stamp=state.stamp
    ),
  )


def _mean_rest(dedication: Dedication) -> optax.GradientTransformation:
  """Averages the non-target gradients over all devices (inside shard_map).

  A sharded param's gradient arrives summed over the manual axes of its
  sharding but the tensor-parallel one (the transpose of
  :meth:`Dedication.gather_rest`'s all-gather); it is divided by their size
  and averaged over the other axes it varies on (not over the TP axis of a
  TP-sharded param: each TP shard holds its own slice).
  """
  mesh = dedication.mesh

  def update_fn(updates, state, params=None):
    del params
    if mesh is None or not _collectives.manual_axes():
      return updates, state
    sizes = dict(mesh.shape)
    tp_axis = dedication.tensor_parallel_axis
    manual = _collectives.manual_axes()
    out = []
    for x, spec, path in zip(
      _gather.full_leaves(updates, dedication.treedef),
      dedication.rest_specs,
      dedication.leaf_paths,
    ):
      spec_axes = [a for e in _mesh.spec_entries(spec) for a in e]
      if (
        x is not None
        and tp_axis in _collectives.varying_axes(x)
        and tp_axis not in spec_axes
      ):
        raise ValueError(
          f'dmuon: the gradient of {path!r} differs between the shards of '
          f'the tensor-parallel axis {tp_axis!r} (it is a partial sum '
          'there). Compute gradients with dmuon_jax.local_value_and_grad('
          f'loss, axis_names={dedication.buffer_axes}) so that autodiff '
          'sums TP-replicated params over the TP axis.'
        )
      if x is not None:
        # Summed over the manual axes its sharding names (the transpose of
        # gather_rest's all-gather), not over the TP axis (a TP-sharded
        # param stays each TP shard's slice) nor over automatic axes
        # (dmuon_jax.flax.train_step's TP axis: the partitioner's).
        summed = [a for a in spec_axes if a in manual and a != tp_axis]
        # Invariant over an axis of a step run whole inside shard_map
        # (dmuon_jax.flax.train_step): autodiff summed it there.
        summed += [
          a
          for a in sorted(_collectives.summed_axes())
          if a not in summed and a not in _collectives.varying_axes(x)
        ]
        if summed:
          x = x / np.prod([sizes[a] for a in summed])
        others = tuple(
          a
          for a in mesh.axis_names
          if a not in summed
          and a not in spec_axes
          and a in _collectives.varying_axes(x)
        )
        if others:
          x = jax.lax.pmean(x, others)
      out.append(x)
    return jax.tree.unflatten(dedication.treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def dedicated_muon(
  dedication: Dedication,
  learning_rate: optax.ScalarOrSchedule,
  ns_coeffs: Any = 'jordan',
  ns_steps: int | None = None,
  beta: jax.typing.ArrayLike = 0.95,
  eps: jax.typing.ArrayLike = 1e-8,
  weight_decay: jax.typing.ArrayLike = 0.0,
  weight_decay_mask: Any = None,
  mu_dtype: Any = None,
  *,
  nesterov: bool = True,
  adaptive: bool = False,
  preconditioning: str = 'frobenius',
  adam_b1: jax.typing.ArrayLike = 0.9,
  adam_b2: jax.typing.ArrayLike = 0.999,
  adam_eps_root: jax.typing.ArrayLike = 0.0,
  adam_weight_decay: jax.typing.ArrayLike = 0.0,
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  consistent_rms: jax.typing.ArrayLike | None = None,
  momentum: str = 'optax',
  compute_dtype: Any = None,
  nonfinite: str = 'skip',
) -> optax.GradientTransformation:
  """:func:`dmuon_jax.dmuon` for :class:`DedicatedParams`.

  Muon targets (``owned``) are updated on their owners by the same owner
  update as :func:`dmuon_jax.dmuon` (same arguments, same numbers) with no
  communication; the other params (``rest``) by AdamW on gradients averaged
  over devices, on the shards they are stored in. Use with
  :func:`dmuon_jax.local_value_and_grad` inside
  ``jax.shard_map(..., in_specs=dedication.specs() ...)``. The arguments of
  :func:`dmuon_jax.dmuon` that decide routing and placement
  (``predicate``, ``muon_weight_dimension_numbers``, ``mesh``,
  ``axis_names``, ``tensor_parallel_axis``, ``ns_algorithm``) are
  :func:`dedicate`'s.

  Args:
    dedication: the :class:`Dedication`.
    learning_rate: as for :func:`dmuon_jax.dmuon`.
    ns_coeffs: as for :func:`dmuon_jax.dmuon`.
    ns_steps: as for :func:`dmuon_jax.dmuon`.
    beta: as for :func:`dmuon_jax.dmuon`.
    eps: as for :func:`dmuon_jax.dmuon`.
    weight_decay: as for :func:`dmuon_jax.dmuon`.
    weight_decay_mask: as for :func:`dmuon_jax.dmuon` (over the plain
      params tree).
    mu_dtype: as for :func:`dmuon_jax.dmuon` (Muon momentum and AdamW's).
    nesterov: as for :func:`dmuon_jax.dmuon`.
    adaptive: as for :func:`dmuon_jax.dmuon`.
    preconditioning: as for :func:`dmuon_jax.dmuon`.
    adam_b1: as for :func:`dmuon_jax.dmuon`.
    adam_b2: as for :func:`dmuon_jax.dmuon`.
    adam_eps_root: as for :func:`dmuon_jax.dmuon`.
    adam_weight_decay: as for :func:`dmuon_jax.dmuon`.
    adam_learning_rate: as for :func:`dmuon_jax.dmuon`.
    consistent_rms: as for :func:`dmuon_jax.dmuon`.
    momentum: as for :func:`dmuon_jax.dmuon`.
    compute_dtype: as for :func:`dmuon_jax.dmuon`.
    nonfinite: as for :func:`dmuon_jax.dmuon`: ``'skip'`` zeroes the
      updates and keeps the whole state when any gradient, update or new
      state entry is NaN/Inf on any device (the flag is reduced over the
      mesh axes); ``'propagate'`` lets them through.

  Returns:
    A ``optax.GradientTransformation`` on :class:`DedicatedParams`.

  Examples:
    >>> import jax, jax.numpy as jnp, dmuon_jax
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> ded = dmuon_jax.dedicate(params, None)  # None: one device
    >>> dp = ded.to_dedicated(params)
    >>> opt = dmuon_jax.dedicated_muon(ded, learning_rate=0.02)
    >>> state = opt.init(dp)
    >>> grads = jax.tree.map(jnp.ones_like, dp)  # gradients in owner layout
    >>> updates, state = opt.update(grads, state, dp)

    The same numbers as :func:`dmuon_jax.dmuon` on the plain params:

    >>> ref = dmuon_jax.dmuon(learning_rate=0.02)
    >>> ones = jax.tree.map(jnp.ones_like, params)
    >>> ref_updates, _ = ref.update(ones, ref.init(params), params)
    >>> plain = ded.to_params(updates)
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, plain, ref_updates))
    True
  """
  _owner_update.check_nonfinite(nonfinite)
  _hyperparams.check_adam(
    learning_rate=learning_rate,
    adam_learning_rate=adam_learning_rate,
    adam_b1=adam_b1,
    adam_b2=adam_b2,
    adam_eps_root=adam_eps_root,
    adam_weight_decay=adam_weight_decay,
  )
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  muon = optax.chain(
    scale_by_dedicated_muon(
      dedication,
      ns_coeffs,
      ns_steps,
      beta,
      eps,
      mu_dtype,
      nesterov=nesterov,
      consistent_rms=consistent_rms,
      adaptive=adaptive,
      preconditioning=preconditioning,
      momentum=momentum,
      compute_dtype=compute_dtype,
      weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask,
    ),
    optax.scale_by_learning_rate(learning_rate),
  )
  adam = optax.chain(
    _mean_rest(dedication),
    optax.adamw(
      adam_learning_rate,
      b1=adam_b1,
      b2=adam_b2,
      eps=eps,
      eps_root=adam_eps_root,
      weight_decay=adam_weight_decay,
      mu_dtype=mu_dtype,
      nesterov=nesterov,
    ),
  )

  def init_fn(params):
    dedication.check_dedicated(params, 'dedicated_muon init()')
    state = (muon.init(params.owned), adam.init(params.rest))
    # On the mesh (the step counts too), eagerly as under jax.jit.
    return _mesh.replicate_uncommitted(state, dedication.mesh)

  def update_fn(updates, state, params=None):
    dedication.check_dedicated(updates, 'dedicated_muon update()')
    _checks.check_same_tree(
      updates.rest,
      optax.tree_utils.tree_get(state[1], 'mu'),
      'dedicated_muon update()',
      made_by='init()',
      shapes=True,
    )
    owned_u, muon_state = muon.update(
      updates.owned, state[0], None if params is None else params.owned
    )
    rest_u, adam_state = adam.update(
      updates.rest, state[1], None if params is None else params.rest
    )
    return (
      DedicatedParams(owned=owned_u, rest=rest_u),
      (muon_state, adam_state),
    )

  opt = optax.GradientTransformation(init_fn, update_fn)
  if nonfinite == 'skip':
    opt = _owner_update.skip_nonfinite(opt)
  return opt
