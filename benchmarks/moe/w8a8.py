"""One MoE layer's routed experts at Ling-3.1-flash width in W8A8 against the bf16 fused path, beside the GPU's
FP8 and bf16 matmul peaks measured in the same run.

    python -m benchmarks.moe --fp8-matmul w8a8           # 8192 tokens, hidden 4096, width 1280, 512 experts, top-8
    python -m benchmarks.moe --fp8-matmul w8a8 --sweep   # plus a tile sweep of the W8A8 kernels (Mosaic too)
    python -m benchmarks.moe --fp8-matmul w8a8 --sweep down_scatter_w8a8   # the sweep of one kernel only
    python -m benchmarks.moe --fp8-matmul w8a8 --quick   # small sizes; on a CPU the kernels run in interpret mode
    python -m benchmarks.moe --fp8-matmul w8a8 --balanced  # every expert exactly 128 rows (one row tile each)
    python -m benchmarks.moe --fp8-matmul w8a8 --width-of ling-3.0-flash   # another preset's experts (hidden 2560,
                                                                            # width 768, 512 experts, top-8)

Paths, each on the same routing (uniform random top-k, distinct experts per token) and the same weights (the bf16
experts, and their block-FP8 quantisation, 128 x 128 blocks):
- bf16 fused: `pallas_kernels.moe.ops.gather_swiglu` + `down_scatter` on bf16 weights (what the model runs today);
- W8A8: `gather_swiglu_w8a8_gpu` (x quantised per token in 1 x 128 groups, FP8 products, h quantised in the
  epilogue) + `down_scatter_w8a8_gpu` (`pallas_kernels.moe.gpu_triton.w8a8`) on the block-FP8 weights;
- Mosaic W8A8 (GPU only): `pallas_kernels.experimental.moe_gpu_mosaic.w8a8_expert_rows_mgpu`, the same arithmetic
  in Mosaic GPU kernels (TMA pipelines, FP8 wgmma) over rows padded to 64-row tiles per expert;
each as "kernels only" (on a computed sort, a lone call), "kernels, 8 chained" (8 calls in one program, each x
nudged by the last output, as a prefill chains its layers: a call's time without a lone call's dispatch) and
"routed experts" (sort by expert + kernels + the top-k sum).
Reports ms, TFLOP/s of the routed products (2 T k 3 D I), the kernels' byte floor over the time (operands read
once and the output rows written once, at the same-run copy bandwidth: at 8192 tokens each expert gets ~128 rows, so
the products are bound by reading the weights), % of the FP8 peak (the best FP8 row of
`bench_fp8_peak` at 8192^3: torch._scaled_mm where torch has CUDA, XLA's FP8 dot), the speed-up over bf16, and the
W8A8 layer's rel. error against the bf16 one (activation quantisation: a few %). Issue 25's goals: >= 1.6x the bf16
path, >= 55% of the FP8 peak.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from benchmarks import trace
from benchmarks.common import copy_bandwidth, median_seconds, per_call_seconds, rel_error
from benchmarks.fp8_peak import jax_rows, torch_rows
from benchmarks.moe import calls
from benchmarks.moe.shared import LIMIT, nudge_x, selection_parser
from ling_jax.presets import PRESETS
from pallas_kernels.fp8.reference import E4M3_MAX

BLOCK = (128, 128)
FULL = dict(tokens=8192, hidden=4096, width=1280, experts=512, top_k=8, peak_size=8192, copy_bytes=4 << 30)
QUICK = dict(tokens=64, hidden=256, width=256, experts=8, top_k=2, peak_size=256, copy_bytes=1 << 20)
# (block_m, num_warps, num_stages, min_block_m) of gate/up; (block_m, block_n, num_warps, num_stages, min_block_m,
# columns) of down; the first of each is the tuned default (pallas_kernels/moe/tuned.py).
SWEEP = {
    "gather_swiglu_w8a8": [
        (128, 8, 4, 64),
        (128, 8, 3, 64),
        (128, 8, 4, 32),
        (128, 8, 4, 128),
        (64, 8, 4, 64),
        (64, 4, 2, 64),
    ],
    "down_scatter_w8a8": [
        (64, 128, 4, 3, 64, 1),
        (64, 128, 4, 4, 64, 1),
        (64, 128, 4, 2, 64, 1),
        (64, 128, 4, 4, 64, 8),
        (64, 128, 4, 3, 64, 4),
        (128, 128, 8, 4, 64, 4),
        (64, 64, 4, 4, 64, 8),
    ],
}
# (gate_up_stages, down_block_n, down_stages, down_columns[, gate_up_tma_store, down_tma_store, down_step_blocks])
# of the Mosaic kernels; the first is the default
MOSAIC_SWEEP = [
    (4, 128, 5, 4),
    (3, 128, 5, 4),
    (4, 128, 5, 8),
    (4, 128, 5, 1),
    (4, 128, 2, 4),
    (4, 64, 6, 4),
    (4, 128, 5, 4, True, False),
    (4, 128, 5, 4, False, True),
    (4, 128, 3, 4, False, False, 2),
    (4, 256, 4, 2),
    (4, 256, 3, 2, True, True),
]
SWEEP_KEYWORDS = {
    "gather_swiglu_w8a8": ("block_m", "num_warps", "num_stages", "min_block_m"),
    "down_scatter_w8a8": ("block_m", "block_n", "num_warps", "num_stages", "min_block_m", "columns"),
}
MOSAIC = "mosaic"
PROFILED_CALLS = 3
CHAINED = 8  # calls in one program (each x nudged by the last output), as a prefill chains its layers


@jax.jit
def block_fp8(w_GNK):
    """(e4m3 values, fp32 scales) of w [G, N, K] in BLOCK blocks (N and K multiples of them): scale = amax / 448."""
    num_groups, n_dim, k_dim = w_GNK.shape
    blocks = w_GNK.astype(jnp.float32).reshape(num_groups, n_dim // BLOCK[0], BLOCK[0], k_dim // BLOCK[1], BLOCK[1])
    scales = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(2, 4)), 1e-12) / E4M3_MAX
    values = (blocks / scales[:, :, None, :, None]).astype(jnp.float8_e4m3fn)
    return values.reshape(w_GNK.shape), scales


def random_problem(tokens: int, hidden: int, width: int, experts: int, top_k: int, balanced: bool = False):
    """(x, routing weights [T, k], experts [T, k], gate, up, down bf16) drawn on the device; balanced: token t's
    j-th expert (t k + j) mod E, so every expert gets T k / E rows (distinct experts a token while k <= E)."""
    keys = jax.random.split(jax.random.key(0), 6)
    if balanced:
        experts_TK = (jnp.arange(tokens * top_k, dtype=jnp.int32) % experts).reshape(tokens, top_k)
    else:
        experts_TK = jax.lax.top_k(jax.random.uniform(keys[0], (tokens, experts)), top_k)[1].astype(jnp.int32)
    weights_TK = jax.random.uniform(keys[1], (tokens, top_k), jnp.float32, 0.1, 1.0)
    x_TD = jax.random.normal(keys[2], (tokens, hidden), jnp.bfloat16)
    gate, up = (jax.random.normal(k, (experts, width, hidden), jnp.bfloat16) * hidden**-0.5 for k in keys[3:5])
    down = jax.random.normal(keys[5], (experts, hidden, width), jnp.bfloat16) * width**-0.5
    return x_TD, weights_TK, experts_TK, gate, up, down


def nudge_rows(x_TD, y_RD):
    """x nudged by the kernels' first T output rows (they store rows [T k, D], not the top-k sum)."""
    return nudge_x(x_TD, y_RD[: x_TD.shape[0]])


