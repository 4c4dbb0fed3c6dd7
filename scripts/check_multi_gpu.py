#!/usr/bin/env python3
"""A full-width Ling-3.1-flash-shaped model (random weights, bf16 by default) with its experts split over all devices:
a sharded forward and prefill + decode of as many layers as fit, and a logit check against one device.

    # 2 H200s (expert=2): about 18 layers on the mesh, 9 for the comparison with one GPU
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python scripts/check_multi_gpu.py
    python scripts/check_multi_gpu.py --mesh expert=8 --layers 64 --reference-layers 8
    python scripts/check_multi_gpu.py --plan-only --mesh expert=8 --device-memory-gib 133   # arithmetic only
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/check_multi_gpu.py --quick   # CPU
    python scripts/check_multi_gpu.py --dtype float32 --reference-layers 2 --layers 2   # the tight check

The model is `benchmarks.common.flash_slice_config` (hidden 4096, 64 heads, 512 experts, every layer MoE, an MLA
layer every 8th), its weights created straight into their shardings (`benchmarks.common.init_on_mesh`). Steps:
1. Layer counts from the parameter bytes per device (`ling_jax.sharding` rules over the mesh) and the device
   memory (bytes_limit, or --device-memory-gib) less --headroom-gib; the arithmetic is printed.
2. Reference: --reference-layers (default: the most that fit on one device) on device 0: a forward over a
   batch of left-padded prompts followed by teacher-forced tokens, and a prefill of the prompts plus decode
   steps over those tokens (the cache path).
3. The same reduced model moved to the mesh (its weights, one parameter at a time): both logit sets compared
   with the reference (rel. error, pass at <= 2e-2 in bf16, 1e-4 in fp32). Then a self-test of that
   comparison: the routed experts the last device holds scaled by 2 in place and the same compiled programs run
   again; their logits must fail it.
4. Only if step 3 passed: --layers (default: the most that fit on the mesh) on the mesh: forward, prefill and
   decode; their logits must be finite, and the cached logits are compared with the forward's (reported, not
   judged). Where --layers equals the reference layers, step 3's mesh logits are that run's.
In bf16 the two runs round differently (the mesh's matmuls have other shapes), and a token whose 8th and 9th
expert scores are that close can switch experts: random-weight layers amplify this with depth (on a CPU, hidden
512: 2.6e-4 at 1 layer, 1.0e-2 at 4, with 64 experts), and at full width 0.1% of the router inputs one ulp off
already moves one layer's logits by 1.4e-2 (scripts/routing_sensitivity.py), so a bf16 pass at 2e-2 is
indicative only. `--dtype float32` (matmuls at full fp32 precision) is the tight check, at 1e-4: the same CPU
runs gave 4e-7 to 1e-6.
Exit code 0 when every check passes (the self-test included), 1 otherwise, 2 for a bad mesh or flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import flash_slice_config, init_on_mesh, rel_error  # noqa: E402
from ling_jax import ExecutionPolicy, KernelBackend, LingConfig, LingForCausalLM  # noqa: E402
from ling_jax.config import KDA, MLA  # noqa: E402
from ling_jax.generation.flags import add_mesh_flag
from ling_jax.generation.memory import format_bytes  # noqa: E402
from ling_jax.generation.sharded import ShardedLM  # noqa: E402
from ling_jax.moe.block import MoE  # noqa: E402
from ling_jax.presets import preset
from ling_jax.sharding import ShardingError, make_mesh, param_shardings, param_specs, parse_mesh  # noqa: E402

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}  # logits rel. error, mesh vs one device
MAX_LAYERS = preset("ling-3.1-flash").num_hidden_layers
CORRUPT_SCALE = 2.0
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Parameter bytes one device holds: what every model has, and one decoder layer of each kind."""

    fixed: int  # embedding, final norm, lm_head
    per_kind: dict[str, int]  # KDA / MLA (+ MoE) layer

    def total(self, config: LingConfig) -> int:
        return self.fixed + sum(self.per_kind[kind] for kind in config.layer_types)


