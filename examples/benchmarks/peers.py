"""Peers: dmuon against the other ways JAX trainers distribute Muon.

Every strategy computes ``optax.contrib.muon``'s update (Nesterov momentum
with optax's bias corrections, the quintic Newton–Schulz iteration with
coefficients ``(3.4445, -4.7750, 2.0315)``, 5 steps, Frobenius
normalization with ``eps = 1e-8``, the wide orientation, Jordan's
``sqrt(max(1, fan_out / fan_in))`` factor; AdamW on the other leaves);
they differ in where each matrix's Newton–Schulz runs:

* ``replicated``: ``optax.contrib.muon`` on replicated params (every device
  orthogonalizes every matrix);
* ``gspmd_fsdp``: ``optax.contrib.muon`` under ``jax.jit`` on FSDP params
  (XLA's sharding propagation decides);
* ``gspmd_constraint`` (baseline written here from levanter's public
  description): each Newton–Schulz input, in its wide orientation, is
  constrained to ``P(None, <all mesh axes>)`` so that XLA partitions every
  Newton–Schulz matmul over all devices and all-reduces inside every
  iteration;
* ``stacked`` (baseline written here from the public descriptions of
  MaxText's sharded Muon, Marin's Grug MuonH and goodfire's stacked Muon):
  matrices of one shape are stacked ``(count, m, n)``, ``count`` padded
  with zero matrices to a multiple of N, the stack axis sharded over all
  devices; each device runs a ``vmap``'d Newton–Schulz on its slice with no
  communication (``shard_map``) and the results are resharded back to the
  params' FSDP layout;
* ``dmuon``: ``dmuon_jax.dmuon`` (drop-in) on FSDP params, owners over
  every mesh axis; ``dmuon_shard``: owners over ``'shard'`` only
  (``axis_names=('shard',)``);
* ``dedicated_z2`` / ``dedicated_z3``: ``dmuon_jax.dedicate`` (the
  explicit Dedication API, ``reshard_after_forward`` False / True) and
  ``dmuon_jax.dedicated_muon``'s update inside ``shard_map`` on gradients
  already in owner layout (what the gathers' transpose, a reduce-scatter,
  delivers in a train step; the gathers themselves replace FSDP's and are
  reported apart: ``gathered_bytes``); their AdamW leaves FSDP-sharded
  as the other FSDP strategies'.

``dmuon_chunks<c>`` (not in the defaults; ``--strategies`` names it) is
a memory experiment: the drop-in's update on the layers in ``c`` parts in
sequence (``chunked_dmuon``).

The non-optax baselines share this file's momentum and Newton–Schulz
(``peer_muon``), checked against single-device ``optax.contrib.muon``: the
check runs every strategy three steps on a small float32 tree on 8
simulated devices (mesh 2x4) and records the largest per-leaf relative
Frobenius difference (pass: <= 1e-5, tests/support.py's OPTAX_F32_RTOL);
then each strategy's median step time, all in one process.

Compile-only rows (abstract bfloat16 params, float32 momentum, nothing
allocated) for the four models of the PyTorch original's optimizer-step
table (Qwen2.5-1.5B, Llama-3.2-3B, Qwen2.5-7B, Llama-3.1-8B; Muon on the
hidden matrices, AdamW on embeddings, head, norms and biases) on
``(N / 8) x 8`` meshes ``('replicate', 'shard')``, one subprocess per N:
the busiest device's matmul FLOPs (all of them Newton–Schulz here:
``hlo_tools.dot_flops`` with loop trip counts and owner-slot branches)
over the ideal ``total / N`` (``total``: optax's Newton–Schulz FLOPs of
every matrix, ``5 (4 m^2 n + 2 m^3)`` with ``m <= n``), collective bytes
per device by kind (the program lowered for CUDA) and by mesh axis (the
CPU program's replica groups), peak memory per device
(``memory_analysis``), lowering and compile time. A failure or timeout is
a row with its error.

A model named ``<model>_L<k>`` is cut to its first ``k`` layers (fast
to compile). ``--predict`` adds, without compiling, the busiest device's
NS / ideal of ``stacked`` (from the counts of each matrix shape) and of
dmuon's owner plans, at full depth; the compiled rows check the
predictions where both exist.

    python examples/benchmarks/peers.py --quick   # the check + step times
    nice -n 19 python examples/benchmarks/peers.py --devices 8,64,256
    python examples/benchmarks/peers.py --no-check --devices '' --append \
      --predict qwen2.5_1.5b,llama3.2_3b,qwen2.5_7b,llama3.1_8b  # re-render

Writes ``results/peers.json`` (one JSON object per line) and
``results/peers.md`` (``peers_quick.*`` with ``--quick``) next to this
file, or under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optimizer_step as _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import scale as _scale  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = pathlib.Path(__file__).resolve().parent

STRATEGIES = (
  'replicated',
  'gspmd_fsdp',
  'gspmd_constraint',
  'stacked',
  'dmuon',
  'dmuon_shard',
  'dedicated_z2',
  'dedicated_z3',
)

# name: (layers, hidden, intermediate, heads, kv heads, vocab, tied, qkv
# biases); head_dim 128 (public configs).
MODELS = {
  'qwen2.5_1.5b': (28, 1536, 8960, 12, 2, 151936, True, True),
  'llama3.2_3b': (28, 3072, 8192, 24, 8, 128256, True, False),
  'qwen2.5_7b': (28, 3584, 18944, 28, 4, 152064, False, True),
  'llama3.1_8b': (32, 4096, 14336, 32, 8, 128256, False, False),
}
# The PyTorch original's optimizer step on 8xA800 (its v0.1 README).
TORCH_MS = {
  'qwen2.5_1.5b': 31,
  'llama3.2_3b': 99,
  'qwen2.5_7b': 189,
  'llama3.1_8b': 260,
}
# The small float32 tree of the check: 2 layers, head_dim 8.
SMALL = (2, 32, 64, 4, 2, 64, False, True)
HEAD_DIM = 128

LR, ADAM_LR = 0.02, 3e-3
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS, BETA, EPS = 5, 0.95, 1e-8
OPTAX_F32_RTOL = 1e-5  # tests/support.py's
# tests/conftest.py's: cheaper XLA:CPU code generation (LLVM passes,
# backend optimization level, loop emitters), about half the compile time.
FAST_XLA_FLAGS = (
  '--xla_llvm_disable_expensive_passes=true '
  '--xla_backend_optimization_level=0 '
  '--xla_cpu_use_fusion_emitters=false'
)


def model_config(name):
  """A model's config; ``<model>_L<k>``: the model cut to ``k`` layers."""
  base, _, cut = name.partition('_L')
  config = MODELS[base]
  return (int(cut), *config[1:]) if cut else config


