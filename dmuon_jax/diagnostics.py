r"""Collective bytes and per-device FLOPs read from a compiled program's HLO.

:func:`analyze` (or :func:`analyze_compiled`) reads the text of a compiled
XLA program and lists every collective it runs, with the bytes each device
sends per call, plus XLA's per-device FLOP count and memory statistics. Tests
and benchmarks use it to check that a train step moves what the performance
model in ``DESIGN.md`` says it should.

Bytes per device (ring / bus-bandwidth model). ``N`` is the number of devices
in one replica group (``group_size``) and ``B`` the size in bytes
(elements times itemsize) of the *full* array named below:

========================  ==================  ================================
kind                      bytes per device    ``B`` is
========================  ==================  ================================
``all-gather``            (N-1)/N * B         the result (the gathered array)
``reduce-scatter``        (N-1)/N * B         the operand (N times the result)
``all-reduce``            2 (N-1)/N * B       the operand (= the result)
``all-to-all``            (N-1)/N * B         the operand on one device
``collective-permute``    B                   the operand (bytes received)
``collective-broadcast``  B                   the operand (bytes a non-source
                                              device receives)
========================  ==================  ================================

A group of one device (``N = 1``) moves 0 bytes. Ops with several operands
(a combined, tuple-shaped all-reduce; XLA:CPU's all-to-all, which it splits
into one operand per peer) add up the sizes of all their operands; their
``shape`` is then ``(total elements,)``, and their ``dtype`` joins distinct
dtypes with ``+``.

How collectives are counted in compiled HLO:

* Each collective instruction is counted once; of an async pair
  (``all-gather-start`` / ``all-gather-done`` and the like) the ``-start``
  is counted and the ``-done`` skipped. Collectives wrapped in an
  ``async-start`` computation are found inside it. A reduce-scatter that XLA
  rewrote as an all-reduce plus a dynamic-slice is reported as the
  all-reduce it runs. ``send``/``recv`` and ``ragged-all-to-all`` (whose
  sizes are only known at run time) are not reported.
* ``executions`` is the product of the trip counts of the enclosing
  ``while`` loops (from ``backend_config={"known_trip_count":{"n":"5"}}``);
  a collective in a loop's condition computation runs ``n + 1`` times per
  loop. A loop whose trip count XLA does not know counts once, with
  ``in_loop=True``: its bytes are then a lower bound.
* Collectives in the branches of a ``conditional`` (``lax.switch``,
  ``lax.cond``) are each counted once, as if every branch ran: an upper bound
  when the branches differ.
* ``group_size`` is the size of the largest replica group as printed
  (explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` or transposed iota
  ``[4,2]<=[2,4]T(1,0)``). Empty groups ``{}`` mean every device:
  ``num_partitions * replica_count`` from the module header (only
  ``replica_count`` for an op without ``channel_id``). For a
  collective-permute it is the size of the largest connected set of devices
  in ``source_target_pairs`` (the ring size of a ``ppermute``).

XLA:CPU (jax 0.10.2) converts bf16 collectives to f32 (a ``convert`` on each
side of an f32 all-gather or all-reduce), so a CPU program reports twice the
bytes a GPU program moves for bf16 data; :func:`stablehlo_collectives` on the
program lowered for CUDA shows the bf16 ops.

FLOPs come from ``compiled.cost_analysis()['flops']`` and are per device.
XLA:CPU (jax 0.10.2) counts a ``while`` body **once**, not once per
iteration (a ``lax.scan`` of 5 matmuls reports the FLOPs of one), and counts
the most expensive branch of a ``conditional``. Multiply by hand where a loop
matters.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np

KINDS = (
  'all-gather',
  'reduce-scatter',
  'all-reduce',
  'all-to-all',
  'collective-permute',
  'collective-broadcast',
)
"""The collective kinds reported, in HLO spelling (``Collective.kind``)."""

# StableHLO op names (``stablehlo.all_gather``) to HLO kinds.
_STABLEHLO_KINDS = {k.replace('-', '_'): k for k in KINDS}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  Attributes:
    kind: one of :data:`KINDS`, e.g. ``'all-gather'``.
    name: the HLO instruction name (``'all-gather.3'``), or the SSA value
      (``'%1'``) for StableHLO.
    dtype: element type as HLO spells it (``'f32'``, ``'bf16'``); distinct
      dtypes of a tuple-shaped op are joined with ``+``.
    shape: the shape of the full array that ``bytes`` is computed from (see
      the module docstring); ``(total elements,)`` for a tuple-shaped op.
    group_size: number of devices in one replica group.
    executions: how many times it runs per call of the program: the product
      of the known trip counts of the enclosing ``while`` loops (1 outside
      loops).
    in_loop: whether it sits in a ``while`` body or condition, or in a
      computation called from one.
    bytes: bytes per device per execution.

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from dmuon_jax import diagnostics
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
    >>> report = diagnostics.analyze(step, x)
    >>> outside, inside = report.collectives
    >>> outside.kind, outside.shape, outside.group_size == n
    ('all-reduce', (8, 16), True)
    >>> inside.in_loop, inside.executions  # the loop's known trip count
    (True, 3)
    >>> inside.bytes == 2 * (n - 1) / n * 8 * 16 * 4  # ring all-reduce
    True
    >>> inside.total_bytes == 3 * inside.bytes
    True
  """

  kind: str
  name: str
  dtype: str
  shape: tuple[int, ...]
  group_size: int
  executions: int
  in_loop: bool
  bytes: float

  @property
  def total_bytes(self) -> float:
    """Bytes per device per call of the program (``bytes * executions``)."""
    return self.bytes * self.executions


