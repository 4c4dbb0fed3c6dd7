"""Sampling: filters against hand-computed kept sets, greedy rows, per-request keys, draw statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.generation.sampling import (
    MAX_LOGPROBS,
    SamplingArrays,
    SamplingParams,
    apply_repetition_penalty,
    process_logits,
    sample,
    seen_from_prompts,
    token_logprobs,
    update_seen,
)

VOCAB = 512
# known probabilities, scattered over the vocabulary so that sort order and token order differ
KNOWN_PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
KNOWN_IDS = np.array([7, 300, 2, 451, 99])

sample_jit = jax.jit(sample)
process_jit = jax.jit(process_logits)


def random_logits(batch, seed=0, scale=3.0):
    return jax.random.normal(jax.random.key(seed), (batch, VOCAB)) * scale


def no_seen(batch, vocab=VOCAB):
    return jnp.zeros((batch, vocab), bool)


def known_logits():
    logits = np.full((1, VOCAB), -np.inf, np.float32)
    logits[0, KNOWN_IDS] = np.log(KNOWN_PROBS)
    return jnp.asarray(logits)


def kept_ids(**params):
    processed = process_jit(known_logits(), SamplingArrays.from_params([SamplingParams(**params)]), no_seen(1))
    return set(np.flatnonzero(np.isfinite(np.asarray(processed[0]))).tolist())


def first_ids(count):
    """Ids of the `count` most probable known tokens."""
    return set(KNOWN_IDS[:count].tolist())


def test_top_k_1_is_greedy():
    logits = random_logits(8)
    arrays = SamplingArrays.from_params([SamplingParams(temperature=1.3, top_k=1, seed=s) for s in range(8)])
    for step in range(3):
        np.testing.assert_array_equal(sample_jit(logits, arrays, step, no_seen(8)), jnp.argmax(logits, -1))


def test_temperature_0_is_argmax_whatever_the_seed_and_filters():
    logits = random_logits(6, seed=1)
    params = [SamplingParams(temperature=0, seed=s, top_k=3 * s, top_p=1.0 - 0.1 * s, min_p=0.05 * s) for s in range(6)]
    tokens = sample_jit(logits, SamplingArrays.from_params(params), jnp.arange(6) * 7, no_seen(6))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
    assert tokens.dtype == jnp.int32


def draw_sequence(seed, steps=16, **params):
    logits = random_logits(1, seed=2, scale=1.0)
    arrays = SamplingArrays.from_params([SamplingParams(seed=seed, **params)])
    return [int(sample_jit(logits, arrays, step, no_seen(1))[0]) for step in range(steps)]


def test_fixed_seed_reproducible_other_seed_differs():
    assert draw_sequence(5) == draw_sequence(5)
    assert draw_sequence(5) != draw_sequence(6)
    assert len(set(draw_sequence(5))) > 1  # the step index changes the key


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(temperature=0.8, top_k=20, min_p=0.02, repetition_penalty=1.3, seed=11),
        SamplingParams(temperature=0, repetition_penalty=1.3),
    ],
)
def test_request_tokens_do_not_depend_on_the_batch(target):
    logits = random_logits(1, seed=3)
    seen = jnp.zeros((1, VOCAB), bool).at[0, :40].set(True)
    others = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.5, top_p=0.8, seed=2),
        SamplingParams(temperature=0),
        SamplingParams(top_k=5, seed=3),
    ]
    for step in (0, 4):
        alone = sample_jit(logits, SamplingArrays.from_params([target]), step, seen)[0]
        for other in others:
            # the target sits in row 1, next to a row with other logits and parameters and its own step
            batch_logits = jnp.concatenate([random_logits(1, seed=9), logits])
            batch_seen = jnp.concatenate([no_seen(1), seen])
            arrays = SamplingArrays.from_params([other, target])
            together = sample_jit(batch_logits, arrays, jnp.array([17, step]), batch_seen)[1]
            assert int(together) == int(alone), (step, other)


@pytest.mark.parametrize("top_p, count", [(0.3, 1), (0.65, 2), (0.71, 3), (0.86, 4), (0.96, 5), (1.0, 5)])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, count):
    assert kept_ids(top_p=top_p) == first_ids(count)


def test_top_p_sums_what_top_k_kept():
    # after top-k = 2 the probabilities are 0.4/0.7 = 0.571 and 0.429: p = 0.55 is reached by the first alone
    assert kept_ids(top_p=0.55) == first_ids(2)
    assert kept_ids(top_k=2, top_p=0.55) == first_ids(1)
    assert kept_ids(top_k=3) == first_ids(3)
    assert kept_ids(top_k=VOCAB + 10) == first_ids(5)


@pytest.mark.parametrize("min_p, count", [(0.0, 5), (0.2, 4), (0.3, 3), (0.5, 2), (0.9, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_fraction_of_top(min_p, count):
    # thresholds min_p * 0.4: 0.08 keeps 0.1 (4 tokens), 0.12 keeps 0.15, 0.2 keeps 0.3, 0.36 only 0.4
    assert kept_ids(min_p=min_p) == first_ids(count)


def test_filters_compose_and_temperature_scales_the_kept_logits():
    # at temperature 0.5 the probabilities become 0.561, 0.316, 0.079, 0.035, 0.009: top-p 0.9 keeps three
    # (it keeps four at temperature 1), min-p 0.1 (threshold 0.056) keeps the same three
    arrays = SamplingArrays.from_params([SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1)])
    processed = process_jit(known_logits(), arrays, no_seen(1))
    expected = np.full(VOCAB, -np.inf, np.float32)
    expected[KNOWN_IDS[:3]] = np.log(KNOWN_PROBS[:3]) / 0.5
    np.testing.assert_allclose(processed[0], expected, rtol=1e-6)


def test_repetition_penalty_rule():
    logits = jnp.array([[2.0, -2.0, 2.0, -2.0, 0.0]])
    seen = jnp.array([[True, True, False, False, True]])
    penalised = apply_repetition_penalty(logits, seen, jnp.array([2.0]))
    np.testing.assert_array_equal(penalised, [[1.0, -4.0, 2.0, -2.0, 0.0]])
    # a penalty below 1 rewards seen tokens
    np.testing.assert_array_equal(
        apply_repetition_penalty(logits, seen, jnp.array([0.5])), [[4.0, -1.0, 2.0, -2.0, 0.0]]
    )


def test_repetition_penalty_changes_the_greedy_choice():
    logits = jnp.array([[3.0, 2.0, -1.0, -0.6]])
    seen = jnp.array([[True, False, False, True]])
    greedy = SamplingArrays.from_params([SamplingParams(temperature=0, repetition_penalty=2.0)])
    assert int(sample_jit(logits, greedy, 0, seen)[0]) == 1
    np.testing.assert_allclose(process_jit(logits, greedy, seen), [[1.5, 2.0, -1.0, -1.2]], rtol=1e-6)


def test_seen_mask_from_prompts_ignores_pads_and_updates():
    ids = jnp.array([[0, 0, 5, 6], [3, 4, 4, 1]])
    mask = jnp.array([[False, False, True, True], [True, True, True, True]])
    seen = jax.jit(seen_from_prompts, static_argnums=2)(ids, mask, 8)
    expected = np.zeros((2, 8), bool)
    expected[0, [5, 6]] = True
    expected[1, [1, 3, 4]] = True
    np.testing.assert_array_equal(seen, expected)
    expected[0, 2] = expected[1, 7] = True
    np.testing.assert_array_equal(jax.jit(update_seen)(seen, jnp.array([2, 7])), expected)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_k=4),
        dict(temperature=1.5, top_p=0.8, min_p=0.1),
    ],
)
def test_draws_follow_the_filtered_softmax(params):
    draws = 20000
    logits_V = jnp.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    arrays = SamplingArrays.from_params([SamplingParams(seed=1234, **params)] * draws)
    # one request per row, all with the same seed: each row's step index gives it a different key
    tokens = sample_jit(jnp.broadcast_to(logits_V, (draws, 8)), arrays, jnp.arange(draws), no_seen(draws, 8))
    counts = np.bincount(np.asarray(tokens), minlength=8)

    scaled = np.asarray(logits_V, np.float64) / params["temperature"]
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    kept = np.zeros(8, bool)
    if "top_k" in params:
        kept[order[: params["top_k"]]] = True
    else:
        mass_before = np.cumsum(probs[order]) - probs[order]
        kept[order[mass_before < params["top_p"]]] = True
        kept &= probs >= params["min_p"] * probs.max()
    expected = np.where(kept, probs, 0.0)
    expected /= expected.sum()

    assert counts[~kept].sum() == 0
    chi_square = np.sum((counts[kept] - draws * expected[kept]) ** 2 / (draws * expected[kept]))
    # <= 5 degrees of freedom: 30 is beyond the 99.99th percentile
    assert chi_square < 30, (counts, draws * expected)


def test_new_values_do_not_recompile():
    traces = []

    @jax.jit
    def step(logits, arrays, steps, seen):
        traces.append(1)
        return sample(logits, arrays, steps, seen)

    logits = random_logits(2)
    for params in (
        [SamplingParams(), SamplingParams(temperature=0)],
        [SamplingParams(top_p=0.5, seed=3), SamplingParams(top_k=7, min_p=0.1, repetition_penalty=1.2)],
    ):
        step(logits, SamplingArrays.from_params(params), jnp.zeros(2, jnp.int32), no_seen(2))
    assert len(traces) == 1


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(temperature=-1), "--temperature must be >= 0, got -1"),
        (dict(temperature=float("nan")), "--temperature"),
        (dict(top_k=-2), "--top-k must be an integer >= 0"),
        (dict(top_k=2.5), "--top-k"),
        (dict(top_p=0.0), r"--top-p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), "--top-p"),
        (dict(min_p=-0.1), r"--min-p must be in \[0, 1\]"),
        (dict(repetition_penalty=0), "--repetition-penalty must be > 0"),
        (dict(seed=-1), r"--seed must be an integer in \[0, 2\*\*32\)"),
        (dict(seed=2**32), "--seed"),
        (dict(logprobs=-1), r"--logprobs must be an integer in \[0, 20\], got -1"),
        (dict(logprobs=21), "--logprobs"),
    ],
)
def test_validate_names_the_flag(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_validate_accepts_edges():
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=1.0, repetition_penalty=0.5, seed=2**32 - 1).validate()
    with pytest.raises(ValueError, match="at least one request"):
        SamplingArrays.from_params([])


def test_logprobs_are_the_raw_log_softmax_and_skipped_when_no_row_asks():
    """Whatever a row samples with (penalty, temperature, filters), its logprobs are the raw logits'."""
    logits = jax.random.normal(jax.random.key(0), (3, VOCAB)) * 3
    params = [
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, seed=1),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1, seed=2, logprobs=MAX_LOGPROBS),
    ]
    arrays = SamplingArrays.from_params(params)
    seen = update_seen(jnp.zeros((3, VOCAB), bool), jnp.array([1, 2, 3]))
    tokens = sample_jit(logits, arrays, 0, seen)
    logprobs = jax.jit(token_logprobs)(logits, tokens, arrays)
    expected = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(logprobs.chosen, expected[np.arange(3), tokens], rtol=1e-6)
    np.testing.assert_allclose(logprobs.top, -np.sort(-expected, axis=-1)[:, :MAX_LOGPROBS], rtol=1e-6)
    np.testing.assert_array_equal(np.take_along_axis(expected, np.asarray(logprobs.top_ids), 1), logprobs.top)
    none = token_logprobs(logits, tokens, SamplingArrays.from_params([SamplingParams()] * 3))
    assert not np.any(none.chosen) and not np.any(none.top) and none.top.shape == (3, MAX_LOGPROBS)


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0)] * 3,
        [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)],
        [SamplingParams(temperature=0), SamplingParams(top_k=5, seed=4), SamplingParams(top_p=0.7, seed=9)],
        [SamplingParams(temperature=0.8, seed=2), SamplingParams(temperature=0, presence_penalty=0.5)],
        [SamplingParams(temperature=0, logit_bias=((5, 30.0),)), SamplingParams(min_tokens=4, end_ids=(3, 11))],
    ],
    ids=["greedy", "greedy-logprobs", "sampled-filters", "sampled-penalties", "bias-min-tokens"],
)
def test_specialised_programs_give_the_general_tokens_and_leave_out_unused_steps(params):
    """`SamplingArrays.from_params(specialise=True)` traces only the steps some row uses: the same tokens and
    logprobs as the general program (every step behind its lax.cond), on random logits, seen and counted tokens;
    an all-greedy batch without logprobs traces no conditional at all."""
    batch = len(params)
    logits = random_logits(batch, seed=batch)
    seen = jax.random.bernoulli(jax.random.key(1), 0.05, (batch, VOCAB))
    counts = jax.random.poisson(jax.random.key(2), 0.05, (batch, VOCAB)).astype(jnp.int32)
    steps = jnp.arange(batch, dtype=jnp.int32) + 1

    def draw(logits, arrays, steps, seen, counts):
        tokens = sample(logits, arrays, steps, seen, counts)
        return tokens, token_logprobs(logits, tokens, arrays)

    general = SamplingArrays.from_params(params)
    specialised = SamplingArrays.from_params(params, specialise=True)
    expected, got = (jax.jit(draw)(logits, a, steps, seen, counts) for a in (general, specialised))
    jax.tree.map(np.testing.assert_array_equal, got, expected)
    conds = str(jax.make_jaxpr(draw)(logits, specialised, steps, seen, counts)).count("cond[")
    assert (conds == 0) == all(p.temperature == 0 and p.logprobs is None and not p.logit_bias for p in params)
