"""The jnp KDA forms (chunked and recurrent) against the float64 delta-rule recurrence of np_reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import l2, rel_error
from np_reference import kda_recurrence

from pallas_kernels.kda import reference as kda

# jitted: one compile per shape instead of every jnp op's own (eager) compile
kda_chunked, kda_recurrent = jax.jit(kda.kda_chunked), jax.jit(kda.kda_recurrent)
FORMS = {"chunked": kda_chunked, "recurrent": kda_recurrent}


def random_inputs(length, *, batch=2, heads=3, key_dim=16, value_dim=8, gate_floor=-5.0, seed=0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(batch, length, heads, key_dim))
    k = r.normal(size=(batch, length, heads, key_dim))
    v = r.normal(size=(batch, length, heads, value_dim))
    g = gate_floor * r.uniform(0.0, 1.0, size=(batch, length, heads, key_dim))
    beta = r.uniform(0.05, 1.0, size=(batch, length, heads))
    state = r.normal(size=(batch, heads, key_dim, value_dim))
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state):
    return kda_recurrence(l2(q), l2(k), v, g, beta, state)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_float64_recurrence_fp32(form, length, with_state):
    q, k, v, g, beta, state = random_inputs(length, seed=length)
    initial = state if with_state else None
    o_ref, s_ref = reference(q, k, v, g, beta, initial)
    o, s = FORMS[form](
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)),
        initial_state=None if initial is None else jnp.asarray(initial, jnp.float32),
    )
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert rel_error(o, o_ref) <= 1e-4, rel_error(o, o_ref)
    assert rel_error(s, s_ref) <= 1e-4, rel_error(s, s_ref)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_bf16_inputs(form):
    q, k, v, g, beta, state = random_inputs(77, seed=7)
    o_ref, s_ref = reference(q, k, v, g, beta, state)
    o, s = FORMS[form](
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
        jnp.asarray(g, jnp.float32),
        jnp.asarray(beta, jnp.float32),
        initial_state=jnp.asarray(state, jnp.float32),
    )
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_error(o, o_ref) <= 2e-2 and rel_error(s, s_ref) <= 2e-2


def test_gates_at_the_safe_bound_do_not_overflow():
    """g = -5 everywhere for two full chunks: cumulative decay reaches -640, far past fp32's exp range."""
    q, k, v, _, beta, state = random_inputs(128, seed=3)
    g = np.full(q.shape, -5.0)
    o_ref, s_ref = reference(q, k, v, g, beta, state)
    o, s = kda_chunked(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)), initial_state=jnp.asarray(state, jnp.float32)
    )
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_error(o, o_ref) <= 1e-4 and rel_error(s, s_ref) <= 1e-4


def test_prefill_then_steps_equals_longer_prefill():
    q, k, v, g, beta, _ = random_inputs(70, seed=11)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    o_all, s_all = kda_chunked(*args)
    o_pre, state = kda_chunked(*(x[:, :66] for x in args))
    outputs = [o_pre]
    for t in range(66, 70):
        o_t, state = kda_recurrent(*(x[:, t : t + 1] for x in args), initial_state=state)
        outputs.append(o_t)
    assert rel_error(jnp.concatenate(outputs, axis=1), o_all) <= 1e-5
    assert rel_error(state, s_all) <= 1e-5


def test_identity_tokens_leave_the_state_alone():
    """g = 0 and beta = 0 (how padding is expressed) must not touch the state."""
    q, k, v, g, beta, state = random_inputs(9, seed=5)
    g[:, 3:6], beta[:, 3:6] = 0.0, 0.0
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    _, s_full = kda_chunked(*args, initial_state=jnp.asarray(state, jnp.float32))
    keep = np.r_[0:3, 6:9]
    _, s_skip = kda_chunked(*(x[:, keep] for x in args), initial_state=jnp.asarray(state, jnp.float32))
    assert rel_error(s_full, s_skip) <= 1e-6


def test_few_tokens_conv_matches_the_chunk_form():
    """A decode step's or verify pass's short convs (over one joined copy, `kda._joined_conv`) equal the chunk form's
    (`kda._conv`: each part read where it lies), pads anywhere, a row of pads, the new window too."""
    from ling_jax import kda as layer
    from ling_jax.policy import ExecutionPolicy

    r = np.random.default_rng(7)
    batch, length, width, taps = 4, 5, 6, 4
    qkv = [jnp.asarray(r.normal(size=(batch, length, width)), jnp.float32) for _ in range(3)]
    window = jnp.asarray(r.normal(size=(batch, taps - 1, 3 * width)), jnp.float32)
    weight = jnp.asarray(r.normal(size=(3, width, taps)), jnp.float32)
    mask = jnp.asarray(r.uniform(size=(batch, length)) < 0.6).at[0].set(True).at[1].set(False)
    policy = ExecutionPolicy(kernel_backend="reference")
    for m in (mask, None):
        joined, joined_window = layer._joined_conv(qkv, window, weight, m)
        chunked, chunked_window = layer._conv(qkv, window, weight, m, policy)
        for a, b in zip([*joined, joined_window], [*chunked, chunked_window], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
