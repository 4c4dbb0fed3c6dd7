"""How the MoE Triton kernels read a tile of a stacked expert weight [E, N, K]: dense, block FP8 or MXFP4.

A kernel is written once against `ExpertTiles.load`, the [block_n, block_k] tile of expert e's rows
[col0, col0 + block_n) and inputs [k0, k0 + block_k), zeros outside the weight, in the compute dtype. The format
says what is in HBM and how a tile becomes numbers on chip (weight-only: nothing dense is ever written):

- `Dense`: the weight itself, [E, N, K] (the kernels' original operand);
- `BlockFP8`: e4m3 values [E, N, K] (one byte an element) and fp32 scales [E, ceil(N / br), ceil(K / bc)] for
  blocks of br x bc weights (spec §6.2): the tile is values * scale in fp32, cast to the compute dtype. A stack
  of more than 2^31 elements (Ling flash's [512, 1280, 4096]) needs int64 offsets, which Pallas's Triton lowering
  gives it once `compat.widen_triton_offsets` has patched it; where that cannot apply, such a stack with K even
  goes as uint16 pairs [E, N, K / 2] (a bitcast; split into their two bytes on chip like MXFP4's nibbles,
  `pairs_needed`), which halve the largest offset. Where the tile lies in one block (block_n divides br, block_k
  divides bc: the 128 x 128 checkpoints with the tuned tiles) the scale is one scalar load; otherwise one scale
  a row block a row and one a K block, repeated over the block's inputs (or, where a block does not divide the
  tile, gathered a column);
- `MXFP4`: packed E2M1 codes uint8 [E, N, K / 2] (element 2j in the low nibble of byte j, half a byte an element)
  and one E8M0 scale per 32 inputs [E, N, ceil(K / 32)] (spec §6.3), given as uint8 exponents (2^(u - 127),
  a float8_e8m0fnu array reinterpreted) or as float powers of two: the packed bytes are split into their two
  nibbles and interleaved (Triton's join), each E2M1 code decoded through float16's bit layout (the magnitude's
  3 bits are an fp16 with a denormal at 0.5, times 2^14) and multiplied by its group's scale (exact in bf16).

`weight_format` tells a weight's format from what it is: an array is dense, a quantised weight is anything with
`values` and `scales` (`ling_jax.quantized.BlockFP8Weight`, which has a `block`, or `MXFP4Weight`);
`kernel_operands` gives the arrays a pallas_call takes for it, and refuses one that int32 offsets cannot
index (`check_offsets`: only where the workaround cannot apply).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import widen_triton_offsets
from pallas_kernels.fp8.reference import is_quantized
from pallas_kernels.triton_masked import mask_2d, masked_load

MXFP4_GROUP = 32  # inputs per E8M0 scale
_FP32_MANTISSA_BITS = 23
_E2M1_AS_FP16 = 2.0**14  # an E2M1 magnitude's 3 bits placed at fp16's bits 9-11 read as the value / 2^14


# Pallas's Triton lowering indexes a ref with int32 element offsets unless it holds more than 2^32 bytes (jax
# 0.10.2 / 0.11.2), unless `compat.widen_triton_offsets` applies (then: unless it has more than 2^31 elements)
_INT32_OFFSETS_MAX_BYTES = 2**32
_INT32_OFFSET_LIMIT = 2**31


def _range(start, size: int):
    return start + jnp.arange(size)


# tests: every block-FP8 stack with K even goes as uint16 pairs (the form taken where the workaround does not apply)
FORCE_PAIRS = False


def pairs_needed(values) -> bool:
    """Whether block-FP8 values [..., K] go to a kernel as uint16 pairs: K even and too many elements for the int32
    element offsets the lowering gives them (only where `compat.widen_triton_offsets` cannot apply), or
    `FORCE_PAIRS`."""
    if values.shape[-1] % 2:
        return False
    return FORCE_PAIRS or (values.size > _INT32_OFFSET_LIMIT and not widen_triton_offsets())


def check_offsets(array, name: str) -> None:
    """Refuses a kernel operand whose int32 element offsets would overflow (more than 2^31 elements in at most
    2^32 bytes: a one-byte dtype) where `compat.widen_triton_offsets` cannot apply; larger operands get int64
    offsets."""
    nbytes = array.size * np.dtype(array.dtype).itemsize
    if array.size > _INT32_OFFSET_LIMIT and nbytes <= _INT32_OFFSETS_MAX_BYTES and not widen_triton_offsets():
        raise ValueError(
            f"{name}: {tuple(array.shape)} {np.dtype(array.dtype).name} has {array.size} elements; Pallas's Triton "
            f"lowering would index it with int32 offsets (overflow past 2^31)"
        )


def _load_pairs(ref, expert, col0, k0, *, block_n: int, block_k: int, cols_ok_N, k_ok_K):
    """int32 [block_n, block_k / 2]: the words (two inputs each: an MXFP4 byte, a uint16 FP8 pair) of expert's
    rows [col0, col0 + block_n) holding inputs [k0, k0 + block_k), zeros outside."""
    half_k = block_k // 2
    words_ok = None if k_ok_K is None else _range(k0 // 2, half_k) < ref.shape[2]
    words_NH = masked_load(ref.at[expert, pl.ds(col0, block_n), pl.ds(k0 // 2, half_k)], mask_2d(cols_ok_N, words_ok))
    return words_NH.astype(jnp.int32)


def _interleave(low_NH, high_NH):
    """[N, 2H]: low[:, j] at column 2j, high[:, j] at 2j + 1 (Triton's join)."""
    rows, half = low_NH.shape
    return jnp.stack([low_NH, high_NH], axis=-1).reshape(rows, 2 * half)


@dataclasses.dataclass(frozen=True)
class Dense:
    """A dense stacked weight [E, N, K]: one operand, read as stored."""

    num_operands: ClassVar[int] = 1

    def shape(self, refs) -> tuple[int, int, int]:
        return tuple(refs[0].shape)

    def load(self, refs, expert, col0, k0, *, block_n: int, block_k: int, cols_ok_N, k_ok_K, dtype):
        tile_NK = masked_load(refs[0].at[expert, pl.ds(col0, block_n), pl.ds(k0, block_k)], mask_2d(cols_ok_N, k_ok_K))
        return tile_NK.astype(dtype)


def _scale_rows(col0, block_n: int, block_rows: int, count: int):
    """The scale row of each of a tile's rows [col0, col0 + block_n): a scalar when they lie in one row block (col0
    is a multiple of block_n, so that holds when block_n divides block_rows), else one a row [N], clipped to the
    count (rows past the weight's edge read the last)."""
    if block_n <= block_rows and block_rows % block_n == 0:
        return col0 // block_rows
    return jnp.minimum(_range(col0, block_n) // block_rows, count - 1)


def _scale_tile(scales_ref, expert, rows, cols):
    """scales[expert, rows, cols] for scalar or vector (1-D) rows and cols: a scalar, [N, 1], [1, C] or [N, C]."""
    if jnp.ndim(rows) == 0 and jnp.ndim(cols) == 0:
        return scales_ref[expert, rows, cols]
    rows_N1 = jnp.reshape(rows, (-1, 1)) if jnp.ndim(rows) else jnp.full((1, 1), rows)
    cols_1C = jnp.reshape(cols, (1, -1)) if jnp.ndim(cols) else jnp.full((1, 1), cols)
    return plgpu.load(scales_ref.at[expert, rows_N1, cols_1C])


def _tile_scales(scales_ref, expert, rows, k0, *, block_k: int, group: int, to_float):
    """float32 scales of a tile's elements, broadcastable to [N, block_k]: the tile's inputs [k0, k0 + block_k) take
    the scale of their group of `group` inputs (k0 is a multiple of block_k). One group: one scale a row (a scalar
    when rows is); block_k a multiple of group: the block_k / group scales, each repeated over its group (a
    broadcast and a reshape); otherwise one gathered a column. to_float: the stored scales to float32."""
    count = scales_ref.shape[2]
    if block_k <= group and group % block_k == 0:
        return to_float(_scale_tile(scales_ref, expert, rows, k0 // group))
    if block_k % group:
        return to_float(_scale_tile(scales_ref, expert, rows, jnp.minimum(_range(k0, block_k) // group, count - 1)))
    groups = block_k // group
    scales = to_float(_scale_tile(scales_ref, expert, rows, jnp.minimum(_range(k0 // group, groups), count - 1)))
    num_rows = scales.shape[0]
    return jnp.broadcast_to(scales[:, :, None], (num_rows, groups, group)).reshape(num_rows, block_k)


def _as_float32(scales):
    return scales.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class BlockFP8:
    """Block-FP8 experts: e4m3 values [E, N, K] (paired: as uint16 pairs [E, N, K / 2], the first in the low
    byte) and fp32 scales [E, ceil(N / br), ceil(K / bc)], block (br, bc). Paired: block_k must be even."""

    block: tuple[int, int]
    paired: bool = True
    num_operands: ClassVar[int] = 2

    def shape(self, refs) -> tuple[int, int, int]:
        experts, rows, cols = refs[0].shape
        return experts, rows, 2 * cols if self.paired else cols

    def load_e4m3(self, values_ref, expert, col0, k0, *, block_n: int, block_k: int, cols_ok_N, k_ok_K):
        """The stored e4m3 values of the [block_n, block_k] tile at (col0, k0), zeros outside the masks (what the
        W8A8 kernels' FP8 products take)."""
        if not self.paired:
            tile = values_ref.at[expert, pl.ds(col0, block_n), pl.ds(k0, block_k)]
            return masked_load(tile, mask_2d(cols_ok_N, k_ok_K))
        pairs_NH = _load_pairs(
            values_ref, expert, col0, k0, block_n=block_n, block_k=block_k, cols_ok_N=cols_ok_N, k_ok_K=k_ok_K
        )
        bytes_NK = _interleave(pairs_NH & 0xFF, pairs_NH >> 8).astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(bytes_NK, jnp.float8_e4m3fn)

    def load(self, refs, expert, col0, k0, *, block_n: int, block_k: int, cols_ok_N, k_ok_K, dtype):
        values_ref, scales_ref = refs
        values_NK = self.load_e4m3(
            values_ref, expert, col0, k0, block_n=block_n, block_k=block_k, cols_ok_N=cols_ok_N, k_ok_K=k_ok_K
        ).astype(jnp.float32)
        block_rows, block_cols = self.block
        rows = _scale_rows(col0, block_n, block_rows, scales_ref.shape[1])
        scales = _tile_scales(scales_ref, expert, rows, k0, block_k=block_k, group=block_cols, to_float=_as_float32)
        return (values_NK * scales).astype(dtype)


def _e2m1_values(codes):
    """float32 values of E2M1 codes (int32, 0..15): the sign bit to fp16's bit 15, the 3 magnitude bits to bits
    9-11 (exponent 0-3 over fp16's bias 15, one mantissa bit; exponent 0 is fp16's denormal, 0.5 x 2^-14)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    as_fp16 = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return as_fp16.astype(jnp.float32) * _E2M1_AS_FP16


def _e8m0_values(exponents):
    """float32 2^(u - 127) of uint8 E8M0 exponents, built as fp32 bits (u = 0, 2^-127, reads as 0)."""
    return jax.lax.bitcast_convert_type(exponents.astype(jnp.int32) << _FP32_MANTISSA_BITS, jnp.float32)


@dataclasses.dataclass(frozen=True)
class MXFP4:
    """MXFP4 experts: packed codes uint8 [E, N, K / 2], scales [E, N, ceil(K / 32)] as uint8 E8M0 exponents
    (exponent_scales: float8_e8m0fnu reinterpreted) or float32 values. block_k must be even."""

    exponent_scales: bool
    num_operands: ClassVar[int] = 2

    def shape(self, refs) -> tuple[int, int, int]:
        experts, rows, half = refs[0].shape
        return experts, rows, 2 * half

    def load(self, refs, expert, col0, k0, *, block_n: int, block_k: int, cols_ok_N, k_ok_K, dtype):
        codes_ref, scales_ref = refs
        packed_NH = _load_pairs(
            codes_ref, expert, col0, k0, block_n=block_n, block_k=block_k, cols_ok_N=cols_ok_N, k_ok_K=k_ok_K
        )
        codes_NK = _interleave(packed_NH & 0x0F, packed_NH >> 4)
        rows = _scale_rows(col0, block_n, 1, codes_ref.shape[1])
        to_float = _e8m0_values if self.exponent_scales else _as_float32
        scales = _tile_scales(scales_ref, expert, rows, k0, block_k=block_k, group=MXFP4_GROUP, to_float=to_float)
        return (_e2m1_values(codes_NK) * scales).astype(dtype)


DENSE = Dense()
Format = Dense | BlockFP8 | MXFP4


def weight_format(weight, name: str = "weight") -> Format:
    """The format of an expert weight (module docstring); a quantised one with unexpected dtypes is refused."""
    if not is_quantized(weight):
        return DENSE
    values_dtype = np.dtype(weight.values.dtype)
    if getattr(weight, "block", None) is not None:
        if values_dtype != np.dtype(jnp.float8_e4m3fn):
            raise ValueError(f"{name}: block-FP8 values must be float8_e4m3fn, got {values_dtype.name}")
        return BlockFP8(tuple(int(b) for b in weight.block), paired=pairs_needed(weight.values))
    if values_dtype != np.dtype(jnp.uint8):
        raise ValueError(f"{name}: MXFP4 values must be uint8 (two E2M1 codes a byte), got {values_dtype.name}")
    scales_dtype = np.dtype(weight.scales.dtype)
    if scales_dtype != np.dtype(jnp.float8_e8m0fnu) and not jnp.issubdtype(scales_dtype, jnp.floating):
        raise ValueError(f"{name}: MXFP4 scales must be float8_e8m0fnu or float powers of two, got {scales_dtype.name}")
    return MXFP4(exponent_scales=scales_dtype == np.dtype(jnp.float8_e8m0fnu))


class StoredWeight(NamedTuple):
    """A quantised expert stack given as its arrays (what `kernel_operands` reads of a weight)."""

    values: jax.Array
    scales: jax.Array


def kernel_operands(weight, weight_format: Format, dtype=None, name: str = "weight") -> tuple[jax.Array, ...]:
    """The arrays a kernel takes for `weight`: a dense one cast to `dtype` (None: as stored); FP8 values (paired:
    as uint16 pairs, a bitcast) with fp32 scales; MXFP4 codes with E8M0 scales as uint8 exponents (a bitcast, no
    copy) or as float32. An operand int32 offsets cannot index is refused (`check_offsets`)."""
    if isinstance(weight_format, Dense):
        operands = (weight if dtype is None else weight.astype(dtype),)
    elif isinstance(weight_format, MXFP4) and weight_format.exponent_scales:
        operands = (weight.values, jax.lax.bitcast_convert_type(weight.scales, jnp.uint8))
    elif isinstance(weight_format, BlockFP8) and weight_format.paired:
        values = weight.values
        pairs = jax.lax.bitcast_convert_type(values.reshape(*values.shape[:-1], -1, 2), jnp.uint16)
        operands = (pairs, weight.scales.astype(jnp.float32))
    else:
        operands = (weight.values, weight.scales.astype(jnp.float32))
    for operand, part in zip(operands, ("values", "scales")):
        check_offsets(operand, f"{name} {part}" if len(operands) > 1 else name)
    return operands


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """One expert weight inside a kernel: its format and its refs."""

    format: Format
    refs: tuple

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense weight's [E, N, K]."""
        return self.format.shape(self.refs)

    def load(self, expert, col0, k0, *, block_n: int, block_k: int, cols_ok_N, k_ok_K, dtype):
        """[block_n, block_k] of expert `expert` at (col0, k0) in dtype, zeros outside the masks."""
        return self.format.load(
            self.refs,
            expert,
            col0,
            k0,
            block_n=block_n,
            block_k=block_k,
            cols_ok_N=cols_ok_N,
            k_ok_K=k_ok_K,
            dtype=dtype,
        )


def expert_tiles(refs, formats) -> list[ExpertTiles]:
    """The refs of weights in `formats` (each taking format.num_operands refs, in order) as ExpertTiles."""
    tiles, at = [], 0
    for each in formats:
        tiles.append(ExpertTiles(each, tuple(refs[at : at + each.num_operands])))
        at += each.num_operands
    if at != len(refs):
        raise ValueError(f"{len(refs)} weight refs for formats taking {at}")
    return tiles
