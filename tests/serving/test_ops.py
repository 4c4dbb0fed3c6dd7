"""`ling-serve`'s operations: the API key, vLLM's tokenizer routes, the request-size limit, `max_model_len` in
/v1/models and the refusal of unsupported fields, against one server on the demo checkpoint started on 127.0.0.1
with a key (from $LING_API_KEY) and a small size limit, driven with the official `openai` client and httpx."""

from __future__ import annotations

import pytest
from doc_blocks import blocks
from helpers import REPO_ROOT
from optional_deps import require_serve_extra
from served import DEMO_MAX_CONTEXT, DEMO_SERVER_ENV, DEMO_SERVER_FLAGS

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

from ling_jax.serving import cli  # noqa: E402

MODEL, KEY, MAX_CONTEXT, MAX_REQUEST_BYTES = "ling-demo", "test-key-0123", DEMO_MAX_CONTEXT, 4096
REQUEST_TIMEOUT_S = 60
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url(start_server):
    """A server of this module's own (a key, a size limit) with the demo server's other flags: it compiles nothing
    that the demo server compiled in this run (the compile cache)."""
    flags = [*DEMO_SERVER_FLAGS, "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    with start_server(flags, DEMO_SERVER_ENV | {cli.API_KEY_ENV: KEY}) as server:
        yield server.ready()  # /health needs no key


DOC_URL, DOC_KEY = "http://127.0.0.1:8000", "my-key"  # the docs example's


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_the_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.api_key(cli.build_parser().parse_args(["--api-key", "from-flag"])) == "from-flag"
    assert cli.api_key(cli.build_parser().parse_args([])) == "from-env"
    monkeypatch.delenv(cli.API_KEY_ENV)
    assert cli.api_key(cli.build_parser().parse_args([])) is None


@pytest.mark.parametrize(
    "flags, message",
    [(["--api-key", " "], "--api-key must not be empty"), (["--max-request-bytes", "0"], "must be >= 1, got 0")],
)
def test_bad_flags_are_one_error_line(flags, message, capsys):
    assert cli.main(flags) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flags[0]}") and message in err and err.count("\n") == 1


def test_every_route_but_health_needs_the_key(url):
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        _client(url, "wrong").models.list()
    for path in ("/v1/models", "/metrics", "/tokenizer_info"):
        error = _error(httpx.get(url + path), 401)
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    _error(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a"}), 401)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/metrics", headers=AUTH).status_code == 200
    models = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, MAX_CONTEXT)]
    reply = _client(url, KEY).completions.create(model=MODEL, prompt="Once", max_tokens=2, temperature=0, user="u1")
    assert reply.usage.completion_tokens <= 2 and reply.choices[0].finish_reason in ("length", "stop")


def test_tokenize_and_detokenize_equal_the_tokenizer(url, demo_tokenizer):
    text = "It is a truth universally acknowledged"
    reply = httpx.post(url + "/tokenize", headers=AUTH, json={"model": MODEL, "prompt": text}).json()
    assert reply == {"count": len(reply["tokens"]), "max_model_len": MAX_CONTEXT, "tokens": demo_tokenizer.encode(text)}
    back = httpx.post(url + "/detokenize", headers=AUTH, json={"tokens": reply["tokens"]}).json()
    assert back == {"prompt": demo_tokenizer.decode(reply["tokens"], skip_special_tokens=False)} == {"prompt": text}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = httpx.post(url + "/tokenize", headers=AUTH, json={"messages": messages}).json()
    rendered = demo_tokenizer.apply_chat_template(messages)
    assert chat["tokens"] == demo_tokenizer.encode(rendered, add_special_tokens=False)
    reply = _client(url, KEY).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]  # the chat route feeds the model the same tokens
    info = httpx.get(url + "/tokenizer_info", headers=AUTH).json()
    assert info["tokenizer_class"] and info["chat_template"] == demo_tokenizer.chat_template
    error = _error(httpx.post(url + "/detokenize", headers=AUTH, json={"tokens": [1, -1]}), 400)
    assert error["param"] == "tokens"


def test_an_unsupported_field_is_refused_by_name_and_the_server_keeps_serving(url):
    client = _client(url, KEY)
    with pytest.raises(openai.BadRequestError, match="best_of") as refused:
        client.completions.create(model=MODEL, prompt="Once", max_tokens=2, best_of=2)
    assert refused.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.audio"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi", "audio": {"id": "a1"}}])
    with pytest.raises(openai.BadRequestError, match="stream_options.continuous_usage_stats"):
        client.completions.create(model=MODEL, prompt="a", stream=True, stream_options={"continuous_usage_stats": True})
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "temperature": 0, "best_of": None}
    assert httpx.post(url + "/v1/completions", headers=AUTH, json=body).status_code == 200  # null: as absent


def test_a_body_over_the_size_limit_gets_413(url):
    body = {"model": MODEL, "prompt": "a" * MAX_REQUEST_BYTES}
    error = _error(httpx.post(url + "/v1/completions", headers=AUTH, json=body), 413)
    assert error["code"] == "request_too_large" and str(MAX_REQUEST_BYTES) in error["message"]
    chunked = iter([b'{"model": "ling-demo", "prompt": "', b"a" * MAX_REQUEST_BYTES, b'"}'])  # no Content-Length
    _error(httpx.post(url + "/tokenize", headers=AUTH, content=chunked), 413)
    assert httpx.post(url + "/tokenize", headers=AUTH, json={"prompt": "a" * 100}).json()["count"] > 0


def test_the_docs_example_works_as_written(url, capsys):
    """docs/serving.md's example of these routes, pointed at this server and its key."""
    page = (REPO_ROOT / "docs" / "serving.md").read_text()
    example = next(b.code for b in blocks(page, "docs/serving.md") if b.lang == "python" and "/tokenize" in b.code)
    exec(example.replace(DOC_URL, url).replace(DOC_KEY, KEY), {"__name__": "docs_example"})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(MAX_CONTEXT) and printed[1].endswith("It is a truth")
    assert printed[2].startswith("unsupported field `suffix`")
