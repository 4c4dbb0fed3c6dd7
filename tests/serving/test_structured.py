"""Structured outputs through the official `openai` client against `ling-serve` on the demo checkpoint (the serving
tests' shared demo server, tests/serving/conftest.py): `response_format` (json_schema, json_object) and vLLM's
`structured_outputs` / `guided_*` give text that parses and validates under sampling at temperature 1 (several
seeds, batched together, streamed and whole) and greedily; a bad schema or regex is a 400 naming the field and the
server keeps serving. The device-side mask against numpy on random logits."""

from __future__ import annotations

import concurrent.futures
import json
import re
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from doc_blocks import blocks
from helpers import REPO_ROOT
from optional_deps import require_serve_extra

from ling_jax.generation.grammar_mask import mask_logits, unconstrained
from ling_jax.generation.sampling import SamplingArrays, SamplingParams, sample

require_serve_extra()
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

from ling_jax.serving import structured  # noqa: E402  (needs the serve extra)
from ling_jax.serving.schemas import APIError, ChatBody, parse  # noqa: E402

MODEL = "ling-demo"
COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": COLORS},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SEEDS = (0, 1, 2)
MAX_TOKENS = 96


def _needs_llguidance():
    pytest.importorskip("llguidance", reason=f"structured outputs need {structured.PACKAGE} (the serve extra)")


def test_mask_logits_equals_numpy_on_an_odd_vocabulary():
    vocab, rng = 101, np.random.default_rng(0)  # 4 words: the last one's bits past 101 are set at random
    logits_BV = rng.normal(size=(3, vocab)).astype(np.float32)
    bitmask_BW = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    bitmask_BW[2] = -1  # a row without a grammar
    allowed_BV = np.unpackbits(bitmask_BW.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    masked_BV = np.asarray(mask_logits(jnp.asarray(logits_BV), jnp.asarray(bitmask_BW)))
    np.testing.assert_array_equal(masked_BV, np.where(allowed_BV, logits_BV, -np.inf))
    free_BW = jnp.asarray(unconstrained(3, vocab))
    np.testing.assert_array_equal(np.asarray(mask_logits(jnp.asarray(logits_BV), free_BW)), logits_BV)
    # greedy and sampled rows both take an allowed token
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3), SamplingParams(seed=4)]
    arrays = SamplingArrays.from_params(params, vocab).replace(token_bitmask_BW=jnp.asarray(bitmask_BW))
    tokens_B = np.asarray(sample(jnp.asarray(logits_BV), arrays, jnp.zeros(3, jnp.int32), jnp.zeros((3, vocab), bool)))
    assert allowed_BV[[0, 1], tokens_B[:2]].all()
    assert tokens_B[0] == np.argmax(np.where(allowed_BV[0], logits_BV[0], -np.inf))


def test_without_llguidance_a_grammar_is_a_400_naming_the_package(monkeypatch, demo_tokenizer):
    monkeypatch.setattr(structured, "llguidance", None)
    body = parse(ChatBody, json.dumps({"model": MODEL, "messages": ASK, "guided_regex": "a+"}).encode())
    with pytest.raises(APIError) as error:
        structured.compile_constraint(structured.constraint_of(body), demo_tokenizer, 4096)
    assert error.value.param == "guided_regex" and structured.PACKAGE in error.value.message


def test_a_grammar_with_mtp_is_a_400(demo_tokenizer):
    body = parse(ChatBody, json.dumps({"model": MODEL, "messages": ASK, "response_format": {"type": "json_object"}}))
    engine = SimpleNamespace(mtp=2, config=SimpleNamespace(vocab_size=4096))
    with pytest.raises(APIError, match="--mtp") as error:
        structured.grammar_of(body, demo_tokenizer, engine)
    assert error.value.param == "response_format"


@pytest.fixture(scope="module")
def client(demo_server):
    _needs_llguidance()
    return openai.OpenAI(base_url=demo_server.ready() + "/v1", api_key="unused", timeout=300, max_retries=0)


def _validate(text: str) -> None:
    """The text is one JSON document that SCHEMA accepts (jsonschema when installed, else the same rules by hand)."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == set(SCHEMA["required"])
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert type(value["age"]) is int and 0 <= value["age"] <= 150 and value["color"] in COLORS
    else:
        jsonschema.validate(value, SCHEMA)


def _chat(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(the reply's content, its finish reason)."""
    args = {"model": MODEL, "messages": ASK, "max_tokens": MAX_TOKENS} | kwargs
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **args))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_always_validates_at_temperature_1(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    with concurrent.futures.ThreadPoolExecutor(len(SEEDS) + 1) as pool:  # one batch: three grammars, a plain row
        plain = pool.submit(_chat, client, stream, seed=9, max_tokens=8)
        replies = list(pool.map(lambda seed: _chat(client, stream, response_format=response_format, seed=seed), SEEDS))
    for text, finish in replies:
        assert finish == "stop", text
        _validate(text)
    assert plain.result()[1] == "length"  # the row without a grammar is not constrained


def test_a_json_schema_greedily_and_vllm_spellings(client):
    text, finish = _chat(client, False, temperature=0, extra_body={"guided_json": SCHEMA})
    assert finish == "stop"
    _validate(text)
    reply = client.completions.create(
        model=MODEL, prompt="Person:", max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"json": SCHEMA}}
    )
    _validate(reply.choices[0].text)


def test_json_object_starts_an_object_whose_every_token_the_grammar_allows(client, demo_tokenizer):
    text, finish = _chat(client, False, seed=0, max_tokens=24, response_format={"type": "json_object"})
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the demo model's strings run long: a prefix that llguidance's JSON grammar accepts
        assert text.startswith("{")
        grammar = structured.compile_constraint(
            structured.Constraint("response_format", "json", structured.ANY_JSON_OBJECT), demo_tokenizer, 4096
        )
        matcher = grammar.matcher()
        for token in demo_tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
        assert not matcher.done  # neither failed nor complete


def test_regex_choice_and_grammar(client):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for temperature in (1.0, 0.0):
        reply = client.completions.create(
            model=MODEL, prompt="Code:", max_tokens=16, temperature=temperature, extra_body={"guided_regex": pattern}
        )
        assert re.fullmatch(pattern, reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
        text, finish = _chat(client, True, temperature=temperature, extra_body={"guided_choice": ["yes", "no"]})
        assert text in ("yes", "no") and finish == "stop"
    constraint = {"structured_outputs": {"grammar": 'root ::= "Mr. " ("Darcy" | "Bingley")'}}
    text, _ = _chat(client, False, extra_body=constraint)
    assert text in ("Mr. Darcy", "Mr. Bingley")


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format",
        ),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_keeps_serving(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert error.value.body["param"] == param
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_the_docs_example_works_as_written(client, capsys):
    """docs/serving.md's structured outputs example, pointed at this server."""
    docs = (REPO_ROOT / "docs" / "serving.md").read_text()
    (example,) = [b.code for b in blocks(docs, "docs/serving.md") if b.lang == "python" and "json_schema" in b.code]
    exec(example.replace("http://127.0.0.1:8000", str(client.base_url).removesuffix("/v1/")), {"__name__": "doc"})
    names, code = capsys.readouterr().out.splitlines()
    assert names == "['age', 'color', 'name']" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", code)
