"""3-axis (t, h, w) rotary positions of the VL model (spec §7).

Host side: `mrope_positions` turns a prompt with image / video pad tokens into per-token (t, h, w) positions.
Text tokens get t = h = w = a running index; a media block of merged grid (T, Hm, Wm) after text_len text
tokens at base b gets t = b + text_len + 2 * frame, h = t + row - (Hm - 1) // 2, w = t + col - (Wm - 1) // 2
(centred, possibly negative), and the following text restarts at max(t) + 1. The returned delta (the next
token's position minus its index: max t + 1 - tokens) shifts every later token, so decode continues there.

Device side: `mrope_angles` rotates each of the rope_dim / 2 frequencies by the position of its axis: with
sections [t, h, w] (h == w) the first h + w frequencies alternate h (even index) / w (odd index) and the last
t frequencies follow t. With t = h = w (text only) this is ordinary 1-D RoPE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

T_AXIS, H_AXIS, W_AXIS = 0, 1, 2
FRAME_STRIDE = 2  # SGLang advances t by 2 per frame, for images and videos alike


@dataclasses.dataclass(frozen=True)
class MediaGrid:
    """An image or video in patches (before the spatial merge): temporal x height x width."""

    t: int
    h: int
    w: int

    def merged(self, merge: int) -> tuple[int, int, int]:
        return self.t, self.h // merge, self.w // merge

    def num_tokens(self, merge: int) -> int:
        """Pad tokens (= merged vision tokens) this media occupies in the prompt."""
        t, hm, wm = self.merged(merge)
        return t * hm * wm


def frequency_axes(mrope_section: Sequence[int]) -> np.ndarray:
    """Which axis (T_AXIS, H_AXIS, W_AXIS) rotates each frequency, [sum(mrope_section)]."""
    t, h, w = mrope_section
    axes = np.full(t + h + w, T_AXIS, np.int32)
    axes[0 : h + w : 2] = H_AXIS
    axes[1 : h + w : 2] = W_AXIS
    return axes


def mrope_angles(positions_BT3: jax.Array, inv_freq_F: jax.Array, mrope_section: Sequence[int]) -> jax.Array:
    """Rotation angles [B, T, F] for (t, h, w) positions [B, T, 3]."""
    if mrope_section is None:
        raise ValueError("3-axis positions [B, T, 3] need a config with rope_scaling.mrope_section")
    axes = frequency_axes(mrope_section)
    if len(axes) != inv_freq_F.shape[0]:
        raise ValueError(
            f"mrope_section {list(mrope_section)} covers {len(axes)} frequencies, "
            f"the rope dims have {inv_freq_F.shape[0]}"
        )
    positions_BTF = jnp.take(positions_BT3.astype(jnp.float32), jnp.asarray(axes), axis=-1)
    return positions_BTF * inv_freq_F


def mrope_positions(
    input_ids_T: np.ndarray,
    image_grids: Sequence[MediaGrid],
    video_grids: Sequence[MediaGrid],
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """(positions [T, 3] int64, delta) for one prompt; media are consumed in prompt order, images from
    image_grids and videos from video_grids. Raises if the pad-token runs do not match the grids."""
    ids = np.asarray(input_ids_T)
    queues = {image_token_id: (list(image_grids), "image"), video_token_id: (list(video_grids), "video")}
    is_media = (ids == image_token_id) | (ids == video_token_id)
    blocks, start, cursor = [], 0, 0
    while True:
        found = np.flatnonzero(is_media[cursor:])
        if not len(found):
            break
        media_start = cursor + int(found[0])
        token = int(ids[media_start])
        grids, kind = queues[token]
        if not grids:
            raise ValueError(f"the prompt has more {kind} pad-token runs (token {token}) than {kind} grids")
        grid = grids.pop(0)
        length = grid.num_tokens(spatial_merge_size)
        run = int(np.argmin(np.append(ids[media_start : media_start + length] == token, False)))
        if run != length:
            raise ValueError(
                f"{kind} grid {grid} needs {length} consecutive pad tokens ({token}) at position "
                f"{media_start}; the prompt has {run}"
            )
        text_len = media_start - cursor
        blocks.append(np.broadcast_to(start + np.arange(text_len), (3, text_len)))
        blocks.append(_media_positions(grid.merged(spatial_merge_size), start + text_len))
        start = int(blocks[-1][T_AXIS].max()) + 1
        cursor = media_start + length
    for grids, kind in queues.values():
        if grids:
            raise ValueError(f"{len(grids)} {kind} grid(s) left over: the prompt has fewer {kind} pad-token runs")
    text_len = len(ids) - cursor
    blocks.append(np.broadcast_to(start + np.arange(text_len), (3, text_len)))
    positions_3T = np.concatenate(blocks, axis=1).astype(np.int64)
    delta = start + text_len - len(ids)  # the next token's position (max t + 1 after media) minus its slot
    return positions_3T.T.copy(), delta


def _media_positions(merged_grid: tuple[int, int, int], base: int) -> np.ndarray:
    frames, rows, cols = merged_grid
    frame_3N, row_3N, col_3N = (a.reshape(-1) for a in np.indices((frames, rows, cols)))
    t = base + FRAME_STRIDE * frame_3N
    return np.stack([t, t + row_3N - (rows - 1) // 2, t + col_3N - (cols - 1) // 2])


def batch_mrope_positions(
    input_ids_BT: np.ndarray,
    attention_mask_BT: np.ndarray,
    image_grids: Sequence[Sequence[MediaGrid]],
    video_grids: Sequence[Sequence[MediaGrid]],
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Positions [B, T, 3] (pads: 0) and deltas [B] for a padded batch; grids are given per row."""
    batch, length = input_ids_BT.shape
    mask = np.ones((batch, length), bool) if attention_mask_BT is None else np.asarray(attention_mask_BT, bool)
    positions = np.zeros((batch, length, 3), np.int64)
    deltas = np.zeros((batch,), np.int64)
    for row in range(batch):
        real = np.flatnonzero(mask[row])
        try:
            positions[row, real], deltas[row] = mrope_positions(
                input_ids_BT[row, real],
                image_grids[row],
                video_grids[row],
                image_token_id=image_token_id,
                video_token_id=video_token_id,
                spatial_merge_size=spatial_merge_size,
            )
        except ValueError as e:
            raise ValueError(f"prompt {row}: {e}") from e
    return positions, deltas
