"""HLO tooling for the suite and the benchmarks: per-device matmul FLOPs,
the collectives of a StableHLO program and the control flow around each
collective.

Not part of ``dmuon_jax``: the tests and the scripts here import it (with
this folder on ``sys.path``). ``dmuon_jax.diagnostics`` keeps what a user
runs on their own step (:func:`dmuon_jax.diagnostics.analyze`: collectives
and bytes by kind, XLA's FLOPs and memory).

* :func:`dot_flops`: the matmul FLOPs of the busiest device, each loop
  times its trip count, read where XLA knows none from the constant tables
  a slot's lookup reads (``fori_loop(0, table[axis_index], ...)``), and
  each owner's own branch of a ``conditional``.
* :func:`stablehlo_collectives`: the collectives of a program lowered for a
  platform this machine cannot compile for (the CUDA program on a CPU host).
* :func:`collective_nesting`: the ``conditional`` and ``while`` around each
  collective of a compiled program (a collective only some devices run is
  an NCCL hazard).

All were in ``dmuon_jax.diagnostics`` (deprecated aliases there for one
release, :class:`NestedCollective` too).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from dmuon_jax import diagnostics

# ---------------------------------------------------------------------------
# The control flow around each collective of compiled HLO.


class NestedCollective(NamedTuple):
  """A collective and the control flow around it.

  One entry of :func:`collective_nesting`: a collective inside a
  ``conditional`` runs only on the devices that take its branch, which
  NCCL, matching collectives by their order, does not allow.

  Attributes:
    kind: one of :data:`dmuon_jax.diagnostics.KINDS`.
    context: the enclosing ``'conditional'`` and ``'while'`` instructions,
      outermost first; ``()`` at the top level.
    elements: the number of elements of its result (one execution).

  Examples:
    >>> text = '''ENTRY main () -> f32[16] {
    ...   ROOT g = f32[16] all-gather(f32[8] x), replica_groups={{0,1}}
    ... }'''
    >>> collective_nesting(text)
    (NestedCollective(kind='all-gather', context=(), elements=16),)
  """

  kind: str
  context: tuple[str, ...]
  elements: int


def collective_nesting(compiled: Any) -> tuple[NestedCollective, ...]:
  """Every collective of a compiled program with the control flow around it.

  On GPU a collective that only some devices of its replica groups execute
  (one inside a branch of a ``conditional`` that devices take differently)
  is a hazard: NCCL matches collectives by their order on each
  communicator. This lists, for each collective instruction, the
  ``conditional`` and ``while`` instructions it is nested in.

  Args:
    compiled: a ``jax.stages.Compiled`` (or ``Lowered``), or HLO text.

  Returns:
    A :class:`NestedCollective` per collective instruction (asynchronous
    pairs counted once, by their start): its kind, the enclosing
    ``'conditional'`` and ``'while'`` opcodes, outermost first (``()`` at
    the top level), and the elements of its result (one execution).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((2,), ('data',))  # of the first 2 devices
    >>> x = jnp.ones((8, 16), device=jax.NamedSharding(mesh, jax.P('data')))
    >>> @jax.jit
    ... def step(x):  # each iteration sums the sharded rows: an all-reduce
    ...   return jax.lax.fori_loop(0, 3, lambda i, y: y + y.sum(0), x)
    >>> for c in collective_nesting(step.lower(x).compile()):
    ...   print(c.kind, c.context, c.elements)
    all-reduce ('while',) 16
  """
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  computations, entry, _, _ = diagnostics.parse_module(text)
  out: list[NestedCollective] = []
  seen = set()  # A computation called twice in one context lists once.
  walk = diagnostics.walk(computations, entry) if entry else ()
  for comp, ins, _, context in walk:
    kind = ins.opcode.removesuffix('-start')
    if kind in diagnostics.KINDS and (comp, ins.name, context) not in seen:
      seen.add((comp, ins.name, context))
      result = diagnostics.elements(ins.shape)
      if ins.opcode.endswith('-start') and len(result) > 1:
        result = result[len(result) // 2 :]  # (operands, results)
      size = sum(math.prod(dims) for _, dims in result)
      out.append(NestedCollective(kind, context, int(size)))
  return tuple(out)


# ---------------------------------------------------------------------------
# StableHLO (MLIR) text.

# StableHLO op names (``stablehlo.all_gather``) to HLO kinds.
_STABLEHLO_KINDS = {k.replace('-', '_'): k for k in diagnostics.KINDS}

_MLIR_OP_RE = re.compile(
  r'(?P<result>%[\w#:]+)\s*=\s*"stablehlo\.(?P<op>all_gather|reduce_scatter|'
  r'all_reduce|all_to_all|collective_permute|collective_broadcast)"\('
)
_MLIR_FUNC_RE = re.compile(r'\bfunc\.func\s+(?:\w+\s+)*@(?P<name>[\w.$\-]+)')
_MLIR_CALL_RE = re.compile(r'\bcall\s+@(?P<name>[\w.$\-]+)')
_MLIR_TENSOR_RE = re.compile(
  r'tensor<(?P<dims>(?:(?:\d+|\?)x)*)(?P<dtype>complex<\w+>|\w+)[^<>]*>'
)
_MLIR_SIGNATURE_RE = re.compile(r':\s*\((?P<ins>[^()]*)\)\s*->\s*(?P<outs>.*)$')


def _mlir_dtype(dtype: str) -> str:
  """MLIR element type to the HLO spelling: ``i32`` -> ``s32``."""
  if dtype == 'i1':
    return 'pred'
  if m := re.fullmatch(r'(ui|si|i)(\d+)', dtype):
    return ('u' if m[1] == 'ui' else 's') + m[2]
  if m := re.fullmatch(r'complex<f(\d+)>', dtype):
    return f'c{2 * int(m[1])}'
  return dtype.lower()


def _mlir_elements(types: str) -> list[diagnostics.Element]:
  out = []
  for m in _MLIR_TENSOR_RE.finditer(types):
    dims = tuple(0 if d == '?' else int(d) for d in m['dims'].split('x') if d)
    out.append((_mlir_dtype(m['dtype']), dims))
  return out


def _mlir_matrix(attrs: str, name: str) -> list[tuple[int, ...]] | None:
  """Rows of a ``name = dense<...> : tensor<RxCxi64>`` attribute."""
  m = re.search(
    name + r'\s*=\s*dense<(?P<value>.*?)>\s*:\s*tensor<(?P<r>\d+)x(?P<c>\d+)'
    r'xi64>',
    attrs,
  )
  if not m:
    return None
  rows, cols = int(m['r']), int(m['c'])
  value = m['value'].strip()
  if value.startswith('"0x'):
    flat = np.frombuffer(bytes.fromhex(value[3:-1]), dtype='<i8')
    if flat.size == 1:
      flat = np.full(rows * cols, flat[0])
  elif '[' in value:
    flat = np.array([int(v) for v in re.findall(r'-?\d+', value)])
  else:
    flat = np.full(rows * cols, int(value) if value else 0)
  if flat.size != rows * cols:
    return [()] * rows if cols == 0 else None
  return [tuple(int(v) for v in row) for row in flat.reshape(rows, cols)]


def stablehlo_collectives(
  text: str, num_devices: int | None = None
) -> tuple[diagnostics.Collective, ...]:
  """Lists the collectives of a StableHLO (MLIR) module's text.

  Useful for a platform this machine cannot compile for, e.g. the CUDA
  program on a CPU-only host:
  ``jax.jit(f).trace(*args).lower(lowering_platforms=('cuda',)).as_text()``.
  XLA has not yet optimized this program: collectives are not yet combined,
  scheduled or made async, and loops carry no known trip count.

  Args:
    text: StableHLO text in MLIR's generic op form
      (``"stablehlo.all_gather"(%x) <{...}> : (...) -> ...``).
    num_devices: (optional, default None) the number of devices an empty
      replica group spans; if None, ``mhlo.num_partitions *
      mhlo.num_replicas`` from the module attributes.

  Returns:
    The collectives in text order, each with ``executions=1``. ``in_loop`` is
    True inside a ``stablehlo.while`` region or in a function called
    (transitively) from one.

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> devices = jax.devices()[:2]
    >>> n = len(devices)  # 2, or 1 on a single device
    >>> mesh = jax.make_mesh((n,), ('data',), devices=devices)
    >>> def body(i, y):
    ...   return y + jax.lax.psum(y, 'data')
    >>> @jax.jit
    ... @functools.partial(jax.shard_map, mesh=mesh,
    ...                    in_specs=P('data'), out_specs=P('data'))
    ... def step(x):  # x: this device's f32[8, 16] block
    ...   x = x + jax.lax.psum(x, 'data')  # one all-reduce
    ...   return jax.lax.fori_loop(0, 3, body, x)  # and one per iteration
    >>> data = NamedSharding(mesh, P('data'))
    >>> x = jax.device_put(jnp.ones((8 * n, 16)), data)
    >>> lowered = step.trace(x).lower(lowering_platforms=('cuda',))
    >>> [(c.kind, c.in_loop, c.executions, c.group_size == n)
    ...  for c in stablehlo_collectives(lowered.as_text())]
    [('all-reduce', False, 1, True), ('all-reduce', True, 1, True)]
  """
  if num_devices is None:
    partitions = re.search(r'mhlo\.num_partitions\s*=\s*(\d+)', text)
    replicas = re.search(r'mhlo\.num_replicas\s*=\s*(\d+)', text)
    num_devices = (int(partitions[1]) if partitions else 1) * (
      int(replicas[1]) if replicas else 1
    )
  # (function, in a while region, kind, result name, op text) per op.
  found: list[tuple[str | None, bool, str, str, str]] = []
  calls: list[tuple[str | None, str, bool]] = []  # (caller, callee, in while)
  function = None
  depth = 0
  loops: list[int] = []  # The brace depth of each open stablehlo.while.
  # An op with a region spans lines until the depth falls back.
  open_op: tuple[int, tuple[str | None, bool, str, str]] | None = None
  open_lines: list[str] = []
  for line in text.splitlines():
    stripped = diagnostics.STRING_RE.sub('""', line)
    before = depth
    depth += stripped.count('{') - stripped.count('}')
    if m := _MLIR_FUNC_RE.search(stripped):
      function = m['name']
    in_while = bool(loops)
    if open_op is not None:
      open_lines.append(line)
      if depth <= open_op[0]:
        found.append(open_op[1] + ('\n'.join(open_lines),))
        open_op = None
    elif m := _MLIR_OP_RE.search(line):
      op = (function, in_while, _STABLEHLO_KINDS[m['op']], m['result'])
      if depth <= before:
        found.append(op + (line,))
      else:
        open_op, open_lines = (before, op), [line]
    for m in _MLIR_CALL_RE.finditer(stripped):
      calls.append((function, m['name'], in_while))
    if 'stablehlo.while' in stripped:
      loops.append(before)
    while loops and before > loops[-1] and depth <= loops[-1]:
      loops.pop()
  looped = {callee for _, callee, in_while in calls if in_while}
  changed = True
  while changed:
    changed = False
    for caller, callee, _ in calls:
      if caller in looped and callee not in looped:
        looped.add(callee)
        changed = True
  out = []
  for fn, in_while, kind, result, op_text in found:
    last = re.sub(r'\s*loc\(.*\)\s*$', '', op_text.splitlines()[-1])
    signature = _MLIR_SIGNATURE_RE.search(last)
    ins = _mlir_elements(signature['ins']) if signature else []
    outs = _mlir_elements(signature['outs']) if signature else []
    if kind == 'collective-permute':
      pairs = _mlir_matrix(op_text, 'source_target_pairs') or []
      n = diagnostics.largest_component(p for p in pairs if len(p) == 2)
    else:
      groups = _mlir_matrix(op_text, 'replica_groups')
      n = max((len(g) for g in groups), default=0) if groups else 0
      n = n or num_devices
    elements = outs if kind == 'all-gather' else ins
    out.append(
      diagnostics.make_collective(
        kind, result, elements, n, 1, in_while or fn in looped
      )
    )
  return tuple(out)


# ---------------------------------------------------------------------------
# Matmul FLOPs per device.


def _text_with_large_constants(compiled) -> str | None:
  """The compiled HLO with every constant printed (``as_text()`` elides
  arrays of more than a few elements as ``{...}``, among them the tables
  that branch indices and loop bounds are looked up in, :class:`_Lookup`),
  or None where this jaxlib
  has no such printer (its HLO module API is not public)."""
  try:
    from jaxlib import _hlo  # pylint: disable=import-outside-toplevel

    options = _hlo.HloPrintOptions()
    options.print_large_constants = True
    modules = compiled.runtime_executable().hlo_modules()
    return '\n'.join(m.to_string(options) for m in modules)
  except Exception:  # pylint: disable=broad-except
    return None


def _state_index(byname, name) -> int | None:
  """``k`` where ``name`` is element ``k`` of the computation's parameter."""
  src = byname.get(name)
  if src is None or src.opcode != 'get-tuple-element' or not src.operands:
    return None
  param = byname.get(src.operands[0][1])
  index = re.search(r'\bindex=(\d+)', src.attrs)
  if param is None or param.opcode != 'parameter' or index is None:
    return None
  return int(index[1])


