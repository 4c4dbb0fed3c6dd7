"""LingConfig parsing (spec §1): presets, transformers' save_pretrained spelling, inclusionAI's spelling, the
VL nesting, and the errors that keep a wrong default from silently changing the numerics."""

import dataclasses
import json

import pytest
from oracle import build_oracle, save_oracle

from ling_jax.config import DENSE, KDA, MLA, MOE, LingConfig
from ling_jax.presets import TINY, preset

FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _without(raw: dict, *keys: str) -> dict:
    return {k: v for k, v in raw.items() if k not in keys}


def _indices(kinds, kind) -> list[int]:
    return [i for i, k in enumerate(kinds) if k == kind]


# ------------------------------------------------------------------------------------------------ presets
def test_preset_ling_3_1_flash():
    c = preset("ling-3.1-flash")
    assert c.num_hidden_layers == 72
    assert _indices(c.layer_types, MLA) == list(range(7, 72, 8))
    assert len(_indices(c.layer_types, MLA)) == 9 and len(_indices(c.layer_types, KDA)) == 63
    assert _indices(c.mlp_layer_types, DENSE) == [0, 1, 2, 3]
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.kda_dim) == (4096, 64, 128, 8192)
    assert c.q_lora_rank == 1536
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.latent_dim) == (512, 64, 576)
    assert (c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim) == (128, 128, 192)
    assert (c.num_experts, c.n_group, c.topk_group, c.num_experts_per_tok) == (512, 8, 4, 8)
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5
    assert c.num_nextn_predict_layers == 1 and c.mtp_layer_index == 72
    assert not c.rope.is_yarn and c.rope.interleave


def test_preset_ling_3_0_flash():
    c = preset("ling-3.0-flash")
    assert c.num_hidden_layers == 42
    assert _indices(c.layer_types, MLA) == list(range(5, 42, 6))
    assert len(_indices(c.layer_types, KDA)) == 35
    assert _indices(c.mlp_layer_types, DENSE) == [0, 1]
    assert c.hidden_size == 2560 and c.num_attention_heads == 32
    assert c.q_lora_rank is None
    assert c.latent_dim == 576


def test_preset_ling_3_0_flash_vl():
    c = preset("ling-3.0-flash-vl")
    text = preset("ling-3.0-flash")
    assert c.layer_types == text.layer_types and c.mlp_layer_types == text.mlp_layer_types
    assert c.rope.is_yarn and c.rope.rope_type == "yarn"
    assert c.rope.factor == 2.0 and c.rope.original_max_position_embeddings == 131072
    assert c.rope.mrope_section == (8, 12, 12)


def test_preset_tiny_has_every_feature():
    c = preset("tiny")
    assert set(c.layer_types) == {KDA, MLA} and set(c.mlp_layer_types) == {DENSE, MOE}
    assert c.q_lora_rank is not None
    assert c.n_group > 0 and c.topk_group > 0
    assert c.shared_expert_intermediate_size > 0
    assert c.num_nextn_predict_layers == 1
    assert c.swiglu_limit(1, shared=False) == 7.0 and c.swiglu_limit(1, shared=True) == 7.0
    assert c.swiglu_limit(0, shared=False) is None  # the dense layer is never clipped


def test_unknown_preset_names_it():
    with pytest.raises(ValueError, match="ling-9.9-huge"):
        preset("ling-9.9-huge")


def test_config_is_frozen():
    c = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rope.theta = 1.0
    assert c.replace(hidden_size=128).hidden_size == 128 and c.hidden_size == 64


# save_pretrained spelling
@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("g3_list_dense2")
    save_oracle(build_oracle("g3_list_dense2"), path)
    return path


