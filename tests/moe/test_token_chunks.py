"""A large prefill runs the routed experts on its tokens in chunks (`ling_jax.moe.experts.in_token_chunks`): the
same bits as in one piece, padding included (the expert-parallel exchange: tests/test_sharding.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.moe import experts as moe_experts
from ling_jax.policy import ExecutionPolicy
from pallas_kernels.moe.ops import ExpertWeights, Routing


def test_local_moe_in_padded_token_chunks_equals_one_piece(monkeypatch):
    """50 tokens with ROW_BUFFER_BYTES room for the rows of 7: 8 chunks, the last with 6 padding tokens. In bf16, as
    the models run (XLA:CPU's float32 dots may sum in another order at another row count)."""
    tokens, top_k, num_experts, hidden, width = 50, 3, 8, 64, 32
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(tokens, hidden)), jnp.bfloat16)
    weights = jnp.asarray(r.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)
    experts = jnp.asarray(np.stack([r.permutation(num_experts)[:top_k] for _ in range(tokens)]), jnp.int32)
    stacks = [
        jnp.asarray(r.normal(size=shape) * 0.2, jnp.bfloat16)
        for shape in [(num_experts, width, hidden)] * 2 + [(num_experts, hidden, width)]
    ]

    def run():
        return jax.jit(
            functools.partial(moe_experts.local_moe, limit=7.0, policy=ExecutionPolicy(kernel_backend="reference"))
        )(x, Routing(weights, experts), ExpertWeights(*stacks))

    whole = run()
    row_bytes = hidden * x.dtype.itemsize
    monkeypatch.setattr(moe_experts, "ROW_BUFFER_BYTES", 7 * top_k * row_bytes)
    assert moe_experts.token_chunks(tokens, top_k, row_bytes) == 8
    np.testing.assert_array_equal(run(), whole)
