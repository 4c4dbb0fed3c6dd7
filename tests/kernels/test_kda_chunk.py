"""KDA chunked-prefill kernels (GPU and TPU, Pallas interpret mode on the CPU) vs the float64 recurrence;
lowering for TPU and CUDA from the CPU; gradients; prefill then decode steps; a long-sequence stability run
of the jnp path. The GPU kernel works in 64-token chunks (T = 63..65, 129, 200, 257 cross their edges).
The bounded kernels (gpu_triton, tpu_mosaic) run with gates >= -5, as chunk_kda picks them only for
gate_lower_bound >= -5; the any-gate kernels with gates of every kind: -A softplus(a), logsigmoid / 0.1,
constants -5.5 and -20, and the safe gate mixed with them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test, l2, lower_for_cuda, rel_error
from np_reference import kda_recurrence

from pallas_kernels.kda import chunk_kda, kda_chunked, kda_decode_step, kda_recurrent
from pallas_kernels.kda.gpu_triton import intra_chunk, sub_block_keys, unit_lower_inverse_16, wy_factors
from pallas_kernels.kda.ops import kernel
from pallas_kernels.kda.reference import unit_lower_inverse
from pallas_kernels.kda.tuned import IntraTiles

BACKENDS = ["interpret_gpu", "interpret_tpu"]
ANY_GATE_VARIANTS = {"interpret_gpu": "gpu_triton_any_gate", "interpret_tpu": "tpu_mosaic_any_gate"}
chunk_kda_gpu = kernel("chunk_kda", "gpu_triton")
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
BOUNDED = -5.0  # random_sequence's gates are >= -5: chunk_kda runs the bounded kernels
INTRA_16 = IntraTiles(block_k=16, num_warps=2, num_stages=1, factors_num_warps=2)  # the table's, 16 key columns


def random_sequence(batch, length, heads, key_dim, value_dim, dtype, seed):
    r = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    q = rounded(r.normal(size=(batch, length, heads, key_dim)))
    k = rounded(r.normal(size=(batch, length, heads, key_dim)))
    v = rounded(r.normal(size=(batch, length, heads, value_dim)))
    g = (-5.0 * r.uniform(size=(batch, length, heads, key_dim))).astype(np.float32)  # down to the safe bound
    beta = r.uniform(0.05, 1.0, size=(batch, length, heads)).astype(np.float32)
    state = r.normal(size=(batch, heads, key_dim, value_dim)).astype(np.float32)
    return q, k, v, g, beta, state


def _softplus_gate(r, shape):
    """-A softplus(a), the gate without the safe bound: A = e^{A_log} in [1, 16] per head, a with spread 2."""
    decay_rate = np.exp(r.uniform(0.0, np.log(16.0), size=(1, 1, shape[2], 1)))
    return -decay_rate * np.logaddexp(0.0, r.normal(scale=2.0, size=shape))


GATES = {  # name -> (rng, shape) -> log-decays <= 0 of any size
    "softplus": _softplus_gate,
    "logsigmoid/0.1": lambda r, shape: -np.logaddexp(0.0, -r.normal(scale=2.0, size=shape)) / 0.1,
    "constant-5.5": lambda r, shape: np.full(shape, -5.5),
    "constant-20": lambda r, shape: np.full(shape, -20.0),
    "safe-mixed": lambda r, shape: np.where(
        r.uniform(size=shape) < 0.5, -5.0 * r.uniform(size=shape), _softplus_gate(r, shape)
    ),
}


def gates_of(kind: str, shape, seed: int):
    return GATES[kind](np.random.default_rng(seed), shape).astype(np.float32)


def chunk_kda_of(q, k, v, g, beta, state, dtype=jnp.float32, **options):
    """chunk_kda on random_sequence's arrays, q, k, v as dtype; state None: a zero state."""
    return chunk_kda(
        *(jnp.asarray(x, dtype) for x in (q, k, v)),
        jnp.asarray(g),
        jnp.asarray(beta),
        initial_state=None if state is None else jnp.asarray(state),
        **options,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [1, 63, 64, 65, 129, 200])  # 257: test_kernel_bf16
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_kernel_matches_float64_recurrence_fp32(backend, length, with_state):
    q, k, v, g, beta, state = random_sequence(2, length, 2, 16, 32, jnp.float32, seed=length)
    initial = state if with_state else None
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, initial)
    o, s = chunk_kda_of(q, k, v, g, beta, initial, gate_lower_bound=BOUNDED, backend=backend)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32 and o.shape == o_ref.shape
    assert rel_error(o, o_ref) <= 1e-4, rel_error(o, o_ref)
    assert rel_error(s, s_ref) <= 1e-4, rel_error(s, s_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_bf16(backend):
    """Four whole chunks and a one-token tail (partial tails of other sizes: the fp32 test)."""
    q, k, v, g, beta, state = random_sequence(2, 257, 3, 32, 16, jnp.bfloat16, seed=3)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    o, s = chunk_kda_of(q, k, v, g, beta, state, jnp.bfloat16, gate_lower_bound=BOUNDED, backend=backend)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_error(o, o_ref) <= TOL[jnp.bfloat16] and rel_error(s, s_ref) <= TOL[jnp.bfloat16]


def test_gpu_kernel_fp32_parts_for_bf16_inputs():
    """parts_dtype=float32: phase 2 gets fp32 factors (tf32 products on a GPU, exact here), so the final state
    is as close as the fp32 inputs' (the default bf16 parts give ~2e-3)."""
    q, k, v, g, beta, state = random_sequence(2, 150, 2, 32, 32, jnp.bfloat16, seed=7)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    o, s = chunk_kda_gpu(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
        jnp.asarray(g),
        jnp.asarray(beta),
        jnp.asarray(state),
        scale=32**-0.5,
        parts_dtype=jnp.float32,
        interpret=True,
    )
    assert o.dtype == jnp.bfloat16 and rel_error(o, o_ref) <= TOL[jnp.bfloat16]
    assert rel_error(s, s_ref) <= 1e-4, rel_error(s, s_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gates_at_the_bound_do_not_overflow(backend):
    """g = -5 at every step of two whole 64-token chunks and a part: e^{-G} would reach e^320 in a chunk."""
    q, k, v, _, beta, state = random_sequence(1, 160, 2, 16, 16, jnp.float32, seed=8)
    g = np.full(q.shape, -5.0, np.float32)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    o, s = chunk_kda_of(q, k, v, g, beta, state, gate_lower_bound=BOUNDED, backend=backend)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gates", sorted(GATES))
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_any_gate_kernels_match_float64_recurrence(backend, gates, with_state):
    """Gates of any size (the bounded kernels give NaN from 16 gates of -6), T = 75 a multiple of neither
    chunk; one compile per kernel (the shapes of test_kda_gates' layer test)."""
    q, k, v, _, beta, state = random_sequence(2, 75, 4, 16, 16, jnp.float32, seed=31)
    g = gates_of(gates, q.shape, seed=32)
    initial = state if with_state else None
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, initial)
    o, s = chunk_kda_of(q, k, v, g, beta, initial, backend=backend)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_error(o, o_ref) <= 1e-4, rel_error(o, o_ref)
    assert rel_error(s, s_ref) <= 1e-4, rel_error(s, s_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_without_in_kernel_l2norm(backend):
    q, k, v, g, beta, state = random_sequence(2, 70, 2, 16, 16, jnp.float32, seed=5)
    q, k = l2(q), 0.7 * l2(k)
    o_ref, s_ref = kda_recurrence(q, k, v, g, beta, state)
    o, s = chunk_kda_of(q, k, v, g, beta, state, use_qk_l2norm=False, gate_lower_bound=BOUNDED, backend=backend)
    assert rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_prefill_then_decode_steps(backend):
    """Prefill 130 tokens with the kernel, decode 4 more with the decode kernel: equal to the recurrence."""
    q, k, v, g, beta, _ = random_sequence(2, 134, 2, 16, 16, jnp.float32, seed=6)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta)
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    prefix = (x[:, :130] for x in (q, k, v, g, beta))
    o, state = chunk_kda(*prefix, gate_lower_bound=BOUNDED, backend=backend)
    assert rel_error(o, o_ref[:, :130]) <= 1e-4
    for t in range(130, 134):
        o_t, state = kda_decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, backend=backend)
        assert rel_error(o_t, o_ref[:, t]) <= 1e-4
    assert rel_error(state, s_ref) <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_gradient_matches_the_recurrence(backend):
    q, k, v, g, beta, state = random_sequence(1, 40, 2, 16, 16, jnp.float32, seed=4)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]

    def loss(fn, q, k, v, g, beta):
        o, s = fn(q, k, v, g, beta)
        return jnp.sum(o * o) + jnp.sum(jnp.sin(s))

    ours = jax.jit(
        jax.grad(
            functools.partial(loss, functools.partial(chunk_kda, gate_lower_bound=BOUNDED, backend=backend)),
            argnums=(0, 1, 2, 3, 4),
        )
    )
    ref = jax.jit(jax.grad(functools.partial(loss, kda_recurrent), argnums=(0, 1, 2, 3, 4)))
    for name, a, b in zip("q k v g beta".split(), ours(*args), ref(*args)):
        assert rel_error(a, b) <= 1e-4, f"d/d{name}: {rel_error(a, b):.2e}"


