"""3-axis (t, h, w) positions and the mRoPE frequency assignment, against numpy written from spec §7 / §3.3."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from np_reference import rope_inv_freq_and_mscale

from ling_jax.config import LingConfig
from ling_jax.mrope import MediaGrid, batch_mrope_positions, mrope_positions
from ling_jax.presets import LING_3_0_FLASH_VL_TEXT
from ling_jax.rope import cos_sin_factor, inv_frequencies, rope_cos_sin

IMAGE, VIDEO, MERGE = 900, 901, 2


def spec_positions(ids, media, media_tokens=(IMAGE, VIDEO)):
    """Token by token: text gets (n, n, n) from a running counter n; a media block of merged grid (T, Hm, Wm)
    starting at counter n gets t = n + 2 f, h = t + r - (Hm - 1) // 2, w = t + c - (Wm - 1) // 2, and the
    counter continues at max(t) + 1 = n + 2 (T - 1) + 1."""
    return spec_positions_and_next(ids, media, media_tokens)[0]


def spec_positions_and_next(ids, media, media_tokens=(IMAGE, VIDEO)):
    """(positions, the counter after the prompt = the position of the next token)."""
    media = iter(media)
    out, counter, i = [], 0, 0
    while i < len(ids):
        if ids[i] in media_tokens:
            frames, rows, cols = next(media)
            for f in range(frames):
                for r in range(rows):
                    for c in range(cols):
                        t = counter + 2 * f
                        out.append((t, t + r - (rows - 1) // 2, t + c - (cols - 1) // 2))
            counter += 2 * (frames - 1) + 1
            i += frames * rows * cols
        else:
            out.append((counter, counter, counter))
            counter += 1
            i += 1
    return np.array(out, np.int64), counter


def _prompt(parts):
    """parts: ints (text lengths) or (token, MediaGrid)."""
    rng = np.random.default_rng(0)
    ids, images, videos, merged = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += list(rng.integers(10, 800, size=part))
        else:
            token, grid = part
            ids += [token] * grid.num_tokens(MERGE)
            (images if token == IMAGE else videos).append(grid)
            merged.append(grid.merged(MERGE))
    return np.array(ids), images, videos, merged


CASES = {
    "text-image-text-video-text": [3, (IMAGE, MediaGrid(1, 6, 10)), 2, (VIDEO, MediaGrid(3, 4, 8)), 4],
    "image-first-then-video-last": [(IMAGE, MediaGrid(1, 10, 6)), 1, (VIDEO, MediaGrid(2, 6, 6))],
    "adjacent-images": [2, (IMAGE, MediaGrid(1, 4, 4)), (IMAGE, MediaGrid(1, 8, 2)), 5],
    # the image's w positions run past the trailing text's: the next position still follows the text
    "wide-image-short-tail": [2, (IMAGE, MediaGrid(1, 14, 20)), 2],
}


@pytest.mark.parametrize("name", CASES)
def test_positions_match_spec(name):
    ids, images, videos, merged = _prompt(CASES[name])
    ours, delta = mrope_positions(
        ids, images, videos, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE
    )
    ref, next_position = spec_positions_and_next(ids, merged)
    np.testing.assert_array_equal(ours, ref)
    assert delta == next_position - len(ids)


def test_positions_go_negative_when_media_comes_first():
    ids, images, videos, _ = _prompt(CASES["image-first-then-video-last"])
    ours, _ = mrope_positions(ids, images, videos, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE)
    assert ours[0].tolist() == [0, -2, -1]  # merged grid 5 x 3: rows centred by 2, columns by 1
    assert ours.min() < 0


def test_text_only_positions_are_one_dimensional():
    ids = np.arange(11)
    ours, delta = mrope_positions(ids, [], [], image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE)
    np.testing.assert_array_equal(ours, np.repeat(np.arange(11)[:, None], 3, axis=1))
    assert delta == 0


def test_batch_positions_skip_pads():
    ids, images, videos, merged = _prompt(CASES["text-image-text-video-text"])
    padded = np.concatenate([np.zeros(4, int), ids])[None].repeat(2, axis=0)
    mask = np.ones_like(padded, bool)
    mask[0, :4] = False
    padded[1, :4] = 7
    positions, deltas = batch_mrope_positions(
        padded,
        mask,
        [images, images],
        [videos, videos],
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=MERGE,
    )
    np.testing.assert_array_equal(positions[0, 4:], spec_positions(ids, merged))
    np.testing.assert_array_equal(positions[0, :4], 0)
    np.testing.assert_array_equal(positions[1], spec_positions(padded[1], merged))
    assert deltas[0] == deltas[1] == spec_positions_and_next(ids, merged)[1] - len(ids)


def test_grid_and_prompt_mismatches_are_refused():
    ids, images, videos, _ = _prompt(CASES["text-image-text-video-text"])
    kwargs = dict(image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="needs 15 consecutive pad tokens"):
        mrope_positions(np.delete(ids, 5), images, videos, **kwargs)
    with pytest.raises(ValueError, match="more video pad-token runs"):
        mrope_positions(ids, images, [], **kwargs)
    with pytest.raises(ValueError, match="image grid\\(s\\) left over"):
        mrope_positions(ids, images * 2, videos, **kwargs)


VL_TEXT = LingConfig.from_dict(LING_3_0_FLASH_VL_TEXT)


def test_vl_yarn_constants():
    """Spec §3.3 example: f = 2, L0 = 131072, theta = 6e6 -> ramp from 13 to 21, cos/sin factor 1.0693147."""
    assert cos_sin_factor(VL_TEXT.rope) == pytest.approx(0.1 * math.log(2) + 1, rel=1e-12)
    ratio = inv_frequencies(VL_TEXT.rope, 64) / 6e6 ** -(np.arange(32) * 2 / 64)
    np.testing.assert_allclose(ratio[:14], 1.0, rtol=1e-12)
    np.testing.assert_allclose(ratio[21:], 0.5, rtol=1e-12)
    assert 0.5 < ratio[17] < 1.0


def test_mrope_cos_sin_against_numpy():
    """Frequencies 0..23 alternate h (even) / w (odd), 24..31 follow t; YaRN inv_freq; factor (0.1 ln 2 + 1)."""
    rng = np.random.default_rng(0)
    positions_BT3 = rng.integers(-40, 2000, size=(2, 9, 3))
    cos, sin = rope_cos_sin(jnp.asarray(positions_BT3, jnp.int32), VL_TEXT)
    inv_freq, _, _ = rope_inv_freq_and_mscale(LING_3_0_FLASH_VL_TEXT)
    axis = np.array([1 if i % 2 == 0 else 2 for i in range(24)] + [0] * 8)
    angles = positions_BT3[..., axis].astype(np.float64) * inv_freq
    factor = 0.1 * math.log(2.0) + 1.0
    assert rel_error(cos, np.cos(angles) * factor) <= 1e-4
    assert rel_error(sin, np.sin(angles) * factor) <= 1e-4


def test_equal_axes_reduce_to_1d_rope():
    positions_BT = np.arange(-3, 17)[None].repeat(2, axis=0)
    one_d = rope_cos_sin(jnp.asarray(positions_BT), VL_TEXT)
    three_d = rope_cos_sin(jnp.asarray(np.repeat(positions_BT[..., None], 3, axis=-1)), VL_TEXT)
    for a, b in zip(one_d, three_d):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mrope_section_must_fit_rope_dims():
    with pytest.raises(ValueError, match="must sum to qk_rope_head_dim / 2 = 32"):
        LingConfig.from_dict(
            {
                **LING_3_0_FLASH_VL_TEXT,
                "rope_scaling": {**LING_3_0_FLASH_VL_TEXT["rope_scaling"], "mrope_section": [8, 10, 10]},
            }
        )
    with pytest.raises(ValueError, match="contradicts"):
        LingConfig.from_dict({"text_config": LING_3_0_FLASH_VL_TEXT, "mrope_section": [16, 8, 8]})
