"""scripts/generate.py: flags, prompt sources, streaming, stop strings, JSON output, MTP, and one-line errors.

Most cases call `generate_cli.main(argv)` in process (compilations are shared between calls); three run the
real script in a subprocess. The checkpoint is the tiny preset with random weights, written in HF format with
a small byte-level BPE tokenizer.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from helpers import ONE_DEVICE_XLA_FLAGS, REPO_ROOT, train_byte_bpe

from convert.synthetic import write_random_checkpoint
from ling_jax import ExecutionPolicy, FP8Matmul, KernelBackend, LingConfig
from ling_jax.config import DENSE, KDA, MLA, MOE
from ling_jax.generation import cli as generate_cli
from ling_jax.generation import cli_checks, flags
from ling_jax.generation.completion import Completion
from ling_jax.generation.tokenizer import StopChecker, load_tokenizer
from ling_jax.presets import preset

ROOT = REPO_ROOT
SCRIPT = ROOT / "scripts" / "generate.py"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Ling is a mixture of experts language model.",
    "Delta attention keeps a fixed size state per layer.",
]
# pad = 0 and eos = 1, as in the tiny preset's config
SPECIALS = ["<|pad|>", "<|endoftext|>", "<role>"]
# short, so that a chat prompt pads to the same 16 tokens as PROMPTS and reuses their compilations
TEMPLATE = "{% for m in messages %}<role>{{ m['role'][0] }}{{ m['content'] }}{% endfor %}<role>"
PROMPTS = ["The quick brown", "Delta attention"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny preset cut to one KDA + dense and one MLA + MoE layer, with its MTP layer (every layer kind, half
    the layers to compile), as a HF checkpoint, plus a trained tokenizer.json."""
    directory = tmp_path_factory.mktemp("tiny-hf")
    config = preset("tiny").replace(
        vocab_size=320, num_hidden_layers=2, layer_types=(KDA, MLA), mlp_layer_types=(DENSE, MOE)
    )
    write_random_checkpoint(str(directory), config, seed=0, num_shards=1)
    train_byte_bpe(directory / "tokenizer.json", SENTENCES, 300, SPECIALS)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE})
    )
    return directory


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    return load_tokenizer(hf_dir, LingConfig.from_pretrained(hf_dir))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = generate_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def without_stats(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "stats"} for r in records]


def run_json(capsys, *argv) -> list[dict]:
    code, out, err = run_cli(capsys, "--json", "--max-new-tokens", NEW_TOKENS, *argv)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def greedy(hf_dir):
    """The greedy completions of PROMPTS (computed once; capsys is function-scoped, so capture by hand)."""
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        assert generate_cli.main(["--model", str(hf_dir), "--json", "--max-new-tokens", str(NEW_TOKENS), *PROMPTS]) == 0
        out = sys.stdout.getvalue()
    finally:
        sys.stdout = stdout
    return [json.loads(line) for line in out.splitlines()]


def test_json_records_are_consistent(greedy, tokenizer):
    assert [r["prompt"] for r in greedy] == PROMPTS
    for record in greedy:
        assert record["prompt_tokens"] == len(tokenizer.encode(record["prompt"]))
        assert record["completion_tokens"] == len(record["completion_ids"]) <= NEW_TOKENS
        assert record["completion"] == tokenizer.decode(record["completion_ids"])
        assert record["finish_reason"] == ("length" if record["completion_tokens"] == NEW_TOKENS else "eos")
        assert not set(record["completion_ids"]) & set(tokenizer.eos_ids)
        stats = record["stats"]
        assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in greedy)
        assert stats["generated_tokens"] == sum(r["completion_tokens"] for r in greedy)
        assert stats["drafted"] == 0 and stats["acceptance_rate"] is None
    assert len(greedy[0]["completion"]) >= 4, "the stop-string tests need some text"


