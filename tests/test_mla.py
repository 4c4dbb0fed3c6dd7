"""Expanded vs absorbed MLA (same cache, same outputs), and RoPE/YaRN tables vs np_reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_error
from np_reference import rope_inv_freq_and_mscale

from ling_jax import LingConfig, LingForCausalLM
from ling_jax.config import MLA
from ling_jax.mla import ABSORBED, EXPANDED, KeyVisibility, MultiLatentAttention
from ling_jax.presets import TINY, preset
from ling_jax.rope import cos_sin_factor, inv_frequencies, rope_cos_sin, softmax_scale

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
    expanded = attention(x, cos, sin, keys_BSA=cache, visibility=visibility, mode=EXPANDED)
    absorbed = attention(x, cos, sin, keys_BSA=cache, visibility=visibility, mode=ABSORBED)
    assert rel_error(absorbed, expanded) <= 1e-5


@nnx.jit
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
