"""Which model a checkpoint builds: the one place that knows both the text model and the VL model.

config = load_model_config(path)       # LingVLConfig when config.json has a vision_config, else LingConfig
model = build_model(config, rngs=nnx.Rngs(0))
"""

from __future__ import annotations

import os

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
