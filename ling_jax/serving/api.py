"""The HTTP API: OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events or whole),
/v1/models, /health and /metrics, over a running `Scheduler`; ops.py adds the tokenizer routes, the API key
and the request-size limit.

A request is checked, tokenised and submitted from the event loop; the scheduler's thread hands its deltas
back through `loop.call_soon_threadsafe` into the request's asyncio queue. A streaming client that goes away
cancels its request (the slot is freed at the scheduler's next step); so does one waiting for a whole response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ling_jax.generation.tokenizer import Tokenizer
from ling_jax.serving.chat import render_chat
from ling_jax.serving.ops import DEFAULT_MAX_REQUEST_BYTES, check_model, mount
from ling_jax.serving.reasoning import THINK_START, ReasoningSplitter, marks_reasoning, split_reasoning
from ling_jax.serving.scheduler import Delta, Finish, QueueFull, Request, Scheduler
from ling_jax.serving.schemas import APIError, ChatBody, CompletionBody, parse
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
SEED_LIMIT = 2**32
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
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class _Prepared:
    prompt: list[int]
    max_tokens: int
    in_reasoning: bool = False  # the rendered chat prompt already opened the reasoning
    tools: ToolPlan = NO_TOOLS
    stops: tuple[str, ...] = ()  # stop strings beyond the request's (the chat template's end of turn)


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
        prepared = _prepare_completion(service, body)
        return await _respond(service, request, body, prepared, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        body = parse(ChatBody, await request.body())
        prepared = _prepare_chat(service, body)
        return await _respond(service, request, body, prepared, chat=True)

    mount(app, service)
    return app


def _check_common(service: Service, body, limit: int | None) -> None:
    check_model(service, body.model)
    if body.n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
    if limit is not None and limit <= 0:
        raise APIError(400, f"max_tokens must be >= 1, got {limit}", param="max_tokens")


def _limits(service: Service, prompt: list[int], limit: int | None) -> int:
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
            f"the prompt has {len(prompt)} tokens; with max_tokens {limit} that exceeds this "
            f"server's --max-context of {service.max_context}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return room if limit is None else limit


def _prepare_completion(service: Service, body: CompletionBody) -> _Prepared:
    _check_common(service, body, body.max_tokens)
    prompt = body.prompt if isinstance(body.prompt, list) else service.tokenizer.encode(body.prompt)
    return _Prepared(prompt, _limits(service, prompt, body.max_tokens))


def _prepare_chat(service: Service, body: ChatBody) -> _Prepared:
    _check_common(service, body, body.token_limit)
    plan = plan_tools(body.tools, body.tool_choice)
    template = service.tokenizer.chat_template
    text = render_chat(service.tokenizer, body.messages, tools=plan.tools, template_kwargs=body.chat_template_kwargs)
    prompt = service.tokenizer.encode(text + plan.prefill, add_special_tokens=False)
    in_reasoning = marks_reasoning(template) and text.rstrip().endswith(THINK_START)
    turn_ends = (ROLE_END, service.tokenizer.special_tokens.get("eos_token"))
    stops = tuple(dict.fromkeys(s for s in turn_ends if s and template and s in template))
    return _Prepared(prompt, _limits(service, prompt, body.token_limit), in_reasoning, plan, stops)


async def _respond(service: Service, request: HTTPRequest, body, prepared: _Prepared, *, chat: bool) -> Response:
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[Delta] = asyncio.Queue()
    job = Request(
        prompt=prepared.prompt,
        sampling=body.sampling(secrets.randbelow(SEED_LIMIT)),
        max_tokens=prepared.max_tokens,
        stop=body.stops() + prepared.stops,
        emit=lambda delta: loop.call_soon_threadsafe(deltas.put_nowait, delta),
    )
    try:
        service.scheduler.submit(job)
    except QueueFull as e:
        raise APIError(503, f"{e}; retry later", code="overloaded") from e
    reply = _Reply(service, job, prepared, chat=chat)
    if body.stream:
        return StreamingResponse(reply.stream(deltas, body.include_usage), media_type="text/event-stream")
    return await reply.whole(deltas, request)


class _Reply:
    """Builds the OpenAI objects of one request from its deltas."""

    def __init__(self, service: Service, job: Request, prepared: _Prepared, *, chat: bool):
        self.service, self.job, self.chat = service, job, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.reasoning = marks_reasoning(service.tokenizer.chat_template) and chat
        self.in_reasoning = prepared.in_reasoning
        self.tools = prepared.tools
        self._call_ids: list[str] = []
        self.completion_tokens = 0

    def _envelope(self, object_name: str, choice: dict, usage: dict | None = None) -> dict:
        reply = {
            "id": self.id,
            "object": object_name,
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": [{"index": 0, **choice}] if choice else [],
        }
        if usage is not None:
            reply["usage"] = usage
        return reply

    def _usage(self) -> dict:
        prompt_tokens, completion_tokens = len(self.job.prompt), len(self.job.tokens)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def whole(self, deltas: asyncio.Queue[Delta], request: HTTPRequest) -> Response:
        text = []
        while True:
            try:
                delta = await asyncio.wait_for(deltas.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.service.scheduler.cancel(self.job)
                    return Response(status_code=499)
                continue
            text.append(delta.text)
            if delta.finish is not None:
                break
        if delta.finish is Finish.CANCELLED:
            raise APIError(500, "the request was cancelled by the server (engine failure or shutdown)")
        text = "".join(text)
        if self.chat:
            text = self.tools.prefill + text
            reasoning, content = (
                split_reasoning(text, in_reasoning=self.in_reasoning) if self.reasoning else (None, text)
            )
            message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            finish = str(delta.finish)
            if self.tools.parses:
                parsed = parse_reply(content, self.tools.string_parameters)
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = [
                        {"id": self._call_id(i), "type": "function", "function": {"name": name, "arguments": args}}
                        for i, (name, args) in enumerate(parsed.tool_calls)
                    ]
                    finish = "tool_calls"
            choice = {"message": message, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"text": text, "finish_reason": str(delta.finish), "logprobs": None}
        return JSONResponse(self._envelope(self.object, choice, self._usage()))

    async def stream(self, deltas: asyncio.Queue[Delta], include_usage: bool) -> AsyncIterator[str]:
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        splitter = ReasoningSplitter(in_reasoning=self.in_reasoning) if self.reasoning else None
        parser = ToolCallParser(self.tools.string_parameters) if self.chat and self.tools.parses else None
        finish = None
        try:
            if self.chat:
                yield _event(
                    self._envelope(
                        chunk_object,
                        {"delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None},
                    )
                )
                for piece in self._pieces(self.tools.prefill, splitter, parser, last=False):
                    yield _event(self._envelope(chunk_object, piece | {"finish_reason": None, "logprobs": None}))
            while finish is None:
                delta = await deltas.get()
                finish = delta.finish
                if finish is Finish.CANCELLED:
                    return
                for piece in self._pieces(delta.text, splitter, parser, last=finish is not None):
                    yield _event(self._envelope(chunk_object, piece | {"finish_reason": None, "logprobs": None}))
                if finish is not None:
                    last = {"delta": {}} if self.chat else {"text": ""}
                    reason = "tool_calls" if parser is not None and parser.calls else str(finish)
                    yield _event(self._envelope(chunk_object, last | {"finish_reason": reason, "logprobs": None}))
            if include_usage:
                yield _event(self._envelope(chunk_object, {}, self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            if finish is None:  # the client went away (or the server is cancelling this stream)
                self.service.scheduler.cancel(self.job)

    def _pieces(
        self, text: str, splitter: ReasoningSplitter | None, parser: ToolCallParser | None, *, last: bool
    ) -> list[dict]:
        """The choice bodies of one delta's text (chat: reasoning, answer and tool calls apart)."""
        if not self.chat:
            return [{"text": text}] if text else []
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


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
