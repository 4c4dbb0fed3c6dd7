"""Lazy safetensors reading with numpy + ml_dtypes (bf16, FP8 E4M3, E8M0 included), memory-mapped.

A checkpoint directory holds `model.safetensors`, or shards plus `model.safetensors.index.json`
({"weight_map": {tensor: shard file}}). Nothing is read until a tensor is asked for: `get` maps it, `read` copies
a slice of it (the sharded loaders read each device's slice that way: pread, no memory map, so the process's
RSS holds the slice and not the pages of the whole tensor).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

Index = tuple[slice, ...]  # a slice of a tensor: one slice (step 1) per leading dimension, the rest whole

READ_CHUNK_BYTES = 64 << 20  # a slice cut from inner dimensions is read through a buffer of whole rows this size

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

    def read(self, name: str, index: Index = (), out: np.ndarray | None = None) -> np.ndarray:
        """A copy of tensor[index], read with pread: only the rows (of dimension 0) the slice covers; when it cuts
        the inner dimensions too, those rows pass through a buffer of at most READ_CHUNK_BYTES (or one row).
        out: the array to read into (the slice's shape and the tensor's dtype), returned; None: a new one."""
        shape, dtype = self.shape(name), self.dtype(name)
        bounds = _bounds(index, shape, f"{self.path}: tensor '{name}'")
        sliced = tuple(stop - start for start, stop in bounds)
        if out is None:
            out = np.empty(sliced, dtype)
        elif out.shape != sliced or out.dtype != dtype:
            wanted = f"{dtype}{list(sliced)}"
            raise ValueError(f"{self.path}: tensor '{name}'[{index}] is {wanted}, not {out.dtype}{list(out.shape)}")
        if not shape or out.size == 0:
            return self._pread(name, 0, out) if shape == () else out
        row_elements = math.prod(shape[1:])
        (first, last), inner = bounds[0], tuple(slice(start, stop) for start, stop in bounds[1:])
        if all(stop - start == size for (start, stop), size in zip(bounds[1:], shape[1:])):
            return self._pread(name, first * row_elements, out)
        rows_per_chunk = max(1, READ_CHUNK_BYTES // (row_elements * dtype.itemsize))
        for row in range(first, last, rows_per_chunk):
            rows = np.empty((min(rows_per_chunk, last - row), *shape[1:]), dtype)
            self._pread(name, row * row_elements, rows)
            out[row - first : row - first + len(rows)] = rows[(slice(None), *inner)]
        return out

    def _pread(self, name: str, element: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` from tensor `name`'s bytes, starting at its `element`-th element."""
        begin, end = self._entries[name]["data_offsets"]
        offset = self._data_start + begin + element * out.itemsize
        buffer, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        if offset + len(buffer) > self._data_start + end:
            raise ValueError(f"{self.path}: read past the end of tensor '{name}'")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < len(buffer):
                got = os.preadv(fd, [buffer[done:]], offset + done)
                if not got:
                    raise ValueError(f"{self.path}: tensor '{name}' ends early (the file changed while loading?)")
                done += got
        finally:
            os.close(fd)
        return out


def _bounds(index: Index, shape: tuple[int, ...], what: str) -> list[tuple[int, int]]:
    """(start, stop) per dimension of `shape` for `index` (missing trailing entries: the whole dimension)."""
    if len(index) > len(shape):
        raise IndexError(f"{what}: index {index} has more entries than its shape {list(shape)}")
    bounds = []
    for size, entry in zip(shape, (*index, *(slice(None),) * (len(shape) - len(index)))):
        start, stop, step = entry.indices(size)
        if step != 1:
            raise IndexError(f"{what}: slices are read with step 1, got {entry}")
        bounds.append((start, max(start, stop)))
    return bounds


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

    def read(self, name: str, index: Index = (), out: np.ndarray | None = None) -> np.ndarray:
        """A copy of tensor[index], into `out` if given (`SafetensorsFile.read`)."""
        return self.reader(name).read(name, index, out)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.reader(name).dtype(name)