@pytest.mark.parametrize("size", [16, 37, 64])
def test_unit_lower_inverse_with_equal_keys(size):
    """Equal unit keys, beta 1, no decay: L is all ones below the diagonal, whose powers reach binomial
    sizes (~1e17 at 64 rows); the inverse itself is bidiagonal. It must come out right in fp32."""
    r = np.random.default_rng(size)
    strict = np.tril(np.ones((size, size)), -1) * r.uniform(0.9, 1.0, size=(3, size, size))
    expected = np.linalg.inv(np.eye(size) + strict)
    ours = unit_lower_inverse(jnp.asarray(strict, jnp.float32))
    assert rel_error(ours, expected) <= 1e-5


def _strictly_lower(rng, count, size, equal_keys: bool):
    """count strictly lower [size, size] matrices: random (the delta rule's size) or ~all ones (equal keys)."""
    if equal_keys:
        return np.tril(np.ones((size, size)), -1) * rng.uniform(0.9, 1.0, size=(count, size, size))
    return np.tril(rng.normal(scale=0.3, size=(count, size, size)), -1)


@pytest.mark.parametrize("equal_keys", [False, True], ids=["random", "equal-keys"])
def test_gpu_diagonal_block_inverse_by_row_updates(equal_keys):
    """Phase 1's 16x16 inverse in registers, given L transposed, against numpy's inverse."""
    strict = _strictly_lower(np.random.default_rng(1), 4, 16, equal_keys)
    for L in strict:
        ours = unit_lower_inverse_16(jnp.asarray(L.T, jnp.float32))
        assert rel_error(ours, np.linalg.inv(np.eye(16) + L)) <= 1e-6


