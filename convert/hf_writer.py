"""Writing HF-format checkpoints: block-FP8 and MXFP4 quantisation (spec §6.2, §6.3) and a streaming writer of
byte-balanced safetensors shards with `model.safetensors.index.json` (one tensor in memory at a time)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

from ling_jax.checkpoints.safetensors_io import DTYPES, INDEX_FILE
from ling_jax.quant import MXFP4_GROUP

FP8_E4M3_MAX = 448.0
MXFP4_SCALE_FORMATS = ("e8m0", "float32", "uint8")  # float8_e8m0fnu, fp32 powers of two, raw exponents u
_E2M1_MAX = 6.0
_E8M0_BIAS = 127
_SAFETENSORS_NAME = {dtype: name for name, dtype in DTYPES.items()}


def quantize_fp8_block(weight: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """-> (float8_e4m3fn [O, I], float32 scale [ceil(O/bo), ceil(I/bi)]) with W ~= fp8 * scale per block:
    scale = block amax / 448 (1 for an all-zero block); edge blocks are partial."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    padded = np.zeros((grid[0] * block_rows, grid[1] * block_cols), np.float32)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(grid[0], block_rows, grid[1], block_cols)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)
    codes = np.clip(blocks / scale[:, None, :, None], -FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(padded.shape)
    return codes[:rows, :cols].astype(ml_dtypes.float8_e4m3fn), scale


def _group_exponents(amax: np.ndarray) -> np.ndarray:
    """Smallest e with amax / 2^e <= 6 (E2M1's largest value), 0 for all-zero groups, clipped to E8M0's range."""
    mantissa, exponent = np.frexp(amax.astype(np.float64) / _E2M1_MAX)  # amax / 6 = m 2^k, m in [0.5, 1)
    e = np.where(mantissa == 0.5, exponent - 1, exponent)
    e = np.where(amax / np.exp2(e) > _E2M1_MAX, e + 1, e)  # amax / 6 is rounded: settle e on exact values
    e = np.where(amax / np.exp2(e - 1) <= _E2M1_MAX, e - 1, e)
    return np.clip(np.where(amax > 0, e, 0), -_E8M0_BIAS, _E8M0_BIAS).astype(np.int32)


def quantize_mxfp4(weight: np.ndarray, scale_format: str = "e8m0") -> tuple[np.ndarray, np.ndarray]:
    """-> (uint8 [O, I/2]: element 2j in the low nibble of byte j, E8M0 scales [O, ceil(I/32)]).

    One power-of-two scale per 32 inputs, the smallest that fits the group's amax into E2M1 without
    clipping; elements round to the nearest E2M1 value, ties to even. Zeros get a positive sign."""
    rows, cols = weight.shape
    if cols % 2:
        raise ValueError(f"MXFP4 packs two inputs per byte; got {cols} inputs")
    groups = -(-cols // MXFP4_GROUP)
    padded = np.zeros((rows, groups * MXFP4_GROUP), np.float32)
    padded[:, :cols] = weight
    grouped = padded.reshape(rows, groups, MXFP4_GROUP)
    exponents = _group_exponents(np.abs(grouped).max(axis=-1))
    scale = np.exp2(exponents.astype(np.float64)).astype(np.float32)
    codes = (grouped / scale[..., None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(rows, -1)[:, :cols]
    codes = np.where(codes & 0x7, codes, 0).astype(np.uint8)  # -0 -> +0
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    biased = (exponents + _E8M0_BIAS).astype(np.uint8)
    if scale_format == "e8m0":
        return packed, biased.view(ml_dtypes.float8_e8m0fnu)
    if scale_format == "float32":
        return packed, scale
    if scale_format == "uint8":
        return packed, biased
    raise ValueError(f"MXFP4 scale format must be one of {MXFP4_SCALE_FORMATS}, got {scale_format!r}")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _shard_of_each(entries: list[TensorEntry], num_shards: int) -> list[int]:
    """Contiguous, byte-balanced shards: a new shard starts when a tensor's middle byte crosses the next
    1/N of the total, or when only one tensor per remaining shard is left."""
    total = sum(entry.nbytes for entry in entries)
    shard, cumulative, owners = 0, 0, []
    for i, entry in enumerate(entries):
        shards_after = num_shards - 1 - shard
        crosses = cumulative + entry.nbytes / 2 > total * (shard + 1) / num_shards
        if owners and shards_after and (crosses or len(entries) - i == shards_after):
            shard += 1
        owners.append(shard)
        cumulative += entry.nbytes
    return owners


def _header(entries: list[TensorEntry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": _SAFETENSORS_NAME[np.dtype(entry.dtype)],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)


def write_sharded(
    directory: str, config: dict, entries: list[TensorEntry], arrays: Iterable[tuple[str, np.ndarray]], num_shards: int
) -> None:
    """config.json, model-0000i-of-0000N.safetensors and the index, with `arrays` (name, value) arriving in
    the order of `entries`, which fixes every header up front."""
    os.makedirs(directory, exist_ok=True)
    num_shards = max(1, min(num_shards, len(entries)))
    owners = _shard_of_each(entries, num_shards)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    stream = iter(arrays)
    for shard, file in enumerate(files):
        members = [entry for entry, owner in zip(entries, owners, strict=True) if owner == shard]
        header = _header(members)
        with open(os.path.join(directory, file), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for entry in members:
                name, value = next(stream)
                announced = (entry.name, np.dtype(entry.dtype), entry.shape)
                if (name, np.dtype(value.dtype), tuple(value.shape)) != announced:
                    raise ValueError(
                        f"{file}: got '{name}' {value.dtype} {list(value.shape)} where the header "
                        f"announced '{entry.name}' {entry.dtype} {list(entry.shape)}"
                    )
                f.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
    index = {
        "metadata": {"total_size": sum(entry.nbytes for entry in entries)},
        "weight_map": {entry.name: files[owner] for entry, owner in zip(entries, owners, strict=True)},
    }
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