def test_save_pretrained_config_parses(saved_dir):
    raw = json.loads((saved_dir / "config.json").read_text())
    # the spelling this test is about: aliases, linear_head_dim, explicit lists, rope_parameters
    assert raw["head_dim"] == 8 and raw["linear_head_dim"] == 16
    for alias in (
        "num_experts_per_token",
        "num_expert_group",
        "moe_renormalize",
        "model_max_length",
        "num_nextn_predict_layers",
        "num_shared_experts",
        "rope_parameters",
        "layer_types",
    ):
        assert alias in raw, alias
    assert "num_experts_per_tok" not in raw and "norm_topk_prob" not in raw

    c = LingConfig.from_pretrained(saved_dir)
    assert c.head_dim == 16 and c.kda_dim == 48  # linear_head_dim, not the overwritten head_dim
    # explicit layer_types win over layer_group_size=3 (which would give KDA, KDA, MLA, ...)
    assert c.layer_types == (KDA, MLA, KDA, KDA, MLA, KDA)
    assert c.mlp_layer_types == (DENSE, DENSE, MOE, MOE, MOE, MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (16, 3, 4, 2)
    assert c.norm_topk_prob is True
    assert c.max_position_embeddings == 4096
    assert c.num_nextn_predict_layers == 0
    assert c.shared_expert_intermediate_size == 40  # moe_intermediate_size * num_shared_experts
    assert c.rope.theta == 20000.0 and not c.rope.is_yarn
    assert c.q_lora_rank is None
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (24, 12, 8, 10)
    assert (c.hidden_size, c.num_attention_heads, c.vocab_size, c.intermediate_size) == (96, 3, 113, 80)
    assert c.moe_intermediate_size == 40 and c.routed_scaling_factor == 2.5
    assert c.short_conv_kernel_size == 4 and c.kda_safe_gate and c.kda_lower_bound == -5.0
    assert c.pad_token_id == 0 and c.eos_token_ids == (1,)


def test_from_pretrained_accepts_dir_or_file(saved_dir):
    assert LingConfig.from_pretrained(saved_dir) == LingConfig.from_pretrained(saved_dir / "config.json")
    assert LingConfig.from_pretrained(str(saved_dir)) == LingConfig.from_pretrained(saved_dir)


def test_rope_theta_inside_rope_parameters_wins(saved_dir):
    raw = json.loads((saved_dir / "config.json").read_text())
    assert LingConfig.from_dict({**raw, "rope_theta": 1.0}).rope.theta == 20000.0
    no_dict_theta = {**raw, "rope_parameters": {"rope_type": "default"}, "rope_theta": 123.0}
    assert LingConfig.from_dict(no_dict_theta).rope.theta == 123.0


# ------------------------------------------------------------------------------------------------ inclusionAI spelling
def test_layer_group_size_int():
    c = LingConfig.from_dict(
        {
            **TINY,
            "num_hidden_layers": 6,
            "layer_group_size": 3,
            "expert_swiglu_limit_list": [],
            "share_expert_swiglu_limit_list": [],
        }
    )
    assert c.layer_types == (KDA, KDA, MLA, KDA, KDA, MLA)


def test_layer_group_size_list():
    c = LingConfig.from_dict({**TINY, "layer_group_size": [1, 0, 1, 2]})
    assert c.layer_types == (KDA, MLA, KDA, MLA)


@pytest.mark.parametrize("group", [0, -1])
def test_layer_group_size_non_positive_is_all_mla(group):
    c = LingConfig.from_dict({**TINY, "layer_group_size": group})
    assert c.layer_types == (MLA,) * 4


def test_first_k_dense_replace():
    assert LingConfig.from_dict({**TINY, "first_k_dense_replace": 3}).mlp_layer_types == (DENSE, DENSE, DENSE, MOE)
    assert LingConfig.from_dict({**TINY, "first_k_dense_replace": 0}).mlp_layer_types == (MOE,) * 4


def test_single_expert_means_all_dense():
    raw = {
        **_without(TINY, "first_k_dense_replace"),
        "num_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 0,
        "topk_group": 0,
    }
    assert LingConfig.from_dict(raw).mlp_layer_types == (DENSE,) * 4


def test_shared_expert_width():
    assert LingConfig.from_dict({**TINY, "num_shared_experts": 2}).shared_expert_intermediate_size == 64
    c = LingConfig.from_dict({**TINY, "num_shared_experts": 2, "moe_shared_expert_intermediate_size": 80})
    assert c.shared_expert_intermediate_size == 80
    # with the explicit width the expert count is not needed
    c = LingConfig.from_dict({**_without(TINY, "num_shared_experts"), "moe_shared_expert_intermediate_size": 24})
    assert c.shared_expert_intermediate_size == 24


def test_swiglu_limits():
    c = LingConfig.from_dict(
        {**TINY, "expert_swiglu_limit_list": [0, None, 5.5], "share_expert_swiglu_limit_list": [3, 0, 0, 9.0]}
    )
    assert [c.swiglu_limit(i, shared=False) for i in range(5)] == [None, None, 5.5, None, None]
    assert [c.swiglu_limit(i, shared=True) for i in range(5)] == [3.0, None, None, 9.0, None]
    c = LingConfig.from_dict(_without(TINY, "expert_swiglu_limit_list", "share_expert_swiglu_limit_list"))
    assert all(c.swiglu_limit(i, shared=s) is None for i in range(4) for s in (False, True))


def test_q_lora_rank_null_or_int():
    assert LingConfig.from_dict({**TINY, "q_lora_rank": None}).q_lora_rank is None
    assert LingConfig.from_dict(_without(TINY, "q_lora_rank")).q_lora_rank is None
    assert LingConfig.from_dict({**TINY, "q_lora_rank": 24}).q_lora_rank == 24


def test_inclusionai_aliases():
    raw = _without(
        TINY,
        "num_experts",
        "num_experts_per_tok",
        "n_group",
        "num_shared_experts",
        "norm_topk_prob",
        "max_position_embeddings",
        "num_nextn_predict_layers",
    )
    raw.update(
        num_local_experts=16,
        num_experts_per_token=4,
        num_expert_group=4,
        n_shared_experts=1,
        moe_renormalize=False,
        model_max_length=2048,
        num_mtp_layers=1,
    )
    c = LingConfig.from_dict(raw)
    assert (c.num_experts, c.num_experts_per_tok, c.n_group, c.shared_expert_intermediate_size) == (16, 4, 4, 32)
    assert c.norm_topk_prob is False
    assert c.max_position_embeddings == 2048 and c.num_nextn_predict_layers == 1
    # the same value under both names is fine
    assert LingConfig.from_dict({**TINY, "num_local_experts": 16}).num_experts == 16


def test_norm_topk_prob_false_is_kept():
    assert LingConfig.from_dict({**TINY, "norm_topk_prob": False}).norm_topk_prob is False


def test_rope_scaling_yarn_all_fields():
    scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.707,
        "mscale_all_dim": 0.5,
        "attn_factor": 1.25,
        "extrapolation_factor": 0.75,
        "truncate": False,
        "mrope_section": [2, 1, 1],
    }
    rope = LingConfig.from_dict({**TINY, "rope_scaling": scaling}).rope
    assert rope.is_yarn and rope.rope_type == "yarn" and rope.theta == 10000.0
    assert (rope.factor, rope.original_max_position_embeddings) == (4.0, 256)
    assert (rope.beta_fast, rope.beta_slow) == (16.0, 2.0)
    assert (rope.mscale, rope.mscale_all_dim, rope.attn_factor) == (0.707, 0.5, 1.25)
    assert rope.extrapolation_factor == 0.75 and rope.truncate is False
    assert rope.mrope_section == (2, 1, 1)


