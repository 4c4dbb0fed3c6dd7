#!/usr/bin/env python3
"""One MoE layer at Ling-3.1-flash width on one GPU: the fused grouped path vs the unfused one vs the dense
one-hot baseline, and a tile sweep of the fused kernels.

    python scripts/bench_moe.py            # 8192 and 64 tokens, hidden 4096, 512 experts, top-8, bf16
    python scripts/bench_moe.py --quick    # small sizes; on a CPU the kernels run in Pallas interpret mode
    python scripts/bench_moe.py --no-sweep # without the tile sweep
    python scripts/bench_moe.py --no-sweep --profile /tmp/moe  # plus a trace of the fused layer per token count
    python scripts/bench_moe.py --fp8-experts  # plus the fused kernels on block-FP8 expert weights

For each token count:
- unfused (the old path, `unfused_local_moe`): repeat and sort the token-assignments by expert (a copy of the
  rows), three Pallas grouped matmuls with the SwiGLU between them, unsort, weighted combine;
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

With --fp8-experts the expert weights are also quantized to block FP8 (float8_e4m3fn, one scale per 128 x 128
block, scale = max|block| / 448, as the checkpoints store them) and the two fused kernels, alone and chained,
run on the FP8 codes and scales (each weight tile dequantized to bf16 in the kernel) next to the bf16 weights,
on the same FLOP count, once for each dot form (`fp8_weight_operand`): "fp8 (weights as A)", the dequantized
weight tile as the dot's first operand (transposed products, one transpose per output tile), and "fp8 (weights
as B)", as its second; the FP8 outputs are compared with the bf16 kernels on the dequantized weights (the same
numbers up to fp32 summation order) and with the bf16 path on the original weights (the quantization error).
The sweep then also runs on the FP8 weights, a few tiles (FP8_SWEEP) in each form.
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
from ling_jax import LingConfig  # noqa: E402
from ling_jax.expert_ffn import dense_expert_ffn, local_moe, sort_by_expert, unfused_local_moe  # noqa: E402
from ling_jax.moe import MoE  # noqa: E402
from pallas_kernels.moe.fused_gpu import (  # noqa: E402
    dequantize_fp8_blocks,
    down_scatter_gpu,
    gather_swiglu_gpu,
    quantize_fp8_blocks,
)
from pallas_kernels.moe.gmm_gpu import FEW_ROWS_PER_GROUP  # noqa: E402
from pallas_kernels.moe.ops import down_scatter, gather_swiglu, grouped_matmul  # noqa: E402
from pallas_kernels.moe.reference import swiglu  # noqa: E402

BASELINE_CHUNK = 512  # tokens per dense-baseline chunk: [chunk, E, D] bf16 intermediates stay ~2 GB
ISSUE_PEAK = 683e12  # the H200 bf16 peak issue 6 states its goal against
# (block_m, block_n, block_k, num_warps, num_stages, min_block_m) of the sweep; the first of each list is the
# default. min_block_m: the smallest row tile a group's last, partial tile shrinks to (= block_m: no shrinking).
SWEEP = {
    "many rows": {  # block_k 128: room in shared memory with FP8 weight tiles (min_block_m swept 2026-11-29)
        "gather_swiglu": [(128, 128, 64, 8, 4, 32), (128, 128, 128, 8, 3, 32), (128, 128, 64, 8, 3, 32),
                          (64, 128, 128, 4, 3, 32)],
        "down_scatter": [(128, 256, 64, 8, 4, 32), (128, 256, 128, 8, 3, 32), (128, 128, 128, 8, 3, 32),
                         (128, 128, 64, 8, 4, 32)],
    },
    "few rows": {
        "gather_swiglu": [(16, 64, 128, 4, 4, 16), (16, 32, 128, 4, 4, 16), (32, 64, 128, 4, 4, 16)],
        "down_scatter": [(16, 64, 128, 4, 4, 16), (16, 32, 128, 4, 4, 16), (32, 64, 128, 4, 4, 16)],
    },
}
# The sweep on FP8 weights, run once per dot form: the default tile and the best FP8 ones of the first sweep.
FP8_SWEEP = {
    "many rows": {
        "gather_swiglu": [(128, 128, 64, 8, 4, 32), (128, 128, 128, 8, 3, 32)],
        "down_scatter": [(128, 256, 64, 8, 4, 32), (128, 128, 128, 8, 3, 32)],
    },
    "few rows": SWEEP["few rows"],
}
# fp8_weight_operand: the name of its rows ("a": the dequantized weight tile is the dot's first operand).
FP8_FORMS = {"a": "fp8 (weights as A)", "b": "fp8 (weights as B)"}


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


def unfused_gemms(rows_RD, sizes_E, gate, up, down, *, limit, backend):
    """The unfused path's kernels alone: three grouped matmuls and the SwiGLU on already repeated rows."""
    hidden_RI = swiglu(grouped_matmul(rows_RD, gate, sizes_E, backend=backend),
                       grouped_matmul(rows_RD, up, sizes_E, backend=backend), limit)
    return grouped_matmul(hidden_RI, down, sizes_E, backend=backend)


