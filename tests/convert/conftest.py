import os

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _full_xla_optimisation():
    """The converter's tests (Orbax restores onto 8-device meshes, multi-process conversions) run with XLA's full
    optimiser: at the cheap level that tests/conftest.py sets, a restore followed by a jitted check aborted the
    process (XLA:CPU, jax 0.10.2) in 2 of 4 runs of these files, and in none of 2 without it."""
    saved = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    saved_flag = jax.config.read("jax_disable_most_optimizations")
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"  # the subprocesses these tests start
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", saved_flag)
    if saved is None:
        del os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]
    else:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = saved
