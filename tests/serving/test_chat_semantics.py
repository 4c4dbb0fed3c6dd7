"""Ling 3.x chat semantics through the official `openai` client: tools rendered by a Ling-style chat template, the
model's tool calls parsed into `tool_calls` (whole and streamed), the thinking switch in the rendered prompt, the
role-end stop, bad tool fields refused. The model's output is scripted (a stand-in scheduler replies with recorded
text), so the server here is the API layer alone, on 127.0.0.1."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from doc_blocks import blocks
from helpers import REPO_ROOT, serve_in_thread
from optional_deps import require_serve_extra

from ling_jax import load_model_config
from ling_jax.generation.cli import DEMO_DIR
from ling_jax.generation.completion import Completion
from ling_jax.generation.tokenizer import StopChecker, load_tokenizer
from ling_jax.serving.metrics import Metrics
from ling_jax.serving.scheduler import Delta, Finish

require_serve_extra()
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")
uvicorn = pytest.importorskip("uvicorn")

from ling_jax.serving.api import Service, create_app  # noqa: E402  (needs the serve extra)

MODEL = "ling-scripted"
# written like Ling 3.x's template (docs: the spec's chat format): turns closed by <|role_end|>, the thinking
# switch on the system line, the generation prompt opening (or pre-closing) <think>, tools as JSON lines
LING_TEMPLATE = """\
{%- set thinking = enable_thinking if enable_thinking is defined else true -%}
<role>SYSTEM</role>
{%- if tools %}# Tools
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>NAME
<arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>
</tool_call>
{% endif %}detailed thinking {{ 'on' if thinking else 'off' }}<|role_end|>
{%- for m in messages %}
{%- if m.role == 'user' %}<role>HUMAN</role>{{ m.content }}<|role_end|>
{%- elif m.role == 'assistant' %}<role>ASSISTANT</role>{{ m.content }}
{%- for call in m.tool_calls or [] %}<tool_call>{{ call.function.name }}
{% for k, v in call.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}<|role_end|>
{%- elif m.role == 'tool' %}<role>OBSERVATION</role>{{ m.content }}<|role_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<role>ASSISTANT</role>
<think>{% if not thinking %}</think>{% endif %}{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>3</arg_value>\n</tool_call>"
)
REPLY = "The user wants a forecast; I have a tool for that.\n" + CALL  # no </think>: the call ends the reasoning


class ScriptedScheduler:
    """Replies to every request with `pieces` (one delta each), recording the requests."""

    def __init__(self, vocab_size: int):
        self.engine = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size), max_batch=1)
        self.eos_ids = frozenset()
        self.error = None
        self.metrics = Metrics()
        self.pieces: list[str] = []
        self.jobs: list = []

    def submit(self, job) -> None:
        self.jobs.append(job)
        job.tokens.extend(range(len(self.pieces)))
        for i, piece in enumerate(self.pieces):
            job.emit(Delta(piece, (), Finish.STOP if i == len(self.pieces) - 1 else None))

    def cancel(self, job) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = load_tokenizer(DEMO_DIR, load_model_config(DEMO_DIR))
    tokenizer.chat_template = LING_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def scheduler(tokenizer):
    return ScriptedScheduler(load_model_config(DEMO_DIR).vocab_size)


@pytest.fixture(scope="module")
def client(scheduler, tokenizer):
    with serve_in_thread(create_app(Service(scheduler, tokenizer, MODEL, max_context=4096))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=30, max_retries=0)


def _prompt(scheduler, tokenizer) -> str:
    return tokenizer.decode(scheduler.jobs[-1].prompt, skip_special_tokens=False)


def test_tools_and_the_thinking_switch_in_the_rendered_prompt(client, scheduler, tokenizer):
    scheduler.pieces = ["Fine."]
    client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    prompt = _prompt(scheduler, tokenizer)
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt
    assert "detailed thinking on" in prompt and prompt.endswith("<role>ASSISTANT</role>\n<think>")
    assert scheduler.jobs[-1].stop == ("<|role_end|>",)  # the end of a turn, spelled out, stops the reply
    for switch in ("enable_thinking", "thinking"):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {switch: False}}
        )
        prompt = _prompt(scheduler, tokenizer)
        assert "detailed thinking off" in prompt and prompt.endswith("<think></think>")
        assert "# Tools" not in prompt
        assert reply.choices[0].message.content == "Fine." and reply.choices[0].finish_reason == "stop"


