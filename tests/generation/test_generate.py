"""The generation engine: cached greedy == recomputed argmax, grouped decode == the one-step loop, MTP speculation ==
plain decoding, sampling."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling_jax import LingForCausalLM
from ling_jax.generation import generator as generator_module
from ling_jax.generation.generator import (
    DECODE_READ_GROUP,
    DecodeState,
    Generator,
    _prefill_chunk,
    default_prefill_chunk,
    prefill_chunks,
)
from ling_jax.generation.sampling import SamplingArrays, SamplingParams, sample, seen_from_prompts, update_seen
from ling_jax.generation.static_model import split_model
from ling_jax.presets import preset
from ling_jax.sharding import make_mesh

GREEDY = SamplingParams(temperature=0.0)
LENGTHS = (5, 1, 20)  # with 16-token chunks the longest prompt is prefilled in two chunks


@pytest.fixture(scope="module")
def model():
    config = preset("tiny").replace(num_nextn_predict_layers=1)
    return LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def two_token_model():
    """Only tokens 3 and 4 get non-zero logits: outputs still depend on every state, and the MTP draft (same
    lm_head) is right often enough to exercise partial and full acceptance."""
    config = preset("tiny").replace(num_nextn_predict_layers=1)
    model = LingForCausalLM(config, rngs=nnx.Rngs(1), dtype=jnp.float32)
    weight = np.zeros(model.lm_head.weight[...].shape, np.float32)
    weight[3:5] = np.asarray(model.lm_head.weight[...])[3:5] * 50
    model.lm_head.weight[...] = jnp.asarray(weight)
    return model


def _prompts(config, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, config.vocab_size, n)] for n in lengths]


@nnx.jit
def _logits(model, ids_BT):
    return model(ids_BT).logits


def _recomputed_argmax(model, prompts, news):
    """The tokens an uncached full forward picks greedily after prompt + new[:i], for each row and i: the model is
    causal (the logits at a position depend on the tokens up to it only), so one forward over prompt + new gives
    them all, where a forward per step would recompute the same prefixes again; and the rows, padded at their
    end, go in one batch: a pad after a position does not change its logits."""
    rows = [prompt + new for prompt, new in zip(prompts, news)]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = tokens
    argmax = np.asarray(jnp.argmax(_logits(model, jnp.asarray(ids)), axis=-1))
    return [
        [int(t) for t in argmax[row, len(prompt) - 1 : len(prompt) - 1 + len(new)]]
        for row, (prompt, new) in enumerate(zip(prompts, news))
    ]


@functools.partial(jax.jit, static_argnums=0)
def _forward_and_draw(graphdef, params, ids_BT, mask_BT, cache, seen_BV, arrays, steps_B):
    out = nnx.merge(graphdef, params)(ids_BT, cache=cache, attention_mask=mask_BT)
    token_B = sample(out.logits[:, -1], arrays, steps_B, seen_BV)
    return token_B, out.cache, update_seen(seen_BV, token_B)


def _one_step_loop(model, prompts, sampling, max_new_tokens):
    """The decode loop written out one step at a time: the left-padded batch prefilled in one forward, then one
    forward and one draw per token (step s draws with the row's seed and s), every row to max_new_tokens."""
    batch, width = len(prompts), max(map(len, prompts))
    ids = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, True
    graphdef, params = nnx.split(model)
    arrays = SamplingArrays.from_params(sampling)
    cache = model.init_cache(batch_size=batch, max_length=width + max_new_tokens)
    seen = seen_from_prompts(jnp.asarray(ids), jnp.asarray(mask), model.config.vocab_size)
    token, cache, seen = _forward_and_draw(graphdef, params, ids, mask, cache, seen, arrays, jnp.zeros(batch, int))
    columns = [np.asarray(token)]
    for step in range(1, max_new_tokens):
        token, cache, seen = _forward_and_draw(
            graphdef, params, token[:, None], np.ones((batch, 1), bool), cache, seen, arrays, jnp.full(batch, step)
        )
        columns.append(np.asarray(token))
    return np.stack(columns, axis=1).tolist()


def test_default_prefill_chunk_splits_8192_tokens_over_the_prompts():
    """generate.py's --prefill-chunk default: 8192 tokens a call for one prompt (and --interactive's none yet), 4096 a
    row for two, never below the fixed 2048 of before."""
    assert [default_prefill_chunk(rows) for rows in (0, 1, 2, 3, 4, 5, 64)] == [
        8192,
        8192,
        4096,
        2048,
        2048,
        2048,
        2048,
    ]


def test_prefill_chunks_cover_the_prompt_with_few_shapes():
    assert prefill_chunks(5, 2048) == [16]
    assert prefill_chunks(100, 2048) == [128]
    assert prefill_chunks(4096, 2048) == [2048, 2048]
    assert prefill_chunks(4100, 2048) == [16, 2048, 2048]
    # past 2048 tokens, two head pieces where they pad less than one: 5,000 tokens in 5,120 slots, not 8,192
    assert prefill_chunks(5000, 8192) == [4096, 1024]
    assert prefill_chunks(8192 + 3000, 8192) == [2048, 1024, 8192]
    assert prefill_chunks(6500, 8192) == [8192]  # 4096 + 4096 pads as much
    assert prefill_chunks(1500, 8192) == [2048]  # a short head stays one compiled shape
    for longest in (1, 17, 999, 2049, 4097, 6143, 8191, 12289, 40000):
        chunks = prefill_chunks(longest, 8192)
        assert sum(chunks) >= longest and len(chunks) <= 2 + longest // 8192
        assert all(c & (c - 1) == 0 and 16 <= c <= 8192 for c in chunks)
        head = longest % 8192
        assert head <= 2048 or sum(chunks) - longest < head // 2  # a long head pads under half its tokens


def test_cached_greedy_equals_recomputed_argmax_for_ragged_prompts(model):
    prompts = _prompts(model.config)
    out, stats = Generator(model, prefill_chunk=16).generate(prompts, [GREEDY] * 3, 10)
    assert all(len(new) == 10 for new in out)
    assert out == _recomputed_argmax(model, prompts, out)
    assert stats.prompt_tokens == sum(LENGTHS) and stats.generated_tokens == 30


def test_grouped_decode_equals_the_one_step_loop(model):
    """Greedy and seeded sampled rows (temperature, top-p, top-k, repetition penalty) in one ragged batch: the
    Generator's programs of DECODE_READ_GROUP steps give the one-step loop's tokens, with max_new_tokens not a
    multiple of the group (the last program's extra steps dropped) and with rows ending at an EOS early. Every
    max_new_tokens here shares one cache length: after the first call nothing compiles, a short last group
    included."""
    prompts = _prompts(model.config)
    sampling = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.2, top_k=20, repetition_penalty=1.3, seed=2),
    ]
    new = 2 * DECODE_READ_GROUP + 3  # the prefill's token, then programs of 8 steps: 8, 8 and 2 of 8 kept
    reference = _one_step_loop(model, prompts, sampling, new)
    generator = Generator(model, prefill_chunk=16)
    assert generator.generate(prompts, sampling, new)[0] == reference
    for short in (1, 2, DECODE_READ_GROUP + 1, DECODE_READ_GROUP + 2):
        out, stats = generator.generate(prompts, sampling, short)
        assert out == [r[:short] for r in reference] and stats.compile_s == 0
    eos = reference[0][3]
    ended = [r[: r.index(eos)] if eos in r else r for r in reference]
    assert len(ended[0]) <= 3
    assert generator.generate(prompts, sampling, new, eos_ids=[eos])[0] == ended


