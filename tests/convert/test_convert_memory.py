"""ling-convert streams: converting a multi-GB checkpoint to bf16 keeps the converter's own peak RSS (measured
from the child, `convert.measure`) under a fixed bound, well below the checkpoint's size."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from helpers import REPO_ROOT

from convert.measure import run_measured
from convert.synthetic import benchmark_config, write_random_checkpoint

ROOT = str(REPO_ROOT)
RSS_BOUND = 1 << 30  # 1 GiB; an idle converter process (JAX, orbax, tensorstore imported) is ~0.25 GiB


def directory_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.slow
def test_peak_rss_is_bounded_on_a_multi_gb_checkpoint(tmp_path):
    src, dst = tmp_path / "hf", tmp_path / "orbax"
    try:
        write_random_checkpoint(str(src), benchmark_config(2.3e9), num_shards=3, random_codes=True)
        source_bytes = directory_bytes(src)
        assert source_bytes >= 2e9
        run = run_measured(
            [sys.executable, "-m", "convert.cli", str(src), str(dst), "--dtype", "bf16", "--workers", "2", "--quiet"],
            cwd=ROOT,
        )
        assert run.returncode == 0, run.stderr
        print(
            f"converted {source_bytes / 1e9:.2f} GB -> {directory_bytes(dst) / 1e9:.2f} GB in {run.seconds:.1f} s, "
            f"peak RSS {run.peak_rss / 2**20:.0f} MiB"
        )
        assert run.peak_rss < RSS_BOUND < source_bytes / 2
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
