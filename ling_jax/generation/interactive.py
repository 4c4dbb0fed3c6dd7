"""`generate.py --interactive`: a prompt loop that keeps the conversation.

Each line read from stdin is one user turn (the prompt marker goes to stderr, so stdout holds only the
replies); the reply streams to stdout. With a chat template the turns are rendered through it as user and
assistant messages (a --system message first); without one the conversation is running text, each turn and
reply continuing the last. When the conversation no longer fits the context the oldest turns are dropped.
The loop ends at end of input or on a line `exit` or `quit`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from ling_jax.generation.tokenizer import Tokenizer

PROMPT_MARKER = "> "
EXIT_WORDS = frozenset({"exit", "quit"})


def check_flags(args: argparse.Namespace) -> None:
    """--interactive reads its prompts from stdin and streams text: refuse flags that say otherwise."""
    given = [
        flag
        for flag, on in (
            ("PROMPT", args.prompts),
            ("--prompt-file", args.prompt_file is not None),
            ("--json", args.json),
            ("--no-stream", args.no_stream),
            ("--image", args.image),
            ("--video", args.video),
        )
        if on
    ]
    if given:
        raise ValueError(f"--interactive reads its prompts from stdin and streams the replies; drop {', '.join(given)}")


@dataclasses.dataclass
class Conversation:
    """The turns so far and how to render them as the prompt of the next reply."""

    tokenizer: Tokenizer
    system: str | None = None
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (user text, reply)

    @property
    def templated(self) -> bool:
        return self.tokenizer.chat_template is not None

    def prompt_ids(self, user_text: str) -> list[int]:
        """Token ids of the conversation followed by `user_text`, ready for the reply."""
        if not self.templated:
            text = "".join(f"{user}{reply}\n" for user, reply in self.turns) + user_text
            return self.tokenizer.encode(text)
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        for user, reply in self.turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        text = self.tokenizer.apply_chat_template([*messages, {"role": "user", "content": user_text}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def fitting_prompt_ids(self, user_text: str, budget: int) -> list[int] | None:
        """prompt_ids(user_text), dropping the oldest turns until it has at most `budget` tokens; None when
        even the new turn alone is too long."""
        while True:
            ids = self.prompt_ids(user_text)
            if len(ids) <= budget:
                return ids
            if not self.turns:
                return None
            self.turns.pop(0)


def prompt_lines(stdin: TextIO, stderr: TextIO) -> Iterator[str]:
    """The non-blank lines of stdin, each after a prompt marker on stderr, until EOF or `exit` / `quit`."""
    while True:
        stderr.write(PROMPT_MARKER)
        stderr.flush()
        line = stdin.readline()
        if not line:
            stderr.write("\n")
            return
        text = line.rstrip("\r\n")
        if text.strip().lower() in EXIT_WORDS:
            return
        if text.strip():
            yield text


def run_loop(
    conversation: Conversation,
    budget: int,
    respond: Callable[[list[int]], str],
    stdin: TextIO = sys.stdin,
    stderr: TextIO = sys.stderr,
) -> None:
    """Read turns, stream each reply through `respond(prompt_ids) -> reply text`, keep the conversation.
    budget: the most prompt tokens a reply leaves room for (context less --max-new-tokens)."""
    for text in prompt_lines(stdin, stderr):
        ids = conversation.fitting_prompt_ids(text, budget)
        if ids is None:
            print(
                f"error: this turn alone has more than {budget} tokens (the context less --max-new-tokens); "
                "try a shorter one",
                file=stderr,
                flush=True,
            )
            continue
        conversation.turns.append((text, respond(ids)))
