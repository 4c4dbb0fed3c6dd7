"""Pallas kernels for ling-jax, each beside a pure-jnp reference that states the maths."""
