"""The docstring examples run (as optax doctests its docs)."""

import doctest
import importlib

from absl.testing import absltest, parameterized

import dmuon_jax

MODULES = (
  '_alias',
  '_dedicated',
  '_planner',
  '_tensor_parallel',
  '_transform',
  'checkpoint',
)

# The entry points a user starts from: each must carry a runnable example.
WITH_EXAMPLES = (
  'dmuon',
  'scale_by_dmuon',
  'dedicate',
  'plan_ownership',
  'routing_summary',
  'owner_layouts',
  'orthogonalize_via_gram_newton_schulz_tp',
)


class DoctestTest(parameterized.TestCase):
  @parameterized.named_parameters((name.strip('_'), name) for name in MODULES)
  def test_examples_pass(self, name):
    module = importlib.import_module(f'dmuon_jax.{name}')
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    self.assertEqual(result.failed, 0, f'{name}: {result}')
    # A module without examples would pass whatever the code does.
    self.assertGreater(result.attempted, 0, f'{name}: no example ran')

  @parameterized.named_parameters((name, name) for name in WITH_EXAMPLES)
  def test_entry_point_has_an_example(self, name):
    fn = getattr(dmuon_jax, name)
    (test,) = [t for t in doctest.DocTestFinder(recurse=False).find(fn)]
    self.assertGreaterEqual(len(test.examples), 3, name)
    # ...and the module that defines it is one test_examples_pass runs.
    self.assertIn(fn.__module__.removeprefix('dmuon_jax.'), MODULES)


if __name__ == '__main__':
  absltest.main()