def layer_bytes(quick: bool, axis_sizes: dict[str, int], dtype) -> LayerBytes:
    """Per-device parameter bytes over a mesh of `axis_sizes`, from the abstract two-layer (KDA, MLA) model."""
    config = flash_slice_config(2, quick)
    state = nnx.state(nnx.eval_shape(lambda: LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype)))
    specs = param_specs(state, axis_sizes)
    fixed, per_layer = 0, [0] * config.num_hidden_layers
    for (path, variable), (_, spec) in zip(nnx.to_flat_state(state), nnx.to_flat_state(specs)):
        ways = math.prod(
            axis_sizes[axis]
            for entry in spec.get_value()
            if entry
            for axis in ((entry,) if isinstance(entry, str) else entry)
        )
        nbytes = math.prod(variable.shape) * variable.get_value().dtype.itemsize // ways
        if path[:2] == ("model", "layers"):
            per_layer[path[2]] += nbytes
        else:
            fixed += nbytes
    return LayerBytes(fixed=fixed, per_kind=dict(zip(config.layer_types, per_layer)))


def layers_that_fit(sizes: LayerBytes, budget: int, quick: bool) -> int:
    """The most layers (up to the model's 72) whose parameters fit in `budget` bytes per device; prints the sum."""
    fitting = [n for n in range(1, MAX_LAYERS + 1) if sizes.total(flash_slice_config(n, quick)) <= budget]
    if not fitting:
        raise ShardingError(
            f"not even one layer fits: {format_bytes(sizes.total(flash_slice_config(1, quick)))} "
            f"> budget {format_bytes(budget)} per device"
        )
    layers = fitting[-1]
    types = flash_slice_config(layers, quick).layer_types
    terms = " + ".join(f"{types.count(kind)} x {format_bytes(sizes.per_kind[kind])}" for kind in (KDA, MLA))
    total = sizes.total(flash_slice_config(layers, quick))
    if layers == MAX_LAYERS:
        beyond = "the model's full depth"
    else:
        beyond = f"{layers + 1} would need {format_bytes(sizes.total(flash_slice_config(layers + 1, quick)))}"
    print(
        f"    {layers} layers ({types.count(KDA)} KDA + {types.count(MLA)} MLA): {format_bytes(sizes.fixed)} + "
        f"{terms} = {format_bytes(total)} <= {format_bytes(budget)} ({beyond})"
    )
    return layers


def device_budget(device, memory_gib: float | None, headroom_gib: float) -> int:
    """Bytes per device for parameters: the device's memory less the headroom."""
    if memory_gib is None:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ShardingError(f"{device.platform} device reports no memory limit: give --device-memory-gib")
        memory, source = stats["bytes_limit"], "bytes_limit"
    else:
        memory, source = int(memory_gib * GIB), "--device-memory-gib"
    headroom = int(headroom_gib * GIB)
    print(
        f"  budget per device: {format_bytes(memory)} ({source}) - {format_bytes(headroom)} headroom (activations, "
        f"cache, init temporaries) = {format_bytes(memory - headroom)}"
    )
    return memory - headroom


def plan_layers(quick: bool, axis_sizes: dict[str, int], budget: int, dtype) -> int:
    sizes = layer_bytes(quick, axis_sizes, dtype)
    print(
        f"  parameters per device on {axis_sizes or 'one device'}: fixed {format_bytes(sizes.fixed)} (embedding, "
        f"lm_head, final norm), KDA+MoE layer {format_bytes(sizes.per_kind[KDA])}, MLA+MoE layer "
        f"{format_bytes(sizes.per_kind[MLA])}"
    )
    return layers_that_fit(sizes, budget, quick)


@dataclasses.dataclass(frozen=True)
class Inputs:
    ids_BL: np.ndarray  # [B, prompt + steps]: the prompts, then the tokens the decode steps feed
    mask_BL: np.ndarray  # left padding in the prompts; the decode tokens are all real
    prompt_length: int


