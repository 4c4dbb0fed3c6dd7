"""The commands' refusals of bad input: one `error: ...` line naming the flag or file, before anything slow runs
and before anything is written. Every case calls a command's `main(argv)` (or its checking function) in process
and fails before a model is built or a weight read."""

from __future__ import annotations

import importlib
import json
import re
import types

import jax
import pytest
from helpers import REPO_ROOT
from optional_deps import require_serve_extra

from convert import cli as convert_cli
from ling_jax.generation import cli as generate_cli
from ling_jax.presets import preset
from ling_jax.training import cli as train_cli


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("It is a truth universally acknowledged.\n")
    return path


def _refusal(capsys, main, argv) -> str:
    """`main(argv)`'s one `error:` line, the last on stderr (a preset's NOTE may come first; a traceback would end
    in another line); it must exit with status 2."""
    assert main([str(arg) for arg in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.startswith("error: ") for line in lines] == [False] * (len(lines) - 1) + [True], lines
    return lines[-1]


def _usage_error(capsys, parse, argv) -> list[str]:
    """`parse(argv)`'s argparse refusal (exit status 2): its stderr lines."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--corpus", "{tmp}/missing.txt"], "--corpus {tmp}/missing.txt: No such file or directory"),
        (["--corpus", "{tmp}"], "--corpus {tmp}: Is a directory"),
        (["--config", "no-such-preset"], "--config no-such-preset: not a preset ("),
        (["--config", "{tmp}/corpus.txt"], "--config: {tmp}/corpus.txt: not valid JSON"),
        (["--tokenizer", "{tmp}"], "--tokenizer {tmp}: tokenizer.json and tokenizer_config.json missing"),
        (["--vocab-size", "100"], "--vocab-size 100: a trained byte-level BPE needs 258 tokens at least"),
        (["--vocab-size", "5000"], "ling-demo's vocab_size (4096) at most"),
        (["--seq-len", "4096"], "--seq-len 4096 exceeds the config's max_position_embeddings 2048"),
    ],
)
def test_train_refuses_bad_input_before_writing(tmp_path, corpus, capsys, flags, expected):
    out = tmp_path / "run"
    argv = ["--corpus", corpus, "--out", out, *(flag.format(tmp=tmp_path) for flag in flags)]
    assert expected.format(tmp=tmp_path) in _refusal(capsys, train_cli.main, argv)
    assert not out.exists()


def test_train_refuses_a_corpus_that_is_not_text(tmp_path, capsys):
    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(b"\xff\xfe text")
    argv = ["--corpus", corpus, "--out", tmp_path / "run"]
    assert f"--corpus {corpus}: not UTF-8 text (byte 0xff at offset 0)" in _refusal(capsys, train_cli.main, argv)


def test_train_never_replaces_an_export_dir_it_did_not_write(tmp_path, corpus, capsys):
    """OUT/hf is replaced by a finished export; a directory there that is not one is refused, and kept."""
    out = tmp_path / "run"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "notes.txt").write_text("mine")
    line = _refusal(capsys, train_cli.main, ["--corpus", corpus, "--out", out])
    assert f"{out / 'hf'} is not a ling-train export" in line
    assert (out / "hf" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--lr", "0", "--lr must be > 0, got 0.0"),
        ("--lr", "nan", "--lr must be > 0, got nan"),
        ("--grad-clip", "-1", "--grad-clip must be > 0, got -1.0"),
        ("--warmup", "-1", "--warmup must be >= 0, got -1"),
        ("--weight-decay", "-0.1", "--weight-decay must be >= 0, got -0.1"),
        ("--sample-tokens", "-1", "--sample-tokens must be >= 0, got -1"),
    ],
)
def test_train_flag_bounds(capsys, flag, value, expected):
    argv = ["--corpus", "c.txt", "--out", "run", flag, value]
    assert _usage_error(capsys, train_cli.parse_args, argv) == [f"ling-train: error: {expected}"]


def test_train_help_states_every_default():
    """Every ling-train flag that has a default says it in its --help line."""
    parser = train_cli.build_parser()
    for action in parser._actions:
        if action.default not in (None, False, "==SUPPRESS==") and action.help is not None:
            assert "default" in action.help, action.option_strings


def test_generate_system_message_with_interactive_needs_a_chat_template(capsys):
    """--system goes with --interactive as with --chat; a model without a chat template (a preset's byte
    tokenizer) has no place for it, refused before the model is built."""
    argv = ["--interactive", "--system", "Be brief.", "--preset", "tiny"]
    assert "--system: the random 'tiny' preset has no chat template" in _refusal(capsys, generate_cli.main, argv)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--prefix-cache-gb", "inf"], "--prefix-cache-gb must be >= 0 and finite (0 = off), got inf"),
        (["--served-model-name", " "], "--served-model-name must not be empty (it is the model id clients ask for)"),
    ],
)
def test_serve_refuses_bad_flags(capsys, flags, expected):
    require_serve_extra()
    from ling_jax.serving import cli as serve_cli

    assert _refusal(capsys, serve_cli.main, flags) == f"error: {expected}"


@pytest.mark.parametrize(
    ("main", "positional", "prefix"),
    [(generate_cli.main, [], "error: "), (convert_cli.main, ["src", "dst"], "ling-convert: error: ")],
    ids=["generate", "convert"],
)
@pytest.mark.parametrize(
    ("mesh", "expected"),
    [
        ("tensor=0", "--mesh 'tensor=0': mesh axis sizes must be positive integers"),
        ("tensor=1,tensor=1", "--mesh 'tensor=1,tensor=1': each axis at most once, got tensor more than once"),
    ],
)
def test_mesh_errors_name_the_flag(tmp_path, capsys, main, positional, prefix, mesh, expected):
    """Every command's --mesh goes through `flags.parse_mesh_flag`: its refusals name the flag and the value."""
    assert main([str(tmp_path / name) for name in positional] + ["--mesh", mesh]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(prefix + expected)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (b"[1, 2]", None, "the request body must be a JSON object, got an array"),
        (b"null", None, "the request body must be a JSON object, got null"),
        ({"stop": [5]}, "stop", "stop: expected a string or an array of strings"),
        (
            {"messages": [{"role": "user", "content": [1]}]},
            "messages",
            "messages.0.content: expected a string or an array of objects",
        ),
        (
            {"messages": [{"role": "wizard", "content": "Hi"}]},
            "messages",
            "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant', 'tool' or 'function'",
        ),
    ],
)
def test_serve_refuses_malformed_chat_bodies(body, param, message):
    require_serve_extra()
    from ling_jax.serving.schemas import APIError, ChatBody, parse

    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    raw = body if isinstance(body, bytes) else json.dumps({**chat, **body}).encode()
    with pytest.raises(APIError) as refusal:
        parse(ChatBody, raw)
    assert (refusal.value.status, refusal.value.param, refusal.value.message) == (400, param, message)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"max_completion_tokens": -3}, "max_completion_tokens", "max_completion_tokens must be >= 1, got -3"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"stop_token_ids": [5, 259]}, "stop_token_ids", "stop_token_ids must be token ids in [0, 259), got [259]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages",
            'a text content part needs a string "text"',
        ),
    ],
)
def test_serve_names_the_field_it_refuses(fields, param, message):
    """The chat route's checks before a request is queued, on a server of the tiny preset (vocabulary 259)."""
    require_serve_extra()
    from ling_jax.serving import api
    from ling_jax.serving.schemas import APIError, ChatBody, parse

    engine = types.SimpleNamespace(max_batch=2, config=preset("tiny"))
    service = types.SimpleNamespace(model_name="m", scheduler=types.SimpleNamespace(engine=engine))
    body = parse(ChatBody, json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}))
    with pytest.raises(APIError) as refusal:
        api._check_common(service, body, body.token_limit, field=body.token_limit_field)
        body.messages[0].text()
    assert (refusal.value.status, refusal.value.param, refusal.value.message) == (400, param, message)


