"""Test set-up: 8 simulated CPU devices, float32 everywhere.

The test processes (and their child processes: examples, benchmarks,
guides run as projects, multi-host workers) compile with four XLA:CPU
settings that make compiling cheaper; the figures the docs quote come from
runs outside the suite, at XLA's defaults:

- ``--xla_llvm_disable_expensive_passes=true`` (the suite 18 min 1 s ->
  14 min 53 s);
- ``--xla_backend_optimization_level=0`` (a Gemma-like dedicated class
  compiled in 8.9 s instead of 13.0 s; the suite 18 min 8 s -> 12 min 16 s;
  the train-step benchmark's quick run 26.4 s -> 18.2 s);
- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's loop emitters instead
  of its MLIR fusion emitters (perf put 18% of a tensor-parallel test's CPU
  time in the fusion emitters' MLIR pipelines, much of it building an MLIR
  context per fusion; the suite 11 min 53 s / 1348 CPU s -> 6 min 20 s /
  690 CPU s within the same hour, the machine's speed varying ~25% by the
  hour);
- ``--xla_cpu_parallel_codegen_split_count=1``: each program's LLVM module
  compiled whole instead of split into parts compiled on a thread pool
  (the parts repeat per-module work; the suite's two workers on two cores
  leave no core for the parallelism: measured CPU seconds of one process,
  XLA's default -> 1: numerics_test 34.1 -> 29.2, dedicated_split_test
  51.1 -> 47.9, two of flax_nnx_test's parity runs 26.6 -> 24.0 (two runs
  each)). The kernels round differently in places (5 steps of
  optax.contrib.muon in float32: a third of the values differ in their
  last bits, at most 4.8e-7); the programs a test compares are compiled
  alike.

Compilation was most of the suite's time (XLA's backend compile 573 of 816
CPU seconds in the test processes, jax.monitoring). The HLO the tests read
(collectives, nesting, memory analysis) and the programs they compare (the
library's and optax's, both compiled here) compile under the same
settings. Two numerical effects, each stated where a tolerance meets it:

- float16 arithmetic is rounded per operation at level 0 (float16
  Newton-Schulz of a 1e30-scaled gradient 1.8e-3 to 2.5e-3 from the
  scale-1 update, < 1e-3 at the default level; numerics_test).
- Two float32 programs that compute the same update no longer round alike:
  the loop emitters sum in other orders, each op's own error unchanged
  (matmul, norm, sqrt, rsqrt and the Newton-Schulz polynomial 1.8e-7 to
  3.6e-7 from float64 under either emitter), and Newton-Schulz amplifies a
  small singular value's rounding up to a^5 ~ 490 times (a = 3.4445).
  dmuon against optax in float32 moved from ~1e-8 to ~1e-6
  (support.OPTAX_F32_RTOL).
"""

import gc
import os
import re
import shutil
import tempfile

import chex
import jax
import pytest

# Must run before any JAX computation: chex raises if JAX already started
# (child processes get the flags below but not the device count; see
# support.subprocess_env). The config says the device count too, so that
# code under test that sets it as a user's script does (the docs' guides)
# finds it set.
_TEST_FLAGS = (
  '--xla_llvm_disable_expensive_passes=true',
  '--xla_backend_optimization_level=0',
  '--xla_cpu_use_fusion_emitters=false',
  '--xla_cpu_parallel_codegen_split_count=1',
)
_flags = os.environ.get('XLA_FLAGS', '').split()
# xdist workers inherit the controller's env
_missing = [f for f in _TEST_FLAGS if f not in _flags]
if _missing:
  os.environ['XLA_FLAGS'] = ' '.join([*_flags, *_missing])
# For the child processes (support.subprocess_env).
os.environ['DMUON_TEST_XLA_FLAGS'] = ' '.join(_TEST_FLAGS)
chex.set_n_cpu_devices(8)
# Python's cyclic garbage collector walked the large, long-lived object
# graphs of traced programs and JAX's caches ~5% of a test process's time
# (perf samples of flax_linen_scan_test's Z3 runs): the objects alive once
# everything is imported are left out of its walks, and it runs after
# 50,000 new objects instead of 700 (measured: 1.9% left).
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 20)
jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')
# Each lowered op's location is its innermost user frame, not the whole
# Python traceback (JAX's default: up to 100 frames per op, carried through
# the MLIR module and XLA's HLO metadata). Nothing here reads them; two of
# flax_nnx_test's parity runs took 20.7 CPU seconds instead of 23.8 (two
# runs each). Child processes: support.subprocess_env.
jax.config.update('jax_include_full_tracebacks_in_locations', False)


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


# The longest modules, longest first (CPU seconds of each in the suite's
# run of 2026-12-06, -n 2, children included: 86, 73, 59, 54, 53, 53, 49,
# 46, 45, 44, 44, 39, 34, 33, 33, 32, 31; owner_groups_test 61 then, ~37
# since its batch is split over the devices, beside gpu_and_linen_examples'
# 39 (one process each, side by side)): xdist (--dist loadfile, see
# pyproject.toml) hands modules out in this order, so that none of them
# ends the run on one worker while the other idles.
LONGEST = (
  'tests/flax_nnx_test.py',
  'tests/examples_test.py',
  'tests/dedicated_test.py',
  'tests/flax_dedicated_test.py',
  'tests/docs_test.py',
  'tests/clients_test.py',
  'tests/layout_test.py',
  'tests/dedicated_split_test.py',
  'tests/flax_tp_test.py',
  'tests/checkpoint_test.py',
  'tests/flax_route_test.py',
  'tests/gpu_and_linen_examples_test.py',
  'tests/owner_groups_test.py',
  'tests/multihost_test.py',
  'tests/tensor_parallel_model_test.py',
  'tests/flax_linen_scan_test.py',
  'tests/cost_test.py',
  'tests/numerics_test.py',
)


def pytest_unconfigure(config):
  if getattr(config, 'dmuon_cache_owner', False):
    shutil.rmtree(
      os.environ.pop('DMUON_TEST_COMPILATION_CACHE'), ignore_errors=True
    )


def pytest_collection_modifyitems(config, items):
  """Marks ``slow`` the cases a test module lists in ``SLOW_CASES``.

  A module's ``SLOW_CASES`` holds regexes searched in ``Class::test_name``
  of each of its tests: the rest of a mesh x mode grid beyond one
  configuration per behaviour, and the compile-heavy checks (multi-layer
  memory analyses, whole trainers) whose behaviour a cheaper case of the
  inner loop also reaches. ``-m 'not slow'`` (the inner loop) leaves
  them out with the subprocess tests; the README's command and CI run
  everything.
  """
  del config
  for item in items:
    patterns = getattr(item.module, 'SLOW_CASES', ())
    name = item.nodeid.split('::', 1)[-1]
    if any(re.search(p, name) for p in patterns):
      item.add_marker(pytest.mark.slow)
  rank = {module: k for k, module in enumerate(LONGEST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split('::')[0], len(rank)))
