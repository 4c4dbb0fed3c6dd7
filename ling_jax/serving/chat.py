"""Chat messages through the checkpoint's chat template, as the chat route and /tokenize render them: a request's
messages (an assistant's earlier tool calls and the tool results included), its `tools` and its
`chat_template_kwargs` (the thinking switch)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jinja2

from ling_jax.generation.tokenizer import Tokenizer
from ling_jax.serving.schemas import APIError, ChatMessage

THINKING_SWITCHES = ("enable_thinking", "thinking")  # chat_template_kwargs names of the thinking switch (vLLM's)
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # set by the server


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text the chat template writes for these messages (400s naming the field on bad input)."""
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    rendered = [template_message(m, i) for i, m in enumerate(messages)]
    kwargs = checked_template_kwargs(template_kwargs)
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt, tools=tools, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # raise_exception in the template, or no template
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from e


def template_message(message: ChatMessage, i: int) -> dict:
    """A request message as chat templates take it: an assistant's tool-call arguments as a dict."""
    rendered = {"role": message.role, "content": message.text()}
    if message.tool_calls is not None:
        calls = []
        for call in message.tool_calls:
            function = call.get("function")
            try:
                arguments = json.loads(function["arguments"])
            except (TypeError, KeyError, json.JSONDecodeError) as e:
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls: each needs function.arguments, a JSON object string",
                    param="messages",
                ) from e
            calls.append({**call, "function": {**function, "arguments": arguments}})
        rendered["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            rendered[key] = getattr(message, key)
    return rendered


def checked_template_kwargs(kwargs: dict | None) -> dict:
    """chat_template_kwargs checked; either thinking switch sets both names (templates read one or the other)."""
    kwargs = dict(kwargs or {})
    reserved = sorted(TEMPLATE_VARIABLES & kwargs.keys())
    if reserved:
        raise APIError(
            400, f"chat_template_kwargs cannot set {reserved}: the server sets them", param="chat_template_kwargs"
        )
    switches = [kwargs[name] for name in THINKING_SWITCHES if name in kwargs]
    if any(not isinstance(value, bool) for value in switches) or len(set(switches)) > 1:
        raise APIError(
            400, "chat_template_kwargs enable_thinking / thinking must be one boolean", param="chat_template_kwargs"
        )
    if switches:
        kwargs.update(dict.fromkeys(THINKING_SWITCHES, switches[0]))
    return kwargs
