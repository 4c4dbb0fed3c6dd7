#!/usr/bin/env python3
"""One MoE layer at Ling-3.1-flash width on one GPU: the grouped-GEMM path vs the dense one-hot baseline.

    python scripts/bench_moe.py            # 8192 and 64 tokens, hidden 4096, 512 experts, top-8, bf16
    python scripts/bench_moe.py --quick    # small sizes (smoke test)

For each token count: the routed experts through `local_moe` (sort rows by expert, three Pallas grouped
matmuls, unsort, combine), the same three grouped matmuls alone, the whole layer (router + routed + shared
expert), and the dense baseline (every expert on every token, masked by the routing weights; run in token
chunks so it fits). Reports ms, useful TFLOP/s (2 * tokens * top_k * 3 * hidden * width) and the fraction of
the bf16 matmul peak measured in the same run; checks grouped vs dense on device.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench_common import median_seconds, rel_error  # noqa: E402
from ling_jax import LingConfig  # noqa: E402
from ling_jax.expert_ffn import dense_expert_ffn, local_moe  # noqa: E402
from ling_jax.moe import MoE  # noqa: E402
from pallas_kernels.moe.ops import grouped_matmul  # noqa: E402

BASELINE_CHUNK = 512  # tokens per dense-baseline chunk: [chunk, E, D] bf16 intermediates stay ~2 GB


def matmul_peak(iters: int, n: int = 8192) -> float:
    """The best of three medians: clocks ramp up over the first runs."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    return max(2 * n ** 3 / median_seconds(matmul, a, b, iters=iters) for _ in range(3))


def dense_in_chunks(x_TD, weights_TK, experts_TK, gate, up, down, limit):
    chunks = x_TD.shape[0] // min(BASELINE_CHUNK, x_TD.shape[0])

    def one(args):
        return dense_expert_ffn(*args, gate, up, down, limit)

    split = [a.reshape(chunks, -1, *a.shape[1:]) for a in (x_TD, weights_TK, experts_TK)]
    return jax.lax.map(one, split).reshape(x_TD.shape)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backend", default="pallas_gpu", help="grouped-matmul backend (reference: CPU smoke test)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and args.backend == "pallas_gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    backend = args.backend
    config = LingConfig.preset("ling-3.1-flash")
    token_counts = (8192, 64)
    if args.quick:
        config = config.replace(hidden_size=1024, moe_intermediate_size=256, num_experts=64, n_group=8,
                                topk_group=4, shared_expert_intermediate_size=256)
        token_counts = (1024, 64)
    hidden, width, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; hidden {hidden}, {config.num_experts} experts, "
          f"top-{top_k}, width {width}, shared width {config.shared_expert_intermediate_size}, bf16")
    peak = matmul_peak(args.iters, n=2048 if args.quick else 8192)
    print(f"bf16 matmul peak (8192^3, XLA): {peak / 1e12:.0f} TFLOP/s")
    moe = MoE(config, clip_layer=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    gate, up, down = moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...]
    limit = moe.experts.limit
    graphdef, state = nnx.split(moe)
    rows = []
    for tokens in token_counts:
        x_TD = jax.random.normal(jax.random.key(tokens), (tokens, hidden), jnp.bfloat16)
        weights_TK, experts_TK = jax.jit(moe.gate)(x_TD)
        flops = 2 * tokens * top_k * 3 * hidden * width
        # weights are arguments, never closed over: 13 GB of captured constants would stall the compiler
        routed = jax.jit(lambda *a: local_moe(*a, limit, backend=backend))
        baseline = jax.jit(lambda *a: dense_in_chunks(*a, limit))
        routing = (x_TD, weights_TK, experts_TK, gate, up, down)
        err = rel_error(routed(*routing), baseline(*routing))
        rows_RD = jnp.repeat(x_TD, top_k, axis=0)
        sizes = jnp.bincount(experts_TK.reshape(-1), length=config.num_experts).astype(jnp.int32)

        def three_gemms(x, sizes, gate, up, down):
            h = jax.nn.silu(grouped_matmul(x, gate, sizes, backend=backend)) * grouped_matmul(x, up, sizes,
                                                                                                 backend=backend)
            return grouped_matmul(h, down, sizes, backend=backend)

        # jax.jit over the split state, as the model runs (nnx.jit would also return, i.e. copy, the 13 GB state)
        layer = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, kernel_backend=backend))
        times = {
            "grouped GEMMs only": median_seconds(jax.jit(three_gemms), rows_RD, sizes, gate, up, down,
                                                 iters=args.iters),
            "routed experts (grouped)": median_seconds(routed, *routing, iters=args.iters),
            "whole MoE layer (grouped)": median_seconds(layer, state, x_TD[None], iters=args.iters),
            "dense one-hot baseline": median_seconds(baseline, *routing, iters=max(3, args.iters // 5)),
        }
        print(f"\ntokens {tokens}: grouped vs dense rel. error {err:.2e}")
        for name, seconds in times.items():
            tflops = flops / seconds / 1e12
            print(f"  {name:28s} {seconds * 1e3:9.3f} ms  {tflops:7.1f} TFLOP/s  {tflops * 1e12 / peak:6.1%} of peak")
            rows.append((tokens, name, seconds, tflops))
    print(f"\n| tokens | path | ms | useful TFLOP/s | % of measured peak ({peak / 1e12:.0f}) |")
    print("|---|---|---|---|---|")
    for tokens, name, seconds, tflops in rows:
        print(f"| {tokens} | {name} | {seconds * 1e3:.3f} | {tflops:.1f} | {tflops * 1e12 / peak:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
