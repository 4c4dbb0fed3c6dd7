"""The persistent, warp-specialised Pallas Mosaic GPU kernel of block-FP8 W8A8 products over row tiles that each
take one of G weights (TMA, e4m3 wgmma): `grouped_call`. The dense W8A8 linear (`gpu_mosaic_ws`: one weight, every
tile its own rows of x) and the lab's routed experts (`pallas_kernels.experimental.moe_gpu_mosaic`: a weight an
expert, tiles of each expert's rows) run it.

One CTA per SM loops over the (tile, column group) items (`plgpu.nd_loop`, the column group fastest: the items in
flight share a tile's x and a weight in L2); per item a warp-specialised pipeline: one warpgroup issues the TMA
copies of the x tile (128 rows of x_q from the tile's start row), the weight tiles [block_n, 128] and the tile's
activation scales of each K block, two compute warpgroups take 64 rows each: per K block a wgmma in a fresh
accumulator, waited for, scaled by the rows' activation scales and the weight block's scale and added to the fp32
accumulators in registers (one warpgroup's promotion overlaps the other's wgmma); at a column tile's last K block
`store` writes the accumulators (`store_rows`: cast to the output's dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8.gpu_mosaic import BLOCK_K, fp8_transforms, out_transforms, promoted_products, tma_store

BLOCK_M = 128  # a tile's rows: 64 for each of the two compute warpgroups
WG_ROWS = 64  # one warpgroup's wgmma rows
MEMORY_REGISTERS = 40  # the TMA warpgroup's registers a thread (the compute warpgroups get the rest)
HOPPER_SMS = 132  # the persistent grid when lowering without a GPU
ALIGN = 8  # an expert's first row in the aligned x: a TMA of (8, 128)-tiled shared memory starts on a tile row


def store_rows(accs, rows, cols, out_smem, y_gmem):
    """The accumulator's sub-tiles cast to y's dtype: through the warpgroup's shared-memory buffers by TMA where there
    are some, else from registers."""
    (subtiles,) = accs
    width = cols.size // len(subtiles)
    y_cols = [pl.ds(cols.start + i * width, width) for i in range(len(subtiles))]
    if out_smem is None:
        for acc_MN, sub_cols in zip(subtiles, y_cols):
            y_gmem[rows, sub_cols] = acc_MN.astype(y_gmem.dtype)
    else:
        out_smems = [out_smem.at[i] for i in range(len(subtiles))]
        tma_store(subtiles, out_smems, [y_gmem.at[rows, sub_cols] for sub_cols in y_cols])


def _grouped_kernel(
    tile_group_gmem,
    tile_start_gmem,
    x_gmem,
    row_scales_gmem,
    *refs,
    num_weights,
    block_n,
    columns,
    stages,
    store,
    tma_dtype,
    step_blocks,
):
    """One CTA per SM over the (tile t, column group c) items, a column group `columns` column tiles of block_n:
    store(accumulators, the warpgroup's 64 rows of tile t in the padded layout, column tile, the warpgroup's
    shared-memory buffers [block_n / sub_n, 64, sub_n] of tma_dtype (None where tma_dtype is None), *outputs) for
    each column tile of the group in turn, the accumulators a tuple per (values [G, N, K], scales [G, N / 128,
    K / 128]) pair of the first 2 num_weights refs (the outputs follow) of its [64, sub_n] sub-tiles (sub_n =
    min(block_n, 128): a column tile wider than a weight block is one TMA tile, its 128-column halves products of
    their own, each with its block's scale), for tile t's expert, from x's 128 rows starting at tile_start[t]; tiles
    past the last expert's are skipped. One pipeline an item walks its column tiles' K blocks (a longer pipeline
    than one column tile's: one fill an item), step_blocks K blocks a step (`promoted_products`: 2 overlaps a
    block's promotion with the next block's wgmma; K blocks a multiple of it)."""
    weight_refs, out_refs = refs[: 2 * num_weights], refs[2 * num_weights :]
    values_refs, scales_refs = weight_refs[0::2], weight_refs[1::2]
    num_groups, n_dim, k_dim = values_refs[0].shape
    k_steps, item_n = k_dim // (BLOCK_K * step_blocks), columns * block_n
    sub_n = min(block_n, BLOCK_K)
    subtiles = block_n // sub_n
    num_tiles, num_items_n = tile_group_gmem.shape[0], n_dim // item_n
    wg = lax.axis_index("wg")
    half = pl.ds(wg * WG_ROWS, WG_ROWS)
    x_specs = [
        plgpu.BlockSpec((BLOCK_M, BLOCK_K), lambda j, k, b=b: (0, step_blocks * k + b), transforms=fp8_transforms())
        for b in range(step_blocks)
    ]
    weight_specs = [
        plgpu.BlockSpec((block_n, BLOCK_K), lambda j, k, b=b: (j, step_blocks * k + b), transforms=fp8_transforms())
        for b in range(step_blocks)
    ]

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(columns, k_steps),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                *x_specs,
                *(spec for _ in values_refs for spec in weight_specs),
                plgpu.BlockSpec((step_blocks, BLOCK_M), lambda j, k: (k, 0)),
            ],
            max_concurrent_steps=stages,
            wg_axis="wg",
            num_compute_wgs=2,
            compute_context=context,
        )

    def operands(tile_start, group, c):
        return (
            *(x_gmem.at[pl.ds(tile_start, BLOCK_M)] for _ in range(step_blocks)),
            *(values.at[group, pl.ds(c * item_n, item_n)] for values in values_refs for _ in range(step_blocks)),
            row_scales_gmem.at[:, pl.ds(tile_start, BLOCK_M)],
        )

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(*operands(0, 0, 0)),
        out_smem=None
        if tma_dtype is None
        else plgpu.SMEM((2, subtiles, WG_ROWS, sub_n), tma_dtype, transforms=out_transforms(tma_dtype, sub_n)),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        @plgpu.nd_loop((num_tiles * num_items_n,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            t, c = lax.div(item, num_items_n), lax.rem(item, num_items_n)
            group = tile_group_gmem[t]

            def step(indices, *step_refs):
                j, k_step = indices
                x_smems = [x_smem.at[half] for x_smem in step_refs[:step_blocks]]
                weight_smems = [  # each weight's tiles of the step's K blocks
                    step_refs[step_blocks * (1 + w) : step_blocks * (2 + w)] for w in range(num_weights)
                ]
                row_scales_smem, accs = step_refs[-2], step_refs[-1]
                row_scales = [
                    plgpu.layout_cast(row_scales_smem[b, half], plgpu.Layout.WGMMA.reduce(1))
                    for b in range(step_blocks)
                ]
                k_blocks = [step_blocks * k_step + b for b in range(step_blocks)]
                col0 = c * item_n + j * block_n
                accs = tuple(
                    tuple(
                        promoted_products(
                            acc_MN,
                            x_smems,
                            [w_smem.at[pl.ds(i * sub_n, sub_n)] for w_smem in w_smems],
                            row_scales,
                            [scales[group, (col0 + i * sub_n) // BLOCK_K, k_block] for k_block in k_blocks],
                        )
                        for i, acc_MN in enumerate(weight_accs)
                    )
                    for w_smems, scales, weight_accs in zip(weight_smems, scales_refs, accs, strict=True)
                )
                last = k_step == k_steps - 1

                @pl.when(last)
                def _():
                    store(
                        accs,
                        pl.ds(t * BLOCK_M + wg * WG_ROWS, WG_ROWS),
                        pl.ds(col0, block_n),
                        None if out_smem is None else out_smem.at[wg],
                        *out_refs,
                    )

                keep = jnp.where(last, 0.0, 1.0)  # the next column tile starts from zeros (the sums are finite)
                return tuple(tuple(acc_MN * keep for acc_MN in weight_accs) for weight_accs in accs)

            def context(run):
                zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, sub_n), jnp.float32), plgpu.Layout.WGMMA)
                run(tuple(tuple(zeros for _ in range(subtiles)) for _ in values_refs))

            @pl.when(group < num_groups)
            def _():
                tile_start = pl.multiple_of(tile_start_gmem[t], ALIGN)
                pipeline(step, context)(*operands(tile_start, group, c), allocations=allocations)

        if out_smem is not None:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last TMA stores have read their buffers


def _num_sms() -> int:
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else HOPPER_SMS


def grouped_call(
    tile_group_T,
    tile_start_T,
    x_q_SK,
    row_scales_GS,
    weights,
    *,
    out_type,
    block_n,
    columns,
    stages,
    store,
    name,
    tma_dtype=None,
    step_blocks=1,
):
    """`_grouped_kernel` over the tiles, weights a tuple of block-FP8 stacks; out_type that of store's outputs;
    name the kernel's (what a profile shows); step_blocks K blocks a pipeline step; tma_dtype that of the
    warpgroups' output buffers for TMA stores (None: none). x_q_SK's rows (and row_scales_GS's columns, a multiple
    of 4 of them) reach BLOCK_M past every tile_start."""

    def kernel(*refs):
        _grouped_kernel(
            *refs,
            num_weights=len(weights),
            block_n=block_n,
            columns=columns,
            stages=stages,
            store=store,
            tma_dtype=tma_dtype,
            step_blocks=step_blocks,
        )

    kernel.__name__ = kernel.__qualname__ = name
    operands = [array for w in weights for array in (w.values, w.scales.astype(jnp.float32))]
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(tile_group_T, tile_start_T, x_q_SK, row_scales_GS, *operands)