@dataclasses.dataclass(frozen=True)
class HloReport:
  """Collectives, FLOPs and memory of one compiled program, per device.

  Attributes:
    collectives: every collective, in program order (callees after their
      call sites).
    flops: per-device FLOPs from ``compiled.cost_analysis()`` (0.0 where it
      reports none). XLA:CPU counts a ``while`` body once.
    argument_bytes: size of the arguments, from
      ``compiled.memory_analysis()``; None if unavailable.
    output_bytes: size of the outputs; None if unavailable.
    temp_bytes: size of temporaries; None if unavailable.
    alias_bytes: bytes of outputs aliased to (donated) arguments; None if
      unavailable.
    generated_code_bytes: size of the generated code; None if unavailable.

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from dmuon_jax import diagnostics
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
    >>> report = diagnostics.analyze(step, x)
    >>> report.count_by_kind  # 1 + 3 executions per call
    {'all-reduce': 4}
    >>> report.total_bytes('all-reduce') == 4 * 2 * (n - 1) / n * 8 * 16 * 4
    True
    >>> report.peak_bytes is not None  # from compiled.memory_analysis()
    True
    >>> print(report.summary().splitlines()[1][:35])
    all-reduce                2       4
  """

  collectives: tuple[Collective, ...]
  flops: float
  argument_bytes: int | None = None
  output_bytes: int | None = None
  temp_bytes: int | None = None
  alias_bytes: int | None = None
  generated_code_bytes: int | None = None

  @property
  def bytes_by_kind(self) -> dict[str, float]:
    """``{kind: bytes per device per call}``, executions included."""
    out: dict[str, float] = {}
    for c in self.collectives:
      out[c.kind] = out.get(c.kind, 0.0) + c.total_bytes
    return out

  @property
  def count_by_kind(self) -> dict[str, int]:
    """``{kind: number of executions per call}``."""
    out: dict[str, int] = {}
    for c in self.collectives:
      out[c.kind] = out.get(c.kind, 0) + c.executions
    return out

  @property
  def peak_bytes(self) -> int | None:
    """The estimated peak memory, arguments + outputs + temporaries - aliases.

    None if ``memory_analysis()`` was unavailable.
    """
    parts = (
      self.argument_bytes,
      self.output_bytes,
      self.temp_bytes,
      self.alias_bytes,
    )
    if any(p is None for p in parts):
      return None
    arg, out, temp, alias = parts
    return arg + out + temp - alias

  def total_bytes(self, kinds: str | Iterable[str] | None = None) -> float:
    """Bytes per device per call, summed over ``kinds``.

    Args:
      kinds: (optional, default None) a kind or several of :data:`KINDS`;
        None means all.

    Returns:
      The summed ``total_bytes`` of the matching collectives.
    """
    selected = _check_kinds(kinds)
    return float(
      sum(c.total_bytes for c in self.collectives if c.kind in selected)
    )

  def summary(self) -> str:
    """A readable table: per kind the ops, executions and bytes, then FLOPs.

    Returns:
      A multi-line string.
    """
    lines = [f'{"kind":<22}{"ops":>5}{"count":>8}{"bytes":>14}']
    ops: dict[str, int] = {}
    for c in self.collectives:
      ops[c.kind] = ops.get(c.kind, 0) + 1
    counts, nbytes = self.count_by_kind, self.bytes_by_kind
    for kind in KINDS:
      if kind in ops:
        lines.append(
          f'{kind:<22}{ops[kind]:>5}{counts[kind]:>8}'
          f'{_human_bytes(nbytes[kind]):>14}'
        )
    lines.append(
      f'{"total":<22}{len(self.collectives):>5}'
      f'{sum(counts.values()):>8}{_human_bytes(self.total_bytes()):>14}'
    )
    lines.append(f'flops per device: {self.flops:.4g}')
    if self.peak_bytes is not None:
      lines.append(
        f'memory: arguments {_human_bytes(self.argument_bytes)}, outputs'
        f' {_human_bytes(self.output_bytes)}, temporaries'
        f' {_human_bytes(self.temp_bytes)}, aliased'
        f' {_human_bytes(self.alias_bytes)}, peak'
        f' {_human_bytes(self.peak_bytes)}'
      )
    return '\n'.join(lines)


