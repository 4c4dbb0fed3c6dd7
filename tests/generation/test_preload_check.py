"""generate.py checks that the parameters and the decode cache fit the device's memory before it reads a weight
or initialises one, and refuses with one line: the per-device figures and a --weights or --mesh that would fit."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from tiny_fp8 import write_tiny_fp8_checkpoint

from ling_jax.checkpoints.safetensors_io import SafetensorsFile
from ling_jax.generation import cli, cli_checks
from ling_jax.generation.fit_check import FitCheck, check_fit
from ling_jax.generation.generator import CACHE_BUCKET
from ling_jax.generation.memory_plan import Hardware

BATCH, CONTEXT = 1, CACHE_BUCKET  # a short prompt and 8 new tokens: one bucket of cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8")
    return directory, write_tiny_fp8_checkpoint(directory)


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Any read of a checkpoint tensor, or a random initialisation, fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the memory check")

    monkeypatch.setattr(SafetensorsFile, "read", refuse)
    monkeypatch.setattr(SafetensorsFile, "get", refuse)
    monkeypatch.setattr(cli, "random_model", refuse)


def _chip(monkeypatch, memory_bytes: int) -> Hardware:
    chip = Hardware("test-chip", memory_bytes, 1.0, "a test")
    monkeypatch.setattr(cli_checks, "device_memory", lambda: chip)
    return chip


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


def test_refused_before_any_weight_is_read_with_the_weights_that_fit(checkpoint, capsys, monkeypatch, nothing_loaded):
    directory, config = checkpoint
    check = FitCheck(config, dtype=jnp.float32, batch=BATCH, context=CONTEXT, mtp=False)
    dense, stored = check.footprint({}, "bf16").total_bytes, check.footprint({}, "stored").total_bytes
    assert stored < dense / 2
    _chip(monkeypatch, (stored + dense) // 2)  # FP8 kept fits one device, dequantised does not
    code, err = _run(capsys, "--model", directory, "--byte-tokenizer", "--weights", "bf16", "--max-new-tokens", 8, "hi")
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {directory} does not fit: "), err
    assert f"per device (mesh one device, --weights bf16, batch 1, context {CONTEXT})" in err
    assert "usable on test-chip; --weights stored fits" in err and "--no-memory-check" in err


def test_refused_preset_names_a_mesh_that_fits(capsys, monkeypatch, nothing_loaded):
    """No device count or format fits one device: a mesh over this process's 8 devices does."""
    from ling_jax.presets import preset

    check = FitCheck(preset("tiny"), dtype=jnp.float32, batch=BATCH, context=CONTEXT, mtp=False)
    _chip(monkeypatch, check.footprint({"expert": 8}, "stored").total_bytes + 1024)
    assert check.footprint({}, "stored").total_bytes > check.footprint({"expert": 8}, "stored").total_bytes + 1024
    code, err = _run(capsys, "--preset", "tiny", "--max-new-tokens", 8, "hi")
    note, refusal = err.splitlines()
    assert code == 2 and note.startswith("NOTE: --preset tiny: a RANDOMLY INITIALISED model")
    assert refusal.startswith("error: the random 'tiny' preset does not fit: ") and "--mesh expert=8 would fit: " in err


def test_the_flag_skips_the_check(checkpoint, capsys, monkeypatch):
    directory, _ = checkpoint
    _chip(monkeypatch, 1)
    reached = "the loader was reached"
    monkeypatch.setattr(cli, "load_hf_checkpoint", lambda *a, **k: (_ for _ in ()).throw(ValueError(reached)))
    code, err = _run(capsys, "--model", directory, "--byte-tokenizer", "--no-memory-check", "hi")
    assert code == 2 and err == f"error: {reached}\n"


def test_more_devices_than_this_process_has(checkpoint):
    _, config = checkpoint
    chip = Hardware("test-chip", 1, 1.0, "a test")
    check = FitCheck(config, dtype=jnp.float32, batch=BATCH, context=CONTEXT, mtp=False)
    chip = dataclasses.replace(chip, memory_bytes=check.footprint({"expert": 32}, "stored").total_bytes)
    refusal = check_fit(config, {}, chip, weights="stored", dtype=jnp.float32, batch=BATCH, context=CONTEXT, devices=2)
    assert "--mesh expert=32 would fit (32 devices; this process has 2)" in refusal
    fits = dataclasses.replace(chip, memory_bytes=check.footprint({}, "stored").total_bytes)
    assert check_fit(config, {}, fits, weights="stored", dtype=jnp.float32, batch=BATCH, context=CONTEXT) is None
