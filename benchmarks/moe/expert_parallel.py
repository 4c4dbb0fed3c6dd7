"""Expert parallelism over N devices (mesh expert=N): one MoE layer split into its stages, and the sharded
decode step of the full-width Ling-3.1-flash slice.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m benchmarks.moe --devices 8
    python -m benchmarks.moe --devices 2 --capacity-factor 1.25
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.moe --devices 8 --quick   # CPU

MoE layer (hidden 4096, 512 experts, top-8, random bf16 weights and router) at 64 and 8192 tokens per device,
both ways of moving rows (`ExecutionPolicy.moe_exchange`), each stage jitted on the mesh as its own shard_map
over the previous stage's real outputs:
- dense: dispatch = pack each token-assignment into its destination's fixed block, then the all-to-all
  (`dispatch`); grouped GEMM = sort the received rows by expert, the expert FFN, unsort
  (`grouped_expert_ffn`); combine = the all-to-all back and the weighted sum of each token's k results
  (`return_and_combine`); and the two all-to-alls alone (`exchange` over buffers of the same size). Each moves
  the whole buffer (ep x capacity rows per device; dropless: capacity = tokens x top-k), used or not;
- ragged: routes = the slice tables (`ragged_routes`, one all-gather of per-expert counts); dispatch = gather
  the rows in expert order and `ragged_all_to_all` them (`ragged_dispatch`); grouped GEMM = the expert FFN on
  the received rows, already in expert order (`expert_sorted_ffn`); combine = the ragged all-to-all back,
  unsort and weighted sum (`ragged_return_and_combine`). Only the kept rows move;
then the routed experts end to end (`moe_parallel`) both ways, and the whole layer (router + routed + shared
expert, the model's default exchange). The table gives the bytes a device sends to the others (buffer / the
assignments that really leave it) and the achieved GB/s.
Decode: the 8-layer full-width slice (`benchmarks.common.flash_slice_config`; --quick: 2 layers, one KDA and one
MLA) on the mesh, batch 64 over a cache of 8192 tokens, steps dispatched back to back as `Generator` runs them
(`benchmarks.common.time_decode`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import filled_cache, flash_slice_config, init_on_mesh, median_seconds, rel_error, time_decode
from benchmarks.moe.shared import selection_parser
from ling_jax import ExecutionPolicy, KernelBackend, LingForCausalLM
from ling_jax.moe.block import MoE, route
from ling_jax.moe.expert_parallel import (
    SLICES_PER_EXPERT,
    dispatch,
    exchange,
    has_ragged_all_to_all,
    moe_parallel,
    ragged_dispatch,
    ragged_return_and_combine,
    ragged_routes,
    resolve_exchange,
    return_and_combine,
    rows_per_source,
)
from ling_jax.sharding import ShardingError, cache_shardings, make_mesh
from pallas_kernels.backend import resolve_backend
from pallas_kernels.moe.ops import ExpertWeights, Routing, expert_path, expert_sorted_ffn, grouped_expert_ffn

SPLIT = P("expert")  # leading dimension (tokens, buffer rows, experts) over the expert axis
FULL = {"tokens_per_device": (64, 8192), "decode_batch": 64, "context": 8192, "iters": 20, "steps": 20}
QUICK = {"tokens_per_device": (8,), "decode_batch": 8, "context": 64, "iters": 1, "steps": 2}
DECODE_LAYERS = {False: 8, True: 2}  # quick: one KDA and one MLA layer


@dataclasses.dataclass(frozen=True)
class Row:
    tokens: int  # per device
    stage: str
    seconds: float
    sent_bytes: int = 0  # all-to-all bytes one device sends to the others (its own block stays)
    useful_bytes: int = 0  # of which token-assignments that really go to another device


def expert_mesh(devices: int):
    if devices > jax.device_count():
        raise ShardingError(
            f"--devices {devices}: only {jax.device_count()} present (on a CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices})"
        )
    return make_mesh({"expert": devices}, devices=jax.devices()[:devices])


def on_mesh(fn, mesh, in_specs, out_specs):
    """fn jitted as a shard_map over `mesh` (per-device bodies that name the `expert` axis)."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def stage_functions(mesh, *, local_experts: int, capacity: int, limit, backend: str) -> dict:
    ep = mesh.shape["expert"]
    weights = (P("expert", None, None),) * 3
    native = has_ragged_all_to_all()
    routes_spec = SPLIT  # every field of RaggedRoutes is per device: concatenated over the expert axis

    def grouped_gemm(x, e, g, u, d):
        experts = ExpertWeights(g, u, d)
        return grouped_expert_ffn(x, e, experts, limit, expert_path(backend, experts))

    def ragged_grouped_gemm(x, routes, g, u, d):
        experts = ExpertWeights(g, u, d)
        path = expert_path(backend, experts, sorted_rows=True)
        return expert_sorted_ffn(x, routes.group_sizes_L, experts, limit, path)

    return {
        "dispatch": on_mesh(
            functools.partial(dispatch, ep=ep, local_experts=local_experts, capacity=capacity),
            mesh,
            (SPLIT, SPLIT),
            (SPLIT,) * 4,
        ),
        "dispatch all-to-all": on_mesh(
            lambda x, e: (exchange(x, ep), exchange(e, ep)), mesh, (SPLIT, SPLIT), (SPLIT, SPLIT)
        ),
        "grouped GEMM": on_mesh(
            grouped_gemm,
            mesh,
            (SPLIT, SPLIT, *weights),
            SPLIT,
        ),
        "combine": on_mesh(
            lambda y, slot, kept, w: return_and_combine(y, slot, kept, w, ep=ep, tp_axes=(), dtype=y.dtype),
            mesh,
            (SPLIT,) * 4,
            SPLIT,
        ),
        "combine all-to-all": on_mesh(lambda y: exchange(y, ep), mesh, (SPLIT,), SPLIT),
        "ragged routes": on_mesh(
            functools.partial(ragged_routes, ep=ep, local_experts=local_experts, capacity=capacity),
            mesh,
            (SPLIT,),
            routes_spec,
        ),
        "ragged dispatch": on_mesh(
            functools.partial(ragged_dispatch, rows=ep * capacity, native=native), mesh, (SPLIT, routes_spec), SPLIT
        ),
        "ragged grouped GEMM": on_mesh(
            ragged_grouped_gemm,
            mesh,
            (SPLIT, routes_spec, *weights),
            SPLIT,
        ),
        "ragged combine": on_mesh(
            lambda y, routes, w: ragged_return_and_combine(y, routes, w, tp_axes=(), dtype=y.dtype, native=native),
            mesh,
            (SPLIT, routes_spec, SPLIT),
            SPLIT,
        ),
    }


