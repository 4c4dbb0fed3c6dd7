"""Two real processes of two CPU devices each (`conftest.launch`): `ling-convert --distributed` writes the same
checkpoint as one process; `generate.py --distributed` on that checkpoint (tensor=2 x expert=2 over the four
devices) prints the same completion as one process on one device; `load_hf_checkpoint` and `load_checkpoint`
leave each process only its own shards, and the HF loader reads only its own experts (generate_and_load.py)."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from convert.pipeline import Options, convert
from ling_jax import load_checkpoint
from ling_jax.generation.cli import DEMO_DIR, main

PROMPT = "Mr. Darcy"
GENERATE = ["--max-new-tokens", "4", "--prefill-chunk", "16", "--json", PROMPT]


def joining(process_id: int, coordinator: str) -> list[str]:
    return ["--distributed", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(process_id)]


def json_lines(stdout: str) -> list[dict]:
    """generate.py --json's records (gloo prints its connection lines on stdout too)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def converted(launch, tmp_path_factory):
    """DEMO_DIR converted by two processes, and by one."""
    root = tmp_path_factory.mktemp("converted")
    two, one = root / "two", root / "one"
    command = ["-m", "convert.cli", str(DEMO_DIR), str(two), "--quiet", "--workers", "1"]
    runs = launch(lambda i, at: [*command, *joining(i, at)])
    assert [run.returncode for run in runs] == [0, 0]
    convert(str(DEMO_DIR), str(one), Options(workers=1, progress=False))
    return two, one, runs


def test_two_process_conversion_equals_one_process(converted):
    two, one, runs = converted
    counts = [int(re.search(r": (\d+) parameters", run.stdout).group(1)) for run in runs]  # each converted some
    assert all(counts) and set(os.listdir(two)) - set(os.listdir(one)) == {"ocdbt.process_1"}
    ours, reference = load_checkpoint(two), load_checkpoint(one)
    pairs = zip(nnx.to_flat_state(nnx.state(ours)), nnx.to_flat_state(nnx.state(reference)), strict=True)
    assert sum(counts) == len(nnx.to_flat_state(nnx.state(reference)))
    for (path, a), (_, b) in pairs:
        for x, y in zip(jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value()), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_two_processes_generate_as_one_and_hold_only_their_shards(converted, launch, capsys):
    two, one, _ = converted
    runs = launch(
        lambda i, at: [
            "tests/multiprocess/generate_and_load.py",
            str(DEMO_DIR),
            str(two),
            "--model",
            str(two),
            "--mesh",
            "tensor=2,expert=2",
            *GENERATE,
            *joining(i, at),
        ]
    )
    assert [run.returncode for run in runs] == [0, 0]
    assert all("own shards: ok" in run.stderr for run in runs)
    (distributed,) = json_lines(runs[0].stdout)
    assert json_lines(runs[1].stdout) == []  # only process 0 prints

    assert main(["--model", str(one), *GENERATE]) == 0
    (alone,) = json_lines(capsys.readouterr().out)
    assert distributed["completion_ids"] == alone["completion_ids"] and len(alone["completion_ids"]) == 4
    assert distributed["completion"] == alone["completion"]
