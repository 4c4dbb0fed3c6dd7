"""The segment-parallel KDA prefill (`pallas_kernels.kda.segments`, `chunk_kda(segments=...)`) vs the unsplit
chunk_kda and the float64 recurrence: every variant (the reference, the GPU and TPU kernels in interpret mode),
gates inside the safe bound (the bounded kernels) and beyond it (the any-gate ones), a non-zero initial state that
still matters in the last segment, T a multiple of neither the segments nor the chunk; the gradient; the rule
that picks the segment count; the policy's field through the KDA layer; lowering for CUDA at the size it is for
(B=1, T=32768, H=8) and the compiled kernels on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_test, l2, lower_for_cuda, rel_error
from np_reference import kda_recurrence
from test_kda_chunk import TOL, abstract_inputs, chunk_kda_of, random_sequence

from ling_jax import ExecutionPolicy, KDAState, LingConfig
from ling_jax.kda import KimiDeltaAttention
from ling_jax.presets import TINY
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.gpu_triton.combine import combine_segments_gpu
from pallas_kernels.kda.segments import combine_reference, segment_count, segment_length

BACKENDS = ["reference", "interpret_gpu", "interpret_tpu"]
LENGTH = 150  # 3 segments of 64 tokens (segment_length), the last one 22 real tokens
SEGMENTS = 3


def long_memory_sequence(batch, length, heads, key_dim, value_dim, dtype, *, beyond_bound: bool, seed: int):
    """random_sequence's arrays with slow decays (g in [-0.02, 0]), small beta and a large initial state, so the
    state a segment starts from still shapes the last one's outputs; beyond_bound: 2% of the gates of half the
    key columns drawn from [-20, -8], below the safe bound (the other half keep the memory)."""
    q, k, v, g, beta, state = random_sequence(batch, length, heads, key_dim, value_dim, dtype, seed=seed)
    r = np.random.default_rng(seed + 1)
    g = -0.02 * r.uniform(size=g.shape)
    if beyond_bound:
        strong = (r.uniform(size=g.shape) < 0.02) & (np.arange(key_dim) < key_dim // 2)
        g = np.where(strong, -8.0 - 12.0 * r.uniform(size=g.shape), g)
    beta = r.uniform(0.01, 0.1, size=beta.shape)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), 3.0 * state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beyond_bound", [False, True], ids=["bounded-gates", "gates-beyond-the-bound"])
def test_segments_match_unsplit_and_float64(backend, beyond_bound):
    q, k, v, g, beta, state = long_memory_sequence(2, LENGTH, 3, 16, 24, jnp.float32, beyond_bound=beyond_bound, seed=5)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    o_zero, _ = kda_recurrence(l2(q), l2(k), v, g, beta, None)
    assert rel_error(o_zero[:, 128:], o_ref[:, 128:]) > 0.1  # the incoming state matters in the last segment
    bound = {} if beyond_bound else {"gate_lower_bound": -5.0}  # the bounded kernels only within the bound
    run = functools.partial(chunk_kda_of, q, k, v, g, beta, state, backend=backend, **bound)
    (o, s), (o_unsplit, s_unsplit) = run(segments=SEGMENTS), run()
    assert o.shape == o_ref.shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
    for ours, want in ((o, o_ref), (s, s_ref), (o, o_unsplit), (s, s_unsplit)):
        assert rel_error(ours, want) <= 1e-4, rel_error(ours, want)


def test_segments_bf16_and_zero_state():
    """bf16 inputs and no initial state, through the reference, to bf16 rounding."""
    q, k, v, g, beta, _ = long_memory_sequence(1, LENGTH, 2, 16, 16, jnp.bfloat16, beyond_bound=False, seed=7)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, None)
    o, s = chunk_kda_of(q, k, v, g, beta, None, jnp.bfloat16, backend="reference", segments=SEGMENTS)
    assert o.dtype == jnp.bfloat16
    assert rel_error(o, o_ref) <= TOL[jnp.bfloat16] and rel_error(s, s_ref) <= TOL[jnp.bfloat16]


def test_segments_gradient_matches_unsplit():
    q, k, v, g, beta, state = (
        jnp.asarray(x) for x in long_memory_sequence(1, 130, 2, 16, 16, jnp.float32, beyond_bound=False, seed=9)
    )

    def loss(segments, *arrays):
        o, s = chunk_kda(*arrays[:5], initial_state=arrays[5], backend="reference", segments=segments)
        return jnp.sum(o * o) + jnp.sum(s * s)

    argnums = tuple(range(6))
    ours = jax.jit(jax.grad(functools.partial(loss, 2), argnums))(q, k, v, g, beta, state)
    want = jax.jit(jax.grad(functools.partial(loss, 1), argnums))(q, k, v, g, beta, state)
    for d_ours, d_want in zip(ours, want, strict=True):
        assert rel_error(d_ours, d_want) <= 1e-4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_combine_matches_xla(dtype):
    """`combine_segments_gpu` (interpreted) against `combine_reference`: N = 3 pieces of 384 tokens (programs of
    2 x 64 tokens: the largest power of two of steps dividing 6), H = 2."""
    r = np.random.default_rng(12)
    o_NLHW = jnp.asarray(r.normal(size=(3, 384, 2, 16 + 32)), dtype)
    incoming_NHKV = jnp.asarray(r.normal(size=(3, 2, 16, 32)), jnp.float32)
    ours = combine_segments_gpu(o_NLHW, incoming_NHKV, interpret=True)
    want = combine_reference(o_NLHW, incoming_NHKV)
    assert ours.shape == (3, 384, 2, 32) and ours.dtype == dtype
    assert rel_error(ours, want) <= (1e-6 if dtype == jnp.float32 else TOL[jnp.bfloat16])


def test_gpu_segments_with_the_combine_kernel_and_its_gradient():
    """K and V powers of two: the interpreted GPU kernels combine the segments; outputs vs float64, the gradient
    (the kernel's is the XLA combine's) vs the unsplit reference's."""
    q, k, v, g, beta, state = (
        jnp.asarray(x) for x in long_memory_sequence(1, 150, 2, 16, 32, jnp.float32, beyond_bound=False, seed=13)
    )
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)

    def run(segments, backend, *arrays):
        options = dict(gate_lower_bound=-5.0, backend=backend, segments=segments)
        return chunk_kda(*arrays[:5], initial_state=arrays[5], **options)

    o, s = run(3, "interpret_gpu", q, k, v, g, beta, state)
    assert rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4

    def loss(segments, backend, *arrays):
        o, s = run(segments, backend, *arrays)
        return jnp.sum(o * o) + jnp.sum(s * s)

    ours = jax.grad(functools.partial(loss, 3, "interpret_gpu"), argnums=(0, 2, 5))(q, k, v, g, beta, state)
    want = jax.grad(functools.partial(loss, 1, "reference"), argnums=(0, 2, 5))(q, k, v, g, beta, state)
    for d_ours, d_want in zip(ours, want, strict=True):
        assert rel_error(d_ours, d_want) <= 1e-4


