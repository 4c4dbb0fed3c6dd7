"""ling-jax: Ling 3.x hybrid (KDA + gated MLA + MoE) models in JAX / Flax NNX.

The names below are the public API: `from ling_jax import Generator` works whichever wing a name lives in, and
each is imported on first use, so `import ling_jax` stays cheap (orbax and the tokenizers load only when asked).
The package's layout: the model core at the top (config, presets, policy, context, layers, rope, mrope, cache,
kda, mla, model, sharding, quant, functional), `build` for "which model does this config.json build", and the
wings `moe/`, `vl/`, `checkpoints/`, `generation/`, `training/` (docs/layout.md).
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    # configuration
    "LingConfig": "ling_jax.config",
    "RopeConfig": "ling_jax.config",
    "QuantizationConfig": "ling_jax.config",
    "PRESETS": "ling_jax.presets",
    "preset": "ling_jax.presets",
    "ExecutionPolicy": "ling_jax.policy",
    "KernelBackend": "ling_jax.policy",
    "KDAMode": "ling_jax.policy",
    "MLAMode": "ling_jax.policy",
    "MoEExchange": "ling_jax.policy",
    "FP8Matmul": "ling_jax.policy",
    # the model and its caches
    "LingForCausalLM": "ling_jax.model",
    "LingOutput": "ling_jax.model",
    "KDAState": "ling_jax.cache",
    "LingCache": "ling_jax.cache",
    "MLAState": "ling_jax.cache",
    "MTPCache": "ling_jax.cache",
    "PagedMLAState": "ling_jax.cache",
    "functional": "ling_jax",
    # which model a checkpoint builds; the VL model
    "build_model": "ling_jax.build",
    "load_model_config": "ling_jax.build",
    "LingVLConfig": "ling_jax.vl.config",
    "LingVLForConditionalGeneration": "ling_jax.vl.model",
    # checkpoints
    "load_hf_checkpoint": "ling_jax.checkpoints.hf",
    "load_checkpoint": "ling_jax.checkpoints.orbax",
    "CheckpointError": "ling_jax.checkpoints.hf",
    # sharding
    "make_mesh": "ling_jax.sharding",
    "RULES": "ling_jax.sharding",
    "shard_model": "ling_jax.sharding",
    "ShardedLM": "ling_jax.generation.sharded",
    # generation
    "Generator": "ling_jax.generation.generator",
    "GenerationStats": "ling_jax.generation.generator",
    "SamplingParams": "ling_jax.generation.sampling",
    "load_tokenizer": "ling_jax.generation.tokenizer",
    # training
    "TrainConfig": "ling_jax.training.train",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ling_jax' has no attribute {name!r}")
    value = (
        importlib.import_module(f"ling_jax.{name}")
        if module == "ling_jax"
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
