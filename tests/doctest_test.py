"""The docstring examples run, and every public name is documented.

The public names are those of the ``__all__`` of ``dmuon_jax`` and of its
public submodules. Each function and class must carry its Google-style
sections and a runnable example (run by ``test_examples_pass``, as optax
doctests its docs), and each public object must have exactly one entry in
the API reference (``docs/api``, read as text: the docs build itself runs
in CI, not here).
"""

import ast
import doctest
import functools
import importlib
import inspect
import pathlib
import re
import types

from absl.testing import absltest, parameterized

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_DOCS = ROOT / 'docs' / 'api'

# The public modules: their __all__ are the public names. dmuon_jax.flax is
# not imported by ``import dmuon_jax`` (flax is an optional extra).
PUBLIC_MODULES = (
  'dmuon_jax',
  'dmuon_jax.checkpoint',
  'dmuon_jax.diagnostics',
  'dmuon_jax.flax',
)


def _is_documented_object(obj) -> bool:
  """A function or class (what needs sections and an example)."""
  return inspect.isclass(obj) or inspect.isfunction(obj)


def _ours(obj) -> bool:
  return getattr(obj, '__module__', '').partition('.')[0] == 'dmuon_jax'


def _public_names():
  """``{public spelling: object}`` over every public ``__all__``."""
  names = {}
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    if module_name != 'dmuon_jax':
      names[module_name] = module
    for name in module.__all__:
      names[f'{module_name}.{name}'] = getattr(module, name)
  return names


PUBLIC = _public_names()


def _canonical(spelling: str, obj) -> str:
  """The one name an object is documented under.

  Its defining module's name when that module is public (so
  ``dmuon_jax.state_to_portable`` is documented as
  ``dmuon_jax.checkpoint.state_to_portable``); else the public spelling
  itself. A constant or module exported by a submodule and the top level
  is documented under the submodule.
  """
  if isinstance(obj, types.ModuleType):
    return obj.__name__
  if _is_documented_object(obj) and _ours(obj):
    if obj.__module__ in PUBLIC_MODULES[1:]:
      return f'{obj.__module__}.{obj.__name__}'
    return spelling
  for other, value in PUBLIC.items():
    if value is obj and other.count('.') > spelling.count('.'):
      return other
  return spelling


CANONICAL = {}  # canonical name -> object
ALIASES = {}  # public spelling -> canonical name, where they differ
for _spelling, _obj in PUBLIC.items():
  _name = _canonical(_spelling, _obj)
  CANONICAL[_name] = _obj
  if _name != _spelling:
    ALIASES[_spelling] = _name

# Functions and classes defined here (not re-exported from optax), by name.
OBJECTS = {
  name: obj
  for name, obj in CANONICAL.items()
  if _is_documented_object(obj) and _ours(obj)
}
FUNCTIONS = sorted(n for n, o in OBJECTS.items() if inspect.isfunction(o))
CLASSES = sorted(n for n, o in OBJECTS.items() if inspect.isclass(o))
# Re-exported from elsewhere (optax.contrib.MuonDimensionNumbers): a page
# with an example in docs/api, since their docstrings are not ours.
FOREIGN = sorted(
  n for n, o in CANONICAL.items() if _is_documented_object(o) and not _ours(o)
)
MODULES = sorted(
  n for n, o in CANONICAL.items() if isinstance(o, types.ModuleType)
)
CONSTANTS = sorted(set(CANONICAL) - set(OBJECTS) - set(FOREIGN) - set(MODULES))

# Every module that defines a public function or class: all are doctested.
DEFINING_MODULES = sorted({obj.__module__ for obj in OBJECTS.values()})


def _param_name(name: str) -> str:
  return name.removeprefix('dmuon_jax.').replace('.', '_') or 'dmuon_jax'


def _sections(doc: str) -> set[str]:
  """The Google-style section headers of a (dedented) docstring."""
  return set(re.findall(r'^[A-Z][A-Za-z ]*:$', doc, flags=re.M))


@functools.cache
def _module_tests(module_name: str) -> dict[str, doctest.DocTest]:
  """The doctests ``doctest.testmod`` runs for a module, by name."""
  module = importlib.import_module(module_name)
  return {t.name: t for t in doctest.DocTestFinder().find(module)}


def _attribute_docstring(module_name: str, name: str) -> str | None:
  """The string after ``name = ...`` in a module's source, following
  ``from X import name`` to the module that assigns it."""
  module = importlib.import_module(module_name)
  tree = ast.parse(inspect.getsource(module))
  for i, node in enumerate(tree.body):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, ast.AnnAssign):
      targets = [node.target]
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      after = tree.body[i + 1] if i + 1 < len(tree.body) else None
      if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
        return after.value.value
      return None
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        if (alias.asname or alias.name) == name:
          return _attribute_docstring(node.module, alias.name)
  return None