def floor_bytes(kernels, *operands) -> int:
    """The fewest bytes the kernels move: every operand read once, their output written once (h, the hidden
    activations between the two kernels, not counted)."""
    out = jax.eval_shape(kernels, *operands)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves((operands, out)))


def peaks(size: int, iters: int) -> tuple[float, float, str]:
    """(bf16 TFLOP/s, FP8 TFLOP/s, which FP8 row) from bench_fp8_peak's rows at size^3; prints every row."""
    flops = 2 * size**3
    rows = {**jax_rows(size, iters), **torch_rows(size, iters)}
    print(f"\nmatmul peaks at M = N = K = {size}:")
    rates = {}
    for name, seconds in rows.items():
        if isinstance(seconds, str):
            print(f"  {name:24s} {seconds}")
            continue
        rates[name] = flops / seconds / 1e12
        print(f"  {name:24s} {seconds * 1e3:8.3f} ms  {rates[name]:7.1f} TFLOP/s")
    fp8_name = max((name for name in rates if "fp8" in name), key=rates.get)
    bf16 = max(rate for name, rate in rates.items() if "bf16" in name)
    return bf16, rates[fp8_name], fp8_name


def sweep(kernel_args, kernels, *, flops: float, interpret: bool, iters: int) -> None:
    """Time each setting of `kernels` (names of SWEEP and MOSAIC; empty: all) alone."""
    kernels = set(kernels) or {MOSAIC, *SWEEP}
    kernel_calls = calls.w8a8_kernel_calls(kernel_args, limit=LIMIT, block=BLOCK, interpret=interpret)
    kernel_flops = {"gather_swiglu_w8a8": 2 * flops / 3, "down_scatter_w8a8": flops / 3}
    mosaic = functools.partial(calls.mosaic_kernels, limit=LIMIT, block=BLOCK)
    print("\n| kernel | tiles | ms | TFLOP/s |")
    print("|---|---|---|---|")
    for tiles in () if interpret or MOSAIC not in kernels else MOSAIC_SWEEP:
        named = dict(zip(calls.MOSAIC_TILE_KEYWORDS, tiles))
        try:
            seconds = median_seconds(jax.jit(functools.partial(mosaic, **named)), *kernel_args, iters=iters)
        except Exception as error:  # noqa: BLE001 - a tile that does not fit (shared memory) is reported, not fatal
            print(f"| mosaic experts | {named} | failed: {str(error).splitlines()[0][:160]} | |")
            continue
        print(f"| mosaic experts | {named} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} |", flush=True)
    for kernel, settings in SWEEP.items():
        if kernel not in kernels:
            continue
        entry, args = kernel_calls[kernel]
        for tiles in settings:
            named = dict(zip(SWEEP_KEYWORDS[kernel], tiles, strict=True))
            try:
                seconds = median_seconds(jax.jit(functools.partial(entry, **named)), *args, iters=iters)
            except Exception as error:  # noqa: BLE001 - as above
                print(f"| {kernel} | {named} | failed: {str(error).splitlines()[0][:160]} | |")
                continue
            print(
                f"| {kernel} | {named} | {seconds * 1e3:.3f} | {kernel_flops[kernel] / seconds / 1e12:.1f} |",
                flush=True,
            )


