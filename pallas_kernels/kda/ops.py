"""KDA entry points by backend: `chunk_kda` (a whole sequence) and `kda_decode_step` (one token)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend, with_reference_vjp
from pallas_kernels.kda.chunk_gpu import chunk_kda_gpu
from pallas_kernels.kda.chunk_tpu import chunk_kda_tpu
from pallas_kernels.kda.decode_gpu import kda_decode_step_gpu
from pallas_kernels.kda.decode_tpu import kda_decode_step_tpu
from pallas_kernels.kda.reference import kda_chunked, kda_recurrent


def kda_decode_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, *, scale=None, use_qk_l2norm=True,
                    backend: str = "auto"):
    """(o [B, H, V], new state [B, H, K, V] fp32) for one token per sequence.

    g: fp32 log-decay (<= 0); beta [B, H]; scale defaults to K^-1/2. The kernels update the state in place
    when the caller donates it (e.g. `jax.jit(..., donate_argnums=...)` around a decode step).
    backend: as for `pallas_kernels.mla.mla_decode` ("auto", "reference", "pallas_gpu", "pallas_tpu",
    "interpret_gpu", "interpret_tpu").
    """
    backend = resolve_backend(backend)
    scale = q_BHK.shape[-1] ** -0.5 if scale is None else scale
    if backend == "reference":
        o, state = kda_recurrent(q_BHK[:, None], k_BHK[:, None], v_BHV[:, None], g_BHK[:, None], beta_BH[:, None],
                                 scale=scale, initial_state=state_BHKV, use_qk_l2norm=use_qk_l2norm)
        return o[:, 0], state
    args = (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV)
    interpret = backend.startswith("interpret")
    if KERNEL_TARGET[backend] == "gpu":
        return kda_decode_step_gpu(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret)
    return kda_decode_step_tpu(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret)


def _chunk_kda_reference(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, backend):
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                       chunk_size=chunk_size)


def _chunk_kda_by_backend(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, backend):
    if backend == "reference":
        return _chunk_kda_reference(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, backend)
    interpret = backend.startswith("interpret")
    if KERNEL_TARGET[backend] == "gpu":
        return chunk_kda_gpu(q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                             interpret=interpret)
    return chunk_kda_tpu(q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                         interpret=interpret)


_chunk_kda = with_reference_vjp(_chunk_kda_by_backend, _chunk_kda_reference, nondiff_argnums=(6, 7, 8, 9))


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, chunk_size=64,
              backend: str = "auto"):
    """Chunked KDA over a whole sequence: (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32).

    q, k [B, T, H, K], v [B, T, H, V] (bf16 or fp32); g [B, T, H, K] fp32 log-decay (<= 0, e.g. bounded by
    the safe gate); beta [B, T, H]; initial_state [B, H, K, V] or None. Any T. chunk_size is the reference's
    chunk; the GPU kernels work in 64-token chunks of 16-row sub-blocks and the TPU kernel in 16-token chunks,
    where every exponential is of a difference and fp32-safe.
    Differentiable: the backward pass is the autodiff of the jnp chunked reference (recomputed from the
    inputs), whichever backend ran the forward.
    """
    backend = resolve_backend(backend)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is None:
        initial_state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    return _chunk_kda(q, k, v, g, beta, initial_state.astype(jnp.float32), scale, use_qk_l2norm, chunk_size,
                      backend)
