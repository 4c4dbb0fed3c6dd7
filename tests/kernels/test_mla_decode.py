"""MLA decode kernels (GPU and TPU, Pallas interpret mode on the CPU) against a float64 softmax attention;
TPU and GPU lowering from the CPU (the model's decode with the kernel: test_model_kernels.py; compiled: here).

The Mosaic GPU (Hopper) kernel runs in Mosaic GPU interpret mode only on jax >= 0.11: jax 0.10's interpreter
cannot read a transposed shared-memory wgmma operand, so there those tests are skipped with that reason (the
CUDA lowering test runs on both versions, and the compiled kernel is tested on the GPU with `pytest -m gpu`)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_test, lower_for_cuda, rel_error

from ling_jax import LingConfig, LingForCausalLM
from ling_jax.mla import EXPANDED
from ling_jax.presets import TINY
from pallas_kernels.mla import mla_decode, mla_decode_paged, mla_decode_tokens
from pallas_kernels.mla.gpu_triton.decode import combine_splits_gpu
from pallas_kernels.mla.ops import kernel
from pallas_kernels.mla.reference import combine_splits, mla_decode_tokens_reference
from pallas_kernels.mla.tuned import DECODE_MOSAIC, DECODE_TRITON, MOSAIC_MIN_SLOTS, DecodeTpuTiles
from pallas_kernels.tuning import lookup

mla_decode_gpu, mla_decode_tpu = kernel("mla_decode", "gpu_triton"), kernel("mla_decode", "tpu_mosaic")
mla_decode_mgpu, mla_decode_paged_mgpu = kernel("mla_decode", "gpu_mosaic"), kernel("mla_decode_paged", "gpu_mosaic")

LATENT, ROPE = 512, 64
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def float64_attention(q_latent, q_rope, cache, lengths, scale):
    """Plain softmax over the first lengths[b] slots, in float64, from the (rounded) inputs."""
    q = np.concatenate([q_latent, q_rope], axis=-1).astype(np.float64)  # [B, H, R+P]
    cache = cache.astype(np.float64)
    out = np.zeros(q_latent.shape, np.float64)
    for b, length in enumerate(lengths):
        keys = cache[b, :length]  # [n, R+P]
        scores = scale * q[b] @ keys.T
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[b] = probs @ keys[:, :LATENT]
    return out


def random_case(heads, max_len, dtype, seed):
    r = np.random.default_rng(seed)
    batch = 3
    lengths = np.array([1, max(1, max_len // 2 + 1), max_len])[:batch]
    q_latent = (r.normal(size=(batch, heads, LATENT)) * 0.2).astype(np.float32)
    q_rope = r.normal(size=(batch, heads, ROPE)).astype(np.float32)
    cache = r.normal(size=(batch, max_len, LATENT + ROPE)).astype(np.float32)
    rounded = [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q_latent, q_rope, cache)]
    return rounded, lengths


KERNELS = {
    "gpu": functools.partial(mla_decode_gpu, interpret=True),
    "tpu": functools.partial(mla_decode_tpu, interpret=True, tiles=DecodeTpuTiles(block_k=128, num_splits=2)),
}


# (heads, max_len): each head count (one, a few, Ling's 64) and cache size (one slot, one partial block, several
# blocks and a tail) with both ends of the other; every case's rows hold 1, max_len // 2 + 1 and max_len slots
INTERPRET_SHAPES = [(1, 1), (4, 17), (64, 17), (1, 300), (64, 300)]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("heads, max_len", INTERPRET_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_float64_attention(kernel, heads, max_len, dtype):
    (q_latent, q_rope, cache), lengths = random_case(heads, max_len, dtype, seed=heads * 1000 + max_len)
    scale = 1 / np.sqrt(192)
    ref = float64_attention(q_latent, q_rope, cache, lengths, scale)
    out = KERNELS[kernel](
        jnp.asarray(q_latent, dtype),
        jnp.asarray(q_rope, dtype),
        jnp.asarray(cache, dtype),
        jnp.asarray(lengths, jnp.int32),
        scale=scale,
    )
    assert out.shape == ref.shape and out.dtype == jnp.float32
    err = rel_error(out, ref)
    assert err <= TOL[dtype], f"{kernel} H={heads} L={max_len} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernel needs a GPU; it runs on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("heads", [1, 4, 64])
@pytest.mark.parametrize(
    "max_len, dtype",
    [(1, jnp.bfloat16), (17, jnp.bfloat16), (300, jnp.bfloat16), (40000, jnp.bfloat16), (40000, jnp.float32)],
    ids=["1-bf16", "17-bf16", "300-bf16", "40000-bf16", "40000-fp32"],
)  # fp32 at the longest length only: its short cases repeated the bf16 ones (docs/testing.md, the GPU suite)
def test_compiled_gpu_kernel_matches_float64_attention(heads, max_len, dtype):
    (q_latent, q_rope, cache), lengths = random_case(heads, max_len, dtype, seed=heads + max_len)
    scale = 1 / np.sqrt(192)
    out = mla_decode_gpu(
        jnp.asarray(q_latent, dtype),
        jnp.asarray(q_rope, dtype),
        jnp.asarray(cache, dtype),
        jnp.asarray(lengths, jnp.int32),
        scale=scale,
    )
    err = rel_error(out, float64_attention(q_latent, q_rope, cache, lengths, scale))
    assert err <= TOL[dtype], f"compiled GPU kernel H={heads} L={max_len}: rel. error {err:.2e}"


@pytest.mark.parametrize("backend", ["interpret_gpu", "interpret_tpu", "interpret", "reference"])
def test_dispatcher_and_many_splits(backend):
    (q_latent, q_rope, cache), lengths = random_case(8, 300, jnp.float32, seed=5)
    ref = float64_attention(q_latent, q_rope, cache, lengths, 0.05)
    out = mla_decode(
        *(jnp.asarray(x) for x in (q_latent, q_rope, cache)), jnp.asarray(lengths), scale=0.05, backend=backend
    )
    assert rel_error(out, ref) <= 1e-4
    split = mla_decode_gpu(
        *(jnp.asarray(x) for x in (q_latent, q_rope, cache)),
        jnp.asarray(lengths),
        scale=0.05,
        num_splits=7,
        tiles=dataclasses.replace(lookup(DECODE_TRITON, dtype=jnp.float32), block_k=16),
        interpret=True,
    )
    assert rel_error(split, ref) <= 1e-4


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        mla_decode(
            jnp.zeros((1, 1, LATENT)),
            jnp.zeros((1, 1, ROPE)),
            jnp.zeros((1, 4, LATENT + ROPE)),
            jnp.ones((1,), jnp.int32),
            scale=1.0,
            backend="cuda",
        )


def _abstract_args(batch=2, heads=64, max_len=1024):
    return (
        jax.ShapeDtypeStruct((batch, heads, LATENT), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, heads, ROPE), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_len, LATENT + ROPE), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


@pytest.mark.parametrize("max_len", [1024, 1000])
def test_tpu_kernel_lowers_for_tpu(max_len):
    lowered = (
        jax.jit(functools.partial(mla_decode_tpu, scale=0.07))
        .trace(*_abstract_args(max_len=max_len))
        .lower(lowering_platforms=("tpu",))
    )
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize("batch, max_len", [(2, 1024), (64, 32768)])
def test_gpu_kernel_lowers_for_cuda(batch, max_len):
    lowered = lower_for_cuda(
        functools.partial(mla_decode_gpu, scale=0.07), *_abstract_args(batch=batch, max_len=max_len)
    )
    assert "mla_decode_split" in lowered.as_text()


def check_tokens_kernel(tokens, heads, max_len, dtype, backend):
    """T query tokens a row (the MTP verify pass) on the Triton kernel: rows of different lengths, token t one
    slot past token t - 1, a pad token that sees nothing (zeros); against the jnp path over the [B, T, L] mask
    (the model's path before the kernel) and float64."""
    r = np.random.default_rng(tokens * 100 + heads)
    batch = 3
    first_BT = np.array([[1], [max_len // 2], [max_len - tokens + 1]]) + np.arange(tokens)  # the last row: all slots
    lengths_BT = jnp.asarray(first_BT, jnp.int32).at[1, -1].set(0)  # row 1's last token a pad
    q_latent, q_rope = (jnp.asarray(r.normal(size=(batch, tokens, heads, d)) * 0.3, dtype) for d in (LATENT, ROPE))
    cache = jnp.asarray(r.normal(size=(batch, max_len, LATENT + ROPE)), dtype)
    scale = 1 / np.sqrt(192)
    out = mla_decode_tokens(q_latent, q_rope, cache, lengths_BT, scale=scale, backend=backend)
    masked = mla_decode_tokens_reference(q_latent, q_rope, cache, lengths_BT, scale=scale)
    assert out.shape == (batch, tokens, heads, LATENT) and out.dtype == jnp.float32
    assert rel_error(out, masked) <= TOL[dtype] and not np.asarray(out[1, -1]).any()
    f32 = [np.asarray(x.astype(jnp.float32)) for x in (q_latent, q_rope, cache)]
    for t in range(tokens):
        lengths = np.maximum(np.asarray(lengths_BT[:, t]), 1)  # float64_attention needs a key: the pad row skipped
        ref = float64_attention(f32[0][:, t], f32[1][:, t], f32[2], lengths, scale)
        rows = [0, 2] if t == tokens - 1 else [0, 1, 2]
        assert rel_error(np.asarray(out[rows, t]), ref[rows]) <= TOL[dtype]


@pytest.mark.parametrize("tokens, heads, max_len", [(2, 5, 37), (3, 4, 300)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_tokens_kernel_matches_the_masked_reference(tokens, heads, max_len, dtype):
    """Interpreted, at odd sizes: heads not filling the 16-head block (padded heads see no slot)."""
    check_tokens_kernel(tokens, heads, max_len, dtype, "interpret_gpu")


@gpu_test("the compiled Triton kernel for a few tokens a row")
@pytest.mark.parametrize("tokens, heads", [(2, 64), (3, 32)])
def test_compiled_tokens_kernel_matches_the_masked_reference(tokens, heads):
    """Ling's head counts at a 40,000-slot cache: 2 tokens of 64 heads (two 64-head blocks), 3 of 32."""
    check_tokens_kernel(tokens, heads, 40000, jnp.bfloat16, "pallas_gpu")


def test_tokens_kernel_lowers_for_cuda():
    """Ling's 64 heads, 2 tokens: one Triton program per (64-head block, split, row), the lengths per head."""
    batch, tokens, heads, max_len = 2, 2, 64, 4096
    args = (
        jax.ShapeDtypeStruct((batch, tokens, heads, LATENT), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, tokens, heads, ROPE), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_len, LATENT + ROPE), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, tokens), jnp.int32),
    )
    text = lower_for_cuda(functools.partial(kernel("mla_decode_tokens", "gpu_triton"), scale=0.07), *args).as_text()
    assert "mla_decode_split" in text and "mla_combine_splits" in text


def test_split_combine_kernel_equals_the_reference():
    """Splits not a power of two, splits that saw no key (lse -inf) and a sequence with none at all (zeros)."""
    r = np.random.default_rng(0)
    o_BSHR = jnp.asarray(r.normal(size=(3, 5, 4, 256)), jnp.float32)
    lse_BSH = np.asarray(r.normal(size=(3, 5, 4)) * 3, np.float32)
    lse_BSH[0, 1:3] = -np.inf
    lse_BSH[2] = -np.inf
    got = combine_splits_gpu(o_BSHR, jnp.asarray(lse_BSH), interpret=True)
    assert rel_error(got, combine_splits(o_BSHR, jnp.asarray(lse_BSH))) <= 1e-6
    assert not np.asarray(got[2]).any()


def test_gpu_kernel_blocks_no_more_heads_than_a_model_has():
    """Ling-3.0-flash's 32 heads at one decode token: one 32-head block (the table's 64 would compute and write 32
    padded heads), so the query goes in unpadded and the fp32 partial outputs are [1, splits, 32, 512]."""
    text = lower_for_cuda(functools.partial(mla_decode_gpu, scale=0.07), *_abstract_args(1, 32, 8192)).as_text()
    assert "_pad" not in text and re.search(r"tensor<1x\d+x32x512xf32>", text)


MGPU_INTERPRET_OK = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
needs_mgpu_interpreter = pytest.mark.skipif(
    not MGPU_INTERPRET_OK,
    reason=f"jax {jax.__version__}'s Mosaic GPU interpreter cannot run transposed wgmma "
    "operands (jax >= 0.11 can); the kernel's CUDA lowering is still tested here and the compiled kernel on the GPU",
)


@needs_mgpu_interpreter
@pytest.mark.parametrize("heads", [1, 4, 64])
@pytest.mark.parametrize("max_len", [1, 17, 300])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_mosaic_kernel_matches_float64_attention(heads, max_len, dtype):
    (q_latent, q_rope, cache), lengths = random_case(heads, max_len, dtype, seed=heads * 7 + max_len)
    scale = 1 / np.sqrt(192)
    out = mla_decode_mgpu(
        jnp.asarray(q_latent, dtype),
        jnp.asarray(q_rope, dtype),
        jnp.asarray(cache, dtype),
        jnp.asarray(lengths, jnp.int32),
        scale=scale,
        num_splits=2,
        interpret=True,
    )
    err = rel_error(out, float64_attention(q_latent, q_rope, cache, lengths, scale))
    assert out.shape == (3, heads, LATENT) and err <= TOL[jnp.bfloat16], f"H={heads} L={max_len}: {err:.2e}"


@needs_mgpu_interpreter
def test_mosaic_kernel_many_splits_and_empty_ones():
    """Splits of one 64-slot tile, splits past a sequence's length (no tile: zero weight in the combine)."""
    (q_latent, q_rope, cache), lengths = random_case(8, 300, jnp.bfloat16, seed=11)
    ref = float64_attention(q_latent, q_rope, cache, lengths, 0.05)
    out = mla_decode_mgpu(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q_latent, q_rope, cache)),
        jnp.asarray(lengths),
        scale=0.05,
        num_splits=5,
        interpret=True,
    )
    assert rel_error(out, ref) <= 2e-2


def test_mosaic_kernel_refuses_what_it_cannot_run():
    args = [jnp.zeros(x.shape, x.dtype) for x in _abstract_args(batch=1, max_len=64)]
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mla_decode_mgpu(*args[:2], args[2].astype(jnp.float32), args[3], scale=1.0)
    with pytest.raises(ValueError, match="block_k"):
        mla_decode_mgpu(
            *args, scale=1.0, tiles=dataclasses.replace(lookup(DECODE_MOSAIC, dtype=args[2].dtype), block_k=32)
        )


@pytest.mark.parametrize("batch, max_len", [(2, 1000), (64, 32768)])
def test_mosaic_kernel_lowers_for_cuda(batch, max_len):
    """Layout inference and the shared-memory budget (227 KiB) are checked at lowering."""
    lowered = lower_for_cuda(
        functools.partial(mla_decode_mgpu, scale=0.07), *_abstract_args(batch=batch, max_len=max_len)
    )
    assert "mosaic_gpu" in lowered.as_text()


@gpu_test("the compiled Mosaic GPU kernel (Hopper)")
@pytest.mark.parametrize("heads", [1, 64])
@pytest.mark.parametrize("max_len", [1, 17, 300, 40000])
def test_compiled_mosaic_kernel_matches_float64_attention(heads, max_len):
    (q_latent, q_rope, cache), lengths = random_case(heads, max_len, jnp.bfloat16, seed=heads + max_len)
    scale = 1 / np.sqrt(192)
    out = mla_decode_mgpu(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q_latent, q_rope, cache)), jnp.asarray(lengths, jnp.int32), scale=scale
    )
    err = rel_error(out, float64_attention(q_latent, q_rope, cache, lengths, scale))
    assert err <= TOL[jnp.bfloat16], f"compiled Mosaic GPU kernel H={heads} L={max_len}: rel. error {err:.2e}"


