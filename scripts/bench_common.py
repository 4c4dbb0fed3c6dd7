"""Timing and checking helpers shared by the scripts/bench_*.py benchmarks."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, *args, iters: int) -> float:
    """Median seconds per call of a jitted fn, synchronised, after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def rel_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def copy_bandwidth(iters: int, nbytes: int = 4 << 30) -> float:
    """Bytes per second (read + written) of an fp32 elementwise scale over `nbytes`: the bandwidth ceiling."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    return 2 * nbytes / median_seconds(jax.jit(lambda a: a * 1.0001), x, iters=iters)
