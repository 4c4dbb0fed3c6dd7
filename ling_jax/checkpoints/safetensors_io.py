"""Lazy safetensors reading with numpy + ml_dtypes (bf16, FP8 E4M3, E8M0 included), memory-mapped.

A checkpoint directory holds `model.safetensors`, or shards plus `model.safetensors.index.json`
({"weight_map": {tensor: shard file}}). Nothing is read until a tensor is asked for.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, tensors read on demand from a memory map."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise ValueError(f"{path}: truncated safetensors file (header of {header_len} bytes, file {size})")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = header
        for name, entry in header.items():
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {entry['dtype']}")
            begin, end = entry["data_offsets"]
            expected = int(np.prod(entry["shape"], dtype=np.int64)) * DTYPES[entry["dtype"]].itemsize
            if end - begin != expected or self._data_start + end > size:
                raise ValueError(
                    f"{path}: tensor '{name}' is truncated or mis-sized "
                    f"(bytes {begin}..{end} of a {size - self._data_start}-byte data section)"
                )
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    def get(self, name: str) -> np.ndarray:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The index's {tensor name: shard file}; a file that is no such index raises ValueError naming it."""
    try:
        with open(index_path, "rb") as f:
            body = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index_path}: not valid JSON ({e})") from e
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path}: no 'weight_map' object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise ValueError(f"{index_path}: 'weight_map' maps '{name}' to {file!r}, not a shard file name")
    return weight_map


class CheckpointTensors:
    """All tensors of a HF-format checkpoint directory, looked up by name across shards."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = _read_weight_map(index_path)
            files = sorted(set(weight_map.values()))
            for file in files:
                if not os.path.isfile(os.path.join(directory, file)):
                    raise FileNotFoundError(f"{index_path}: shard '{file}' is listed but missing from {directory}")
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{directory}: no model.safetensors, shards or {INDEX_FILE}")
            weight_map = None
        self._files = {file: SafetensorsFile(os.path.join(directory, file)) for file in files}
        self._where: dict[str, str] = {}
        for file, reader in self._files.items():
            for name in reader.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    where = weight_map.get(name)
                    raise ValueError(
                        f"{reader.path}: tensor '{name}' is not mapped to this file by {INDEX_FILE}"
                        f" (index says {where!r})"
                    )
                self._where[name] = file
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self._where:
                    raise ValueError(f"{index_path}: tensor '{name}' is mapped to '{file}' but that shard lacks it")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def file_of(self, name: str) -> str:
        return self._files[self._where[name]].path

    def reader(self, name: str) -> SafetensorsFile:
        return self._files[self._where[name]]

    def get(self, name: str) -> np.ndarray:
        return self.reader(name).get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.reader(name).dtype(name)
