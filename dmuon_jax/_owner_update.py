"""The owner update, shared by every path: momentum, Newton–Schulz, scaling.

Each owner runs, on the matrices it owns (its blocks of the owner buffers):
momentum (optax's bias-corrected EMA or the DMuon/Moonlight rule, with or
without Nesterov) -> rescaling of huge matrices -> direct, Gram or
tensor-parallel Gram Newton–Schulz (``compute_dtype``) -> ``adaptive``
scaling -> the shape factor -> (dedicated mode) masked weight decay. The
drop-in, explicit and dedicated paths differ only in how gradients reach
the owner buffers and how results leave them.

Numeric hyperparameters are data (:class:`Hyperparams`), passed into
``shard_map`` as arguments, so that ``optax.inject_hyperparams`` can inject
them; everything structural is the frozen :class:`OwnerConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dmuon_jax import (
  _checks,
  _gather,
  _layout,
  _newton_schulz,
  _owner_layout,
  _staged,
)

MOMENTUM_RULES = ('optax', 'sgd')
NONFINITE = ('skip', 'propagate')


def static_dtype(value: Any, name: str) -> np.dtype | None:
  """A dtype argument (None, a dtype or its name) as a numpy dtype.

  Raises:
    TypeError: for a value that is not a dtype, e.g. an array produced by
      ``optax.inject_hyperparams`` (which calls every callable argument,
      ``jnp.float32`` included, as a schedule).
  """
  if value is None:
    return None
  if isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
    raise TypeError(
      f'dmuon: {name} is an array ({value!r}), not a dtype. '
      'optax.inject_hyperparams calls every callable argument as a '
      f'schedule, and dtypes such as jnp.float32 are callable: pass '
      f"{name} as a string ('float32'), or in static_args=('{name}',)."
    )
  try:
    return np.dtype(jnp.dtype(value))
  except TypeError as e:
    raise TypeError(f'dmuon: {name}={value!r} is not a dtype.') from e


def static_int(value: Any, name: str) -> int | None:
  """An int argument that decides the program's structure (e.g. ns_steps).

  Concrete arrays (``optax.inject_hyperparams`` turns ints into arrays at
  ``init``) are read; traced ones are an error that says what to do.
  """
  if value is None or isinstance(value, (int, np.integer)):
    return value
  if isinstance(value, jax.core.Tracer):
    what = {
      'ns_steps': 'the number of Newton-Schulz iterations',
      'owner_groups': 'how matrices are split over devices',
    }.get(name, 'its structure')
    raise TypeError(
      f'dmuon: {name} is a traced value: optax.inject_hyperparams injects '
      f'every int argument, but {name} decides the program ({what}). Pass '
      f"static_args=('{name}',) to inject_hyperparams, or leave {name} at "
      'its default.'
    )
  arr = np.asarray(value)
  if arr.shape == () and np.issubdtype(arr.dtype, np.integer):
    return int(arr)
  raise TypeError(f'dmuon: {name}={value!r} must be an int.')


@dataclasses.dataclass(frozen=True)
class OwnerConfig:
  """Structural (static) options of the owner update.

  Attributes:
    coeffs: Newton–Schulz rows ``(a, b, c)``, one per iteration.
    momentum: ``'optax'`` or ``'sgd'``.
    nesterov: Nesterov momentum.
    adaptive: scale by the dual norm of each matrix.
    preconditioning: Newton–Schulz normalization.
    ns_algorithm: ``'auto'``, ``'standard'`` or ``'gram'``.
    compute_dtype: dtype name of the Newton–Schulz matmuls, or None.
    shape_scaling: whether the owner applies Muon's shape factor.
    consistent_rms: whether the shape factor is ``consistent_rms``'s
      (``Hyperparams.consistent_rms``) rather than Jordan's width scaling.
    mu_dtype: momentum dtype name, or None (the gradients').
  """

  coeffs: tuple[tuple[float, float, float], ...]
  momentum: str = 'optax'
  nesterov: bool = True
  adaptive: bool = False
  preconditioning: str = 'frobenius'
  ns_algorithm: str = 'auto'
  compute_dtype: str | None = None
  shape_scaling: bool = True
  consistent_rms: bool = False
  mu_dtype: str | None = None


def check_nonfinite(nonfinite: str) -> None:
  if nonfinite not in NONFINITE:
    raise ValueError(
      f'dmuon: nonfinite={nonfinite!r} is not one of {NONFINITE}: '
      "'skip' drops a step with a NaN/Inf gradient (zero updates, state "
      "unchanged), 'propagate' lets it through as optax does."
    )


def make_config(
  *, ns_coeffs, ns_steps, compute_dtype, mu_dtype, nonfinite='skip', **options
) -> OwnerConfig:
  """Validates the static arguments (at the factory call) into a config
  (``options``: the other fields of :class:`OwnerConfig`, by name)."""
  check_nonfinite(nonfinite)
  if (momentum := options['momentum']) not in MOMENTUM_RULES:
    raise ValueError(
      f'dmuon: momentum={momentum!r} is not one of {MOMENTUM_RULES}: '
      "'optax' is optax.contrib.muon's bias-corrected EMA, 'sgd' is the "
      'DMuon/Moonlight rule buf = beta * buf + g.'
    )
  _checks.check_ns_algorithm(options['ns_algorithm'])
  compute = static_dtype(compute_dtype, 'compute_dtype')
  _newton_schulz.check_ns_options(
    'dmuon', options['preconditioning'], compute_dtype
  )
  mu = static_dtype(mu_dtype, 'mu_dtype')
  coeffs = _newton_schulz.resolve_ns_coeffs(
    ns_coeffs, static_int(ns_steps, 'ns_steps')
  )
  return OwnerConfig(
    coeffs=tuple(tuple(float(v) for v in row) for row in coeffs),
    compute_dtype=None if compute is None else compute.name,
    mu_dtype=None if mu is None else mu.name,
    **options | {k: bool(options[k]) for k in ('nesterov', 'adaptive')},
  )


class Hyperparams(NamedTuple):
  """Numeric hyperparameters of the owner update.

  Python numbers stay Python numbers (so that the arithmetic is optax's,
  bit for bit); arrays (e.g. injected by ``optax.inject_hyperparams``) are
  passed into ``shard_map`` as arguments (see :func:`dynamic`), never
  closed over.
  """

  beta: Any
  eps: Any
  consistent_rms: Any = None
  weight_decay: Any = None


def make_hyperparams(**values: Any) -> Hyperparams:
  """Validates concrete values (``beta``, ``eps``, ``consistent_rms``,
  ``weight_decay``; at the factory call) into :class:`Hyperparams`;
  run-time values (tracers) pass through."""
  _checks.check_numbers(('consistent_rms', 'weight_decay'), **values)
  return Hyperparams(**values)


def dynamic(hp: Hyperparams) -> dict[str, Any]:
  """The array-valued hyperparameters, to pass into ``shard_map`` (and
  back into ``hp`` there with ``hp._replace(**values)``)."""
  static = (int, float, np.integer, np.floating, type(None))
  return {k: v for k, v in hp._asdict().items() if not isinstance(v, static)}


def momentum_update(grads, mus, count_inc, *, beta, nesterov, rule):
  """One momentum step on flat buffers.

  Returns:
    (new momentum, the momentum to orthogonalize), in the promoted dtype of
    gradients and momentum.
  """
  if rule == 'optax':
    # Same operation order as optax.tree.update_moment, so that results
    # match optax.contrib.muon to rounding.
    new = tuple((1 - beta) * g + beta * m for m, g in zip(mus, grads))
    if nesterov:
      c_mu = 1 - beta ** optax.safe_increment(count_inc)
      c_g = 1 - beta**count_inc
      hat = tuple(
        beta * (m / c_mu.astype(m.dtype))
        + (1 - beta) * (g / c_g.astype(g.dtype))
        for m, g in zip(new, grads)
      )
    else:
      c_mu = 1 - beta**count_inc
      hat = tuple(m / c_mu.astype(m.dtype) for m in new)
  else:
    new = tuple(beta * m + g for m, g in zip(mus, grads))
    hat = tuple(g + beta * m for m, g in zip(new, grads)) if nesterov else new
  return new, hat


def shape_scale(fan_in: int, fan_out: int, consistent_rms=None):
  """Muon's shape factor for a ``(fan_in, fan_out)`` matrix (as optax).

  An empty matrix (``fan_in == 0``; its update is empty) gets 1, where
  optax's ``fan_out / fan_in`` divides by zero.
  """
  if consistent_rms is None:
    return np.sqrt(max(1.0, fan_out / fan_in)) if fan_in else 1.0
  return np.sqrt(max(fan_in, fan_out)) * consistent_rms


def finish_ns(cfg, hp, out, dot, full_shape, out_dtype):
  """After Newton–Schulz: ``adaptive``'s dual norm ``dot`` (None without),
  the cast to the updates' dtype and the shape factor of ``full_shape``."""
  if dot is not None:
    out = dot * out
  out = out.astype(out_dtype)
  if cfg.shape_scaling:
    rms = hp.consistent_rms if cfg.consistent_rms else None
    out = (shape_scale(*full_shape, rms) * out).astype(out_dtype)
  return out


def _decayed(hp, out, param, dtype):
  """``out + weight_decay * param`` (as ``optax.add_decayed_weights``)."""
  return (out + hp.weight_decay * param.astype(dtype)).astype(dtype)


def slot_update(
  cfg: OwnerConfig,
  hp: Hyperparams,
  olayout: _owner_layout.OwnerLayout,
  lay: _layout.Layout,
  work: _layout.SlotWork,
  rows: Sequence,
  hat: Sequence[jax.Array],
  params: Sequence[jax.Array] | None = None,
  decay: frozenset[int] | None = None,
) -> tuple[jax.Array, ...]:
  """One owner slot's results from its (local) buffers of group ``lay``.

  ``work`` is :func:`slot_work`'s (with ``skip_distributed``, owner-group
  and TP matrices left out, their places zero for ``_staged`` to fill),
  ``rows`` the slot's rows of its tables (numpy, or read at run time).
  Results have the dtype of the momentum step's output ``hat`` (the
  promoted dtype of momentum and gradients), as ``optax.contrib.muon``'s
  updates do: float32 momentum of bfloat16 params gives float32 updates.
  With ``params`` and ``decay`` (the leaf indices whose matrices decay),
  adds ``weight_decay * param`` to those matrices' results, as
  ``optax.add_decayed_weights`` does.
  """

  def fn(stacks, bucket):
    """Newton–Schulz of a ``(count, m, n)`` stack of whole matrices, then
    :func:`finish_ns` (matrices split over devices, by owner groups or a
    tensor-parallel axis, run in ``_staged``) and the decay."""
    stack = stacks[0]
    if bucket.crop is not None:  # a padded leaf: its own rows and columns
      stack = _layout.crop_stack(stack, bucket.crop)
    x = _newton_schulz.rescale_large(stack)
    algo = cfg.ns_algorithm
    if algo == 'auto':
      algo = _newton_schulz.cheaper_ns_algorithm(*x.shape[-2:], len(cfg.coeffs))
    form = (
      _newton_schulz.orthogonalize_via_gram_newton_schulz
      if algo == 'gram'
      else _newton_schulz.orthogonalize_via_newton_schulz
    )
    out = form(
      x,
      cfg.coeffs,
      preconditioning=cfg.preconditioning,
      eps=hp.eps,
      compute_dtype=cfg.compute_dtype,
    )
    # adaptive: the dual norm <M, NS(M)> of the unscaled momentum.
    dot = (
      jnp.sum(stack * out, (-2, -1), keepdims=True) if cfg.adaptive else None
    )
    dtype = stacks[0].dtype
    full_shape = olayout.full_shape(lay, bucket.units[0])
    out = finish_ns(cfg, hp, out, dot, full_shape, dtype)
    if bucket.crop is not None:
      out = _layout.uncrop_stack(out, bucket.crop, stacks[0].shape)
    if params is not None and decay:
      mask = np.array(
        [_unit_key(olayout, lay, decay, u)[1] for u in bucket.units]
      )
      if mask.any():
        decayed = _decayed(hp, out, stacks[1], dtype)
        out = jnp.where(jnp.asarray(mask)[:, None, None], decayed, out)
    return out

  operands = (tuple(hat),) if params is None else (tuple(hat), tuple(params))
  return lay.map_slot_at(operands, work, rows, fn)


def slot_work(olayout, lay, decay, skip_distributed=False) -> _layout.SlotWork:
  """Every slot's matrices as :func:`slot_update` reads them (each unit's
  whole-matrix shape and whether it decays, beyond its bucket): one
  program for every slot, its matrices and their offsets read from tables.
  ``skip_distributed`` leaves out owner-group and TP matrices."""

  keep = lambda b: not (skip_distributed and (b.grouped or b.tp_split))
  return lay.slot_work(lambda u: _unit_key(olayout, lay, decay, u), keep)


def _unit_key(olayout, lay, decay, u):
  """What an update reads of unit ``u`` beyond its bucket: its whole
  matrix's shape and whether it decays."""
  leaf = lay.plan.leaves[lay.unit_leaf[u]].leaf_index
  return olayout.full_shape(lay, u), bool(decay) and leaf in decay


def owner_step(
  cfg: OwnerConfig,
  hp: Hyperparams,
  olayout: _owner_layout.OwnerLayout,
  grads: Sequence[jax.Array],
  mus: Sequence[jax.Array],
  count_inc: jax.Array,
  params: Sequence[jax.Array] | None = None,
  decay: frozenset[int] | None = None,
):
  """The update of this device's own matrices (local blocks, no routing).

  Runs inside ``shard_map`` over the owner axes (one program: each device
  reads which matrices it owns from tables indexed by its owner slot, so
  no device computes another owner's matrices), or on one device for a
  single-slot layout.

  Args:
    cfg: the static options.
    hp: the numeric hyperparameters.
    olayout: the layout of the buffers.
    grads: this device's gradient blocks, one per buffer (with ``mus``
      None: the momentum to orthogonalize, its step taken already).
    mus: its momentum blocks, or None (``momentum='params'`` layouts).
    count_inc: the incremented step count.
    params: (dedicated mode) its param blocks, for weight decay.
    decay: leaf indices whose matrices decay (None: no decay here).

  Returns:
    ``(results, new momentum)``: the results in the dtype the momentum
    step produced (momentum and gradients promoted, as optax's updates),
    the momentum in its own dtype.
  """
  none = [None] * len(olayout.groups)
  split = lambda bufs: none if bufs is None else olayout.split_groups(bufs)
  grad_groups, mu_groups, param_groups = map(split, (grads, mus, params))
  out, new_mu, start = [], [], 0
  for g, lay in enumerate(olayout.groups):
    # The previous group's results.
    grads_g, previous, start = grad_groups[g], out[start:], len(out)
    if previous:
      # One group at a time: its momentum and Newton-Schulz temporaries (and
      # a staged group's Gram exchange buffers) are live only while it runs;
      # XLA otherwise runs every group side by side, so that the update's
      # temporaries grow with the model (an optimization_barrier does not
      # survive XLA:CPU's pipeline). Each group's inputs wait for the
      # previous group's results through a tie that is 0 whatever they hold.
      tie = _gather.zero_after(*previous)
      grads_g = [x + tie.astype(x.dtype) for x in grads_g]
    p, mu_g = param_groups[g], None if mus is None else mu_groups[g]
    seg, iters = olayout.momentum_segments[g], None
    if seg is not None:
      # A scanned stack whose momentum keeps only what this slot holds of
      # each iteration (OwnerLayout.momentum_segments): the update runs on
      # the rows of those iterations (`iters`; past the last one: none),
      # the other rows' updates are 0.
      slot = _gather.slot_index(olayout.buffer_axes)
      iters = jnp.asarray(seg.iterations)[slot]
      grads_g = [seg.rows(x, slot) for x in grads_g]
      p = None if p is None else [seg.rows(x, slot) for x in p]
      if mu_g is not None:
        mu_g = [
          seg.segment_rows(d, m[0], slot, x.shape[1])
          for d, (m, x) in enumerate(zip(mu_g, grads_g))
        ]
    if mus is None:
      h = grads_g
    else:
      mu_g, h = momentum_update(
        grads_g,
        mu_g,
        count_inc,
        beta=hp.beta,
        nesterov=cfg.nesterov,
        rule=cfg.momentum,
      )
      if seg is not None:
        mu_g = [seg.compact(d, m, slot)[None] for d, m in enumerate(mu_g)]
      new_mu.extend(mu_g)
    # Owner-group or TP matrices: the staged update.
    tp = olayout.tp_size > 1 and any(s is not None for s in lay.tp_splits)
    staged = bool(lay.plan.groups) or tp
    work = slot_work(olayout, lay, decay, skip_distributed=staged)
    run = functools.partial(
      slot_update, cfg, hp, olayout, lay, work, decay=decay
    )
    if staged:
      args = (h, p, decay, run, work, olayout.iterations[g])
      out.extend(_staged_update(cfg, hp, olayout, lay, *args))
      continue
    # Every slot runs one program (see slot_work), its matrices and their
    # offsets read from the tables.
    one = functools.partial(_gather.with_slot_rows, lay, run, work.offsets)
    if olayout.iterations[g]:
      # Iteration t holds base slot (slot - t) mod n of the layout.
      it = olayout.iterations[g]
      res = jax.lax.map(
        lambda a, one=one: one(a[1], a[2], shift=a[0]),
        (jnp.arange(it) if iters is None else iters, h, p),
      )
      if seg is not None:  # the iterations' rows, the others 0
        res = [seg.expand(x, slot) for x in res]
    else:
      res = one(h, p)
    out.extend(res)
  new_mu = tuple(m.astype(old.dtype) for m, old in zip(new_mu, mus or ()))
  return tuple(out), new_mu


def _staged_update(
  cfg, hp, olayout, lay, hat, params, decay, plain, work, iterations
):
  """Owner-group and TP matrices by :mod:`_staged` (collectives between
  stages), the slot's whole matrices (``plain``, by :func:`slot_update`
  from ``work``) in its first stage."""
  # What finish reads of a unit: its key, its dtype group.
  keys = [
    _unit_key(olayout, lay, params is not None and decay, u)
    + (lay.unit_group[u],)
    for u in range(len(lay.plan.units))
  ]
  stages = _stages(olayout, lay, len(cfg.coeffs), tuple(keys))

  def finish(u, ns_out, dot, param):
    shape, decays, group = keys[u]
    dtype = hat[group].dtype  # as slot_update's results
    out = finish_ns(cfg, hp, ns_out, dot, shape, dtype)
    return _decayed(hp, out, param, dtype) if decays else out

  return _staged.run(
    stages,
    cfg,
    hp.eps,
    finish,
    plain,
    work,
    tuple(hat),
    None if params is None else tuple(params),
    iterations,
  )


_stages = functools.lru_cache(maxsize=64)(_staged.Stages)


# ---------------------------------------------------------------------------
# The non-finite policy.


def all_finite(*trees: Any) -> jax.Array:
  """Whether every leaf of ``trees`` is finite, on every device.

  Inside ``shard_map`` the flag is reduced (``pmin``) over the manual mesh
  axes, so that every device takes the same decision; under plain ``jit``
  the leaves are global arrays and the reduction is global already.
  """
  flags = [
    jnp.all(jnp.isfinite(x)).astype(jnp.int32)
    for x in map(jnp.asarray, jax.tree.leaves(trees))
    if jnp.issubdtype(x.dtype, jnp.inexact) and x.size
  ]
  ok = jnp.array(True)
  if flags:
    # The flag of the first non-finite leaf (argmin): XLA unrolls an ``all``
    # (or ``&``) of per-leaf flags into a chain of scalar ops and copies it
    # into every select that reads the result, leaves x selects ops (36% of
    # a 56-matrix model's compiled update); an argmin it keeps as one
    # reduction.
    stacked = jnp.stack(flags)
    ok = stacked[jnp.argmin(stacked)] > 0
  manual = _gather.manual_axes()
  if manual:
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in mesh.axis_names if a in manual)
    ok = jax.lax.pmin(ok.astype(jnp.int32), axes) > 0
  return ok


