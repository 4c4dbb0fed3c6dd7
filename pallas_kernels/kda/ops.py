"""`kda_decode_step`: one token per sequence through the delta rule, by backend."""

from __future__ import annotations

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend
from pallas_kernels.kda.decode_gpu import kda_decode_step_gpu
from pallas_kernels.kda.decode_tpu import kda_decode_step_tpu
from pallas_kernels.kda.reference import kda_recurrent


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
