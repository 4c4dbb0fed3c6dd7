"""The routed experts' gate/up products with block-FP8 weights on Hopper: a Pallas Mosaic GPU kernel that reads
the checkpoint's FP8 codes (half the bytes of bf16) and multiplies in bf16 on the tensor cores.

At ~128 rows per expert (8192 tokens, top-8 of 512) the bf16 kernels stream each expert's weights once and are
bound by that stream; FP8 codes halve it. A weight tile changed in registers must reach the tensor cores
without a round trip through shared memory, so the weight is wgmma's A operand, taken from registers:

- the producer warpgroup streams, per K step of 128, the tile's rows of x [block_m, 128] (bf16) and the FP8
  gate and up tiles [128, 128] of its expert through a ring of `stages` shared-memory buffers (TMA);
- consumer c (of two) takes weight rows [64c, 64c + 64) of the tile: it loads its FP8 gate and up rows into
  registers, multiplies them by their 128 x 128 block's scale in fp32 (the tile spans one scale block in each
  direction), rounds to bf16 (bit for bit the weights `ling_jax.quant.dequantize_fp8_block` gives, cast to
  bf16) and accumulates gate^T = W_gate x^T and up^T in fp32 [64, block_m];
- after the K loop it stores swiglu(gate, up) in bf16, transposed: the output is h^T.

Rows sorted by expert are gathered (jnp) into a layout where each expert's rows start at a multiple of 8 (TMA
row offsets must be), and each row tile (`block_m` rows of one expert) owns its own output slab
hT [tiles, I, block_m]: full boxes are stored with no race against the next expert's tile. `slabs_to_rows`
turns the slabs back into h [R, I] (for tests; a consumer kernel reads the slabs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mosaic_gpu_interpret

SCALE_BLOCK = 128  # the checkpoints' FP8 block (rows and columns)
BLOCK_N = SCALE_BLOCK  # weight rows a CTA: two consumers of 64 (wgmma's M)
BLOCK_K = SCALE_BLOCK
CONSUMERS = 2
ROW_ALIGN = 8  # TMA row offsets into x are multiples of this


class RowTiles(NamedTuple):
    """The row tiles of rows sorted by group, in the 8-aligned layout: tile t covers rows [8 * row8[t], +block_m)
    of the gathered x, of which rows[t] (0 for unused tiles) belong to group[t]."""
    group: jax.Array
    row8: jax.Array
    rows: jax.Array


def max_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Tiles for R rows in G groups at most: each group wastes at most one partial tile."""
    return pl.cdiv(num_rows, block_m) + num_groups


def aligned_rows(num_rows: int, num_groups: int, block_m: int) -> int:
    """Rows of the gathered x (a multiple of 8, TMA's row tiling): every group padded to a multiple of 8, plus
    one tile of slack (a tile's box may run past the last group)."""
    return pl.cdiv(num_rows + (ROW_ALIGN - 1) * num_groups + block_m, ROW_ALIGN) * ROW_ALIGN


