"""HF-format Ling checkpoints for tests and benchmarks, stored the way the real ones are (spec §6.2, §6.3):
block FP8 for the projections, MLPs and experts, optionally MXFP4 routed experts, bfloat16 for what SGLang
never quantises (embeddings, lm_head, norms, router, MLA gate, KDA b_proj) and float32 for A_log, dt_bias,
convs and the expert bias.

`write_random_checkpoint` fills every tensor a config implies with seeded random weights (or, for benchmarks,
random FP8 / MXFP4 codes drawn directly: no quantisation cost); `write_quantized_copy` quantises an
unquantised HF directory such as transformers' `save_pretrained` output. Both stream one tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np

from convert.hf_writer import TensorEntry, quantize_fp8_block, quantize_mxfp4, write_sharded
from convert.plan import model_parameters
from convert.source import ShardReader
from ling_jax.checkpoints.hf import SCALE_SUFFIX
from ling_jax.checkpoints.names import source_for
from ling_jax.checkpoints.safetensors_io import CheckpointTensors
from ling_jax.checkpoints.storage import BF16, FP8, FP32, MXFP4, storage_kind
from ling_jax.config import DENSE, KDA, MLA, MOE, LingConfig
from ling_jax.presets import preset
from ling_jax.quant import MXFP4_GROUP, is_float8

FP8_BLOCK = (128, 128)
_SCALE_DTYPES = {
    "e8m0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "float32": np.dtype(np.float32),
    "uint8": np.dtype(np.uint8),
}


def natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def benchmark_config(target_bytes: float) -> LingConfig:
    """A Ling-shaped config (hidden 2048, 64 experts of width 1024 in 8 groups, KDA/MLA 3:1, one dense layer,
    an MTP layer) with as many MoE layers as make its FP8 checkpoint about `target_bytes` (at least 1.2 GB)."""
    hidden, experts, width = 2048, 64, 1024
    # FP8 experts, shared expert and attention ~0.43 GB per MoE layer; embeddings, lm_head, the dense layer
    # and the MTP layer ~0.78 GB
    moe_layers = max(1, round((target_bytes - 0.78e9) / 0.43e9))
    layers = 1 + moe_layers
    return preset("tiny").replace(
        vocab_size=32768,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        head_dim=128,
        intermediate_size=4 * hidden,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width,
        num_experts=experts,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        layer_types=tuple(MLA if i % 4 == 3 else KDA for i in range(layers)),
        mlp_layer_types=(DENSE,) + (MOE,) * moe_layers,
        expert_swiglu_limit_list=(),
        share_expert_swiglu_limit_list=(),
    )


def checkpoint_tensors(config: LingConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(original name, logical shape) of every tensor the config implies, in natural name order."""
    tensors = []
    for path, value, _ in model_parameters(config):
        source = source_for(path, value.shape, config)
        tensors += [(name, tuple(source.shape)) for name in source.names]
    return sorted(tensors, key=lambda item: natural_key(item[0]))


