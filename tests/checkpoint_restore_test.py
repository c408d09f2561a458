"""Restores keep the shardings of params_like (Auto and Explicit meshes)."""

import functools
import tempfile
import warnings

import jax
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dmuon_jax
from dmuon_jax import checkpoint
from tests import support

LR = 0.02
SHAPES = {
  'w1': (64, 32),
  'w2': (32, 64),
  'w3': (64, 32),
  'w4': (32, 64),
  'b': (32,),
}
SAVED_AT = 3
STEPS = 6


def host_params():
  rng = np.random.default_rng(0)
  return {
    k: (0.1 * rng.standard_normal(s)).astype(np.float32)
    for k, s in SHAPES.items()
  }


def batch_specs():
  """``P('batch', None)`` for the matrices, ``P('batch')`` for the bias."""
  return {k: P('batch', *[None] * (len(s) - 1)) for k, s in SHAPES.items()}


def mesh_of(n, kind):
  return support.make_mesh((n,), ('batch',), kind=kind)


def like_on(mesh):
  """``params_like``: ShapeDtypeStructs placed by ``batch_specs``."""
  return {
    k: jax.ShapeDtypeStruct(
      SHAPES[k], np.float32, sharding=NamedSharding(mesh, spec)
    )
    for k, spec in batch_specs().items()
  }


def train(opt, params, state, start, stop, mesh):
  """Steps ``start..stop`` on :func:`support.grads_at`, jitted, with the
  params' and state's placement pinned (see ``support.pin_placement``)."""
  params, state, pinned = support.pin_placement(params, state)

  @functools.partial(jax.jit, **pinned)
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  shardings = jax.tree.map(lambda x: x.sharding, params)
  for i in range(start, stop):
    grads = jax.device_put(support.grads_at(i, params), shardings)
    with jax.set_mesh(mesh):
      params, state = step(params, state, grads)
  return params, state


def dmuon_warnings(caught):
  return [
    str(w.message)
    for w in caught
    if issubclass(w.category, dmuon_jax.DMuonWarning)
  ]


class RestoreKeepsShardingsTest(parameterized.TestCase):
  """Trained 3 steps on 8 devices, restored onto 4 with params_like sharded
  over 'batch': the state is laid out as a fresh init on those params."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # optax.contrib.muon on one device, the 6 steps uninterrupted.
    params = jax.device_put(host_params(), jax.devices()[0])
    ref = support.optax_muon(LR, params)
    state = ref.init(params)
    for i in range(STEPS):
      updates, state = ref.update(support.grads_at(i, params), state, params)
      params = optax.apply_updates(params, updates)
    cls.expected = jax.tree.map(np.asarray, params)

  @parameterized.named_parameters(
    ('auto', AxisType.Auto),
    ('explicit', AxisType.Explicit),
  )
  def test_restored_layout_is_a_fresh_inits(self, kind):
    mesh8 = mesh_of(8, kind)
    opt8 = dmuon_jax.dmuon(LR, mesh=mesh8)
    params = jax.device_put(
      host_params(),
      {k: NamedSharding(mesh8, s) for k, s in batch_specs().items()},
    )
    params, state = train(opt8, params, opt8.init(params), 0, SAVED_AT, mesh8)
    mesh4 = mesh_of(4, kind)
    opt4 = dmuon_jax.dmuon(LR, mesh=mesh4)
    with tempfile.TemporaryDirectory() as directory:
      checkpoint.save(directory, SAVED_AT, params, state, opt=opt8)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        step, params, state = checkpoint.restore(
          directory, like_on(mesh4), opt4
        )
        self.assertEqual(step, SAVED_AT)
        for k, spec in batch_specs().items():
          self.assertEqual(params[k].sharding, NamedSharding(mesh4, spec))
        (restored,) = dmuon_jax.owner_layouts(state)
        (fresh,) = dmuon_jax.owner_layouts(opt4.init(params))
        # param_entries is compared on its own too: it may leave ==.
        self.assertEqual(restored.param_entries, fresh.param_entries)
        self.assertEqual(restored, fresh)
        self.assertEqual(restored.collective_bytes(), fresh.collective_bytes())
        self.assertIn(', 0 unknown', restored.summary())
        params, _ = train(opt4, params, state, SAVED_AT, STEPS, mesh4)
    self.assertEqual(dmuon_warnings(caught), [])
    support.assert_trees_rel_close(
      self, params, self.expected, support.OPTAX_F32_RTOL
    )


if __name__ == '__main__':
  absltest.main()