@gpu_test("the compiled Mosaic GPU kernel in the model (Hopper)")
def test_compiled_model_decode_with_mosaic_kernel_equals_expanded_reference():
    """TINY with Ling's latent widths (512 + 64) and a cache of MOSAIC_MIN_SLOTS slots, so that mla_decode picks
    the Mosaic GPU kernel, in bf16."""
    config = LingConfig.from_dict({**TINY, "kv_lora_rank": LATENT, "qk_rope_head_dim": ROPE})
    model = LingForCausalLM(config, rngs=nnx.Rngs(4), dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(6).integers(2, config.vocab_size, (2, 75)))
    logits = {}
    for mode in ("kernel", EXPANDED):
        cache = model(ids[:, :72], cache=model.init_cache(2, MOSAIC_MIN_SLOTS // 2)).cache
        steps = []
        for t in range(72, 75):
            out = model(ids[:, t : t + 1], cache=cache, mla_mode=None if mode == "kernel" else EXPANDED)
            steps.append(out.logits)
            cache = out.cache
        logits[mode] = jnp.concatenate(steps, axis=1)
    assert rel_error(logits["kernel"], logits[EXPANDED]) <= 2e-2


def random_paged_case(heads, page_size, max_pages, dtype, seed):
    """3 sequences over shuffled pages; sequence 1 shares sequence 0's first page (a reused prefix), and the
    table's unused entries are -1. Returns the (rounded) inputs, the table, the lengths and the contiguous
    cache each sequence sees."""
    r = np.random.default_rng(seed)
    batch, num_pages = 3, 3 * max_pages
    table = r.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    table[1, 0] = table[0, 0]
    lengths = np.array([1, page_size + 5, max_pages * page_size], np.int32)
    table[0, 1:] = -1
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    q_latent = rounded(r.normal(size=(batch, heads, LATENT)) * 0.2)
    q_rope = rounded(r.normal(size=(batch, heads, ROPE)))
    pages = rounded(r.normal(size=(num_pages, page_size, LATENT + ROPE)))
    contiguous = pages[np.clip(table, 0, None)].reshape(batch, max_pages * page_size, LATENT + ROPE)
    return (q_latent, q_rope, pages), table, lengths, contiguous


@pytest.mark.parametrize("backend", ["reference", "interpret_gpu", "interpret_tpu"])
def test_paged_decode_matches_float64_attention(backend):
    (q_latent, q_rope, pages), table, lengths, contiguous = random_paged_case(4, 16, 3, jnp.float32, seed=21)
    ref = float64_attention(q_latent, q_rope, contiguous, lengths, 0.06)
    out = mla_decode_paged(
        *(jnp.asarray(x) for x in (q_latent, q_rope, pages)),
        jnp.asarray(table),
        jnp.asarray(lengths),
        scale=0.06,
        backend=backend,
    )
    assert rel_error(out, ref) <= 1e-4


@needs_mgpu_interpreter
@pytest.mark.parametrize("heads, page_size", [(4, 64), (64, 128)])
def test_mosaic_paged_kernel_matches_float64_attention(heads, page_size):
    (q_latent, q_rope, pages), table, lengths, contiguous = random_paged_case(
        heads, page_size, 3, jnp.bfloat16, seed=page_size
    )
    ref = float64_attention(q_latent, q_rope, contiguous, lengths, 0.06)
    out = mla_decode_paged_mgpu(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q_latent, q_rope, pages)),
        jnp.asarray(table),
        jnp.asarray(lengths),
        scale=0.06,
        num_splits=2,
        interpret=True,
    )
    assert rel_error(out, ref) <= 2e-2


