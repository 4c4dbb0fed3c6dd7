"""Expanded vs absorbed MLA (same cache, same outputs), a paged cache vs a contiguous one, and RoPE/YaRN tables
vs np_reference."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST_COMPILE_OPTIONS, rel_error
from np_reference import rope_inv_freq_and_mscale
from tiny_fp8 import write_tiny_fp8_checkpoint

from ling_jax import ExecutionPolicy, LingConfig, LingForCausalLM, load_hf_checkpoint
from ling_jax.cache import MLAState, PagedMLAState
from ling_jax.config import MLA
from ling_jax.context import token_context
from ling_jax.layers import params_of
from ling_jax.mla import ABSORBED, EXPANDED, KeyVisibility, MultiLatentAttention, latent_attention
from ling_jax.presets import TINY, preset
from ling_jax.quantized import BlockFP8Weight
from ling_jax.rope import cos_sin_factor, inv_frequencies, rope_cos_sin, softmax_scale
from pallas_kernels.mla.reference import gather_pages

VARIANTS = {
    "qlora-interleaved": {},
    "plain-q-neox": {"q_lora_rank": None, "rope_interleave": False},
    "yarn": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        }
    },
}


def config(variant):
    return LingConfig.from_dict({**TINY, **VARIANTS[variant]})


def perturb_(module, seed):
    """Move every norm weight off 1 so the test sees them."""
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(module))):
        if "layernorm" in "/".join(map(str, path)):
            var.set_value(var.get_value() * (1.0 + 0.3 * jax.random.normal(jax.random.key(seed + i), var.shape)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("length", [1, 9])
def test_absorbed_equals_expanded(variant, length):
    c = config(variant)
    attention = MultiLatentAttention(c, dtype=jnp.float32, rngs=nnx.Rngs(1))
    perturb_(attention, 7)
    r = np.random.default_rng(length)
    batch, slots = 3, 40
    x = jnp.asarray(r.normal(size=(batch, length, c.hidden_size)), jnp.float32)
    positions = jnp.asarray(r.integers(0, 60, (batch, length)))
    cos, sin = rope_cos_sin(positions, c)
    cache = jnp.asarray(r.normal(size=(batch, slots, c.latent_dim)), jnp.float32)
    visibility = KeyVisibility(
        jnp.asarray(r.integers(0, slots, (batch, length)), jnp.int32), jnp.asarray(r.uniform(size=(batch, slots)) < 0.8)
    )
    expanded = attention(x, cos, sin, keys_BSA=cache, visibility=visibility, policy=ExecutionPolicy(mla_mode=EXPANDED))
    absorbed = attention(x, cos, sin, keys_BSA=cache, visibility=visibility, policy=ExecutionPolicy(mla_mode=ABSORBED))
    assert rel_error(absorbed, expanded) <= 1e-5


def compiled_fast(fun):
    """`nnx.jit(fun)` for `fun(model, ids)`, compiled with XLA:CPU's faster-compiling emitters (each program runs
    once); `.fun` is `fun` itself, to trace inside another trace (compiler options are for a top-level jit only)."""

    @functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE_OPTIONS)
    def merged(graphdef, state, ids):
        return fun(nnx.merge(graphdef, state), ids)

    def call(model, ids):
        return merged(*nnx.split(model), ids)

    call.fun = fun
    return call


@compiled_fast
def decode_steps_both_modes(model, ids):
    """Prefill all but the last two ids, then decode those two steps in each MLA mode: {mode: logits}."""
    prefill = model(ids[:, :-2], cache=model.init_cache(2, 16)).cache
    logits = {}
    for mode in (EXPANDED, ABSORBED):
        cache, steps = prefill, []
        for t in range(ids.shape[1] - 2, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, mla_mode=mode)
            steps.append(out.logits)
            cache = out.cache
        logits[mode] = jnp.concatenate(steps, axis=1)
    return logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_decode_absorbed_equals_expanded(variant):
    """Two layers (KDA, MLA) of the variant; prefill and both modes' decode steps in one compiled program."""
    c = LingConfig.from_dict(
        {
            **TINY,
            **VARIANTS[variant],
            "num_hidden_layers": 2,
            "expert_swiglu_limit_list": [0, 7.0],
            "share_expert_swiglu_limit_list": [0, 7.0],
        }
    )
    model = LingForCausalLM(c, rngs=nnx.Rngs(2), dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(3).integers(2, c.vocab_size, (2, 12)))
    logits = decode_steps_both_modes(model, ids)
    assert MLA in c.layer_types
    assert rel_error(logits[ABSORBED], logits[EXPANDED]) <= 1e-5


