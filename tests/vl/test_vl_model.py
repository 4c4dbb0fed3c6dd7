"""The VL model end to end on a tiny checkpoint: loader (vision + projector tensors, bf16 / FP8 / fp32),
vision embeddings merged into the prompt, 3-axis positions, text-only equality with the text model, and
cached prefill + decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST_COMPILE_OPTIONS, rel_error
from scipy.special import erf
from vl_checkpoint import IMAGE_TOKEN, VIDEO_TOKEN, projector_weights, write_text_checkpoint, write_vl_checkpoint
from vl_oracle import vision_oracle_output

from ling_jax import load_hf_checkpoint
from ling_jax.checkpoints.hf import CheckpointError
from ling_jax.model import LingForCausalLM
from ling_jax.mrope import MediaGrid
from ling_jax.sharding import make_mesh, shard_model
from ling_jax.vl.model import LingVLForConditionalGeneration
from tests.test_mrope import spec_positions

IMAGE, VIDEO = MediaGrid(1, 4, 6), MediaGrid(2, 4, 4)  # 6 and 8 merged tokens
MEDIA_GRIDS = ("image_grids", "video_grids")  # the model's keyword arguments that are host-side structure


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    write_text_checkpoint(str(root / "text"))
    oracle = write_vl_checkpoint(str(root / "text"), str(root / "vl"))
    text_model = load_hf_checkpoint(root / "text", dtype=jnp.float32, progress=False)
    vl_model = load_hf_checkpoint(root / "vl", dtype=jnp.float32, progress=False)
    return root, oracle, text_model, vl_model


def _media(image_seed=3, video_seed=4):
    """The model's keyword arguments for _prompt()'s image and video."""
    return dict(
        pixel_values=jnp.asarray(_pixels((IMAGE,), image_seed)),
        image_grids=[[IMAGE]],
        pixel_values_videos=jnp.asarray(_pixels((VIDEO,), video_seed)),
        video_grids=[[VIDEO]],
    )


@pytest.fixture(scope="module")
def media_logits(checkpoints):
    """The loaded VL model's logits for _prompt() with _media(): one forward shared by the tests."""
    return forward(checkpoints[3], _prompt(), **_media())[0]


def forward(model, ids, **kwargs):
    """(logits as numpy, cache) of `model(ids, **kwargs)` in one compiled program (`_compiled_forward`): run op by
    op, each of the forward's ops compiles again at every new length (5-15 s a call). With media and no
    `positions`, the model's host-side mRoPE positions, as its eager call computes them."""
    grids = tuple((name, tuple(map(tuple, kwargs.pop(name)))) for name in MEDIA_GRIDS if name in kwargs)
    if grids and "positions" not in kwargs:
        kwargs["positions"] = model.positions(ids, kwargs.get("attention_mask"), **dict(grids))[0]
    graphdef, state = nnx.split(model)
    logits, cache = _compiled_forward(graphdef, grids, state, jnp.asarray(ids), kwargs)
    return np.asarray(logits), cache


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=FAST_COMPILE_OPTIONS)
def _compiled_forward(graphdef, grids, state, ids, kwargs):
    out = nnx.merge(graphdef, state)(ids, **kwargs, **dict(grids))
    return out.logits, out.cache


def _pixels(grids, seed):
    patches = sum(g.t * g.h * g.w for g in grids)
    return np.random.default_rng(seed).normal(size=(patches, 96)).astype(np.float32)


def _prompt():
    """text + image + text + video + text, 27 tokens."""
    rng = np.random.default_rng(1)
    text = lambda n: list(rng.integers(2, 240, size=n))  # noqa: E731
    return np.array([text(3) + [IMAGE_TOKEN] * 6 + text(2) + [VIDEO_TOKEN] * 8 + text(4)])


def _numpy_projector(weights, x):
    h = x @ weights["linear_proj.0.weight"].T + weights["linear_proj.0.bias"]
    h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    return h @ weights["linear_proj.2.weight"].T + weights["linear_proj.2.bias"]


