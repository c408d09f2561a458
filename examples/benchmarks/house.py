"""Issue 51's measures of the package's size and shape ("One house").

Reads every ``.py`` file under ``--package`` with :mod:`ast` and
:mod:`tokenize` (nothing is imported or run) and prints one line per measure,
each beside its target with PASS or FAIL, then the whole report as one JSON
line:

- code lines: lines holding a code token (not blank, not only a comment, not
  part of a module, class or function docstring), each line counted once;
- modules: the number of ``.py`` files;
- largest module: its physical lines (and code lines);
- longest function or method in code lines (its docstring left out, nested
  functions counted in the function that holds them), and every function over
  120 code lines;
- import cycles among the package's own modules: every ``import`` and
  ``from ... import`` (module level, inside functions, under
  ``if TYPE_CHECKING:``, relative or absolute) is an edge to the module it
  names (``from pkg import _x`` to ``pkg._x``, ``from pkg import name`` to
  ``pkg``); importing ``pkg._x`` is not counted as importing ``pkg`` itself.
  Each strongly connected component of more than one module (Tarjan) is one
  cycle, printed with one closed path through it;
- ``__class__`` assignments: ``x.__class__ = ...`` (plain, augmented or
  annotated targets, inside tuples too) and ``object.__setattr__(x,
  '__class__', ...)`` or ``setattr(x, '__class__', ...)`` calls;
- ``ContextVar(...)`` constructions;
- module-level mutable containers written inside a function: names bound at
  module level to a dict, list or set literal or comprehension, a
  ``dict()``/``list()``/``set()`` call, a ``collections.*`` call or a
  ``weakref`` dictionary or set, which some function (of any module of the
  package, through ``from m import NAME`` or ``m.NAME`` too) mutates:
  ``NAME.add/append/update/setdefault/pop/popitem/clear/extend/insert/remove/
  discard(...)`` (``NAME[k].append(...)`` too), ``NAME[...] = ...``,
  ``NAME[...] += ...``, ``del NAME[...]``, or ``global NAME`` and a rebinding.
  Other ``global`` rebindings are listed for information.

    python examples/benchmarks/house.py                  # dmuon_jax
    python examples/benchmarks/house.py --json           # the JSON line only

The exit code is 0 whatever the measures: this is a report, not a check.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The targets.
MAX_CODE_LINES = 8500
MAX_MODULES = 26
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 120
MAX_CONTEXT_VARS = 1

NON_CODE_TOKENS = frozenset(
  {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
  }
)
MUTATING_METHODS = frozenset(
  {
    'add',
    'append',
    'update',
    'setdefault',
    'pop',
    'popitem',
    'clear',
    'extend',
    'insert',
    'remove',
    'discard',
  }
)
CONTAINER_CALLS = frozenset({'dict', 'list', 'set'})
WEAKREF_CONTAINERS = frozenset(
  {'WeakKeyDictionary', 'WeakValueDictionary', 'WeakSet'}
)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
# Statements whose blocks are still module level.
BLOCKS = (
  ast.If,
  ast.For,
  ast.AsyncFor,
  ast.While,
  ast.With,
  ast.AsyncWith,
  ast.Try,
  ast.TryStar,
)


@dataclasses.dataclass
class Module:
  name: str  # dotted, e.g. dmuon_jax._alias
  path: pathlib.Path
  is_package: bool  # an __init__.py
  text: str
  tree: ast.Module
  code_lines: set[int]  # line numbers holding code tokens


def is_string_statement(node) -> bool:
  return (
    isinstance(node, ast.Expr)
    and isinstance(node.value, ast.Constant)
    and isinstance(node.value.value, str)
  )


def attribute_docstring_lines(tree: ast.Module) -> set[int]:
  """Lines of bare string statements that are not docstrings (information).

  Sphinx reads a string right after an assignment as the attribute's
  docstring; the issue's measure counts these lines as code.
  """
  docstrings = {
    id(node.body[0])
    for node in ast.walk(tree)
    if isinstance(
      node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    )
    and node.body
    and is_string_statement(node.body[0])
  }
  return {
    line
    for node in ast.walk(tree)
    if is_string_statement(node) and id(node) not in docstrings
    for line in range(node.lineno, node.end_lineno + 1)
  }


def docstring_spans(tree: ast.Module) -> list[tuple[tuple[int, int], ...]]:
  """The (start, end) positions of every module/class/function docstring."""
  spans = []
  for node in ast.walk(tree):
    if not isinstance(
      node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    ):
      continue
    body = node.body
    if body and is_string_statement(body[0]):
      expr = body[0]
      spans.append(
        (
          (expr.lineno, expr.col_offset),
          (expr.end_lineno, expr.end_col_offset),
        )
      )
  return spans


def code_lines(text: str, tree: ast.Module) -> set[int]:
  """Line numbers that hold a code token (a multi-line token: all its lines)."""
  spans_by_line = {}  # line -> the docstring spans over it
  for lo, hi in docstring_spans(tree):
    for line in range(lo[0], hi[0] + 1):
      spans_by_line.setdefault(line, []).append((lo, hi))
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type in NON_CODE_TOKENS:
      continue
    if any(
      lo <= tok.start and tok.end <= hi
      for lo, hi in spans_by_line.get(tok.start[0], ())
    ):
      continue
    lines.update(range(tok.start[0], tok.end[0] + 1))
  return lines


def load(package: pathlib.Path) -> dict[str, Module]:
  modules = {}
  for path in sorted(package.rglob('*.py')):
    parts = path.relative_to(package.parent).with_suffix('').parts
    is_package = parts[-1] == '__init__'
    if is_package:
      parts = parts[:-1]
    text = path.read_text(encoding='utf-8')
    tree = ast.parse(text, filename=str(path))
    name = '.'.join(parts)
    modules[name] = Module(
      name, path, is_package, text, tree, code_lines(text, tree)
    )
  return modules


def functions(module: Module):
  """Yields (qualified name, node) for every function and method."""

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        qualname = prefix + child.name
        yield qualname, child
        yield from visit(child, qualname + '.<locals>.')
      elif isinstance(child, ast.ClassDef):
        yield from visit(child, prefix + child.name + '.')
      else:
        yield from visit(child, prefix)

  yield from visit(module.tree, '')


def function_sizes(modules: dict[str, Module]) -> list[tuple[str, int]]:
  sizes = []
  for module in modules.values():
    for qualname, node in functions(module):
      span = range(node.lineno, node.end_lineno + 1)
      count = sum(1 for line in span if line in module.code_lines)
      sizes.append((f'{module.name}:{qualname}', count))
  return sorted(sizes, key=lambda s: (-s[1], s[0]))


# Imports.


def base_package(module: Module, level: int) -> str | None:
  """The package a relative import of ``level`` dots starts from."""
  parts = module.name.split('.')
  if not module.is_package:
    parts = parts[:-1]
  drop = level - 1
  if drop > len(parts):
    return None
  return '.'.join(parts[: len(parts) - drop]) if drop else '.'.join(parts)


def import_nodes(tree: ast.Module):
  """Yields (import node, where): 'module', 'function' or 'TYPE_CHECKING'."""

  def visit(node, where):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        yield child, where
      elif isinstance(child, FUNCTIONS):
        yield from visit(child, 'function')
      elif isinstance(child, ast.If) and 'TYPE_CHECKING' in ast.unparse(
        child.test
      ):
        for statement in child.body:
          yield from visit(ast.Module([statement], []), 'TYPE_CHECKING')
        for statement in child.orelse:
          yield from visit(ast.Module([statement], []), where)
      else:
        yield from visit(child, where)

  yield from visit(tree, 'module')


def imports(module: Module, names: set[str]):
  """Yields (target, line, where) for each import of another package module."""
  for node, where in import_nodes(module.tree):
    targets = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    else:
      if node.level:
        base = base_package(module, node.level)
        if base is None:
          continue
        source = f'{base}.{node.module}' if node.module else base
      else:
        source = node.module
      for alias in node.names:
        sub = f'{source}.{alias.name}'
        targets.append(sub if sub in names else source)
    for target in targets:
      # `import pkg._x.y` names pkg._x.y; take the longest package module.
      while target and target not in names:
        target = target.rpartition('.')[0]
      if target and target != module.name:
        yield target, node.lineno, where


def import_graph(modules: dict[str, Module]):
  names = set(modules)
  # name -> {target: {where: line of the first such import}}
  graph = {name: {} for name in modules}
  for module in modules.values():
    for target, line, where in imports(module, names):
      graph[module.name].setdefault(target, {}).setdefault(where, line)
  return graph


def runtime_graph(graph, wheres):
  """The edges with an import of one of ``wheres`` kinds."""
  return {
    a: {b: w for b, w in edges.items() if wheres & set(w)}
    for a, edges in graph.items()
  }


def edge(graph, a, b) -> dict:
  """An import edge: {'from', 'to', 'lines': {where: first line}}."""
  return {'from': a, 'to': b, 'lines': graph[a][b]}


def edge_text(e: dict) -> str:
  wheres = ', '.join(f'{w} line {line}' for w, line in e['lines'].items())
  return f'{e["from"]} -> {e["to"]} ({wheres})'


def strongly_connected(graph) -> list[list[str]]:
  """Tarjan's algorithm (iterative); components of more than one node."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []
  counter = 0
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter
    counter += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        parent = work[-1][0]
        low[parent] = min(low[parent], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1:
          found.append(sorted(component))
  return sorted(found)


def closed_path(graph, component: list[str]) -> list[str]:
  """A shortest cycle through the component's first module (BFS)."""
  members = set(component)
  start = component[0]
  previous = {start: None}
  queue = [start]
  for node in queue:
    for child in sorted(graph[node]):
      if child == start:
        path = [node]
        while previous[path[-1]] is not None:
          path.append(previous[path[-1]])
        return [*reversed(path), start]
      if child in members and child not in previous:
        previous[child] = node
        queue.append(child)
  return component


# __class__ assignments and ContextVars.


def flat_targets(target):
  if isinstance(target, (ast.Tuple, ast.List)):
    for element in target.elts:
      yield from flat_targets(element)
  elif isinstance(target, ast.Starred):
    yield from flat_targets(target.value)
  else:
    yield target


def class_assignments(module: Module) -> list[str]:
  found = []
  for node in ast.walk(module.tree):
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    elif isinstance(node, ast.Call):
      func = node.func
      is_setattr = (
        isinstance(func, ast.Attribute) and func.attr == '__setattr__'
      ) or (isinstance(func, ast.Name) and func.id == 'setattr')
      if (
        is_setattr
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == '__class__'
      ):
        found.append(f'{module.path.name}:{node.lineno}')
      continue
    else:
      continue
    for target in targets:
      for t in flat_targets(target):
        if isinstance(t, ast.Attribute) and t.attr == '__class__':
          found.append(f'{module.path.name}:{node.lineno}')
  return found


def context_vars(module: Module) -> list[str]:
  found = []
  for node in ast.walk(module.tree):
    if isinstance(node, ast.Call):
      func = node.func
      name = (
        func.attr
        if isinstance(func, ast.Attribute)
        else (func.id if isinstance(func, ast.Name) else None)
      )
      if name == 'ContextVar':
        found.append(f'{module.path.name}:{node.lineno}')
  return found


# Module-level mutable containers.


def module_level_statements(body):
  """Module-level statements, into if/try/with/for blocks, not defs/classes."""
  for node in body:
    yield node
    if isinstance(node, BLOCKS):
      for field in ('body', 'orelse', 'finalbody'):
        yield from module_level_statements(getattr(node, field, []))
      for handler in getattr(node, 'handlers', []):
        yield from module_level_statements(handler.body)


def imported_names(module: Module, prefix: str):
  """Names bound by `import m as a` / `from m import x`, anywhere in a module.

  Returns ({local: module name}, {local: (module name, attribute)}).
  """
  module_aliases, attributes = {}, {}
  for node in ast.walk(module.tree):  # imports inside functions too
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.asname and alias.name.startswith(prefix):
          module_aliases[alias.asname] = alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        source = base_package(module, node.level)
        if source and node.module:
          source = f'{source}.{node.module}'
      else:
        source = node.module
      if not source:
        continue
      for alias in node.names:
        local = alias.asname or alias.name
        module_aliases[local] = f'{source}.{alias.name}'
        attributes[local] = (source, alias.name)
  return module_aliases, attributes


def is_container(value, collections_names: set[str]) -> bool:
  if isinstance(
    value,
    (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp),
  ):
    return True
  if not isinstance(value, ast.Call):
    return False
  func = value.func
  if isinstance(func, ast.Name):
    return func.id in CONTAINER_CALLS or func.id in collections_names
  if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
    owner = func.value.id
    return owner == 'collections' or (
      owner == 'weakref' and func.attr in WEAKREF_CONTAINERS
    )
  return False


def module_containers(module: Module) -> dict[str, int]:
  """Module-level names bound to a mutable container: {name: line}."""
  collections_names = set()
  for node in module_level_statements(module.tree.body):
    if isinstance(node, ast.ImportFrom) and node.module in (
      'collections',
      'weakref',
    ):
      for alias in node.names:
        if node.module == 'collections' or alias.name in WEAKREF_CONTAINERS:
          collections_names.add(alias.asname or alias.name)
  found = {}
  for node in module_level_statements(module.tree.body):
    if isinstance(node, ast.Assign):
      targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
      targets, value = [node.target], node.value
    else:
      continue
    if not is_container(value, collections_names):
      continue
    for target in targets:
      for t in flat_targets(target):
        if isinstance(t, ast.Name):
          found.setdefault(t.id, node.lineno)
  return found


def local_names(func) -> set[str]:
  """Names a function binds locally (parameters, assignments), not global."""
  names, declared_global = set(), set()
  args = func.args
  for arg in [
    *args.posonlyargs,
    *args.args,
    *args.kwonlyargs,
    args.vararg,
    args.kwarg,
  ]:
    if arg is not None:
      names.add(arg.arg)
  body = func.body if isinstance(func.body, list) else [func.body]
  stack = list(body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Global, ast.Nonlocal)):
      declared_global.update(node.names)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      names.add(node.name)
      stack.extend(node.decorator_list)
      continue  # its body is its own scope
    elif isinstance(node, ast.ClassDef):
      names.add(node.name)
      continue
    elif isinstance(node, ast.Lambda):
      continue
    stack.extend(ast.iter_child_nodes(node))
  return names - declared_global


