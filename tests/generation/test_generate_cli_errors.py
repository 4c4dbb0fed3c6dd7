"""scripts/generate.py refuses what it cannot use with one `error: ...` line and exit status 2, and everything
that can be checked without the weights is checked before they load: the tokenizer, the prompts, the config,
the checkpoint's index and layout files. Damaged and NaN / Inf weights are refused as they load, by name.

The checkpoint is test_generate_cli's tiny HF checkpoint (and its ling-convert conversion); copies are damaged
one way each. `no_weights` makes any weight loading fail the test.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import struct
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ONE_DEVICE_XLA_FLAGS

from convert.pipeline import Options, convert
from ling_jax.generation import cli as generate_cli
from ling_jax.generation.cli_checks import MAX_MTP
from tests.generation import test_generate_cli
from tests.generation.test_generate_cli import ROOT, run_cli

INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00001.safetensors"
hf_dir = test_generate_cli.hf_dir  # the fixture: the tiny HF checkpoint with a trained tokenizer.json


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the inputs were checked")

    for loader in ("load_hf_checkpoint", "load_checkpoint", "random_model"):
        monkeypatch.setattr(generate_cli, loader, refuse)


def copy_of(source, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def edit_json(path, **changes):
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_missing_tokenizer_json_is_refused_unless_bytes_are_asked_for(capsys, tmp_path, hf_dir, no_weights):
    model = copy_of(hf_dir, tmp_path)
    (model / "tokenizer.json").unlink()
    assert_one_line_error(
        *run_cli(capsys, "--model", model, "hi"), f"{model / 'tokenizer.json'}: missing", "--byte-tokenizer"
    )
    prompt = "é" * 3  # 6 bytes: the byte tokenizer is what counts them
    assert_one_line_error(
        *run_cli(capsys, "--model", model, "--byte-tokenizer", "--max-new-tokens", 4091, prompt),
        "prompt 1 has 6 tokens",
    )
    assert_one_line_error(
        *run_cli(capsys, "--model", hf_dir, "--byte-tokenizer", "hi"),
        f"--byte-tokenizer: {hf_dir} has a tokenizer.json",
    )


def test_input_errors_come_before_the_weights_load(capsys, tmp_path, hf_dir, no_weights):
    assert_one_line_error(
        *run_cli(capsys, "--model", hf_dir, "--max-new-tokens", 4096, "The quick brown"),
        "prompt 1 has",
        "exceeds the model's context of 4096 tokens",
    )
    plain = copy_of(hf_dir, tmp_path, "no-template")
    (plain / "tokenizer_config.json").unlink()
    assert_one_line_error(*run_cli(capsys, "--model", plain, "--chat", "hi"), "has no chat template")
    edit_json(plain / "config.json", num_nextn_predict_layers=0)
    assert_one_line_error(*run_cli(capsys, "--model", plain, "--mtp", 1, "hi"), "needs a model with an MTP layer")
    corrupt = copy_of(hf_dir, tmp_path, "corrupt")
    (corrupt / "tokenizer.json").write_text('{"model": ')
    assert_one_line_error(
        *run_cli(capsys, "--model", corrupt, "hi"), f"{corrupt / 'tokenizer.json'}: not a valid tokenizer.json"
    )
    (corrupt / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    edit_json(corrupt / "tokenizer_config.json", eos_token="<|not-a-token|>")
    assert_one_line_error(*run_cli(capsys, "--model", corrupt, "hi"), "eos_token '<|not-a-token|>' is not a token")
    (corrupt / "tokenizer_config.json").write_bytes(b"\xff{")
    assert_one_line_error(
        *run_cli(capsys, "--model", corrupt, "hi"), f"{corrupt / 'tokenizer_config.json'}: not valid JSON"
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ("{", "not valid JSON"),
        ("[]", "no 'weight_map' object"),
        ('{"weight_map": {"lm_head.weight": 7}}', "'weight_map' maps 'lm_head.weight' to 7"),
    ],
)
def test_broken_safetensors_index(capsys, tmp_path, hf_dir, no_weights, body, message):
    model = copy_of(hf_dir, tmp_path)
    (model / INDEX).write_text(body)
    assert_one_line_error(*run_cli(capsys, "--model", model, "hi"), f"{model / INDEX}: {message}")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 16.5}, "config key 'num_experts': must be an integer, got 16.5"),
        ({"hidden_size": "64"}, "config key 'hidden_size': must be an integer, got '64'"),
        ({"rms_norm_eps": True}, "config key 'rms_norm_eps': must be a number, got True"),
        ({"model_type": "llama"}, "config key 'model_type': 'llama' is not a Ling 3.x model"),
    ],
)
def test_config_nonsense_is_refused_by_key(capsys, tmp_path, hf_dir, no_weights, change, message):
    model = copy_of(hf_dir, tmp_path)
    edit_json(model / "config.json", **change)
    assert_one_line_error(*run_cli(capsys, "--model", model, "hi"), f"{model / 'config.json'}: {message}")


def test_mtp_is_bounded(capsys, no_weights):
    assert_one_line_error(
        *run_cli(capsys, "--preset", "tiny", "--mtp", 100, "hi"), f"--mtp must be <= {MAX_MTP}", "got 100"
    )


def test_prompts_must_be_utf8_and_stdin_not_empty(capsys, monkeypatch, tmp_path, no_weights):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("naïve\n".encode("latin-1"))
    assert_one_line_error(
        *run_cli(capsys, "--preset", "tiny", "--prompt-file", prompts),
        f"--prompt-file {prompts}: not UTF-8 text (byte 0xef at offset 2)",
    )
    for text in ("", "\n  \n"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        assert_one_line_error(*run_cli(capsys, "--preset", "tiny"), "no prompt on stdin")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    assert_one_line_error(*run_cli(capsys, "--preset", "tiny"), "stdin: not UTF-8 text (byte 0xff at offset 3)")


def poison(model_dir, kind: str, value: float) -> str:
    """Write `value` into one element of a seeded random tensor of dtype `kind`; return the tensor's name."""
    shard = model_dir / SHARD
    with open(shard, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    names = sorted(
        n for n, e in header.items() if n != "__metadata__" and e["dtype"] == kind and not n.endswith("_scale_inv")
    )
    rng = np.random.default_rng(len(names))
    name = names[rng.integers(len(names))]
    dtype = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}[kind]
    begin, end = header[name]["data_offsets"]
    data = np.memmap(shard, dtype=np.uint8, mode="r+", offset=8 + header_len + begin, shape=(end - begin,))
    values = data.view(dtype)
    values[rng.integers(values.size)] = value
    data.flush()
    return name


