"""The block-FP8 gate/up kernel (`pallas_kernels.moe.fp8_gate_up_mgpu`, Pallas Mosaic GPU) against float64
numpy: the weights dequantised by `ling_jax.quant.dequantize_fp8_block` and rounded to bf16, the SwiGLU with
and without its clip, random routing with empty groups, a one-row group, a group over two row tiles and rows
past the groups. The row tables on their own; the CUDA lowering at Ling-3.1-flash size; the compiled kernel
on a GPU.

Mosaic GPU interpret mode runs the kernel only on jax >= 0.11 (jax 0.10's interpreter cannot run a transposed
wgmma operand): those tests say so and skip on older jax. In interpret mode the dequantised weight tiles pass
through shared memory (the interpreter's wgmma takes no register operand); the compiled kernel keeps them in
registers, which the GPU test covers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error

from ling_jax.quant import dequantize_fp8_block
from pallas_kernels.moe.fp8_gate_up_mgpu import gate_up_fp8_mgpu, gather_aligned, row_tiles, slabs_to_rows

MGPU_INTERPRET_OK = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
needs_mgpu_interpreter = pytest.mark.skipif(
    not MGPU_INTERPRET_OK, reason=f"jax {jax.__version__}'s Mosaic GPU interpreter cannot run transposed wgmma "
    "operands (jax >= 0.11 can); the kernel's CUDA lowering is still tested here and the compiled kernel on the GPU")


def _problem(seed: int, sizes, *, experts: int, width: int, hidden: int, tokens: int, tail: int):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes)
    codes = [(rng.standard_normal((experts, width, hidden)) * 3).astype(ml_dtypes.float8_e4m3fn) for _ in range(2)]
    scales = [rng.uniform(0.005, 0.05, (experts, width // 128, hidden // 128)).astype(np.float32) for _ in range(2)]
    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
    source = rng.integers(0, tokens, sizes.sum() + tail)
    return sizes, codes, scales, x, source


def _expected(sizes, codes, scales, x, source, limit):
    """float64 swiglu(x_r W_gate^T, x_r W_up^T) for the rows in groups, weights dequantised then bf16."""
    weights = [np.stack([dequantize_fp8_block(c[g], s[g], (128, 128)) for g in range(len(sizes))])
               .astype(ml_dtypes.bfloat16).astype(np.float64) for c, s in zip(codes, scales)]
    group_R = np.repeat(np.arange(len(sizes)), sizes)
    x_RD = x.astype(np.float64)[source[:len(group_R)]]
    gate, up = (np.einsum("rd,rid->ri", x_RD, w[group_R]) for w in weights)
    activated = gate / (1 + np.exp(-gate))
    if limit is None:
        return activated * up
    return np.minimum(activated, limit) * np.clip(up, -limit, limit)


def _run(sizes, codes, scales, x, source, *, limit, block_m: int, stages: int = 3, parts: int = 2,
         interpret: bool = True):
    hT, tiles = gate_up_fp8_mgpu(jnp.asarray(x), jnp.asarray(source, jnp.int32), jnp.asarray(sizes, jnp.int32),
                                 jnp.asarray(codes[0]), jnp.asarray(scales[0]), jnp.asarray(codes[1]),
                                 jnp.asarray(scales[1]), limit=limit, block_m=block_m, stages=stages,
                                 parts=parts, interpret=interpret)
    del tiles
    rows = slabs_to_rows(hT, jnp.asarray(sizes, jnp.int32), len(source), block_m=block_m)
    return np.asarray(rows.astype(jnp.float32))[:sizes.sum()]


# The output is bf16 (rounding ~1e-3); a product taken with a wrong block's scale or a stale buffer moves the
# error by percents, so the bound is tighter than the 2e-2 for bf16 paths.
TOL = 5e-3


@needs_mgpu_interpreter
@pytest.mark.parametrize("block_m, parts", [(64, 1), (128, 2)])
@pytest.mark.parametrize("limit", [None, 7.0], ids=["no-limit", "limit"])
def test_interpret_matches_float64(block_m, parts, limit):
    sizes, codes, scales, x, source = _problem(block_m, [40, 0, 1, 130, 0, 21], experts=6, width=256, hidden=512,
                                               tokens=37, tail=5)
    h = _run(sizes, codes, scales, x, source, limit=limit, block_m=block_m, stages=2, parts=parts)
    assert rel_error(h, _expected(sizes, codes, scales, x, source, limit)) <= TOL


def test_row_tables_place_each_sorted_row_once_and_slabs_read_back():
    """Tiles in order cover each group's sorted rows in order, at the aligned rows gather_aligned put them, and
    slabs_to_rows reads the slabs back in sorted order."""
    block_m, tokens = 128, 50
    sizes = np.array([0, 9, 1, 300, 0, 128, 17, 0])
    source = np.random.default_rng(0).integers(0, tokens, sizes.sum() + 3)
    x = np.repeat(np.arange(tokens, dtype=np.float32)[:, None], 8, axis=1)  # row t holds t
    tiles = jax.tree.map(np.asarray, row_tiles(jnp.asarray(sizes), len(source), block_m=block_m))
    x_P = np.asarray(gather_aligned(jnp.asarray(x), jnp.asarray(source), jnp.asarray(sizes), block_m=block_m))
    used = np.flatnonzero(tiles.rows)
    assert np.all(used == np.arange(len(used))) and tiles.rows.sum() == sizes.sum()
    placed = np.concatenate([x_P[8 * tiles.row8[t]:8 * tiles.row8[t] + tiles.rows[t], 0] for t in used])
    assert np.array_equal(placed, source[:sizes.sum()])
    assert np.array_equal(np.repeat(tiles.group[used], tiles.rows[used]), np.repeat(np.arange(len(sizes)), sizes))
    hT = np.zeros((len(tiles.rows), 8, block_m), np.float32)
    for t in used:
        hT[t, :, :tiles.rows[t]] = x_P[8 * tiles.row8[t]:8 * tiles.row8[t] + tiles.rows[t]].T
    rows = np.asarray(slabs_to_rows(jnp.asarray(hT), jnp.asarray(sizes), len(source), block_m=block_m))
    assert np.array_equal(rows[:sizes.sum(), 0], source[:sizes.sum()])


def test_bad_weights_are_named():
    sizes, codes, scales, x, source = _problem(0, [3], experts=1, width=128, hidden=256, tokens=4, tail=0)
    with pytest.raises(ValueError, match="gate codes must be float8_e4m3fn"):
        _run(sizes, [codes[0].astype(np.float32), codes[1]], scales, x, source, limit=None, block_m=64)
    with pytest.raises(ValueError, match="up scale must be"):
        _run(sizes, codes, [scales[0], scales[1][:, :, :1]], x, source, limit=None, block_m=64)


def test_lowers_for_cuda_at_ling_flash_size():
    experts, width, hidden, rows = 512, 1024, 4096, 65536
    spec = jax.ShapeDtypeStruct
    codes = spec((experts, width, hidden), jnp.float8_e4m3fn)
    scale = spec((experts, width // 128, hidden // 128), jnp.float32)
    args = (spec((8192, hidden), jnp.bfloat16), spec((rows,), jnp.int32), spec((experts,), jnp.int32), codes, scale,
            codes, scale)
    text = lower_for_cuda(lambda *a: gate_up_fp8_mgpu(*a, limit=7.0)[0], *args).as_text()
    assert "mosaic_gpu" in text


@gpu_test("the compiled Mosaic GPU kernel")
@pytest.mark.parametrize("block_m, stages, parts", [(128, 3, 2), (128, 3, 1), (64, 4, 2)])
def test_compiled_matches_float64(block_m, stages, parts):
    """At Ling's hidden size (32 K steps: every ring buffer is reused many times)."""
    sizes = np.random.default_rng(1).integers(0, 300, 24)
    sizes[3], sizes[7] = 0, 1
    sizes, codes, scales, x, source = _problem(2, sizes, experts=24, width=512, hidden=4096, tokens=333, tail=9)
    run = functools.partial(_run, sizes, codes, scales, x, source, block_m=block_m, stages=stages, parts=parts,
                            interpret=False)
    for limit in (None, 7.0):
        assert rel_error(run(limit=limit), _expected(sizes, codes, scales, x, source, limit)) <= TOL
