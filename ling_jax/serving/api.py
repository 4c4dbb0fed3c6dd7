"""The HTTP API: OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events or whole),
/v1/models, /health and /metrics, over a running `Scheduler`; ops.py adds the tokenizer routes, the API key
and the request-size limit.

A request is checked, tokenised and submitted from the event loop; the scheduler's thread hands its deltas
back through `loop.call_soon_threadsafe` into the request's asyncio queue. A streaming client that goes away
cancels its request (the slot is freed at the scheduler's next step); so does one waiting for a whole response.
A completions request with a list of prompts submits one request per prompt and answers one choice per prompt;
with `n` > 1, each prompt's request carries its other choices as siblings (decoded from its one prefill), and
choice i of prompt p has `index` p * n + i, as OpenAI and vLLM number them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ling_jax.generation.generator import MediaInputs
from ling_jax.generation.sampling import SEED_LIMIT
from ling_jax.generation.tokenizer import Tokenizer
from ling_jax.serving.chat import render_chat
from ling_jax.serving.media import MediaReader, encode_with_images, split_images
from ling_jax.serving.ops import DEFAULT_MAX_REQUEST_BYTES, check_model, mount
from ling_jax.serving.reasoning import THINK_START, ReasoningSplitter, marks_reasoning, split_reasoning
from ling_jax.serving.scheduler import Delta, Finish, QueueFull, Request, Scheduler, TokenLogprob
from ling_jax.serving.schemas import APIError, ChatBody, CompletionBody, parse
from ling_jax.serving.structured import grammar_of
from ling_jax.serving.tool_calls import (
    NO_TOOLS,
    Content,
    Event,
    ToolCallName,
    ToolCallParser,
    ToolPlan,
    parse_reply,
    plan_tools,
)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
ROLE_END = "<|role_end|>"  # Ling's end of a turn: the model sometimes spells it out as text


@dataclasses.dataclass
class Service:
    """What the routes serve: the scheduler, the tokenizer, the model's name and the context limit; the API key
    (None: none needed) and the request-size limit."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    media: MediaReader | None = None  # a VL model's image reader (None: a text model, image parts refused)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class _Prepared:
    prompt: list[int]
    max_tokens: int
    in_reasoning: bool = False  # the rendered chat prompt already opened the reasoning
    tools: ToolPlan = NO_TOOLS
    stops: tuple[str, ...] = ()  # stop strings beyond the request's (the chat template's end of turn)
    echo: str | None = None  # the prompt's text, which the completion's text starts with (`echo`)
    media: MediaInputs | None = None  # the chat prompt's images


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="ling-serve", docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(_request: HTTPRequest, error: APIError) -> JSONResponse:
        return error.response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if service.scheduler.error is not None:
            return APIError(503, f"the engine failed: {service.scheduler.error!r}").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.scheduler.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": service.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": "ling-jax",
            "max_model_len": service.max_context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        body = parse(CompletionBody, await request.body())
        return await _respond(service, request, body, _prepare_completion(service, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        body = parse(ChatBody, await request.body())
        return await _respond(service, request, body, [_prepare_chat(service, body)], chat=True)

    mount(app, service)
    return app


def _check_common(service: Service, body, limit: int | None, least: int = 1, field: str = "max_tokens") -> None:
    check_model(service, body.model)
    slots = service.scheduler.engine.max_batch
    if body.n > slots:
        raise APIError(
            400, f"n must be in [1, {slots}] (--max-batch: the choices decode together), got {body.n}", param="n"
        )
    if limit is not None and limit < least:
        with_echo = " (0 with echo)" if least < 1 else ""
        raise APIError(400, f"{field} must be >= {least}{with_echo}, got {limit}", param=field)
    vocab = service.scheduler.engine.config.vocab_size
    unknown = [token for token in body.stop_token_ids or () if token >= vocab]
    if unknown:
        raise APIError(
            400, f"stop_token_ids must be token ids in [0, {vocab}), got {unknown[:5]}", param="stop_token_ids"
        )


def _limits(service: Service, prompt: list[int], limit: int | None, field: str = "max_tokens") -> int:
    vocab = service.scheduler.engine.config.vocab_size
    if not prompt:
        raise APIError(400, "the prompt is empty (it has no tokens)", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"the prompt has token ids outside [0, {vocab}): {bad[:5]}", param="prompt")
    room = service.max_context - len(prompt)
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens; this server's --max-context is "
            f"{service.max_context} (prompt and completion together)",
            param="prompt",
            code="context_length_exceeded",
        )
    if limit is not None and limit > room:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens; with {field} {limit} that exceeds this "
            f"server's --max-context of {service.max_context}",
            param=field,
            code="context_length_exceeded",
        )
    return room if limit is None else limit


