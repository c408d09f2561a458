"""Compiled HLO module text: instructions, computations, replica groups."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import numpy as np

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


def largest_component(pairs: Iterable[tuple[int, int]]) -> int:
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


def elements(shape: str) -> list[Element]:
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
    attrs=STRING_RE.sub('""', rest[close + 1 :]),
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
  out = []
  for m in _CALLEE_RE.finditer(ins.attrs):
    out.extend(re.findall(r'%?([\w.\-]+)', m[1]))
  return out


def group_size(
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


def _gather_dimension(ins: _Instruction) -> int:
  m = re.search(r'\bdimensions=\{(\d+)\}', ins.attrs)
  return int(m[1]) if m else 0


def _scaled(elements: list[Element], dim: int, factor: float) -> list[Element]:
  out = []
  for dtype, shape in elements:
    shape = list(shape)
    if shape:
      shape[dim] = int(shape[dim] * factor)
    out.append((dtype, tuple(shape)))
  return out


def full_elements(
  ins: _Instruction, kind: str, n: int, shapes: dict[str, str]
) -> list[Element]:
  """Elements of the full array that the byte formula for ``kind`` uses."""
  operands: list[Element] | None = []
  for inline, name in ins.operands:
    text = inline or shapes.get(name)
    if text is None:  # Not in this computation: fall back to the result.
      operands = None
      break
    operands.extend(elements(text))
  result = elements(ins.shape)
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
