"""The docstring examples run (as optax doctests its docs)."""

import doctest
import importlib

from absl.testing import absltest
from absl.testing import parameterized

MODULES = ('_alias', '_dedicated', '_tensor_parallel', '_transform',
           'checkpoint')


class DoctestTest(parameterized.TestCase):

  @parameterized.parameters(*MODULES)
  def test_examples(self, name):
    module = importlib.import_module(f'dmuon_jax.{name}')
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    self.assertEqual(result.failed, 0, f'{name}: {result}')
    # A module without examples would pass whatever the code does.
    self.assertGreater(result.attempted, 0, f'{name}: no example ran')


if __name__ == '__main__':
  absltest.main()