def _root(computation):
  return next((i for i in computation if i.raw.lstrip()[:5] == 'ROOT '), None)


def _passes_on(body, k) -> bool:
  """Whether a ``while`` body returns element ``k`` of its state unchanged."""
  root = _root(body)
  if root is None or root.opcode != 'tuple' or k >= len(root.operands):
    return False
  return _state_index({i.name: i for i in body}, root.operands[k][1]) == k


_INTEGERS = ('pred', 's8', 's16', 's32', 's64', 'u8', 'u16', 'u32', 'u64')
_ELEMENTWISE = {  # Index arithmetic (on indices >= 0).
  'add': np.add,
  'subtract': np.subtract,
  'multiply': np.multiply,
  'divide': np.floor_divide,
  'remainder': np.remainder,
  'and': np.bitwise_and,
  'maximum': np.maximum,
  'minimum': np.minimum,
  'shift-right-logical': np.right_shift,
  'negate': np.negative,
  'select': np.where,
  'clamp': lambda lo, x, hi: np.clip(x, lo, hi),
}
_COMPARE = {
  'EQ': np.equal,
  'NE': np.not_equal,
  'LT': np.less,
  'LE': np.less_equal,
  'GT': np.greater,
  'GE': np.greater_equal,
}
_EVALUATED = _ELEMENTWISE.keys() | {
  *('constant', 'parameter', 'get-tuple-element', 'partition-id', 'replica-id'),
  'iota',
  *('bitcast', 'reshape', 'copy', 'convert', 'slice', 'dynamic-slice'),
  *('fusion', 'compare'),
}