def config_dict(config: LingConfig) -> dict:
    """A config.json for `config` (explicit per-layer lists), which `LingConfig.from_dict` parses back to it."""
    c, rope = config, config.rope
    raw = {
        "model_type": "bailing_hybrid",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob,
        "routed_scaling_factor": c.routed_scaling_factor,
        "layer_types": ["linear_attention" if t == KDA else "full_attention" for t in c.layer_types],
        "mlp_layer_types": ["dense" if t == DENSE else "sparse" for t in c.mlp_layer_types],
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "short_conv_kernel_size": c.short_conv_kernel_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope.theta,
        "rope_interleave": rope.interleave,
        "max_position_embeddings": c.max_position_embeddings,
        "no_kda_lora": c.no_kda_lora,
        "kda_safe_gate": c.kda_safe_gate,
        "kda_lower_bound": c.kda_lower_bound,
        "num_nextn_predict_layers": c.num_nextn_predict_layers,
        "tie_word_embeddings": c.tie_word_embeddings,
        "moe_router_enable_expert_bias": True,
        "score_function": "sigmoid",
        "gated_attention_proj_granularity_type": "head_wise",
    }
    scaling = {
        "rope_type": rope.rope_type,
        "factor": rope.factor,
        "beta_fast": rope.beta_fast,
        "beta_slow": rope.beta_slow,
        "attn_factor": rope.attn_factor,
        "extrapolation_factor": rope.extrapolation_factor,
        "truncate": rope.truncate,
    }
    optional = {
        "original_max_position_embeddings": rope.original_max_position_embeddings,
        "mscale": rope.mscale,
        "mscale_all_dim": rope.mscale_all_dim,
        "mrope_section": None if rope.mrope_section is None else list(rope.mrope_section),
    }
    raw["rope_scaling"] = {**scaling, **{k: v for k, v in optional.items() if v is not None}}
    for key, limits in (
        ("expert_swiglu_limit_list", c.expert_swiglu_limit_list),
        ("share_expert_swiglu_limit_list", c.share_expert_swiglu_limit_list),
    ):
        if limits:
            raw[key] = [limit or 0 for limit in limits]
    if c.pad_token_id is not None:
        raw["pad_token_id"] = c.pad_token_id
    if c.eos_token_ids:
        raw["eos_token_id"] = list(c.eos_token_ids)
    if c.quantization:
        q = c.quantization
        raw["quantization_config"] = {
            "quant_method": q.quant_method,
            "weight_block_size": list(q.weight_block_size),
            "activation_scheme": q.activation_scheme,
            "modules_to_not_convert": list(q.modules_to_not_convert),
            **({"routed_experts_quant_method": q.routed_experts_quant_method} if q.routed_experts_quant_method else {}),
        }
    return raw


