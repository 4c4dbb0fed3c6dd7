"""A cheap NaN/Inf check of one tensor as it streams (ling-convert, the checkpoint loaders).

numpy's `isfinite` on bfloat16 and FP8 goes through ml_dtypes' scalar loops (~0.25 G elements/s here), so
narrow floats are checked on their bits instead: for IEEE-style formats (bfloat16, float16, E5M2), E4M3FN and
E8M0 the non-finite values are exactly the bit patterns whose magnitude bits reach those of the first one (Inf,
or the one NaN), so one masked max decides (~1-4 G elements/s). float32 and float64 use min and max, which
propagate NaN; the rest (the fnuz formats) plain `isfinite`. Device (jax) arrays are reduced where they live;
only a boolean comes back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {1: np.uint8, 2: np.uint16}
_CHUNK = 1 << 22  # elements per masked max: bounds the temporary for the largest tensors


class NonFiniteError(ValueError):
    """A tensor holds NaN or Inf; the message names it and says how many and where the first one is."""

    def __init__(self, name: str, count: int, first: tuple[int, ...]):
        super().__init__(f"tensor '{name}' has {count} NaN or Inf values (the first at index {list(first)})")
        self.name = name
        self.count = count


@functools.cache
def _bit_threshold(dtype: np.dtype) -> tuple[int, int] | None:
    """(magnitude mask, smallest non-finite magnitude) if every value of `dtype` whose masked bits reach the
    threshold is non-finite and no other value is; None for formats where that does not hold (E8M0, fnuz)."""
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=_UINT[dtype.itemsize])
    with np.errstate(invalid="ignore"):
        nonfinite = ~np.isfinite(bits.view(dtype).astype(np.float32))
    if not nonfinite.any():
        return None
    for mask in ((1 << (8 * dtype.itemsize - 1)) - 1, (1 << (8 * dtype.itemsize)) - 1):
        threshold = int((bits[nonfinite] & mask).min())
        if np.array_equal(nonfinite, (bits & mask) >= threshold):
            return mask, threshold
    return None


def all_finite_numpy(array: np.ndarray) -> bool:
    """Whether a host array holds no NaN / Inf: 8- and 16-bit floats judged on their bits, in bounded chunks."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.itemsize in _UINT and (rule := _bit_threshold(flat.dtype)) is not None:
        mask, threshold = rule
        codes = flat.view(_UINT[flat.dtype.itemsize])
        return all(int((codes[i : i + _CHUNK] & mask).max()) < threshold for i in range(0, codes.size, _CHUNK))
    if flat.dtype.kind == "f":
        return bool(np.isfinite(flat.min()) and np.isfinite(flat.max()))
    return bool(np.isfinite(flat).all())


@jax.jit
def _all_finite_jax(array: jax.Array) -> jax.Array:
    return jnp.isfinite(array).all()


def _is_float(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def check_finite(array: np.ndarray | jax.Array, name: str) -> None:
    """Raise NonFiniteError naming `name` when the float array `array` holds NaN or Inf (non-float arrays and
    empty ones pass)."""
    if not _is_float(array.dtype) or array.size == 0:
        return
    if isinstance(array, jax.Array):
        if bool(_all_finite_jax(array)):
            return
        array = np.asarray(array)
    elif all_finite_numpy(array):
        return
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(np.asarray(array).astype(np.float32))
    raise NonFiniteError(name, int(bad.sum()), tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape)))
