"""A tiny block-FP8 HF checkpoint of the sharding tests' two-layer config (KDA + dense MLP, MLA + MoE, an MTP layer),
with 16 x 16 scale blocks: small enough that every mesh of the sharding tests splits whole blocks."""

from __future__ import annotations

import numpy as np
from checkpoint_factory import make_quantized_checkpoint, write_hf_checkpoint

from convert.synthetic import checkpoint_tensors, config_dict, random_weight
from ling_jax.config import LingConfig
from ling_jax.presets import preset

BLOCK = (16, 16)


def sharding_test_config() -> LingConfig:
    """tests/test_sharding.py's config: 32 experts in 4 groups, two layers (every kind of block once)."""
    return preset("tiny").replace(
        num_experts=32,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        vocab_size=264,
        num_hidden_layers=2,
        layer_types=("kda", "mla"),
        mlp_layer_types=("dense", "moe"),
    )


def write_tiny_fp8_checkpoint(directory, *, mxfp4_experts: bool = False, seed: int = 0) -> LingConfig:
    """Random weights of `sharding_test_config()` quantised to block FP8 (MXFP4 routed experts if asked: int8
    packed codes with raw uint8 exponents, the least direct spelling) in `directory` (its `src` subdirectory holds
    the unquantised copy)."""
    config = sharding_test_config()
    rng = np.random.default_rng(seed)
    tensors = {name: random_weight(name, shape, rng) for name, shape in checkpoint_tensors(config)}
    source = directory / "src"
    write_hf_checkpoint(source, config_dict(config), tensors)
    make_quantized_checkpoint(
        source,
        directory,
        block=BLOCK,
        mxfp4_experts=mxfp4_experts,
        mxfp4_scale_format="uint8",
        mxfp4_packed_dtype="int8",
        num_shards=3,
    )
    return config