def _check_min_tokens(body, max_tokens: int) -> None:
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")


def _prepare_completion(service: Service, body: CompletionBody) -> list[_Prepared]:
    """One request per prompt: `prompt` is a string, a list of token ids, or a list of either."""
    _check_common(service, body, body.max_tokens, least=0 if body.echo else 1)
    batched = isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
    prepared = []
    for prompt in body.prompt if batched else [body.prompt]:
        ids = prompt if isinstance(prompt, list) else service.tokenizer.encode(prompt)
        echo = (prompt if isinstance(prompt, str) else service.tokenizer.decode(ids)) if body.echo else None
        prepared.append(_Prepared(ids, _limits(service, ids, body.max_tokens), echo=echo))
        _check_min_tokens(body, prepared[-1].max_tokens)
    return prepared


def _prepare_chat(service: Service, body: ChatBody) -> _Prepared:
    _check_common(service, body, body.token_limit, field=body.token_limit_field)
    plan = plan_tools(body.tools, body.tool_choice)
    template = service.tokenizer.chat_template
    messages, images = split_images(body.messages, service.media)
    text = render_chat(service.tokenizer, messages, tools=plan.tools, template_kwargs=body.chat_template_kwargs)
    prompt, media = encode_with_images(service.tokenizer, text + plan.prefill, images, service.media)
    in_reasoning = marks_reasoning(template) and text.rstrip().endswith(THINK_START)
    turn_ends = (ROLE_END, service.tokenizer.special_tokens.get("eos_token"))
    stops = tuple(dict.fromkeys(s for s in turn_ends if s and template and s in template))
    max_tokens = _limits(service, prompt, body.token_limit, body.token_limit_field)
    _check_min_tokens(body, max_tokens)
    return _Prepared(prompt, max_tokens, in_reasoning, plan, stops, media=media)


async def _respond(service: Service, request: HTTPRequest, body, prepared: list[_Prepared], *, chat: bool) -> Response:
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
    stop = body.stops()
    if body.n > 1 and any(one.media is not None for one in prepared):
        raise APIError(400, "n > 1 with images is not supported yet: send the request n times", param="n")
    grammar = grammar_of(body, service.tokenizer, service.scheduler.engine)
    vocab = service.scheduler.engine.config.vocab_size
    stop_ids = frozenset(body.stop_token_ids or ())
    eos_ids = () if body.ignore_eos else sorted(service.scheduler.eos_ids)
    end_ids = tuple(dict.fromkeys([*eos_ids, *(body.stop_token_ids or ())]))
    jobs = []
    for one in prepared:
        seed = secrets.randbelow(SEED_LIMIT)
        for choice in range(body.n):
            sampling = body.sampling(seed, vocab, end_ids, choice)
            jobs.append(
                Request(
                    prompt=one.prompt,
                    sampling=sampling,
                    max_tokens=one.max_tokens,
                    stop=stop + one.stops,
                    prompt_logprobs=one.echo is not None and sampling.logprobs is not None,
                    media=one.media,
                    grammar=None if grammar is None else grammar.matcher(),
                    emit=functools.partial(_hand_back, loop, deltas, len(jobs)),
                    ignore_eos=body.ignore_eos,
                    stop_ids=stop_ids,
                )
            )
    groups = jobs[:: body.n]  # each prompt's first choice, with the others as its siblings
    for first, group in enumerate(groups):
        group.siblings = jobs[first * body.n + 1 : (first + 1) * body.n]
    try:
        for job in groups:
            service.scheduler.submit(job)
    except QueueFull as e:
        for job in jobs:
            service.scheduler.cancel(job)
        raise APIError(503, f"{e}; retry later", code="overloaded") from e
    reply = _Reply(service, jobs, prepared, chat=chat, n=body.n)
    if body.stream:
        return StreamingResponse(reply.stream(deltas, body.include_usage), media_type="text/event-stream")
    return await reply.whole(deltas, request)


def _hand_back(loop: asyncio.AbstractEventLoop, deltas: asyncio.Queue, index: int, delta: Delta) -> None:
    """The scheduler's thread hands choice `index` its delta."""
    loop.call_soon_threadsafe(deltas.put_nowait, (index, delta))