def fused_kernels(x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, *, limit, backend):
    """The fused path's kernels alone, on an already computed permutation."""
    h_RI = gather_swiglu(x_TD, source_R, sizes_E, gate, up, limit, backend=backend)
    return down_scatter(h_RI, order_R, row_weight_R, sizes_E, down, backend=backend)


def unfused_layer(graphdef, limit, backend):
    """The whole MoE layer (router, routed experts, shared expert) with the unfused routed path, jitted over
    its split state as the model runs (nnx.jit would also return, i.e. copy, the state)."""
    def run(state, x_TD):
        moe = nnx.merge(graphdef, state)
        weights_TK, experts_TK = moe.gate(x_TD, backend=backend)
        experts = (moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...])
        return (unfused_local_moe(x_TD, weights_TK, experts_TK, *experts, limit, backend=backend)
                + moe.shared_experts(x_TD))

    return jax.jit(run)


def model_layer(graphdef, backend):
    """The MoE module itself, as the model calls it (its fused path on a GPU)."""
    return jax.jit(lambda state, x_TD: nnx.merge(graphdef, state)(x_TD, kernel_backend=backend))


def profile_calls(fn, args, directory: str, *, calls: int) -> None:
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)


def sweep_tiles(kernel_args, variants, *, flops_per_kernel, interpret, limit, iters, scales=(None, None, None),
                fp8_weight_operand="a"):
    """Rows (kernel, tiles, ms, TFLOP/s) for each fused kernel alone over its tile variants; scales: the block
    scales of gate, up and down when kernel_args holds FP8 codes (the rows' kernel names then end in the
    FP8_FORMS name of fp8_weight_operand)."""
    x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down = kernel_args
    gate_scale, up_scale, down_scale = scales
    gather = functools.partial(gather_swiglu_gpu, limit=limit, gate_scale=gate_scale, up_scale=up_scale,
                               fp8_weight_operand=fp8_weight_operand, interpret=interpret)
    scatter = functools.partial(down_scatter_gpu, down_scale=down_scale, fp8_weight_operand=fp8_weight_operand,
                                interpret=interpret)
    h_RI = gather(x_TD, source_R, sizes_E, gate, up)
    calls = {
        "gather_swiglu": lambda tiles: (functools.partial(gather, **tiles), (x_TD, source_R, sizes_E, gate, up)),
        "down_scatter": lambda tiles: (functools.partial(scatter, **tiles), (h_RI, order_R, row_weight_R, sizes_E,
                                                                             down)),
    }
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "min_block_m")
    rows = []
    for kernel, tile_list in variants.items():
        for tiles in tile_list:
            fn, args = calls[kernel](dict(zip(names, tiles)))
            name = kernel if gate_scale is None else f"{kernel} {FP8_FORMS[fp8_weight_operand]}"
            try:
                seconds = median_seconds(fn, *args, iters=iters)
            except Exception as error:  # noqa: BLE001 - a tile that does not fit (shared memory) is reported, not fatal
                print(f"  {name} {tiles}: failed: {str(error).splitlines()[0][:200]}")
                continue
            rows.append((name, tiles, seconds, flops_per_kernel[kernel] / seconds / 1e12))
    return rows


@jax.jit
def device_rel_error(ours, ref):
    """||ours - ref|| / ||ref|| in fp32 on the device (full-size outputs need not come to the host)."""
    diff = ours.astype(jnp.float32) - ref.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(diff * diff) / jnp.sum(ref.astype(jnp.float32) ** 2))


def fp8_experts(gate, up, down):
    """((codes, scale) of gate, up and down quantized to block FP8, and the weights they dequantize to, bf16)."""
    quantized = [jax.jit(quantize_fp8_blocks)(weight) for weight in (gate, up, down)]
    dequantize = jax.jit(functools.partial(dequantize_fp8_blocks, dtype=jnp.bfloat16))
    return quantized, [dequantize(codes, scale) for codes, scale in quantized]


