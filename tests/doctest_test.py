"""The docstring examples run (as optax doctests its docs)."""

import doctest
import importlib

from absl.testing import absltest
from absl.testing import parameterized

MODULES = ('_alias', '_boundaries', '_collectives', '_diagnostics',
           '_explicit', '_layout', '_newton_schulz', '_planner',
           '_tensor_parallel', '_transform')


class DoctestTest(parameterized.TestCase):

  @parameterized.parameters(*MODULES)
  def test_examples(self, name):
    module = importlib.import_module(f'dmuon_jax.{name}')
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    self.assertEqual(result.failed, 0, f'{name}: {result}')


if __name__ == '__main__':
  absltest.main()
