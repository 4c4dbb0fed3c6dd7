"""Flash attention's online softmax inside a Triton kernel, as the MLA decode and prefill kernels both run it: a
running (accumulator [rows, width] fp32, row max, row sum) updated key block by key block, then stored normalised
with its log-sum-exp (-inf and zeros for a row that saw no key). Called while a kernel is traced; the Mosaic GPU
prefill kernel resumes from a running pair with `resume` too."""

from __future__ import annotations

import jax.numpy as jnp


def start(rows: int, width: int):
    """The running state before any key: (zeros [rows, width], a max of -1e30 (finite: no inf - inf), zero sums)."""
    return (
        jnp.zeros((rows, width), jnp.float32),
        jnp.full((rows,), -1e30, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def resume(o_RW, lse_R):
    """The running state equal to an attention already normalised with its log-sum-exp (o [rows, width] fp32, zeros
    and lse -inf where no key was seen): with the max at lse the sum is 1 and the accumulator is o, so adding
    blocks to it merges exactly, as `start` where nothing was seen."""
    seen = lse_R > -jnp.inf
    return o_RW, jnp.where(seen, lse_R, -1e30), seen.astype(jnp.float32)


def add_block(carry, scores_RK, visible_RK, values_KW, dot):
    """The running state after a key block: its scores [rows, keys] (-inf where not visible) folded into the max,
    the accumulator and sums rescaled to it, plus softmax weights (in the values' dtype) @ values [keys, width] with
    `dot` (the kernel's `plgpu.dot`)."""
    acc_RW, m_R, l_R = carry
    scores_RK = jnp.where(visible_RK, scores_RK, -jnp.inf)
    m_new = jnp.maximum(m_R, jnp.max(scores_RK, axis=1))
    p = jnp.exp(scores_RK - m_new[:, None])
    correction = jnp.exp(m_R - m_new)
    acc_RW = acc_RW * correction[:, None] + dot(p.astype(values_KW.dtype), values_KW)
    return acc_RW, m_new, l_R * correction + jnp.sum(p, axis=1)


def store(o_ref, lse_ref, carry) -> None:
    """o = accumulator / sum (in o_ref's dtype), lse = max + log(sum): 0 and -inf for a row that saw no key."""
    acc_RW, m_R, l_R = carry
    seen = l_R > 0
    o_ref[...] = (acc_RW / jnp.where(seen, l_R, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_R + jnp.log(jnp.where(seen, l_R, 1.0)), -jnp.inf)