def test_rope_scaling_variants():
    deepseek = {"type": "deepseek_yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
    rope = LingConfig.from_dict({**TINY, "rope_scaling": deepseek}).rope
    assert rope.is_yarn and rope.rope_type == "yarn"
    assert (rope.beta_fast, rope.beta_slow, rope.mscale, rope.mscale_all_dim) == (32.0, 1.0, None, None)
    # factor 1: YaRN is a no-op and needs no original length
    assert not LingConfig.from_dict({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 1.0}}).rope.is_yarn
    # theta inside rope_scaling (v5 rope_parameters under the old name) wins over the top-level key
    rope = LingConfig.from_dict({**TINY, "rope_scaling": {"rope_type": "default", "rope_theta": 5e5}}).rope
    assert rope.theta == 5e5 and not rope.is_yarn


def test_rope_interleave():
    assert LingConfig.from_dict(TINY).rope.interleave is True
    assert LingConfig.from_dict({**TINY, "rope_interleave": False}).rope.interleave is False


def test_quantization_config():
    raw = {
        **TINY,
        "quantization_config": {
            **FP8_BLOCK,
            "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"],
            "routed_experts_quant_method": "mxfp4",
        },
    }
    q = LingConfig.from_dict(raw).quantization
    assert q.quant_method == "fp8" and q.weight_block_size == (128, 128) and q.activation_scheme == "dynamic"
    assert q.modules_to_not_convert == ("lm_head", "model.layers.0.mlp")
    assert q.routed_experts_quant_method == "mxfp4"
    q = LingConfig.from_dict({**TINY, "quantization_config": {**FP8_BLOCK, "ignored_layers": ["lm_head"]}}).quantization
    assert q.modules_to_not_convert == ("lm_head",) and q.routed_experts_quant_method is None
    assert LingConfig.from_dict(TINY).quantization is None