def written_root(node):
  """The object a write goes into: `x` of x[...] / x[k][...] / x.m(...)."""
  while isinstance(node, ast.Subscript):
    node = node.value
  return node


def function_writes(func):
  """Yields (receiver expression, line, how) for each write in a function."""
  body = func.body if isinstance(func.body, list) else [func.body]
  stack = list(body)
  globals_declared, stored = set(), []
  while stack:
    node = stack.pop()
    if isinstance(node, FUNCTIONS) or isinstance(node, ast.ClassDef):
      continue  # visited as their own functions
    stack.extend(ast.iter_child_nodes(node))
    if isinstance(node, ast.Global):
      globals_declared.update(node.names)
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      stored.append(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      if node.func.attr in MUTATING_METHODS:
        yield written_root(node.func.value), node.lineno, f'.{node.func.attr}()'
    targets = []
    if isinstance(node, (ast.Assign, ast.Delete)):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    for target in targets:
      for t in flat_targets(target):
        if isinstance(t, ast.Subscript):
          how = 'del [...]' if isinstance(node, ast.Delete) else '[...] ='
          yield written_root(t.value), node.lineno, how
  for node in stored:
    if node.id in globals_declared:
      yield node, node.lineno, 'global rebinding'


def mutated_containers(modules: dict[str, Module], prefix: str):
  """Module-level containers written in functions, and other global writes."""
  containers = {name: module_containers(m) for name, m in modules.items()}
  mutated = {}  # (module, name) -> [where]
  other_globals = []
  for module in modules.values():
    module_aliases, attributes = imported_names(module, prefix)
    for node in ast.walk(module.tree):
      if not isinstance(node, FUNCTIONS):
        continue
      local = local_names(node)
      for receiver, line, how in function_writes(node):
        owner = name = None
        if isinstance(receiver, ast.Name) and receiver.id not in local:
          if receiver.id in containers[module.name]:
            owner, name = module.name, receiver.id
          elif receiver.id in attributes:
            owner, name = attributes[receiver.id]
        elif (
          isinstance(receiver, ast.Attribute)
          and isinstance(receiver.value, ast.Name)
          and receiver.value.id not in local
          and receiver.value.id in module_aliases
        ):
          owner, name = module_aliases[receiver.value.id], receiver.attr
        where = f'{module.path.name}:{line} {how}'
        if owner in containers and name in containers[owner]:
          mutated.setdefault((owner, name), []).append(where)
        elif how == 'global rebinding':
          other_globals.append(f'{receiver.id} ({where})')
  return mutated, sorted(set(other_globals))


# The report.


def measure(package: pathlib.Path) -> dict:
  modules = load(package)
  prefix = package.name
  sizes = function_sizes(modules)
  graph = import_graph(modules)
  cycles = strongly_connected(graph)
  at_run = strongly_connected(runtime_graph(graph, {'module', 'function'}))
  at_import = strongly_connected(runtime_graph(graph, {'module'}))
  mutated, other_globals = mutated_containers(modules, prefix)
  largest = max(modules.values(), key=lambda m: len(m.text.splitlines()))
  class_sets = [w for m in modules.values() for w in class_assignments(m)]
  ctx_vars = [w for m in modules.values() for w in context_vars(m)]
  long_functions = [
    {'function': name, 'code_lines': n}
    for name, n in sizes
    if n > MAX_FUNCTION_LINES
  ]
  return {
    'package': str(package),
    'code_lines': sum(len(m.code_lines) for m in modules.values()),
    'physical_lines': sum(len(m.text.splitlines()) for m in modules.values()),
    # Information: code lines less the attribute docstrings' lines.
    'code_lines_without_attribute_docstrings': sum(
      len(m.code_lines - attribute_docstring_lines(m.tree))
      for m in modules.values()
    ),
    'modules': len(modules),
    'largest_module': {
      'module': largest.name,
      'lines': len(largest.text.splitlines()),
      'code_lines': len(largest.code_lines),
    },
    'longest_function': (
      {'function': sizes[0][0], 'code_lines': sizes[0][1]} if sizes else None
    ),
    'functions_over_limit': long_functions,
    'import_cycles': [
      {
        'modules': component,
        'path': [
          edge(graph, a, b)
          for path in [closed_path(graph, component)]
          for a, b in zip(path, path[1:])
        ],
        'edges': [
          edge(graph, a, b)
          for a in component
          for b in sorted(graph[a])
          if b in component
        ],
      }
      for component in cycles
    ],
    # Information: the cycles left without `if TYPE_CHECKING:` imports, and
    # those of module-level imports only (what import order can break on).
    'import_cycles_without_type_checking': at_run,
    'import_cycles_module_level': at_import,
    'class_assignments': class_sets,
    'context_vars': ctx_vars,
    'mutated_module_containers': [
      {'module': owner, 'name': name, 'writes': writes}
      for (owner, name), writes in sorted(mutated.items())
    ],
    'other_global_rebindings': other_globals,
  }


def targets(report: dict) -> list[dict]:
  rows = [
    ('code lines', report['code_lines'], '<=', MAX_CODE_LINES),
    ('modules', report['modules'], '<=', MAX_MODULES),
    (
      'largest module (lines)',
      report['largest_module']['lines'],
      '<=',
      MAX_MODULE_LINES,
    ),
    (
      f'functions over {MAX_FUNCTION_LINES} code lines',
      len(report['functions_over_limit']),
      '==',
      0,
    ),
    ('import cycles', len(report['import_cycles']), '==', 0),
    ('__class__ assignments', len(report['class_assignments']), '==', 0),
    (
      'ContextVar constructions',
      len(report['context_vars']),
      '<=',
      MAX_CONTEXT_VARS,
    ),
    (
      'module-level containers written in functions',
      len(report['mutated_module_containers']),
      '==',
      0,
    ),
  ]
  return [
    {
      'measure': name,
      'value': value,
      'target': f'{op} {limit}',
      'pass': value <= limit if op == '<=' else value == limit,
    }
    for name, value, op, limit in rows
  ]


def print_report(report: dict, rows: list[dict]) -> None:
  def line(index, detail=''):
    row = rows[index]
    verdict = 'PASS' if row['pass'] else 'FAIL'
    print(
      f'{row["measure"]}: {row["value"]}{detail}  '
      f'(target {row["target"]}: {verdict})'
    )

  print(f'package: {report["package"]}')
  line(
    0,
    f' ({report["physical_lines"]} physical;'
    f' {report["code_lines_without_attribute_docstrings"]} without'
    ' attribute docstrings)',
  )
  line(1)
  largest = report['largest_module']
  line(2, f' ({largest["module"]}, {largest["code_lines"]} code lines)')
  longest = report['longest_function']
  if longest:
    print(
      f'longest function: {longest["function"]} '
      f'({longest["code_lines"]} code lines)'
    )
  line(3)
  for f in report['functions_over_limit']:
    print(f'  {f["function"]}: {f["code_lines"]}')
  line(4)
  for cycle in report['import_cycles']:
    print(f'  {len(cycle["modules"])} modules: {", ".join(cycle["modules"])}')
    print('    a closed path:')
    for e in cycle['path']:
      print(f'      {edge_text(e)}')
    print('    its imports among these modules:')
    for e in cycle['edges']:
      print(f'      {edge_text(e)}')
  for key, what in (
    ('import_cycles_without_type_checking', 'without TYPE_CHECKING imports'),
    ('import_cycles_module_level', 'of module-level imports only'),
  ):
    print(f'  (information) import cycles {what}: {len(report[key])}')
    for component in report[key]:
      print(f'    {", ".join(component)}')
  line(5)
  for where in report['class_assignments']:
    print(f'  {where}')
  line(6)
  for where in report['context_vars']:
    print(f'  {where}')
  line(7)
  for c in report['mutated_module_containers']:
    print(f'  {c["module"]}.{c["name"]}: {"; ".join(c["writes"])}')
  if report['other_global_rebindings']:
    print('other `global` rebindings (information, no target):')
    for where in report['other_global_rebindings']:
      print(f'  {where}')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    '--package',
    default='dmuon_jax',
    help='the package directory to measure (relative to the current '
    "directory, else to the repository's root)",
  )
  parser.add_argument(
    '--json',
    action='store_true',
    help='print only the JSON line (by default the measures, then it)',
  )
  args = parser.parse_args(argv)
  package = pathlib.Path(args.package)
  if not package.is_dir() and not package.is_absolute():
    package = ROOT / package
  if not package.is_dir():
    print(f'house: no package directory {args.package!r}', file=sys.stderr)
    return 0
  report = measure(package.resolve())
  report['package'] = args.package
  rows = targets(report)
  if not args.json:
    print_report(report, rows)
  report['targets'] = rows
  print(json.dumps(report))
  return 0


if __name__ == '__main__':
  sys.exit(main())
