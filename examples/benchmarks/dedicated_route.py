"""Design study (issue 26): a dedicated step with plain-``jit`` semantics.

Route R ("reduced gather"): each block's Muon matrices are stored as one flat
owner buffer sharded over both axes of an Explicit 2x4 mesh
``('replicate', 'shard')``; the block gathers it through a ``jax.custom_vjp``
whose forward is ``jax.reshard(buf, P(reduced=axes))`` and whose backward
reduce-scatters the ``unreduced`` cotangent with a small ``jax.shard_map``
of ``psum_scatter``. The train step is plain ``nnx.jit``: the user's loss,
``nnx.value_and_grad``, an ``nnx.MultiMetric`` update, dropout drawing from
``nnx.Rngs`` and an activation ``with_sharding_constraint`` over the data
axes, all as written.

Configurations, on one small NNX model (embedding, 3 blocks of two Muon
matrices D x F and F x D, dropout, head; float32):

- ``plain_jit``: replicated params, ``nnx.jit`` (data parallel; its Muon
  all-reduce is the Z2 byte floor).
- ``route_z2`` / ``route_z3``: route R without / with each block under
  ``nnx.remat(policy=nothing_saveable)``.
- ``route_hsdp``: buffers ``P('shard')`` (replicated over ``'replicate'``),
  backward reduce-scatter over ``'shard'`` then all-reduce over
  ``'replicate'``.
- ``route_hsdp_sm``: as ``route_hsdp``, the forward a ``shard_map``
  ``all_gather(to='reduced')`` over ``'shard'`` only, then
  ``pcast('replicate', to='reduced')``.
- ``route_scan_z2`` / ``route_scan_z3``: the blocks as ``nnx.scan`` over an
  ``nnx.vmap``-created stack of buffers ``(layers, 2DF)``, sharded
  ``P(None, axes)``; Z3 puts the scan body under ``nnx.remat``.
- ``route_tied``: the embedding table is also the head (``embed.attend``).
- ``route_shared``: block 0 is applied a second time after block 2.
- ``route_auto``: route R on an Auto mesh (what happens is recorded).
- ``dedicated_z2`` / ``dedicated_z3``: today's ``dmuon_jax.flax.dedicate`` +
  ``dmuon_jax.flax.train_step`` (a step-level ``shard_map``) with
  ``dedicated_muon``; the model's activation constraint is switched off
  (with it, the step fails; the message is recorded).

Per configuration: collectives of the compiled step per kind (count and
bytes per device, ``while`` trip counts included), split into Muon (the
owner buffers' size) and the rest; the gradient's max relative difference
from single-device autodiff of the same model; whether the metric's count
and the Rngs' count after 2 steps are those of single-device ``nnx.jit`` of
the same model.

    python examples/benchmarks/dedicated_route.py  # ~27 s, 2 cores
    python examples/benchmarks/dedicated_route.py --quick  # fewer rows, ~10 s

Writes ``results/<name>.json`` (one JSON object per line) and
``results/<name>.md`` next to this file (or under ``--out-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optimizer_step as _common  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dmuon_jax  # noqa: E402
import dmuon_jax.flax as dflax  # noqa: E402

# 8 simulated CPU devices (GPUs are what they are), unless XLA_FLAGS forces a
# host device count of its own; other XLA_FLAGS keep working.
if 'xla_force_host_platform_device_count' not in os.environ.get(
  'XLA_FLAGS', ''
):
  jax.config.update('jax_num_cpu_devices', 8)

AXES = ('replicate', 'shard')
LAYERS = 3
STEPS = 2
# Dropout with rate 0 returns early without drawing; at 1e-9 the keep
# probability is 1.0 in float32: every mask is all ones (exact parity with
# the reference) and every call draws from the Rngs.
DROP_RATE = 1e-9
# Left out of --quick (the smoke run: route R's forms and the baseline).
QUICK_SKIP = (
  'route_hsdp',
  'route_scan_z3',
  'route_tied',
  'route_shared',
  'dedicated_z2',
  'dedicated_z3',
)


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0],
    formatter_class=_common.HelpFormatter,
  )
  p.add_argument(
    '--d-model', type=int, default=64, help='model width D (--quick: 32)'
  )
  p.add_argument(
    '--d-ff', type=int, default=128, help='MLP width F (--quick: 64)'
  )
  p.add_argument(
    '--vocab', type=int, default=64, help='vocabulary (--quick: 48)'
  )
  p.add_argument('--seq', type=int, default=16, help='sequence length')
  p.add_argument('--batch', type=int, default=16, help='global batch')
  _common.add_common_args(p, 'dedicated_route', 'D 32, F 64, vocab 48')
  args = p.parse_args(argv)
  _common.apply_quick(p, args, argv, {'d_model': 32, 'd_ff': 64, 'vocab': 48})
  # Collectives are told apart by element count: the sizes must differ.
  rest, buf = 2 * args.vocab * args.d_model, 2 * args.d_model * args.d_ff
  if rest <= buf <= rest + 8:
    p.error(
      f'--vocab {args.vocab}: the embedding + head gradients have as many '
      f'elements as a block buffer ({buf}); choose another vocab'
    )
  if args.name is None:
    args.name = 'dedicated_route_quick' if args.quick else 'dedicated_route'
  if args.out_dir is None:
    args.out_dir = str(pathlib.Path(__file__).resolve().parent / 'results')
  return args


# ---------------------------------------------------------------------------
# The reduced gather (route R).


def reduced_gather(axes, owner_spec, stages, forward_axes=None):
  """A gather of an owner buffer to a ``reduced`` replicated value.

  ``stages``: ``((scatter_axes, sum_axes),)``: the backward reduce-scatters
  the unreduced cotangent over ``scatter_axes`` and all-reduces it over
  ``sum_axes`` (HSDP: ``('shard',)``, ``('replicate',)``).
  ``forward_axes``: ``None`` gathers with ``jax.reshard``; a tuple of axes
  gathers over those only in a ``shard_map`` (``all_gather(to='reduced')``)
  and marks the other axes reduced with ``pcast`` (the buffer is already
  replicated over them).
  """
  scatter_axes, sum_axes = stages

  def _scatter(g):  # g: f32[n]{U:axes}, this device's partial sum
    g = jax.lax.psum_scatter(g, scatter_axes, tiled=True)
    if sum_axes:
      g = jax.lax.psum(g, sum_axes)
    return g  # f32[n / |scatter_axes|]

  def _gather(b):  # b: f32[n / |forward_axes|]{V:forward_axes}
    w = jax.lax.all_gather(b, forward_axes, tiled=True, to='reduced')
    rest = tuple(a for a in axes if a not in forward_axes)
    return jax.lax.pcast(w, rest, to='reduced')  # f32[n]{R:axes}

  @jax.custom_vjp
  def gather(buf):
    if forward_axes is None:
      return jax.reshard(buf, P(reduced=set(axes)))
    return jax.shard_map(
      _gather, in_specs=owner_spec, out_specs=P(reduced=set(axes))
    )(buf)

  def fwd(buf):
    return gather(buf), None

  def bwd(_, cot):
    scatter = jax.shard_map(
      _scatter, in_specs=P(unreduced=set(axes)), out_specs=owner_spec
    )
    return (scatter(cot),)

  gather.defvjp(fwd, bwd)
  return gather


# ---------------------------------------------------------------------------
# The model.


class Block(nnx.Module):
  def __init__(self, d, f, rngs):
    self.up = nnx.Linear(d, f, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs)
    self.drop = nnx.Dropout(DROP_RATE, rngs=rngs)

  def mlp(self, x, up, down):
    return x + self.drop(nnx.gelu(x @ up) @ down)

  def __call__(self, x):
    return x + self.drop(self.down(nnx.gelu(self.up(x))))


class RouteBlock(nnx.Module):
  """A block whose two matrices live in one flat owner buffer."""

  def __init__(self, block: Block, sharding, gather):
    up, down = block.up.kernel[...], block.down.kernel[...]
    self.shapes = (up.shape, down.shape)
    flat = jnp.concatenate([up.ravel(), down.ravel()])
    self.buf = nnx.Param(jax.device_put(flat, sharding))
    self.drop = block.drop
    self.gather = gather

  def __call__(self, x):
    w = self.gather(self.buf[...])  # f32[2 d f]{R:axes}
    up, down = split_buf(w, self.shapes)
    return x + self.drop(nnx.gelu(x @ up) @ down)


def split_buf(w, shapes):
  (d, f), _ = shapes
  return w[: d * f].reshape(d, f), w[d * f :].reshape(f, d)


class ScanBlock(nnx.Module):
  """One layer of a scanned stack: a flat owner buffer and a dropout."""

  def __init__(self, buf, rngs, shapes, gather):
    self.buf = nnx.Param(buf)
    self.drop = nnx.Dropout(DROP_RATE, rngs=rngs)
    self.shapes = shapes
    self.gather = gather

  def __call__(self, x):
    up, down = split_buf(self.gather(self.buf[...]), self.shapes)
    return x + self.drop(nnx.gelu(x @ up) @ down)


class ScanLayers(nnx.Module):
  """The blocks as ``nnx.scan`` over an ``nnx.vmap``-created stack whose
  buffers, ``(layers, 2 d f)``, are sharded ``P(None, axes)``."""

  def __init__(self, blocks, mesh, gather):
    shapes = (blocks[0].up.kernel.shape, blocks[0].down.kernel.shape)
    bufs = jnp.stack(
      [
        jnp.concatenate([b.up.kernel[...].ravel(), b.down.kernel[...].ravel()])
        for b in blocks
      ]
    )

    @nnx.split_rngs(splits=len(blocks))
    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def make(buf, rngs):
      return ScanBlock(buf, rngs, shapes, gather)

    self.stack = make(bufs, nnx.Rngs(dropout=1))
    state = nnx.state(self.stack)
    nnx.update(
      self.stack,
      jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P())), state
      ),
    )
    self.stack.buf.value = jax.device_put(
      self.stack.buf[...], NamedSharding(mesh, P(None, AXES))
    )

  def __call__(self, x, remat, constrain):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, x):
      if remat:
        x = nnx.remat(
          lambda b, x: b(x), policy=jax.checkpoint_policies.nothing_saveable
        )(block, x)
      else:
        x = block(x)
      if constrain is not None:
        x = jax.lax.with_sharding_constraint(x, constrain)
      return x

    return body(self.stack, x)


class Model(nnx.Module):
  def __init__(self, args, rngs, *, tied=False, shared=False):
    d, f = args.d_model, args.d_ff
    self.embed = nnx.Embed(args.vocab, d, rngs=rngs)
    blocks = [Block(d, f, rngs) for _ in range(LAYERS)]
    if shared:  # block 0 applied a second time, after the others
      blocks.append(blocks[0])
    self.layers = nnx.List(blocks)
    self.head = nnx.Linear(d, args.vocab, use_bias=False, rngs=rngs)
    self.tied = tied  # the embedding table is also the output head
    self.constrain = None  # a PartitionSpec of the activations, or None
    self.lookup = None  # the embedding lookup's out_sharding (Explicit)
    self.remat = False

  def __call__(self, tokens):
    if self.lookup is None:
      x = self.embed(tokens)
    else:  # Explicit axes: the lookup's output sharding must be given
      x = self.embed.embedding[...].at[tokens].get(out_sharding=self.lookup)
    if isinstance(self.layers, ScanLayers):
      x = self.layers(x, self.remat, self.constrain)
    else:
      for block in self.layers:
        if self.remat:
          x = nnx.remat(
            lambda b, x: b(x), policy=jax.checkpoint_policies.nothing_saveable
          )(block, x)
        else:
          x = block(x)
        if self.constrain is not None:
          x = jax.lax.with_sharding_constraint(x, self.constrain)
    return self.embed.attend(x) if self.tied else self.head(x)


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def grad_step(model, metrics, tokens):
  """The user's step: loss, gradients, the metric (no optimizer)."""
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  metrics.update(loss=loss)
  return loss, grads


