"""Does a model fit a mesh? Per-device bytes of generation (the prefill chunk and the decode step), from the
abstract model and XLA's memory analysis of the programs compiled ahead of time for that mesh.

What each figure is:
- parameters and the decode cache: exact per-device bytes, from the abstract model's shapes and dtypes and the
  shardings the logical axis rules (`ling_jax.sharding`) give them on the mesh; the whole model, MTP layer
  included. `weights="stored"` builds the model as a block-FP8 checkpoint holds it (`BlockFP8Weight`: FP8 values
  and float32 scales, per spec §6.2: `ling_jax.checkpoints.storage`; MXFP4 routed experts when the config says
  so); `weights="bf16"` dense in the activation dtype.
- temporaries and the other inputs / outputs (ids, mask, last hidden state or next token): XLA's
  `compiled.memory_analysis()` of the prefill chunk and the decode step (as `Generator` runs them), lowered from
  `jax.ShapeDtypeStruct`s with the mesh's shardings and compiled, nothing allocated. Compiling all 72 layers
  takes tens of minutes on a CPU, so the programs are compiled with one decoder layer of each kind the model has
  (KDA / MLA attention x dense / MoE feed-forward), the embedding and the lm_head, and the largest temporaries
  are taken: the layers run one after another and reuse their buffers. `whole_model=True` compiles the whole
  model instead.
Compiled on CPU devices standing in for the accelerators (`XLA_FLAGS=--xla_force_host_platform_device_count=N`),
the programs use the GPU Pallas kernels in interpret mode: the MoE then runs its fused gather / scatter kernels
(XLA:CPU's own grouped matmul would hold a masked copy of the rows per local expert, which no accelerator makes).
The temporaries are XLA:CPU's plan of those programs, an estimate of the accelerator's: the CPU has no bf16
matmul, so it also holds float32 copies of one layer's bf16 weights and of the lm_head. On the accelerators
themselves the same call compiles for them and every figure is that compiler's. docs/memory.md has the results
and what makes up the temporaries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from ling_jax import build
from ling_jax.cache import LingCache, MTPCache
from ling_jax.checkpoints.hf import BF16, FP8, MXFP4, STORED, check_weights, stored_struct
from ling_jax.checkpoints.names import source_for
from ling_jax.checkpoints.storage import storage_kind
from ling_jax.config import LingConfig
from ling_jax.generation.memory import format_bytes
from ling_jax.policy import ExecutionPolicy
from ling_jax.quant import MXFP4_GROUP
from ling_jax.sharding import activation_spec, cache_shardings, make_mesh, param_shardings
from ling_jax.vl.config import LingVLConfig

MIB, GIB = 1 << 20, 1 << 30
PUBLISHED_FP8_BLOCK = (128, 128)  # the published checkpoints' weight_block_size


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator chip: its memory and the fraction of it the process may use."""

    name: str
    memory_bytes: int
    usable_fraction: float
    source: str

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)


HARDWARE = {
    "h200": Hardware(
        "h200",
        143_771 * MIB,
        0.95,
        "141 GB HBM3e (143,771 MiB); 0.95 as the project runs it (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; "
        "JAX's default preallocation is 0.75)",
    ),
    "v5p": Hardware("v5p", 95 * GIB, 1.0, "95 GiB HBM2e per chip (v5p-N has N/2 chips)"),
    "v6e": Hardware("v6e", 32 * GIB, 1.0, "32 GiB HBM per chip"),
    "v5e": Hardware("v5e", 16 * GIB, 1.0, "16 GiB HBM2 per chip"),
}