def test_streamed_text_is_the_json_completion(capsys, hf_dir, greedy):
    code, out, err = run_cli(capsys, "--model", hf_dir, "--max-new-tokens", NEW_TOKENS, PROMPTS[0])
    assert code == 0, err
    assert out == f"> {PROMPTS[0]}\n{greedy[0]['completion']}\n"
    assert "prompt tokens" in err.splitlines()[-1]  # the stats line
    code, batched, err = run_cli(capsys, "--model", hf_dir, "--max-new-tokens", NEW_TOKENS, "--no-stream", *PROMPTS)
    assert code == 0, err
    assert batched == "".join(f"> {r['prompt']}\n{r['completion']}\n\n" for r in greedy).removesuffix("\n")


def test_stop_strings_cut_the_completion(capsys, hf_dir, tokenizer, greedy):
    full = greedy[0]["completion"]
    stop = full[2:4]
    cut = full.find(stop)
    code, out, err = run_cli(
        capsys,
        "--model",
        hf_dir,
        "--max-new-tokens",
        NEW_TOKENS,
        "--stop",
        stop,
        "--stop",
        "never-generated",
        PROMPTS[0],
    )
    assert code == 0, err
    assert out == f"> {PROMPTS[0]}\n{full[:cut]}\n"  # streamed: the stop string never shows, even in part
    record, _ = run_json(capsys, "--model", hf_dir, "--stop", stop, *PROMPTS)
    assert record["completion"] == full[:cut] and record["finish_reason"] == "stop"
    ids = record["completion_ids"]
    assert ids == greedy[0]["completion_ids"][: len(ids)]  # the ids end with the one completing the stop string
    assert StopChecker([stop]).find(tokenizer.decode(ids)) == cut


def test_prompt_file_and_stdin(capsys, monkeypatch, tmp_path, hf_dir, greedy):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    expected = without_stats(greedy)
    assert without_stats(run_json(capsys, "--model", hf_dir, "--prompt-file", prompt_file)) == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(PROMPTS)))
    assert without_stats(run_json(capsys, "--model", hf_dir, "--prompt-file", "-")) == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(PROMPTS)))  # not a TTY: read without a flag
    assert without_stats(run_json(capsys, "--model", hf_dir)) == expected


def test_mtp_speculation_gives_the_greedy_completion(capsys, hf_dir, greedy):
    records = run_json(capsys, "--model", hf_dir, "--mtp", 1, *PROMPTS)
    assert [r["completion_ids"] for r in records] == [r["completion_ids"] for r in greedy]
    stats = records[0]["stats"]
    assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]


