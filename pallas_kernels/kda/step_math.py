"""The one-token delta-rule update shared by the Pallas KDA decode kernels (Triton's decode step and fused decode,
Mosaic TPU's decode step), traced inside their programs: elementwise products and sums over K (a token's tiles are
too thin for a dot), in the state's fp32."""

from __future__ import annotations

import jax.numpy as jnp


def delta_rule_update(state_KV, k_K, v_V, beta):
    """S + k beta (v - S^T k)^T: the delta rule's correction of a decayed state S [..., K, V] (leading axes: a block
    of heads) by one token's key k [..., K] and value v [..., V]; beta broadcasts against v."""
    delta_V = beta * (v_V - jnp.sum(k_K[..., :, None] * state_KV, axis=-2))
    return state_KV + k_K[..., :, None] * delta_V[..., None, :]