def useful_rows(experts_TK, tokens_per_device: int, local_experts: int) -> int:
    """Token-assignments per device (mean) whose expert lives on another device."""
    experts = np.asarray(experts_TK)
    source = np.arange(experts.shape[0])[:, None] // tokens_per_device
    return int((experts // local_experts != source).sum()) // (experts.shape[0] // tokens_per_device)


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """One MoE layer's routed inputs at a token count, on the mesh."""

    tokens_per_device: int
    capacity: int  # receive rows per source
    x_TD: jax.Array
    weights_TK: jax.Array
    experts_TK: jax.Array
    expert_weights: tuple  # gate, up, down


def layer_inputs(moe: MoE, mesh, tokens_per_device: int, capacity_factor) -> LayerInputs:
    config = moe.gate.config
    ep = mesh.shape["expert"]
    tokens = ep * tokens_per_device
    x_TD = jax.device_put(
        jax.random.normal(jax.random.key(tokens), (tokens, config.hidden_size), jnp.bfloat16),
        NamedSharding(mesh, SPLIT),
    )
    gate_weights = (moe.gate.weight[...], moe.gate.expert_bias[...])
    weights_TK, experts_TK = jax.jit(lambda x, w, b: route(x, w, b, config))(x_TD, *gate_weights)
    capacity = rows_per_source(
        tokens_per_device, config.num_experts_per_tok, ep, config.num_experts // ep, capacity_factor
    )
    return LayerInputs(
        tokens_per_device,
        capacity,
        x_TD,
        weights_TK,
        experts_TK,
        (moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...]),
    )


def routed_experts(mesh, limit, policy: ExecutionPolicy):
    """`moe_parallel` jitted: (x, weights, experts, gate, up, down) -> (y, dropped assignments)."""

    def run(x_TD, weights_TK, experts_TK, gate, up, down):
        routing, experts = Routing(weights_TK, experts_TK), ExpertWeights(gate, up, down)
        return moe_parallel(x_TD, routing, experts, limit=limit, mesh=mesh, policy=policy)

    return jax.jit(run)


def time_moe_layer(
    moe: MoE, mesh, tokens_per_device: int, *, capacity_factor, backend: str, iters: int, slice_counts: tuple[int, ...]
) -> list[Row]:
    """Every stage of one MoE layer at `tokens_per_device`, both exchanges (each checked against moe_parallel
    and the ragged one against the dense one), the ragged all-to-alls at other slice counts, and the layer."""
    config = moe.gate.config
    ep = mesh.shape["expert"]
    local_experts = config.num_experts // ep
    inputs = layer_inputs(moe, mesh, tokens_per_device, capacity_factor)
    stages = stage_functions(
        mesh, local_experts=local_experts, capacity=inputs.capacity, limit=moe.experts.limit, backend=backend
    )
    routed = {
        exchange_: routed_experts(
            mesh,
            moe.experts.limit,
            ExecutionPolicy(kernel_backend=backend, moe_exchange=exchange_, moe_capacity_factor=capacity_factor),
        )
        for exchange_ in ("dense", "ragged")
    }
    row_bytes = config.hidden_size * jnp.dtype(jnp.bfloat16).itemsize
    useful = useful_rows(inputs.experts_TK, tokens_per_device, local_experts)  # rows that leave a device
    others = (ep - 1) * inputs.capacity  # a device's buffer rows for the other devices

    def timed(name, *args):
        return median_seconds(stages[name], *args, iters=iters)

    def routed_row(exchange_):
        seconds = median_seconds(
            routed[exchange_], inputs.x_TD, inputs.weights_TK, inputs.experts_TK, *inputs.expert_weights, iters=iters
        )
        return Row(tokens_per_device, f"{exchange_}: routed experts (moe_parallel)", seconds)

    dense, dense_out = dense_rows(stages, inputs, timed, others=others, useful=useful, row_bytes=row_bytes)
    ragged, ragged_out, (received, y_ragged) = ragged_rows(stages, inputs, timed, useful_bytes=useful * row_bytes)
    for name, out in (("dense", dense_out), ("ragged", ragged_out)):
        reference = routed[name](inputs.x_TD, inputs.weights_TK, inputs.experts_TK, *inputs.expert_weights)[0]
        print(
            f"tokens/device {tokens_per_device}: capacity {inputs.capacity} rows per source; {name} exchange: "
            f"chained stages vs moe_parallel rel. error {rel_error(out, reference):.1e}, vs the dense exchange "
            f"{rel_error(out, dense_out):.1e}",
            flush=True,
        )
    slices = slice_count_rows(
        stages,
        inputs,
        timed,
        mesh,
        received,
        y_ragged,
        local_experts=local_experts,
        slice_counts=slice_counts,
        useful_bytes=useful * row_bytes,
    )
    graphdef, state = nnx.split(moe)
    with jax.set_mesh(mesh):
        policy = ExecutionPolicy(kernel_backend=backend)
        layer = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, policy=policy))
        layer_s = median_seconds(layer, state, inputs.x_TD[None], iters=iters)
    return [
        *dense,
        routed_row("dense"),
        *ragged,
        *slices,
        routed_row("ragged"),
        Row(
            tokens_per_device,
            f"whole MoE layer (router + routed + shared; {resolve_exchange('auto')} exchange)",
            layer_s,
        ),
    ]


