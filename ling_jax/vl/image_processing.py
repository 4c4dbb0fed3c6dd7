"""Image and video preprocessing for the VL model, with Pillow and numpy, following the Qwen3-VL processor:
resize (bicubic, on the 8-bit image) so that both sides are multiples of patch x merge and the pixel count lies
in [min_pixels, max_pixels], rescale to [0, 1], normalise per channel, and cut into flattened patches
[N, C * temporal_patch * patch * patch] in spatial-merge-block order (what `ling_jax.vl.vision` reads). An image
fills both temporal slots of its patches with the same pixels; video frames are paired (the last frame repeated
to an even count) and resized together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

from ling_jax.mrope import MediaGrid
from ling_jax.vl.config import VisionConfig

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """Defaults: CLIP normalisation and a 4096 .. 4194304 pixel budget (the Ling-VL processor as published);
    a checkpoint's preprocessor_config.json wins (`from_pretrained`)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 4096
    max_pixels: int = 4194304
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> ProcessorConfig:
        return cls(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, vision: VisionConfig) -> ProcessorConfig:
        """preprocessor_config.json of the checkpoint directory when present, else the defaults; patch sizes
        must agree with the vision config."""
        config = cls.for_vision(vision)
        file = os.path.join(os.fspath(path), PREPROCESSOR_FILE)
        if not os.path.isfile(file):
            return config
        with open(file) as f:
            raw = json.load(f)
        size = raw.get("size") or {}
        config = dataclasses.replace(
            config,
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or config.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or config.max_pixels),
            image_mean=tuple(float(v) for v in raw.get("image_mean", config.image_mean)),
            image_std=tuple(float(v) for v in raw.get("image_std", config.image_std)),
        )
        for key, expected in (
            ("patch_size", vision.patch_size),
            ("temporal_patch_size", vision.temporal_patch_size),
            ("merge_size", vision.spatial_merge_size),
        ):
            if key in raw and int(raw[key]) != expected:
                raise ValueError(f"{file}: {key}={raw[key]} disagrees with the vision config ({expected})")
        return config


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` (Python's round, as the reference), then scaled with
    the aspect ratio kept so that the area lies in [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height}: the aspect ratio must be below 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent images are composited onto white first (as the reference processor does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _normalized_chw(image: Image.Image, size_hw: tuple[int, int], config: ProcessorConfig) -> np.ndarray:
    resized = to_rgb(image).resize((size_hw[1], size_hw[0]), resample=Image.Resampling.BICUBIC)
    pixels_HWC = (np.asarray(resized).astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(config.image_mean, np.float32), np.asarray(config.image_std, np.float32)
    return np.moveaxis((pixels_HWC - mean) / std, -1, 0)


def patchify(frames_FCHW: np.ndarray, config: ProcessorConfig) -> tuple[np.ndarray, MediaGrid]:
    """Frames [F, C, H, W] (F a multiple of temporal_patch_size) -> patches [N, C * T * P * P] in
    (frame pair, block row, block col, row in block, col in block) order, and the grid in patches."""
    frames, channels, height, width = frames_FCHW.shape
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    grid = MediaGrid(frames // tp, height // p, width // p)
    blocks = frames_FCHW.reshape(grid.t, tp, channels, grid.h // m, m, p, grid.w // m, m, p)
    # -> (t, block row, block col, row in block, col in block, C, temporal, P, P)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(blocks).reshape(grid.t * grid.h * grid.w, -1), grid


def preprocess_image(image: Image.Image, config: ProcessorConfig) -> tuple[np.ndarray, MediaGrid]:
    """One image -> (patches [h * w, C * T * P * P] float32, grid (1, h, w) in patches)."""
    size = smart_resize(image.height, image.width, config.factor, config.min_pixels, config.max_pixels)
    chw = _normalized_chw(image, size, config)
    return patchify(np.repeat(chw[None], config.temporal_patch_size, axis=0), config)


def video_size(num_frames: int, height: int, width: int, config: ProcessorConfig) -> tuple[int, int]:
    """The Qwen3-VL video rule: the pixel budget covers all frames (rounded to temporal pairs) together."""
    factor, tp = config.factor, config.temporal_patch_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"video of {width}x{height}: the aspect ratio must be below 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(num_frames / tp) * tp
    if t * h * w > config.max_pixels:
        beta = math.sqrt(num_frames * height * width / config.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def preprocess_video(frames: Sequence[Image.Image], config: ProcessorConfig) -> tuple[np.ndarray, MediaGrid]:
    """Frames of one video (all the size of the first) -> (patches, grid (frames / 2, h, w))."""
    if len(frames) < config.temporal_patch_size:
        raise ValueError(f"a video needs at least {config.temporal_patch_size} frames, got {len(frames)}")
    first = frames[0]
    odd = [i for i, f in enumerate(frames) if f.size != first.size]
    if odd:
        raise ValueError(
            f"video frame {odd[0]} is {frames[odd[0]].size}, frame 0 is {first.size}: frames must share one size"
        )
    size = video_size(len(frames), first.height, first.width, config)
    chw = np.stack([_normalized_chw(frame, size, config) for frame in frames])
    missing = -len(frames) % config.temporal_patch_size
    chw = np.concatenate([chw, np.repeat(chw[-1:], missing, axis=0)])
    return patchify(chw, config)


def load_image(path: str | os.PathLike) -> Image.Image:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image not found: {path}")
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except OSError as e:
        raise ValueError(f"{path}: not an image Pillow can read ({e})") from e