@pytest.mark.parametrize(
    "batch, heads, length, cores, want",
    [
        (1, 8, 32768, 132, 8),  # H=8 (tensor=8): 8 x 8 x 4 state-pass programs, two to each of 132 SMs
        (1, 16, 32768, 132, 4),
        (1, 8, 4 * 2048, 132, 4),  # as many 2048-token segments as the sequence holds
        (1, 8, 6000, 132, 1),  # fewer than MIN_SEGMENTS: unsplit
        (1, 64, 32768, 132, 1),  # H=64 fills the SMs already
        (8, 8, 32768, 132, 1),
        (1, 8, 32768, None, 1),  # no GPU
    ],
)
def test_segment_count_rule(batch, heads, length, cores, want):
    assert segment_count(batch, heads, length, cores) == want


def test_segment_count_counts_the_value_columns():
    assert segment_count(1, 8, 32768, 132, width=64 + 64) == 16  # half the programs a segment: twice the segments


def test_segment_length_is_whole_chunks():
    assert [segment_length(n, 3) for n in (1, 192, 193, 331, 32768)] == [64, 64, 128, 128, 10944]


def test_bad_segments_name_the_argument():
    q, k, v, g, beta, _ = random_sequence(1, 8, 1, 16, 16, jnp.float32, seed=1)
    with pytest.raises(ValueError, match=r"chunk_kda: segments must be a positive int or None \(the rule\), got 0"):
        chunk_kda_of(q, k, v, g, beta, None, backend="reference", segments=0)
    with pytest.raises(ValueError, match=r"ExecutionPolicy.kda_segments: must be None \(the rule\) or a positive int"):
        ExecutionPolicy(kda_segments=2.5)