@pytest.mark.parametrize("input_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("equal_keys", [False, True], ids=["random", "equal-keys"])
def test_gpu_wy_factors_from_the_inverse_blocks(equal_keys, input_dtype):
    """The merge kernel: w = X kb and u = X (beta v), X = (I + L)^-1 of 64x64 chunks merged from the diagonal
    blocks' inverses and the blocks below them (upper blocks of its input are garbage, never read), against
    numpy's inverse."""
    rng = np.random.default_rng(2)
    strict = _strictly_lower(rng, 6, 64, equal_keys)  # 2 sequence-heads x 3 chunks
    blocks = strict + np.triu(rng.normal(size=strict.shape), 1)
    for i in range(4):
        rows = slice(16 * i, 16 * i + 16)
        blocks[:, rows, rows] = np.linalg.inv(np.eye(16) + strict[:, rows, rows])
    kb = rng.normal(size=(6, 64, 32))
    v = rng.normal(size=(1, 3 * 64, 2, 16)).astype(np.float32)  # [B, Tp, H, V]: heads 0, 1 are the two rows
    beta = rng.uniform(0.05, 1.0, size=(1, 3 * 64, 2, 1)).astype(np.float32)
    w, u = wy_factors(
        jnp.asarray(blocks.reshape(2, 3 * 64, 64), jnp.float32),
        jnp.asarray(kb.reshape(2, 3 * 64, 32), jnp.float32),
        jnp.asarray(v),
        jnp.asarray(beta),
        parts_dtype=jnp.float32,
        input_dtype=input_dtype,
        interpret=True,
    )
    inverse = np.linalg.inv(np.eye(64) + strict)
    beta_v = np.moveaxis(beta * v, 2, 0).reshape(6, 64, 16)
    assert rel_error(np.asarray(w).reshape(6, 64, 32), inverse @ kb) <= 1e-5
    assert rel_error(np.asarray(u).reshape(6, 64, 16), inverse @ beta_v) <= 1e-5


@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "as-given"])
def test_gpu_sub_block_keys_match_float64(l2norm):
    """Phase 1's keys kernel: every 16-row sub-block's keys decayed to its end, k_s e^{t_j - G_s} (G the
    cumulative gate inside the sub-block, t_j its total), and the totals in log2 units, against float64."""
    _, k, _, g, _, _ = random_sequence(2, 128, 3, 32, 16, jnp.float32, seed=21)
    right, totals = sub_block_keys(
        jnp.asarray(k),
        jnp.asarray(g),
        use_qk_l2norm=l2norm,
        parts_dtype=jnp.float32,
        tiles=IntraTiles(block_k=16, num_warps=2, num_stages=1, factors_num_warps=2),
        interpret=True,
    )
    flat = lambda x: np.moveaxis(np.asarray(x, np.float64), 2, 1).reshape(6, 8, 16, -1)  # noqa: E731
    keys, gates = flat(l2(k) if l2norm else k), flat(g)
    total = gates.sum(axis=2, keepdims=True)
    expected = keys * np.exp(total - np.cumsum(gates, axis=2))
    # t_j - G_s is a difference of fp32 sums of up to 16 gates (to -80): ~1e-5 of rounding in the exponent
    assert rel_error(np.asarray(right).reshape(expected.shape), expected) <= 1e-5
    assert rel_error(np.asarray(totals).reshape(6, 8, 32), total[:, :, 0] / np.log(2.0)) <= 1e-6