def test_batching_does_not_change_a_prompt_output(model):
    prompts = _prompts(model.config)
    generator = Generator(model, prefill_chunk=16)
    together, _ = generator.generate(prompts, [GREEDY] * 3, 6)
    assert together == [generator.generate([p], [GREEDY], 6)[0][0] for p in prompts]


@pytest.mark.parametrize("drafts", [1, 3])
def test_mtp_greedy_is_token_identical_and_reports_acceptance(two_token_model, drafts):
    prompts = _prompts(two_token_model.config)
    plain, _ = Generator(two_token_model, prefill_chunk=16).generate(prompts, [GREEDY] * 3, 16)
    speculative, stats = Generator(two_token_model, prefill_chunk=16, mtp=drafts).generate(prompts, [GREEDY] * 3, 16)
    print(f"K={drafts}: {stats.summary()}")
    assert speculative == plain
    assert 0 < stats.accepted < stats.drafted  # both accepted and rejected drafts were exercised


def test_mtp_rows_stop_on_the_device(two_token_model, monkeypatch):
    """Programs of several rounds stop each row on the device at its EOS or its max_new_tokens: the tokens a row's
    programs hand the host run exactly to its EOS (included) or its last token, none past it, and their drafts
    are the rounds it ran; the output is the plain decode's up to the EOS."""
    prompts = _prompts(two_token_model.config)
    plain, _ = Generator(two_token_model, prefill_chunk=16).generate(prompts, [GREEDY] * 3, 16)
    eos = plain[0][5]
    programs = []
    group = generator_module._speculative_group

    def recording(*args):
        new, state = group(*args)
        programs.append(jax.device_get(new))
        return new, state

    monkeypatch.setattr(generator_module, "_speculative_group", recording)
    out, stats = Generator(two_token_model, prefill_chunk=16, mtp=3).generate(prompts, [GREEDY] * 3, 16, eos_ids=[eos])
    assert out == [r[: r.index(eos)] if eos in r else r for r in plain]
    from_device = [[t for p in programs for t in p.tokens_BT[row, : p.counts_B[row]].tolist()] for row in range(3)]
    assert from_device == [r[1 : r.index(eos) + 1] if eos in r else r[1:] for r in plain]
    assert stats.drafted == 3 * sum(int(p.rounds_B.sum()) for p in programs)
    # a program gives a running row at least one token a round: none is dispatched once those in flight end every row
    assert len(programs) <= -(-(16 - 1) // DECODE_READ_GROUP)


def test_mtp_sampling_is_identical_to_plain_sampling(model):
    """Sampled and greedy, with the penalties: each verified position sees the drafts before it as generated."""
    prompts = _prompts(model.config)
    penalties = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 1.5}
    settings = [SamplingParams(temperature=0.9 * s, top_p=0.9, seed=s, **penalties) for s in range(3)]
    plain, _ = Generator(model, prefill_chunk=16).generate(prompts, settings, 8)
    speculative, _ = Generator(model, prefill_chunk=16, mtp=2).generate(prompts, settings, 8)
    assert speculative == plain


