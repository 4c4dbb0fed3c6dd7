"""Reading a checkpoint's config.json: the field values of `ling_jax.config`'s dataclasses, as plain dicts.

inclusionAI's own config files, transformers' `save_pretrained` output (alias key names, `linear_head_dim`,
explicit `layer_types`) and the VL checkpoint's nested `text_config` are all accepted. SGLang and
transformers disagree on the default of almost every key (spec §1), so keys whose meaning would change the
numerics are required, and a key given under two spellings with two values is an error.

This module knows JSON, not the dataclasses (`ling_jax.config` builds them from `text_fields`), so the two
import one way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"
YARN_TYPES = ("yarn", "deepseek_yarn")

# canonical key -> aliases that mean the same thing
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts",),
    "num_experts_per_tok": ("num_experts_per_token",),
    "n_group": ("num_expert_group",),
    "num_shared_experts": ("n_shared_experts",),
    "norm_topk_prob": ("moe_renormalize",),
    "max_position_embeddings": ("model_max_length",),
    "num_nextn_predict_layers": ("num_mtp_layers",),
    "rope_scaling": ("rope_parameters",),
}
_HF_LAYER_TYPES = {"linear_attention": KDA, "full_attention": MLA}
_HF_MLP_TYPES = {"dense": DENSE, "sparse": MOE}
# model_type of Ling 3.x: `bailing_hybrid` (inclusionAI, transformers) or `bailing_moe_v3` (vLLM); of Ling-VL
_TEXT_MODEL_TYPES = ("bailing_hybrid", "bailing_moe_v3")
_VL_MODEL_TYPES = ("bailing_moe_v3_vl",)
# ling-jax runtime options that config.json once carried -> the `ExecutionPolicy` field that holds them now
_RUNTIME_OPTIONS = {"moe_capacity_factor": "moe_capacity_factor", "moe_all_to_all": "moe_exchange"}


def config_error(key: str, message: str) -> ValueError:
    return ValueError(f"config key '{key}': {message}")


def config_file(path: str | os.PathLike) -> str:
    """The config.json of a checkpoint directory, or `path` itself when it is a file."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json at {file}")
    return file


def read_json(file: str) -> dict:
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from e