def analyze_compiled(compiled: Any) -> HloReport:
  """Reads collectives, FLOPs and memory from a compiled program.

  Args:
    compiled: a ``jax.stages.Compiled``, e.g.
      ``jax.jit(f).lower(*args).compile()``; a ``jax.stages.Lowered`` is
      compiled first.

  Returns:
    An :class:`HloReport`.

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from dmuon_jax import diagnostics
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
    >>> compiled = step.lower(x).compile()
    >>> report = diagnostics.analyze_compiled(compiled)
    >>> [(c.kind, c.executions) for c in report.collectives]
    [('all-reduce', 1), ('all-reduce', 3)]
    >>> report == diagnostics.analyze_compiled(step.lower(x))  # compiled here
    True
  """
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  if not hasattr(compiled, 'as_text'):
    raise TypeError(
      'analyze_compiled expects a jax.stages.Compiled (from'
      f' jax.jit(f).lower(*args).compile()); got {type(compiled).__name__}.'
    )
  collectives = hlo_collectives(compiled.as_text())
  memory = _memory_fields(compiled)
  return HloReport(collectives=collectives, flops=_flops(compiled), **memory)


def analyze(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> HloReport:
  """Compiles ``fn`` for ``args`` and analyzes the result.

  Args:
    fn: a function, or one already wrapped in ``jax.jit`` (anything with
      a ``lower`` method).
    *args: positional arguments, arrays or ``jax.ShapeDtypeStruct`` (with a
      ``sharding`` where the program needs one).
    **kwargs: keyword arguments, passed to ``lower`` as well.

  Returns:
    An :class:`HloReport`; see :func:`analyze_compiled`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from dmuon_jax import diagnostics
    >>> matmul = lambda a, b: a @ b
    >>> a = jax.ShapeDtypeStruct((8, 16), jnp.float32)  # shapes are enough
    >>> report = diagnostics.analyze(matmul, a, jnp.ones((16, 4)))
    >>> report.collectives, report.flops  # 2 * 8 * 16 * 4
    ((), 1024.0)
    >>> report.argument_bytes, report.output_bytes  # (128 + 64) and 32 f32
    (768, 128)
  """
  jitted = fn if hasattr(fn, 'lower') else jax.jit(fn)

  def free(x):
    # Uncommitted arrays (e.g. optax's step counts) may go anywhere, as in a
    # call; lowering would pin them to their one device.
    if isinstance(x, jax.Array) and not getattr(x, 'committed', True):
      return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x

  args, kwargs = jax.tree.map(free, (args, kwargs))
  return analyze_compiled(jitted.lower(*args, **kwargs).compile())


# ---------------------------------------------------------------------------
# Replica groups and sizes.


_IOTA_RE = re.compile(
  r'^\[(?P<shape>\d+(?:,\d+)*)\]<=\[(?P<dims>\d+(?:,\d+)*)\]'
  r'(?:T\((?P<perm>\d+(?:,\d+)*)\))?$'
)


def parse_replica_groups(
  text: str, num_devices: int | None = None
) -> tuple[tuple[int, ...], ...]:
  """Parses an HLO ``replica_groups`` value into explicit groups.

  Args:
    text: the value, in one of three forms: explicit ``{{0,1,2,3},{4,5,6,7}}``,
      iota ``[2,4]<=[8]`` (2 groups of 4 from ``arange(8)``) or transposed
      iota ``[4,2]<=[2,4]T(1,0)`` (``arange(8).reshape(2, 4).T`` cut into 4
      groups of 2). Empty ``{}`` means one group of all devices.
    num_devices: (optional, default None) the number of devices that ``{}``
      stands for; if None, ``{}`` gives no groups.

  Returns:
    A tuple of groups, each a tuple of device ids.

  Examples:
    >>> from dmuon_jax import diagnostics
    >>> diagnostics.parse_replica_groups('[2,4]<=[8]')
    ((0, 1, 2, 3), (4, 5, 6, 7))
    >>> diagnostics.parse_replica_groups('[4,2]<=[2,4]T(1,0)')
    ((0, 4), (1, 5), (2, 6), (3, 7))
    >>> diagnostics.parse_replica_groups('{}', num_devices=4)
    ((0, 1, 2, 3),)
  """
  compact = re.sub(r'\s+', '', text)
  m = _IOTA_RE.match(compact)
  if m:
    shape = [int(v) for v in m['shape'].split(',')]
    dims = [int(v) for v in m['dims'].split(',')]
    perm = (
      [int(v) for v in m['perm'].split(',')]
      if m['perm']
      else list(range(len(dims)))
    )
    if math.prod(shape) != math.prod(dims) or sorted(perm) != list(
      range(len(dims))
    ):
      raise ValueError(f'Inconsistent iota replica_groups {text!r}.')
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm)
    ids = ids.reshape(shape[0], -1)
    return tuple(tuple(int(v) for v in row) for row in ids)
  if compact.startswith('{') and compact.endswith('}'):
    inner = compact[1:-1]
    if not inner:
      return (tuple(range(num_devices)),) if num_devices else ()
    groups = re.findall(r'\{([^{}]*)\}', inner)
    if re.sub(r'\{[^{}]*\}', '', inner).strip(','):
      raise ValueError(f'Cannot parse replica_groups {text!r}.')
    return tuple(tuple(int(v) for v in g.split(',') if v) for g in groups)
  raise ValueError(
    f'Cannot parse replica_groups {text!r}; expected {{{{0,1}},{{2,3}}}},'
    ' [2,4]<=[8] or [4,2]<=[2,4]T(1,0).'
  )


