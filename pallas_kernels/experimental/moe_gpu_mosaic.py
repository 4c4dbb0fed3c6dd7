"""The routed-expert FFN in W8A8 on Hopper as Pallas Mosaic GPU kernels (TMA, e4m3 wgmma): `w8a8_expert_rows_mgpu`.

The arithmetic of `moe.w8a8_reference` (x and h quantised per token in 1 x 128 groups, FP8 products scaled per
128-input block, fp32 sums) on the pipeline of the W8A8 linear (`fp8.gpu_mosaic.block_scaled_products`), over
rows laid out by expert in 64-row tiles:

- XLA quantises x once per token and gathers x_q's rows (one byte an input) into the padded expert order: each
  expert's rows start on a 64-row tile, a tile belongs to one expert (`padded_layout`: tile_group[t], the
  expert of tile t, or G for the tiles past the last expert's, which the kernels skip);
- gate/up kernel: CTA (n, t) multiplies tile t's x_q by its expert's gate and up tiles [128, K] in one TMA
  pipeline (two accumulators), then SwiGLU in fp32 and h quantised in registers (the column tile is one 1 x 128
  group of h), storing h_q [P, I] e4m3 and its scales transposed [I / 128, P];
- XLA folds each row's routing weight into h's scales (the down product is linear in them);
- down kernel: the same pipeline on h_q and the expert's down tiles, storing [P, D] in x's dtype, whose rows XLA
  gathers back to the caller's order.

On the H200 at Ling-3.1-flash width (8192 tokens, 2026-12-03, `benchmarks/moe/w8a8.py`) these ran at 0.76x the
bf16 fused kernels and 0.6x the Triton W8A8 ones (`gpu_triton.w8a8`, the default): 2.5 ms a kernel, plus 1.1 ms of
XLA gathers. A CTA's K loop is short (32 and 10 steps of 128) and each step waits for its wgmma, so the pipeline's
fill is paid per 64-row tile; a persistent kernel whose pipeline runs on across tiles is the lead. Named variant
only: importing this module registers the entry point as MOSAIC ("gpu_mosaic") of `pallas_kernels.moe.ops`'
`w8a8_expert_rows`.

Grid order: the column tile n varies fastest, so the CTAs that run together share a row tile and its expert's
weight tiles in L2. Shapes: 128 x 128 weight blocks, I and D multiples of 128. Like the linear, the kernels run in
interpret mode only on jax >= 0.11 (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mosaic_gpu_interpret
from pallas_kernels.fp8.gpu_mosaic import BLOCK_K, BLOCK_M, block_scaled_products, layout_cast
from pallas_kernels.fp8.reference import E4M3_MAX, EPS, quantize_activations
from pallas_kernels.moe import ops, tuned
from pallas_kernels.tuning import fill, lookup
from pallas_kernels.variants import Variant

MOSAIC = "gpu_mosaic"

TILE_KEYWORDS = ("gate_up_stages", "down_block_n", "down_stages")


def padded_layout(sizes_G, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(pos_R, tile_group_T): where row r of the expert order (rows grouped by expert, sizes_G of them in turn,
    rows past their sum a tail) lies in the padded layout, whose every expert starts on a BLOCK_M-row tile (the
    tail rows' pos is P = T * BLOCK_M, out of range), and the expert of each of the T tiles (G past the last
    expert's). T = ceil(R / BLOCK_M) + min(G, R) covers any sizes."""
    num_groups = sizes_G.shape[0]
    num_tiles = -(-num_rows // BLOCK_M) + min(num_groups, num_rows)
    sizes_G = sizes_G.astype(jnp.int32)
    tiles_G = -(-sizes_G // BLOCK_M)
    tile_end_G = jnp.cumsum(tiles_G)
    tile_group_T = jnp.searchsorted(tile_end_G, jnp.arange(num_tiles), side="right").astype(jnp.int32)
    row_end_G = jnp.cumsum(sizes_G)
    rows_R = jnp.arange(num_rows, dtype=jnp.int32)
    group_R = jnp.searchsorted(row_end_G, rows_R, side="right")
    offset_G = (tile_end_G - tiles_G) * BLOCK_M - (row_end_G - sizes_G)  # padded start - start
    pos_R = rows_R + jnp.take(offset_G, group_R, mode="clip")
    return jnp.where(group_R < num_groups, pos_R, num_tiles * BLOCK_M).astype(jnp.int32), tile_group_T


def _swiglu(gate_MN, up_MN, limit: float | None):
    """`moe.reference.swiglu` in the ops a register tile has (SiLU as g / (1 + exp(-g)))."""
    activated_MN = gate_MN / (1.0 + jnp.exp(-gate_MN))
    if limit is None:
        return activated_MN * up_MN
    return jnp.minimum(activated_MN, limit) * jnp.clip(up_MN, -limit, limit)


def _store_h_quantized(accs, rows, cols, h_q_gmem, h_scale_gmem, *, limit):
    """h quantised in registers: the column tile is one 1 x 128 group (`fp8.reference.quantize_groups`), its scales
    stored transposed ([I / 128, P]: a tile's are one row of 64), as the down kernel reads them."""
    h_MN = _swiglu(*accs, limit)
    scale_M = jnp.maximum(jnp.max(jnp.abs(h_MN), axis=1), EPS) / E4M3_MAX
    h_q_gmem[rows, cols] = jnp.clip(h_MN / lax.broadcast_in_dim(scale_M, h_MN.shape, [0]), -E4M3_MAX, E4M3_MAX).astype(
        h_q_gmem.dtype
    )
    h_scale_gmem[cols.start // BLOCK_K, rows] = scale_M


def _store_rows(accs, rows, cols, y_gmem):
    (acc_MN,) = accs
    y_gmem[rows, cols] = acc_MN.astype(y_gmem.dtype)


def _grouped_kernel(
    tile_group_gmem, x_gmem, row_scales_gmem, *refs, num_weights: int, block_n: int, stages: int, cast, store
):
    """CTA (n, t): store(accumulators, tile t's 64 rows, column tile n, *outputs), one accumulator per (values
    [G, N, K], scales [G, N / 128, K / 128]) pair of the first 2 num_weights refs (the outputs follow), for tile t's
    expert; tiles past the last expert's store nothing."""
    weight_refs, out_refs = refs[: 2 * num_weights], refs[2 * num_weights :]
    n, t = lax.axis_index("n"), lax.axis_index("t")
    group = tile_group_gmem[t]
    scale_row = n * block_n // BLOCK_K

    @pl.when(group < weight_refs[0].shape[0])
    def _():
        weights = tuple(
            (values.at[group, pl.ds(n * block_n, block_n)], lambda k, scales=scales: scales[group, scale_row, k])
            for values, scales in zip(weight_refs[0::2], weight_refs[1::2])
        )
        accs = block_scaled_products(
            x_gmem.at[pl.ds(t * BLOCK_M, BLOCK_M)],
            row_scales_gmem.at[:, pl.ds(t * BLOCK_M, BLOCK_M)],
            weights,
            block_n=block_n,
            stages=stages,
            cast=cast,
        )
        store(accs, pl.ds(t * BLOCK_M, BLOCK_M), pl.ds(n * block_n, block_n), *out_refs)


def _grouped_call(tile_group_T, x_q_PK, row_scales_GP, weights, *, out_type, block_n, stages, store, interpret):
    """`_grouped_kernel` over the padded rows, weights a tuple of block-FP8 stacks; out_type that of store's
    outputs."""
    n_dim = weights[0].values.shape[1]
    kernel = functools.partial(
        _grouped_kernel,
        num_weights=len(weights),
        block_n=block_n,
        stages=stages,
        cast=layout_cast(interpret),
        store=store,
    )
    operands = [array for w in weights for array in (w.values, w.scales.astype(jnp.float32))]
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(n_dim // block_n, x_q_PK.shape[0] // BLOCK_M),
        grid_names=("n", "t"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
    )(tile_group_T, x_q_PK, row_scales_GP, *operands)


def takes(gate, up, down, down_block_n: int = BLOCK_K) -> bool:
    """Whether the kernels run these block-FP8 experts: 128 x 128 blocks, I and D multiples of 128, D of down's
    column tile (which divides 128)."""
    width, hidden = gate.values.shape[1:]
    return (
        all(tuple(w.block) == (BLOCK_K, BLOCK_K) for w in (gate, up, down))
        and not width % BLOCK_K
        and not hidden % BLOCK_K
        and not BLOCK_K % down_block_n
    )


def _check(gate, up, down, down_block_n: int) -> None:
    if not takes(gate, up, down, down_block_n):
        raise ValueError(
            "w8a8_expert_rows_mgpu takes 128 x 128 weight blocks and an expert width and hidden size that are "
            f"multiples of 128 (down's column tile {down_block_n} dividing 128); got blocks "
            f"{[tuple(w.block) for w in (gate, up, down)]}, gate {gate.values.shape}, down {down.values.shape}"
        )


@functools.partial(jax.jit, static_argnames=("limit", *TILE_KEYWORDS, "fill_tail", "interpret"))
def w8a8_expert_rows_mgpu(
    x_XD,
    source_R,
    order_R,
    row_weight_R,
    sizes_E,
    gate,
    up,
    down,
    limit: float | None,
    *,
    gate_up_stages: int | None = None,
    down_block_n: int | None = None,
    down_stages: int | None = None,
    fill_tail: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """[R, D] in x's dtype, as `gpu_triton.w8a8.w8a8_expert_rows`: row order[r] = row_weight[r] *
    FFN_g(x[source[r]]) for the r-th row of the expert order (rows past sum(sizes) zeros), from block-FP8 gate, up
    [G, I, D] and down [G, D, I] (module docstring). fill_tail is the Triton kernels' (the tail rows are always
    zeros here). Tiles: None from `tuned.W8A8_MOSAIC_EXPERTS`."""
    del fill_tail
    gate_up_stages, down_block_n, down_stages = fill(
        (gate_up_stages, down_block_n, down_stages), lookup(tuned.W8A8_MOSAIC_EXPERTS, dtype=x_XD.dtype)
    )
    _check(gate, up, down, down_block_n)
    num_rows = source_R.shape[0]
    pos_R, tile_group_T = padded_layout(sizes_E, num_rows)
    padded_rows = tile_group_T.shape[0] * BLOCK_M
    token_P = jnp.zeros(padded_rows, jnp.int32).at[pos_R].set(source_R.astype(jnp.int32), mode="drop")
    x_q_XD, x_scale_XG = quantize_activations(x_XD, BLOCK_K)
    h_q_PI, h_scale_GP = _grouped_call(
        tile_group_T,
        x_q_XD[token_P],
        x_scale_XG[token_P].T,
        (gate, up),
        out_type=(
            jax.ShapeDtypeStruct((padded_rows, gate.values.shape[1]), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((gate.values.shape[1] // BLOCK_K, padded_rows), jnp.float32),
        ),
        block_n=BLOCK_K,
        stages=gate_up_stages,
        store=functools.partial(_store_h_quantized, limit=limit),
        interpret=interpret,
    )
    row_weight_P = jnp.zeros(padded_rows, jnp.float32).at[pos_R].set(row_weight_R.astype(jnp.float32), mode="drop")
    y_PD = _grouped_call(
        tile_group_T,
        h_q_PI,
        h_scale_GP * row_weight_P,
        (down,),
        out_type=jax.ShapeDtypeStruct((padded_rows, down.values.shape[1]), x_XD.dtype),
        block_n=down_block_n,
        stages=down_stages,
        store=_store_rows,
        interpret=interpret,
    )
    pos_of_out_R = jnp.zeros(num_rows, jnp.int32).at[order_R].set(pos_R)
    return jnp.take(y_PD, pos_of_out_R, axis=0, mode="fill", fill_value=0)


ops.VARIANTS["w8a8_expert_rows"][MOSAIC] = Variant("gpu", w8a8_expert_rows_mgpu)
