"""Grouped matmul (MoE expert GEMM): the GPU kernels in Pallas interpret mode and the jnp reference against a
float64 per-group loop, forward and gradients; the row tiling; CUDA lowering from the CPU; the compiled
kernels on a GPU, up to a Ling-sized MoE layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from pallas_kernels.moe import grouped_matmul, grouped_matmul_reference
from pallas_kernels.moe.gpu_triton import (
    MIN_ROW_TILE,
    grouped_weight_grad_gpu,
    max_row_tiles,
    row_tile_sizes,
    row_tiles,
)
from pallas_kernels.moe.ops import kernel

grouped_matmul_gpu = kernel("grouped_matmul", "gpu_triton")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])

# (rows M, K, N, group sizes): odd M, K and N off the default tiles, empty groups, one group holding every
# row, sum(group_sizes) < M, up to 16 groups, fewer rows than one tile, tiles that divide K and N exactly.
CASES = {
    "odd": (77, 48, 80, [10, 0, 33, 1, 20]),
    "one_group": (50, 32, 16, [0, 0, 50, 0]),
    "sixteen": (203, 32, 48, [0, 17, 3, 0, 0, 40, 1, 1, 25, 0, 9, 30, 2, 0, 44, 5]),
    "few_rows": (5, 16, 32, [0, 1, 0, 0, 2, 0, 1, 0]),
    "exact_tiles": (128, 64, 128, [64, 0, 30, 34]),
}
SMALL_TILES = pytest.mark.parametrize("tiles", [(16, 16, 16), (16, 32, 32), (32, 64, 16)])


def random_case(rows, k_dim, n_dim, group_sizes, dtype, seed):
    """lhs, rhs and a cotangent for the output rounded to dtype (as float32 numpy), group sizes; no zeros."""
    r = np.random.default_rng(seed)
    rounded = lambda shape: np.asarray(
        jnp.asarray(  # noqa: E731
            r.choice([-1.0, 1.0], size=shape) * r.uniform(0.1, 1.0, shape), dtype
        ).astype(jnp.float32)
    )
    return (
        rounded((rows, k_dim)),
        rounded((len(group_sizes), n_dim, k_dim)),
        rounded((rows, n_dim)),
        np.asarray(group_sizes, np.int32),
    )


def float64_per_group(lhs, rhs, d_out, group_sizes):
    """out = lhs_g @ rhs_g.T, d_lhs = d_out_g @ rhs_g, d_rhs_g = d_out_g.T @ lhs_g per group, in float64."""
    lhs, rhs, d_out = (x.astype(np.float64) for x in (lhs, rhs, d_out))
    out, d_lhs, d_rhs = np.zeros(d_out.shape), np.zeros(lhs.shape), np.zeros(rhs.shape)
    start = 0
    for group, size in enumerate(group_sizes):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ rhs[group].T
        d_lhs[rows], d_rhs[group] = d_out[rows] @ rhs[group], d_out[rows].T @ lhs[rows]
        start += size
    return out, d_lhs, d_rhs


def value_and_grads(backend, lhs, rhs, d_out, group_sizes, dtype):
    """(out, d_lhs, d_rhs) of grouped_matmul through jax.vjp with cotangent d_out."""
    fn = lambda x, w: grouped_matmul(x, w, jnp.asarray(group_sizes), backend=backend)  # noqa: E731

    @jax.jit
    def run(lhs, rhs, d_out):
        out, vjp = jax.vjp(fn, lhs, rhs)
        return (out, *vjp(d_out))

    return run(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(d_out, dtype))


@pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
@pytest.mark.parametrize("case", sorted(CASES))
@DTYPES
def test_matches_float64_per_group_loop(backend, case, dtype):
    lhs, rhs, d_out, group_sizes = random_case(*CASES[case], dtype, seed=len(case))
    out = grouped_matmul(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(group_sizes), backend=backend)
    ref = float64_per_group(lhs, rhs, d_out, group_sizes)[0]
    assert out.shape == ref.shape and out.dtype == dtype
    assert not np.any(np.asarray(out[group_sizes.sum() :], np.float32)), f"{backend} {case}: tail rows are not 0"
    err = rel_error(out, ref)
    assert err <= TOL[dtype], f"{backend} {case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


@pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
@pytest.mark.parametrize("case", ["odd", "sixteen"])
@DTYPES
def test_gradients_match_float64(backend, case, dtype):
    lhs, rhs, d_out, group_sizes = random_case(*CASES[case], dtype, seed=2)
    got = value_and_grads(backend, lhs, rhs, d_out, group_sizes, dtype)
    for name, ours, ref in zip(("out", "d_lhs", "d_rhs"), got, float64_per_group(lhs, rhs, d_out, group_sizes)):
        assert ours.dtype == dtype
        err = rel_error(ours, ref)
        assert err <= TOL[dtype], f"{backend} {case} {name} {jnp.dtype(dtype).name}: rel. error {err:.2e}"
    d_lhs, d_rhs = got[1:]
    assert not np.any(np.asarray(d_lhs[group_sizes.sum() :], np.float32)), "tail rows of d_lhs are not 0"
    assert not np.any(np.asarray(d_rhs[group_sizes == 0], np.float32)), "d_rhs of an empty group is not 0"


def test_gradient_under_jit_and_grad():
    lhs, rhs, _, group_sizes = random_case(*CASES["odd"], jnp.float32, seed=3)

    def loss(lhs, rhs, backend):
        return jnp.sum(grouped_matmul(lhs, rhs, jnp.asarray(group_sizes), backend=backend) ** 2)

    grads = {
        backend: jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(lhs, rhs, backend)
        for backend in ("interpret_gpu", "reference")
    }
    for ours, ref in zip(grads["interpret_gpu"], grads["reference"]):
        assert rel_error(ours, ref) <= 1e-5


@SMALL_TILES
def test_kernels_with_small_tiles(tiles):
    """Many row tiles per group, several column tiles and K steps, K and N masks, in all three products."""
    block_m, block_n, block_k = tiles
    lhs, rhs, d_out, group_sizes = random_case(*CASES["sixteen"], jnp.float32, seed=block_m + block_n)
    out_ref, d_lhs_ref, d_rhs_ref = float64_per_group(lhs, rhs, d_out, group_sizes)
    gs = jnp.asarray(group_sizes)
    out = grouped_matmul_gpu(lhs, rhs, gs, block_m=block_m, block_n=block_n, block_k=block_k, interpret=True)
    d_lhs = grouped_matmul_gpu(
        d_out, rhs, gs, rhs_transposed=True, block_m=block_m, block_n=block_k, block_k=block_n, interpret=True
    )
    d_rhs = grouped_weight_grad_gpu(lhs, d_out, gs, block_m=block_m, block_n=block_n, block_k=block_k, interpret=True)
    for name, ours, ref in (("out", out, out_ref), ("d_lhs", d_lhs, d_lhs_ref), ("d_rhs", d_rhs, d_rhs_ref)):
        assert rel_error(ours, ref) <= TOL[jnp.float32], f"{name} with tiles {tiles}"


@pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
def test_no_rows_in_any_group_gives_zeros(backend):
    lhs, rhs, d_out, _ = random_case(*CASES["odd"], jnp.float32, seed=1)
    out, d_lhs, d_rhs = value_and_grads(backend, lhs, rhs, d_out, np.zeros(5, np.int32), jnp.float32)
    assert out.shape == (77, 80) and not np.any(np.asarray(out))
    assert not np.any(np.asarray(d_lhs)) and not np.any(np.asarray(d_rhs))


def test_reference_gradient_in_bf16_under_jit():
    lhs, rhs, _, group_sizes = random_case(*CASES["sixteen"], jnp.bfloat16, seed=4)

    def loss(lhs, rhs):
        return jnp.sum(grouped_matmul_reference(lhs, rhs, jnp.asarray(group_sizes)).astype(jnp.float32))

    d_lhs, d_rhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
    )
    assert d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(d_rhs, np.float32))) and np.any(np.asarray(d_rhs, np.float32))


@pytest.mark.parametrize("backend", ["interpret_tpu", "interpret", "auto"])
def test_backends_without_a_kernel_run_the_reference(backend):
    lhs, rhs, d_out, group_sizes = random_case(*CASES["odd"], jnp.float32, seed=5)
    out = grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes), backend=backend)
    assert rel_error(out, float64_per_group(lhs, rhs, d_out, group_sizes)[0]) <= TOL[jnp.float32]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        grouped_matmul(jnp.ones((4, 16)), jnp.ones((2, 16, 16)), jnp.array([2, 2], jnp.int32), backend="cuda")


@pytest.mark.parametrize("seed", range(6))
def test_row_tiles_cover_each_row_once_within_one_group(seed):
    r = np.random.default_rng(seed)
    rows, num_groups, block_m = [
        (1000, 7, 128),
        (300, 64, 16),
        (64, 512, 64),
        (5000, 3, 32),
        (128, 4, 32),
        (17, 16, 16),
    ][seed]
    group_sizes = r.multinomial(int(rows * r.uniform(0.5, 1.0)), r.dirichlet(np.full(num_groups, 0.3)))
    if seed == 0:
        group_sizes = np.ones(num_groups, np.int64)  # the worst case: G + 1 parts, each with a partial tile
    tiles = jax.jit(row_tiles, static_argnums=(1, 2))(jnp.asarray(group_sizes, jnp.int32), rows, block_m)
    group_T, start_T, end_T = map(np.asarray, tiles)
    assert len(group_T) == max_row_tiles(rows, num_groups, block_m)
    part_ends = np.r_[np.cumsum(group_sizes), rows]
    part_starts = np.r_[0, part_ends[:-1]]
    owner = np.full(rows, -1)
    for group, start, end in zip(group_T, start_T, end_T):
        if end > start:
            assert part_starts[group] <= start and end <= part_ends[group] and end - start <= block_m
            assert end == part_ends[group] or end - start == block_m
            assert (owner[start:end] == -1).all()
            owner[start:end] = group
    assert (owner >= 0).all()
    if seed == 0:
        assert (end_T > start_T).all()  # the bound is tight


def _abstract_args(rows=1000, num_groups=64, k_dim=512, n_dim=256):
    return (
        jax.ShapeDtypeStruct((rows, k_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_groups, n_dim, k_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_groups,), jnp.int32),
    )


def test_gpu_kernels_lower_for_cuda():
    loss = lambda x, w, gs: jnp.sum(grouped_matmul(x, w, gs, backend="pallas_gpu").astype(jnp.float32))  # noqa: E731
    lowered = lower_for_cuda(jax.grad(loss, argnums=(0, 1)), *_abstract_args())
    text = lowered.as_text()
    assert "grouped_matmul" in text and "grouped_weight_grad" in text


ON_GPU = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernels need a GPU; they run on the device machine (pytest -m gpu)",
)


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize("case", sorted(CASES))
@DTYPES
def test_compiled_gpu_kernels_match_float64_per_group_loop(case, dtype):
    lhs, rhs, d_out, group_sizes = random_case(*CASES[case], dtype, seed=len(case))
    got = value_and_grads("pallas_gpu", lhs, rhs, d_out, group_sizes, dtype)
    assert not np.any(np.asarray(got[0][group_sizes.sum() :], np.float32)), "tail rows are not 0"
    for name, ours, ref in zip(("out", "d_lhs", "d_rhs"), got, float64_per_group(lhs, rhs, d_out, group_sizes)):
        err = rel_error(ours, ref)
        assert err <= TOL[dtype], f"compiled {name} {case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


@functools.partial(jax.jit, static_argnames="window")
def per_group_rel_errors(lhs_MK, rhs_GNK, group_sizes_G, d_out_MN, got, *, window: int):
    """Relative errors of got = (out, d_lhs, d_rhs) against plain fp32-accumulated dots on one row window
    (>= the largest group) per group, group after group (lax.map)."""
    starts_G = jnp.cumsum(group_sizes_G) - group_sizes_G
    out_MN, d_lhs_MK, d_rhs_GNK = got
    padded = [jnp.pad(x, ((0, window), (0, 0))) for x in (lhs_MK, d_out_MN, out_MN, d_lhs_MK)]
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)

    def one_group(args):
        rhs_NK, d_rhs_NK, start, size = args
        valid = (jnp.arange(window) < size)[:, None]
        lhs, d_out, out, d_lhs = (jnp.where(valid, jax.lax.dynamic_slice_in_dim(x, start, window), 0) for x in padded)
        pairs = ((out, dot(lhs, rhs_NK.T)), (d_lhs, dot(d_out, rhs_NK)), (d_rhs_NK, dot(d_out.T, lhs)))
        return (
            jnp.stack([jnp.sum((ours.astype(jnp.float32) - ref) ** 2) for ours, ref in pairs]),
            jnp.stack([jnp.sum(ref**2) for _, ref in pairs]),
        )

    diff_G3, ref_G3 = jax.lax.map(one_group, (rhs_GNK, d_rhs_GNK, starts_G, group_sizes_G))
    return jnp.sqrt(diff_G3.sum(0) / ref_G3.sum(0))


@pytest.mark.gpu
@ON_GPU
def test_compiled_gpu_kernels_at_moe_size():
    """8192 tokens x top-8 rows over 512 experts of skewed sizes (some empty, a few rows left unused).

    Checked group by group with plain dots: XLA's GPU ragged_dot (jax 0.11.2) materialises a masked copy of
    lhs per group, [G, M, K] = 256 GiB here, so the reference runs out of memory at this size."""
    rows, k_dim, n_dim, num_groups = 8192 * 8, 4096, 1024, 512
    r = np.random.default_rng(0)
    group_sizes = r.multinomial(rows - 300, r.dirichlet(np.full(num_groups, 0.3))).astype(np.int32)
    assert (group_sizes == 0).any()
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k_dim), jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (num_groups, n_dim, k_dim), jnp.bfloat16)
    d_out = jax.random.normal(keys[2], (rows, n_dim), jnp.bfloat16)
    fn = lambda x, w: grouped_matmul(x, w, jnp.asarray(group_sizes), backend="pallas_gpu")  # noqa: E731
    out, vjp = jax.vjp(fn, lhs, rhs)
    got = (out, *vjp(d_out))
    errors = per_group_rel_errors(lhs, rhs, jnp.asarray(group_sizes), d_out, got, window=int(group_sizes.max()))
    for name, err in zip(("out", "d_lhs", "d_rhs"), np.asarray(errors)):
        assert err <= 2e-2, f"compiled {name}: rel. error {err:.2e} against per-group dots"
    assert not jnp.any(out[int(group_sizes.sum()) :]) and not jnp.any(got[1][int(group_sizes.sum()) :])


@pytest.mark.gpu
@ON_GPU
def test_compiled_gpu_kernels_match_reference():
    """A size XLA's ragged_dot still fits: 4096 rows over 64 groups, bf16, forward and gradients."""
    rows, k_dim, n_dim, num_groups = 4096, 1024, 512, 64
    r = np.random.default_rng(1)
    group_sizes = r.multinomial(rows - 100, r.dirichlet(np.full(num_groups, 0.5))).astype(np.int32)
    keys = jax.random.split(jax.random.key(1), 3)
    args = (
        jax.random.normal(keys[0], (rows, k_dim), jnp.bfloat16),
        jax.random.normal(keys[1], (num_groups, n_dim, k_dim), jnp.bfloat16),
        jax.random.normal(keys[2], (rows, n_dim), jnp.bfloat16),
        group_sizes,
        jnp.bfloat16,
    )
    for ours, ref in zip(value_and_grads("pallas_gpu", *args), value_and_grads("reference", *args)):
        assert rel_error(ours.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2


def test_row_tile_sizes_are_the_powers_of_two_up_to_the_tile():
    assert row_tile_sizes(64, 16) == (16, 32, 64)
    assert row_tile_sizes(128)[0] == MIN_ROW_TILE and row_tile_sizes(128)[-1] == 128
    assert row_tile_sizes(16, 64) == (16,) and row_tile_sizes(32, 8) == (16, 32)


# Groups whose last 64-row tile holds 6, 26, 36, 16 and 64 rows (tiles of 16, 32, 64, 16, 64), an empty one,
# a tail of 9 rows past the groups.
SHRINKING = (64 + 6 + 90 + 100 + 16 + 64 + 9, 48, 80, [70, 90, 100, 16, 0, 64])


@pytest.mark.parametrize("min_block_m", [16, 64], ids=["shrinking", "fixed"])
def test_partial_row_tiles_shrink_to_the_rows_they_hold(min_block_m):
    lhs, rhs, d_out, group_sizes = random_case(*SHRINKING, jnp.float32, seed=min_block_m)
    out = grouped_matmul_gpu(
        jnp.asarray(lhs),
        jnp.asarray(rhs),
        jnp.asarray(group_sizes),
        block_m=64,
        block_n=32,
        block_k=16,
        min_block_m=min_block_m,
        interpret=True,
    )
    assert rel_error(out, float64_per_group(lhs, rhs, d_out, group_sizes)[0]) <= TOL[jnp.float32]
    assert not np.any(np.asarray(out[group_sizes.sum() :])), "tail rows are not 0"
