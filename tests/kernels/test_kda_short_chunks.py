"""The KDA prefill over 16-token chunks (`gpu_triton_short`, Pallas interpret mode on the CPU): its phase 1 part by
part against the literal float64 form at 16 rows a chunk, the whole prefill against the float64 recurrence (odd
lengths, an initial state, bf16, over segments), its Neumann inverse, and its lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_kda_chunk as chunk_tests
from flax import nnx
from helpers import gpu_test, l2, lower_for_cuda, rel_error
from np_reference import kda_recurrence
from test_kda_chunk import BOUNDED, TOL, abstract_inputs, check_parts, chunk_kda_of, random_sequence

from ling_jax import ExecutionPolicy, KDAState, LingConfig
from ling_jax.kda import KimiDeltaAttention
from ling_jax.presets import TINY
from pallas_kernels.kda.gpu_triton.short_chunks import SHORT_CHUNK, neumann_inverse, short_chunk_parts
from pallas_kernels.kda.ops import kernel
from pallas_kernels.kda.tuned import ChunkTiles, InterTiles, ShortChunkTiles


@pytest.mark.parametrize("chunks, chunk", [(1, 16), (4, 16), (2, 32)])
def test_parts_match_float64(chunks, chunk):
    """One 64-token stretch of slow decay, one at the gate bound (-5 a token), four column blocks of keys; one
    chunk a program or more; 16- and 32-token chunks (two 16-row blocks of decay factors)."""
    tiles = ShortChunkTiles(chunks=chunks, num_warps=4, chunk=chunk)
    check_parts(jnp.float32, 64, 32, interpret=True, tolerance=1e-6, phase1=short_chunk_parts, tiles=tiles, chunk=chunk)


def test_neumann_inverse_is_the_inverse():
    r = np.random.default_rng(5)
    strict = np.tril(r.normal(scale=0.5, size=(SHORT_CHUNK, SHORT_CHUNK)), -1).astype(np.float32)
    expected = np.linalg.inv(np.eye(SHORT_CHUNK) + strict.astype(np.float64))
    assert rel_error(neumann_inverse(jnp.asarray(strict)), expected) <= 1e-6


@pytest.mark.parametrize("length, with_state", [(200, True), (17, False)])
def test_prefill_matches_float64_recurrence(length, with_state):
    q, k, v, g, beta, state = random_sequence(1, length, 2, 16, 32, jnp.float32, seed=length)
    initial = state if with_state else None
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, initial)
    o, s = chunk_kda_of(
        q, k, v, g, beta, initial, gate_lower_bound=BOUNDED, backend="interpret_gpu", variant="gpu_triton_short"
    )
    assert o.shape == o_ref.shape and rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4


@pytest.mark.parametrize(
    "name, state_rows, chunk, paired",
    [("gpu_triton_short", True, 16, False), ("gpu_triton", True, 16, False), ("gpu_triton_short", False, 16, False)]
    + [("gpu_triton_short", True, 32, False), ("gpu_triton_short", True, 16, True)],
)
def test_phase2_forms_match_float64(name, state_rows, chunk, paired):
    """Phase 2 with the state held transposed (`InterTiles.state_rows`) after either phase 1, and either form
    after the short phase 1 at 16- and 32-token chunks, the paired parts' state pass, an initial state, T = 83."""
    q, k, v, g, beta, state = random_sequence(1, 83, 2, 16, 32, jnp.float32, seed=3)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    short = name == "gpu_triton_short"
    tiles = ChunkTiles(
        intra=ShortChunkTiles(chunks=1, num_warps=4, chunk=chunk, paired=paired) if short else None,
        inter=InterTiles(block_v=16, num_warps=4, num_stages=2, state_rows=state_rows),
    )
    arrays = (jnp.asarray(x) for x in (q, k, v, g, beta, state))
    o, s = kernel("chunk_kda", name)(*arrays, scale=16**-0.5, tiles=tiles, interpret=True)
    assert rel_error(o, o_ref) <= 1e-5 and rel_error(s, s_ref) <= 1e-5


@pytest.mark.parametrize("state_rows, paired, block_v", [(False, False, 16), (True, False, 32), (True, True, 16)])
def test_identity_columns_match_float64(state_rows, paired, block_v):
    """`identity_columns=K`: the values [0_K | v] from a state [K, K + V] (how `segments` carries a segment's
    transition), the zero columns never stored (block_v 32 over K = 16: the blocks shrunk to 16), T = 83."""
    q, k, v, g, beta, state = random_sequence(1, 83, 2, 16, 24, jnp.float32, seed=4)
    state_W = np.concatenate([np.eye(16, dtype=np.float32)[None, None].repeat(2, 1), state], axis=-1)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), np.concatenate([np.zeros_like(q), v], -1), g, beta, state_W)
    tiles = ChunkTiles(
        intra=ShortChunkTiles(chunks=1, num_warps=4, paired=paired),
        inter=InterTiles(block_v=block_v, num_warps=4, num_stages=2, state_rows=state_rows),
    )
    arrays = (jnp.asarray(x) for x in (q, k, v, g, beta, state_W))
    run = kernel("chunk_kda", "gpu_triton_short")
    o, s = run(*arrays, scale=16**-0.5, tiles=tiles, identity_columns=16, interpret=True)
    assert o.shape == (1, 83, 2, 40) and s.shape == (1, 2, 16, 40)
    assert rel_error(o, o_ref) <= 1e-5 and rel_error(s, s_ref) <= 1e-5


