"""Launch settings of the block-FP8 linear kernels, keyed by (device kind, shape bucket, dtype)
(`pallas_kernels.tuning`), and the row counts at which `fp8_linear` runs each kernel by default.

The K step of both kernels is the weight's scale block (128 inputs), so only the output tile and the launch are
tuned. WEIGHT_ONLY_GEMV is for decode-sized calls (up to GEMV_MAX_ROWS rows: a stream of the FP8 weight),
WEIGHT_ONLY for the block-scaled weight-only kernel (any rows), W8A8 and W8A8_TC_ACC for prefill-sized ones (FP8
tensor cores; the second for the variant that accumulates each K block in the tensor cores), W8A8_MOSAIC for the
Mosaic GPU W8A8 kernel (`fp8/gpu_mosaic.py`), TPU for the TPU weight-only kernel (`fp8/tpu_mosaic.py`). Every kernel
entry point takes its tiles as one of the dataclasses here (`tiles=`; None: its table's entry).
(The W8A8 routed-expert kernels' settings are in `pallas_kernels.moe.tuned`.)
Entries without a measurement say so.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.tuning import ANY, H200, Entry

# `fp8_linear` on a GPU without a mode named (`ExecutionPolicy(fp8_matmul="auto")` for a checkpoint that declares
# `activation_scheme: dynamic`, as every published one does): the weight-only kernels up to WEIGHT_ONLY_MAX_ROWS rows
# (tokens), W8A8 from W8A8_MIN_ROWS (None: never), XLA's dot on the dequantised weight in between. So a decode step
# keeps the weight-only kernels (faster there) and a prefill chunk runs FP8 x FP8, the checkpoint's own numerics:
# a token's output then depends on how many rows share its call (a serving batch, a prefill chunk, an MTP verify
# pass); `mode="weight_only"` / `ExecutionPolicy(fp8_matmul="weight_only")` is the batch-invariant mode (the
# dequantised weights' numerics at every size, as the transformers reference computes them). W8A8 at every size is
# `mode="w8a8"`. The 8-layer Ling-3.1-flash slice prefilled one 8192-token chunk at 73,849 tok/s with W8A8 from 256
# rows against 23,094 weight-only (docs/benchmarks/generation.md, 2026-12-03).
# Measured on the H200 (docs/benchmarks/matmul.md, 'Block-FP8 linear kernels (2026-12-02)', 'The decode-shaped
# kernel', 'Decode rows again, the XLA scale-folded product, and the Mosaic W8A8 kernel measured (2026-12-03)' and
# 'Weight-only tiles for 17-255 rows (2026-12-03)'): the block-scaled weight-only kernel took 29-46 us at 8 and 16
# rows of the 4096- and 10240-wide projections and, at its "more_rows" tiles, 38.7 us at 64 rows of 8192 x 4096,
# against 84-117 us for dequantise + dot; past 255 rows dequantise + dot is the faster weight-only product (0.83
# against 5.3 ms at 8192 rows). In W8A8 the Mosaic kernel beat dequantise + dot at every size from 256 rows (8192 x
# 4096: 47.1 against 117.4 us at 256 rows, 781.7 against 825.8 = 703 TFLOP/s at 8192), so W8A8 runs it from
# MOSAIC_MIN_ROWS rows where it takes the weight (the tensor-core-accumulated Triton kernel below that and
# elsewhere: 41.5 against 56.2 us at 64 rows).
WEIGHT_ONLY_MAX_ROWS = 255
W8A8_MIN_ROWS = 256
MOSAIC_MIN_ROWS = 256
GEMV_MAX_ROWS = 16
GEMV_DEFAULT_ROWS = 2


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """gpu_triton: block_m rows x block_n outputs a program (block_n at most the weight's row block: one weight
    scale per K step), group_m row tiles whose programs run together (L2 reuse of the weight tiles), the K steps
    cut into k_splits ranges run by separate programs (fp32 partial sums added after the kernel: more programs,
    more loads in flight, for a few rows)."""

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    k_splits: int = 1


@dataclasses.dataclass(frozen=True)
class WeightOnlyTiles(LinearTiles):
    """The weight-only kernel's tiles, plus weight_left: each product as the dequantised weight tile @ x tile^T
    (the weight tile stays in registers as the MMA's first operand, which Hopper's wgmma allows; the second must
    come from shared memory), accumulated as [block_n, block_m] and transposed once at the end."""

    weight_left: bool = False


def _gpu(entries: dict) -> dict:
    """The H200's entries {(bucket, dtype): Entry}, also the defaults for every other device."""
    return {(device, *key): entry for key, entry in entries.items() for device in (H200, ANY)}


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    """gpu_triton_gemv: block_o outputs a program (at most the weight's row block), blocks_per_step K blocks of
    weight loaded a loop step (all issued before any is used: the bytes in flight), the K steps split over
    programs until there are min_programs (fp32 partial sums added after the kernel), tensor-core products from
    dot_min_rows rows (below: FMA products, no padded rows). sum_k: where the FMA products are summed along K
    (cross-thread sums): SUM_EACH_STEP, held [block_o, block_k] a row over a loop step and summed once it is done;
    SUM_EACH_BLOCK, after every K block into a [block_o] accumulator a row (fewer registers: at 2-7 rows with the
    1-row tiles, 72-128 a thread against 136-255 held over the step, Triton 3.6 for sm_90); SUM_AFTER_LOOP, held
    [block_o, block_k] a row over the whole loop and summed once after it (no cross-thread sums in the loop, the
    same registers as SUM_EACH_STEP)."""

    block_o: int
    blocks_per_step: int
    min_programs: int
    dot_min_rows: int
    num_warps: int
    num_stages: int
    sum_k: int = 0


