"""`stored_kind`, the one classification of a stored tensor that the loaders and the converter share."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ling_jax.checkpoints.storage import FP8, MXFP4, PLAIN, stored_kind


@pytest.mark.parametrize(
    "dtype, scaled, kind",
    [
        (ml_dtypes.float8_e4m3fn, True, FP8),
        (ml_dtypes.float8_e5m2, True, FP8),
        (np.uint8, True, MXFP4),
        (np.int8, True, MXFP4),
        (ml_dtypes.float8_e4m3fn, False, PLAIN),
        (np.uint8, False, PLAIN),
        (np.float32, True, PLAIN),
        (ml_dtypes.bfloat16, False, PLAIN),
    ],
)
def test_a_tensor_is_quantised_by_its_dtype_and_its_scale_sibling(dtype, scaled, kind):
    assert stored_kind(np.dtype(dtype), scaled) == kind
