"""`ling_jax.functional`: each layer function, jitted with the config static, against the transformers oracle's own
layer module on random inputs (weights read from the oracle's save_pretrained output by
`checkpoint_layer_weights`); MLA alone over a cache; the execution policy's checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import rel_error
from oracle import build_oracle, save_oracle

from ling_jax import LingConfig, LingForCausalLM, MLAState, load_hf_checkpoint
from ling_jax import functional as F
from ling_jax.checkpoints.hf import checkpoint_layer_weights
from ling_jax.presets import preset
from pallas_kernels.backend import BACKENDS

FP32_TOL = 1e-4
BATCH, LENGTH = 2, 11
KDA_DENSE, MLA_MOE = 0, 1  # the layers of the g2_dense1 oracle: [KDA + dense, MLA + MoE, KDA + MoE, MLA + MoE]
POLICY = F.ExecutionPolicy(kernel_backend="reference")


@pytest.fixture(scope="module")
def oracle_setup(tmp_path_factory):
    """(oracle, config, checkpoint path) for the g2_dense1 oracle in fp32."""
    oracle = build_oracle("g2_dense1", seed=5)
    path = save_oracle(oracle, tmp_path_factory.mktemp("g2_dense1"))
    return oracle, LingConfig.from_pretrained(path), path


@pytest.fixture(scope="module")
def x_BTD(oracle_setup):
    config = oracle_setup[1]
    return jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, LENGTH, config.hidden_size)), jnp.float32)


def torch_of(x):
    return torch.as_tensor(np.array(x))


def hf_position_inputs(oracle, x_BTD):
    """(rope tables, causal additive mask [B, 1, T, T]) as BailingHybridModel.forward builds them."""
    positions = torch.arange(LENGTH)[None].expand(BATCH, -1)
    cos_sin = oracle.model.rotary_emb(torch_of(x_BTD), positions)
    causal = torch.full((LENGTH, LENGTH), torch.finfo(torch.float32).min).triu(1)
    return cos_sin, causal[None, None].expand(BATCH, 1, -1, -1), positions


def jitted(fn, *static):
    return jax.jit(fn, static_argnames=("cfg", *static))


def test_kda_attention_matches_oracle(oracle_setup, x_BTD):
    oracle, config, path = oracle_setup
    weights = checkpoint_layer_weights(path, KDA_DENSE)
    ctx = F.token_context(config, BATCH, LENGTH, policy=POLICY)
    y, state = jitted(F.kda_attention)(weights["attention"], x_BTD, None, ctx, cfg=config)
    with torch.no_grad():
        expected = oracle.model.layers[KDA_DENSE].self_attn(hidden_states=torch_of(x_BTD))
    assert rel_error(y, expected.numpy()) <= FP32_TOL
    assert state.recurrent_state.shape == (BATCH, config.num_attention_heads, config.head_dim, config.head_dim)


def test_latent_attention_matches_oracle(oracle_setup, x_BTD):
    oracle, config, path = oracle_setup
    weights = checkpoint_layer_weights(path, MLA_MOE)
    ctx = F.token_context(config, BATCH, LENGTH, policy=POLICY)
    y, cache = jitted(F.latent_attention)(weights["attention"], x_BTD, None, ctx, cfg=config)
    cos_sin, mask, _ = hf_position_inputs(oracle, x_BTD)
    with torch.no_grad():
        expected, _ = oracle.model.layers[MLA_MOE].self_attn(
            hidden_states=torch_of(x_BTD), position_embeddings=cos_sin, attention_mask=mask
        )
    assert cache is None
    assert rel_error(y, expected.numpy()) <= FP32_TOL


def test_feed_forward_functions_match_oracle(oracle_setup, x_BTD):
    oracle, config, path = oracle_setup
    dense, sparse = (checkpoint_layer_weights(path, i)["mlp"] for i in (KDA_DENSE, MLA_MOE))
    hf_dense, hf_moe = oracle.model.layers[KDA_DENSE].mlp, oracle.model.layers[MLA_MOE].mlp
    x_TD = x_BTD.reshape(-1, config.hidden_size)
    moe = jitted(F.moe_block, "layer", "policy")(sparse, x_BTD, cfg=config, layer=MLA_MOE, policy=POLICY)
    route_weights, experts = jitted(F.router)(sparse["gate"], x_TD, cfg=config)
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_moe.gate(torch_of(x_TD))
        expected_moe, expected_dense = hf_moe(torch_of(x_BTD)), hf_dense(torch_of(x_BTD))
        expected_norm = oracle.model.layers[KDA_DENSE].input_layernorm(torch_of(x_BTD))
    assert rel_error(jax.jit(F.dense_mlp)(dense, x_BTD), expected_dense.numpy()) <= FP32_TOL
    assert rel_error(moe, expected_moe.numpy()) <= FP32_TOL
    order, hf_order = np.argsort(np.asarray(experts), -1), np.argsort(hf_experts.numpy(), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(experts), order, -1), np.take_along_axis(hf_experts.numpy(), hf_order, -1)
    )
    assert (
        rel_error(
            np.take_along_axis(np.asarray(route_weights), order, -1),
            np.take_along_axis(hf_weights.numpy(), hf_order, -1),
        )
        <= FP32_TOL
    )
    norm_weights = checkpoint_layer_weights(path, KDA_DENSE)["input_layernorm"]
    norm = jax.jit(F.rms_norm, static_argnames="eps")(norm_weights, x_BTD, eps=config.rms_norm_eps)
    assert rel_error(norm, expected_norm.numpy()) <= FP32_TOL


@pytest.mark.parametrize("index", [KDA_DENSE, MLA_MOE])
def test_decoder_layer_matches_oracle(oracle_setup, x_BTD, index):
    oracle, config, path = oracle_setup
    ctx = F.token_context(config, BATCH, LENGTH, policy=POLICY)
    h, _ = jitted(F.decoder_layer, "layer")(
        checkpoint_layer_weights(path, index), x_BTD, None, ctx, cfg=config, layer=index
    )
    cos_sin, mask, positions = hf_position_inputs(oracle, x_BTD)
    with torch.no_grad():
        expected = oracle.model.layers[index](
            torch_of(x_BTD),
            attention_mask=None if index == KDA_DENSE else mask,
            position_ids=positions,
            position_embeddings=cos_sin,
        )
    assert rel_error(h, expected.numpy()) <= FP32_TOL


def test_checkpoint_layer_weights_equal_the_loaded_model_layer(oracle_setup):
    _, _, path = oracle_setup
    model = load_hf_checkpoint(path, dtype=jnp.float32, progress=False)
    ours, loaded = checkpoint_layer_weights(path, MLA_MOE), F.layer_weights(model, MLA_MOE)
    assert jax.tree.structure(ours) == jax.tree.structure(loaded)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), ours, loaded)))
    with pytest.raises(IndexError, match="layer 9 of a config with 4 decoder layers"):
        checkpoint_layer_weights(path, 9)


def test_latent_attention_alone_over_a_cache_equals_one_full_call():
    config = preset("tiny")
    model = LingForCausalLM(config, rngs=nnx.Rngs(1), dtype=jnp.float32, policy=POLICY)
    index = config.layer_types.index("mla")
    weights = F.layer_weights(model, index)["attention"]
    x = jax.random.normal(jax.random.key(2), (BATCH, LENGTH, config.hidden_size))
    attend = jitted(F.latent_attention)
    full, _ = attend(weights, x, None, F.token_context(config, BATCH, LENGTH, policy=POLICY), cfg=config)
    prefill, slots = 7, 16
    context = functools.partial(F.token_context, config, BATCH, max_length=slots, policy=POLICY)
    y, cache = attend(
        weights,
        x[:, :prefill],
        MLAState.zeros(config, BATCH, slots, jnp.float32),
        context(prefill, lengths=jnp.zeros((BATCH,), jnp.int32)),
        cfg=config,
    )
    steps = [y]
    for t in range(prefill, LENGTH):
        ctx = context(1, lengths=jnp.full((BATCH,), t, jnp.int32))
        assert ctx.mla_mode == F.MLAMode.ABSORBED
        y, cache = attend(weights, x[:, t : t + 1], cache, ctx, cfg=config)
        steps.append(y)
    assert rel_error(jnp.concatenate(steps, axis=1), full) <= 1e-5


def test_kda_steps_mode_pads_keep_the_state():
    """Steps mode (speculative verification) with a padding mask: the state after a pad is the one before it, bit for
    bit (a row of pads keeps its initial state at every token), and the real tokens' states and outputs are those of
    the call without the pad."""
    config = preset("tiny")
    model = LingForCausalLM(config, rngs=nnx.Rngs(1), dtype=jnp.float32, policy=POLICY)
    weights = F.layer_weights(model, config.layer_types.index("kda"))["attention"]
    x = jax.random.normal(jax.random.key(3), (BATCH, 9, config.hidden_size))
    kda = jitted(F.kda_attention)
    _, start = kda(weights, x[:, :5], None, F.token_context(config, BATCH, 5, policy=POLICY), cfg=config)
    mask = jnp.array([[True, False, True, True], [False] * 4])
    ctx = F.token_context(config, BATCH, 4, attention_mask=mask, policy=POLICY, kda_mode=F.KDAMode.STEPS)
    y, steps = kda(weights, x[:, 5:], start, ctx, cfg=config)
    real = np.array([5, 7, 8])
    unpadded = F.token_context(config, BATCH, 3, policy=POLICY, kda_mode=F.KDAMode.STEPS)
    y_real, steps_real = kda(weights, x[:, real], start, unpadded, cfg=config)
    for name in ("recurrent_state", "conv_window"):
        padded, plain, before = (np.asarray(getattr(s, name)) for s in (steps, steps_real, start))
        assert padded[0, 1].tobytes() == padded[0, 0].tobytes()
        assert all(padded[1, t].tobytes() == before[1].tobytes() for t in range(4))
        assert rel_error(padded[0, [0, 2, 3]], plain[0]) <= 1e-6
    assert rel_error(y[0, [0, 2, 3]], y_real[0]) <= 1e-6


def test_policy_rejects_typos_at_construction():
    with pytest.raises(ValueError, match=r"kernel_backend: 'pallas-gpu' is not one of 'auto', 'reference'"):
        F.ExecutionPolicy(kernel_backend="pallas-gpu")
    with pytest.raises(ValueError, match=r"kda_mode: 'chunk' is not one of 'chunked', 'recurrent', 'steps', None"):
        F.ExecutionPolicy(kda_mode="chunk")
    with pytest.raises(ValueError, match="moe_capacity_factor: must be None"):
        F.ExecutionPolicy(moe_capacity_factor=0)
    with pytest.raises(TypeError, match=r"ExecutionPolicy or None, got 'reference' \(for a kernel backend: Exec"):
        LingForCausalLM(preset("tiny"), rngs=nnx.Rngs(0), policy="reference")
    policy = F.ExecutionPolicy(kernel_backend="reference", moe_exchange="ragged", mla_mode="absorbed")
    assert (policy.moe_exchange, policy.mla_mode) == (F.MoEExchange.RAGGED, F.MLAMode.ABSORBED)
    assert policy.kernel_backend is F.KernelBackend.REFERENCE
    assert {b.value for b in F.KernelBackend} == set(BACKENDS)