def _constant(ins, devices) -> np.ndarray | None:
  """An integer constant, one copy per device (None if elided)."""
  (dtype, dims), *more = diagnostics.elements(ins.shape) or [('', ())]
  text = re.search(r'constant\(([^()]*)\)', ins.raw)
  if more or dtype not in _INTEGERS or text is None:
    return None
  words = re.findall(r'true|false|-?\d+|\.\.\.', text[1])
  values = [int(w) if w[-1].isdigit() else int(w == 'true') for w in words]
  if '...' in words or len(values) != math.prod(dims):
    return None
  return np.broadcast_to(np.reshape(values, dims), (devices, *dims))


class _Lookup:
  """Values, on every device (a leading axis), of instructions that are
  functions of integer constants and the device id only, as a slot's
  lookup in a constant table is (``jnp.asarray(table)[axis_index]``),
  followed out through loops that pass them on unchanged; else None."""

  def __init__(self, comps, loops, partitions, replicas):
    self.comps, self.loops, self.partitions = comps, loops, partitions
    self.devices = partitions * replicas
    self.names = {c: {i.name: i for i in body} for c, body in comps.items()}
    self.constants = {}  # Parsed once: a table serves many loops.
    self.fixed = {}  # (body, k) -> an enclosing loop's counter, held fixed

  def state(self, caller, loop, k):
    """Element ``k`` of the state ``loop`` (in ``caller``) starts from."""
    state = self.names[caller].get(loop.operands[0][1])
    if state is None or state.opcode != 'tuple' or k >= len(state.operands):
      return None
    return self.value(caller, state.operands[k][1], (), {})

  def value(self, comp, name, params, memo):
    if name not in memo:
      memo[name] = None  # Guards against cycles.
      ins = self.names.get(comp, {}).get(name)
      if ins is not None and ins.opcode in _EVALUATED:
        memo[name] = self._value(comp, ins, params, memo)
    return memo[name]

  def _value(self, comp, ins, params, memo):
    d, op = self.devices, ins.opcode
    if op == 'constant':
      if (comp, ins.name) not in self.constants:
        self.constants[comp, ins.name] = _constant(ins, d)
      return self.constants[comp, ins.name]
    if op == 'iota':
      return _iota(ins, d)
    if op in ('partition-id', 'replica-id'):
      ids = np.arange(d)
      return ids % self.partitions if op[0] == 'p' else ids // self.partitions
    if op == 'parameter':
      index = int(re.search(r'parameter\((\d+)\)', ins.raw)[1])
      return params[index] if index < len(params) else None
    if op == 'get-tuple-element':  # A loop's state, passed on unchanged?
      k = _state_index(self.names[comp], ins.name)
      if (comp, k) in self.fixed:
        return self.fixed[comp, k]
      if k is None or comp not in self.loops:
        return None
      if not _passes_on(self.comps[comp], k):
        return None
      return self.state(*self.loops[comp], k)
    args = []
    for _, o in ins.operands:
      args.append(self.value(comp, o, params, memo))
      if args[-1] is None:
        return None
    if op == 'fusion':
      callee = next(iter(diagnostics.callees(ins)), None)
      root = _root(self.comps.get(callee, ()))
      return self.value(callee, root.name, args, {}) if root else None
    return _apply(ins, args, d)