def model_shapes(config, head_dim=HEAD_DIM):
  """``{name: shape}`` tree and the tree of Muon dimension numbers."""
  from optax.contrib import MuonDimensionNumbers as Dims  # pylint: disable=import-outside-toplevel

  layers, d, f, heads, kv, vocab, tied, bias = config
  q, k = heads * head_dim, kv * head_dim
  layer = {
    'q': (d, q),
    'k': (d, k),
    'v': (d, k),
    'o': (q, d),
    'gate': (d, f),
    'up': (d, f),
    'down': (f, d),
    'attn_norm': (d,),
    'mlp_norm': (d,),
  }
  if bias:
    layer.update(q_bias=(q,), k_bias=(k,), v_bias=(k,))
  shapes = {'embed': (vocab, d), 'final_norm': (d,)}
  if not tied:
    shapes['head'] = (d, vocab)
  shapes.update({f'layers_{i}': dict(layer) for i in range(layers)})
  dims = {
    key: (
      {n: Dims() if len(s) == 2 else None for n, s in value.items()}
      if key.startswith('layers_')
      else None
    )
    for key, value in shapes.items()
  }
  return shapes, dims


def is_shape(x):
  return isinstance(x, tuple)


def is_dims(x):
  from optax.contrib import MuonDimensionNumbers as Dims  # pylint: disable=import-outside-toplevel

  return x is None or isinstance(x, Dims)


def muon_shapes(shapes, dims):
  """The Muon matrices' shapes, in tree order."""
  import jax  # pylint: disable=import-outside-toplevel

  out = []
  for key, value in shapes.items():
    if dims[key] is not None:
      out += [value[n] for n in value if dims[key][n] is not None]
  del jax
  return out


def ns_flops(shape):
  """optax's Newton–Schulz matmul FLOPs of one matrix (wide orientation)."""
  m, n = sorted(shape)
  return NS_STEPS * (4 * m * m * n + 2 * m**3)


# ---------------------------------------------------------------------------
# The peers' shared update (optax.contrib.muon's formula, written here).


def newton_schulz(x):
  """optax's quintic iteration on ``(..., m, n)``: wide orientation,
  Frobenius normalization, ``NS_STEPS`` unrolled steps."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + EPS)
  a, b, c = (jnp.asarray(v, x.dtype) for v in NS_COEFFS)
  for _ in range(NS_STEPS):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return jnp.swapaxes(x, -1, -2) if tall else x


def peer_muon(orthogonalize, dims, mu_dtype=None):
  """``optax.contrib.muon(LR, adam_learning_rate=ADAM_LR, ...)``'s update
  with the Newton–Schulz of the Muon leaves done by ``orthogonalize``
  (a list of momentum matrices -> the list of results)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  def init(params):
    return {
      'count': jnp.zeros([], jnp.int32),
      'mu': jax.tree.map(lambda p: jnp.zeros_like(p, mu_dtype), params),
    }

  def update(grads, state, params=None):
    del params
    count = state['count'] + 1
    mu = jax.tree.map(
      lambda g, m: (1 - BETA) * g + BETA * m, grads, state['mu']
    )

    def corrected(t, k):
      return t / (1 - BETA**k).astype(t.dtype)

    leaves, tree = jax.tree.flatten(mu)
    raw = jax.tree.leaves(grads)
    hat = [
      BETA * corrected(m, count + 1) + (1 - BETA) * corrected(g, count)
      for m, g in zip(leaves, raw)
    ]
    out = orthogonalize(hat)
    out = [-LR * math.sqrt(max(1.0, u.shape[1] / u.shape[0])) * u for u in out]
    mu = jax.tree.map(lambda m: m.astype(mu_dtype) if mu_dtype else m, mu)
    return jax.tree.unflatten(tree, out), {'count': count, 'mu': mu}

  labels = jax.tree.map(
    lambda d: 'adam' if d is None else 'muon', dims, is_leaf=is_dims
  )
  return optax.partition(
    {
      'muon': optax.GradientTransformation(init, update),
      'adam': optax.adamw(
        ADAM_LR, eps=EPS, weight_decay=0.0, mu_dtype=mu_dtype, nesterov=True
      ),
    },
    lambda params: _labels_like(labels, params),
  )


def _labels_like(labels, params):
  """``labels`` (leaves ``'muon'``/``'adam'``, None-free) as a tree shaped
  like ``params``."""
  import jax  # pylint: disable=import-outside-toplevel

  return jax.tree.map(lambda lbl, _: lbl, labels, params)


