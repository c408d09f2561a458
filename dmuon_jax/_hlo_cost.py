"""FLOPs and memory of a compiled program: XLA's and the HLO's matmuls."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import jax
import numpy as np

from dmuon_jax import _hlo_text


def flops(compiled: Any) -> float:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # Not every backend has it.
    return 0.0
  if isinstance(cost, (list, tuple)):  # Older jax: one dict per program.
    cost = cost[0] if cost else None
  if not cost:
    return 0.0
  return float(cost.get('flops', 0.0))


def memory_fields(compiled: Any) -> dict[str, int | None]:
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
  comps, entry, _, _ = _hlo_text.parse_module(text)
  memo: dict[str, Any] = {}
  warned: list[str] = []

  def cost(name):
    """A float, or with ``branches_per_device`` an array: per slot."""
    if name in memo:
      return memo[name]
    memo[name] = np.zeros(n) if n else 0.0  # Guards against cycles.
    shapes = {
      ins.name: _hlo_text.elements(ins.shape) for ins in comps.get(name, ())
    }
    total = np.zeros(n) if n else 0.0
    for ins in comps.get(name, ()):
      if ins.opcode == 'dot':
        inline, lhs_name = ins.operands[0]
        lhs = _hlo_text.elements(inline) if inline else shapes.get(lhs_name)
        out = _hlo_text.elements(ins.shape)
        dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins.attrs)
        if not lhs or not out or dims is None:
          continue
        contracted = math.prod(
          lhs[0][1][int(d)] for d in dims[1].split(',') if d
        )
        total += 2.0 * math.prod(out[0][1]) * contracted
      elif ins.opcode == 'conditional':
        callees = _hlo_text.callees(ins)
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
        trip = (
          _hlo_text.TRIP_COUNT_RE.search(ins.raw) if loop_trip_counts else None
        )
        trips = int(trip[1]) if trip else 1
        total += cost(body[1]) * trips if body else 0.0
      else:
        total += sum(cost(c) for c in _hlo_text.callees(ins))
    memo[name] = total
    return total

  return float(np.max(cost(entry))) if entry else 0.0
