"""The model's decode step with its input projections grouped (`ling_jax.layers.linear_many`: a layer's block-FP8
projections of one x in one grouped gemv, the dense MLP's gate and up too) and its output projections' split-K sums
added in the residual add + norm kernel (`ling_jax.layers.linear_add_rms_norm`) equals the same step with each
projection its own gemv and its own reduction, the GPU kernels in Pallas interpret mode on random block-FP8 weights
(128 x 128 blocks, as a checkpoint stores them)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import rel_error

import ling_jax.layers
from benchmarks.kernel_census import kernel_census
from ling_jax import ExecutionPolicy
from ling_jax.generation.random_init import random_model
from ling_jax.presets import preset
from pallas_kernels.fp8 import fp8_linear, tuned

STEPS = 2


def decode_steps(graphdef, state, ids_BT):
    """Logits [B, STEPS, V] of STEPS one-token decode steps from an empty cache."""
    model = nnx.merge(graphdef, state)
    cache, logits = model.init_cache(ids_BT.shape[0], STEPS), []
    for t in range(STEPS):
        out = model(ids_BT[:, t : t + 1], cache=cache)
        cache = out.cache
        logits.append(out.logits)
    return jnp.concatenate(logits, axis=1)


def test_grouped_and_folded_decode_projections_equal_separate_gemvs(monkeypatch):
    # heads of 64: the output projections' K is 256 (2 blocks), which the gemv splits in 2 with a K block a step
    config = preset("tiny").replace(
        num_hidden_layers=2, layer_types=("kda", "mla"), mlp_layer_types=("dense",) * 2, head_dim=64, v_head_dim=64
    )
    one_block_a_step = {
        key: dataclasses.replace(entry, params=dataclasses.replace(entry.params, blocks_per_step=1))
        for key, entry in tuned.WEIGHT_ONLY_GEMV.items()
    }
    monkeypatch.setattr(tuned, "WEIGHT_ONLY_GEMV", one_block_a_step)
    policy = ExecutionPolicy(kernel_backend="interpret_gpu")
    model = random_model(config, weights="stored", dtype=jnp.float32, policy=policy, seed=3)
    ids_BT = jnp.asarray(np.random.default_rng(0).integers(2, config.vocab_size, (2, STEPS)))
    graphdef, state = nnx.split(model)
    results = {}
    for grouped in (True, False):
        if not grouped:  # the previous path: each projection its own fp8_linear, each gemv its own reduction
            monkeypatch.setattr(
                ling_jax.layers, "fp8_linear_many", lambda x, ws, **kw: [fp8_linear(x, w, **kw) for w in ws]
            )
            monkeypatch.setattr(ling_jax.layers, "fp8_linear_partials", lambda x, w, **kw: None)
        traced = jax.jit(lambda state, ids_BT: decode_steps(graphdef, state, ids_BT)).trace(
            state, ids_BT
        )  # a fresh trace
        census = kernel_census(traced.jaxpr)
        # KDA's q/k/v/f_a/g_a, MLA's q_a/kv_a, each dense MLP's gate/up
        assert census["weight_only_gemv_many"] == (4 * STEPS if grouped else 0)
        assert census["add_partials_rms_norm"] == (2 * STEPS if grouped else 0)  # after each layer's dense
        # layer 1's input norm and the final norm, each with the residual add in front; ungrouped also after each dense
        assert census["add_rms_norm"] == (2 * STEPS if grouped else 4 * STEPS)
        assert census["weight_only_gemv -> reduce"] == (0 if grouped else 2 * STEPS)  # the dense gemvs' K splits
        results[grouped] = np.asarray(traced.lower().compile()(state, ids_BT))
    assert rel_error(results[True], results[False]) <= 1e-5  # bit for bit on the CPU today (2 splits)