def device_hardware(device: jax.Device) -> Hardware:
    """The `Hardware` of a live accelerator: its allocator's limit (`memory_stats()["bytes_limit"]`, the memory
    fraction already applied), all of it usable."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit is None:
        raise ValueError(f"{device.platform} device {device.id} reports no memory limit: name its hardware instead")
    return Hardware(device.device_kind, int(limit), 1.0, "the device's bytes_limit")


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One compiled step's per-device bytes besides the parameters and the cache."""

    name: str
    temp_bytes: int  # the largest of the compiled programs' temporaries
    io_bytes: int  # ids / mask in, hidden / token out (the donated cache excluded)
    temps_by_kind: tuple[tuple[str, int], ...]  # (layer kind, temporaries) of each compiled program


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str
    mesh_shape: tuple[tuple[str, int], ...]
    hardware: Hardware
    batch: int
    context: int
    prefill_chunk: int
    weights: str
    param_bytes: int  # exact, per device
    cache_bytes: int  # exact, per device
    mtp_cache_bytes: int  # exact, per device; only speculative decoding (--mtp) allocates it, not in the total
    steps: tuple[StepMemory, ...]  # empty when the parameters and the cache alone do not fit: nothing compiled
    compiled_on: str
    whole_model: bool

    @property
    def devices(self) -> int:
        return math.prod(size for _, size in self.mesh_shape)

    def step_bytes(self, step: StepMemory) -> int:
        return self.param_bytes + self.cache_bytes + step.io_bytes + step.temp_bytes

    @property
    def peak_bytes(self) -> int:
        return max((self.step_bytes(step) for step in self.steps), default=self.param_bytes + self.cache_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hardware.usable_bytes

    def verdict(self) -> str:
        usable = self.hardware.usable_bytes
        if self.fits:
            return f"fits: peak {format_bytes(self.peak_bytes)} of {format_bytes(usable)} usable per device"
        if not self.steps:
            return (
                f"does not fit by at least {format_bytes(self.peak_bytes - usable)}: the parameters and the cache "
                f"alone take {format_bytes(self.peak_bytes)} of {format_bytes(usable)} usable per device"
            )
        return (
            f"does not fit by {format_bytes(self.peak_bytes - usable)}: peak {format_bytes(self.peak_bytes)} of "
            f"{format_bytes(usable)} usable per device"
        )

    def report(self) -> str:
        hw = self.hardware
        mesh = ", ".join(f"{axis}={size}" for axis, size in self.mesh_shape) or "one device"
        if not self.steps:
            compiled = f"compiled: {self.compiled_on}"
        elif self.whole_model:
            compiled = f"compiled on {self.compiled_on}: the whole model"
        else:
            compiled = f"compiled on {self.compiled_on}: one decoder layer of each kind, the largest temporaries"
        temporaries = f"temporaries (compiled: {'whole model' if self.whole_model else 'largest layer'})"
        rows = [
            ("parameters (exact, whole model)", lambda s: self.param_bytes),
            ("decode cache (exact)", lambda s: self.cache_bytes),
            ("inputs / outputs (compiled)", lambda s: s.io_bytes),
            (temporaries, lambda s: s.temp_bytes),
            ("total", self.step_bytes),
        ]
        width = max(len(label) for label, _ in rows)
        lines = [
            f"Memory plan: {self.model}, weights {self.weights}, batch {self.batch}, context {self.context:,}, "
            f"prefill chunk {self.prefill_chunk:,}",
            f"mesh {mesh} ({self.devices} x {hw.name}): {format_bytes(hw.memory_bytes)} per device, usable "
            f"{format_bytes(hw.usable_bytes)} ({hw.usable_fraction:g}; {hw.source})",
            compiled,
            "",
            f"{'per device':<{width}}  " + "  ".join(f"{step.name:>14}" for step in self.steps),
        ]
        for label, value in rows if self.steps else rows[:2]:
            figures = [format_bytes(value(step)) for step in self.steps] or [format_bytes(value(None))]
            lines.append(f"{label:<{width}}  " + "  ".join(f"{figure:>14}" for figure in figures))
        for step in self.steps:
            kinds = ", ".join(f"{kind} {format_bytes(nbytes)}" for kind, nbytes in step.temps_by_kind)
            lines.append(f"{step.name} temporaries by program: {kinds}")
        if self.mtp_cache_bytes:
            lines.append(f"not included: the MTP draft cache of --mtp, {format_bytes(self.mtp_cache_bytes)} more")
        lines += ["", f"verdict: {self.verdict()}"]
        return "\n".join(lines)


def stored_format(config: LingConfig) -> tuple[tuple[int, int], bool]:
    """(FP8 block, MXFP4 routed experts) of the checkpoint `config` describes; a config without a
    quantization_config (a preset) is taken as published: block FP8 128 x 128, FP8 experts."""
    q = config.quantization
    if q is None:
        return PUBLISHED_FP8_BLOCK, False
    return tuple(q.weight_block_size), q.routed_experts_quant_method == MXFP4


def abstract_model(config: LingConfig | LingVLConfig, *, weights: str, dtype=jnp.bfloat16, policy=None):
    """The model as shapes only (nothing allocated): dense in `dtype`, or with weights="stored" its quantisable
    parameters as the checkpoint stores them (`stored_format`, spec §6.2), as the loaders' weights="stored" build
    it."""
    check_weights(weights, "abstract_model")
    model = build.abstract_model(config, dtype=dtype, policy=policy)
    if weights == BF16:
        return model
    config = build.text_config_of(config)
    block, mxfp4 = stored_format(config)
    graphdef, state = nnx.split(model)
    stored = []
    for path, variable in nnx.to_flat_state(state):
        shape = tuple(variable.get_value().shape)
        if variable.get_metadata().get("quantizable"):
            kind = storage_kind(source_for(path, shape, config).names[0], config, mxfp4)
            if kind in (FP8, MXFP4) and not (kind == MXFP4 and shape[-1] % 2):
                variable = variable.replace(stored_struct(shape, kind, block if kind == FP8 else (1, MXFP4_GROUP)))
        stored.append((path, variable))
    return nnx.merge(graphdef, nnx.from_flat_state(stored))


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) placed with `shardings` (a matching tree of
    NamedShardings; every device holds an equal shard)."""
    sizes = jax.tree.map(
        lambda leaf, sharding: math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize,
        tree,
        shardings,
    )
    return sum(jax.tree.leaves(sizes))


def _abstract_args(tree, shardings):
    return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings)


def _layer_configs(config: LingConfig) -> dict[str, LingConfig]:
    """One single-layer config per (attention, feed-forward) kind the model has, no MTP layer."""
    kinds = dict.fromkeys(zip(config.layer_types, config.mlp_layer_types))
    return {
        f"{attention}+{mlp}": config.replace(
            num_hidden_layers=1,
            layer_types=(attention,),
            mlp_layer_types=(mlp,),
            num_nextn_predict_layers=0,
            expert_swiglu_limit_list=(),
            share_expert_swiglu_limit_list=(),
        )
        for attention, mlp in kinds
    }


@dataclasses.dataclass(frozen=True)
class _Compiled:
    temp_bytes: int
    io_bytes: int


def _compile_steps(config, mesh, *, weights, dtype, policy, batch, context, chunk) -> dict[str, _Compiled]:
    """The prefill chunk and the decode step of `config`'s model, compiled for `mesh` from abstract inputs."""
    graphdef, state = nnx.split(abstract_model(config, weights=weights, dtype=dtype, policy=policy))
    state_shardings = param_shardings(state, mesh)
    cache = jax.eval_shape(lambda: LingCache.create(config, batch, context, dtype))
    cache_sharding = cache_shardings(cache, mesh)
    fixed = per_device_bytes(state, state_shardings) + per_device_bytes(cache, cache_sharding)
    params, cache = _abstract_args(state, state_shardings), _abstract_args(cache, cache_sharding)

    def tokens(length: int, dtype):
        spec = activation_spec(("activation_batch", "activation_length"), (batch, length), mesh)
        return jax.ShapeDtypeStruct((batch, length), dtype, sharding=NamedSharding(mesh, spec))

    def prefill(params, cache, ids_BC, mask_BC):  # Generator's prefill chunk: the cache and the last hidden state
        model = nnx.merge(graphdef, params)
        hidden_BCD, cache = model.model(ids_BC, cache=cache, attention_mask=mask_BC, policy=model.policy)
        return cache, hidden_BCD[:, -1]

    def decode(params, cache, ids_B1):  # one token per row: logits, the next token, the cache
        out = nnx.merge(graphdef, params)(ids_B1, cache=cache)
        return jnp.argmax(out.logits[:, -1], axis=-1), out.cache

    compiled = {}  # every parameter is an argument (keep_unused): the ones a step does not read stay resident too
    with jax.set_mesh(mesh):
        for name, fn, args in (
            ("prefill chunk", prefill, (tokens(chunk, jnp.int32), tokens(chunk, jnp.bool_))),
            ("decode step", decode, (tokens(1, jnp.int32),)),
        ):
            lowered = jax.jit(fn, donate_argnums=1, keep_unused=True).lower(params, cache, *args)
            stats = lowered.compile().memory_analysis()
            io = stats.argument_size_in_bytes - fixed + stats.output_size_in_bytes - stats.alias_size_in_bytes
            compiled[name] = _Compiled(stats.temp_size_in_bytes, io)
    return compiled


