"""Host memory of the sharded HF loader: peak RSS of `load_hf_checkpoint(path, mesh=...)` on a multi-GB block-FP8
checkpoint, beside the checkpoint's size and the bound it must keep (2 GiB plus its largest per-device slice).

    python -m benchmarks.load_memory --size-gb 2.5 --mesh expert=8 --workdir /tmp/bench_load
    python -m benchmarks.load_memory --quick      # the tiny preset's checkpoint: a smoke test

It writes a checkpoint of `convert.synthetic.benchmark_config` (random FP8 codes), then loads it in a child process
(`convert.measure`: the child's own peak RSS) on CPU devices standing in for the mesh. CPU devices keep their arrays
in host memory, so the figure that must stay bounded is the peak RSS less the bytes the loaded model holds on this
process's devices: what loading costs beyond the arrays themselves. Everything written is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from convert.measure import run_measured  # noqa: E402
from convert.synthetic import benchmark_config, write_random_checkpoint  # noqa: E402
from ling_jax.presets import preset  # noqa: E402

GIB = 1 << 30
BOUND_BYTES = 2 * GIB  # plus one slice

_LOAD = """
import json, math, os, sys, time
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[3]}"
import jax
from ling_jax import load_hf_checkpoint, make_mesh
from ling_jax.sharding import parse_mesh
start = time.perf_counter()
mesh = make_mesh(parse_mesh(sys.argv[2]))
model = load_hf_checkpoint(sys.argv[1], mesh=mesh, weights="stored", progress=False)
leaves = jax.block_until_ready(jax.tree.leaves(model))
held = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)
largest = max(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in leaves)
print(json.dumps({"seconds": time.perf_counter() - start, "device_bytes": held, "largest_slice": largest}))
"""


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.5, help="checkpoint size to write (default 2.5)")
    parser.add_argument("--mesh", default="expert=8", help="mesh of CPU devices (default expert=8)")
    parser.add_argument("--workdir", default="/tmp/bench_load_memory")
    parser.add_argument("--quick", action="store_true", help="the tiny preset's checkpoint (smoke test)")
    args = parser.parse_args(argv)
    config = preset("tiny") if args.quick else benchmark_config(args.size_gb * 1e9)
    devices = math.prod(int(item.split("=")[1]) for item in args.mesh.split(",") if item)
    src = os.path.join(args.workdir, "hf")
    shutil.rmtree(args.workdir, ignore_errors=True)
    try:
        write_random_checkpoint(src, config, num_shards=3, random_codes=True)
        run = run_measured([sys.executable, "-c", _LOAD, src, args.mesh, str(devices)], cwd=ROOT)
        if run.returncode:
            raise RuntimeError(f"loading failed:\n{run.stderr}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        checkpoint = directory_bytes(src)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    beyond = run.peak_rss - result["device_bytes"]
    bound = BOUND_BYTES + result["largest_slice"]
    rows = [
        ("checkpoint on disk", checkpoint),
        (f"model on this process's {devices} CPU devices", result["device_bytes"]),
        ("largest per-device slice", result["largest_slice"]),
        ("peak RSS of the loading process", run.peak_rss),
        ("peak RSS beyond the device arrays", beyond),
        ("bound: 2 GiB + the largest slice", bound),
    ]
    print(f"load_hf_checkpoint(mesh {args.mesh}, weights stored) in {result['seconds']:.1f} s")
    for label, nbytes in rows:
        print(f"{label:<44} {nbytes / GIB:8.2f} GiB")
    print("within the bound" if beyond <= bound else "OVER THE BOUND")
    return 0 if beyond <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