def skip_nonfinite(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """Skips the whole step of ``inner`` unless everything stays finite.

  A step is skipped when any gradient, any update or any new state leaf of
  ``inner`` is NaN or infinite (on any device, see :func:`all_finite`): the
  updates are then zero and ``inner``'s state (counts included) is the old
  one. ``jnp.where`` selects, so the step costs the same either way.

  Args:
    inner: the transformation to guard.

  Returns:
    A ``optax.GradientTransformation`` with ``inner``'s state.
  """

  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    ok = all_finite(updates, new_updates, new_state)
    updates = jax.tree.map(
      lambda x: jnp.where(ok, x, jnp.zeros((), x.dtype)), new_updates
    )
    return updates, jax.tree.map(
      lambda n, o: jnp.where(ok, n, o).astype(jnp.asarray(n).dtype),
      new_state,
      state,
    )

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


# ---------------------------------------------------------------------------
# Finding dmuon states in any optax state tree, and their layout stamp.

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
@dataclasses.dataclass(frozen=True, repr=False)
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

  marker: Any
  value: Any
  name: str

  def tree_flatten_with_keys(self):
    keys = map(jax.tree_util.DictKey, ('stamp_marker', 'stamp'))
    return tuple(zip(keys, (self.marker, self.value))), self.name

  @classmethod
  def tree_unflatten(cls, name, children):
    """Raises if ``children`` are the stamp of a layout other than the one
    named ``name`` (values not readable without waiting, or not stamps at
    all, pass)."""
    got = [_read(x) for x in children]
    if all(
      x is not None and x.shape == () and x.dtype == np.uint32 for x in got
    ):
      saved = int(got[1])
      if int(got[0]) == _MAGIC and saved != int(name.rsplit('_', 1)[-1], 16):
        raise ValueError(
          STAMP_MISMATCH_MSG.format(name=name, saved=f'..._{saved:08x}')
        )
    return cls(*children, name)

  def __repr__(self) -> str:
    return f'LayoutStamp({self.name})'


def make_stamp(layout: _owner_layout.OwnerLayout, place=None) -> LayoutStamp:
  """The stamp of a fresh state of ``layout`` (``place`` puts it on the
  mesh, as the step count)."""
  values = [jax.numpy.asarray(x) for x in stamp_value(layout)]
  if place is not None:
    values = [place(x) for x in values]
  return LayoutStamp(*values, layout.name)