def fused_kernel_calls(kernel_args, scales, *, limit, interpret, fp8_weight_operand="a"):
    """(gather(gate, up) -> h, scatter(h, down) -> y, both(gate, up, down) -> y): the two fused kernels on
    kernel_args' rows, and the two chained; scales: None for bf16 weights, else the block scales of FP8 gate, up
    and down (their tiles then the dot operand fp8_weight_operand)."""
    x_TD, source_R, order_R, row_weight_R, sizes_E = kernel_args[:5]
    gate_scale, up_scale, down_scale = (None, None, None) if scales is None else scales

    def gather(gate, up):
        return gather_swiglu_gpu(x_TD, source_R, sizes_E, gate, up, limit=limit, gate_scale=gate_scale,
                                 up_scale=up_scale, fp8_weight_operand=fp8_weight_operand, interpret=interpret)

    def scatter(h_RI, down):
        return down_scatter_gpu(h_RI, order_R, row_weight_R, sizes_E, down, down_scale=down_scale,
                                fp8_weight_operand=fp8_weight_operand, interpret=interpret)

    def both(gate, up, down):
        return scatter(gather(gate, up), down)

    return gather, scatter, both


def timed_kernel_calls(calls, weights, h_RI, *, flops, iters):
    """{kernel: (seconds, TFLOP/s)} of `fused_kernel_calls`' gather, scatter (on h) and both chained, on weights
    (gate, up, down), the chained pair counting flops."""
    gather, scatter, both = calls
    timed = {"gather_swiglu": (2 * flops / 3, gather, weights[:2]),
             "down_scatter": (flops / 3, scatter, (h_RI, weights[2])),
             "both kernels": (flops, both, weights)}
    results = {}
    for name, (call_flops, fn, args) in timed.items():
        seconds = median_seconds(fn, *args, iters=iters)
        results[name] = (seconds, call_flops / seconds / 1e12)
    return results


def fp8_comparison(kernel_args, quantized, dequantized, *, flops, interpret, limit, iters):
    """The fused kernels on bf16 weights and on block-FP8 ones in each FP8_FORMS form, each alone and chained:
    {"bf16" or form name: {kernel: (seconds, TFLOP/s)}} on the bf16 path's FLOP count, and {form name: {output:
    (rel. difference of FP8 vs the bf16 kernels on the dequantized weights, vs the bf16 kernels on the original
    weights)}} for h, y alone (on the same h) and y chained."""
    gate, up, down = kernel_args[5:]
    codes = tuple(codes for codes, _ in quantized)
    scales = tuple(scale for _, scale in quantized)
    bf16_gather, bf16_scatter, bf16_both = bf16_calls = fused_kernel_calls(kernel_args, None, limit=limit,
                                                                            interpret=interpret)
    fp8_calls = {name: fused_kernel_calls(kernel_args, scales, limit=limit, interpret=interpret,
                                          fp8_weight_operand=form) for form, name in FP8_FORMS.items()}
    h_RI = bf16_gather(gate, up)
    timed = functools.partial(timed_kernel_calls, h_RI=h_RI, flops=flops, iters=iters)
    times = {"bf16": timed(bf16_calls, (gate, up, down)), **{name: timed(calls, codes)
                                                             for name, calls in fp8_calls.items()}}
    references = {  # (bf16 on the dequantized weights, bf16 on the original weights)
        "h": (bf16_gather(*dequantized[:2]), h_RI),
        "y": (bf16_scatter(h_RI, dequantized[2]), bf16_scatter(h_RI, down)),
        "y chained": (bf16_both(*dequantized), bf16_both(gate, up, down)),
    }
    differences = {}
    for name, (gather, scatter, both) in fp8_calls.items():
        outputs = {"h": gather(*codes[:2]), "y": scatter(h_RI, codes[2]), "y chained": both(*codes)}
        differences[name] = {output: tuple(float(device_rel_error(fp8, reference)) for reference in references[output])
                             for output, fp8 in outputs.items()}
    return times, differences


