#!/usr/bin/env python3
"""The routed experts' gate/up products with block-FP8 weights (Mosaic GPU kernel, `pallas_kernels.moe.
fp8_gate_up_mgpu`) against the bf16 Triton kernel the model runs (`gather_swiglu_gpu`), on one Hopper GPU.

    python scripts/bench_fp8_experts.py                  # 2048, 8192 and 32768 tokens at Ling-3.1-flash width
    python scripts/bench_fp8_experts.py --tokens 8192 --iters 20

Both run on the same routing (the MoE module's router on random activations) and the same weights: random
bf16 experts quantised to block FP8 (128 x 128 blocks, scale = amax / 448), and the bf16 kernel gets their
dequantised values, so the outputs agree up to summation order (reported). Timed per token count:
- bf16: `gather_swiglu_gpu` with its default tiles (reads x through the sort permutation);
- FP8: the row gather into the 8-aligned layout (`prepare_rows`), the kernel alone (`gate_up_fp8_tiles`) for
  each (block_m, stages) variant, and the two together.
Reports ms, TFLOP/s of the gate/up products (2 * rows * hidden * 2 * width) with the share of the bf16 matmul
peak measured in the same run, and the weight bytes streamed per second.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench_common import median_seconds, rel_error  # noqa: E402
from bench_moe import matmul_peak  # noqa: E402
from ling_jax import LingConfig  # noqa: E402
from ling_jax.expert_ffn import sort_by_expert  # noqa: E402
from ling_jax.moe import MoE  # noqa: E402
from pallas_kernels.moe.fp8_gate_up_mgpu import (SCALE_BLOCK, gate_up_fp8_tiles, prepare_rows,  # noqa: E402
                                                 slabs_to_rows)
from pallas_kernels.moe.fused_gpu import gather_swiglu_gpu  # noqa: E402

FP8_MAX = 448.0
VARIANTS = ((128, 3), (128, 2), (64, 4), (64, 3))  # (block_m, stages); the first is the default


@jax.jit
def quantize_blocks(w_GNK):
    """(float8_e4m3fn codes, fp32 scales [G, N/128, K/128], the bf16 weights they stand for)."""
    groups, rows, cols = w_GNK.shape
    blocks = w_GNK.astype(jnp.float32).reshape(groups, rows // SCALE_BLOCK, SCALE_BLOCK, cols // SCALE_BLOCK,
                                               SCALE_BLOCK)
    scale = jnp.maximum(jnp.abs(blocks).max(axis=(2, 4)), 1e-12) / FP8_MAX
    codes = (blocks / scale[:, :, None, :, None]).astype(jnp.float8_e4m3fn)
    dequantized = (codes.astype(jnp.float32) * scale[:, :, None, :, None]).astype(jnp.bfloat16)
    return codes.reshape(w_GNK.shape), scale, dequantized.reshape(w_GNK.shape)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"needs a Hopper GPU (jax.default_backend() is {jax.default_backend()!r})")
    config = LingConfig.preset("ling-3.1-flash")
    hidden, width, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; hidden {hidden}, {config.num_experts} experts, "
          f"top-{top_k}, width {width}")
    peak = matmul_peak(args.iters)
    print(f"bf16 matmul peak (XLA, best of three medians): {peak / 1e12:.1f} TFLOP/s")
    moe = MoE(config, clip_layer=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    limit = moe.experts.limit
    gate_codes, gate_scale, gate_bf16 = quantize_blocks(moe.experts.gate_proj[...])
    up_codes, up_scale, up_bf16 = quantize_blocks(moe.experts.up_proj[...])
    fp8_bytes = 2 * (gate_codes.size + 4 * gate_scale.size)
    bf16_bytes = 2 * 2 * gate_bf16.size
    print("| tokens | path | ms | TFLOP/s | % of peak | weights GB/s |")
    print("|---|---|---|---|---|---|")
    for tokens in args.tokens:
        x_TD = jax.random.normal(jax.random.key(tokens), (tokens, hidden), jnp.bfloat16)
        _, experts_TK = jax.jit(moe.gate)(x_TD)
        order_R, sizes_E = jax.jit(sort_by_expert, static_argnums=1)(experts_TK.reshape(-1), config.num_experts)
        source_R = order_R // top_k
        flops = 2 * source_R.shape[0] * hidden * 2 * width
        bf16 = jax.jit(functools.partial(gather_swiglu_gpu, limit=limit))
        h_bf16 = bf16(x_TD, source_R, sizes_E, gate_bf16, up_bf16)

        def row(path, seconds, weight_bytes):
            print(f"| {tokens} | {path} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} | "
                  f"{100 * flops / seconds / peak:.1f}% | {weight_bytes / seconds / 1e9:.0f} |", flush=True)

        row("bf16 Triton gather_swiglu", median_seconds(bf16, x_TD, source_R, sizes_E, gate_bf16, up_bf16,
                                                        iters=args.iters), bf16_bytes)
        for block_m, stages in VARIANTS:
            prepare = jax.jit(functools.partial(prepare_rows, block_m=block_m))
            kernel = jax.jit(functools.partial(gate_up_fp8_tiles, limit=limit, block_m=block_m, stages=stages))
            tiles, x_PD = prepare(x_TD, source_R, sizes_E)
            weights = (gate_codes, gate_scale, up_codes, up_scale)
            try:
                hT = kernel(tiles, x_PD, *weights)
            except Exception as error:  # noqa: BLE001 -- a variant that does not compile is reported, not fatal
                print(f"| {tokens} | FP8 block_m {block_m} stages {stages} | failed: {type(error).__name__}: "
                      f"{str(error).splitlines()[0][:160]} | | | |")
                continue
            error = rel_error(slabs_to_rows(hT, tiles)[:h_bf16.shape[0]].astype(jnp.float32),
                              h_bf16.astype(jnp.float32))
            kernel_s = median_seconds(kernel, tiles, x_PD, *weights, iters=args.iters)
            row(f"FP8 Mosaic kernel alone, block_m {block_m}, stages {stages} (vs bf16: {error:.1e})", kernel_s,
                fp8_bytes)
            if (block_m, stages) == VARIANTS[0]:
                prepare_s = median_seconds(prepare, x_TD, source_R, sizes_E, iters=args.iters)
                print(f"| {tokens} | FP8 row gather + tile table alone | {prepare_s * 1e3:.3f} | | | |")
                row("FP8 gather + kernel", prepare_s + kernel_s, fp8_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
