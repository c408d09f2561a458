"""Shared test helpers: meshes, models, references, train steps, assertions.

Test modules import this module only (never each other), so each keeps its
own tests and the references they share are computed once per process.
"""

import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN
from optax.contrib import _muon as optax_muon_module

import dmuon_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The suite's HLO tooling (per-device matmul FLOPs, StableHLO collectives)
# lives with the benchmarks that use it too: examples/benchmarks/hlo_tools.py.
sys.path.append(str(ROOT / 'examples' / 'benchmarks'))
import hlo_tools as hlo_tools  # noqa: E402

AXES = ('replicate', 'shard')
STEPS = 20
MESHES = (('1x8', (1, 8)), ('2x4', (2, 4)), ('4x2', (4, 2)), ('8x1', (8, 1)))


# -- meshes -------------------------------------------------------------------


def make_mesh(shape, names=AXES, kind=AxisType.Explicit):
  """A mesh over the first devices; skips the test if there are too few."""
  n = int(np.prod(shape))
  if jax.device_count() < n:
    raise absltest.SkipTest(f'needs {n} devices, found {jax.device_count()}')
  return jax.make_mesh(
    shape, names, axis_types=(kind,) * len(names), devices=jax.devices()[:n]
  )


def fsdp_shardings(params, mesh, axes=('shard',)):
  """Shards each leaf's first dim divisible by ``axes`` (else replicated)."""
  size = int(np.prod([mesh.shape[a] for a in axes]))

  def one(x):
    for dim in range(x.ndim):
      if size > 1 and x.shape[dim] % size == 0:
        spec = [None] * x.ndim
        spec[dim] = axes
        return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, params)


def place(params, mesh, layout):
  """``'replicated'`` or ``'fsdp'`` (see :func:`fsdp_shardings`)."""
  if layout == 'replicated':
    return jax.device_put(params, NamedSharding(mesh, P()))
  return jax.device_put(params, fsdp_shardings(params, mesh))


# -- small models -------------------------------------------------------------


def make_params(seed=0):
  """A small tree with every kind of leaf dmuon has to route."""
  n = _scaled_draws(
    0.1,
    seed,
    16,
    [(32, 16), (16, 2, 8), (16, 16), (16, 40), (40,), (40, 16), (16,)]
    + [(3, 16, 24), (7, 13), (16, 32)],
  )
  return {
    'embed': {'embedding': n((32, 16))},
    'layers_0': {
      'attn': {
        'qkv': {'kernel': n((16, 2, 8))},  # (d, heads, head_dim)
        'out': {'kernel': n((16, 16))},
      },
      'mlp': {
        'up': {'kernel': n((16, 40)), 'bias': n((40,))},
        'down': {'kernel': n((40, 16))},
      },
      'norm': {'scale': 1 + n((16,))},
    },
    'stack': {'kernel': n((3, 16, 24))},  # scanned layers (L, m, n)
    'odd': {'kernel': n((7, 13))},
    'lm_head': {'kernel': n((16, 32))},
  }


def dim_numbers(params):
  """Explicit routing shared by dmuon and optax in the parity tests."""
  dims = jax.tree.map(lambda x: MDN() if x.ndim == 2 else None, params)
  dims['embed']['embedding'] = None
  dims['lm_head']['kernel'] = None
  if 'qkv' in params.get('layers_0', {}).get('attn', {}):
    dims['layers_0']['attn']['qkv']['kernel'] = MDN(0, (1, 2))
  if 'stack' in params:
    dims['stack']['kernel'] = MDN(1, 2)
  return dims


def same_routing_dims(params):
  """optax's dimension numbers for the leaves dmuon routes to Muon (a
  callable for ``optax.contrib.muon``: the same routing)."""
  return jax.tree.map(
    lambda x: MDN() if x == 'muon' else None, dmuon_jax.muon_labels(params)
  )