def print_fp8_comparison(tokens, times, differences, peak, weight_bytes):
    """weight_bytes: {"bf16": ..., "fp8": ...} bytes of expert weights (and scales) each kernel pair reads."""
    print(f"\ntokens {tokens}: fused kernels on bf16 vs block-FP8 expert weights ({weight_bytes['bf16'] / 1e9:.3g} vs "
          f"{weight_bytes['fp8'] / 1e9:.3g} GB of weights and scales, every expert)")
    for kind, kernel_times in times.items():
        kind_bytes = weight_bytes["bf16" if kind == "bf16" else "fp8"]
        for name, (seconds, tflops) in kernel_times.items():
            stream = f"  {kind_bytes / seconds / 1e9:7.0f} GB/s of weights" if name == "both kernels" else ""
            print(f"  {kind:18s} {name:14s} {seconds * 1e3:9.3f} ms  {tflops:7.1f} TFLOP/s  "
                  f"{tflops * 1e12 / peak:6.1%} of peak{stream}")
    for kind, kind_differences in differences.items():
        for name, (vs_dequantized, vs_original) in kind_differences.items():
            print(f"  {kind} {name}: rel. difference vs bf16 kernels on the dequantized weights {vs_dequantized:.2e}, "
                  f"vs bf16 on the original weights {vs_original:.2e}")


def print_table(rows, peak):
    print(f"\n| tokens | path | ms | useful TFLOP/s | % of measured peak ({peak / 1e12:.3g}) | "
          f"% of {ISSUE_PEAK / 1e12:.0f} |")
    print("|---|---|---|---|---|---|")
    for tokens, name, seconds, tflops in rows:
        print(f"| {tokens} | {name} | {seconds * 1e3:.3f} | {tflops:.1f} | {tflops * 1e12 / peak:.1%} | "
              f"{tflops * 1e12 / ISSUE_PEAK:.1%} |")


