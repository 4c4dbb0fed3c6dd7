"""Which model a checkpoint builds: the one place that knows both the text model and the VL model.

config = load_model_config(path)       # LingVLConfig when config.json has a vision_config, else LingConfig
model = build_model(config, rngs=nnx.Rngs(0))
abstract = abstract_model(config)      # the same model as shapes only (nothing allocated), in about a second
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.config_json import config_file, read_json
from ling_jax.model import LingForCausalLM
from ling_jax.policy import ExecutionPolicy
from ling_jax.vl.config import LingVLConfig
from ling_jax.vl.model import LingVLForConditionalGeneration


def is_vl_checkpoint(path: str | os.PathLike) -> bool:
    """True when the checkpoint's config.json has a `vision_config` (a Ling-VL checkpoint)."""
    return "vision_config" in read_json(config_file(path))


def load_model_config(path: str | os.PathLike) -> LingConfig | LingVLConfig:
    """A checkpoint's config: `LingVLConfig` when config.json has a `vision_config`, else `LingConfig`."""
    if is_vl_checkpoint(path):
        return LingVLConfig.from_pretrained(path)
    return LingConfig.from_pretrained(path)


def text_config_of(config: LingConfig | LingVLConfig) -> LingConfig:
    return config.text if isinstance(config, LingVLConfig) else config


def build_model(
    config: LingConfig | LingVLConfig,
    *,
    rngs: nnx.Rngs,
    dtype=jnp.bfloat16,
    policy: ExecutionPolicy | None = None,
) -> LingForCausalLM:
    """The model a config describes: `LingVLForConditionalGeneration` for a VL config, else `LingForCausalLM`;
    policy: how it runs (None: `ExecutionPolicy()`)."""
    cls = LingVLForConditionalGeneration if isinstance(config, LingVLConfig) else LingForCausalLM
    return cls(config, rngs=rngs, dtype=dtype, policy=policy)


class _ReplacingStream(nnx.RngStream):
    """An `nnx.RngStream` that draws the same keys (the stream key folded with the count), but replaces its count
    instead of updating it in place. Inside a trace (`nnx.eval_shape`, `jax.jit`) flax's in-place update looks up
    `.sharding` on the traced count, and each failed lookup walks the whole program traced so far to word an error
    message: building Ling-3.1-flash that way took 45 s (quadratic in its 72 layers), this way 1 s."""

    def __call__(self) -> jax.Array:
        count = self.count.get_value()
        self.count.set_value(count + 1)
        return jax.random.fold_in(self.key.get_value(), count)


def model_rngs(seed: int) -> nnx.Rngs:
    """`nnx.Rngs(seed)` whose streams give the same keys, and whose count updates stay cheap while a model is built
    inside a trace (`_ReplacingStream`)."""
    rngs = nnx.Rngs(seed)
    for name, stream in list(rngs.items()):
        setattr(rngs, name, _ReplacingStream(stream.key.get_value(), tag=name))
    return rngs


def abstract_model(
    config: LingConfig | LingVLConfig, *, dtype=jnp.bfloat16, policy: ExecutionPolicy | None = None
) -> LingForCausalLM:
    """`build_model(config, ...)` as shapes only (`jax.ShapeDtypeStruct` parameters, nothing allocated), built
    with `model_rngs`: the loaders' and the memory plan's starting point."""
    return nnx.eval_shape(lambda: build_model(config, rngs=model_rngs(0), dtype=dtype, policy=policy))
