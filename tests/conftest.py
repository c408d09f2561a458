"""Test set-up: 8 simulated CPU devices, float32 everywhere.

XLA:CPU runs at its default optimization level, as users run it: level 0
(``--xla_backend_optimization_level=0``) compiles ~20% faster but is not
numerically neutral (measured: float16 Newton-Schulz of a 1e30-scaled
gradient 4.6e-3 from the scale-1 update instead of < 1e-3), so it is not
used to speed the suite up. LLVM's expensive passes are off in the test
processes (``--xla_llvm_disable_expensive_passes``): XLA's HLO passes, which
decide the collectives, fusions and buffers the tests read, are unchanged;
only machine-code optimization is lighter. Measured on this 2-core machine: a
dedicated NNX parity case plus the one-owner-update class 53.2 s -> 46.0 s,
the whole suite 18 min 1 s -> 14 min 53 s, all passing at unchanged
tolerances. Child processes (examples, benchmarks, multi-host workers) run
without it, as users run them.
"""

import os
import re
import shutil
import tempfile

import chex
import jax
import pytest

# Must run before any JAX computation: chex raises if JAX already started
# (child processes get an environment without this XLA flag; see
# support.subprocess_env). The config says the same, so that code under test
# that sets it as a user's script does (the docs' guides) finds it set.
_LLVM_FLAG = '--xla_llvm_disable_expensive_passes=true'
_flags = os.environ.get('XLA_FLAGS', '').split()
if _LLVM_FLAG not in _flags:  # xdist workers inherit the controller's env
  os.environ['XLA_FLAGS'] = ' '.join([*_flags, _LLVM_FLAG])
chex.set_n_cpu_devices(8)
jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')


def pytest_configure(config):
  # One persistent compilation cache for this run, new each run: the xdist
  # workers and the child processes (examples, benchmarks, multi-host
  # workers, the kill -9 restarts) compile a program that another test
  # already compiled once (tests build equal optimizers and jit equal
  # updates). Made by the controller before xdist starts its workers, which
  # inherit the variable. A loaded executable keeps its HLO text, cost and
  # memory analysis, which the tests read.
  if 'DMUON_TEST_COMPILATION_CACHE' not in os.environ:
    os.environ['DMUON_TEST_COMPILATION_CACHE'] = tempfile.mkdtemp(
      prefix='dmuon-jax-test-cache-'
    )
    config.dmuon_cache_owner = True
  jax.config.update(
    'jax_compilation_cache_dir', os.environ['DMUON_TEST_COMPILATION_CACHE']
  )
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


LONGEST = (
  'tests/examples_test.py',
  'tests/flax_nnx_test.py',
  'tests/multihost_test.py',
  'tests/checkpoint_test.py::KillTest',
  'tests/gpu_and_linen_examples_test.py',
  'tests/scale_compile_test.py',
)


# Modules whose test classes read the same module-level ``functools.cache``
# runs (a trained model, a compiled step): each runs on one xdist worker as
# one unit, so a run is made once, not once on each worker that gets one of
# its classes (measured in a full run: 64 s of the two workers' time went to
# such repeats, under load). Every other module's classes are units of
# their own, as --dist loadscope makes them.
SHARED_CACHE_MODULES = (
  'tests/flax_nnx_test.py',  # _dedicated, reference: 5 classes
  'tests/nnx_trainer_test.py',  # trainer: NnxTrainerTest, NnxCheckpointTest
  'tests/trainer_test.py',  # trainer: TrainerTest, TrainerCheckpointTest
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if config.getoption('dist') != 'loadscope':
    return None
  from xdist.scheduler import LoadScopeScheduling

  class ModuleOrClassScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      module = nodeid.split('::', 1)[0]
      if module in SHARED_CACHE_MODULES:
        return module
      return super()._split_scope(nodeid)

  return ModuleOrClassScheduling(config, log)


def pytest_unconfigure(config):
  if getattr(config, 'dmuon_cache_owner', False):
    shutil.rmtree(
      os.environ.pop('DMUON_TEST_COMPILATION_CACHE'), ignore_errors=True
    )


def pytest_collection_modifyitems(config, items):
  """Marks ``slow`` the cases a test module lists in ``SLOW_CASES``.

  A module's ``SLOW_CASES`` holds regexes searched in ``Class::test_name``
  of each of its tests: the rest of a mesh x mode grid beyond one
  configuration per behaviour. ``-m 'not slow'`` (the inner loop) leaves
  them out with the subprocess tests; the README's command and CI run
  everything.
  """
  del config
  for item in items:
    patterns = getattr(item.module, 'SLOW_CASES', ())
    name = item.nodeid.split('::', 1)[-1]
    if any(re.search(p, name) for p in patterns):
      item.add_marker(pytest.mark.slow)
  # The longest test classes (child processes, minutes each) and modules
  # (flax_nnx_test: one unit, see SHARED_CACHE_MODULES) first: xdist
  # hands classes out in this order, so they do not end the run on one
  # worker while the other idles.
  items.sort(key=lambda item: not item.nodeid.startswith(LONGEST))
