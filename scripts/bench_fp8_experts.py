#!/usr/bin/env python3
"""The routed experts' gate/up products with block-FP8 weights (Mosaic GPU kernel, `pallas_kernels.moe.
fp8_gate_up_mgpu`) against the bf16 Triton kernel the model runs (`gather_swiglu_gpu`), on one Hopper GPU.

    python scripts/bench_fp8_experts.py                  # 2048, 8192 and 32768 tokens at Ling-3.1-flash width
    python scripts/bench_fp8_experts.py --tokens 8192 --iters 20
    python scripts/bench_fp8_experts.py --quick        # small sizes, both kernels in interpret mode (jax >= 0.11)

Both run on the same routing (the MoE module's router on random activations) and the same weights: random
bf16 experts quantised to block FP8 (128 x 128 blocks, scale = amax / 448), and the bf16 kernel gets their
dequantised values (a separate jitted call, so XLA cannot fold the FP8 round trip away). Both are checked
against float64 numpy on the rows of the first experts. Timed per token count:
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
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_common import median_seconds, rel_error  # noqa: E402
from bench_moe import matmul_peak  # noqa: E402
from ling_jax import LingConfig  # noqa: E402
from ling_jax.expert_ffn import sort_by_expert  # noqa: E402
from ling_jax.moe import MoE  # noqa: E402
from ling_jax.quant import dequantize_fp8_block  # noqa: E402
from pallas_kernels.moe.fp8_gate_up_mgpu import (SCALE_BLOCK, gate_up_fp8_tiles, prepare_rows,  # noqa: E402
                                                 slabs_to_rows)
from pallas_kernels.moe.fused_gpu import gather_swiglu_gpu  # noqa: E402

FP8_MAX = 448.0
VARIANTS = ((128, 3, 2), (128, 3, 1), (128, 2, 2), (64, 4, 2), (64, 4, 1))  # (block_m, stages, parts); default first


def _blocks(w_GNK):
    groups, rows, cols = w_GNK.shape
    return w_GNK.reshape(groups, rows // SCALE_BLOCK, SCALE_BLOCK, cols // SCALE_BLOCK, SCALE_BLOCK)


@jax.jit
def quantize_blocks(w_GNK):
    """(float8_e4m3fn codes [G, N, K], fp32 scales [G, N/128, K/128])."""
    blocks = _blocks(w_GNK.astype(jnp.float32))
    scale = jnp.maximum(jnp.abs(blocks).max(axis=(2, 4)), 1e-12) / FP8_MAX
    return (blocks / scale[:, :, None, :, None]).astype(jnp.float8_e4m3fn).reshape(w_GNK.shape), scale


@jax.jit
def dequantize_blocks(codes_GNK, scale):
    """The bf16 weights the codes stand for (`ling_jax.quant.dequantize_fp8_block`, then bf16)."""
    weight = _blocks(codes_GNK.astype(jnp.float32)) * scale[:, :, None, :, None]
    return weight.astype(jnp.bfloat16).reshape(codes_GNK.shape)


def float64_check(h_RI, x_TD, source_R, sizes_E, codes, scales, limit, *, experts: int = 8):
    """Rel. error of h's rows of the first `experts` experts against float64 numpy (weights dequantised by
    `dequantize_fp8_block` and rounded to bf16, as the kernels see them)."""
    sizes = np.asarray(sizes_E)[:experts]
    rows = int(sizes.sum())
    x_RD = np.asarray(x_TD.astype(jnp.float32), np.float64)[np.asarray(source_R)[:rows]]
    products = []
    for c, s in zip(codes, scales):
        c, s = np.asarray(c[:experts].astype(jnp.float32)), np.asarray(s[:experts])
        w = np.stack([dequantize_fp8_block(c[e], s[e], (SCALE_BLOCK, SCALE_BLOCK)) for e in range(experts)])
        w = w.astype(ml_dtypes.bfloat16).astype(np.float64)
        products.append(np.concatenate([x_RD[a:b] @ w[e].T for e, (a, b) in
                                        enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes)))]))
    gate, up = products
    activated = gate / (1 + np.exp(-gate))
    expected = activated * up if limit is None else np.minimum(activated, limit) * np.clip(up, -limit, limit)
    return rel_error(np.asarray(h_RI[:rows].astype(jnp.float32)), expected)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small sizes, interpret mode (checks the script)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.quick:
        parser.error(f"needs a Hopper GPU (jax.default_backend() is {jax.default_backend()!r}); try --quick")
    config = LingConfig.preset("ling-3.1-flash")
    if args.quick:
        config = config.replace(hidden_size=512, moe_intermediate_size=256, num_experts=16, n_group=4, topk_group=2,
                                shared_expert_intermediate_size=256)
        args.tokens, args.iters = [64], 1
    hidden, width, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; hidden {hidden}, {config.num_experts} experts, "
          f"top-{top_k}, width {width}")
    peak = matmul_peak(args.iters, n=1024 if args.quick else 8192)
    print(f"bf16 matmul peak (XLA, best of three medians): {peak / 1e12:.1f} TFLOP/s")
    moe = MoE(config, clip_layer=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    limit = moe.experts.limit
    gate_codes, gate_scale = quantize_blocks(moe.experts.gate_proj[...])
    up_codes, up_scale = quantize_blocks(moe.experts.up_proj[...])
    gate_bf16, up_bf16 = dequantize_blocks(gate_codes, gate_scale), dequantize_blocks(up_codes, up_scale)
    check = functools.partial(float64_check, codes=(gate_codes, up_codes), scales=(gate_scale, up_scale),
                              limit=limit)
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
        bf16 = jax.jit(functools.partial(gather_swiglu_gpu, limit=limit, interpret=args.quick))
        h_bf16 = bf16(x_TD, source_R, sizes_E, gate_bf16, up_bf16)

        def row(path, seconds, weight_bytes):
            print(f"| {tokens} | {path} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} | "
                  f"{100 * flops / seconds / peak:.1f}% | {weight_bytes / seconds / 1e9:.0f} |", flush=True)

        row(f"bf16 Triton gather_swiglu (vs float64: {check(h_bf16, x_TD, source_R, sizes_E):.1e})",
            median_seconds(bf16, x_TD, source_R, sizes_E, gate_bf16, up_bf16, iters=args.iters), bf16_bytes)
        for block_m, stages, parts in VARIANTS:
            prepare = jax.jit(functools.partial(prepare_rows, block_m=block_m))
            kernel = jax.jit(functools.partial(gate_up_fp8_tiles, limit=limit, block_m=block_m, stages=stages,
                                               parts=parts, interpret=args.quick))
            variant = f"block_m {block_m}, stages {stages}, parts {parts}"
            tiles, x_PD = prepare(x_TD, source_R, sizes_E)
            weights = (gate_codes, gate_scale, up_codes, up_scale)
            try:
                hT = kernel(tiles, x_PD, *weights)
            except Exception as error:  # noqa: BLE001 -- a variant that does not compile is reported, not fatal
                print(f"| {tokens} | FP8 {variant} | failed: {type(error).__name__}: "
                      f"{str(error).splitlines()[0][:160]} | | | |")
                continue
            h_fp8 = slabs_to_rows(hT, sizes_E, source_R.shape[0], block_m=block_m)
            errors = (f"vs float64: {check(h_fp8, x_TD, source_R, sizes_E):.1e}, vs bf16 kernel: "
                      f"{rel_error(h_fp8.astype(jnp.float32), h_bf16.astype(jnp.float32)):.1e}")
            kernel_s = median_seconds(kernel, tiles, x_PD, *weights, iters=args.iters)
            row(f"FP8 Mosaic kernel alone, {variant} ({errors})", kernel_s, fp8_bytes)
            if (block_m, stages, parts) == VARIANTS[0]:
                prepare_s = median_seconds(prepare, x_TD, source_R, sizes_E, iters=args.iters)
                print(f"| {tokens} | FP8 row gather + tile table alone | {prepare_s * 1e3:.3f} | | | |")
                row("FP8 gather + kernel", prepare_s + kernel_s, fp8_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
