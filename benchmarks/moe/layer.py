"""One MoE layer at Ling-3.1-flash width on one GPU: the fused grouped path vs the unfused one vs the dense
one-hot baseline, and a tile sweep of the fused kernels (`python -m benchmarks.moe`, bf16 experts).

    python -m benchmarks.moe            # 8192 and 64 tokens, hidden 4096, 512 experts, top-8, bf16
    python -m benchmarks.moe --quick    # small sizes; on a CPU the kernels run in Pallas interpret mode
    python -m benchmarks.moe --no-sweep # without the tile sweep
    python -m benchmarks.moe --no-sweep --profile /tmp/moe  # plus a trace of the fused layer per token count

For each token count:
- unfused (the old path, `moe_experts` on `ExpertKernel.GROUPED`): repeat and sort the token-assignments by
  expert (a copy of the rows), three Pallas grouped matmuls with the SwiGLU between them, unsort, weighted combine;
- fused (`local_moe`, what the model runs): sort the assignment indices only, `gather_swiglu` (rows read from
  x through the permutation inside the kernel, gate + up + SwiGLU in one pass) and `down_scatter` (weighted
  rows stored back through the permutation), a sum over k;
- each path's kernels alone on pre-sorted inputs ("GEMMs only"), each inside the whole layer (router with the
  backend's expert selection + routed + shared expert; the fused one is the `MoE` module as the model calls
  it), and the dense baseline (every expert on every token, in token chunks), which also checks
  both paths on device (the bf16 baseline rounds gate and up to bf16 as the unfused path does, the fused
  kernel keeps them in fp32, so the fused path sits ~5e-3 from it while closer to an fp32 computation).
Reports ms, useful TFLOP/s (2 * tokens * top_k * 3 * hidden * width: the routed experts' products only) and
the share of the bf16 matmul peak measured in the same run (and of the 683 TFLOP/s issue 6 measures against);
for the fused whole layer also the rate counting all its matmuls (routed, shared expert, router). The sweep
times each fused kernel alone over a few (block_m, block_n, block_k, num_warps, num_stages, min_block_m)
variants.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import median_seconds, rel_error
from benchmarks.moe import calls
from benchmarks.moe.shared import selection_parser
from ling_jax.presets import preset
from pallas_kernels.moe.tuned import FEW_ROWS_PER_GROUP

ISSUE_PEAK = 683e12  # the H200 bf16 peak issue 6 states its goal against
# (block_m, block_n, block_k, num_warps, num_stages, min_block_m) of the sweep; the first of each list is the
# default. min_block_m: the smallest row tile a group's last, partial tile shrinks to (= block_m: no shrinking).
SWEEP = {
    "many rows": {
        "gather_swiglu": [
            (128, 128, 64, 8, 4, 32),
            (128, 128, 64, 8, 4, 128),
            (128, 128, 64, 8, 4, 64),
            (128, 128, 64, 8, 4, 16),
            (128, 128, 64, 8, 3, 32),
            (64, 128, 64, 4, 4, 16),
            (64, 256, 64, 8, 3, 16),
        ],
        "down_scatter": [
            (128, 256, 64, 8, 4, 32),
            (128, 256, 64, 8, 4, 128),
            (128, 256, 64, 8, 4, 64),
            (128, 256, 64, 8, 4, 16),
            (128, 256, 64, 8, 3, 32),
            (64, 256, 64, 8, 4, 16),
            (128, 128, 64, 8, 4, 32),
        ],
    },
    "few rows": {
        "gather_swiglu": [(16, 64, 128, 4, 4, 16), (16, 32, 128, 4, 4, 16), (32, 64, 128, 4, 4, 16)],
        "down_scatter": [(16, 64, 128, 4, 4, 16), (16, 32, 128, 4, 4, 16), (32, 64, 128, 4, 4, 16)],
    },
}


def matmul_peak(iters: int, n: int = 8192) -> float:
    """The best of three medians: clocks ramp up over the first runs."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    return max(2 * n**3 / median_seconds(matmul, a, b, iters=iters) for _ in range(3))


