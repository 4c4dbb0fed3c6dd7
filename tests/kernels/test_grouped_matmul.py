"""Grouped matmul (MoE expert GEMM): the GPU kernel in Pallas interpret mode and the jnp reference against a
float64 per-group loop; tail rows; gradients; CUDA lowering from the CPU; the compiled kernel on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul, grouped_matmul_reference
from pallas_kernels.moe.gmm_gpu import grouped_matmul_gpu
from helpers import rel_error

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# (rows M, K, N, group sizes): odd M, K and N off the default tiles, empty groups, one group holding every
# row, sum(group_sizes) < M, up to 16 groups, fewer rows than one tile, tiles that divide K and N exactly.
CASES = {
    "odd": (77, 48, 80, [10, 0, 33, 1, 20]),
    "one_group": (50, 32, 16, [0, 0, 50, 0]),
    "sixteen": (203, 32, 48, [0, 17, 3, 0, 0, 40, 1, 1, 25, 0, 9, 30, 2, 0, 44, 5]),
    "few_rows": (5, 16, 32, [0, 1, 0, 0, 2, 0, 1, 0]),
    "exact_tiles": (128, 64, 128, [64, 0, 30, 34]),
}


def float64_grouped_matmul(lhs, rhs, group_sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[1]), np.float64)
    start = 0
    for group, size in enumerate(group_sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[group].astype(np.float64).T
        start += size
    return out


def random_case(rows, k_dim, n_dim, group_sizes, dtype, seed):
    """lhs, rhs rounded to dtype (as float32 numpy) and group sizes; no zero values in lhs or rhs."""
    r = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    signs = lambda shape: r.choice([-1.0, 1.0], size=shape)  # noqa: E731
    lhs = rounded(signs((rows, k_dim)) * r.uniform(0.1, 1.0, (rows, k_dim)))
    rhs = rounded(signs((len(group_sizes), n_dim, k_dim)) * r.uniform(0.1, 1.0, (len(group_sizes), n_dim, k_dim)))
    return lhs, rhs, np.asarray(group_sizes, np.int32)


@pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_matches_float64_per_group_loop(backend, case, dtype):
    lhs, rhs, group_sizes = random_case(*CASES[case], dtype, seed=len(case))
    ref = float64_grouped_matmul(lhs, rhs, group_sizes)
    out = grouped_matmul(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(group_sizes),
                         backend=backend)
    assert out.shape == ref.shape and out.dtype == dtype
    used = int(group_sizes.sum())
    assert not np.any(np.asarray(out[used:], np.float32)), f"{backend} {case}: rows past the groups are not 0"
    err = rel_error(out, ref)
    assert err <= TOL[dtype], f"{backend} {case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


@pytest.mark.parametrize("tiles", [(16, 16, 16), (16, 32, 32), (32, 64, 16)])
def test_kernel_small_tiles(tiles):
    """Row tiles straddling many groups, several column tiles and K steps, K and N masks."""
    block_m, block_n, block_k = tiles
    lhs, rhs, group_sizes = random_case(*CASES["sixteen"], jnp.float32, seed=block_m + block_n)
    out = grouped_matmul_gpu(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes), block_m=block_m,
                             block_n=block_n, block_k=block_k, interpret=True)
    assert rel_error(out, float64_grouped_matmul(lhs, rhs, group_sizes)) <= TOL[jnp.float32]


@pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
def test_no_rows_in_any_group_gives_zeros(backend):
    lhs, rhs, _ = random_case(*CASES["odd"], jnp.float32, seed=1)
    out = grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.zeros((5,), jnp.int32), backend=backend)
    assert out.shape == (77, 80) and not np.any(np.asarray(out))


@pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
def test_gradients_match_float64(backend):
    lhs, rhs, group_sizes = random_case(*CASES["odd"], jnp.float32, seed=2)
    cotangent = np.random.default_rng(3).normal(size=(lhs.shape[0], rhs.shape[1])).astype(np.float32)
    loss = lambda x, w: jnp.sum(grouped_matmul(x, w, jnp.asarray(group_sizes), backend=backend) * cotangent)  # noqa: E731
    d_lhs, d_rhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(lhs), jnp.asarray(rhs))
    want_lhs, want_rhs = np.zeros(lhs.shape), np.zeros(rhs.shape)
    start = 0
    for group, size in enumerate(group_sizes):
        rows = slice(start, start + size)
        want_lhs[rows] = cotangent[rows].astype(np.float64) @ rhs[group].astype(np.float64)
        want_rhs[group] = cotangent[rows].astype(np.float64).T @ lhs[rows].astype(np.float64)
        start += size
    assert rel_error(d_lhs, want_lhs) <= 1e-5 and rel_error(d_rhs, want_rhs) <= 1e-5
    assert not np.any(np.asarray(d_lhs[start:])) and not np.any(np.asarray(d_rhs[1]))  # tail rows, empty group


def test_reference_gradient_in_bf16():
    lhs, rhs, group_sizes = random_case(*CASES["sixteen"], jnp.bfloat16, seed=4)
    loss = lambda x, w: jnp.sum(grouped_matmul_reference(x, w, jnp.asarray(group_sizes)).astype(jnp.float32))  # noqa: E731
    d_lhs, d_rhs = jax.grad(loss, argnums=(0, 1))(jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16))
    assert d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(d_rhs, np.float32))) and np.any(np.asarray(d_rhs, np.float32))


@pytest.mark.parametrize("backend", ["interpret_tpu", "interpret", "auto"])
def test_backends_without_a_kernel_run_the_reference(backend):
    lhs, rhs, group_sizes = random_case(*CASES["odd"], jnp.float32, seed=5)
    out = grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes), backend=backend)
    assert rel_error(out, float64_grouped_matmul(lhs, rhs, group_sizes)) <= TOL[jnp.float32]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        grouped_matmul(jnp.ones((4, 16)), jnp.ones((2, 16, 16)), jnp.array([2, 2], jnp.int32), backend="cuda")


def test_gpu_kernel_lowers_for_cuda():
    """jax >= 0.11 asks for the target GPU when none is attached: an H200, through an abstract mesh."""
    args = (jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16), jax.ShapeDtypeStruct((64, 256, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((64,), jnp.int32))
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(grouped_matmul_gpu).trace(*args).lower(lowering_platforms=("cuda",))
    assert "grouped_matmul" in lowered.as_text()


ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="the compiled Triton kernel needs a GPU; it runs on the device machine (pytest -m gpu)")


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_gpu_kernel_matches_float64_per_group_loop(case, dtype):
    lhs, rhs, group_sizes = random_case(*CASES[case], dtype, seed=len(case))
    out = grouped_matmul(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(group_sizes),
                         backend="pallas_gpu")
    assert not np.any(np.asarray(out[int(group_sizes.sum()):], np.float32))
    err = rel_error(out, float64_grouped_matmul(lhs, rhs, group_sizes))
    assert err <= TOL[dtype], f"compiled GPU kernel {case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


def per_group_rel_error(out_MN, lhs_MK, rhs_GNK, group_sizes):
    """||out - lhs_g @ rhs_g.T|| / ||lhs_g @ rhs_g.T|| over all groups, one fixed-size row window per group
    (lax.map), in fp32 on the device; the reference's ragged dot would not fit (see the test below)."""
    window = int(max(group_sizes.max(), 1))
    starts = jnp.asarray(np.cumsum(group_sizes) - group_sizes, jnp.int32)
    lhs_pad = jnp.pad(lhs_MK, ((0, window), (0, 0)))
    out_pad = jnp.pad(out_MN, ((0, window), (0, 0)))

    def one_group(args):
        group, start, size = args
        want = jnp.dot(jax.lax.dynamic_slice_in_dim(lhs_pad, start, window), rhs_GNK[group].T,
                       preferred_element_type=jnp.float32)
        got = jax.lax.dynamic_slice_in_dim(out_pad, start, window).astype(jnp.float32)
        valid = (jnp.arange(window) < size)[:, None]
        return jnp.sum(jnp.where(valid, got - want, 0.0) ** 2), jnp.sum(jnp.where(valid, want, 0.0) ** 2)

    diff, ref = jax.jit(lambda *a: jax.lax.map(one_group, a))(
        jnp.arange(len(group_sizes)), starts, jnp.asarray(group_sizes))
    return float(jnp.sqrt(diff.sum() / ref.sum()))


