#!/usr/bin/env python3
"""Structured outputs: the host's per-token mask time of the two maintained grammar engines, llguidance and
xgrammar, on this CPU (what chose ling-serve's engine: docs/serving.md, "Structured outputs").

    python -m benchmarks.grammar_mask                              # the demo tokenizer and a 157k-token vocabulary
    python -m benchmarks.grammar_mask --tokenizer DIR/tokenizer.json   # also a checkpoint's own tokenizer

Each engine runs if installed (`pip install llguidance==1.9.1 xgrammar==0.2.9`; xgrammar pulls torch and triton,
so ling-jax's extras leave it out). For each tokenizer and engine: the time to build the engine's tokenizer, the
grammar's compile time for a JSON schema (required keys, integers, an enum, a bounded string), then a walk of
WALKS documents: at each position the engine computes the [ceil(V / 32)] int32 bitmask of the allowed tokens
(timed), a seeded random allowed token is taken and fed back, until the grammar ends. Prints the median, p90 and
mean mask time per token. JSON is compact with json.dumps' spacing for both (ling-serve's setting).

The 157k vocabulary (Ling 3.x's size; no such tokenizer ships with the repo) is the demo's byte-level BPE
tokenizer with its vocabulary grown to 157,184 tokens from the word and punctuation pieces of Python's standard
library sources (most frequent first): a stand-in whose token bytes look like a real BPE vocabulary's (merges are
not needed: masks depend on the tokens' bytes only). Pass a real one with --tokenizer.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import tokenizers

from ling_jax.generation.cli import DEMO_DIR

LARGE_VOCAB = 157_184
WALKS = 20
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["name", "age", "color", "score"],
    "additionalProperties": False,
}
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps' spacing
_PIECES = re.compile(r" ?[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]+|\s+")


_BYTE_LEVEL = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level(text: str) -> str:
    """`text`'s UTF-8 bytes in the byte-level BPE alphabet (GPT-2's printable stand-ins for bytes)."""
    return "".join(piece for piece, _ in _BYTE_LEVEL.pre_tokenize_str(text))


def large_tokenizer_json(size: int = LARGE_VOCAB) -> str:
    """The demo's tokenizer.json with `size` tokens: its own, then the stdlib's most frequent pieces."""
    spec = json.loads((Path(DEMO_DIR) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    counts = collections.Counter()
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        counts.update(_PIECES.findall(source.read_text(encoding="utf-8", errors="ignore")))
    for piece, _ in counts.most_common():
        if len(vocab) >= size:
            break
        vocab.setdefault(_byte_level(piece), len(vocab))
    if len(vocab) < size:
        raise SystemExit(f"the standard library gave only {len(vocab)} distinct pieces, fewer than {size}")
    spec["model"]["merges"] = []
    return json.dumps(spec)


class Llguidance:
    name, pin = "llguidance", "llguidance==1.9.1"

    def __init__(self, tokenizer_json: str, eos: int):
        import llguidance

        self.llguidance = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.vocab = self.tokenizer.vocab_size

    def compile(self, schema: dict):
        grammar = self.llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
        return lambda: self.llguidance.LLMatcher(self.tokenizer, grammar)

    def mask(self, matcher, bitmask_W: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask_W.ctypes.data, bitmask_W.nbytes)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        matcher.consume_token(token)
        return matcher.is_stopped()


class Xgrammar:
    name, pin = "xgrammar", "xgrammar==0.2.9"

    def __init__(self, tokenizer_json: str, eos: int):
        import transformers
        import xgrammar

        self.xgrammar = xgrammar
        backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
        self.vocab = backend.get_vocab_size(with_added_tokens=True)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(COMPACT["item_separator"], COMPACT["key_separator"])
        )
        return lambda: self.xgrammar.GrammarMatcher(compiled)

    def mask(self, matcher, bitmask_W: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask_W[None])

    @staticmethod
    def accept(matcher, token: int) -> bool:
        matcher.accept_token(token)
        return matcher.is_terminated()


def allowed(bitmask_W: np.ndarray, vocab: int) -> np.ndarray:
    bits_V = np.unpackbits(bitmask_W.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits_V)


def measure(engine, tokenizer_json: str, eos: int, label: str, walks: int) -> str:
    start = time.perf_counter()
    engine = engine(tokenizer_json, eos)
    setup_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    new_matcher = engine.compile(SCHEMA)
    new_matcher()
    compile_ms = (time.perf_counter() - start) * 1e3
    times, bitmask_W = [], np.zeros(-(-engine.vocab // 32), np.int32)
    for seed in range(walks):
        rng, matcher = np.random.default_rng(seed), new_matcher()
        for _ in range(256):
            start = time.perf_counter()
            engine.mask(matcher, bitmask_W)
            times.append(time.perf_counter() - start)
            if engine.accept(matcher, int(rng.choice(allowed(bitmask_W, engine.vocab)))):
                break
    median_us, p90_us = statistics.median(times) * 1e6, float(np.percentile(times, 90)) * 1e6
    mean_us = statistics.mean(times) * 1e6
    return (
        f"| {label} | {engine.vocab} | {engine.name} | {setup_ms:.0f} | {compile_ms:.1f} | {median_us:.0f} | "
        f"{p90_us:.0f} | {mean_us:.0f} | {len(times)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="a checkpoint's tokenizer.json, measured too")
    parser.add_argument("--walks", type=int, default=WALKS)
    args = parser.parse_args()
    demo = (Path(DEMO_DIR) / "tokenizer.json").read_text()
    cases = [("demo", demo), ("157k stand-in", large_tokenizer_json())]
    if args.tokenizer is not None:
        cases.append((args.tokenizer.parent.name, args.tokenizer.read_text()))
    print("| tokenizer | vocab | engine | tokenizer setup ms | compile ms | mask us p50 | p90 | mean | tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, tokenizer_json in cases:
        eos = tokenizers.Tokenizer.from_str(tokenizer_json).token_to_id("<|endoftext|>") or 0
        for engine in (Llguidance, Xgrammar):
            if importlib.util.find_spec(engine.name) is None:
                print(f"| {label} | | {engine.name} | not installed: pip install {engine.pin} | | | | | |")
            else:
                print(measure(engine, tokenizer_json, eos, label, args.walks), flush=True)


if __name__ == "__main__":
    main()
