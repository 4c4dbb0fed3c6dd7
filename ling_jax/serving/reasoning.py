"""Reasoning text apart from the answer: the part of a chat completion between `<think>` and `</think>`.

A chat template marks reasoning when it contains the start marker; the reply is reasoning from the start
marker to the end marker (or from the start of the reply when the rendered prompt already ends with the start
marker) and answer after it. A tool call (`<tool_call>`) also ends the reasoning, even before the end marker:
the call is the answer's. `ReasoningSplitter` splits streamed text piece by piece: a tail that could be the
beginning of a marker is held back until the next piece decides it.
"""

from __future__ import annotations

from ling_jax.serving.tool_calls import TOOL_CALL_START, partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"
_START, _REASONING, _AFTER_END, _ANSWER = range(4)


def marks_reasoning(chat_template: str | None) -> bool:
    return chat_template is not None and THINK_START in chat_template


class ReasoningSplitter:
    """feed(piece) -> (reasoning, answer) text that can be placed now; flush() once the reply ends.

    States: at the reply's start (it may open with the start marker, after whitespace), in reasoning (until the
    end marker), in the answer (everything else). Newlines right after the end marker are dropped."""

    def __init__(self, *, in_reasoning: bool = False):
        self.state = _REASONING if in_reasoning else _START
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        reasoning = ""
        if self.state == _START:
            opening = text.lstrip()
            if THINK_START.startswith(opening):  # still undecided (or only whitespace so far)
                self._held = text
                return "", ""
            if not opening.startswith(THINK_START):
                self.state = _ANSWER
                return "", text
            self.state, text = _REASONING, opening[len(THINK_START) :]
        if self.state == _REASONING:
            end, call = text.find(THINK_END), text.find(TOOL_CALL_START)
            if call >= 0 and (end < 0 or call < end):
                self.state = _ANSWER
                return text[:call], text[call:]
            if end < 0:
                held = max(partial_suffix(text, THINK_END), partial_suffix(text, TOOL_CALL_START))
                self._held = text[len(text) - held :]
                return text[: len(text) - held], ""
            self.state, reasoning, text = _AFTER_END, text[:end], text[end + len(THINK_END) :]
        if self.state == _AFTER_END:
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.state = _ANSWER
        return reasoning, text

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.state == _REASONING else ("", held)


def split_reasoning(text: str, *, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    parts = [splitter.feed(text), splitter.flush()]
    reasoning = "".join(p[0] for p in parts)
    reasoned = in_reasoning or text.lstrip().startswith(THINK_START)
    return (reasoning if reasoned else None), "".join(p[1] for p in parts)