def _group_layout(group_sizes_G, block_m: int):
    """(sizes, first sorted row, first aligned row, first tile, tiles) per group, int32 [G] each."""
    sizes_G = group_sizes_G.astype(jnp.int32)
    padded_G = (sizes_G + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    tiles_G = (sizes_G + block_m - 1) // block_m
    return (sizes_G, jnp.cumsum(sizes_G) - sizes_G, jnp.cumsum(padded_G) - padded_G, jnp.cumsum(tiles_G) - tiles_G,
            tiles_G)


def _owner(first_G, index_N):
    """The group whose range [first[g], first[g + 1]) holds each index (first non-decreasing)."""
    return jnp.maximum(jnp.searchsorted(first_G, index_N, side="right") - 1, 0)


def row_tiles(group_sizes_G, num_rows: int, *, block_m: int) -> RowTiles:
    """The tile table for sorted rows (group_sizes [G], sum <= num_rows; rows past the sum are in no tile)."""
    sizes_G, _, aligned_G, first_tile_G, tiles_G = _group_layout(group_sizes_G, block_m)
    tile_T = jnp.arange(max_row_tiles(num_rows, sizes_G.shape[0], block_m), dtype=jnp.int32)
    group_T = _owner(first_tile_G, tile_T)
    within_T = tile_T - first_tile_G[group_T]
    rows_T = jnp.where(within_T < tiles_G[group_T], jnp.clip(sizes_G[group_T] - within_T * block_m, 0, block_m), 0)
    return RowTiles(group=group_T, row8=(aligned_G[group_T] + within_T * block_m) // ROW_ALIGN, rows=rows_T)


def gather_aligned(x_XD, source_R, group_sizes_G, *, block_m: int):
    """[aligned_rows, D]: aligned row p holds x[source[r]] for the sorted row r placed there (padding rows
    hold x's row 0). Every index is gathered (no scatter)."""
    num_rows = source_R.shape[0]
    sizes_G, sorted_G, aligned_G, _, _ = _group_layout(group_sizes_G, block_m)
    position_P = jnp.arange(aligned_rows(num_rows, sizes_G.shape[0], block_m), dtype=jnp.int32)
    group_P = _owner(aligned_G, position_P)
    within_P = position_P - aligned_G[group_P]
    row_P = jnp.where(within_P < sizes_G[group_P], sorted_G[group_P] + within_P, num_rows)
    source_P = jnp.concatenate([source_R.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])[row_P]
    return x_XD[source_P]


def slabs_to_rows(hT_TIM, group_sizes_G, num_rows: int, *, block_m: int):
    """h [R, I] in sorted row order (rows past sum(group_sizes) undefined) from the slabs [tiles, I, block_m]."""
    _, sorted_G, _, first_tile_G, _ = _group_layout(group_sizes_G, block_m)
    row_R = jnp.arange(num_rows, dtype=jnp.int32)
    group_R = _owner(sorted_G, row_R)
    within_R = row_R - sorted_G[group_R]
    return hT_TIM[first_tile_G[group_R] + within_R // block_m, :, within_R % block_m]


def _producer(group, row8, num_steps, x_gmem, gate_gmem, up_gmem, scale_gmem, x_smem, gate_smem, up_smem,
              scale_smem, ready, free, scale_ready, *, n_tile, block_m: int, stages: int):
    plgpu.set_max_registers(40, action="decrease")
    rows = pl.ds(row8 * ROW_ALIGN, block_m)
    weight_rows = pl.ds(n_tile * BLOCK_N, BLOCK_N)
    x_ready, gate_ready, up_ready = ready

    @pl.when(num_steps > 0)
    def _scales():
        plgpu.copy_gmem_to_smem(scale_gmem.at[group, n_tile], scale_smem, scale_ready.at[0])

    def load(step, slot):
        cols = pl.ds(step * BLOCK_K, BLOCK_K)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem.at[slot], x_ready.at[slot])
        plgpu.copy_gmem_to_smem(gate_gmem.at[group, weight_rows, cols], gate_smem.at[slot], gate_ready.at[slot])
        plgpu.copy_gmem_to_smem(up_gmem.at[group, weight_rows, cols], up_smem.at[slot], up_ready.at[slot])

    for step in range(min(stages, x_gmem.shape[1] // BLOCK_K)):
        pl.when(step < num_steps)(functools.partial(load, step, step))

    @pl.loop(stages, jnp.maximum(num_steps, stages))
    def _refill(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(free.at[slot])
        load(step, slot)

    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _drain(step):  # every release is observed before the barriers go away
        plgpu.barrier_wait(free.at[lax.rem(step, stages)])


def _swiglu(gate, up, limit: float | None):
    """`pallas_kernels.moe.reference.swiglu` in the operations the Mosaic GPU lowering has (no logistic)."""
    activated = gate / (1.0 + jnp.exp(-gate))
    if limit is None:
        return activated * up
    return jnp.minimum(activated, limit) * jnp.clip(up, -limit, limit)


def _dequantized(codes_smem, scale):
    """FP8 codes [64, k] times their block scale, as bf16 registers."""
    return (codes_smem[...].astype(jnp.float16).astype(jnp.float32) * scale).astype(jnp.bfloat16)


def _output_rows(n_tile, consumer: int):
    return pl.ds(n_tile * BLOCK_N + consumer * (BLOCK_N // CONSUMERS), BLOCK_N // CONSUMERS)


def _consumer(consumer: int, num_steps, x_smem, gate_smem, up_smem, scale_smem, h_smem, a_smem, hT_gmem, ready,
              free, scale_ready, *, limit, n_tile, block_m: int, stages: int, parts: int):
    """Weight rows [64 * consumer, +64) of the tile. Each K step runs in `parts` column parts: dequantize a
    part, issue its two products, wait for the part before it (its registers and, at a step's first part,
    the previous step's buffer are then free), so dequantizing overlaps the tensor cores. a_smem: None, or
    (interpret mode, whose wgmma takes no register operand) shared memory [2, 64, 128] the dequantized
    tiles pass through."""
    plgpu.set_max_registers(232, action="increase")
    part_k = BLOCK_K // parts

    def a_operand(which: int, part: int, weight):
        if a_smem is None:
            return weight
        a_smem.at[which, :, pl.ds(part * part_k, part_k)][...] = weight
        return a_smem.at[which, :, pl.ds(part * part_k, part_k)]

    x_ready, gate_ready, up_ready = ready
    mine = pl.ds(consumer * (BLOCK_N // CONSUMERS), BLOCK_N // CONSUMERS)
    pl.when(num_steps > 0)(lambda: plgpu.barrier_wait(scale_ready.at[0]))

    def products(gate_ref, up_ref):
        @pl.loop(0, num_steps)
        def _step(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(x_ready.at[slot])
            plgpu.barrier_wait(gate_ready.at[slot])
            plgpu.barrier_wait(up_ready.at[slot])
            rows_T = x_smem.at[slot].transpose((1, 0))  # x^T [128, block_m], wgmma's B
            for part in range(parts):
                cols = pl.ds(part * part_k, part_k)
                for which, (acc_ref, codes_smem) in enumerate(((gate_ref, gate_smem), (up_ref, up_smem))):
                    weight = _dequantized(codes_smem.at[slot, mine, cols], scale_smem[which, step])
                    plgpu.wgmma(acc_ref, a_operand(which, part, weight), rows_T.at[cols])
                plgpu.wgmma_wait(2)  # the part before this one is done
                if part == 0:
                    pl.when(step > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(step + stages - 1, stages)]))

        plgpu.wgmma_wait(0)
        pl.when(num_steps > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(num_steps - 1, stages)]))
        return _swiglu(gate_ref[...], up_ref[...], limit)

    acc = plgpu.ACC((BLOCK_N // CONSUMERS, block_m), jnp.float32)
    hT = pl.run_scoped(products, acc, acc)

    @pl.when(num_steps > 0)
    def _store():
        h_smem.at[consumer][...] = hT.astype(h_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_smem.at[consumer], hT_gmem.at[_output_rows(n_tile, consumer)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(group_gmem, row8_gmem, rows_gmem, x_gmem, gate_gmem, up_gmem, scale_gmem, hT_gmem, x_smem, gate_smem,
            up_smem, scale_smem, h_smem, x_ready, gate_ready, up_ready, free, scale_ready, *a_smem, limit,
            block_m: int, stages: int, parts: int):
    n_tile, tile, warpgroup = lax.axis_index("n"), lax.axis_index("tile"), lax.axis_index("wg")
    group, row8 = group_gmem[tile], row8_gmem[tile]
    num_steps = jnp.where(rows_gmem[tile] > 0, x_gmem.shape[1] // BLOCK_K, 0)
    ready = (x_ready, gate_ready, up_ready)
    for consumer in range(CONSUMERS):
        pl.when(warpgroup == consumer)(functools.partial(
            _consumer, consumer, num_steps, x_smem, gate_smem, up_smem, scale_smem, h_smem,
            a_smem[0].at[consumer] if a_smem else None, hT_gmem.at[tile],
            ready, free, scale_ready, limit=limit, n_tile=n_tile, block_m=block_m, stages=stages, parts=parts))
    pl.when(warpgroup == CONSUMERS)(functools.partial(
        _producer, group, row8, num_steps, x_gmem, gate_gmem, up_gmem, scale_gmem, x_smem, gate_smem, up_smem,
        scale_smem, ready, free, scale_ready, n_tile=n_tile, block_m=block_m, stages=stages))


def _check(x_XD, gate_GID, gate_scale, up_GID, up_scale, block_m: int, parts: int):
    width, hidden = gate_GID.shape[1:]
    expected_scale = (gate_GID.shape[0], width // SCALE_BLOCK, hidden // SCALE_BLOCK)
    if x_XD.dtype != jnp.bfloat16:
        raise ValueError(f"gate_up_fp8_mgpu takes bf16 activations, got {x_XD.dtype}")
    for name, codes, scale in (("gate", gate_GID, gate_scale), ("up", up_GID, up_scale)):
        if codes.dtype != jnp.float8_e4m3fn or codes.shape != gate_GID.shape:
            raise ValueError(f"gate_up_fp8_mgpu: {name} codes must be float8_e4m3fn {gate_GID.shape}, got "
                             f"{codes.dtype} {codes.shape}")
        if scale.shape != expected_scale:
            raise ValueError(f"gate_up_fp8_mgpu: {name} scale must be {expected_scale} (one per 128 x 128 block), "
                             f"got {scale.shape}")
    if (width % BLOCK_N or hidden % BLOCK_K or x_XD.shape[1] != hidden or block_m not in (64, 128)
            or parts not in (1, 2)):
        raise ValueError(f"gate_up_fp8_mgpu needs width and hidden multiples of {SCALE_BLOCK}, x's width equal to "
                         f"hidden, block_m 64 or 128 and parts 1 or 2; got width {width}, hidden {hidden}, x "
                         f"{x_XD.shape}, block_m {block_m}, parts {parts}")


@functools.partial(jax.jit, static_argnames=("block_m",))
def prepare_rows(x_XD, source_R, group_sizes_G, *, block_m: int = 128):
    """(RowTiles, x's rows gathered into the 8-aligned layout) for `gate_up_fp8_tiles`."""
    return (row_tiles(group_sizes_G, source_R.shape[0], block_m=block_m),
            gather_aligned(x_XD, source_R, group_sizes_G, block_m=block_m))


@functools.partial(jax.jit, static_argnames=("limit", "block_m", "stages", "parts", "interpret"))
def gate_up_fp8_tiles(tiles: RowTiles, x_PD, gate_GID, gate_scale_GIbDb, up_GID, up_scale_GIbDb, *,
                      limit: float | None, block_m: int = 128, stages: int = 3, parts: int = 2,
                      interpret: bool = False):
    """The kernel alone on `prepare_rows`' output (made with the same block_m): hT [tiles, I, block_m] bf16."""
    _check(x_PD, gate_GID, gate_scale_GIbDb, up_GID, up_scale_GIbDb, block_m, parts)
    width, hidden = gate_GID.shape[1:]
    num_tiles = tiles.group.shape[0]
    scale_GN2S = jnp.stack([gate_scale_GIbDb, up_scale_GIbDb], axis=2).astype(jnp.float32)
    part_k = BLOCK_K // parts  # an FP8 swizzle tile per part: a part's columns are whole tiles
    fp8_layout = (plgpu.TilingTransform((8, part_k)), plgpu.SwizzleTransform(part_k))
    bf16_layout = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return plgpu.kernel(
        functools.partial(_kernel, limit=limit, block_m=block_m, stages=stages, parts=parts),
        out_type=jax.ShapeDtypeStruct((num_tiles, width, block_m), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((stages, block_m, BLOCK_K), jnp.bfloat16, transforms=bf16_layout),
            plgpu.SMEM((stages, BLOCK_N, BLOCK_K), jnp.float8_e4m3fn, transforms=fp8_layout),
            plgpu.SMEM((stages, BLOCK_N, BLOCK_K), jnp.float8_e4m3fn, transforms=fp8_layout),
            plgpu.SMEM((2, hidden // BLOCK_K), jnp.float32),
            plgpu.SMEM((CONSUMERS, BLOCK_N // CONSUMERS, block_m), jnp.bfloat16, transforms=bf16_layout),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_barriers=1),
            *([plgpu.SMEM((CONSUMERS, 2, BLOCK_N // CONSUMERS, BLOCK_K), jnp.bfloat16, transforms=bf16_layout)]
              if interpret else []),
        ),
        grid=(width // BLOCK_N, num_tiles),
        grid_names=("n", "tile"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
    )(tiles.group, tiles.row8, tiles.rows, x_PD, gate_GID, up_GID, scale_GN2S)


@functools.partial(jax.jit, static_argnames=("limit", "block_m", "stages", "parts", "interpret"))
def gate_up_fp8_mgpu(x_XD, source_R, group_sizes_G, gate_GID, gate_scale_GIbDb, up_GID, up_scale_GIbDb, *,
                     limit: float | None, block_m: int = 128, stages: int = 3, parts: int = 2,
                     interpret: bool = False):
    """(hT [tiles, I, block_m] bf16, RowTiles): the slab of row tile t holds swiglu(x_r @ gate[g].T,
    x_r @ up[g].T, limit) for the tile's rows r (columns past tiles.rows[t] undefined), where x_r = x[source[r]]
    and rows are sorted by group (group_sizes [G], sum <= R). gate, up: float8_e4m3fn [G, I, D] codes with fp32
    scales [G, I/128, D/128] (the checkpoint's `weight_scale_inv`); x bf16 [X, D]; fp32 accumulation.
    block_m: rows a tile (64 or 128); stages: ring buffers (3 at block_m 128 fills the shared memory); parts:
    column parts of each K step whose dequantizing overlaps the previous part's products (1 or 2)."""
    _check(x_XD, gate_GID, gate_scale_GIbDb, up_GID, up_scale_GIbDb, block_m, parts)
    tiles, x_PD = prepare_rows(x_XD, source_R, group_sizes_G, block_m=block_m)
    hT_TIM = gate_up_fp8_tiles(tiles, x_PD, gate_GID, gate_scale_GIbDb, up_GID, up_scale_GIbDb, limit=limit,
                               block_m=block_m, stages=stages, parts=parts, interpret=interpret)
    return hT_TIM, tiles