def full_dims(dims, shapes):
  """``dims`` with each None subtree expanded to None leaves of
  ``shapes``' structure (a label per leaf)."""
  out = {}
  for key, value in shapes.items():
    if dims[key] is None:
      out[key] = {n: None for n in value} if isinstance(value, dict) else None
    else:
      out[key] = dims[key]
  return out


def fsdp_spec(shape):
  """scale.fsdp's spec: the first matrix dimension over 'shard'."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  spec = [None] * len(shape)
  spec[len(shape) - 2] = 'shard'
  return P(*spec)


def chunked_dmuon(chunks, make, dims, specs):
  """dmuon's update on the layers in ``chunks`` contiguous parts, each
  part's gradients held back (``optimization_barrier``) until the previous
  part's updates exist, so that one part's routing buffers are live at a
  time; the leaves outside the layers go with the first part.
  ``make(dims, specs)``: the dmuon of one part."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  layers = sorted(
    (k for k in dims if k.startswith('layers_')),
    key=lambda k: int(k.removeprefix('layers_')),
  )
  per = -(-len(layers) // chunks)
  parts = [layers[i : i + per] for i in range(0, len(layers), per)]
  parts[0] = [k for k in dims if not k.startswith('layers_')] + parts[0]
  pick = lambda tree, keys: {k: tree[k] for k in keys}
  opts = [make(pick(dims, keys), pick(specs, keys)) for keys in parts]

  def init(params):
    return tuple(o.init(pick(params, k)) for o, k in zip(opts, parts))

  def update(grads, state, params=None):
    out, new, prev = {}, [], None
    for o, keys, st in zip(opts, parts, state):
      g = pick(grads, keys)
      if prev is not None:
        g, _ = jax.lax.optimization_barrier((g, prev))
      p = None if params is None else pick(params, keys)
      prev, st = o.update(g, st, p)
      out.update(prev)
      new.append(st)
    return out, tuple(new)

  return optax.GradientTransformation(init, update)


def constraint_orthogonalize(mesh):
  """levanter-style: each wide NS input over ``P(None, all axes)``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  wide = NamedSharding(mesh, P(None, tuple(mesh.axis_names)))

  def one(x):
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = jax.lax.with_sharding_constraint(x, wide)
    u = newton_schulz(x)
    u = u.T if tall else u
    return jax.lax.with_sharding_constraint(
      u, NamedSharding(mesh, fsdp_spec(u.shape))
    )

  del jnp
  return lambda xs: [one(x) for x in xs]


def stacked_orthogonalize(mesh):
  """Same-shape stacks, padded to a multiple of N, the stack axis over all
  devices; NS ``vmap``'d on each device's slice; back to FSDP."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  axes = tuple(mesh.axis_names)
  n = mesh.size
  spread = P(axes)
  local = jax.shard_map(
    jax.vmap(newton_schulz), mesh=mesh, in_specs=spread, out_specs=spread
  )

  def run(xs):
    groups = {}
    for i, x in enumerate(xs):
      groups.setdefault((x.shape, x.dtype), []).append(i)
    out = [None] * len(xs)
    for (shape, dtype), members in groups.items():
      count = len(members)
      pad = -count % n
      stack = jnp.stack([xs[i] for i in members])
      if pad:
        stack = jnp.concatenate([stack, jnp.zeros((pad, *shape), dtype)])
      stack = jax.lax.with_sharding_constraint(
        stack, NamedSharding(mesh, spread)
      )
      done = local(stack)
      for k, i in enumerate(members):
        out[i] = jax.lax.with_sharding_constraint(
          done[k], NamedSharding(mesh, fsdp_spec(shape))
        )
    return out

  return run


# ---------------------------------------------------------------------------
# Strategies: optimizer, params layout and one step.


def _dict_keys(path):
  return tuple(k.key for k in path if hasattr(k, 'key'))


class Strategy:
  """One strategy on one mesh and params tree.

  ``params``/``grads`` are placed (or abstract) in the strategy's layout
  by ``place``; ``step(params, state, grads)`` returns ``(params,
  state)``; ``to_plain`` turns the strategy's params back into the plain
  tree."""

  def __init__(self, name, mesh, abstract, dims, mu_dtype):
    import jax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

    import dmuon_jax  # pylint: disable=import-outside-toplevel

    self.name, self.mesh, self.dims = name, mesh, dims
    self.ded = None
    self.slots = None
    replicated = NamedSharding(mesh, P())
    if name == 'replicated':
      self.param_sh = jax.tree.map(lambda _: replicated, abstract)
    else:
      # dedicated: the Muon matrices FSDP too (dedicate moves them to
      # owner buffers).
      self.param_sh = jax.tree.map(
        lambda x: NamedSharding(mesh, fsdp_spec(x.shape)), abstract
      )
    common = dict(
      adam_learning_rate=ADAM_LR,
      mu_dtype=mu_dtype,
      muon_weight_dimension_numbers=dims,
    )
    if name in ('replicated', 'gspmd_fsdp'):
      self.opt = optax.contrib.muon(LR, **common)
    elif name == 'gspmd_constraint':
      self.opt = peer_muon(constraint_orthogonalize(mesh), dims, mu_dtype)
    elif name == 'stacked':
      self.opt = peer_muon(stacked_orthogonalize(mesh), dims, mu_dtype)
    elif name in ('dmuon', 'dmuon_shard'):
      axes = ('shard',) if name == 'dmuon_shard' else None
      # param_specs: init on abstract params of an Auto mesh sees no
      # shardings (it would take the matrices as replicated).
      self.opt = dmuon_jax.dmuon(
        LR,
        mesh=mesh,
        axis_names=axes,
        nonfinite='propagate',
        param_specs=jax.tree.map(lambda sh: sh.spec, self.param_sh),
        **common,
      )
      self.slots = mesh.shape['shard'] if axes else mesh.size
    elif name.startswith('dmuon_chunks'):
      # dmuon's update in `chunks` parts in sequence (a memory experiment,
      # not a default strategy).
      self.opt = chunked_dmuon(
        int(name.removeprefix('dmuon_chunks')),
        lambda d, specs: dmuon_jax.dmuon(
          LR,
          mesh=mesh,
          nonfinite='propagate',
          param_specs=specs,
          adam_learning_rate=ADAM_LR,
          mu_dtype=mu_dtype,
          muon_weight_dimension_numbers=d,
        ),
        dims,
        jax.tree.map(lambda sh: sh.spec, self.param_sh),
      )
      self.slots = mesh.size
    elif name.startswith('dedicated'):
      placed = self.abstract_params(abstract)
      self.ded = dmuon_jax.dedicate(
        placed,
        mesh,
        muon_weight_dimension_numbers=dims,
        reshard_after_forward=name.endswith('z3'),
      )
      self.opt = dmuon_jax.dedicated_muon(
        self.ded,
        LR,
        adam_learning_rate=ADAM_LR,
        mu_dtype=mu_dtype,
        nonfinite='propagate',
      )
      self.slots = self.ded.num_slots
    else:
      raise ValueError(f'unknown strategy {name!r}')

  def abstract_params(self, abstract):
    import jax  # pylint: disable=import-outside-toplevel

    return jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      abstract,
      self.param_sh,
    )

  def place(self, tree):
    """Host arrays -> the strategy's params (or gradients) on the mesh."""
    import jax  # pylint: disable=import-outside-toplevel

    placed = jax.tree.map(jax.device_put, tree, self.param_sh)
    return self.ded.to_dedicated(placed) if self.ded else placed

  def place_grads(self, tree):
    """Host gradients (averaged over devices) -> the step's gradients.
    Dedicated: the Muon ones times the slots, the rest's times the devices
    they are split over, as the gathers' transposes (reduce-scatters that
    sum) deliver them and the update divides."""
    import math  # pylint: disable=import-outside-toplevel

    import jax  # pylint: disable=import-outside-toplevel

    if self.ded:
      n = self.ded.num_slots
      shape = self.mesh.shape
      split = lambda sh: math.prod(
        shape[a]
        for e in sh.spec
        if e is not None
        for a in ((e,) if isinstance(e, str) else e)
      )
      tree = jax.tree.map(
        lambda d, g, sh: g * split(sh) if d is None else g * n,
        full_dims(self.dims, tree),
        tree,
        self.param_sh,
        is_leaf=is_dims,
      )
    return self.place(tree)

  def abstract_inputs(self, abstract):
    """``(params, state, grads)`` abstract, with shardings."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

    params = self.abstract_params(abstract)
    if self.ded:
      # The owned buffers and the rest as the step's shard_map takes them.
      params = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)
        ),
        jax.eval_shape(self.ded.to_dedicated, params),
        self.ded.specs(),
        is_leaf=lambda x: isinstance(x, P),
      )
    with jax.set_mesh(self.mesh):
      state = jax.eval_shape(self.opt.init, params)
    state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      state,
      self.state_shardings(params),
    )
    return params, state, params

  def state_shardings(self, params):
    """The state's shardings: the params' for params-shaped leaves
    (optax), the library's own (dmuon), replicated scalars."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

    replicated = NamedSharding(self.mesh, P())
    if self.ded:
      # dedicated_muon's init places its whole state (the momentum in
      # owner buffers, AdamW's moments as their params).
      with jax.set_mesh(self.mesh):
        return jax.jit(self.opt.init).lower(params).compile().output_shardings
    with jax.set_mesh(self.mesh):
      state = jax.eval_shape(self.opt.init, params)
      if self.name.startswith('dmuon'):
        # The shardings init places the Muon momentum in (its owner
        # layout); AdamW's state follows the params (below).
        owner = jax.jit(self.opt.init).lower(params).compile().output_shardings
      else:
        owner = jax.tree.map(lambda _: replicated, state)
    # optax's states: a leaf at a params path (its dict keys end with the
    # param's) of the param's shape takes the param's sharding.
    by_path = {
      _dict_keys(path): (x.shape, sh)
      for (path, x), sh in zip(
        jax.tree.leaves_with_path(params), jax.tree.leaves(self.param_sh)
      )
    }

    def one(path, s, default):
      keys = _dict_keys(path)
      for k in range(len(keys)):
        shape, sh = by_path.get(keys[k:], (None, None))
        if shape == s.shape:
          return sh
      return default

    return jax.tree.map_with_path(one, state, owner)

  def init(self, params):
    import jax  # pylint: disable=import-outside-toplevel

    with jax.set_mesh(self.mesh):
      if self.ded:
        return self.opt.init(params)
      return jax.jit(self.opt.init, out_shardings=self.state_shardings(params))(
        params
      )

  def step(self, params, state):
    """The jitted step (``params``, ``state``: the strategy's, for the
    state's shardings and specs)."""
    import functools  # pylint: disable=import-outside-toplevel

    import jax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel

    opt = self.opt

    def fn(params, state, grads):
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    if self.ded is None:
      return jax.jit(
        fn,
        out_shardings=(self.param_sh, self.state_shardings(params)),
        donate_argnums=(0, 1),
      )
    ded = self.ded
    specs = ded.specs()

    # The gradients come in as the gathers' transposes deliver them
    # (place_grads): the update averages them without moving anything.
    body = fn

    # (Outside jit: specs_of reads the state's shardings.)
    state_specs = ded.specs_of(state)

    def wrapped(params, state, grads):
      return jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(specs, state_specs, specs),
        out_specs=(specs, state_specs),
      )(params, state, grads)

    return jax.jit(functools.partial(wrapped), donate_argnums=(0, 1))

  def to_plain(self, params):
    return self.ded.to_params(params) if self.ded else params


