"""Load a HF-format Ling checkpoint (config.json + safetensors shards, original tensor names) into
`LingForCausalLM`, keeping block-FP8 weights and MXFP4 experts quantised on the device (`weights="stored"`,
`ling_jax.quantized`) or dequantising them to the model dtype (`weights="bf16"`)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from ling_jax.build import build_model, load_model_config, text_config_of
from ling_jax.checkpoints.names import TensorSource, canonical, ignored, source_for
from ling_jax.checkpoints.safetensors_io import CheckpointTensors
from ling_jax.config import LingConfig
from ling_jax.layers import Weights
from ling_jax.model import DecoderLayer, LingForCausalLM
from ling_jax.policy import ExecutionPolicy
from ling_jax.quant import MXFP4_GROUP, dequantize_fp8_block, dequantize_mxfp4, is_float8
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight, QuantizedWeight, check_activation_dtype

SCALE_SUFFIX = "_scale_inv"  # <module>.weight_scale_inv sits beside <module>.weight

# how a checkpoint tensor is stored
PLAIN, FP8, MXFP4 = "plain", "fp8", "mxfp4"

# `weights=` of the loaders: quantised tensors stay as stored on the device, or are dequantised to the model dtype
STORED, BF16 = "stored", "bf16"
WEIGHTS = (STORED, BF16)


def check_weights(weights: str, where: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(
            f"{where}: weights={weights!r}; expected 'stored' (quantised tensors stay quantised on the device) "
            "or 'bf16' (dequantised to the model dtype)"
        )
    return weights


class CheckpointError(ValueError):
    """A checkpoint does not match its config: the message names the tensor and the file."""


class TensorResolver:
    """Finds checkpoint tensors by canonical name and returns them dequantised to float32."""

    def __init__(self, tensors: CheckpointTensors, config: LingConfig):
        self.tensors = tensors
        self.config = config
        self.by_name: dict[str, str] = {}
        for stored in tensors:
            if ignored(stored, config):
                continue
            if stored.endswith(SCALE_SUFFIX):
                self._check_scale_owner(stored)
                continue
            name = canonical(stored)
            if name in self.by_name:
                raise CheckpointError(
                    f"{tensors.file_of(stored)}: '{stored}' and '{self.by_name[name]}' "
                    f"({tensors.file_of(self.by_name[name])}) are the same tensor spelled twice"
                )
            self.by_name[name] = stored

    def _check_scale_owner(self, scale_name: str) -> None:
        weight = scale_name[: -len(SCALE_SUFFIX)]
        file = self.tensors.file_of(scale_name)
        if weight not in self.tensors:
            raise CheckpointError(f"{file}: '{scale_name}' has no '{weight}' to scale")
        dtype = self.tensors.dtype(weight)
        if not (is_float8(dtype) or dtype in (np.uint8, np.int8)):
            raise CheckpointError(f"{file}: '{scale_name}' scales '{weight}', which is {dtype}, not FP8 or MXFP4")

    def _stored(self, name: str) -> str:
        stored = self.by_name.get(name)
        if stored is None:
            raise CheckpointError(f"{self.tensors.directory}: tensor '{name}' is missing from every shard")
        return stored

    def storage(self, name: str) -> str:
        """PLAIN, FP8 or MXFP4: a tensor is quantised iff it is float8 (FP8) or (u)int8 (MXFP4) with a
        `weight_scale_inv` sibling (spec §6.2)."""
        return self._kind(self._stored(name))

    def _kind(self, stored: str) -> str:
        if stored + SCALE_SUFFIX not in self.tensors:
            return PLAIN
        dtype = self.tensors.dtype(stored)
        return FP8 if is_float8(dtype) else MXFP4 if dtype in (np.uint8, np.int8) else PLAIN

    def read(self, name: str, expected: tuple[int, ...]) -> np.ndarray:
        """The tensor `name` as float32 of shape `expected` (dequantised); NaN or Inf in it raises CheckpointError."""
        stored = self._stored(name)
        return self._refuse_non_finite(stored, self._read(stored, expected))

    def read_quantized(self, name: str, expected: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(values, scales) of the quantised tensor `name` of dense shape `expected`, as stored: FP8 values with
        float32 block scales; MXFP4 packed bytes as uint8 with E8M0 scales as float8_e8m0fnu (raw uint8
        exponents reinterpreted) or the float values stored. NaN or Inf in either raises CheckpointError."""
        stored = self._stored(name)
        values, scales = self._quantized_parts(stored, self._kind(stored), expected)
        if scales.dtype == np.uint8:  # raw E8M0 exponents: the same bits as float8_e8m0fnu
            scales = scales.view(ml_dtypes.float8_e8m0fnu)
        elif scales.dtype != ml_dtypes.float8_e8m0fnu:
            scales = np.asarray(scales, np.float32)
        return self._refuse_non_finite(stored, values), self._refuse_non_finite(stored + SCALE_SUFFIX, scales)

    def _refuse_non_finite(self, stored: str, value: np.ndarray) -> np.ndarray:
        if not np.issubdtype(value.dtype, np.integer) and not np.isfinite(value.sum(dtype=np.float64)):
            # one pass, no temporary: NaN and Inf reach a float64 sum, which finite float32 values cannot overflow
            bad = int(np.count_nonzero(~np.isfinite(value)))
            raise CheckpointError(
                f"{self.tensors.file_of(stored)}: tensor '{stored}' has {bad} NaN or Inf "
                f"value{'s' if bad > 1 else ''} (of {value.size}): the checkpoint is damaged"
            )
        return value

    def _quantized_parts(self, stored: str, kind: str, expected: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The stored values and scales of an FP8 or MXFP4 tensor, their shapes checked against `expected`."""
        file, shape, scale_name = self.tensors.file_of(stored), self.tensors.shape(stored), stored + SCALE_SUFFIX
        if kind == MXFP4:  # two E2M1 codes per byte, one scale per 32 inputs
            self._check_shape(stored, file, shape, (*expected[:-1], -(-expected[-1] // 2)), "packed MXFP4 ")
            scale_shape, what = (*expected[:-1], -(-expected[-1] // MXFP4_GROUP)), "one per 32 inputs"
        else:
            self._check_shape(stored, file, shape, expected, "")
            block_rows, block_cols = self.block
            scale_shape = (-(-expected[0] // block_rows), -(-expected[1] // block_cols))
            what = f"{block_rows}x{block_cols} blocks"
        have = tuple(self.tensors.shape(scale_name))
        if have != scale_shape:
            raise CheckpointError(
                f"{self.tensors.file_of(scale_name)}: '{scale_name}' has shape {have}, "
                f"expected {tuple(scale_shape)} for a {list(expected)} weight ({what})"
            )
        values = self.tensors.get(stored)
        return (values.view(np.uint8) if kind == MXFP4 else values), self.tensors.get(scale_name)

    @property
    def block(self) -> tuple[int, int]:
        return self.config.quantization.weight_block_size if self.config.quantization else (128, 128)

    def _read(self, stored: str, expected: tuple[int, ...]) -> np.ndarray:
        file, dtype = self.tensors.file_of(stored), self.tensors.dtype(stored)
        kind = self._kind(stored)
        if kind == MXFP4:
            values, scales = self._quantized_parts(stored, kind, expected)
            return dequantize_mxfp4(values, scales)[..., : expected[-1]]
        if kind == FP8:
            return dequantize_fp8_block(*self._quantized_parts(stored, kind, expected), self.block)
        self._check_shape(stored, file, self.tensors.shape(stored), expected, "")
        if is_float8(dtype):
            raise CheckpointError(f"{file}: FP8 tensor '{stored}' has no '{stored + SCALE_SUFFIX}' beside it")
        if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
            raise CheckpointError(f"{file}: tensor '{stored}' has dtype {dtype}, expected a float type")
        return np.asarray(self.tensors.get(stored), np.float32)

    @staticmethod
    def _check_shape(stored, file, shape, expected, what):
        if tuple(shape) != tuple(expected):
            raise CheckpointError(
                f"{file}: tensor '{stored}' has {what}shape {list(shape)}, expected {list(expected)} from config.json"
            )

    def refuse_unused(self, used: set[str]) -> None:
        """Raise if the checkpoint holds tensors outside `used` (the names the config asks for)."""
        unknown = sorted(set(self.by_name) - used)
        if unknown:
            shown = ", ".join(f"'{n}' ({os.path.basename(self.tensors.file_of(self.by_name[n]))})" for n in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise CheckpointError(f"{self.tensors.directory}: tensors not used by the config: {shown}{more}")


def _load(resolver: TensorResolver, source: TensorSource) -> np.ndarray:
    arrays = [resolver.read(name, source.shape) for name in source.names]
    return np.stack(arrays) if source.stacked else arrays[0]


def _load_quantized(resolver: TensorResolver, source: TensorSource) -> QuantizedWeight | None:
    """The parameter as the checkpoint stores it, on the device; None unless every one of its tensors is
    quantised the same way (or for MXFP4 with an odd number of inputs, which the packed type cannot hold)."""
    kinds = {resolver.storage(name) for name in source.names}
    if len(kinds) != 1 or PLAIN in kinds or (MXFP4 in kinds and source.shape[-1] % 2):
        return None
    parts = [resolver.read_quantized(name, source.shape) for name in source.names]
    values, scales = (np.stack(p) if source.stacked else p[0] for p in zip(*parts))
    if kinds == {FP8}:
        return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales), tuple(resolver.block))
    return MXFP4Weight(jnp.asarray(values), jnp.asarray(scales))


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    weights: str = STORED,
    progress: bool = True,
    policy: ExecutionPolicy | None = None,
) -> LingForCausalLM:
    """Build `LingForCausalLM` (or, for a VL checkpoint, `LingVLForConditionalGeneration`) from a HF-format
    checkpoint directory.

    Reads `config.json` and `model.safetensors` (or the shards of `model.safetensors.index.json`) lazily,
    tensor by tensor. FP8 weights (float8 with a `weight_scale_inv` sibling) and MXFP4 experts (packed bytes
    with E8M0 scales) stay as stored with weights="stored" (the default): each becomes a `BlockFP8Weight` or
    `MXFP4Weight` (`ling_jax.quantized`) wherever the model takes one (projections, routed and shared experts;
    elsewhere, e.g. in the vision tower, it is dequantised); weights="bf16" dequantises every one to `dtype`.
    A_log, dt_bias, conv weights and the expert bias stay fp32, the rest becomes `dtype` (the activation dtype:
    bfloat16, float16 or float32; an FP8 dtype is refused). A missing, unknown or mis-shaped tensor raises
    `CheckpointError` naming it and its file. policy: how the model runs, as for `LingForCausalLM`
    (None: `ExecutionPolicy()`).
    """
    path = os.fspath(path)
    check_weights(weights, "load_hf_checkpoint")
    check_activation_dtype(dtype, "load_hf_checkpoint")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    model_config = load_model_config(path)
    config = text_config_of(model_config)
    resolver = TensorResolver(CheckpointTensors(path), config)
    abstract = nnx.eval_shape(lambda: build_model(model_config, rngs=nnx.Rngs(0), dtype=dtype, policy=policy))
    graphdef, abstract_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abstract_state)
    plan = [(p, v, source_for(p, v.get_value().shape, config)) for p, v in flat]
    used = {name for _, _, source in plan for name in source.names}
    resolver.refuse_unused(used)
    loaded = []
    for p, variable, source in tqdm(plan, desc="loading checkpoint", unit="tensor", disable=not progress):
        like = variable.get_value()
        value = None
        if weights == STORED and variable.get_metadata().get("quantizable"):
            value = _load_quantized(resolver, source)
        if value is None:
            value = jnp.asarray(_load(resolver, source).reshape(like.shape), like.dtype)
        loaded.append((p, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def checkpoint_layer_weights(path: str | os.PathLike, index: int, *, dtype=jnp.float32) -> Weights:
    """Decoder layer `index`'s weights from a HF-format checkpoint directory, reading only that layer's tensors
    (dequantised as `load_hf_checkpoint(weights="bf16")` does; A_log, dt_bias, conv weights and the expert bias
    stay fp32)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config: LingConfig = text_config_of(load_model_config(path))
    if not 0 <= index < config.num_hidden_layers:
        raise IndexError(
            f"checkpoint_layer_weights: layer {index} of a config with {config.num_hidden_layers} "
            f"decoder layers ({path}/config.json)"
        )
    resolver = TensorResolver(CheckpointTensors(path), config)
    abstract = nnx.eval_shape(
        lambda: DecoderLayer(
            config,
            attention=config.layer_types[index],
            mlp=config.mlp_layer_types[index],
            clip_layer=index,
            dtype=dtype,
            rngs=nnx.Rngs(0),
        )
    )
    loaded = []
    for p, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        like = variable.get_value()
        source = source_for(("model", "layers", index, *p), like.shape, config)
        loaded.append((p, jnp.asarray(_load(resolver, source).reshape(like.shape), like.dtype)))
    return nnx.to_pure_dict(nnx.from_flat_state(loaded))