def train_step(model, optimizer, metrics, tokens):
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  metrics.update(loss=loss)
  return loss


def new_metrics():
  return nnx.MultiMetric(loss=nnx.metrics.Average('loss'))


def new_model(args, **variant):
  return Model(args, nnx.Rngs(params=0, dropout=1), **variant)


def counters(model, metrics):
  if isinstance(model.layers, ScanLayers):  # layer 0's stream of the stack
    rngs = model.layers.stack.drop.rngs.count[...][0]
  else:
    rngs = model.layers[0].drop.rngs.count[...]
  return {
    'metric_count': int(metrics.loss.count[...]),
    'metric_total': float(metrics.loss.total[...]),
    'rngs_count': int(rngs),
  }


# ---------------------------------------------------------------------------
# Measurement.


def collectives(compiled, rest_elems, devices=8):
  """Per kind: count and bytes per device (executions included; ``ops``:
  the HLO ops, fewer than ``count`` inside a ``while``), split into "rest"
  (ops over all devices of scalars: loss, metric; or of ``rest_elems``
  elements: the embedding and head gradients) and "Muon" (everything else:
  the owner buffers' gathers and scatters, or a combined all-reduce of all
  gradients)."""
  report = dmuon_jax.analyze_compiled(compiled)
  out = {'muon': {}, 'rest': {}}
  for c in report.collectives:
    n = int(np.prod(c.shape))
    rest = n == 1 or rest_elems <= n <= rest_elems + 8
    part = 'rest' if rest and c.group_size == devices else 'muon'
    row = out[part].setdefault(
      c.kind, {'count': 0, 'ops': 0, 'bytes': 0.0, 'group_sizes': []}
    )
    row['count'] += c.executions
    row['ops'] += 1
    if c.group_size not in row['group_sizes']:
      row['group_sizes'].append(c.group_size)
    row['bytes'] += c.bytes * c.executions
  return out


