"""A conversion killed or interrupted (Ctrl-C) mid-way resumes without redoing finished parameters, and the result
verifies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO_ROOT

from convert.cli import INTERRUPTED, main
from convert.plan import model_parameters
from convert.synthetic import write_random_checkpoint
from convert.workspace import Journal, Workspace
from ling_jax.config import KDA, MLA, MOE, LingConfig
from ling_jax.presets import preset

ROOT = str(REPO_ROOT)


def medium_config(layers: int = 6) -> LingConfig:
    """~300 MB in FP8: big enough to be caught mid-conversion, small enough for CI."""
    return preset("tiny").replace(
        vocab_size=4096,
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        head_dim=128,
        intermediate_size=2048,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=32,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        layer_types=tuple(MLA if i % 2 else KDA for i in range(layers)),
        mlp_layer_types=(MOE,) * layers,
        expert_swiglu_limit_list=(),
        share_expert_swiglu_limit_list=(),
    )


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("medium") / "hf"
    write_random_checkpoint(str(path), medium_config(), num_shards=3, random_codes=True)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def dst(tmp_path):
    """A conversion destination removed after the test (hundreds of MB)."""
    yield tmp_path / "dst"
    shutil.rmtree(tmp_path / "dst", ignore_errors=True)
    shutil.rmtree(Workspace(str(tmp_path / "dst")).path, ignore_errors=True)


def _stopped_in_progress(checkpoint, dst, stop: signal.Signals, *flags: str) -> tuple[subprocess.Popen, str]:
    """Start `ling-convert checkpoint dst *flags` and send it `stop` once it has finished a parameter more than
    the journal held before."""
    journal = Journal(Workspace(str(dst)).journal(0).path)
    earlier = len(journal.finished())
    child = subprocess.Popen(
        [sys.executable, "-m", "convert.cli", str(checkpoint), str(dst), "--workers", "1", "--quiet", *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a shell starts it, whatever we inherited
    )
    deadline = time.monotonic() + 120
    while child.poll() is None and len(journal.finished()) <= earlier and time.monotonic() < deadline:
        time.sleep(0.005)
    child.send_signal(stop)
    _, stderr = child.communicate(timeout=120)
    return child, stderr


def test_interrupted_then_killed_conversion_resumes_and_verifies(medium_checkpoint, dst, capsys):
    journal = Journal(Workspace(str(dst)).journal(0).path)
    child, stderr = _stopped_in_progress(medium_checkpoint, dst, signal.SIGINT)
    assert child.returncode == 130 and stderr.splitlines() == [INTERRUPTED], stderr  # Ctrl-C: one line, no traceback
    assert "--resume" in INTERRUPTED
    interrupted = journal.finished()
    assert interrupted and not dst.exists()

    child, stderr = _stopped_in_progress(medium_checkpoint, dst, signal.SIGKILL, "--resume")
    assert child.returncode == -signal.SIGKILL, f"the conversion ended before it could be killed: {stderr}"
    finished = journal.finished()
    assert finished > interrupted and not dst.exists()

    assert main([str(medium_checkpoint), str(dst), "--resume", "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f", {len(finished)} finished earlier" in out and "verified" in out
    converted = int(out.split(": ")[2].split(" parameters")[0])
    assert converted + len(finished) == len(model_parameters(medium_config())), out
    assert not os.path.exists(Workspace(str(dst)).path)
    assert not [f for f in os.listdir(dst) if f.startswith(("journal", "job"))]


def test_journal_ignores_a_line_cut_short(tmp_path):
    journal = Journal(str(tmp_path / "journal.jsonl"))
    journal.record("model.norm.weight")
    journal.record("lm_head.weight")
    with open(journal.path, "a") as f:
        f.write('{"param": "model.layers.0.att')
    assert journal.finished() == {"model.norm.weight", "lm_head.weight"}


def test_resume_without_an_unfinished_conversion_starts_afresh(medium_checkpoint, dst, capsys):
    assert main([str(medium_checkpoint), str(dst), "--resume", "--dtype", "fp8", "--quiet"]) == 0
    assert "finished earlier" not in capsys.readouterr().out
    blocks = json.loads((dst / "ling_convert.json").read_text())["scale_blocks"]
    assert blocks["model.layers.0.mlp.experts.up_proj"] == [128, 128]
    assert np.prod(blocks["model.layers.0.attention.q_proj.weight"]) == 128 * 128