def test_segments_match_float64():
    """Over 3 segments (`chunk_kda(segments=...)`, values widened to K + V), an initial state, T = 150."""
    q, k, v, g, beta, state = random_sequence(1, 150, 2, 16, 24, jnp.float32, seed=9)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    options = dict(gate_lower_bound=BOUNDED, backend="interpret_gpu", variant="gpu_triton_short", segments=3)
    o, s = chunk_kda_of(q, k, v, g, beta, state, **options)
    assert rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4


@pytest.mark.parametrize("chunk, paired", [(16, False), (32, False), (16, True)])
def test_prefill_bf16_at_the_gate_bound(chunk, paired):
    q, k, v, g, beta, state = random_sequence(1, 96, 3, 32, 16, jnp.bfloat16, seed=7)
    g[:, 40:] = -5.0
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    tiles = ChunkTiles(intra=ShortChunkTiles(chunks=1, num_warps=4, chunk=chunk, paired=paired))
    arrays = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(x) for x in (g, beta, state)]
    o, s = kernel("chunk_kda", "gpu_triton_short")(*arrays, scale=32**-0.5, tiles=tiles, interpret=True)
    assert o.dtype == jnp.bfloat16 and np.isfinite(np.asarray(o, np.float32)).all()
    assert rel_error(o, o_ref) <= TOL[jnp.bfloat16] and rel_error(s, s_ref) <= TOL[jnp.bfloat16]


def test_layer_under_policy_kda_prefill():
    """The KDA layer's chunked prefill under ExecutionPolicy(kda_prefill="gpu_triton_short") (interpreted) equals
    the reference policy's; a bounded kernel named for gates without the bound, or a name of another type, is
    refused with the field named."""
    config = LingConfig.from_dict(TINY)
    layer = KimiDeltaAttention(config, dtype=jnp.float32, rngs=nnx.Rngs(4))
    prompt = jnp.asarray(np.random.default_rng(6).normal(size=(1, 37, config.hidden_size)), jnp.float32)
    state = KDAState.zeros(config, 1, jnp.float32)
    policies = [
        ExecutionPolicy(kernel_backend="interpret_gpu", kda_prefill="gpu_triton_short"),
        ExecutionPolicy(kernel_backend="reference"),
    ]
    outputs = [layer(prompt, state, policy=policy) for policy in policies]
    for ours, theirs in zip(*(jax.tree.leaves(out) for out in outputs), strict=True):
        assert rel_error(ours, theirs) <= 1e-4
    unbounded = KimiDeltaAttention(
        LingConfig.from_dict({**TINY, "kda_safe_gate": False}), dtype=jnp.float32, rngs=nnx.Rngs(4)
    )
    with pytest.raises(ValueError, match="variant 'gpu_triton_short' of chunk_kda takes log-decays >= -5"):
        unbounded(prompt, state, policy=policies[0])
    with pytest.raises(ValueError, match="ExecutionPolicy.kda_prefill: must be None"):
        ExecutionPolicy(kda_prefill=1)


@pytest.mark.parametrize("paired", [False, True])
def test_lowers_for_cuda(paired):
    tiles = ChunkTiles(intra=ShortChunkTiles(chunks=1, num_warps=2, paired=paired))
    prefill = functools.partial(kernel("chunk_kda", "gpu_triton_short"), scale=128**-0.5, tiles=tiles)
    text = lower_for_cuda(prefill, *abstract_inputs(1, 1000, 4)).as_text()
    assert "kda_prefill_short_chunks" in text and "kda_prefill_inter_chunk" in text


def test_paired_parts_need_16_token_chunks_and_the_transposed_state():
    q, k, v, g, beta, state = (jnp.asarray(x) for x in random_sequence(1, 64, 1, 16, 16, jnp.float32, seed=1))
    prefill = functools.partial(kernel("chunk_kda", "gpu_triton_short"), scale=0.25, interpret=True)
    with pytest.raises(ValueError, match="paired parts take 16-token chunks, got 32"):
        prefill(q, k, v, g, beta, state, tiles=ChunkTiles(intra=ShortChunkTiles(1, 4, chunk=32, paired=True)))
    untransposed = InterTiles(block_v=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="paired parts need the state held transposed"):
        prefill(q, k, v, g, beta, state, tiles=ChunkTiles(ShortChunkTiles(1, 4, paired=True), untransposed))


@gpu_test("the compiled short-chunk Triton kernels")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compiled_full_width(dtype):
    """At K = V = 128 compiled: phase 1's parts (tf32 products for bf16 inputs, IEEE fp32 for fp32 ones), then the
    whole prefill against the float64 recurrence."""
    check_parts(
        dtype,
        128,
        128,
        interpret=False,
        tolerance=TOL[dtype] if dtype == jnp.bfloat16 else 1e-5,
        phase1=short_chunk_parts,
        chunk=16,
    )
    chunk_tests.test_compiled_gpu_kernel_full_width(dtype, "gpu_triton_short")


@gpu_test("the compiled short-chunk Triton kernels")
def test_compiled_paired_parts_at_full_width():
    """The paired parts' phase 1 and state pass compiled at K = V = 128, bf16, at the gate bound from token 90,
    an initial state, T = 200, against the float64 recurrence."""
    q, k, v, g, beta, state = random_sequence(1, 200, 2, 128, 128, jnp.bfloat16, seed=11)
    g[:, 90:] = -5.0
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    tiles = ChunkTiles(intra=ShortChunkTiles(chunks=1, num_warps=2, paired=True))
    arrays = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(x) for x in (g, beta, state)]
    o, s = kernel("chunk_kda", "gpu_triton_short")(*arrays, scale=128**-0.5, tiles=tiles)
    assert rel_error(o, o_ref) <= TOL[jnp.bfloat16] and rel_error(s, s_ref) <= TOL[jnp.bfloat16]