def make_inputs(vocab: int, batch: int, prompt_length: int, steps: int) -> Inputs:
    """Random prompts, row r left-padded by r * prompt_length // (2 * batch), and random decode tokens."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, prompt_length + steps), dtype=np.int32)
    mask = np.ones(ids.shape, bool)
    for row in range(batch):
        mask[row, : row * prompt_length // (2 * batch)] = False
    return Inputs(ids_BL=ids, mask_BL=mask, prompt_length=prompt_length)


@dataclasses.dataclass(frozen=True)
class Logits:
    forward: np.ndarray  # [B, L, V] fp32, full-sequence forward (no cache)
    cached: np.ndarray  # [B, steps + 1, V] fp32: the prefill's last position, then one per decode step


def build_model(config: LingConfig, mesh, *, dtype, policy: ExecutionPolicy) -> tuple[LingForCausalLM, ShardedLM]:
    """The model on `mesh` (seed 0) and its ShardedLM, which holds the model's parameter variables (an in-place
    change to the model reaches the compiled programs)."""
    start = time.perf_counter()
    model = init_on_mesh(lambda: LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, policy=policy), mesh)
    sharded = ShardedLM(model, mesh)
    print(f"    init {time.perf_counter() - start:.1f} s", flush=True)
    return model, sharded


def run_logits(sharded: ShardedLM, inputs: Inputs) -> Logits:
    """The forward, then the prefill + decode steps (compiled on a ShardedLM's first call)."""
    start = time.perf_counter()
    forward = np.asarray(sharded(inputs.ids_BL, attention_mask=inputs.mask_BL), np.float32)
    print(
        f"    forward [{inputs.ids_BL.shape[0]}, {inputs.ids_BL.shape[1]}] {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    start = time.perf_counter()
    cached = prefill_and_decode(sharded, inputs)
    steps = inputs.ids_BL.shape[1] - inputs.prompt_length
    print(f"    prefill + {steps} decode steps {time.perf_counter() - start:.1f} s", flush=True)
    return Logits(forward=forward, cached=cached)


def move_to_mesh(model: LingForCausalLM, mesh) -> ShardedLM:
    """Each parameter of `model` to its sharding on `mesh` (`ling_jax.sharding` rules), in place, one at a time
    (the old copy is freed when its variable lets go of it): a model on one device moves holding no more than one
    parameter twice. -> the model's ShardedLM on `mesh`."""
    state = nnx.state(model)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    shardings = jax.tree.leaves(param_shardings(state, mesh), is_leaf=is_variable)
    for variable, sharding in zip(jax.tree.leaves(state, is_leaf=is_variable), shardings):
        variable.set_value(jax.device_put(variable.get_value(), sharding.get_value()))
    return ShardedLM(model, mesh)


def run_model(config: LingConfig, mesh, inputs: Inputs, *, dtype, policy: ExecutionPolicy) -> Logits:
    """Builds the model on `mesh`, runs it (`run_logits`) and frees it."""
    model, sharded = build_model(config, mesh, dtype=dtype, policy=policy)
    logits = run_logits(sharded, inputs)
    del sharded, model
    gc.collect()
    return logits


def prefill_and_decode(sharded: ShardedLM, inputs: Inputs) -> np.ndarray:
    batch, length = inputs.ids_BL.shape
    prompt = inputs.prompt_length
    cache = sharded.init_cache(batch, length)
    logits, cache = sharded(inputs.ids_BL[:, :prompt], cache=cache, attention_mask=inputs.mask_BL[:, :prompt])
    out = [np.asarray(logits[:, -1], np.float32)]
    for position in range(prompt, length):
        logits, cache = sharded(inputs.ids_BL[:, position : position + 1], cache=cache)
        out.append(np.asarray(logits[:, -1], np.float32))
    return np.stack(out, axis=1)


def corrupt_last_shard(model: LingForCausalLM, expert_ways: int) -> None:
    """Scales down_proj of the routed experts the last device on the expert axis holds (all of them without an
    expert axis), in every MoE layer, in place (each array keeps its sharding)."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            down = layer.mlp.experts.down_proj
            local = down.shape[0] // expert_ways
            down[...] = jax.device_put(down[...].at[-local:].multiply(CORRUPT_SCALE), down[...].sharding)


def errors_vs_reference(ref: Logits, ours: Logits, inputs: Inputs) -> dict[str, float]:
    """Rel. errors of the forward logits at real tokens (pads' logits are not outputs) and the cached ones."""
    return {
        "forward": rel_error(ours.forward[inputs.mask_BL], ref.forward[inputs.mask_BL]),
        "prefill + decode": rel_error(ours.cached, ref.cached),
    }


def compare_with_reference(ref: Logits, ours: Logits, inputs: Inputs, tolerance: float) -> bool:
    """Every rel. error within `tolerance`; prints them."""
    errors = errors_vs_reference(ref, ours, inputs)
    for name, err in errors.items():
        print(
            f"    {name} logits rel. error vs one device: {err:.2e} "
            f"({'pass' if err <= tolerance else 'FAIL'} at {tolerance:.0e})"
        )
    return all(err <= tolerance for err in errors.values())


def self_test(model, sharded: ShardedLM, ref: Logits, inputs: Inputs, tolerance: float) -> bool:
    """Step 3 can fail: with the last expert shard corrupted in place, the same programs' logits must differ from
    the reference by more than `tolerance`."""
    corrupt_last_shard(model, sharded.mesh.shape.get("expert", 1))
    errors = errors_vs_reference(ref, run_logits(sharded, inputs), inputs)
    caught = any(err > tolerance for err in errors.values())
    print(
        f"    self-test, the last expert shard scaled by {CORRUPT_SCALE}: rel. error vs one device "
        + ", ".join(f"{name} {err:.2e}" for name, err in errors.items())
        + f" ({'caught' if caught else 'FAIL: not caught'} at {tolerance:.0e})"
    )
    return caught


def check_large_run(logits: Logits, inputs: Inputs) -> bool:
    """Finite logits; the cache path's logits vs the forward's at the same positions (reported only)."""
    finite = bool(np.isfinite(logits.forward).all() and np.isfinite(logits.cached).all())
    forward_at_cached = logits.forward[:, inputs.prompt_length - 1 :]
    print(
        f"    logits finite: {'pass' if finite else 'FAIL'}; prefill + decode vs forward at the same positions: "
        f"rel. error {rel_error(logits.cached, forward_at_cached):.2e} (cache path vs full sequence)"
    )
    return finite


DEFAULTS = {"batch": 8, "prompt_length": 64, "decode_steps": 4, "device_memory_gib": None, "headroom_gib": 12.0}
QUICK_DEFAULTS = {"batch": 8, "prompt_length": 12, "decode_steps": 2, "device_memory_gib": 0.1, "headroom_gib": 0.02}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_flag(parser, default_means="expert=<all devices>")
    parser.add_argument("--layers", type=int, help="layers of the large run (default: the most that fit)")
    parser.add_argument(
        "--reference-layers",
        type=int,
        help="layers of the comparison with one device (default: the most that fit on one)",
    )
    parser.add_argument("--batch", type=int, help=f"prompts (default {DEFAULTS['batch']})")
    parser.add_argument("--prompt-length", type=int, help=f"tokens per prompt (default {DEFAULTS['prompt_length']})")
    parser.add_argument("--decode-steps", type=int, help=f"default {DEFAULTS['decode_steps']}")
    parser.add_argument(
        "--device-memory-gib", type=float, help="memory per device (default: the device's bytes_limit; needed on a CPU)"
    )
    parser.add_argument(
        "--headroom-gib",
        type=float,
        help="memory per device kept free of parameters: activations, "
        f"cache, init temporaries (default {DEFAULTS['headroom_gib']})",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(TOLERANCE),
        default="bfloat16",
        help="parameters and activations; float32 also runs the matmuls at full fp32 precision",
    )
    parser.add_argument(
        "--kernel-backend",
        choices=[backend.value for backend in KernelBackend],
        default=KernelBackend.AUTO.value,
        help="auto: the Pallas kernels on a GPU, jnp on a CPU; reference: jnp everywhere",
    )
    parser.add_argument("--plan-only", action="store_true", help="print the layer arithmetic and stop")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a narrow model (hidden 512, 64 experts), short "
        f"prompts, {QUICK_DEFAULTS['device_memory_gib']} GiB per device: a CPU smoke test",
    )
    args = parser.parse_args(argv)
    for name, default in (QUICK_DEFAULTS if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def mesh_for(text: str | None):
    """The mesh over the first devices that `text` (--mesh) names."""
    shape = parse_mesh(text) if text else {"expert": jax.device_count()}
    needed = math.prod(shape.values())
    if needed > jax.device_count():
        raise ShardingError(
            f"mesh {shape} needs {needed} devices, {jax.device_count()} present (on a CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})"
        )
    return make_mesh(shape, devices=jax.devices()[:needed])


def main(argv=None) -> int:
    args = parse_args(argv)
    with jax.default_matmul_precision("highest" if args.dtype == "float32" else None):  # for this call only
        return check(args)


def check(args) -> int:
    try:
        mesh = mesh_for(args.mesh)
        one_device = make_mesh({}, devices=jax.devices()[:1])
        mesh_sizes = {axis: size for axis, size in mesh.shape.items() if size > 1}
        print(
            f"jax {jax.__version__}, {mesh.devices.size} x {jax.devices()[0].device_kind}, mesh {mesh_sizes}",
            flush=True,
        )
        dtype, tolerance = jnp.dtype(args.dtype), TOLERANCE[args.dtype]
        policy = ExecutionPolicy(kernel_backend=args.kernel_backend)
        print(f"layer arithmetic ({args.dtype} parameters):")
        budget = device_budget(jax.devices()[0], args.device_memory_gib, args.headroom_gib)
        layers = args.layers or plan_layers(args.quick, mesh_sizes, budget, dtype)
        reference_layers = args.reference_layers or plan_layers(args.quick, {}, budget, dtype)
        if args.plan_only:
            return 0
        inputs = make_inputs(
            flash_slice_config(1, args.quick).vocab_size, args.batch, args.prompt_length, args.decode_steps
        )
        reduced = flash_slice_config(reference_layers, args.quick)
        print(f"\n{reference_layers} layers on one device (reference):", flush=True)
        model, sharded = build_model(reduced, one_device, dtype=dtype, policy=policy)
        reference = run_logits(sharded, inputs)
        print(f"{reference_layers} layers on the mesh (the same weights, moved):", flush=True)
        sharded = move_to_mesh(model, mesh)
        on_mesh = run_logits(sharded, inputs)
        matches = compare_with_reference(reference, on_mesh, inputs, tolerance)
        can_fail = self_test(model, sharded, reference, inputs, tolerance)
        del reference, sharded, model
        gc.collect()
        if not (matches and can_fail):
            print(
                f"\nFAIL: {reference_layers}-layer logits on mesh {mesh_sizes} "
                + ("differ from one device by more than" if not matches else "corrupted do not fail the check at")
                + f" {tolerance:.0e}; the {layers}-layer run is skipped"
            )
            return 1
        if layers == reference_layers:
            print(f"{layers} layers on the mesh: the run above", flush=True)
            large = on_mesh
        else:
            print(f"{layers} layers on the mesh:", flush=True)
            large = run_model(flash_slice_config(layers, args.quick), mesh, inputs, dtype=dtype, policy=policy)
        large_ok = check_large_run(large, inputs)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"\n{'PASS' if large_ok else 'FAIL'}: {reference_layers}-layer logits on mesh {mesh_sizes} match one device "
        f"within {tolerance:.0e}; {layers}-layer run logits finite: {large_ok}"
    )
    return 0 if large_ok else 1


if __name__ == "__main__":
    sys.exit(main())
