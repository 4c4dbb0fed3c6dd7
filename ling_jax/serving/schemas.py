"""The OpenAI request bodies the server accepts (pydantic, strict types) and its error responses.

Fields beyond OpenAI's that vLLM / SGLang accept too: `top_k`, `min_p`, `repetition_penalty`. Unknown fields
are ignored, as OpenAI-compatible servers do. A wrong type or a value out of range is a 400 with OpenAI's
error object: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ling_jax.generation.sampling import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 404:
            return "not_found_error"
        if self.status in (429, 503):
            return "server_overloaded" if self.status == 503 else "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1

    def sampling(self, default_seed: int) -> SamplingParams:
        """The request's sampling parameters (OpenAI's defaults: temperature 1, no filter)."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                top_p=1.0 if self.top_p is None else self.top_p,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=default_seed if self.seed is None else self.seed,
                logprobs=self.logprob_count,
            )
        except ValueError as e:  # its messages name command-line flags: name the JSON field instead
            message = re.sub(r"--([a-z-]+)", lambda m: m.group(1).replace("-", "_"), str(e))
            raise APIError(400, message, param=message.split()[0]) from e

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def logprob_count(self) -> int | None:
        """The alternatives each token reports with its logprob; None: no logprobs."""
        return None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text (a list of content parts: their "text" parts joined)."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(body_type: type[_Body], raw: bytes) -> _Body:
    """The request body, or a 400 naming the first field that is wrong."""
    try:
        return body_type.model_validate_json(raw, strict=None)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {error['msg']}") from e
        where = ".".join(str(part) for part in error["loc"])
        param = str(error["loc"][0]) if error["loc"] else None
        raise APIError(400, f"{where}: {error['msg']}", param=param) from e