def test_block_fp8_kv_b_decodes_absorbed_as_stored(tmp_path):
    """A block-FP8 checkpoint kept as stored, on the GPU kernels in interpret mode: the absorbed decode steps give
    kv_b_proj's e4m3 values and scales (split per head) to the absorbed products' kernels
    (tests/kernels/test_mla_absorb.py: no dense copy) and equal the expanded ones, which attend with it
    dequantised."""
    write_tiny_fp8_checkpoint(tmp_path)
    model = load_hf_checkpoint(
        tmp_path, dtype=jnp.float32, policy=ExecutionPolicy(kernel_backend="interpret_gpu"), progress=False
    )
    mla_layer = model.model.layers[model.config.layer_types.index(MLA)]
    kv_b = mla_layer.attention.kv_b_proj.weight.get_value()
    assert isinstance(kv_b, BlockFP8Weight)
    ids = jnp.asarray(np.random.default_rng(4).integers(2, model.config.vocab_size, (2, 9)))
    graph, state = nnx.split(model)
    text = str(jax.make_jaxpr(lambda state, ids: decode_steps_both_modes.fun(nnx.merge(graph, state), ids))(state, ids))
    kernel_operands = dict(re.findall(r"(absorb_query_gpu|expand_output_gpu)\S* = \{ lambda ; ([^.]*)\.", text))
    assert len(kernel_operands) == 2 and all("f8_e4m3fn[4,32,32] " in o for o in kernel_operands.values())
    logits = decode_steps_both_modes(model, ids)
    assert rel_error(logits[ABSORBED], logits[EXPANDED]) <= 1e-5


MODES = (EXPANDED, ABSORBED)


@compiled_fast
def verify_step_both_modes(model, ids):
    """Prefill all but the last 3 ids (expanded; row 1 two tokens shorter), then those 3 in one call over the cache
    (the MTP verify pass's shape; row 1's last a pad) in each MLA mode: {mode: logits of the real tokens}."""
    prompt_mask = jnp.arange(ids.shape[1] - 3) < jnp.asarray([[ids.shape[1] - 3], [ids.shape[1] - 5]])
    prefill = model(ids[:, :-3], cache=model.init_cache(2, 16), attention_mask=prompt_mask, mla_mode=EXPANDED).cache
    step_mask = jnp.asarray([[True, True, True], [True, True, False]])
    logits = {mode: model(ids[:, -3:], cache=prefill, attention_mask=step_mask, mla_mode=mode).logits for mode in MODES}
    return {mode: jnp.where(step_mask[..., None], value, 0.0) for mode, value in logits.items()}


def test_verify_tokens_absorbed_on_the_decode_kernel(tmp_path):
    """Three tokens a row over a cache, rows of different lengths, the block-FP8 kv_b as stored, on the GPU
    kernels in interpret mode: the absorbed call attends with `mla_decode_tokens`' Triton kernel (one
    mla_decode_split launch for all the tokens) and equals the expanded call."""
    write_tiny_fp8_checkpoint(tmp_path)
    model = load_hf_checkpoint(
        tmp_path, dtype=jnp.float32, policy=ExecutionPolicy(kernel_backend="interpret_gpu"), progress=False
    )
    ids = jnp.asarray(np.random.default_rng(5).integers(2, model.config.vocab_size, (2, 10)))
    graph, state = nnx.split(model)
    text = str(jax.make_jaxpr(lambda state, ids: verify_step_both_modes.fun(nnx.merge(graph, state), ids))(state, ids))
    mla_layers = model.config.layer_types.count(MLA)
    assert text.count("name=mla_decode_split") == mla_layers
    logits = verify_step_both_modes(model, ids)
    assert rel_error(logits[ABSORBED], logits[EXPANDED]) <= 1e-5


def prefill_then_step(c, weights, inputs, state, page_table, max_length, policy=None):
    """latent_attention over each [B, T, D] input in turn, a cache of `max_length` slots: (outputs, state)."""
    outputs, lengths = [], jnp.zeros((2,), jnp.int32)
    for x_BTD in inputs:
        ctx = token_context(
            c, 2, x_BTD.shape[1], lengths=lengths, max_length=max_length, page_table=page_table, policy=policy
        )
        y_BTD, state = latent_attention(weights, x_BTD, state, ctx, c)
        outputs.append(y_BTD)
        lengths = lengths + x_BTD.shape[1]
    return jnp.concatenate(outputs, axis=1), state


