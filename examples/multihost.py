"""Multi-process DMuon on one machine: P processes x D simulated CPU devices.

The parent starts ``--processes`` children (this same script, ``--child i``),
each with ``--local-devices`` CPU devices; they join one global mesh via
``jax.distributed.initialize`` (gloo collectives) and train a small model
with ``dmuon`` (``--mode dropin``, under ``jax.jit``) or with
``dedicated_muon`` (``--mode dedicated``, Z3, the ``shard_map`` recipe).
Process 0 writes the per-step losses and final params to
``OUT_DIR/<mode>_p<P>xd<D>.npz``; with ``--checkpoint-dir`` all processes
then save a mesh-independent checkpoint (``dmuon_jax.checkpoint.save``)
that restores on any mesh, e.g. in one process, restore it again in every
process and check that it is bitwise identical to the trained state.
``--mode both`` trains drop-in, then dedicated, in the same processes (one
launch, one ``.npz`` per mode, checkpoints in ``CHECKPOINT_DIR/<mode>``).

    python examples/multihost.py --processes 1 --local-devices 8 \\
        --mode dedicated --out-dir /tmp/mh      # single-process reference
    python examples/multihost.py --processes 2 --local-devices 4 \\
        --mode dedicated --out-dir /tmp/mh \\
        --compare-to /tmp/mh/dedicated_p1xd8.npz

When the children are done the parent checks the run (``check_run``): the
loss falls and, with ``--compare-to``, the losses and params are within
``--compare-rtol`` (relative) of the other run's. Across process counts
they need not be bitwise equal (the cross-process reductions may add in
another order): the parent prints the measured max relative difference
(``bitwise equal`` when it is 0). A failed check prints a ``FAILED
checks:`` line (stderr), exit status 1.

The parent prints ``child <i> pid <pid>`` per child (and writes
``OUT_DIR/pids.json``). If a child fails (``--fail-at-start i`` makes child
``i`` raise before ``jax.distributed.initialize``), or the run exceeds
``--timeout``, the parent kills the remaining children (who would otherwise
wait for the missing peer), prints the failed child's stderr tail and exits
nonzero.
"""

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

AXES = ('replicate', 'shard')
BLOCKS, WIDTH, MATS, OUT = 4, 16, 8, 8
BATCH = 512
LR = 0.002
COMPARE_RTOL = 1e-6  # --compare-to's default tolerance (see check_run)

# ---------------------------------------------------------------- the model
# (the synthetic model of tests/dedicated_test.py: ``layers_i`` blocks of
# ``MATS`` Muon matrices each, AdamW for the scales and the head).


def init_params(blocks=BLOCKS):
  import jax
  import jax.numpy as jnp

  k = iter(jax.random.split(jax.random.key(0), 64))
  n = lambda *shape: 0.3 * jax.random.normal(next(k), shape, jnp.float32)
  params = {
    f'layers_{i}': {f'w{j}': n(WIDTH, WIDTH) for j in range(MATS)}
    | {'scale': 1 + n(WIDTH)}
    for i in range(blocks)
  }
  params['head'] = n(WIDTH, OUT)
  return params


def block_fn(layer, x):
  import jax.numpy as jnp

  for j in range(MATS):
    x = x + jnp.tanh(x @ layer[f'w{j}']) * layer['scale']
  return x


def block_names(params):
  """``layers_0``, ``layers_1``, ... of ``params`` (``init_params``), in order."""
  return [
    f'layers_{i}' for i in range(sum(k.startswith('layers_') for k in params))
  ]


def loss_fn(params, x):
  import jax.numpy as jnp

  for name in block_names(params):
    x = block_fn(params[name], x)
  return jnp.mean((x @ params['head']) ** 2)


def make_batch():
  import jax

  return jax.random.normal(jax.random.key(1), (BATCH, WIDTH))


# ---------------------------------------------------------------- the child


def _global(host, sharding):
  """A global array from host data every process holds in full."""
  import jax

  return jax.make_array_from_callback(
    host.shape, sharding, lambda idx: host[idx]
  )