def max_rel_diff(got: dict, want: dict) -> float:
  worst = 0.0
  for k, b in want.items():
    a = np.asarray(got[k], np.float64)
    b = np.asarray(b, np.float64)
    if not np.abs(b).max():  # an unused leaf (the tied model's head)
      worst = max(worst, float(np.abs(a).max()))
      continue
    worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
  return worst


def plain_grads(grads) -> dict:
  g = nnx.to_pure_dict(grads)
  out = {'embed': g['embed']['embedding'], 'head': g['head']['kernel']}
  for i, layer in g['layers'].items():
    if 'buf' in layer or 'stack' in g['layers']:
      continue
    out[f'{i}/up'] = layer['up']['kernel']
    out[f'{i}/down'] = layer['down']['kernel']
  return out


def route_grads(model, grads) -> dict:
  out = plain_grads(grads)
  g = nnx.to_pure_dict(grads)
  if isinstance(model.layers, ScanLayers):
    shapes = model.layers.stack.shapes
    rows = enumerate(np.asarray(g['layers']['stack']['buf']))
  else:  # a block used twice has one gradient, under its first index
    shapes = model.layers[0].shapes
    rows = ((i, np.asarray(v['buf'])) for i, v in g['layers'].items())
  for i, flat in rows:
    out[f'{i}/up'], out[f'{i}/down'] = split_buf(flat, shapes)
  return out