def print_sweep(tokens, rows):
    print("\n| tokens | kernel | block_m, block_n, block_k, num_warps, num_stages, min_block_m | ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for kernel, tiles, seconds, tflops in rows:
        print(f"| {tokens} | {kernel} | {', '.join(map(str, tiles))} | {seconds * 1e3:.3f} | {tflops:.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep of the fused kernels")
    parser.add_argument("--profile", metavar="DIR", help="write a Perfetto trace of 3 calls of the fused whole layer "
                        "per token count under DIR/tokens<N> (read it with scripts/trace_summary.py --steps 3)")
    parser.add_argument("--fp8-experts", action="store_true",
                        help="also time the fused kernels on the expert weights quantized to block FP8")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="token counts to time (default 8192 64; --quick 256 16)")
    parser.add_argument("--backend", default=None,
                        help="kernel backend: pallas_gpu (default on a GPU), interpret_gpu (default with --quick "
                             "elsewhere), reference (jnp ragged dots, no kernels)")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    backend = args.backend or ("pallas_gpu" if on_gpu else "interpret_gpu" if args.quick else None)
    if backend is None or (backend == "pallas_gpu" and not on_gpu):
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}); try --quick")
    config = LingConfig.preset("ling-3.1-flash")
    token_counts = (8192, 64)
    if args.quick:
        config = config.replace(hidden_size=256, moe_intermediate_size=128, num_experts=16, n_group=4,
                                topk_group=2, shared_expert_intermediate_size=128)
        token_counts = (256, 16)  # 16 x top-8 rows: above local_moe's row-path limit
    token_counts = args.tokens or token_counts
    hidden, width, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; backend {backend}; hidden {hidden}, "
          f"{config.num_experts} experts, top-{top_k}, width {width}, shared width "
          f"{config.shared_expert_intermediate_size}, bf16")
    peak = matmul_peak(args.iters, n=1024 if args.quick else 8192)
    print(f"bf16 matmul peak (XLA, best of three medians): {peak / 1e12:.1f} TFLOP/s")
    moe = MoE(config, clip_layer=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    gate, up, down = moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...]
    limit = moe.experts.limit
    graphdef, state = nnx.split(moe)
    if args.fp8_experts:
        quantized, dequantized = fp8_experts(gate, up, down)
        weight_bytes = {"bf16": sum(w.nbytes for w in (gate, up, down)),
                        "fp8": sum(codes.nbytes + scale.nbytes for codes, scale in quantized)}
    rows = []
    for tokens in token_counts:
        x_TD = jax.random.normal(jax.random.key(tokens), (tokens, hidden), jnp.bfloat16)
        weights_TK, experts_TK = jax.jit(functools.partial(moe.gate, backend=backend))(x_TD)
        flops = 2 * tokens * top_k * 3 * hidden * width
        # weights are arguments, never closed over: 13 GB of captured constants would stall the compiler
        unfused = jax.jit(functools.partial(unfused_local_moe, limit=limit, backend=backend))
        fused = jax.jit(functools.partial(local_moe, limit=limit, backend=backend))
        baseline = jax.jit(lambda *a: dense_in_chunks(*a, limit))
        routing = (x_TD, weights_TK, experts_TK, gate, up, down)
        dense = baseline(*routing)
        errors = {"unfused": rel_error(unfused(*routing), dense), "fused": rel_error(fused(*routing), dense)}
        order_R, sizes_E = jax.jit(sort_by_expert, static_argnums=1)(experts_TK.reshape(-1), config.num_experts)
        kernel_args = (x_TD, order_R // top_k, order_R, weights_TK.reshape(-1)[order_R], sizes_E, gate, up, down)
        rows_RD = jnp.repeat(x_TD, top_k, axis=0)
        fused_layer = model_layer(graphdef, backend)
        times = {
            "unfused: GEMMs only": median_seconds(
                jax.jit(functools.partial(unfused_gemms, limit=limit, backend=backend)), rows_RD, sizes_E, gate, up,
                down, iters=args.iters),
            "fused: kernels only": median_seconds(
                jax.jit(functools.partial(fused_kernels, limit=limit, backend=backend)), *kernel_args,
                iters=args.iters),
            "unfused: routed experts": median_seconds(unfused, *routing, iters=args.iters),
            "fused: routed experts": median_seconds(fused, *routing, iters=args.iters),
            "unfused: whole MoE layer": median_seconds(unfused_layer(graphdef, limit, backend), state, x_TD,
                                                       iters=args.iters),
            "fused: whole MoE layer": median_seconds(fused_layer, state, x_TD, iters=args.iters),
            "dense one-hot baseline": median_seconds(baseline, *routing, iters=max(3, args.iters // 5)),
        }
        if args.profile:
            profile_calls(fused_layer, (state, x_TD), os.path.join(args.profile, f"tokens{tokens}"), calls=3)
        layer_flops = flops + 2 * tokens * hidden * (config.num_experts + 3 * config.shared_expert_intermediate_size)
        print(f"\ntokens {tokens}: whole fused layer counting all its matmuls (routed top-{top_k}, shared expert, "
              f"router: {layer_flops / 1e12:.3f} TFLOP): {layer_flops / times['fused: whole MoE layer'] / 1e12:.1f} "
              f"TFLOP/s, {layer_flops / times['fused: whole MoE layer'] / peak:.1%} of peak")
        print(f"\ntokens {tokens}: rel. error vs dense: unfused {errors['unfused']:.2e}, fused {errors['fused']:.2e}")
        for name, seconds in times.items():
            tflops = flops / seconds / 1e12
            print(f"  {name:28s} {seconds * 1e3:9.3f} ms  {tflops:7.1f} TFLOP/s  {tflops * 1e12 / peak:6.1%} of peak")
            rows.append((tokens, name, seconds, tflops))
        if not args.no_sweep and backend != "reference":
            rows_kind = "few rows" if tokens * top_k <= FEW_ROWS_PER_GROUP * config.num_experts else "many rows"
            sweep_over = functools.partial(sweep_tiles, flops_per_kernel={"gather_swiglu": 2 * flops / 3,
                                                                          "down_scatter": flops / 3},
                                           interpret=backend.startswith("interpret"), limit=limit, iters=args.iters)
            sweep = sweep_over(kernel_args, SWEEP[rows_kind])
            if args.fp8_experts:
                for form in FP8_FORMS:
                    sweep += sweep_over((*kernel_args[:5], *(codes for codes, _ in quantized)), FP8_SWEEP[rows_kind],
                                        scales=tuple(scale for _, scale in quantized), fp8_weight_operand=form)
            print_sweep(tokens, sweep)
        if args.fp8_experts and backend != "reference":
            fp8_times, differences = fp8_comparison(kernel_args, quantized, dequantized, flops=flops,
                                                    interpret=backend.startswith("interpret"), limit=limit,
                                                    iters=args.iters)
            print_fp8_comparison(tokens, fp8_times, differences, peak, weight_bytes)
            rows += [(tokens, f"{name}, {kind}", seconds, tflops)
                     for kind, kernel_times in fp8_times.items() for name, (seconds, tflops) in kernel_times.items()]
    print_table(rows, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
