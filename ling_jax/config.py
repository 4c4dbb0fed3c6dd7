"""Ling 3.x model configuration, parsed explicitly from a checkpoint's config.json.

inclusionAI's own config files, transformers' `save_pretrained` output (alias key names, `linear_head_dim`,
explicit `layer_types`) and the VL checkpoint's nested `text_config` are all accepted. SGLang and
transformers disagree on the default of almost every key (spec §1), so keys whose meaning would change the
numerics are required, and a key given under two spellings with two values is an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"
MOE_ALL_TO_ALL = ("auto", "ragged", "dense")  # how expert parallelism moves rows: ling_jax.moe.expert_parallel

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
_YARN_TYPES = ("yarn", "deepseek_yarn")
# model_type of Ling 3.x: `bailing_hybrid` (inclusionAI, transformers) or `bailing_moe_v3` (vLLM); of Ling-VL
_TEXT_MODEL_TYPES = ("bailing_hybrid", "bailing_moe_v3")
_VL_MODEL_TYPES = ("bailing_moe_v3_vl",)


def _fail(key: str, message: str) -> ValueError:
    return ValueError(f"config key '{key}': {message}")


def _integer(key: str, value: Any) -> int:
    """A JSON integer (a float without a fraction too, as some writers emit); never a bool, string or 16.5."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise _fail(key, f"must be an integer, got {value!r}")
    return int(value)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(key, f"must be a number, got {value!r}")
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
            raise _fail(key, f"given under several names with different values ({found})")
        return values[0] if values else default

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            names = " / ".join((key, *_ALIASES.get(key, ())))
            raise _fail(key, f"missing (looked for {names}); it must be read from the checkpoint")
        return value

    def require_int(self, key: str) -> int:
        return _integer(key, self.require(key))

    def require_float(self, key: str) -> float:
        return _number(key, self.require(key))

    def get_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key)
        return default if value is None else _integer(key, value)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the MLA rope dims (spec §3.2, §3.3)."""

    theta: float
    interleave: bool = True
    rope_type: str = "default"  # "default" or "yarn" (deepseek_yarn is the same maths)
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attn_factor: float = 1.0
    extrapolation_factor: float = 1.0
    truncate: bool = True
    mrope_section: tuple[int, ...] | None = None

    @property
    def is_yarn(self) -> bool:
        return self.rope_type in _YARN_TYPES and self.factor > 1.0


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Block-FP8 (and MXFP4 routed experts) checkpoint quantization (spec §6.2, §6.3)."""

    quant_method: str
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    routed_experts_quant_method: str | None = None