def _api_entries() -> list[tuple[str, str, bool]]:
  """``(full name, file, makes a page)`` for every entry of docs/api.

  An entry is a name listed under ``.. autosummary::`` (it makes a page
  when the block has ``:toctree:``) or an ``.. auto*::`` directive (its
  object is described where it stands). ``.. currentmodule::`` sets the
  module that relative names are in, as in Sphinx.
  """
  entries = []
  for path in sorted(API_DOCS.glob('*.*')):
    if path.suffix not in ('.md', '.rst'):
      continue
    module, block, toctree = None, None, False
    for line in path.read_text().splitlines():
      stripped = line.strip()
      indent = len(line) - len(line.lstrip())
      if block is not None:
        if not stripped or stripped.startswith(':'):
          toctree = toctree or stripped.startswith(':toctree:')
          continue
        if indent > block:
          name = stripped.lstrip('~')
          full = f'{module}.{name}' if module and name[0] != '.' else name
          entries.append((full, path.name, toctree))
          continue
        block = None
      if m := re.match(r'\.\. currentmodule:: (\S+)', stripped):
        module = None if m[1] == 'None' else m[1]
      elif stripped.startswith('.. autosummary::'):
        block, toctree = indent, False
      elif m := re.match(r'\.\. auto(\w+):: (\S+)', stripped):
        name = m[2]
        if m[1] != 'module' and module and not name.startswith(module):
          name = f'{module}.{name}'
        entries.append((name, path.name, True))
  return entries


@functools.cache
def _pages() -> dict[str, tuple[str, ...]]:
  """``{full name: files}`` of the entries that make or hold a page."""
  pages = {}
  for name, file, page in _api_entries():
    if page:
      pages[name] = pages.get(name, ()) + (file,)
  return pages


class DoctestTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (name.removeprefix('dmuon_jax.').strip('_'), name)
    for name in DEFINING_MODULES
  )
  def test_examples_pass(self, name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    self.assertEqual(result.failed, 0, f'{name}: {result}')
    # A module without examples would pass whatever the code does.
    self.assertGreater(result.attempted, 0, f'{name}: no example ran')

  def test_api_page_examples_pass(self):
    # Examples written in docs/api itself (for names whose docstrings are
    # not ours, e.g. optax's MuonDimensionNumbers).
    attempted = 0
    for path in sorted(API_DOCS.glob('*.rst')):
      result = doctest.testfile(
        str(path), module_relative=False, optionflags=doctest.ELLIPSIS
      )
      self.assertEqual(result.failed, 0, f'{path.name}: {result}')
      attempted += result.attempted
    self.assertGreater(attempted, 0)


class DocstringTest(parameterized.TestCase):
  """Every public function and class: its sections and a running example.

  ``test_examples_pass`` runs every example of the modules that define
  them; this checks that each object has one that it runs.
  """

  def assert_has_running_example(self, name, obj):
    doc = inspect.getdoc(obj) or ''
    self.assertIn('Examples:', _sections(doc), f'{name}: no Examples:')
    test = _module_tests(obj.__module__).get(
      f'{obj.__module__}.{obj.__qualname__}'
    )
    self.assertIsNotNone(test, f'{name}: doctest.testmod does not see it')
    self.assertNotEmpty(test.examples, f'{name}: no >>> example')
    self.assertIn(obj.__module__, DEFINING_MODULES)

  @parameterized.named_parameters((_param_name(n), n) for n in FUNCTIONS)
  def test_function(self, name):
    fn = OBJECTS[name]
    sections = _sections(inspect.getdoc(fn) or '')
    self.assertIn('Args:', sections, f'{name}: no Args:')
    self.assertIn('Returns:', sections, f'{name}: no Returns:')
    self.assert_has_running_example(name, fn)

  @parameterized.named_parameters((_param_name(n), n) for n in CLASSES)
  def test_class(self, name):
    cls = OBJECTS[name]
    doc = inspect.getdoc(cls) or ''
    self.assertTrue(doc.split('\n\n')[0].strip(), f'{name}: no description')
    self.assertTrue(
      {'Attributes:', 'Args:'} & _sections(doc),
      f'{name}: no Attributes: (or Args:, for a class users construct)',
    )
    self.assert_has_running_example(name, cls)

  @parameterized.named_parameters((_param_name(n), n) for n in CONSTANTS)
  def test_constant(self, name):
    module, _, attr = name.rpartition('.')
    doc = _attribute_docstring(module, attr)
    self.assertTrue(doc and doc.strip(), f'{name}: no attribute docstring')

  @parameterized.named_parameters((_param_name(n), n) for n in MODULES)
  def test_module(self, name):
    self.assertTrue(inspect.getdoc(importlib.import_module(name)))


class ApiReferenceTest(parameterized.TestCase):
  """docs/api has one page (or one description) per public object."""

  @parameterized.named_parameters((_param_name(n), n) for n in CANONICAL)
  def test_has_one_page(self, name):
    pages = _pages().get(name, [])
    # Two would be duplicate object descriptions: a Sphinx warning.
    self.assertLen(pages, 1, f'{name}: pages in docs/api: {pages}')

  @parameterized.named_parameters((_param_name(n), n) for n in ALIASES)
  def test_alias_is_listed(self, name):
    # Documented once, under its module; the top-level spelling is listed
    # (docs/api/index.md, "Top-level aliases") and gets no page of its own.
    text = (API_DOCS / 'index.md').read_text()
    self.assertIn(f'`{name}`', text)
    self.assertNotIn(name, _pages())

  def test_no_page_for_a_name_that_is_not_public(self):
    stale = sorted(set(_pages()) - set(CANONICAL))
    self.assertEmpty(stale, 'docs/api documents names that are not public')

  def test_foreign_classes_have_an_example(self):
    # Their docstrings are not ours: the page adds the description and an
    # example (run by test_api_page_examples_pass).
    for name in FOREIGN:
      (file,) = _pages()[name]
      self.assertIn('>>>', (API_DOCS / file).read_text(), name)


if __name__ == '__main__':
  absltest.main()
