"""Structured outputs: a request's grammar (OpenAI's `response_format`; vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`), compiled and checked before any work, and
its matcher, which the scheduler advances on the host by each token and asks for the next token bitmask.

The grammar engine is llguidance (the serve extra pins it; docs/serving.md, "Structured outputs", says why): its
tokenizer is built once per served tokenizer from its tokenizer.json, its matcher per request. The import is
optional: without the package a request that asks for a grammar gets a 400 naming it. JSON is generated compact,
with json.dumps' spacing (", " and ": ", no other whitespace), so a sampled reply cannot wander into whitespace.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import numpy as np

from ling_jax.generation.grammar_mask import bitmask_words
from ling_jax.generation.tokenizer import HFTokenizer, Tokenizer
from ling_jax.serving.schemas import APIError

try:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
except ImportError:  # the serve extra installs it; without it, grammars are refused
    llguidance = None

PACKAGE = "llguidance==1.9.1"
JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request asks its output to follow: `kind` (json, regex, choice or grammar) and its value, from the
    request field `field` (named in errors)."""

    field: str
    kind: str
    value: Any


def constraint_of(body) -> Constraint | None:
    """The request's constraint, or None; a 400 when it names more than one."""
    found = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        found.append(Constraint("response_format", "json", ANY_JSON_OBJECT))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            message = "response_format.json_schema is required with type json_schema"
            raise APIError(400, message, param="response_format")
        found.append(Constraint("response_format", "json", response_format.json_schema.schema_))
    vllm = body.structured_outputs
    if vllm is not None:
        where = "structured_outputs"
        kinds = [("json", vllm.json_), ("regex", vllm.regex), ("choice", vllm.choice), ("grammar", vllm.grammar)]
        found += [Constraint(f"{where}.{kind}", kind, value) for kind, value in kinds if value is not None]
        if vllm.json_object:
            found.append(Constraint(f"{where}.json_object", "json", ANY_JSON_OBJECT))
    guided = [("json", body.guided_json), ("regex", body.guided_regex), ("choice", body.guided_choice)]
    guided.append(("grammar", body.guided_grammar))
    found += [Constraint(f"guided_{kind}", kind, value) for kind, value in guided if value is not None]
    if len(found) > 1:
        raise APIError(
            400, f"{found[1].field}: a request takes one constraint, it also has {found[0].field}", param=found[1].field
        )
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A checked llguidance grammar over a tokenizer; `matcher()` starts one request's walk through it."""

    spec: str
    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int

    def matcher(self) -> Matcher:
        return Matcher(llguidance.LLMatcher(self.tokenizer, self.spec, log_level=0), self.vocab_size)


class Matcher:
    """One request's place in its grammar (on the scheduler's thread)."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._bitmask_W = np.zeros(bitmask_words(vocab_size), np.int32)

    def bitmask(self) -> np.ndarray:
        """[W] int32: the tokens the grammar allows next (`grammar_mask`'s layout); EOS once it may end."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask_W.ctypes.data, self._bitmask_W.nbytes)
        return self._bitmask_W.copy()

    def accept(self, token: int) -> None:
        """Advance by the sampled token (one the last bitmask allowed)."""
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (or the matcher failed): the request ends."""
        return self._matcher.is_stopped() or self._matcher.is_error()


def grammar_of(body, tokenizer: Tokenizer, engine) -> Grammar | None:
    """The request's grammar over the `Engine`'s vocabulary (None: it asks for none), or a 400 naming the field;
    refused with MTP drafts (a speculative round draws several tokens per step, each needing its own bitmask)."""
    constraint = constraint_of(body)
    if constraint is None:
        return None
    if engine.mtp:
        raise APIError(400, f"{constraint.field} is not supported with --mtp", param=constraint.field)
    return compile_constraint(constraint, tokenizer, engine.config.vocab_size)


def compile_constraint(constraint: Constraint, tokenizer: Tokenizer, vocab_size: int) -> Grammar:
    """The constraint's grammar over the served tokenizer (model vocabulary `vocab_size`); a 400 naming the field
    when llguidance is missing or the schema / regex / grammar does not compile."""
    field = constraint.field
    if llguidance is None:
        raise APIError(400, f"{field} needs the {PACKAGE} package (pip install -e '.[serve]')", param=field)
    if not isinstance(tokenizer, HFTokenizer):
        message = f"{field} needs the checkpoint's tokenizer.json (this server has {tokenizer.name})"
        raise APIError(400, message, param=field)
    try:
        spec = _spec(constraint)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from e
    ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec, ll_tokenizer)
    if failed:
        raise APIError(400, f"{field}: {messages[0].strip()}", param=field)
    return Grammar(spec, ll_tokenizer, vocab_size)


def _spec(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; ValueError for a value of the wrong shape."""
    value = constraint.value
    if constraint.kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_SPACING)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if constraint.kind == "choice":
        if not value:
            raise ValueError("needs at least one choice")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as e:  # the GBNF converter raises what its parser meets
        raise ValueError(f"not a Lark or GBNF grammar ({e})") from e


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: HFTokenizer, vocab_size: int):
    """llguidance's view of the served tokenizer (built once: ~1 s for a 157k vocabulary), its masks `vocab_size`
    bits wide (the model's vocabulary, which may pad the tokenizer's)."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_ids))