def error_line(err: Exception) -> str:
  text = f'{type(err).__name__}: {err}'.split('\n')[0]
  return text[:300]


def run_grad_config(
  name, args, mesh, tokens_np, *, route=None, remat=False, scan=False, **variant
):
  """Plain ``nnx.jit`` of ``grad_step``, replicated params or route R
  (``route``: owner spec, backward stages and forward axes)."""
  model = new_model(args, **variant)
  with jax.set_mesh(mesh):
    data = NamedSharding(mesh, P(AXES))
    state = nnx.state(model)
    nnx.update(
      model,
      jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P())), state
      ),
    )
    model.constrain = P(AXES)
    if AxisType.Explicit in mesh.axis_types:
      model.lookup = P(AXES)
    model.remat = remat
    if route is not None:
      owner_spec, stages, *forward = route
      gather = reduced_gather(AXES, owner_spec, stages, *forward)
      sharding = NamedSharding(mesh, owner_spec)
      if scan:
        model.layers = ScanLayers(list(model.layers), mesh, gather)
      else:  # one RouteBlock per distinct Block (a shared one stays shared)
        routed = {}
        model.layers = nnx.List(
          [
            routed.setdefault(id(b), RouteBlock(b, sharding, gather))
            for b in model.layers
          ]
        )
    metrics = new_metrics()
    tokens = jax.device_put(tokens_np, data)
    step = nnx.jit(grad_step)
    compiled = step.lower(model, metrics, tokens).compile()
    for _ in range(STEPS):
      loss, grads = step(model, metrics, tokens)
  grads = route_grads(model, grads) if route else plain_grads(grads)
  return compiled, float(loss), grads, counters(model, metrics)


