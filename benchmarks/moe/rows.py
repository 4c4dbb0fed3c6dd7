"""Routed experts of a few tokens at hidden 4096, 512 experts, top-8, width 1024 (published Ling-3.1-flash: 1280), bf16,
plus the shared expert of the same width, as a decode step runs them): the row-by-row decode kernels
(`pallas_kernels.moe.routed_experts`) against the grouped path (sort by expert, the fused grouped kernels, the sum
over k: `pallas_kernels.moe.ops.moe_experts` on the FUSED path, then the shared expert), then a tile sweep of the row
kernels at one token, then the expert selection before them (`pallas_kernels.moe.select_experts`: kernel tiles vs
the jnp reference).

    python -m benchmarks.moe --path rows            # 1, 2, 4, 8 and 16 tokens, sweeps at 1 token
    python -m benchmarks.moe --path rows --quick    # 1 token, no sweep (smoke test)

Every time is per call of a chain of `common.CHAINED_CALLS` dependent calls in one jitted program (each call's input
nudged by the last output): a lone call of a few-ten-microsecond kernel would time the launch, not the kernel.
Bandwidth is over the expert weights each path must read (every distinct picked expert once for the grouped
path; a weight read per token-expert pair for the row path, which is its cost; the shared expert once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import per_call_seconds, rel_error
from benchmarks.moe import calls
from benchmarks.moe.shared import LIMIT, nudge_x, selection_parser

HIDDEN, WIDTH, EXPERTS, TOP_K = 4096, 1024, 512, 8
RULE = calls.RoutingRule(top_k=TOP_K, n_group=8, topk_group=4, norm_topk_prob=True, scaling=2.5)
SELECT_WARPS = [1, 2, 4]  # warps a program of the one-token-a-program kernel


def nudge_logits(logits_TE, selection):
    return logits_TE + 1e-6 * selection[0][:, :1]


def bench_select_experts(iters: int, token_counts=(1, 8, 64, 8192)) -> None:
    print("\nexpert selection, us per call; kernel at 1, 2, 4 warps")
    print("| tokens | jnp reference (XLA) | " + " | ".join(f"kernel {w} warps" for w in SELECT_WARPS) + " |")
    print("|---|---|" + "---|" * len(SELECT_WARPS))
    for tokens in token_counts:
        r = np.random.default_rng(tokens)
        logits = jnp.asarray(r.normal(size=(tokens, EXPERTS)), jnp.float32)
        bias = jnp.asarray(r.normal(size=EXPERTS) * 0.1, jnp.float32)
        ref_experts = calls.select_experts_reference(logits, bias, RULE)[1]
        cells = [
            per_call_seconds(
                lambda lg, b: calls.select_experts_reference(lg, b, RULE), nudge_logits, logits, bias, iters=iters
            )
        ]
        for warps in SELECT_WARPS:
            select = calls.select_experts_tiles(RULE, warps)
            assert (np.asarray(select(logits, bias)[1]) == np.asarray(ref_experts)).all(), warps
            cells.append(per_call_seconds(select, nudge_logits, logits, bias, iters=iters))
        print(f"| {tokens} | " + " | ".join(f"{c * 1e6:.1f}" for c in cells) + " |", flush=True)


SWIGLU_SWEEP = [
    (8, 512, 4, 3),
    (8, 1024, 4, 3),
    (16, 512, 4, 2),
    (16, 512, 4, 3),
    (16, 1024, 4, 3),
    (16, 512, 8, 3),
    (32, 256, 4, 3),
    (32, 512, 8, 3),
    (8, 512, 2, 3),
    (16, 256, 4, 4),
    (8, 256, 4, 4),
    (4, 1024, 4, 3),
]
DOWN_SWEEP = [
    (8, 1024, 4, 3),
    (4, 1024, 4, 3),
    (8, 512, 4, 3),
    (16, 512, 4, 3),
    (16, 1024, 8, 3),
    (8, 1024, 2, 3),
    (8, 256, 4, 4),
]


def sweep_row_tiles(operands, shared, iters: int) -> None:
    """The SwiGLU-rows kernel's tiles with the default down tiles, then the down kernel's with the best."""
    default = calls.row_kernel_tiles(jnp.bfloat16, quantized=False)  # the table's, this device's
    swiglu_default, down_default = default["swiglu_tiles"], default["down_tiles"]

    def timed(swiglu_tiles, down_tiles):
        rows = calls.row_kernels(LIMIT, swiglu_tiles=swiglu_tiles, down_tiles=down_tiles)
        try:
            return per_call_seconds(lambda x, *rest: rows(x, *rest), nudge_x, *operands, shared, iters=iters)
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile is skipped
            print(f"  skip {swiglu_tiles} {down_tiles}: {type(error).__name__}")
            return float("inf")

    swiglu = sorted((timed(t, down_default), t) for t in SWIGLU_SWEEP)
    down = sorted((timed(swiglu[0][1], t), t) for t in DOWN_SWEEP)
    print(
        f"\nrow-kernel tiles at 1 token (block_n, block_k, num_warps, num_stages), us per call (default "
        f"swiglu {swiglu_default}, down {down_default})"
    )
    for seconds, tiles in swiglu[:5]:
        print(f"    swiglu {tiles} down {down_default}: {seconds * 1e6:.1f}")
    for seconds, tiles in down[:4]:
        print(f"    swiglu {swiglu[0][1]} down {tiles}: {seconds * 1e6:.1f}")


def main(argv=None) -> int:
    parser = selection_parser(__doc__)
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 token, no tile sweep, selection at 1 and 8 tokens")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    keys = jax.random.split(jax.random.key(0), 7)
    gate = jax.random.normal(keys[0], (EXPERTS, WIDTH, HIDDEN), jnp.bfloat16) * HIDDEN**-0.5
    up = jax.random.normal(keys[1], (EXPERTS, WIDTH, HIDDEN), jnp.bfloat16) * HIDDEN**-0.5
    down = jax.random.normal(keys[2], (EXPERTS, HIDDEN, WIDTH), jnp.bfloat16) * WIDTH**-0.5
    shared = (
        jax.random.normal(keys[4], (WIDTH, HIDDEN), jnp.bfloat16) * HIDDEN**-0.5,
        jax.random.normal(keys[5], (WIDTH, HIDDEN), jnp.bfloat16) * HIDDEN**-0.5,
        jax.random.normal(keys[6], (HIDDEN, WIDTH), jnp.bfloat16) * WIDTH**-0.5,
    )
    expert_bytes = 3 * HIDDEN * WIDTH * 2

    rows, grouped = calls.row_kernels(LIMIT), calls.grouped_with_shared(LIMIT)

    print("| tokens | row kernels us | TB/s (pair reads) | grouped path us | TB/s (distinct experts) | rel. diff |")
    print("|---|---|---|---|---|---|")
    for tokens in (1,) if args.quick else map(int, args.tokens.split(",")):
        r = np.random.default_rng(tokens)
        experts = jnp.asarray(np.stack([r.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]), jnp.int32)
        weights = jnp.asarray(r.uniform(0.1, 1.0, (tokens, TOP_K)), jnp.float32)
        x = jax.random.normal(keys[3], (tokens, HIDDEN), jnp.bfloat16)
        operands = (x, weights, experts, gate, up, down)
        row_s = per_call_seconds(rows, nudge_x, *operands, shared, iters=args.iters)
        grouped_s = per_call_seconds(grouped, nudge_x, *operands, shared, iters=args.iters)
        distinct = len(np.unique(np.asarray(experts))) + 1
        diff = rel_error(jax.jit(rows)(*operands, shared), jax.jit(grouped)(*operands, shared))
        print(
            f"| {tokens} | {row_s * 1e6:.1f} | {(tokens * TOP_K + 1) * expert_bytes / row_s / 1e12:.2f} | "
            f"{grouped_s * 1e6:.1f} | {distinct * expert_bytes / grouped_s / 1e12:.2f} | {diff:.1e} |",
            flush=True,
        )
        if tokens == 1 and not (args.no_sweep or args.quick):
            sweep_row_tiles(operands, shared, args.iters)
    bench_select_experts(args.iters, (1, 8) if args.quick else (1, 8, 64, 8192))
    return 0
