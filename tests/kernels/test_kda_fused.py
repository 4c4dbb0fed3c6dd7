"""The lab's KDA prefill forms (`pallas_kernels.experimental.kda_fused`: phase 1 over whole chunks, in one kernel
or two) against the float64 recurrence and phase 1's literal float64 parts, interpreted on the CPU, lowered for
CUDA, compiled on the device machine; named only, bounded gates only. The checks are test_kda_chunk's."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import test_kda_chunk as chunk_tests
from helpers import gpu_test, l2, rel_error
from np_reference import kda_recurrence
from test_kda_chunk import BOUNDED, TOL, check_parts, random_sequence

from pallas_kernels.experimental import kda_fused
from pallas_kernels.kda.ops import chunk_variant, kernel
from pallas_kernels.kda.tuned import ChunkTiles
from pallas_kernels.tuning import lookup

FUSED = ["gpu_triton_fused", "gpu_triton_fused_wy"]  # phase 1 over whole chunks: one kernel, two
TABLES = {"gpu_triton_fused": kda_fused.CHUNK_FUSED, "gpu_triton_fused_wy": kda_fused.CHUNK_FUSED_WY}


@pytest.mark.parametrize(
    "name, dtype, l2norm",
    [
        ("gpu_triton_fused", jnp.float32, True),
        ("gpu_triton_fused", jnp.bfloat16, True),
        ("gpu_triton_fused_wy", jnp.float32, False),
    ],
    ids=["fp32", "bf16", "wy-fp32-as-given"],
)
def test_fused_kernels_match_float64_recurrence(name, dtype, l2norm):
    """The chunk-wide forms, interpreted: T = 75 (a chunk and a part), 16 key columns at a time over K = 32, one
    sequence with an initial state and one without (a zero state); the two-kernel form in fp32 only (its
    kernels differ from the one kernel's only in where the WY factors are formed), on q, k as given (not
    normalised in the kernel)."""
    q, k, v, g, beta, state = random_sequence(2, 75, 2, 32, 32, dtype, seed=41)
    state[1] = 0.0
    if not l2norm:
        q, k = l2(q), 0.7 * l2(k)
    o_ref, s_ref = kda_recurrence(*((l2(q), l2(k)) if l2norm else (q, k)), v, g, beta, state)
    o, s = kernel("chunk_kda", name)(
        *(jnp.asarray(x, dtype) for x in (q, k, v)),
        jnp.asarray(g),
        jnp.asarray(beta),
        jnp.asarray(state),
        scale=32**-0.5,
        use_qk_l2norm=l2norm,
        tiles=ChunkTiles(intra=dataclasses.replace(lookup(TABLES[name], dtype=dtype), block_k=16)),
        interpret=True,
    )
    assert o.dtype == dtype and np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(s)).all()
    err_o, err_s = rel_error(o, o_ref), rel_error(s, s_ref)
    assert err_o <= TOL[dtype] and err_s <= TOL[dtype], (err_o, err_s)


def test_fused_variants_are_named_only_and_keep_the_gate_bound():
    """The chunk-wide forms run when named (the default is gpu_triton_short, measured faster on the device), and
    are refused for gates not bounded by -5 (they take the bounded kernels' gates only)."""
    assert chunk_variant("pallas_gpu", BOUNDED) == "gpu_triton_short"
    for name in FUSED:
        assert chunk_variant("pallas_gpu", BOUNDED, name) == name
        with pytest.raises(ValueError, match="gpu_triton_any_gate"):
            chunk_variant("pallas_gpu", -6.0, name)


def test_gpu_fused_chunk_parts_match_float64():
    """The same parts from `fused_intra_chunk` in one kernel, over four 16-column steps of the keys. The left
    decay factors are exponentials of a 64-gate running sum (fp32 rounding of the exponent: a_qk 1.5e-6 off at the
    gate bound; the three kernels' sums span 16 gates)."""
    tiles = kda_fused.FusedTiles(block_k=16, num_warps=4)
    check_parts(jnp.float32, 64, 32, interpret=True, tolerance=5e-6, phase1=kda_fused.fused_intra_chunk, tiles=tiles)


@gpu_test("the compiled Triton kernels")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "phase1", [kda_fused.fused_intra_chunk, kda_fused.fused_wy_intra_chunk], ids=["fused", "fused-wy"]
)
def test_compiled_gpu_chunk_parts_full_width(dtype, phase1):
    chunk_tests.test_compiled_gpu_chunk_parts_full_width(dtype, phase1)


@pytest.mark.parametrize(
    "name, shape, phase1",
    [
        ("gpu_triton_fused", (1, 32768, 64), ("fused_intra",)),
        ("gpu_triton_fused_wy", (1, 1000, 4), ("fused_blocks", "intra_wy_factors_inverting")),
    ],
    ids=["fused-T32768-H64", "fused-wy-T1000-H4"],
)
def test_gpu_kernel_lowers_for_cuda(name, shape, phase1):
    chunk_tests.test_gpu_kernel_lowers_for_cuda(name, shape, phase1)


# bf16 only, the dtype the model runs (the device's time is the compile, ~50 s a case): the fused forms' fp32 path
# stays checked at full width by test_compiled_gpu_chunk_parts_full_width and in interpret mode.
@gpu_test("the compiled Triton kernel")
@pytest.mark.parametrize("dtype", [jnp.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("variant", FUSED)
def test_compiled_gpu_kernel_full_width(dtype, variant):
    chunk_tests.test_compiled_gpu_kernel_full_width(dtype, variant)


@gpu_test("fla's Triton chunk_kda")
@pytest.mark.parametrize("name", FUSED)
def test_compiled_gpu_kernel_matches_fla(name):
    chunk_tests.test_compiled_gpu_kernel_matches_fla(name)
