"""Tool calls in Ling 3.x chat: the request's `tools` / `tool_choice` checked, and the model's calls parsed back.

The model writes a call as `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs (newlines
between the parts) and `</tool_call>`; several calls may follow one another. A value that parses as JSON keeps
its type (`42`, `true`, `{"a": 1}`) unless the tool's schema declares that parameter a string; any other value
is a string. `ToolCallParser` is fed the answer's text in pieces as they stream and hands back events (content,
a call's name, a call's arguments as one JSON string once the call closes) that are the same however the text
was split: a tail that could be the start of `<tool_call>` is held until the next piece decides it, and so is
whitespace after content (whitespace before, between and after calls is dropped).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ling_jax.serving.schemas import APIError

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END = re.compile(r"[\s<]")
_CONTENT, _NAME, _ARGUMENTS = range(3)


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallName:
    index: int  # the call's position among this reply's calls
    name: str


@dataclasses.dataclass(frozen=True)
class ToolCallArguments:
    index: int
    arguments: str  # a JSON object, as OpenAI's `function.arguments`


Event = Content | ToolCallName | ToolCallArguments


class ToolCallParser:
    """feed(piece) -> the events the text so far decides; flush() -> the rest once the reply ends.

    `string_parameters` maps a tool's name to the parameters its schema declares strings (kept as written)."""

    def __init__(self, string_parameters: Mapping[str, frozenset[str]] | None = None):
        self.string_parameters = dict(string_parameters or {})
        self.calls = 0
        self._state = _CONTENT
        self._held = ""  # text not parsed yet
        self._space = ""  # whitespace after the content placed so far
        self._after_call = False  # a call closed and no content came since: its whitespace is dropped
        self._name = ""

    def feed(self, piece: str) -> list[Event]:
        self._held += piece
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def flush(self) -> list[Event]:
        events: list[Event] = []
        held, self._held = self._held, ""
        if self._state == _CONTENT:
            self._content(held, events)
            if self._space and not self._after_call:
                events.append(Content(self._space))
        elif self._state == _NAME and held.strip():
            self._name = _NAME_END.split(held.strip(), 1)[0]
            events.append(ToolCallName(self.calls, self._name))
            self._close(held, events)
        elif self._state == _ARGUMENTS:
            self._close(held, events)
        self._space, self._state = "", _CONTENT
        return events

    def _step(self, events: list[Event]) -> bool:
        """Parse what the held text decides; True when the state changed and there may be more to parse."""
        text = self._held
        if self._state == _CONTENT:
            at = text.find(TOOL_CALL_START)
            if at < 0:
                keep = partial_suffix(text, TOOL_CALL_START)
                self._content(text[: len(text) - keep], events)
                self._held = text[len(text) - keep :]
                return False
            self._content(text[:at], events)
            self._space, self._held, self._state = "", text[at + len(TOOL_CALL_START) :], _NAME
            return True
        if self._state == _NAME:
            text = text.lstrip()
            end = _NAME_END.search(text)
            self._held = text
            if end is None:
                return False
            self._name = text[: end.start()]
            events.append(ToolCallName(self.calls, self._name))
            self._held, self._state = text[end.start() :], _ARGUMENTS
            return True
        at = text.find(TOOL_CALL_END)
        if at < 0:
            return False
        self._close(text[:at], events)
        self._held, self._state = text[at + len(TOOL_CALL_END) :], _CONTENT
        return True

    def _content(self, text: str, events: list[Event]) -> None:
        """Place content text, holding its trailing whitespace back."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if not body:
            return
        if self._after_call:
            body, self._after_call = body.lstrip(), False
        events.append(Content(body))

    def _close(self, body: str, events: list[Event]) -> None:
        strings = self.string_parameters.get(self._name, frozenset())
        arguments = {key.strip(): _value(value, key.strip() in strings) for key, value in _PAIR.findall(body)}
        events.append(ToolCallArguments(self.calls, json.dumps(arguments, ensure_ascii=False)))
        self.calls += 1
        self._after_call = True


def _value(text: str, is_string: bool) -> Any:
    if is_string:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    content: str | None  # None when the reply is only tool calls
    tool_calls: tuple[tuple[str, str], ...]  # (name, arguments JSON) per call


def parse_reply(text: str, string_parameters: Mapping[str, frozenset[str]] | None = None) -> ParsedReply:
    """A whole answer's content and tool calls."""
    parser = ToolCallParser(string_parameters)
    events = parser.feed(text) + parser.flush()
    content = "".join(e.text for e in events if isinstance(e, Content))
    names = {e.index: e.name for e in events if isinstance(e, ToolCallName)}
    calls = tuple((names[e.index], e.arguments) for e in events if isinstance(e, ToolCallArguments))
    return ParsedReply(content if content or not calls else None, calls)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's `tools` and `tool_choice` ask of the prompt and the reply."""

    tools: tuple[dict, ...] | None  # for the chat template (None: the prompt shows no tools)
    prefill: str  # text the reply is made to start with (appended to the rendered prompt)
    string_parameters: Mapping[str, frozenset[str]]

    @property
    def parses(self) -> bool:
        return self.tools is not None


NO_TOOLS = ToolPlan(None, "", {})


def plan_tools(tools: Sequence[dict] | None, tool_choice: str | dict | None) -> ToolPlan:
    """Check `tools` and `tool_choice` (400s naming the field): "none" hides the tools, "auto" (the default with
    tools) lets the model choose, "required" starts the reply with `<tool_call>`, a named function with
    `<tool_call>NAME`."""
    names = [_tool_name(tool, i) for i, tool in enumerate(tools or ())]
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in names:
            raise APIError(
                400, f"tool_choice names the function {name!r}, not one of tools {names}", param="tool_choice"
            )
        prefill = f"{TOOL_CALL_START}{name}\n"
    elif tool_choice in (None, "auto", "none"):
        prefill = ""
    elif tool_choice == "required":
        if not names:
            raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
        prefill = TOOL_CALL_START
    else:
        raise APIError(
            400,
            f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}',
            param="tool_choice",
        )
    if not names or tool_choice == "none":
        return NO_TOOLS
    strings = {
        name: frozenset(
            key
            for key, schema in tool["function"].get("parameters", {}).get("properties", {}).items()
            if isinstance(schema, dict) and schema.get("type") == "string"
        )
        for name, tool in zip(names, tools)
    }
    return ToolPlan(tuple(tools), prefill, strings)


def _tool_name(tool: dict, i: int) -> str:
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', param="tools")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
        raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return function["name"]