# ---------------------------------------------------------------------------
# The check and step times (8 simulated devices).


def rel_err(a, b):
  import numpy as np  # pylint: disable=import-outside-toplevel

  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(args):
  """Rows: every strategy against optax.contrib.muon on one device (3
  steps), then each strategy's median step time."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh(
    (2, 4), ('replicate', 'shard'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  shapes, dims = model_shapes(SMALL, head_dim=8)
  rng = np.random.default_rng(args.seed)
  new = lambda s, scale: (scale * rng.standard_normal(s)).astype(np.float32)
  params = jax.tree.map(lambda s: new(s, 0.1), shapes, is_leaf=is_shape)
  grads = [
    jax.tree.map(lambda s: new(s, 1e-2), shapes, is_leaf=is_shape)
    for _ in range(3)
  ]
  # The reference: optax.contrib.muon on one device.
  ref = optax.contrib.muon(
    LR, adam_learning_rate=ADAM_LR, muon_weight_dimension_numbers=dims
  )
  one = jax.devices()[0]
  want = jax.device_put(params, one)
  ref_state = ref.init(want)
  ref_step = jax.jit(
    lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *ref.update(g, s, p)
    )
  )
  for g in grads:
    want, ref_state = ref_step(want, ref_state, jax.device_put(g, one))
  want = jax.tree.map(np.asarray, want)
  machine = _common.machine_info(jax, optax, dmuon_jax)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  rows = []
  for name in args.strategies.split(','):
    t0 = time.perf_counter()
    row = {'mode': 'check', 'strategy': name, 'devices': mesh.size}
    try:
      st = Strategy(name, mesh, abstract, dims, None)
      p = st.place(params)
      state = st.init(p)
      step = st.step(p, state)
      with jax.set_mesh(mesh):
        compiled = step.lower(p, state, st.place_grads(grads[0])).compile()
        row['compile_s'] = time.perf_counter() - t0
        for g in grads:
          p, state = compiled(p, state, st.place_grads(g))
        got = jax.tree.map(np.asarray, st.to_plain(p))
        errs = jax.tree.map(rel_err, got, want)
        worst = max(jax.tree.leaves(errs))
        row['max_rel_diff'] = worst
        row['passed'] = bool(worst <= OPTAX_F32_RTOL)
        g = st.place_grads(grads[0])
        times, first, other = _common.time_steps(
          compiled,
          p,
          state,
          g,
          reps=args.reps,
          warmup=1,
          min_reps=1,
          budget_s=30.0,
          block=jax.block_until_ready,
        )
      row['median_ms'] = 1e3 * statistics.median(times)
      row['times_ms'] = [1e3 * t for t in times]
      row['first_step_ms'] = 1e3 * first
      row['other_processes_cpu_share'] = other
    except Exception as e:  # pylint: disable=broad-except
      row['error'] = f'{type(e).__name__}: {str(e)[:400]}'
      row['passed'] = False
    row['wall_s'] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    rows.append(row)
  rows.append({'mode': 'machine', **machine})
  return rows


# ---------------------------------------------------------------------------
# Compile-only rows.


def compile_row(model, name, n, s=8):
  import hlo_tools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh(
    (n // s, s),
    ('replicate', 'shard'),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  shapes, dims = model_shapes(model_config(model))
  abstract = jax.tree.map(
    lambda sh: jax.ShapeDtypeStruct(sh, jnp.bfloat16), shapes, is_leaf=is_shape
  )
  t = time.perf_counter()
  st = Strategy(name, mesh, abstract, dims, jnp.float32)
  plan_s = time.perf_counter() - t
  params, state, grads = st.abstract_inputs(abstract)
  with jax.set_mesh(mesh):
    compiled, lower_s, compile_s, cuda = _scale.compile_timed(
      st.step(params, state), n, params, state, grads
    )
  report = dmuon_jax.analyze_compiled(compiled)
  flops = hlo_tools.dot_flops(
    compiled, loop_trip_counts=True, branches_per_device=st.slots
  )
  total = sum(ns_flops(x) for x in muon_shapes(shapes, dims))
  row = {
    'model': model,
    'devices': n,
    'mode': 'compile',
    'strategy': name,
    'plan_s': plan_s,
    'lower_s': lower_s,
    'compile_s': compile_s,
    'ns_flops_per_device': flops,
    'ns_flops_total': total,
    'ns_over_ideal': flops / (total / n),
    'bytes_by_kind': cuda,
    'cuda_bytes_per_device': sum(cuda.values()),
    'cpu_bytes_by_kind': report.bytes_by_kind,
    'bytes_by_axis': _scale.by_axis(report, n, s),
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    **_scale.memory(compiled),
  }
  if st.ded is not None:
    payload, gathered = st.ded.gather_bytes()
    row['gathered_bytes'] = gathered
    row['payload_bytes'] = payload
    row['layers_per_gather'] = st.ded.layers_per_gather
  return row


def predict_rows(model, n, s=8):
  """Predicted busiest-device NS / ideal without compiling: ``replicated``
  N; ``stacked`` the most matrices of a shape on one device,
  ``sum ceil(count / N) * flops`` over shapes; ``dmuon`` (owners over
  both axes) and ``dmuon_shard`` the owner plans' makespans over their
  own single-owner totals / N (``dmuon_jax.plan_ownership``, as
  scale.py's plan rows)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import dmuon_jax  # pylint: disable=import-outside-toplevel

  shapes, dims = model_shapes(model_config(model))
  mats = muon_shapes(shapes, dims)
  total = sum(ns_flops(x) for x in mats)
  counts = {}
  for x in mats:
    counts[x] = counts.get(x, 0) + 1
  stacked = sum(-(-c // n) * ns_flops(x) for x, c in counts.items())
  abstract = jax.tree.map(
    lambda sh: jax.ShapeDtypeStruct(sh, jnp.bfloat16), shapes, is_leaf=is_shape
  )
  mesh = {'replicate': n // s, 'shard': s}
  kw = dict(weight_dimension_numbers=dims)
  plain = dmuon_jax.plan_ownership(abstract, mesh, owner_groups=None, **kw)
  ideal = sum(u.cost for u in plain.units) / n
  plan = dmuon_jax.plan_ownership(abstract, mesh, **kw)
  shard = dmuon_jax.plan_ownership(abstract, mesh, axis_names=('shard',), **kw)
  out = {
    'replicated': float(n),
    'stacked': stacked / (total / n),
    'dmuon': plan.makespan / ideal,
    'dmuon_shard': shard.makespan / ideal,
  }
  return [
    {
      'model': model,
      'devices': n,
      'mode': 'predict',
      'strategy': k,
      'ns_over_ideal': v,
      'matrices': len(mats),
      'shapes': len(counts),
    }
    for k, v in out.items()
  ]


def worker(args):
  n = args.worker
  for model in args.models.split(','):
    for name in args.strategies.split(','):
      t = time.perf_counter()
      try:
        row = compile_row(model, name, n)
      except Exception as e:  # pylint: disable=broad-except
        row = {
          'model': model,
          'devices': n,
          'mode': 'compile',
          'strategy': name,
          'error': f'{type(e).__name__}: {str(e)[:300]}',
        }
      row['wall_s'] = time.perf_counter() - t
      print(json.dumps(row), flush=True)


def run_worker(argv, timeout):
  """``(rows, error or None)`` of one subprocess of this script."""
  rows, rc, err = _scale.run_worker(__file__, argv, timeout)
  if rc == 'timeout':
    err = f'timeout after {timeout:.0f} s'
  return rows, None if rc == 0 else f'exit {rc}: {err[-400:]}'


# ---------------------------------------------------------------------------
# Report.


# Strategies whose every collective is written in shard_map (visible in
# the program lowered for CUDA); the others' come from XLA's partitioner,
# in the compiled (CPU) program only.
EXPLICIT = ('dmuon', 'dmuon_shard', 'dedicated_z2', 'dedicated_z3')


def is_explicit(name):
  return name in EXPLICIT or name.startswith('dmuon_chunks')


def row_bytes(r):
  """``(bytes by kind per device, source)`` of a compile row: the CUDA
  program's for EXPLICIT strategies (XLA:CPU runs bfloat16 all-to-alls in
  float32, doubling them), the compiled CPU program's for the others
  (GSPMD's collectives exist only after partitioning; their data is the
  float32 momentum and AdamW state)."""
  if is_explicit(r['strategy']):
    return r['bytes_by_kind'], 'cuda'
  return r['cpu_bytes_by_kind'], 'cpu'


def _model_order(m):
  base = m.partition('_L')[0]
  return (list(MODELS).index(base) if base in MODELS else 99, m)


def _mib(b):
  return f'{b / 2**20:.1f}'


def write_markdown(rows, path):
  lines = [
    '# Peers: dmuon against the other distributed Muons',
    '',
    'Produced by `python examples/benchmarks/peers.py` (see its docstring).',
    '',
  ]
  checks = [r for r in rows if r.get('mode') == 'check']
  if checks:
    lines += [
      '## Numbers check and step times (small float32 tree, 2x4 mesh of '
      'simulated CPU devices)',
      '',
      'Largest per-leaf relative Frobenius difference after 3 steps from '
      f'single-device `optax.contrib.muon` (pass: <= {OPTAX_F32_RTOL:g}); '
      'median step time of one run.',
      '',
      '| strategy | max rel. diff | passed | median step | compile |',
      '|---|---:|---|---:|---:|',
    ]
    for r in checks:
      if 'error' in r:
        lines.append(
          f'| {r["strategy"]} | error: {r["error"][:120]} | no | | |'
        )
        continue
      lines.append(
        f'| {r["strategy"]} | {r["max_rel_diff"]:.2e} | '
        f'{"yes" if r["passed"] else "NO"} | {r["median_ms"]:.1f} ms | '
        f'{r["compile_s"]:.1f} s |'
      )
  compiled = [r for r in rows if r.get('mode') == 'compile']
  if compiled:
    lines += [
      '',
      '## Compiled programs (abstract bfloat16 params, float32 momentum)',
      '',
      "NS / ideal: the busiest device's matmul FLOPs over optax's total / "
      'N. Bytes: per device (MiB), of the program lowered for CUDA for '
      'dmuon and dedicated (all their collectives are explicit; XLA:CPU '
      'would double their bfloat16 all-to-alls), of the compiled program '
      'for the GSPMD strategies (their collectives appear at '
      'partitioning). Peak: '
      'memory_analysis per device (MiB).',
      '',
      '| model | N | strategy | NS / ideal | bytes / device | by kind | '
      'by axis (CPU program) | peak | compile |',
      '|---|---:|---|---:|---:|---|---|---:|---:|',
    ]
    key = lambda r: (
      _model_order(r['model']),
      r['devices'],
      STRATEGIES.index(r['strategy']) if r['strategy'] in STRATEGIES else 99,
    )
    for r in sorted(compiled, key=key):
      if 'error' in r:
        lines.append(
          f'| {r["model"]} | {r["devices"]} | {r["strategy"]} | '
          f'not reached: {r["error"][:160]} | | | | | |'
        )
        continue
      by_kind, _ = row_bytes(r)
      kinds = ', '.join(
        f'{_common.KIND_ABBREV.get(k, k)} {_mib(v)}'
        for k, v in sorted(by_kind.items())
        if v
      )
      axes = ', '.join(
        f'{k} {_mib(v)}' for k, v in sorted(r['bytes_by_axis'].items()) if v
      )
      lines.append(
        f'| {r["model"]} | {r["devices"]} | {r["strategy"]} | '
        f'{r["ns_over_ideal"]:.3f} | {_mib(sum(by_kind.values()))} | '
        f'{kinds or "-"} | {axes or "-"} | {_mib(r["peak_bytes"])} | '
        f'{r["compile_s"]:.1f} s |'
      )
  ded = [
    r
    for r in compiled
    if r['strategy'].startswith('dedicated') and 'error' not in r
  ]
  if ded:
    lines += [
      '',
      "## Dedicated: the update above, and the gathers that replace FSDP's",
      '',
      "The dedicated rows above are dedicated_muon's update alone (owned "
      'gradients in, no gather). The forward and backward gather the '
      "owned matrices instead of FSDP's gathers: per step, per device "
      '(`Dedication.gather_bytes`, MiB; Z3 gathers again for the backward).',
      '',
      '| model | N | mode | layers per gather | gathered | payload |',
      '|---|---:|---|---:|---:|---:|',
    ]
    for r in sorted(ded, key=key):
      lines.append(
        f'| {r["model"]} | {r["devices"]} | {r["strategy"]} | '
        f'{r["layers_per_gather"]} | {_mib(r["gathered_bytes"])} | '
        f'{_mib(r["payload_bytes"])} |'
      )
  predicted = [r for r in rows if r.get('mode') == 'predict']
  if predicted:
    names = ('replicated', 'stacked', 'dmuon', 'dmuon_shard')
    table = {}
    for r in predicted:
      table.setdefault((r['model'], r['devices']), {})[r['strategy']] = r
    measured = {
      (r['model'], r['devices'], r['strategy']): r['ns_over_ideal']
      for r in compiled
      if 'error' not in r
    }
    lines += [
      '',
      '## Predicted busiest-device NS / ideal (no compile)',
      '',
      'replicated: N; stacked: the most matrices of one shape a device '
      'gets (stacks padded to a multiple of N) times their FLOPs, over '
      "optax's total / N; dmuon: the owner plan's makespan over its "
      "single-owner total / N (dmuon's own cost model: its Gram "
      "Newton–Schulz counts fewer FLOPs than optax's for rectangular "
      'matrices). In brackets: the compiled row of the same model and N '
      "(NS FLOPs over optax's total / N).",
      '',
      '| model | N | ' + ' | '.join(names) + ' |',
      '|---|---:|' + '---:|' * len(names),
    ]
    for (model, n), v in sorted(
      table.items(), key=lambda kv: (_model_order(kv[0][0]), kv[0][1])
    ):
      cells = []
      for name in names:
        got = measured.get((model, n, name))
        cell = f'{v[name]["ns_over_ideal"]:.3f}' if name in v else '-'
        cells.append(cell + (f' ({got:.3f})' if got is not None else ''))
      lines.append(f'| {model} | {n} | ' + ' | '.join(cells) + ' |')
  hsdp = {}
  for r in compiled:
    if r['strategy'] in ('dmuon', 'dmuon_shard') and 'error' not in r:
      hsdp.setdefault((r['model'], r['devices']), {})[r['strategy']] = r
  pairs = [(k, v) for k, v in sorted(hsdp.items()) if len(v) == 2]
  if pairs:
    lines += [
      '',
      "## HSDP: dmuon's owners over both axes against over 'shard' only",
      '',
      "Bytes over 'replicate': collectives whose groups have N / 8 "
      "devices (at N = 64 both axes have 8: 'shard|replicate'), per "
      'device, CPU program (MiB).',
      '',
      "| model | N | owners | NS / ideal | bytes over 'replicate' | "
      'bytes / device | peak |',
      '|---|---:|---|---:|---:|---:|---:|',
    ]
    for (model, n), v in pairs:
      for name, label in (('dmuon', 'both axes'), ('dmuon_shard', "'shard'")):
        r = v[name]
        rep = sum(
          b
          for k, b in r['bytes_by_axis'].items()
          if k.endswith('over replicate')
        )
        rep = _mib(rep) if n // 8 != 8 else 'n/a (both axes 8)'
        lines.append(
          f'| {model} | {n} | {label} | {r["ns_over_ideal"]:.3f} | '
          f'{rep} | {_mib(sum(row_bytes(r)[0].values()))} | '
          f'{_mib(r["peak_bytes"])} |'
        )
  errors = [r for r in rows if r.get('mode') == 'worker']
  if errors:
    lines += ['', '## Workers that failed', '']
    lines += [
      f'- {r.get("model", "")} N={r["devices"]}: {r["error"]}' for r in errors
    ]
  path.write_text('\n'.join(lines) + '\n')


def plot(rows, path):
  """NS / ideal per strategy against N, one panel per model."""
  plt = _common.pyplot()
  if plt is None:
    return
  compiled = [
    r for r in rows if r.get('mode') == 'compile' and 'error' not in r
  ]
  predicted = [r for r in rows if r.get('mode') == 'predict']
  models = sorted({r['model'] for r in compiled}, key=_model_order)
  if not models:
    return
  fig, axes = plt.subplots(
    1, len(models), figsize=(4.6 * len(models), 4), squeeze=False
  )
  for ax, model in zip(axes[0], models):
    for i, name in enumerate(STRATEGIES):
      color = f'C{i}'
      pts = sorted(
        (r['devices'], r['ns_over_ideal'])
        for r in compiled
        if r['model'] == model and r['strategy'] == name
      )
      if pts:
        ax.plot(*zip(*pts), 'o-', color=color, label=name)
      pts = sorted(
        (r['devices'], r['ns_over_ideal'])
        for r in predicted
        if r['model'] == model and r['strategy'] == name
      )
      if pts:
        ax.plot(*zip(*pts), '--', color=color, alpha=0.6)
    ax.axhline(1.0, color='k', lw=0.6, ls='--')
    ax.set(
      xscale='log',
      yscale='log',
      xlabel='devices N',
      ylabel='busiest device NS FLOPs / (total / N)',
      title=f'{model} (dashed: predicted)',
    )
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=_common.HelpFormatter
  )
  p.add_argument(
    '--devices',
    default='8,64,256',
    help="device counts N of the compile-only rows ('' for none)",
  )
  p.add_argument(
    '--models', default=','.join(MODELS), help='models, comma-separated'
  )
  p.add_argument(
    '--strategies',
    default=','.join(STRATEGIES),
    help='strategies, comma-separated',
  )
  p.add_argument(
    '--reps', type=int, default=5, help='timed steps of the small tree'
  )
  p.add_argument(
    '--worker-timeout',
    type=float,
    default=3600.0,
    help='seconds for one device count (all its models and strategies)',
  )
  p.add_argument(
    '--append',
    action='store_true',
    help='keep the rows of an existing results file not measured again',
  )
  p.add_argument(
    '--fast-compile',
    action=argparse.BooleanOptionalAction,
    default=True,
    help="compile-only rows with the suite's cheaper XLA:CPU backend "
    'settings (FAST_XLA_FLAGS: backend code generation only; the HLO '
    'passes that decide partitioning, collectives and buffers are '
    'unchanged)',
  )
  p.add_argument(
    '--check',
    action=argparse.BooleanOptionalAction,
    default=True,
    help='run the numbers check and step times (--no-check: only the '
    "compile-only rows, or with --devices '' --append re-render)",
  )
  p.add_argument(
    '--predict',
    default='',
    help='models (comma-separated) whose NS / ideal is predicted without '
    'compiling (stacked; dmuon owner plans) at N = --predict-devices',
  )
  p.add_argument(
    '--predict-devices', default='8,64,256', help='device counts of --predict'
  )
  p.add_argument(
    '--worker', type=int, default=0, help='(internal) one device count'
  )
  p.add_argument(
    '--check-worker', action='store_true', help='(internal) the check'
  )
  _common.add_common_args(p, 'peers', 'the check and step times only (< 30 s)')
  args = p.parse_args(argv)
  _common.apply_quick(p, args, argv, {'devices': '', 'reps': 3})
  if args.name is None:
    args.name = 'peers_quick' if args.quick else 'peers'
  if args.out_dir is None:
    args.out_dir = str(HERE / 'results')
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.worker or args.check_worker:
    flags = f' --xla_force_host_platform_device_count={args.worker or 8}'
    if args.worker and args.fast_compile:
      flags += ' ' + FAST_XLA_FLAGS
    os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + flags
    if args.worker:
      worker(args)
    else:
      for row in check(args):
        if row['mode'] == 'machine':
          print(json.dumps(row), flush=True)
    return
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f'{args.name}.json'
  rows = []
  if args.append and path.exists():
    rows = [json.loads(l) for l in path.read_text().splitlines() if l]
  fresh = []
  common = ['--strategies', args.strategies, '--seed', str(args.seed)]
  got, err = [], None
  if args.check:
    got, err = run_worker(
      ['--check-worker', '--reps', str(args.reps), *common],
      args.worker_timeout,
    )
  fresh += got
  if err:
    fresh.append({'mode': 'worker', 'devices': 8, 'error': err})
  for row in got:
    if row.get('mode') == 'check':
      print(
        f'{row["strategy"]:>17}: max rel. diff '
        f'{row.get("max_rel_diff", float("nan")):.2e} '
        f'{"passed" if row.get("passed") else "FAILED"}, median step '
        f'{row.get("median_ms", float("nan")):.1f} ms'
        + (f' ({row["error"]})' if 'error' in row else ''),
        flush=True,
      )
  for n in [int(x) for x in args.devices.split(',') if x]:
    fast = '--fast-compile' if args.fast_compile else '--no-fast-compile'
    got, err = run_worker(
      ['--worker', str(n), '--models', args.models, fast, *common],
      args.worker_timeout,
    )
    for row in got:
      print(json.dumps(row), flush=True)
    fresh += got
    if err:
      fresh.append({'mode': 'worker', 'devices': n, 'error': err})
  for model in [m for m in args.predict.split(',') if m]:
    for n in [int(x) for x in args.predict_devices.split(',') if x]:
      fresh += predict_rows(model, n)
  key = lambda r: (
    r.get('mode'),
    r.get('model'),
    r.get('devices'),
    r.get('strategy'),
  )
  latest = {key(r): r for r in rows}
  latest.update({key(r): r for r in fresh})
  rows = list(latest.values())
  with open(path, 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  write_markdown(rows, out_dir / f'{args.name}.md')
  if any(r.get('mode') == 'compile' for r in rows):
    plot(rows, out_dir / f'{args.name}.png')
  failed = [
    r['strategy']
    for r in fresh
    if r.get('mode') == 'check' and not r.get('passed')
  ]
  if failed:
    sys.exit(f'check failed: {", ".join(failed)}')


if __name__ == '__main__':
  main()