def test_chat_template_and_system_message(capsys, hf_dir, tokenizer):
    (record,) = run_json(capsys, "--model", hf_dir, "--chat", "--system", "Be brief.", "Hi")
    formatted = "<role>sBe brief.<role>uHi<role>"
    assert record["prompt"] == "Hi"
    assert record["prompt_tokens"] == len(tokenizer.encode(formatted, add_special_tokens=False))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--min-p", "2"], "--min-p"),
        (["--frequency-penalty", "3"], "--frequency-penalty must be in [-2, 2], got 3.0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--system", "x"], "--system needs --chat"),
        (["--stop", "END", "--stop", ""], "--stop strings must be non-empty"),
        (["--model", "/nonexistent/ling"], "--model /nonexistent/ling: not a directory"),
        (["--mesh", "tensor=x"], "--mesh expects axis=size pairs"),
        (["--mesh", "tensor=3"], "--mesh 'tensor=3': mesh {'data': 1, 'fsdp': 1, 'tensor': 3, 'expert': 1} needs 3"),
        (["--mesh", "pipeline=8"], "unknown mesh axes ['pipeline']"),
        (["--mesh", "tensor=4,expert=2", "--tp", "2"], "--tp 2 contradicts --mesh tensor=4"),
        (["--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file /nonexistent/prompts.txt: No such file"),
    ],
)
def test_errors_before_loading_are_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv, "a prompt")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_errors_after_loading_are_one_line(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    cases = [
        (["--model", tmp_path, "x"], f"--model {tmp_path}: expected a HF checkpoint directory"),
        (
            ["--preset", "tiny", "x" * 4100],
            ("prompt 1 has 4100 tokens; with --max-new-tokens 64 that exceeds the model's context of 4096 tokens"),
        ),
        (["--preset", "tiny", "--mesh", "tensor=8", "x"], "--mesh 'tensor=8': the model does not fit this mesh"),
        (["--preset", "tiny", "--chat", "x"], "has no chat template"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "", (argv, out)
        assert err.splitlines()[-1].startswith("error: ") and message in err, (argv, err)
        assert "Traceback" not in err


def test_mesh_flags_combine():
    def mesh_of(*argv):
        mesh = flags.build_mesh(generate_cli.build_parser().parse_args(list(argv)))
        return None if mesh is None else dict(mesh.shape)

    assert mesh_of() is None  # one device
    assert mesh_of("--tp", "2", "--ep", "4") == {"data": 1, "fsdp": 1, "tensor": 2, "expert": 4}
    assert mesh_of("--mesh", "data=2,tensor=2", "--tp", "2", "--ep", "2") == {
        "data": 2,
        "fsdp": 1,
        "tensor": 2,
        "expert": 2,
    }


def test_kernel_backend_flag_builds_the_policy(capsys, hf_dir):
    with pytest.raises(SystemExit) as info:
        generate_cli.build_parser().parse_args(["--kernel-backend", "cuda", "x"])
    assert info.value.code == 2
    assert "argument --kernel-backend: invalid choice: 'cuda'" in capsys.readouterr().err.splitlines()[-1]
    args = generate_cli.build_parser().parse_args(["--kernel-backend", "reference", "--fp8-matmul", "w8a8", "x"])
    policy = ExecutionPolicy(kernel_backend=args.kernel_backend, fp8_matmul=args.fp8_matmul)
    assert policy.fp8_matmul is FP8Matmul.W8A8
    assert generate_cli.build_parser().parse_args(["x"]).fp8_matmul == "auto"
    source = cli_checks.checkpoint_source(hf_dir, "--model", byte_tokenizer=False)
    model = generate_cli.load_model(source, jnp.float32, None, policy, "stored", verbose=False)
    assert model.policy is policy and model.policy.kernel_backend is KernelBackend.REFERENCE


def test_completion_holds_back_a_possible_stop_string():
    completion = Completion(load_tokenizer(None, preset("tiny")), StopChecker(["<END>"]))
    assert not completion.add(b"ab<E")
    assert completion.unshown() == "ab"  # "<E" may grow into "<END>"
    assert not completion.add(b"x<")
    assert completion.unshown() == "<Ex"
    assert completion.add(b"END>tail")
    assert completion.unshown() == "" and completion.text == "ab<Ex"
    assert bytes(completion.ids) == b"ab<Ex<END>"  # nothing after the token that completed the stop string


def run_script(*argv, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS
    stdin_source = {"stdin": subprocess.DEVNULL} if stdin is None else {"input": stdin}  # /dev/null: no prompts
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, argv)],
        **stdin_source,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_script_default_model(shared_compile_cache):
    """The README's quick-start command: the demo checkpoint when installed, else the random tiny model."""
    result = run_script("--max-new-tokens", 1, env=shared_compile_cache)  # one token: the prefill's programs only
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"> {generate_cli.DEFAULT_PROMPT}\n")
    assert "prompt tokens" in result.stderr
    if not generate_cli.DEMO_DIR.is_dir():
        assert "RANDOMLY INITIALISED 'tiny'" in result.stderr


def test_script_reads_stdin_and_prints_json(hf_dir, greedy):
    result = run_script(
        "--model", hf_dir, "--json", "--max-new-tokens", NEW_TOKENS, "--temperature", 0, stdin="\n".join(PROMPTS) + "\n"
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["completion_ids"] for r in records] == [r["completion_ids"] for r in greedy]


def test_script_error_has_no_traceback():
    result = run_script("--model", "/nonexistent/ling", "--top-k", 5, "x")
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr == "error: --model /nonexistent/ling: not a directory (expected a HF checkpoint or "
        "ling-convert directory)\n"
    )