def test_loader_builds_the_vl_model_with_the_reference_tower(checkpoints):
    _, oracle, _, model = checkpoints
    assert isinstance(model, LingVLForConditionalGeneration)
    grids = (IMAGE, VIDEO)
    pixels = _pixels(grids, seed=2)
    err = rel_error(model.visual(jnp.asarray(pixels), grids), vision_oracle_output(oracle, pixels, grids))
    print(f"loaded vision tower (fp32 / bf16 / FP8 tensors): fp32 rel. error {err:.2e}")
    assert err <= 1e-4


def test_media_prompt_matches_reference_composition(checkpoints, media_logits):
    """logits = text model(embeddings with pad rows <- numpy projector(transformers tower), spec positions)."""
    root, oracle, text_model, _ = checkpoints
    ids = _prompt()
    image_pixels, video_pixels = _pixels((IMAGE,), 3), _pixels((VIDEO,), 4)
    weights = projector_weights(str(root / "vl"))
    embeds = np.asarray(text_model.model.word_embeddings(jnp.asarray(ids)), np.float64)
    embeds[ids == IMAGE_TOKEN] = _numpy_projector(weights, vision_oracle_output(oracle, image_pixels, (IMAGE,)))
    embeds[ids == VIDEO_TOKEN] = _numpy_projector(weights, vision_oracle_output(oracle, video_pixels, (VIDEO,)))
    positions = spec_positions(ids[0], [IMAGE.merged(2), VIDEO.merged(2)], (IMAGE_TOKEN, VIDEO_TOKEN))[None]
    graphdef, state = nnx.split(text_model)

    @jax.jit
    def composed(state, ids, positions, embeds):
        model = nnx.merge(graphdef, state)
        return model.logits(model.model(ids, positions=positions, inputs_embeds=embeds)[0])

    err = rel_error(media_logits, composed(state, jnp.asarray(ids), positions, jnp.asarray(embeds, jnp.float32)))
    print(f"VL logits vs reference composition: fp32 rel. error {err:.2e}")
    assert err <= 1e-4


def test_image_changes_the_logits_after_it_only(checkpoints, media_logits):
    _, _, _, model = checkpoints
    ids = _prompt()
    a = media_logits
    b = forward(model, ids, **_media(image_seed=5))[0]
    np.testing.assert_allclose(a[:, :3], b[:, :3], rtol=1e-5, atol=1e-5)
    assert rel_error(a[:, 3:], b[:, 3:]) > 1e-2
    plain = forward(model, ids)[0]  # pad tokens embedded as text, 1-D positions
    assert rel_error(a[:, 3:], plain[:, 3:]) > 1e-2


def test_text_only_equals_the_text_model(checkpoints):
    _, _, text_model, model = checkpoints
    assert type(text_model) is LingForCausalLM
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 240, size=(2, 13)))
    mask = jnp.asarray(np.arange(13)[None] >= np.array([[0], [4]]))
    ref = forward(text_model, ids, attention_mask=mask)[0]
    np.testing.assert_array_equal(forward(model, ids, attention_mask=mask)[0], ref)
    equal_axes = jnp.repeat(jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)[..., None], 3, axis=-1)
    three_axis = forward(model, ids, attention_mask=mask, positions=equal_axes)[0]
    assert rel_error(three_axis[np.asarray(mask)], ref[np.asarray(mask)]) <= 1e-6


def test_cached_prefill_and_decode_continue_after_media(checkpoints):
    """Prefill the media prompt into a cache, then decode two tokens at position slot + delta: same logits as
    one full forward over the whole sequence."""
    _, _, _, model = checkpoints
    ids = np.concatenate([_prompt(), [[17, 29]]], axis=1)
    media = dict(
        pixel_values=jnp.asarray(_pixels((IMAGE,), 3)),
        image_grids=[[IMAGE]],
        pixel_values_videos=jnp.asarray(_pixels((VIDEO,), 4)),
        video_grids=[[VIDEO]],
    )
    full = forward(model, ids, **media)[0]
    prompt = ids[:, :-2]
    positions, deltas = model.positions(prompt, image_grids=[[IMAGE]], video_grids=[[VIDEO]])
    cache = model.init_cache(1, 40, dtype=jnp.float32)
    logits, cache = forward(model, prompt, positions=jnp.asarray(positions), cache=cache, **media)
    steps = [logits]
    for token in ids[0, -2:]:
        step_positions = (cache.lengths + jnp.asarray(deltas))[:, None]
        logits, cache = forward(model, [[token]], positions=step_positions, cache=cache)
        steps.append(logits)
    assert rel_error(np.concatenate(steps, axis=1), full) <= 1e-4