def chunk_parts_float64(q, k, v, g, beta, scale, chunk=64):
    """Phase 1's parts (`ChunkParts`, as [B*H, T, ...] float64) from q, k [B, T, H, K] (normalised), v, g, beta
    [B, T, H] with T a multiple of the chunk, literally: per chunk G = cumsum(g), decays e^{G_c - G_s} in
    float64."""
    batch, length, heads, _ = q.shape
    flat = lambda x: np.moveaxis(np.asarray(x, np.float64), 2, 1).reshape(batch * heads, length, -1)  # noqa: E731
    q, k, v, g, beta = (flat(x) for x in (q, k, v, g, beta))
    parts = {name: [] for name in ("w", "u", "qg", "kg", "a_qk", "decay_last")}
    lower = np.tril(np.ones((chunk, chunk)))
    for rows in (slice(start, start + chunk) for start in range(0, length, chunk)):
        G = np.cumsum(g[:, rows], axis=1)  # [BH, 64, K]
        with np.errstate(over="ignore", invalid="ignore"):
            decay = np.exp(G[:, :, None, :] - G[:, None, :, :])  # [BH, c, s, K]; overflows only where masked
            a_kk = np.einsum("bck,bsk,bcsk->bcs", k[:, rows], k[:, rows], decay)
            a_kk = np.nan_to_num(a_kk * (lower - np.eye(chunk)))
            a_qk = np.nan_to_num(np.einsum("bck,bsk,bcsk->bcs", q[:, rows], k[:, rows], decay) * lower)
        transform = np.linalg.inv(np.eye(chunk) + beta[:, rows] * a_kk) * beta[:, rows, 0][:, None, :]  # T
        parts["w"].append(transform @ (np.exp(G) * k[:, rows]))
        parts["u"].append(transform @ v[:, rows])
        parts["qg"].append(np.exp(G) * q[:, rows] * scale)
        parts["kg"].append(np.exp(G[:, -1:] - G) * k[:, rows])
        parts["a_qk"].append(a_qk * scale)
        parts["decay_last"].append(np.exp(G[:, -1:]))
    return {name: np.concatenate(x, axis=1) for name, x in parts.items()}


def check_parts(
    dtype, key_dim, value_dim, interpret, tolerance, any_gate=False, phase1=intra_chunk, tiles=None, chunk=64
):
    q, k, v, g, beta, _ = random_sequence(1, 128, 2, key_dim, value_dim, dtype, seed=13)
    g[:, :64] *= 0.02  # the first chunk's decay_last far from fp32's underflow (e^-160 for the full range)
    # the second chunk at the gate bound, or for any gate the safe gate mixed with -A softplus(a)
    g[:, 64:] = gates_of("safe-mixed", g[:, 64:].shape, seed=14) if any_gate else -5.0
    parts = phase1(
        *(jnp.asarray(x, dtype) for x in (q, k, v)),
        jnp.asarray(g),
        jnp.asarray(beta)[..., None],
        scale=key_dim**-0.5,
        parts_dtype=jnp.float32,
        interpret=interpret,
        tiles=tiles,
        **({"any_gate": True} if any_gate else {}),  # the lab's phase 1s: bounded gates only
    )
    expected = chunk_parts_float64(l2(q), l2(k), v, g, beta[..., None], key_dim**-0.5, chunk)
    for name, ours in parts._asdict().items():
        ours = np.asarray(ours).reshape(expected[name].shape)
        error = rel_error(ours, expected[name])
        assert np.isfinite(ours).all() and error <= tolerance, (name, error)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("key_dim, value_dim", [(16, 32), (64, 32)], ids=["one-column-block", "column-blocks"])