def run_dedicated(args, mesh, tokens_np, z3, constrain):
  model = new_model(args)
  model.constrain = P(AXES) if constrain else None
  ded = dflax.dedicate(model, mesh, reshard_after_forward=z3)
  optimizer = nnx.Optimizer(
    model, dflax.dedicated_muon(ded, learning_rate=0.0), wrt=nnx.Param
  )
  metrics = new_metrics()
  step = dflax.train_step(ded)(train_step)
  tokens = jnp.asarray(tokens_np)
  compiled = step.compile(model, optimizer, metrics, tokens)
  for _ in range(STEPS):
    loss = step(model, optimizer, metrics, tokens)
  summary = ded.summary().splitlines()
  return compiled, float(loss), counters(model, metrics), summary


def main(argv=None):  # pylint: disable=too-many-locals,too-many-statements
  args = parse_args(argv)
  t0 = time.perf_counter()
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(
    timespec='seconds'
  )
  machine = _common.machine_info(jax, optax, dmuon_jax)
  explicit = jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Explicit,) * 2)
  auto = jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
  n = explicit.size
  d, f = args.d_model, args.d_ff
  buf_elems = 2 * d * f
  rest_elems = 2 * args.vocab * d  # embedding + head
  p_m = 4 * LAYERS * buf_elems  # bytes of the Muon matrices
  tokens_np = np.asarray(
    jax.random.randint(
      jax.random.key(args.seed), (args.batch, args.seq + 1), 0, args.vocab
    )
  )

  refs = {}

  def reference(tied=False, shared=False):
    """Single-device autodiff of the same model under plain ``nnx.jit``:
    the reference gradient and the counts after ``STEPS`` steps."""
    if (tied, shared) not in refs:
      model = new_model(args, tied=tied, shared=shared)
      metrics = new_metrics()
      step = nnx.jit(grad_step)
      for _ in range(STEPS):
        _, grads = step(model, metrics, jnp.asarray(tokens_np))
      refs[tied, shared] = plain_grads(grads), counters(model, metrics)
    return refs[tied, shared]

  both = (AXES, ())
  hsdp = (('shard',), ('replicate',))
  results = {}

  def grad_config(name, description, mesh=explicit, note='', **kw):
    if args.quick and name in QUICK_SKIP:
      return
    row = {'config': name, 'description': description}
    t = time.perf_counter()
    if note:
      row['note'] = note
    ref, ref_count = reference(kw.get('tied', False), kw.get('shared', False))
    row.update({f'ref_{k}': v for k, v in ref_count.items()})
    try:
      compiled, loss, grads, count = run_grad_config(
        name, args, mesh, tokens_np, **kw
      )
    except Exception as err:  # pylint: disable=broad-except
      row['error'] = error_line(err)
    else:
      row.update(
        collectives=collectives(compiled, rest_elems, n),
        loss=loss,
        grad_max_rel_diff=max_rel_diff(grads, ref),
        **count,
      )
    row['wall_s'] = time.perf_counter() - t
    results[name] = row
    print(name, f'{row["wall_s"]:.1f} s', row.get('error', ''))

  grad_config('plain_jit', 'nnx.jit, replicated params (data parallel)')
  grad_config(
    'route_z2',
    'nnx.jit, reduced gather, buffers P((replicate, shard))',
    route=(P(AXES), both),
  )
  grad_config(
    'route_z3',
    'as route_z2, each block under nnx.remat(nothing_saveable)',
    route=(P(AXES), both),
    remat=True,
  )
  grad_config(
    'route_hsdp',
    'nnx.jit, reduced gather, buffers P(shard): RS shard + AR replicate',
    route=(P('shard'), hsdp),
  )
  grad_config(
    'route_hsdp_sm',
    'as route_hsdp, forward a shard_map all_gather(to=reduced) over shard'
    ' + pcast(replicate, to=reduced)',
    route=(P('shard'), hsdp, ('shard',)),
  )
  grad_config(
    'route_scan_z2',
    'route_z2 as nnx.scan over an nnx.vmap stack, buffers'
    ' (layers, 2DF) P(None, (replicate, shard))',
    route=(P(AXES), both),
    scan=True,
  )
  grad_config(
    'route_scan_z3',
    'as route_scan_z2, the scan body under nnx.remat(nothing_saveable)',
    route=(P(AXES), both),
    scan=True,
    remat=True,
  )
  grad_config(
    'route_tied',
    'route_z2, the embedding table also the head (embed.attend)',
    route=(P(AXES), both),
    tied=True,
    note='rest: one tuple all-reduce of the table gradient per use'
    ' (lookup scatter, attend), summed after it: 2·V·D elements as untied',
  )
  grad_config(
    'route_shared',
    'route_z2, block 0 applied again after block 2 (4 uses, 3 buffers)',
    route=(P(AXES), both),
    shared=True,
  )
  grad_config(
    'route_auto',
    'route_z2 on an Auto mesh',
    mesh=auto,
    route=(P(AXES), both),
  )

  for z3 in (False, True):
    name = 'dedicated_z3' if z3 else 'dedicated_z2'
    if args.quick and name in QUICK_SKIP:
      continue
    row = {
      'config': name,
      'description': 'dmuon_jax.flax.dedicate + train_step (shard_map step)'
      + (', reshard_after_forward' if z3 else ''),
    }
    try:
      run_dedicated(args, explicit, tokens_np, z3, constrain=True)
    except Exception as err:  # pylint: disable=broad-except
      row['error_with_constraint'] = error_line(err)
    try:
      compiled, loss, count, summary = run_dedicated(
        args, explicit, tokens_np, z3, constrain=False
      )
    except Exception as err:  # pylint: disable=broad-except
      row['error'] = error_line(err)
    else:
      row.update(
        collectives=collectives(compiled, rest_elems, n),
        loss=loss,
        gathers=[ln.strip() for ln in summary if 'gathered as' in ln],
        **count,
      )
    results[name] = row
    print(name, {k: v for k, v in row.items() if k != 'description'})

  wall_s = time.perf_counter() - t0
  model_info = {
    'layers': LAYERS,
    'd_model': d,
    'd_ff': f,
    'vocab': args.vocab,
    'seq': args.seq,
    'global_batch': args.batch,
    'dtype': 'float32',
    'mesh': '2x4',
    'muon_bytes': p_m,
    'steps': STEPS,
  }
  floors = {
    'z2': 2 * (n - 1) / n * p_m,
    'z3': 3 * (n - 1) / n * p_m,
  }
  md = render_markdown(args, date, machine, model_info, floors, results, wall_s)
  common = {
    'date': date,
    'machine': machine,
    'model': model_info,
    'benchmark': 'dedicated_route',
    'quick': args.quick,
  }
  lines = [dict(common, **row) for row in results.values()]
  lines.append(dict(common, config='summary', wall_s=wall_s, floors=floors))
  _common.write_results(args.out_dir, args.name, lines, md, wall_s)
  return lines