class _Reply:
    """Builds the OpenAI objects of one HTTP request (one choice per scheduler request) from their deltas."""

    def __init__(self, service: Service, jobs: list[Request], prepared: list[_Prepared], *, chat: bool, n: int = 1):
        """jobs: n choices per prompt of `prepared`, in order."""
        self.service, self.jobs, self.chat, self.n = service, jobs, chat, n
        self.prepared = [one for one in prepared for _ in range(n)]  # each choice's
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.reasoning = marks_reasoning(service.tokenizer.chat_template) and chat
        self.tools = prepared[0].tools  # chat has one choice; completions have no tools
        self._call_ids: list[str] = []
        self.logprobs = jobs[0].sampling.logprobs is not None
        self.offsets = [0] * len(jobs)  # completions: each choice's text so far, where its next token's text starts
        self.texts: dict[int, str] = {}  # token texts decoded so far

    def _envelope(self, object_name: str, choices: list[dict], usage: dict | None = None) -> dict:
        reply = {
            "id": self.id,
            "object": object_name,
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": choices,
        }
        if usage is not None:
            reply["usage"] = usage
        return reply

    def _usage(self) -> dict:
        """Every choice's completion tokens; each prompt's tokens (and prefix-cache hit) once, however many choices."""
        firsts = self.jobs[:: self.n]
        prompt_tokens = sum(len(job.prompt) for job in firsts)
        completion_tokens = sum(len(job.tokens) for job in self.jobs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(job.cached_tokens for job in firsts)},
        }

    def _cancel(self) -> None:
        for job in self.jobs:
            self.service.scheduler.cancel(job)

    async def whole(self, deltas: asyncio.Queue[tuple[int, Delta]], request: HTTPRequest) -> Response:
        received: list[list[Delta]] = [[] for _ in self.jobs]
        running = len(self.jobs)
        while running:
            try:
                index, delta = await asyncio.wait_for(deltas.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self._cancel()
                    return Response(status_code=499)
                continue
            received[index].append(delta)
            running -= delta.finish is not None
            if delta.finish is Finish.CANCELLED:
                self._cancel()
                raise APIError(500, "the request was cancelled by the server (engine failure or shutdown)")
        choices = [self._whole_choice(index, parts) for index, parts in enumerate(received)]
        return JSONResponse(self._envelope(self.object, choices, self._usage()))

    def _whole_choice(self, index: int, parts: list[Delta]) -> dict:
        text = "".join(delta.text for delta in parts)
        finish = str(parts[-1].finish)
        if not self.chat:
            text = (self.prepared[index].echo or "") + text
            return {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": self._completion_logprobs(index, parts),
            }
        text = self.tools.prefill + text
        in_reasoning = self.prepared[index].in_reasoning
        reasoning, content = split_reasoning(text, in_reasoning=in_reasoning) if self.reasoning else (None, text)
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tools.parses:
            parsed = parse_reply(content, self.tools.string_parameters)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [
                    {"id": self._call_id(i), "type": "function", "function": {"name": name, "arguments": args}}
                    for i, (name, args) in enumerate(parsed.tool_calls)
                ]
                finish = "tool_calls"
        logprobs = self._chat_logprobs([entry for delta in parts for entry in delta.logprobs])
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}

    async def stream(self, deltas: asyncio.Queue[tuple[int, Delta]], include_usage: bool) -> AsyncIterator[str]:
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        splitters = [
            ReasoningSplitter(in_reasoning=one.in_reasoning) if self.reasoning else None for one in self.prepared
        ]
        parsers = [ToolCallParser(self.tools.string_parameters) if self.tools.parses else None for _ in self.jobs]
        running = len(self.jobs)
        try:
            for index in range(len(self.jobs)):
                first = self._first_piece(index)
                if first is not None:
                    yield _event(self._envelope(chunk_object, [{"index": index, **first, "finish_reason": None}]))
                if self.chat:
                    for body in self._chat_bodies(self.tools.prefill, splitters[index], parsers[index], last=False):
                        choice = {"index": index, **body, "finish_reason": None, "logprobs": None}
                        yield _event(self._envelope(chunk_object, [choice]))
            while running:
                index, delta = await deltas.get()
                if delta.finish is Finish.CANCELLED:
                    return
                for piece in self._pieces(index, delta, splitters[index], parsers[index]):
                    yield _event(self._envelope(chunk_object, [{"index": index, **piece, "finish_reason": None}]))
                if delta.finish is not None:
                    running -= 1
                    last = {"delta": {}} if self.chat else {"text": ""}
                    parser = parsers[index]
                    reason = "tool_calls" if parser is not None and parser.calls else str(delta.finish)
                    choice = {"index": index, **last, "finish_reason": reason, "logprobs": None}
                    yield _event(self._envelope(chunk_object, [choice]))
            if include_usage:
                yield _event(self._envelope(chunk_object, [], self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            if running:  # the client went away (or the server is cancelling this stream)
                self._cancel()

    def _first_piece(self, index: int) -> dict | None:
        """What a stream sends of choice `index` before its deltas: chat, the role; an echoed prompt without
        logprobs, its text (with logprobs, the prompt's text comes with them, on the prompt's delta)."""
        if self.chat:
            return {"delta": {"role": "assistant", "content": ""}, "logprobs": None}
        echo = self.prepared[index].echo
        if echo is None or self.jobs[index].prompt_logprobs:
            return None
        return {"text": echo, "logprobs": None}

    def _pieces(
        self, index: int, delta: Delta, splitter: ReasoningSplitter | None, parser: ToolCallParser | None
    ) -> list[dict]:
        """The choice bodies of one delta: its text (chat: reasoning, answer and tool calls apart) and its tokens'
        logprobs (on the first body). A delta of tokens whose text is held back (an incomplete character, a
        possible stop string, a tool call being parsed) is one body of empty text: every decoded token reaches
        the client when it is decoded, as streaming clients time it."""
        if not self.chat:
            text = (self.prepared[index].echo if delta.prompt_logprobs is not None else "") + delta.text
            logprobs = self._completion_logprobs(index, [delta])
            logprobs = logprobs if logprobs is not None and logprobs["tokens"] else None
            return [{"text": text, "logprobs": logprobs}] if text or logprobs or delta.token_ids else []
        logprobs = self._chat_logprobs(list(delta.logprobs)) if delta.logprobs else None
        pieces = self._chat_bodies(delta.text, splitter, parser, last=delta.finish is not None)
        if (logprobs is not None or delta.token_ids) and not pieces:
            pieces = [{"delta": {"content": ""}}]
        return [piece | {"logprobs": logprobs if i == 0 else None} for i, piece in enumerate(pieces)]

    def _chat_bodies(
        self, text: str, splitter: ReasoningSplitter | None, parser: ToolCallParser | None, *, last: bool
    ) -> list[dict]:
        """A chat stream's bodies for some text: reasoning, answer and tool calls apart."""
        reasoning, content = "", text
        if splitter is not None:
            parts = [splitter.feed(text)]
            if last:
                parts.append(splitter.flush())
            reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        pieces = [{"delta": {"reasoning_content": reasoning}}] if reasoning else []
        if parser is None:
            return pieces + ([{"delta": {"content": content}}] if content else [])
        events = parser.feed(content) + (parser.flush() if last else [])
        return pieces + [{"delta": self._tool_delta(event)} for event in events]

    def _tool_delta(self, event: Event) -> dict:
        """A streamed answer's event as a chunk's delta: content, a call's id and name, then its arguments."""
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, ToolCallName):
            function = {"name": event.name, "arguments": ""}
            return {
                "tool_calls": [
                    {"index": event.index, "id": self._call_id(event.index), "type": "function", "function": function}
                ]
            }
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}

    def _call_id(self, index: int) -> str:
        while len(self._call_ids) <= index:
            self._call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self._call_ids[index]

    def _text(self, token: int) -> str:
        """One token's text, as the logprobs name it (special tokens included)."""
        if token not in self.texts:
            self.texts[token] = self.service.tokenizer.decode([token], skip_special_tokens=False)
        return self.texts[token]

    def _completion_logprobs(self, index: int, parts: list[Delta]) -> dict | None:
        """OpenAI's legacy logprobs of the deltas' tokens (the echoed prompt's first, its first token's None),
        their text offsets continuing choice `index`'s text; None for a request without logprobs."""
        if not self.logprobs:
            return None
        rows = []
        for delta in parts:
            if delta.prompt_logprobs is not None:
                prompt = self.jobs[index].prompt
                rows += self._legacy_rows(index, [(prompt[0], None), *((e.token, e) for e in delta.prompt_logprobs)])
                self.offsets[index] = len(self.prepared[index].echo)  # the completion's text follows the prompt's
            rows += self._legacy_rows(index, [(e.token, e) for e in delta.logprobs])
        tokens, values, tops, offsets = (list(column) for column in zip(*rows)) if rows else ([], [], [], [])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _legacy_rows(self, index: int, entries: list[tuple[int, TokenLogprob | None]]) -> list[tuple]:
        """(token text, logprob, {text: logprob} of the top tokens and the token, text offset) per entry, the
        offsets running on from choice `index`'s; an entry without a logprob (a prompt's first token) has None."""
        rows = []
        for token, entry in entries:
            text = self._text(token)
            top = None if entry is None else {self._text(t): value for t, value in entry.top} | {text: entry.logprob}
            rows.append((text, None if entry is None else entry.logprob, top, self.offsets[index]))
            self.offsets[index] += len(text)
        return rows

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        """OpenAI's chat logprobs of the tokens; None for a request without logprobs."""
        if not self.logprobs:
            return None

        def item(token: int, logprob: float) -> dict:
            text = self._text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [item(e.token, e.logprob) | {"top_logprobs": [item(t, v) for t, v in e.top]} for e in entries]
        return {"content": content}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
