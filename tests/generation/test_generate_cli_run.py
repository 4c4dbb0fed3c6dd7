"""scripts/generate.py as a run: Ctrl-C, the stats line, the compilation cache and its notice, --interactive,
benchmarks/generate_cli.py. Subprocesses where the behaviour is the process's (signals, exit status, env)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx
from helpers import ONE_DEVICE_XLA_FLAGS, REPO_ROOT
from jax import monitoring

from ling_jax import LingForCausalLM
from ling_jax.generation import cli_runtime, generator
from ling_jax.generation.cli import DEMO_DIR, main
from ling_jax.generation.compile_watch import BACKEND_COMPILE_EVENT, CACHE_HIT_EVENT, CACHE_LOOKUP_EVENT, CompileClock
from ling_jax.generation.generator import DECODE_READ_GROUP, GenerationStats, Generator
from ling_jax.generation.interactive import Conversation
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import load_tokenizer
from ling_jax.presets import preset

ROOT = REPO_ROOT
SCRIPT = ROOT / "scripts" / "generate.py"
needs_demo = pytest.mark.skipif(not DEMO_DIR.is_dir(), reason="the demo checkpoint is not installed")


def script_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **extra}
    env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS
    return env


def read_until(proc: subprocess.Popen, done, timeout: float = 120.0) -> str:
    """stdout read as it arrives until done(text); the process keeps running."""
    text, deadline = b"", time.monotonic() + timeout
    while not done(text.decode(errors="replace")):
        assert time.monotonic() < deadline and proc.poll() is None, (text, proc.stderr.read())
        text += os.read(proc.stdout.fileno(), 4096)
    return text.decode(errors="replace")


def default_sigint() -> None:
    """In the child: Ctrl-C as a shell gives it, whatever the test process inherited (a SIGINT ignored by the
    pytest-xdist worker would be inherited, and a Ctrl-C test would then see the run finish)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(argv: list[str], ready) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=script_env(),
        cwd=ROOT,
        preexec_fn=default_sigint,
    )
    try:
        seen = read_until(proc, ready)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, seen + rest.decode(errors="replace"), err.decode(errors="replace")


@needs_demo
def test_ctrl_c_during_compile_and_generation_exits_130_with_one_line():
    # the prompt line is printed just before the first compilation starts
    code, out, err = interrupt(["--max-new-tokens", "8", "Mr. Darcy"], lambda text: text.startswith("> Mr. Darcy\n"))
    assert code == 130, err
    assert "Traceback" not in err and [line for line in err.splitlines() if "interrupt" in line] == [
        "interrupted (Ctrl-C): generation stopped"
    ], err
    # the demo writes ~1900 tokens of Austen before EOS: interrupted mid-stream, the line is finished
    code, out, err = interrupt(["--max-new-tokens", "1900", "Mr. Darcy"], lambda text: len(text) > 60)
    assert code == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "interrupted (Ctrl-C): generation stopped" and err.count("interrupt") == 1, err
    assert out.endswith("\n") and len(out) > 60 and "prompt tokens" not in err


def test_stats_rates_count_steady_state_steps_only():
    generator = Generator(LingForCausalLM(preset("tiny"), rngs=nnx.Rngs(3), dtype="float32"), prefill_chunk=16)
    prompts, sampling = [[5, 9, 2], [7, 3, 3, 8, 1, 4]], [SamplingParams()] * 2
    new = 2 * DECODE_READ_GROUP + 4  # eos_ids=(): every row makes 20 tokens
    _, first = generator.generate(prompts, sampling, new)
    _, warm = generator.generate(prompts, sampling, new)
    assert first.compile_s > 0 and 0 < first.prefill_compile_s <= first.compile_s
    assert warm.compile_s < first.compile_s / 10 and warm.prefill_compile_s < first.prefill_compile_s
    for stats in first, warm:  # the prefill's token, then 3 programs of 8 steps: the first compiles, 2 are timed
        assert stats.generated_tokens == 40 and (stats.steady_steps, stats.steady_tokens) == (16, 22)  # 8 + 3 kept
        assert stats.decode_tokens_per_s == pytest.approx(22 / stats.steady_s) and stats.steady_s < stats.decode_s
        assert stats.prefill_tokens_per_s == pytest.approx(9 / (stats.prefill_s - stats.prefill_compile_s))
    _, one = generator.generate(prompts, sampling, 1)
    assert one.decode_tokens_per_s is None and one.steady_steps == 0
    line = one.summary()
    assert "decode n/a (steady state)" in line and f"compile {one.compile_s:.1f} s" in line
    assert (
        GenerationStats(3, 1, prefill_s=0.5, decode_s=0.0, ttft_s=0.5, prefill_compile_s=0.5).prefill_tokens_per_s
        is None
    )


def test_steady_state_time_excludes_a_compilation_between_its_programs():
    rows, clock = generator._Rows(1, 20, (), None), CompileClock()
    steady = generator._SteadyClock(rows, clock)
    steady.tick(DECODE_READ_GROUP)  # the first program: starts the clock
    time.sleep(0.3)
    clock.seconds += 0.25  # a program compiled again in between, as a recompiled decode step would be
    rows.add(np.zeros((1, DECODE_READ_GROUP), np.int32))
    steady.tick(DECODE_READ_GROUP)
    stats = GenerationStats(1, 9, prefill_s=0.1, decode_s=0.4, ttft_s=0.1)
    steady.record(stats)
    assert stats.steady_tokens == DECODE_READ_GROUP and 0.05 <= stats.steady_s < 0.25


