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
bytes a GPU program moves for bf16 data; ``stablehlo_collectives`` of the
repository's ``examples/benchmarks/hlo_tools.py`` on the program lowered for
CUDA shows the bf16 ops.

FLOPs come from ``compiled.cost_analysis()['flops']`` and are per device.
XLA:CPU (jax 0.10.2) counts a ``while`` body **once**, not once per
iteration (a ``lax.scan`` of 5 matmuls reports the FLOPs of one), and counts
the most expensive branch of a ``conditional``. Multiply by hand where a loop
matters (``dot_flops`` of ``examples/benchmarks/hlo_tools.py`` counts each
loop's trips, device by device).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import pathlib
import re
import runpy
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from dmuon_jax import _checks

KINDS = (
  'all-gather',
  'reduce-scatter',
  'all-reduce',
  'all-to-all',
  'collective-permute',
  'collective-broadcast',
)
"""The collective kinds reported, in HLO spelling (``Collective.kind``)."""


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
    >>> import jax, jax.numpy as jnp
    >>> from dmuon_jax import diagnostics
    >>> mesh = jax.make_mesh((2,), ('data',))  # of the first 2 devices
    >>> x = jnp.ones((8, 16), device=jax.NamedSharding(mesh, jax.P('data')))
    >>> @jax.jit
    ... def step(x):  # each iteration sums the sharded rows: an all-reduce
    ...   return jax.lax.fori_loop(0, 3, lambda i, y: y + y.sum(0), x)
    >>> (c,) = diagnostics.analyze(step, x).collectives
    >>> c.kind, c.shape, c.group_size, c.in_loop, c.executions
    ('all-reduce', (16,), 2, True, 3)
    >>> c.bytes == 2 * (2 - 1) / 2 * 16 * 4, c.total_bytes == 3 * c.bytes
    (True, True)
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
    >>> import jax, jax.numpy as jnp
    >>> from dmuon_jax import diagnostics
    >>> mesh = jax.make_mesh((2,), ('data',))  # of the first 2 devices
    >>> x = jnp.ones((8, 16), device=jax.NamedSharding(mesh, jax.P('data')))
    >>> replicated = jax.NamedSharding(mesh, jax.P())
    >>> gather = jax.jit(lambda x: x, out_shardings=replicated)
    >>> report = diagnostics.analyze(gather, x)
    >>> report.count_by_kind, report.bytes_by_kind  # half of 8 * 16 f32
    ({'all-gather': 1}, {'all-gather': 256.0})
    >>> report.peak_bytes is not None  # from compiled.memory_analysis()
    True
    >>> print(report.summary().splitlines()[1][:35])
    all-gather                1       1
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
    return self._by_kind(lambda c: c.total_bytes, 0.0)

  @property
  def count_by_kind(self) -> dict[str, int]:
    """``{kind: number of executions per call}``."""
    return self._by_kind(lambda c: c.executions, 0)

  def _by_kind(self, value, zero):
    out = {}
    for c in self.collectives:
      out[c.kind] = out.get(c.kind, zero) + value(c)
    return out

  @property
  def peak_bytes(self) -> int | None:
    """The estimated peak memory, arguments + outputs + temporaries - aliases.

    None if ``memory_analysis()`` was unavailable.
    """
    arg, out, temp, alias = self._memory
    return None if None in self._memory else arg + out + temp - alias

  @property
  def _memory(self) -> tuple[int | None, ...]:
    return (
      self.argument_bytes,
      self.output_bytes,
      self.temp_bytes,
      self.alias_bytes,
    )

  def total_bytes(self, kinds: str | Iterable[str] | None = None) -> float:
    """Bytes per device per call, summed over ``kinds``.

    Args:
      kinds: (optional, default None) a kind or several of :data:`KINDS`;
        None means all.

    Returns:
      The summed ``total_bytes`` of the matching collectives.
    """
    selected = frozenset(
      KINDS if kinds is None else [kinds] if isinstance(kinds, str) else kinds
    )
    if unknown := sorted(selected - frozenset(KINDS)):
      raise ValueError(f'Unknown collective kinds {unknown}; expected {KINDS}.')
    return float(
      sum(c.total_bytes for c in self.collectives if c.kind in selected)
    )

  def summary(self) -> str:
    """A readable table: per kind the ops, executions and bytes, then FLOPs.

    Returns:
      A multi-line string.
    """
    size = lambda n: _checks.human_bytes(n, digits=1)
    lines = [f'{"kind":<22}{"ops":>5}{"count":>8}{"bytes":>14}']
    ops = collections.Counter(c.kind for c in self.collectives)
    counts, nbytes = self.count_by_kind, self.bytes_by_kind
    for kind in KINDS:
      if kind in ops:
        lines.append(
          f'{kind:<22}{ops[kind]:>5}{counts[kind]:>8}{size(nbytes[kind]):>14}'
        )
    lines.append(
      f'{"total":<22}{len(self.collectives):>5}'
      f'{sum(counts.values()):>8}{size(self.total_bytes()):>14}'
    )
    lines.append(f'flops per device: {self.flops:.4g}')
    if self.peak_bytes is not None:
      names = ('arguments', 'outputs', 'temporaries', 'aliased', 'peak')
      values = (*self._memory, self.peak_bytes)
      lines.append(
        'memory: ' + ', '.join(f'{k} {size(v)}' for k, v in zip(names, values))
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
    >>> import jax, jax.numpy as jnp
    >>> from dmuon_jax import diagnostics
    >>> a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
    >>> lowered = jax.jit(lambda a, b: a @ b).lower(a, b)
    >>> report = diagnostics.analyze_compiled(lowered.compile())
    >>> report.collectives, report.flops  # 2 * 8 * 16 * 4
    ((), 1024.0)
    >>> report == diagnostics.analyze_compiled(lowered)  # compiled here
    True
  """
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  if not hasattr(compiled, 'as_text'):
    raise TypeError(
      'analyze_compiled expects a jax.stages.Compiled (from'
      f' jax.jit(f).lower(*args).compile()); got {type(compiled).__name__}.'
    )
  cost, stats = None, None
  with contextlib.suppress(Exception):  # Not on every backend.
    cost = compiled.cost_analysis()
  with contextlib.suppress(Exception):
    stats = compiled.memory_analysis()
  memory = {}
  for part in ('argument', 'output', 'temp', 'alias', 'generated_code'):
    value = getattr(stats, f'{part}_size_in_bytes', None)
    memory[f'{part}_bytes'] = None if value is None else int(value)
  return HloReport(
    collectives=hlo_collectives(compiled.as_text()),
    flops=float(cost.get('flops', 0.0)) if cost else 0.0,
    **memory,
  )


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
# Sizes and bytes.


def _itemsize(dtype: str) -> float:
  """Bytes per element of an HLO element type (``f32`` -> 4, ``s4`` -> .5)."""
  if dtype == 'pred':
    return 1.0
  m = re.match(r'[a-z]+?(\d+)', dtype)
  return int(m[1]) / 8 if m else 0.0  # 0 for token[], opaque[]


def make_collective(
  kind: str,
  name: str,
  elements: list[Element],
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
    bytes=_checks.ring_bytes(kind, group_size, full_bytes),
  )


# ---------------------------------------------------------------------------
# Compiled HLO text. The names here without an underscore that __all__ leaves
# out (parse_module, elements, callees, ...) serve the repository's tests and
# examples/benchmarks/hlo_tools.py.


_IOTA_RE = re.compile(
  r'^\[(?P<shape>\d+(?:,\d+)*)\]<=\[(?P<dims>\d+(?:,\d+)*)\]'
  r'(?:T\((?P<perm>\d+(?:,\d+)*)\))?$'
)


def parse_replica_groups(
  text: str, num_devices: int | None = None
) -> tuple[tuple[int, ...], ...]:
  """Parses an HLO ``replica_groups`` value into explicit groups.

  Args:
    text: the value, in one of four forms: explicit ``{{0,1,2,3},{4,5,6,7}}``,
      iota ``[2,4]<=[8]`` (2 groups of 4 from ``arange(8)``), transposed
      iota ``[4,2]<=[2,4]T(1,0)`` (``arange(8).reshape(2, 4).T`` cut into 4
      groups of 2), or over named axes of a mesh (XLA with jax 0.10):
      ``mesh['a'=4,'b'=2] {'a'}`` (devices ``arange(8).reshape(4, 2)``, a
      group per index of the axes not named in the braces: 2 groups of 4),
      with ``, device_ids=([2,4]T(1,0))`` before the braces where the
      mesh's devices are an iota of their own. Empty ``{}`` means one
      group of all devices.
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
    >>> diagnostics.parse_replica_groups(
    ...   "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    ... )
    ((0, 1, 2, 3), (4, 5, 6, 7))
  """
  compact = re.sub(r'\s+', '', text)
  m = _MESH_GROUPS_RE.fullmatch(compact)
  if m:
    return _mesh_groups(text, m)
  m = _IOTA_RE.match(compact)
  if m:
    shape, dims, perm = (
      [int(v) for v in (m[k] or '').split(',') if v]
      for k in ('shape', 'dims', 'perm')
    )
    try:  # numpy rejects a repeated axis or a shape of another size
      ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm or None)
      ids = ids.reshape(shape).reshape(shape[0], -1)
    except ValueError as e:
      raise ValueError(f'Inconsistent iota replica_groups {text!r}.') from e
    return tuple(tuple(int(v) for v in row) for row in ids)
  if re.fullmatch(r'\{(?:\{[\d,]*\},?)*\}', compact):
    groups = re.findall(r'\{([\d,]*)\}', compact[1:-1])
    if not groups:
      return (tuple(range(num_devices)),) if num_devices else ()
    return tuple(tuple(int(v) for v in g.split(',') if v) for g in groups)
  raise ValueError(
    f'Cannot parse replica_groups {text!r}; expected {{{{0,1}},{{2,3}}}},'
    ' [2,4]<=[8] or [4,2]<=[2,4]T(1,0).'
  )


_MESH_GROUPS_RE = re.compile(
  r'mesh\[(?P<axes>[^\]]*)\]'
  r'(?:,device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?)\))?'
  r'\{(?P<over>[^}]*)\}'
)


def _mesh_groups(text: str, m: re.Match) -> tuple[tuple[int, ...], ...]:
  """The groups of ``mesh['a'=4,'b'=2], device_ids=(...) {'a'}``."""
  axes = re.findall(r"'?([\w.\-]+)'?=(\d+)", m['axes'])
  names = [a for a, _ in axes]
  sizes = [int(n) for _, n in axes]
  over = [a.strip("'") for a in m['over'].split(',') if a]
  if not axes or any(a not in names for a in over):
    raise ValueError(f'Cannot parse replica_groups {text!r}: unknown axes.')
  try:
    if m['ids']:
      iota = _IOTA_IDS_RE.fullmatch(m['ids'])
      if iota is None:
        raise ValueError(m['ids'])
      dims, perm = (
        [int(v) for v in (iota[k] or '').split(',') if v]
        for k in ('dims', 'perm')
      )
      ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm or None)
    else:
      ids = np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
  except ValueError as e:
    raise ValueError(f'Inconsistent mesh replica_groups {text!r}.') from e
  inside = [names.index(a) for a in over]
  outside = [i for i in range(len(names)) if i not in inside]
  size = math.prod(sizes[i] for i in inside)
  ids = ids.transpose(outside + inside).reshape(-1, size)
  return tuple(tuple(int(v) for v in row) for row in ids)


_IOTA_IDS_RE = re.compile(
  r'\[(?P<dims>\d+(?:,\d+)*)\](?:T\((?P<perm>\d+(?:,\d+)*)\))?'
)


def largest_component(pairs: Iterable[tuple[int, int]]) -> int:
  """Size of the largest connected set of devices joined by ``pairs``."""
  components: list[set[int]] = []
  for pair in pairs:
    joined = set(pair).union(*(c for c in components if c & set(pair)))
    components = [c for c in components if not c & joined] + [joined]
  return max(map(len, components), default=1)


Element = tuple[str, tuple[int, ...]]


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
STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT_RE = re.compile(r'/\*.*?\*/')
_ELEMENT_RE = re.compile(r'\b([a-z][a-z0-9]*)\[([^\]]*)\]')
_CALLEE_RE = re.compile(
  r'\b(?:calls|to_apply|branch_computations|true_computation|'
  r'false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)'
)
LOOP_RE = re.compile(r'\b(?P<key>body|condition)=%?(?P<name>[\w.\-]+)')
TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_RE = re.compile(
  r'replica_groups=(\{\}|\{(?:\{[\d,\s]*\},?\s*)*\}|\[[\d,]+\]<=\[[\d,]+\]'
  r'(?:T\([\d,]+\))?|mesh\[[^\]]*\]'
  r'(?:,\s*device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))?\s*'
  r'\{[^}]*\})'
)
_PAIRS_RE = re.compile(r'source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}')


def _bracketed(text: str, start: int) -> tuple[list[str], int]:
  """The parts, split on top-level commas, inside the bracket opened at
  ``text[start]``, and the index of the bracket closing it."""
  parts, depth, begin = [], 0, start + 1
  for i in range(start, len(text)):
    if text[i] in '([{':
      depth += 1
    elif text[i] in ')]}':
      depth -= 1
      if depth == 0:
        break
    elif text[i] == ',' and depth == 1:
      parts.append(text[begin:i])
      begin = i + 1
  else:
    i = len(text)
  parts.append(text[begin:i])
  return [p for p in parts if p.strip()], i


def elements(shape: str) -> list[Element]:
  """Array elements of an HLO shape (a tuple shape gives several)."""
  return [
    (
      dtype,
      tuple(int(d.replace('<=', '')) for d in dims.split(',') if d.strip()),
    )
    for dtype, dims in _ELEMENT_RE.findall(shape)
    if dtype not in ('token', 'opaque')
  ]


def _parse_instruction(line: str) -> _Instruction | None:
  line = _COMMENT_RE.sub('', line)  # Long lists carry /*index=5*/ marks.
  m = _INSTRUCTION_RE.match(line)
  if not m:
    return None
  rest = m['rest']
  if rest.startswith('('):
    end = _bracketed(rest, 0)[1] + 1
  else:
    end = len(rest.split(' ', 1)[0])
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  tokens, close = _bracketed(rest, op.end() - 1)
  names = [re.fullmatch(r'(.*?)%?([\w.\-]+)', t.strip()) for t in tokens]
  return _Instruction(
    name=m['name'],
    shape=shape,
    opcode=op[1],
    operands=tuple((n[1].strip() or None, n[2]) for n in names if n),
    attrs=STRING_RE.sub('""', rest[close + 1 :]),
    raw=line,
  )


def parse_module(
  text: str,
) -> tuple[dict[str, list[_Instruction]], str | None, int, int]:
  """Computations by name, the entry's name, partitions and replicas."""
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  num_partitions, replica_count = 1, 1
  for line in text.splitlines():
    if line.startswith('HloModule'):
      header = STRING_RE.sub('""', line)
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


def callees(ins: _Instruction) -> list[str]:
  """Computations an instruction calls, other than a while's."""
  return [
    name
    for m in _CALLEE_RE.finditer(ins.attrs)
    for name in re.findall(r'%?([\w.\-]+)', m[1])
  ]


def _group_size(
  ins: _Instruction, kind: str, num_partitions: int, replica_count: int
) -> int:
  if kind == 'collective-permute':
    m = _PAIRS_RE.search(ins.attrs)
    pairs = re.findall(r'\{\s*(\d+)\s*,\s*(\d+)\s*\}', m[1]) if m else []
    return largest_component((int(s), int(t)) for s, t in pairs)
  m = _GROUPS_RE.search(ins.attrs)
  groups = parse_replica_groups(m[1]) if m else ()
  if groups:
    return max(len(g) for g in groups)
  if 'channel_id=' in ins.attrs:
    return num_partitions * replica_count
  return replica_count


def _full_elements(
  ins: _Instruction, kind: str, n: int, shapes: dict[str, str]
) -> list[Element]:
  """Elements of the full array that the byte formula for ``kind`` uses:
  the operands, but the result of an all-gather (its operands times ``n``
  along the gathered dimension for an async start, whose shape bundles
  operands, results and u32[] contexts)."""
  if kind == 'all-gather' and not ins.opcode.endswith('-start'):
    return elements(ins.shape)
  operands = [
    e for s, name in ins.operands for e in elements(s or shapes[name])
  ]
  if kind != 'all-gather':
    return operands
  dim = re.search(r'\bdimensions=\{(\d+)\}', ins.attrs)
  dim = int(dim[1]) if dim else 0
  return [
    (dtype, s[:dim] + (s[dim] * n,) + s[dim + 1 :] if s else s)
    for dtype, s in operands
  ]


def walk(
  computations: dict[str, list[_Instruction]],
  name: str,
  executions: int = 1,
  context: tuple[str, ...] = (),
  stack: tuple[str, ...] = (),
) -> Iterable[tuple[str, _Instruction, int, tuple[str, ...]]]:
  """``(computation, instruction, executions, context)`` of the computation
  ``name`` and, where called, of its callees: ``executions`` multiplies the
  known trip counts of the enclosing loops, ``context`` lists the enclosing
  ``'while'`` and ``'conditional'`` opcodes, outermost first."""
  if name not in computations or name in stack:
    return
  stack += (name,)
  for ins in computations[name]:
    yield name, ins, executions, context
    if ins.opcode == 'while':
      trip = TRIP_COUNT_RE.search(ins.raw)
      trips = int(trip[1]) if trip else 1
      for m in LOOP_RE.finditer(ins.attrs):
        # The condition runs once more than the body.
        extra = 1 if trip and m['key'] == 'condition' else 0
        runs = executions * (trips + extra)
        yield from walk(
          computations, m['name'], runs, context + ('while',), stack
        )
    elif ins.opcode not in ('async-done', 'async-update'):
      # (Those two call the op that their async-start does.)
      inner = context + ('conditional',) * (ins.opcode == 'conditional')
      for callee in callees(ins):
        yield from walk(computations, callee, executions, inner, stack)


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
    >>> from dmuon_jax import diagnostics
    >>> text = '''ENTRY main () -> f32[16] {
    ...   ROOT g = f32[16] all-gather(f32[8] x), replica_groups={{0,1}}
    ... }'''
    >>> (c,) = diagnostics.hlo_collectives(text)
    >>> c.kind, c.shape, c.group_size, c.bytes  # half of the 16 gathered f32s
    ('all-gather', (16,), 2, 32.0)
  """
  computations, entry, num_partitions, replica_count = parse_module(text)
  if num_devices is not None:
    num_partitions, replica_count = num_devices, 1
  if entry is not None:
    roots = [entry]
  else:  # A fragment without ENTRY: start from computations nobody calls.
    called = {
      callee
      for instructions in computations.values()
      for ins in instructions
      for callee in callees(ins)
      + [m['name'] for m in LOOP_RE.finditer(ins.attrs)]
    }
    roots = [c for c in computations if c not in called]
  shapes = {
    c: {i.name: i.shape for i in body} for c, body in computations.items()
  }
  out: list[Collective] = []
  for root in roots:
    for comp, ins, executions, context in walk(computations, root):
      if (kind := ins.opcode.removesuffix('-start')) in KINDS:
        n = _group_size(ins, kind, num_partitions, replica_count)
        full = _full_elements(ins, kind, n, shapes[comp])
        in_loop = 'while' in context
        out.append(
          make_collective(kind, ins.name, full, n, executions, in_loop)
        )
  return tuple(out)


# Moved to the repository's examples/benchmarks/hlo_tools.py (tooling for the
# tests and benchmarks); importable from here for one more release.
_MOVED = (
  'NestedCollective',
  'collective_nesting',
  'dot_flops',
  'stablehlo_collectives',
)


def __getattr__(name: str) -> Any:
  """A moved name, with a ``DeprecationWarning`` naming its new home."""
  if name not in _MOVED:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  path = pathlib.Path(__file__).parents[1] / 'examples/benchmarks/hlo_tools.py'
  warnings.warn(
    f'dmuon_jax.diagnostics.{name} moved to examples/benchmarks/hlo_tools.py'
    f' of the dmuon_jax repository ({path}); this alias goes in the next'
    ' release.',
    DeprecationWarning,
    stacklevel=2,
  )
  if not path.is_file():  # Not a source checkout (pip install -e .).
    raise AttributeError(f'{name} moved to {path}, which is not here.')
  return runpy.run_path(str(path))[name]


__all__ = (
  'KINDS',
  'Collective',
  'HloReport',
  'analyze',
  'analyze_compiled',
  'hlo_collectives',
  'parse_replica_groups',
)
