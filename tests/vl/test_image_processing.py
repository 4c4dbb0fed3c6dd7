"""Image preprocessing against transformers' Qwen2VLImageProcessorPil (the Qwen3-VL image processor, PIL
backend); video patch layout against numpy written from the Qwen3-VL video processor's layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import rel_error
from optional_deps import from_transformers
from PIL import Image
from vl_oracle import TINY_VISION

from ling_jax.mrope import MediaGrid
from ling_jax.vl.config import VisionConfig
from ling_jax.vl.image_processing import ProcessorConfig, patchify, preprocess_image, preprocess_video, video_size

(Qwen2VLImageProcessorPil,) = from_transformers(
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"
)

CONFIG = ProcessorConfig(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=64 * 64, max_pixels=320 * 320)


def _reference(image):
    processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=list(CONFIG.image_mean),
        image_std=list(CONFIG.image_std),
        size={"shortest_edge": CONFIG.min_pixels, "longest_edge": CONFIG.max_pixels},
    )
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def _random_image(height, width, mode, seed):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


@pytest.mark.parametrize(
    "height,width,mode",
    [(97, 131, "RGB"), (500, 45, "RGB"), (40, 33, "L"), (700, 613, "RGBA")],
    ids=["odd", "tall-thin", "small-gray-upscaled", "large-rgba-downscaled"],
)
def test_image_matches_transformers(height, width, mode):
    image = _random_image(height, width, mode, seed=height)
    ours, grid = preprocess_image(image, CONFIG)
    ref, ref_grid = _reference(image)
    assert (grid.t, grid.h, grid.w) == ref_grid
    assert ours.shape == ref.shape and ours.dtype == np.float32
    assert rel_error(ours, ref) <= 1e-6


def spec_video_patches(frames_FCHW, p, m, tp):
    """Patch by patch: index (t, block row, block col, row, col) -> values (C, temporal, P, P)."""
    frames, channels, height, width = frames_FCHW.shape
    gh, gw = height // p, width // p
    rows = []
    for t in range(frames // tp):
        for br in range(gh // m):
            for bc in range(gw // m):
                for r in range(m):
                    for c in range(m):
                        y, x = (br * m + r) * p, (bc * m + c) * p
                        rows.append(
                            frames_FCHW[t * tp : (t + 1) * tp, :, y : y + p, x : x + p].transpose(1, 0, 2, 3).ravel()
                        )
    return np.stack(rows)


def test_patch_layout():
    frames = np.random.default_rng(0).normal(size=(4, 3, 8 * 4, 4 * 4)).astype(np.float32)
    small = ProcessorConfig(patch_size=4, temporal_patch_size=2, merge_size=2)
    ours, grid = patchify(frames, small)
    assert grid == MediaGrid(2, 8, 4)
    np.testing.assert_array_equal(ours, spec_video_patches(frames, 4, 2, 2))


def test_video_frames_are_paired_and_resized_together():
    frames = [_random_image(90, 120, "RGB", seed=i) for i in range(3)]
    ours, grid = preprocess_video(frames, CONFIG)
    height, width = video_size(3, 90, 120, CONFIG)
    assert (grid.t, grid.h * 16, grid.w * 16) == (2, height, width)
    # the odd frame count is padded with the last frame: the second pair holds frame 2 twice
    second_pair = ours[grid.h * grid.w :].reshape(-1, 3, 2, 16, 16)
    np.testing.assert_array_equal(second_pair[:, :, 0], second_pair[:, :, 1])
    with pytest.raises(ValueError, match="share one size"):
        preprocess_video(frames[:2] + [_random_image(91, 120, "RGB", seed=9)], CONFIG)


def test_preprocessor_config_file_wins(tmp_path):
    vision = VisionConfig.from_dict(TINY_VISION)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "patch_size": 4,
                "merge_size": 2,
                "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3,
                "size": {"shortest_edge": 1024, "longest_edge": 4096},
            }
        )
    )
    config = ProcessorConfig.from_pretrained(tmp_path, vision)
    assert (config.patch_size, config.min_pixels, config.max_pixels, config.image_mean) == (4, 1024, 4096, (0.5,) * 3)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ValueError, match="patch_size=14 disagrees"):
        ProcessorConfig.from_pretrained(tmp_path, vision)
