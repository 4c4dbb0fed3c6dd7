"""ling-convert loses nothing and refuses damaged input with one line: a DST that holds or lies inside SRC, a
directory of other files, NaN / Inf weights, damaged JSON files and shard headers (exit status 2, nothing
published). A refusal before any tensor is read (a damaged shard header) and one while tensors stream (NaN / Inf)
run as `python -m convert.cli`: the process's status and stderr; the other cases run in process through `main`,
which the process's status is."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import read_checkpoint_raw, write_hf_checkpoint
from helpers import REPO_ROOT

from convert.cli import main
from convert.synthetic import write_random_checkpoint
from convert.workspace import Workspace
from ling_jax.checkpoints.orbax import LAYOUT_FILE
from ling_jax.presets import preset

ROOT = str(REPO_ROOT)
INDEX = "model.safetensors.index.json"
NORM = "model.norm.weight"
DENSE = "model.layers.0.attention.dense.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict, name -> stored array) of a small block-FP8 checkpoint; tests write edited copies."""
    path = tmp_path_factory.mktemp("tiny") / "hf"
    write_random_checkpoint(str(path), preset("tiny"), seed=int(np.random.default_rng().integers(1 << 30)))
    return read_checkpoint_raw(path)


def _write(directory, config: dict, tensors: dict[str, np.ndarray]):
    write_hf_checkpoint(directory, config, tensors, num_shards=3)
    return directory


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "convert.cli", *map(str, args), "--quiet"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_error_line(stderr: str, *needles) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ling-convert: error: "), stderr
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


def _refused(result: subprocess.CompletedProcess, *needles) -> str:
    assert result.returncode == 2, result.stderr
    return _one_error_line(result.stderr, *needles)


def _refused_in_process(capsys, *args, needles=()) -> str:
    assert main([*map(str, args), "--quiet"]) == 2
    return _one_error_line(capsys.readouterr().err, *needles)


def _snapshot(directory) -> dict[str, bytes]:
    """Every file under `directory` with its bytes."""
    files = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


def _shard_of(src, name) -> str:
    return str(src / json.loads((src / INDEX).read_text())["weight_map"][name])


def test_destination_holding_the_source_is_refused(source, tmp_path, capsys):
    parent = tmp_path / "par"
    src = _write(parent / "src", *source)
    (parent / "notes.txt").write_text("not ling-convert's")
    before = _snapshot(parent)
    _refused_in_process(capsys, src, parent, "--overwrite", needles=(parent, "holds the source checkpoint", src))
    assert _snapshot(parent) == before

    (tmp_path / "link").symlink_to(parent)
    (tmp_path / "src_link").symlink_to(src)
    _refused_in_process(
        capsys,
        src,
        tmp_path / "link",
        "--overwrite",
        needles=(tmp_path / "link", f"really {parent}", "holds the source"),
    )
    _refused_in_process(capsys, tmp_path / "src_link", parent, "--overwrite", needles=("holds the source",))
    _refused_in_process(capsys, src, tmp_path / "src_link", "--overwrite", needles=("is the source checkpoint",))
    _refused_in_process(capsys, src, src / "out", needles=("lies inside the source checkpoint",))
    assert _snapshot(parent) == before and not os.path.exists(Workspace(str(parent)).path)


