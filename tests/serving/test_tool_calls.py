"""Ling 3.x tool calls parsed from model output: whole replies, and the same events however the text is split."""

from __future__ import annotations

import json

import pytest
from optional_deps import require_serve_extra

require_serve_extra()  # the parser raises the server's APIError (ling_jax.serving.schemas imports fastapi)

from ling_jax.serving.schemas import APIError  # noqa: E402
from ling_jax.serving.tool_calls import (  # noqa: E402
    Content,
    ToolCallArguments,
    ToolCallName,
    ToolCallParser,
    parse_reply,
    plan_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
STRINGS = {"get_weather": frozenset({"city"})}
REPLIES = [  # (model output, expected content, expected [(name, arguments)])
    (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "Let me look both up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
        "</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>Europe/Paris</arg_value>\n"
        "</tool_call>\n",
        "Let me look both up.",
        [("get_weather", {"city": "Zürich"}), ("get_time", {"zone": "Europe/Paris"})],
    ),
    (  # typed values, a value declared a string kept as written, the compact form without newlines
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value><arg_key>days</arg_key><arg_value>7"
        '</arg_value><arg_key>opts</arg_key><arg_value>{"units": "metric", "hourly": [1, 2]}</arg_value>'
        "<arg_key>alerts</arg_key><arg_value>true</arg_value><arg_key>note</arg_key><arg_value>not json</arg_value>"
        "</tool_call>",
        None,
        [
            (
                "get_weather",
                {
                    "city": "42",
                    "days": 7,
                    "opts": {"units": "metric", "hourly": [1, 2]},
                    "alerts": True,
                    "note": "not json",
                },
            )
        ],
    ),
    (
        "<tool_call>list_files</tool_call>\n\nDone: a < b, <tool> tags.",
        "Done: a < b, <tool> tags.",
        [("list_files", {})],
    ),
    ("No call here: 2 < 3 and <tool_cal", "No call here: 2 < 3 and <tool_cal", []),
    (  # the reply ended (max_tokens) inside the call: the pairs that closed
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon</arg_value>\n<arg_key>days</arg_key>\n<arg_va",
        None,
        [("get_weather", {"city": "Lyon"})],
    ),
    ("  plain answer  \n", "  plain answer  \n", []),
]


def _events(pieces: list[str]) -> list:
    """The parser's events over `pieces`, adjacent content joined (pieces may cut content anywhere)."""
    parser = ToolCallParser(STRINGS)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.flush()
    merged = []
    for event in events:
        if isinstance(event, Content) and merged and isinstance(merged[-1], Content):
            merged[-1] = Content(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


@pytest.mark.parametrize("reply, content, calls", REPLIES)
def test_whole_reply(reply, content, calls):
    parsed = parse_reply(reply, STRINGS)
    assert parsed.content == content
    assert [(name, json.loads(arguments)) for name, arguments in parsed.tool_calls] == calls


@pytest.mark.parametrize("reply", [r[0] for r in REPLIES])
def test_split_anywhere_gives_the_same_events(reply):
    whole = _events([reply])
    for cut in range(1, len(reply)):
        assert _events([reply[:cut], reply[cut:]]) == whole, cut
    assert _events(list(reply)) == whole


def test_events_name_first_then_arguments():
    events = _events(list(REPLIES[1][0]))
    assert events == [
        Content("Let me look both up."),
        ToolCallName(0, "get_weather"),
        ToolCallArguments(0, '{"city": "Zürich"}'),
        ToolCallName(1, "get_time"),
        ToolCallArguments(1, '{"zone": "Europe/Paris"}'),
    ]


def test_plan_tools():
    assert plan_tools(None, None).tools is None
    assert plan_tools([WEATHER], "none").tools is None
    assert plan_tools([WEATHER], None).string_parameters == STRINGS
    assert plan_tools([WEATHER], "required").prefill == "<tool_call>"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert plan_tools([WEATHER], named).prefill == "<tool_call>get_weather\n"
    for tools, choice, param in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function"}], None, "tools"),
    ]:
        with pytest.raises(APIError) as error:
            plan_tools(tools, choice)
        assert error.value.param == param and error.value.status == 400