def dense_rows(stages, inputs: LayerInputs, timed, *, others: int, useful: int, row_bytes: int):
    """The dense exchange's stages chained (-> rows, the chained output). others / useful: rows a device sends
    to the other devices (its buffer) / of which really leave it; a dispatch row also carries its int32 expert
    id."""
    tokens = inputs.tokens_per_device
    x_RD, expert_R, slot_A, kept_A = stages["dispatch"](inputs.x_TD, inputs.experts_TK)
    y_RD = stages["grouped GEMM"](x_RD, expert_R, *inputs.expert_weights)
    dispatch_bytes = (others * (row_bytes + 4), useful * (row_bytes + 4))
    combine_bytes = (others * row_bytes, useful * row_bytes)
    rows = [
        Row(
            tokens,
            "dense: dispatch (pack + all-to-all)",
            timed("dispatch", inputs.x_TD, inputs.experts_TK),
            *dispatch_bytes,
        ),
        Row(
            tokens, "dense:   dispatch all-to-all alone", timed("dispatch all-to-all", x_RD, expert_R), *dispatch_bytes
        ),
        Row(
            tokens,
            "dense: grouped GEMM (sort, expert FFN, unsort)",
            timed("grouped GEMM", x_RD, expert_R, *inputs.expert_weights),
        ),
        Row(
            tokens,
            "dense: combine (all-to-all back + weighted sum)",
            timed("combine", y_RD, slot_A, kept_A, inputs.weights_TK),
            *combine_bytes,
        ),
        Row(tokens, "dense:   combine all-to-all alone", timed("combine all-to-all", y_RD), *combine_bytes),
    ]
    return rows, stages["combine"](y_RD, slot_A, kept_A, inputs.weights_TK)


