"""Reasoning apart from the answer: whole replies and replies streamed in arbitrary pieces split the same way."""

from __future__ import annotations

import pytest
from optional_deps import require_serve_extra

require_serve_extra()  # the parser raises the server's APIError (ling_jax.serving.schemas imports fastapi)

from ling_jax.serving.reasoning import ReasoningSplitter, marks_reasoning, split_reasoning  # noqa: E402

REPLIES = [  # (reply, in_reasoning: the prompt opened the reasoning, expected (reasoning, answer))
    ("<think>Mr. Darcy is proud.</think>\n\nHe is proud.", False, ("Mr. Darcy is proud.", "He is proud.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Plain answer <think>not reasoning</think>", False, (None, "Plain answer <think>not reasoning</think>")),
    ("thinking already</think>\nanswer", True, ("thinking already", "answer")),
    ("<think>never closed", False, ("never closed", "")),
    ("<thin", False, (None, "<thin")),
    ("", False, (None, "")),
]


@pytest.mark.parametrize("reply, in_reasoning, expected", REPLIES)
def test_whole_reply(reply, in_reasoning, expected):
    assert split_reasoning(reply, in_reasoning=in_reasoning) == expected


@pytest.mark.parametrize("reply, in_reasoning, expected", REPLIES)
@pytest.mark.parametrize("piece", [1, 2, 3, 5])
def test_streamed_pieces_add_up_to_the_whole_split(reply, in_reasoning, expected, piece):
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    parts = [splitter.feed(reply[i : i + piece]) for i in range(0, len(reply), piece)] + [splitter.flush()]
    reasoning, answer = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    assert (reasoning or None if expected[0] is None else reasoning, answer) == expected


def test_a_template_marks_reasoning_with_the_start_marker():
    assert marks_reasoning("{{ '<think>\\n' if add_generation_prompt }}")
    assert not marks_reasoning("User: {{ m }}") and not marks_reasoning(None)


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_a_tool_call_ends_the_reasoning(piece):
    reply = "I should look it up<tool_call>get_weather\n<arg_key>city</arg_key></tool_call>"
    splitter = ReasoningSplitter(in_reasoning=True)
    parts = [splitter.feed(reply[i : i + piece]) for i in range(0, len(reply), piece)] + [splitter.flush()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (
        "I should look it up",
        "<tool_call>get_weather\n<arg_key>city</arg_key></tool_call>",
    )
    assert split_reasoning("<think>hm</think>a<tool_call>f</tool_call>") == ("hm", "a<tool_call>f</tool_call>")
