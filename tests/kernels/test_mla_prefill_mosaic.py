"""The Mosaic GPU (Hopper) MLA prefill kernel (`pallas_kernels.mla.gpu_mosaic_prefill`) against a float64 dense
softmax (test_mla_prefill's cases: a chunk after cached tokens, a ragged row with a pad query): in jax's Mosaic
GPU interpreter on the CPU, its CUDA lowering at Ling width (layouts and the 227 KiB of shared memory are checked
there), and compiled on the GPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_test, lower_for_cuda, rel_error
from test_mla_prefill import assert_matches, random_case

from ling_jax import ExecutionPolicy, LingConfig, LingForCausalLM
from ling_jax.presets import TINY
from pallas_kernels.mla import gpu_mosaic_prefill, ops
from pallas_kernels.mla.ops import kernel, mla_prefill
from pallas_kernels.mla.tuned import PREFILL_MOSAIC
from pallas_kernels.tuning import lookup

flash_expanded_attention_mgpu = kernel("mla_prefill", "gpu_mosaic")
MOSAIC_DIMS = dict(nope=48, rope=16, value=64)  # nope + rope and value: multiples of 64


def test_mosaic_kernel_matches_dense_float64_in_the_interpreter():
    """Two 128-query blocks, two 256-slot segments (the second padded) of four 64-key tiles through three
    ring buffers: the segments merged in the kernel, tiles past a block's last visible slot skipped."""
    args, ref = random_case(jnp.bfloat16, seed=5, length=150, slots=300, **MOSAIC_DIMS)
    tiles = dataclasses.replace(lookup(PREFILL_MOSAIC, dtype=jnp.bfloat16), segment=256, stages=3)
    out = flash_expanded_attention_mgpu(*args, scale=0.2, tiles=tiles, interpret=True)
    assert_matches(out, ref, jnp.bfloat16, 2e-2, "Mosaic GPU interpreter")


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap-softmax"])
def test_mosaic_kernel_skips_the_mask_where_a_block_sees_whole_tiles(overlap):
    """Row 0 after 200 cache slots, the first 70 invalid: its first query block sees tiles 0-2 of the first
    segment whole, and takes tile 2 alone unmasked (tiles 0-1 hold invalid keys, tile 3 the diagonal); its second
    block all four; row 1's random validity leaves none unmasked (an empty range after its last partly invalid
    tile). The walk's counts, then the kernel against
    float64, its softmax serial or overlapping the next tile's scores (row 1's first block sees no key of the
    second segment: one fully masked tile)."""
    args, ref = random_case(jnp.bfloat16, seed=3, length=256, slots=500, cached=200, left_pad=70, **MOSAIC_DIMS)
    query_slots, key_valid = args[3], jnp.pad(args[4], ((0, 0), (0, 12)))
    walk = gpu_mosaic_prefill._tile_walk(query_slots, key_valid[:, :256], 0, 64)
    np.testing.assert_array_equal(walk, [[[4, 2, 3], [4, 2, 4]], [[4, 0, 0], [4, 3, 3]]])
    walk = gpu_mosaic_prefill._tile_walk(query_slots, key_valid[:, 256:], 256, 64)
    np.testing.assert_array_equal(walk[0], [[2, 0, 0], [4, 0, 1]])
    tiles = dataclasses.replace(lookup(PREFILL_MOSAIC, dtype=jnp.bfloat16), segment=256, overlap_softmax=overlap)
    out = flash_expanded_attention_mgpu(*args, scale=0.2, tiles=tiles, interpret=True)
    assert_matches(out, ref, jnp.bfloat16, 2e-2, f"Mosaic GPU interpreter, unmasked tiles, overlap {overlap}")


def test_mosaic_kernel_refuses_what_it_cannot_run():
    args, _ = random_case(jnp.float32, seed=1, **MOSAIC_DIMS)
    with pytest.raises(ValueError, match="bf16 or fp16 queries.*got float32"):
        flash_expanded_attention_mgpu(*args, scale=0.2)
    args, _ = random_case(jnp.bfloat16, seed=1, nope=32, rope=16, value=64)
    with pytest.raises(ValueError, match="multiple of 8; got bfloat16, nope 32, rope 16, value 64"):
        mla_prefill(*args, scale=0.2, backend="interpret_gpu", variant="gpu_mosaic")


def _ling_args(heads: int, length: int, slots: int):
    shape = jax.ShapeDtypeStruct
    return (
        shape((1, length, heads, 128), jnp.bfloat16),
        shape((1, length, heads, 64), jnp.bfloat16),
        shape((1, slots, 576), jnp.bfloat16),
        shape((1, length), jnp.int32),
        shape((1, slots), jnp.bool_),
        shape((heads, 128, 512), jnp.bfloat16),
        shape((heads, 128, 512), jnp.bfloat16),
    )


@pytest.mark.parametrize("heads", [32, 64])
def test_mosaic_kernel_lowers_for_cuda_at_ling_width(heads):
    """Ling-3.0-flash's (32 heads) and Ling-3.1-flash's (64) last 8192-token chunk of a 32k prompt, the consumers
    unscheduled and ping-ponged, P through shared memory and from registers with the softmax overlapping the next
    scores; 64-key tiles in three stages would
    exceed shared memory, which the lowering refuses."""
    args = _ling_args(heads, 8192, 32768)
    tiles = lookup(PREFILL_MOSAIC, dtype=jnp.bfloat16)
    for ping_pong, registers, overlap in ((False, False, False), (True, False, False), (True, True, True)):
        scheduled = dataclasses.replace(tiles, ping_pong=ping_pong, p_in_registers=registers, overlap_softmax=overlap)
        lowered = lower_for_cuda(functools.partial(flash_expanded_attention_mgpu, scale=0.07, tiles=scheduled), *args)
        assert "mosaic_gpu" in lowered.as_text()
    too_deep = dataclasses.replace(tiles, stages=3)
    with pytest.raises(Exception, match="exceeds available shared memory"):
        lower_for_cuda(functools.partial(flash_expanded_attention_mgpu, scale=0.07, tiles=too_deep), *args)


