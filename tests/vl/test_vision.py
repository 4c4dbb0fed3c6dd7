"""The vision tower against transformers' Qwen3VLMoeVisionModel, the projector and the embedding merge."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_error
from vl_oracle import TINY_VISION, build_vision_oracle, copy_weights, vision_oracle_output

from ling_jax.mrope import MediaGrid
from ling_jax.vl.config import VisionConfig
from ling_jax.vl.vision import VisionTransformer, make_projector, merge_media, project


def _tower(**overrides):
    oracle = build_vision_oracle(seed=1, **overrides)
    config = VisionConfig.from_dict({**TINY_VISION, **overrides})
    tower = VisionTransformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    copy_weights(oracle, tower)
    return oracle, tower, config


def _pixels(grids, config, seed):
    patches = sum(g.t * g.h * g.w for g in grids)
    return np.random.default_rng(seed).normal(size=(patches, config.patch_dim)).astype(np.float32)


# two image sizes (one not square, one smaller than the 6 x 6 table, one larger), then a 2-frame video
GRIDS = (MediaGrid(1, 6, 10), MediaGrid(1, 4, 4), MediaGrid(2, 8, 6))


@pytest.mark.parametrize("grids", [GRIDS[:1], GRIDS[1:2], GRIDS], ids=["image-6x10", "image-4x4", "two-images-video"])
def test_tower_matches_transformers(grids):
    oracle, tower, config = _tower()
    pixels = _pixels(grids, config, seed=len(grids))
    ours = jax.jit(tower.__call__, static_argnums=1)(jnp.asarray(pixels), grids)
    ref = vision_oracle_output(oracle, pixels, grids)
    assert ours.shape == ref.shape == (sum(g.t * g.h * g.w for g in grids) // 4, config.out_hidden_size)
    err = rel_error(ours, ref)
    print(f"vision tower {[tuple(vars(g).values()) for g in grids]}: fp32 rel. error {err:.2e}")
    assert err <= 1e-4


def test_tower_exact_gelu_mlp():
    oracle, tower, config = _tower(hidden_act="gelu")
    pixels = _pixels(GRIDS[:1], config, seed=7)
    assert rel_error(tower(jnp.asarray(pixels), GRIDS[:1]), vision_oracle_output(oracle, pixels, GRIDS[:1])) <= 1e-4


def test_frames_do_not_attend_to_each_other():
    """Attention stays inside a frame: changing frame 1 of a video leaves frame 0's tokens unchanged."""
    _, tower, config = _tower()
    grid = (MediaGrid(2, 4, 4),)
    pixels = _pixels(grid, config, seed=3)
    changed = pixels.copy()
    changed[16:] += 1.0
    a, b = tower(jnp.asarray(pixels), grid), tower(jnp.asarray(changed), grid)
    np.testing.assert_allclose(a[:4], b[:4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[4:], b[4:])


def test_merger_without_projection():
    """disable_merger_proj: the merger is the LayerNorm and the 2x2 concatenation only."""
    config = VisionConfig.from_dict({**TINY_VISION, "disable_merger_proj": True})
    tower = VisionTransformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert not hasattr(tower.merger, "linear_fc1") and config.output_dim == 4 * config.hidden_size
    x = np.random.default_rng(0).normal(size=(8, config.hidden_size))
    normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    assert rel_error(tower.merger(jnp.asarray(x, jnp.float32)), normed.reshape(2, -1)) <= 1e-5


def test_grid_mismatch_names_pixel_values():
    _, tower, config = _tower()
    with pytest.raises(ValueError, match="pixel_values has shape"):
        tower(jnp.zeros((10, config.patch_dim)), GRIDS[:1])
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        tower(jnp.zeros((15, config.patch_dim)), (MediaGrid(1, 3, 5),))


@pytest.mark.parametrize("l2", [False, True])
def test_projector_against_numpy(l2):
    """linear_proj: Linear -> exact GELU -> Linear (erf, not tanh), then optional L2 normalisation."""
    from scipy.special import erf

    config = VisionConfig.from_dict(TINY_VISION)
    proj = make_projector(config, 20, dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = np.random.default_rng(1).normal(size=(5, config.output_dim)) * 3
    w0, b0 = (np.asarray(proj[0].weight[...], np.float64), np.asarray(proj[0].bias[...], np.float64))
    w2, b2 = (np.asarray(proj[2].weight[...], np.float64), np.asarray(proj[2].bias[...], np.float64))
    h = x @ w0.T + b0
    ref = (0.5 * h * (1 + erf(h / np.sqrt(2)))) @ w2.T + b2
    if l2:
        ref = ref / np.linalg.norm(ref, axis=-1, keepdims=True)
    assert rel_error(project(proj, jnp.asarray(x, jnp.float32), l2_normalize=l2), ref) <= 1e-5


def test_merge_replaces_pad_tokens_in_order():
    rng = np.random.default_rng(0)
    ids = np.array([[5, 9, 9, 6, 9], [9, 7, 8, 9, 9]])
    embeds = rng.normal(size=(2, 5, 3))
    media = rng.normal(size=(6, 3))
    out = np.asarray(merge_media(jnp.asarray(embeds), jnp.asarray(ids), jnp.asarray(media), 9))
    expected = embeds.copy()
    expected[ids == 9] = media
    np.testing.assert_allclose(out, expected, rtol=1e-6)
