"""Block-FP8 linear maps at Ling-3.1-flash widths (hidden 4096): the weight-only and W8A8 kernels
(`pallas_kernels.fp8`) against XLA's bf16 dot on the dequantised weight and today's jnp path (dequantise inside
the step, then the bf16 dot), in one run.

    python scripts/bench_fp8_linear.py                        # the table
    python scripts/bench_fp8_linear.py --rows 1 8 --shapes "KDA q/k/v proj"   # part of it
    python scripts/bench_fp8_linear.py --sweep weight-only W8A8             # tile sweeps instead

Every time is per call of a chain of CALLS dependent calls in one jitted program (each call's input nudged by
the last output), the calls cycling over enough copies of the weight that they never fit the L2 together (a
lone decode-sized call would time the launch; one weight would be read from the L2). TFLOP/s is 2 M O In over
the time; for decode sizes the roofline is the bytes the weight-only kernel must move (the FP8 weight, its scales,
x and y) at the measured copy bandwidth. Errors are against the dequantised fp32 product.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_common import copy_bandwidth, median_seconds, rel_error  # noqa: E402

from pallas_kernels.fp8.gpu_triton.block_scaled import TILE_KEYWORDS  # noqa: E402
from pallas_kernels.fp8.ops import kernel  # noqa: E402
from pallas_kernels.fp8.reference import dequantize_blocks  # noqa: E402

BLOCK = (128, 128)
SHAPES = {  # name: (out, in)
    "KDA q/k/v proj": (8192, 4096),
    "KDA/MLA o proj": (4096, 8192),
    "MLA kv_a proj": (576, 4096),
    "dense MLP gate/up": (12288, 4096),
    "dense MLP down": (4096, 12288),
}
ROWS = (1, 8, 64, 256, 2048, 8192)
DECODE_ROWS = 64
CALLS = 16
CYCLE_BYTES = 512 << 20  # the weight copies a chain cycles over: 10x the H200's 50 MB L2
weight_only_gpu, w8a8_gpu = kernel("weight_only_linear", "gpu_triton"), kernel("w8a8_linear", "gpu_triton")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def random_weights(out_dim: int, in_dim: int, copies: int):
    """`copies` block-FP8 weights (values e4m3 [copies, O, In], scales [copies, O/128, In/128])."""
    k_values, k_scales = jax.random.split(jax.random.key(out_dim * in_dim))
    values = (32.0 * jax.random.normal(k_values, (copies, out_dim, in_dim), jnp.bfloat16)).astype(jnp.float8_e4m3fn)
    scale_shape = (copies, -(-out_dim // BLOCK[0]), -(-in_dim // BLOCK[1]))
    return values, jax.random.uniform(k_scales, scale_shape, jnp.float32, 1e-4, 1e-3)


def chain_seconds(product, x_MK, *weights, iters: int) -> float:
    """Seconds per call of product(x, *one copy of the weights), CALLS chained calls cycling over the copies."""
    copies = weights[0].shape[0]

    def run(x_MK, *weights):
        for call in range(CALLS):
            y_MN = product(x_MK, *(w[call % copies] for w in weights))
            x_MK = x_MK + (1e-3 * y_MN[:, :1]).astype(x_MK.dtype)
        return x_MK

    return median_seconds(jax.jit(run), x_MK, *weights, iters=iters) / CALLS


def methods(dense_copies):
    """(name, product, weights) of each timed path; dense_copies: the bf16 weights the XLA baseline reads."""
    kernels = {
        "weight-only": lambda x, v, s: weight_only_gpu(x, v, s, block=BLOCK),
        "W8A8": lambda x, v, s: w8a8_gpu(x, v, s, block=BLOCK),
    }
    return {
        "XLA bf16": (lambda x, w: x @ w.T, (dense_copies,)),
        "dequant + dot": (lambda x, v, s: x @ dequantize_blocks(v, s, BLOCK, x.dtype).T, None),
        **{name: (fn, None) for name, fn in kernels.items()},
    }


def table(iters: int, copy_bw: float, shapes, rows_list) -> None:
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; us per call (TFLOP/s); bf16 activations, {BLOCK} blocks")
    print(
        "| layer (O x In) | M | XLA bf16 dot | dequant + dot (today) | weight-only | W8A8 | weight-only "
        "% of roofline | W8A8 error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in shapes:
        out_dim, in_dim = SHAPES[name]
        copies = max(1, -(-CYCLE_BYTES // (out_dim * in_dim)))
        values, scales = random_weights(out_dim, in_dim, copies)
        dense = jax.jit(jax.vmap(lambda v, s: dequantize_blocks(v, s, BLOCK, jnp.bfloat16)))(values, scales)
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, in_dim), jnp.bfloat16)
            flops = 2 * rows * out_dim * in_dim
            seconds = {
                method: chain_seconds(product, x, *(weights or (values, scales)), iters=iters)
                for method, (product, weights) in methods(dense).items()
            }
            cells = [f"{t * 1e6:.1f} ({flops / t / 1e12:.1f})" for t in seconds.values()]
            fp8_bytes = values[0].nbytes + scales[0].nbytes + 2 * rows * (in_dim + out_dim)
            roofline = f"{fp8_bytes / copy_bw / seconds['weight-only']:.0%}" if rows <= DECODE_ROWS else ""
            exact = jnp.matmul(x, dequantize_blocks(values[0], scales[0], BLOCK, jnp.float32).T, precision="highest")
            error = rel_error(w8a8_gpu(x, values[0], scales[0], block=BLOCK), exact)
            row = " | ".join([f"{name} ({out_dim} x {in_dim})", str(rows), *cells, roofline, f"{error:.1e}"])
            print(f"| {row} |", flush=True)


SWEEPS = {  # kernel: (entry, tiles (block_m, block_n, group_m, num_warps, num_stages, k_splits), shape, rows)
    "weight-only": (
        weight_only_gpu,
        [(16, 32, 1, 4, 4, 1), (16, 32, 1, 4, 4, 4), (16, 64, 1, 4, 4, 4), (16, 64, 1, 4, 4, 8), (16, 128, 1, 4, 4, 8)],
        "KDA q/k/v proj",
        (1, 8),
    ),
    "W8A8": (
        w8a8_gpu,
        [(64, 128, 8, 4, 3, 1), (64, 128, 8, 4, 4, 1), (128, 128, 8, 8, 4, 1), (128, 64, 8, 4, 4, 1)],
        "dense MLP gate/up",
        (2048, 8192),
    ),
}


def sweep(iters: int, kernels) -> None:
    for label in kernels:
        entry, settings, shape, rows_list = SWEEPS[label]
        out_dim, in_dim = SHAPES[shape]
        copies = max(1, -(-CYCLE_BYTES // (out_dim * in_dim)))
        values, scales = random_weights(out_dim, in_dim, copies)
        print(f"\n{label} sweep at {shape} ({out_dim} x {in_dim}), us per call (TFLOP/s)")
        print(f"| {', '.join(TILE_KEYWORDS)} | " + " | ".join(f"M = {r}" for r in rows_list) + " |")
        print("|---|" + "---|" * len(rows_list))
        for tiles in settings:
            keywords = dict(zip(TILE_KEYWORDS, tiles, strict=True))
            product = functools.partial(entry, block=BLOCK, **keywords)
            cells = []
            for rows in rows_list:
                x = jax.random.normal(jax.random.key(rows), (rows, in_dim), jnp.bfloat16)
                seconds = chain_seconds(product, x, values, scales, iters=iters)
                cells.append(f"{seconds * 1e6:.1f} ({2 * rows * out_dim * in_dim / seconds / 1e12:.1f})")
            print(f"| {tiles} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sweep", nargs="+", choices=list(SWEEPS), help="sweep these kernels' tiles instead")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    args = parser.parse_args()
    print(f"# bench_fp8_linear {datetime.date.today()} commit {_commit()} on {jax.devices()[0].device_kind}")
    if args.sweep:
        sweep(args.iters, args.sweep)
    else:
        table(args.iters, copy_bandwidth(args.iters), args.shapes, args.rows)


if __name__ == "__main__":
    main()
