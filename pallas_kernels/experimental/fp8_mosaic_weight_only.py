"""A lab variant: weight-only block-FP8 linear for decode batches on Hopper as a Pallas Mosaic GPU kernel,
`weight_only_linear_mgpu`. Importing this module registers it as "gpu_mosaic" of
`pallas_kernels.fp8.ops.VARIANTS["weight_only_linear"]` (named only).

Status: written 2026-12-03 from the batch-64 decode profile (the projections' Triton weight-only kernel read ~1
TB/s); CUDA lowering tested in CI, correct on the H200 (`pytest -m gpu`), and 10-20% faster than the Triton kernel
at 32-128 rows but still ~1 TB/s at best (docs/benchmarks/matmul.md, 'The Mosaic weight-only kernel on the H200'),
which leaves the default with the Triton kernels.

The product of `reference.weight_only_linear_reference` (W dequantised to x's dtype, then x @ W^T with fp32 sums),
computed transposed so that the weight is wgmma's register operand: one CTA (one warpgroup) per 64 weight rows
and one of k_splits ranges of K walks its K blocks of 128 in a TMA pipeline (`plgpu.emit_pipeline`, `stages`
buffers) of the e4m3 weight tile [64, 128] and the x tile [M, 128]; each step loads the weight tile into
registers, dequantises it (times the block's scale in fp32, cast to x's dtype: the reference's rounding) and
issues y^T[64, M] += W_tile @ x_tile^T, x read transposed from shared memory. The fp32 partial sums [k_splits, N,
M] are added and transposed by XLA (N x M elements: small next to the weight). The weight is read once, as
stored; x (M <= MAX_ROWS rows, padded to a multiple of 8: wgmma's N) once per CTA, from L2.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import variants
from pallas_kernels.compat import mosaic_gpu_interpret
from pallas_kernels.fp8 import ops
from pallas_kernels.fp8.gpu_mosaic import BLOCK_K, fp8_transforms
from pallas_kernels.tuning import ANY, H200, Entry, lookup
from pallas_kernels.variants import Variant

BLOCK_N = 64  # weight rows a CTA: one warpgroup's wgmma rows
MAX_ROWS = 128  # x rows (wgmma's N at most 256; shared memory: a stage holds 8 KB of weight and 256 B a row of x)


@dataclasses.dataclass(frozen=True)
class MosaicWeightOnlyTiles:
    """stages shared-memory buffers of the TMA pipeline over K, the K blocks cut into k_splits ranges run by separate
    CTAs (more CTAs for a narrow weight)."""

    stages: int
    k_splits: int


# A CTA covers 64 weight rows: an 8192-row weight gives 128 CTAs a split, so 2 splits fill the H200's 132 SMs about
# twice.
_MEASURED = Entry(
    MosaicWeightOnlyTiles(4, 2),
    "docs/benchmarks/matmul.md#the-mosaic-weight-only-kernel-on-the-h200-2026-12-03-eighth-session: 8192 x "
    "4096 at 8 / 32 / 64 / 128 rows 25.2 / 32.3 / 36.5 / 46.6 us (second run); no setting best at every size",
)
WEIGHT_ONLY_MOSAIC = {(H200, ANY, ANY): _MEASURED, (ANY, ANY, ANY): _MEASURED}


def _x_transforms(dtype):
    """A 16-bit x tile: rows of 128 elements (256 bytes) in 64-element swizzled tiles."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