def test_overwrite_replaces_only_an_earlier_output(source, tmp_path, capsys):
    src = _write(tmp_path / "src", *source)
    other = tmp_path / "other"
    other.mkdir()
    for i in range(7):
        (other / f"file{i}.txt").write_text(str(i))
    before = _snapshot(other)
    line = _refused_in_process(
        capsys,
        src,
        other,
        "--overwrite",
        needles=(
            other,
            "would delete 7 entries (file0.txt, ",
            ", ...)",
            "--overwrite only replaces an earlier ling-convert output",
        ),
    )
    assert "file6.txt" not in line
    line = _refused_in_process(capsys, src, other, needles=("would delete 7 entries", "--overwrite only replaces"))
    assert "pass --overwrite" not in line
    assert _snapshot(other) == before

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(src), str(empty), "--quiet"]) == 0

    (empty / "notes.txt").write_text("mine")
    _refused_in_process(capsys, src, empty, "--overwrite", needles=("1 entry (notes.txt)", "did not write"))
    (empty / "notes.txt").unlink()
    layout = (empty / LAYOUT_FILE).read_bytes()
    (empty / LAYOUT_FILE).write_bytes(layout[: len(layout) // 2])
    _refused_in_process(capsys, src, empty, "--overwrite", needles=(LAYOUT_FILE, "not an earlier ling-convert output"))
    (empty / LAYOUT_FILE).write_bytes(layout)
    assert main([str(src), str(empty), "--quiet", "--overwrite", "--dtype", "fp8"]) == 0
    assert json.loads((empty / LAYOUT_FILE).read_text())["scale_blocks"]
    assert sorted(os.listdir(tmp_path)) == ["empty", "other", "src"]


def _poison(array: np.ndarray, value: float, rng: np.random.Generator) -> np.ndarray:
    poisoned = array.astype(np.float32)
    poisoned.reshape(-1)[rng.integers(poisoned.size)] = value
    return poisoned.astype(array.dtype)


def test_nonfinite_weights_are_not_published(source, tmp_path, capsys):
    config, tensors = source
    rng = np.random.default_rng()
    good = _write(tmp_path / "good", config, tensors)
    dst = tmp_path / "dst"
    assert main([str(good), str(dst), "--quiet"]) == 0
    published = _snapshot(dst)

    bad = _write(tmp_path / "bad", config, {**tensors, NORM: _poison(tensors[NORM], np.inf, rng)})
    workspace = Workspace(str(dst)).path
    _refused(
        _cli(bad, dst, "--overwrite"),
        f"{_shard_of(bad, NORM)}: tensor '{NORM}' has 1 NaN or Inf values",
        "--allow-nonfinite",
        f"nothing was published at {dst}",
        f"kept in {workspace} for --resume",
    )
    assert _snapshot(dst) == published  # the earlier output is untouched
    assert main([str(bad), str(dst), "--quiet", "--overwrite", "--resume", "--allow-nonfinite", "--verify"]) == 0
    assert "parameters" in capsys.readouterr().out and not os.path.exists(workspace)

    scale = DENSE + "_scale_inv"
    bad = _write(tmp_path / "bad_scale", config, {**tensors, scale: _poison(tensors[scale], np.nan, rng)})
    _refused_in_process(capsys, bad, tmp_path / "bf16", needles=(f"tensor '{DENSE}' has {tensors[DENSE].size} NaN",))
    _refused_in_process(capsys, bad, tmp_path / "fp8", "--dtype", "fp8", needles=(f"tensor '{scale}' has 1 NaN",))
    code = DENSE
    nan_code = tensors[code].copy()
    nan_code.view(np.uint8).reshape(-1)[rng.integers(nan_code.size)] = 0x7F  # the E4M3FN NaN
    assert nan_code.dtype == ml_dtypes.float8_e4m3fn
    bad = _write(tmp_path / "bad_code", config, {**tensors, code: nan_code})
    _refused_in_process(capsys, bad, tmp_path / "fp8_code", "--dtype", "fp8", needles=(f"tensor '{code}' has 1 NaN",))


def _damage_header(shard) -> None:
    """Drop one tensor's data_offsets from a shard's header (still valid JSON)."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    del header[name]["data_offsets"]
    encoded = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def test_damaged_shard_header(source, tmp_path):
    src = _write(tmp_path / "src", *source)
    shard = src / "model-00002-of-00003.safetensors"
    _damage_header(shard)
    _refused(_cli(src, tmp_path / "dst"), f"{shard}: damaged safetensors header", "data_offsets")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "file,damage,message",
    [
        (INDEX, lambda text: text[:-40], "not valid JSON"),
        (INDEX, lambda text: "[" + text + "]", "expected a JSON object, found list"),
        (INDEX, lambda text: json.dumps({"weight_map": {NORM: None}}), f"'weight_map' maps '{NORM}' to None"),
        ("config.json", lambda text: text.replace('"', '"\udcff', 1), "not UTF-8 text (byte {} is 0xff)"),
        ("config.json", lambda text: "[]", "expected a JSON object, found list"),
    ],
)
def test_damaged_json_file(source, tmp_path, capsys, file, damage, message):
    src = _write(tmp_path / "src", *source)
    text = (src / file).read_text()
    (src / file).write_bytes(damage(text).encode("utf-8", "surrogateescape"))
    first_quote_end = text.index('"') + 1  # where the non-UTF-8 byte goes
    _refused_in_process(capsys, src, tmp_path / "dst", needles=(f"{src / file}: {message.format(first_quote_end)}",))
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("journal,line", [(b'{"param": "lm_head.weight"}\n\xff\xfe\n', 2), (b"5\n", 1)])
def test_damaged_journal_on_resume(source, tmp_path, capsys, journal, line):
    src = _write(tmp_path / "src", *source)
    dst = tmp_path / "dst"
    workspace = Workspace(str(dst))
    workspace.prepare({"source": str(src), "dtype": "bf16", "process_count": 1}, resume=False, overwrite=False)
    with open(workspace.journal(0).path, "wb") as f:
        f.write(journal)
    _refused_in_process(
        capsys,
        src,
        dst,
        "--resume",
        needles=(f"{workspace.journal(0).path}: line {line} is not a journal entry", "--overwrite"),
    )
    with open(os.path.join(workspace.path, "job.json"), "wb") as f:
        f.write(b'{"source": "\xff"}')
    _refused_in_process(capsys, src, dst, "--resume", needles=("job.json", "utf-8"))
    shutil.rmtree(workspace.path)