def _iota(ins, devices) -> np.ndarray | None:
  """An integer ``iota``, one copy per device."""
  (dtype, dims), *more = diagnostics.elements(ins.shape) or [('', ())]
  axis = re.search(r'iota_dimension=(\d+)', ins.attrs)
  if more or dtype not in _INTEGERS or axis is None or not dims:
    return None
  shape = [1] * len(dims)
  shape[int(axis[1])] = dims[int(axis[1])]
  values = np.arange(dims[int(axis[1])]).reshape(shape)
  return np.broadcast_to(values, (devices, *dims))


def _apply(ins, args, devices) -> np.ndarray | None:
  """An index computation's instruction on every device's ``args``."""
  op, (x, *rest) = ins.opcode, args
  if op in _ELEMENTWISE:
    return _ELEMENTWISE[op](*args)
  if op == 'compare':
    direction = re.search(r'direction=(\w+)', ins.attrs)
    compare = _COMPARE.get(direction[1] if direction else '')
    return compare(*args) if compare else None
  (dtype, dims), *more = diagnostics.elements(ins.shape) or [('', ())]
  if more or dtype not in _INTEGERS:
    return None
  if op == 'slice':
    ranges = re.findall(r'\[(\d+):(\d+)(?::(\d+))?\]', ins.attrs)
    cut = [slice(int(a), int(b), int(c or 1)) for a, b, c in ranges]
    return x[(slice(None), *cut)]
  if op == 'dynamic-slice':  # Starts clamped into range, as XLA does.
    if any(r.shape != (devices,) for r in rest):
      return None
    out = []
    for i, row in enumerate(x):
      starts = [
        min(max(int(r[i]), 0), n - z) for r, n, z in zip(rest, row.shape, dims)
      ]
      out.append(row[tuple(slice(a, a + z) for a, z in zip(starts, dims))])
    return np.stack(out)
  x = x.reshape((devices, *dims))  # bitcast, reshape, copy, convert
  return x != 0 if dtype == 'pred' else x.astype(np.int64, copy=False)


