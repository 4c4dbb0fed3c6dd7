#!/usr/bin/env python3
"""Absorbed-MLA decode: the Pallas GPU kernels (Triton lowering; Mosaic GPU for Hopper) vs XLA's einsum
implementation, on one GPU.

    python -m benchmarks.mla                 # the issue's sizes, H=64, bf16 cache, full lengths
    python -m benchmarks.mla --quick         # small sizes (smoke test)
    python -m benchmarks.mla --decode-step   # Ling-3.0-flash's decode step: H=32, L=8192 at B=1 and 8, Triton
                                             # splits from its default to 4x, 64 and 32 slots a block

For each size: device correctness of every kernel variant (tiles, warps, stages, splits) against the jnp
reference (fp32 upcast), then the median time per call of CALLS dependent calls chained in one jitted program
(after warm-up, synchronised), cache bytes/s, useful FLOP/s and the ratio to XLA.
Also measures a device-to-device copy as the bandwidth ceiling. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import chained, copy_bandwidth, per_call_seconds, rel_error  # noqa: E402
from pallas_kernels.mla.gpu_mosaic import default_num_splits as mosaic_num_splits  # noqa: E402
from pallas_kernels.mla.gpu_triton import default_num_splits  # noqa: E402
from pallas_kernels.mla.ops import kernel  # noqa: E402
from pallas_kernels.mla.reference import mla_decode_reference  # noqa: E402
from pallas_kernels.mla.tuned import DECODE_MOSAIC, DecodeTritonTiles  # noqa: E402
from pallas_kernels.tuning import lookup  # noqa: E402

mla_decode_gpu, mla_decode_mgpu = kernel("mla_decode", "gpu_triton"), kernel("mla_decode", "gpu_mosaic")

LATENT, ROPE, HEADS = 512, 64, 64
SIZES = [(64, 32768), (8, 131072), (1, 262144)]
QUICK_SIZES = [(4, 4096), (1, 8192)]
# Triton kernel (block_k, head_block, num_warps, num_stages): the last runs' best two. Mosaic GPU kernel
# (pv_chunk, splits relative to its default, approx_math): the default, twice the splits, accurate exp.
TRITON_VARIANTS = [(64, 64, 8, 2), (32, 64, 8, 4)]
# --decode-step: Ling-3.0-flash's MLA layers in a decode step (32 heads, one head block of 32; at B=1 the default
# splits give 33 programs of 256 slots on 132 SMs): (block_k, num_warps, num_stages, splits as a multiple of the
# default), the default first
DECODE_STEP_HEADS, DECODE_STEP_SIZES = 32, [(1, 8192), (8, 8192)]
DECODE_STEP_VARIANTS = [(64, 8, 2, 1), (64, 8, 2, 2), (64, 8, 2, 4), (32, 4, 2, 4), (32, 4, 3, 8), (64, 4, 2, 2)]
MOSAIC_VARIANTS = [(128, 1, True), (128, 2, True), (128, 1, False)]


CALLS = 8  # decode calls chained in one jitted program per timing (no per-dispatch floor in small calls)


def nudge_query(q_latent_BHR, o_latent_BHR):
    """The next chained call's query depends on this call's output (so XLA cannot merge the calls)."""
    return q_latent_BHR + (1e-3 * o_latent_BHR).astype(q_latent_BHR.dtype)


def kernel_variants(batch: int, length: int, scale: float, heads: int = HEADS, decode_step: bool = False):
    """(label, jitted kernel) pairs for one size: the Triton and Mosaic variants, or (decode_step) the Triton
    kernel's DECODE_STEP_VARIANTS."""
    triton = (
        [(block_k, heads, warps, stages, factor) for block_k, warps, stages, factor in DECODE_STEP_VARIANTS]
        if decode_step
        else [(*variant, 1) for variant in TRITON_VARIANTS]
    )
    for block_k, head_block, warps, stages, factor in triton:
        splits = factor * default_num_splits(batch, -(-heads // head_block), length)
        yield (
            f"triton (bk {block_k}, hb {head_block}, warps {warps}, stages {stages}, splits {splits})",
            jax.jit(
                functools.partial(
                    mla_decode_gpu,
                    scale=scale,
                    tiles=DecodeTritonTiles(block_k, head_block, warps, stages),
                    num_splits=splits,
                )
            ),
        )
    for pv_chunk, split_factor, approx_math in () if decode_step else MOSAIC_VARIANTS:
        splits = split_factor * mosaic_num_splits(batch, length)
        tiles = dataclasses.replace(
            lookup(DECODE_MOSAIC, dtype=jnp.bfloat16), pv_chunk=pv_chunk, approx_math=approx_math
        )
        yield (
            f"mosaic (pv_chunk {pv_chunk}, splits {splits}{', approx. exp' if approx_math else ''})",
            jax.jit(functools.partial(mla_decode_mgpu, scale=scale, tiles=tiles, num_splits=splits)),
        )


def profile_default_kernel(directory: str, scale: float, *args) -> None:
    chain = chained(functools.partial(mla_decode_mgpu, scale=scale), nudge_query, CALLS)
    jax.block_until_ready(chain(*args))
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        jax.block_until_ready(chain(*args))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write a Perfetto trace of the default Mosaic kernel's "
        "chained calls at each size under DIR/B<batch>_L<length> (read it with trace_summary.py)",
    )
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="Ling-3.0-flash's decode step (H=32, L=8192, B=1 and 8): the Triton kernel's splits and blocks",
    )
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    scale = 1 / np.sqrt(192)
    ceiling = copy_bandwidth(args.iters)
    print(f"device copy: {ceiling / 1e12:.2f} TB/s (bytes read + written)")
    rows = []
    heads = DECODE_STEP_HEADS if args.decode_step else HEADS
    for batch, length in DECODE_STEP_SIZES if args.decode_step else QUICK_SIZES if args.quick else SIZES:
        keys = jax.random.split(jax.random.key(batch * length), 3)
        q_latent = 0.2 * jax.random.normal(keys[0], (batch, heads, LATENT), jnp.bfloat16)
        q_rope = jax.random.normal(keys[1], (batch, heads, ROPE), jnp.bfloat16)
        cache = jax.random.normal(keys[2], (batch, length, LATENT + ROPE), jnp.bfloat16)
        lengths = jnp.full((batch,), length, jnp.int32)
        cache_bytes = cache.size * cache.dtype.itemsize
        flops = 2 * batch * heads * length * (LATENT + ROPE + LATENT)
        xla = jax.jit(functools.partial(mla_decode_reference, scale=scale))
        ref = xla(q_latent.astype(jnp.float32), q_rope.astype(jnp.float32), cache.astype(jnp.float32), lengths)
        xla_s = per_call_seconds(xla, nudge_query, q_latent, q_rope, cache, lengths, iters=args.iters, calls=CALLS)
        print(f"B={batch} L={length}: XLA einsum {xla_s * 1e3:.3f} ms, {cache_bytes / xla_s / 1e12:.2f} TB/s")
        best = None
        for variant, fn in kernel_variants(batch, length, scale, heads, args.decode_step):
            try:
                err = rel_error(fn(q_latent, q_rope, cache, lengths), ref)
                seconds = per_call_seconds(
                    fn, nudge_query, q_latent, q_rope, cache, lengths, iters=args.iters, calls=CALLS
                )
            except Exception as e:  # a variant that does not compile (e.g. out of shared memory) is reported
                print(f"  variant {variant}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            print(
                f"  variant {variant}: {seconds * 1e3:.3f} ms, {cache_bytes / seconds / 1e12:.2f} TB/s, "
                f"rel. error {err:.1e}"
            )
            assert err < 2e-2, f"kernel variant is wrong: rel. error {err}"
            if best is None or seconds < best[0]:
                best = (seconds, variant, err)
        if args.profile:
            profile_default_kernel(
                os.path.join(args.profile, f"B{batch}_L{length}"), scale, q_latent, q_rope, cache, lengths
            )
        if best is None:
            print(f"B={batch} L={length}: no kernel variant ran")
            continue
        seconds, variant, err = best
        rows.append((batch, length, xla_s, seconds, variant, err, cache_bytes, flops))
    print(
        "\n| B | L | XLA ms | best ms | speed-up | cache TB/s | % of copy | TFLOP/s |"
        " kernel | rel. err |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for batch, length, xla_s, seconds, variant, err, cache_bytes, flops in rows:
        print(
            f"| {batch} | {length} | {xla_s * 1e3:.3f} | {seconds * 1e3:.3f} | {xla_s / seconds:.2f}x | "
            f"{cache_bytes / seconds / 1e12:.2f} | {100 * cache_bytes / seconds / ceiling:.0f}% | "
            f"{flops / seconds / 1e12:.0f} | {variant} | {err:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
