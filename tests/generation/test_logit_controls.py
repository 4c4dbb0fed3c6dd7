"""OpenAI's logit controls (presence / frequency penalties, logit bias, min_tokens) against numpy on random logits
of an odd vocabulary, and through `sample`: a +100 bias forces its token, -100 bans it, greedy or sampled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.generation.logit_controls import LogitControls, apply_logit_controls, count_tokens
from ling_jax.generation.sampling import SamplingArrays, SamplingParams, sample

VOCAB = 37  # odd: no power-of-two shapes
PARAMS = [  # one row without controls, one penalised, one biased with its end tokens held back until 3 tokens
    SamplingParams(),
    SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
    SamplingParams(presence_penalty=-1.5, logit_bias=((5, 100.0), (36, -2.5), (0, 0.25)), min_tokens=3, end_ids=(2, 9)),
]


def test_controls_equal_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, VOCAB)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(3, VOCAB)) * (rng.random((3, VOCAB)) < 0.3)
    steps = np.array([5, 5, 2])
    expected = logits.astype(np.float64)
    for row, p in enumerate(PARAMS):
        expected[row] -= p.presence_penalty * (counts[row] > 0) + p.frequency_penalty * counts[row]
        for token, bias in p.logit_bias:
            expected[row, token] += bias
        if steps[row] < p.min_tokens:
            expected[row, list(p.end_ids)] = -np.inf
    apply = jax.jit(apply_logit_controls)
    controls = LogitControls.from_params(PARAMS)
    got = apply(jnp.asarray(logits), controls, jnp.asarray(steps), jnp.asarray(counts, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[0]), logits[0])  # a row without controls is untouched
    released = apply(jnp.asarray(logits), controls, jnp.asarray([5, 5, 3]), jnp.asarray(counts, jnp.int32))
    assert np.isfinite(np.asarray(released)).all()  # min_tokens reached: the end tokens are back
    none = apply(jnp.asarray(logits), LogitControls.from_params([SamplingParams()] * 3), 0, None)
    np.testing.assert_array_equal(np.asarray(none), logits)


def test_count_tokens():
    counts = count_tokens(jnp.zeros((2, VOCAB), jnp.int32), jnp.array([3, 3]))
    counts = np.asarray(count_tokens(counts, jnp.array([3, 4])))
    assert counts[0, 3] == 2 and counts[1, 3] == counts[1, 4] == 1 and counts.sum() == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bias_forces_and_bans_a_token(temperature):
    logits = jax.random.normal(jax.random.key(1), (4, VOCAB)) * 3
    best = np.asarray(jnp.argmax(logits, -1))
    seen = jnp.zeros((4, VOCAB), bool)
    forced = [SamplingParams(temperature=temperature, seed=s, logit_bias=((11, 100.0),)) for s in range(4)]
    tokens = jax.jit(sample)(logits, SamplingArrays.from_params(forced), 0, seen)
    np.testing.assert_array_equal(tokens, [11] * 4)
    banned = [
        SamplingParams(temperature=temperature, seed=s, logit_bias=((int(b), -100.0),)) for s, b in enumerate(best)
    ]
    for step in range(8):
        tokens = jax.jit(sample)(logits * 0.1, SamplingArrays.from_params(banned), step, seen)
        assert not np.any(np.asarray(tokens) == best)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, "--presence-penalty must be in [-2, 2]"),
        ("frequency_penalty", float("nan"), "--frequency-penalty must be in [-2, 2]"),
        ("logit_bias", ((1, 101.0),), "--logit-bias values must be in [-100, 100]"),
        ("logit_bias", ((-1, 1.0),), "--logit-bias keys must be token ids"),
        ("logit_bias", tuple((t, 1.0) for t in range(301)), "--logit-bias takes at most 300 tokens"),
        ("min_tokens", -1, "--min-tokens must be an integer >= 0"),
    ],
)
def test_bad_controls_name_the_flag(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})
