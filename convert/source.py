"""Source tensors of a HF-format checkpoint: inspected up front, then read a slice of rows at a time.

`inspect_source` checks one checkpoint tensor (and its `weight_scale_inv`, for block FP8 and MXFP4) against the
shape config.json implies, so a broken checkpoint fails before anything is written. `ShardReader` reads rows
[start, stop) and their scale rows into fresh buffers: resident memory stays at a few slices however large the
shards are.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from ling_jax.checkpoints.hf import SCALE_SUFFIX, CheckpointError
from ling_jax.checkpoints.safetensors_io import CheckpointTensors
from ling_jax.checkpoints.storage import FP8, MXFP4, PLAIN, stored_kind
from ling_jax.quant import MXFP4_GROUP, e8m0_to_float, is_float8


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """One checkpoint tensor as the conversion will read it."""

    name: str  # as stored
    file: str  # the shard holding it
    kind: str  # PLAIN, FP8 or MXFP4
    shape: tuple[int, ...]  # logical (dequantised) shape
    dtype: np.dtype  # as stored
    nbytes: int  # stored bytes, scale included
    scale: str | None = None  # the `weight_scale_inv` tensor of FP8 and MXFP4 weights
    block: tuple[int, int] | None = None  # weight rows x cols covered by one scale entry

    @property
    def row_align(self) -> int:
        """Row slices start at multiples of this, so each one owns whole rows of scales."""
        return self.block[0] if self.block else 1


@dataclasses.dataclass(frozen=True)
class SourceRows:
    values: np.ndarray  # rows [start, stop) in the stored dtype (MXFP4: packed bytes)
    scale: np.ndarray | None  # float32 scales of those rows
    nbytes: int  # bytes read from the checkpoint


def _fail_shape(stored: str, file: str, shape, expected, what: str) -> CheckpointError:
    return CheckpointError(
        f"{file}: tensor '{stored}' has {what}shape {list(shape)}, expected {list(expected)} from config.json"
    )


def _check_scale(
    tensors: CheckpointTensors, weight: str, scale: str, expected: tuple[int, ...], why: str, *, raw_exponents: bool
) -> None:
    """raw_exponents: MXFP4 scales may also be stored as uint8 E8M0 exponents."""
    file, shape, dtype = tensors.file_of(scale), tensors.shape(scale), tensors.dtype(scale)
    if tuple(shape) != expected:
        raise CheckpointError(f"{file}: '{scale}' has shape {tuple(shape)}, expected {expected} for '{weight}' ({why})")
    floating = np.issubdtype(dtype, np.floating) or dtype.name in ("bfloat16", "float8_e8m0fnu")
    if not (floating or (raw_exponents and dtype == np.uint8)):
        raise CheckpointError(f"{file}: '{scale}' has dtype {dtype}, expected a float type")


def _bytes(tensors: CheckpointTensors, name: str) -> int:
    return int(np.prod(tensors.shape(name), dtype=np.int64)) * tensors.dtype(name).itemsize


def inspect_source(
    tensors: CheckpointTensors, stored: str | None, name: str, expected: tuple[int, ...], fp8_block: tuple[int, int]
) -> SourceTensor:
    """Check the tensor stored as `stored` (None: absent) that fills checkpoint name `name` of logical shape
    `expected`, stored as `stored_kind` says (spec §6.2, §6.3); a plain tensor must be a float one, and a float8 one
    without its `weight_scale_inv` is refused."""
    if stored is None:
        raise CheckpointError(f"{tensors.directory}: tensor '{name}' is missing from every shard")
    file, dtype, shape = tensors.file_of(stored), tensors.dtype(stored), tuple(tensors.shape(stored))
    scale = stored + SCALE_SUFFIX
    kind = stored_kind(dtype, scaled=scale in tensors)
    if kind == MXFP4:
        packed = (*expected[:-1], -(-expected[-1] // 2))
        if shape != packed or len(expected) != 2:
            raise _fail_shape(stored, file, shape, packed, "packed MXFP4 ")
        _check_scale(
            tensors,
            stored,
            scale,
            (expected[0], -(-expected[1] // MXFP4_GROUP)),
            f"one E8M0 scale per {MXFP4_GROUP} inputs",
            raw_exponents=True,
        )
        return SourceTensor(
            stored,
            file,
            MXFP4,
            expected,
            dtype,
            _bytes(tensors, stored) + _bytes(tensors, scale),
            scale,
            (1, MXFP4_GROUP),
        )
    if shape != tuple(expected):
        raise _fail_shape(stored, file, shape, expected, "")
    if kind == FP8:
        if len(expected) != 2:
            raise CheckpointError(f"{file}: FP8 tensor '{stored}' has {len(expected)} dims; block FP8 is 2-D")
        rows, cols = fp8_block
        _check_scale(
            tensors,
            stored,
            scale,
            (-(-expected[0] // rows), -(-expected[1] // cols)),
            f"{rows}x{cols} blocks from quantization_config.weight_block_size",
            raw_exponents=False,
        )
        return SourceTensor(
            stored,
            file,
            FP8,
            expected,
            dtype,
            _bytes(tensors, stored) + _bytes(tensors, scale),
            scale,
            tuple(fp8_block),
        )
    if is_float8(dtype):
        raise CheckpointError(f"{file}: FP8 tensor '{stored}' has no '{scale}' beside it")
    if not (np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"):
        raise CheckpointError(f"{file}: tensor '{stored}' has dtype {dtype}, expected a float type")
    return SourceTensor(stored, file, PLAIN, expected, dtype, _bytes(tensors, stored))


def _file_range(view: np.memmap) -> tuple[str, int]:
    """(file, byte offset) of a C-contiguous slice of a memory-mapped file, without touching its pages."""
    whole = view
    while isinstance(whole.base, np.ndarray):
        whole = whole.base
    address, whole_address = view.__array_interface__["data"][0], whole.__array_interface__["data"][0]
    return whole.filename, whole.offset + address - whole_address


class ShardReader:
    """Reads rows of checkpoint tensors with pread into fresh buffers. The shards' memory maps are used only to
    locate the bytes and are never touched: pages read through a map would stay in the process's RSS until
    the shard is closed, and each would cost a page fault."""

    def __init__(self, tensors: CheckpointTensors):
        self.tensors = tensors
        self._files: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()

    def _fd(self, path: str) -> int:
        with self._lock:
            if path not in self._files:
                self._files[path] = os.open(path, os.O_RDONLY)
            return self._files[path]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        view = self.tensors.get(name)[start:stop]
        path, offset = _file_range(view)
        rows = np.empty(view.shape, view.dtype)
        buffer = memoryview(rows.reshape(-1).view(np.uint8))
        fd, done = self._fd(path), 0
        while done < len(buffer):
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if not got:
                raise CheckpointError(f"{path}: tensor '{name}' ends early (the file changed while converting?)")
            done += got
        return rows

    def read_rows(self, source: SourceTensor, start: int, stop: int) -> SourceRows:
        """Rows [start, stop) of `source` (start a multiple of `source.row_align`) with their float32 scales."""
        values = self.rows(source.name, start, stop)
        if source.scale is None:
            return SourceRows(values, None, values.nbytes)
        block_rows = source.block[0]
        stored_scale = self.rows(source.scale, start // block_rows, -(-stop // block_rows))
        scale = e8m0_to_float(stored_scale) if source.kind == MXFP4 else stored_scale.astype(np.float32)
        return SourceRows(values, scale, values.nbytes + stored_scale.nbytes)
