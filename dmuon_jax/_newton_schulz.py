"""Newton-Schulz (direct, Gram, TP Gram), presets, the large-matrix rescale,
the FLOP model. One Gram iteration (:func:`gram_factor` per restart window)
for whole and split matrices; one window of a split matrix from its summed
Grams (:func:`window_factor`) for the TP function here and ``_staged``'s
stages (which sum the Grams between stages)."""

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

# Anything that :func:`resolve_ns_coeffs` accepts: a preset name, one row
# ``(a, b, c)`` or a sequence / array of rows of shape ``(k, 3)``.
NSCoeffsLike: TypeAlias = (
  str | Sequence[float] | Sequence[Sequence[float]] | np.ndarray
)
Preconditioning: TypeAlias = Literal['frobenius', 'spectral', 'aol', 'schatten']

_DEFAULT_NS_STEPS = 5

# Polar Express, degree 5 (Amsel, Persson, Musco & Gower 2025,
# arXiv:2505.16932): the first five rows of the paper's coefficient list,
# before any safety factor is applied.
_POLAR_EXPRESS_RAW_ROWS = (
  (8.28721201814563, -23.595886519098837, 17.300387312530933),
  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
# Safety factor s: every row p(x) = a x + b x^3 + c x^5 is replaced by
# p(x / s), i.e. (a / s, b / s^3, c / s^5), so that each polynomial stays
# well-behaved on singular values up to s instead of 1, which round-off can
# produce. This is the encoding used by Gram Newton-Schulz (Dao-AILab) and
# DMuon.
_SAFETY = 1.05


NS_COEFF_PRESETS: dict[str, tuple[tuple[float, float, float], ...]] = {
  # Keller Jordan's Muon quintic (optax's 'standard'), repeated ns_steps
  # times: https://kellerjordan.github.io/posts/muon/
  'jordan': ((3.4445, -4.7750, 2.0315),),
  # Jiacheng You's five per-iteration rows (optax's 'dion').
  'you': (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
  ),
  # Polar Express (arXiv:2505.16932), safety factor 1.05, see above.
  'polar_express_sf1.05': tuple(
    (a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW_ROWS
  ),
}
"""Newton-Schulz coefficients by name, one row ``(a, b, c)`` per iteration.

A single row (``'jordan'``) is repeated ``ns_steps`` times (5 by default);
several rows run once each. Aliases: ``'standard'`` (optax's name) for
``'jordan'`` and ``'dion'`` for ``'you'``. The singular values each preset
produces, in float32 and low precision: :doc:`/reference/newton_schulz`.
"""

# Names used by optax.contrib.muon, accepted as aliases.
_PRESET_ALIASES = {'standard': 'jordan', 'dion': 'you'}

PRECONDITIONINGS = ('frobenius', 'spectral', 'aol', 'schatten')
COMPUTE_DTYPES = tuple(
  jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
)


def is_int(value: object) -> bool:
  """Whether ``value`` is a Python or numpy int (not a bool)."""
  return isinstance(value, (int, np.integer)) and not isinstance(
    value, (bool, np.bool_)
  )


def resolve_ns_coeffs(
  ns_coeffs: NSCoeffsLike, ns_steps: int | None = None
) -> np.ndarray:
  r"""Resolves Newton-Schulz coefficients to one row per iteration.

  Each row :math:`(a, b, c)` defines one iteration
  :math:`X \leftarrow a X + (b A + c A^2) X` with :math:`A = X X^\top`,
  which maps every singular value :math:`\sigma` of :math:`X` to
  :math:`a \sigma + b \sigma^3 + c \sigma^5`.

  Args:
    ns_coeffs: a preset name from :data:`NS_COEFF_PRESETS` (or one of optax's
      names ``'standard'`` for ``'jordan'`` and ``'dion'`` for ``'you'``); a
      single row ``(a, b, c)``; or a sequence of rows / array of shape
      ``(k, 3)``, one row per iteration. The values must be static (Python or
      NumPy numbers, not traced arrays) and finite.
    ns_steps: (optional, default None) number of iterations. A triple of
      shape ``(3,)`` or a one-row preset such as ``'jordan'`` is repeated
      ``ns_steps`` times, 5 when None. Rows of shape ``(k, 3)`` (any
      ``k >= 1``, also a multi-row preset) run exactly once each, so
      ``ns_steps`` must then be None or ``k``.

  Returns:
    A new float64 NumPy array of shape ``(k, 3)``, row ``i`` holding the
    coefficients of iteration ``i``. Resolving the result again returns it
    unchanged, so callers may pass it on as ``ns_coeffs``.

  Raises:
    ValueError: for an unknown preset name, a shape other than ``(3,)`` or
      ``(k, 3)`` with ``k >= 1``, non-finite values, an ``ns_steps`` that is
      not a positive int, or ``ns_steps`` disagreeing with ``k`` rows.

  Examples:
    >>> import dmuon_jax
    >>> dmuon_jax.resolve_ns_coeffs('jordan', ns_steps=2)
    array([[ 3.4445, -4.775 ,  2.0315],
           [ 3.4445, -4.775 ,  2.0315]])
    >>> dmuon_jax.resolve_ns_coeffs('you').shape  # five rows, once each
    (5, 3)
    >>> dmuon_jax.resolve_ns_coeffs((2.0, -1.5, 0.5)).shape  # 5 by default
    (5, 3)
  """
  if ns_steps is not None and (not is_int(ns_steps) or ns_steps < 1):
    raise ValueError(
      f'dmuon: ns_steps must be a positive int or None, got {ns_steps!r}. Pass'
      ' None (5 steps for a single row, all rows otherwise) or an int >= 1.'
    )
  if isinstance(ns_coeffs, str):
    name = _PRESET_ALIASES.get(ns_coeffs, ns_coeffs)
    if name not in NS_COEFF_PRESETS:
      known = ', '.join(repr(n) for n in (*NS_COEFF_PRESETS, *_PRESET_ALIASES))
      raise ValueError(
        f'ns_coeffs: unknown preset {ns_coeffs!r}. Known presets: {known}.'
        ' Or pass the coefficients themselves: one row (a, b, c) or a'
        ' (k, 3) array.'
      )
    rows = NS_COEFF_PRESETS[name]
    ns_coeffs = rows[0] if len(rows) == 1 else rows  # one row: repeated
  try:
    coeffs = np.array(ns_coeffs, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(
      'ns_coeffs must be a preset name, one row (a, b, c) or a (k, 3)'
      f' array of static numbers (not traced arrays), got {ns_coeffs!r}.'
    ) from e
  repeat = coeffs.shape == (3,)
  coeffs = coeffs[None] if repeat else coeffs
  if coeffs.ndim != 2 or coeffs.shape[1] != 3 or coeffs.shape[0] < 1:
    raise ValueError(
      'ns_coeffs must have shape (3,) (one row (a, b, c), repeated ns_steps'
      ' times) or (k, 3) with k >= 1 (one row per iteration), got shape'
      f' {coeffs.shape}.'
    )
  if not np.all(np.isfinite(coeffs)):
    raise ValueError(
      f'ns_coeffs must be finite, got {coeffs.tolist()}. Pass finite'
      ' coefficients.'
    )
  if repeat:
    return np.repeat(coeffs, ns_steps or _DEFAULT_NS_STEPS, axis=0)
  k = coeffs.shape[0]
  if ns_steps not in (None, k):
    raise ValueError(
      f'ns_coeffs has {k} rows (one per iteration) but {ns_steps=}. Pass'
      f' ns_steps=None or ns_steps={k} to run the {k} rows, or pass exactly'
      f' {ns_steps} rows (or one row of shape (3,), which is repeated'
      ' ns_steps times).'
    )
  return coeffs


def _transpose(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)


def _clipped_rsqrt(x: jax.Array, eps: jax.typing.ArrayLike) -> jax.Array:
  """``1 / sqrt(max(x, eps))``, finite even for ``eps = 0``.

  The floor is also clipped at the smallest normal number, so that a zero
  matrix is scaled by a finite factor and stays zero.
  """
  floor = jnp.maximum(eps, jnp.finfo(x.dtype).tiny).astype(x.dtype)
  return jax.lax.rsqrt(jnp.maximum(x, floor))


def check_ns_options(
  where: str, preconditioning: str, compute_dtype: jax.typing.DTypeLike | None
) -> None:
  """Raises for an unknown ``preconditioning`` or ``compute_dtype`` (None:
  the input's dtype); ``where`` names the caller in the message."""
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(
      f'{where}: {preconditioning=} is not one of {PRECONDITIONINGS}.'
    )
  if compute_dtype is not None and jnp.dtype(compute_dtype) not in (
    COMPUTE_DTYPES
  ):
    raise ValueError(
      f'{where}: compute_dtype={compute_dtype!r} is not one of'
      f' {tuple(d.name for d in COMPUTE_DTYPES)} (or None: the dtype of the'
      ' input).'
    )


def _orient(x: jax.Array) -> tuple[jax.Array, bool]:
  """Transposes tall matrices so that rows are the short side."""
  if x.shape[-2] > x.shape[-1]:
    return _transpose(x), True
  return x, False


def _normalize(
  x: jax.Array, preconditioning: str, eps: jax.typing.ArrayLike
) -> tuple[jax.Array, jax.Array | None]:
  """Scales each matrix so that its singular values are at most about 1.

  Args:
    x: matrices of shape ``(..., m, n)`` with ``m <= n``, in the
      normalization dtype (float32 or float64).
    preconditioning: one of ``PRECONDITIONINGS``.
    eps: added to the norms, or the lower clip of the AOL / Schatten factors.

  Returns:
    The scaled matrices and, for ``'aol'`` and ``'schatten'``, their Gram
    matrices ``X X^T`` (computed for the scaling, reused by the first
    iteration), else None.
  """
  if preconditioning in ('frobenius', 'spectral'):
    ord_ = 'fro' if preconditioning == 'frobenius' else 2
    norm = jnp.linalg.norm(x, ord=ord_, axis=(-2, -1), keepdims=True) + eps
    # A zero matrix (norm 0 with eps = 0) stays zero.
    return x / jnp.where(norm > 0, norm, 1), None
  gram = x @ _transpose(x)
  if preconditioning == 'aol':
    # Almost-orthogonal-layer scaling: X <- D^{-1/2} X with D the row sums of
    # |X X^T|; D^{-1/2} X X^T D^{-1/2} then has every absolute row sum <= 1,
    # hence spectral norm <= 1.
    scale = _clipped_rsqrt(jnp.abs(gram).sum(axis=-1), eps)[..., None]
    return x * scale, gram * scale * _transpose(scale)
  # Schatten-4 scaling: X <- X / ||X X^T||_F^{1/2} = X / ||X||_{S4}, an upper
  # bound of the spectral norm tighter than the Frobenius norm.
  norm = jnp.linalg.norm(gram, ord='fro', axis=(-2, -1), keepdims=True)
  scale = _clipped_rsqrt(norm, eps)
  return x * scale, gram * scale**2


def _prepare(
  fn_name: str,
  x: jax.Array,
  preconditioning: str,
  eps: jax.typing.ArrayLike,
  compute_dtype: jax.typing.DTypeLike | None,
) -> tuple[jax.Array, jax.Array | None, bool, jnp.dtype]:
  """Validates the arguments (``fn_name`` names the caller), then
  flattens, orients, normalizes and casts to the compute dtype (returned
  too; None means the dtype of ``x``).

  The leading axes are flattened into one batch axis, also for a single
  matrix: on CPU, XLA's batched and unbatched matmuls round differently, and
  the batched one is what ``optax.contrib`` (which uses ``jax.vmap``) runs.
  """
  if x.ndim < 2:
    raise ValueError(
      f'{fn_name}: x must have shape (..., m, n), got shape {x.shape}.'
      ' Reshape vectors to (1, n) or (n, 1).'
    )
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f'{fn_name}: x must have a real floating dtype, got {x.dtype}. '
      'Cast it first, e.g. x.astype(jnp.float32).'
    )
  check_ns_options(fn_name, preconditioning, compute_dtype)
  compute_dtype = jnp.dtype(x.dtype if compute_dtype is None else compute_dtype)
  x = x.reshape((math.prod(x.shape[:-2]),) + x.shape[-2:])
  x, transposed = _orient(x)
  norm_dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  x, gram = _normalize(x.astype(norm_dtype), preconditioning, eps)
  if gram is not None:
    gram = gram.astype(compute_dtype)
  return x.astype(compute_dtype), gram, transposed, compute_dtype


def _finish(y: jax.Array, transposed: bool, x: jax.Array) -> jax.Array:
  """Undoes :func:`_prepare`'s transposition, flattening and cast."""
  if transposed:
    y = _transpose(y)
  return y.reshape(x.shape).astype(x.dtype)


def _coeffs(row: np.ndarray, dtype: jnp.dtype) -> tuple[jax.Array, ...]:
  return tuple(jnp.asarray(v, dtype=dtype) for v in row)


LARGE = 2.0**10  # See rescale_large.


def rescale_large(x: jax.Array, amax: jax.Array | None = None) -> jax.Array:
  """Divides each matrix whose max-abs entry exceeds ``LARGE`` by 2^k.

  Newton-Schulz normalizes in float32 through sums of squares (the Frobenius
  norm, the Gram matrix ``X X^T`` and, for ``'schatten'``, its squares),
  which overflow for entries above about 1e19 (1e9 for ``'schatten'``):
  the result is then zero (``'frobenius'``) or NaN (``'aol'``,
  ``'schatten'``). Newton-Schulz is scale invariant (up to ``eps``), so
  such matrices are brought to a max-abs entry in ``[0.5, 1)`` first. The
  factor is a power of two, so the scaling itself rounds nothing, and
  matrices at most ``LARGE`` (and dtypes whose range stays below it) are
  left bitwise as they are. ``amax``: the max-abs entries of the ``(..., m,
  n)`` matrices ``x`` (broadcastable), None to read them from ``x``; a
  matrix split over devices passes its pieces' maximum (``_staged``)."""
  if not jnp.issubdtype(x.dtype, jnp.floating) or (
    jnp.finfo(x.dtype).max <= LARGE
  ):
    return x
  if amax is None:
    # initial=0: the max-abs of an empty (e.g. (0, n)) matrix is 0, which a
    # reduction without an identity would refuse.
    amax = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True, initial=0)
  # The factor is built from the IEEE 754 exponent field (as frexp reads
  # it): a few integer ops, where jnp.frexp + jnp.ldexp expand to ~60 ops
  # per call (a third of a small model's compiled update). Exact: float32
  # holds every bfloat16/float16 value.
  wide = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  info = jnp.finfo(wide)
  ints = jnp.int64 if wide == jnp.float64 else jnp.int32
  bias = info.maxexp - 1  # 127 for float32
  a = amax.astype(wide)
  field = (jax.lax.bitcast_convert_type(a, ints) >> info.nmant) & (2 * bias + 1)
  # a = f * 2**e, f in [0.5, 1), e = field - bias + 1; 2**-e has the field
  # bias - e. At most 2**(1 - bias), the smallest normal (a >= 2**(bias -
  # 1), near float32's max: the result's max-abs entry is then in [1, 4)).
  scale_field = jnp.maximum(2 * bias - 1 - field, 1).astype(ints)
  factor = jax.lax.bitcast_convert_type(scale_field << info.nmant, wide)
  return x * jnp.where((a > LARGE) & (a < jnp.inf), factor, 1).astype(x.dtype)


def orthogonalize_via_newton_schulz(
  x: jax.typing.ArrayLike,
  ns_coeffs: NSCoeffsLike = 'jordan',
  ns_steps: int | None = None,
  *,
  preconditioning: Preconditioning = 'frobenius',
  eps: jax.typing.ArrayLike = 1e-8,
  compute_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  r"""Approximates the polar factor of each matrix by Newton-Schulz iterations.

  For :math:`X = U \Sigma V^\top` (reduced SVD) the result approximates
  :math:`U V^\top`: it is :math:`U \varphi(\Sigma / \nu) V^\top`, where
  :math:`\nu` is the normalization of ``preconditioning`` and :math:`\varphi`
  composes the odd quintics :math:`p_i(\sigma) = a_i \sigma + b_i \sigma^3 +
  c_i \sigma^5` of the rows of ``ns_coeffs``. Each iteration computes

  .. math::
    A = X X^\top, \quad B = b A + (c A) A, \quad X \leftarrow a X + B X

  on the short side (tall matrices are transposed, then transposed back).
  The normalization runs in float32 (float64 for float64 inputs), the
  iterations in ``compute_dtype``. For float32 inputs this follows the
  operation order of ``optax.contrib.orthogonalize_via_newton_schulz`` with
  the same coefficients and preconditioning (under ``jax.jit`` on CPU we
  observed bitwise-equal results); optax normalizes low-precision inputs in
  their own dtype instead. The singular values each preset of
  :data:`NS_COEFF_PRESETS` produces: :doc:`/reference/newton_schulz`.

  Args:
    x: array of shape ``(..., m, n)``; every matrix over the leading axes is
      orthogonalized independently.
    ns_coeffs: (optional, default ``'jordan'``) a preset name, a row
      ``(a, b, c)`` or ``(k, 3)`` rows; see :func:`resolve_ns_coeffs`.
    ns_steps: (optional, default None) number of iterations for a row of
      shape ``(3,)`` (5 when None); must be None or ``k`` for ``(k, 3)``
      rows.
    preconditioning: (optional, default ``'frobenius'``) ``'frobenius'``
      divides by :math:`\|X\|_F + \epsilon`; ``'spectral'`` by
      :math:`\|X\|_2 + \epsilon`; ``'aol'`` scales the rows by
      :math:`D^{-1/2}`, with :math:`D` the absolute row sums of
      :math:`X X^\top` (clipped below at ``eps``); ``'schatten'`` divides by
      :math:`\|X X^\top\|_F^{1/2}` (clipped below at ``eps``). The last two
      replace the first iteration by one on the rescaled matrix, as optax
      does.
    eps: (optional, default 1e-8) added to the norm (``'frobenius'``,
      ``'spectral'``) or lower clip (``'aol'``, ``'schatten'``). A zero
      matrix gives a zero result, never NaN, even with ``eps=0``.
    compute_dtype: (optional, default None) dtype of the iterations: one of
      float32, bfloat16, float16, float64; None means the dtype of ``x``.
      The coefficients are cast to it.

  Returns:
    An array of the shape and dtype of ``x``.

  Raises:
    ValueError: for invalid ``ns_coeffs``, ``ns_steps``,
      ``preconditioning`` or ``compute_dtype``, or ``x.ndim < 2``.
    TypeError: if ``x`` does not have a real floating dtype.

  Examples:
    >>> import jax, numpy as np, dmuon_jax
    >>> x = jax.random.normal(jax.random.key(0), (4, 16))
    >>> y = dmuon_jax.orthogonalize_via_newton_schulz(x)
    >>> y.shape, y.dtype
    ((4, 16), dtype('float32'))
    >>> s = np.linalg.svd(y, compute_uv=False)  # in 'jordan''s band
    >>> bool(((0.68 < s) & (s < 1.21)).all())
    True
    >>> err = dmuon_jax.orthogonality_error  # 0 for orthonormal rows
    >>> float(err(y)) < 0.25 < 10 < float(err(x))
    True
    >>> stack = x.reshape(2, 4, 8)  # two matrices, each on its own
    >>> dmuon_jax.orthogonalize_via_newton_schulz(stack, 'you').shape
    (2, 4, 8)

  References:
    Jordan, `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  rows = resolve_ns_coeffs(ns_coeffs, ns_steps)
  x = jnp.asarray(x)
  y, gram, transposed, compute_dtype = _prepare(
    'orthogonalize_via_newton_schulz', x, preconditioning, eps, compute_dtype
  )
  if gram is not None:  # 'aol'/'schatten' computed the first X X^T already
    y = _quintic_step(y, gram, _coeffs(rows[0], compute_dtype))
    rows = rows[1:]
  if len(rows) > 1:
    # One loop body instead of an unrolled copy per iteration (as optax's
    # Newton-Schulz loops): the compiled update of many matrix shapes is
    # several times smaller and compiles faster; same operations, same
    # order. The coefficients travel as data (rounded to the compute dtype,
    # as the unrolled form's constants are).
    def body(y, row):
      return _quintic_step(y, y @ _transpose(y), (row[0], row[1], row[2])), None

    y, _ = jax.lax.scan(body, y, jnp.asarray(np.asarray(rows), compute_dtype))
  elif len(rows):
    y = _quintic_step(y, y @ _transpose(y), _coeffs(rows[0], compute_dtype))
  return _finish(y, transposed, x)


def _quintic_step(y, gram, coeffs):
  """One iteration ``X <- a X + (b A + c A^2) X`` with ``A = gram``."""
  a, b, c = coeffs
  poly = b * gram + (c * gram) @ gram
  return a * y + poly @ y


def orthogonalize_via_gram_newton_schulz(
  x: jax.typing.ArrayLike,
  ns_coeffs: NSCoeffsLike = 'jordan',
  ns_steps: int | None = None,
  *,
  restart_iterations: Sequence[int] | None = None,
  preconditioning: Preconditioning = 'frobenius',
  eps: jax.typing.ArrayLike = 1e-8,
  compute_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  r"""Newton-Schulz orthogonalization in the Gram (short-side) formulation.

  Computes the same polynomial of :math:`X` as
  :func:`orthogonalize_via_newton_schulz`, but iterates on the small
  :math:`m \times m` Gram matrix instead of the :math:`m \times n` matrix
  (:math:`m \le n` after transposing tall matrices). With :math:`X_0` the
  normalized input, :math:`R = X_0 X_0^\top` and :math:`Q = I`, iteration
  :math:`i` computes

  .. math::
    Z = a_i I + b_i R + c_i R^2, \quad Q \leftarrow Z Q,
    \quad R \leftarrow Z R Z,

  (:math:`Z` is a polynomial in :math:`R`, so :math:`X_i = Q X_0` and
  :math:`R = X_i X_i^\top`; :math:`R` is re-symmetrized after each update),
  and returns :math:`Q X_0`. Rounding errors in :math:`R` grow through the
  iterations, so before each iteration in ``restart_iterations`` the product
  is formed explicitly: :math:`X_0 \leftarrow Q X_0`,
  :math:`R \leftarrow X_0 X_0^\top`, :math:`Q \leftarrow I`. Only these
  products and the first and last ones involve the long side: with 5
  iterations and one restart, :math:`8 m^2 n + 28 m^3` matmul FLOPs instead
  of the direct form's :math:`20 m^2 n + 10 m^3`, fewer when
  :math:`n > 1.5 m`. In float32 the two forms agree to about
  :math:`10^{-5}` relative; in low precision, restarts matter.

  Args:
    x: array of shape ``(..., m, n)``; every matrix over the leading axes is
      orthogonalized independently.
    ns_coeffs: (optional, default ``'jordan'``) a preset name, a row
      ``(a, b, c)`` or ``(k, 3)`` rows; see :func:`resolve_ns_coeffs`.
    ns_steps: (optional, default None) number of iterations for a row of
      shape ``(3,)`` (5 when None); must be None or ``k`` for ``(k, 3)``
      rows.
    restart_iterations: (optional, default None) strictly increasing
      iteration indices in ``[1, k - 1]`` before which to restart; ``()``
      never restarts. None: ``(2,)`` (restart before iteration 2) when there
      are at least 3 iterations, else ``()``.
    preconditioning: (optional, default ``'frobenius'``) as in
      :func:`orthogonalize_via_newton_schulz`.
    eps: (optional, default 1e-8) as in
      :func:`orthogonalize_via_newton_schulz`.
    compute_dtype: (optional, default None) dtype of the iterations: one of
      float32, bfloat16, float16, float64; None means the dtype of ``x``.

  Returns:
    An array of the shape and dtype of ``x``.

  Raises:
    ValueError: for invalid ``ns_coeffs``, ``ns_steps``,
      ``restart_iterations``, ``preconditioning`` or ``compute_dtype``, or
      ``x.ndim < 2``.
    TypeError: if ``x`` does not have a real floating dtype.

  Examples:
    >>> import jax, numpy as np, dmuon_jax
    >>> x = jax.random.normal(jax.random.key(0), (4, 16))
    >>> y = dmuon_jax.orthogonalize_via_gram_newton_schulz(x)
    >>> y.shape
    (4, 16)
    >>> direct = dmuon_jax.orthogonalize_via_newton_schulz(x)
    >>> bool(np.allclose(y, direct, atol=1e-5))  # the same polynomial
    True

  References:
    Dao, Zhang, Amsel & Chen, `Gram Newton-Schulz
    <https://tridao.me/blog/2026/gram-newton-schulz/>`_, 2026; code at
    https://github.com/Dao-AILab/gram-newton-schulz
  """
  rows = resolve_ns_coeffs(ns_coeffs, ns_steps)
  windows = gram_windows(len(rows), restart_iterations)
  x = jnp.asarray(x)
  x0, r, transposed, _ = _prepare(
    'orthogonalize_via_gram_newton_schulz',
    x,
    preconditioning,
    eps,
    compute_dtype,
  )
  for w, (start, end) in enumerate(windows):
    if w or r is None:
      r = x0 @ _transpose(x0)
    x0 = gram_factor(r, rows[start:end]) @ x0
  return _finish(x0, transposed, x)


def gram_windows(
  k: int, restart_iterations: Sequence[int] | None = None, long_gram=False
) -> tuple[tuple[int, int], ...]:
  """The ``[start, end)`` iteration ranges between the restarts of ``k``
  iterations. ``restart_iterations``: strictly increasing ints in ``[1, k -
  1]``; None: ``(2,)`` for >= 3 iterations, else ``()``; with
  ``long_gram`` (the Gram of a TP-split matrix is over its long side)
  ``(1, 3)`` for >= 4 iterations (the iteration amplifies the rounding in
  its large null space; seen: 1.6e-5 against direct NS with one restart on
  32 x 128, 3.7e-6 with two)."""
  if restart_iterations is None:
    long = long_gram and k >= 4
    restart_iterations = (1, 3) if long else (2,) if k >= 3 else ()
  try:
    restarts = tuple(restart_iterations)
  except TypeError as e:
    raise ValueError(
      'restart_iterations must be a sequence of ints, got'
      f' {restart_iterations!r}.'
    ) from e
  valid = all(is_int(i) and 1 <= i < k for i in restarts)
  increasing = all(a < b for a, b in zip(restarts, restarts[1:]))
  if not valid or not increasing:
    raise ValueError(
      'restart_iterations must hold strictly increasing ints in [1,'
      f' {k - 1}] (iteration indices, for {k} iterations), got'
      f' {restart_iterations!r}. Pass () for no restart.'
    )
  bounds = (0, *(int(i) for i in restarts), k)
  return tuple(zip(bounds[:-1], bounds[1:]))


def gram_factor(r: jax.Array, rows: np.ndarray) -> jax.Array:
  """The factor ``Q`` of one restart window: from the Gram ``R`` of the
  window's ``X``, iterates ``Z = a I + b R + c R^2, Q <- Z Q,
  R <- Z R Z`` over ``rows`` (``R`` re-symmetrized); ``Q X`` is the
  window's result. Only ``g x g`` matrices: this is the part of Gram
  Newton–Schulz that does not split over the long side."""
  eye = jnp.eye(r.shape[-1], dtype=r.dtype)
  q = None  # The identity, not materialized.
  for j, row in enumerate(rows):
    a, b, c = _coeffs(row, r.dtype)
    z = b * r + (c * r) @ r + a * eye
    q = z if q is None else z @ q
    if j + 1 < len(rows):
      r = (z @ r) @ z
      r = 0.5 * (r + _transpose(r))
  return q


def window_factor(
  gram: jax.Array, rows: np.ndarray, first: bool, eps, compute_dtype
) -> tuple[jax.Array, jax.Array | None]:
  """One restart window of a matrix split over devices (TP shards, an
  owner group's members), from ``gram``, the sum of its pieces' Grams (in
  the norm dtype): the window's factor (:func:`gram_factor` in
  ``compute_dtype``) and, in the ``first`` window, the Frobenius
  normalization ``1 / (||X||_F + eps)`` (1 where that is zero, read from
  ``trace(gram)``) that it assumes applied to ``X``; None in later ones."""
  if not first:
    return gram_factor(gram.astype(compute_dtype), rows), None
  norm = jnp.sqrt(jnp.maximum(jnp.trace(gram, axis1=-2, axis2=-1), 0)) + eps
  scale = (1 / jnp.where(norm > 0, norm, 1))[..., None, None]
  scale = scale.astype(gram.dtype)
  return gram_factor((gram * scale**2).astype(compute_dtype), rows), scale


def split_last(x: jax.Array, split_axis: int) -> jax.Array:
  """``x`` with its split dimension (``split_axis``: -1 or -2) last."""
  return x if split_axis == -1 else _transpose(x)


def orthogonalize_via_gram_newton_schulz_tp(
  x: jax.Array,
  ns_coeffs: NSCoeffsLike = 'jordan',
  ns_steps: int | None = None,
  *,
  axis_name: str,
  split_axis: Literal[-1, -2] = -1,
  restart_iterations: tuple[int, ...] | None = None,
  eps: jax.typing.ArrayLike = 1e-8,
  compute_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  r"""Gram Newton–Schulz of a TP-sharded matrix, inside ``shard_map``.

  The result is this shard's slice of the Newton–Schulz polynomial of the
  whole matrix (the same polynomial as
  :func:`dmuon_jax.orthogonalize_via_newton_schulz` with Frobenius
  normalization).

  With the split dimension last, ``X = [X_1 | ... | X_T]``, the Gram of
  the unsplit dimension is ``R = X X^T = sum_t X_t X_t^T``: one ``psum`` of
  a ``g x g`` matrix per restart window, ``||X||_F^2 = trace(R)`` with it. Each shard then iterates ``Z = a I + b R + c R^2, Q <- Z Q,
  R <- Z R Z`` on ``g x g`` matrices and returns ``Q X_t``. When TP splits
  the long side (Megatron column-parallel ``(d, f)`` split along ``f``,
  row-parallel ``(f, d)`` split along ``f``), ``g`` is the short side:
  that is the cheap case, Gram Newton–Schulz proper. When it splits the
  short side, ``g`` is the long side: still exact (``p(X X^T) X =
  X p(X^T X)``), but the all-reduce and the iteration are ``g x g`` with
  ``g`` the larger dimension.

  Precision: in float32 the result equals direct Newton–Schulz on the whole
  matrix to about 1e-6 relative. With ``compute_dtype=bfloat16`` (the Gram
  and the norm still float32) it stays within 8e-2 of it, and within the
  coefficients' band around the SVD polar factor: for ``'jordan'`` the
  singular values stay in [0.6, 1.3] (float32: [0.68, 1.14]) and the
  relative distance to the polar factor grows by less than 0.03 (tested in
  ``tests/tensor_parallel_test.py``).

  Args:
    x: this shard's slice, ``(..., m, n_local)`` for ``split_axis=-1``
      (columns split) or ``(..., m_local, n)`` for ``split_axis=-2``.
    ns_coeffs: a preset name, a row ``(a, b, c)`` or ``(k, 3)`` rows; see
      :func:`dmuon_jax.resolve_ns_coeffs`.
    ns_steps: iterations for a single row (5 when None).
    axis_name: the TP mesh axis the matrix is split over.
    split_axis: -1 if the columns are split, -2 if the rows are.
    restart_iterations: iterations before which the Gram is formed again
      from the shards (one more ``psum`` each); None: ``(2,)`` when there are
      at least 3 iterations, ``(1, 3)`` for a Gram over the long side (at
      least 4 iterations).
    eps: added to the Frobenius norm.
    compute_dtype: dtype of the iterations (None: the dtype of ``x``); the
      Gram and the norm are formed in float32 (float64 for float64 input).

  Returns:
    This shard's slice of the result, shape and dtype of ``x``.

  Raises:
    ValueError: for invalid coefficients, restarts or ``split_axis``.

  Examples:
    >>> import functools, jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import dmuon_jax
    >>> devices = jax.devices()[:2]  # a TP axis of 2, or 1 on one device
    >>> mesh = jax.make_mesh((len(devices),), ('model',), devices=devices)
    >>> column = P(None, 'model')  # columns split over 'model'
    >>> ns = jax.shard_map(functools.partial(
    ...     dmuon_jax.orthogonalize_via_gram_newton_schulz_tp,
    ...     axis_name='model', split_axis=-1),
    ...     mesh=mesh, in_specs=column, out_specs=column)
    >>> x = jax.random.normal(jax.random.key(0), (16, 64))
    >>> y = ns(jax.device_put(x, NamedSharding(mesh, column)))
    >>> want = dmuon_jax.orthogonalize_via_newton_schulz(x)
    >>> bool(np.allclose(y, want, atol=1e-5))
    True
  """
  if split_axis not in (-1, -2):
    raise ValueError(
      f'dmuon: split_axis={split_axis!r} must be -1 (columns '
      'split) or -2 (rows split).'
    )
  rows = resolve_ns_coeffs(ns_coeffs, ns_steps)
  try:
    tp = jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
      f'dmuon: axis_name={axis_name!r} is not bound here: call '
      'orthogonalize_via_gram_newton_schulz_tp inside jax.shard_map over a '
      'mesh with that axis (the matrix split over it).'
    ) from e
  x = jnp.asarray(x)
  compute_dtype = jnp.dtype(compute_dtype or x.dtype)
  norm_dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  x0 = split_last(x.astype(norm_dtype), split_axis)
  long_gram = x0.shape[-2] > x0.shape[-1] * tp
  windows = gram_windows(len(rows), restart_iterations, long_gram)
  for w, (start, end) in enumerate(windows):
    gram = jax.lax.psum(x0 @ _transpose(x0), axis_name)
    q, scale = window_factor(gram, rows[start:end], not w, eps, compute_dtype)
    if scale is not None:
      x0 = (x0 * scale).astype(compute_dtype)
    x0 = q @ x0
  return split_last(x0, split_axis).astype(x.dtype)


def matmul_flops(
  m: int,
  n: int,
  k: int,
  algorithm: Literal['standard', 'gram'],
  restart_iterations: Sequence[int] | None = None,
) -> int:
  """Matmul FLOPs of one orthogonalization (2 per multiply-add).

  Elementwise work (scaling, adding ``a I``) and the normalization are not
  counted. With ``s = min(m, n)``, ``l = max(m, n)``:

  - ``'standard'``: per iteration ``A = X X^T`` (2 s^2 l), ``(c A) A``
    (2 s^3) and ``B X`` (2 s^2 l): ``k (4 s^2 l + 2 s^3)``.
  - ``'gram'``, with ``p = len(restart_iterations) + 1`` segments of
    ``k_j`` iterations: each segment forms ``R = X X^T`` once (2 s^2 l) and
    ends with ``Q X`` (2 s^2 l: the restart product or the output); each
    iteration computes ``(c R) R`` (2 s^3), ``Z Q`` except in the first
    iteration of a segment (2 s^3), and ``(Z R) Z`` except in the last
    (4 s^3): ``4 p s^2 l + sum_j (2 k_j + 6 (k_j - 1)) s^3
    = 4 p s^2 l + (8 k - 6 p) s^3``. Symmetry of ``R`` is not exploited.

  Args:
    m: rows.
    n: columns.
    k: number of iterations.
    algorithm: ``'standard'`` (direct) or ``'gram'``.
    restart_iterations: (optional, default None) for ``'gram'`` only, as in
      :func:`orthogonalize_via_gram_newton_schulz`.

  Returns:
    The number of floating-point operations.
  """
  s, long = min(m, n), max(m, n)
  if algorithm == 'standard':
    return k * (4 * s * s * long + 2 * s**3)
  p = len(gram_windows(k, restart_iterations))
  return 4 * p * s * s * long + (8 * k - 6 * p) * s**3


def cheaper_ns_algorithm(m: int, n: int, k: int) -> Literal['standard', 'gram']:
  """The Newton–Schulz form with fewer matmul FLOPs for an ``m x n`` matrix.

  Compares :func:`matmul_flops` of the direct form and of the Gram form with its
  default restarts: Gram wins for wide (or tall) matrices, from an aspect
  ratio of about 1.5 with 5 iterations; ties go to the direct form.

  Args:
    m: rows.
    n: columns.
    k: number of iterations.

  Returns:
    ``'gram'`` or ``'standard'``.
  """
  gram = matmul_flops(m, n, k, 'gram')
  return 'gram' if gram < matmul_flops(m, n, k, 'standard') else 'standard'


def orthogonality_error(x: jax.typing.ArrayLike) -> jax.Array:
  r"""Distance of each matrix from having orthonormal rows or columns.

  With :math:`s = \min(m, n)` and :math:`Y` the matrix oriented so that its
  :math:`s` short-side vectors are rows, returns
  :math:`\|Y Y^\top - I_s\|_F / \sqrt{s}`: 0 for a semi-orthogonal matrix,
  and the root-mean-square of :math:`\sigma_i^2 - 1` over the singular
  values :math:`\sigma_i`.

  Args:
    x: array of shape ``(..., m, n)``.

  Returns:
    A float32 array (float64 for float64 inputs) of shape ``x.shape[:-2]``.

  Examples:
    >>> import jax.numpy as jnp, dmuon_jax
    >>> eye = jnp.eye(4, 16)  # orthonormal rows
    >>> float(dmuon_jax.orthogonality_error(eye))
    0.0
    >>> float(dmuon_jax.orthogonality_error(2 * eye))  # 2**2 - 1
    3.0
    >>> dmuon_jax.orthogonality_error(jnp.stack([eye, 2 * eye])).tolist()
    [0.0, 3.0]
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(
      f'orthogonality_error: x must have shape (..., m, n), got {x.shape}.'
    )
  dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  y, _ = _orient(x.astype(dtype))
  s = y.shape[-2]
  gram = jnp.matmul(y, _transpose(y), precision=jax.lax.Precision.HIGHEST)
  residual = gram - jnp.eye(s, dtype=dtype)
  norm = jnp.linalg.norm(residual, ord='fro', axis=(-2, -1))
  return norm / math.sqrt(max(s, 1))
