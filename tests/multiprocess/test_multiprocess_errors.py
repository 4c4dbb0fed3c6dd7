"""Bad multi-process input ends every process with one named error, within the timeout, instead of a hang: a
process count that the launch does not match (nobody can join), a checkpoint missing on one process (the others
name it), processes given different work."""

from __future__ import annotations

import time

from ling_jax.distributed import disagreement
from ling_jax.generation.cli import DEMO_DIR, main


def generate(process_id: int, coordinator: str, *args: str, processes: int = 2, timeout_s: int = 60) -> list[str]:
    joining = ["--coordinator", coordinator, "--num-processes", str(processes), "--process-id", str(process_id)]
    return ["scripts/generate.py", "--distributed", *joining, "--distributed-timeout", str(timeout_s), *args, "Hi"]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_a_process_count_the_launch_does_not_match_fails_within_the_timeout(launch):
    start = time.monotonic()
    runs = launch(lambda i, at: generate(i, at, "--preset", "tiny", processes=3, timeout_s=3), timeout_s=150)
    assert time.monotonic() - start < 120  # the imports, then 3 s (jax alone: 300 s, then an abort)
    for i, run in enumerate(runs):
        assert run.returncode == 2
        (error,) = errors(run.stderr)
        assert error.startswith(f"error: process {i} could not join the job of 3 processes at 127.0.0.1:")
        assert "within --distributed-timeout 3 s" in error and "same --coordinator and --num-processes" in error


def test_a_checkpoint_missing_on_one_process_stops_every_process(launch, tmp_path):
    missing = tmp_path / "Ling-demo"
    runs = launch(lambda i, at: generate(i, at, "--model", str(missing if i else DEMO_DIR)), timeout_s=120)
    assert [run.returncode for run in runs] == [2, 2]
    (own,) = errors(runs[1].stderr)
    assert own.startswith(f"error: --model {missing}: not a directory")
    assert errors(runs[0].stderr) == [f"error: process 1 failed, so every process stops: {own[len('error: ') :]}"]


def test_processes_given_different_work_are_told_which_flag_differs():
    def record(model: str, error: str | None = None) -> dict:
        return {"job": {"model": model, "max_new_tokens": 4}, "error": error}

    assert disagreement(0, {0: record("/ckpt"), 1: record("/ckpt")}) is None
    different = disagreement(0, {0: record("/ckpt"), 1: record("/other")})
    assert different.startswith("the processes were given different work: model is '/other' on process 1 and '/ckpt'")
    failed = disagreement(1, {0: record("/a", "disk full"), 1: record("/b")})
    assert failed == "process 0 failed, so every process stops: disk full"  # an error comes before a difference


def test_joining_flags_without_distributed_are_refused(capsys):
    assert main(["--preset", "tiny", "--process-id", "1", "--num-processes", "2", "Hi"]) == 2
    assert capsys.readouterr().err == "error: --num-processes, --process-id: only with --distributed\n"
