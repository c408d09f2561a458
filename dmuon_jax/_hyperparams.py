"""Checks of numeric hyperparameters when a factory is called."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

_SCHEDULE_HINT = (
  'Pass a number (e.g. 0.02) or a schedule, a callable step -> value such'
  ' as optax.cosine_decay_schedule(0.02, 1000).'
)


def _concrete(value: Any) -> np.ndarray | None:
  """``value`` as a numpy array, or None when it is only known at run time
  (a tracer, or an array not fully on this process)."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, jax.Array):
    if not value.is_fully_addressable:
      return None
    return np.asarray(value)
  return np.asarray(value)


def _number(name: str, value: Any, hint: str) -> float | None:
  """The value of a real scalar hyperparameter, None if not concrete.

  Raises:
    TypeError: if ``value`` is not a real number (a str, None, a bool, a
      non-scalar array).
  """
  if (
    isinstance(value, (str, bytes)) or value is None or isinstance(value, bool)
  ):
    kind = 'None' if value is None else f'a {type(value).__name__}'
    raise TypeError(f'dmuon: {name}={value!r} is {kind}, not a number. {hint}')
  try:
    arr = _concrete(value)
  except (TypeError, ValueError) as e:
    raise TypeError(
      f'dmuon: {name}={value!r} ({type(value).__name__}) is not a number.'
      f' {hint}'
    ) from e
  if arr is None:
    return None
  if arr.shape != () or not (
    np.issubdtype(arr.dtype, np.floating)
    or np.issubdtype(arr.dtype, np.integer)
  ):
    raise TypeError(
      f'dmuon: {name}={value!r} is not a real scalar (shape {arr.shape},'
      f' dtype {arr.dtype}). {hint}'
    )
  return float(arr)


def check_learning_rate(name: str, value: Any) -> None:
  """A learning rate: a schedule, or a finite number >= 0."""
  if callable(value) and not isinstance(value, jax.Array):
    return  # A schedule: its values are only known at run time.
  x = _number(name, value, _SCHEDULE_HINT)
  if x is not None and not (math.isfinite(x) and x >= 0):
    raise ValueError(
      f'dmuon: {name}={value!r} must be a finite number >= 0 (updates are'
      ' subtracted: a negative rate would climb the loss). Pass its'
      ' magnitude, e.g. 0.02, or a schedule.'
    )


def decay_rate(name: str, value: Any, what: str) -> None:
  """A moment decay rate in ``[0, 1)``."""
  x = _number(name, value, f'Pass a decay rate in [0, 1), e.g. {what}.')
  if x is not None and not (0 <= x < 1):
    raise ValueError(
      f'dmuon: {name}={value!r} must be in [0, 1): at 1 the moment never'
      " forgets (optax's bias correction 1 - beta**t divides by zero) and"
      f' above 1 it grows without bound. Use a decay rate such as {what}.'
    )


def positive(name: str, value: Any, example: str, why: str) -> None:
  """A finite number > 0."""
  x = _number(name, value, f'Pass a number > 0, e.g. {example}.')
  if x is not None and not (math.isfinite(x) and x > 0):
    raise ValueError(
      f'dmuon: {name}={value!r} must be a finite number > 0 ({why}).'
      f' Use e.g. {example}.'
    )


def nonnegative(name: str, value: Any, example: str) -> None:
  """A finite number >= 0."""
  x = _number(name, value, f'Pass a number >= 0, e.g. {example}.')
  if x is not None and not (math.isfinite(x) and x >= 0):
    raise ValueError(
      f'dmuon: {name}={value!r} must be a finite number >= 0. Use e.g.'
      f' {example}.'
    )


def real(name: str, value: Any, example: str) -> None:
  """A real number (any sign), or a run-time value."""
  _number(name, value, f'Pass a number, e.g. {example}.')


def check_muon(
  *,
  beta: Any,
  eps: Any,
  consistent_rms: Any = None,
  weight_decay: Any = None,
) -> None:
  """The Muon hyperparameters every factory shares."""
  decay_rate('beta', beta, '0.95')
  positive(
    'eps',
    eps,
    '1e-8',
    'it keeps the normalization of a zero gradient, and AdamW of a zero'
    ' second moment, from dividing by zero',
  )
  if consistent_rms is not None:
    nonnegative('consistent_rms', consistent_rms, '0.2')
  if weight_decay is not None:
    real('weight_decay', weight_decay, '0.1')


def check_adam(
  *,
  learning_rate: Any,
  adam_learning_rate: Any,
  adam_b1: Any,
  adam_b2: Any,
  adam_eps_root: Any,
  adam_weight_decay: Any,
) -> None:
  """The learning rates and AdamW hyperparameters of the aliases."""
  check_learning_rate('learning_rate', learning_rate)
  if adam_learning_rate is not None:
    check_learning_rate('adam_learning_rate', adam_learning_rate)
  decay_rate('adam_b1', adam_b1, '0.9')
  decay_rate('adam_b2', adam_b2, '0.999')
  nonnegative('adam_eps_root', adam_eps_root, '0.0')
  real('adam_weight_decay', adam_weight_decay, '0.1')