@gpu_test("the compiled Mosaic GPU prefill kernel (Hopper)")
@pytest.mark.parametrize(
    "registers, overlap", [(False, False), (True, False), (True, True)], ids=["p-smem", "p-registers", "overlapped"]
)
@pytest.mark.parametrize("dims", [MOSAIC_DIMS, dict(nope=128, rope=64, value=128)], ids=["small", "ling"])
def test_compiled_mosaic_kernel_matches_dense_float64(dims, registers, overlap):
    args, ref = random_case(jnp.bfloat16, seed=7, length=300, slots=700, **dims)
    tiles = lookup(PREFILL_MOSAIC, dtype=jnp.bfloat16)
    tiles = dataclasses.replace(tiles, segment=256, p_in_registers=registers, overlap_softmax=overlap)
    assert_matches(flash_expanded_attention_mgpu(*args, scale=0.2, tiles=tiles), ref, jnp.bfloat16, 2e-2, "compiled")
    out = mla_prefill(*args, scale=0.2, backend="pallas_gpu", variant="gpu_mosaic")
    assert_matches(out, ref, jnp.bfloat16, 2e-2, "mla_prefill, gpu_mosaic")


MOSAIC_TINY = {**TINY, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64}  # both kernels' dims


def _tiny_model(backend: str, named: str | None):
    policy = ExecutionPolicy(kernel_backend=backend, mla_mode="expanded", mla_prefill=named)
    return LingForCausalLM(LingConfig.from_dict(MOSAIC_TINY), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, policy=policy)


def _prompt(length: int):
    return jnp.asarray(np.random.default_rng(1).integers(2, MOSAIC_TINY["vocab_size"], (2, length)))


@pytest.mark.parametrize("named, kernel_name", [(None, "mla_prefill_segment"), ("gpu_mosaic", "mla_prefill_mgpu")])
def test_policy_names_the_models_mla_prefill_kernel(named, kernel_name):
    """ExecutionPolicy.mla_prefill: the model's prefill traces the named kernel (None: the op's, interpreted
    Triton's)."""
    model = _tiny_model("interpret_gpu", named)
    text = str(jax.make_jaxpr(lambda ids: model(ids, cache=model.init_cache(2, 16)).logits)(_prompt(9)))
    kernels = {"mla_prefill_segment", "mla_prefill_mgpu"}
    assert {name for name in kernels if name in text} == {kernel_name}
    with pytest.raises(ValueError, match="ExecutionPolicy.mla_prefill: must be None"):
        ExecutionPolicy(mla_prefill=1)


@pytest.mark.parametrize(
    "backend, hopper, dtype, length, dims, expected",
    [
        ("pallas_gpu", True, jnp.bfloat16, 128, (128, 64, 128), "gpu_mosaic"),
        ("pallas_gpu", True, jnp.float32, 128, (128, 64, 128), "gpu_triton"),  # 16-bit queries only
        ("pallas_gpu", True, jnp.bfloat16, 127, (128, 64, 128), "gpu_triton"),  # less than one query block
        ("pallas_gpu", False, jnp.bfloat16, 4096, (128, 64, 128), "gpu_triton"),  # not a Hopper GPU
        ("pallas_gpu", True, jnp.bfloat16, 4096, (48, 16, 64), "gpu_mosaic"),
        ("pallas_gpu", True, jnp.bfloat16, 4096, (32, 16, 32), "gpu_triton"),
        ("interpret_gpu", True, jnp.bfloat16, 4096, (128, 64, 128), "gpu_triton"),  # interpreted: Triton's
        ("pallas_gpu", True, jnp.bfloat16, 4096, (48, 16, 32), "reference"),
    ],
)
def test_default_prefill_kernel(monkeypatch, backend, hopper, dtype, length, dims, expected):
    """Compiled on a Hopper GPU the Mosaic kernel for 16-bit queries of at least 128 tokens where its dims fit,
    else the Triton kernel where its dims fit, else the jnp path."""
    monkeypatch.setattr(ops, "_on_hopper", lambda: hopper)
    nope, rope, value = dims
    shape = jax.ShapeDtypeStruct
    args = (
        shape((1, length, 4, nope), dtype),
        shape((1, length, 4, rope), dtype),
        shape((1, 8192, 512 + rope), dtype),
        shape((1, length), jnp.int32),
        shape((1, 8192), jnp.bool_),
        shape((4, nope, 512), dtype),
        shape((4, value, 512), dtype),
    )
    assert ops._prefill_default(backend, *args) == expected


@gpu_test("the compiled Mosaic GPU prefill kernel in the model (Hopper)")
def test_compiled_model_prefill_mosaic_equals_triton():
    """A bf16 prefill of 150 tokens a row under the default (the Mosaic kernel on a Hopper GPU) and under the Triton
    kernel named: the same logits up to bf16 rounding."""
    logits = {}
    for named in (None, "gpu_triton"):
        model = _tiny_model("pallas_gpu", named)
        logits[named] = model(_prompt(150), cache=model.init_cache(2, 160)).logits
    assert rel_error(logits[None], logits["gpu_triton"]) <= 2e-2
