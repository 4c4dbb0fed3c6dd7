"""The scheduler and engine in-process on the demo checkpoint: more requests than slots, mixed prompt lengths
(one and several prefill chunks), greedy and seeded sampling; each output equals the request run alone through
`Generator`, no slot is left taken, and a cancelled request frees its slot at the next step."""

from __future__ import annotations

import pytest
from helpers import gpu_test

from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import GREEDY, Engine
from ling_jax.serving.scheduler import Finish, QueueFull, Request, Scheduler

MAX_BATCH, MAX_CONTEXT, CHUNK, BUDGET = 3, 96, 16, 32  # two prompts' chunks per prefill step
CASES = [  # (prompt ids, sampling, max_tokens)
    ([5, 17, 300, 42, 9, 1000, 77], GREEDY, 9),
    (list(range(100, 141)), SamplingParams(temperature=0.8, top_p=0.9, seed=3), 7),  # three chunks: 16 + 16 + 16
    ([400, 12, 13], SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3, seed=11), 5),
    (list(range(2000, 2019)), SamplingParams(temperature=0.7, min_p=0.05, seed=5), 8),  # two chunks
    ([33, 34], GREEDY, 3),
]


@pytest.fixture(scope="module")
def scheduler(demo_model, demo_tokenizer):
    engine = Engine(
        demo_model, max_batch=MAX_BATCH, max_context=MAX_CONTEXT, prefill_chunk=CHUNK, prefill_budget=BUDGET
    )
    engine.warm_up()
    return Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=8)


def _request(case, sink: list) -> Request:
    prompt, sampling, max_tokens = case
    return Request(prompt=prompt, sampling=sampling, max_tokens=max_tokens, emit=sink.append)


def _run_until_idle(scheduler: Scheduler, limit: int = 200) -> int:
    for step in range(limit):
        if not scheduler.waiting and not any(scheduler.slots):
            return step
        scheduler._step()
    raise AssertionError(f"still busy after {limit} steps")


def test_more_requests_than_slots_each_equal_alone(scheduler, alone, demo_tokenizer):
    _check_each_equals_alone(scheduler, alone, demo_tokenizer)


@gpu_test("the serving engine over the GPU kernels (Pallas KDA / MLA decode, fused MoE)")
def test_on_the_gpu_each_equals_alone(demo_model, demo_tokenizer, alone):
    engine = Engine(
        demo_model, max_batch=MAX_BATCH, max_context=MAX_CONTEXT, prefill_chunk=CHUNK, prefill_budget=BUDGET
    )
    engine.warm_up()
    scheduler = Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=8)
    _check_each_equals_alone(scheduler, alone, demo_tokenizer)


def _check_each_equals_alone(scheduler, alone, demo_tokenizer):
    sinks = [[] for _ in CASES]
    requests = [_request(case, sink) for case, sink in zip(CASES, sinks)]
    for request in requests:
        scheduler.submit(request)
    _run_until_idle(scheduler)
    reference = alone(CHUNK)
    for case, request, sink in zip(CASES, requests, sinks):
        expected = reference(*case)
        assert request.tokens == expected, case
        assert [t for d in sink for t in d.token_ids] == expected
        assert sink[-1].finish in (Finish.LENGTH, Finish.STOP) and all(d.finish is None for d in sink[:-1])
        assert "".join(d.text for d in sink) == demo_tokenizer.decode(expected)
    assert scheduler.slots == [None] * MAX_BATCH and not scheduler.waiting
    assert scheduler.engine._params == [GREEDY] * MAX_BATCH  # every slot released


def test_cancelled_request_frees_its_slot_at_the_next_step(scheduler):
    sink = []
    request = _request((list(range(50, 60)), GREEDY, 40), sink)
    scheduler.submit(request)
    while len(request.tokens) < 3:
        scheduler._step()
    scheduler.cancel(request)
    scheduler._step()
    assert request.slot is not None and scheduler.slots[request.slot] is None
    assert sink[-1].finish is Finish.CANCELLED and len(request.tokens) < 10


def test_full_queue_is_refused(scheduler):
    requests = [_request(([7, 8, 9], GREEDY, 1), []) for _ in range(MAX_BATCH + scheduler.max_queue)]
    for request in requests:
        scheduler.submit(request)
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.submit(_request(([7, 8, 9], GREEDY, 1), []))
    with pytest.raises(ValueError, match="got 90 prompt tokens and max_tokens 7"):
        scheduler.submit(_request(([7] * 90, GREEDY, 7), []))
    _run_until_idle(scheduler)
    assert all(len(r.tokens) == 1 for r in requests)
