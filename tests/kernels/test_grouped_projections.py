"""The model's decode step with its input projections grouped (`ling_jax.layers.linear_many`: a layer's block-FP8
projections of one x in one grouped gemv) equals the same step with each projection its own gemv, the GPU kernels
in Pallas interpret mode on random block-FP8 weights (128 x 128 blocks, as a checkpoint stores them)."""

from __future__ import annotations

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
from pallas_kernels.fp8 import fp8_linear

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


def test_grouped_decode_projections_equal_separate_gemvs(monkeypatch):
    config = preset("tiny").replace(num_hidden_layers=2, layer_types=("kda", "mla"), mlp_layer_types=("dense",) * 2)
    policy = ExecutionPolicy(kernel_backend="interpret_gpu")
    model = random_model(config, weights="stored", dtype=jnp.float32, policy=policy, seed=3)
    ids_BT = jnp.asarray(np.random.default_rng(0).integers(2, config.vocab_size, (2, STEPS)))
    graphdef, state = nnx.split(model)
    results = {}
    for grouped in (True, False):
        if not grouped:  # the previous path: each projection its own fp8_linear
            monkeypatch.setattr(
                ling_jax.layers, "fp8_linear_many", lambda x, ws, **kw: [fp8_linear(x, w, **kw) for w in ws]
            )
        traced = jax.jit(lambda state, ids_BT: decode_steps(graphdef, state, ids_BT)).trace(
            state, ids_BT
        )  # a fresh trace
        launches = kernel_census(traced.jaxpr)["weight_only_gemv_many"]
        assert launches == (2 * STEPS if grouped else 0)  # the KDA layer's q/k/v/f_a/g_a, the MLA layer's q_a/kv_a
        results[grouped] = np.asarray(traced.lower().compile()(state, ids_BT))
    assert rel_error(results[True], results[False]) <= 1e-5
