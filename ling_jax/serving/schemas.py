"""The OpenAI request bodies the server accepts (pydantic, strict types) and its error responses.

Fields beyond OpenAI's that vLLM / SGLang accept too: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, and vLLM's structured outputs (`structured_outputs`, `guided_*`: `structured.py`).
Nothing is silently dropped: a field the server does not declare is a 400 naming it (a field set to null counts as
absent), and the fields accepted and ignored on purpose are declared as such (`user`). A wrong type or a value out
of range is a 400 with OpenAI's error object: {"error": {"message", "type", "param", "code"}}. docs/serving.md
("Supported fields") lists them per endpoint.
"""

from __future__ import annotations

import re
from typing import Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, model_validator

from ling_jax.generation.sampling import MAX_LOGPROBS, SEED_LIMIT, SamplingParams

MAX_STOP_TOKEN_IDS = 32  # stop_token_ids per request
JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


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


class Strict(BaseModel):
    """A request object: strict types, and an undeclared field is an error unless it is null."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_undeclared_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items() if value is not None or name in cls.model_fields}


B = TypeVar("B", bound=Strict)


class StreamOptions(Strict):
    include_usage: bool | None = None


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's `response_format` (`structured.py` turns it into a grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a list of choices, a grammar, any JSON object."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Body(Strict):
    model: str
    user: str | None = None  # accepted and ignored: OpenAI's end-user id for abuse monitoring
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # at most --max-batch (api.py): a request's choices decode together
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias added to its logit
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[NonNegativeInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None  # vLLM's older names of structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling(self, default_seed: int, vocab_size: int, end_ids: tuple[int, ...], choice: int = 0) -> SamplingParams:
        """The sampling parameters of the request's choice `choice` (OpenAI's defaults: temperature 1, no filter;
        choice i samples with seed + i, as vLLM's). end_ids: the tokens that end it (EOS unless ignored, stop
        token ids), which `min_tokens` holds back."""
        seed = default_seed if self.seed is None else self.seed
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                top_p=1.0 if self.top_p is None else self.top_p,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=(seed + choice) % SEED_LIMIT if choice else seed,
                logprobs=self.logprob_count,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=self._bias(vocab_size),
                min_tokens=self.min_tokens,
                end_ids=end_ids if self.min_tokens else (),
            )
        except ValueError as e:  # its messages name command-line flags: name the JSON field instead
            message = re.sub(r"--([a-z-]+)", lambda m: m.group(1).replace("-", "_"), str(e))
            raise APIError(400, message, param=message.split()[0]) from e

    def _bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
                raise APIError(
                    400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias"
                )
            pairs.append((int(key), bias))
        return tuple(pairs)

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

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


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls: {"id", "type": "function", "function": {...}}
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    name: str | None = None

    def text(self) -> str:
        """The message's text (a list of content parts: their "text" parts joined)."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            if any(not isinstance(part.get("text"), str) for part in self.content):
                raise APIError(400, 'a text content part needs a string "text"', param="messages")
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (`enable_thinking`)
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

    @property
    def token_limit_field(self) -> str:
        """The field `token_limit` comes from, for messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def parse(body_type: type[B], raw: bytes) -> B:
    """The request body, or a 400 naming the first field that is wrong (or unsupported)."""
    try:
        return body_type.model_validate_json(raw, strict=None)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {error['msg']}") from e
        if not error["loc"]:
            kind = JSON_KINDS.get(type(error["input"]), "a value of another kind")
            raise APIError(400, f"the request body must be a JSON object, got {kind}") from e
        where = ".".join(str(part) for part in error["loc"])
        param = str(error["loc"][0]) if error["loc"] else None
        if error["type"] == "extra_forbidden":
            raise APIError(
                400,
                f"unsupported field `{where}`: this server does not implement it (docs/serving.md, "
                "'Supported fields', lists those it does)",
                param=param,
                code="unsupported_field",
            ) from e
        branch = next((i for i, part in enumerate(error["loc"]) if _is_union_branch(part)), None)
        if branch is not None:  # a field of several accepted forms (`str | list[str]`) matched none of them
            field = error["loc"][:branch]
            tags = [other["loc"][branch] for other in e.errors() if other["loc"][:branch] == field]
            forms = [_json_form(tag) for tag in dict.fromkeys(tags)]
            expected = forms[0] if len(forms) == 1 else f"{', '.join(forms[:-1])} or {forms[-1]}"
            raise APIError(400, f"{'.'.join(map(str, field))}: expected {expected}", param=param) from e
        raise APIError(400, f"{where}: {error['msg']}", param=param) from e


def _is_union_branch(part) -> bool:
    """Whether a pydantic error location's part names the branch of a union (`str`, `list[int]`), not a field."""
    return isinstance(part, str) and re.fullmatch(r"(str|int|float|bool|dict|list)(\[.*\])?", part) is not None


def _json_form(tag: str, plural: bool = False) -> str:
    """A union branch's type in JSON words: 'list[list[int]]' -> 'an array of arrays of integers'."""
    if tag.startswith("list["):
        return ("arrays of " if plural else "an array of ") + _json_form(tag[len("list[") : -1], plural=True)
    singular, several = {
        "str": ("a string", "strings"),
        "int": ("an integer", "integers"),
        "float": ("a number", "numbers"),
        "bool": ("a boolean", "booleans"),
    }.get(tag, ("an object", "objects"))  # dict[...]
    return several if plural else singular