def _kernel(values_gmem, x_gmem, scales_gmem, y_gmem, *, steps_per_split: int, stages: int):
    """CTA (n, s): y^T partial sum s of weight rows [n * 64, n * 64 + 64) over K blocks [s * steps, (s + 1) *
    steps)."""
    n, split = lax.axis_index("n"), lax.axis_index("s")
    first_step = split * steps_per_split
    scale_row = n * BLOCK_N // BLOCK_K
    num_rows = x_gmem.shape[0]

    def k_step(indices, w_smem, x_smem, acc_ref):
        (step,) = indices
        scale = scales_gmem[scale_row, first_step + step]
        w_NK = (w_smem[...].astype(jnp.float32) * scale).astype(x_gmem.dtype)
        plgpu.wgmma(acc_ref, w_NK, x_smem.T)
        plgpu.wgmma_wait(0)
        return acc_ref

    def run(acc_ref):
        k_range = pl.ds(first_step * BLOCK_K, steps_per_split * BLOCK_K)
        plgpu.emit_pipeline(
            k_step,
            grid=(steps_per_split,),
            in_specs=[
                plgpu.BlockSpec((BLOCK_N, BLOCK_K), lambda k: (0, k), transforms=fp8_transforms()),
                plgpu.BlockSpec((num_rows, BLOCK_K), lambda k: (0, k), transforms=_x_transforms(x_gmem.dtype)),
            ],
            max_concurrent_steps=stages,
            init_carry=acc_ref,
        )(values_gmem.at[pl.ds(n * BLOCK_N, BLOCK_N), k_range], x_gmem.at[:, k_range])
        return acc_ref[...]

    acc_NM = pl.run_scoped(run, plgpu.ACC((BLOCK_N, num_rows), jnp.float32))
    y_gmem[split, pl.ds(n * BLOCK_N, BLOCK_N), :] = acc_NM


def _fits(x_MK, values_NK, block: tuple[int, int]) -> bool:
    """16-bit x of at most MAX_ROWS rows, 128 x 128 blocks, N a multiple of 64 and K of 128."""
    n_dim, k_dim = values_NK.shape
    return (
        jnp.dtype(x_MK.dtype).itemsize == 2
        and x_MK.shape[0] <= MAX_ROWS
        and tuple(block) == (BLOCK_K, BLOCK_K)
        and not n_dim % BLOCK_N
        and not k_dim % BLOCK_K
    )


def takes(x, weight) -> bool:
    """Whether the kernel runs x @ W^T (its record's `takes`): a 2-D weight, and the shapes of `_fits`."""
    return weight.values.ndim == 2 and _fits(x.reshape(-1, x.shape[-1]), weight.values, weight.block)


@functools.partial(jax.jit, static_argnames=("block", "tiles", "interpret"))
def weight_only_linear_mgpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: MosaicWeightOnlyTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y [M, N] in x's dtype (module docstring). values [N, K] e4m3, scales [N / 128, K / 128]. Tiles: None from
    `WEIGHT_ONLY_MOSAIC`; k_splits is cut to a divisor of the K blocks."""
    if not _fits(x_MK, values_NK, block):
        raise ValueError(
            f"weight_only_linear_mgpu takes bf16 / fp16 x of at most {MAX_ROWS} rows, 128 x 128 weight blocks, N a "
            f"multiple of {BLOCK_N} and K of {BLOCK_K}; got x {x_MK.dtype} {x_MK.shape}, block {tuple(block)}, "
            f"weight {values_NK.shape}"
        )
    tiles = tiles or lookup(WEIGHT_ONLY_MOSAIC, dtype=x_MK.dtype)
    num_rows, k_dim = x_MK.shape
    num_steps = k_dim // BLOCK_K
    k_splits = math.gcd(num_steps, tiles.k_splits)
    padded_rows = -(-num_rows // 8) * 8
    x_MK_padded = jnp.pad(x_MK, ((0, padded_rows - num_rows), (0, 0)))
    kernel = functools.partial(_kernel, steps_per_split=num_steps // k_splits, stages=tiles.stages)
    partial_SNM = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((k_splits, values_NK.shape[0], padded_rows), jnp.float32),
        grid=(values_NK.shape[0] // BLOCK_N, k_splits),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
    )(values_NK, x_MK_padded, scales.astype(jnp.float32))
    return jnp.sum(partial_SNM, axis=0)[:, :num_rows].T.astype(x_MK.dtype)


variants.register(ops.VARIANTS, "weight_only_linear", ops.MOSAIC, Variant("gpu", weight_only_linear_mgpu, takes=takes))
