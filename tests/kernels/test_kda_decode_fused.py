"""The fused KDA decode step (convs, gates, recurrence and gated norm in one GPU kernel, Pallas interpret mode on
the CPU) vs its jnp reference, pad tokens included, and lowering for CUDA from the CPU; the KDA layer with a
padding mask under `ExecutionPolicy(kda_decode="fused")` vs its separate ops (the whole model without one:
test_model_kernels.py). The same for the fused verify pass (`kda_verify_fused`: T tokens a row, each token's
state kept) against its reference and the layer's steps mode on the jnp path."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_test, lower_for_cuda, rel_error

from benchmarks.kernel_census import XLA_NORMS, kernel_census
from ling_jax import ExecutionPolicy, KDAState, LingConfig
from ling_jax.context import token_context
from ling_jax.kda import KimiDeltaAttention, fused_decode, kda_attention
from ling_jax.layers import GatedNormInput, linear_add_rms_norm, params_of
from ling_jax.policy import KDAMode
from ling_jax.presets import TINY
from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.backend import BACKENDS
from pallas_kernels.kda import BetaProjection, DecodeWeights, kda_decode_fused, kda_verify_fused
from pallas_kernels.kda.gpu_triton.decode_fused import value_splits
from pallas_kernels.kda.ops import fused_decode_leaves_norm, kernel
from pallas_kernels.kda.reference import kda_decode_fused as fused_reference
from pallas_kernels.kda.reference import kda_log_decay
from pallas_kernels.kda.reference import kda_verify_fused as verify_reference
from pallas_kernels.kda.tuned import DecodeFusedGpuTiles

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
EPS = 1e-6
kda_decode_fused_gpu = kernel("kda_decode_fused", "gpu_triton")
kda_verify_fused_gpu = kernel("kda_verify_fused", "gpu_triton")


def random_step(batch, heads, dim, taps, dtype, *, gate_scale=1.0, seed=0, tokens=None):
    """The fused op's arguments: pre-conv q/k/v, gate pre-activations f / b / output gate, conv window, state and
    the weights (conv [H, d, taps], dt_bias, A_log in the model's init range, norm weight). gate_scale widens f:
    with -A softplus(f) the log-decays then reach far below the safe gate's bound of -5. tokens: the verify op's
    arguments, T tokens a row (a token axis after the batch's)."""
    r = np.random.default_rng(seed)
    rows = (batch,) if tokens is None else (batch, tokens)

    def normal(*shape, scale=1.0, to=dtype):
        return jnp.asarray(scale * r.normal(size=shape), jnp.float32).astype(to)

    arrays = (
        normal(*rows, heads, dim),
        normal(*rows, heads, dim),
        normal(*rows, heads, dim),
        normal(*rows, heads, dim, scale=gate_scale),
        normal(*rows, heads),
        normal(*rows, heads, dim),
        normal(batch, taps - 1, 3, heads, dim),
        normal(batch, heads, dim, dim, to=jnp.float32),
    )
    weights = DecodeWeights(
        normal(heads, dim, taps, scale=0.5, to=jnp.float32),
        normal(heads, dim, taps, scale=0.5, to=jnp.float32),
        normal(heads, dim, taps, scale=0.5, to=jnp.float32),
        normal(heads, dim, scale=0.1, to=jnp.float32),
        jnp.log(jnp.asarray(r.uniform(1.0, 16.0, heads), jnp.float32)),
        1.0 + normal(dim, scale=0.1),
    )
    return (*arrays, weights)


def assert_matches_reference(step, arrays, dtype, lower_bound, real_B=None):
    """step(*arrays, real_B=) -> (o, window, state) against the jnp reference (run first: the kernels donate the
    state)."""
    scale = arrays[0].shape[-1] ** -0.5
    want = fused_reference(*arrays, real_B=real_B, scale=scale, lower_bound=lower_bound, eps=EPS)
    got = step(*arrays, real_B=real_B)
    assert [x.dtype for x in got] == [dtype, dtype, jnp.float32]
    o, window, state = got
    assert rel_error(o, want[0]) <= TOL[dtype], rel_error(o, want[0])
    np.testing.assert_array_equal(np.asarray(window, np.float32), np.asarray(want[1], np.float32))
    assert rel_error(state, want[2]) <= 1e-5, rel_error(state, want[2])


GATES = {  # lower_bound, gate_scale: the safe gate near its bound; -A softplus(f), log-decays far below -5
    "safe_gate": (-5.0, 1.0),
    "unbounded_gate": (None, 4.0),
}


SHAPES = {"B3_H5_d16_taps4": (3, 5, 16, 4), "B2_H3_d32_taps3": (2, 3, 32, 3)}
CASES = [  # each shape, dtype and gate twice, each pair of them once (a compile per case in interpret mode)
    ("B3_H5_d16_taps4", jnp.float32, "safe_gate"),
    ("B2_H3_d32_taps3", jnp.bfloat16, "safe_gate"),
    ("B3_H5_d16_taps4", jnp.bfloat16, "unbounded_gate"),
    ("B2_H3_d32_taps3", jnp.float32, "unbounded_gate"),
]


@pytest.mark.parametrize("shape_name, dtype, gate", CASES, ids=[f"{s}-{jnp.dtype(d).name}-{g}" for s, d, g in CASES])
def test_kernel_matches_reference(shape_name, dtype, gate):
    shape = SHAPES[shape_name]
    lower_bound, gate_scale = GATES[gate]
    arrays = random_step(*shape, dtype, gate_scale=gate_scale, seed=sum(shape))
    g = kda_log_decay(arrays[3], arrays[-1].dt_bias_HK, arrays[-1].a_log_H, lower_bound)
    assert float(g.min()) < (-4.0 if lower_bound else -20.0)  # at the safe bound; far below it
    step = functools.partial(kda_decode_fused, lower_bound=lower_bound, eps=EPS, backend="interpret_gpu")
    assert_matches_reference(step, arrays, dtype, lower_bound)


FUSED_TILES = {  # tiles, whether beta's pre-activation comes as its projection
    "one_program_4_steps": (DecodeFusedGpuTiles(block_v=8, num_warps=2, value_splits=1), False),
    "2_programs_2_steps": (DecodeFusedGpuTiles(block_v=8, num_warps=4, value_splits=2), False),
    "4_programs_beta_projected": (DecodeFusedGpuTiles(block_v=32, num_warps=8, value_splits=4), True),
}


@pytest.mark.parametrize("case", FUSED_TILES)
def test_kernel_tiles_and_pad_tokens_match_reference(case):
    """One program a sequence-head walking its state 8 columns at a time (4 steps, the norm in the kernel), two
    programs walking their 16 columns in 2 steps, four taking their 8 columns at once (the norm after the kernel),
    these forming beta's pre-activation from a 48-wide input row and b_proj's weight (`BetaProjection`, summed 16
    columns at a time); the second sequence's token is a pad."""
    tiles, project_beta = FUSED_TILES[case]
    arrays = random_step(2, 3, 32, 4, jnp.bfloat16, seed=5)
    if project_beta:
        r = np.random.default_rng(7)
        x_BD, weight_HD = (jnp.asarray(r.normal(size=shape), jnp.bfloat16) for shape in ((2, 48), (3, 48)))
        arrays = (*arrays[:4], BetaProjection(x_BD, weight_HD), *arrays[5:])
    step = functools.partial(
        kda_decode_fused_gpu, scale=32**-0.5, lower_bound=-5.0, eps=EPS, tiles=tiles, interpret=True
    )
    assert_matches_reference(step, arrays, jnp.bfloat16, -5.0, real_B=jnp.asarray([True, False]))


def test_pad_tokens_give_zero_and_keep_window_and_state():
    *arrays, weights = random_step(2, 3, 16, 4, jnp.float32, seed=1)
    o, window, state = fused_reference(*arrays, weights, real_B=jnp.asarray([False, True]), lower_bound=-5.0, eps=EPS)
    assert not np.asarray(o[0]).any() and np.asarray(o[1]).any()
    np.testing.assert_array_equal(window[0], arrays[6][0])
    np.testing.assert_array_equal(state[0], arrays[7][0])
    np.testing.assert_array_equal(window[1, :-1], arrays[6][1, 1:])


def test_masked_layer_step_fused_equals_separate_ops():
    """The KDA layer's one-token step with a padding mask under ExecutionPolicy(kda_decode="fused"), the kernel in
    interpret mode, equals its separate ops on the reference path: output, conv window and state, from a state a
    prefill left. The traced step holds the fused kernel and not the recurrence kernel. (Without a mask:
    test_model_kernels.py, the whole model.)"""
    config = LingConfig.from_dict(TINY)
    layer = KimiDeltaAttention(config, dtype=jnp.float32, rngs=nnx.Rngs(4))
    r = np.random.default_rng(6)
    prompt, token = (jnp.asarray(r.normal(size=(3, n, config.hidden_size)), jnp.float32) for n in (7, 1))
    mask = jnp.asarray([[True], [False], [True]])
    reference = ExecutionPolicy(kernel_backend="reference")
    _, state = layer(prompt, KDAState.zeros(config, 3, jnp.float32), policy=reference)
    fused = ExecutionPolicy(kernel_backend="interpret_gpu", kda_decode="fused")
    traced = jax.jit(lambda x, s, m: layer(x, s, m, policy=fused)).trace(token, state, mask)
    names = set(re.findall(r"name=(\w+)", str(traced.jaxpr)))
    assert "kda_decode_fused_gpu" in names and "kda_decode_step_gpu" not in names
    got = traced.lower().compile()(token, state, mask)
    want = layer(token, state, mask, policy=reference)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_output_before_the_norm_and_where_the_kernel_leaves_it():
    """output_norm False: o before the gated output norm, the kernel's (2 programs a head) as the reference's, for
    one token a row and for a verify pass's 2. The GPU kernel runs the norm as a kernel of its own where it splits
    the values (Ling-3.0-flash's 32 heads of 128 at batch 1 and 2, not at 8: `fused_decode_leaves_norm`), the
    reference never."""
    keywords = dict(scale=32**-0.5, lower_bound=-5.0, eps=EPS, output_norm=False)
    tiles = DecodeFusedGpuTiles(block_v=8, num_warps=4, value_splits=2)
    for tokens, reference, fused in (
        (None, fused_reference, kda_decode_fused_gpu),
        (2, verify_reference, kda_verify_fused_gpu),
    ):
        arrays = random_step(3, 5, 32, 4, jnp.float32, seed=3, tokens=tokens)
        want = reference(*arrays, **keywords)
        got = fused(*arrays, tiles=tiles, interpret=True, **keywords)
        assert rel_error(got[0], want[0]) <= TOL[jnp.float32]
    leaves = [fused_decode_leaves_norm(batch, 32, 128, jnp.bfloat16, backend="interpret_gpu") for batch in (1, 2, 8)]
    assert leaves == [True, True, False]
    assert not fused_decode_leaves_norm(1, 32, 128, jnp.bfloat16, backend="reference")


@pytest.mark.parametrize(
    "batch, tokens, mode", [(2, 1, KDAMode.RECURRENT), (1, 2, KDAMode.STEPS)], ids=["decode_batch_2", "verify_2_tokens"]
)
def test_layer_step_leaves_the_norm_to_the_output_projection(batch, tokens, mode):
    """Where the fused step splits the values (heads of 32 at batch 1 or 2: 2 programs a head), the KDA layer's decode
    step (or a verify pass's) for the caller to project gives o before its gated norm, with the norm
    (`GatedNormInput`); the output projection (a block-FP8 weight, the decode gemv: 2 rows) forms the norm as it reads
    o, then the residual add + RMSNorm: as the reference path's, whose step normalises o itself. No norm runs outside
    the kernels."""
    config = LingConfig.from_dict({**TINY, "head_dim": 32})
    layer = KimiDeltaAttention(config, dtype=jnp.float32, rngs=nnx.Rngs(8))
    weights = params_of(layer)
    r = np.random.default_rng(9)
    values = jnp.asarray(r.normal(size=(config.hidden_size, config.kda_dim)) * 60.0, jnp.float8_e4m3fn)
    scales = jnp.asarray(r.uniform(1e-3, 1e-2, (config.hidden_size // 32, config.kda_dim // 32)), jnp.float32)
    weights["dense"]["weight"] = BlockFP8Weight(values, scales, (32, 32))
    x_BTD, residual_BTD = (
        jnp.asarray(r.normal(size=(batch, tokens, config.hidden_size)), jnp.float32) for _ in range(2)
    )
    state = KDAState(
        conv_window=jnp.asarray(r.normal(size=(batch, 3, 3 * config.kda_dim)), jnp.float32),
        recurrent_state=jnp.asarray(r.normal(size=(batch, 4, 32, 32)) * 0.1, jnp.float32),
    )
    norm_weights = {"weight": jnp.asarray(1.0 + 0.1 * r.normal(size=config.hidden_size), jnp.float32)}

    def step(x_BTD, residual_BTD, policy):
        ctx = token_context(config, batch, tokens, policy=policy, kda_mode=mode)
        o_BTC, _ = kda_attention(weights, x_BTD, state, ctx, config, project_output=False)
        assert isinstance(o_BTC, GatedNormInput) == (policy.kernel_backend == "interpret_gpu")
        return linear_add_rms_norm(weights["dense"], o_BTC, residual_BTD, norm_weights, config.rms_norm_eps, policy)

    fused, reference = (ExecutionPolicy(kernel_backend=backend) for backend in ("interpret_gpu", "reference"))
    census = kernel_census(jax.make_jaxpr(functools.partial(step, policy=fused))(x_BTD, residual_BTD))
    assert census["weight_only_gemv_gated_norm"] == 1 and XLA_NORMS not in census
    want = step(x_BTD, residual_BTD, reference)  # first: the kernel donates the state
    for ours, theirs in zip(step(x_BTD, residual_BTD, fused), want, strict=True):
        assert rel_error(ours, theirs) <= 1e-4, rel_error(ours, theirs)


def _abstract_step(batch, heads=64, dim=128, taps=4, hidden=None, tokens=None):
    """The fused op's abstract arguments; hidden: beta's pre-activation as a `BetaProjection` from that width;
    tokens: the verify op's, T tokens a row."""
    shape, bf16, fp32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    row = (batch,) if tokens is None else (batch, tokens)
    b = (
        shape((*row, heads), bf16)
        if hidden is None
        else BetaProjection(shape((*row, hidden), bf16), shape((heads, hidden), bf16))
    )
    rows = [shape((*row, heads, dim), bf16)] * 4 + [b, shape((*row, heads, dim), bf16)]
    conv = [shape((heads, dim, taps), fp32)] * 3
    weights = DecodeWeights(*conv, shape((heads, dim), fp32), shape((heads,), fp32), shape((dim,), bf16))
    window = shape((batch, taps - 1, 3, heads, dim), bf16)
    return rows + [window, shape((batch, heads, dim, dim), fp32), weights]


def test_value_splits_fill_the_sms():
    """Ling-3.0-flash's 32 heads: 4 programs a head at batch 1 (128 on 132 SMs), 2 at batch 2, 1 from batch 8;
    no program owns fewer than 16 value columns."""
    assert [value_splits(32 * batch, 128, 132) for batch in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert value_splits(1, 128, 132) == 8 and value_splits(1, 16, 132) == 1


@pytest.mark.parametrize(
    "lower_bound, batch, hidden",
    [(-5.0, 1, 2560), (None, 64, None)],
    ids=["safe_gate-split-beta_projected", "unbounded_gate"],
)
def test_kernel_lowers_for_cuda(lower_bound, batch, hidden):
    """Ling-3.0-flash's 2560-wide input row (beta's projection in 5 pieces of 512) at batch 1 (2 programs a head)."""
    step = functools.partial(kda_decode_fused_gpu, scale=128**-0.5, lower_bound=lower_bound, eps=EPS)
    lowered = lower_for_cuda(step, *_abstract_step(batch=batch, hidden=hidden))
    assert "kda_decode_fused" in lowered.as_text()


@gpu_test("the compiled Triton kernel")
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "unbounded_gate"])
def test_compiled_kernel_full_size(batch, lower_bound):
    arrays = random_step(batch, 64, 128, 4, jnp.bfloat16, gate_scale=1.0 if lower_bound else 4.0, seed=batch)
    step = functools.partial(kda_decode_fused, lower_bound=lower_bound, eps=EPS, backend="pallas_gpu")
    assert_matches_reference(step, arrays, jnp.bfloat16, lower_bound, real_B=jnp.arange(batch) % 5 != 3)


def test_policy_names_a_misspelt_mode():
    with pytest.raises(
        ValueError, match=r"ExecutionPolicy.kda_decode: 'fuse' is not one of 'auto', 'separate', 'fused'"
    ):
        ExecutionPolicy(kda_decode="fuse")


def test_auto_fuses_the_decode_step_on_the_gpu_path_only():
    """The default (kda_decode AUTO) runs the fused step with a GPU's kernels, interpreted or not, and the separate
    ops with a TPU's kernels (no fused TPU kernel) and the reference."""
    fused = {
        backend: fused_decode(ExecutionPolicy(kernel_backend=backend)) for backend in BACKENDS if backend != "auto"
    }
    assert fused == {
        "reference": False,
        "pallas_gpu": True,
        "pallas_tpu": False,
        "interpret_gpu": True,
        "interpret_tpu": False,
        "interpret": False,
    }
    assert not fused_decode(ExecutionPolicy(kernel_backend="interpret_gpu", kda_decode="separate"))


VERIFY_CASES = {  # B, H, d, taps, T, dtype, gate, tiles, whether beta comes as its projection
    "B3_H5_d16_taps4_T2-fp32-safe_gate-one_program": (
        (3, 5, 16, 4, 2),
        jnp.float32,
        "safe_gate",
        DecodeFusedGpuTiles(block_v=8, num_warps=2, value_splits=1),
        False,
    ),
    "B2_H3_d32_taps3_T3-bf16-unbounded_gate-2_programs_beta_projected": (
        (2, 3, 32, 3, 3),
        jnp.bfloat16,
        "unbounded_gate",
        DecodeFusedGpuTiles(block_v=8, num_warps=4, value_splits=2),
        True,
    ),
}


@pytest.mark.parametrize("case", VERIFY_CASES)
def test_verify_kernel_matches_reference(case):
    """T tokens a row in one kernel against T reference decode steps: each token's output, window and state. One
    program walking 8 columns at a time (the norm in the kernel); two programs forming beta's pre-activation from a
    48-wide input row (the norm after the kernel). Pad tokens: a row's first, another's middle one."""
    shape, dtype, gate, tiles, project_beta = VERIFY_CASES[case]
    batch, heads, dim, taps, tokens = shape
    lower_bound, gate_scale = GATES[gate]
    arrays = random_step(batch, heads, dim, taps, dtype, gate_scale=gate_scale, seed=sum(shape), tokens=tokens)
    if project_beta:
        r = np.random.default_rng(3)
        x_BTD, weight_HD = (jnp.asarray(r.normal(size=s), dtype) for s in ((batch, tokens, 48), (heads, 48)))
        arrays = (*arrays[:4], BetaProjection(x_BTD, weight_HD), *arrays[5:])
    real_BT = np.ones((batch, tokens), bool)
    real_BT[0, 0] = real_BT[1, tokens // 2] = False
    real_BT = jnp.asarray(real_BT)
    keywords = dict(real_BT=real_BT, scale=dim**-0.5, lower_bound=lower_bound, eps=EPS)
    want = verify_reference(*arrays, **keywords)
    got = kda_verify_fused_gpu(*arrays, **keywords, tiles=tiles, interpret=True)
    assert [x.shape for x in got] == [
        (batch, tokens, heads, dim),
        (batch, tokens, taps - 1, 3, heads, dim),
        (batch, tokens, heads, dim, dim),
    ]
    assert [x.dtype for x in got] == [dtype, dtype, jnp.float32]
    assert rel_error(got[0], want[0]) <= TOL[dtype], rel_error(got[0], want[0])
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))
    assert rel_error(got[2], want[2]) <= 1e-5, rel_error(got[2], want[2])
    assert not np.asarray(got[0][0, 0], np.float32).any()  # a pad's output
    np.testing.assert_array_equal(got[2][0, 0], arrays[7][0])  # the state after a first pad: the one before it


def test_masked_layer_steps_fused_equals_jnp_steps():
    """The KDA layer's steps mode (a speculative verify pass) over 3 tokens with pads under the default policy on the
    GPU path (the verify kernel interpreted) equals the jnp steps path: output, each token's conv window and state,
    from a state a prefill left. The traced pass holds the verify kernel and no recurrence."""
    config = LingConfig.from_dict(TINY)
    layer = KimiDeltaAttention(config, dtype=jnp.float32, rngs=nnx.Rngs(5))
    r = np.random.default_rng(8)
    prompt, drafts = (jnp.asarray(r.normal(size=(3, n, config.hidden_size)), jnp.float32) for n in (5, 3))
    mask = jnp.asarray([[True, True, True], [True, False, True], [False, False, False]])
    reference = ExecutionPolicy(kernel_backend="reference")
    _, state = layer(prompt, KDAState.zeros(config, 3, jnp.float32), policy=reference)
    fused = ExecutionPolicy(kernel_backend="interpret_gpu", kda_mode="steps")
    traced = jax.jit(lambda x, s, m: layer(x, s, m, policy=fused)).trace(drafts, state, mask)
    names = set(re.findall(r"name=(\w+)", str(traced.jaxpr)))
    assert "kda_verify_fused_gpu" in names and "scan" not in str(traced.jaxpr)
    got = traced.lower().compile()(drafts, state, mask)
    want = layer(drafts, state, mask, policy=reference.replace(kda_mode="steps"))
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "lower_bound, batch, tokens, hidden",
    [(-5.0, 1, 2, 2560), (None, 64, 3, None)],
    ids=["safe_gate-T2-split-beta_projected", "unbounded_gate-T3"],
)
def test_verify_kernel_lowers_for_cuda(lower_bound, batch, tokens, hidden):
    step = functools.partial(kda_verify_fused_gpu, scale=128**-0.5, lower_bound=lower_bound, eps=EPS)
    lowered = lower_for_cuda(step, *_abstract_step(batch=batch, hidden=hidden, tokens=tokens))
    assert "kda_verify_fused" in lowered.as_text()


@gpu_test("the compiled Triton kernel")
@pytest.mark.parametrize("batch, tokens", [(1, 2), (64, 3)])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "unbounded_gate"])
def test_compiled_verify_kernel_full_size(batch, tokens, lower_bound):
    arrays = random_step(
        batch, 64, 128, 4, jnp.bfloat16, gate_scale=1.0 if lower_bound else 4.0, seed=batch, tokens=tokens
    )
    real_BT = (jnp.arange(batch * tokens) % 5 != 3).reshape(batch, tokens)
    keywords = dict(real_BT=real_BT, lower_bound=lower_bound, eps=EPS)
    want = verify_reference(*arrays, **keywords)
    got = kda_verify_fused(*arrays, **keywords, backend="pallas_gpu")
    assert rel_error(got[0], want[0]) <= TOL[jnp.bfloat16], rel_error(got[0], want[0])
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))
    assert rel_error(got[2], want[2]) <= 1e-5, rel_error(got[2], want[2])
