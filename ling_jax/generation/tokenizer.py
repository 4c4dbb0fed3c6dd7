"""Text in and out of generation: tokenizers, chat templates, streaming detokenisation, stop strings.

`load_tokenizer` wraps a checkpoint's `tokenizer.json` (the `tokenizers` library) or, without one, falls back
to bytes: every UTF-8 byte is one token whose id is the byte value (what a randomly initialised model
needs to run end to end; a trained checkpoint's ids are not bytes, so its output would be meaningless, and
`scripts/generate.py` refuses a checkpoint without tokenizer.json unless told `--byte-tokenizer`). A file that
cannot be read as what it should be raises ValueError naming it.
"""

from __future__ import annotations

import abc
import datetime
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from ling_jax.config import LingConfig

_BYTE_VOCAB = 256
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_REPLACEMENT_CHAR = "\ufffd"  # what lossy UTF-8 decoding makes of an incomplete byte sequence


class Tokenizer(abc.ABC):
    """What generation needs from a tokenizer; build one with `load_tokenizer`."""

    def __init__(
        self, *, name: str, eos_ids: tuple[int, ...], chat_template: str | None, special_tokens: Mapping[str, str]
    ):
        self.name = name
        self.eos_ids = eos_ids
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)  # bos_token / eos_token / ... text, for the template

    @abc.abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; pass add_special_tokens=False for text a chat template already formatted."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences become U+FFFD."""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the checkpoint's jinja2 chat template over `messages` ([{"role": ..., "content": ...}]), as
        transformers does: `tools` (OpenAI's function specs) and `template_kwargs` (`enable_thinking`, ...) are
        the template's variables too."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template (looked for chat_template.jinja and "
                f"tokenizer_config.json's 'chat_template'): drop --chat to send prompts as raw text"
            )
        # transformers passes tools and documents even when there are none; some templates test `is none`
        return _compile_chat_template(self.chat_template).render(
            **{
                **self.special_tokens,
                **template_kwargs,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "tools": None if tools is None else list(tools),
                "documents": None,
            }
        )


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` read by the `tokenizers` library."""

    def __init__(self, backend: tokenizers.Tokenizer, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


class ByteTokenizer(Tokenizer):
    """Token id = UTF-8 byte value. Ids >= 256 decode to nothing; so do eos / pad ids unless kept."""

    def __init__(self, special_ids: frozenset[int], **kwargs):
        super().__init__(**kwargs)
        self.special_ids = special_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        skipped = self.special_ids if skip_special_tokens else frozenset()
        return bytes(i for i in ids if 0 <= i < _BYTE_VOCAB and i not in skipped).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path | None, config: LingConfig) -> Tokenizer:
    """The checkpoint's tokenizer.json if `model_dir` has one, else the byte-level fallback.

    eos_ids gathers config.json's eos_token_id, generation_config.json's eos_token_id and
    tokenizer_config.json's eos_token (when the tokenizer knows it), without repeats.
    """
    directory = None if model_dir is None else Path(model_dir)
    if directory is not None and not directory.is_dir():
        raise FileNotFoundError(f"tokenizer: {directory} is not a directory")
    settings = _read_json(directory, "tokenizer_config.json")
    generation = _read_json(directory, "generation_config.json")
    special_tokens = {name: _token_text(settings[name]) for name in _SPECIAL_TOKEN_NAMES if settings.get(name)}
    chat_template = _read_chat_template(directory, settings)
    eos_ids = [*config.eos_token_ids, *_as_id_list(generation.get("eos_token_id"))]

    if directory is not None and (directory / "tokenizer.json").is_file():
        backend = _read_tokenizer_json(directory / "tokenizer.json")
        size = backend.get_vocab_size(with_added_tokens=True)
        if size > config.vocab_size:
            raise ValueError(
                f"{directory / 'tokenizer.json'} has {size} tokens but config.json's vocab_size is "
                f"{config.vocab_size}: the model cannot embed the extra ids"
            )
        if "eos_token" in special_tokens:
            eos_id = backend.token_to_id(special_tokens["eos_token"])
            if eos_id is None:
                raise ValueError(
                    f"tokenizer_config.json's eos_token {special_tokens['eos_token']!r} is not a token "
                    f"of {directory / 'tokenizer.json'}"
                )
            eos_ids.append(eos_id)
        return HFTokenizer(
            backend,
            name=f"tokenizer.json of {directory}",
            eos_ids=tuple(dict.fromkeys(eos_ids)),
            chat_template=chat_template,
            special_tokens=special_tokens,
        )

    if config.vocab_size < _BYTE_VOCAB:
        raise ValueError(
            f"no tokenizer.json{'' if directory is None else f' in {directory}'}, and the byte-level "
            f"fallback needs vocab_size >= {_BYTE_VOCAB} (one id per byte value); the config has "
            f"{config.vocab_size}"
        )
    special_ids = frozenset(eos_ids) | ({config.pad_token_id} if config.pad_token_id is not None else frozenset())
    where = "no model directory" if directory is None else f"no tokenizer.json in {directory}"
    return ByteTokenizer(
        special_ids,
        name=f"byte-level fallback ({where}; token id = UTF-8 byte)",
        eos_ids=tuple(dict.fromkeys(eos_ids)),
        chat_template=chat_template,
        special_tokens=special_tokens,
    )


def _read_tokenizer_json(file: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception for every malformed file
        raise ValueError(f"{file}: not a valid tokenizer.json ({e})") from e


def _read_json(directory: Path | None, filename: str) -> dict[str, Any]:
    if directory is None or not (directory / filename).is_file():
        return {}
    file = directory / filename
    try:
        body = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(body).__name__}")
    return body


def _token_text(token: str | Mapping[str, Any]) -> str:
    """tokenizer_config.json writes a special token as its text or as an AddedToken dict."""
    return token["content"] if isinstance(token, Mapping) else token


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_chat_template(directory: Path | None, settings: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (newer transformers) wins over tokenizer_config.json, as in transformers."""
    file = None if directory is None else directory / "chat_template.jinja"
    if file is not None and file.is_file():
        try:
            return file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 text ({e})") from e
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # jinja2's own tojson escapes HTML characters; transformers replaces it with plain json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class StreamDecoder:
    """Turns one request's generated ids, pushed one at a time, into printable text.

    Each push decodes a short window (the ids since the last printed boundary plus the token before it, for
    tokens whose text depends on their neighbour) and returns what it adds beyond the text already printed.
    Text ending in U+FFFD (a character whose bytes have not all arrived) is held back until it completes;
    `flush` returns whatever is still held once generation ends. Everything returned, concatenated, is the
    decode of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0  # first id of the decode window
        self._printed_end = 0  # ids before this are printed

    def push(self, token_id: int) -> str:
        """Add one id; return the new complete text ('' while a character is incomplete)."""
        return self.extend([token_id])

    def extend(self, token_ids: Iterable[int]) -> str:
        """Add several ids with one decode of the window (not one per id); return the new complete text."""
        self.ids.extend(map(int, token_ids))
        printed_text, window_text = self._window()
        if len(window_text) <= len(printed_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._window_start, self._printed_end = self._printed_end, len(self.ids)
        return window_text[len(printed_text) :]

    def flush(self) -> str:
        """The held-back text (possibly ending in U+FFFD); call once when the request ends."""
        printed_text, window_text = self._window()
        self._window_start = self._printed_end = len(self.ids)
        return window_text[len(printed_text) :]

    def _window(self) -> tuple[str, str]:
        """The decodes of the printed part of the window and of the whole window."""
        printed, window = self.ids[self._window_start : self._printed_end], self.ids[self._window_start :]
        skip = self.skip_special_tokens
        return (
            self.tokenizer.decode(printed, skip_special_tokens=skip) if printed else "",
            self.tokenizer.decode(window, skip_special_tokens=skip),
        )


class StopChecker:
    """Finds the first stop string in a request's generated text; the stop string itself is never shown."""

    def __init__(self, stop_strings: Sequence[str]):
        if any(not s for s in stop_strings):
            raise ValueError("--stop strings must be non-empty")
        self.stop_strings = tuple(stop_strings)

    def find(self, text: str) -> int | None:
        """Where to cut `text` (keep text[:cut]) if it contains a stop string, else None.

        The occurrence that ends first wins (the one a character-by-character check would meet first);
        of two ending together, the longer.
        """
        ends = []
        for stop in self.stop_strings:
            start = text.find(stop)
            if start >= 0:
                ends.append((start + len(stop), start))
        return min(ends)[1] if ends else None

    def printable_length(self, text: str) -> int:
        """How much of `text` (with no stop string in it) can be shown now: all but the longest suffix that
        could still grow into a stop string."""
        for held in range(min(len(text), max((len(s) for s in self.stop_strings), default=1) - 1), 0, -1):
            if any(stop.startswith(text[-held:]) for stop in self.stop_strings):
                return len(text) - held
        return len(text)
