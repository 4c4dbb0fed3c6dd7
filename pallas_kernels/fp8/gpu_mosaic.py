"""W8A8 block-FP8 linear on Hopper as a Pallas Mosaic GPU kernel (TMA, e4m3 wgmma): `w8a8_linear_mgpu`.

The arithmetic of `reference.w8a8_linear_reference`: x quantised per token in 1 x 128 groups (one XLA pass), then
one CTA (one warpgroup) per [64, block_n] output tile walks the K blocks of 128 inputs in a pipeline of `stages`
shared-memory buffers filled by TMA (`plgpu.emit_pipeline`): the x_q tile [64, 128], the weight tile [block_n,
128] (read K-major, as FP8 wgmma wants it) and the tile's 64 activation scales of that K block. Each step's wgmma
goes to a fresh accumulator (the K block's products accumulated in the tensor cores), which is then scaled by the
rows' activation scales and the weight block's scale (a scalar read from global memory) and added to the fp32
accumulator in registers: DeepSeek-V3's promotion once per 128 inputs. block_n divides the weight's 128-row block
so the tile takes one weight scale.

Shapes: the weight's blocks must be 128 x 128, N a multiple of block_n and K of 128; x's rows are padded to a
multiple of 64 (a copy of x_q, small next to the product). jax 0.10's Mosaic GPU interpreter cannot read the
transposed (K-major) weight operand, so the kernel runs in interpret mode only on jax >= 0.11 (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mosaic_gpu_interpret
from pallas_kernels.fp8 import tuned
from pallas_kernels.fp8.reference import quantize_activations
from pallas_kernels.tuning import lookup

BLOCK_M = 64  # one warpgroup's wgmma rows
BLOCK_K = 128  # the weight's K block: 128 e4m3 bytes, one 128-byte swizzle row


def fp8_transforms():
    """Tiling and swizzle of an e4m3 wgmma operand in shared memory (rows of 128 one-byte columns)."""
    return (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(BLOCK_K))


def out_transforms(dtype, block_n: int):
    """Tiling and swizzle of a [rows, block_n] output tile of dtype in shared memory (the TMA store's source)."""
    swizzle = plgpu.find_swizzle(block_n * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def tma_store(accs, out_smems, y_tiles) -> None:
    """Each acc_MN of accs cast to its out_smem's dtype, written to that shared-memory buffer and copied to its
    y_tile by TMA (whole rows written by the copy engine, where a store from registers in the WGMMA layout writes 4
    bytes a thread). Waits first until the buffers' previous copies have read them; the caller waits for the last
    copies before the kernel exits."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for acc_MN, out_smem in zip(accs, out_smems, strict=True):
        out_smem[...] = acc_MN.astype(out_smem.dtype)
    plgpu.commit_smem()
    for out_smem, y_tile in zip(out_smems, y_tiles, strict=True):
        plgpu.copy_smem_to_gmem(out_smem, y_tile)


def _keep_layout(x, layout):
    """Interpret mode's stand-in for plgpu.layout_cast (register layouts do not exist there)."""
    del layout
    return x


def layout_cast(interpret: bool):
    """plgpu.layout_cast for a compiled kernel, the identity in interpret mode."""
    return _keep_layout if interpret else plgpu.layout_cast


def promoted_product(acc_MN, x_smem, w_smem, row_scale_M, block_scale):
    """acc + (x_smem @ w_smem^T) * row_scale_M[:, None] * block_scale: one K block's FP8 wgmma in a fresh
    accumulator, scaled per row and by the weight block's scale, and added to the fp32 accumulator in registers
    (DeepSeek-V3's promotion once per 128 inputs; the scales are multiplied after the wgmma is issued, so their
    loads wait behind it). x_smem [M, 128] e4m3, w_smem [N, 128] e4m3 (K-major), row_scale_M [M] in the WGMMA row
    layout, block_scale a scalar."""
    return promoted_products(acc_MN, (x_smem,), (w_smem,), (row_scale_M,), (block_scale,))


def promoted_products(acc_MN, x_smems, w_smems, row_scales, block_scales):
    """`promoted_product` over several K blocks in turn (the same sums in the same order): every block's wgmma is
    issued, each into a fresh accumulator, before the first is read, so each promotion overlaps the later blocks'
    wgmmas (one more fp32 accumulator in registers a block)."""
    count = len(x_smems)

    def block_products(*partial_refs):
        for partial_ref, x_smem, w_smem in zip(partial_refs, x_smems, w_smems, strict=True):
            plgpu.wgmma(partial_ref, x_smem, w_smem.T)
        total_MN = acc_MN
        for i, (partial_ref, row_scale_M, block_scale) in enumerate(zip(partial_refs, row_scales, block_scales)):
            # each read waits for its block's wgmma only (the last one's for all)
            partial_MN = plgpu.wgmma_accumulator_load(partial_ref, wait_n=count - 1 - i)
            total_MN = total_MN + partial_MN * lax.broadcast_in_dim(row_scale_M * block_scale, partial_MN.shape, [0])
        return total_MN

    return pl.run_scoped(block_products, *(plgpu.ACC(acc_MN.shape, jnp.float32) for _ in x_smems))


def block_scaled_products(x_gmem, row_scales_gmem, weights, *, block_n: int, stages: int, cast) -> tuple:
    """One fp32 [BLOCK_M, block_n] accumulator in registers per (w_gmem, scale_at) of weights: the sum over the K
    blocks of the x tile's FP8 wgmma with the weight tile, times the rows' activation scales of that K block and the
    weight block's scale scale_at(k_block) (a scalar read from global memory). x_gmem [BLOCK_M, K] e4m3, each w_gmem
    [block_n, K] e4m3 (K-major, as FP8 wgmma wants it), row_scales_gmem [K / BLOCK_K, BLOCK_M] (transposed, so a
    tile's scales of one K block are one contiguous TMA row). One TMA pipeline of `stages` buffers feeds them all."""
    num_weights = len(weights)

    def k_step(indices, x_smem, *refs):
        (k_block,) = indices
        w_smems, row_scales_smem, accs = refs[:num_weights], refs[num_weights], refs[-1]
        row_scale_M = cast(row_scales_smem[0, :], plgpu.Layout.WGMMA.reduce(1))
        return tuple(
            promoted_product(acc_MN, x_smem, w_smem, row_scale_M, scale_at(k_block))
            for w_smem, (_, scale_at), acc_MN in zip(w_smems, weights, accs)
        )

    tile = plgpu.BlockSpec((block_n, BLOCK_K), lambda k: (0, k), transforms=fp8_transforms())
    zeros = cast(jnp.zeros((BLOCK_M, block_n), jnp.float32), plgpu.Layout.WGMMA)
    return plgpu.emit_pipeline(
        k_step,
        grid=(x_gmem.shape[1] // BLOCK_K,),
        in_specs=[
            plgpu.BlockSpec((BLOCK_M, BLOCK_K), lambda k: (0, k), transforms=fp8_transforms()),
            *(tile for _ in weights),
            plgpu.BlockSpec((1, BLOCK_M), lambda k: (k, 0)),
        ],
        max_concurrent_steps=stages,
        init_carry=tuple(zeros for _ in weights),
    )(x_gmem, *(w_gmem for w_gmem, _ in weights), row_scales_gmem)


def _kernel(x_gmem, w_gmem, row_scales_gmem, scales_gmem, y_gmem, *, block_n: int, stages: int, tma: bool, cast):
    """The CTA of output tile (m, n): y[64 rows, block_n columns]. row_scales [K blocks, M]. tma: y written through
    shared memory by TMA (the pipeline's buffers are free by then), else from registers."""
    m, n = lax.axis_index("m"), lax.axis_index("n")
    scale_row = n * block_n // BLOCK_K
    (acc_MN,) = block_scaled_products(
        x_gmem.at[pl.ds(m * BLOCK_M, BLOCK_M)],
        row_scales_gmem.at[:, pl.ds(m * BLOCK_M, BLOCK_M)],
        ((w_gmem.at[pl.ds(n * block_n, block_n)], lambda k_block: scales_gmem[scale_row, k_block]),),
        block_n=block_n,
        stages=stages,
        cast=cast,
    )
    y_tile = y_gmem.at[pl.ds(m * BLOCK_M, BLOCK_M), pl.ds(n * block_n, block_n)]
    if not tma:
        y_tile[...] = acc_MN.astype(y_gmem.dtype)
        return

    def store(out_smem):
        tma_store((acc_MN,), (out_smem,), (y_tile,))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(store, plgpu.SMEM((BLOCK_M, block_n), y_gmem.dtype, transforms=out_transforms(y_gmem.dtype, block_n)))


def quantized_rows(x_MK, tile_rows: int) -> tuple[jax.Array, jax.Array]:
    """(x_q [P, K] e4m3, its row scales transposed [K / 128, P]): x quantised per token in 1 x 128 groups, its rows
    padded with zeros to P, a multiple of tile_rows (the kernels' TMA reads whole row tiles)."""
    x_q_MK, row_scales_MG = quantize_activations(x_MK, BLOCK_K)
    padded_rows = -x_MK.shape[0] % tile_rows
    return (
        jnp.pad(x_q_MK, ((0, padded_rows), (0, 0))),
        jnp.pad(row_scales_MG, ((0, padded_rows), (0, 0))).T,
    )


def fits(values_NK, block: tuple[int, int], block_n: int) -> bool:
    """128 x 128 blocks, N a multiple of block_n (which divides 128 or is a multiple of it), K of 128."""
    n_dim, k_dim = values_NK.shape
    return (
        tuple(block) == (BLOCK_K, BLOCK_K)
        and not n_dim % block_n
        and not k_dim % BLOCK_K
        and not (BLOCK_K % block_n and block_n % BLOCK_K)
    )


def takes(x, weight) -> bool:
    """Whether the kernel, at its tuned block_n, runs x @ W^T (the "gpu_mosaic" record's `takes`): a 2-D weight
    of 128 x 128 blocks, N a multiple of block_n, K of 128."""
    block_n = lookup(tuned.W8A8_MOSAIC, dtype=x.dtype).block_n
    return weight.values.ndim == 2 and fits(weight.values, weight.block, block_n)


def _check(values_NK, block: tuple[int, int], block_n: int) -> None:
    n_dim, k_dim = values_NK.shape
    if not fits(values_NK, block, block_n) or block_n > BLOCK_K:
        raise ValueError(
            f"w8a8_linear_mgpu takes 128 x 128 weight blocks, N a multiple of block_n ({block_n}, which divides 128) "
            f"and K a multiple of 128; got block {tuple(block)} and a weight of {n_dim} x {k_dim}"
        )


@functools.partial(jax.jit, static_argnames=("block", "tiles", "interpret"))
def w8a8_linear_mgpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: tuned.MosaicTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y [M, N] in x's dtype: `w8a8.w8a8_linear_gpu`'s product (module docstring) on Hopper's FP8 wgmma. values
    [N, K] e4m3, scales [N / 128, K / 128]. Tiles: None from `tuned.W8A8_MOSAIC`."""
    tiles = tiles or lookup(tuned.W8A8_MOSAIC, dtype=x_MK.dtype)
    block_n = tiles.block_n
    _check(values_NK, block, block_n)
    x_q_PK, row_scales_GP = quantized_rows(x_MK, BLOCK_M)
    padded_rows = x_q_PK.shape[0]
    cast = layout_cast(interpret)

    def w8a8_linear_mgpu_kernel(*refs):  # the name a profile shows
        _kernel(*refs, block_n=block_n, stages=tiles.stages, tma=tiles.tma_store, cast=cast)

    y_MN = plgpu.kernel(
        w8a8_linear_mgpu_kernel,
        out_type=jax.ShapeDtypeStruct((padded_rows, values_NK.shape[0]), x_MK.dtype),
        grid=(padded_rows // BLOCK_M, values_NK.shape[0] // block_n),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
    )(x_q_PK, values_NK, row_scales_GP, scales.astype(jnp.float32))
    return y_MN[: x_MK.shape[0]]
