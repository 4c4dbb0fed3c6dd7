"""Weight-only dequantisation inside Pallas TPU (Mosaic) kernels: the stored weight tile is DMA'd into VMEM as
stored (e4m3 bytes, packed E2M1 nibbles, or a dense float), decoded and scaled there, and multiplied on the MXU
in the activation's dtype with fp32 accumulation. TPU v5e / v6e have no FP8 matrix unit, so this reads half
(FP8) or a quarter (MXFP4) of the bf16 weight bytes and does bf16 products.

Stored forms (`describe`), each a weight W [N, K] (out, in; stacked experts add a leading dim):
- dense: any float array;
- block FP8 (spec §6.2): e4m3 values [N, K], fp32 scales [ceil(N / br), ceil(K / bc)] (anything with `values`,
  `scales`, `block`: `ling_jax.quantized.BlockFP8Weight`, also its 1 x 32 MXFP4-as-FP8 experts);
- MXFP4 (spec §6.3): uint8 values [N, K / 2], element 2j in the low nibble of byte j, and one E8M0 scale per 32
  inputs [N, ceil(K / 32)] (float8_e8m0fnu codes, or float powers of two): `ling_jax.quantized.MXFP4Weight`.

The kernels take whole rows of K (a tile is [block_n, K] as stored; expert and linear K are at most a few
thousand) and walk them in 128-column chunks, statically unrolled: every lane slice is static. Scales:
- 128 x 128 blocks (scale_rows >= 8, whole chunks of columns): one scale a row block in a chunk, read by a
  static single-lane load and broadcast; with few rows (decode) it multiplies the chunk's [block_m, block_n]
  product rather than the weight tile (`scales_products`);
- one-row blocks narrower than a chunk (MXFP4's 32 inputs, the converter's 1 x 32 FP8): the chunk's [block_n,
  128] scale grid is the scale tile times a one-hot matrix, on the MXU (`_expand_by_matmul`; fp32 scales as
  three bf16 pieces, so exactly);
- other one-row blocks: a select per scale group a chunk touches.
An MXFP4 product splits K into even and odd elements (x's deinterleaved halves against the low and high
nibbles), so a byte is never spread across lanes.

FP8 is decoded by the TPU itself: the e4m3 bytes are handed to the kernel as float8_e4m3b11fnuz, the TPU's own
FP8 type (same bit layout, exponent bias 11: a hardware unpack, subnormals included), and the factor 16 between
the two goes into the scales; the b11 type's one NaN code, 0x80, is e4m3's -0 and is mapped to 0. At 8 rows the
libtpu-compiled linear kernel takes about 1,000 VLIW bundles a 256 x 4096 tile on v5e and v6e, against 2,800 for
decoding the bits with integer arithmetic (`scripts/compile_tpu_kernels.py` has the counts). E2M1 nibbles are
decoded with integer arithmetic (shifted to fp32 exponent and mantissa bits, rebiased by +126; the subnormal is
0.5), an E8M0 code u is the fp32 with exponent field u. Codes the checkpoints never hold are not special-cased:
e4m3's NaNs (0x7F, 0xFF) decode as +-480 and the E8M0 codes 0 and 255 (2^-127, NaN) as 0 and inf.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.fp8.reference import is_quantized

DENSE, BLOCK_FP8, MXFP4 = "dense", "block_fp8", "mxfp4"
LANES = 128
MXFP4_GROUP = 32
E4M3_OVER_B11 = 16.0  # an e4m3 byte's value over its float8_e4m3b11fnuz value: 2^(11 - 7)
VMEM_LIMIT_BYTES = 64 * 1024 * 1024  # v5e / v6e have 128 MiB of VMEM, v5p 95 MiB; the default limit is 16-32
TILE_BUDGET_BYTES = 24 * 1024 * 1024  # double-buffered input and output tiles of one grid step, at most
POST_SCALE_MAX_ROWS = 32  # up to this many rows a tile, a 128 x 128-block scale multiplies the product


@dataclasses.dataclass(frozen=True)
class TileFormat:
    """How a weight is stored, as a kernel reads it. kind: DENSE, BLOCK_FP8 or MXFP4. scale_rows x scale_cols:
    the stored elements (rows, stored columns: bytes for MXFP4) one scale covers; (0, 0) for DENSE. parts: how
    many x operands a stored column pairs with (MXFP4: the even and odd elements, 2)."""

    kind: str
    scale_rows: int = 0
    scale_cols: int = 0

    @property
    def parts(self) -> int:
        return 2 if self.kind == MXFP4 else 1

    @property
    def scaled(self) -> bool:
        return self.kind != DENSE


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """A weight ready for a kernel: its format, values [..., N, Kp] (Kp stored columns; FP8 as
    float8_e4m3b11fnuz), scales [..., ceil(N / scale_rows), ceil(Kp / scale_cols)] (fp32, FP8's times 16, or uint8
    E8M0 codes) or None, and the dense in-features K."""

    fmt: TileFormat
    values: jax.Array
    scales: jax.Array | None
    in_features: int

    @property
    def out_features(self) -> int:
        return self.values.shape[-2]


def as_dense(weight, dtype) -> jax.Array:
    """`weight` as a dense array of `dtype` (a quantised weight dequantised by its own `dequantize`)."""
    return weight.dequantize(dtype) if is_quantized(weight) else weight.astype(dtype)


def describe(weight) -> StoredWeight:
    """The kernel's view of a dense array, a block-FP8 weight (`values` e4m3, `scales`, `block`) or an MXFP4
    weight (`values` uint8, `scales` E8M0 or float); a ValueError naming what else was given."""
    if not is_quantized(weight):
        if not jnp.issubdtype(weight.dtype, jnp.floating):
            raise ValueError(f"weight: expected a float array or a quantised weight, got dtype {weight.dtype}")
        return StoredWeight(TileFormat(DENSE), weight, None, weight.shape[-1])
    values, scales = weight.values, weight.scales
    if values.dtype == jnp.float8_e4m3fn:
        return block_fp8(values, scales, tuple(weight.block))
    if values.dtype == jnp.uint8:
        if scales.dtype == jnp.float8_e8m0fnu:
            codes = jax.lax.bitcast_convert_type(scales, jnp.uint8)
        else:
            codes = scales.astype(jnp.float32)
        fmt = TileFormat(MXFP4, 1, MXFP4_GROUP // 2)
        return StoredWeight(fmt, values, codes, 2 * values.shape[-1])
    raise ValueError(f"weight.values: expected float8_e4m3fn (block FP8) or uint8 (MXFP4 nibbles), got {values.dtype}")


def block_fp8(values, scales, block: tuple[int, int]) -> StoredWeight:
    """A block-FP8 weight's kernel view: the e4m3 bytes as the TPU's own FP8 type, float8_e4m3b11fnuz (a free
    bitcast: the same bit layout with exponent bias 11, so each value is 1/16 of the e4m3 one), and the fp32
    scales times 16 (exact)."""
    native = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3b11fnuz)
    return StoredWeight(
        TileFormat(BLOCK_FP8, *block), native, scales.astype(jnp.float32) * E4M3_OVER_B11, values.shape[-1]
    )


def kernel_takes(stored: StoredWeight) -> bool:
    """Whether the kernels' scale handling covers this format: scale blocks of one row or a multiple of 8 rows
    (a sublane tile), and of a divisor or a multiple of 128 stored columns."""
    fmt = stored.fmt
    if not fmt.scaled:
        return True
    rows_ok = fmt.scale_rows == 1 or fmt.scale_rows % 8 == 0
    cols_ok = fmt.scale_cols > 0 and (LANES % fmt.scale_cols == 0 or fmt.scale_cols % LANES == 0)
    return rows_ok and cols_ok


def x_parts(x_MK, fmt: TileFormat) -> jax.Array:
    """x [M, K] as the kernel's [parts, M, Kp]: itself, or for MXFP4 its even and odd columns (one XLA pass over
    x, so that a packed byte's two nibbles meet their inputs in the same lane)."""
    if fmt.kind != MXFP4:
        return x_MK[None]
    num_rows, k_dim = x_MK.shape
    return x_MK.reshape(num_rows, k_dim // 2, 2).transpose(2, 0, 1)


def block_n_for(fmt: TileFormat, block_n: int, out_features: int) -> int:
    """A tile of output rows that holds whole scale rows: block_n rounded to a multiple of scale_rows (at most
    the scale rows covering out_features), or to a multiple of 8."""
    if fmt.scale_rows > 1:
        row_blocks = -(-out_features // fmt.scale_rows)
        return fmt.scale_rows * max(1, min(block_n // fmt.scale_rows, row_blocks))
    return max(8, min(block_n, -(-out_features // 8) * 8) // 8 * 8)


def scale_operand(stored: StoredWeight) -> jax.Array:
    """The scales as the kernels' block specs read them: [..., N, Kg] for one-row scale blocks, else
    [..., Nb, 1, Kg] (a unit sublane dim, so that a tile's few scale rows are a legal block; scales are small)."""
    scales = stored.scales
    return scales if stored.fmt.scale_rows == 1 else jnp.expand_dims(scales, -2)


def scale_block_shape(fmt: TileFormat, block_n: int, scale_cols: int) -> tuple[int, ...]:
    """The block of `scale_operand` that covers a [block_n, Kp] weight tile (leading dims excluded)."""
    if fmt.scale_rows == 1:
        return (block_n, scale_cols)
    return (block_n // fmt.scale_rows, 1, scale_cols)


def fit_tiles(block_m: int, block_n: int, stored: StoredWeight, x_dtype, out_dtype) -> tuple[int, int]:
    """(block_m, block_n) halved (to multiples of 8), the larger first, until a grid step's double-buffered
    tiles fit TILE_BUDGET_BYTES."""
    fmt, k_stored = stored.fmt, stored.values.shape[-1]

    def step_bytes(bm: int, bn: int) -> int:
        x_bytes = fmt.parts * bm * k_stored * jnp.dtype(x_dtype).itemsize
        w_bytes = bn * k_stored * stored.values.dtype.itemsize
        s_bytes = 0 if stored.scales is None else bn * stored.scales.shape[-1] * 4
        return 2 * (x_bytes + w_bytes + s_bytes) + 2 * bm * bn * jnp.dtype(out_dtype).itemsize

    while step_bytes(block_m, block_n) > TILE_BUDGET_BYTES and max(block_m, block_n) > 8:
        if block_m >= block_n and block_m > 8:
            block_m = max(8, block_m // 16 * 8)
        else:
            block_n = max(8, block_n // 16 * 8)
    return block_m, block_n


def cost_estimate(x_MK, stored: StoredWeight, x_reads: int) -> pl.CostEstimate:
    """What XLA is told a call costs: a product of every row with one [N, K] weight, every stored weight byte
    read once (an upper bound for experts: the unvisited ones are not read), x read x_reads times, y written."""
    num_rows, k_dim = x_MK.shape
    x_bytes = x_MK.size * x_MK.dtype.itemsize
    w_bytes = stored.values.size * stored.values.dtype.itemsize
    s_bytes = 0 if stored.scales is None else stored.scales.size * stored.scales.dtype.itemsize
    y_bytes = num_rows * stored.out_features * x_MK.dtype.itemsize
    return pl.CostEstimate(
        flops=2 * num_rows * k_dim * stored.out_features,
        transcendentals=0,
        bytes_accessed=w_bytes + s_bytes + x_reads * x_bytes + y_bytes,
    )


def compiler_params(dimension_semantics: tuple[str, ...]) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics, vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _f32_from_bits(bits):
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bits_of_f32(values):
    return jax.lax.bitcast_convert_type(values, jnp.int32)


def _e2m1_to_f32(nibble):
    """int32 E2M1 codes 0..15 -> their fp32 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated."""
    magnitude = nibble & 0x7
    normal = (magnitude << 22) + (126 << 23)
    subnormal = _bits_of_f32(magnitude.astype(jnp.float32) * 0.5)
    return _f32_from_bits(jnp.where(magnitude < 2, subnormal, normal) | ((nibble & 0x8) << 28))


def _scale_values(codes):
    """A scale tile in fp32: uint8 E8M0 codes u -> 2^(u - 127), floats as they are."""
    if codes.dtype == jnp.uint8:
        return _f32_from_bits(codes.astype(jnp.int32) << 23)
    return codes.astype(jnp.float32)


def _decode(stored_tile, fmt: TileFormat) -> list:
    """A stored [rows, cols] tile -> one fp32 tile per x part (MXFP4: low nibbles, high nibbles)."""
    if fmt.kind == DENSE:
        return [stored_tile.astype(jnp.float32)]
    if fmt.kind == BLOCK_FP8:
        # The TPU unpacks its own FP8 type in hardware; its one NaN code, 0x80, is e4m3's -0.
        values = stored_tile.astype(jnp.float32)
        return [jnp.where(values == values, values, 0.0)]
    byte = stored_tile.astype(jnp.int32)
    return [_e2m1_to_f32(byte & 0xF), _e2m1_to_f32(byte >> 4)]


def _expand_columns(load_column, first: int, width: int, scale_cols: int):
    """The scales of stored columns [first, first + width) from the scale columns covering them: column g's
    scales (`load_column(g)`, [rows, 1]) broadcast over its lanes, a select per further group."""
    first_group, last_group = first // scale_cols, (first + width - 1) // scale_cols
    expanded = _scale_values(load_column(first_group))
    if last_group == first_group:
        return expanded
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) + first
    for group in range(first_group + 1, last_group + 1):
        expanded = jnp.where(lane >= group * scale_cols, _scale_values(load_column(group)), expanded)
    return expanded


def _expand_by_matmul(scale_pieces: list, first: int, width: int, scale_cols: int):
    """[rows, width] fp32: the scales of stored columns [first, first + width) from a whole [rows, groups] scale
    tile, as its product with a one-hot [groups, width] matrix on the MXU (idle at decode sizes) rather than
    lane broadcasts and selects on the VPU. The tile comes as bf16 pieces that sum to it (`_scale_pieces`): each
    product is exact (one term a sum), and so is their fp32 sum."""
    groups = scale_pieces[0].shape[1]
    shift = scale_cols.bit_length() - 1  # scale_cols divides 128: a power of two
    lane_group = (jax.lax.broadcasted_iota(jnp.int32, (groups, width), 1) + first) >> shift
    one_hot = (jax.lax.broadcasted_iota(jnp.int32, (groups, width), 0) == lane_group).astype(jnp.bfloat16)
    expanded = [jnp.dot(piece, one_hot, preferred_element_type=jnp.float32) for piece in scale_pieces]
    return functools.reduce(jnp.add, expanded)


def _scale_pieces(scale_ref) -> list:
    """The whole scale tile of a one-row-block format as bf16 pieces summing to it exactly: E8M0 codes are powers
    of two, one piece; fp32 scales split in three (8 significant bits each)."""
    values = _scale_values(scale_ref[...])
    if scale_ref.dtype == jnp.uint8:
        return [values.astype(jnp.bfloat16)]
    pieces = []
    for _ in range(3):
        piece = values.astype(jnp.bfloat16)
        pieces.append(piece)
        values = values - piece.astype(jnp.float32)
    return pieces


def _expands_by_matmul(fmt: TileFormat) -> bool:
    """Whether a chunk's scales come from `_expand_by_matmul`: one-row scale blocks narrower than a chunk."""
    return fmt.scaled and fmt.scale_rows == 1 and fmt.scale_cols < LANES


def _scaled(tiles: list, scale_ref, fmt: TileFormat, first: int, width: int, scale_pieces=None) -> list:
    """The decoded tiles of stored columns [first, first + width) times their scales."""
    if scale_pieces is not None:
        scale = _expand_by_matmul(scale_pieces, first, width, fmt.scale_cols)
        return [tile * scale for tile in tiles]
    if fmt.scale_rows == 1:
        scale = _expand_columns(lambda g: scale_ref[:, g : g + 1], first, width, fmt.scale_cols)
        return [tile * scale for tile in tiles]
    block_rows = fmt.scale_rows
    row_blocks = tiles[0].shape[0] // block_rows
    scaled = []
    for tile in tiles:
        pieces = [
            tile[i * block_rows : (i + 1) * block_rows]
            * _expand_columns(lambda g, i=i: scale_ref[i, :, g : g + 1], first, width, fmt.scale_cols)
            for i in range(row_blocks)
        ]
        scaled.append(pieces[0] if row_blocks == 1 else jnp.concatenate(pieces, axis=0))
    return scaled


def _output_scales(scale_ref, fmt: TileFormat, first: int, block_n: int):
    """[1, block_n]: the scale of each output column for the K block holding stored column `first` (scale
    blocks of scale_rows >= 8 rows and whole 128-column multiples: one scale a row block in a chunk)."""
    group = first // fmt.scale_cols
    pieces = [
        jnp.broadcast_to(scale_ref[i, :, group : group + 1], (1, fmt.scale_rows))
        for i in range(block_n // fmt.scale_rows)
    ]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def scales_products(fmt: TileFormat, block_m: int) -> bool:
    """Whether a chunk's scale multiplies its [block_m, block_n] product instead of the weight tile: where the
    scale is constant over the chunk's inputs for each output (row blocks, K blocks of whole chunks) and the
    product is smaller than the tile (few rows: decode). Saves a multiply a weight element."""
    blocks_fit = fmt.scale_rows > 1 and fmt.scale_cols % LANES == 0
    return fmt.scaled and blocks_fit and block_m <= POST_SCALE_MAX_ROWS


def dequantized_product(x_ref, w_ref, scale_ref, fmt: TileFormat):
    """[block_m, block_n] fp32: x [parts, block_m, Kp] times the dequantised weight tile [block_n, Kp]
    transposed, 128 stored columns a step: each chunk decoded in fp32, scaled (the tile, or its product with
    few rows: `scales_products`), cast to x's dtype, one MXU product per x part (fp32 at full precision)."""
    dtype = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    contract_k = (((1,), (1,)), ((), ()))
    block_m, (block_n, k_stored) = x_ref.shape[1], w_ref.shape
    post_scale = scales_products(fmt, block_m)
    scale_pieces = _scale_pieces(scale_ref) if _expands_by_matmul(fmt) else None
    acc = None
    for first in range(0, k_stored, LANES):
        width = min(LANES, k_stored - first)
        tiles = _decode(w_ref[:, first : first + width], fmt)
        if fmt.scaled and not post_scale:
            tiles = _scaled(tiles, scale_ref, fmt, first, width, scale_pieces)
        for part, tile in enumerate(tiles):
            product = jax.lax.dot_general(
                x_ref[part, :, first : first + width],
                tile.astype(dtype),
                contract_k,
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            if post_scale:
                product = product * _output_scales(scale_ref, fmt, first, block_n)
            acc = product if acc is None else acc + product
    return acc