def _largest_component(pairs: Iterable[tuple[int, int]]) -> int:
  """Size of the largest connected set of devices joined by ``pairs``."""
  parent: dict[int, int] = {}

  def find(a: int) -> int:
    parent.setdefault(a, a)
    while parent[a] != a:
      parent[a] = parent[parent[a]]
      a = parent[a]
    return a

  for s, t in pairs:
    parent[find(s)] = find(t)
  sizes: dict[int, int] = {}
  for a in list(parent):
    root = find(a)
    sizes[root] = sizes.get(root, 0) + 1
  return max(sizes.values(), default=1)


def _collective_bytes(kind: str, group_size: int, full_bytes: float) -> float:
  """Per-device bytes of one execution; see the module docstring."""
  if group_size <= 1:
    return 0.0
  frac = (group_size - 1) / group_size
  if kind == 'all-reduce':
    return 2 * frac * full_bytes
  if kind in ('collective-permute', 'collective-broadcast'):
    return float(full_bytes)
  return frac * full_bytes


def _itemsize(dtype: str) -> float:
  """Bytes per element of an HLO element type (``f32`` -> 4, ``s4`` -> .5)."""
  if dtype == 'pred':
    return 1.0
  m = re.match(r'[a-z]+?(\d+)', dtype)
  if not m:  # token[], opaque[]
    return 0.0
  return int(m[1]) / 8


_Element = tuple[str, tuple[int, ...]]


def _record(
  kind: str,
  name: str,
  elements: list[_Element],
  group_size: int,
  executions: int,
  in_loop: bool,
) -> Collective:
  """Builds a :class:`Collective` from the elements of its full array."""
  full_bytes = sum(_itemsize(d) * math.prod(s) for d, s in elements)
  dtypes = list(dict.fromkeys(d for d, _ in elements))
  if len(elements) == 1:
    shape = elements[0][1]
  else:
    shape = (sum(math.prod(s) for _, s in elements),)
  return Collective(
    kind=kind,
    name=name,
    dtype='+'.join(dtypes),
    shape=shape,
    group_size=group_size,
    executions=executions,
    in_loop=in_loop,
    bytes=_collective_bytes(kind, group_size, full_bytes),
  )


def _check_kinds(kinds: str | Iterable[str] | None) -> frozenset[str]:
  if kinds is None:
    return frozenset(KINDS)
  selected = frozenset([kinds] if isinstance(kinds, str) else kinds)
  unknown = sorted(selected - frozenset(KINDS))
  if unknown:
    raise ValueError(f'Unknown collective kinds {unknown}; expected {KINDS}.')
  return selected


def _human_bytes(n: float | None) -> str:
  if n is None:
    return '-'
  units = ('B', 'KiB', 'MiB', 'GiB', 'TiB')
  i = 0
  while abs(n) >= 1024 and i < len(units) - 1:
    n /= 1024
    i += 1
  return f'{n:.0f} B' if i == 0 else f'{n:.1f} {units[i]}'


# ---------------------------------------------------------------------------
# Compiled HLO text.


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: tuple[tuple[str | None, str], ...]  # (inline shape, name)
  attrs: str  # attributes with quoted strings blanked
  raw: str