def _fsdp_sharding(x, mesh):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  size = mesh.shape['shard']
  for dim in range(x.ndim - 1, -1, -1):
    if size > 1 and x.shape[dim] % size == 0:
      spec = [None] * x.ndim
      spec[dim] = 'shard'
      return NamedSharding(mesh, P(*spec))
  return NamedSharding(mesh, P())


def _place(host_params, mesh, layout):
  """Host params -> global arrays (replicated, or FSDP over 'shard')."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def one(x):
    sharding = (
      NamedSharding(mesh, P())
      if layout == 'replicated'
      else _fsdp_sharding(x, mesh)
    )
    return _global(x, sharding)

  return jax.tree.map(one, host_params)


def _to_host(tree, mesh):
  """Global arrays -> host numpy on every process (replicated, then local)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  full = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), full)


def save_and_check(
  checkpoint_dir, steps, mesh, like, trained, opt, dedication=None
):
  """Saves ``trained = (params, state)`` from every process, restores it
  (every process again, onto the same mesh) and checks it is identical."""
  import jax
  import numpy as np

  import dmuon_jax

  params, state = trained
  dmuon_jax.checkpoint.save(checkpoint_dir, steps, params, state)
  step, params2, state2 = dmuon_jax.checkpoint.restore(
    checkpoint_dir, like, opt, dedication=dedication
  )

  def portable(p, s):
    out = dmuon_jax.checkpoint.state_to_portable(s)
    return (p if dedication is None else dedication.to_params(p)), out

  before = _to_host(portable(params, state), mesh)
  after = _to_host(portable(params2, state2), mesh)
  same = step == steps and all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  )
  print(
    f'process {jax.process_index()}: checkpoint of step {step} restored '
    f'{"identical (bitwise)" if same else "DIFFERENT"}',
    flush=True,
  )
  if not same:
    raise SystemExit('restored checkpoint differs from the saved state')


def _like(params):
  import jax

  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    params,
  )


def train_dropin(mesh, host_params, x, steps, layout, checkpoint_dir=None):
  import jax
  import optax

  import dmuon_jax

  params = _place(host_params, mesh, layout)
  opt = dmuon_jax.dmuon(LR, mesh=mesh)
  state = jax.block_until_ready(opt.init(params))  # eagerly, placed arrays

  @jax.jit
  def step(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, x)
    losses.append(jax.block_until_ready(loss))
  if checkpoint_dir:  # every process takes part
    save_and_check(
      checkpoint_dir, steps, mesh, _like(params), (params, state), opt
    )
  return losses, params


def train_dedicated(
  mesh, host_params, x, steps, layout, checkpoint_dir=None, z3=True
):
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import PartitionSpec as P

  import dmuon_jax

  params = _place(host_params, mesh, layout)
  ded = dmuon_jax.dedicate(params, mesh, reshard_after_forward=z3)
  # Every set-up program finishes before the next starts: all processes
  # then run their collectives in one order.
  dp = jax.block_until_ready(ded.to_dedicated(params))
  opt = dmuon_jax.dedicated_muon(ded, learning_rate=LR)
  state = jax.block_until_ready(opt.init(dp))

  def dedicated_loss(dp, x):
    rest = ded.gather_rest(dp)
    x = ded.sequential(block_fn, block_names(host_params))(dp, x)
    return jnp.mean((x @ rest['head']) ** 2)

  specs, state_specs = ded.specs(), ded.specs_of(state)

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(specs, state_specs, P(AXES)),
    out_specs=(specs, state_specs, P()),
  )
  def step(dp, state, x):
    loss, grads = dmuon_jax.local_value_and_grad(dedicated_loss)(dp, x)
    updates, state = opt.update(grads, state, dp)
    return (optax.apply_updates(dp, updates), state, jax.lax.pmean(loss, AXES))

  losses = []
  for _ in range(steps):
    dp, state, loss = step(dp, state, x)
    losses.append(jax.block_until_ready(loss))
  if checkpoint_dir:
    save_and_check(
      checkpoint_dir,
      steps,
      mesh,
      _like(params),
      (dp, state),
      opt,
      dedication=ded,
    )
  return losses, ded.to_params(dp)


