"""Configs for the published shapes and tiny test models.

Ling-3.1-flash is its published shape (spec §0: expert width 1280, dense width 10240, q-LoRA 1536, 72 layers +
1 MTP layer); its block-FP8 checkpoint comes to within 0.1% of the published 573,753,281,152 tensor bytes
(tests/test_presets.py). The SwiGLU clip lists are those the checkpoints' config.json files are reported to
carry (3.1-flash: 10 on the shared experts of layers 64-71 and the routed experts of layers 65-71; 3.0-flash:
routed 4 on layers 35-41, shared 5 on layers 34-39 and 7 on 40-41); the VL text model is taken to share
3.0-flash's. Values the spec marks UNCONFIRMED (the VL rope theta, its clip lists) are the best public guesses;
a real checkpoint's config.json always wins (`LingConfig.from_pretrained`).
"""

from __future__ import annotations

from ling_jax.config import LingConfig

_LING_COMMON = {
    "vocab_size": 157184,
    "head_dim": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 512,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 6e6,
    "max_position_embeddings": 262144,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 156892,
    "eos_token_id": 156895,
}

LING_3_1_FLASH = {
    **_LING_COMMON,
    "hidden_size": 4096,
    "num_hidden_layers": 72,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "layer_group_size": 8,
    "first_k_dense_replace": 4,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1280,
    "expert_swiglu_limit_list": [0] * 65 + [10.0] * 7,
    "share_expert_swiglu_limit_list": [0] * 64 + [10.0] * 8,
}

LING_3_0_FLASH = {
    **_LING_COMMON,
    "hidden_size": 2560,
    "num_hidden_layers": 42,
    "num_attention_heads": 32,
    "q_lora_rank": None,
    "layer_group_size": 6,
    "first_k_dense_replace": 2,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "expert_swiglu_limit_list": [0] * 35 + [4.0] * 7,
    "share_expert_swiglu_limit_list": [0] * 34 + [5.0] * 6 + [7.0] * 2,
}

LING_3_0_FLASH_VL_TEXT = {
    **LING_3_0_FLASH,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 131072,
        "beta_fast": 32,
        "beta_slow": 1,
        "mrope_section": [8, 12, 12],
    },
}

# Every architectural feature at toy size: KDA and MLA groups, q-LoRA, dense first layer, 16 experts in
# 4 groups, shared expert, SwiGLU limits, an MTP layer.
TINY = {
    **_LING_COMMON,
    "vocab_size": 259,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "layer_group_size": 2,
    "first_k_dense_replace": 1,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "expert_swiglu_limit_list": [0, 7.0, 7.0, 7.0],
    "share_expert_swiglu_limit_list": [0, 7.0, 7.0, 7.0],
    "pad_token_id": 0,
    "eos_token_id": 1,
}

# The demo model trained by scripts/train.py (docs/demo_model.md): every architectural feature, small enough to
# train on one GPU in minutes. Two groups of 3 KDA + 1 MLA layers, q-LoRA, one dense layer, 16 experts in 4
# groups (2 kept per token), shared expert, SwiGLU limits, an MTP layer; the vocab is the demo tokenizer's
# (pad = 0, eos = 1).
DEMO = {
    **_LING_COMMON,
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 64,
    "num_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "layer_group_size": 4,
    "first_k_dense_replace": 1,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "expert_swiglu_limit_list": [0] + [7.0] * 7,
    "share_expert_swiglu_limit_list": [0] + [7.0] * 7,
    "pad_token_id": 0,
    "eos_token_id": 1,
}

PRESETS: dict[str, LingConfig] = {
    "ling-3.1-flash": LingConfig.from_dict(LING_3_1_FLASH),
    "ling-3.0-flash": LingConfig.from_dict(LING_3_0_FLASH),
    "ling-3.0-flash-vl": LingConfig.from_dict(LING_3_0_FLASH_VL_TEXT),
    "tiny": LingConfig.from_dict(TINY),
    "ling-demo": LingConfig.from_dict(DEMO),
    "tiny-yarn-neox": LingConfig.from_dict(
        {
            **TINY,
            "q_lora_rank": None,
            "rope_interleave": False,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        }
    ),
}


def preset(name: str) -> LingConfig:
    """The config named `name` in `PRESETS`; an unknown name lists the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