def test_projector_without_model_prefix_and_l2_norm(tmp_path, checkpoints):
    """`linear_proj.*` (no `model.` prefix) is accepted; norm_query_embeds L2-normalises the vision embeddings."""
    root = checkpoints[0]
    oracle = write_vl_checkpoint(str(root / "text"), str(tmp_path / "vl"), norm_query_embeds=True, projector_prefix="")
    model = load_hf_checkpoint(tmp_path / "vl", dtype=jnp.float32, progress=False)
    pixels = _pixels((IMAGE,), 6)
    ref = _numpy_projector(
        projector_weights(str(tmp_path / "vl"), prefix=""), vision_oracle_output(oracle, pixels, (IMAGE,))
    )
    ref /= np.linalg.norm(ref, axis=-1, keepdims=True)
    assert rel_error(model.media_embeddings(jnp.asarray(pixels), (IMAGE,)), ref) <= 1e-4


def test_missing_vision_tensor_is_named(tmp_path, checkpoints):
    write_vl_checkpoint(str(checkpoints[0] / "text"), str(tmp_path / "vl"), omit="model.visual.merger.norm.bias")
    with pytest.raises(CheckpointError, match="model.visual.merger.norm.bias"):
        load_hf_checkpoint(tmp_path / "vl", dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_convert_round_trip(tmp_path, checkpoints, dtype):
    """ling-convert keeps the vision tower and projector: load_checkpoint restores the VL model with the same
    parameters load_hf_checkpoint reads in bfloat16."""
    from convert.cli import main
    from ling_jax.checkpoints.orbax import load_checkpoint

    root = checkpoints[0]
    assert main([str(root / "vl"), str(tmp_path / "orbax"), "--dtype", dtype, "--verify", "--quiet"]) == 0
    restored = load_checkpoint(tmp_path / "orbax", dtype=jnp.bfloat16)
    assert isinstance(restored, LingVLForConditionalGeneration)
    reference = dict(
        nnx.to_flat_state(nnx.state(load_hf_checkpoint(root / "vl", dtype=jnp.bfloat16, progress=False), nnx.Param))
    )
    vision_paths = [p for p in reference if p[0] in ("visual", "linear_proj")]
    assert len(vision_paths) == 37
    ours = dict(nnx.to_flat_state(nnx.state(restored, nnx.Param)))
    for path in vision_paths:
        np.testing.assert_array_equal(
            np.asarray(ours[path].get_value(), np.float32),
            np.asarray(reference[path].get_value(), np.float32),
            err_msg=str(path),
        )


def test_generator_with_media_equals_full_forward_greedy(checkpoints):
    """Batched, left-padded generation (one row with an image and a video, one text-only) gives each row the
    tokens a full forward over its own growing sequence picks greedily (one forward over prompt + output gives
    every step's pick: the model is causal)."""
    from ling_jax.generation.generator import Generator, MediaInputs
    from ling_jax.generation.sampling import SamplingParams

    _, _, _, model = checkpoints
    media_prompt = _prompt()[0].tolist()
    text_prompt = [5, 7, 11, 13]
    image_pixels, video_pixels = _pixels((IMAGE,), 3), _pixels((VIDEO,), 4)
    media = MediaInputs(
        image_grids=((IMAGE,), ()),
        pixel_values=image_pixels,
        video_grids=((VIDEO,), ()),
        pixel_values_videos=video_pixels,
    )
    generator = Generator(model, prefill_chunk=16)
    outputs, _ = generator.generate([media_prompt, text_prompt], [SamplingParams(temperature=0.0)] * 2, 3, media=media)
    for prompt, output, row_media in (
        (
            media_prompt,
            outputs[0],
            dict(
                pixel_values=jnp.asarray(image_pixels),
                image_grids=[[IMAGE]],
                pixel_values_videos=jnp.asarray(video_pixels),
                video_grids=[[VIDEO]],
            ),
        ),
        (text_prompt, outputs[1], {}),
    ):
        assert len(output) == 3
        logits = forward(model, [list(prompt) + output], **row_media)[0][0]
        assert output == [int(t) for t in np.argmax(logits[len(prompt) - 1 : -1], axis=-1)]


def test_generator_refuses_media_for_a_text_model(checkpoints):
    from ling_jax.generation.generator import Generator, MediaInputs
    from ling_jax.generation.sampling import SamplingParams

    text_model = checkpoints[2]
    with pytest.raises(ValueError, match="need a VL model"):
        Generator(text_model).generate(
            [[5, 6]],
            [SamplingParams()],
            2,
            media=MediaInputs(image_grids=((IMAGE,),), pixel_values=_pixels((IMAGE,), 1)),
        )


def test_generate_cli_with_an_image(tmp_path, checkpoints, capsys):
    """scripts/generate.py --image: the image becomes [vision_start, pads, vision_end] where the prompt says
    <image>; the completion is the model's greedy continuation of exactly those ids and pixels."""
    import json

    from PIL import Image
    from vl_checkpoint import VISION_END, VISION_START

    from ling_jax.generation.cli import main
    from ling_jax.vl.image_processing import ProcessorConfig, preprocess_image

    root, _, _, model = checkpoints
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (44, 60, 3), dtype=np.uint8))
    image.save(tmp_path / "cat.png")
    argv = [
        "--byte-tokenizer",
        "--model",
        str(root / "vl"),
        "--image",
        str(tmp_path / "cat.png"),
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
        "--json",
        "A <image> B",
    ]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    patches, grid = preprocess_image(image, ProcessorConfig.for_vision(model.vl_config.vision))
    ids = [ord("A"), ord(" "), VISION_START, *[IMAGE_TOKEN] * grid.num_tokens(2), VISION_END, ord(" "), ord("B")]
    assert record["prompt_tokens"] == len(ids) and len(record["completion_ids"]) == 2
    # one forward over prompt + completion gives each step's greedy pick (the model is causal)
    full = [*ids, *record["completion_ids"]]
    logits = forward(model, [full], pixel_values=jnp.asarray(patches), image_grids=[[grid]])[0]
    assert record["completion_ids"] == [int(t) for t in np.argmax(logits[0, len(ids) - 1 : -1], -1)]