@pytest.mark.parametrize("kind, value", [("BF16", np.nan), ("F32", -np.inf)])
def test_non_finite_hf_weights_are_refused_with_the_tensor_name(capsys, tmp_path, hf_dir, kind, value):
    model = copy_of(hf_dir, tmp_path)
    name = poison(model, kind, value)
    assert_one_line_error(
        *run_cli(capsys, "--model", model, "hi"), f"{model / SHARD}: tensor '{name}' has 1 NaN or Inf value (of "
    )


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-orbax") / "ckpt"
    convert(str(hf_dir), str(directory), Options(progress=False))
    return directory


def test_non_finite_orbax_weights_are_refused_with_the_parameter_name(capsys, tmp_path, orbax_dir):
    """The converted arrays restored, one element of a seeded random one set to NaN, saved again."""
    with ocp.StandardCheckpointer() as checkpointer:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(checkpointer.restore(str(orbax_dir)))
    rng = np.random.default_rng(len(leaves))
    pick = int(rng.integers(len(leaves)))
    path, array = leaves[pick]
    array = np.array(array)
    array.flat[rng.integers(array.size)] = np.nan
    leaves[pick] = (path, array)
    model = tmp_path / "nan"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(model), jax.tree_util.tree_unflatten(treedef, [value for _, value in leaves]))
    for side_file in ("config.json", "ling_convert.json", "tokenizer.json"):
        shutil.copy(orbax_dir / side_file, model)
    name = ".".join(key.key for key in path)
    assert_one_line_error(*run_cli(capsys, "--model", model, "hi"), f"{model}: parameter '{name}' holds NaN or Inf")


def truncate_data_files(model):
    """Cut every array data file (in the per-process OCDBT databases; the root one holds the index)."""
    for folder, _, files in os.walk(model):
        if os.path.basename(folder) == "d" and os.path.basename(os.path.dirname(folder)).startswith("ocdbt.process_"):
            for file in files:
                os.truncate(os.path.join(folder, file), 10)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda m: (m / "_METADATA").unlink(),
            "damaged checkpoint: _METADATA (the index of the stored arrays) is missing",
        ),
        (lambda m: (m / "_METADATA").write_text("{"), "damaged checkpoint: its array metadata"),
        (truncate_data_files, "restoring failed, the checkpoint looks damaged: "),
        (lambda m: (m / "ling_convert.json").write_text("{"), "ling_convert.json: not valid JSON"),
        (
            lambda m: (m / "ling_convert.json").write_text('{"format": "ling-convert/1", "compute_dtype": "bfloat16"}'),
            "ling_convert.json: 'scale_blocks' must map parameter names",
        ),
    ],
)
def test_damaged_orbax_checkpoint_is_one_line(capsys, tmp_path, orbax_dir, damage, message):
    model = copy_of(orbax_dir, tmp_path)
    damage(model)
    assert_one_line_error(*run_cli(capsys, "--model", model, "hi"), str(model), message)


def cli_process(*argv, stdin):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS
    return subprocess.Popen(
        [sys.executable, *map(str, argv)],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )


def test_an_open_stdin_is_announced_and_its_end_without_prompts_refused():
    """A pipe that gives nothing: a line on stderr says what the script waits for; EOF then ends it."""
    process = cli_process(ROOT / "scripts" / "generate.py", "--preset", "tiny", stdin=subprocess.PIPE)
    try:
        ready, _, _ = select.select([process.stderr], [], [], 60)
        assert ready, "nothing on stderr while waiting for stdin"
        assert b"reading the prompts from stdin" in process.stderr.readline()
        process.stdin.close()
        assert process.wait(timeout=60) == 2
        assert (
            process.stderr.read()
            .decode()
            .endswith(
                "error: no prompt on stdin (it is empty or every line is "
                "blank): pipe some text, or give PROMPT arguments or "
                "--prompt-file\n"
            )
        )
    finally:
        process.kill()


def test_python_m_runs_the_cli(tmp_path):
    """`python -m ling_jax.generation.cli` is the script; here with a stdin that is not UTF-8."""
    stdin = tmp_path / "stdin.txt"
    stdin.write_bytes(b"\xfe\xff\n")
    with open(stdin, "rb") as f:
        process = cli_process("-m", "ling_jax.generation.cli", "--preset", "tiny", stdin=f)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 2 and out == b""
    assert err.decode() == "error: stdin: not UTF-8 text (byte 0xfe at offset 0)\n"
