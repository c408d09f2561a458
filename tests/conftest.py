"""Test set-up: 8 simulated CPU devices, float32 everywhere."""

import jax

# Must run before any JAX computation; fails loudly if it is too late
# (a late XLA_FLAGS would be silently ignored).
jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')
