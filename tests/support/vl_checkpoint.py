"""A tiny Ling-VL checkpoint on disk: a random text checkpoint (`convert.synthetic`, block-FP8 like the real
one) plus the vision tower of transformers' Qwen3VLMoeVisionModel (`model.visual.*`, one weight stored as block
FP8) and a random `model.linear_proj`, under a `bailing_moe_v3_vl` config.json."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from vl_oracle import TINY_VISION, build_vision_oracle

from convert.hf_writer import quantize_fp8_block
from convert.synthetic import write_random_checkpoint
from ling_jax.config import LingConfig
from ling_jax.presets import TINY
from ling_jax.quant import dequantize_fp8_block

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 250, 251, 252, 253
# rope dims 8 -> 4 frequencies: [t, h, w] = [2, 1, 1]; YaRN with a short original context so that it matters
TINY_VL_TEXT = {
    **TINY,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "mrope_section": [2, 1, 1],
    },
}
FP8_VISION_WEIGHT = "model.visual.blocks.0.mlp.linear_fc1.weight"
VISION_SHARD = "model-vision.safetensors"


def write_text_checkpoint(directory: str) -> LingConfig:
    config = LingConfig.from_dict(TINY_VL_TEXT)
    write_random_checkpoint(directory, config, seed=3, num_shards=2)
    return config


def write_vl_checkpoint(
    text_directory: str,
    directory: str,
    *,
    norm_query_embeds: bool = False,
    projector_prefix: str = "model.",
    omit: str | None = None,
) -> torch.nn.Module:
    """Copy the text checkpoint and add the vision side; returns the vision oracle (its weights as loaded).
    omit: a vision tensor to leave out (for error tests)."""
    shutil.copytree(text_directory, directory)
    oracle = build_vision_oracle(seed=5)
    tensors = {}
    with torch.no_grad():
        for name, value in oracle.state_dict().items():
            full = "model.visual." + name
            array = value.numpy().astype(np.float32)
            if full == FP8_VISION_WEIGHT:
                codes, scale = quantize_fp8_block(array, (128, 128))
                tensors[full], tensors[full + "_scale_inv"] = codes, scale
                array = dequantize_fp8_block(codes, scale, (128, 128)).astype(np.float32)
                value.copy_(torch.from_numpy(array))  # the oracle runs with exactly what the loader reads
            else:
                tensors[full] = array.astype(ml_dtypes.bfloat16) if name.startswith("blocks.1.") else array
                value.copy_(torch.from_numpy(tensors[full].astype(np.float32)))
    rng = np.random.default_rng(9)
    text = LingConfig.from_dict(TINY_VL_TEXT)
    for index, (rows, cols) in (
        (0, (text.hidden_size, TINY_VISION["out_hidden_size"])),
        (2, (text.hidden_size, text.hidden_size)),
    ):
        tensors[f"{projector_prefix}linear_proj.{index}.weight"] = rng.normal(0, cols**-0.5, (rows, cols)).astype(
            np.float32
        )
        tensors[f"{projector_prefix}linear_proj.{index}.bias"] = rng.normal(0, 0.1, (rows,)).astype(np.float32)
    tensors.pop(omit, None)
    save_file(tensors, os.path.join(directory, VISION_SHARD))
    index_file = os.path.join(directory, "model.safetensors.index.json")
    with open(index_file) as f:
        index = json.load(f)
    index["weight_map"].update({name: VISION_SHARD for name in tensors})
    with open(index_file, "w") as f:
        json.dump(index, f)
    config_file = os.path.join(directory, "config.json")
    with open(config_file) as f:
        text_raw = json.load(f)
    vl_raw = {
        "architectures": ["BailingMoeV3VLForConditionalGeneration"],
        "model_type": "bailing_moe_v3_vl",
        "text_config": text_raw,
        "vision_config": {**TINY_VISION, "model_type": "qwen3_moe_vit"},
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": VIDEO_TOKEN,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "norm_query_embeds": norm_query_embeds,
        "mrope_section": [2, 1, 1],
    }
    with open(config_file, "w") as f:
        json.dump(vl_raw, f)
    return oracle


def projector_weights(directory: str, prefix: str = "model.") -> dict[str, np.ndarray]:
    with safe_open(os.path.join(directory, VISION_SHARD), framework="np") as f:
        return {
            name[len(prefix) :]: f.get_tensor(name).astype(np.float64)
            for name in f.keys()
            if name.startswith(prefix + "linear_proj.")
        }


def write_byte_tokenizer(directory: str, chat_template: str) -> None:
    """A tokenizer.json whose ids are UTF-8 byte values (what the byte-level fallback gives, so ids 250-253, never
    in UTF-8 text, stay the media tokens), and a tokenizer_config.json with `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]  # GPT-2's byte-to-character map: the rest from U+0100
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
    backend = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": chat_template}, f)
