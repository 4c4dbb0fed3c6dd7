"""Pallas kernels for ling-jax, each beside a pure-jnp reference that states the maths."""

from pallas_kernels import compat  # noqa: F401  (applies the XLA:CPU workaround before any computation)
