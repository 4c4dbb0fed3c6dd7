"""Ling-3.0-flash-VL (`BailingMoeV3VLForConditionalGeneration`, spec §7): the Ling text model plus the vision
tower (`model.visual.*`) and projector (`model.linear_proj.*`), whose outputs replace the image / video pad
tokens' embeddings, with 3-axis (t, h, w) rotary positions in the MLA layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.cache import LingCache
from ling_jax.model import LingForCausalLM, LingOutput
from ling_jax.mrope import MediaGrid, batch_mrope_positions
from ling_jax.policy import ExecutionPolicy, KDAMode, MLAMode
from ling_jax.vl.config import LingVLConfig
from ling_jax.vl.vision import VisionTransformer, make_projector, merge_media, project

MediaPerRow = Sequence[Sequence[MediaGrid]]  # the grids of each prompt's images (or videos), in prompt order


class LingVLForConditionalGeneration(LingForCausalLM):
    """`model(input_ids, pixel_values=, image_grids=, pixel_values_videos=, video_grids=, positions=, cache=,
    attention_mask=)` -> LingOutput. Without media it is exactly the text model.

    pixel_values: every image's flattened patches [N, patch_dim], concatenated in batch-row then prompt order
    (`ling_jax.vl.image_processing`); image_grids: per row, the (t, h, w) patch grid of each of its images (the
    same for videos). positions [B, T, 3] default to `positions(...)` of the (concrete) input ids.
    """

    def __init__(
        self, config: LingVLConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, policy: ExecutionPolicy | None = None
    ):
        """policy: as for `LingForCausalLM` (None: `ExecutionPolicy()`)."""
        super().__init__(config.text, rngs=rngs, dtype=dtype, policy=policy)
        self.vl_config = config
        self.visual = VisionTransformer(config.vision, dtype=dtype, rngs=rngs)
        self.linear_proj = make_projector(config.vision, config.text.hidden_size, dtype=dtype, rngs=rngs)

    def media_embeddings(self, pixels_NK: jax.Array, grids: Sequence[MediaGrid]) -> jax.Array:
        """Projected vision tokens [sum of t * h * w / merge^2, D], one per pad token."""
        tokens = self.visual(pixels_NK.astype(self.dtype), grids)
        return project(self.linear_proj, tokens, l2_normalize=self.vl_config.norm_query_embeds)

    def embed(
        self,
        input_ids_BT,
        *,
        pixel_values=None,
        image_grids: MediaPerRow = (),
        pixel_values_videos=None,
        video_grids: MediaPerRow = (),
    ) -> jax.Array:
        """Token embeddings [B, T, D] with the image and video pad tokens replaced by vision embeddings."""
        c = self.vl_config
        embeds_BTD = self.model.word_embeddings(input_ids_BT)
        for pixels, grids, token in (
            (pixel_values, image_grids, c.image_token_id),
            (pixel_values_videos, video_grids, c.video_token_id),
        ):
            flat = [grid for row in grids for grid in row]
            if flat:
                if pixels is None:
                    raise ValueError(f"grids given for token {token} but no pixel values")
                embeds_BTD = merge_media(embeds_BTD, input_ids_BT, self.media_embeddings(pixels, flat), token)
        return embeds_BTD

    def positions(
        self, input_ids_BT, attention_mask_BT=None, *, image_grids: MediaPerRow = (), video_grids: MediaPerRow = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host-side (t, h, w) positions [B, T, 3] and per-row deltas [B] (later tokens sit at slot + delta)."""
        ids = np.asarray(input_ids_BT)
        rows = ids.shape[0]
        c = self.vl_config
        return batch_mrope_positions(
            ids,
            attention_mask_BT,
            image_grids or [[]] * rows,
            video_grids or [[]] * rows,
            image_token_id=c.image_token_id,
            video_token_id=c.video_token_id,
            spatial_merge_size=c.vision.spatial_merge_size,
        )

    def __call__(
        self,
        input_ids_BT,
        *,
        pixel_values=None,
        image_grids: MediaPerRow = (),
        pixel_values_videos=None,
        video_grids: MediaPerRow = (),
        positions=None,
        cache: LingCache | None = None,
        attention_mask=None,
        kda_mode: KDAMode | None = None,
        mla_mode: MLAMode | None = None,
    ) -> LingOutput:
        embeds = None
        if any(len(row) for row in (*image_grids, *video_grids)):
            if positions is None:
                if isinstance(input_ids_BT, jax.core.Tracer):
                    raise ValueError(
                        "with media under jit, pass positions (model.positions(input_ids, ...)): they are "
                        "computed on the host from concrete token ids"
                    )
                positions, _ = self.positions(
                    input_ids_BT, attention_mask, image_grids=image_grids, video_grids=video_grids
                )
            embeds = self.embed(
                input_ids_BT,
                pixel_values=pixel_values,
                image_grids=image_grids,
                pixel_values_videos=pixel_values_videos,
                video_grids=video_grids,
            )
        return super().__call__(
            input_ids_BT,
            positions=positions,
            cache=cache,
            attention_mask=attention_mask,
            kda_mode=kda_mode,
            mla_mode=mla_mode,
            inputs_embeds=embeds,
        )
