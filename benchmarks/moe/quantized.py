"""Routed experts at Ling-3.1-flash width (hidden 4096, expert width 1280, 512 experts, top-8) with the experts
stored bf16, block FP8 (128 x 128 blocks, fp32 scales) or MXFP4 (E8M0 scales per 32 inputs) on one GPU.

    python -m benchmarks.moe --format fp8 mxfp4          # prefill at 8192 tokens, decode rows at 1, 8, 64 tokens
    python -m benchmarks.moe --format fp8 --path rows    # FP8 beside bf16, the decode rows (b) and their sweep only
    python -m benchmarks.moe --format fp8 mxfp4 --quick  # small sizes; on a CPU the kernels run in interpret mode

(a) Prefill at 8192 tokens, routed by a random router with a realistic imbalance (each expert's popularity drawn
once, top-8 of noise + popularity; the busiest expert's load is printed): `ling_jax.moe.experts.local_moe` (the
fused gather + gate/up + SwiGLU and down + scatter kernels) with bf16 experts, and with FP8 and MXFP4 experts on
the default path (the weight-only fused kernels `ops.WEIGHT_ONLY`: tiles loaded as stored, dequantised on chip),
each checked against the same experts dequantised to bf16 inside the step, then the bf16 kernels (timed too: the
default until 2026-12-02; bf16 = the FP8 weights dequantised, so FP8 is also checked against bf16). On an H200 the
FP8 weight-only kernels gave a rel. difference of 5.6 before the FP8 values went to them as uint16 pairs (int32
offsets: `gpu_triton.weight_only`), 0 after.

(b) Decode rows, `pallas_kernels.moe.routed_experts` (the row-by-row kernels, which `local_moe` runs up to 64
token-expert rows) at 1, 8 and 64 tokens x top-8: bf16 vs FP8 vs MXFP4 experts by default (FP8: the weight-only
row kernels; MXFP4: the picked experts dequantised, then the bf16 kernels) and through the weight-only row kernels
by name (rel. difference to the default printed), each beside its byte roofline: the bytes of the distinct experts
the step touches (values and scales) over the copy bandwidth measured in the same run
(`benchmarks.common.copy_bandwidth`); `local_moe` (what the model runs: the fused path above 64 rows); and, for FP8 up
to 8 tokens, `pallas_kernels.experimental.moe_xla_folded` (XLA's gather + reduction, no Pallas).
Each time is per call of a chain of dependent calls in one program (`benchmarks.common.per_call_seconds`).

Then sweeps of the weight-only kernels' launch settings: the fused kernels alone (rows
already sorted) at the prefill size and at 64 tokens over (block_m, block_n, block_k, num_warps, num_stages,
weight_left: the weight tile as the MMA's first operand), beside the bf16 kernels at their tuned tiles; the row
kernels with the shared expert at 1 and 8 tokens over (block_n, block_k, num_warps, num_stages), the first row of each
the tuned default for that many tokens. The defaults for quantised experts are `pallas_kernels.moe.tuned`'s
*_QUANTIZED tables.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, median_seconds, per_call_seconds, rel_error
from benchmarks.moe import calls
from benchmarks.moe.shared import LIMIT, nudge_x, selection_parser
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight

FP8_BLOCK = (128, 128)
FULL = {"hidden": 4096, "width": 1280, "experts": 512, "top_k": 8, "prefill": 8192, "decode": (1, 8, 64)}
QUICK = {"hidden": 256, "width": 192, "experts": 16, "top_k": 4, "prefill": 128, "decode": (1, 2)}
# (block_m, block_n, block_k, num_warps, num_stages, weight_left) of the weight-only fused kernels; the first of
# each list: the quantised experts' default (`tuned.GATHER_SWIGLU_QUANTIZED`), the second the bf16 kernels' tiles
FUSED_SWEEP = {
    "many rows": [
        (64, 128, 64, 4, 4, False),
        (128, 128, 64, 8, 4, False),
        (128, 128, 128, 8, 3, True),
        (64, 128, 64, 4, 4, True),
        (64, 128, 128, 4, 3, False),
        (64, 64, 64, 4, 4, False),
    ],
    "few rows": [
        (16, 64, 256, 4, 3, True),
        (32, 64, 128, 4, 4, False),
        (16, 64, 256, 4, 3, False),
        (16, 64, 512, 4, 3, True),
        (16, 128, 256, 4, 3, True),
        (16, 64, 256, 8, 3, True),
    ],
}
# (block_n, block_k, num_warps, num_stages[, in_flight]) of the weight-only row kernels, swept at ROW_SWEEP_TOKENS
# tokens, each list against the other kernel at its tuned default for that many tokens (`tuned.ROUTED_SWIGLU_QUANTIZED`,
# `tuned.ROUTED_DOWN_QUANTIZED`: buckets by `tuned.tokens_bucket`; in_flight not given: the table's)
ROW_SWEEP = {
    "swiglu_tiles": [
        (16, 512, 4, 3, 0),
        (16, 512, 4, 3, 1),
        (8, 512, 4, 3),
        (16, 512, 4, 3),
        (8, 256, 4, 4),
        (4, 512, 4, 3),
        (8, 1024, 4, 3),
        (16, 256, 4, 4),
    ],
    "down_tiles": [
        (8, 256, 4, 3, 1),
        (32, 256, 8, 3, 0),
        (8, 512, 4, 3, 1),
        (16, 256, 4, 3, 3),
        (8, 512, 4, 3),
        (32, 256, 8, 3),
        (16, 256, 4, 3),
        (8, 256, 2, 4),
        (16, 512, 4, 3),
        (4, 256, 2, 4),
        (8, 1024, 4, 3),
        (16, 128, 4, 4),
    ],
}
ROW_SWEEP_TOKENS = (1, 8)


def fp8_experts(key, shape) -> BlockFP8Weight:
    """Random block-FP8 experts [E, N, K] of entries ~ 1 / sqrt(K): e4m3 values with a scale a 128 x 128 block."""
    experts, rows, cols = shape
    values = jnp.concatenate(  # expert by expert: no [E, N, K] fp32 temporary
        [
            (jax.random.normal(k, (1, rows, cols), jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)
            for k in jax.random.split(key, experts)
        ]
    )
    grid = (experts, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
    scales = jax.random.uniform(jax.random.fold_in(key, 1), grid, jnp.float32, 0.5, 1.5) / (64 * cols**0.5)
    return BlockFP8Weight(values, scales, FP8_BLOCK)


def mxfp4_experts(seed: int, shape) -> MXFP4Weight:
    """Random MXFP4 experts [E, N, K]: random E2M1 codes, E8M0 scales 2^-8 .. 2^-5 (entries ~ 1 / sqrt(K) at K
    4096; the same exponents at small K)."""
    import ml_dtypes

    experts, rows, cols = shape
    r = np.random.default_rng(seed)
    codes = jax.random.bits(jax.random.key(seed), (experts, rows, cols // 2), jnp.uint8)
    exponents = r.integers(-8, -4, (experts, rows, -(-cols // 32)))
    return MXFP4Weight(codes, jnp.asarray(np.ldexp(1.0, exponents).astype(ml_dtypes.float8_e8m0fnu)))


def nbytes(weight) -> int:
    return weight.nbytes if hasattr(weight, "dequantize") else weight.size * weight.dtype.itemsize


def routing(tokens: int, num_experts: int, top_k: int, seed: int):
    """(weights [T, k] fp32, experts [T, k] int32): top-k of noise + a popularity per expert (std 0.7 against
    unit noise: the busiest expert gets ~2-3x the mean load, as trained routers show)."""
    key_noise, key_pop, key_w = jax.random.split(jax.random.key(seed), 3)
    popularity = 0.7 * jax.random.normal(key_pop, (num_experts,))
    scores = jax.random.normal(key_noise, (tokens, num_experts)) + popularity
    _, experts = jax.lax.top_k(scores, top_k)
    weights = jax.random.uniform(key_w, (tokens, top_k), jnp.float32, 0.1, 1.0)
    return weights, experts.astype(jnp.int32)


def dequantised_moe(x_TD, weights_TK, experts_TK, gate, up, down, *, backend: str):
    """`local_moe`'s fused path with the experts dequantised to bf16 inside the step, then the bf16 kernels (the
    default before the weight-only kernels): rows sorted by expert, gather + gate/up + SwiGLU, down + scatter, the
    sum over the top-k in fp32."""
    kernels = functools.partial(calls.fused_kernels, limit=LIMIT, backend=backend, variant="gpu_triton")
    return calls.routed_by_expert(kernels, x_TD, weights_TK, experts_TK, gate, up, down, num_experts=gate.shape[0])


def prefill_table(sizes, stacks, backend: str, iters: int) -> None:
    tokens, hidden, width, top_k = sizes["prefill"], sizes["hidden"], sizes["width"], sizes["top_k"]
    x = jax.random.normal(jax.random.key(5), (tokens, hidden), jnp.bfloat16)
    weights, experts = routing(tokens, sizes["experts"], top_k, seed=6)
    load = np.bincount(np.asarray(experts).ravel(), minlength=sizes["experts"])
    print(
        f"\n(a) prefill, {tokens} tokens x top-{top_k}; busiest expert {load.max()} rows (mean "
        f"{load.mean():.0f}), {np.sum(load == 0)} experts empty; ms per call"
    )
    fused = calls.fused_routed(LIMIT, backend)
    dequantised = jax.jit(functools.partial(dequantised_moe, backend=backend))
    # name: (function, experts, the path it is compared with)
    paths = {
        "bf16 experts, fused kernels": (fused, "bf16", "bf16"),
        "FP8 experts, default: weight-only fused kernels": (fused, "fp8", "fp8"),
        "FP8 experts, dequantised in the step, then bf16 kernels": (dequantised, "fp8", "bf16"),
        "MXFP4 experts, default: weight-only fused kernels": (fused, "mxfp4", "mxfp4"),
        "MXFP4 experts, dequantised in the step, then bf16 kernels": (dequantised, "mxfp4", "mxfp4"),
    }
    paths = {name: path for name, path in paths.items() if path[1] in stacks}
    flops = 2 * tokens * top_k * 3 * hidden * width
    references = {"bf16": fused(x, weights, experts, *stacks["bf16"])}
    references |= {fmt: dequantised(x, weights, experts, *stacks[fmt]) for fmt in ("fp8", "mxfp4") if fmt in stacks}
    print("| path | ms | useful TFLOP/s | vs bf16 | rel. diff (vs) |")
    print("|---|---|---|---|---|")
    bf16_seconds = None
    for name, (fn, fmt, compared) in paths.items():
        seconds = median_seconds(fn, x, weights, experts, *stacks[fmt], iters=iters)
        bf16_seconds = bf16_seconds or seconds
        diff = rel_error(fn(x, weights, experts, *stacks[fmt]), references[compared])
        print(
            f"| {name} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} | {bf16_seconds / seconds:.2f}x | "
            f"{diff:.1e} ({compared}, dequantised) |",
            flush=True,
        )


def touched_bytes(experts_TK, stacks) -> int:
    """Bytes of the distinct experts a call reads (values and scales of gate, up and down)."""
    distinct = len(np.unique(np.asarray(experts_TK)))
    return distinct * sum(nbytes(w) for w in stacks) // stacks[0].shape[0]


def decode_table(sizes, stacks, backend: str, iters: int, copy_bw: float, chain: int) -> None:
    print(
        f"\n(b) decode rows, top-{sizes['top_k']}; us per call (x the byte roofline: touched experts' bytes / "
        f"{copy_bw / 1e12:.2f} TB/s copy bandwidth); weight-only: the opt-in row kernels"
    )
    print(
        "| tokens | experts | touched MB | row kernels us | x roofline | weight-only us | x roofline | rel. diff "
        "| local_moe us | x roofline | XLA folded us | x roofline | rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = calls.routed_rows(LIMIT, backend)
    weight_only = calls.routed_rows(LIMIT, backend, calls.WEIGHT_ONLY)
    model = calls.fused_routed(LIMIT, backend)
    folded = calls.folded_rows(LIMIT)
    for tokens in sizes["decode"]:
        x = jax.random.normal(jax.random.key(tokens), (tokens, sizes["hidden"]), jnp.bfloat16)
        weights, experts = routing(tokens, sizes["experts"], sizes["top_k"], seed=tokens)
        for fmt, weight_stacks in stacks.items():
            args = (x, weights, experts, *weight_stacks)
            roofline = touched_bytes(experts, weight_stacks) / copy_bw
            cells = []
            for fn in (rows, weight_only, model, folded):
                if (fn is weight_only and fmt == "bf16") or (
                    fn is folded and (fmt != "fp8" or tokens > 8 or not calls.folded_takes(weight_stacks))
                ):
                    cells += ["-", "-", "-"]
                    continue
                seconds = per_call_seconds(fn, nudge_x, *args, iters=iters, calls=chain)
                cells += [f"{seconds * 1e6:.1f}", f"{seconds / roofline:.2f}"]
                if fn in (weight_only, folded):
                    cells.append(f"{rel_error(fn(*args), rows(*args)):.1e}")
            print(f"| {tokens} | {fmt} | {roofline * copy_bw / 1e6:.1f} | {' | '.join(cells)} |", flush=True)


def sweep_fused(sizes, stacks, iters: int, interpret: bool, count: int | None) -> None:
    print(
        "\nthe fused kernels alone (gather_swiglu + down_scatter, rows sorted), ms per call; tiles (block_m, block_n, "
    )
    print("block_k, num_warps, num_stages, weight_left)")
    print("| tokens | experts | tiles | ms | useful TFLOP/s |")
    print("|---|---|---|---|---|")
    hidden, width, top_k = sizes["hidden"], sizes["width"], sizes["top_k"]
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "weight_left")
    for tokens, bucket in ((sizes["prefill"], "many rows"), (max(sizes["decode"]), "few rows")):
        x = jax.random.normal(jax.random.key(7), (tokens, hidden), jnp.bfloat16)
        weights, experts = routing(tokens, sizes["experts"], top_k, seed=8)
        rows = calls.sorted_rows(x, weights, experts, sizes["experts"])
        flops = 2 * tokens * top_k * 3 * hidden * width
        settings = [("bf16", None)] + [
            (fmt, tiles) for fmt in ("fp8", "mxfp4") if fmt in stacks for tiles in FUSED_SWEEP[bucket][:count]
        ]
        for fmt, tiles in settings:
            gate_up_entry, down_entry = calls.fused_kernel_entries("gpu_triton" if tiles is None else calls.WEIGHT_ONLY)
            given = {} if tiles is None else dict(zip(names, tiles))
            gate_up = functools.partial(gate_up_entry, limit=LIMIT, interpret=interpret, **given)
            down = functools.partial(down_entry, interpret=interpret, **given)

            def fused(x, source, dest, row_weight, group_sizes, gate, up, down_weight, gate_up=gate_up, down=down):
                return down(gate_up(x, source, group_sizes, gate, up), dest, row_weight, group_sizes, down_weight)

            try:
                seconds = median_seconds(jax.jit(fused), *rows, *stacks[fmt], iters=iters)
            except Exception as error:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                print(f"| {tokens} | {fmt} | {tiles} | failed: {str(error).splitlines()[0][:120]} | |")
                continue
            label = "tuned (bf16)" if tiles is None else ", ".join(map(str, tiles))
            print(f"| {tokens} | {fmt} | {label} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} |", flush=True)


def first_expert(stack):
    """Expert 0 of a quantised stack as a one-expert weight (the sweep's shared expert)."""
    return dataclasses.replace(stack, values=stack.values[0], scales=stack.scales[0])


def sweep_rows(sizes, stacks, iters: int, chain: int, interpret: bool, count: int | None) -> None:
    print(
        f"\nweight-only row kernels with the shared expert, tile sweep at {ROW_SWEEP_TOKENS} tokens (block_n, block_k, "
        "num_warps, num_stages), each kernel's list against the other at its tuned default; us per call"
    )
    print("| tokens | experts | swiglu tiles | down tiles | us |")
    print("|---|---|---|---|---|")
    for tokens in ROW_SWEEP_TOKENS:
        x = jax.random.normal(jax.random.key(1), (tokens, sizes["hidden"]), jnp.bfloat16)
        weights, experts = routing(tokens, sizes["experts"], sizes["top_k"], seed=1)
        default = calls.row_kernel_tiles(x.dtype, calls.tuned.tokens_bucket(tokens), quantized=True)
        for fmt in ("fp8", "mxfp4"):
            if fmt not in stacks:
                continue
            shared = tuple(first_expert(w) for w in stacks[fmt])
            settings = [default] + [
                {**default, name: tiles}
                for name, tile_list in ROW_SWEEP.items()
                for tiles in tile_list[:count]
                if tiles != default[name]
            ]
            for setting in settings:
                fn = calls.row_kernels(LIMIT, calls.WEIGHT_ONLY, interpret=interpret, **setting)
                operands = (x, weights, experts, *stacks[fmt], shared)
                cells = f"| {tokens} | {fmt} | {setting['swiglu_tiles']} | {setting['down_tiles']} |"
                try:
                    seconds = per_call_seconds(fn, nudge_x, *operands, iters=iters, calls=chain)
                except Exception as error:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                    print(f"{cells} failed: {str(error)[:120]} |")
                    continue
                print(f"{cells} {seconds * 1e6:.1f} |", flush=True)


def main(argv=None) -> int:
    parser = selection_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run in interpret mode)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-sweep", action="store_true", help="skip the weight-only kernels' tile sweeps")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.quick:
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}); try --quick")
    sizes = QUICK if args.quick else FULL
    backend = "pallas_gpu" if on_gpu else "interpret_gpu"
    iters, chain = (1, 1) if args.quick and not on_gpu else (args.iters, 32)
    hidden, width, num_experts = sizes["hidden"], sizes["width"], sizes["experts"]
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; backend {backend}; hidden {hidden}, width {width}, "
        f"{num_experts} experts, top-{sizes['top_k']}; bf16 activations; FP8 blocks {FP8_BLOCK}"
    )
    gate_up_shape, down_shape = (num_experts, width, hidden), (num_experts, hidden, width)
    fp8 = [fp8_experts(jax.random.key(i), s) for i, s in enumerate((gate_up_shape, gate_up_shape, down_shape))]
    stacks = {"bf16": [jax.jit(lambda w: w.dequantize(jnp.bfloat16))(w) for w in fp8]}
    if "fp8" in args.format:
        stacks["fp8"] = fp8
    if "mxfp4" in args.format:
        stacks["mxfp4"] = [mxfp4_experts(10 + i, s) for i, s in enumerate((gate_up_shape, gate_up_shape, down_shape))]
    for fmt, weight_stacks in stacks.items():
        print(f"{fmt} experts: {sum(nbytes(w) for w in weight_stacks) / 1e9:.2f} GB")
    grouped, rows = args.path != "rows", args.path != "grouped"
    if grouped:
        prefill_table(sizes, stacks, backend, iters)
    if rows:
        copy_bw = copy_bandwidth(iters, nbytes=(1 << 20) if args.quick else (4 << 30))
        decode_table(sizes, stacks, backend, iters, copy_bw, chain)
    if not args.no_sweep:
        count = 2 if args.quick else None  # --quick: the first two settings of each sweep
        if grouped:
            sweep_fused(sizes, stacks, iters, interpret=not on_gpu, count=count)
        if rows:
            sweep_rows(sizes, stacks, iters, chain, interpret=not on_gpu, count=count)
    return 0