SUM_EACH_STEP, SUM_EACH_BLOCK, SUM_AFTER_LOOP = 0, 1, 2

_SWEEP = "docs/benchmarks/matmul.md#block-fp8-linear-kernels-benchmarksfp8_linearpy-2026-12-02"
_ROWS_SWEEP = "docs/benchmarks/matmul.md#weight-only-tiles-for-17-255-rows-2026-12-03"
_SIDES_SWEEP = "docs/benchmarks/matmul.md#the-weight-tile-on-either-side-of-the-mma-2026-12-03"
# Row buckets of the block-scaled weight-only kernel: up to FEW_ROWS rows ("few_rows", decode of a few sequences),
# up to MORE_ROWS ("more_rows"), then "many_rows" (a decode batch of up to WEIGHT_ONLY_MAX_ROWS sequences).
FEW_ROWS = 16
MORE_ROWS = 64


def weight_only_bucket(num_rows: int) -> str:
    if num_rows <= FEW_ROWS:
        return "few_rows"
    return "more_rows" if num_rows <= MORE_ROWS else "many_rows"


WEIGHT_ONLY = _gpu(
    {
        ("few_rows", "16bit"): Entry(
            WeightOnlyTiles(16, 64, 1, 4, 4, k_splits=4),
            f"{_SIDES_SWEEP}: 8192 x 4096 at 8 rows 29.2 us against 34.5 with the weight tile on the left",
        ),
        ("more_rows", "16bit"): Entry(
            WeightOnlyTiles(64, 64, 1, 4, 4, k_splits=2, weight_left=True),
            f"{_SIDES_SWEEP}: 8192 x 4096 at 32 / 64 rows 32.5 / 38.2 us against 36.3 / 40.4 with the weight tile on "
            f"the right ({_ROWS_SWEEP}: 96.0 / 84.4 us for dequantise + dot)",
        ),
        ("many_rows", "16bit"): Entry(
            WeightOnlyTiles(128, 128, 1, 8, 4, k_splits=2, weight_left=True),
            f"{_SIDES_SWEEP}: 8192 x 4096 at 128 rows 60.4 us against 67.2 for the more_rows tiles with the weight "
            "on the right (76.5 on the left)",
        ),
        (ANY, ANY): Entry(WeightOnlyTiles(16, 32, 1, 4, 3, k_splits=4), "fp32 untuned: the 16-bit tiles, narrower"),
    }
)
# Chosen for the H200's 132 SMs and its ~4.8 TB/s. A program streams 32 x 512 e4m3 (16 KB) a step
# in 16-byte loads (4 warps: 8 a thread); K splits until 4 programs an SM. FMA products cost M multiply-adds a weight
# byte, about the H200's fp32 rate against its bandwidth at 8 rows, hence tensor cores from 8 rows. fp32 x never
# takes the dot (an IEEE fp32 dot is FMAs too, with padded rows).
# Row buckets (`gemv_bucket`): "one_row", "fma_rows" (2 to GEMV_DOT_ROWS - 1: the 16-bit tiles' FMA products over
# several rows), "dot_rows". Each extra row of FMA products holds its own sums: the 1-row tiles, held over the step,
# took 168-255 registers a thread at 2-7 rows (136-255 once the products went tile by tile; Triton 3.6 for sm_90,
# scripts/compile_gpu_kernels.py; 227-255 in Ling-3.0-flash's MTP verify pass), over the 128 that let 4 programs of
# 4 warps share an SM.
GEMV_DOT_ROWS = 8
# The decode gemv's tensor-core form by default (16-bit x; fp32 x never takes the dot) from GEMV_DOT_ROWS rows up to
# GEMV_DOT_DEFAULT_ROWS, with its "dot_rows" tiles: at 8 rows its many-weight, gated-norm and partial-sum forms leave
# a Ling-3.0-flash decode step 356 kernels and 11 split-K sums where the block-scaled products left 505 and 237
# (`python -m benchmarks.kernel_census --preset ling-3.0-flash --batch 8`); Ling-3.0-flash's first 24 layers on an
# H100 at batch 8: 5.61 -> 5.44 ms
# (docs/benchmarks/generation.md#decode-at-batch-8-on-an-h100-the-gemv-at-8-rows-2026-12-06-twenty-first-session).
# 3-7 rows keep the block-scaled kernel (at 4 rows the gemv's tensor-core form tied, 4.00 against 4.02 ms).
GEMV_DOT_DEFAULT_ROWS = 8


