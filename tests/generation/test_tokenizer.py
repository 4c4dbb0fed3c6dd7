"""Tokenizers (a small trained BPE and the byte fallback), chat templates, streaming decode, stop strings."""

from __future__ import annotations

import json

import jinja2
import numpy as np
import pytest
from helpers import train_byte_bpe

from ling_jax.generation.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    StopChecker,
    StreamDecoder,
    load_tokenizer,
)
from ling_jax.presets import preset

MULTIBYTE = "héllo 世界 🙂"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Ling is a mixture of experts language model.",
    "Delta attention keeps a fixed size state per layer.",
    "The quick model answers the lazy question.",
]
SPECIALS = ["<|endoftext|>", "<|pad|>", "<role>"]
# trim_blocks / lstrip_blocks remove the indentation and the newlines around the block tags
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<role>{{ message['role'] | upper }}</role>{{ message['content'] }}{{ eos_token }}
{%- endfor %}
{% if add_generation_prompt %}
<role>ASSISTANT</role>
{%- endif %}"""
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]


def tiny_config(**changes):
    return preset("tiny").replace(**changes)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE trained on four sentences: too small a vocabulary to hold whole CJK characters."""
    directory = tmp_path_factory.mktemp("bpe")
    train_byte_bpe(directory / "tokenizer.json", SENTENCES, 320, SPECIALS)
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"__type": "AddedToken", "content": "<|pad|>"},
                "eos_token": "<|endoftext|>",
                "chat_template": TEMPLATE,
            }
        )
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return directory


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir, tiny_config(vocab_size=512, eos_token_ids=(5,)))


def test_bpe_round_trip(bpe):
    assert isinstance(bpe, HFTokenizer)
    for text in [*SENTENCES, MULTIBYTE, "unseen wörds, digits 12345 and\nnewlines"]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
    assert len(bpe.encode(SENTENCES[0])) < len(SENTENCES[0].encode())  # merges were learnt


def test_bpe_eos_ids_merge_config_generation_config_and_tokenizer_config(bpe):
    endoftext = bpe.backend.token_to_id("<|endoftext|>")
    assert bpe.eos_ids == (5, 2, endoftext)
    assert bpe.decode([*bpe.encode("fox"), endoftext]) == "fox"
    assert bpe.decode([*bpe.encode("fox"), endoftext], skip_special_tokens=False) == "fox<|endoftext|>"


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(bpe_dir):
    with pytest.raises(ValueError, match="vocab_size is 300"):
        load_tokenizer(bpe_dir, tiny_config(vocab_size=300))


def test_chat_template_renders_like_transformers(bpe):
    text = bpe.apply_chat_template(MESSAGES)
    assert text == (
        "<|pad|><role>SYSTEM</role>Be brief.<|endoftext|><role>USER</role>Hi 🙂<|endoftext|><role>ASSISTANT</role>"
    )
    assert not bpe.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("<role>ASSISTANT</role>")
    ids = bpe.encode(text, add_special_tokens=False)
    assert bpe.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        bpe.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_sandbox_and_helpers(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "unused"},
                    {
                        "name": "default",
                        "template": "{{ messages | tojson }}|{{ tools is none }}|{{ strftime_now('%Y') | length }}",
                    },
                ]
            }
        )
    )
    tokenizer = load_tokenizer(tmp_path, tiny_config())
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '[{"role": "user", "content": "é"}]|True|4'  # tojson keeps non-ASCII, as transformers
    (tmp_path / "chat_template.jinja").write_text("{{ messages.append(1) }}")  # wins over tokenizer_config
    with pytest.raises(jinja2.exceptions.SecurityError):
        load_tokenizer(tmp_path, tiny_config()).apply_chat_template(MESSAGES)


def test_missing_chat_template_is_a_clear_error(tmp_path):
    for model_dir in (None, tmp_path):
        with pytest.raises(ValueError, match="has no chat template.*--chat"):
            load_tokenizer(model_dir, tiny_config()).apply_chat_template(MESSAGES)