def test_mosaic_paged_kernel_refuses_pages_off_the_tile():
    (q_latent, q_rope, pages), table, lengths, _ = random_paged_case(4, 32, 2, jnp.bfloat16, seed=3)
    with pytest.raises(ValueError, match="page size"):
        mla_decode_paged_mgpu(
            *(jnp.asarray(x, jnp.bfloat16) for x in (q_latent, q_rope, pages)),
            jnp.asarray(table),
            jnp.asarray(lengths),
            scale=0.06,
        )


def test_mosaic_paged_kernel_lowers_for_cuda():
    args = (
        jax.ShapeDtypeStruct((64, 64, LATENT), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 64, ROPE), jnp.bfloat16),
        jax.ShapeDtypeStruct((64 * 512, 64, LATENT + ROPE), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 512), jnp.int32),
        jax.ShapeDtypeStruct((64,), jnp.int32),
    )
    lowered = lower_for_cuda(functools.partial(mla_decode_paged_mgpu, scale=0.07), *args)
    assert "mosaic_gpu" in lowered.as_text()


@gpu_test("the compiled paged Mosaic GPU kernel (Hopper)")
@pytest.mark.parametrize("page_size", [64, 256])
def test_compiled_mosaic_paged_kernel_matches_float64_attention(page_size):
    (q_latent, q_rope, pages), table, lengths, contiguous = random_paged_case(
        64, page_size, 40, jnp.bfloat16, seed=page_size
    )
    ref = float64_attention(q_latent, q_rope, contiguous, lengths, 0.06)
    out = mla_decode_paged(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q_latent, q_rope, pages)),
        jnp.asarray(table),
        jnp.asarray(lengths),
        scale=0.06,
    )
    assert rel_error(out, ref) <= 2e-2
