"""The HF block-FP8 loader's rate against the disk's, in the same run: a random checkpoint of about --size-gb
written to --workdir, its files read raw (threads of preads, each byte once) and then loaded by
`load_hf_checkpoint(weights="stored")` once per --workers count, each from a cold page cache (the files' cached
pages dropped with posix_fadvise before every read: no root needed; on a tmpfs nothing is dropped). Each line gives
the seconds, the GB/s and the CPU seconds this process spent (user + system, all threads): on a shared machine the
CPU seconds move less than the wall time.

    python -m benchmarks.load_rate --size-gb 8 --workers 1,8 --workdir /tmp/bench_load_rate
    python -m benchmarks.load_rate --quick     # the tiny preset's checkpoint: a smoke test

The checkpoint is `convert.synthetic.benchmark_config` (random FP8 codes, float32 block scales as the published
FP8 checkpoints store them), loaded onto this process's first device (or over --mesh). Everything written is
deleted afterwards.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax

from convert.synthetic import benchmark_config, write_random_checkpoint
from ling_jax import load_hf_checkpoint, make_mesh
from ling_jax.presets import preset
from ling_jax.sharding import parse_mesh

CHUNK_BYTES = 64 << 20  # the raw read's unit


def checkpoint_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def drop_cached_pages(files: list[str]) -> None:
    """Ask the kernel to forget the files' cached pages (written back first), so the next read comes from disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_raw(files: list[str], workers: int) -> int:
    """Every byte of `files` read once, CHUNK_BYTES at a time by `workers` threads; -> bytes read."""

    def read_chunk(chunk: tuple[str, int]) -> int:
        path, offset = chunk
        buffer = bytearray(CHUNK_BYTES)
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)

    chunks = [(path, offset) for path in files for offset in range(0, os.path.getsize(path), CHUNK_BYTES)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return sum(pool.map(read_chunk, chunks))


def timed(label: str, size: int, run: Callable[[], object]) -> None:
    """run(), then `label` with the seconds it took, `size` bytes over them in GB/s and the CPU seconds of this
    process meanwhile (user + system, all threads); what run() returns is dropped."""
    start, cpu = time.perf_counter(), os.times()
    run()
    seconds, end = time.perf_counter() - start, os.times()
    cpu_seconds = end.user - cpu.user + end.system - cpu.system
    print(f"{label:<34} {seconds:7.2f} s {size / 1e9 / seconds:6.2f} GB/s {cpu_seconds:7.2f} s CPU")


def load_ready(src: str, mesh, workers: int):
    """The model loaded with `workers`, every parameter in place on its devices."""
    model = load_hf_checkpoint(src, mesh=mesh, weights="stored", progress=False, workers=workers)
    jax.block_until_ready(jax.tree.leaves(model))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size to write (default 8)")
    parser.add_argument("--workers", default="1,8", help="comma-separated loader worker counts (default 1,8)")
    parser.add_argument("--mesh", default="", help="load over this mesh (e.g. expert=8; default: the first device)")
    parser.add_argument("--workdir", default="/tmp/bench_load_rate")
    parser.add_argument("--quick", action="store_true", help="the tiny preset's checkpoint (smoke test)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    config = preset("tiny") if args.quick else benchmark_config(args.size_gb * 1e9)
    mesh = make_mesh(parse_mesh(args.mesh)) if args.mesh else None
    src = os.path.join(args.workdir, "hf")
    shutil.rmtree(args.workdir, ignore_errors=True)
    try:
        write_random_checkpoint(src, config, num_shards=4, random_codes=True, scale_format="float32")
        files = checkpoint_files(src)
        size = sum(os.path.getsize(path) for path in files)
        print(f"checkpoint: {size / 2**30:.2f} GiB in {len(files)} files, {jax.devices()[0].platform} devices")
        drop_cached_pages(files)
        timed(f"raw read ({max(counts)} threads)", size, functools.partial(read_raw, files, max(counts)))
        for workers in counts:
            drop_cached_pages(files)
            timed(f"load_hf_checkpoint ({workers} workers)", size, functools.partial(load_ready, src, mesh, workers))
            gc.collect()  # the model just loaded is freed before the next load
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
