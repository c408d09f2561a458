"""Explicit gradient reduction: train steps written inside ``shard_map``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from dmuon_jax import _collectives


def _mesh_axes(axis_names: Sequence[str] | None) -> tuple[str, ...]:
  if axis_names is not None:
    return tuple(axis_names)
  axes = _collectives.manual_axes()
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

    def to_varying(x):
      missing = tuple(a for a in axes if a not in _collectives.varying_axes(x))
      return jax.lax.pcast(x, missing, to='varying') if missing else x

    args = list(args)
    args[argnums] = jax.tree.map(to_varying, args[argnums])
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
    if not _collectives.manual_axes():
      return updates, state
    axes = set(_mesh_axes(axis_names))

    def mean(x):
      varying = tuple(
        a
        for a in _mesh_axes(axis_names)
        if a in _collectives.varying_axes(x) and a in axes
      )
      return jax.lax.pmean(x, varying) if varying else x

    return jax.tree.map(mean, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