def llama_like(seed=0, d=32, f=48, vocab=64, layers=3):
  """Stacked, attention, odd, 1×n and n×1 leaves; 9 Muon matrices."""
  names_shapes = (  # In the order of the draws.
    ('embed', (vocab, d)),
    ('qkv', (d, 4, 8)),  # (d, heads, head_dim)
    ('o', (d, d)),
    ('up', (layers, d, f)),  # scanned (L, m, n)
    ('down', (f, d)),
    ('norm', (d,)),
    ('odd', (7, 13)),
    ('row', (1, 24)),
    ('col', (24, 1)),
    ('head', (d, vocab)),
  )
  # Drawn in one small program: eager's values, 3.5 s of a set-up's
  # compiles fewer.
  draws = normal_draws(16, tuple(shape for _, shape in names_shapes), seed)
  n = {
    name: np.float32(0.1) * draw for (name, _), draw in zip(names_shapes, draws)
  }
  n['norm'] = np.float32(1) + n['norm']
  n = {name: jnp.asarray(x) for name, x in n.items()}
  layers = ('qkv', 'o', 'up', 'down', 'norm')
  params = {
    'embed': n['embed'],
    'layers': {name: n[name] for name in layers},
    **{name: n[name] for name in ('odd', 'row', 'col', 'head')},
  }
  return params, _llama_like_dims()


def normal_draws(n_keys, shapes, seed=0):
  """``jax.random.normal(keys[i], shapes[i])`` for ``keys =
  jax.random.split(jax.random.key(seed), n_keys)``, as NumPy arrays.

  The eager draws' values bit for bit (checked by running), from one small
  program: eager, each shape compiles two programs of its own (grouping
  the shapes into vmaps compiles as slowly). Under partitionable threefry
  (jax's default) element i of a draw depends on its key and i only, so
  each is the start of one flat draw of the largest size. Scale them in
  NumPy: a scale fused into the draw moves some values by 1 ulp.
  """
  if len(shapes) > n_keys:
    raise ValueError(f'{len(shapes)} draws from {n_keys} keys')
  sizes = [math.prod(shape) for shape in shapes]
  if not jax.config.jax_threefry_partitionable:
    keys = jax.random.split(jax.random.key(seed), n_keys)
    return [np.asarray(jax.random.normal(k, s)) for k, s in zip(keys, shapes)]
  flat = np.asarray(_flat_normal_draws(n_keys, len(shapes), max(sizes), seed))
  return [x[:size].reshape(s) for x, size, s in zip(flat, sizes, shapes)]


@functools.partial(jax.jit, static_argnums=range(3))
def _flat_normal_draws(n_keys, n_draws, size, seed):  # One compile per size.
  keys = jax.random.split(jax.random.key(seed), n_keys)[:n_draws]
  return jax.vmap(lambda key: jax.random.normal(key, (size,), jnp.float32))(
    keys
  )


def _scaled_draws(scale, seed, n_keys, shapes):
  """``n(shape)``: the next of ``scale * jax.random.normal(keys[i],
  shapes[i])`` (float32, as :func:`normal_draws` gives them), each called
  with its shape in turn, as eager draws from an iterator of keys are."""
  draws = iter(normal_draws(n_keys, shapes, seed))

  def n(shape):
    draw = next(draws)
    assert draw.shape == tuple(shape), (draw.shape, shape)
    return jnp.asarray(np.float32(scale) * draw)

  return n


def _llama_like_dims():
  dims = {
    'embed': None,
    'layers': {
      'qkv': MDN(0, (1, 2)),
      'o': MDN(),
      'up': MDN(1, 2),
      'down': MDN(),
      'norm': None,
    },
    'odd': MDN(),
    'row': MDN(),
    'col': MDN(),
    'head': None,
  }
  return dims