def test_gpu_chunk_parts_match_float64(dtype, key_dim, value_dim):
    """Phase 1 alone (its three kernels), each part against the literal float64 form, one chunk of slow decay
    and one at the gate bound: a failing part names the kernel at fault (keys and blocks: a_qk, qg, kg,
    decay_last; WY factors: w, u; the keys kernel also has its own test)."""
    check_parts(
        dtype,
        key_dim,
        value_dim,
        interpret=True,
        tolerance=1e-6,  # exact fp32 products when interpreted
        tiles=INTRA_16,
    )  # several column blocks at 64 keys


def test_gpu_any_gate_chunk_parts_match_float64():
    """The same for the any-gate kernels, gates far below -5 in the second chunk, over four column blocks."""
    check_parts(jnp.float32, 64, 32, interpret=True, tolerance=1e-6, any_gate=True, tiles=INTRA_16)


@gpu_test("the compiled Triton kernels")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compiled_gpu_chunk_parts_full_width(dtype, phase1=intra_chunk):
    """The same compiled at K = V = 128: tf32 products for bf16 inputs, IEEE fp32 ones for fp32 inputs."""
    tolerance = TOL[dtype] if dtype == jnp.bfloat16 else 1e-5
    check_parts(dtype, 128, 128, interpret=False, tolerance=tolerance, phase1=phase1)


@pytest.mark.parametrize("backend", ["reference", "interpret_gpu"])
def test_correlated_keys_without_decay(backend):
    """Early in training keys are alike and gates near 0: forward and gradient stay exact (a power-series
    inverse of the chunk's (I + L) blew the gradient up to 1e13 on a GPU)."""
    q, k, v, _, _, _ = random_sequence(2, 150, 2, 16, 16, jnp.float32, seed=11)
    k = np.ones_like(k) + 0.05 * k
    g = np.full(q.shape, -1e-3, np.float32)
    beta = np.full(q.shape[:3], 0.95, np.float32)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]

    def loss(fn, *xs):
        o, s = fn(*xs)
        return jnp.sum(o * o) + jnp.sum(jnp.sin(s))

    ours = jax.jit(
        jax.value_and_grad(
            functools.partial(loss, functools.partial(chunk_kda, gate_lower_bound=BOUNDED, backend=backend)),
            argnums=(0, 1, 2),
        )
    )(*args)
    ref = jax.jit(jax.value_and_grad(functools.partial(loss, kda_recurrent), argnums=(0, 1, 2)))(*args)
    assert abs(float(ours[0]) - float(ref[0])) <= 1e-4 * abs(float(ref[0]))
    for name, a, b in zip("q k v".split(), ours[1], ref[1]):
        assert rel_error(a, b) <= 1e-4, f"d/d{name}: {rel_error(a, b):.2e}"


def abstract_inputs(batch=1, length=1000, heads=4, dim=128):
    shape = jax.ShapeDtypeStruct
    return (
        shape((batch, length, heads, dim), jnp.bfloat16),
        shape((batch, length, heads, dim), jnp.bfloat16),
        shape((batch, length, heads, dim), jnp.bfloat16),
        shape((batch, length, heads, dim), jnp.float32),
        shape((batch, length, heads), jnp.float32),
    )


