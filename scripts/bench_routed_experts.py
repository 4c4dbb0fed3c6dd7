#!/usr/bin/env python3
"""Routed experts of a few tokens at Ling-3.1-flash width (hidden 4096, 512 experts, top-8, width 1024, bf16):
the row-by-row decode kernels (`pallas_kernels.moe.routed_experts`) against the grouped path (sort, three
grouped matmuls, unsort, combine: `ling_jax.expert_ffn.grouped_local_moe`), in one jitted layer each.

    python scripts/bench_routed_experts.py              # 1, 2, 4, 8 and 16 tokens, with a tile sweep at 1 token

Prints ms per call and the bandwidth over the expert weights each path must read (every distinct picked
expert once for the grouped path; a weight read per token-expert pair for the row path, which is its cost).
Then the expert selection before them (`pallas_kernels.moe.routing`): the GPU kernel's tiles against the jnp
reference under XLA, each timed as a chain of CHAINED_CALLS dependent calls in one jitted program (a lone
call of a few-microsecond kernel would time the launch, not the kernel).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_common import median_seconds, rel_error  # noqa: E402
from ling_jax.expert_ffn import grouped_local_moe  # noqa: E402
from pallas_kernels.moe.decode_gpu import routed_experts_gpu  # noqa: E402
from pallas_kernels.moe.routing import RoutingRule, select_experts_gpu, select_experts_reference  # noqa: E402

HIDDEN, WIDTH, EXPERTS, TOP_K, LIMIT = 4096, 1024, 512, 8, 7.0
RULE = RoutingRule(top_k=TOP_K, n_group=8, topk_group=4, norm_topk_prob=True, scaling=2.5)
CHAINED_CALLS = 64
SELECT_TILES = [(1, 1), (1, 2), (1, 4), (2, 2), (4, 4), (16, 4)]  # (block_t, num_warps)


def chained(select):
    """CHAINED_CALLS selections in one program, each call's logits nudged by the last call's weights."""
    def run(logits_TE, bias_E):
        for _ in range(CHAINED_CALLS):
            weights_TK, _ = select(logits_TE, bias_E)
            logits_TE = logits_TE + 1e-6 * weights_TK[:, :1]
        return logits_TE
    return jax.jit(run)


def bench_select_experts(iters: int) -> None:
    print(f"\nexpert selection, us per call (chains of {CHAINED_CALLS}); kernel tiles (block_t, num_warps)")
    print("| tokens | jnp reference (XLA) | " + " | ".join(f"kernel {t}" for t in SELECT_TILES) + " |")
    print("|---|---|" + "---|" * len(SELECT_TILES))
    for tokens in (1, 8, 64, 8192):
        r = np.random.default_rng(tokens)
        logits = jnp.asarray(r.normal(size=(tokens, EXPERTS)), jnp.float32)
        bias = jnp.asarray(r.normal(size=EXPERTS) * 0.1, jnp.float32)
        ref_experts = select_experts_reference(logits, bias, RULE)[1]
        cells = [median_seconds(chained(lambda lg, b: select_experts_reference(lg, b, RULE)), logits, bias,
                                iters=iters)]
        for block_t, warps in SELECT_TILES:
            select = functools.partial(select_experts_gpu, rule=RULE, block_t=block_t, num_warps=warps)
            assert (np.asarray(select(logits, bias)[1]) == np.asarray(ref_experts)).all(), (block_t, warps)
            cells.append(median_seconds(chained(select), logits, bias, iters=iters))
        print(f"| {tokens} | " + " | ".join(f"{c / CHAINED_CALLS * 1e6:.1f}" for c in cells) + " |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    keys = jax.random.split(jax.random.key(0), 4)
    gate = jax.random.normal(keys[0], (EXPERTS, WIDTH, HIDDEN), jnp.bfloat16) * HIDDEN ** -0.5
    up = jax.random.normal(keys[1], (EXPERTS, WIDTH, HIDDEN), jnp.bfloat16) * HIDDEN ** -0.5
    down = jax.random.normal(keys[2], (EXPERTS, HIDDEN, WIDTH), jnp.bfloat16) * WIDTH ** -0.5
    expert_bytes = 3 * HIDDEN * WIDTH * 2
    grouped = jax.jit(functools.partial(grouped_local_moe, limit=LIMIT, backend="pallas_gpu"))
    print("| tokens | row kernels ms | TB/s (pair reads) | grouped path ms | TB/s (distinct experts) | rel. diff |")
    print("|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        r = np.random.default_rng(tokens)
        experts = jnp.asarray(np.stack([r.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]), jnp.int32)
        weights = jnp.asarray(r.uniform(0.1, 1.0, (tokens, TOP_K)), jnp.float32)
        x = jax.random.normal(keys[3], (tokens, HIDDEN), jnp.bfloat16)
        rows = jax.jit(lambda *a: routed_experts_gpu(*a, limit=LIMIT))
        operands = (x, weights, experts, gate, up, down)
        row_s = median_seconds(rows, *operands, iters=args.iters)
        grouped_s = median_seconds(grouped, *operands, iters=args.iters)
        distinct = len(np.unique(np.asarray(experts)))
        diff = rel_error(rows(*operands), grouped(*operands))
        print(f"| {tokens} | {row_s * 1e3:.3f} | {tokens * TOP_K * expert_bytes / row_s / 1e12:.2f} | "
              f"{grouped_s * 1e3:.3f} | {distinct * expert_bytes / grouped_s / 1e12:.2f} | {diff:.1e} |", flush=True)
        if tokens != 1 or args.no_sweep:
            continue
        results = []
        for swiglu_tiles, down_tiles in itertools.product(
                itertools.product((8, 16, 32), (256, 512, 1024), (4,), (2, 3)),
                [(16, 512, 4, 3), (32, 512, 4, 3), (8, 1024, 4, 3)]):
            fn = jax.jit(lambda *a, s=swiglu_tiles, d=down_tiles: routed_experts_gpu(
                *a, limit=LIMIT, swiglu_tiles=s, down_tiles=d))
            try:
                results.append((median_seconds(fn, *operands, iters=args.iters), swiglu_tiles, down_tiles))
            except Exception as error:  # noqa: BLE001 - a candidate that does not compile is skipped
                print(f"  skip {swiglu_tiles} {down_tiles}: {type(error).__name__}")
        for seconds, swiglu_tiles, down_tiles in sorted(results)[:6]:
            print(f"    swiglu {swiglu_tiles} down {down_tiles}: {seconds * 1e3:.3f} ms")
    bench_select_experts(max(args.iters // 5, 5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