def test_vl_nesting_merges_top_level_keys():
    text = _without(TINY, "eos_token_id", "pad_token_id")
    raw = {
        "model_type": "bailing_moe_v3_vl",
        "text_config": text,
        "vision_config": {"depth": 2},
        "quantization_config": {**FP8_BLOCK, "routed_experts_quant_method": "mxfp4"},
        "eos_token_id": [5, 6],
        "pad_token_id": 7,
        "image_token_id": 157157,
    }
    c = LingConfig.from_dict(raw)
    assert c.quantization is not None and c.quantization.routed_experts_quant_method == "mxfp4"
    assert c.eos_token_ids == (5, 6) and c.pad_token_id == 7
    assert c.layer_types == LingConfig.from_dict(TINY).layer_types
    # keys the text config has itself win over the top level
    c = LingConfig.from_dict({**raw, "text_config": TINY})
    assert c.eos_token_ids == (1,) and c.pad_token_id == 0


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "key",
    [
        "hidden_size",
        "norm_topk_prob",
        "kv_lora_rank",
        "vocab_size",
        "num_hidden_layers",
        "routed_scaling_factor",
        "rms_norm_eps",
        "max_position_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "qk_rope_head_dim",
        "rope_theta",
    ],
)
def test_missing_required_key(key):
    with pytest.raises(ValueError, match=key):
        LingConfig.from_dict(_without(TINY, key))


def test_missing_required_key_given_as_null():
    with pytest.raises(ValueError, match="norm_topk_prob"):
        LingConfig.from_dict({**TINY, "norm_topk_prob": None})


def test_missing_layer_group_size_without_layer_types():
    with pytest.raises(ValueError, match="layer_group_size"):
        LingConfig.from_dict(_without(TINY, "layer_group_size"))
    explicit = ["linear_attention", "full_attention"] * 2
    assert LingConfig.from_dict({**_without(TINY, "layer_group_size"), "layer_types": explicit}).layer_types == (
        KDA,
        MLA,
        KDA,
        MLA,
    )


def test_missing_first_k_dense_replace_without_mlp_layer_types():
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        LingConfig.from_dict(_without(TINY, "first_k_dense_replace"))
    explicit = ["dense", "sparse", "sparse", "dense"]
    c = LingConfig.from_dict({**_without(TINY, "first_k_dense_replace"), "mlp_layer_types": explicit})
    assert c.mlp_layer_types == (DENSE, MOE, MOE, DENSE)


def test_missing_num_shared_experts():
    with pytest.raises(ValueError, match="num_shared_experts"):
        LingConfig.from_dict(_without(TINY, "num_shared_experts"))


def test_missing_kda_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        LingConfig.from_dict(_without(TINY, "head_dim"))


@pytest.mark.parametrize(
    "canonical, alias, a, b",
    [
        ("num_experts", "num_local_experts", 16, 32),
        ("num_experts_per_tok", "num_experts_per_token", 4, 2),
        ("n_group", "num_expert_group", 4, 2),
        ("norm_topk_prob", "moe_renormalize", True, False),
        ("max_position_embeddings", "model_max_length", 4096, 8192),
    ],
)
def test_alias_contradiction_names_both(canonical, alias, a, b):
    with pytest.raises(ValueError) as info:
        LingConfig.from_dict({**TINY, canonical: a, alias: b})
    assert canonical in str(info.value) and alias in str(info.value)