def gemv_by_default(num_rows: int, dtype) -> bool:
    """Whether a weight-only product of num_rows rows of x in dtype runs the decode gemv when no variant is named:
    its FMA form up to GEMV_DEFAULT_ROWS rows, its tensor-core form (16-bit x) from GEMV_DOT_ROWS to
    GEMV_DOT_DEFAULT_ROWS."""
    dot_rows = GEMV_DOT_ROWS <= num_rows <= GEMV_DOT_DEFAULT_ROWS and jnp.dtype(dtype).itemsize == 2
    return num_rows <= GEMV_DEFAULT_ROWS or dot_rows


def gemv_bucket(num_rows: int) -> str:
    if num_rows == 1:
        return "one_row"
    return "fma_rows" if num_rows < GEMV_DOT_ROWS else "dot_rows"


_GEMV_REGISTERS = "docs/benchmarks/matmul.md#decode-gemv-tiles-for-2-7-rows-2026-12-05"
_DOT_ROWS = "decode-at-batch-8-on-an-h100-the-gemv-at-8-rows-2026-12-06-twenty-first-session"
_GEMV_ONE_BLOCK = "the-decode-gemvs-tensor-core-tiles-at-8-rows-on-an-h100-2026-12-06-twenty-second-session"
WEIGHT_ONLY_GEMV = _gpu(
    {
        (ANY, "16bit"): Entry(
            GemvTiles(32, 2, 528, GEMV_DOT_ROWS, 4, 2, sum_k=SUM_AFTER_LOOP),
            "docs/benchmarks/generation.md#decode-launch-settings-timed-in-the-model-2026-12-05-eighteenth-session: "
            "2 K blocks a step (4 before), in the model (Ling-3.0-flash's first 24 layers, H100): decode step 2.45 -> "
            "2.33 ms at batch 1, 6.21 -> 6.23 ms at batch 8; (32, 4, 528) was the best of a 7-setting sweep at 1 row "
            "(docs/benchmarks/matmul.md#the-decode-shaped-kernel-gpu_triton_gemv-2026-12-02: 8192 x 4096 24.9 us); "
            "summed after the loop: docs/benchmarks/generation.md#decode-launch-settings-timed-in-the-model-again-"
            "2026-12-06-nineteenth-session (2.33 -> 2.29 ms at batch 1; with the down kernel's K steps of 128, 2.29 -> "
            "2.28; the next step's tiles loaded during a step (prefetch) 2.45-2.70, tensor-core dots at 1 row 3.06)",
        ),
        ("dot_rows", "16bit"): Entry(
            GemvTiles(64, 1, 528, GEMV_DOT_ROWS, 4, 3, sum_k=SUM_AFTER_LOOP),
            f"docs/benchmarks/generation.md#{_DOT_ROWS}: in Ling-3.0-flash's first 24 layers at batch 8 (H100), "
            "5.72 ms with the 1-row tiles, 5.59 with 3 stages (the cp.async pipeline then keeps a step's tiles in "
            "flight during the products: 2 stages wait for every load first), 5.64 with 4, 5.67 with 4 K blocks a "
            "step, 5.44 with strips of 64 outputs and 3 stages; FMA products at 8 rows 6.91. One K block a step: "
            f"docs/benchmarks/generation.md#{_GEMV_ONE_BLOCK}: 5.44 -> 5.32 and 5.46 -> 5.29 ms in two calls (H100)",
        ),
        ("fma_rows", "16bit"): Entry(
            GemvTiles(32, 4, 528, GEMV_DOT_ROWS, 4, 2, sum_k=SUM_EACH_BLOCK),
            "docs/benchmarks/matmul.md#decode-gemv-tiles-for-2-7-rows-2026-12-05: the 1-row tiles summed after each "
            "K block; on an H100 (8192 x 4096) 30.3 / 38.1 / 37.5 us at 2 / 3 / 4 rows against 32.3 / 46.0 / 41.1 held "
            "over the step; (64, 4, 264, 8 warps) was faster at 2-3 rows (27.9 / 31.6) but takes 170 registers in "
            f"the gated-norm form; 72-128 registers at 2-7 rows, no spills ({_GEMV_REGISTERS}); not yet swept on an "
            "H200",
        ),
        (ANY, ANY): Entry(
            GemvTiles(32, 4, 528, GEMV_MAX_ROWS + 1, 4, 2), "not measured: the 16-bit tiles, FMA products only"
        ),
        ("fma_rows", ANY): Entry(
            GemvTiles(32, 4, 528, GEMV_MAX_ROWS + 1, 4, 2, sum_k=SUM_EACH_BLOCK),
            "not measured: the 16-bit fma_rows tiles, FMA products only",
        ),
    }
)
W8A8 = _gpu(
    {
        (ANY, ANY): Entry(
            LinearTiles(128, 64, 8, 4, 4), f"{_SWEEP}, W8A8 sweep at 12288 x 4096: 331 / 359 TFLOP/s at M 2048 / 8192"
        )
    }
)
# 128 x 128 e4m3 tiles of x and W a K step (32 KB) in 4 stages (128 KB of the H200's 228 KB shared memory); 8 warps
# (two warpgroups of 64 rows) hold the fp32 accumulator and the K block's partial product, 64 registers each.
W8A8_TC_ACC = _gpu(
    {
        (ANY, ANY): Entry(
            LinearTiles(128, 128, 8, 8, 4),
            "not measured: benchmarks/fp8_linear.py --sweep W8A8-tc-acc sweeps it (issue 25)",
        )
    }
)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """gpu_mosaic W8A8: block_n outputs a CTA (64 rows, one warpgroup; block_n divides the weight's 128-row block),
    stages shared-memory buffers of the TMA pipeline over K; tma_store: the output tile written through shared
    memory by TMA, else from registers."""

    block_n: int
    stages: int
    tma_store: bool = False


# 64 x 128 fp32 accumulator and K block partial product: 64 registers a thread each; a stage holds 8 + 16 KB of
# e4m3 tiles and 256 B of scales, so 4 stages leave room for two CTAs an SM. The output through shared memory and
# TMA: KDA's f_b / g_b (4096 x 128, one K block, the product bound by its 64 MB of output) 2.2x faster
W8A8_MOSAIC = _gpu(
    {
        (ANY, ANY): Entry(
            MosaicTiles(128, 4, tma_store=True),
            "docs/benchmarks/matmul.md#the-w8a8-linears-output-through-tma-2026-12-07-thirty-first-session: H100, "
            "8192 rows of 4096 x 128: 46.5 us against 100.9 from registers (64-column tiles 51.4 / 89.7; "
            "dequantise + XLA's dot 46.2)",
        )
    }
)


@dataclasses.dataclass(frozen=True)
class WarpSpecialisedTiles:
    """gpu_mosaic_ws W8A8: block_n outputs a column tile (dividing the weight's 128-row block, or a multiple of it:
    one TMA tile whose 128-column halves are products of their own, each with its weight block's scale: fewer
    bytes from L2 a product), stages TMA buffers,
    columns column tiles an item (one pipeline walks their K blocks in turn; cut to a divisor of the weight's column
    tiles). A tile is 128 rows (two compute warpgroups of 64). tma_store: each output tile written through shared
    memory by TMA (a buffer a compute warpgroup), else from registers. step_blocks: K blocks a pipeline step (2: a
    block's promotion overlaps the next block's wgmma, one more accumulator in registers; where the weight's K
    blocks are a multiple of it, else 1)."""

    block_n: int = 128
    stages: int = 4
    columns: int = 1
    tma_store: bool = False
    step_blocks: int = 1


