"""The VL model's vision side (spec §7): the Qwen3-VL ViT, the `linear_proj` projector and the merge of vision
embeddings into the text embeddings.

Pixels arrive as the processor's flattened patches, [N, C * temporal_patch * patch * patch], each image or
video's patches in spatial-merge-block order (frame, block row, block col, row in block, col in block), with
its grid (t, h, w) in patches (`ling_jax.vl.image_processing`). The tower embeds patches with a Conv3d (a matmul
here), adds the learned position table resampled bilinearly (align corners) to the grid, runs pre-LayerNorm
blocks whose attention stays inside each frame and rotates queries and keys by the patch's (row, col) with a
2-D RoPE, and merges each 2x2 block into one token. Grids are static: each distinct set of grids compiles once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.layers import normal_param, param
from ling_jax.mrope import MediaGrid
from ling_jax.rope import apply_rope
from ling_jax.vl.config import VisionConfig

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
}


class BiasedLinear(nnx.Module):
    """y = x @ weight.T + bias, weight [out, in] as stored in checkpoints."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], dtype, rngs: nnx.Rngs):
        self.weight = normal_param(rngs, (out_features, in_features), dtype, axes)
        self.bias = normal_param(rngs, (out_features,), dtype, axes[:1])

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype)) + self.bias[...].astype(x.dtype)


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.bias = param(jnp.zeros((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class ExactGELU(nnx.Module):
    """The parameter-free middle entry of linear_proj (checkpoint index 1 of the Sequential)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=False)


class PatchProjection(nnx.Module):
    """The Conv3d patch embedding: kernel = stride = (temporal_patch, patch, patch), so a matmul per patch."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.weight = normal_param(rngs, shape, dtype, ("vision_embed", None, None, None, None))
        self.bias = normal_param(rngs, (c.hidden_size,), dtype, ("vision_embed",))

    def __call__(self, pixels_NK: jax.Array) -> jax.Array:
        weight_DK = self.weight[...].reshape(self.weight.shape[0], -1)
        return jnp.einsum("nk,dk->nd", pixels_NK.astype(weight_DK.dtype), weight_DK) + self.bias[...]


class PatchEmbed(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.proj = PatchProjection(config, dtype=dtype, rngs=rngs)

    def __call__(self, pixels_NK: jax.Array) -> jax.Array:
        return self.proj(pixels_NK)


class PositionTable(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.weight = normal_param(
            rngs, (config.num_position_embeddings, config.hidden_size), dtype, ("vision_positions", "vision_embed")
        )


class VisionAttention(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = BiasedLinear(d, 3 * d, axes=("vision_qkv", "vision_embed"), dtype=dtype, rngs=rngs)
        self.proj = BiasedLinear(d, d, axes=("vision_embed", "vision_qkv"), dtype=dtype, rngs=rngs)

    def __call__(
        self, x_ND: jax.Array, cos_NF: jax.Array, sin_NF: jax.Array, frames: Sequence[tuple[int, int]]
    ) -> jax.Array:
        """frames: (number of frames, patches per frame) per media, in order; attention stays inside a frame."""
        n = x_ND.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x_ND).reshape(n, 3, self.num_heads, -1), 1, 0)
        q_NHK = apply_rope(q[None], cos_NF[None], sin_NF[None], interleave=False)[0]
        k_NHK = apply_rope(k[None], cos_NF[None], sin_NF[None], interleave=False)[0]
        scale = q_NHK.shape[-1] ** -0.5
        outputs, offset = [], 0
        for count, per_frame in frames:
            part = slice(offset, offset + count * per_frame)
            q_FPHK, k_FPHK, v_FPHK = (a[part].reshape(count, per_frame, self.num_heads, -1) for a in (q_NHK, k_NHK, v))
            scores = jnp.einsum("fqhk,fshk->fhqs", q_FPHK, k_FPHK, preferred_element_type=jnp.float32) * scale
            weights = jax.nn.softmax(scores, axis=-1).astype(v_FPHK.dtype)
            outputs.append(jnp.einsum("fhqs,fshk->fqhk", weights, v_FPHK).reshape(count * per_frame, -1))
            offset += count * per_frame
        return self.proj(jnp.concatenate(outputs, axis=0))


class VisionMLP(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.linear_fc1 = BiasedLinear(
            config.hidden_size, config.intermediate_size, axes=("vision_mlp", "vision_embed"), dtype=dtype, rngs=rngs
        )
        self.linear_fc2 = BiasedLinear(
            config.intermediate_size, config.hidden_size, axes=("vision_embed", "vision_mlp"), dtype=dtype, rngs=rngs
        )
        self.activation = config.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(_ACTIVATIONS[self.activation](self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)
        self.norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)
        self.attn = VisionAttention(config, dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x_ND, cos_NF, sin_NF, frames):
        x_ND = x_ND + self.attn(self.norm1(x_ND), cos_NF, sin_NF, frames)
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchMerger(nnx.Module):
    """LayerNorm per patch, then each merge x merge block's patches concatenated into one token and, unless
    `disable_merger_proj`, Linear -> exact GELU -> Linear to out_hidden_size."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.merged_dim = c.merged_dim
        self.norm = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)
        if not c.disable_merger_proj:
            self.linear_fc1 = BiasedLinear(
                c.merged_dim, c.merged_dim, axes=("vision_merged", "vision_merged_in"), dtype=dtype, rngs=rngs
            )
            self.linear_fc2 = BiasedLinear(
                c.merged_dim, c.out_hidden_size, axes=("vision_out", "vision_merged"), dtype=dtype, rngs=rngs
            )

    def __call__(self, x_ND: jax.Array) -> jax.Array:
        merged_MK = self.norm(x_ND).reshape(-1, self.merged_dim)
        if not hasattr(self, "linear_fc1"):
            return merged_MK
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(merged_MK), approximate=False))


class VisionTransformer(nnx.Module):
    """`model.visual`: flattened patches [N, patch_dim] of media `grids` -> merged tokens [N / merge^2, output_dim]."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.patch_embed = PatchEmbed(config, dtype=dtype, rngs=rngs)
        self.pos_embed = PositionTable(config, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(config, dtype=dtype, rngs=rngs) for _ in range(config.depth)])
        self.merger = PatchMerger(config, dtype=dtype, rngs=rngs)

    def __call__(self, pixels_NK: jax.Array, grids: Sequence[MediaGrid]) -> jax.Array:
        c = self.config
        check_grids(grids, pixels_NK.shape, c)
        x_ND = self.patch_embed(pixels_NK)
        taps_N4, weights_N4 = position_interpolation(grids, c)
        table = self.pos_embed.weight[...]
        positions_ND = jnp.einsum("nt,ntd->nd", jnp.asarray(weights_N4, table.dtype), table[jnp.asarray(taps_N4)])
        x_ND = x_ND + positions_ND.astype(x_ND.dtype)
        cos_NF, sin_NF = rotary_cos_sin(grids, c)
        frames = [(g.t, g.h * g.w) for g in grids]
        for block in self.blocks:
            x_ND = block(x_ND, cos_NF, sin_NF, frames)
        return self.merger(x_ND)


def check_grids(grids: Sequence[MediaGrid], pixels_shape: tuple[int, ...], config: VisionConfig) -> None:
    merge = config.spatial_merge_size
    for grid in grids:
        if min(grid.t, grid.h, grid.w) <= 0 or grid.h % merge or grid.w % merge:
            raise ValueError(f"grid {grid}: t, h, w must be positive and h, w multiples of spatial_merge_size={merge}")
    patches = sum(g.t * g.h * g.w for g in grids)
    if tuple(pixels_shape) != (patches, config.patch_dim):
        raise ValueError(
            f"pixel_values has shape {list(pixels_shape)}; the grids need "
            f"[{patches}, {config.patch_dim}] (patches x channels * temporal_patch * patch^2)"
        )


def block_order_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one h x w frame, in spatial-merge-block order."""
    block_row, block_col, in_row, in_col = np.indices((h // merge, w // merge, merge, merge)).reshape(4, -1)
    return block_row * merge + in_row, block_col * merge + in_col


def rotary_cos_sin(grids: Sequence[MediaGrid], config: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """The 2-D RoPE tables [N, head_dim / 2] (NeoX pairs): the first head_dim / 4 frequencies turn with the
    patch's row, the next head_dim / 4 with its column; every frame of a video repeats its image's table."""
    quarter = config.head_dim // 4
    inv_freq = config.rope_theta ** -(np.arange(quarter, dtype=np.float64) * 2 / (config.head_dim // 2))
    angles = []
    for grid in grids:
        rows, cols = block_order_rows_cols(grid.h, grid.w, config.spatial_merge_size)
        frame = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=1)
        angles.append(np.tile(frame, (grid.t, 1)))
    angles_NF = jnp.asarray(np.concatenate(angles), jnp.float32)
    return jnp.cos(angles_NF), jnp.sin(angles_NF)


def position_interpolation(grids: Sequence[MediaGrid], config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align corners) resampling of the side x side position table to each frame's grid: four
    table rows [N, 4] and their weights [N, 4] per patch, in block order."""
    side = config.grid_side
    taps, weights = [], []
    for grid in grids:
        rows, cols = block_order_rows_cols(grid.h, grid.w, config.spatial_merge_size)
        row_taps, row_weights = _axis_taps(rows, grid.h, side)
        col_taps, col_weights = _axis_taps(cols, grid.w, side)
        frame_taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        frame_weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
        taps.append(np.tile(frame_taps, (grid.t, 1)))
        weights.append(np.tile(frame_weights, (grid.t, 1)))
    return np.concatenate(taps), np.concatenate(weights)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    source = index * (side - 1) / max(size - 1, 1)
    low = np.floor(source)
    taps = np.stack([low, low + 1], axis=1)
    weights = np.clip(1.0 - np.abs(source[:, None] - taps), 0.0, None)
    return np.clip(taps, 0, side - 1).astype(np.int32), weights


def make_projector(config: VisionConfig, text_hidden: int, *, dtype, rngs: nnx.Rngs) -> nnx.List:
    """`linear_proj`: Linear(output_dim -> D) -> exact GELU -> Linear(D -> D), indexed as the checkpoint's
    Sequential (0, 1, 2)."""
    return nnx.List(
        [
            BiasedLinear(config.output_dim, text_hidden, axes=("vision_proj", "vision_out"), dtype=dtype, rngs=rngs),
            ExactGELU(),
            BiasedLinear(text_hidden, text_hidden, axes=("vision_proj", "vision_proj_in"), dtype=dtype, rngs=rngs),
        ]
    )


def project(linear_proj: nnx.List, vision_MK: jax.Array, *, l2_normalize: bool) -> jax.Array:
    """Vision tokens -> text embeddings [M, D]; optionally L2-normalised (`norm_query_embeds`)."""
    x = vision_MK
    for layer in linear_proj:
        x = layer(x)
    if l2_normalize:
        xf = x.astype(jnp.float32)
        x = (xf / jnp.maximum(jnp.linalg.norm(xf, axis=-1, keepdims=True), 1e-12)).astype(x.dtype)
    return x


def merge_media(embeds_BTD: jax.Array, input_ids_BT: jax.Array, media_MD: jax.Array, token_id: int) -> jax.Array:
    """Replace the embedding of every `token_id` pad token with the next row of media_MD (row-major order over
    the batch); the caller checks that there are exactly M pad tokens (`ling_jax.mrope.mrope_positions`)."""
    is_pad_BT = input_ids_BT == token_id
    index_BT = jnp.cumsum(is_pad_BT.reshape(-1)).reshape(is_pad_BT.shape) - 1
    gathered_BTD = media_MD[jnp.clip(index_BT, 0, media_MD.shape[0] - 1)].astype(embeds_BTD.dtype)
    return jnp.where(is_pad_BT[..., None], gathered_BTD, embeds_BTD)