def ragged_rows(stages, inputs: LayerInputs, timed, *, useful_bytes: int):
    """The ragged exchange's stages chained (-> rows, the chained output, (the received rows, their expert
    outputs)): only the useful bytes move."""
    tokens = inputs.tokens_per_device
    routes = stages["ragged routes"](inputs.experts_TK)
    x_RD = stages["ragged dispatch"](inputs.x_TD, routes)
    y_RD = stages["ragged grouped GEMM"](x_RD, routes, *inputs.expert_weights)
    rows = [
        Row(tokens, "ragged: routes (count all-gather, tables)", timed("ragged routes", inputs.experts_TK)),
        Row(
            tokens,
            "ragged: dispatch (gather + ragged all-to-all)",
            timed("ragged dispatch", inputs.x_TD, routes),
            useful_bytes,
            useful_bytes,
        ),
        Row(
            tokens,
            "ragged: grouped GEMM (expert FFN on ordered rows)",
            timed("ragged grouped GEMM", x_RD, routes, *inputs.expert_weights),
        ),
        Row(
            tokens,
            "ragged: combine (ragged all-to-all back, unsort, weighted sum)",
            timed("ragged combine", y_RD, routes, inputs.weights_TK),
            useful_bytes,
            useful_bytes,
        ),
    ]
    return rows, stages["ragged combine"](y_RD, routes, inputs.weights_TK), (x_RD, y_RD)


def slice_count_rows(
    stages,
    inputs: LayerInputs,
    timed,
    mesh,
    received,
    y_RD,
    *,
    local_experts: int,
    slice_counts: tuple[int, ...],
    useful_bytes: int,
) -> list[Row]:
    """The ragged all-to-alls with each expert's rows in each of `slice_counts` slices; received / y_RD: the
    model's received rows (which each count must reproduce) and their expert outputs."""
    ep = mesh.shape["expert"]
    rows = []
    for count in slice_counts:
        routes = on_mesh(
            functools.partial(
                ragged_routes, ep=ep, local_experts=local_experts, capacity=inputs.capacity, slices_per_expert=count
            ),
            mesh,
            (SPLIT,),
            SPLIT,
        )(inputs.experts_TK)
        if rel_error(stages["ragged dispatch"](inputs.x_TD, routes), received) != 0.0:
            raise AssertionError(f"{count} slices per expert: received rows differ")
        rows += [
            Row(
                inputs.tokens_per_device,
                f"ragged, {count} slices per expert: dispatch",
                timed("ragged dispatch", inputs.x_TD, routes),
                useful_bytes,
                useful_bytes,
            ),
            Row(
                inputs.tokens_per_device,
                f"ragged, {count} slices per expert: combine",
                timed("ragged combine", y_RD, routes, inputs.weights_TK),
                useful_bytes,
                useful_bytes,
            ),
        ]
    return rows


