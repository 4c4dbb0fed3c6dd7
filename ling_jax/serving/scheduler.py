"""Continuous batching: one thread drives the `Engine`, admitting requests into free slots at step boundaries.

Each iteration of the loop
1. drops the requests cancelled since the last one (a disconnected client): their slots are free at once;
2. admits waiting requests (first come, first served) into free slots;
3. runs one prefill step: the next chunk of the oldest request still in prefill and of others whose next
   chunk has the same length, as many as the engine's token budget allows (a last chunk also samples the
   request's first token), so a long prompt delays the running requests by one step per chunk; with a
   prefix cache, a request is admitted with the pages of its longest cached prefix shared into its page
   table and resumes after it, and each whole block it prefills is cached (its pages shared, not copied);
4. dispatches one decode program of every decoding slot, then hands each request its tokens of the program
   before (read while this one runs on the device, so the host's work overlaps the device's): one decode step
   while anything else waits (a request to admit, a prompt chunk, a prompt's logprobs) or a grammar request
   decodes, else the engine's `decode_steps` steps in one program, each slot stopping on the device at its
   max_tokens or its end token (EOS unless ignored, its stop token ids: handed to the engine with its first
   token); with MTP a step (a speculative round) gives each request one to K + 1 tokens. A request takes
   its tokens in order up to the one that ends it (EOS, a stop string, max_tokens): none past it is streamed.

A request that ends in program k still runs in program k + 1, already dispatched (within its pages: it stops at
its max_tokens; after an EOS or stop token it runs no step at all, but after a stop string it runs); those tokens
are dropped and the slot is free at the next iteration's admission (the next request's prefill runs after it on
the device).

A request's tokens go through its `Completion` (incremental detokenising, stop strings) and out through its
`emit` callback as `Delta`s; the request ends at EOS (not emitted), at a stop string, at `max_tokens` or when
cancelled, and its slot is free for the next iteration's admission. The waiting queue is bounded: `submit`
raises `QueueFull` once `max_queue` requests wait beyond the free slots.

A request with a grammar (structured outputs) hands each decode step the bitmask of the tokens its grammar allows
next, computed from its matcher once the step before's token is taken: while one decodes, a step's tokens are read
before the next step is dispatched (the batch gives up the host / device overlap) and the request ends, finish
`stop`, once its grammar is complete.

A request with `siblings` (the other choices of an OpenAI request's `n`) is admitted with a slot for each of them
and prefilled once: after its last chunk each sibling's slot becomes a copy of its slot (`Engine.fork`: the
prompt's whole pages shared, the rest copied) and draws its own first token, then they decode as rows of their own.
A request ends at EOS unless it has `ignore_eos`, and at any of its `stop_ids`; its `cached_tokens` are the prompt
tokens its prefix-cache hit skipped.

A request whose sampling asks for logprobs gets each token's (`TokenLogprob`) on the delta that carries the token;
one with `prompt_logprobs` first gets a delta with its prompt's (`Engine.prompt_logprobs`, computed when it is
admitted). A request of `max_tokens` 0 gets only that delta (its last, finish `length`) and never takes a slot.

A request with images (`media`, a VL model) runs them through the vision tower when it is admitted
(`Engine.media_prefill`: its chunks' merged embeddings and mRoPE positions, and its slot's decode offset); each of
its chunks is a prefill step of its own, and it neither reads nor writes the prefix cache (its ids do not tell
which image its pad tokens stand for).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import jax
import numpy as np

from ling_jax.generation.completion import Completion
from ling_jax.generation.generator import MediaInputs, NewTokens
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import StopChecker, Tokenizer
from ling_jax.serving.engine import Engine
from ling_jax.serving.metrics import Metrics
from ling_jax.serving.prefix_cache import Node, PrefixCache

if TYPE_CHECKING:
    from ling_jax.serving.structured import Matcher

IDLE_WAIT_S = 0.05  # how long the loop sleeps when there is nothing to run (a submit wakes it at once)


class QueueFull(Exception):
    """The bounded waiting queue has no room; the client should retry later."""


class Finish(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # the client went away


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and the request's `logprobs` most likely tokens at its position, (id, logprob) each."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request produced in one step: new text, the token ids behind it (with their logprobs when the
    request asks), and the finish reason once done; the prompt's logprobs (its tokens after the first) on a
    delta of their own, the request's first."""

    text: str
    token_ids: tuple[int, ...]
    finish: Finish | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One completion: prompt ids, sampling, limits and where its output goes (`emit`, called on the
    scheduler's thread)."""

    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    emit: Callable[[Delta], None]
    stop: tuple[str, ...] = ()
    prompt_logprobs: bool = False  # emit the prompt's logprobs first (OpenAI's echo with logprobs)
    media: MediaInputs | None = None  # a VL prompt's images (one row; `ling_jax.serving.media`)
    grammar: Matcher | None = None  # structured outputs: the grammar its tokens follow, ending it when complete
    ignore_eos: bool = False  # EOS is a token like any other
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request as EOS does
    siblings: list[Request] = dataclasses.field(default_factory=list)  # more choices, forked after the prefill
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    _chunks: list = dataclasses.field(default_factory=list)  # prompt chunks not prefilled yet
    _media_chunks: list = dataclasses.field(default_factory=list)  # their embeddings and positions (media)
    _position: int = 0  # prompt tokens in the slot so far
    _node: Node | None = None  # the prefix-cache node of the prompt's blocks so far
    _completion: Completion | None = None


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        eos_ids: Collection[int],
        max_queue: int,
        metrics: Metrics | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        mismatched = prefix_cache is not None and (
            engine.prefix_block != prefix_cache.block or prefix_cache.pool is not engine.pages
        )
        if mismatched:
            raise ValueError("the prefix cache's blocks and pages must be the engine's (its prefill chunks and pool)")
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.metrics = metrics or Metrics()
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * engine.max_batch
        self.steps = 0  # loop iterations that ran a program
        self._in_flight: tuple[NewTokens, list[Request]] | None = None  # the last decode step and its requests
        self._scoring: list[Request] = []  # admitted requests whose prompt logprobs are due
        self._firsts: list[tuple[Request, NewTokens]] = []  # first tokens drawn on the device, not read yet
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the loop, if it crashed

    # --- the HTTP side (any thread) -------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; ValueError for one that cannot run, QueueFull when the queue is full."""
        if request.stop:
            StopChecker(request.stop)  # raises on an empty stop string
        if len(request.siblings) >= self.engine.max_batch:
            raise ValueError(f"a request's choices decode together: at most {self.engine.max_batch} (the slots)")
        room = self.engine.max_context - len(request.prompt)
        if not request.prompt or not 0 <= request.max_tokens <= room or room < 1:
            raise ValueError(
                f"a request needs 1 to {self.engine.max_context - 1} prompt tokens and 0 <= max_tokens <= the rest of "
                f"the context; got {len(request.prompt)} prompt tokens and max_tokens {request.max_tokens}"
            )
        with self._lock:
            if self._stopping or self.error is not None:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) - self.slots.count(None) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting for a slot)")
            self.waiting.append(request)
            self.metrics.queue_depth.set(len(self.waiting))
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """The client is gone: the request ends at the next step boundary (its slot freed then)."""
        with self._lock:
            request.cancelled = True
            self._lock.notify()

    def busy_slots(self) -> int:
        return sum(r is not None for r in self.slots)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ling-serve-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the loop (the scheduler's thread) -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # the device failed: every request still here ends, the server reports it
            self.error = e
            for request in [*self.waiting, *filter(None, self.slots)]:
                self._emit(request, Delta("", (), Finish.CANCELLED))
            raise

    def _step(self) -> bool:
        """One iteration; False once stopping with nothing left to run."""
        with self._lock:
            self._drop_cancelled()
            self._admit()
            scoring, self._scoring = self._scoring, []
            if not any(self.slots) and self._in_flight is None and not scoring:
                if self._stopping:
                    return False
                self._lock.wait(IDLE_WAIT_S)
                return True
        for request in scoring:
            self._score(request)
        prefilling = sorted((r for r in self.slots if r is not None and r._chunks), key=lambda r: r.submitted_at)
        if prefilling:
            length = len(prefilling[0]._chunks[0][0])  # the oldest request's next chunk, and others of its length
            group = [r for r in prefilling if len(r._chunks[0][0]) == length and r.media is None]
            if prefilling[0].media is not None:  # a prompt with images prefills alone
                group = prefilling[:1]
            self._prefill_step(group[: self.engine.prefill_rows(length)])
        drawn = {id(r) for r, _ in self._firsts}  # their first token is on the device: they decode this step
        decoding = [r for r in self.slots if r is not None and not r._chunks and (r.tokens or id(r) in drawn)]
        previous, self._in_flight = self._in_flight, None
        if previous is not None and any(r.grammar is not None for r in decoding):
            self._take_step(*previous)  # a grammar's next bitmask needs its last token: this step waits for it
            previous, decoding = None, [r for r in decoding if self.slots[r.slot] is r]
        if decoding:
            active_B = np.zeros(self.engine.max_batch, bool)
            active_B[[r.slot for r in decoding]] = True
            bitmasks = {r.slot: r.grammar.bitmask() for r in decoding if r.grammar is not None}
            steps = 1 if bitmasks or self._pending() else self.engine.decode_steps
            self._in_flight = (self.engine.decode(active_B, bitmasks=bitmasks, steps=steps), decoding)
        self._take_firsts()
        if previous is not None:
            self._take_step(*previous)
        self.steps += 1
        self.metrics.steps.inc()
        return True

    def _pending(self) -> bool:
        """Whether anything but decoding waits for the next step boundary: a request to admit, a prompt chunk, a
        prompt's logprobs."""
        return bool(self.waiting or self._scoring or any(r is not None and r._chunks for r in self.slots))

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
        for request in self.slots:
            if request is not None and request.cancelled:
                self._finish(request, Finish.CANCELLED)
        self.metrics.queue_depth.set(len(self.waiting))

    def _admit(self) -> None:
        for request in [r for r in self.waiting if not r.max_tokens]:  # prompt logprobs only: no slot
            self.waiting.remove(request)
            self._scoring += [request, *request.siblings]
        free = [slot for slot, occupant in enumerate(self.slots) if occupant is None]
        while self.waiting and len(self.waiting[0].siblings) < len(free):  # a slot for every choice
            request = self.waiting.popleft()
            for member in (request, *request.siblings):
                member.slot = free.pop(0)
                member._completion = Completion(self.tokenizer, StopChecker(member.stop) if member.stop else None)
                self.slots[member.slot] = member
                if member.prompt_logprobs:
                    self._scoring.append(member)
            self._resume(request)
            request.cached_tokens = request._position
            request._chunks = self.engine.prompt_chunks(request.prompt, request._position)
            if request.media is not None:
                request._media_chunks = self.engine.media_prefill(request.slot, request._chunks, request.media)
            self.metrics.prompt_tokens.inc(len(request.prompt))
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.running_batch.set(self.busy_slots())

    def _score(self, request: Request) -> None:
        """Emit the prompt's logprobs if the request asks (a request of max_tokens 0 ends here)."""
        if request.cancelled:
            return
        rows = None
        if request.prompt_logprobs:
            logprobs, k = self.engine.prompt_logprobs(request.prompt), request.sampling.logprobs
            rows = tuple(_token_logprob(logprobs, (row,), token, k) for row, token in enumerate(request.prompt[1:]))
        finish = None if request.max_tokens else Finish.LENGTH
        if finish is not None:
            self.metrics.requests.labels(str(finish)).inc()
        self._emit(request, Delta("", (), finish, prompt_logprobs=rows))

    def _resume(self, request: Request) -> None:
        """Give the request's slot its pages, the cached ones of its longest cached prefix first, and restore
        that prefix's end into the slot now (a later insert may evict it)."""
        caching = self.prefix_cache is not None and request.media is None  # images: neither read nor cached
        path = self.prefix_cache.match(request.prompt) if caching else []
        shared = [page for node in path for page in node.pages]
        self.engine.assign(request.slot, shared, len(request.prompt) + request.max_tokens)
        if caching:
            request._node = path[-1] if path else self.prefix_cache.root
        if path:
            request._position = len(path) * self.prefix_cache.block
            self.engine.restore(request.slot, [node.state for node in path], request.prompt[: request._position])
            self.metrics.prefix_hits.inc()
            self.metrics.prefix_hit_tokens.inc(request._position)

    def _prefill_step(self, requests: list[Request]) -> None:
        """One prefill chunk of each of `requests` (chunks of one length) in one program."""
        chunks = [r._chunks.pop(0) for r in requests]
        starts = [r._position for r in requests]
        media = requests[0]._media_chunks.pop(0) if requests[0].media is not None else None
        hidden_PD = self.engine.prefill([r.slot for r in requests], chunks, [start == 0 for start in starts], media)
        self.metrics.prefill_steps.inc()
        self.metrics.prefill_tokens.inc(sum(len(ids) for ids, _ in chunks))
        for row, (request, (_, mask_C), start) in enumerate(zip(requests, chunks, starts)):
            real = int(mask_C.sum())
            request._position += real
            cache = self.prefix_cache
            if cache is not None and real == cache.block and request._node is not None:
                state, pages = self.engine.snapshot(request.slot, start), self.engine.block_pages(request.slot, start)
                request._node = cache.insert(request._node, request.prompt[start : start + real], state, pages)
                self.metrics.prefix_bytes.set(cache.nbytes)
            if not request._chunks:
                siblings, request.siblings = request.siblings, []
                for sibling in siblings:  # before the request's first token changes its slot
                    if self.slots[sibling.slot] is sibling:
                        tokens = len(request.prompt) + sibling.max_tokens
                        self.engine.fork(request.slot, sibling.slot, len(request.prompt), tokens)
                        sibling._position = request._position
                for member in (request, *siblings):
                    if self.slots[member.slot] is member:
                        self._first_token(member, hidden_PD[row : row + 1])

    def _first_token(self, request: Request, hidden_1D: jax.Array) -> None:
        """Draw the request's first token from its prompt's last hidden state (within its grammar). It is read once
        this step's decode program is dispatched (`_take_firsts`), which already decodes the request: the device
        runs the prefill, the first token and the decode back to back while the host waits for the token. A request
        with a grammar takes it now (its next bitmask needs it)."""
        bitmask_W = None if request.grammar is None else request.grammar.bitmask()
        end_ids = self._end_ids(request)
        self._firsts.append(
            (request, self.engine.first_token(request.slot, hidden_1D, request.sampling, bitmask_W, end_ids))
        )
        if request.grammar is not None:
            self._take_firsts()

    def _take_firsts(self) -> None:
        """Read and take the first tokens drawn since the last call (`_first_token`). One that ends its request
        (an end token, a stop string, max_tokens 1) frees the slot; a decode program dispatched with the slot
        stops it on the device at its end token or capacity, and its tokens for the slot are ignored."""
        firsts, self._firsts = self._firsts, []
        for request, first in firsts:
            first = jax.device_get(first)
            request.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(request.first_token_at - request.submitted_at)
            self._take_row(request, first, 0)

    def _take_step(self, new: NewTokens, decoding: list[Request]) -> None:
        """A decode step's tokens (`Engine.decode`), read once the next step is dispatched: each request still in
        its slot takes its tokens in order, up to the one that ends it (one that ended meanwhile, or whose slot
        was taken since, ignores the step)."""
        new = jax.device_get(new)
        for request in decoding:
            if self.slots[request.slot] is request and new.rounds_B is not None:
                rounds = int(new.rounds_B[request.slot])
                self.metrics.mtp_drafted.inc(self.engine.mtp * rounds)
                self.metrics.mtp_accepted.inc(int(new.counts_B[request.slot]) - rounds)
            self._take_row(request, new, request.slot)

    def _take_row(self, request: Request, new: NewTokens, row: int) -> None:
        """The request's new tokens at `row` of `new` (on the host), in order, while it holds its slot."""
        for column, token in enumerate(new.tokens_BT[row, : new.counts_B[row]]):
            if self.slots[request.slot] is not request:
                break
            k = request.sampling.logprobs
            logprob = None if k is None else _token_logprob(new.logprobs, (row, column), int(token), k)
            self._take(request, int(token), logprob)

    def _take(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        """The request's next token (with its logprob, if it asks): emit its text, or end the request."""
        self.metrics.count_tokens(1)
        if token in self._end_ids(request):
            self._finish(request, Finish.STOP)
            return
        if request.grammar is not None:
            request.grammar.accept(token)
        request.tokens.append(token)
        logprobs = () if logprob is None else (logprob,)
        if request._completion.add([token]) or (request.grammar is not None and request.grammar.done):
            self._finish(request, Finish.STOP, token, logprobs)
        elif len(request.tokens) >= request.max_tokens:
            self._finish(request, Finish.LENGTH, token, logprobs)
        else:
            self._emit(request, Delta(request._completion.unshown(), (token,), logprobs=logprobs))

    def _end_ids(self, request: Request) -> frozenset[int]:
        """The tokens that end the request: EOS unless it ignores it, and its stop token ids."""
        return request.stop_ids if request.ignore_eos else request.stop_ids | self.eos_ids

    @staticmethod
    def _emit(request: Request, delta: Delta) -> None:
        """Hand a delta to the request's consumer; one that fails (its client is gone) cancels the request."""
        try:
            request.emit(delta)
        except Exception:
            request.cancelled = True

    def _finish(
        self, request: Request, finish: Finish, token: int | None = None, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        """End the request and free its slot now; the last delta carries `token` (not emitted yet) with its
        `logprobs` and the rest of the text."""
        self.engine.release(request.slot)
        self.slots[request.slot] = None
        for sibling in request.siblings:  # choices not forked yet: they never will be
            if self.slots[sibling.slot] is sibling:
                self._finish(sibling, Finish.CANCELLED)
        self.metrics.running_batch.set(self.busy_slots())
        self.metrics.requests.labels(str(finish)).inc()
        if finish is Finish.CANCELLED:
            self._emit(request, Delta("", (), finish))
            return
        request._completion.finish(request.tokens)
        if len(request.tokens) > 1:
            self.metrics.tpot.observe((time.perf_counter() - request.first_token_at) / (len(request.tokens) - 1))
        token_ids = () if token is None else (token,)
        self._emit(request, Delta(request._completion.unshown(), token_ids, finish, logprobs))


def _token_logprob(logprobs, at: tuple[int, ...], token: int, k: int) -> TokenLogprob:
    """The `TokenLogprob` of `token` at index `at` of host `Logprobs` ([B, T] / [L] arrays), with its top k."""
    top = zip(logprobs.top_ids[at][:k].tolist(), logprobs.top[at][:k].tolist())
    return TokenLogprob(token, float(logprobs.chosen[at]), tuple(top))