_COMPUTATION_RE = re.compile(
  r'^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$'
)
_INSTRUCTION_RE = re.compile(
  r'^\s+(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$'
)
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT_RE = re.compile(r'/\*.*?\*/')
_ELEMENT_RE = re.compile(r'\b([a-z][a-z0-9]*)\[([^\]]*)\]')
_CALLEE_RE = re.compile(
  r'\b(?:calls|to_apply|branch_computations|true_computation|'
  r'false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)'
)
_LOOP_RE = re.compile(r'\b(?P<key>body|condition)=%?(?P<name>[\w.\-]+)')
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_RE = re.compile(
  r'replica_groups=(\{\}|\{(?:\{[\d,\s]*\},?\s*)*\}|\[[\d,]+\]<=\[[\d,]+\]'
  r'(?:T\([\d,]+\))?)'
)
_PAIRS_RE = re.compile(r'source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}')


def _closing(text: str, start: int) -> int:
  """Index of the parenthesis closing the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == '(':
      depth += 1
    elif text[i] == ')':
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def _elements(shape: str) -> list[_Element]:
  """Array elements of an HLO shape (a tuple shape gives several)."""
  out = []
  for dtype, dims in _ELEMENT_RE.findall(shape):
    if dtype in ('token', 'opaque'):
      continue
    sizes = tuple(
      int(d.replace('<=', '')) for d in dims.split(',') if d.strip()
    )
    out.append((dtype, sizes))
  return out


def _parse_instruction(line: str) -> _Instruction | None:
  line = _COMMENT_RE.sub('', line)  # Long lists carry /*index=5*/ marks.
  m = _INSTRUCTION_RE.match(line)
  if not m:
    return None
  rest = m['rest']
  if rest.startswith('('):
    end = _closing(rest, 0) + 1
  else:
    end = len(rest.split(' ', 1)[0])
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  close = _closing(rest, op.end() - 1)
  operands = []
  for token in _split_top_level(rest[op.end() : close]):
    token = token.strip()
    name = re.search(r'%?([\w.\-]+)$', token)
    if not name:
      continue
    inline = token[: name.start()].strip() or None
    operands.append((inline, name[1]))
  return _Instruction(
    name=m['name'],
    shape=shape,
    opcode=op[1],
    operands=tuple(operands),
    attrs=_STRING_RE.sub('""', rest[close + 1 :]),
    raw=line,
  )


def _split_top_level(text: str) -> list[str]:
  """Splits on commas outside brackets of any kind."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p for p in parts if p.strip()]


def _parse_module(
  text: str,
) -> tuple[dict[str, list[_Instruction]], str | None, int, int]:
  """Computations by name, the entry's name, partitions and replicas."""
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  num_partitions, replica_count = 1, 1
  for line in text.splitlines():
    if line.startswith('HloModule'):
      header = _STRING_RE.sub('""', line)
      if m := re.search(r'\bnum_partitions=(\d+)', header):
        num_partitions = int(m[1])
      if m := re.search(r'\breplica_count=(\d+)', header):
        replica_count = int(m[1])
      continue
    if current is None:
      m = _COMPUTATION_RE.match(line)
      if m:
        current = m['name']
        computations[current] = []
        if m['entry']:
          entry = current
      continue
    if line.strip() == '}':
      current = None
      continue
    instruction = _parse_instruction(line)
    if instruction is not None:
      computations[current].append(instruction)
  return computations, entry, num_partitions, replica_count


def _callees(ins: _Instruction) -> list[str]:
  """Computations an instruction calls, other than a while's."""
  out = []
  for m in _CALLEE_RE.finditer(ins.attrs):
    out.extend(re.findall(r'%?([\w.\-]+)', m[1]))
  return out


def _hlo_kind(opcode: str) -> str | None:
  base = opcode.removesuffix('-start')
  return base if base in KINDS else None


def _group_size(
  ins: _Instruction, kind: str, num_partitions: int, replica_count: int
) -> int:
  if kind == 'collective-permute':
    m = _PAIRS_RE.search(ins.attrs)
    pairs = re.findall(r'\{\s*(\d+)\s*,\s*(\d+)\s*\}', m[1]) if m else []
    return _largest_component((int(s), int(t)) for s, t in pairs)
  m = _GROUPS_RE.search(ins.attrs)
  groups = parse_replica_groups(m[1]) if m else ()
  if groups:
    return max(len(g) for g in groups)
  if 'channel_id=' in ins.attrs:
    return num_partitions * replica_count
  return replica_count


