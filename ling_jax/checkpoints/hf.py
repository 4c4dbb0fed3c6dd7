"""Load a HF-format Ling checkpoint (config.json + safetensors shards, original tensor names) into
`LingForCausalLM`, keeping block-FP8 weights and MXFP4 experts quantised on the device (`weights="stored"`,
`ling_jax.quantized`) or dequantising them to the model dtype (`weights="bf16"`).

Loading is sharded: an abstract model first (shapes only), every tensor checked from the shard headers, then
each parameter built from the slices this process's devices hold (`ling_jax.checkpoints.pieces.assemble`), read
with pread (`CheckpointTensors.read`) and dequantised slice by slice, several parameters at once in threads
(`pieces.load_all`, within a bound on the host bytes in flight): a full-size checkpoint never sits whole on one host
or one device."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from ling_jax.build import abstract_model, load_model_config, model_rngs, text_config_of
from ling_jax.checkpoints.finite_check import NonFiniteError, check_finite
from ling_jax.checkpoints.names import TensorSource, canonical, ignored, source_for
from ling_jax.checkpoints.pieces import LOAD_WORKERS, assemble, host_bytes, load_all, one_device_sharding
from ling_jax.checkpoints.safetensors_io import CheckpointTensors, Index
from ling_jax.checkpoints.storage import FP8, MXFP4, PLAIN, stored_kind
from ling_jax.config import LingConfig
from ling_jax.layers import Weights
from ling_jax.model import DecoderLayer, LingForCausalLM
from ling_jax.policy import ExecutionPolicy
from ling_jax.progress import progress_bar
from ling_jax.quant import E2M1_VALUES, MXFP4_GROUP, is_float8, unpack_e2m1
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight, QuantizedWeight, check_activation_dtype, is_quantized
from ling_jax.sharding import param_shardings

SCALE_SUFFIX = "_scale_inv"  # <module>.weight_scale_inv sits beside <module>.weight

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
    """Finds checkpoint tensors by canonical name; checks them against the config from the shard headers alone
    (`check`), then reads slices of them: dequantised to float32 (`read`) or as stored (`read_stored`)."""

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
        if stored_kind(dtype, scaled=True) == PLAIN:
            raise CheckpointError(f"{file}: '{scale_name}' scales '{weight}', which is {dtype}, not FP8 or MXFP4")

    def _stored(self, name: str) -> str:
        stored = self.by_name.get(name)
        if stored is None:
            raise CheckpointError(f"{self.tensors.directory}: tensor '{name}' is missing from every shard")
        return stored

    def _kind(self, stored: str) -> str:
        """PLAIN, FP8 or MXFP4 (`stored_kind`)."""
        return stored_kind(self.tensors.dtype(stored), scaled=stored + SCALE_SUFFIX in self.tensors)

    @property
    def block(self) -> tuple[int, int]:
        return self.config.quantization.weight_block_size if self.config.quantization else (128, 128)

    def scale_block(self, kind: str) -> tuple[int, int]:
        """Weight elements (rows, cols) one scale of a `kind` tensor covers."""
        return (1, MXFP4_GROUP) if kind == MXFP4 else tuple(self.block)

    def check(self, name: str, expected: tuple[int, ...]) -> str:
        """The storage kind of the tensor `name` of dense shape `expected`, after checking its shape and dtype and
        those of its scales against it (headers only: nothing is read)."""
        stored = self._stored(name)
        kind, file, dtype = self._kind(stored), self.tensors.file_of(stored), self.tensors.dtype(stored)
        if kind == PLAIN:
            _check_shape(stored, file, self.tensors.shape(stored), expected, "")
            if is_float8(dtype):
                raise CheckpointError(f"{file}: FP8 tensor '{stored}' has no '{stored + SCALE_SUFFIX}' beside it")
            if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
                raise CheckpointError(f"{file}: tensor '{stored}' has dtype {dtype}, expected a float type")
            return kind
        values_shape, scales_shape = stored_shapes(expected, kind, self.scale_block(kind))
        _check_shape(stored, file, self.tensors.shape(stored), values_shape, "packed MXFP4 " if kind == MXFP4 else "")
        scale_name = stored + SCALE_SUFFIX
        have = tuple(self.tensors.shape(scale_name))
        if have != scales_shape:
            rows, cols = self.scale_block(kind)
            what = "one per 32 inputs" if kind == MXFP4 else f"{rows}x{cols} blocks"
            raise CheckpointError(
                f"{self.tensors.file_of(scale_name)}: '{scale_name}' has shape {have}, "
                f"expected {scales_shape} for a {list(expected)} weight ({what})"
            )
        return kind

    def stored_weight(self, name: str, expected: tuple[int, ...], experts: int | None = None) -> QuantizedWeight:
        """The quantised tensor `name` of dense shape `expected` as an abstract `BlockFP8Weight` / `MXFP4Weight`
        (shapes and dtypes as `read_stored` gives them), stacked [experts, ...] unless experts is None."""
        stored = self._stored(name)
        kind = self._kind(stored)
        scale_dtype = _scale_dtype(self.tensors.dtype(stored + SCALE_SUFFIX))
        values_dtype = np.uint8 if kind == MXFP4 else self.tensors.dtype(stored)
        lead = () if experts is None else (experts,)
        return stored_struct(
            (*lead, *expected), kind, self.scale_block(kind), values_dtype=values_dtype, scale_dtype=scale_dtype
        )

    def read(self, name: str, expected: tuple[int, ...], index: Index, out: np.ndarray) -> None:
        """Fill `out` (any shape of as many elements, any float dtype) with the slice `index` of the tensor `name`
        (dense shape `expected`): a quantised one dequantised in float32 from the values and scales covering that
        slice only, then converted; a plain one read straight into `out` when stored in its dtype, else converted
        once; NaN or Inf in it raises CheckpointError."""
        stored = self._stored(name)
        kind = self._kind(stored)
        bounds = [entry.indices(size)[:2] for entry, size in zip((*index, *_whole(expected, index)), expected)]
        target = np.reshape(out, [stop - start for start, stop in bounds], copy=False)
        if kind == PLAIN:
            self._read_into(stored, index, target)
            return
        block = self.scale_block(kind)
        lead = tuple(slice(*b) for b in bounds[:-2])
        (row0, row1), (col0, col1) = bounds[-2:]
        covering = (slice(start // side, -(-stop // side)) for (start, stop), side in zip(bounds[-2:], block))
        scale_index = (*lead, *covering)
        scales = _scale_values(self.tensors.read(stored + SCALE_SUFFIX, scale_index))
        if kind == FP8:
            elements = self.tensors.read(stored, (*lead, slice(row0, row1), slice(col0, col1))).astype(np.float32)
        else:  # two E2M1 codes a byte: the bytes covering the columns, unpacked, then cut to them
            packed = self.tensors.read(stored, (*lead, slice(row0, row1), slice(col0 // 2, -(-col1 // 2))))
            elements = E2M1_VALUES[unpack_e2m1(packed)][..., col0 % 2 : col0 % 2 + col1 - col0]
        rows, cols = (np.arange(start, stop) // side - start // side for (start, stop), side in zip(bounds[-2:], block))
        target[...] = self._refuse_non_finite(stored, elements * scales[..., rows[:, None], cols[None, :]])

    def read_stored(self, name: str, part: str, index: Index, out: np.ndarray) -> None:
        """Fill `out` with the slice `index` of the quantised tensor `name`'s stored "values" (MXFP4 packed bytes as
        uint8) or "scales" (float32; E8M0 exponents as float8_e8m0fnu), in the dtype `stored_weight` gives them;
        NaN or Inf in it raises CheckpointError."""
        stored = self._stored(name)
        self._read_into(stored if part == "values" else stored + SCALE_SUFFIX, index, out)

    def _read_into(self, stored: str, index: Index, out: np.ndarray) -> None:
        """Fill `out` with the slice `index` of the tensor `stored`: read straight into it when it holds the same bits
        (the same dtype, or byte codes into a one-byte dtype: MXFP4 bytes, raw E8M0 exponents), else read and
        converted once; NaN or Inf in it raises CheckpointError."""
        dtype = self.tensors.dtype(stored)
        if dtype == out.dtype or (dtype.kind in "iu" and dtype.itemsize == out.dtype.itemsize == 1):
            self.tensors.read(stored, index, out.view(dtype))
            self._refuse_non_finite(stored, out)
        else:
            out[...] = self._refuse_non_finite(stored, self.tensors.read(stored, index))

    def _refuse_non_finite(self, stored: str, value: np.ndarray) -> np.ndarray:
        """`value`, a slice of the tensor `stored`, after checking it on its bits (`finite_check`: FP8 and bf16
        without a float conversion)."""
        try:
            check_finite(value, stored)
        except NonFiniteError as e:
            raise CheckpointError(
                f"{self.tensors.file_of(stored)}: tensor '{stored}' has {e.count} NaN or Inf "
                f"value{'s' if e.count > 1 else ''} (of {value.size} read): the checkpoint is damaged"
            ) from None
        return value

    def refuse_unused(self, used: set[str]) -> None:
        """Raise if the checkpoint holds tensors outside `used` (the names the config asks for)."""
        unknown = sorted(set(self.by_name) - used)
        if unknown:
            shown = ", ".join(f"'{n}' ({os.path.basename(self.tensors.file_of(self.by_name[n]))})" for n in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise CheckpointError(f"{self.tensors.directory}: tensors not used by the config: {shown}{more}")


def _check_shape(stored: str, file: str, shape, expected, what: str) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(
            f"{file}: tensor '{stored}' has {what}shape {list(shape)}, expected {list(expected)} from config.json"
        )


def _whole(shape: tuple[int, ...], index: Index) -> tuple[slice, ...]:
    return (slice(None),) * (len(shape) - len(index))


def _scale_dtype(stored: np.dtype) -> np.dtype:
    """The dtype scales are kept in: raw E8M0 exponents (uint8) as float8_e8m0fnu (the same bits), E8M0 as is,
    any other float as float32."""
    if stored in (np.uint8, ml_dtypes.float8_e8m0fnu):
        return np.dtype(ml_dtypes.float8_e8m0fnu)
    return np.dtype(np.float32)


def _scale_values(scales: np.ndarray) -> np.ndarray:
    return (scales.view(ml_dtypes.float8_e8m0fnu) if scales.dtype == np.uint8 else scales).astype(np.float32)


def stored_shapes(shape: tuple[int, ...], kind: str, block: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(values, scales) shapes of a quantised weight of dense `shape` [..., O, In]: FP8 values as the weight with one
    scale per block; MXFP4 two codes a byte with one scale per 32 inputs."""
    *lead, rows, cols = shape
    scales = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    return ((*lead, rows, -(-cols // 2)) if kind == MXFP4 else tuple(shape)), scales


def stored_struct(
    shape: tuple[int, ...],
    kind: str,
    block: tuple[int, int],
    *,
    values_dtype=ml_dtypes.float8_e4m3fn,
    scale_dtype=None,
) -> QuantizedWeight:
    """An abstract quantised weight (`jax.ShapeDtypeStruct` leaves) of dense `shape` stored as `kind`: FP8
    (`values_dtype`) with float32 scales per `block`, or MXFP4 (uint8 codes) with E8M0 scales; `scale_dtype`
    overrides the scales' dtype."""
    values, scales = stored_shapes(shape, kind, block)
    if kind == FP8:
        scales = jax.ShapeDtypeStruct(scales, scale_dtype or np.float32)
        return BlockFP8Weight(jax.ShapeDtypeStruct(values, values_dtype), scales, tuple(block))
    scales = jax.ShapeDtypeStruct(scales, scale_dtype or ml_dtypes.float8_e8m0fnu)
    return MXFP4Weight(jax.ShapeDtypeStruct(values, np.uint8), scales)


Reader = Callable[[Index, np.ndarray], None]  # read(index, out): fills out with the slice index of a parameter
ReadOne = Callable[[str, Index, np.ndarray], None]  # read_one(name, index, out): the same for one tensor


def _stacked_reader(source: TensorSource, read_one: ReadOne, workers: int = 1) -> Reader:
    """read(index, out) of the parameter `source` fills: its one tensor's slice, or for stacked experts the slices
    of the experts index[0] selects (only those are read), each straight into its place out[i], by `workers`
    threads."""
    if not source.stacked:
        return lambda index, out: read_one(source.names[0], index, out)

    def read(index: Index, out: np.ndarray) -> None:
        names = source.names[index[0]]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(lambda name, place: read_one(name, index[1:], place), names, out))

    return read


def _tensor_index(index: Index, shape: tuple[int, ...], source_shape: tuple[int, ...]) -> Index:
    """The slice of a checkpoint tensor of `source_shape` behind the slice `index` of a parameter of `shape` (the
    same dimensions, or with size-1 dimensions more: a conv stored [C, 1, K] for a [C, K] parameter)."""
    if tuple(shape) == tuple(source_shape):
        return index
    entries, extra = iter(index), len(source_shape) - len(shape)
    mapped = []
    for size in source_shape:
        if size == 1 and extra:
            mapped.append(slice(0, 1))
            extra -= 1
        else:
            mapped.append(next(entries))
    return tuple(mapped)


def _dense_reader(resolver: TensorResolver, source: TensorSource, shape: tuple[int, ...], workers: int = 1) -> Reader:
    """read(index, out) of a parameter of `shape` in out's dtype, dequantised from the tensors `source` names (a
    plain tensor converted once, from its stored dtype); stacked experts by `workers` threads."""
    tensor_shape = shape[1:] if source.stacked else shape

    def read_one(name: str, index: Index, out: np.ndarray) -> None:
        resolver.read(name, source.shape, _tensor_index(index, tensor_shape, source.shape), out)

    return _stacked_reader(source, read_one, workers)


def _check_fills(resolver: TensorResolver, source: TensorSource, shape: tuple[int, ...]) -> None:
    """Refuse a checkpoint tensor whose shape is neither the parameter's nor it with size-1 dimensions added."""
    tensor_shape = shape[1:] if source.stacked else shape
    if [n for n in source.shape if n != 1] != [n for n in tensor_shape if n != 1]:
        stored = resolver.by_name[source.names[0]]
        _check_shape(stored, resolver.tensors.file_of(stored), source.shape, tensor_shape, "")


def _target(resolver: TensorResolver, variable: nnx.Variable, source: TensorSource, weights: str):
    """What the parameter becomes (abstract): the quantised weight as stored when weights="stored", its layer takes
    one and every tensor of it is quantised the same way (MXFP4 with an even number of inputs), else the dense
    array. Every tensor's header is checked here, before anything is read."""
    like = variable.get_value()
    kinds = {resolver.check(name, source.shape) for name in source.names}
    _check_fills(resolver, source, like.shape)
    (kind,) = kinds if len(kinds) == 1 else (PLAIN,)
    packable = kind == FP8 or (kind == MXFP4 and source.shape[-1] % 2 == 0)
    if weights != STORED or not variable.get_metadata().get("quantizable") or not packable:
        return jax.ShapeDtypeStruct(like.shape, like.dtype)
    return resolver.stored_weight(source.names[0], source.shape, len(source.names) if source.stacked else None)


def _load_parameter(resolver: TensorResolver, source: TensorSource, target, sharding, workers: int):
    """The parameter `target` describes, placed with `sharding`, from its devices' slices of the checkpoint (stacked
    experts read by `workers` threads)."""
    if not is_quantized(target):
        return assemble(target.shape, target.dtype, sharding, _dense_reader(resolver, source, target.shape, workers))
    parts = {}
    for part in ("values", "scales"):
        leaf = getattr(target, part)
        read = _stacked_reader(
            source, lambda name, index, out, part=part: resolver.read_stored(name, part, index, out), workers
        )
        parts[part] = assemble(leaf.shape, leaf.dtype, getattr(sharding, part), read)
    return dataclasses.replace(target, **parts)


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype=jnp.bfloat16,
    weights: str = STORED,
    progress: bool = True,
    policy: ExecutionPolicy | None = None,
    workers: int = LOAD_WORKERS,
) -> LingForCausalLM:
    """Build `LingForCausalLM` (or, for a VL checkpoint, `LingVLForConditionalGeneration`) from a HF-format
    checkpoint directory, every parameter straight into its sharding over `mesh` (from the logical axis rules of
    `ling_jax.sharding`; without a mesh, on this process's first device).

    Reads `config.json` and the shard headers of `model.safetensors` (or of `model.safetensors.index.json`'s
    shards) and checks every tensor against the abstract model before reading any. Then, parameter by
    parameter, each process reads only the slices of the tensors its own devices hold (routed experts: the
    experts of its devices, each cut to their slice), once per distinct slice, and puts them on those devices:
    no parameter is ever whole on one host or device unless its sharding says so. FP8 weights (float8 with a
    `weight_scale_inv` sibling) and MXFP4 experts (packed bytes with E8M0 scales) stay as stored with
    weights="stored" (the default): each becomes a `BlockFP8Weight` or `MXFP4Weight` (`ling_jax.quantized`),
    values and scales sliced alike, wherever the model takes one (projections, routed and shared experts;
    elsewhere, e.g. in the vision tower, it is dequantised); a mesh whose shards would cut a scale block is
    refused (`ShardingError`). weights="bf16" dequantises every one to `dtype`, slice by slice. A_log, dt_bias,
    conv weights and the expert bias stay fp32, the rest becomes `dtype` (the activation dtype: bfloat16,
    float16 or float32; an FP8 dtype is refused). A missing, unknown or mis-shaped tensor raises
    `CheckpointError` naming it and its file. policy: how the model runs, as for `LingForCausalLM`
    (None: `ExecutionPolicy()`). workers: parameters read at once, in threads (`pieces.load_all`: at most
    `LOAD_BUFFER_BYTES` of host data in flight, or one larger parameter), and the threads reading the experts of
    one stacked parameter; progress: the bytes read on stderr (`ling_jax.progress`: a bar on a terminal, a line
    every few seconds on a pipe), then one line with the bytes, seconds and GB/s.
    """
    path = os.fspath(path)
    check_weights(weights, "load_hf_checkpoint")
    check_activation_dtype(dtype, "load_hf_checkpoint")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    model_config = load_model_config(path)
    config = text_config_of(model_config)
    resolver = TensorResolver(CheckpointTensors(path), config)
    graphdef, abstract_state = nnx.split(abstract_model(model_config, dtype=dtype, policy=policy))
    flat = nnx.to_flat_state(abstract_state)
    sources = {p: source_for(p, v.get_value().shape, config) for p, v in flat}
    resolver.refuse_unused({name for source in sources.values() for name in source.names})
    targets = [(p, v.replace(_target(resolver, v, sources[p], weights))) for p, v in flat]
    if mesh is None:
        one = one_device_sharding()
        shardings = {p: jax.tree.map(lambda _: one, v.get_value()) for p, v in targets}
    else:
        placed = nnx.to_flat_state(param_shardings(nnx.from_flat_state(targets), mesh))
        shardings = {p: v.get_value() for p, v in placed}
    jobs = [
        functools.partial(_load_parameter, resolver, sources[p], variable.get_value(), shardings[p], workers)
        for p, variable in targets
    ]
    nbytes = [_host_bytes(variable.get_value(), shardings[p]) for p, variable in targets]
    start = time.perf_counter()
    bar = progress_bar(total=sum(nbytes), desc="reading checkpoint", unit="B", unit_scale=True, enabled=progress)
    with bar:
        values = load_all(jobs, nbytes, workers=workers, done=bar.update)
    if progress:
        seconds = time.perf_counter() - start
        print(
            f"read {sum(nbytes) / 2**30:.2f} GiB of parameters in {seconds:.1f} s "
            f"({sum(nbytes) / 1e9 / max(seconds, 1e-9):.2f} GB/s, workers={workers})",
            file=sys.stderr,
        )
    loaded = [(p, variable.replace(value)) for (p, variable), value in zip(targets, values)]
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _host_bytes(target, sharding) -> int:
    """The host bytes this process reads for the parameter `target` (values and scales of a quantised one)."""
    return sum(jax.tree.leaves(jax.tree.map(lambda leaf, s: host_bytes(leaf.shape, leaf.dtype, s), target, sharding)))


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
            rngs=model_rngs(0),
        )
    )
    loaded = []
    for p, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        like = variable.get_value()
        source = source_for(("model", "layers", index, *p), like.shape, config)
        for name in source.names:
            resolver.check(name, source.shape)
        _check_fills(resolver, source, like.shape)
        value = np.empty(like.shape, like.dtype)
        _dense_reader(resolver, source, like.shape)(tuple(slice(0, n) for n in like.shape), value)
        loaded.append((p, jnp.asarray(value)))
    return nnx.to_pure_dict(nnx.from_flat_state(loaded))
