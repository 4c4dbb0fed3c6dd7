"""Prompts with images and videos for the VL model: media files -> patches and grids, and prompt text with
`<image>` / `<video>` placeholders -> token ids in which each placeholder becomes
[vision_start, pad x (tokens of that media), vision_end]. Media without a placeholder go before the text."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from ling_jax.generation.generator import MediaInputs
from ling_jax.mrope import MediaGrid
from ling_jax.vl.config import LingVLConfig
from ling_jax.vl.image_processing import ProcessorConfig, load_image, preprocess_image, preprocess_video

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "<image>", "<video>"
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


@dataclasses.dataclass(frozen=True)
class PromptMedia:
    """Preprocessed media of one prompt: (patches, grid) per image and per video, in prompt order."""

    images: tuple[tuple[np.ndarray, MediaGrid], ...] = ()
    videos: tuple[tuple[np.ndarray, MediaGrid], ...] = ()


def load_media(
    image_paths: Sequence[str | os.PathLike], videos: Sequence[Sequence[str | os.PathLike]], processor: ProcessorConfig
) -> PromptMedia:
    """Images from files, and videos each given as its frame image files."""
    images = tuple(preprocess_image(load_image(path), processor) for path in image_paths)
    clips = tuple(preprocess_video([load_image(path) for path in frames], processor) for frames in videos)
    return PromptMedia(images, clips)


def with_placeholders(text: str, media: PromptMedia) -> str:
    """The text with a placeholder for every media it does not place itself, prepended (images first)."""
    images, videos = text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER)
    for count, given, what in ((images, len(media.images), "image"), (videos, len(media.videos), "video")):
        if count > given:
            raise ValueError(f"the prompt has {count} <{what}> placeholders but {given} {what}(s) were given")
    return IMAGE_PLACEHOLDER * (len(media.images) - images) + VIDEO_PLACEHOLDER * (len(media.videos) - videos) + text


def encode_with_media(
    encode: Callable[[str, bool], list[int]], text: str, media: PromptMedia, config: LingVLConfig
) -> list[int]:
    """Token ids of `text` (placeholders already in place) with media blocks; encode(piece, first) tokenises a
    piece of text, `first` telling whether it starts the prompt (special tokens are added there only)."""
    merge = config.vision.spatial_merge_size
    images, videos = iter(media.images), iter(media.videos)
    ids: list[int] = []
    for index, piece in enumerate(_PLACEHOLDERS.split(text)):
        if piece in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
            token, (_, grid) = (
                (config.image_token_id, next(images))
                if piece == IMAGE_PLACEHOLDER
                else (config.video_token_id, next(videos))
            )
            ids += [config.vision_start_token_id, *[token] * grid.num_tokens(merge), config.vision_end_token_id]
        elif piece:
            ids += encode(piece, index == 0)
    return ids


def media_inputs(media: PromptMedia, rows: int) -> MediaInputs:
    """The same media for each of `rows` prompts, as the generator takes them."""

    def pixels(items):
        return np.concatenate([patches for patches, _ in items] * rows) if items else None

    return MediaInputs(
        image_grids=(tuple(grid for _, grid in media.images),) * rows,
        pixel_values=pixels(media.images),
        video_grids=(tuple(grid for _, grid in media.videos),) * rows,
        pixel_values_videos=pixels(media.videos),
    )