def profile_calls(fn, args, directory: str, *, count: int) -> None:
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(count):
            out = fn(*args)
        jax.block_until_ready(out)


def sweep_tiles(kernel_args, variants, *, flops_per_kernel, interpret, limit, iters):
    """Rows (kernel, tiles, ms, TFLOP/s) for each fused kernel alone over its tile variants."""
    x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down = kernel_args
    gather_swiglu_gpu, down_scatter_gpu = calls.fused_kernel_entries("gpu_triton")
    h_RI = gather_swiglu_gpu(x_TD, source_R, sizes_E, gate, up, limit=limit, interpret=interpret)
    kernel_calls = {
        "gather_swiglu": lambda tiles: (
            functools.partial(gather_swiglu_gpu, limit=limit, interpret=interpret, **tiles),
            (x_TD, source_R, sizes_E, gate, up),
        ),
        "down_scatter": lambda tiles: (
            functools.partial(down_scatter_gpu, interpret=interpret, **tiles),
            (h_RI, order_R, row_weight_R, sizes_E, down),
        ),
    }
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "min_block_m")
    rows = []
    for kernel, tile_list in variants.items():
        for tiles in tile_list:
            fn, args = kernel_calls[kernel](dict(zip(names, tiles)))
            try:
                seconds = median_seconds(fn, *args, iters=iters)
            except Exception as error:  # noqa: BLE001 - a tile that does not fit (shared memory) is reported, not fatal
                print(f"  {kernel} {tiles}: failed: {str(error).splitlines()[0][:200]}")
                continue
            rows.append((kernel, tiles, seconds, flops_per_kernel[kernel] / seconds / 1e12))
    return rows


def print_table(rows, peak):
    print(
        f"\n| tokens | path | ms | useful TFLOP/s | % of measured peak ({peak / 1e12:.3g}) | "
        f"% of {ISSUE_PEAK / 1e12:.0f} |"
    )
    print("|---|---|---|---|---|---|")
    for tokens, name, seconds, tflops in rows:
        print(
            f"| {tokens} | {name} | {seconds * 1e3:.3f} | {tflops:.1f} | {tflops * 1e12 / peak:.1%} | "
            f"{tflops * 1e12 / ISSUE_PEAK:.1%} |"
        )


