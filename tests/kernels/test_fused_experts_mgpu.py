"""The Mosaic GPU fused routed-expert kernels (`pallas_kernels.moe.fused_mgpu`): in the Mosaic GPU interpreter
on the CPU against the jnp reference (`fused_reference`), bf16 (the kernels take bf16 / fp16 only), with
empty groups, groups off the row tile, tail rows and both epilogues of down_scatter; CUDA lowering at
Ling-3.1-flash size from the CPU; the compiled kernels on a GPU against the Triton fused kernels.

Under jax < 0.11.2 the interpreter cannot wgmma a transposed SMEM tile, so there the kernels read the
weights pre-transposed to [G, K, N] (`fused_mgpu._weights_for_kernel`; all else is the same code); the
[G, N, K] path the GPU runs is interpreted under jax 0.11.2. CUDA lowering from the CPU works under jax 0.11.2
(the GPU's version); jax 0.10.2's Mosaic GPU layout inference rejects down_scatter's row-weight broadcast, so
that test is skipped there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from ling_jax.expert_ffn import sort_by_expert
from pallas_kernels.moe.fused_gpu import down_scatter_gpu, gather_swiglu_gpu
from pallas_kernels.moe.fused_mgpu import down_scatter_mgpu, gather_swiglu_mgpu
from pallas_kernels.moe.fused_reference import down_scatter_reference, gather_swiglu_reference

TOL = 2e-2  # bf16
LIMITS = pytest.mark.parametrize("limit", [None, 0.9], ids=["no-limit", "limit"])
SCATTERS = pytest.mark.parametrize("scatter", ["rows", "sorted"])
# rows per group: empty groups, one row, a group over two 64-row tiles, one over 128 rows; 9 tail rows
GROUP_SIZES = np.array([70, 0, 1, 130, 37, 0], np.int32)
NUM_ROWS = int(GROUP_SIZES.sum()) + 9
HIDDEN, WIDTH, TOKENS = 256, 128, 40


def bf16(r, shape, scale=1.0):
    return jnp.asarray(r.normal(size=shape) * scale, jnp.bfloat16)


def gather_inputs(seed):
    """x [TOKENS, D], source [R], group sizes, gate and up [G, I, D], all bf16 but the indices."""
    r = np.random.default_rng(seed)
    num_groups = len(GROUP_SIZES)
    return (bf16(r, (TOKENS, HIDDEN)), jnp.asarray(r.integers(0, TOKENS, NUM_ROWS), jnp.int32),
            jnp.asarray(GROUP_SIZES), bf16(r, (num_groups, WIDTH, HIDDEN), HIDDEN ** -0.5),
            bf16(r, (num_groups, WIDTH, HIDDEN), HIDDEN ** -0.5))


def down_inputs(seed):
    """h [R, I] bf16, dest (a permutation of [0, R)), row weights fp32, group sizes, down [G, D, I] bf16."""
    r = np.random.default_rng(seed)
    return (bf16(r, (NUM_ROWS, WIDTH)), jnp.asarray(r.permutation(NUM_ROWS), jnp.int32),
            jnp.asarray(r.uniform(0.1, 1.0, NUM_ROWS), jnp.float32), jnp.asarray(GROUP_SIZES),
            bf16(r, (len(GROUP_SIZES), HIDDEN, WIDTH), WIDTH ** -0.5))


@LIMITS
@pytest.mark.parametrize("tiles", [{}, {"block_m": 128, "block_n": 64, "max_concurrent_steps": 2}],
                         ids=["default", "m128-n64-2steps"])
def test_gather_swiglu_matches_the_reference(limit, tiles):
    args = gather_inputs(seed=1)
    h = gather_swiglu_mgpu(*args, limit=limit, interpret=True, **tiles)
    assert h.dtype == jnp.bfloat16 and h.shape == (NUM_ROWS, WIDTH)
    assert not np.any(np.asarray(h[GROUP_SIZES.sum():], np.float32)), "tail rows are not 0"
    err = rel_error(h.astype(jnp.float32), gather_swiglu_reference(*args, limit).astype(jnp.float32))
    assert err <= TOL, f"rel. error {err:.2e}"


@SCATTERS
@pytest.mark.parametrize("tiles", [{}, {"block_m": 128, "block_n": 128, "block_k": 32}],
                         ids=["default", "m128-n128-k32"])
def test_down_scatter_matches_the_reference(scatter, tiles):
    h, dest, row_weight, sizes, down = down_inputs(seed=2)
    y = down_scatter_mgpu(h, dest, row_weight, sizes, down, scatter=scatter, interpret=True, **tiles)
    assert y.dtype == jnp.bfloat16 and y.shape == (NUM_ROWS, HIDDEN)
    assert not np.any(np.asarray(y[np.asarray(dest)[GROUP_SIZES.sum():]], np.float32)), "tail rows are not 0"
    ref = down_scatter_reference(h, dest, row_weight, sizes, down)
    err = rel_error(y.astype(jnp.float32), ref.astype(jnp.float32))
    assert err <= TOL, f"{scatter}: rel. error {err:.2e}"


def test_fewer_rows_than_a_tile_and_no_rows_in_any_group():
    """12 rows (under block_m) over two groups, then all groups empty: zeros everywhere."""
    x, source, _, gate, up = gather_inputs(seed=3)
    sizes = jnp.asarray([5, 0, 4, 0, 0, 0], jnp.int32)
    h = gather_swiglu_mgpu(x, source[:12], sizes, gate, up, limit=None, interpret=True)
    assert rel_error(h.astype(jnp.float32),
                     gather_swiglu_reference(x, source[:12], sizes, gate, up, None).astype(jnp.float32)) <= TOL
    h_none = gather_swiglu_mgpu(x, source[:12], jnp.zeros_like(sizes), gate, up, limit=None, interpret=True)
    assert not np.any(np.asarray(h_none, np.float32))


def test_other_dtypes_and_misfit_tiles_are_refused():
    x, source, sizes, gate, up = gather_inputs(seed=4)
    with pytest.raises(NotImplementedError, match="bf16 or fp16"):
        gather_swiglu_mgpu(x.astype(jnp.float32), source, sizes, gate, up, limit=None, interpret=True)
    with pytest.raises(ValueError, match="multiples"):
        gather_swiglu_mgpu(x, source, sizes, gate, up, limit=None, block_n=96, interpret=True)
    with pytest.raises(ValueError, match="64 or 128"):
        gather_swiglu_mgpu(x, source, sizes, gate, up, limit=None, block_m=32, interpret=True)


FLASH = {"tokens": 8192, "top_k": 8, "experts": 512, "hidden": 4096, "width": 1024}


@pytest.mark.skipif(jax.__version_info__ < (0, 11, 2),
                    reason="jax < 0.11.2: Mosaic GPU layout inference rejects down_scatter's row-weight broadcast")
@SCATTERS
def test_kernels_lower_for_cuda_at_ling_flash_size(scatter):
    """8192 tokens x top-8 rows over 512 experts, hidden 4096, width 1024, bf16, the default tiles."""
    rows, groups, hidden, width = FLASH["tokens"] * FLASH["top_k"], FLASH["experts"], FLASH["hidden"], FLASH["width"]
    shape = jax.ShapeDtypeStruct

    def experts(x, source, sizes, gate, up, dest, row_weight, down):
        h = gather_swiglu_mgpu(x, source, sizes, gate, up, limit=7.0)
        return down_scatter_mgpu(h, dest, row_weight, sizes, down, scatter=scatter)

    text = lower_for_cuda(experts, shape((FLASH["tokens"], hidden), jnp.bfloat16), shape((rows,), jnp.int32),
                          shape((groups,), jnp.int32), shape((groups, width, hidden), jnp.bfloat16),
                          shape((groups, width, hidden), jnp.bfloat16), shape((rows,), jnp.int32),
                          shape((rows,), jnp.float32), shape((groups, hidden, width), jnp.bfloat16)).as_text()
    assert "gather_swiglu_mgpu" in text and "down_scatter_mgpu" in text


ON_GPU = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Mosaic GPU kernels need a Hopper GPU; they run on the device machine (pytest -m gpu)")


@jax.jit
def device_rel_error(ours, ref):
    """||ours - ref|| / ||ref|| in fp32 on the device (the full-size arrays stay there)."""
    diff = ours.astype(jnp.float32) - ref.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(diff * diff) / jnp.sum(ref.astype(jnp.float32) ** 2))


def flash_routing(seed):
    """Device-drawn full-width inputs: x, source, dest (the sort permutation), sorted row weights, group sizes,
    gate, up, down; each token's top-8 experts distinct and random."""
    tokens, top_k, num_experts = FLASH["tokens"], FLASH["top_k"], FLASH["experts"]
    hidden, width = FLASH["hidden"], FLASH["width"]
    keys = jax.random.split(jax.random.key(seed), 6)
    experts = jax.vmap(lambda k: jax.random.permutation(k, num_experts)[:top_k])(jax.random.split(keys[0], tokens))
    weights = jax.random.uniform(keys[1], (tokens, top_k), jnp.float32, 0.1, 1.0)
    order, sizes = sort_by_expert(experts.reshape(-1).astype(jnp.int32), num_experts)
    x = jax.random.normal(keys[2], (tokens, hidden), jnp.bfloat16)
    gate, up = (jax.random.normal(k, (num_experts, width, hidden), jnp.bfloat16) * hidden ** -0.5 for k in keys[3:5])
    down = jax.random.normal(keys[5], (num_experts, hidden, width), jnp.bfloat16) * width ** -0.5
    return x, order // top_k, order, weights.reshape(-1)[order], sizes, gate, up, down


@pytest.mark.gpu
@ON_GPU
@SCATTERS
def test_compiled_kernels_at_ling_flash_size_match_the_triton_kernels(scatter):
    """8192 tokens, top-8 of 512 experts, hidden 4096, width 1024, bf16: the Mosaic GPU kernels against the
    Triton fused kernels (which test_fused_experts checks against the unfused ones at this size)."""
    x, source, order, row_weight, sizes, gate, up, down = flash_routing(seed=18)
    h = gather_swiglu_mgpu(x, source, sizes, gate, up, limit=7.0)
    h_triton = gather_swiglu_gpu(x, source, sizes, gate, up, limit=7.0)
    assert device_rel_error(h, h_triton) <= TOL
    y = down_scatter_mgpu(h_triton, order, row_weight, sizes, down, scatter=scatter)
    y_triton = down_scatter_gpu(h_triton, order, row_weight, sizes, down)
    assert device_rel_error(y, y_triton) <= TOL
