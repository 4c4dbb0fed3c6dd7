"""`ling-serve`'s flag checks: one `error:` line and status 2, before any weight is read."""

from __future__ import annotations

import pytest

from ling_jax.serving.cli import build_parser, main


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mtp", "2"], "--mtp 2: MTP speculation per slot is not built"),
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--prefill-chunk", "8"], "--prefill-chunk must be >= 16, got 8"),
        (["--prefix-cache-gb", "-1"], "--prefix-cache-gb must be >= 0"),
        (["--prefix-cache-gb", "1", "--page-size", "48"], "--page-size 48 must divide --prefill-chunk 512"),
        (["--prefill-chunk", "64", "--prefill-budget", "32"], "--prefill-budget must be >= --prefill-chunk (64)"),
        (["--max-context", "1000000"], "--max-context 1000000 exceeds the model's context of 2048"),
        (["--model", "/nonexistent/ckpt"], "--model /nonexistent/ckpt: not a directory"),
        (["--mesh", "tensor"], "--mesh expects axis=size pairs"),
    ],
)
def test_bad_flags_are_one_error_line(flags, message, capsys):
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_defaults_serve_the_demo_checkpoint_on_localhost():
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.model.name, args.mtp, args.prefix_cache_gb) == (
        "127.0.0.1",
        8000,
        "ling-demo",
        0,
        0,
    )