def _ops(v: dict) -> str:
  return f' ({v["ops"]} op)' if v.get('ops', v['count']) != v['count'] else ''


def _fmt(part: dict) -> str:
  items = [
    f'{_common.KIND_ABBREV.get(k, k)}/{"+".join(map(str, v["group_sizes"]))}'
    f' {v["count"]}×{_ops(v)} {v["bytes"] / 1e3:.1f}'
    for k, v in sorted(part.items())
    if v['count']
  ]
  return ', '.join(items) if items else '–'


def render_markdown(args, date, machine, model, floors, results, wall_s):
  base = results['plain_jit']
  lines = [
    '# Dedicated step route: reduced gather under plain jit (issue 26)',
    '',
    f'- date: {date}; wall time of the run {wall_s:.0f} s',
    f'- machine: {machine["platform"]}, {machine["cpu_count"]} CPUs,'
    f' {machine["devices"]} simulated XLA:CPU devices (mesh 2x4,'
    ' replicate x shard)',
    f'- software: python {machine["python"]}, jax {machine["jax"]}, optax'
    f' {machine["optax"]}, dmuon_jax {machine["dmuon_jax"]}',
    f'- model: NNX, embedding {args.vocab}x{model["d_model"]}, {LAYERS} blocks'
    f' (Muon {model["d_model"]}x{model["d_ff"]} and'
    f' {model["d_ff"]}x{model["d_model"]}, dropout), head; seq {args.seq},'
    f' global batch {args.batch}, float32; P_M = {model["muon_bytes"] / 1e3:.1f}'
    f' kB; Z2 floor 2(N-1)/N·P_M = {floors["z2"] / 1e3:.1f} kB, Z3 floor'
    f' 3(N-1)/N·P_M = {floors["z3"] / 1e3:.1f} kB',
    '- collectives: from the compiled step, "count× kB per device"'
    ' (executions included), "AG/8" = all-gather over groups of 8 devices;'
    ' "rest" = scalars (loss, metric) and the embedding + head gradients'
    ' (told by size), "Muon" = everything else',
    '- grad rel. diff: max over leaves of max|g − g_ref| / max|g_ref|,'
    ' g_ref = single-device autodiff (float32); metric / Rngs counts after'
    f' {STEPS} steps, "(=)" where single-device nnx.jit of the same model'
    f' gives the same ({base.get("metric_count")} / {base.get("rngs_count")}'
    " for the untied, unshared model; the Rngs count is block 0's dropout"
    ' stream)',
    '',
    '| config | Muon collectives | Muon kB | × Z2 floor | rest | total kB |'
    ' grad rel. diff | metric count | Rngs count | note |',
    '|---|---|---:|---:|---|---:|---:|---:|---:|---|',
  ]
  for name, row in results.items():
    if 'collectives' not in row:
      lines.append(
        f'| `{name}` | – | – | – | – | – | – | – | – | {row.get("error", "")} |'
      )
      continue
    muon = row['collectives']['muon']
    muon_b = sum(v['bytes'] for v in muon.values())
    diff = row.get('grad_max_rel_diff')

    mark = {}
    for key in ('metric_count', 'rngs_count'):
      want = row.get(f'ref_{key}', base.get(key))
      mark[key] = f'{row[key]} {"(=)" if row[key] == want else "(≠ plain)"}'
    note = row.get('error_with_constraint', '')
    if note:
      note = f'with the activation constraint: {note}'
    note = '; '.join(filter(None, [row.get('note', ''), note]))
    if name == 'plain_jit':
      note = 'one combined all-reduce of every gradient (Muon and rest)'
    gathers = row.get('gathers')
    if gathers:
      note = '; '.join(filter(None, [f'`ded.summary()`: {gathers[-1]}', note]))
    total = muon_b + sum(
      v['bytes'] for v in row['collectives']['rest'].values()
    )
    lines.append(
      f'| `{name}` | {_fmt(muon)} | {muon_b / 1e3:.1f} |'
      f' {muon_b / floors["z2"]:.3f} | {_fmt(row["collectives"]["rest"])} |'
      f' {total / 1e3:.1f} |'
      f' {"n/a" if diff is None else f"{diff:.1e}"} | {mark["metric_count"]} |'
      f' {mark["rngs_count"]} | {note} |'
    )
  lines.append('')
  lines.append(
    'Configs: '
    + '; '.join(f'`{k}`: {v["description"]}' for k, v in results.items())
    + '.'
  )
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
