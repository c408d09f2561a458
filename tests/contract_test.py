"""dmuon behaves as an optax GradientTransformation: composition, jit, state."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest

import dmuon_jax
from tests import support

# Compile-heavy: the README command runs these, the inner loop
# (-m 'not slow') does not (tests/conftest.py).
SLOW_CASES = (r'^ContractTest::test_inject_hyperparams_learning_rate$',)

DIMS = support.dim_numbers


def small_params():
  params = support.make_params()
  del params['layers_0']
  return params


@functools.cache
def small_setup():
  """One optimizer, state and gradients, shared (its jitted update compiles
  once per process)."""
  params = small_params()
  opt = dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=DIMS(params))
  return params, opt, opt.init(params), support.grads_at(0, params)


def zeros_like(tree):
  return jax.tree.map(jnp.zeros_like, tree)


class ContractTest(chex.TestCase):
  def test_init_from_shape_dtype_structs(self):
    params, opt, from_arrays, _ = small_setup()
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )
    # The same state (structure, layout metadata and values) from shapes.
    chex.assert_trees_all_equal(opt.init(abstract), from_arrays)
    # jax.eval_shape works too (no concrete values needed).
    chex.assert_trees_all_equal_shapes_and_dtypes(
      jax.eval_shape(opt.init, abstract), from_arrays
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_update_equals_jitted_update_and_keeps_state_types(self):
    params, opt, state, grads = small_setup()
    updates, new_state = self.variant(opt.update)(grads, state, params)
    # Eager (op by op) and jit agree to float32 rounding.
    reference = jax.jit(opt.update)(grads, state, params)
    chex.assert_trees_all_close(
      (updates, new_state), reference, rtol=1e-6, atol=1e-7
    )
    # The state keeps its types (shapes, dtypes, shardings) step after step.
    types = jax.tree.map(jax.typeof, state)
    self.assertEqual(jax.tree.map(jax.typeof, new_state), types)
    _, again = self.variant(opt.update)(grads, new_state, params)
    self.assertEqual(jax.tree.map(jax.typeof, again), types)

  def test_compiles_once_across_steps(self):
    params, opt, state, _ = small_setup()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state):
      updates, state = opt.update(support.grads_at(0, params), state, params)
      return optax.apply_updates(params, updates), state

    for _ in range(3):
      params, state = step(params, state)

  def test_bf16_params_keep_dtypes_with_f32_momentum(self):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), small_params())
    opt = dmuon_jax.dmuon(
      0.02, mu_dtype=jnp.float32, muon_weight_dimension_numbers=DIMS(params)
    )
    state = opt.init(params)
    updates, new_state = jax.jit(opt.update)(
      support.grads_at(0, params), state, params
    )
    chex.assert_tree_all_finite(updates)
    # float32 updates on Muon and AdamW leaves, as optax.contrib.muon gives
    # (the momentum's dtype); apply_updates casts them to the params' dtype.
    for u in jax.tree.leaves(updates):
      self.assertEqual(u.dtype, jnp.float32)
    new_params = optax.apply_updates(params, updates)
    self.assertEqual(
      jax.tree.map(jax.typeof, new_params), jax.tree.map(jax.typeof, params)
    )
    self.assertEqual(
      jax.tree.map(jax.typeof, new_state), jax.tree.map(jax.typeof, state)
    )
    dmuon_states = [
      x
      for x in jax.tree.leaves(
        new_state, is_leaf=lambda x: isinstance(x, dmuon_jax.ScaleByDMuonState)
      )
      if isinstance(x, dmuon_jax.ScaleByDMuonState)
    ]
    self.assertLen(dmuon_states, 1)
    self.assertNotEmpty(dmuon_states[0].mu)
    self.assertTrue(all(m.dtype == jnp.float32 for m in dmuon_states[0].mu))

  def test_inject_hyperparams_learning_rate(self):
    params = small_params()
    dims = DIMS(params)
    opt = optax.inject_hyperparams(dmuon_jax.dmuon)(
      learning_rate=0.02, muon_weight_dimension_numbers=dims
    )
    # optax.contrib.muon under the same wrapper: AdamW leaves see the same
    # injected (array) learning rate.
    plain = optax.inject_hyperparams(optax.contrib.muon)(
      learning_rate=0.02, muon_weight_dimension_numbers=dims
    )
    ours = support.run(opt, params, steps=3)
    ref = support.run(plain, params, steps=3)
    support.assert_trees_rel_close(
      self, ours[-1], ref[-1], rtol=support.OPTAX_F32_RTOL
    )
    # Changing the injected learning rate changes the step.
    state = opt.init(params)
    state.hyperparams['learning_rate'] = jnp.asarray(0.0)
    updates, _ = opt.update(support.grads_at(0, params), state, params)
    chex.assert_trees_all_equal(updates, zeros_like(updates))

  def test_multi_steps_accumulates_then_matches_mean_gradient(self):
    params = small_params()
    dims = DIMS(params)
    opt = optax.MultiSteps(
      dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=dims), 2
    )
    state = opt.init(params)
    g0, g1 = support.grads_at(0, params), support.grads_at(1, params)
    u0, state = jax.jit(opt.update)(g0, state, params)
    chex.assert_trees_all_equal(u0, zeros_like(u0))
    u1, state = jax.jit(opt.update)(g1, state, params)
    inner = dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=dims)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
    expected, _ = inner.update(mean, inner.init(params), params)
    chex.assert_trees_all_close(u1, expected, rtol=1e-5, atol=1e-7)

  def test_schedule_matches_optax(self):
    params = small_params()
    dims = DIMS(params)
    schedule = optax.linear_schedule(0.02, 0.0, 4)
    ours = support.run(
      dmuon_jax.dmuon(schedule, muon_weight_dimension_numbers=dims),
      params,
      steps=5,
    )
    ref = support.run(
      optax.contrib.muon(schedule, muon_weight_dimension_numbers=dims),
      params,
      steps=5,
    )
    support.assert_trees_rel_close(
      self, ours[-1], ref[-1], rtol=support.OPTAX_F32_RTOL
    )
    # The schedule reached zero: the last step changed nothing.
    chex.assert_trees_all_equal(ours[-1], ours[-2])

  def test_chain_with_clipping_matches_optax(self):
    params = small_params()
    dims = DIMS(params)
    ours = support.run(
      optax.chain(
        optax.clip_by_global_norm(1.0),
        dmuon_jax.dmuon(0.02, muon_weight_dimension_numbers=dims),
      ),
      params,
      4,
    )
    ref = support.run(
      optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims),
      ),
      params,
      4,
    )
    support.assert_trees_rel_close(
      self, ours[-1], ref[-1], rtol=support.OPTAX_F32_RTOL
    )

  def test_update_with_a_different_tree_raises(self):
    params, opt, state, _ = small_setup()
    other = dict(params, odd={'kernel': jnp.zeros((9, 13))})
    with self.assertRaisesRegex(ValueError, 'does not match the one given to'):
      opt.update(other, state, other)


class FlaxNnxTest(absltest.TestCase):
  def test_nnx_optimizer_runs_a_step(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    class Mlp(nnx.Module):
      def __init__(self, rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 16, rngs=rngs)

      def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
          x = jax.nn.gelu(layer(x))
        return self.head(self.norm(x))

    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dmuon_jax.dmuon(0.05), wrt=nnx.Param)
    tokens = jnp.arange(12).reshape(3, 4) % 16

    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]
      ).mean()

    @nnx.jit
    def train_step(model, optimizer):
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    before = np.asarray(model.layers[0].kernel[...])
    losses = [float(train_step(model, optimizer)) for _ in range(3)]
    self.assertLess(losses[-1], losses[0])
    after = np.asarray(model.layers[0].kernel[...])
    # Hidden kernels are Muon targets: their update is orthogonal-ish,
    # lr * NS(.) with singular values near 1, so it has spectral norm ~lr.
    delta = np.linalg.svd(after - before, compute_uv=False)
    self.assertGreater(delta[0], 0.01)
    labels = dmuon_jax.muon_labels(nnx.as_pure(nnx.state(model, nnx.Param)))
    self.assertEqual(labels['layers'][0]['kernel'], 'muon')
    self.assertEqual(labels['embed']['embedding'], 'adam')
    self.assertEqual(labels['head']['kernel'], 'adam')


if __name__ == '__main__':
  absltest.main()
