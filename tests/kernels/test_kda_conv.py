"""KDA's short causal convs + SiLU (`pallas_kernels.kda.ops.short_conv_silu`): the reference and the GPU kernel (in
interpret mode) against a float64 per-row loop, pads anywhere; the kernel lowers for CUDA at Ling-3.0-flash width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error

from pallas_kernels.kda.gpu_triton.conv import ConvTiles
from pallas_kernels.kda.ops import kernel, short_conv_silu


def conv_silu_float64(parts, window, weight, mask):
    """Per row: the real inputs in order ([window ; real tokens]), each real token's conv over its K-1 latest real
    predecessors and itself, SiLU; pads 0; the new window the last K-1 real inputs."""
    joined = np.concatenate(parts, axis=-1)
    lag = weight.shape[1] - 1
    ys, windows = np.zeros_like(joined), []
    for row in range(joined.shape[0]):
        history = list(window[row])
        for t in np.flatnonzero(mask[row]):
            history.append(joined[row, t])
            conv = sum(weight[:, tap] * history[-1 - lag + tap] for tap in range(lag + 1))
            ys[row, t] = conv / (1.0 + np.exp(-conv))
        windows.append(history[-lag:])
    return np.split(ys, np.cumsum([p.shape[-1] for p in parts])[:-1], axis=-1), np.asarray(windows)


def problem(length, widths, seed, taps=4, batch=5):
    """Random parts, window and weights; a row all real, a row all pads, the others ~40% pads anywhere."""
    r = np.random.default_rng(seed)
    parts = [r.normal(size=(batch, length, w)) for w in widths]
    window = r.normal(size=(batch, taps - 1, sum(widths)))
    weight = r.normal(size=(sum(widths), taps))
    mask = r.uniform(size=(batch, length)) < 0.6
    mask[0], mask[1] = True, False
    return parts, window, weight, mask


def check(backend, parts, window, weight, mask, tol, dtype=jnp.float32):
    conv = jax.jit(lambda *a: short_conv_silu(*a, backend=backend))
    for m in (mask, None):
        ys, new_window = conv([jnp.asarray(p, dtype) for p in parts], jnp.asarray(window, dtype), weight, m)
        cast = [np.asarray(jnp.asarray(p, dtype).astype(jnp.float32), np.float64) for p in parts]
        ref_ys, ref_window = conv_silu_float64(
            cast,
            np.asarray(jnp.asarray(window, dtype).astype(jnp.float32)),
            weight,
            np.ones_like(mask) if m is None else m,
        )
        for y, ref in zip(ys, ref_ys, strict=True):
            assert y.dtype == dtype and rel_error(y, ref) <= tol
        assert rel_error(new_window, ref_window) <= tol


@pytest.mark.parametrize("length", [1, 2, 13])
def test_reference_skips_pads_anywhere(length):
    """Pads at the left, in the middle, at the end, a row of pads (its window kept), rows with fewer real tokens
    than the conv's lag; parts of different widths; no mask = all real."""
    check("reference", *problem(length, (5, 3, 6), seed=length), tol=1e-6)


@pytest.mark.parametrize("length, dtype", [(13, jnp.float32), (70, jnp.bfloat16)])
def test_gpu_kernel_matches_float64(length, dtype):
    """Interpret mode: 3 parts of 40 channels (masked past them in a 32-channel block), 16-token blocks (70 tokens:
    a partial last block), pads anywhere (the all-real row's blocks past the first take the kernel's path without
    gathers)."""
    parts, window, weight, mask = problem(length, (40, 40, 40), seed=length)
    tiles = ConvTiles(block_t=16, block_c=32)
    entry = kernel("short_conv_silu", "gpu_triton")
    from pallas_kernels.kda.reference import conv_sources

    positions, _ = conv_sources(jnp.asarray(mask), 3)
    cast = [jnp.asarray(p, dtype) for p in parts]
    ys = entry(cast, jnp.asarray(window, dtype), weight, jnp.asarray(mask), positions, tiles=tiles, interpret=True)
    refs, _ = conv_silu_float64(
        [np.asarray(p.astype(jnp.float32), np.float64) for p in cast],
        np.asarray(jnp.asarray(window, dtype).astype(jnp.float32)),
        weight,
        mask,
    )
    for y, ref in zip(ys, refs, strict=True):
        assert y.dtype == dtype and rel_error(y, ref) <= (1e-2 if dtype == jnp.bfloat16 else 1e-6)
    if dtype == jnp.float32:
        check("interpret_gpu", parts, window, weight, mask, tol=1e-6)


def test_gpu_kernel_lowers_for_cuda_at_full_width():
    """Ling-3.0-flash's q, k, v (4096 channels each) over an 8192-token chunk."""
    shape = jax.ShapeDtypeStruct
    part = shape((1, 8192, 4096), jnp.bfloat16)
    lowered = lower_for_cuda(
        lambda q, k, v, window, weight, mask: short_conv_silu([q, k, v], window, weight, mask, backend="pallas_gpu"),
        part,
        part,
        part,
        shape((1, 3, 3 * 4096), jnp.bfloat16),
        shape((3 * 4096, 4), jnp.float32),
        shape((1, 8192), jnp.bool_),
    )
    assert "kda_short_conv_silu" in lowered.as_text()


def test_gpu_kernel_differentiates_as_the_reference():
    """The kernel's backward pass is the reference's (the training path on a GPU)."""
    parts, window, weight, mask = problem(9, (32, 32, 32), seed=3)
    args = ([jnp.asarray(p, jnp.float32) for p in parts], jnp.asarray(window, jnp.float32), jnp.asarray(weight))

    def grads(backend):
        loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in short_conv_silu(*a, mask, backend=backend)[0])  # noqa: E731
        return jax.tree.leaves(jax.grad(loss, argnums=(0, 1, 2))(*args))

    for ours, ref in zip(grads("interpret_gpu"), grads("reference"), strict=True):
        assert rel_error(ours, ref) <= 1e-6


@gpu_test("the compiled KDA short-conv kernel")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_gpu_kernel_matches_float64(dtype):
    """The default tiles: 3 parts of 160 channels (a partial 128-channel block), 150 tokens (a partial block), pads
    anywhere."""
    parts, window, weight, mask = problem(150, (160, 160, 160), seed=11)
    check("pallas_gpu", parts, window, weight, mask, tol=1e-2 if dtype == jnp.bfloat16 else 1e-5, dtype=dtype)