def test_layer_under_policy_segments_equals_unsplit():
    """The KDA layer's chunked prefill under ExecutionPolicy(kda_segments=2) equals kda_segments=1 (reference)."""
    config = LingConfig.from_dict(TINY)
    layer = KimiDeltaAttention(config, dtype=jnp.float32, rngs=nnx.Rngs(4))
    prompt = jnp.asarray(np.random.default_rng(6).normal(size=(1, 150, config.hidden_size)), jnp.float32)
    state = KDAState.zeros(config, 1, jnp.float32)
    outputs = [layer(prompt, state, policy=ExecutionPolicy(kernel_backend="reference", kda_segments=n)) for n in (2, 1)]
    for ours, theirs in zip(*(jax.tree.leaves(out) for out in outputs), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_rule_lowers_for_cuda_without_a_gpu():
    """segments=None with the GPU kernels on a CPU (a program lowered for CUDA): no GPU to count, unsplit."""
    prefill = functools.partial(chunk_kda, backend="pallas_gpu", gate_lower_bound=-5.0, segments=None)
    text = lower_for_cuda(prefill, *abstract_inputs(1, 8192, 2)).as_text()
    assert "kda_prefill_inter_chunk" in text and "128x256" not in text  # no state [K, K + V] of a segment


def test_segmented_gpu_kernel_lowers_for_cuda():
    """B=1, T=32768, H=8 in 16 segments: one batch of 16 x 8 sequence-heads through both phases."""
    prefill = functools.partial(chunk_kda, backend="pallas_gpu", gate_lower_bound=-5.0, segments=16)
    text = lower_for_cuda(prefill, *abstract_inputs(1, 32768, 8)).as_text()
    for stage in ("short_chunks", "inter_chunk"):
        assert f"kda_prefill_{stage}" in text, stage


@gpu_test("the compiled Triton kernels")
@pytest.mark.parametrize(
    "dtype, beyond_bound",
    [(jnp.bfloat16, False), (jnp.float32, True)],
    ids=["bf16-bounded-gates", "fp32-gates-beyond-the-bound"],
)
def test_compiled_gpu_segments_full_width(dtype, beyond_bound):
    q, k, v, g, beta, state = long_memory_sequence(1, 5000, 4, 128, 128, dtype, beyond_bound=beyond_bound, seed=11)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    bound = {} if beyond_bound else {"gate_lower_bound": -5.0}
    o, s = chunk_kda_of(q, k, v, g, beta, state, dtype, backend="pallas_gpu", segments=5, **bound)
    err_o, err_s = rel_error(o, o_ref), rel_error(s, s_ref)
    print(f"compiled segmented GPU prefill, {jnp.dtype(dtype).name}: o {err_o:.1e}, final state {err_s:.1e}")
    assert err_o <= TOL[dtype] and err_s <= TOL[dtype], (err_o, err_s)
