"""check_finite finds every NaN / Inf bit pattern of every float format a checkpoint holds, and nothing else."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ling_jax.checkpoints.finite_check import NonFiniteError, check_finite

NARROW = [
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fnuz,
]


def _refused(array) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        check_finite(array, "w")
    return info.value


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
def test_every_bit_pattern_of_narrow_floats(dtype):
    dtype = np.dtype(dtype)
    uint = {1: np.uint8, 2: np.uint16}[dtype.itemsize]
    values = np.arange(1 << (8 * dtype.itemsize), dtype=uint).view(dtype)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(values.astype(np.float32))
    check_finite(values[finite], "w")
    rng = np.random.default_rng()
    for bad in values[~finite]:
        array = rng.choice(values[finite], size=int(rng.integers(1, 300)))
        where = int(rng.integers(array.size))
        array[where] = bad
        error = _refused(array)
        assert error.count == 1 and str(error) == f"tensor 'w' has 1 NaN or Inf values (the first at index [{where}])"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_wide_floats_and_device_arrays(dtype, bad):
    rng = np.random.default_rng()
    array = rng.standard_normal((int(rng.integers(1, 40)), int(rng.integers(1, 40)))).astype(dtype)
    check_finite(array, "w")
    check_finite(jnp.asarray(array), "w")
    row, col = int(rng.integers(array.shape[0])), int(rng.integers(array.shape[1]))
    array[row, col] = bad
    array[-1, -1] = bad
    for candidate in (array, jnp.asarray(array)):
        error = _refused(candidate)
        assert error.count == 1 + ((row, col) != (array.shape[0] - 1, array.shape[1] - 1))
        assert f"(the first at index [{row}, {col}])" in str(error)


def test_integers_and_empty_arrays_pass():
    check_finite(np.arange(7, dtype=np.int32), "ids")
    check_finite(np.zeros((0, 3), np.float32), "empty")