def llama_shapes(layers=8, d=128, f=384, vocab=1024):
  """Shapes of a Llama-like model (float32)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  tree = {'embed': s(vocab, d), 'norm_f': s(d), 'lm_head': s(d, vocab)}
  for i in range(layers):
    tree[f'layers_{i}'] = {
      'attn': {'q': s(d, d), 'k': s(d, d), 'v': s(d, d), 'o': s(d, d)},
      'mlp': {'gate': s(d, f), 'up': s(d, f), 'down': s(f, d)},
      'attn_norm': s(d),
      'mlp_norm': s(d),
    }
  return tree


def materialize(shapes, mesh, shardings=None):
  """Random arrays of ``shapes``, placed (default: replicated on mesh)."""
  leaves, treedef = jax.tree.flatten(shapes)
  if {x.dtype for x in leaves} == {np.dtype(np.float32)}:
    # The draws below in one program, placed from host memory (a transfer;
    # from device 0 each shape compiled a reshard of its own): their values
    # bit for bit, 3.3 s of compiles fewer for llama_shapes() on 1x8.
    draws = normal_draws(len(leaves), [x.shape for x in leaves])
    arrays = [np.float32(0.02) * x for x in draws]
  else:
    keys = jax.random.split(jax.random.key(0), len(leaves))
    arrays = [
      0.02 * jax.random.normal(k, x.shape, x.dtype)
      for k, x in zip(keys, leaves)
    ]
  tree = jax.tree.unflatten(treedef, arrays)
  if shardings is None:
    shardings = NamedSharding(mesh, P())
  return jax.device_put(tree, shardings)


# -- pseudo-gradients and training loops --------------------------------------


def grads_at(step, params):
  """Deterministic pseudo-gradients, different at every step (host-made,
  so that no train step compiles a random generator)."""
  rng = np.random.default_rng(1000 + step)
  return jax.tree.map(
    lambda x: jnp.asarray(
      rng.standard_normal(np.shape(x)).astype(np.float32) * (1 + 0.1 * step),
      x.dtype,
    ),
    params,
  )


def run(opt, params, steps=STEPS, grad_shardings=None):
  """Runs ``steps`` jitted updates on :func:`grads_at`; returns params after
  each step (on the host).

  ``grad_shardings`` (a tree of shardings) places the gradients as a
  sharded train step would produce them.
  """
  state = opt.init(params)
  params, state, pinned = pin_placement(params, state)

  @functools.partial(jax.jit, **pinned)
  def step(params, state, grads):
    if grad_shardings is not None:
      grads = jax.tree.map(jax.reshard, grads, grad_shardings)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for i in range(steps):
    params, state = step(params, state, grads_at(i, params))
    history.append(jax.tree.map(np.asarray, params))
  return history


def pin_placement(params, state, replicated_outputs=0):
  """``(params, state, jit_kwargs)``: on a mesh with Auto axes, the state's
  uncommitted leaves (counts) placed on it and ``out_shardings`` that
  return params and state as they came in (then ``replicated_outputs``
  replicated ones, e.g. the loss). XLA otherwise picks the shardings of
  what an Auto-axes step returns (it sharded the replicated AdamW moments
  over 'shard'), and the step's second call compiled it again, as a
  trainer that pins its state's shardings would not."""
  meshes = {
    x.sharding.mesh
    for x in jax.tree.leaves(params)
    if isinstance(getattr(x, 'sharding', None), NamedSharding)
  }
  if len(meshes) != 1:
    return params, state, {}
  (mesh,) = meshes
  if AxisType.Auto not in mesh.axis_types:
    return params, state, {}
  placed = lambda x: (
    x.sharding
    if isinstance(getattr(x, 'sharding', None), NamedSharding)
    else NamedSharding(mesh, P())
  )
  state = jax.tree.map(lambda x: jax.device_put(x, placed(x)), state)
  shardings = (
    *jax.tree.map(placed, (params, state)),
    *[NamedSharding(mesh, P())] * replicated_outputs,
  )
  return params, state, {'out_shardings': shardings}


