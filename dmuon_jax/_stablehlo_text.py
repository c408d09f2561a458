"""StableHLO (MLIR) module text: collective ops, tensor types, attributes."""

from __future__ import annotations

import re

import numpy as np

from dmuon_jax import _hlo_text

MLIR_OP_RE = re.compile(
  r'(?P<result>%[\w#:]+)\s*=\s*"stablehlo\.(?P<op>all_gather|reduce_scatter|'
  r'all_reduce|all_to_all|collective_permute|collective_broadcast)"\('
)
MLIR_FUNC_RE = re.compile(r'\bfunc\.func\s+(?:\w+\s+)*@(?P<name>[\w.$\-]+)')
MLIR_CALL_RE = re.compile(r'\bcall\s+@(?P<name>[\w.$\-]+)')
_MLIR_TENSOR_RE = re.compile(
  r'tensor<(?P<dims>(?:(?:\d+|\?)x)*)(?P<dtype>complex<\w+>|\w+)[^<>]*>'
)
MLIR_SIGNATURE_RE = re.compile(r':\s*\((?P<ins>[^()]*)\)\s*->\s*(?P<outs>.*)$')


def _mlir_dtype(dtype: str) -> str:
  """MLIR element type to the HLO spelling: ``i32`` -> ``s32``."""
  if dtype == 'i1':
    return 'pred'
  if m := re.fullmatch(r'(ui|si|i)(\d+)', dtype):
    return ('u' if m[1] == 'ui' else 's') + m[2]
  if m := re.fullmatch(r'complex<f(\d+)>', dtype):
    return f'c{2 * int(m[1])}'
  return dtype.lower()


def mlir_elements(types: str) -> list[_hlo_text.Element]:
  out = []
  for m in _MLIR_TENSOR_RE.finditer(types):
    dims = tuple(0 if d == '?' else int(d) for d in m['dims'].split('x') if d)
    out.append((_mlir_dtype(m['dtype']), dims))
  return out


def mlir_matrix(attrs: str, name: str) -> list[tuple[int, ...]] | None:
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
