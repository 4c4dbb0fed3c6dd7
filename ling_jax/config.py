"""Ling 3.x model configuration: `LingConfig`, `RopeConfig`, `QuantizationConfig` and their validation.

`LingConfig.from_pretrained` / `from_dict` read a checkpoint's config.json through `ling_jax.config_json`
(key spellings, aliases, required keys); what is here is what the numbers must satisfy. How the model runs
(kernels, MoE exchange and capacity) is `ling_jax.policy.ExecutionPolicy`'s; how it is trained,
`ling_jax.training.train.TrainConfig`'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ling_jax import config_json
from ling_jax.config_json import DENSE, KDA, MLA, MOE, YARN_TYPES, config_error

__all__ = ["DENSE", "KDA", "MLA", "MOE", "LingConfig", "QuantizationConfig", "RopeConfig"]


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
        return self.rope_type in YARN_TYPES and self.factor > 1.0


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
                raise config_error(key, f"must be positive, got {getattr(self, key)}")
        if len(self.layer_types) != layers:
            raise config_error("layer_types", f"has {len(self.layer_types)} entries for num_hidden_layers={layers}")
        if len(self.mlp_layer_types) != layers:
            raise config_error(
                "mlp_layer_types", f"has {len(self.mlp_layer_types)} entries for num_hidden_layers={layers}"
            )
        if not set(self.layer_types) <= {KDA, MLA}:
            raise config_error(
                "layer_types", f"entries must be {KDA!r} or {MLA!r}, got {sorted(set(self.layer_types))}"
            )
        if not set(self.mlp_layer_types) <= {DENSE, MOE}:
            raise config_error("mlp_layer_types", f"entries must be {DENSE!r} or {MOE!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise config_error("num_experts_per_tok", f"{self.num_experts_per_tok} > num_experts={self.num_experts}")
        if self.n_group:
            if self.num_experts % self.n_group:
                raise config_error("n_group", f"{self.n_group} does not divide num_experts={self.num_experts}")
            if not 0 < self.topk_group <= self.n_group:
                raise config_error("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise config_error(
                    "n_group", "group scores sum the top-2 experts of a group: need >= 2 experts per group"
                )
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise config_error(
                    "num_experts_per_tok",
                    f"{self.num_experts_per_tok} exceeds the {self.topk_group * per_group} experts "
                    f"left after keeping topk_group={self.topk_group} groups",
                )
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise config_error("qk_rope_head_dim", f"must be positive and even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise config_error("q_lora_rank", f"must be null or positive, got {self.q_lora_rank}")
        if self.kda_safe_gate and self.kda_lower_bound >= 0:
            raise config_error("kda_lower_bound", f"must be negative with the safe gate, got {self.kda_lower_bound}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise config_error(
                "num_nextn_predict_layers", f"Ling has at most one MTP layer, got {self.num_nextn_predict_layers}"
            )
        if self.rope.mrope_section is not None:
            section = self.rope.mrope_section
            if len(section) != 3 or section[1] != section[2] or min(section) < 0:
                raise config_error(
                    "mrope_section",
                    f"must be [t, h, w] with h == w (h and w frequencies alternate), got {list(section)}",
                )
            if sum(section) != self.qk_rope_head_dim // 2:
                raise config_error(
                    "mrope_section", f"{list(section)} must sum to qk_rope_head_dim / 2 = {self.qk_rope_head_dim // 2}"
                )
        if self.rope.is_yarn and not self.rope.original_max_position_embeddings:
            raise config_error("rope_scaling.original_max_position_embeddings", "required for YaRN")
        if self.quantization and len(self.quantization.weight_block_size) != 2:
            raise config_error("quantization_config.weight_block_size", "must be [rows, cols]")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LingConfig:
        """Parse a config.json dict (inclusionAI or transformers spelling, or a VL config with text_config)."""
        fields = config_json.text_fields(raw)
        quantization = fields["quantization"]
        return cls(
            **{
                **fields,
                "rope": RopeConfig(**fields["rope"]),
                "quantization": None if quantization is None else QuantizationConfig(**quantization),
            }
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LingConfig:
        """Read `config.json` from a file path or a checkpoint directory."""
        return config_json.parse_file(path, cls.from_dict)