def test_tool_calls_whole(client, scheduler):
    scheduler.pieces = [REPLY]
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants a forecast; I have a tool for that.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("piece", [1, 7])
def test_tool_calls_streamed(client, scheduler, piece):
    reply = REPLY + "\n" + CALL.replace("Paris", "Lyon")
    scheduler.pieces = [reply[i : i + piece] for i in range(0, len(reply), piece)]
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    calls, reasoning, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += delta.model_extra.get("reasoning_content") or ""
        assert not delta.content
        for call in delta.tool_calls or []:
            if call.index not in calls:  # the first delta of a call: its id and name, no arguments yet
                assert call.id.startswith("call_") and call.function.name and not call.function.arguments
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and reasoning == "The user wants a forecast; I have a tool for that.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Lyon", "days": 3}),
    ]
    assert len({c["id"] for c in calls.values()}) == 2


def test_a_named_tool_choice_starts_the_reply_with_the_call(client, scheduler, tokenizer):
    scheduler.pieces = [CALL.removeprefix("<tool_call>get_weather\n")]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice)
    assert _prompt(scheduler, tokenizer).endswith("<think><tool_call>get_weather\n")
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice, stream=True)
    calls = [call for chunk in stream for call in chunk.choices[0].delta.tool_calls or []]
    assert [call.function.name for call in calls] == ["get_weather", None]
    assert json.loads(calls[1].function.arguments) == {"city": "Paris", "days": 3}


def test_tool_choice_none_hides_the_tools_and_parses_nothing(client, scheduler, tokenizer):
    scheduler.pieces = ["</think>" + CALL]
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "# Tools" not in _prompt(scheduler, tokenizer)
    assert reply.choices[0].message.content == CALL and reply.choices[0].message.tool_calls is None


def test_a_tool_conversation_renders(client, scheduler, tokenizer):
    scheduler.pieces = ["Sunny."]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"})
    client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    prompt = _prompt(scheduler, tokenizer)
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>" in prompt
    assert "<role>OBSERVATION</role>sunny, 21 C<|role_end|>" in prompt


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": "no"}}}, "chat_template_kwargs"),
        ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
        ({"extra_body": {"chat_template_kwargs": {"thinking": {"on": 1}}}}, "chat_template_kwargs"),
    ],
)
def test_bad_tool_fields_get_a_400_naming_them(client, scheduler, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, **extra)
    assert error.value.body["param"] == param
    scheduler.pieces = ["</think>still serving"]
    assert client.chat.completions.create(model=MODEL, messages=ASK).choices[0].message.content == "still serving"


def test_the_docs_example_works_as_written(client, scheduler, capsys):
    """docs/serving.md's tools example, pointed at this server and its model."""
    docs = (REPO_ROOT / "docs" / "serving.md").read_text()
    (example,) = [b.code for b in blocks(docs, "docs/serving.md") if b.lang == "python" and "tools=" in b.code]
    scheduler.pieces = [REPLY]
    url = str(client.base_url).removesuffix("/v1/")
    exec(example.replace("http://127.0.0.1:8000", url).replace("Ling-3.1-flash", MODEL), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert out.startswith("tool_calls The user wants a forecast") and "get_weather {'city': 'Paris', 'days': 3}" in out


def test_streamed_text_never_splits_a_character(tokenizer):
    """The scheduler's text path (`Completion`): a character whose bytes span tokens reaches the client whole."""
    text = "Zürich 世界 🙂 ok <|role_end|> never shown"
    completion = Completion(tokenizer, StopChecker(["<|role_end|>"]))
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        completion.add([token])
        pieces.append(completion.unshown())
    assert completion.stopped and "".join(pieces) == "Zürich 世界 🙂 ok "
    assert all("\ufffd" not in piece for piece in pieces) and "" in pieces  # a partial character waited