def parse_file(path: str | os.PathLike, parse: Callable[[dict], T]) -> T:
    """`parse` of the config.json at `path` (a file or a checkpoint directory); its errors name the file."""
    file = config_file(path)
    raw = read_json(file)
    try:
        return parse(raw)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def _integer(key: str, value: Any) -> int:
    """A JSON integer (a float without a fraction too, as some writers emit); never a bool, string or 16.5."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise config_error(key, f"must be an integer, got {value!r}")
    return int(value)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise config_error(key, f"must be a number, got {value!r}")
    return float(value)


class _Reader:
    """Looks keys up under their canonical name or an alias; refuses contradictions."""

    def __init__(self, raw: Mapping[str, Any]):
        self.raw = raw

    def get(self, key: str, default: Any = None) -> Any:
        names = (key, *_ALIASES.get(key, ()))
        present = [(name, self.raw[name]) for name in names if name in self.raw]
        values = [value for _, value in present if value is not None]
        if any(value != values[0] for value in values[1:]):
            found = ", ".join(f"{name}={value!r}" for name, value in present)
            raise config_error(key, f"given under several names with different values ({found})")
        return values[0] if values else default

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            names = " / ".join((key, *_ALIASES.get(key, ())))
            raise config_error(key, f"missing (looked for {names}); it must be read from the checkpoint")
        return value

    def require_int(self, key: str) -> int:
        return _integer(key, self.require(key))

    def require_float(self, key: str) -> float:
        return _number(key, self.require(key))

    def get_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key)
        return default if value is None else _integer(key, value)


def text_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`LingConfig`'s fields from a config.json dict (inclusionAI or transformers spelling, or a VL config with
    text_config); `rope` is a dict of `RopeConfig` fields, `quantization` one of `QuantizationConfig` fields or
    None. Keys that only training reads (`mtp_loss_scaling_factor`, as HF configs carry it) are ignored."""
    if "text_config" in raw:
        _check_model_type(raw, "model_type", _VL_MODEL_TYPES)
        text = dict(raw["text_config"])
        _check_model_type(text, "text_config.model_type", _TEXT_MODEL_TYPES)
        for key in ("quantization_config", "eos_token_id", "pad_token_id"):
            if key in raw and key not in text:
                text[key] = raw[key]
        if raw.get("mrope_section") is not None:
            text["mrope_section"] = _vl_mrope_section(raw, text)
        raw = text
    else:
        _check_model_type(raw, "model_type", _TEXT_MODEL_TYPES)
    r = _Reader(raw)
    _refuse_unsupported(r)
    num_layers = r.require_int("num_hidden_layers")
    num_experts = r.require_int("num_experts")
    moe_width = r.require_int("moe_intermediate_size")
    shared_width = r.get("moe_shared_expert_intermediate_size")
    if shared_width is None:
        shared_width = moe_width * r.require_int("num_shared_experts")
    else:
        shared_width = _integer("moe_shared_expert_intermediate_size", shared_width)
    eos = r.get("eos_token_id")
    eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
    # mtp_loss_scaling_factor is not read: it weighs a training loss (TrainConfig.mtp_loss_scale), not the model
    return {
        "vocab_size": r.require_int("vocab_size"),
        "hidden_size": r.require_int("hidden_size"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": r.require_int("num_attention_heads"),
        "head_dim": _integer("linear_head_dim", raw["linear_head_dim"])
        if raw.get("linear_head_dim")
        else r.require_int("head_dim"),
        "intermediate_size": r.require_int("intermediate_size"),
        "moe_intermediate_size": moe_width,
        "shared_expert_intermediate_size": shared_width,
        "num_experts": num_experts,
        "num_experts_per_tok": r.require_int("num_experts_per_tok"),
        "n_group": r.get_int("n_group", 0),
        "topk_group": r.get_int("topk_group", 0),
        "norm_topk_prob": bool(r.require("norm_topk_prob")),
        "routed_scaling_factor": r.require_float("routed_scaling_factor"),
        "layer_types": _parse_layer_types(r, num_layers),
        "mlp_layer_types": _parse_mlp_layer_types(r, num_layers, num_experts),
        "q_lora_rank": r.get_int("q_lora_rank"),
        "kv_lora_rank": r.require_int("kv_lora_rank"),
        "qk_nope_head_dim": r.require_int("qk_nope_head_dim"),
        "qk_rope_head_dim": r.require_int("qk_rope_head_dim"),
        "v_head_dim": r.require_int("v_head_dim"),
        "short_conv_kernel_size": r.require_int("short_conv_kernel_size"),
        "rms_norm_eps": r.require_float("rms_norm_eps"),
        "rope": _parse_rope(r),
        "max_position_embeddings": r.require_int("max_position_embeddings"),
        "no_kda_lora": bool(r.get("no_kda_lora", True)),
        "kda_safe_gate": bool(r.get("kda_safe_gate", True)),
        "kda_lower_bound": float(r.get("kda_lower_bound", -5.0)),
        "expert_swiglu_limit_list": _limits(r, "expert_swiglu_limit_list"),
        "share_expert_swiglu_limit_list": _limits(r, "share_expert_swiglu_limit_list"),
        "num_nextn_predict_layers": r.get_int("num_nextn_predict_layers", 0),
        "tie_word_embeddings": bool(r.get("tie_word_embeddings", False)),
        "pad_token_id": r.get("pad_token_id"),
        "eos_token_ids": tuple(_integer("eos_token_id", e) for e in eos_list),
        "quantization": _parse_quantization(r),
    }


def _vl_mrope_section(raw: Mapping[str, Any], text: Mapping[str, Any]) -> list[int]:
    """A VL config's top-level mrope_section, which must agree with one in text_config if both are given."""
    section = list(raw["mrope_section"])
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    inner = rope.get("mrope_section", text.get("mrope_section"))
    if inner is not None and list(inner) != section:
        raise config_error("mrope_section", f"top level {section} contradicts text_config's {list(inner)}")
    return section


def _refuse_unsupported(r: _Reader) -> None:
    for key, field in _RUNTIME_OPTIONS.items():
        if key in r.raw:
            raise config_error(
                key,
                f"is a ling-jax runtime option, not a checkpoint setting: remove it from config.json and pass "
                f"ExecutionPolicy({field}=...) to the model instead",
            )
    if "short_conv_kernel_size" in r.raw and r.raw["short_conv_kernel_size"] is None:
        raise config_error(
            "short_conv_kernel_size", "null selects the Ling-2.5 lightning-attention path, which is not supported"
        )
    if r.get("full_attention_type", "mla") != "mla":
        raise config_error("full_attention_type", "only 'mla' (Ling 3.x) is supported")
    if r.get("moe_router_enable_expert_bias", True) is False:
        raise config_error("moe_router_enable_expert_bias", "Ling 3.x routing needs the expert bias (sigmoid scoring)")
    if r.get("score_function", "sigmoid") != "sigmoid":
        raise config_error("score_function", "only sigmoid scoring is supported")
    granularity = r.get("gated_attention_proj_granularity_type", "head_wise")
    if granularity != "head_wise":
        raise config_error(
            "gated_attention_proj_granularity_type", f"only 'head_wise' is supported, got {granularity!r}"
        )
    if r.get("use_mla_nope", False):
        raise config_error("use_mla_nope", "MLA without RoPE is not supported (spec §3.6)")
    if r.get("router_dtype", "fp32") not in ("fp32", "float32"):
        raise config_error("router_dtype", "the router runs in fp32")


def _check_model_type(raw: Mapping[str, Any], key: str, known: tuple[str, ...]) -> None:
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in known:
        raise config_error(key, f"{model_type!r} is not a Ling 3.x model (expected {' or '.join(map(repr, known))})")


def _explicit_types(r: _Reader, key: str, names: dict[str, str]) -> tuple[str, ...] | None:
    """transformers' explicit per-layer type list, translated; None when the key is absent."""
    explicit = r.get(key)
    if explicit is None:
        return None
    unknown = sorted({t for t in explicit if t not in names})
    if unknown:
        raise config_error(key, f"unknown entries {unknown}; expected {sorted(names)}")
    return tuple(names[t] for t in explicit)


def _parse_layer_types(r: _Reader, num_layers: int) -> tuple[str, ...]:
    explicit = _explicit_types(r, "layer_types", _HF_LAYER_TYPES)
    if explicit is not None:
        return explicit
    group = r.require("layer_group_size")
    if isinstance(group, list):
        if len(group) != num_layers:
            raise config_error("layer_group_size", f"list has {len(group)} entries for num_hidden_layers={num_layers}")
        return tuple(KDA if entry == 1 else MLA for entry in group)
    group = _integer("layer_group_size", group)
    if group <= 0:
        return (MLA,) * num_layers
    if num_layers % group:
        raise config_error("layer_group_size", f"{group} does not divide num_hidden_layers={num_layers}")
    return tuple(MLA if (i + 1) % group == 0 else KDA for i in range(num_layers))


def _parse_mlp_layer_types(r: _Reader, num_layers: int, num_experts: int) -> tuple[str, ...]:
    explicit = _explicit_types(r, "mlp_layer_types", _HF_MLP_TYPES)
    if explicit is not None:
        return explicit
    if num_experts == 1:
        return (DENSE,) * num_layers
    first_dense = r.require_int("first_k_dense_replace")
    return tuple(DENSE if i < first_dense else MOE for i in range(num_layers))


def _limits(r: _Reader, key: str) -> tuple[float | None, ...]:
    values = r.get(key)
    if values is None:
        return ()
    if not isinstance(values, list):
        raise config_error(key, f"must be a per-layer list, got {type(values).__name__}")
    return tuple(None if v in (None, 0) else float(v) for v in values)


def _parse_rope(r: _Reader) -> dict[str, Any]:
    scaling = dict(r.get("rope_scaling") or {})
    # transformers v5 keeps theta inside rope_parameters and also writes a top-level rope_theta that it
    # ignores (possibly a stale default), so the dict's value wins.
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = r.get("rope_theta")
    if theta is None:
        raise config_error(
            "rope_theta", "missing (looked for rope_parameters.rope_theta, rope_scaling.rope_theta, rope_theta)"
        )
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in ("default", *YARN_TYPES):
        raise config_error("rope_scaling.rope_type", f"{rope_type!r} is not supported (default, yarn, deepseek_yarn)")
    mrope = scaling.get("mrope_section", r.get("mrope_section"))

    def opt_float(key):
        return None if scaling.get(key) is None else float(scaling[key])

    original = scaling.get("original_max_position_embeddings")
    return {
        "theta": float(theta),
        "interleave": bool(r.get("rope_interleave", True)),
        "rope_type": "yarn" if rope_type in YARN_TYPES else "default",
        "factor": float(scaling.get("factor") or 1.0),
        "original_max_position_embeddings": None
        if original is None
        else _integer("rope_scaling.original_max_position_embeddings", original),
        "beta_fast": float(scaling.get("beta_fast", 32.0)),
        "beta_slow": float(scaling.get("beta_slow", 1.0)),
        "mscale": opt_float("mscale"),
        "mscale_all_dim": opt_float("mscale_all_dim"),
        "attn_factor": float(scaling.get("attn_factor", 1.0) or 1.0),
        "extrapolation_factor": float(scaling.get("extrapolation_factor", 1.0)),
        "truncate": bool(scaling.get("truncate", True)),
        "mrope_section": None if mrope is None else tuple(int(s) for s in mrope),
    }


def _parse_quantization(r: _Reader) -> dict[str, Any] | None:
    q = r.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", ""))
    if "fp8" not in method:
        raise config_error(
            "quantization_config.quant_method", f"only block FP8 checkpoints are supported, got {method!r}"
        )
    block = q.get("weight_block_size")
    if block is None:
        raise config_error("quantization_config.weight_block_size", "missing (block FP8 needs [128, 128])")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise config_error("quantization_config.activation_scheme", f"block FP8 needs 'dynamic', got {scheme!r}")
    experts = q.get("routed_experts_quant_method")
    if experts not in (None, "mxfp4"):
        raise config_error(
            "quantization_config.routed_experts_quant_method", f"only 'mxfp4' is supported, got {experts!r}"
        )
    ignored = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return {
        "quant_method": method,
        "weight_block_size": tuple(int(b) for b in block),
        "activation_scheme": scheme,
        "modules_to_not_convert": tuple(ignored),
        "routed_experts_quant_method": experts,
    }