def _loop_state(comps, loop):
  """``(bounds, counters)``: the state elements a ``while``'s condition
  compares that its body passes on unchanged, and the others."""
  names = {
    m['key']: m['name'] for m in diagnostics.LOOP_RE.finditer(loop.attrs)
  }
  cond = comps.get(names.get('condition'), ())
  body = comps.get(names.get('body'), ())
  root, byname = _root(cond), {i.name: i for i in cond}
  compared = [_state_index(byname, o) for _, o in root.operands] if root else []
  compared = [k for k in compared if k is not None]
  bounds = [k for k in compared if _passes_on(body, k)]
  return bounds, [k for k in compared if k not in bounds]


# The most iterations of an enclosing loop a bound is evaluated for.
_MAX_OUTER = 4096


def _table_trips(comps, lookup, caller, loop) -> np.ndarray | None:
  """Each device's trip count of a ``while`` whose bound is data, or None.

  ``fori_loop(0, table[slot], ...)`` compiles to a condition comparing the
  counter with a state element the body passes on unchanged (the bound),
  here a function of constant tables and the device id (:class:`_Lookup`);
  the counter starts from such a value too (else it is taken as 0). A
  bound that also reads the counter of the loop around it (of known trip
  count: ``lax.map`` over a table's rows) is the mean over that loop's
  iterations, so that the two loops' product is each device's total.
  """
  bounds, counters = _loop_state(comps, loop)
  if len(bounds) != 1 or len(counters) > 1:
    return None

  def trips():
    bound = lookup.state(caller, loop, bounds[0])
    if bound is None or bound.shape != (lookup.devices,):
      return None
    start = lookup.state(caller, loop, counters[0]) if counters else None
    if start is None or start.shape != bound.shape:
      start = 0
    return np.maximum(bound - start, 0)

  found = trips()
  if found is not None or caller not in lookup.loops:
    return found
  outer_caller, outer = lookup.loops[caller]
  known = diagnostics.TRIP_COUNT_RE.search(outer.raw)
  _, outer_counters = _loop_state(comps, outer)
  if not known or len(outer_counters) != 1 or int(known[1]) > _MAX_OUTER:
    return None
  k = outer_counters[0]
  start = lookup.state(outer_caller, outer, k)
  start = 0 if start is None or start.shape != (lookup.devices,) else start
  per = []
  try:
    for t in range(int(known[1])):
      lookup.fixed = {(caller, k): start + t + np.zeros(lookup.devices, int)}
      per.append(trips())
      if per[-1] is None:
        return None
  finally:
    lookup.fixed = {}
  return np.mean(per, axis=0)


