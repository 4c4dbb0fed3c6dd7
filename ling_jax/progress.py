"""Progress of long work on stderr: a live bar on a terminal, plain lines on a pipe or in a log file.

tqdm redraws its bar in place with carriage returns, which a pipe or a log file receives as one ever-growing line
(or, with the bar switched off there, nothing for the minutes a large checkpoint takes to read). `progress_bar`
gives tqdm's bar on a terminal and, elsewhere, the same counter as a whole line at most every LINE_SECONDS and
once at the end, the first after LINE_SECONDS: work that ends (or fails) sooner prints no line of its own there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm as plain_tqdm
from tqdm.auto import tqdm

LINE_SECONDS = 15.0  # a line at most this often on a pipe or in a log file


class _Lines:
    """A stream for tqdm that turns each of its in-place redraws into one line of `stream`, flushed."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **tqdm_kwargs) -> tqdm:
    """tqdm over `iterable` (or counted by `update`) with `tqdm_kwargs` (total, desc, unit, ...) on stderr: its
    bar on a terminal; on anything else, from LINE_SECONDS on, a line at most every LINE_SECONDS and the last
    state; nothing when not `enabled`."""
    stream = sys.stderr
    if not enabled or stream is None:
        return tqdm(iterable, disable=True, **tqdm_kwargs)
    if stream.isatty():
        return tqdm(iterable, file=stream, **tqdm_kwargs)
    lines = {"mininterval": LINE_SECONDS, "delay": LINE_SECONDS, "ascii": True, "ncols": 80}
    return plain_tqdm(iterable, file=_Lines(stream), **lines, **tqdm_kwargs)


__all__ = ["LINE_SECONDS", "progress_bar"]
