#!/usr/bin/env python3
"""MLA prefill attention on one GPU: the Pallas segment kernels, Triton (`flash_expanded_attention_gpu`, the
model's prefill) and Mosaic GPU (`flash_expanded_attention_mgpu`, Hopper), vs the jnp flash-style path under XLA
(`flash_expanded_attention`), in one run. A kernel that fails to compile is reported in its row (exit status 1).

    python -m benchmarks.mla_prefill           # a 2048-token chunk over 8192 and 32768 cache slots, H=64
    python -m benchmarks.mla_prefill --quick   # small sizes
    python -m benchmarks.mla_prefill --heads 32 --sizes 8192x32768 --sweep   # Ling-3.0-flash's last chunk of a 32k
                                               # prompt, and the flash tiles of SWEEP at segment 4096

Ling widths (nope 128, rope 64, value 128, latent 512), bf16, one sequence whose chunk ends at the last slot
(causal: the chunk's queries see every earlier slot). Each path is checked against the other on the device,
then timed (median of synchronised calls after warm-up); FLOP/s counts the attention products over the
visible keys (2 x visible pairs x H x (nope + rope + value)) and not the key expansion.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import median_seconds, rel_error  # noqa: E402
from pallas_kernels.mla.ops import kernel  # noqa: E402
from pallas_kernels.mla.reference import flash_expanded_attention  # noqa: E402
from pallas_kernels.mla.tuned import PREFILL, PREFILL_MOSAIC, PrefillTiles  # noqa: E402
from pallas_kernels.tuning import lookup  # noqa: E402

flash_expanded_attention_gpu = kernel("mla_prefill", "gpu_triton")
flash_expanded_attention_mgpu = kernel("mla_prefill", "gpu_mosaic")

HEADS, NOPE, ROPE, VALUE, LATENT = 64, 128, 64, 128, 512
SEGMENTS = (2048, 4096, 8192)  # the Triton kernel's key segment, swept
# the Mosaic GPU kernel's (segment, ping_pong, p_in_registers, overlap_softmax), all timed; the third is the tuned
# default
MOSAIC_FLAGS = (
    ("ping_pong", "ping-pong"),
    ("p_in_registers", "P in registers"),
    ("overlap_softmax", "overlapped softmax"),
)
MOSAIC_SWEEP = [
    (4096, False, False, False),
    (8192, False, False, False),
    (8192, True, False, False),
    (8192, True, True, False),
    (8192, False, False, True),
    (8192, True, False, True),
    (8192, True, True, True),
    (32768, True, False, False),
]
# (block_q, block_k, num_warps, num_stages) at segment 4096 for --sweep; the first is the tuned default
SWEEP = [
    (64, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 64, 4, 2),
    (64, 64, 4, 3),
]


def segment_tiles(segment: int):
    """The Triton kernel's tuned bf16 tiles with the key segment replaced."""
    return dataclasses.replace(lookup(PREFILL, dtype=jnp.bfloat16), segment=segment)


def mosaic_tiles(segment: int, **fields):
    """The Mosaic GPU kernel's tuned bf16 tiles with the key segment (and `fields`) replaced."""
    return dataclasses.replace(lookup(PREFILL_MOSAIC, dtype=jnp.bfloat16), segment=segment, **fields)


def inputs(length: int, slots: int, heads: int = HEADS):
    keys = jax.random.split(jax.random.key(slots), 5)
    normal = lambda key, shape, s=1.0: (s * jax.random.normal(key, shape)).astype(jnp.bfloat16)  # noqa: E731
    first = slots - length
    return (
        normal(keys[0], (1, length, heads, NOPE)),
        normal(keys[1], (1, length, heads, ROPE)),
        normal(keys[2], (1, slots, LATENT + ROPE)),
        (first + jnp.arange(length))[None].astype(jnp.int32),
        jnp.ones((1, slots), bool),
        normal(keys[3], (heads, NOPE, LATENT), LATENT**-0.5),
        normal(keys[4], (heads, VALUE, LATENT), LATENT**-0.5),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--heads", type=int, default=HEADS, help=f"query heads (default {HEADS}: Ling-3.1-flash's)")
    parser.add_argument(
        "--sizes", help="comma-separated CHUNKxSLOTS, the chunk ending at the last slot (default 2048x8192,2048x32768)"
    )
    parser.add_argument("--sweep", action="store_true", help="also the flash tiles of SWEEP at segment 4096")
    args = parser.parse_args(argv)
    try:
        sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        sizes = [()]
    if sizes and any(len(size) != 2 for size in sizes):
        parser.error(f"--sizes: expected CHUNKxSLOTS[,CHUNKxSLOTS...], got {args.sizes!r}")
    if sizes and any(not 0 < chunk <= slots for chunk, slots in sizes):
        parser.error(f"--sizes: each CHUNKxSLOTS needs 0 < CHUNK <= SLOTS, got {args.sizes!r}")
    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    scale = (NOPE + ROPE) ** -0.5
    sizes = sizes or ([(256, 1024)] if args.quick else [(2048, 8192), (2048, 32768)])
    sweep = [PrefillTiles(4096, *tiles) for tiles in SWEEP] if args.sweep else []
    failed = False
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.heads} heads")
    print("| chunk | cache slots | path | ms | TFLOP/s | rel. err vs jnp |\n|---|---|---|---|---|---|")
    for length, slots in sizes:
        case = inputs(length, slots, args.heads)
        visible_pairs = length * (slots - length) + length * (length + 1) // 2
        flops = 2 * visible_pairs * args.heads * (NOPE + ROPE + VALUE)
        jnp_path = jax.jit(functools.partial(flash_expanded_attention, scale=scale))
        ref = jnp_path(*case)
        paths = [("jnp flash (XLA)", jnp_path)] + [
            (
                f"Pallas kernel, segment {segment}",
                jax.jit(functools.partial(flash_expanded_attention_gpu, scale=scale, tiles=segment_tiles(segment))),
            )
            for segment in SEGMENTS
        ]
        paths += [
            (
                f"Pallas kernel, tiles {tiles.block_q, tiles.block_k, tiles.num_warps, tiles.num_stages}",
                jax.jit(functools.partial(flash_expanded_attention_gpu, scale=scale, tiles=tiles)),
            )
            for tiles in sweep
        ]
        for segment, *flags in MOSAIC_SWEEP:
            fields = {field: on for (field, _), on in zip(MOSAIC_FLAGS, flags, strict=True)}
            name = f"Mosaic GPU kernel, segment {segment}" + "".join(
                f", {label}" for (_, label), on in zip(MOSAIC_FLAGS, flags, strict=True) if on
            )
            tiles = mosaic_tiles(segment, **fields)
            paths.append((name, jax.jit(functools.partial(flash_expanded_attention_mgpu, scale=scale, tiles=tiles))))
        for name, fn in paths:
            try:
                err = rel_error(fn(*case), ref)
            except Exception as error:  # a kernel that does not compile here: say so, time the others
                failed = True
                print(f"| {length} | {slots} | {name} | failed: {str(error).splitlines()[0][:200]} | | |")
                continue
            assert err < 2e-2, f"{name}: rel. error {err}"
            seconds = median_seconds(fn, *case, iters=args.iters)
            print(f"| {length} | {slots} | {name} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.0f} | {err:.1e} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
