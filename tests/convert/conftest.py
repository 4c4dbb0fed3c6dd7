import pytest


@pytest.fixture(autouse=True, scope="module")
def _converter_tests_fully_optimised(full_xla_optimisation):
    """The converter's tests (Orbax restores onto 8-device meshes, multi-process conversions) run with XLA's full
    optimiser: at the cheap level that tests/conftest.py sets, a restore followed by a jitted check aborted the
    process (XLA:CPU, jax 0.10.2) in 2 of 4 runs of these files, and in none of 2 without it."""
