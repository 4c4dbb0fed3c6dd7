"""RMSNorm, residual add + RMSNorm, and the add of a split-K product's partial sums + RMSNorm (`pallas_kernels.norm`):
the GPU kernel (Pallas interpret mode on the CPU,
compiled on the device machine) and the jnp reference against float64 numpy; gradients; lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from benchmarks.kernel_census import kernel_census
from pallas_kernels.norm import add_partials_rms_norm, add_rms_norm, rms_norm

BACKENDS = ["interpret_gpu", "reference"]
EPS = 1e-6


def float64_norm(x, weight):
    x = np.asarray(x, np.float64)
    return np.asarray(weight, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def random_rows(shape, dtype, seed):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=shape) * 3.0, dtype)
    residual = jnp.asarray(r.normal(size=shape), dtype)
    weight = jnp.asarray(r.uniform(0.5, 1.5, shape[-1]), dtype)
    return x, residual, weight


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", [(1, 1, 64), (5, 256), (3, 7, 128), (2, 160)], ids=["one-row", "rows", "batch-time", "width-160"]
)
def test_matches_float64(shape, dtype, tol, backend):
    """Rows of any width (160: 256 loaded, 96 masked)."""
    x, residual, weight = random_rows(shape, dtype, seed=sum(shape))
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    normed = rms_norm(x, weight, EPS, backend=backend)
    assert normed.dtype == dtype and normed.shape == x.shape
    assert rel_error(normed, float64_norm(f32(x), f32(weight))) <= tol
    total, normed = add_rms_norm(x, residual, weight, EPS, backend=backend)
    expected_total = f32(x).astype(np.float64) + f32(residual)
    assert rel_error(total, expected_total) <= tol
    assert rel_error(normed, float64_norm(f32(total), f32(weight))) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "splits, shape", [(1, (1, 1, 64)), (3, (5, 160)), (7, (3, 1, 128))], ids=["one", "three-width-160", "seven"]
)
def test_partials_match_float64(splits, shape, backend):
    """x + (the fp32 partial sums added, cast to x's dtype), then the norm; the kernel adds the splits in order, on
    rows of any width (160: 256 loaded, 96 masked)."""
    x, _, weight = random_rows(shape, jnp.float32, seed=splits)
    rows = x.size // shape[-1]
    partials_SND = jnp.asarray(np.random.default_rng(splits).normal(size=(splits, rows, shape[-1])), jnp.float32)
    total, normed = add_partials_rms_norm(x, partials_SND, weight, EPS, backend=backend)
    assert total.shape == normed.shape == x.shape
    expected_total = np.asarray(x, np.float64) + np.sum(np.asarray(partials_SND, np.float64), axis=0).reshape(shape)
    assert rel_error(total, expected_total) <= 1e-6
    assert rel_error(normed, float64_norm(expected_total, weight)) <= 1e-6
    same_path = add_rms_norm(x, jnp.sum(partials_SND, axis=0).reshape(shape), weight, EPS, backend=backend)
    for a, b in zip((total, normed), same_path):
        assert rel_error(a, b) <= 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_reference(dtype):
    """The kernel rounds where the reference does (the normalised row to the input dtype, then the product): in
    bf16 at most 1% of the elements differ; in fp32 the two differ by float32 rounding only (the sum of squares
    may be reduced in another order, e.g. at XLA's cheap optimisation level, which the tests use)."""
    x, residual, weight = random_rows((9, 512), dtype, seed=1)
    for op, args in ((rms_norm, (x, weight, EPS)), (add_rms_norm, (x, residual, weight, EPS))):
        ours = jax.tree.leaves(op(*args, backend="interpret_gpu"))
        ref = jax.tree.leaves(op(*args, backend="reference"))
        for a, b in zip(ours, ref):
            if dtype == jnp.bfloat16:
                assert (np.asarray(a, np.float32) != np.asarray(b, np.float32)).mean() <= 0.01
            assert rel_error(a, b) <= (1e-6 if dtype == jnp.float32 else 1e-3)


def test_every_width_runs_the_kernel():
    """Ling-3.0-flash's 2,560-wide rows too (they ran as the reference, XLA's fusions, before)."""
    row, weight = jax.ShapeDtypeStruct((1, 2560), jnp.bfloat16), jax.ShapeDtypeStruct((2560,), jnp.bfloat16)
    for op, args in ((rms_norm, (row, weight)), (add_rms_norm, (row, row, weight))):
        jaxpr = jax.make_jaxpr(functools.partial(op, eps=EPS, backend="interpret_gpu"))(*args)
        assert kernel_census(jaxpr) == {op.__name__: 1}


def test_gradients_match_the_reference():
    x, residual, weight = random_rows((3, 128), jnp.float32, seed=3)
    probe = jnp.asarray(np.random.default_rng(4).normal(size=(3, 128)), jnp.float32)

    def loss(backend, x, residual, weight):
        total, normed = add_rms_norm(x, residual, weight, EPS, backend=backend)
        return (
            jnp.sum(jnp.sin(normed) * probe)
            + jnp.sum(total * total)
            + jnp.sum(rms_norm(x, weight, EPS, backend=backend) * probe)
        )

    grads = {b: jax.jit(jax.grad(functools.partial(loss, b), argnums=(0, 1, 2)))(x, residual, weight) for b in BACKENDS}
    for a, b in zip(grads["interpret_gpu"], grads["reference"]):
        assert rel_error(a, b) <= 1e-6


def test_gpu_kernels_lower_for_cuda():
    """A decode step's one row and a 4096-token prefill chunk, of Ling-3.1-flash (hidden 4096) and Ling-3.0-flash
    (2,560: masked past it)."""
    for rows in (1, 4096):
        for dim in (4096, 2560):
            row = jax.ShapeDtypeStruct((rows, dim), jnp.bfloat16)
            weight = jax.ShapeDtypeStruct((dim,), jnp.bfloat16)
            partials = jax.ShapeDtypeStruct((3, rows, dim), jnp.float32)
            for op, args in ((rms_norm, (row, weight)), (add_rms_norm, (row, row, weight))):
                text = lower_for_cuda(functools.partial(op, eps=EPS, backend="pallas_gpu"), *args).as_text()
                assert op.__name__ in text
            norm = functools.partial(add_partials_rms_norm, eps=EPS, backend="pallas_gpu")
            assert "add_partials_rms_norm" in lower_for_cuda(norm, row, partials, weight).as_text()


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernel needs a GPU; it runs on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_compiled_gpu_kernels(rows):
    x, residual, weight = random_rows((rows, 4096), jnp.bfloat16, seed=rows)
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    for dim in (4096, 2560):  # Ling-3.1-flash's rows, Ling-3.0-flash's (masked past 2,560)
        x_d, residual_d, weight_d = x[:, :dim], residual[:, :dim], weight[:dim]
        total, normed = add_rms_norm(x_d, residual_d, weight_d, EPS, backend="pallas_gpu")
        assert rel_error(total, f32(x_d).astype(np.float64) + f32(residual_d)) <= 1e-2
        assert rel_error(normed, float64_norm(f32(total), f32(weight_d))) <= 1e-2
        normed = rms_norm(x_d, weight_d, EPS, backend="pallas_gpu")
        assert rel_error(normed, float64_norm(f32(x_d), f32(weight_d))) <= 1e-2
        partials = jnp.asarray(np.random.default_rng(dim).normal(size=(4, rows, dim)), jnp.float32)
        ours = add_partials_rms_norm(x_d, partials, weight_d, EPS, backend="pallas_gpu")
        for a, b in zip(ours, add_partials_rms_norm(x_d, partials, weight_d, EPS, backend="reference")):
            assert rel_error(a, b) <= 1e-2
