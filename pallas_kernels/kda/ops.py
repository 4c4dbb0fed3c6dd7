"""KDA entry points: `chunk_kda` (a whole sequence), `kda_decode_step` (one token), `kda_decode_fused` (one token
from the projections to the gated norm: convs, gates, step, norm) and `kda_verify_fused` (the same over a speculative
verify pass's few tokens, keeping each token's state), each over its variants.

VARIANTS lists every implementation by op and name; `kernel(op, name)` gives one's entry point (with its
block-size overrides, for tests and benchmarks). Without a variant named, the backend's platform picks: the
GPU's kernels on a GPU, "tpu_mosaic" on a TPU, the jnp reference otherwise. The prefill kernels come in two forms
per platform: bounded ones take log-decays >= GATE_FLOOR (-5, the safe gate's default bound) and fail below it
(NaN from 16 gates of -6): "gpu_triton_short" (16-token chunks, `gpu_triton.short_chunks`, the GPU's default:
faster than "gpu_triton" on an H100, docs/benchmarks/kda.md), "gpu_triton" (64-token chunks) and "tpu_mosaic";
"gpu_triton_any_gate" / "tpu_mosaic_any_gate" take any log-decay <= 0 (a bounded variant's record `takes` a gate
bound >= GATE_FLOOR). `chunk_variant` picks the bounded form only when the caller guarantees the bound. The lab's
forms (`pallas_kernels.experimental`) join VARIANTS when their module is imported. `chunk_kda(segments=n)` runs any of
them over n segments of each sequence at once (`segments.py`: a GPU's SMs filled when B x H is small).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels import variants
from pallas_kernels.backend import KERNEL_TARGET, device_cores, resolve_backend, with_reference_vjp
from pallas_kernels.kda import reference
from pallas_kernels.kda.chunk_math import GATE_FLOOR
from pallas_kernels.kda.gpu_triton import (
    chunk_kda_gpu,
    chunk_kda_gpu_any_gate,
    combine,
    kda_decode_fused_gpu,
    kda_decode_step_gpu,
    kda_verify_fused_gpu,
)
from pallas_kernels.kda.gpu_triton.conv import short_conv_silu_gpu
from pallas_kernels.kda.gpu_triton.decode_fused import leaves_norm
from pallas_kernels.kda.gpu_triton.short_chunks import chunk_kda_gpu_short
from pallas_kernels.kda.reference import kda_chunked, kda_recurrent
from pallas_kernels.kda.segments import combine_reference, segment_count, segmented_chunk_kda
from pallas_kernels.kda.tpu_mosaic import chunk_kda_tpu, chunk_kda_tpu_any_gate, kda_decode_step_tpu
from pallas_kernels.variants import REFERENCE, Variant


def _decode_reference(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, *, scale, use_qk_l2norm):
    o, state = kda_recurrent(
        q_BHK[:, None],
        k_BHK[:, None],
        v_BHV[:, None],
        g_BHK[:, None],
        beta_BH[:, None],
        scale=scale,
        initial_state=state_BHKV,
        use_qk_l2norm=use_qk_l2norm,
    )
    return o[:, 0], state


def _chunk_reference(q, k, v, g, beta, initial_state, *, scale, use_qk_l2norm, chunk_size=64):
    return kda_chunked(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
    )


def _parts_alike(parts_BTC, *_) -> bool:
    """Whether the conv kernel takes these parts: one shape and dtype."""
    return all(u.shape == parts_BTC[0].shape and u.dtype == parts_BTC[0].dtype for u in parts_BTC)


def gate_is_bounded(gate_lower_bound: float | None) -> bool:
    """Whether log-decays >= gate_lower_bound suit the bounded prefill kernels (None: no bound known): what a
    bounded chunk_kda variant `takes`."""
    return gate_lower_bound is not None and gate_lower_bound >= GATE_FLOOR


VARIANTS = {
    "chunk_kda": {
        REFERENCE: Variant(None, _chunk_reference),
        "gpu_triton": Variant("gpu", chunk_kda_gpu, takes=gate_is_bounded),
        "tpu_mosaic": Variant("tpu", chunk_kda_tpu, takes=gate_is_bounded),
        "gpu_triton_any_gate": Variant("gpu", chunk_kda_gpu_any_gate),
        "tpu_mosaic_any_gate": Variant("tpu", chunk_kda_tpu_any_gate),
        "gpu_triton_short": Variant("gpu", chunk_kda_gpu_short, takes=gate_is_bounded),
    },
    "kda_decode_step": {
        REFERENCE: Variant(None, _decode_reference),
        "gpu_triton": Variant("gpu", kda_decode_step_gpu),
        "tpu_mosaic": Variant("tpu", kda_decode_step_tpu),
    },
    "kda_decode_fused": {
        REFERENCE: Variant(None, reference.kda_decode_fused),
        "gpu_triton": Variant("gpu", kda_decode_fused_gpu),
    },
    "kda_verify_fused": {
        REFERENCE: Variant(None, reference.kda_verify_fused),
        "gpu_triton": Variant("gpu", kda_verify_fused_gpu),
    },
    "short_conv_silu": {
        REFERENCE: Variant(None, reference.short_conv_silu),
        "gpu_triton": Variant("gpu", short_conv_silu_gpu, takes=_parts_alike),
    },
}
_BY_PLATFORM = {"gpu": "gpu_triton", "tpu": "tpu_mosaic"}
_FUSED = {"gpu": "gpu_triton"}  # each platform's fused decode (and verify) kernel (none on a TPU)
_ANY_GATE = {"gpu": "gpu_triton_any_gate", "tpu": "tpu_mosaic_any_gate"}  # each platform's prefill for any gate
_BOUNDED = {"gpu": "gpu_triton_short", "tpu": "tpu_mosaic"}  # each platform's prefill for gates >= GATE_FLOOR


def kernel(op: str, name: str):
    """The entry point of variant `name` of `op` ("chunk_kda", "kda_decode_step", "kda_decode_fused",
    "kda_verify_fused" or "short_conv_silu")."""
    return variants.lookup(VARIANTS, op, name).kernel


def kda_decode_step(
    q_BHK,
    k_BHK,
    v_BHV,
    g_BHK,
    beta_BH,
    state_BHKV,
    *,
    scale=None,
    use_qk_l2norm=True,
    backend: str = "auto",
    variant: str | None = None,
):
    """(o [B, H, V], new state [B, H, K, V] fp32) for one token per sequence.

    g: fp32 log-decay (<= 0); beta [B, H]; scale defaults to K^-1/2. The kernels update the state in place
    when the caller donates it (e.g. `jax.jit(..., donate_argnums=...)` around a decode step).
    backend: as for `pallas_kernels.mla.mla_decode` ("auto", "reference", "pallas_gpu", "pallas_tpu",
    "interpret_gpu", "interpret_tpu"); variant: a name of VARIANTS["kda_decode_step"], None for the backend's.
    """
    backend = resolve_backend(backend)
    name = variants.pick(VARIANTS, "kda_decode_step", variant, backend, variants.by_platform(backend, _BY_PLATFORM))
    scale = q_BHK.shape[-1] ** -0.5 if scale is None else scale
    args = (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV)
    return variants.run(VARIANTS, "kda_decode_step", name, backend, *args, scale=scale, use_qk_l2norm=use_qk_l2norm)


_short_conv_gpu = with_reference_vjp(
    lambda parts, window, weight, real, positions, interpret: tuple(
        short_conv_silu_gpu(parts, window, weight, real, positions, interpret=interpret)
    ),
    lambda parts, window, weight, real, positions, interpret: tuple(
        reference.short_conv_silu(parts, window, weight, real, positions)
    ),
    nondiff_argnums=(5,),
)


def short_conv_silu(parts_BTC, window_BWC, weight_CK, mask_BT=None, *, backend: str = "auto", variant=None):
    """A KDA layer's short causal convs + SiLU over its q, k and v (`reference.short_conv_silu`: each real token's
    conv over its K-1 latest real inputs, pads skipped, their outputs 0; mask_BT None: every token real): ([y [B, T,
    C_i] in the parts' dtype for each part], the new window [B, K-1, sum C_i]: the newest K-1 real inputs). backend
    as for `kda_decode_step`; a GPU's kernel ("gpu_triton", parts of one shape) is differentiated as the reference."""
    backend = resolve_backend(backend)
    batch, length = parts_BTC[0].shape[:2]
    real_BT = jnp.ones((batch, length), bool) if mask_BT is None else mask_BT.astype(bool)
    positions_LBT, newest_BW = reference.conv_sources(real_BT, weight_CK.shape[-1] - 1)
    args = (list(parts_BTC), window_BWC, weight_CK, real_BT, positions_LBT)
    default = variants.by_platform(backend, {"gpu": "gpu_triton"})
    if default != REFERENCE and not VARIANTS["short_conv_silu"][default].supports(*args):
        default = REFERENCE
    name = variants.pick(VARIANTS, "short_conv_silu", variant, backend, default)
    if name == REFERENCE:
        ys = reference.short_conv_silu(*args)
    else:
        ys = list(_short_conv_gpu(*args, variants.interpreted(backend)))
    return ys, reference.conv_windows(parts_BTC, window_BWC, newest_BW)


def _fused_variant(op: str, backend: str, variant: str | None) -> str:
    """The variant of fused `op` that the resolved `backend` and `variant` pick (the platform's fused kernel, the
    reference elsewhere)."""
    return variants.pick(VARIANTS, op, variant, backend, variants.by_platform(backend, _FUSED))


def _fused_op(op: str, args, keywords: dict, backend: str, variant: str | None):
    """Fused `op` ("kda_decode_fused" or "kda_verify_fused") on `_fused_variant`, q's scale None for K^-1/2."""
    backend = resolve_backend(backend)
    name = _fused_variant(op, backend, variant)
    keywords = dict(keywords, scale=args[0].shape[-1] ** -0.5 if keywords["scale"] is None else keywords["scale"])
    return variants.run(VARIANTS, op, name, backend, *args, **keywords)


def kda_decode_fused(
    q_BHK,
    k_BHK,
    v_BHV,
    f_BHK,
    b_BH,
    gate_BHV,
    conv_window_BW3HK,
    state_BHKV,
    weights: reference.DecodeWeights,
    *,
    real_B=None,
    scale=None,
    lower_bound: float | None,
    eps: float,
    output_norm: bool = True,
    backend: str = "auto",
    variant: str | None = None,
):
    """A KDA layer's decode step from its projections to its gated output norm, one token per sequence: (o
    [B, H, V] in v's dtype, new conv window [B, T-1, 3, H, K], new state [B, H, K, V] fp32); the arrays and
    keywords are `reference.kda_decode_fused`'s (b_BH: beta's pre-activation or a `reference.BetaProjection`;
    real_B: the padding mask, None for none; lower_bound: the safe gate's bound, None for -A softplus; output_norm
    False: o before the gated output norm, for the caller to fuse where `fused_decode_leaves_norm`).

    One kernel on a GPU ("gpu_triton", the state updated in place when the caller donates it); the reference
    elsewhere, a TPU included (it has no fused kernel: `kda_decode_step` runs its recurrence kernel).
    backend, variant: as for `kda_decode_step` (variant: a name of VARIANTS["kda_decode_fused"]).
    """
    args = (q_BHK, k_BHK, v_BHV, f_BHK, b_BH, gate_BHV, conv_window_BW3HK, state_BHKV, weights)
    keywords = dict(real_B=real_B, scale=scale, lower_bound=lower_bound, eps=eps, output_norm=output_norm)
    return _fused_op("kda_decode_fused", args, keywords, backend, variant)


def fused_decode_leaves_norm(
    batch: int, heads: int, value_dim: int, dtype, *, backend: str = "auto", variant: str | None = None
) -> bool:
    """Whether `kda_decode_fused` (and `kda_verify_fused`, the same kernel) on `backend` (variant: as there) runs its
    gated output norm as a kernel of its own after the step's (the GPU kernel splitting each head's values over
    programs: `gpu_triton.decode_fused.leaves_norm`), one the caller saves by asking for o without it (output_norm
    False) and fusing the norm into its next kernel; False where the step's kernel normalises o itself, or the
    reference runs."""
    backend = resolve_backend(backend)
    if _fused_variant("kda_decode_fused", backend, variant) != "gpu_triton":
        return False
    return leaves_norm(batch, heads, value_dim, dtype, interpret=variants.interpreted(backend))


def kda_verify_fused(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    f_BTHK,
    b_BTH,
    gate_BTHV,
    conv_window_BW3HK,
    state_BHKV,
    weights: reference.DecodeWeights,
    *,
    real_BT=None,
    scale=None,
    lower_bound: float | None,
    eps: float,
    output_norm: bool = True,
    backend: str = "auto",
    variant: str | None = None,
):
    """`kda_decode_fused` over T tokens a row (a speculative verify pass: T = drafts + 1, a few): (o [B, T, H, V] in
    v's dtype, the conv window [B, T, W, 3, H, K] and state [B, T, H, K, V] fp32 after each token); the arrays and
    keywords are `reference.kda_verify_fused`'s (real_BT: the padding mask, None for none; output_norm as in
    `kda_decode_fused`).

    One kernel on a GPU ("gpu_triton": each program walks the T tokens with its state columns on chip); the
    reference elsewhere. backend, variant: as for `kda_decode_fused` (variant: a name of VARIANTS["kda_verify_fused"]).
    """
    args = (q_BTHK, k_BTHK, v_BTHV, f_BTHK, b_BTH, gate_BTHV, conv_window_BW3HK, state_BHKV, weights)
    keywords = dict(real_BT=real_BT, scale=scale, lower_bound=lower_bound, eps=eps, output_norm=output_norm)
    return _fused_op("kda_verify_fused", args, keywords, backend, variant)


def chunk_variant(backend: str, gate_lower_bound: float | None = None, variant: str | None = None) -> str:
    """The chunk_kda variant that runs on `backend` (resolved or not) for gates >= gate_lower_bound (None: of any
    size): `variant` when named, else the platform's bounded kernel when the bound suits it, its any-gate kernel
    otherwise, the reference on a CPU. A bounded kernel named with a bound below its floor is refused."""
    backend = resolve_backend(backend)
    bounded = variants.by_platform(backend, _BOUNDED)
    default = (
        bounded if VARIANTS["chunk_kda"][bounded].supports(gate_lower_bound) else _ANY_GATE[KERNEL_TARGET[backend]]
    )
    name = variants.pick(VARIANTS, "chunk_kda", variant, backend, default)
    chosen = VARIANTS["chunk_kda"][name]
    if gate_lower_bound is not None and not chosen.supports(gate_lower_bound):
        raise ValueError(
            f"variant {name!r} of chunk_kda takes log-decays >= {GATE_FLOOR}, but the gates are only bounded by "
            f"{gate_lower_bound}: use {_ANY_GATE[chosen.platform]!r}"
        )
    return name


def _with_zero_columns(v, columns: int):
    """v [B, T, H, V] as [0 | v]: `columns` zero value columns first (`segments`' transition columns)."""
    return jnp.concatenate([jnp.zeros((*v.shape[:-1], columns), v.dtype), v], axis=-1) if columns else v


def _chunk_kda_reference(
    q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, name, interpret, identity_columns
):
    return _chunk_reference(
        q,
        k,
        _with_zero_columns(v, identity_columns),
        g,
        beta,
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )


def _chunk_kda_variant(
    q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, name, interpret, identity_columns
):
    """Variant `name` on the values [0_identity_columns | v]: every GPU variant (`chunk_kda_gpu` with its phase 1)
    takes the zero columns itself, forming none of them in phase 1; the others are given them."""
    statics = (scale, use_qk_l2norm, chunk_size, name, interpret, identity_columns)
    if name == REFERENCE:
        return _chunk_kda_reference(q, k, v, g, beta, initial_state, *statics)
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret)
    if VARIANTS["chunk_kda"][name].platform == "gpu":
        options["identity_columns"] = identity_columns
    else:
        v = _with_zero_columns(v, identity_columns)
    return kernel("chunk_kda", name)(q, k, v, g, beta, initial_state, **options)


_chunk_kda = with_reference_vjp(_chunk_kda_variant, _chunk_kda_reference, nondiff_argnums=(6, 7, 8, 9, 10, 11))


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    use_qk_l2norm=True,
    chunk_size=64,
    gate_lower_bound: float | None = None,
    backend: str = "auto",
    variant: str | None = None,
    segments: int | None = 1,
):
    """Chunked KDA over a whole sequence: (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32).

    q, k [B, T, H, K], v [B, T, H, V] (bf16 or fp32); g [B, T, H, K] fp32 log-decay (<= 0); beta [B, T, H];
    initial_state [B, H, K, V] or None. Any T. chunk_size is the reference's chunk; the GPU kernels work in
    64-token chunks of 16-row sub-blocks and the TPU kernels in 16-token chunks, where no exponential can
    overflow fp32. gate_lower_bound: a bound the caller guarantees, every g >= it (the safe gate's
    kda_lower_bound), None for none: the faster bounded kernels run only when it is >= GATE_FLOOR (-5),
    the any-gate ones otherwise (`chunk_variant`). variant: a name of VARIANTS["chunk_kda"], None for that
    choice. segments: each sequence split into this many pieces run as a batch, then combined
    (`pallas_kernels.kda.segments`: fills a GPU's SMs when B x H is small); 1 unsplit, None by
    `segments.segment_count`'s rule (on a GPU only, for few sequence-heads and long T).
    Differentiable: the backward pass is the autodiff of the jnp chunked reference (recomputed from the
    inputs), whichever variant ran the forward.
    """
    backend = resolve_backend(backend)
    name = chunk_variant(backend, gate_lower_bound, variant)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, length, heads, key_dim = q.shape
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, key_dim, v.shape[3]), jnp.float32)
    if segments is None:
        segments = segment_count(batch, heads, length, device_cores(backend), key_dim + v.shape[3])
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"chunk_kda: segments must be a positive int or None (the rule), got {segments!r}")

    def chunk(q, k, v, g, beta, initial_state, identity_columns=0):
        statics = (scale, use_qk_l2norm, chunk_size, name, variants.interpreted(backend), identity_columns)
        return _chunk_kda(q, k, v, g, beta, initial_state, *statics)

    if segments == 1:
        return chunk(q, k, v, g, beta, initial_state.astype(jnp.float32))
    last_step = combine_reference
    if VARIANTS["chunk_kda"][name].platform == "gpu" and combine.takes(key_dim, v.shape[3]):
        kernel_combine = functools.partial(combine.combine_segments_gpu, interpret=variants.interpreted(backend))
        last_step = with_reference_vjp(kernel_combine, combine_reference)
    return segmented_chunk_kda(chunk, q, k, v, g, beta, initial_state.astype(jnp.float32), segments, last_step)