def main(argv=None) -> int:
    parser = selection_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke test)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--sweep",
        nargs="*",
        choices=(MOSAIC, *SWEEP),
        metavar="KERNEL",
        help=f"also sweep the tiles of these kernels ({', '.join((MOSAIC, *SWEEP))}; none named: all)",
    )
    parser.add_argument(
        "--balanced",
        action="store_true",
        help="route every expert exactly tokens x k / experts rows (no expert's rows spill into a second tile) "
        "instead of uniform random top-k",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help=f"write a Perfetto trace of {PROFILED_CALLS} calls of each path into DIR/<path> "
        "(scripts/trace_summary.py) and print each path's kernel device time a call (a lone call's wall time also "
        "holds its dispatch)",
    )
    parser.add_argument(
        "--width-of",
        metavar="PRESET",
        choices=sorted(PRESETS),
        help="the experts of this preset (its hidden size, expert width, experts and top-k) instead of "
        "Ling-3.1-flash's; 8192 tokens",
    )
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.quick):
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}); try --quick")
    if args.quick and args.width_of:
        parser.error("--quick runs its own small sizes; --width-of names a preset's full ones")
    sizes = QUICK if args.quick else FULL
    if args.width_of:
        config = PRESETS[args.width_of]
        sizes = dict(
            FULL,
            hidden=config.hidden_size,
            width=config.moe_intermediate_size,
            experts=config.num_experts,
            top_k=config.num_experts_per_tok,
        )
    interpret = not on_gpu
    backend = "interpret_gpu" if interpret else "pallas_gpu"
    tokens, hidden, width, num_experts, top_k = (sizes[k] for k in ("tokens", "hidden", "width", "experts", "top_k"))
    print(
        f"# benchmarks.moe --fp8-matmul w8a8: jax {jax.__version__}, {jax.devices()[0].device_kind}, backend "
        f"{backend}; {tokens} tokens, hidden {hidden}, width {width}, {num_experts} experts, top-{top_k}, bf16 "
        f"activations, {BLOCK} blocks, {'balanced' if args.balanced else 'uniform random'} routing"
    )
    bf16_peak, fp8_peak, fp8_name = peaks(sizes["peak_size"], args.iters)
    x_TD, weights_TK, experts_TK, gate, up, down = random_problem(
        tokens, hidden, width, num_experts, top_k, args.balanced
    )
    fp8_weights = tuple(block_fp8(w) for w in (gate, up, down))
    paths = {
        "bf16 fused": (functools.partial(calls.fused_kernels, limit=LIMIT, backend=backend), (gate, up, down)),
        "W8A8": (functools.partial(calls.w8a8_kernels, limit=LIMIT, block=BLOCK, interpret=interpret), fp8_weights),
    }
    if on_gpu:
        paths["Mosaic W8A8"] = (functools.partial(calls.mosaic_kernels, limit=LIMIT, block=BLOCK), fp8_weights)
    sorted_args = calls.sorted_rows(x_TD, weights_TK, experts_TK, num_experts)
    copy = copy_bandwidth(args.iters, sizes["copy_bytes"])
    floors = {name: floor_bytes(kernels, *sorted_args, *weights) / copy for name, (kernels, weights) in paths.items()}
    print(
        f"\nbyte floor of the kernels (operands read once, the rows [T k, D] written once; h not counted) at the "
        f"same-run copy {copy / 1e12:.2f} TB/s: "
        + ", ".join(f"{name} {floor * copy / 1e9:.2f} GB = {floor * 1e3:.3f} ms" for name, floor in floors.items())
    )
    flops = 2 * tokens * top_k * 3 * hidden * width
    times, outputs = {}, {}
    for name, (kernels, weights) in paths.items():
        routed = jax.jit(functools.partial(calls.routed_by_expert, kernels, num_experts=num_experts))
        outputs[name] = routed(x_TD, weights_TK, experts_TK, *weights)
        times[f"{name}: kernels only"] = median_seconds(jax.jit(kernels), *sorted_args, *weights, iters=args.iters)
        times[f"{name}: kernels, {CHAINED} chained"] = per_call_seconds(
            kernels, nudge_rows, *sorted_args, *weights, iters=args.iters, calls=CHAINED
        )
        times[f"{name}: routed experts"] = median_seconds(
            routed, x_TD, weights_TK, experts_TK, *weights, iters=args.iters
        )
    device_seconds = {}
    for name, (kernels, weights) in paths.items() if args.profile else ():
        directory = pathlib.Path(args.profile) / name.replace(" ", "_")
        with jax.profiler.trace(str(directory), create_perfetto_trace=True):
            for _ in range(PROFILED_CALLS):
                jax.block_until_ready(jax.jit(kernels)(*sorted_args, *weights))
        device_seconds[name] = trace.device_seconds(directory, PROFILED_CALLS)
    for name in paths:
        if name != "bf16 fused":
            print(f"\n{name} routed experts vs bf16: rel. error {rel_error(outputs[name], outputs['bf16 fused']):.2e}")
    print(
        f"\n| path | ms | TFLOP/s | % of FP8 peak ({fp8_name}) | % of bf16 peak | byte floor / time | "
        "speed-up over bf16 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, seconds in times.items():
        tflops = flops / seconds / 1e12
        path, timing = name.split(":", 1)
        bf16_seconds = times["bf16 fused:" + timing]
        print(
            f"| {name} | {seconds * 1e3:.3f} | {tflops:.1f} | {tflops / fp8_peak:.1%} | {tflops / bf16_peak:.1%} | "
            f"{floors[path] / seconds:.1%} | {bf16_seconds / seconds:.2f}x |"
        )
    if device_seconds:
        print(
            f"\n| path: kernels only | device time a call, ms (profile of {PROFILED_CALLS}) | byte floor / time | "
            "speed-up over bf16 |"
        )
        print("|---|---|---|---|")
        for name, seconds in device_seconds.items():
            print(
                f"| {name} | {seconds * 1e3:.3f} | {floors[name] / seconds:.1%} | "
                f"{device_seconds['bf16 fused'] / seconds:.2f}x |"
            )
    if args.sweep is not None:
        sweep((*sorted_args, *fp8_weights), args.sweep, flops=flops, interpret=interpret, iters=args.iters)
    return 0