def _dot(ins, shapes) -> float:
  """``2 * out * contracted`` FLOPs of a ``dot`` instruction."""
  inline, lhs_name = ins.operands[0]
  lhs = diagnostics.elements(inline) if inline else shapes.get(lhs_name)
  out = diagnostics.elements(ins.shape)
  dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins.attrs)
  if not lhs or not out or dims is None:
    return 0.0
  contracted = math.prod(lhs[0][1][int(d)] for d in dims[1].split(',') if d)
  return 2.0 * math.prod(out[0][1]) * contracted


def _module(compiled, n, loop_trip_counts):
  """The parsed HLO (:func:`diagnostics.parse_module`), with every constant
  printed where slot tables (of branches, of trip counts) are read."""
  if isinstance(compiled, str):
    return diagnostics.parse_module(compiled)
  text = compiled.as_text()
  dynamic = text.count(' while(') > text.count('"known_trip_count"')
  if n or (loop_trip_counts and dynamic):
    text = _text_with_large_constants(compiled) or text
  return diagnostics.parse_module(text)


class _Costs:
  """Matmul FLOPs of a computation: a float, or with ``n`` slots an array
  (per slot). Warnings, one per kind, collect in ``warnings``."""

  def __init__(self, module, n, loop_trip_counts):
    self.comps, self.entry, partitions, replicas = module
    self.n, self.loop_trip_counts = n, loop_trip_counts
    loops = {  # while body -> (calling computation, while)
      m['name']: (caller, ins)
      for caller, instructions in self.comps.items()
      for ins in instructions
      if ins.opcode == 'while'
      for m in diagnostics.LOOP_RE.finditer(ins.attrs)
      if m['key'] == 'body'
    }
    self.lookup = _Lookup(self.comps, loops, partitions, replicas)
    # Costs are per device (per slot with n): a loop's trip count may be.
    devices = self.lookup.devices
    self.width = n or (devices if devices > 1 else 0)
    self.memo: dict[str, Any] = {}
    self.warnings: dict[str, str] = {}

  def __call__(self, name):
    if name in self.memo:
      return self.memo[name]
    total = np.zeros(self.width) if self.width else 0.0
    self.memo[name] = total  # Guards against cycles.
    computation = self.comps.get(name, ())
    shapes = {i.name: diagnostics.elements(i.shape) for i in computation}
    for ins in computation:
      if ins.opcode == 'dot':
        total = total + _dot(ins, shapes)
      elif ins.opcode == 'conditional':
        total = total + self._conditional(ins, name)
      elif ins.opcode == 'while':
        total = total + self._while(ins, name)
      else:
        total = total + sum(self(c) for c in diagnostics.callees(ins))
    self.memo[name] = total
    return total

  def _conditional(self, ins, caller):
    n, callees = self.n, diagnostics.callees(ins)
    per = [np.max(self(c)) for c in callees]
    if not n or len(callees) < 2:
      return max(per, default=0.0)
    index = self._branch_index(ins, caller, len(callees))
    if index is not None:  # each device's own branch, from the program
      return np.array([per[b] for b in index])
    if len(callees) == n:  # one branch per owner slot
      return np.array(per)
    self.warnings.setdefault(
      'conditional',
      f'dot_flops: conditional {ins.name} has {len(callees)} branches for '
      f'{n} devices and no branch index computed from constant tables and '
      'the device id alone; it counts its busiest branch (an upper bound). '
      'Pass the Compiled object rather than its text.',
    )
    return max(per, default=0.0)

  def _branch_index(self, ins, caller, k) -> np.ndarray | None:
    """Per device, the branch a ``conditional`` of ``k`` branches runs
    where its index is a function of constant tables and the device id (an
    owner's lookup in a slot -> branch table), else None. An index out of range runs the last
    branch, as in XLA; a predicate's true branch is the first."""
    if not ins.operands or self.lookup.devices != self.n:
      return None
    try:
      index = self.lookup.value(caller, ins.operands[0][1], (), {})
    except (ArithmeticError, IndexError, TypeError, ValueError):
      return None
    if index is None or np.shape(index) != (self.n,):
      return None
    if index.dtype == bool:
      return np.where(index, 0, 1)
    index = index.astype(np.int64)
    return np.where((index < 0) | (index >= k), k - 1, index)

  def _while(self, ins, caller):
    body = re.search(r'\bbody=%?([\w.\-]+)', ins.attrs)
    once = self(body[1]) if body else 0.0
    if not self.loop_trip_counts:
      return once
    if trip := diagnostics.TRIP_COUNT_RE.search(ins.raw):
      return once * int(trip[1])
    try:
      trips = _table_trips(self.comps, self.lookup, caller, ins)
    except (ArithmeticError, IndexError, TypeError, ValueError):
      trips = None  # An index computation this reading gets wrong.
    if trips is None:
      self.warnings.setdefault(
        'while',
        f'dot_flops: while {ins.name} has no known trip count, and its bound '
        'is not computed from constant tables and the device id alone; it '
        'counts its body once (a lower bound). Pass the Compiled object '
        'rather than its text (which elides large constants).',
      )
      return once
    if self.width and trips.shape == (self.width,):
      return once * trips  # Device i runs trips[i] iterations.
    return once * float(trips.max())


