"""KDA's short causal convs + SiLU on GPU (`reference.short_conv_silu`), one Pallas kernel (Triton lowering) for all
the parts (q, k and v): a program takes block_t tokens x block_c channels of each part and writes the part's output
once; each token's K-1 earlier inputs are read as the blocks of rows 1..K-1 back (contiguous), a gather (masked to
those tokens) taking the ones whose input lies elsewhere: before a pad (`reference.conv_sources` gives every
token's real inputs) or in the conv window.

On an H100 (2026-12-07, q, k and v of 4096 channels over 8192 tokens, docs/benchmarks/kda.md): 472 us with every
token real, 431 us with 100 pads, against 478 / 712 us for the jnp gathers and 813 / 909 us for the form before
(the window joined to a copy of q, k and v, pads sorted out); 16 x 128 blocks at 4 warps were the fastest of seven
tile settings (32 x 128: 682 / 634 us). A second H100 run (`benchmarks.kda_conv`) found the kernel and the jnp
gathers even (468 / 441 us against 432 / 441)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    """block_t tokens x block_c channels a program (powers of two), num_warps warps."""

    block_t: int = 16
    block_c: int = 128
    num_warps: int = 4


def _kernel(
    positions_ref, real_ref, window_ref, weight_ref, *refs, lag: int, block_t: int, block_c: int, interpret: bool
):
    """positions [lag, B, T] int32 (lag l+1's input of each token in [window ; part]), real [B, T] int32, window
    [B, lag, P x C] in the parts' dtype, weight [lag + 1, P x C] fp32 (tap-major), then the P parts [B, T, C] and
    their P outputs. Each earlier input is read as the block of rows `lag - tap` back (contiguous, vector loads). A
    block whose tokens are all real and past the first `lag` (a prefill chunk's blocks but the first) takes nothing
    else; in the others the tokens whose input is elsewhere (a pad in between, or the window) take it by a gather,
    masked off for the rest."""
    parts, outputs = refs[: len(refs) // 2], refs[len(refs) // 2 :]
    length, width = parts[0].shape[1:]
    b, t0, c0 = pl.program_id(0), pl.program_id(1) * block_t, pl.program_id(2) * block_c
    rows_T, cols_C = t0 + jnp.arange(block_t), c0 + jnp.arange(block_c)
    row_ok_T, col_ok_C = rows_T < length, cols_C < width
    ok_TC = row_ok_T[:, None] & col_ok_C[None, :]
    tokens, columns = pl.ds(t0, block_t), pl.ds(c0, block_c)
    sources = [plgpu.load(positions_ref.at[jnp.int32(l), b, tokens], mask=row_ok_T, other=lag) for l in range(lag)]
    real_T = plgpu.load(real_ref.at[b, tokens], mask=row_ok_T, other=0)
    gathers = [(position_T != rows_T - back + lag) & row_ok_T for back, position_T in enumerate(sources, start=1)]
    regular = t0 >= lag
    for gather_T in gathers:  # (Triton lowers no boolean reduction)
        regular = regular & (jnp.max(gather_T.astype(jnp.int32)) == 0)

    def shifted_rows(back: int):
        """The block's rows `back` earlier: a slice, or (the interpreter clamps a slice's start into range) an index
        array."""
        return (rows_T - back)[:, None] if interpret else pl.ds(t0 - back, block_t)

    def load_shifted(u_ref, back: int, mask_TC):
        at = u_ref.at[b, shifted_rows(back), cols_C[None, :] if interpret else columns]
        return plgpu.load(at, mask=mask_TC, other=0.0)

    def gathered(u_ref, p: int, back: int):
        """The inputs `back` real tokens earlier: the shifted block where that is each token's, gathers (every
        index an array) from the part or the window where not."""
        position_T, gather_T = sources[back - 1], gathers[back - 1] | (rows_T < back)
        x_TC = load_shifted(u_ref, back, (~gather_T)[:, None] & ok_TC)
        in_part_T = position_T >= lag
        from_part = plgpu.load(
            u_ref.at[b, jnp.maximum(position_T - lag, 0)[:, None], cols_C[None, :]],
            mask=(gather_T & in_part_T)[:, None] & ok_TC,
            other=0.0,
        )
        from_window = plgpu.load(
            window_ref.at[b, jnp.minimum(position_T, lag - 1)[:, None], p * width + cols_C[None, :]],
            mask=(gather_T & ~in_part_T)[:, None] & ok_TC,
            other=0.0,
        )
        return jnp.where(gather_T[:, None], jnp.where(in_part_T[:, None], from_part, from_window), x_TC)

    def convs(earlier):
        """Each part's conv + SiLU with earlier(u_ref, p, back) its inputs `back` tokens earlier, stored."""
        for p, (u_ref, y_ref) in enumerate(zip(parts, outputs, strict=True)):
            channels = pl.ds(p * width + c0, block_c)
            acc_TC = jnp.zeros((block_t, block_c), jnp.float32)
            for tap in range(lag + 1):
                weight_C = plgpu.load(weight_ref.at[jnp.int32(tap), channels], mask=col_ok_C, other=0.0)
                back = lag - tap  # tap j weighs the input lag - j real tokens back
                if back == 0:
                    x_TC = plgpu.load(u_ref.at[b, tokens, columns], mask=ok_TC, other=0.0)
                else:
                    x_TC = earlier(u_ref, p, back)
                acc_TC = acc_TC + x_TC.astype(jnp.float32) * weight_C[None, :]
            y_TC = acc_TC / (1.0 + jnp.exp(-acc_TC))
            y_TC = jnp.where(real_T[:, None] != 0, y_TC, 0.0)
            plgpu.store(y_ref.at[b, tokens, columns], y_TC.astype(y_ref.dtype), mask=ok_TC)

    pl.when(regular)(lambda: convs(lambda u_ref, p, back: load_shifted(u_ref, back, ok_TC)))
    pl.when(~regular)(lambda: convs(gathered))


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def short_conv_silu_gpu(
    parts_BTC, window_BWC, weight_CK, real_BT, positions_LBT, *, tiles: ConvTiles | None = None, interpret=False
):
    """[y [B, T, C] in the parts' dtype for each part] (`reference.short_conv_silu`'s): the parts all C wide, the
    window [B, K-1, P x C] and weight [P x C, K] holding theirs side by side, real [B, T] (pads' outputs 0),
    positions [K-1, B, T] from `reference.conv_sources`. Grid (B, T / block_t, C / block_c), masked at the edges."""
    tiles = tiles or ConvTiles()
    batch, length, width = parts_BTC[0].shape
    dtype = parts_BTC[0].dtype
    if any(u.shape != parts_BTC[0].shape or u.dtype != dtype for u in parts_BTC):
        raise ValueError(f"short_conv_silu_gpu takes parts of one shape and dtype, got {[u.shape for u in parts_BTC]}")
    lag = weight_CK.shape[1] - 1
    kernel = functools.partial(_kernel, lag=lag, block_t=tiles.block_t, block_c=tiles.block_c, interpret=interpret)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n)  # noqa: E731 - the kernel indexes
    inputs = (
        positions_LBT.astype(jnp.int32),
        real_BT.astype(jnp.int32),
        window_BWC.astype(dtype),
        weight_CK.astype(jnp.float32).T,
        *parts_BTC,
    )
    out_shape = [jax.ShapeDtypeStruct(u.shape, dtype) for u in parts_BTC]
    return pl.pallas_call(
        kernel,
        grid=(batch, pl.cdiv(length, tiles.block_t), pl.cdiv(width, tiles.block_c)),
        in_specs=[whole(a) for a in inputs],
        out_specs=[whole(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_short_conv_silu",
    )(*inputs)