def time_sharded_decode(mesh, *, quick: bool, batch: int, context: int, steps: int, policy: ExecutionPolicy) -> float:
    """Seconds per decode step of the full-width slice (`DECODE_LAYERS`) on `mesh`, batch over the expert axis."""
    config = flash_slice_config(DECODE_LAYERS[quick], quick)
    model = init_on_mesh(lambda: LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, policy=policy), mesh)
    cache = filled_cache(model, batch, context, steps + 8)
    cache = jax.device_put(cache, cache_shardings(cache, mesh))
    with jax.set_mesh(mesh):
        return time_decode(model, cache, steps)


def print_table(rows: list[Row], decode: tuple[int, int, int, float], devices: int) -> None:
    print(
        f"\n| tokens/device | stage (mesh expert={devices}) | ms | all-to-all MB sent per device "
        f"(buffer / useful) | GB/s per device (buffer / useful) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        if row.sent_bytes:
            moved = f"{row.sent_bytes / 1e6:.1f} / {row.useful_bytes / 1e6:.1f}"
            rate = f"{row.sent_bytes / row.seconds / 1e9:.1f} / {row.useful_bytes / row.seconds / 1e9:.1f}"
        else:
            moved = rate = ""
        print(f"| {row.tokens} | {row.stage} | {row.seconds * 1e3:.3f} | {moved} | {rate} |")
    layers, batch, context, seconds = decode
    print(f"\n| decode step (mesh expert={devices}) | batch | context | ms |\n|---|---|---|---|")
    print(f"| {layers}-layer full-width slice | {batch} | {context} | {seconds * 1e3:.2f} |")


def main(argv=None) -> int:
    parser = selection_parser(__doc__)
    parser.add_argument("--capacity-factor", type=float, help="cap rows per source (default: dropless)")
    parser.add_argument(
        "--kernel-backend",
        choices=[backend.value for backend in KernelBackend],
        default=KernelBackend.AUTO.value,
        help="auto: the Pallas kernels on a GPU, jnp on a CPU",
    )
    parser.add_argument("--iters", type=int, help=f"timed calls per stage (default {FULL['iters']})")
    parser.add_argument("--steps", type=int, help=f"decode steps timed (default {FULL['steps']})")
    parser.add_argument(
        "--slices-per-expert",
        type=int,
        nargs="*",
        default=[4, 16],
        metavar="N",
        help=f"also time the ragged all-to-alls with each expert's rows in N slices (the model "
        f"uses {SLICES_PER_EXPERT}; default: 4 16)",
    )
    parser.add_argument("--quick", action="store_true", help="a narrow model, fewer tokens: a CPU smoke test")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    iters, steps = args.iters or sizes["iters"], args.steps or sizes["steps"]
    policy = ExecutionPolicy(kernel_backend=args.kernel_backend)
    backend = resolve_backend(policy.kernel_backend)
    config = flash_slice_config(8, args.quick)
    try:
        mesh = expert_mesh(args.devices)
        if config.num_experts % args.devices:
            raise ShardingError(f"{config.num_experts} experts cannot be split over {args.devices} devices")
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"jax {jax.__version__}, {args.devices} x {jax.devices()[0].device_kind}, mesh expert={args.devices}; "
        f"hidden {config.hidden_size}, {config.num_experts} experts, top-{config.num_experts_per_tok}, width "
        f"{config.moe_intermediate_size}, bf16, kernels {backend}, capacity factor {args.capacity_factor}",
        flush=True,
    )
    moe = init_on_mesh(lambda: MoE(config, clip_layer=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh)
    rows = [
        row
        for tokens in sizes["tokens_per_device"]
        for row in time_moe_layer(
            moe,
            mesh,
            tokens,
            capacity_factor=args.capacity_factor,
            backend=backend,
            iters=iters,
            slice_counts=tuple(args.slices_per_expert),
        )
    ]
    del moe
    gc.collect()
    decode_s = time_sharded_decode(
        mesh,
        quick=args.quick,
        batch=sizes["decode_batch"],
        context=sizes["context"],
        steps=steps,
        policy=policy,
    )
    decode = (DECODE_LAYERS[args.quick], sizes["decode_batch"], sizes["context"], decode_s)
    print_table(rows, decode, args.devices)
    return 0