def dot_flops(
  compiled: Any,
  *,
  loop_trip_counts: bool = True,
  branches_per_device: int | None = None,
) -> float:
  """Matmul FLOPs of one device's program: ``2 * out * contracted`` per dot.

  Counts only ``dot`` instructions, so it compares with a Newton–Schulz cost
  model exactly (XLA's ``cost_analysis`` also counts elementwise work). A
  ``conditional`` counts its most expensive branch (on an owner-per-branch
  program: the busiest owner).

  Args:
    compiled: a ``jax.stages.Compiled`` (or ``Lowered``), or HLO text.
    loop_trip_counts: (default True) multiply the body of each ``while``
      loop by its trip count: dmuon's Newton–Schulz iterations and scanned
      layers are loops of a trip count XLA knows. Where XLA knows none, a
      bound computed from constant integer tables and the device's id
      alone (``fori_loop(0, table[axis_index], ...)`` in ``shard_map``) is
      evaluated for every device, and the body counts each device's own
      value times (the largest where ``branches_per_device`` differs from
      the device count: an upper bound). Any other bound counts the body
      once (a lower bound) and warns.
      False counts each body once, as XLA's ``cost_analysis`` (and so
      :attr:`HloReport.flops`) does.
    branches_per_device: (optional) the number of owner slots: every
      ``conditional`` with that many branches is taken to branch on the
      owner slot (as dmuon's updates do, stage after stage), so branch ``i``
      of each is device ``i``'s work: the result is the busiest device's
      total rather than the sum of each conditional's busiest branch.
      Conditionals with fewer branches (owners whose work is alike share
      one branch body) count their busiest branch: an upper bound.

  Returns:
    The FLOP count.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def three_matmuls(a, b):
    ...   return jax.lax.fori_loop(0, 3, lambda i, a: jnp.tanh(a @ b), a)
    >>> a, b = jnp.ones((8, 16)), jnp.ones((16, 16))
    >>> compiled = jax.jit(three_matmuls).lower(a, b).compile()
    >>> dot_flops(compiled)  # 3 iterations of 2 * 8 * 16 * 16
    12288.0
    >>> dot_flops(compiled, loop_trip_counts=False)  # body once
    4096.0
  """
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  n = branches_per_device or 0
  costs = _Costs(_module(compiled, n, loop_trip_counts), n, loop_trip_counts)
  total = float(np.max(costs(costs.entry))) if costs.entry else 0.0
  for message in costs.warnings.values():
    warnings.warn(message, stacklevel=2)
  return total
