"""What an operator needs around the OpenAI routes: the API key and the request-size limit (one ASGI middleware),
and vLLM's tokenizer routes `/tokenize`, `/detokenize` and `/tokenizer_info`.

With an API key every route but `/health` needs `Authorization: Bearer <key>` (compared in constant time);
without one, or with another, the reply is a 401 in OpenAI's error schema, which the `openai` client raises as
`AuthenticationError`. A request body over the limit is a 413 before it is parsed: at once when its
Content-Length says so, else as soon as the bytes read pass it.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from ling_jax.serving.chat import render_chat
from ling_jax.serving.schemas import APIError, ChatMessage, Strict, parse

if TYPE_CHECKING:
    from ling_jax.serving.api import Service

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
OPEN_PATHS = frozenset({"/health"})  # served without the API key (load balancers' probes)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Guard:
    """ASGI middleware: the API key (when there is one), then the request-size limit."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope["headers"]}
        if self.key is not None and scope["path"] not in OPEN_PATHS:
            refusal = self._refusal(headers.get(b"authorization"))
            if refusal is not None:
                response = refusal.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:  # the whole body (every route reads all of it anyway), counting as it comes
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                await self._too_large().response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:  # the body once, then the client's own messages (its disconnect)
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    def _refusal(self, authorization: bytes | None) -> APIError | None:
        if authorization is None:
            return APIError(
                401, "no API key given: send it as the header `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            return APIError(401, "incorrect API key", code="invalid_api_key")
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's --max-request-bytes of {self.max_request_bytes}",
            code="request_too_large",
        )


def check_model(service: Service, model: str | None) -> None:
    """A 404 for a model this server does not serve (None: the request names none, where that is allowed)."""
    if model is not None and model != service.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist (this server serves `{service.model_name}`)",
            param="model",
            code="model_not_found",
        )


class TokenizeBody(Strict):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (rendered as the chat route does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as each route encodes)
    add_generation_prompt: bool | None = None  # messages only; default True


class DetokenizeBody(Strict):
    model: str | None = None
    tokens: list[int]


def tokenize(service: Service, body: TokenizeBody) -> list[int]:
    """The token ids the completion or chat route would feed the model for the same prompt or messages."""
    check_model(service, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400, "give one of `prompt` and `messages`", param="prompt" if body.prompt is None else "messages"
        )
    if body.prompt is not None:
        if body.add_generation_prompt is not None:
            raise APIError(400, "add_generation_prompt applies to `messages` only", param="add_generation_prompt")
        return service.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens in (None, True))
    generation_prompt = body.add_generation_prompt in (None, True)
    text = render_chat(service.tokenizer, body.messages, add_generation_prompt=generation_prompt)
    return service.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def detokenize(service: Service, body: DetokenizeBody) -> str:
    check_model(service, body.model)
    vocab = service.scheduler.engine.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids outside [0, {vocab}): {bad[:5]}", param="tokens")
    return service.tokenizer.decode(body.tokens, skip_special_tokens=False)


def tokenizer_info(service: Service) -> dict:
    """The tokenizer's settings (vLLM answers its tokenizer_config.json; these are what ling-jax reads of it)."""
    tokenizer = service.tokenizer
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": service.scheduler.engine.config.vocab_size,
        "model_max_length": service.max_context,
        "eos_token_ids": list(tokenizer.eos_ids),
        **tokenizer.special_tokens,
        "chat_template": tokenizer.chat_template,
    }


def mount(app: FastAPI, service: Service) -> None:
    """The tokenizer routes, and the guard around every route."""

    @app.post("/tokenize")
    async def tokenize_route(request: HTTPRequest) -> JSONResponse:
        tokens = tokenize(service, parse(TokenizeBody, await request.body()))
        return JSONResponse({"count": len(tokens), "max_model_len": service.max_context, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize_route(request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"prompt": detokenize(service, parse(DetokenizeBody, await request.body()))})

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> JSONResponse:
        return JSONResponse(tokenizer_info(service))

    app.add_middleware(Guard, api_key=service.api_key, max_request_bytes=service.max_request_bytes)
