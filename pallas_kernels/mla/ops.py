"""`mla_decode`: absorbed-MLA attention of one query token per sequence over a ragged latent cache."""

from __future__ import annotations

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend
from pallas_kernels.mla.decode_gpu import mla_decode_gpu
from pallas_kernels.mla.decode_tpu import mla_decode_tpu
from pallas_kernels.mla.reference import mla_decode_reference


def mla_decode(q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B, *, scale: float, backend: str = "auto"):
    """o_latent [B, H, R] in fp32.

    q_latent: q_nope already multiplied by W_UK [B, H, R]; q_rope [B, H, P] (after RoPE); kv_cache
    [B, L, R + P] = [c_kv ; k_pe] per slot; lengths [B] int32: only the first lengths[b] slots are attended.
    backend: "auto" (by jax.default_backend()), "reference" (jnp), "pallas_gpu", "pallas_tpu", or a kernel
    in Pallas interpret mode on the CPU: "interpret_gpu", "interpret_tpu" ("interpret" = "interpret_tpu").
    """
    backend = resolve_backend(backend)
    args = (q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B)
    if backend == "reference":
        return mla_decode_reference(*args, scale=scale)
    interpret = backend.startswith("interpret")
    if KERNEL_TARGET[backend] == "gpu":
        return mla_decode_gpu(*args, scale=scale, interpret=interpret)
    return mla_decode_tpu(*args, scale=scale, interpret=interpret)