def child_main(args):
  """One process of the run: joins the global mesh, trains, writes .npz."""
  if args.dump_after:  # debugging hangs: stacks to stderr
    import faulthandler

    faulthandler.dump_traceback_later(args.dump_after, exit=True)
  import jax

  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', args.local_devices)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if args.fail_at_start == args.child:  # after the slow import: the peers
    raise RuntimeError(  # are waiting in initialize by now
      f'child {args.child}: failing at start on request (--fail-at-start)'
    )
  print(
    f'child {args.child}: jax.distributed.initialize',
    file=sys.stderr,
    flush=True,
  )
  jax.distributed.initialize(
    coordinator_address=f'127.0.0.1:{args.port}',
    num_processes=args.processes,
    process_id=args.child,
  )
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  start = time.time()
  n = args.processes * args.local_devices
  assert jax.device_count() == n, (jax.device_count(), n)
  assert jax.local_device_count() == args.local_devices
  shape = mesh_shape(args.mesh, n)
  # Global devices in id order: the same mesh as the 1-process reference.
  devices = sorted(jax.devices(), key=lambda d: d.id)
  mesh = Mesh(
    np.array(devices).reshape(shape),
    AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  host_params = jax.tree.map(np.asarray, init_params(args.blocks))
  x = _global(np.asarray(make_batch()), NamedSharding(mesh, P(AXES)))
  for mode in modes(args):
    train = train_dropin if mode == 'dropin' else train_dedicated
    checkpoint_dir = args.checkpoint_dir
    if checkpoint_dir and args.mode == 'both':
      checkpoint_dir = os.path.join(checkpoint_dir, mode)
    losses, params = train(
      mesh, host_params, x, args.steps, args.layout, checkpoint_dir
    )
    losses, params = _to_host((losses, params), mesh)
    seconds = time.time() - start
    if jax.process_index() == 0:
      flat = {
        'params' + jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
      }
      os.makedirs(args.out_dir, exist_ok=True)
      path = os.path.join(args.out_dir, out_name(args, mode))
      np.savez(path, losses=np.stack(losses), seconds=seconds, **flat)
      for i, loss in enumerate(losses):
        print(f'{mode} step {i:3d}  loss {float(loss):.6f}')
      print(f'wrote {path} ({seconds:.1f} s in process 0 after init)')
  jax.distributed.shutdown()
  return 0


# --------------------------------------------------------------- the parent


def mesh_shape(spec, n):
  if not spec:
    return (1, n)
  shape = tuple(int(v) for v in spec.split(','))
  if len(shape) != 2 or shape[0] * shape[1] != n:
    raise ValueError(f'--mesh {spec}: needs R,S with R*S = {n}')
  return shape


def modes(args):
  """The modes a run trains, in order."""
  return ('dropin', 'dedicated') if args.mode == 'both' else (args.mode,)


def out_name(args, mode=None):
  mode = mode or args.mode
  return f'{mode}_p{args.processes}xd{args.local_devices}.npz'


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _tail(path, lines=20):
  try:
    with open(path, errors='replace') as f:
      return ''.join(f.readlines()[-lines:])
  except OSError:
    return ''


def _kill(procs, grace=3.0):
  """Terminates the still-running children (their process groups), then
  kills whatever survived ``grace`` seconds. Returns their indices.

  (After ``jax.distributed.initialize`` a child may ignore SIGTERM: JAX's
  preemption notifier catches it. Hence the SIGKILL.)
  """
  killed = [i for i, p in enumerate(procs) if p.poll() is None]
  alive = [procs[i] for i in killed]
  for p in alive:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.time() + grace
  for p in alive:
    try:
      p.wait(max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()
  return killed


def _child_env():
  env = dict(os.environ)
  # A forced host device count would clash with jax_num_cpu_devices.
  flags = [
    f
    for f in env.pop('XLA_FLAGS', '').split()
    if not f.startswith('--xla_force_host_platform_device_count')
  ]
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = os.pathsep.join(
    [root] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
  )
  return env


def launch(args, argv):
  """Starts the children, waits, cleans up; returns the exit status."""
  os.makedirs(args.out_dir, exist_ok=True)
  port = args.port or _free_port()
  env = _child_env()
  procs, logs = [], []
  start = time.time()

  def on_sigterm(signum, frame):
    del frame
    raise SystemExit(128 + signum)  # runs the ``finally`` below

  previous = signal.signal(signal.SIGTERM, on_sigterm)
  try:
    for i in range(args.processes):
      log = os.path.join(args.out_dir, f'child{i}.stderr')
      logs.append(log)
      with open(log, 'w') as err:
        procs.append(
          subprocess.Popen(
            [
              sys.executable,
              os.path.abspath(__file__),
              *argv,
              '--child',
              str(i),
              '--port',
              str(port),
            ],
            env=env,
            stderr=err,
            start_new_session=True,
          )
        )
      print(f'child {i} pid {procs[-1].pid}', flush=True)
    with open(os.path.join(args.out_dir, 'pids.json'), 'w') as f:
      json.dump([p.pid for p in procs], f)

    failed = None
    while time.time() - start < args.timeout:
      codes = [p.poll() for p in procs]
      failed = next(
        (i for i, c in enumerate(codes) if c not in (None, 0)), None
      )
      if failed is not None or all(c == 0 for c in codes):
        break
      time.sleep(0.1)
    else:
      _kill(procs)
      print(
        f'timeout after {args.timeout:.0f} s: killed all children',
        file=sys.stderr,
      )
      for i, log in enumerate(logs):
        print(f'--- child {i} stderr tail ---\n{_tail(log)}', file=sys.stderr)
      return 3
    if failed is not None:
      killed = _kill(procs)
      print(
        f'child {failed} failed with exit code {procs[failed].returncode}'
        f'; killed children {killed}\n--- child {failed} stderr tail ---'
        f'\n{_tail(logs[failed])}',
        file=sys.stderr,
      )
      return 2
    print(
      f'all {args.processes} children done in {time.time() - start:.1f} s',
      flush=True,
    )
    return 0
  finally:
    _kill(procs)  # SIGTERM, KeyboardInterrupt, errors
    signal.signal(signal.SIGTERM, previous)


class _Formatter(
  argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
  """Defaults in ``--help``; the description keeps its line breaks."""


def max_rel_diff(a, b):
  """max |a - b| / max |b| over one array (max |a| if b is all zeros)."""
  import numpy as np

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    return float('inf')
  scale = np.max(np.abs(b))
  diff = np.max(np.abs(a - b))
  return float(diff / scale if scale else np.max(np.abs(a)))


def check_run(args):
  """The parent's checks of process 0's results; 0 if all hold, else 1.

  * the run trains: every loss is finite and the last is below the first.
    Measured (the defaults: 10 steps; both modes, 2 processes x 4 devices
    and 1 x 8, replicated or FSDP): the loss falls from 35.42 to 20.10.
  * with ``--compare-to``: every array of this run (the losses, each
    param) is within ``--compare-rtol`` of the other run's, relative to
    the other's largest magnitude. Runs on different process counts need
    not be bitwise equal: the cross-process gradient reductions (gloo) may
    add in another order than one process's, depending on the machine.
    Measured, 2 processes x 4 devices against 1 x 8 on the same mesh (1,8
    or 2,4), both modes, replicated or FSDP, 10 steps: 0 (bitwise equal)
    on a 2-core AMD EPYC VM with jax 0.10.2; 2.1e-7 in an independent
    measurement elsewhere (where plain ``optax.sgd`` differs by 1.8e-8
    too). For scale: ``--mode dedicated`` against ``--mode dropin`` (the
    same math, other programs) differs by 2e-7 here. COMPARE_RTOL, 1e-6,
    is 5x the largest.
  """
  import numpy as np

  results = []
  for mode in modes(args):
    path = os.path.join(args.out_dir, out_name(args, mode))
    with np.load(path) as f:
      run = {k: f[k] for k in f.files if k != 'seconds'}
    losses = run['losses']
    trains = bool(np.all(np.isfinite(losses)) and losses[-1] < losses[0])
    results.append(
      (
        f'{mode} loss falls ({losses[0]:.6f} -> {losses[-1]:.6f}), all '
        f'finite: {"yes" if trains else "no"}',
        trains,
      )
    )
  if args.compare_to:  # one mode (see main)
    with np.load(args.compare_to) as f:
      other = {k: f[k] for k in f.files if k != 'seconds'}
    same_keys = sorted(run) == sorted(other)
    diffs = {k: max_rel_diff(run[k], other[k]) for k in run if k in other}
    worst = max(diffs, key=diffs.get) if diffs else None
    diff = diffs[worst] if diffs else float('inf')
    ok = same_keys and diff <= args.compare_rtol
    where = (
      'bitwise equal'
      if diff == 0
      else f'shapes differ in {worst}'
      if diff == float('inf')
      else f'largest in {worst}'
    )
    results.append(
      (
        f'vs {args.compare_to}: max relative difference {diff:.2g} over '
        f'{len(diffs)} arrays ({where}) <= tolerance {args.compare_rtol:g}'
        + ('' if same_keys else ', but the arrays differ in name')
        + f': {"yes" if ok else "no"}',
        ok,
      )
    )
  print('checks: ' + '; '.join(t for t, _ in results), flush=True)
  failed = [t for t, ok in results if not ok]
  if failed:
    print('FAILED checks: ' + '; '.join(failed), file=sys.stderr, flush=True)
    return 1
  return 0


def parse_args(argv):
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=_Formatter
  )
  parser.add_argument(
    '--processes', type=int, default=2, help='processes (P) to start'
  )
  parser.add_argument(
    '--local-devices',
    type=int,
    default=4,
    help='simulated CPU devices (D) per process',
  )
  parser.add_argument(
    '--mode',
    choices=('dropin', 'dedicated', 'both'),
    default='dedicated',
    help='dmuon under jax.jit, or dedicated_muon (Z3) under shard_map, or '
    'both (drop-in, then dedicated, in the same processes)',
  )
  parser.add_argument(
    '--mesh', default=None, help='R,S over all P*D devices (unset: 1,P*D)'
  )
  parser.add_argument(
    '--layout',
    choices=('replicated', 'fsdp'),
    default='replicated',
    help='placement of the params before training',
  )
  parser.add_argument('--steps', type=int, default=10, help='training steps')
  parser.add_argument(
    '--blocks',
    type=int,
    default=BLOCKS,
    help=f'blocks of the model ({MATS} {WIDTH}x{WIDTH} Muon matrices each)',
  )
  parser.add_argument(
    '--out-dir',
    default='/tmp/dmuon_multihost',
    help='where process 0 writes <mode>_p<P>xd<D>.npz (and the logs)',
  )
  parser.add_argument(
    '--checkpoint-dir',
    default=None,
    help='after training, all processes save the params '
    'and optimizer state here (dmuon_jax.checkpoint, '
    'mesh-independent: restore on any mesh), restore it '
    'and check it equals the trained state (bitwise)',
  )
  parser.add_argument(
    '--compare-to',
    default=None,
    help="another run's .npz (e.g. the 1-process run on the same global "
    "mesh): check that this run's losses and params are within "
    '--compare-rtol of it',
  )
  parser.add_argument(
    '--compare-rtol',
    type=float,
    default=COMPARE_RTOL,
    help='tolerance of --compare-to: max |this - other| / max |other|, '
    'per array',
  )
  parser.add_argument(
    '--timeout',
    type=float,
    default=600,
    help='seconds before the parent kills all children',
  )
  parser.add_argument(
    '--fail-at-start',
    type=int,
    default=-1,
    help='child that raises before initialize (testing)',
  )
  parser.add_argument(
    '--dump-after',
    type=float,
    default=0,
    help='children dump their stacks and exit after this '
    'many seconds (debugging hangs)',
  )
  parser.add_argument('--child', type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument('--port', type=int, default=0, help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  mesh_shape(args.mesh, args.processes * args.local_devices)  # validate
  if args.compare_to and args.mode == 'both':
    raise SystemExit(
      '--compare-to compares one mode: --mode dropin or dedicated'
    )
  if args.child is not None:
    return child_main(args)
  code = launch(args, argv)
  return code or check_run(args)


if __name__ == '__main__':
  sys.exit(main())