@pytest.mark.parametrize(
    ("main", "argv", "expected"),
    [
        (generate_cli.main, ["--dtype", "float16"], "generate.py: error: argument --dtype: invalid choice: 'float16'"),
        (train_cli.main, ["--corpus", "c.txt"], "ling-train: error: the following arguments are required: --out"),
    ],
    ids=["generate", "train"],
)
def test_usage_errors_are_one_line(capsys, main, argv, expected):
    """argparse's own refusals too: one line naming the flag (`flags.CommandParser`), not the usage block."""
    (line,) = _usage_error(capsys, main, argv)
    assert line.startswith(expected)


@pytest.mark.parametrize(
    ("module", "builder", "doc"),
    [
        ("ling_jax.generation.cli", "build_parser", "generation.md"),
        ("ling_jax.serving.cli", "build_parser", "serving.md"),
        ("convert.cli", "_parser", "conversion.md"),
        ("ling_jax.training.cli", "build_parser", "training.md"),
    ],
)
def test_every_flag_is_documented_with_its_default(module, builder, doc):
    """Each command's flags, every one, appear in its page of docs/ (as `--flag`); every flag of the page's table
    (rows `| `--flag ...` | default | meaning |`) exists, and a default the table states as a number or `off` is
    the parser's."""
    if module == "ling_jax.serving.cli":
        require_serve_extra()
    parser = getattr(importlib.import_module(module), builder)()
    text = (REPO_ROOT / "docs" / doc).read_text()
    defaults = {option: action.default for action in parser._actions for option in action.option_strings}
    assert not sorted(f for f in defaults.keys() - {"-h", "--help"} if not re.search(rf"`{f}(?![\w-])", text)), doc
    table = dict(re.findall(r"^\| `(--[\w-]+)[^`]*` \| ([^|]*) \|", text, re.MULTILINE))
    assert table.keys() <= defaults.keys(), sorted(table.keys() - defaults.keys())
    for flag, cell in table.items():
        stated = re.fullmatch(r"\s*(off|[\d.e-]+)\s*(\(.*\))?\s*", cell)  # "off", "64", "0 (off)"; not "0.1 with ..."
        if stated is not None and stated[1] == "off":
            assert defaults[flag] is False, flag
        elif stated is not None:
            assert defaults[flag] == float(stated[1]), (flag, stated[1], defaults[flag])