def run_script(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env=script_env(**env),
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_compile_cache_on_by_default_in_the_user_cache_dir(tmp_path):
    argv = ["--preset", "tiny", "--max-new-tokens", "2", "--json", "x"]
    on = {
        "LING_JAX_NO_COMPILE_CACHE": "",
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }  # every program cached; the notice at once
    result = run_script(*argv, **on)
    assert result.returncode == 0, result.stderr
    cache = tmp_path / "xdg" / "ling-jax" / "jax_cache"
    assert any(cache.glob("jit__decode_step-*")) or any(cache.glob("jit__prefill_chunk-*")), list(cache.iterdir())
    assert json.loads(result.stdout)["stats"]["compile_s"] > 0
    warm = run_script(*argv, **on)  # every program read from the cache: no notice
    assert warm.returncode == 0 and "compiling" not in warm.stderr, warm.stderr


def test_compile_notice_waits_out_cache_reads_and_keeps_off_a_streamed_line(monkeypatch, capsys):
    monkeypatch.setattr(cli_runtime, "NOTICE_AFTER_S", 0.05)
    monkeypatch.setattr(cli_runtime, "CACHE_READ_ALLOWANCE_S", 0.1)
    with cli_runtime.CompileNotice(cached=True) as notice:
        monitoring.record_scalar(BACKEND_COMPILE_EVENT, 0.0)  # a long read from the persistent cache: a hit
        monitoring.record_event(CACHE_LOOKUP_EVENT)
        time.sleep(0.1)
        monitoring.record_event(CACHE_HIT_EVENT)
        monitoring.record_event_duration_secs(BACKEND_COMPILE_EVENT, 0.1)
        time.sleep(0.2)
        assert not notice.shown
        cli_runtime.write_stdout("a streamed li")
        monitoring.record_scalar(BACKEND_COMPILE_EVENT, 0.0)  # a miss: compiled past the read's allowance
        monitoring.record_event(CACHE_LOOKUP_EVENT)
        time.sleep(0.4)
        monitoring.record_event_duration_secs(BACKEND_COMPILE_EVENT, 0.4)
    cli_runtime.write_stdout("ne\n")
    assert capsys.readouterr() == ("a streamed line\n", "\ncompiling (first run; cached afterwards)\n")


def test_compile_cache_off_by_flag_or_env(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli_runtime.compile_cache_dir() == tmp_path / "ling-jax" / "jax_cache"
    monkeypatch.setenv("LING_JAX_NO_COMPILE_CACHE", "")
    assert cli_runtime.enable_compile_cache(disabled=True) is None  # --no-compile-cache
    monkeypatch.setenv("LING_JAX_NO_COMPILE_CACHE", "1")
    assert cli_runtime.enable_compile_cache(disabled=False) is None
    assert not any(tmp_path.iterdir())
    assert "compilation cache is off" in cli_runtime.CompileNotice(cached=False).line


def test_demo_chat_template_keeps_the_conversation():
    conversation = Conversation(load_tokenizer(DEMO_DIR, preset("ling-demo")), system="Be kind.")
    tokenizer = conversation.tokenizer
    assert tokenizer.decode(conversation.prompt_ids("Who is Emma?")) == "Be kind.\n\nUser: Who is Emma?\nAssistant:"
    conversation.turns.append(("Who is Emma?", " A young lady. "))
    assert (
        tokenizer.decode(conversation.prompt_ids("And Harriet?"))
        == "Be kind.\n\nUser: Who is Emma?\nAssistant: A young lady.\nUser: And Harriet?\nAssistant:"
    )
    short = tokenizer.encode("Be kind.\n\nUser: And Harriet?\nAssistant:", add_special_tokens=False)
    assert conversation.fitting_prompt_ids("And Harriet?", budget=len(short) + 1) == short
    assert not conversation.turns  # the oldest turn was dropped to fit
    assert conversation.fitting_prompt_ids("And Harriet?", budget=len(short) - 1) is None


@needs_demo
def test_interactive_reads_turns_until_eof(shared_compile_cache):  # the demo's programs, as the quick start's
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--interactive", "--max-new-tokens", "5", "--chat"],
        input="Who is Mr. Darcy?\n\nAnd Elizabeth?\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env=script_env(**shared_compile_cache),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2 and result.stdout.endswith("\n")  # one streamed line per turn
    assert result.stderr.count("> ") == 4, result.stderr  # a marker per line read (the blank one too) and at EOF


def test_interactive_refuses_json(capsys):  # in process: test_script_error_has_no_traceback runs an error's exit
    assert main(["--interactive", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --interactive") and "--json" in err and len(err.splitlines()) == 1


def test_bench_generate_cli_quick():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.generate_cli", "--quick", "--batches", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=script_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["3"]
    for row in rows:  # batch, CLI ms, CLI tok/s, 1-step ms, ratio, K-step ms, ratio, host ms, two dispatch ms
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert len(cells) == 10 and cells[4].endswith("x") and cells[6].endswith("x"), row
        assert 0 < float(cells[7]) < float(cells[1]) and float(cells[8]) > 0 and float(cells[9]) > 0, row