def test_layer_types_wrong_length():
    with pytest.raises(ValueError, match="layer_types"):
        LingConfig.from_dict({**TINY, "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        LingConfig.from_dict({**TINY, "mlp_layer_types": ["dense"] * 5})
    with pytest.raises(ValueError, match="layer_group_size"):
        LingConfig.from_dict({**TINY, "layer_group_size": [1, 0, 1]})


def test_layer_types_unknown_entry():
    with pytest.raises(ValueError, match="layer_types"):
        LingConfig.from_dict({**TINY, "layer_types": ["linear_attention", "sliding_attention"] * 2})


def test_layer_group_size_must_divide_layers():
    with pytest.raises(ValueError, match="layer_group_size"):
        LingConfig.from_dict({**TINY, "layer_group_size": 3})


def test_n_group_must_divide_experts():
    with pytest.raises(ValueError, match="n_group"):
        LingConfig.from_dict({**TINY, "n_group": 3, "topk_group": 2})


def test_topk_group_at_most_n_group():
    with pytest.raises(ValueError, match="topk_group"):
        LingConfig.from_dict({**TINY, "topk_group": 5})


def test_top_k_at_most_experts():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LingConfig.from_dict({**TINY, "num_experts_per_tok": 17, "n_group": 0, "topk_group": 0})


@pytest.mark.parametrize(
    "key, value",
    [
        ("score_function", "softmax"),
        ("use_mla_nope", True),
        ("short_conv_kernel_size", None),
        ("gated_attention_proj_granularity_type", "element_wise"),
        ("moe_router_enable_expert_bias", False),
        ("full_attention_type", "gqa"),
        ("router_dtype", "bf16"),
    ],
)
def test_unsupported_values(key, value):
    with pytest.raises(ValueError, match=key):
        LingConfig.from_dict({**TINY, key: value})


def test_supported_values_of_refused_keys_are_accepted():
    c = LingConfig.from_dict(
        {
            **TINY,
            "score_function": "sigmoid",
            "use_mla_nope": False,
            "gated_attention_proj_granularity_type": "head_wise",
            "moe_router_enable_expert_bias": True,
            "router_dtype": "fp32",
        }
    )
    assert c == LingConfig.from_dict(TINY)


@pytest.mark.parametrize(
    "quant, key",
    [
        ({**FP8_BLOCK, "quant_method": "awq"}, "quant_method"),
        ({**FP8_BLOCK, "routed_experts_quant_method": "w4afp8"}, "routed_experts_quant_method"),
        (_without(FP8_BLOCK, "weight_block_size"), "weight_block_size"),
        ({**FP8_BLOCK, "activation_scheme": "static"}, "activation_scheme"),
    ],
)
def test_unsupported_quantization(quant, key):
    with pytest.raises(ValueError, match=key):
        LingConfig.from_dict({**TINY, "quantization_config": quant})


def test_yarn_needs_original_max_position_embeddings():
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        LingConfig.from_dict({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope_type"):
        LingConfig.from_dict({**TINY, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_swiglu_limit_must_be_a_list():
    with pytest.raises(ValueError, match="expert_swiglu_limit_list"):
        LingConfig.from_dict({**TINY, "expert_swiglu_limit_list": 7.0})


def test_from_pretrained_errors_name_the_file(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps(_without(TINY, "kv_lora_rank")))
    for path in (tmp_path, file):
        with pytest.raises(ValueError) as info:
            LingConfig.from_pretrained(path)
        assert str(file) in str(info.value) and "kv_lora_rank" in str(info.value)

    file.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        LingConfig.from_pretrained(tmp_path)
    assert str(file) in str(info.value)

    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        LingConfig.from_pretrained(missing)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    ("key", "field"), [("moe_capacity_factor", "moe_capacity_factor"), ("moe_all_to_all", "moe_exchange")]
)
def test_runtime_options_in_config_json_are_refused(key, field):
    with pytest.raises(ValueError, match=rf"'{key}': is a ling-jax runtime option.*ExecutionPolicy\({field}=\.\.\.\)"):
        LingConfig.from_dict({**TINY, key: "ragged" if key == "moe_all_to_all" else 1.25})


def test_training_keys_in_config_json_are_ignored():
    assert LingConfig.from_dict({**TINY, "mtp_loss_scaling_factor": 0.1}) == LingConfig.from_dict(TINY)