def test_bench_serve_quick_keeps_the_flags_given():
    """benchmarks.serve --quick sets its small sizes only where no flag is given."""
    from benchmarks import serve

    args = serve.parse_args(["--quick", "--max-output", "20"])
    assert (args.min_prompt, args.max_prompt, args.min_output, args.max_output) == (8, 40, 2, 20)
    assert (serve.parse_args([]).prefill_chunk, serve.parse_args(["--quick"]).prefill_chunk) == (512, 32)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--concurrency", "1,x"], "--concurrency: expected positive integers, comma-separated, got '1,x'"),
        (["--quick", "--min-output", "50"], "--min-output 50 and --max-output 12: expected 0 < --min-output <="),
    ],
)
def test_bench_serve_refuses_bad_sizes(capsys, argv, expected):
    from benchmarks import serve

    assert expected in _usage_error(capsys, serve.parse_args, argv)[-1]


def test_generate_images_on_a_vl_named_preset_say_presets_are_text_models(tmp_path, capsys):
    argv = ["--preset", "ling-3.0-flash-vl", "--image", tmp_path / "cat.png", "Describe it."]
    line = _refusal(capsys, generate_cli.main, argv)
    assert line.endswith("is a text model (every preset is, a -vl one too: the VL's text part)")


def test_serve_names_the_forms_a_completion_prompt_takes():
    require_serve_extra()
    from ling_jax.serving.schemas import APIError, CompletionBody, parse

    with pytest.raises(APIError) as refusal:
        parse(CompletionBody, json.dumps({"model": "m", "prompt": [1.5]}).encode())
    expected = "prompt: expected a string, an array of strings, an array of integers or an array of arrays of integers"
    assert (refusal.value.param, refusal.value.message) == ("prompt", expected)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal of GPU kernels on a CPU")
def test_generate_refuses_compiled_kernels_of_another_platform(capsys):
    """On this CPU machine pallas_gpu would fail at the first compilation, after loading: refused before."""
    line = _refusal(capsys, generate_cli.main, ["--kernel-backend", "pallas_gpu", "Hi"])
    assert line == (
        "error: --kernel-backend pallas_gpu compiles GPU kernels, and JAX runs on cpu here: use auto, reference or "
        "interpret_gpu (the same kernels interpreted, slowly)"
    )