def test_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    prompts = _prompts(model.config)
    generator = Generator(model, prefill_chunk=16)
    hot = [SamplingParams(temperature=1.5, seed=7)] * 3
    first, _ = generator.generate(prompts, hot, 8)
    assert generator.generate(prompts, hot, 8)[0] == first
    assert generator.generate(prompts, [SamplingParams(temperature=1.5, seed=8)] * 3, 8)[0] != first
    greedy, _ = generator.generate(prompts, [GREEDY] * 3, 8)
    assert generator.generate(prompts, [SamplingParams(temperature=1.0, top_k=1, seed=3)] * 3, 8)[0] == greedy


def test_eos_and_stop_callback_end_rows(model):
    prompts = _prompts(model.config)
    generator = Generator(model, prefill_chunk=16)
    full, _ = generator.generate(prompts, [GREEDY] * 3, 8)
    eos = full[0][3]
    out, _ = generator.generate(prompts, [GREEDY] * 3, 8, eos_ids=[eos])
    assert out[0] == full[0][: full[0].index(eos)]
    seen = []
    out, _ = generator.generate(prompts, [GREEDY] * 3, 8, on_tokens=lambda row, ids: seen.append((row, ids)) or True)
    assert out == [f[:1] for f in full] and sorted(seen) == [(r, f[:1]) for r, f in enumerate(full)]


def test_sharded_generation_equals_unsharded(model):
    """The sharded generator's greedy tokens are the unsharded model's: its recomputed argmax (one uncached forward
    over the rows, `_recomputed_argmax`, the reference `Generator` itself equals above), not an unsharded `Generator`
    compiled for this batch of 4 (its prefill, first-token and decode programs: three compiles for one)."""
    prompts = _prompts(model.config, lengths=(5, 1, 20, 9))
    sharded_model = LingForCausalLM(model.config, rngs=nnx.Rngs(0), dtype=jnp.float32)  # the fixture's weights
    generator = Generator(sharded_model, prefill_chunk=16, mtp=1, mesh=make_mesh({"data": 2, "expert": 4}))
    sharded, _ = generator.generate(prompts, [GREEDY] * 4, 6)
    assert all(len(new) == 6 for new in sharded)
    assert sharded == _recomputed_argmax(model, prompts, sharded)


def test_clear_errors(model):
    generator = Generator(model, prefill_chunk=16)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's context of {limit}"):
        generator.generate([[3] * (limit - 2)], [GREEDY], 8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generator.generate([[3], []], [GREEDY] * 2, 4)
    with pytest.raises(ValueError, match="outside"):
        generator.generate([[model.config.vocab_size]], [GREEDY], 4)
    no_mtp = LingForCausalLM(model.config.replace(num_nextn_predict_layers=0), rngs=nnx.Rngs(0), dtype=jnp.float32)
    with pytest.raises(ValueError, match="--mtp needs a model with an MTP layer"):
        Generator(no_mtp, mtp=2)
    with pytest.raises(ValueError, match="--prefill-chunk"):
        Generator(model, prefill_chunk=4)


def test_prefill_chunk_memory_stays_bounded_up_to_262144_tokens():
    """A 2048-token prefill chunk compiles at the 3.1-flash context (262,144 cache slots) and its temporary
    memory grows by less than the cache itself does from 8192 slots: attention is blocked, never a
    [chunk, context] score matrix (2 GiB per head at fp32)."""
    config = preset("tiny").replace(max_position_embeddings=262144)
    model = LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    static, leaves = split_model(model)
    ids = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 2048), jnp.bool_)

    def memory(slots):
        state = jax.eval_shape(
            lambda: DecodeState.create(
                model.init_cache(batch_size=1, max_length=slots), jnp.zeros((1, config.vocab_size), bool)
            )
        )
        analysis = _prefill_chunk.trace(static, leaves, state, ids, mask, ids, mask).lower().compile().memory_analysis()
        return analysis.temp_size_in_bytes, analysis.argument_size_in_bytes

    (temp_short, args_short), (temp_long, args_long) = memory(8192), memory(262144)
    assert temp_long - temp_short < args_long - args_short
    assert temp_long < 2048 * 262144 * 4 // 8