def test_paged_cache_equals_contiguous():
    """A prefill then a decode step through a paged cache (pages out of order, an empty table entry past each
    sequence) give the contiguous cache's outputs, with the same latents in each sequence's slots."""
    c = config("qlora-interleaved")
    weights = params_of(MultiLatentAttention(c, dtype=jnp.float32, rngs=nnx.Rngs(1)))
    r = np.random.default_rng(4)
    inputs = [jnp.asarray(r.normal(size=(2, n, c.hidden_size)), jnp.float32) for n in (7, 1)]
    page_table_BN = jnp.asarray([[5, 0, 3, 7], [1, 6, 2, 7]], jnp.int32)  # 7 = no page: a pool of 7 pages of 4
    expected, contiguous = prefill_then_step(
        c, weights, inputs, MLAState(latent=jnp.zeros((2, 16, c.latent_dim))), None, 16
    )
    paged, pages = prefill_then_step(
        c, weights, inputs, PagedMLAState(latent_pages=jnp.zeros((7, 4, c.latent_dim))), page_table_BN, 16
    )
    assert rel_error(paged, expected) <= 1e-6
    np.testing.assert_array_equal(gather_pages(pages.latent_pages, page_table_BN)[:, :8], contiguous.latent[:, :8])


def test_paged_decode_on_the_tpu_kernel_reads_the_pages_in_place():
    """With the TPU kernels (interpret mode), the decode step over fp32 pages of 8 slots (a sequence's two pages
    out of order, the empty entry past them) attends with the paged kernel (`mla_decode_paged_tpu`: the pool's
    values are never gathered, only page ids) and equals the contiguous cache's decode on the jnp reference."""
    c = config("qlora-interleaved")
    weights = params_of(MultiLatentAttention(c, dtype=jnp.float32, rngs=nnx.Rngs(2)))
    r = np.random.default_rng(6)
    inputs = [jnp.asarray(r.normal(size=(2, n, c.hidden_size)), jnp.float32) for n in (10, 1)]
    page_table_BN = jnp.asarray([[3, 0, 5], [1, 4, 5]], jnp.int32)  # 5 = no page: a pool of 5 pages of 8
    tpu = ExecutionPolicy(kernel_backend="interpret_tpu")
    expected, _ = prefill_then_step(c, weights, inputs, MLAState(latent=jnp.zeros((2, 24, c.latent_dim))), None, 24)
    pool = PagedMLAState(latent_pages=jnp.zeros((5, 8, c.latent_dim)))
    paged, pages = prefill_then_step(c, weights, inputs[:1], pool, page_table_BN, 24, tpu)
    ctx = token_context(c, 2, 1, lengths=jnp.full((2,), 10), max_length=24, page_table=page_table_BN, policy=tpu)
    step = jax.make_jaxpr(lambda x, state: latent_attention(weights, x, state, ctx, c))(inputs[1], pages)
    gathers = [line for line in str(step).splitlines() if " = gather[" in line]  # of int32 page ids only
    assert "name=mla_decode_paged_tpu" in str(step) and not any(":f32[" in line for line in gathers)
    y_B1D, _ = latent_attention(weights, inputs[1], pages, ctx, c)
    assert rel_error(jnp.concatenate([paged, y_B1D], axis=1), expected) <= 1e-5


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 131072,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        {
            "rope_type": "deepseek_yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "attn_factor": 1.1,
            "truncate": False,
        },
    ],
)
def test_rope_tables_match_reference(rope_scaling):
    raw = {**TINY, "qk_rope_head_dim": 64, "rope_theta": 6e6}
    if rope_scaling:
        raw["rope_scaling"] = rope_scaling
    c = LingConfig.from_dict(raw)
    inv_ref, factor_ref, scale_ref = rope_inv_freq_and_mscale(raw)
    np.testing.assert_allclose(inv_frequencies(c.rope, 64), inv_ref, rtol=1e-12)
    assert cos_sin_factor(c.rope) == pytest.approx(factor_ref, rel=1e-12)
    assert softmax_scale(c) == pytest.approx(scale_ref, rel=1e-12)


def test_spec_yarn_example():
    """Spec §3.3: VL (f = 2, L0 = 131072, theta = 6e6) has cos/sin factor 1.0693147."""
    c = preset("ling-3.0-flash-vl")
    assert cos_sin_factor(c.rope) == pytest.approx(1.0693147, abs=1e-7)
    assert softmax_scale(c) == pytest.approx(1 / np.sqrt(192))
