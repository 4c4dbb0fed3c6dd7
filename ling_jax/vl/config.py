"""Ling-3.0-flash-VL configuration (spec §7): the text model's `LingConfig`, the Qwen3-VL-style vision tower's
`VisionConfig` and the media token ids, parsed from a `bailing_moe_v3_vl` config.json."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ling_jax.config import LingConfig
from ling_jax.config_json import config_error, parse_file

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")

# SGLang's defaults for the media token ids (spec §7); a checkpoint's config.json wins
DEFAULT_TOKEN_IDS = {
    "image_token_id": 157157,
    "video_token_id": 156909,
    "vision_start_token_id": 157158,
    "vision_end_token_id": 157159,
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The Qwen3-VL ViT (transformers' `Qwen3VLMoeVisionConfig` keys)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    # the merger keeps only its LayerNorm; linear_proj reads hidden_size * merge^2 values per merged token
    disable_merger_proj: bool = False
    # Qwen3-VL deepstack taps: Bailing does not feed them to the text model (SGLang keeps only the merger output)
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self):
        for key in (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "out_hidden_size",
            "num_position_embeddings",
            "in_channels",
        ):
            if getattr(self, key) <= 0:
                raise config_error(f"vision_config.{key}", f"must be positive, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads:
            raise config_error(
                "vision_config.num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}"
            )
        if self.head_dim % 4:
            raise config_error(
                "vision_config.num_heads",
                f"the 2-D rotary embedding needs a head dim divisible by 4, got {self.head_dim}",
            )
        side = self.grid_side
        if side * side != self.num_position_embeddings:
            raise config_error(
                "vision_config.num_position_embeddings",
                f"must be a square (a side x side table), got {self.num_position_embeddings}",
            )
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise config_error("vision_config.hidden_act", f"{self.hidden_act!r} is not one of {VISION_ACTIVATIONS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """The learned position table is grid_side x grid_side."""
        return round(self.num_position_embeddings**0.5)

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        """Width of a merged token before the merger's MLP: hidden_size * spatial_merge_size^2."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def output_dim(self) -> int:
        """Width of the tower's output (the linear_proj input)."""
        return self.merged_dim if self.disable_merger_proj else self.out_hidden_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VisionConfig:
        def require(key):
            names = (key, *{"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",)}.get(key, ()))
            for name in names:
                if raw.get(name) is not None:
                    return raw[name]
            raise config_error(f"vision_config.{key}", "missing; it must be read from the checkpoint")

        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        return cls(
            depth=int(require("depth")),
            hidden_size=int(require("hidden_size")),
            intermediate_size=int(require("intermediate_size")),
            num_heads=int(require("num_heads")),
            patch_size=int(require("patch_size")),
            temporal_patch_size=int(require("temporal_patch_size")),
            spatial_merge_size=int(require("spatial_merge_size")),
            out_hidden_size=int(require("out_hidden_size")),
            num_position_embeddings=int(require("num_position_embeddings")),
            hidden_act=str(require("hidden_act")),
            in_channels=int(raw.get("in_channels", 3)),
            rope_theta=float(theta),
            disable_merger_proj=bool(raw.get("disable_merger_proj", False)),
            deepstack_visual_indexes=tuple(int(i) for i in raw.get("deepstack_visual_indexes") or ()),
        )


@dataclasses.dataclass(frozen=True)
class LingVLConfig:
    text: LingConfig
    vision: VisionConfig
    image_token_id: int = DEFAULT_TOKEN_IDS["image_token_id"]
    video_token_id: int = DEFAULT_TOKEN_IDS["video_token_id"]
    vision_start_token_id: int = DEFAULT_TOKEN_IDS["vision_start_token_id"]
    vision_end_token_id: int = DEFAULT_TOKEN_IDS["vision_end_token_id"]
    norm_query_embeds: bool = False  # L2-normalise the projected vision embeddings

    def __post_init__(self):
        if self.text.rope.mrope_section is None:
            raise config_error(
                "mrope_section",
                "the VL model needs 3-axis rotary sections [t, h, w] (top level or in text_config.rope_parameters)",
            )
        for key in DEFAULT_TOKEN_IDS:
            token = getattr(self, key)
            if not 0 <= token < self.text.vocab_size:
                raise config_error(key, f"{token} is outside the vocabulary [0, {self.text.vocab_size})")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LingVLConfig:
        if "text_config" not in raw or "vision_config" not in raw:
            raise ValueError("a VL config needs both 'text_config' and 'vision_config'")
        return cls(
            text=LingConfig.from_dict(raw),
            vision=VisionConfig.from_dict(raw["vision_config"]),
            **{
                key: int(raw.get(key) if raw.get(key) is not None else default)
                for key, default in DEFAULT_TOKEN_IDS.items()
            },
            norm_query_embeds=bool(raw.get("norm_query_embeds", False)),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LingVLConfig:
        return parse_file(path, cls.from_dict)
