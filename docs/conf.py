"""Sphinx configuration: the API reference from the package's docstrings,
guides and reference pages in MyST Markdown. Build (warnings are errors):

  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import ast
import importlib
import os
import sys

sys.path.insert(0, os.path.abspath('..'))

project = 'dmuon_jax'
author = 'The dmuon_jax developers'
copyright = '2026, The dmuon_jax developers'

extensions = [
  'myst_parser',
  'sphinx.ext.autodoc',
  'sphinx.ext.autosummary',
  'sphinx.ext.napoleon',
  'sphinx.ext.mathjax',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
exclude_patterns = ['_build']
templates_path = ['_templates']
myst_enable_extensions = ['colon_fence', 'dollarmath']
myst_heading_anchors = 3

# docs/api/index.md lists every public name; autosummary writes one page per
# name (docs/api/_autosummary/, from docs/_templates/autosummary/).
autosummary_generate = True
autosummary_ignore_module_all = False
autodoc_typehints = 'description'
# Types only where the docstring documents the parameter (a dataclass's
# fields are its Attributes:, not a second, empty parameter list).
autodoc_typehints_description_target = 'documented'
autodoc_member_order = 'bysource'
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = 'furo'
html_title = 'dmuon_jax'

# Public modules whose names may also be exported at the top level.
_PUBLIC_MODULES = ('dmuon_jax.checkpoint', 'dmuon_jax.diagnostics')


def _top_level_aliases():
  """``{'dmuon_jax.X': 'dmuon_jax.sub.Y'}`` for top-level re-exports.

  Such a name is documented once, under its module; a cross-reference to
  the top-level spelling resolves to that page.
  """
  import dmuon_jax

  aliases = {}
  for module_name in _PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    aliases[module_name] = module_name
    for sub_name in module.__all__:
      obj = getattr(module, sub_name)
      for name in dmuon_jax.__all__:
        if getattr(dmuon_jax, name) is obj:
          aliases[f'dmuon_jax.{name}'] = f'{module_name}.{sub_name}'
  return aliases


def _reexported_data_docs():
  """Attribute docstrings of constants ``dmuon_jax/__init__.py`` imports.

  autodoc reads a constant's docstring (the string after its assignment)
  from the module it is documented under; ``dmuon_jax.NS_COEFF_PRESETS`` is
  assigned in a private module.
  """
  from sphinx.pycode import ModuleAnalyzer

  import dmuon_jax

  with open(dmuon_jax.__file__, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  docs = {}
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        name = alias.asname or alias.name
        value = getattr(dmuon_jax, name, None)
        if callable(value) or not name.isupper():
          continue
        attr_docs = ModuleAnalyzer.for_module(node.module).find_attr_docs()
        if ('', alias.name) in attr_docs:
          docs[f'dmuon_jax.{name}'] = list(attr_docs['', alias.name])
  return docs


_ALIASES = _top_level_aliases()
_DATA_DOCS = _reexported_data_docs()


def _resolve_alias(app, env, node, contnode):
  if node.get('refdomain') != 'py':
    return None
  target = node['reftarget'].removeprefix('~').lstrip('.')
  module = node.get('py:module')
  for candidate in (target, f'{module}.{target}' if module else None):
    if candidate in _ALIASES:
      return env.get_domain('py').resolve_xref(
        env,
        node['refdoc'],
        app.builder,
        node['reftype'],
        _ALIASES[candidate],
        node,
        contnode,
      )
  return None


def _data_docstring(app, what, name, obj, options, lines):
  del app, obj, options
  if what == 'data' and name in _DATA_DOCS:
    lines[:] = _DATA_DOCS[name]


def _skip_fields(app, what, name, obj, skip, options):
  """Leaves NamedTuple fields to the class's ``Attributes:`` section."""
  del app, what, name, options
  if type(obj).__name__ == '_tuplegetter':
    return True
  return skip


def setup(app):
  app.connect('missing-reference', _resolve_alias)
  app.connect('autodoc-process-docstring', _data_docstring)
  app.connect('autodoc-skip-member', _skip_fields)