def test_byte_fallback_round_trip():
    tokenizer = load_tokenizer(None, tiny_config())
    assert isinstance(tokenizer, ByteTokenizer)
    ids = tokenizer.encode(MULTIBYTE)
    assert ids == list(MULTIBYTE.encode())
    assert len(ids) == len(MULTIBYTE) + 1 + 2 * 2 + 3  # é: 2 bytes, 世 界: 3 each, 🙂: 4
    assert tokenizer.decode(ids) == MULTIBYTE
    assert tokenizer.eos_ids == (1,)
    # ids past the byte range and the tiny preset's pad (0) / eos (1) decode to nothing
    assert tokenizer.decode([104, 256, 105, 0, 258, 1]) == "hi"
    assert tokenizer.decode([104, 1], skip_special_tokens=False) == "h\x01"
    assert "byte-level fallback" in tokenizer.name


def test_byte_fallback_needs_256_ids(tmp_path):
    with pytest.raises(ValueError, match="vocab_size >= 256.*200"):
        load_tokenizer(tmp_path, tiny_config(vocab_size=200))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing", tiny_config())


def stream(tokenizer, ids):
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


def test_stream_decoder_bytes_split_characters():
    tokenizer = load_tokenizer(None, tiny_config())
    pieces, rest = stream(tokenizer, tokenizer.encode(MULTIBYTE))
    assert "".join(pieces) == MULTIBYTE and rest == ""
    assert all("\ufffd" not in piece for piece in pieces)
    # 🙂 arrives as 4 bytes: three pushes print nothing, the fourth prints the whole character
    assert pieces[-4:] == ["", "", "", "🙂"]


def test_stream_decoder_extend_in_groups_equals_pushes(bpe):
    """Ids added several at a time (the CLI's decode groups) give the same text as one push per id."""
    text = f"{SENTENCES[2]} {MULTIBYTE} 界界 ok"
    ids = bpe.encode(text)
    rng = np.random.default_rng(3)
    decoder, pieces, start = StreamDecoder(bpe), [], 0
    while start < len(ids):
        stop = start + int(rng.integers(1, 6))  # groups of 1-5 ids, splitting multi-byte characters
        pieces.append(decoder.extend(ids[start:stop]))
        start = stop
    rest = decoder.flush()
    assert "".join(pieces) + rest == text and rest == ""
    assert all("\ufffd" not in piece for piece in pieces)


def test_stream_decoder_bpe(bpe):
    text = f"{SENTENCES[1]} {MULTIBYTE} 界界 ok"
    ids = bpe.encode(text)
    assert len(ids) > len(bpe.encode(SENTENCES[1])) + len(MULTIBYTE)  # multi-byte characters were split
    pieces, rest = stream(bpe, [*ids, bpe.backend.token_to_id("<|endoftext|>")])
    assert "".join(pieces) + rest == text and rest == ""
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces  # a token holding part of a character printed nothing


def test_stream_decoder_flushes_an_unfinished_character():
    tokenizer = load_tokenizer(None, tiny_config())
    pieces, rest = stream(tokenizer, [104, 0xE4, 0xB8, 0x80, 105, 0xF0, 0x9F])  # h, a lone byte, i, half of 🙂
    assert "".join(pieces) + rest == tokenizer.decode([104, 0xE4, 0xB8, 0x80, 105, 0xF0, 0x9F])
    assert rest == "\ufffd"


def test_stop_checker_cut_positions():
    checker = StopChecker(["</s>", "\n\n", "END"])
    assert checker.find("no stop here") is None
    assert checker.find("answer</s>more") == len("answer")
    assert checker.find("a\n\nb</s>") == 1  # the earliest occurrence wins
    assert checker.find("xEND</s>") == 1
    assert checker.find("</s>") == 0
    overlapping = StopChecker(["abcd", "bc"])
    assert overlapping.find("xabcd") == 2  # "bc" is complete before "abcd" is
    assert StopChecker(["cd", "bcd"]).find("abcd") == 1  # same end: the longer one


def test_stop_checker_printable_length():
    checker = StopChecker(["</s>", "END"])
    assert checker.printable_length("hello") == 5
    assert checker.printable_length("hello</") == 5  # "</" may become "</s>"
    assert checker.printable_length("hello<") == 5
    assert checker.printable_length("hello EN") == 6
    assert checker.printable_length("hello E</") == 7
    assert StopChecker([]).printable_length("abc") == 3
    assert StopChecker([]).find("abc") is None
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])