@pytest.mark.gpu
@ON_GPU
def test_compiled_gpu_kernel_at_moe_size():
    """8192 tokens x top-8 rows over 512 experts of skewed sizes (some empty, a few rows left unused).

    Checked group by group with plain dots: XLA's GPU ragged_dot (jax 0.11.2) materialises a masked copy of
    lhs per group, [G, M, K] = 256 GiB here, so the reference cannot run at this size."""
    rows, k_dim, n_dim, num_groups = 8192 * 8, 4096, 1024, 512
    r = np.random.default_rng(0)
    group_sizes = r.multinomial(rows - 300, r.dirichlet(np.full(num_groups, 0.3))).astype(np.int32)
    assert (group_sizes == 0).any()
    key_lhs, key_rhs = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(key_lhs, (rows, k_dim), jnp.bfloat16)
    rhs = jax.random.normal(key_rhs, (num_groups, n_dim, k_dim), jnp.bfloat16)
    out = grouped_matmul(lhs, rhs, jnp.asarray(group_sizes), backend="pallas_gpu")
    err = per_group_rel_error(out, lhs, rhs, group_sizes)
    assert err <= 2e-2, f"compiled GPU kernel: rel. error {err:.2e} against per-group dots"
    assert not jnp.any(out[int(group_sizes.sum()):]), "rows past the groups are not 0"


@pytest.mark.gpu
@ON_GPU
def test_compiled_gpu_kernel_matches_reference():
    """A size XLA's ragged_dot still fits: 4096 rows over 64 groups, bf16."""
    rows, k_dim, n_dim, num_groups = 4096, 1024, 512, 64
    r = np.random.default_rng(1)
    group_sizes = jnp.asarray(r.multinomial(rows - 100, r.dirichlet(np.full(num_groups, 0.5))), jnp.int32)
    key_lhs, key_rhs = jax.random.split(jax.random.key(1))
    lhs = jax.random.normal(key_lhs, (rows, k_dim), jnp.bfloat16)
    rhs = jax.random.normal(key_rhs, (num_groups, n_dim, k_dim), jnp.bfloat16)
    out = grouped_matmul(lhs, rhs, group_sizes, backend="pallas_gpu")
    ref = grouped_matmul(lhs, rhs, group_sizes, backend="reference")
    assert rel_error(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2