def plan_memory(
    config: LingConfig,
    mesh_shape: Mapping[str, int],
    hardware: Hardware,
    *,
    batch: int,
    context: int,
    prefill_chunk: int = 2048,
    weights: str = STORED,
    dtype=jnp.bfloat16,
    model_name: str = "model",
    whole_model: bool = False,
    kernel_backend: str | None = None,
) -> MemoryPlan:
    """The per-device memory plan of generating `batch` sequences of up to `context` tokens with `config`'s model
    on a mesh of `mesh_shape` (e.g. {"expert": 8}) of `hardware`, compiled on this process's first devices (CPU
    stand-ins: start the process with XLA_FLAGS=--xla_force_host_platform_device_count=N). Raises ValueError for
    bad sizes and `ling_jax.sharding.ShardingError` for a mesh the model does not divide, before compiling.
    kernel_backend: the programs' (`ExecutionPolicy.kernel_backend`); None: "interpret_gpu" on CPU stand-ins,
    "auto" on accelerators."""
    check_weights(weights, "plan_memory")
    for name, value in (("batch", batch), ("context", context), ("prefill_chunk", prefill_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if prefill_chunk > context:
        raise ValueError(f"prefill_chunk {prefill_chunk} exceeds the context {context}")
    devices = math.prod(mesh_shape.values())
    available = jax.devices()
    if len(available) < devices:
        raise ValueError(
            f"the mesh {dict(mesh_shape)} needs {devices} devices, this process has {len(available)} "
            f"({available[0].platform}); on a CPU start it with XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{devices}"
        )
    mesh = make_mesh(mesh_shape, available[:devices])
    on_cpu = available[0].platform == "cpu"
    if kernel_backend is None:
        kernel_backend = "interpret_gpu" if on_cpu else "auto"
    policy = ExecutionPolicy(kernel_backend=kernel_backend)
    state = nnx.state(abstract_model(config, weights=weights, dtype=dtype))
    cache = jax.eval_shape(lambda: LingCache.create(config, batch, context, dtype))
    param_bytes = per_device_bytes(state, param_shardings(state, mesh))
    main_cache_bytes = per_device_bytes(cache, cache_shardings(cache, mesh))
    mtp_bytes = 0
    if config.num_nextn_predict_layers:
        mtp = jax.eval_shape(lambda: MTPCache.create(config, batch, context, dtype))
        mtp_bytes = per_device_bytes(mtp, cache_shardings(mtp, mesh))
    if param_bytes + main_cache_bytes > hardware.usable_bytes:
        programs = {}
        compiled_on = "nothing (the parameters and the cache alone exceed the usable memory)"
    else:
        programs = {"whole model": config} if whole_model else _layer_configs(config)
        standing_in = "CPU devices standing in" if on_cpu else f"{available[0].device_kind} devices"
        compiled_on = f"{devices} {standing_in}, kernel backend {policy.kernel_backend.value}"
    compiled = {
        kind: _compile_steps(
            layer_config,
            mesh,
            weights=weights,
            dtype=dtype,
            policy=policy,
            batch=batch,
            context=context,
            chunk=prefill_chunk,
        )
        for kind, layer_config in programs.items()
    }
    steps = tuple(
        StepMemory(
            name=step,
            temp_bytes=max(c[step].temp_bytes for c in compiled.values()),
            io_bytes=max(c[step].io_bytes for c in compiled.values()),
            temps_by_kind=tuple((kind, c[step].temp_bytes) for kind, c in compiled.items()),
        )
        for step in ("prefill chunk", "decode step")
        if compiled
    )
    return MemoryPlan(
        model=model_name,
        mesh_shape=tuple((axis, size) for axis, size in mesh.shape.items() if size > 1),
        hardware=hardware,
        batch=batch,
        context=context,
        prefill_chunk=prefill_chunk,
        weights=weights,
        param_bytes=param_bytes,
        cache_bytes=main_cache_bytes,
        mtp_cache_bytes=mtp_bytes,
        steps=steps,
        compiled_on=compiled_on,
        whole_model=whole_model,
    )


__all__ = [
    "HARDWARE",
    "Hardware",
    "MemoryPlan",
    "StepMemory",
    "abstract_model",
    "device_hardware",
    "per_device_bytes",
    "plan_memory",
]
