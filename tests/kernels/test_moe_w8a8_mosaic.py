"""The Mosaic GPU W8A8 routed experts (the lab variant `pallas_kernels.experimental.moe_gpu_mosaic`) against
float64 numpy written from the W8A8 formula (test_moe_w8a8's): the padded expert layout; the XLA around the kernels
(gathers, h quantisation, the routing weights folded into h's scales, the way back to the caller's order) with a jnp
stand-in for the kernel that runs the kernels' own epilogues (SwiGLU, h quantised in registers) and leaves the tail
tiles NaN (so a row read from one fails); CUDA lowering at Ling-3.1-flash size; the compiled kernels on a GPU (jax
0.10's Mosaic GPU interpreter cannot run them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error
from jax.experimental import pallas as pl
from test_moe_w8a8 import f64_down_scatter, f64_gather_swiglu, f64_weight, routed_rows

from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.experimental import moe_gpu_mosaic as gpu_mosaic
from pallas_kernels.experimental.moe_gpu_mosaic import ALIGN, BLOCK_M, padded_layout, w8a8_expert_rows_mgpu
from pallas_kernels.fp8.reference import dequantize_blocks

BLOCK = (128, 128)


def test_padded_layout_starts_every_expert_on_a_tile_and_an_aligned_row():
    """Empty experts, experts of 128 rows exactly, of 129 and of 300, one of one row, a tail of rows of no
    expert: the padded layout (tiles), the aligned one (x's rows) and each tile's first aligned row."""
    sizes = np.array([0, 3, 128, 0, 129, 1, 0, 300], np.int32)
    num_rows = int(sizes.sum()) + 5
    pos, aligned, tile_group, tile_start = map(np.asarray, padded_layout(jnp.asarray(sizes), num_rows))
    expected_pos, expected_aligned, expected_tiles, expected_starts, tile, row = [], [], [], [], 0, 0
    for group, size in enumerate(sizes):
        expected_pos += [tile * BLOCK_M + j for j in range(size)]
        expected_aligned += [row + j for j in range(size)]
        tiles = -(-size // BLOCK_M)
        expected_tiles += [group] * tiles
        expected_starts += [row + j * BLOCK_M for j in range(tiles)]
        tile += tiles
        row += -(-size // ALIGN) * ALIGN
    num_tiles = -(-num_rows // BLOCK_M) + len(sizes)
    assert tile_group.shape == tile_start.shape == (num_tiles,) and pos.shape == aligned.shape == (num_rows,)
    padding = num_tiles - len(expected_tiles)
    np.testing.assert_array_equal(tile_group, expected_tiles + [len(sizes)] * padding)
    np.testing.assert_array_equal(tile_start, expected_starts + [0] * padding)
    np.testing.assert_array_equal(pos, expected_pos + [num_tiles * BLOCK_M] * 5)
    np.testing.assert_array_equal(aligned, expected_aligned + [row + j for j in range(5)])


class Buffer:
    """A jnp array that takes a kernel's stores (`ref[pl.ds, pl.ds] = value`), tail tiles left NaN."""

    def __init__(self, shape_dtype):
        self.dtype, self.value = shape_dtype.dtype, jnp.full(shape_dtype.shape, jnp.nan, jnp.float32)

    def __setitem__(self, index, value):
        index = tuple(slice(i.start, i.start + i.size) if isinstance(i, pl.Slice) else i for i in index)
        self.value = self.value.at[index].set(jnp.asarray(value, self.dtype).astype(jnp.float32))


def stand_in_call(tile_group_T, tile_start_T, x_q_SK, row_scales_GS, weights, *, out_type, block_n, store, **_):
    """`grouped_call` with the products in jnp (each tile's 128 rows from its start, dequantised by their row
    scales, times its expert's dequantised weights, at HIGHEST precision) and the kernels' own stores, tile by
    tile (one sub-tile a weight, from registers: no shared-memory buffer)."""
    x_SK = dequantize_blocks(x_q_SK, row_scales_GS.T, (1, BLOCK[1]), jnp.float32)
    dense = [dequantize_blocks(w.values, w.scales, BLOCK, jnp.float32) for w in weights]
    outputs = [Buffer(t) for t in (out_type if isinstance(out_type, tuple) else (out_type,))]
    for tile, (group, start) in enumerate(zip(np.asarray(tile_group_T), np.asarray(tile_start_T), strict=True)):
        if group >= len(dense[0]):
            continue
        assert start + BLOCK_M <= len(x_SK) and not start % ALIGN
        for col in range(0, dense[0].shape[1], block_n):
            accs = [
                (jnp.dot(x_SK[start : start + BLOCK_M], w[group, col : col + block_n].T, precision="highest"),)
                for w in dense
            ]
            store(accs, pl.ds(tile * BLOCK_M, BLOCK_M), pl.ds(col, block_n), None, *outputs)
    values = tuple(b.value.astype(b.dtype) for b in outputs)
    return values if isinstance(out_type, tuple) else values[0]


def problem(tokens, top_k, num_experts, hidden, width, seed):
    """x, the routing (source, order, sizes; a tail row, an empty expert, an expert of one row), sorted row
    weights and three BlockFP8Weights, with their float64 weights."""
    r = np.random.default_rng(seed)
    x = (r.normal(size=(tokens, hidden)) * r.uniform(0.1, 10.0, hidden)).astype(np.float32)
    source, order, sizes = routed_rows(tokens, top_k, num_experts, seed)
    row_weight = r.uniform(0.1, 1.0, len(order)).astype(np.float32)

    def weight(n_dim, k_dim):
        values = np.asarray(r.normal(size=(num_experts, n_dim, k_dim)) * 60.0, jnp.float8_e4m3fn)
        scales = r.uniform(0.5, 1.5, (num_experts, n_dim // 128, k_dim // 128)) / (60.0 * k_dim**0.5)
        return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales, jnp.float32), BLOCK)

    weights = (weight(width, hidden), weight(width, hidden), weight(hidden, width))
    return x, (source, order, sizes), row_weight, weights


def float64_rows(x, rows, row_weight, weights, limit):
    source, order, sizes = rows
    gate, up, down = (f64_weight(w.values, w.scales, BLOCK) for w in weights)
    h, _ = f64_gather_swiglu(x, source, sizes, gate, up, limit, BLOCK[1])
    return f64_down_scatter(h, order, row_weight, sizes, down)


def run(x, rows, row_weight, weights, limit, dtype=jnp.float32, **kwargs):
    source, order, sizes = rows
    args = (jnp.asarray(x, dtype), jnp.asarray(source), jnp.asarray(order), jnp.asarray(row_weight))
    return w8a8_expert_rows_mgpu(*args, jnp.asarray(sizes), *weights, limit, **kwargs)


def test_the_layout_and_quantisation_around_the_kernels_match_float64(monkeypatch):
    """37 tokens, top-3 of 9 experts (110 rows, experts of up to ~16 rows: every expert on its own tile),
    hidden 256, width 384 (3 groups of h), the SwiGLU clip."""
    monkeypatch.setattr(gpu_mosaic, "grouped_call", stand_in_call)
    x, rows, row_weight, weights = problem(37, 3, 9, 256, 384, seed=3)
    expected = float64_rows(x, rows, row_weight, weights, 0.9)
    for down_block_n in (128, 64):
        with jax.disable_jit():  # the stand-in walks the tiles in Python
            y = run(x, rows, row_weight, weights, 0.9, down_block_n=down_block_n)
        assert y.shape == (37 * 3, 256) and bool(jnp.all(jnp.isfinite(y)))
        assert rel_error(y, expected) <= 1e-3, down_block_n


def test_lowers_for_cuda_at_ling_flash_size_and_refuses_other_blocks():
    shape, (tokens, top_k, num_experts, hidden, width) = jax.ShapeDtypeStruct, (8192, 8, 512, 4096, 1280)
    rows = tokens * top_k

    def weight(n_dim, k_dim):
        grid = (num_experts, n_dim // 128, k_dim // 128)
        return BlockFP8Weight(shape((num_experts, n_dim, k_dim), jnp.float8_e4m3fn), shape(grid, jnp.float32), BLOCK)

    index = shape((rows,), jnp.int32)
    for down_block_n in (128, 64):
        lowered = lower_for_cuda(
            lambda *a, n=down_block_n: w8a8_expert_rows_mgpu(*a, 7.0, down_block_n=n),
            shape((tokens, hidden), jnp.bfloat16),
            index,
            index,
            shape((rows,), jnp.float32),
            shape((num_experts,), jnp.int32),
            weight(width, hidden),
            weight(width, hidden),
            weight(hidden, width),
        )
        assert "mosaic_gpu" in lowered.as_text()
    x, rows_, row_weight, weights = problem(5, 2, 4, 128, 128, seed=1)
    odd = BlockFP8Weight(weights[2].values, weights[2].scales, (128, 64))
    with pytest.raises(ValueError, match="w8a8_expert_rows_mgpu takes 128 x 128 weight blocks"):
        run(x, rows_, row_weight, (*weights[:2], odd), None)


@gpu_test("the compiled Mosaic GPU W8A8 expert kernels")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_float64(dtype):
    """300 tokens, top-4 of 11 experts (tiles shared by nothing, partial tiles, an empty expert, a tail row),
    hidden 512, width 256, at four tile settings: the default, 64-column down tiles, h and y written by TMA with
    two down K blocks a step, and 256-column down tiles with two K blocks a step (each fits shared memory in fp32
    and bf16: lowered on the CPU)."""
    x, rows, row_weight, weights = problem(300, 4, 11, 512, 256, seed=7)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    expected = float64_rows(x, rows, row_weight, weights, 7.0)
    for tiles in ((4, 128, 5, 4), (3, 64, 2, 2), (4, 128, 3, 2, True, True, 2), (4, 256, 3, 2, True, False, 2)):
        named = dict(zip(gpu_mosaic.TILE_KEYWORDS, tiles))
        y = run(x, rows, row_weight, weights, 7.0, dtype, **named)
        assert y.dtype == dtype and bool(jnp.all(jnp.isfinite(y)))
        # h re-quantised: a value on the e4m3 code next to the float64 one moves y by a few 1e-3 (test_moe_w8a8)
        assert rel_error(y, expected) <= (2e-2 if dtype == jnp.bfloat16 else 5e-3), tiles
