"""Load a HF-format Ling checkpoint (config.json + safetensors shards, original tensor names) into
`LingForCausalLM`, dequantising block-FP8 weights and MXFP4 experts to the requested dtype."""

from __future__ import annotations

import os

import jax.numpy as jnp
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
from ling_jax.quant import dequantize_fp8_block, dequantize_mxfp4, is_float8

SCALE_SUFFIX = "_scale_inv"  # <module>.weight_scale_inv sits beside <module>.weight


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

    def read(self, name: str, expected: tuple[int, ...]) -> np.ndarray:
        """The tensor `name` as float32 of shape `expected`; NaN or Inf in it raises CheckpointError."""
        stored = self.by_name.get(name)
        if stored is None:
            raise CheckpointError(f"{self.tensors.directory}: tensor '{name}' is missing from every shard")
        value = self._read(stored, expected)
        # one pass, no temporary: NaN and Inf reach a float64 sum, which finite float32 values cannot overflow
        if not np.isfinite(value.sum(dtype=np.float64)):
            bad = int(np.count_nonzero(~np.isfinite(value)))
            raise CheckpointError(
                f"{self.tensors.file_of(stored)}: tensor '{stored}' has {bad} NaN or Inf "
                f"value{'s' if bad > 1 else ''} (of {value.size}): the checkpoint is damaged"
            )
        return value

    def _read(self, stored: str, expected: tuple[int, ...]) -> np.ndarray:
        file, dtype, shape = self.tensors.file_of(stored), self.tensors.dtype(stored), self.tensors.shape(stored)
        scale_name = stored + SCALE_SUFFIX
        has_scale = scale_name in self.tensors
        if dtype in (np.uint8, np.int8) and has_scale:  # MXFP4: two E2M1 codes per byte
            packed_shape = (*expected[:-1], -(-expected[-1] // 2))
            self._check_shape(stored, file, shape, packed_shape, "packed MXFP4 ")
            try:
                return dequantize_mxfp4(self.tensors.get(stored), self.tensors.get(scale_name))[..., : expected[-1]]
            except ValueError as e:
                raise CheckpointError(f"{self.tensors.file_of(scale_name)}: '{scale_name}': {e}") from e
        self._check_shape(stored, file, shape, expected, "")
        if is_float8(dtype):
            if not has_scale:
                raise CheckpointError(f"{file}: FP8 tensor '{stored}' has no '{scale_name}' beside it")
            block = self.config.quantization.weight_block_size if self.config.quantization else (128, 128)
            try:
                return dequantize_fp8_block(self.tensors.get(stored), self.tensors.get(scale_name), block)
            except ValueError as e:
                raise CheckpointError(f"{self.tensors.file_of(scale_name)}: '{scale_name}': {e}") from e
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


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    progress: bool = True,
    policy: ExecutionPolicy | None = None,
) -> LingForCausalLM:
    """Build `LingForCausalLM` (or, for a VL checkpoint, `LingVLForConditionalGeneration`) from a HF-format
    checkpoint directory.

    Reads `config.json` and `model.safetensors` (or the shards of `model.safetensors.index.json`) lazily,
    tensor by tensor. FP8 weights (float8 with a `weight_scale_inv` sibling) and MXFP4 experts (packed bytes
    with E8M0 scales) are dequantised; A_log, dt_bias, conv weights and the expert bias stay fp32, the rest
    becomes `dtype`. A missing, unknown or mis-shaped tensor raises `CheckpointError` naming it and its file.
    policy: how the model runs, as for `LingForCausalLM` (None: `ExecutionPolicy()`).
    """
    path = os.fspath(path)
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
        value = _load(resolver, source)
        loaded.append(
            (p, variable.replace(jnp.asarray(value.reshape(variable.get_value().shape), variable.get_value().dtype)))
        )
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def checkpoint_layer_weights(path: str | os.PathLike, index: int, *, dtype=jnp.float32) -> Weights:
    """Decoder layer `index`'s weights from a HF-format checkpoint directory, reading only that layer's tensors
    (dequantised as `load_hf_checkpoint` does; A_log, dt_bias, conv weights and the expert bias stay fp32)."""
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
