"""Sphinx configuration: the API reference from the package's docstrings,
guides and reference pages in MyST Markdown. Build (warnings are errors):

  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

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
myst_enable_extensions = ['colon_fence', 'dollarmath']
myst_heading_anchors = 3

autosummary_generate = True
autodoc_typehints = 'description'
autodoc_member_order = 'bysource'
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = 'furo'
html_title = 'dmuon_jax'