def test_train_tokenizer_leaves_no_partial_file(tmp_path):
    """tokenizer.json, the file a later run reuses the pair by, is renamed into place last."""
    directory = tmp_path / "tokenizer"
    train_cli.train_tokenizer(["It is a truth universally acknowledged.\n"] * 4, 300, str(directory), 64)
    assert sorted(p.name for p in directory.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    _, eos_id, pad_id = train_cli.load_tokenizer(str(directory))
    assert (pad_id, eos_id) == (0, 1)


def test_serve_refuses_a_model_that_cannot_fit_before_loading(capsys, monkeypatch):
    """ling-serve runs generate.py's memory check for --max-batch slots of --max-context tokens: on a chip of
    1 MiB the demo checkpoint is one refusal naming the figures; --no-memory-check skips it (the port check after
    it refuses instead: nothing is loaded or served either way)."""
    require_serve_extra()
    from ling_jax.generation import cli_checks
    from ling_jax.generation.memory_plan import Hardware
    from ling_jax.serving import cli as serve_cli

    monkeypatch.setattr(cli_checks, "device_memory", lambda: Hardware("test-chip", 2**20, 1.0, "a test"))
    line = _refusal(capsys, serve_cli.main, ["--max-batch", "2", "--max-context", "256", "--port", "-1"])
    assert "does not fit:" in line and "(mesh one device, --weights stored, batch 2, context 256)" in line
    assert "usable on test-chip" in line and "--no-memory-check skips this check" in line
    flags = ["--max-batch", "2", "--max-context", "256", "--port", "-1", "--no-memory-check"]
    assert _refusal(capsys, serve_cli.main, flags) == "error: --port must be in 0..65535, got -1"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--batches", "1,x"], "--batches: expected positive integers, comma-separated, got '1,x'"),
        (["--steps", "0"], "argument --steps: must be positive, got 0"),
        (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
        (["--prefill-only", "--mtp", "1"], "--prefill-only times no decode step: it takes none of --decode-only"),
        (["--kda-prefill", "default,short"], "--kda-prefill: expected names among default, reference, gpu_triton"),
        (["--mla-prefill", "mosaic"], "--mla-prefill: expected names among default, reference, gpu_triton, gpu_mosaic"),
        (["--prefill-command-buffers", "on,no"], "--prefill-command-buffers: expected on and/or off, got 'on,no'"),
    ],
)
def test_bench_generate_refuses_bad_flags_before_building_a_model(capsys, argv, expected):
    from benchmarks import generate

    assert expected in _usage_error(capsys, generate.main, ["--quick", *argv])[-1]


def test_distributed_without_a_coordinator_says_which_flags_join(monkeypatch):
    from ling_jax import distributed

    def undetected(**_):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.setattr(jax.distributed, "initialize", undetected)
    args = types.SimpleNamespace(coordinator=None, num_processes=None, process_id=None, distributed_timeout=5)
    with pytest.raises(distributed.DistributedError, match="give --coordinator HOST:PORT, --num-processes N and --pr"):
        distributed.join(args)


def test_a_memory_refusal_on_a_gpu_names_jax_s_memory_fraction(monkeypatch):
    from ling_jax.generation.cli_checks import memory_fraction_hint

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in memory_fraction_hint("gpu")
    assert memory_fraction_hint("cpu") == memory_fraction_hint("tpu") == ""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert memory_fraction_hint("gpu") == ""


def test_w8a8_moe_bench_refuses_quick_with_a_preset_width(capsys):
    """`benchmarks.moe --fp8-matmul w8a8`: --width-of names a preset's full sizes, --quick its own small ones."""
    from benchmarks.moe import w8a8

    argv = ["--quick", "--width-of", "ling-3.0-flash"]
    assert "--quick runs its own small sizes" in _usage_error(capsys, w8a8.main, argv)[-1]


def test_mla_prefill_bench_refuses_bad_sizes(capsys):
    """`benchmarks.mla_prefill --sizes`: CHUNKxSLOTS pairs with the chunk inside the cache, refused before the GPU
    check."""
    from benchmarks import mla_prefill

    assert "expected CHUNKxSLOTS" in _usage_error(capsys, mla_prefill.main, ["--sizes", "8192"])[-1]
    assert "0 < CHUNK <= SLOTS" in _usage_error(capsys, mla_prefill.main, ["--sizes", "4096x2048"])[-1]