def _gather_dimension(ins: _Instruction) -> int:
  m = re.search(r'\bdimensions=\{(\d+)\}', ins.attrs)
  return int(m[1]) if m else 0


def _scaled(
  elements: list[_Element], dim: int, factor: float
) -> list[_Element]:
  out = []
  for dtype, shape in elements:
    shape = list(shape)
    if shape:
      shape[dim] = int(shape[dim] * factor)
    out.append((dtype, tuple(shape)))
  return out


def _full_elements(
  ins: _Instruction, kind: str, n: int, shapes: dict[str, str]
) -> list[_Element]:
  """Elements of the full array that the byte formula for ``kind`` uses."""
  operands: list[_Element] | None = []
  for inline, name in ins.operands:
    text = inline or shapes.get(name)
    if text is None:  # Not in this computation: fall back to the result.
      operands = None
      break
    operands.extend(_elements(text))
  result = _elements(ins.shape)
  dim = _gather_dimension(ins)
  if ins.opcode.endswith('-start'):
    # The shape of an async start bundles operands, results and u32[]
    # contexts; the operands are the reliable part.
    if operands is None:
      arrays = [e for e in result if e[1]]
      operands = arrays[: max(1, len(arrays) // 2)]
    if kind == 'all-gather':
      return _scaled(operands, dim, n)
    return operands
  if kind == 'all-gather':
    return result
  if operands is not None:
    return operands
  if kind == 'reduce-scatter':
    return _scaled(result, dim, n)
  return result


def hlo_collectives(
  text: str, num_devices: int | None = None
) -> tuple[Collective, ...]:
  """Lists the collectives of a compiled HLO module's text.

  Args:
    text: HLO text, e.g. ``jax.jit(f).lower(*args).compile().as_text()`` or
      an XLA dump (``after_optimizations.txt``).
    num_devices: (optional, default None) the number of devices an empty
      ``replica_groups={}`` spans; if None, ``num_partitions *
      replica_count`` from the ``HloModule`` header.

  Returns:
    The collectives, walking from the entry computation through the
    computations it calls (see the module docstring for loops, branches and
    async ops).

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from dmuon_jax import diagnostics
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
    >>> text = step.lower(x).compile().as_text()
    >>> [(c.kind, c.in_loop, c.executions)
    ...  for c in diagnostics.hlo_collectives(text)]
    [('all-reduce', False, 1), ('all-reduce', True, 3)]

    Any HLO module text will do, e.g. an all-gather over 2 devices:

    >>> text = '''HloModule m, num_partitions=2
    ... ENTRY main (x: f32[8]) -> f32[16] {
    ...   x = f32[8] parameter(0)
    ...   ROOT g = f32[16] all-gather(x), replica_groups={{0,1}}, dimensions={0}
    ... }'''
    >>> (c,) = diagnostics.hlo_collectives(text)
    >>> c.kind, c.shape, c.group_size, c.bytes  # half of the 16 gathered f32s
    ('all-gather', (16,), 2, 32.0)
  """
  computations, entry, num_partitions, replica_count = _parse_module(text)
  if num_devices is not None:
    num_partitions, replica_count = num_devices, 1
  out: list[Collective] = []

  def visit(
    name: str, executions: int, in_loop: bool, stack: tuple[str, ...]
  ) -> None:
    if name not in computations or name in stack:
      return
    stack += (name,)
    instructions = computations[name]
    shapes = {ins.name: ins.shape for ins in instructions}
    for ins in instructions:
      kind = _hlo_kind(ins.opcode)
      if kind is not None:
        n = _group_size(ins, kind, num_partitions, replica_count)
        elements = _full_elements(ins, kind, n, shapes)
        out.append(_record(kind, ins.name, elements, n, executions, in_loop))
      if ins.opcode == 'while':
        trip = _TRIP_COUNT_RE.search(ins.raw)
        trips = int(trip[1]) if trip else 1
        for m in _LOOP_RE.finditer(ins.attrs):
          # The condition runs once more than the body.
          extra = 1 if trip and m['key'] == 'condition' else 0
          visit(m['name'], executions * (trips + extra), True, stack)
        continue
      if ins.opcode in ('async-done', 'async-update'):
        continue  # Counted at the async-start, which calls the same op.
      for callee in _callees(ins):
        visit(callee, executions, in_loop, stack)

  if entry is not None:
    roots = [entry]
  else:  # A fragment without ENTRY: start from computations nobody calls.
    called = {
      callee
      for instructions in computations.values()
      for ins in instructions
      for callee in _callees(ins)
      + [m['name'] for m in _LOOP_RE.finditer(ins.attrs)]
    }
    roots = [c for c in computations if c not in called]
  for root in roots:
    visit(root, 1, False, ())
  return tuple(out)


# ---------------------------------------------------------------------------
# StableHLO (MLIR) text.


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


def _mlir_elements(types: str) -> list[_Element]:
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
) -> tuple[Collective, ...]:
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
    >>> from dmuon_jax import diagnostics
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
    ...  for c in diagnostics.stablehlo_collectives(lowered.as_text())]
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
    stripped = _STRING_RE.sub('""', line)
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
      n = _largest_component(p for p in pairs if len(p) == 2)
    else:
      groups = _mlir_matrix(op_text, 'replica_groups')
      n = max((len(g) for g in groups), default=0) if groups else 0
      n = n or num_devices
    elements = outs if kind == 'all-gather' else ins
    out.append(_record(kind, result, elements, n, 1, in_while or fn in looped))
  return tuple(out)