def print_sweep(tokens, rows):
    print("\n| tokens | kernel | block_m, block_n, block_k, num_warps, num_stages, min_block_m | ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for kernel, tiles, seconds, tflops in rows:
        print(f"| {tokens} | {kernel} | {', '.join(map(str, tiles))} | {seconds * 1e3:.3f} | {tflops:.1f} |")


def main(argv=None) -> int:
    parser = selection_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep of the fused kernels")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write a Perfetto trace of 3 calls of the fused whole layer "
        "per token count under DIR/tokens<N> (read it with scripts/trace_summary.py --steps 3)",
    )
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None, help="token counts to time (default 8192 64; --quick 256 16)"
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="kernel backend: pallas_gpu (default on a GPU), interpret_gpu (default with --quick "
        "elsewhere), reference (jnp ragged dots, no kernels)",
    )
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    backend = args.backend or ("pallas_gpu" if on_gpu else "interpret_gpu" if args.quick else None)
    if backend is None or (backend == "pallas_gpu" and not on_gpu):
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}); try --quick")
    config = preset("ling-3.1-flash")
    token_counts = (8192, 64)
    if args.quick:
        config = config.replace(
            hidden_size=256,
            moe_intermediate_size=128,
            num_experts=16,
            n_group=4,
            topk_group=2,
            shared_expert_intermediate_size=128,
        )
        token_counts = (256, 16)  # 16 x top-8 rows: above local_moe's row-path limit
    token_counts = args.tokens or token_counts
    hidden, width, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; backend {backend}; hidden {hidden}, "
        f"{config.num_experts} experts, top-{top_k}, width {width}, shared width "
        f"{config.shared_expert_intermediate_size}, bf16"
    )
    peak = matmul_peak(args.iters, n=1024 if args.quick else 8192)
    print(f"bf16 matmul peak (XLA, best of three medians): {peak / 1e12:.1f} TFLOP/s")
    moe = calls.moe_layer(config)
    (gate, up, down), limit = calls.expert_stacks(moe)
    graphdef, state = nnx.split(moe)
    rows = []
    for tokens in token_counts:
        x_TD = jax.random.normal(jax.random.key(tokens), (tokens, hidden), jnp.bfloat16)
        weights_TK, experts_TK = calls.route_tokens(moe, x_TD, backend)
        flops = 2 * tokens * top_k * 3 * hidden * width
        # weights are arguments, never closed over: 13 GB of captured constants would stall the compiler
        unfused = calls.unfused_routed(limit, backend)
        fused = calls.fused_routed(limit, backend)
        baseline = jax.jit(lambda *a: calls.dense_in_chunks(*a, limit))
        routing = (x_TD, weights_TK, experts_TK, gate, up, down)
        dense = baseline(*routing)
        errors = {"unfused": rel_error(unfused(*routing), dense), "fused": rel_error(fused(*routing), dense)}
        kernel_args = (*calls.sorted_rows(x_TD, weights_TK, experts_TK, config.num_experts), gate, up, down)
        sizes_E = kernel_args[4]
        rows_RD = jnp.repeat(x_TD, top_k, axis=0)
        fused_layer = calls.model_layer(graphdef, backend)
        times = {
            "unfused: GEMMs only": median_seconds(
                jax.jit(functools.partial(calls.unfused_gemms, limit=limit, backend=backend)),
                rows_RD,
                sizes_E,
                gate,
                up,
                down,
                iters=args.iters,
            ),
            "fused: kernels only": median_seconds(
                jax.jit(functools.partial(calls.fused_kernels, limit=limit, backend=backend)),
                *kernel_args,
                iters=args.iters,
            ),
            "unfused: routed experts": median_seconds(unfused, *routing, iters=args.iters),
            "fused: routed experts": median_seconds(fused, *routing, iters=args.iters),
            "unfused: whole MoE layer": median_seconds(
                calls.unfused_layer(graphdef, limit, backend), state, x_TD, iters=args.iters
            ),
            "fused: whole MoE layer": median_seconds(fused_layer, state, x_TD, iters=args.iters),
            "dense one-hot baseline": median_seconds(baseline, *routing, iters=max(3, args.iters // 5)),
        }
        if args.profile:
            profile_calls(fused_layer, (state, x_TD), os.path.join(args.profile, f"tokens{tokens}"), count=3)
        layer_flops = flops + 2 * tokens * hidden * (config.num_experts + 3 * config.shared_expert_intermediate_size)
        print(
            f"\ntokens {tokens}: whole fused layer counting all its matmuls (routed top-{top_k}, shared expert, "
            f"router: {layer_flops / 1e12:.3f} TFLOP): {layer_flops / times['fused: whole MoE layer'] / 1e12:.1f} "
            f"TFLOP/s, {layer_flops / times['fused: whole MoE layer'] / peak:.1%} of peak"
        )
        print(f"\ntokens {tokens}: rel. error vs dense: unfused {errors['unfused']:.2e}, fused {errors['fused']:.2e}")
        for name, seconds in times.items():
            tflops = flops / seconds / 1e12
            print(f"  {name:28s} {seconds * 1e3:9.3f} ms  {tflops:7.1f} TFLOP/s  {tflops * 1e12 / peak:6.1%} of peak")
            rows.append((tokens, name, seconds, tflops))
        if not args.no_sweep and backend != "reference":
            few_rows = tokens * top_k <= FEW_ROWS_PER_GROUP * config.num_experts
            sweep = sweep_tiles(
                kernel_args,
                SWEEP["few rows" if few_rows else "many rows"],
                flops_per_kernel={"gather_swiglu": 2 * flops / 3, "down_scatter": flops / 3},
                interpret=backend.startswith("interpret"),
                limit=limit,
                iters=args.iters,
            )
            print_sweep(tokens, sweep)
    print_table(rows, peak)
    return 0