@dataclasses.dataclass(frozen=True)
class LingConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # KDA key/value head dim
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_group: int  # 0 = no group-limited routing
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    layer_types: tuple[str, ...]  # KDA / MLA per layer
    mlp_layer_types: tuple[str, ...]  # DENSE / MOE per layer
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    short_conv_kernel_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    expert_swiglu_limit_list: tuple[float | None, ...] = ()
    share_expert_swiglu_limit_list: tuple[float | None, ...] = ()
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: QuantizationConfig | None = None
    mtp_loss_scaling_factor: float = 0.0  # weight of the MTP draft loss in training (0 = off)
    moe_capacity_factor: float | None = None  # ling-jax runtime option, not in checkpoints: None = dropless
    moe_all_to_all: str = "auto"  # ling-jax runtime option: one of MOE_ALL_TO_ALL

    def __post_init__(self):
        self._validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def kda_dim(self) -> int:
        """C = H * d, the width of every KDA projection."""
        return self.num_attention_heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: kv_lora_rank + qk_rope_head_dim (576 for Ling)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    def swiglu_limit(self, layer_idx: int, *, shared: bool) -> float | None:
        """Per-layer SwiGLU clip (spec §4); 0, null or out of range mean no clipping."""
        limits = self.share_expert_swiglu_limit_list if shared else self.expert_swiglu_limit_list
        if layer_idx >= len(limits) or not limits[layer_idx]:
            return None
        return float(limits[layer_idx])

    def replace(self, **changes: Any) -> LingConfig:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- validation
    def _validate(self) -> None:
        layers = self.num_hidden_layers
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "short_conv_kernel_size",
        ):
            if getattr(self, key) <= 0:
                raise _fail(key, f"must be positive, got {getattr(self, key)}")
        if len(self.layer_types) != layers:
            raise _fail("layer_types", f"has {len(self.layer_types)} entries for num_hidden_layers={layers}")
        if len(self.mlp_layer_types) != layers:
            raise _fail("mlp_layer_types", f"has {len(self.mlp_layer_types)} entries for num_hidden_layers={layers}")
        if not set(self.layer_types) <= {KDA, MLA}:
            raise _fail("layer_types", f"entries must be {KDA!r} or {MLA!r}, got {sorted(set(self.layer_types))}")
        if not set(self.mlp_layer_types) <= {DENSE, MOE}:
            raise _fail("mlp_layer_types", f"entries must be {DENSE!r} or {MOE!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise _fail("num_experts_per_tok", f"{self.num_experts_per_tok} > num_experts={self.num_experts}")
        if self.n_group:
            if self.num_experts % self.n_group:
                raise _fail("n_group", f"{self.n_group} does not divide num_experts={self.num_experts}")
            if not 0 < self.topk_group <= self.n_group:
                raise _fail("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise _fail("n_group", "group scores sum the top-2 experts of a group: need >= 2 experts per group")
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise _fail(
                    "num_experts_per_tok",
                    f"{self.num_experts_per_tok} exceeds the {self.topk_group * per_group} experts "
                    f"left after keeping topk_group={self.topk_group} groups",
                )
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise _fail("qk_rope_head_dim", f"must be positive and even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise _fail("q_lora_rank", f"must be null or positive, got {self.q_lora_rank}")
        if self.kda_safe_gate and self.kda_lower_bound >= 0:
            raise _fail("kda_lower_bound", f"must be negative with the safe gate, got {self.kda_lower_bound}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise _fail(
                "num_nextn_predict_layers", f"Ling has at most one MTP layer, got {self.num_nextn_predict_layers}"
            )
        if self.rope.mrope_section is not None:
            section = self.rope.mrope_section
            if len(section) != 3 or section[1] != section[2] or min(section) < 0:
                raise _fail(
                    "mrope_section",
                    f"must be [t, h, w] with h == w (h and w frequencies alternate), got {list(section)}",
                )
            if sum(section) != self.qk_rope_head_dim // 2:
                raise _fail(
                    "mrope_section", f"{list(section)} must sum to qk_rope_head_dim / 2 = {self.qk_rope_head_dim // 2}"
                )
        if self.rope.is_yarn and not self.rope.original_max_position_embeddings:
            raise _fail("rope_scaling.original_max_position_embeddings", "required for YaRN")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise _fail("moe_capacity_factor", f"must be null (dropless) or positive, got {self.moe_capacity_factor}")
        if self.moe_all_to_all not in MOE_ALL_TO_ALL:
            raise _fail("moe_all_to_all", f"must be one of {list(MOE_ALL_TO_ALL)}, got {self.moe_all_to_all!r}")
        if self.mtp_loss_scaling_factor < 0:
            raise _fail("mtp_loss_scaling_factor", f"must be >= 0, got {self.mtp_loss_scaling_factor}")
        if self.quantization and len(self.quantization.weight_block_size) != 2:
            raise _fail("quantization_config.weight_block_size", "must be [rows, cols]")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LingConfig:
        """Parse a config.json dict (inclusionAI or transformers spelling, or a VL config with text_config)."""
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
        eos_ids = tuple(_integer("eos_token_id", e) for e in eos_list)
        return cls(
            vocab_size=r.require_int("vocab_size"),
            hidden_size=r.require_int("hidden_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=r.require_int("num_attention_heads"),
            head_dim=_integer("linear_head_dim", raw["linear_head_dim"])
            if raw.get("linear_head_dim")
            else r.require_int("head_dim"),
            intermediate_size=r.require_int("intermediate_size"),
            moe_intermediate_size=moe_width,
            shared_expert_intermediate_size=shared_width,
            num_experts=num_experts,
            num_experts_per_tok=r.require_int("num_experts_per_tok"),
            n_group=r.get_int("n_group", 0),
            topk_group=r.get_int("topk_group", 0),
            norm_topk_prob=bool(r.require("norm_topk_prob")),
            routed_scaling_factor=r.require_float("routed_scaling_factor"),
            layer_types=_parse_layer_types(r, num_layers),
            mlp_layer_types=_parse_mlp_layer_types(r, num_layers, num_experts),
            q_lora_rank=r.get_int("q_lora_rank"),
            kv_lora_rank=r.require_int("kv_lora_rank"),
            qk_nope_head_dim=r.require_int("qk_nope_head_dim"),
            qk_rope_head_dim=r.require_int("qk_rope_head_dim"),
            v_head_dim=r.require_int("v_head_dim"),
            short_conv_kernel_size=r.require_int("short_conv_kernel_size"),
            rms_norm_eps=r.require_float("rms_norm_eps"),
            rope=_parse_rope(r),
            max_position_embeddings=r.require_int("max_position_embeddings"),
            no_kda_lora=bool(r.get("no_kda_lora", True)),
            kda_safe_gate=bool(r.get("kda_safe_gate", True)),
            kda_lower_bound=float(r.get("kda_lower_bound", -5.0)),
            expert_swiglu_limit_list=_limits(r, "expert_swiglu_limit_list"),
            share_expert_swiglu_limit_list=_limits(r, "share_expert_swiglu_limit_list"),
            num_nextn_predict_layers=r.get_int("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
            pad_token_id=r.get("pad_token_id"),
            eos_token_ids=eos_ids,
            quantization=_parse_quantization(r),
            mtp_loss_scaling_factor=float(r.get("mtp_loss_scaling_factor", 0.0) or 0.0),
            moe_capacity_factor=r.get("moe_capacity_factor"),
            moe_all_to_all=r.get("moe_all_to_all", "auto"),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LingConfig:
        """Read `config.json` from a file path or a checkpoint directory."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {file}")
        with open(file) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}: not valid JSON ({e})") from e
        try:
            return cls.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from e


def _vl_mrope_section(raw: Mapping[str, Any], text: Mapping[str, Any]) -> list[int]:
    """A VL config's top-level mrope_section, which must agree with one in text_config if both are given."""
    section = list(raw["mrope_section"])
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    inner = rope.get("mrope_section", text.get("mrope_section"))
    if inner is not None and list(inner) != section:
        raise _fail("mrope_section", f"top level {section} contradicts text_config's {list(inner)}")
    return section


def _refuse_unsupported(r: _Reader) -> None:
    if "short_conv_kernel_size" in r.raw and r.raw["short_conv_kernel_size"] is None:
        raise _fail(
            "short_conv_kernel_size", "null selects the Ling-2.5 lightning-attention path, which is not supported"
        )
    if r.get("full_attention_type", "mla") != "mla":
        raise _fail("full_attention_type", "only 'mla' (Ling 3.x) is supported")
    if r.get("moe_router_enable_expert_bias", True) is False:
        raise _fail("moe_router_enable_expert_bias", "Ling 3.x routing needs the expert bias (sigmoid scoring)")
    if r.get("score_function", "sigmoid") != "sigmoid":
        raise _fail("score_function", "only sigmoid scoring is supported")
    granularity = r.get("gated_attention_proj_granularity_type", "head_wise")
    if granularity != "head_wise":
        raise _fail("gated_attention_proj_granularity_type", f"only 'head_wise' is supported, got {granularity!r}")
    if r.get("use_mla_nope", False):
        raise _fail("use_mla_nope", "MLA without RoPE is not supported (spec §3.6)")
    if r.get("router_dtype", "fp32") not in ("fp32", "float32"):
        raise _fail("router_dtype", "the router runs in fp32")


def _check_model_type(raw: Mapping[str, Any], key: str, known: tuple[str, ...]) -> None:
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in known:
        raise _fail(key, f"{model_type!r} is not a Ling 3.x model (expected {' or '.join(map(repr, known))})")


def _explicit_types(r: _Reader, key: str, names: dict[str, str]) -> tuple[str, ...] | None:
    """transformers' explicit per-layer type list, translated; None when the key is absent."""
    explicit = r.get(key)
    if explicit is None:
        return None
    unknown = sorted({t for t in explicit if t not in names})
    if unknown:
        raise _fail(key, f"unknown entries {unknown}; expected {sorted(names)}")
    return tuple(names[t] for t in explicit)


def _parse_layer_types(r: _Reader, num_layers: int) -> tuple[str, ...]:
    explicit = _explicit_types(r, "layer_types", _HF_LAYER_TYPES)
    if explicit is not None:
        return explicit
    group = r.require("layer_group_size")
    if isinstance(group, list):
        if len(group) != num_layers:
            raise _fail("layer_group_size", f"list has {len(group)} entries for num_hidden_layers={num_layers}")
        return tuple(KDA if entry == 1 else MLA for entry in group)
    group = _integer("layer_group_size", group)
    if group <= 0:
        return (MLA,) * num_layers
    if num_layers % group:
        raise _fail("layer_group_size", f"{group} does not divide num_hidden_layers={num_layers}")
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
        raise _fail(key, f"must be a per-layer list, got {type(values).__name__}")
    return tuple(None if v in (None, 0) else float(v) for v in values)


def _parse_rope(r: _Reader) -> RopeConfig:
    scaling = dict(r.get("rope_scaling") or {})
    # transformers v5 keeps theta inside rope_parameters and also writes a top-level rope_theta that it
    # ignores (possibly a stale default), so the dict's value wins.
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = r.get("rope_theta")
    if theta is None:
        raise _fail(
            "rope_theta", "missing (looked for rope_parameters.rope_theta, rope_scaling.rope_theta, rope_theta)"
        )
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in ("default", *_YARN_TYPES):
        raise _fail("rope_scaling.rope_type", f"{rope_type!r} is not supported (default, yarn, deepseek_yarn)")
    mrope = scaling.get("mrope_section", r.get("mrope_section"))

    def opt_float(key):
        return None if scaling.get(key) is None else float(scaling[key])

    original = scaling.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        interleave=bool(r.get("rope_interleave", True)),
        rope_type="yarn" if rope_type in _YARN_TYPES else "default",
        factor=float(scaling.get("factor") or 1.0),
        original_max_position_embeddings=None
        if original is None
        else _integer("rope_scaling.original_max_position_embeddings", original),
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
        mscale=opt_float("mscale"),
        mscale_all_dim=opt_float("mscale_all_dim"),
        attn_factor=float(scaling.get("attn_factor", 1.0) or 1.0),
        extrapolation_factor=float(scaling.get("extrapolation_factor", 1.0)),
        truncate=bool(scaling.get("truncate", True)),
        mrope_section=None if mrope is None else tuple(int(s) for s in mrope),
    )


def _parse_quantization(r: _Reader) -> QuantizationConfig | None:
    q = r.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", ""))
    if "fp8" not in method:
        raise _fail("quantization_config.quant_method", f"only block FP8 checkpoints are supported, got {method!r}")
    block = q.get("weight_block_size")
    if block is None:
        raise _fail("quantization_config.weight_block_size", "missing (block FP8 needs [128, 128])")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _fail("quantization_config.activation_scheme", f"block FP8 needs 'dynamic', got {scheme!r}")
    experts = q.get("routed_experts_quant_method")
    if experts not in (None, "mxfp4"):
        raise _fail("quantization_config.routed_experts_quant_method", f"only 'mxfp4' is supported, got {experts!r}")
    ignored = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return QuantizationConfig(
        quant_method=method,
        weight_block_size=tuple(int(b) for b in block),
        activation_scheme=scheme,
        modules_to_not_convert=tuple(ignored),
        routed_experts_quant_method=experts,
    )


def yarn_mscale(factor: float, mu: float) -> float:
    """m(s, mu) of spec §3.3."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mu * math.log(factor) + 1.0