def rel_err(actual, expected) -> float:
  """``||a - b|| / ||b||`` (Frobenius, in float64; 0/0 is 0)."""
  a = np.asarray(np.asarray(actual, np.float32), np.float64)
  b = np.asarray(np.asarray(expected, np.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# dmuon against optax.contrib.muon, both float32, a few steps (relative
# Frobenius per leaf, assert_trees_rel_close): measured <= 4.1e-6 under the
# suite's XLA:CPU settings (tests/conftest.py: the two programs sum in
# different orders and Newton-Schulz amplifies the rounding), 2e-8 at XLA's
# defaults. The float32 noise itself is larger: optax.contrib.muon in
# float32 is ~7e-6 from the same run in float64 after 20 steps.
OPTAX_F32_RTOL = 1e-5


def assert_trees_rel_close(test, actual, expected, rtol):
  """Per leaf: ``||a - b|| <= rtol ||b||`` (Frobenius, in float64).

  A parity check of whole matrices: elementwise tolerances
  (``chex.assert_trees_all_close``) would fail on entries near zero, which
  Newton-Schulz results have. Built on
  ``chex.assert_trees_all_equal_comparator``, so a failure names the leaf;
  the trees must have the same structure.
  """
  del test  # chex raises AssertionError itself, naming the leaf.
  chex.assert_trees_all_equal_comparator(
    lambda a, b: rel_err(a, b) <= rtol,
    lambda a, b: f'relative error {rel_err(a, b):.3g} > {rtol:g}',
    actual,
    expected,
  )


@functools.partial(jax.jit, static_argnums=2)
def _optax_ns(x, coeffs, dims):
  return optax_muon_module.orthogonalize_via_newton_schulz(
    x, coeffs, 5, dimension_numbers=dims
  )


def reference_sgd_muon(params, dims, *, lr, beta, nesterov, wd, steps):
  """A plain loop of the DMuon/Moonlight rule, leaf by leaf.

  buf = beta * buf + g; u = g + beta * buf (Nesterov) or buf; Muon leaves get
  NS(u) (optax's Newton–Schulz) times Jordan's width factor, plus decoupled
  weight decay; AdamW leaves are left to optax.adamw.
  """
  is_dims = lambda d: d is None or isinstance(d, MDN)
  labels = jax.tree.map(
    lambda d: 'adam' if d is None else 'muon', dims, is_leaf=is_dims
  )
  flat_dims = jax.tree.leaves(dims, is_leaf=is_dims)
  adam = optax.adamw(lr, eps=1e-8, weight_decay=0.0, nesterov=nesterov)
  adam_params = jax.tree.map(
    lambda p, l: p if l == 'adam' else None, params, labels
  )
  adam_state = adam.init(adam_params)
  bufs = jax.tree.map(jnp.zeros_like, params)
  coeffs = jnp.asarray((3.4445, -4.7750, 2.0315))
  history = []
  for i in range(steps):
    grads = grads_at(i, params)
    adam_grads = jax.tree.map(
      lambda g, l: g if l == 'adam' else None, grads, labels
    )
    adam_updates, adam_state = adam.update(adam_grads, adam_state, adam_params)
    leaves, treedef = jax.tree.flatten(params)
    new_leaves, new_bufs = [], []
    adam_flat = iter(jax.tree.leaves(adam_updates))
    for p, g, b, d in zip(
      leaves, jax.tree.leaves(grads), jax.tree.leaves(bufs), flat_dims
    ):
      if d is None:
        new_leaves.append(p + next(adam_flat))
        new_bufs.append(b)
        continue
      b = beta * b + g
      u = g + beta * b if nesterov else b
      o = _optax_ns(u, coeffs, d)
      red = (
        (d.reduction_axis,)
        if isinstance(d.reduction_axis, int)
        else (d.reduction_axis)
      )
      out = (
        (d.output_axis,) if isinstance(d.output_axis, int) else (d.output_axis)
      )
      fan_in = np.prod([p.shape[a] for a in red])
      fan_out = np.prod([p.shape[a] for a in out])
      scale = np.sqrt(max(1.0, fan_out / fan_in))
      new_leaves.append(p - lr * (scale * o + wd * p))
      new_bufs.append(b)
    params = jax.tree.unflatten(treedef, new_leaves)
    adam_params = jax.tree.map(
      lambda p, l: p if l == 'adam' else None, params, labels
    )
    bufs = jax.tree.unflatten(treedef, new_bufs)
    history.append(jax.tree.map(np.asarray, params))
  return history


def dmuon_states(state):
  """The ScaleByDMuonState entries of an optimizer state."""
  is_state = lambda x: isinstance(x, dmuon_jax.ScaleByDMuonState)
  return [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]


def optax_muon(learning_rate, params, predicate=None, dims=None, **kwargs):
  """optax.contrib.muon on the Muon targets dmuon picks (+ its AdamW)."""
  flat = jax.tree.leaves(params)
  plan = dmuon_jax.plan_ownership(
    params, None, predicate=predicate, weight_dimension_numbers=dims
  )
  targets = {s.leaf_index: s for s in plan.leaves}
  dims = [
    MDN(
      reduction_axis=targets[i].reduction_axes,
      output_axis=targets[i].output_axes,
    )
    if i in targets
    else None
    for i in range(len(flat))
  ]
  return optax.contrib.muon(
    learning_rate,
    muon_weight_dimension_numbers=jax.tree.unflatten(
      jax.tree.structure(params), dims
    ),
    **kwargs,
  )


def temp_dir(test) -> str:
  """A temporary directory removed when ``test`` ends (absltest's
  ``create_tempdir`` needs parsed absl flags, which pytest has not)."""
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


def token_batch(batch, length, vocab, seed=0):
  """A fixed batch of ``batch`` token sequences of ``length`` (int32)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)


def multi_steps_tx(kind, mesh=None, *, learning_rate, every_k):
  """A trainer's optimizer in ``optax.MultiSteps``: ``'dmuon'`` (on
  ``mesh``, optax's routing), ``'muon'`` (optax.contrib.muon) or AdamW."""
  if kind == 'dmuon':
    inner = dmuon_jax.dmuon(learning_rate, predicate='optax', mesh=mesh)
  elif kind == 'muon':
    inner = optax.contrib.muon(learning_rate)
  else:
    inner = optax.adamw(learning_rate)
  return optax.MultiSteps(inner, every_k_schedule=every_k)


def next_token_step(state, tokens):
  """A Flax ``TrainState`` step as language-model trainers write it: the
  next-token cross-entropy of ``state.apply_fn`` on ``tokens``; returns
  ``(state, loss)``."""

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def train_single_device(opt, params, loss_fn, steps):
  """The reference: ``steps`` of ``opt`` on ``loss_fn(params)``, one device.

  Returns:
    The final params (on the host) and the loss of every step.
  """
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return jax.device_get(params), losses


# -- data-parallel train steps ------------------------------------------------


def mean_loss(params, batch):
  """A batch-mean loss whose gradient depends on the batch."""

  def per_example(b):
    return sum(jnp.sum(jnp.sin(p * b)) for p in jax.tree.leaves(params))

  return jnp.mean(jax.vmap(per_example)(batch))


def explicit_step_fn(
  opt, mesh, state, loss_fn=mean_loss, param_specs=None, donate=False
):
  """A train step on the explicit path (default: params replicated, DDP);
  with ``donate``, params and state donated as a training loop passes
  them."""
  specs = dmuon_jax.Dedication.specs_of(state)
  param_specs = P() if param_specs is None else param_specs

  @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(param_specs, specs, P(AXES)),
    out_specs=(param_specs, specs, P()),
  )
  def step(params, state, batch):
    loss, grads = dmuon_jax.local_value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return (
      optax.apply_updates(params, updates),
      state,
      jax.lax.pmean(loss, AXES),
    )

  return step


def drop_in_step_fn(opt, loss_fn=mean_loss):
  """A plain-jit train step (XLA reduces the gradients)."""

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


# -- the dedicated-mode model: blocks of square matrices ----------------------

BLOCKS, WIDTH, MATS = 4, 16, 8
DEDICATED_LR = 0.002


def block_params(blocks=BLOCKS, mats=MATS, width=WIDTH):
  shapes = [(width, width)] * mats + [(width,)]
  n = _scaled_draws(0.3, 0, 64, shapes * blocks + [(width, 8)])
  params = {
    f'layers_{i}': {f'w{j}': n((width, width)) for j in range(mats)}
    | {'scale': 1 + n((width,))}
    for i in range(blocks)
  }
  params['head'] = n((width, 8))
  return params


def block_fn(layer, x):
  for j in range(sum(name.startswith('w') for name in layer)):
    x = x + jnp.tanh(x @ layer[f'w{j}']) * layer['scale']
  return x


def block_loss(params, x):
  for i in range(sum(name.startswith('layers_') for name in params)):
    x = block_fn(params[f'layers_{i}'], x)
  return jnp.mean((x @ params['head']) ** 2)


def block_batch():
  # Many more examples than width: well-conditioned gradient matrices, so
  # Newton–Schulz (slope ~500 at small singular values) does not amplify
  # summation-order rounding.
  return jax.random.normal(jax.random.key(1), (512, WIDTH))


@functools.cache
def block_reference(steps):
  """Single-device optax.contrib.muon (+ AdamW) on the block model."""
  params = block_params()
  return train_single_device(
    optax_muon(DEDICATED_LR, params),
    params,
    lambda p: block_loss(p, block_batch()),
    steps,
  )


def dedicated_loss(ded):
  def loss(dp, x):
    x = ded.sequential(block_fn, [f'layers_{i}' for i in range(BLOCKS)])(dp, x)
    return jnp.mean((x @ dp.rest['head']) ** 2)

  return loss


def dedicated_step(ded, opt, state):
  """The explicit shard_map train step of the block model, dedicated."""
  return explicit_step_fn(
    opt, ded.mesh, state, dedicated_loss(ded), ded.specs()
  )


def dedicated_setup(shape, z3, owner_groups='auto', **kwargs):
  """``(ded, dp, opt, state, x)`` for the block model on ``shape``."""
  mesh = make_mesh(shape)
  params = block_params()
  ded = dmuon_jax.dedicate(
    params, mesh, reshard_after_forward=z3, owner_groups=owner_groups
  )
  dp = ded.to_dedicated(jax.device_put(params, NamedSharding(mesh, P())))
  opt = dmuon_jax.dedicated_muon(ded, DEDICATED_LR, **kwargs)
  state = opt.init(dp)
  x = jax.device_put(block_batch(), NamedSharding(mesh, P(AXES)))
  return ded, dp, opt, state, x


# -- compiled-program accounting ------------------------------------------------


def conditional_branches(text: str) -> list[int]:
  """Each conditional's number of branch bodies, from compiled HLO text."""
  return [
    len(m.split(','))
    for m in re.findall(r'branch_computations=\{([^}]*)\}', text)
  ]


def assert_no_collective_in_a_conditional(test, compiled, scanned=False):
  """No collective is nested in a conditional; inside while loops only the
  per-layer gathers of a scanned stack (``scanned``) and their transposes."""
  nesting = hlo_tools.collective_nesting(compiled)
  test.assertNotEmpty(nesting)
  in_branch = [c for c in nesting if 'conditional' in c.context]
  test.assertEmpty(in_branch, in_branch)
  looped = {c.kind for c in nesting if 'while' in c.context}
  if scanned:
    test.assertNotEmpty(looped)
    test.assertLessEqual(looped, {'all-gather', 'reduce-scatter'})
  else:
    test.assertEmpty(looped)


ALL_2D = lambda path, x: x.ndim == 2


def muon_bytes(params, predicate=None):
  labels = dmuon_jax.muon_labels(params, predicate=predicate)
  return sum(
    x.size * x.dtype.itemsize
    for x, l in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
    if l == 'muon'
  )


def without_finite_flags(test, report):
  """Collective counts and bytes without the "all finite?" flags.

  With the default nonfinite='skip', the step checks gradients, updates and
  the new (owner-sharded) state for NaN/Inf on every device: XLA reduces the
  per-leaf booleans in at most one small all-reduce.
  """
  flags = [
    c
    for c in report.collectives
    if c.kind == 'all-reduce' and c.dtype == 'pred'
  ]
  test.assertLessEqual(len(flags), 1)
  test.assertTrue(all(c.bytes < 1024 for c in flags), flags)
  kinds = dict(report.count_by_kind)
  if flags:
    kinds['all-reduce'] -= 1
    if not kinds['all-reduce']:
      del kinds['all-reduce']
  return kinds, report.total_bytes() - sum(c.total_bytes for c in flags)


def device_ns_flops(ded):
  """Newton-Schulz matmul FLOPs of a dedicated update's busiest device,
  from its plan: per gather group its slot's cost, and where the group is a
  scanned stack (lax.map over its iterations) iteration t's slot of the
  base layout is (slot - t) mod n, so the device's sum over iterations."""
  total = 0
  for lay, iters in zip(ded.layouts, ded.num_iterations):
    costs = np.asarray(lay.plan.slot_costs(), float)
    if iters:  # np.roll(costs, t)[s] == costs[(s - t) % n]
      costs = sum(np.roll(costs, t) for t in range(iters))
    total = total + costs
  return float(np.max(total))


def assert_only_the_finite_flag(test, report):
  """The update's one collective: the all-devices "all finite?" flag of the
  default nonfinite='skip' policy (a scalar); no Muon data moves."""
  test.assertLessEqual(set(report.count_by_kind), {'all-reduce'})
  test.assertLessEqual(report.count_by_kind.get('all-reduce', 0), 1)
  for c in report.collectives:
    test.assertLessEqual(int(np.prod(c.shape)), 1, c)


# -- subprocesses ---------------------------------------------------------------


def subprocess_env():
  """The environment of a test's child process: the repo on the path, its
  own device count, the test processes' XLA flags and the run's shared
  compilation cache (children that compile the same programs, e.g. the
  kill-9 restarts, compile once)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable)
  # No forced device count (a child sets its own); the compile-speed flags
  # of the test processes (tests/conftest.py) are kept.
  env['XLA_FLAGS'] = os.environ.get('DMUON_TEST_XLA_FLAGS', '')
  # Op locations without whole tracebacks, as in the test processes
  # (tests/conftest.py).
  env['JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS'] = 'false'
  cache = os.environ.get('DMUON_TEST_COMPILATION_CACHE')
  if cache:
    env['JAX_COMPILATION_CACHE_DIR'] = cache
    env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
  return env


def run_unchecked(args, timeout=600, executable=(sys.executable,)):
  """Runs a repo script in a fresh process (its own device count); returns
  it whatever its exit status."""
  return subprocess.run(
    list(executable) + args,
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def run_script(args, timeout=600, executable=(sys.executable,)):
  """Runs a repo script in a fresh process (its own device count); raises
  on a nonzero exit status."""
  proc = run_unchecked(args, timeout, executable)
  if proc.returncode:
    raise AssertionError(f'{args} failed:\n{proc.stdout}\n{proc.stderr}')
  return proc.stdout


def read_rows(path):
  """The rows of a JSON-lines results file (one object per line)."""
  return [json.loads(line) for line in path.read_text().splitlines() if line]


# -- dedicated-mode tests (shared by flax_*/dedicated/owner_groups tests) --


def _leaf_name(path):
  for k in reversed(path):
    name = getattr(k, 'key', getattr(k, 'name', None))
    if name != 'value':
      return str(name)
  return ''


def host_values(abstract, std, seed=0):
  """Values for a tree of shapes (e.g. ``jax.eval_shape`` of a model's
  init), drawn on the host: ones for norm scales and variances, zeros for
  biases, means and counters, ``jax.random.key(seed)`` (split to the
  shape) for PRNG keys, normal(0, ``std``) for every other float (``std``:
  a number, or a function of the leaf's name and shape).

  Flax initializers, run eagerly, compile a small program per op and
  shape: measured 1.4 to 4.4 s of CPU per model on the 2-core machine (a fifth of
  a dedicated step's compilation); this compiles at most one (the key).
  The tests compare runs started from the same values, so which
  initializer drew them does not matter.
  """
  rng = np.random.default_rng(seed)

  def one(path, x):
    name = _leaf_name(path)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      key = jax.random.key(seed)
      return key if not x.shape else jax.random.split(key, x.shape)
    if not jnp.issubdtype(x.dtype, jnp.floating) or name in (
      'bias',
      'mean',
    ):
      return jnp.asarray(np.zeros(x.shape, x.dtype))
    if name in ('scale', 'var'):
      return jnp.asarray(np.ones(x.shape, x.dtype))
    scale = std(name, x.shape) if callable(std) else std
    return jnp.asarray((scale * rng.standard_normal(x.shape)).astype(x.dtype))

  return jax.tree.map_with_path(one, abstract)


@functools.cache
def block_reference_history(steps=STEPS):
  """Single-device optax.contrib.muon (+ AdamW) on the block model, as
  :func:`block_reference`, one run for every step count up to ``steps``:
  ``(params after each step (host), losses)``."""
  params = block_params()
  opt = optax_muon(DEDICATED_LR, params)
  state = opt.init(params)
  x = block_batch()

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(block_loss)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  history, losses = [], []
  for _ in range(steps):
    params, state, loss = step(params, state)
    history.append(jax.device_get(params))
    losses.append(float(loss))
  return history, losses


def block_reference_at(steps):
  """``(params, losses)`` after ``steps`` (<= STEPS) of the reference."""
  history, losses = block_reference_history()
  return history[steps - 1], losses[:steps]


def run_dedicated_steps(compiled, dp, state, batch, steps):
  """Runs a compiled dedicated step ``(dp, state, batch) -> (dp, state,
  loss)`` ``steps`` times: ``(dp, state, losses)``."""
  losses = []
  for _ in range(steps):
    dp, state, loss = compiled(dp, state, batch)
    losses.append(float(loss))
  return dp, state, losses


@functools.cache
def dedicated_run(shape, z3, owner_groups='auto', steps=STEPS):
  """The block model's dedicated train step on ``shape``, compiled once and
  run ``steps`` times: every check of a configuration (parity, HLO bytes,
  collective nesting) reads this one executable.

  Returns:
    A dict: ``ded``, ``compiled``, ``report`` (its
    :func:`dmuon_jax.analyze_compiled`), ``losses``, ``params`` (plain, on
    the host, after the last step).
  """
  ded, dp, opt, state, x = dedicated_setup(shape, z3, owner_groups)
  compiled = dedicated_step(ded, opt, state).lower(dp, state, x).compile()
  return compiled_dedicated_run(ded, compiled, dp, state, x, steps)


def compiled_dedicated_run(ded, compiled, dp, state, batch, steps):
  """Runs ``compiled`` (a dedicated step of ``ded``) ``steps`` times: the
  dict of :func:`dedicated_run`."""
  dp, state, losses = run_dedicated_steps(compiled, dp, state, batch, steps)
  return {
    'ded': ded,
    'compiled': compiled,
    'report': dmuon_jax.analyze_compiled(compiled),
    'losses': losses,
    'params': jax.device_get(ded.to_params(dp)),
  }


# -- subprocess and checkpoint tests --------------------------------------------


def max_rel_diff(actual, expected) -> float:
  """``max |a - b| / max |b|`` (float64; ``max |a|`` if ``b`` is all zeros)."""
  a = np.asarray(np.asarray(actual, np.float32), np.float64)
  b = np.asarray(np.asarray(expected, np.float32), np.float64)
  scale = np.max(np.abs(b)) if b.size else 0.0
  diff = np.max(np.abs(a - b)) if a.size else 0.0
  return float(diff / scale if scale else diff)


def assert_trees_max_rel_close(actual, expected, rtol):
  """Per leaf: ``max |a - b| <= rtol max |b|`` (a whole-array relative
  check, in the largest entry's units, as the resumed-run and multi-process
  comparisons state it). On ``chex.assert_trees_all_equal_comparator``: a
  failure names the leaf; the trees must have the same structure."""
  chex.assert_trees_all_equal_comparator(
    lambda a, b: max_rel_diff(a, b) <= rtol,
    lambda a, b: f'max |a - b| / max |b| = {max_rel_diff(a, b):.3g} > {rtol:g}',
    actual,
    expected,
  )


# -- dedicated models under plain jit (the reduced-gather route) ---------------


def collectives_of(compiled) -> dict[str, tuple[int, float]]:
  """kind -> (executions, bytes per device), from the compiled HLO."""
  out: dict[str, tuple[int, float]] = {}
  for c in dmuon_jax.diagnostics.hlo_collectives(compiled.as_text()):
    k, b = out.get(c.kind, (0, 0.0))
    out[c.kind] = (k + c.executions, b + c.bytes * c.executions)
  return out


def muon_floor(ded, z3, n=8) -> float:
  """The plan's Z2/Z3 floor for its (padded) gathers, bytes per device
  (``ded``: a ``dmuon_jax.flax.ModelDedication``)."""
  _, gathered = ded.dedication.gather_bytes()
  return (3 if z3 else 2) * (n - 1) / n * gathered


def assert_route_run(test, got, want, z3, rtol=1e-5, adamw_gathered=0.0):
  """A dedicated run (``losses``, ``params``, ``collectives``, ``ded``)
  equal to its reference within ``rtol``, its Muon traffic (all-gather
  + reduce-scatter, less ``adamw_gathered``: bytes per device of the
  all-gathers of AdamW params sharded over an owner axis, see
  :func:`fsdp_adamw_gather_bytes`) at the plan's floor (within 5%) and the
  owner groups' Gram exchange of matrices split over owners
  (collective-permutes) as predicted."""
  rel = np.max(np.abs(got['losses'] - want['losses']) / want['losses'])
  test.assertLess(rel, rtol)
  assert_trees_max_rel_close(got['params'], want['params'], rtol)
  kinds = got['collectives']
  floor = muon_floor(got['ded'], z3)
  muon = kinds['all-gather'][1] + kinds['reduce-scatter'][1] - adamw_gathered
  exchange = got['ded'].dedication.exchange_bytes()
  test.assertAlmostEqual(
    kinds.get('collective-permute', (0, 0))[1], exchange, delta=1
  )
  test.assertLessEqual(muon, 1.05 * floor)
  test.assertGreaterEqual(muon, floor - 1)


def fsdp_adamw_gather_bytes(ded, params) -> float:
  """What ``dmuon_jax.flax.train_step`` all-gathers per device and step
  for the AdamW params of ``params`` (the dedicated params, placed) that
  are sharded over an owner axis of ``ded`` (a ``ModelDedication``): each
  param and its two Adam moments, gathered (XLA's all-gather) over all the
  N owner devices: (N - 1)/N of its bytes each."""
  total, owners = 0.0, set(ded.axes)
  n = math.prod(ded.dedication.mesh.shape[a] for a in owners)
  for x in jax.tree.leaves(ded.dedicated(params).rest):
    spec = x.sharding.spec
    axes = {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}
    if axes & owners:
      total += 3 * (n - 1) / n * x.nbytes
  return total


def llama3_matrices(layers, d, f, kv):
  """A Llama-3-like stack's Muon matrices (q, k, v, o, gate, up, down
  per layer) as bfloat16 ``jax.ShapeDtypeStruct`` s."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return {
    f'layers_{i}': {
      'q': s(d, d),
      'k': s(d, kv),
      'v': s(d, kv),
      'o': s(d, d),
      'gate': s(d, f),
      'up': s(d, f),
      'down': s(f, d),
    }
    for i in range(layers)
  }


def nnx_lm_step(model, optimizer, tokens):
  """The user's NNX step on next-token cross-entropy (``tokens``: a batch
  of sequences; the model maps all but the last token to logits)."""
  from flax import nnx  # (only the Flax tests pay for importing it)

  def loss_fn(model):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss
