"""Block-FP8 linear maps at Ling-3.1-flash widths (hidden 4096): the FP8 kernels (`pallas_kernels.fp8`) against
XLA's bf16 dot on a bf16 weight and today's jnp path (dequantise inside the step, then the bf16 dot).

    python -m benchmarks.fp8_linear --iters 5             # decode: 1, 8, 16 rows, then the decode kernel's tiles
    python -m benchmarks.fp8_linear --prefill             # 64 to 8192 rows: weight-only, both W8A8, XLA
    python -m benchmarks.fp8_linear --prefill --shape 4096x128 --rows 8192   # the prefill table at a shape
    python -m benchmarks.fp8_linear --sweep W8A8 W8A8-tc-acc W8A8-mosaic   # those kernels' tile sweeps alone
    python -m benchmarks.fp8_linear --sweep W8A8-mosaic --shape 4096x2560 --shape 128x2560 --rows 8192   # at shapes
    python -m benchmarks.fp8_linear --sweep weight-only-64 weight-only-mosaic   # decode batches, both kernels
    python -m benchmarks.fp8_linear --sweep gpu_triton_gemv --rows 1,2,3,4   # the decode kernel's tiles by rows
    python -m benchmarks.fp8_linear --sweep gemv-gated-norm   # its tiles with KDA's gated output norm in it
    python -m benchmarks.fp8_linear --sweep gemv-kda-in       # its tiles (K splits too) at KDA's input projections
    python -m benchmarks.fp8_linear --quick [--prefill]   # one 256 x 256 weight, 2 calls, no sweep (smoke test)
    python -m benchmarks.fp8_linear --quick --sweep gpu_triton_gemv --rows 2   # a sweep on the 256 x 256 weight

Every time is per call of a chain of dependent calls in one jitted program (each call's input nudged by the last
output, a small XLA op the time includes; XLA's command buffers on as the model runs them, `ling_jax.xla_flags`,
from 2026-12-05), each call reading its own copy of the weight (a separate argument, so
no slice of a stacked weight is copied first: the bench before 2026-12 sliced one, which XLA may copy), the chain
MIN_CALLS to MAX_CALLS long, reading CHAIN_BYTES of FP8 weight where that cap allows: the copies never fit the L2
together. Decode cells: us, GB/s of the weight bytes the method must read (FP8 values and
fp32 scales, or the bf16 weight, plus x and y) and that rate as % of the measured copy bandwidth. Prefill cells:
us (TFLOP/s, 2 M O In over the time) and each W8A8 variant's error against the fp32 product, after the bf16 and FP8
matmul peaks of the device measured in the same run (`bench_fp8_peak`'s rows at 8192^3). The W8A8 variants:
"gpu_triton" (Pallas's FP8 dot, which Triton splits into one CUDA-core add per wgmma), "gpu_triton_tc_acc"
(each 128-input K block accumulated in the tensor cores, `pallas_kernels/fp8/gpu_triton/fp8_dot.py`) and
"gpu_mosaic" (Mosaic GPU: TMA pipeline, e4m3 wgmma; N and K multiples of 128 only, "n/a" elsewhere) and
"gpu_mosaic_ws" (the same products persistent and warp-specialised, 128-row tiles: the default from 2048 rows and
K = 1024).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import copy_bandwidth, median_seconds, rel_error, run_header  # noqa: E402
from benchmarks.fp8_peak import jax_rows, torch_rows  # noqa: E402
from ling_jax import xla_flags  # noqa: E402
from pallas_kernels.experimental.fp8_mosaic_weight_only import MosaicWeightOnlyTiles  # noqa: E402
from pallas_kernels.experimental.fp8_xla_folded import weight_only_linear_xla, weight_only_linear_xla_reduce  # noqa: E402
from pallas_kernels.fp8 import tuned  # noqa: E402
from pallas_kernels.fp8.gpu_triton.gemv import weight_only_gemv_partials_gpu  # noqa: E402
from pallas_kernels.fp8.ops import GEMV, MOSAIC, MOSAIC_WS, TC_ACC, kernel  # noqa: E402
from pallas_kernels.fp8.reference import GatedHeadNorm, dequantize_blocks  # noqa: E402
from pallas_kernels.tuning import lookup  # noqa: E402

BLOCK = (128, 128)
DECODE_SHAPES = ((8192, 4096), (4096, 8192), (10240, 4096), (4096, 10240), (576, 4096))  # (out, in)
DECODE_ROWS = (1, 8, 16)
PREFILL_SHAPES = ((8192, 4096), (4096, 8192), (576, 4096), (12288, 4096), (4096, 12288))
PREFILL_ROWS = (64, 256, 2048, 8192)
QUICK_SHAPES, QUICK_DECODE_ROWS, QUICK_PREFILL_ROWS = ((256, 256),), (1, 8), (64,)
MIN_CALLS, MAX_CALLS = 16, 48  # calls (weight copies) a chain: 48 of the 576 x 4096 weight are 113 MB
CHAIN_BYTES = 192 << 20  # FP8 weight bytes a chain reads at least: ~4x the H200's 50 MB L2
weight_only_gpu, w8a8_gpu = kernel("weight_only_linear", "gpu_triton"), kernel("w8a8_linear", "gpu_triton")
gemv_gpu = kernel("weight_only_linear", GEMV)
w8a8_tc_acc_gpu = kernel("w8a8_linear", TC_ACC)
w8a8_mosaic_gpu = kernel("w8a8_linear", MOSAIC)
w8a8_mosaic_ws_gpu = kernel("w8a8_linear", MOSAIC_WS)
PEAK_SIZE = 8192


@dataclasses.dataclass
class Copies:
    """One block-FP8 weight [O, In] in `calls` copies, each its own array: e4m3 values, fp32 scales and the bf16
    weight they stand for (XLA's baseline)."""

    values: list
    scales: list
    dense: list

    @property
    def fp8_bytes(self) -> int:
        return self.values[0].nbytes + self.scales[0].nbytes


def random_copies(out_dim: int, in_dim: int) -> Copies:
    calls = min(MAX_CALLS, max(MIN_CALLS, -(-CHAIN_BYTES // (out_dim * in_dim))))
    k_values, k_scales = jax.random.split(jax.random.key(out_dim * in_dim))
    values = (32.0 * jax.random.normal(k_values, (calls, out_dim, in_dim), jnp.bfloat16)).astype(jnp.float8_e4m3fn)
    scale_shape = (calls, -(-out_dim // BLOCK[0]), -(-in_dim // BLOCK[1]))
    scales = jax.random.uniform(k_scales, scale_shape, jnp.float32, 1e-4, 1e-3)
    dense = jax.jit(jax.vmap(lambda v, s: dequantize_blocks(v, s, BLOCK, jnp.bfloat16)))(values, scales)
    return Copies(list(values), list(scales), list(dense))


def chain_seconds(product, x_MK, copies: list, iters: int) -> float:
    """Seconds per call of product(x, *copy), one call for each copy (a tuple of arrays), chained."""

    def run(x_MK, copies):
        for weights in copies:
            y_MN = product(x_MK, *weights)
            x_MK = x_MK + (1e-3 * y_MN[:, :1]).astype(x_MK.dtype)
        return x_MK

    return median_seconds(jax.jit(run), x_MK, copies, iters=iters) / len(copies)


def fp8_copies(weights: Copies) -> list:
    return list(zip(weights.values, weights.scales, strict=True))


DECODE_METHODS = {  # name: (product, whether it reads the bf16 weight)
    "XLA bf16 dot (bf16 weight)": (lambda x, w: x @ w.T, True),
    "dequant + dot (today)": (lambda x, v, s: x @ dequantize_blocks(v, s, BLOCK, x.dtype).T, False),
    "weight-only gpu_triton": (lambda x, v, s: weight_only_gpu(x, v, s, block=BLOCK), False),
    f"weight-only {GEMV}": (lambda x, v, s: gemv_gpu(x, v, s, block=BLOCK), False),
    "weight-only xla_folded": (lambda x, v, s: weight_only_linear_xla(x, v, s, block=BLOCK), False),
    "weight-only xla_folded reduce": (lambda x, v, s: weight_only_linear_xla_reduce(x, v, s, block=BLOCK), False),
}


def decode_table(iters: int, copy_bw: float, shapes=DECODE_SHAPES, rows_list=DECODE_ROWS) -> None:
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; bf16 x, {BLOCK} blocks; us (GB/s, % of copy bandwidth)")
    for bucket in ("one_row", "fma_rows", "dot_rows"):
        print(f"{GEMV} defaults, {bucket}: {lookup(tuned.WEIGHT_ONLY_GEMV, dtype=jnp.bfloat16, bucket=bucket)}")
    print("| O x In | M | " + " | ".join(DECODE_METHODS) + " |")
    print("|---|---|" + "---|" * len(DECODE_METHODS))
    for out_dim, in_dim in shapes:
        weights = random_copies(out_dim, in_dim)
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, in_dim), jnp.bfloat16)
            cells = []
            for product, reads_dense in DECODE_METHODS.values():
                copies = [(w,) for w in weights.dense] if reads_dense else fp8_copies(weights)
                try:
                    seconds = chain_seconds(product, x, copies, iters)
                except ValueError:  # xla_folded takes sides that are multiples of the block only
                    cells.append("n/a")
                    continue
                moved = (weights.dense[0].nbytes if reads_dense else weights.fp8_bytes) + 2 * rows * (in_dim + out_dim)
                cells.append(f"{seconds * 1e6:.1f} ({moved / seconds / 1e9:.0f}, {moved / seconds / copy_bw:.0%})")
            print(f"| {out_dim} x {in_dim} | {rows} | " + " | ".join(cells) + " |", flush=True)


def print_peaks(iters: int, size: int = PEAK_SIZE) -> None:
    """The device's bf16 and FP8 matmul peaks at size^3 (`bench_fp8_peak`), the ceilings of the W8A8 rows."""
    flops = 2 * size**3
    print(f"\nmatmul peaks at M = N = K = {size} (benchmarks/fp8_peak.py):")
    for name, seconds in {**jax_rows(size, iters), **torch_rows(size, iters)}.items():
        rate = seconds if isinstance(seconds, str) else f"{flops / seconds / 1e12:.1f} TFLOP/s"
        print(f"  {name:24s} {rate}")


W8A8_VARIANTS = {
    "W8A8 gpu_triton": w8a8_gpu,
    f"W8A8 {TC_ACC}": w8a8_tc_acc_gpu,
    f"W8A8 {MOSAIC}": w8a8_mosaic_gpu,
    f"W8A8 {MOSAIC_WS}": w8a8_mosaic_ws_gpu,
}


def timed_cell(seconds_of, flops: int) -> str:
    """'us (TFLOP/s)' of seconds_of(), or why it cannot run (gpu_mosaic takes N and K multiples of 128 only)."""
    try:
        seconds = seconds_of()
    except ValueError as error:
        return f"n/a ({str(error).splitlines()[0][:40]})"
    return f"{seconds * 1e6:.1f} ({flops / seconds / 1e12:.1f})"


def error_cell(entry, x, values, scales, exact) -> str:
    try:
        return f"{rel_error(entry(x, values, scales, block=BLOCK), exact):.1e}"
    except ValueError:
        return "n/a"


def prefill_table(iters: int, shapes=PREFILL_SHAPES, rows_list=PREFILL_ROWS, peak_size: int = PEAK_SIZE) -> None:
    print_peaks(iters, peak_size)
    methods = {
        "XLA bf16 dot": (lambda x, w: x @ w.T, True),
        "dequant + dot": DECODE_METHODS["dequant + dot (today)"],
        "weight-only": DECODE_METHODS["weight-only gpu_triton"],
        **{
            name: (lambda x, v, s, entry=entry: entry(x, v, s, block=BLOCK), False)
            for name, entry in W8A8_VARIANTS.items()
        },
    }
    print(f"\nbf16 x, {BLOCK} blocks; us per call (TFLOP/s)")
    print(
        "| O x In | M | " + " | ".join(methods) + " | " + " | ".join(f"{name} error" for name in W8A8_VARIANTS) + " |"
    )
    print("|---|---|" + "---|" * (len(methods) + len(W8A8_VARIANTS)))
    for out_dim, in_dim in shapes:
        weights = random_copies(out_dim, in_dim)
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, in_dim), jnp.bfloat16)
            flops = 2 * rows * out_dim * in_dim
            cells = []
            for product, reads_dense in methods.values():
                copies = [(w,) for w in weights.dense] if reads_dense else fp8_copies(weights)
                cells.append(timed_cell(lambda: chain_seconds(product, x, copies, iters), flops))  # noqa: B023
            values, scales = weights.values[0], weights.scales[0]
            exact = jnp.matmul(x, dequantize_blocks(values, scales, BLOCK, jnp.float32).T, precision="highest")
            errors = [error_cell(entry, x, values, scales, exact) for entry in W8A8_VARIANTS.values()]
            print(f"| {out_dim} x {in_dim} | {rows} | " + " | ".join(cells + errors) + " |", flush=True)


def gated_norm_gemv(x_MK, values, scales, block, tiles=None):
    """KDA's output projection at decode: x normalised head by head in the gemv (its own x as the gate, a norm
    weight of ones), the K splits' partial sums added by XLA (in the model the next add-norm kernel adds them)."""
    norm = GatedHeadNorm(gate=x_MK, weight_D=jnp.ones((128,), jnp.float32), eps=1e-6)
    partials = weight_only_gemv_partials_gpu(x_MK, values, scales, block=block, tiles=tiles, norm=norm)
    return jnp.sum(partials, axis=0).astype(x_MK.dtype)


SWEEPS = {  # kernel: (entry, its tiles' dataclass (None: no tiles), their settings, (out, in), rows)
    GEMV: (  # the 1-row default, then candidates for 2-7 rows (FMA products) under 128 registers a thread
        gemv_gpu,
        tuned.GemvTiles,
        [
            (32, 4, 528, 8, 4, 2, False),
            (32, 4, 528, 8, 4, 2, True),
            (32, 4, 528, 8, 8, 2, True),
            (64, 4, 264, 8, 8, 2, True),
            (16, 4, 1056, 8, 4, 2, True),
            (32, 2, 528, 8, 4, 2, False),
        ],
        (8192, 4096),
        (1, 2, 3, 4),
    ),
    "gemv-gated-norm": (  # Ling-3.0-flash's KDA output projection (4096 -> 2560), its gated norm in the kernel
        gated_norm_gemv,
        tuned.GemvTiles,
        [
            (32, 4, 528, 8, 4, 2, False),
            (32, 4, 264, 8, 4, 2, False),
            (32, 8, 528, 8, 4, 2, False),
            (64, 4, 264, 8, 4, 2, False),
            (64, 2, 528, 8, 4, 2, False),
            (128, 2, 264, 8, 4, 2, False),
            (128, 2, 264, 8, 8, 2, False),
            (16, 4, 1056, 8, 4, 2, False),
            (32, 4, 528, 8, 4, 2, True),
        ],
        (2560, 4096),
        (1, 2),
    ),
    "gemv-kda-in": (  # Ling-3.0-flash's KDA input projections q, k, v, f, g (5 x 4096 -> 2560: 640 strips of 32, no K
        # split at min_programs 528, 1.2 waves of 4 programs an SM) as one weight: the grouped launch's geometry
        gemv_gpu,
        tuned.GemvTiles,
        [
            (32, 4, 528, 8, 4, 2, False),
            (32, 4, 1056, 8, 4, 2, False),
            (32, 5, 528, 8, 4, 2, False),
            (32, 2, 528, 8, 4, 2, False),
            (32, 4, 528, 8, 4, 3, False),
            (32, 4, 528, 8, 8, 2, False),
            (16, 4, 1056, 8, 4, 2, False),
            (16, 5, 1056, 8, 2, 2, False),
            (64, 4, 264, 8, 4, 2, False),
            (64, 4, 528, 8, 4, 2, False),
            (64, 5, 264, 8, 8, 2, False),
            (128, 4, 528, 8, 8, 2, False),
        ],
        (20480, 2560),
        (1, 2),
    ),
    "weight-only": (
        weight_only_gpu,
        tuned.WeightOnlyTiles,
        [
            (16, 64, 1, 4, 4, 4, False),
            (16, 64, 1, 4, 4, 4, True),
            (16, 128, 1, 4, 4, 4, True),
            (16, 64, 1, 4, 4, 8, True),
            (16, 128, 1, 8, 4, 2, True),
        ],
        (8192, 4096),
        (8, 16),
    ),
    "weight-only-64": (
        weight_only_gpu,
        tuned.WeightOnlyTiles,
        [
            (64, 64, 1, 4, 4, 2, False),
            (64, 64, 1, 4, 4, 2, True),
            (64, 128, 1, 4, 4, 2, True),
            (64, 128, 1, 4, 4, 4, True),
            (64, 64, 1, 4, 4, 4, True),
            (32, 128, 1, 4, 4, 2, True),
            (128, 128, 1, 8, 4, 2, True),
            (64, 128, 1, 8, 3, 1, True),
        ],
        (8192, 4096),
        (32, 64, 128),
    ),
    "weight-only-mosaic": (
        kernel("weight_only_linear", MOSAIC),
        MosaicWeightOnlyTiles,
        [(4, 2), (4, 1), (4, 4), (3, 2), (6, 2), (4, 8)],
        (8192, 4096),
        (8, 32, 64, 128),
    ),
    "xla-folded": (weight_only_linear_xla, None, [()], (8192, 4096), (16, 32, 64)),
    "dequant-dot": (
        lambda x, v, s, block: x @ dequantize_blocks(v, s, block, x.dtype).T,
        None,
        [()],
        (8192, 4096),
        (16, 32, 64),
    ),
    "W8A8": (
        w8a8_gpu,
        tuned.LinearTiles,
        [(64, 128, 8, 4, 3, 1), (64, 128, 8, 4, 4, 1), (128, 128, 8, 8, 4, 1), (128, 64, 8, 4, 4, 1)],
        (12288, 4096),
        (2048, 8192),
    ),
    "W8A8-tc-acc": (
        w8a8_tc_acc_gpu,
        tuned.LinearTiles,
        [
            (128, 128, 8, 8, 4, 1),
            (128, 128, 8, 8, 3, 1),
            (128, 128, 8, 4, 4, 1),
            (128, 128, 16, 8, 4, 1),
            (64, 128, 8, 4, 4, 1),
            (64, 128, 8, 4, 3, 1),
            (128, 64, 8, 4, 4, 1),
            (256, 128, 8, 8, 3, 1),
        ],
        (12288, 4096),
        (2048, 8192),
    ),
    "W8A8-mosaic": (
        w8a8_mosaic_gpu,
        tuned.MosaicTiles,
        [(128, 4, True), (128, 3, True), (128, 5, True), (64, 4, True), (128, 4), (64, 4)],  # the default first
        (12288, 4096),
        (2048, 8192),
    ),
    "W8A8-mosaic-ws": (  # the 16-bit default first (thirty-first session's sweep: matmul.md)
        w8a8_mosaic_ws_gpu,
        tuned.WarpSpecialisedTiles,
        [
            (256, 3, 2, True),
            (128, 4, 2, True),
            (128, 2, 2, True, 2),
            (256, 3, 1, True),
            (256, 2, 1, True),
            (128, 3, 2, False, 2),
            (128, 4, 2),
        ],
        (12288, 4096),
        (2048, 8192),
    ),
}


def sweep(iters: int, kernels, rows: tuple[int, ...] | None = None, shape: tuple[int, int] | None = None) -> None:
    """Each kernel's tiles at its SWEEPS shape and rows, or at `rows` / `shape` where given."""
    for label in kernels:
        entry, tiles_type, settings, (out_dim, in_dim), rows_list = SWEEPS[label]
        out_dim, in_dim = shape or (out_dim, in_dim)
        rows_list = rows or rows_list
        keywords = () if tiles_type is None else tuple(field.name for field in dataclasses.fields(tiles_type))
        weights = random_copies(out_dim, in_dim)
        print(f"\n{label} sweep at {out_dim} x {in_dim}, us per call (GB/s of the FP8 weight, TFLOP/s)")
        print(f"| {', '.join(keywords)} | " + " | ".join(f"M = {r}" for r in rows_list) + " |")
        print("|---|" + "---|" * len(rows_list))
        for tiles in settings:
            given = {} if tiles_type is None else {"tiles": tiles_type(*tiles)}
            product = functools.partial(entry, block=BLOCK, **given)
            cells = []
            for num_rows in rows_list:
                x = jax.random.normal(jax.random.key(num_rows), (num_rows, in_dim), jnp.bfloat16)
                try:
                    seconds = chain_seconds(product, x, fp8_copies(weights), iters)
                except Exception as error:  # noqa: BLE001 - a setting that does not fit (shared memory) is skipped
                    cells.append(f"skipped: {type(error).__name__}")
                    continue
                rate = 2 * num_rows * out_dim * in_dim / seconds / 1e12
                cells.append(f"{seconds * 1e6:.1f} ({weights.fp8_bytes / seconds / 1e9:.0f}, {rate:.1f})")
            print(f"| {tiles} | " + " | ".join(cells) + " |", flush=True)


def _shape(text: str) -> tuple[int, int]:
    out_dim, _, in_dim = text.partition("x")
    if not (out_dim.isdigit() and in_dim.isdigit() and int(out_dim) and int(in_dim)):
        raise argparse.ArgumentTypeError(f"a weight shape is OUTxIN (positive integers, like 4096x2560), not {text!r}")
    return int(out_dim), int(in_dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--prefill", action="store_true", help="the prefill table instead of the decode one")
    parser.add_argument("--sweep", nargs="+", choices=list(SWEEPS), help="sweep these kernels' tiles alone")
    parser.add_argument(
        "--rows", help="the sweeps' or the prefill table's row counts, comma-separated (default: each sweep's own)"
    )
    parser.add_argument(
        "--shape",
        action="append",
        type=_shape,
        help="a sweep's weight OUTxIN, or the prefill table's (repeatable: each sweep at each shape; default: each "
        "sweep's own, the table's PREFILL_SHAPES)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="one small weight, 2 calls (smoke test); a sweep only where named"
    )
    args = parser.parse_args(argv)
    xla_flags.set_gpu_flags()
    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}): the kernels are Triton's")
    print(run_header("fp8_linear"))
    start = time.perf_counter()
    rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else None
    if args.quick and args.sweep:
        sweep(2, args.sweep, rows, QUICK_SHAPES[0])
    elif args.quick:
        if args.prefill:
            prefill_table(2, QUICK_SHAPES, QUICK_PREFILL_ROWS, peak_size=256)
        else:
            decode_table(2, copy_bandwidth(2, nbytes=1 << 20), QUICK_SHAPES, QUICK_DECODE_ROWS)
    elif args.sweep:
        for shape in args.shape or [None]:
            sweep(args.iters, args.sweep, rows, shape)
    elif args.prefill:
        prefill_table(args.iters, tuple(args.shape or PREFILL_SHAPES), rows or PREFILL_ROWS)
    else:
        decode_table(args.iters, copy_bandwidth(args.iters))
        print(f"\n({time.perf_counter() - start:.0f} s)")
        sweep(args.iters, [GEMV], rows)
    print(f"\n({time.perf_counter() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
