"""`ling-serve`'s flag checks: one `error:` line and status 2, before any weight is read."""

from __future__ import annotations

import json

import pytest
from optional_deps import require_serve_extra

require_serve_extra()

from ling_jax.generation.cli import DEMO_DIR  # noqa: E402
from ling_jax.serving import cli  # noqa: E402
from ling_jax.serving.cli import build_parser, main  # noqa: E402


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mtp", "-1"], "--mtp must be >= 0, got -1"),
        (["--mtp", "5"], "--mtp must be <= 4"),
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--decode-steps", "0"], "--decode-steps must be >= 1, got 0"),
        (["--prefill-chunk", "8"], "--prefill-chunk must be >= 16, got 8"),
        (["--prefix-cache-gb", "-1"], "--prefix-cache-gb must be >= 0"),
        (["--prefix-cache-gb", "1", "--page-size", "48"], "--page-size 48 must divide --prefill-chunk 512"),
        (["--prefill-chunk", "64", "--prefill-budget", "32"], "--prefill-budget must be >= --prefill-chunk (64)"),
        (["--max-context", "1000000"], "--max-context 1000000 exceeds the model's context of 2048"),
        (["--model", "/nonexistent/ckpt"], "--model /nonexistent/ckpt: not a directory"),
        (["--mesh", "tensor"], "--mesh expects axis=size pairs"),
        (["--prefix-cache-gb", "1e-6"], "--prefix-cache-gb 1e-06 cannot hold one prefix block: a block of"),
        (["--process-id", "1"], "--process-id: only with --distributed"),
    ],
)
def test_bad_flags_are_one_error_line(flags, message, capsys):
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_mtp_needs_a_model_with_an_mtp_layer(tmp_path, capsys, monkeypatch):
    """The demo checkpoint with its MTP layer dropped from the config (weights linked, never read)."""
    for source in DEMO_DIR.iterdir():
        (tmp_path / source.name).symlink_to(source)
    config = json.loads((DEMO_DIR / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("weights loaded before the checks"))
    assert main(["--model", str(tmp_path), "--mtp", "1"]) == 2
    message = f"--mtp 1 needs a model with an MTP layer; {tmp_path} has none (num_nextn_predict_layers = 0)"
    assert capsys.readouterr().err == f"error: {message}\n"


def test_defaults_serve_the_demo_checkpoint_on_localhost():
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.model.name, args.mtp, args.prefix_cache_gb, args.fp8_matmul) == (
        "127.0.0.1",
        8000,
        "ling-demo",
        0,
        0,
        "auto",
    )
    assert build_parser().parse_args(["--fp8-matmul", "w8a8"]).fp8_matmul == "w8a8"