class NestedCollective(NamedTuple):
  """A collective and the control flow around it.

  One entry of :func:`collective_nesting`: a collective inside a
  ``conditional`` runs only on the devices that take its branch, which
  NCCL, matching collectives by their order, does not allow.

  Attributes:
    kind: one of :data:`KINDS`.
    context: the enclosing ``'conditional'`` and ``'while'`` instructions,
      outermost first; ``()`` at the top level.
    elements: the number of elements of its result (one execution).

  Examples:
    >>> from dmuon_jax import diagnostics
    >>> text = '''HloModule m, num_partitions=2
    ... ENTRY main (x: f32[8]) -> f32[16] {
    ...   x = f32[8] parameter(0)
    ...   ROOT g = f32[16] all-gather(x), replica_groups={{0,1}}, dimensions={0}
    ... }'''
    >>> diagnostics.collective_nesting(text)
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
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from dmuon_jax import diagnostics
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
    >>> for c in diagnostics.collective_nesting(step.lower(x).compile()):
    ...   print(c.kind, c.context, c.elements)
    all-reduce () 128
    all-reduce ('while',) 128
  """
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, entry, _, _ = _parse_module(text)
  out: list[NestedCollective] = []
  seen: set[tuple[str, tuple[str, ...]]] = set()

  def visit(name: str, context: tuple[str, ...]) -> None:
    if (name, context) in seen:
      return
    seen.add((name, context))
    for ins in comps.get(name, ()):
      kind = _hlo_kind(ins.opcode)
      if kind is not None and not ins.opcode.endswith('-done'):
        elements = _elements(ins.shape)
        if ins.opcode.endswith('-start') and len(elements) > 1:
          elements = elements[len(elements) // 2 :]  # (operands, results)
        size = sum(math.prod(dims) for _, dims in elements)
        out.append(NestedCollective(kind, context, int(size)))
      if ins.opcode == 'while':
        for m in _LOOP_RE.finditer(ins.attrs):
          visit(m['name'], context + ('while',))
      elif ins.opcode == 'conditional':
        for c in _callees(ins):
          visit(c, context + ('conditional',))
      else:
        for c in _callees(ins):
          visit(c, context)

  if entry:
    visit(entry, ())
  return tuple(out)


# ---------------------------------------------------------------------------
# Cost and memory analysis.


def _flops(compiled: Any) -> float:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # Not every backend has it.
    return 0.0
  if isinstance(cost, (list, tuple)):  # Older jax: one dict per program.
    cost = cost[0] if cost else None
  if not cost:
    return 0.0
  return float(cost.get('flops', 0.0))


def _memory_fields(compiled: Any) -> dict[str, int | None]:
  fields = {
    'argument_bytes': 'argument_size_in_bytes',
    'output_bytes': 'output_size_in_bytes',
    'temp_bytes': 'temp_size_in_bytes',
    'alias_bytes': 'alias_size_in_bytes',
    'generated_code_bytes': 'generated_code_size_in_bytes',
  }
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # Not every backend has it.
    stats = None
  out = {}
  for field, attr in fields.items():
    value = getattr(stats, attr, None) if stats is not None else None
    out[field] = None if value is None else int(value)
  return out


def _text_with_large_constants(compiled) -> str | None:
  """The compiled HLO with every constant printed (``as_text()`` elides
  arrays of more than a few elements as ``{...}``, among them the slot ->
  branch tables :func:`_branch_table` reads), or None where this jaxlib
  has no such printer (its HLO module API is not public)."""
  try:
    from jaxlib import _hlo  # pylint: disable=import-outside-toplevel

    options = _hlo.HloPrintOptions()
    options.print_large_constants = True
    modules = compiled.runtime_executable().hlo_modules()
    return '\n'.join(m.to_string(options) for m in modules)
  except Exception:  # pylint: disable=broad-except
    return None


_TABLE_RE = re.compile(r'^s32\[(\d+)\]')


def _branch_table(ins, computation, n, k):
  """The constant slot -> branch table a ``conditional`` picks its branch
  through (``_collectives.switch_by_slot`` with keys: owners whose work is
  alike share a branch body), or None: an ``s32[n]`` constant of values
  in ``[0, k)`` among the operands of the instructions (up to two levels)
  that compute the branch index."""
  byname = {i.name: i for i in computation}
  frontier = [ins.operands[0][1]] if ins.operands else []
  for _ in range(3):
    nxt = []
    for nm in frontier:
      src = byname.get(nm)
      if src is None:
        continue
      if src.opcode == 'constant':
        m = _TABLE_RE.match(src.shape)
        vals = re.search(r'constant\(\{([\d,\s]*)\}\)', src.raw)
        if m and int(m[1]) == n and vals:
          table = [int(v) for v in vals[1].split(',') if v.strip()]
          if len(table) == n and all(0 <= v < k for v in table):
            return table
        continue
      nxt.extend(o for _, o in src.operands)
    frontier = nxt
  return None


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
      loop by its known trip count: dmuon's Newton–Schulz iterations and
      scanned layers are loops. False counts each body once, as XLA's
      ``cost_analysis`` (and so :attr:`HloReport.flops`) does.
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
    >>> from dmuon_jax import diagnostics
    >>> def three_matmuls(a, b):
    ...   return jax.lax.fori_loop(0, 3, lambda i, a: jnp.tanh(a @ b), a)
    >>> a, b = jnp.ones((8, 16)), jnp.ones((16, 16))
    >>> compiled = jax.jit(three_matmuls).lower(a, b).compile()
    >>> diagnostics.dot_flops(compiled)  # 3 iterations of 2 * 8 * 16 * 16
    12288.0
    >>> diagnostics.dot_flops(compiled, loop_trip_counts=False)  # body once
    4096.0
  """
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  n = branches_per_device or 0
  if isinstance(compiled, str):
    text = compiled
  else:
    text = (_text_with_large_constants(compiled) if n else None) or (
      compiled.as_text()
    )
  comps, entry, _, _ = _parse_module(text)
  memo: dict[str, Any] = {}
  warned: list[str] = []

  def cost(name):
    """A float, or with ``branches_per_device`` an array: per slot."""
    if name in memo:
      return memo[name]
    memo[name] = np.zeros(n) if n else 0.0  # Guards against cycles.
    shapes = {ins.name: _elements(ins.shape) for ins in comps.get(name, ())}
    total = np.zeros(n) if n else 0.0
    for ins in comps.get(name, ()):
      if ins.opcode == 'dot':
        inline, lhs_name = ins.operands[0]
        lhs = _elements(inline) if inline else shapes.get(lhs_name)
        out = _elements(ins.shape)
        dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins.attrs)
        if not lhs or not out or dims is None:
          continue
        contracted = math.prod(
          lhs[0][1][int(d)] for d in dims[1].split(',') if d
        )
        total += 2.0 * math.prod(out[0][1]) * contracted
      elif ins.opcode == 'conditional':
        callees = _callees(ins)
        per = [np.max(cost(c)) for c in callees]
        shared = n and 1 < len(callees) < n  # owners sharing branch bodies
        table = None
        if n and len(callees) == n:
          table = range(n)
        elif shared:
          table = _branch_table(ins, comps.get(name, ()), n, len(callees))
        if table is not None:
          total = total + np.array([per[b] for b in table])
        else:
          if shared and not warned:
            warned.append(ins.name)
            warnings.warn(
              f'dot_flops: conditional {ins.name} has {len(callees)} '
              f'branches for {n} devices and no readable slot -> branch '
              'table; it counts its busiest branch (an upper bound). Pass '
              'the Compiled object rather than its text.',
              stacklevel=2,
            )
          total = total + max(per, default=0.0)
      elif ins.opcode == 'while':
        body = re.search(r'\bbody=%?([\w.\-]+)', ins.attrs)
        trip = _TRIP_COUNT_RE.search(ins.raw) if loop_trip_counts else None
        trips = int(trip[1]) if trip else 1
        total += cost(body[1]) * trips if body else 0.0
      else:
        total += sum(cost(c) for c in _callees(ins))
    memo[name] = total
    return total

  return float(np.max(cost(entry))) if entry else 0.0


__all__ = (
  'KINDS',
  'Collective',
  'HloReport',
  'NestedCollective',
  'analyze',
  'analyze_compiled',
  'collective_nesting',
  'dot_flops',
  'hlo_collectives',
  'parse_replica_groups',
  'stablehlo_collectives',
)
