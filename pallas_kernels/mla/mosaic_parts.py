"""Pieces the Mosaic GPU MLA kernels share (`gpu_mosaic.py`: decode, `gpu_mosaic_prefill.py`): their launch
settings, a product in a fresh accumulator, the layout of a 16-bit wgmma operand in shared memory, interpret mode's
stand-in for layout casts, and the producer's side of a ring of shared-memory buffers filled by TMA (called while a
kernel is traced)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mosaic_gpu_interpret

SWIZZLE = 128  # bytes: 64 16-bit columns per swizzle tile


def warpgroup_launch(warpgroups: int, *, approx_math: bool, interpret: bool) -> dict:
    """`plgpu.kernel`'s keywords for a kernel of `warpgroups` warpgroups (axis "wg") in warpgroup semantics, whose
    row reductions stay within warps; approx_math: exp as ex2.approx; interpret: in jax's Mosaic GPU interpreter."""
    return dict(
        num_threads=warpgroups,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, reduction_scratch_bytes=0, approx_math=approx_math
        ),
        interpret=mosaic_gpu_interpret(interpret),
    )


def operand_layout():
    """Tiling and swizzle of a 16-bit wgmma operand in shared memory (rows of 64 or more columns)."""
    return (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


def product(a, b_smem, rows: int, cols: int, after_issue=lambda: None):
    """a [rows, K] (shared memory or registers) @ b [K, cols] from shared memory, fp32, in a fresh wgmma
    accumulator (jax 0.10's interpreter has no in-place accumulation); after_issue() runs while the tensor cores
    work on it."""
    return product_while(a, b_smem, rows, cols, after_issue)[0]


def product_while(a, b_smem, rows: int, cols: int, work):
    """(`product`'s a @ b, work()): work runs while the tensor cores compute the product, its values returned."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
        done = work()
        return acc_ref[...], done

    return pl.run_scoped(run, plgpu.ACC((rows, cols), jnp.float32))


def keep_layout(x, layout):
    """Interpret mode's stand-in for plgpu.layout_cast (register layouts do not exist there)."""
    del layout
    return x


def fill_ring(num_tiles, stages: int, load_tile, free_barriers) -> None:
    """Tiles 0 .. num_tiles - 1 through `stages` buffers: load_tile(t, slot) issues tile t's copies into buffer
    slot (t as a traced int32: its slices are not bounds-checked at trace time, where tiles past num_tiles
    would be), tile t >= stages once the consumers released its buffer (free_barriers.at[slot]); then every
    release of the last tiles is awaited, so each barrier phase is observed before the barriers go away."""
    for t in range(stages):
        tile = jnp.int32(t)
        pl.when(tile < num_tiles)(lambda tile=tile: load_tile(tile, tile))

    @pl.loop(stages, jnp.maximum(num_tiles, stages))
    def _refill(t):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(free_barriers.at[slot])
        load_tile(t, slot)

    @pl.loop(jnp.maximum(num_tiles - stages, 0), num_tiles)
    def _drain(t):
        plgpu.barrier_wait(free_barriers.at[lax.rem(t, stages)])
