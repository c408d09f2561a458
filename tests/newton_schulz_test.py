"""Tests for dmuon_jax._newton_schulz against NumPy SVD and optax."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.extend import core as jax_core
from optax.contrib import _muon as optax_muon

from dmuon_jax import _newton_schulz as ns

_STATIC = ('ns_coeffs', 'ns_steps', 'preconditioning', 'compute_dtype')
# Shared compiled functions: jit caches one executable per static
# configuration and shape, which the tests below reuse.
_direct = jax.jit(ns.orthogonalize_via_newton_schulz, static_argnames=_STATIC)
_gram = jax.jit(
  ns.orthogonalize_via_gram_newton_schulz,
  static_argnames=_STATIC + ('restart_iterations',),
)
_ALGORITHMS = {'direct': _direct, 'gram': _gram}

# Coefficients written out independently of the module.
_JORDAN = ((3.4445, -4.7750, 2.0315),) * 5
_YOU = (
  (4.0848, -6.8946, 2.9270),
  (3.9505, -6.3029, 2.6377),
  (3.7418, -5.5913, 2.3037),
  (2.8769, -3.1427, 1.2046),
  (2.8366, -3.0525, 1.2012),
)
_PE_RAW = (
  (8.28721201814563, -23.595886519098837, 17.300387312530933),
  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
_PE = tuple((a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in _PE_RAW)
_ROWS = {'jordan': _JORDAN, 'you': _YOU, 'polar_express_sf1.05': _PE}
_PRESETS = tuple(_ROWS)

# Documented in docs/reference/newton_schulz.md: range of the output singular values for
# normalized input singular values x = sigma / ||X||_F >= _CONVERGED_X.
_CONVERGED_X = 2e-3
_BANDS = {
  'jordan': (0.681, 1.203),
  'you': (0.852, 1.146),
  'polar_express_sf1.05': (0.846, 1.124),
}
# Also documented: x from which the band is reached, and phi(1e-3).
_BAND_EDGES = {
  'jordan': 1.5e-3,
  'you': 2.0e-3,
  'polar_express_sf1.05': 1.22e-3,
}
_PHI_AT_1E_3 = {'jordan': 0.47, 'you': 0.47, 'polar_express_sf1.05': 0.73}
# bfloat16 input and compute: 0.1 below and 0.05 above the float32 band.
_BF16_SLACK = (0.1, 0.05)
# Gram form with float16 compute: within 0.02 of the float32 band.
_FP16_GRAM_SLACK = 0.02


def _phi(x: np.ndarray, rows) -> np.ndarray:
  """Scalar reference: the composed quintics, in float64."""
  x = np.asarray(x, np.float64)
  for a, b, c in rows:
    x = a * x + b * x**3 + c * x**5
  return x


def _random_svd(m: int, n: int, cond: float, seed: int):
  """X = U diag(s) V^T with s log-spaced from 1 to 1 / cond (float64)."""
  rng = np.random.default_rng(seed)
  r = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, r)))
  v, _ = np.linalg.qr(rng.standard_normal((n, r)))
  s = np.logspace(0.0, -math.log10(cond), r)
  return u, s, v, (u * s) @ v.T


def _batch(m: int, n: int, conds, seeds=(0, 1)):
  """Stacks _random_svd matrices: returns lists of U, s, V and X (B, m, n)."""
  cases = [_random_svd(m, n, c, seed) for c in conds for seed in seeds]
  us, ss, vs, xs = zip(*cases, strict=True)
  return us, ss, vs, np.stack(xs)


def _gaussian(shape, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.cache
def _direct_on_gaussian(shape: tuple[int, ...], preset: str) -> np.ndarray:
  return np.asarray(_direct(_gaussian(shape), ns_coeffs=preset))


class PresetTest(parameterized.TestCase):
  @parameterized.named_parameters(*((p, p) for p in _PRESETS))
  def test_preset_rows(self, preset):
    np.testing.assert_allclose(
      ns.resolve_ns_coeffs(preset), np.array(_ROWS[preset]), rtol=1e-15
    )

  @parameterized.named_parameters(*((p, p) for p in _PRESETS))
  def test_documented_band_matches_polynomial(self, preset):
    lo, hi = _BANDS[preset]
    y = _phi(np.logspace(math.log10(_CONVERGED_X), 0.0, 200_001), _ROWS[preset])
    self.assertGreaterEqual(y.min(), lo)
    self.assertLessEqual(y.max(), hi)
    # The documented band is tight, not just any enclosing interval.
    self.assertLess(y.min() - lo, 2e-3)
    self.assertLess(hi - y.max(), 2e-3)
    # Nothing in [0, 1] exceeds the band or turns negative.
    y_all = _phi(np.linspace(0.0, 1.0, 200_001), _ROWS[preset])
    self.assertLessEqual(y_all.max(), hi)
    self.assertGreaterEqual(y_all.min(), 0.0)
    # Where the band starts, and how far x = 1e-3 gets.
    edge = _BAND_EDGES[preset]
    x_above = np.logspace(math.log10(1.01 * edge), 0.0, 20_001)
    self.assertGreaterEqual(_phi(x_above, _ROWS[preset]).min(), lo)
    self.assertLess(_phi(0.95 * edge, _ROWS[preset]), lo)
    self.assertAlmostEqual(
      _phi(1e-3, _ROWS[preset]), _PHI_AT_1E_3[preset], delta=0.01
    )

  @parameterized.named_parameters(
    (f'{p}_{name}', p, shape)
    for p in _PRESETS
    for name, shape in (
      ('square', (32, 32)),
      ('wide', (16, 48)),
      ('tall', (48, 16)),
    )
  )
  def test_singular_values_and_vectors(self, preset, shape):
    lo, hi = _BANDS[preset]
    conds = (1.0, 10.0, 1e2, 1e3)
    us, ss, vs, x = _batch(*shape, conds)
    out = np.asarray(_direct(jnp.asarray(x, jnp.float32), ns_coeffs=preset))
    self.assertEqual(out.shape, x.shape)
    num_unconverged = 0
    for i, (u, s, v) in enumerate(zip(us, ss, vs, strict=True)):
      o = out[i].astype(np.float64)
      # In the input's singular bases, the output is diag(phi(x)).
      d = u.T @ o @ v
      diag = np.diag(d)
      x_norm = s / np.linalg.norm(s)
      np.testing.assert_allclose(diag, _phi(x_norm, _ROWS[preset]), atol=1e-4)
      np.testing.assert_allclose(d - np.diag(diag), 0.0, atol=1e-4)
      # Converged part of the spectrum: in the documented band.
      converged = x_norm >= _CONVERGED_X
      self.assertGreaterEqual(converged.sum(), min(shape) // 2)
      num_unconverged += (~converged).sum()
      self.assertGreaterEqual(diag[converged].min(), lo - 1e-4)
      self.assertLessEqual(diag[converged].max(), hi + 1e-4)
      self.assertLessEqual(np.linalg.svd(o, compute_uv=False).max(), hi + 1e-4)
      if converged.all():
        # Distance to the exact polar factor U V^T, bounded by the band.
        polar = u @ v.T
        self.assertLessEqual(
          np.linalg.norm(o - polar, 2), max(1 - lo, hi - 1) + 1e-4
        )
    # cond = 1e3 does reach the unconverged part, as documented.
    self.assertGreater(num_unconverged, 0)


class RobustnessTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (f'{a}_{p}', a, p)
    for a in _ALGORITHMS
    for p in ('frobenius', 'spectral', 'aol', 'schatten')
  )
  def test_zero_tiny_and_regular(self, algorithm, preconditioning):
    fn = _ALGORITHMS[algorithm]
    _, _, _, regular = _random_svd(8, 24, 10.0, seed=3)
    tiny = 1e-30 * np.asarray(_gaussian((8, 24), seed=4))
    x = jnp.asarray(np.stack([np.zeros((8, 24)), tiny, regular]), jnp.float32)
    lo, hi = _BANDS['jordan']
    for eps in (1e-8, 0.0):  # eps is traced: one compilation.
      out = np.asarray(fn(x, preconditioning=preconditioning, eps=eps))
      self.assertTrue(np.isfinite(out).all(), msg=f'{eps=}')
      np.testing.assert_array_equal(out[0], 0.0)
      self.assertLessEqual(np.abs(out[1]).max(), 1.0)
      # Every preconditioning leaves the normalized singular values of this
      # cond-10 matrix far above 2e-3: they converge into the band.
      sv = np.linalg.svd(out[2], compute_uv=False)
      self.assertGreaterEqual(sv.min(), lo - 1e-4)
      self.assertLessEqual(sv.max(), hi + 1e-4)

  @parameterized.named_parameters(
    (f'{a}_{p}', a, p) for a in _ALGORITHMS for p in _PRESETS
  )
  def test_rank_deficient(self, algorithm, preset):
    lo, hi = _BANDS[preset]
    rng = np.random.default_rng(5)
    u, _ = np.linalg.qr(rng.standard_normal((16, 3)))
    v, _ = np.linalg.qr(rng.standard_normal((32, 3)))
    s = np.array([1.0, 0.3, 0.1])
    x = jnp.asarray((u * s) @ v.T, jnp.float32)
    out = np.asarray(_ALGORITHMS[algorithm](x, ns_coeffs=preset), np.float64)
    self.assertTrue(np.isfinite(out).all())
    # On the range: diag(phi(x)) in the band.
    diag = np.diag(u.T @ out @ v)
    np.testing.assert_allclose(
      diag, _phi(s / np.linalg.norm(s), _ROWS[preset]), atol=1e-4
    )
    self.assertGreaterEqual(diag.min(), lo - 1e-4)
    self.assertLessEqual(diag.max(), hi + 1e-4)
    # Off the range: float32 rounding noise amplified by about 500 (measured
    # up to 2.5e-5), still ~0.
    residual = out - u @ np.diag(diag) @ v.T
    self.assertLess(np.linalg.svd(residual, compute_uv=False).max(), 1e-4)
    sv = np.linalg.svd(out, compute_uv=False)
    self.assertLess(sv[3:].max(), 1e-4)

  @parameterized.named_parameters(
    (f'{a}_{name}', a, shape)
    for a in _ALGORITHMS
    for name, shape in (('row', (1, 32)), ('column', (32, 1)))
  )
  def test_vector_gives_unit_vector(self, algorithm, shape):
    x = np.asarray(_gaussian(shape, seed=6), np.float64)
    out = np.asarray(_ALGORITHMS[algorithm](jnp.asarray(x, jnp.float32)))
    self.assertEqual(out.shape, shape)
    unit = x / np.linalg.norm(x)
    # The polar factor of a vector is its unit vector; after 5 iterations
    # its single singular value 1 maps to phi(1).
    np.testing.assert_allclose(out, _phi(1.0, _JORDAN) * unit, atol=1e-6)
    cosine = np.sum(out * unit) / np.linalg.norm(out)
    self.assertGreater(cosine, 1 - 1e-6)

  @parameterized.named_parameters(
    (f'{a}_{name}', a, shape)
    for a in _ALGORITHMS
    for name, shape in (('wide', (8, 20)), ('tall', (20, 8)))
  )
  def test_batched_equals_loop(self, algorithm, shape):
    fn = _ALGORITHMS[algorithm]
    x = _gaussian((2, 3) + shape, seed=7)
    out = fn(x, ns_coeffs='you')
    self.assertEqual(out.shape, x.shape)
    for i in range(2):
      for j in range(3):
        # Batched and single matmuls may round differently (transposed
        # layouts): equal up to float32 rounding.
        np.testing.assert_allclose(
          out[i, j], fn(x[i, j], ns_coeffs='you'), rtol=1e-5, atol=1e-6
        )


class LowPrecisionTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (f'{a}_{p}', a, p) for a in _ALGORITHMS for p in _PRESETS
  )
  def test_bfloat16(self, algorithm, preset):
    lo, hi = _BANDS[preset]
    lo, hi = lo - _BF16_SLACK[0], hi + _BF16_SLACK[1]
    # The Gram form in bfloat16 only stays in the band for well-conditioned
    # inputs (documented); the direct form also for cond 1e3.
    conds = (1.0, 10.0) if algorithm == 'gram' else (1.0, 10.0, 1e3)
    _, ss, _, x = _batch(32, 64, conds)
    x = jnp.asarray(x, jnp.bfloat16)
    out = _ALGORITHMS[algorithm](x, ns_coeffs=preset)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertEqual(out.shape, x.shape)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    self.assertTrue(np.isfinite(out).all())
    for o, s in zip(out, ss, strict=True):
      num_converged = (s / np.linalg.norm(s) >= _CONVERGED_X).sum()
      sv = np.linalg.svd(o, compute_uv=False)
      self.assertLessEqual(sv.max(), hi)
      self.assertGreaterEqual((sv >= lo).sum(), num_converged)

  def test_gram_float16_compute(self):
    lo, hi = _BANDS['jordan']
    _, ss, _, x = _batch(32, 64, (1.0, 1e2, 1e3))
    out = _gram(jnp.asarray(x, jnp.bfloat16), compute_dtype=jnp.float16)
    self.assertEqual(out.dtype, jnp.bfloat16)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    for o, s in zip(out, ss, strict=True):
      num_converged = (s / np.linalg.norm(s) >= _CONVERGED_X).sum()
      sv = np.linalg.svd(o, compute_uv=False)
      self.assertLessEqual(sv.max(), hi + _FP16_GRAM_SLACK)
      num_in_band = (sv >= lo - _FP16_GRAM_SLACK).sum()
      self.assertGreaterEqual(num_in_band, num_converged)

  def test_bfloat16_input_float32_compute(self):
    x = _gaussian((16, 48)).astype(jnp.bfloat16)
    out = _direct(x, compute_dtype=jnp.float32)
    self.assertEqual(out.dtype, jnp.bfloat16)
    reference = _direct_on_gaussian((16, 48), 'jordan')
    # Only the input and output roundings to bfloat16 differ.
    self.assertLess(_rel_err(out.astype(jnp.float32), reference), 2e-2)


class OptaxTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    ('jordan_wide', 'jordan', (24, 40), 'frobenius'),
    ('jordan_tall', 'jordan', (40, 24), 'frobenius'),
    ('jordan_stacked', 'jordan', (3, 16, 24), 'frobenius'),
    ('you_wide', 'you', (24, 40), 'frobenius'),
    ('you_tall', 'you', (40, 24), 'frobenius'),
    ('jordan_spectral', 'jordan', (24, 40), 'spectral'),
    ('jordan_aol', 'jordan', (24, 40), 'aol'),
    ('jordan_schatten', 'jordan', (40, 24), 'schatten'),
    ('you_aol', 'you', (40, 24), 'aol'),
  )
  def test_matches_optax(self, preset, shape, preconditioning):
    x = _gaussian(shape, seed=9)
    coeffs = jnp.asarray(_JORDAN[0] if preset == 'jordan' else _YOU)
    dim_nums = None
    if len(shape) == 3:
      dim_nums = optax_muon.MuonDimensionNumbers(1, 2)
    expected = optax_muon.orthogonalize_via_newton_schulz(
      x,
      coeffs,
      5,
      preconditioning=preconditioning,
      dimension_numbers=dim_nums,
    )
    direct = self.variant(
      ns.orthogonalize_via_newton_schulz, static_argnames=_STATIC
    )
    out = direct(x, ns_coeffs=preset, preconditioning=preconditioning)
    # Op by op (without_jit, nothing fused) float32 rounds differently:
    # measured 1.04e-6 ('schatten') and 1.06e-6 ('aol', whose normalization
    # squares the Gram matrix) from optax's jitted result, <= 1e-6 jitted.
    tol = 1e-6 if self.variant.type == chex.ChexVariantType.WITH_JIT else 2e-6
    self.assertLessEqual(_rel_err(out, expected), tol)


_GRAM_SHAPES = (
  ('16x64', (16, 64)),
  ('32x128', (32, 128)),
  ('32x32', (32, 32)),
  ('64x64', (64, 64)),
)


class GramTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (f'{p}_{name}', p, shape) for p in _PRESETS for name, shape in _GRAM_SHAPES
  )
  def test_matches_direct(self, preset, shape):
    out = _gram(_gaussian(shape), ns_coeffs=preset)
    self.assertLessEqual(
      _rel_err(out, _direct_on_gaussian(shape, preset)), 1e-4
    )

  @parameterized.named_parameters(
    (f'{r_name}_{name}', restarts, shape)
    for r_name, restarts in (('none', ()), ('2_4', (2, 4)))
    for name, shape in _GRAM_SHAPES
  )
  def test_restarts_match_direct(self, restarts, shape):
    out = _gram(_gaussian(shape), restart_iterations=restarts)
    self.assertLessEqual(
      _rel_err(out, _direct_on_gaussian(shape, 'jordan')), 1e-4
    )

  @parameterized.named_parameters(
    ('zero', (0,)),
    ('too_large', (5,)),
    ('unsorted', (3, 2)),
    ('duplicate', (2, 2)),
    ('bool', (True,)),
    ('float', (2.0,)),
    ('not_a_sequence', 2),
  )
  def test_invalid_restart_iterations(self, restarts):
    with self.assertRaisesRegex(ValueError, 'restart_iterations'):
      ns.orthogonalize_via_gram_newton_schulz(
        jnp.ones((4, 8)), restart_iterations=restarts
      )

  def test_default_restart_skipped_below_three_iterations(self):
    x = jax.random.normal(jax.random.key(3), (4, 8))
    gram = ns.orthogonalize_via_gram_newton_schulz(x, ns_steps=2)
    direct = ns.orthogonalize_via_newton_schulz(x, ns_steps=2)
    np.testing.assert_allclose(gram, direct, rtol=1e-4, atol=1e-5)
    with self.assertRaisesRegex(ValueError, r'Pass \(\) for no restart'):
      ns.orthogonalize_via_gram_newton_schulz(
        x, ns_steps=2, restart_iterations=(2,)
      )


class ResolveNsCoeffsTest(parameterized.TestCase):
  def test_preset_shapes(self):
    self.assertEqual(ns.resolve_ns_coeffs('jordan').shape, (5, 3))
    self.assertEqual(ns.resolve_ns_coeffs('jordan', 3).shape, (3, 3))
    self.assertEqual(ns.resolve_ns_coeffs('you').shape, (5, 3))
    self.assertEqual(ns.resolve_ns_coeffs('you', 5).shape, (5, 3))
    self.assertEqual(ns.resolve_ns_coeffs('polar_express_sf1.05').shape, (5, 3))
    self.assertEqual(ns.resolve_ns_coeffs('jordan').dtype, np.float64)

  def test_aliases(self):
    np.testing.assert_array_equal(
      ns.resolve_ns_coeffs('standard'), ns.resolve_ns_coeffs('jordan')
    )
    np.testing.assert_array_equal(
      ns.resolve_ns_coeffs('dion'), ns.resolve_ns_coeffs('you')
    )

  @parameterized.named_parameters(
    ('tuple', (1.0, 2.0, 3.0)),
    ('array', np.array([1.0, 2.0, 3.0])),
  )
  def test_triple_is_repeated(self, coeffs):
    out = ns.resolve_ns_coeffs(coeffs, 4)
    np.testing.assert_array_equal(out, np.tile([1.0, 2.0, 3.0], (4, 1)))
    self.assertEqual(ns.resolve_ns_coeffs(coeffs).shape, (5, 3))

  def test_one_row_array_runs_once(self):
    row = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(ns.resolve_ns_coeffs(row), row)
    np.testing.assert_array_equal(ns.resolve_ns_coeffs(row, 1), row)
    with self.assertRaisesRegex(ValueError, '1 rows'):
      ns.resolve_ns_coeffs(row, 4)

  @parameterized.named_parameters(
    (f'{name}_{steps}', coeffs, steps)
    for name, coeffs in (
      ('jordan', 'jordan'),
      ('you', 'you'),
      ('triple', (1.0, -1.0, 0.5)),
    )
    for steps in (None, 1, 5)
    if name != 'you' or steps != 1
  )
  def test_idempotent(self, ns_coeffs, ns_steps):
    once = ns.resolve_ns_coeffs(ns_coeffs, ns_steps)
    np.testing.assert_array_equal(ns.resolve_ns_coeffs(once), once)
    np.testing.assert_array_equal(ns.resolve_ns_coeffs(once, len(once)), once)

  def test_rows_run_as_given(self):
    rows = np.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(ns.resolve_ns_coeffs(rows), rows)
    np.testing.assert_array_equal(ns.resolve_ns_coeffs(rows.tolist(), 4), rows)

  def test_unknown_preset(self):
    with self.assertRaisesRegex(ValueError, r"'nope'.*'jordan'.*'dion'"):
      ns.resolve_ns_coeffs('nope')

  def test_rows_and_ns_steps_disagree(self):
    with self.assertRaisesRegex(
      ValueError, r'4 rows.*ns_steps=5.*ns_steps=None or ns_steps=4'
    ):
      ns.resolve_ns_coeffs(np.ones((4, 3)), 5)

  @parameterized.named_parameters(
    ('pair', (1.0, 2.0)),
    ('two_columns', np.ones((5, 2))),
    ('three_dims', np.ones((2, 3, 3))),
    ('empty', np.ones((0, 3))),
    ('ragged', [(1.0, 2.0, 3.0), (1.0, 2.0)]),
  )
  def test_wrong_shape(self, coeffs):
    with self.assertRaisesRegex(ValueError, 'ns_coeffs'):
      ns.resolve_ns_coeffs(coeffs)

  def test_non_finite(self):
    with self.assertRaisesRegex(ValueError, 'finite'):
      ns.resolve_ns_coeffs((1.0, np.nan, 3.0))

  @parameterized.named_parameters(
    ('zero', 0), ('negative', -1), ('float', 2.5), ('bool', True)
  )
  def test_invalid_ns_steps(self, ns_steps):
    with self.assertRaisesRegex(ValueError, 'ns_steps'):
      ns.resolve_ns_coeffs('jordan', ns_steps)


class ArgumentErrorTest(parameterized.TestCase):
  @parameterized.named_parameters(*((a, a) for a in _ALGORITHMS))
  def test_errors(self, algorithm):
    fn = {
      'direct': ns.orthogonalize_via_newton_schulz,
      'gram': ns.orthogonalize_via_gram_newton_schulz,
    }[algorithm]
    with self.assertRaisesRegex(ValueError, 'preconditioning'):
      fn(jnp.ones((4, 8)), preconditioning='newton')
    with self.assertRaisesRegex(ValueError, 'compute_dtype'):
      fn(jnp.ones((4, 8)), compute_dtype=jnp.int32)
    with self.assertRaisesRegex(ValueError, r'shape \(\.\.\., m, n\)'):
      fn(jnp.ones((8,)))
    with self.assertRaisesRegex(TypeError, 'floating'):
      fn(jnp.ones((4, 8), jnp.int32))
    with self.assertRaisesRegex(ValueError, 'unknown preset'):
      fn(jnp.ones((4, 8)), ns_coeffs='nope')


class OrthogonalityErrorTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ('square', (16, 16), False),
    ('tall', (32, 8), False),
    ('wide', (32, 8), True),
  )
  def test_orthogonal_is_zero(self, shape, transpose):
    q, _ = np.linalg.qr(np.random.default_rng(10).standard_normal(shape))
    if transpose:
      q = q.T
    self.assertLess(float(ns.orthogonality_error(q.astype(np.float32))), 1e-6)

  def test_scaled_identity(self):
    # ||4 I - I||_F / sqrt(n) = 3 sqrt(n) / sqrt(n).
    np.testing.assert_allclose(
      ns.orthogonality_error(2 * jnp.eye(7)), 3.0, rtol=1e-6
    )

  def test_root_mean_square_formula_and_batch_shape(self):
    s = np.random.default_rng(11).uniform(0.5, 1.5, size=(2, 3, 5))
    x = np.zeros((2, 3, 5, 9))
    for i in range(5):
      x[:, :, i, i] = s[..., i]
    out = ns.orthogonality_error(jnp.asarray(x, jnp.float32))
    self.assertEqual(out.shape, (2, 3))
    self.assertEqual(out.dtype, jnp.float32)
    expected = np.sqrt(np.mean((s**2 - 1) ** 2, axis=-1))
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def _jaxpr_matmul_flops(fn, shape) -> int:
  """Sums 2 * output size * contraction size over the dot_generals (a scan's
  body times its length)."""

  def count(jaxpr) -> int:
    flops = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        (lhs_contract, _), _ = eqn.params['dimension_numbers']
        lhs_shape = eqn.invars[0].aval.shape
        out_size = math.prod(eqn.outvars[0].aval.shape)
        flops += 2 * out_size * math.prod(lhs_shape[d] for d in lhs_contract)
      for v in eqn.params.values():
        if isinstance(v, jax_core.ClosedJaxpr):
          trips = eqn.params['length'] if eqn.primitive.name == 'scan' else 1
          flops += trips * count(v.jaxpr)
    return flops

  return count(jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(shape, jnp.float32)))


class FlopsTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ('wide', (8, 32), ()),
    ('tall', (32, 8), (2,)),
    ('square', (16, 16), (1, 3)),
    ('wide_restarts', (8, 24), (2, 4)),
  )
  def test_formula_counts_the_traced_matmuls(self, shape, restarts):
    m, n = shape
    direct = _jaxpr_matmul_flops(ns.orthogonalize_via_newton_schulz, shape)
    self.assertEqual(direct, ns.matmul_flops(m, n, 5, 'standard'))
    gram = _jaxpr_matmul_flops(
      functools.partial(
        ns.orthogonalize_via_gram_newton_schulz,
        restart_iterations=restarts,
      ),
      shape,
    )
    self.assertEqual(gram, ns.matmul_flops(m, n, 5, 'gram', restarts))

  def test_gram_is_cheaper_for_wide_matrices(self):
    s = 64
    self.assertEqual(ns.matmul_flops(s, 4 * s, 5, 'standard'), 90 * s**3)
    self.assertEqual(ns.matmul_flops(s, 4 * s, 5, 'gram'), 60 * s**3)
    self.assertEqual(ns.matmul_flops(s, s, 5, 'gram'), 36 * s**3)


if __name__ == '__main__':
  absltest.main()
