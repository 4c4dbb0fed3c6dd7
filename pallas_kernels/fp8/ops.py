"""Block-FP8 linear maps: `fp8_linear` (y = x @ W^T for a block-FP8 weight W), weight-only or W8A8, over the
variants of each (`weight_only_linear`, `w8a8_linear`).

VARIANTS lists every implementation by op and name, each record with the weights and activations it `takes`;
`kernel(op, name)` gives one's entry point (with its tiles override, for tests and benchmarks). Without a variant named,
a GPU backend runs a kernel where it takes the weight (`kernel_takes`: 2-D, power-of-two scale blocks of at least 16
rows and 32 inputs, a 16- or 32-bit float activation): for weight-only products of up to tuned.GEMV_DEFAULT_ROWS rows
and (16-bit x) from tuned.GEMV_DOT_ROWS to tuned.GEMV_DOT_DEFAULT_ROWS (`tuned.gemv_by_default`) the decode-shaped
"gpu_triton_gemv", else the block-scaled "gpu_triton"; for W8A8 products the Mosaic GPU kernels (TMA, e4m3 wgmma) from
tuned.MOSAIC_MIN_ROWS rows where they take the weight (128 x 128 blocks): "gpu_mosaic_ws" (persistent, warp-specialised,
128-row tiles) from tuned.MOSAIC_WS_MIN_ROWS rows and K = tuned.MOSAIC_WS_MIN_K, "gpu_mosaic" (a CTA per 64-row output
tile) below; else "gpu_triton_tc_acc" (each K block accumulated in the tensor cores). A TPU backend runs every product
weight-only, in "tpu_mosaic" (the FP8 tile dequantised in VMEM, bf16 MXU products). Every other case runs the jnp
reference. The lab's variants (`pallas_kernels.experimental.fp8_*`: a Mosaic GPU weight-only kernel, the XLA scale-
folded products) join VARIANTS when their module is imported, and run only when named.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from pallas_kernels import variants
from pallas_kernels.backend import KERNEL_TARGET, resolve_backend, with_reference_vjp
from pallas_kernels.fp8 import tuned
from pallas_kernels.fp8.gpu_mosaic import takes as mosaic_takes
from pallas_kernels.fp8.gpu_mosaic import w8a8_linear_mgpu
from pallas_kernels.fp8.gpu_mosaic_ws import takes as mosaic_ws_takes
from pallas_kernels.fp8.gpu_mosaic_ws import w8a8_linear_ws_mgpu
from pallas_kernels.fp8.gpu_triton import (
    w8a8_linear_gpu,
    w8a8_linear_tc_acc_gpu,
    weight_only_gemv_gpu,
    weight_only_gemv_many_gpu,
    weight_only_gemv_partials_gpu,
    weight_only_linear_gpu,
)
from pallas_kernels.fp8.reference import (
    GatedHeadNorm,
    gated_head_norm,
    w8a8_linear_reference,
    weight_only_linear_reference,
)
from pallas_kernels.fp8.tpu_mosaic import takes as tpu_kernel_takes
from pallas_kernels.fp8.tpu_mosaic import weight_only_linear_tpu
from pallas_kernels.variants import REFERENCE, Variant

__all__ = [
    "GEMV",
    "MODES",
    "MOSAIC",
    "MOSAIC_WS",
    "TC_ACC",
    "VARIANTS",
    "W8A8",
    "WEIGHT_ONLY",
    "fp8_linear",
    "fp8_linear_many",
    "fp8_linear_partials",
    "kernel",
]

WEIGHT_ONLY = "weight_only"
W8A8 = "w8a8"
MODES = (WEIGHT_ONLY, W8A8)
_OP_OF_MODE = {WEIGHT_ONLY: "weight_only_linear", W8A8: "w8a8_linear"}
GEMV = "gpu_triton_gemv"
TC_ACC = "gpu_triton_tc_acc"
MOSAIC = "gpu_mosaic"
MOSAIC_WS = "gpu_mosaic_ws"


def _power_of_two(n: int, at_least: int) -> bool:
    return n >= at_least and n & (n - 1) == 0


def kernel_takes(x, weight) -> bool:
    """Whether the GPU Triton kernels run this product (their records' `takes`): a 2-D weight with power-of-two
    scale blocks of >= 16 rows and >= 32 inputs (the FP8 dot's K), and a bf16, fp16 or fp32 activation."""
    block_rows, block_cols = weight.block
    return (
        weight.values.ndim == 2
        and _power_of_two(block_rows, 16)
        and _power_of_two(block_cols, 32)
        and jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    )


VARIANTS = {
    "weight_only_linear": {
        REFERENCE: Variant(None, weight_only_linear_reference),
        "gpu_triton": Variant("gpu", weight_only_linear_gpu, takes=kernel_takes),
        GEMV: Variant("gpu", weight_only_gemv_gpu, takes=kernel_takes),
        "tpu_mosaic": Variant("tpu", weight_only_linear_tpu, takes=tpu_kernel_takes),
    },
    "w8a8_linear": {
        REFERENCE: Variant(None, w8a8_linear_reference),
        "gpu_triton": Variant("gpu", w8a8_linear_gpu, takes=kernel_takes),
        TC_ACC: Variant("gpu", w8a8_linear_tc_acc_gpu, takes=kernel_takes),
        MOSAIC: Variant("gpu", w8a8_linear_mgpu, takes=mosaic_takes),
        MOSAIC_WS: Variant("gpu", w8a8_linear_ws_mgpu, takes=mosaic_ws_takes),
    },
}


def kernel(op: str, name: str):
    """The entry point of variant `name` of `op` ("weight_only_linear" or "w8a8_linear")."""
    return variants.lookup(VARIANTS, op, name).kernel


def _straight_through(x_MK, values_NK, scales, block, interpret):
    return weight_only_linear_reference(x_MK, values_NK, scales, block)


@functools.cache
def _differentiable(op: str, name: str):
    """Kernel variant `name` of `op` as f(x, values, scales, block, interpret), differentiated as
    dequantise-then-dot (straight through W8A8's quantisation)."""
    entry = kernel(op, name)
    return with_reference_vjp(
        lambda x_MK, values_NK, scales, block, interpret: entry(
            x_MK, values_NK, scales, block=block, interpret=interpret
        ),
        _straight_through,
        nondiff_argnums=(3, 4),
    )


def default_mode(num_rows: int, backend: str) -> str | None:
    """The kernel a GPU backend runs for num_rows rows when no mode is named: weight-only up to
    tuned.WEIGHT_ONLY_MAX_ROWS rows, W8A8 from tuned.W8A8_MIN_ROWS (None: never); None means dequantise-then-dot
    (the weight-only reference, XLA's dot), as on every other backend but a TPU's, which is always weight-only
    (v5e / v6e have no FP8 matrix unit)."""
    if KERNEL_TARGET.get(backend) == "tpu":
        return WEIGHT_ONLY
    if KERNEL_TARGET.get(backend) != "gpu":
        return None
    if num_rows <= tuned.WEIGHT_ONLY_MAX_ROWS:
        return WEIGHT_ONLY
    return W8A8 if tuned.W8A8_MIN_ROWS is not None and num_rows >= tuned.W8A8_MIN_ROWS else None


def _w8a8_variant(x_MK, weight, *, interpret: bool) -> str:
    """The W8A8 kernel a GPU runs: from tuned.MOSAIC_MIN_ROWS rows where they take the weight (128 x 128 blocks, sides
    multiples of 128) and compile (jax 0.10's Mosaic GPU interpreter cannot run them) "gpu_mosaic_ws" from
    tuned.MOSAIC_WS_MIN_ROWS rows and K = tuned.MOSAIC_WS_MIN_K, "gpu_mosaic" below; else "gpu_triton_tc_acc"."""
    mosaic = VARIANTS["w8a8_linear"][MOSAIC]
    if interpret or x_MK.shape[0] < tuned.MOSAIC_MIN_ROWS or not mosaic.supports(x_MK, weight):
        return TC_ACC
    num_rows, k_dim = x_MK.shape
    at_ws_size = num_rows >= tuned.MOSAIC_WS_MIN_ROWS and k_dim >= tuned.MOSAIC_WS_MIN_K
    if at_ws_size and VARIANTS["w8a8_linear"][MOSAIC_WS].supports(x_MK, weight):
        return MOSAIC_WS
    return MOSAIC


def fp8_linear(x, weight, *, backend: str = "auto", mode: str | None = None, variant: str | None = None):
    """y [..., O] in x's dtype: x [..., In] @ W^T for a block-FP8 weight W [O, In] (anything with `values` [O, In]
    float8_e4m3fn, `scales` [ceil(O / br), ceil(In / bc)] and `block` (br, bc): `ling_jax.quantized.
    BlockFP8Weight`); fp32 accumulation.

    mode: "weight_only" (W dequantised, products in x's dtype; on a GPU past tuned.WEIGHT_ONLY_MAX_ROWS rows by
    dequantise-then-dot unless a variant is named), "w8a8" (x quantised per token in 1 x bc groups,
    FP8 products: `reference` states both), or None: the backend's choice (`default_mode`: by the row count on
    a GPU backend, dequantise-then-dot elsewhere). backend: "auto" (the GPU kernels on a GPU, the reference
    elsewhere), "reference", "pallas_gpu", "interpret_gpu", "pallas_tpu", "interpret_tpu" (weight-only: the
    "tpu_mosaic" kernel where its record takes the weight; W8A8 runs the reference). variant: a
    name of the mode's op in VARIANTS, None: the module docstring's choice. Differentiable in x, as dequantise-then-dot.
    """
    backend = resolve_backend(backend)
    x_MK = x.reshape(-1, x.shape[-1])
    if mode is not None and mode not in MODES:
        raise ValueError(f"fp8_linear mode must be one of {MODES} or None, got {mode!r}")
    chosen = default_mode(x_MK.shape[0], backend) if mode is None else mode
    op = _OP_OF_MODE[chosen or WEIGHT_ONLY]
    platform_kernel = VARIANTS["weight_only_linear"][
        "tpu_mosaic" if KERNEL_TARGET.get(backend) == "tpu" else "gpu_triton"
    ]
    # weight-only past the kernels' decode sizes on a GPU: dequantise + XLA's dot (the same products, 6x faster than
    # the block-scaled kernel at 8192 rows of 8192 x 4096 on the H200: docs/benchmarks/matmul.md)
    prefill_weight_only = KERNEL_TARGET.get(backend) == "gpu" and x_MK.shape[0] > tuned.WEIGHT_ONLY_MAX_ROWS
    use_kernel = (
        chosen is not None
        and platform_kernel.supports(x, weight)
        and not (chosen == WEIGHT_ONLY and prefill_weight_only)
    )
    if chosen == W8A8:
        gpu_variant = _w8a8_variant(x_MK, weight, interpret=variants.interpreted(backend))
    else:
        gpu_variant = GEMV if tuned.gemv_by_default(x_MK.shape[0], x.dtype) else "gpu_triton"
    kernels = {"gpu": gpu_variant, "tpu": "tpu_mosaic" if chosen == WEIGHT_ONLY else REFERENCE}
    default = variants.by_platform(backend, kernels) if use_kernel else REFERENCE
    name = variants.pick(VARIANTS, op, variant, backend, default)
    block, scales = tuple(weight.block), weight.scales.astype(jnp.float32)
    if name == REFERENCE:
        y_MN = kernel(op, REFERENCE)(x_MK, weight.values, scales, block)
    else:
        y_MN = _differentiable(op, name)(x_MK, weight.values, scales, block, variants.interpreted(backend))
    return y_MN.reshape(*x.shape[:-1], y_MN.shape[-1])


def _gemv_runs(x, weight, resolved: str, mode: str | None) -> bool:
    """Whether `fp8_linear` (no variant named) runs the decode-shaped weight-only kernel "gpu_triton_gemv" for x
    and weight on the resolved backend: a GPU, weight-only, rows `tuned.gemv_by_default` gives it, a weight it takes."""
    num_rows = x.size // x.shape[-1]
    chosen = default_mode(num_rows, resolved) if mode is None else mode
    return (
        KERNEL_TARGET.get(resolved) == "gpu"
        and chosen == WEIGHT_ONLY
        and tuned.gemv_by_default(num_rows, x.dtype)
        and VARIANTS["weight_only_linear"][GEMV].supports(x, weight)
    )


def _first_partial(x_MK, values_NK, scales, norm, block, interpret):
    """The partial sums' reference: the whole product (of x normalised where norm is given) in the first, zeros in
    the others (their sum is the product, and a sum's cotangent is the same for every partial, so this
    differentiates as the product)."""
    splits = jax.eval_shape(
        lambda: weight_only_gemv_partials_gpu(x_MK, values_NK, scales, block=block, interpret=interpret)
    ).shape[0]
    x_MK = x_MK if norm is None else gated_head_norm(x_MK, norm)
    y_1MN = weight_only_linear_reference(x_MK, values_NK, scales, block).astype(jnp.float32)[None]
    return jnp.concatenate([y_1MN, jnp.zeros((splits - 1, *y_1MN.shape[1:]), jnp.float32)])


_gemv_partials = with_reference_vjp(
    lambda x_MK, values_NK, scales, norm, block, interpret: weight_only_gemv_partials_gpu(
        x_MK, values_NK, scales, block=block, interpret=interpret, norm=norm
    ),
    _first_partial,
    nondiff_argnums=(4, 5),
)


def fp8_linear_partials(
    x, weight, *, backend: str = "auto", mode: str | None = None, norm: GatedHeadNorm | None = None
) -> jax.Array | None:
    """Where `fp8_linear(x, weight, backend=backend, mode=mode)` runs the decode-shaped gemv ("gpu_triton_gemv"),
    its fp32 partial sums [splits, M, O] over K, unreduced (`weight_only_gemv_partials_gpu`: their jnp.sum over the
    first axis, cast to x's dtype, is fp8_linear's y [M, O], x's rows flattened), for the next kernel to add
    (`pallas_kernels.norm.add_partials_rms_norm`); None everywhere else. norm: the product's x is
    `reference.gated_head_norm(x, norm)` (norm.gate shaped like x), formed in the gemv as it reads x where heads are
    whole K blocks of the weight, else by XLA before it. Differentiable in x (and the norm's gate and weight), as the
    product."""
    resolved = resolve_backend(backend)
    if not _gemv_runs(x, weight, resolved, mode):
        return None
    x_MK = x.reshape(-1, x.shape[-1])
    if norm is not None:
        norm = dataclasses.replace(norm, gate=norm.gate.reshape(x_MK.shape))
        if norm.weight_D.shape[0] % weight.block[1]:
            x_MK, norm = gated_head_norm(x_MK, norm), None
    scales = weight.scales.astype(jnp.float32)
    return _gemv_partials(x_MK, weight.values, scales, norm, tuple(weight.block), variants.interpreted(resolved))


def _many_reference(x_MK, values, scales, blocks, interpret):
    return tuple(weight_only_linear_reference(x_MK, v, s, b) for v, s, b in zip(values, scales, blocks))


_grouped_gemv = with_reference_vjp(
    lambda x_MK, values, scales, blocks, interpret: weight_only_gemv_many_gpu(
        x_MK, values, scales, blocks=blocks, interpret=interpret
    ),
    _many_reference,
    nondiff_argnums=(3, 4),
)


def _join_key(x, weight, resolved: str, mode: str | None):
    """What a W8A8 product on a GPU must share with others of x to join them (`fp8_linear_many`): the weight's
    block, K and dtypes, for a dataclass weight at most tuned.JOIN_MAX_OUTPUTS wide in whole row blocks (so each
    keeps its own scales); None where it runs alone."""
    num_rows = x.size // x.shape[-1]
    chosen = default_mode(num_rows, resolved) if mode is None else mode
    out_dim = weight.values.shape[0]
    joins = (
        KERNEL_TARGET.get(resolved) == "gpu"
        and chosen == W8A8
        and dataclasses.is_dataclass(weight)
        and weight.values.ndim == 2
        and out_dim <= tuned.JOIN_MAX_OUTPUTS
        and out_dim % weight.block[0] == 0
    )
    return (tuple(weight.block), weight.values.shape[1], weight.values.dtype, weight.scales.dtype) if joins else None


def _joined_products(x, weights, backend: str, mode: str | None) -> list:
    """`fp8_linear_many` outside the grouped gemv: the narrow W8A8 products of one `_join_key` as one product on
    their weights joined by rows, its output split back (each column the same arithmetic as its product alone);
    every other weight `fp8_linear`'s."""
    resolved = resolve_backend(backend)
    by_key: dict = {}
    for i, weight in enumerate(weights):
        by_key.setdefault(_join_key(x, weight, resolved, mode), []).append(i)
    ys = {}
    for key, members in by_key.items():
        if key is None or len(members) == 1:
            ys.update((i, fp8_linear(x, weights[i], backend=backend, mode=mode)) for i in members)
            continue
        parts = [weights[i] for i in members]
        joined = dataclasses.replace(
            parts[0],
            values=jnp.concatenate([w.values for w in parts]),
            scales=jnp.concatenate([w.scales for w in parts]),
        )
        y = fp8_linear(x, joined, backend=backend, mode=mode)
        starts = itertools.accumulate((w.values.shape[0] for w in parts[:-1]), initial=0)
        ys.update((i, y[..., s : s + w.values.shape[0]]) for i, s, w in zip(members, starts, parts, strict=True))
    return [ys[i] for i in range(len(weights))]


def fp8_linear_many(x, weights, *, backend: str = "auto", mode: str | None = None) -> list:
    """[fp8_linear(x, W, backend=backend, mode=mode) for W in weights], the weights sharing x (a layer's input
    projections). Where each of them would run the decode-shaped weight-only kernel ("gpu_triton_gemv": a GPU
    backend, rows `tuned.gemv_by_default` gives it, weight-only) and they share the scale block's K size, one launch
    computes them all (`weight_only_gemv_many_gpu`: each product as the single-weight kernel's within fp32
    rounding); W8A8 products on a GPU at most tuned.JOIN_MAX_OUTPUTS wide run as one product of their weights
    joined (`_joined_products`); every other case runs `fp8_linear` per weight. Differentiable in x, as
    dequantise-then-dot."""
    resolved = resolve_backend(backend)
    x_MK = x.reshape(-1, x.shape[-1])
    grouped = (
        len(weights) > 1
        and all(_gemv_runs(x, w, resolved, mode) for w in weights)
        and len({w.block[1] for w in weights}) == 1
    )
    if not grouped:
        return _joined_products(x, weights, backend, mode)
    ys = _grouped_gemv(
        x_MK,
        tuple(w.values for w in weights),
        tuple(w.scales.astype(jnp.float32) for w in weights),
        tuple(tuple(w.block) for w in weights),
        variants.interpreted(resolved),
    )
    return [y_MN.reshape(*x.shape[:-1], y_MN.shape[-1]) for y_MN in ys]