def test_generate_cli_media_errors(tmp_path, checkpoints, capsys):
    from ling_jax.generation.cli import main

    root = checkpoints[0]
    assert main(["--byte-tokenizer", "--model", str(root / "text"), "--image", str(tmp_path / "x.png"), "hi"]) == 2
    assert "need a VL checkpoint" in capsys.readouterr().err
    assert main(["--byte-tokenizer", "--model", str(root / "vl"), "--image", str(tmp_path / "missing.png"), "hi"]) == 2
    assert "image not found" in capsys.readouterr().err
    from PIL import Image

    Image.new("RGB", (30, 20), (200, 10, 10)).save(tmp_path / "red.png")
    assert (
        main(["--byte-tokenizer", "--model", str(root / "vl"), "--image", str(tmp_path / "red.png"), "<image> <image>"])
        == 2
    )
    assert "2 <image> placeholders but 1 image" in capsys.readouterr().err


def test_sharded_vl_model_equals_unsharded(checkpoints, media_logits):
    """Every parameter (the vision tower and projector replicated) placed on a data x expert mesh of 8 CPU
    devices: the media prompt's logits are unchanged (the sharded forward jitted: one compile, not op by op)."""
    model = load_hf_checkpoint(checkpoints[0] / "vl", dtype=jnp.float32, progress=False)
    ids = _prompt()
    positions, _ = model.positions(ids, image_grids=[[IMAGE]], video_grids=[[VIDEO]])
    mesh = make_mesh({"data": 2, "expert": 4})  # the tiny vocab (259) does not split over a tensor axis
    shard_model(model, mesh)
    assert model.visual.blocks[0].attn.qkv.weight[...].sharding.is_fully_replicated
    graphdef, state = nnx.split(model)

    def forward(state, ids, positions, media):
        return nnx.merge(graphdef, state)(ids, positions=positions, **media).logits

    media = _media()
    grids = {name: media.pop(name) for name in ("image_grids", "video_grids")}
    with jax.set_mesh(mesh):
        sharded = np.asarray(
            jax.jit(lambda *a: forward(*a[:3], {**a[3], **grids}))(state, jnp.asarray(ids), positions, media)
        )
    assert rel_error(sharded, media_logits) <= 1e-5
