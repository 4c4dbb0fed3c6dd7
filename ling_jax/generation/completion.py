"""One completion as its tokens arrive: incremental detokenising and stop strings, for the `ling-generate` command
and the server's scheduler alike (no command-line code: the scheduler's thread imports it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ling_jax.generation.tokenizer import StopChecker, StreamDecoder, Tokenizer


class Completion:
    """One prompt's completion as its tokens arrive: decoded incrementally and cut at the first stop string.

    `ids` ends with the token that completed the stop string (tokens after it are dropped); `text` ends before
    the stop string; `unshown` hands out the text not yet printed, holding back a tail that could still grow
    into a stop string. A completion that is not streamed (`streamed=False`) and has no stop strings needs no
    text before the end: `finish` decodes its ids once (the same text: a stream's pieces add up to the decode).
    """

    def __init__(self, tokenizer: Tokenizer, stops: StopChecker | None, *, streamed: bool = True):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.streamed = streamed
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False  # by a stop string
        self.finished = False
        self._shown = 0

    def add(self, new_ids: Iterable[int]) -> bool:
        """Take newly generated ids; True once a stop string has ended the completion."""
        if self.stops is None:  # no stop string to place at a token: one decode for all the new ids
            new_ids = list(map(int, new_ids))
            self.ids.extend(new_ids)
            if self.streamed:
                self._extend(self.decoder.extend(new_ids))
            return False
        for token in new_ids:
            if self.stopped:
                break
            self.ids.append(int(token))
            self._extend(self.decoder.push(token))
        return self.stopped

    def finish(self, all_ids: Sequence[int]) -> None:
        """The generation is over and returned `all_ids` for this prompt: take any not seen yet, flush."""
        self.add(all_ids[len(self.ids) :])
        if self.stops is None and not self.streamed:
            self._extend(self.decoder.extend(self.ids))
        if not self.stopped:
            self._extend(self.decoder.flush())
        self.finished = True

    def unshown(self) -> str:
        end = len(self.text)
        if self.stops is not None and not (self.stopped or self.finished):
            end = self.stops.printable_length(self.text)
        piece, self._shown = self.text[self._shown : end], max(self._shown, end)
        return piece

    def _extend(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        cut = self.stops.find(self.text) if self.stops is not None else None
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