def _entries(name: str, shape: tuple[int, ...], kind: str, scale_format: str) -> list[TensorEntry]:
    if kind == FP8:
        rows, cols = shape
        return [
            TensorEntry(name, np.dtype(ml_dtypes.float8_e4m3fn), shape),
            TensorEntry(
                name + SCALE_SUFFIX, np.dtype(np.float32), (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
            ),
        ]
    if kind == MXFP4:
        rows, cols = shape
        return [
            TensorEntry(name, np.dtype(np.uint8), (rows, cols // 2)),
            TensorEntry(name + SCALE_SUFFIX, _SCALE_DTYPES[scale_format], (rows, -(-cols // MXFP4_GROUP))),
        ]
    return [TensorEntry(name, np.dtype(np.float32 if kind == FP32 else ml_dtypes.bfloat16), shape)]


def _stored(name: str, weight: np.ndarray, kind: str, scale_format: str) -> list[tuple[str, np.ndarray]]:
    """The arrays a float32 weight is stored as."""
    if kind == FP8:
        codes, scale = quantize_fp8_block(weight, FP8_BLOCK)
        return [(name, codes), (name + SCALE_SUFFIX, scale)]
    if kind == MXFP4:
        packed, scale = quantize_mxfp4(weight, scale_format)
        return [(name, packed), (name + SCALE_SUFFIX, scale)]
    return [(name, weight.astype(np.float32 if kind == FP32 else ml_dtypes.bfloat16))]


def _random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape)


def _random_codes(
    name: str, shape: tuple[int, ...], kind: str, scale_format: str, rng: np.random.Generator
) -> list[tuple[str, np.ndarray]]:
    """Random quantised storage of a [rows, cols] weight of std ~1/sqrt(cols), without quantising anything."""
    weight, scale_entry = _entries(name, shape, kind, scale_format)
    std_exponent = -int(np.log2(shape[1])) // 2
    if kind == FP8:
        codes = (_random_bytes(rng, weight.shape) & 0xBF).view(ml_dtypes.float8_e4m3fn)  # exponent < 8: no NaN
        return [(name, codes), (scale_entry.name, np.full(scale_entry.shape, 2.0**std_exponent, np.float32))]
    exponents = np.full(scale_entry.shape, 127 + std_exponent - 1, np.uint8)
    scale = exponents if scale_format == "uint8" else np.exp2(exponents - 127.0).astype(scale_entry.dtype)
    return [(name, _random_bytes(rng, weight.shape)), (scale_entry.name, scale)]


def random_weight(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random float32 values of a plausible scale for the tensor's role."""
    if name.endswith("word_embeddings.weight"):
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    if name.endswith("norm.weight"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("_conv1d.weight"):
        return rng.normal(0.0, 0.5, shape).astype(np.float32)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.normal(-1.5, 0.5, shape).astype(np.float32)
    if name.endswith("expert_bias"):
        return rng.normal(0.0, 0.08, shape).astype(np.float32)
    return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32)


def _quantization_config(kinds: dict[str, str], shapes: dict[str, tuple[int, ...]], mxfp4_experts: bool) -> dict:
    kept = [
        name[: -len(".weight")]
        for name, kind in kinds.items()
        if kind == BF16 and name.endswith(".weight") and len(shapes[name]) == 2
    ]
    quantization = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
        "modules_to_not_convert": kept,
    }
    if mxfp4_experts:
        quantization["routed_experts_quant_method"] = "mxfp4"
    return quantization


def _write(
    directory: str,
    raw_config: dict,
    config: LingConfig,
    tensors: list[tuple[str, tuple[int, ...]]],
    stored: Callable[[str, tuple[int, ...], str], list[tuple[str, np.ndarray]]],
    *,
    num_shards: int,
    mxfp4_experts: bool,
    scale_format: str,
) -> None:
    kinds = {name: storage_kind(name, config, mxfp4_experts) for name, _ in tensors}
    entries = [entry for name, shape in tensors for entry in _entries(name, shape, kinds[name], scale_format)]

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        for name, shape in tensors:
            yield from stored(name, shape, kinds[name])

    quantization = _quantization_config(kinds, dict(tensors), mxfp4_experts)
    write_sharded(directory, {**raw_config, "quantization_config": quantization}, entries, arrays(), num_shards)


def write_random_checkpoint(
    directory: str,
    config: LingConfig,
    *,
    seed: int = 0,
    num_shards: int = 4,
    mxfp4_experts: bool = False,
    scale_format: str = "e8m0",
    random_codes: bool = False,
) -> None:
    """A checkpoint of `config` with seeded random weights (each tensor's values depend only on the seed and
    its name). random_codes: draw FP8 / MXFP4 weights as random codes instead of quantising Gaussian ones."""

    def stored(name, shape, kind):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if random_codes and kind in (FP8, MXFP4):
            return _random_codes(name, shape, kind, scale_format, rng)
        return _stored(name, random_weight(name, shape, rng), kind, scale_format)

    _write(
        directory,
        config_dict(config),
        config,
        checkpoint_tensors(config),
        stored,
        num_shards=num_shards,
        mxfp4_experts=mxfp4_experts,
        scale_format=scale_format,
    )


def write_quantized_copy(
    src: str, directory: str, *, num_shards: int = 4, mxfp4_experts: bool = False, scale_format: str = "e8m0"
) -> None:
    """Quantise the unquantised HF checkpoint `src` (original tensor names) into `directory`; config.json keeps
    src's spelling and gains a quantization_config."""
    with open(os.path.join(src, "config.json")) as f:
        raw_config = json.load(f)
    config = LingConfig.from_dict(raw_config)
    tensors = CheckpointTensors(src)
    for name in tensors:
        if name.endswith(SCALE_SUFFIX) or is_float8(tensors.dtype(name)):
            raise ValueError(
                f"{tensors.file_of(name)}: '{name}' is already quantised; expected an unquantised checkpoint"
            )
    shapes = [(name, tuple(tensors.shape(name))) for name in sorted(tensors, key=natural_key)]
    with ShardReader(tensors) as reader:

        def stored(name, shape, kind):
            return _stored(name, reader.rows(name, 0, shape[0]).astype(np.float32), kind, scale_format)

        _write(
            directory,
            raw_config,
            config,
            shapes,
            stored,
            num_shards=num_shards,
            mxfp4_experts=mxfp4_experts,
            scale_format=scale_format,
        )
