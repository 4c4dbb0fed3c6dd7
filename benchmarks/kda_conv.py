"""KDA's short causal convs + SiLU (`pallas_kernels.kda.ops.short_conv_silu`) over one chunk: the jnp reference
(XLA's gathers) against the GPU kernel at each of TILES, every token real and with 100 left pads, same inputs, one
run; each kernel output checked against the reference first.

    python -m benchmarks.kda_conv                       # q, k, v of 4096 channels (Ling-3.0-flash), 8192 tokens
    python -m benchmarks.kda_conv --channels 8192       # Ling-3.1-flash's width
    python -m benchmarks.kda_conv --quick               # on a CPU: the kernel interpreted, small (wiring only)

Cells: us per call (median), and the rate of the bytes a conv must move at least (q, k and v read once and written
once) in TB/s.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import median_seconds, rel_error, run_header
from pallas_kernels.kda.gpu_triton.conv import ConvTiles, short_conv_silu_gpu
from pallas_kernels.kda.reference import conv_sources, conv_windows
from pallas_kernels.kda.reference import short_conv_silu as reference

TILES = [ConvTiles(*t) for t in ((16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (64, 64, 4))]
TAPS = 4


def convs(tiles: ConvTiles | None, interpret: bool):
    """f(parts, window, weight, real) -> (ys, new window): the reference (tiles None) or the kernel at tiles."""

    def run(parts, window, weight, real_BT):
        positions, newest = conv_sources(real_BT, TAPS - 1)
        if tiles is None:
            ys = reference(parts, window, weight, real_BT, positions)
        else:
            ys = short_conv_silu_gpu(parts, window, weight, real_BT, positions, tiles=tiles, interpret=interpret)
        return ys, conv_windows(parts, window, newest)

    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--channels", type=int, default=4096, help="each of q, k and v (default 4096)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a CPU's smoke run: 40 tokens of 64 channels, interpreted")
    args = parser.parse_args(argv)
    interpret = args.quick
    if not interpret and jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}), or --quick")
    tokens, channels, iters = (40, 64, 2) if args.quick else (args.tokens, args.channels, args.iters)
    tiles = [ConvTiles(16, 32, 4)] if args.quick else TILES
    print(run_header("kda_conv"))
    keys = jax.random.split(jax.random.key(0), 5)
    parts = [jax.random.normal(k, (1, tokens, channels), jnp.bfloat16) for k in keys[:3]]
    window = jax.random.normal(keys[3], (1, TAPS - 1, 3 * channels), jnp.bfloat16)
    weight = jax.random.normal(keys[4], (3 * channels, TAPS), jnp.float32)
    floor = 2 * 3 * tokens * channels * 2
    print(f"q, k, v of {channels} channels, {tokens} tokens, bf16; us per call (TB/s of {floor / 1e6:.0f} MB)")
    methods = {"jnp reference": convs(None, interpret)}
    methods |= {f"kernel {t.block_t}x{t.block_c}, {t.num_warps} warps": convs(t, interpret) for t in tiles}
    print("| tokens | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    pads = min(100, tokens // 4)
    for label, real in (
        ("all real", jnp.ones((1, tokens), bool)),
        (f"{pads} left pads", jnp.arange(tokens)[None] >= pads),
    ):
        expected = methods["jnp reference"](parts, window, weight, real)
        cells = []
        for name, conv in methods.items():
            error = max(
                rel_error(a, b)
                for a, b in zip(
                    jax.tree.leaves(conv(parts, window, weight, real)), jax.tree.leaves(expected), strict=True
                )
            )
            if error > 1e-2:
                raise SystemExit(f"{name}: rel. error {error:.1e} against the reference ({label})")
            seconds = median_seconds(conv, parts, window, weight, real, iters=iters)
            cells.append(f"{seconds * 1e6:.1f} ({floor / seconds / 1e12:.2f})")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