@pytest.mark.parametrize("name", ["tpu_mosaic", "tpu_mosaic_any_gate"])
def test_tpu_kernel_lowers_for_tpu(name):
    lowered = (
        jax.jit(functools.partial(kernel("chunk_kda", name), scale=128**-0.5))
        .trace(*abstract_inputs())
        .lower(lowering_platforms=("tpu",))
    )
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize(
    "name, shape",
    [
        ("gpu_triton", (1, 1000, 4)),
        ("gpu_triton", (1, 32768, 64)),
        ("gpu_triton_any_gate", (1, 1000, 4)),
    ],
    ids=["T1000-H4", "T32768-H64", "any-gate-T1000-H4"],
)
def test_gpu_kernel_lowers_for_cuda(name, shape, phase1=("intra_blocks", "intra_wy_factors")):
    prefill = functools.partial(kernel("chunk_kda", name), scale=128**-0.5)
    text = lower_for_cuda(prefill, *abstract_inputs(*shape)).as_text()
    for stage in (*phase1, "inter_chunk"):
        assert f"kda_prefill_{stage}" in text, stage


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernel needs a GPU; it runs on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compiled_gpu_kernel_full_width(dtype, variant=None):
    q, k, v, g, beta, state = random_sequence(2, 1000, 4, 128, 128, dtype, seed=11)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
    o, s = chunk_kda_of(q, k, v, g, beta, state, dtype, gate_lower_bound=BOUNDED, backend="pallas_gpu", variant=variant)
    err_o, err_s = rel_error(o, o_ref), rel_error(s, s_ref)
    print(f"compiled GPU prefill {variant}, {jnp.dtype(dtype).name} inputs: o {err_o:.1e}, final state {err_s:.1e}")
    assert err_o <= TOL[dtype] and err_s <= TOL[dtype], (err_o, err_s)  # bf16/tf32 products for bf16 inputs


@gpu_test("the compiled any-gate Triton kernels")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compiled_gpu_any_gate_kernel_full_width(dtype):
    """Every gate kind through the kernel chunk_kda picks without a gate bound (one compile)."""
    q, k, v, _, beta, state = random_sequence(2, 1000, 4, 128, 128, dtype, seed=11)
    for gates in sorted(GATES):
        g = gates_of(gates, q.shape, seed=12)
        o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta, state)
        o, s = chunk_kda_of(q, k, v, g, beta, state, dtype, backend="pallas_gpu")
        err_o, err_s = rel_error(o, o_ref), rel_error(s, s_ref)
        print(f"compiled any-gate GPU prefill, {jnp.dtype(dtype).name}, {gates}: o {err_o:.1e}, state {err_s:.1e}")
        assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(s)).all(), gates
        assert err_o <= TOL[dtype] and err_s <= TOL[dtype], (gates, err_o, err_s)


@gpu_test("fla's Triton chunk_kda")
def test_compiled_gpu_kernel_matches_fla(name="gpu_triton"):
    """bf16 inputs at K = V = 128 against fla 0.6.0's chunk_kda (torch, on the same GPU): both round their
    per-chunk factors to bf16, so they agree to ~5e-3 (BENCHMARKS.md), not to fp32 rounding."""
    torch = pytest.importorskip("torch")
    fla_chunk_kda = pytest.importorskip("fla.ops.kda").chunk_kda
    q, k, v, g, beta, state = random_sequence(1, 1000, 4, 128, 128, jnp.bfloat16, seed=17)
    as_torch = lambda x, dtype=torch.float32: torch.from_numpy(np.ascontiguousarray(x)).cuda().to(dtype)  # noqa: E731
    fla_o, fla_s = fla_chunk_kda(
        *(as_torch(x, torch.bfloat16) for x in (q, k, v)),
        as_torch(g),
        as_torch(beta),
        initial_state=as_torch(state),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, s = kernel("chunk_kda", name)(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
        jnp.asarray(g),
        jnp.asarray(beta),
        jnp.asarray(state),
        scale=128**-0.5,
    )
    err_o = rel_error(o.astype(jnp.float32), fla_o.float().cpu().numpy())
    err_s = rel_error(s, fla_s.float().cpu().numpy())
    print(f"{name} vs fla chunk_kda, bf16: o {err_o:.1e}, final state {err_s:.1e}")
    assert err_o <= 5e-3 and err_s <= 5e-3, (err_o, err_s)


def test_long_sequence_is_stable():
    """8192 tokens through the jnp chunked path in fp32: finite, and equal to the float64 recurrence."""
    q, k, v, g, beta, _ = random_sequence(1, 8192, 1, 16, 16, jnp.float32, seed=12)
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta)
    o, s = jax.jit(kda_chunked)(*(jnp.asarray(x) for x in (q, k, v, g, beta)))
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4
