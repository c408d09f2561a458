"""Cost model: Newton–Schulz FLOPs, bytes against FLOPs, readable units."""

from __future__ import annotations

from dmuon_jax import _newton_schulz


def plural(n: int, one: str, many: str) -> str:
  return f'{n} {one if n == 1 else many}'


def human_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.2f} {unit}'
    n /= 1024
  raise AssertionError('unreachable')


def human_flops(n: float) -> str:
  for prefix in ('', 'k', 'M', 'G', 'T', 'P'):
    if abs(n) < 1000 or prefix == 'P':
      return f'{n:.0f} FLOP' if not prefix else f'{n:.2f} {prefix}FLOP'
    n /= 1000
  raise AssertionError('unreachable')


def ring_bytes(kind: str, group_size: int, full_bytes: float) -> float:
  """Per-device bytes of one collective on the ring model, the one model
  behind every prediction and measurement of this package: over
  ``group_size`` devices, with ``full_bytes`` the size of the whole array
  (an all-gather's result, a reduce-scatter's or all-to-all's operand),
  ``(g - 1) / g`` of it, twice that for an all-reduce; a point-to-point
  send moves its array. 0 over one device."""
  if group_size <= 1:
    return 0.0
  frac = (group_size - 1) / group_size
  if kind == 'all-reduce':
    return 2 * frac * full_bytes
  if kind in ('collective-permute', 'collective-broadcast'):
    return float(full_bytes)
  return frac * full_bytes


def route_bytes(
  num_slots: int, group_size: int, row_bytes: float
) -> dict[str, float]:
  """Per-device bytes of the drop-in update's routes for one class of
  rows: ``row_bytes`` per owner of an axis group of ``group_size``
  devices, all-to-all to the owners over that group and back, then an
  all-gather over the other ``num_slots / group_size`` coordinates:
  ``2 (g - 1) b`` and ``(N - g) b`` (with the all-to-all back, the
  ``(N - 1) b`` of one all-to-all over all N devices)."""
  return {
    'all-to-all': 2
    * ring_bytes('all-to-all', group_size, group_size * row_bytes),
    'all-gather': ring_bytes(
      'all-gather', num_slots // group_size, num_slots * row_bytes
    ),
  }


def ns_flops(m: int, n: int, ns_steps: int = 5) -> float:
  """Predicted FLOPs of Newton–Schulz on an ``m x n`` matrix.

  With ``s = min(m, n)`` and ``l = max(m, n)``, each quintic iteration forms
  ``A = X Xᵀ`` (``2 s² l``), ``A·A`` (``2 s³``) and ``B·X`` (``2 s² l``), so
  the total is ``ns_steps * (4 s² l + 2 s³)`` (about ``20 s² l + 10 s³`` for
  5 steps, see ../shared/DESIGN.md, "Performance model").

  Args:
    m: number of rows.
    n: number of columns.
    ns_steps: number of Newton–Schulz iterations.

  Returns:
    The FLOP count, as a float.
  """
  s, l = min(m, n), max(m, n)
  return float(ns_steps) * (4.0 * s * s * l + 2.0 * s**3)


NS_ALGORITHMS = ('auto', 'standard', 'gram')


def ns_cost(
  m: int, n: int, ns_steps: int = 5, ns_algorithm: str = 'auto'
) -> float:
  """Predicted matmul FLOPs of the Newton–Schulz form that will run.

  ``'standard'`` is :func:`ns_flops`; ``'gram'`` the Gram form with its
  default restarts; ``'auto'`` the cheaper of the two for this shape (what
  :func:`dmuon_jax.dmuon` runs by default: Gram for aspect ratios above about
  1.5 with 5 iterations).

  Args:
    m: rows.
    n: columns.
    ns_steps: Newton–Schulz iterations.
    ns_algorithm: ``'auto'``, ``'standard'`` or ``'gram'``.

  Returns:
    The FLOP count, as a float.
  """
  if ns_algorithm not in NS_ALGORITHMS:
    raise ValueError(
      f'dmuon: ns_algorithm={ns_algorithm!r} is not one of {NS_ALGORITHMS}.'
    )
  if ns_algorithm == 'auto':
    ns_algorithm = _newton_schulz.cheaper_ns_algorithm(m, n, ns_steps)
  return float(_newton_schulz.matmul_flops(m, n, ns_steps, ns_algorithm))


# The planner's exchange rate between Gram bytes and NS FLOPs: a byte a
# device sends in a group's collectives counts as this many FLOPs (a GPU
# doing ~1e14 FLOP/s of float32 matmuls over ~1e12 bytes/s of NVLink).
FLOPS_PER_BYTE = 100.0


def gram_parts(
  s: int, l: int, ns_steps: int
) -> tuple[float, tuple[float, ...]]:
  """``(long-side work, g x g iteration per restart window)`` FLOPs of Gram
  Newton–Schulz on an ``s x l`` matrix (``s <= l``) with the default
  restarts.

  The long-side work (forming each window's Gram ``X X^T`` and applying
  its factor ``Q X``: ``4 p s^2 l`` for ``p`` windows) splits over slices
  of the long side; the iteration on the ``s x s`` Gram (``(8 k_j - 6)
  s^3`` in a window of ``k_j`` iterations, ``(8 k - 6 p) s^3`` in all)
  does not, but each window's starts from a Gram formed anew from the
  slices, so windows may run on different devices. Together they are
  :func:`dmuon_jax.matmul_flops` of the Gram form.
  """
  restarts = _newton_schulz.check_restart_iterations(None, ns_steps)
  windows = _newton_schulz.gram_segments(ns_steps, restarts)
  work = 4.0 * len(windows) * s * s * l
  return work, tuple(float((8 * (b - a) - 6) * s**3) for a, b in windows)