_WS_SWEEP = (
    "docs/benchmarks/matmul.md#the-w8a8-linears-output-through-tma-2026-12-07-thirty-first-session: H100, 8192 "
    "rows at 4096x2560 / 2560x4096 / 6144x2560: 256-column tiles, 3 stages, TMA stores 246.1 / 301.9 / 326.5 us; "
    "128-column tiles, 4 stages, TMA stores 260.2 / 271.0 / 359.4; from registers (the default before) 297.3 / "
    "307.0 / 408.6"
)
# 16-bit outputs: 256-column tiles (N a multiple of 256, else 128: `gpu_mosaic_ws.fitted_tiles`); fp32 outputs
# keep 128 (a 256-column fp32 tile a compute warpgroup and 3 stages exceed the 227 KB of shared memory)
W8A8_MOSAIC_WS = _gpu(
    {
        (ANY, "16bit"): Entry(WarpSpecialisedTiles(256, 3, 2, tma_store=True), _WS_SWEEP),
        (ANY, ANY): Entry(WarpSpecialisedTiles(128, 4, 2, tma_store=True), _WS_SWEEP),
    }
)
# the W8A8 products run gpu_mosaic_ws from this K and this many rows: at K = 512 (8192 x 512) it was no faster than
# gpu_mosaic (191.0-212.0 us against 187.5-195.3 on an H100), from K = 2560 at 8192 rows 1.11-1.17x; fewer rows
# fill fewer SMs (an item is 128 rows x a group of column tiles)
MOSAIC_WS_MIN_K = 1024
MOSAIC_WS_MIN_ROWS = 2048
# `fp8_linear_many` joins the W8A8 products of one x whose outputs are at most this wide (KDA's f_a / g_a: 128 each)
# into one product: a 128-wide product of 8192 rows is 64 row tiles, half a GPU's SMs, and every product reads all of x
JOIN_MAX_OUTPUTS = 256


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """tpu_mosaic weight-only: block_m rows x block_n outputs a grid step (cut to the call's rows, to the weight's
    scale blocks and to fit `tpu_dequant.TILE_BUDGET_BYTES` of VMEM)."""

    block_m: int
    block_n: int


TPU = {
    (ANY, ANY, ANY): Entry(
        TpuTiles(block_m=256, block_n=256),
        "not measured (no TPU was available): 256 x 256, halves of the MXU-friendly sizes, shrunk to fit VMEM for "
        "long K",
    )
}
