"""Compile the weight-only TPU kernels (`fp8/tpu_mosaic.py`, `moe/tpu_mosaic.py`) and the MLA decode kernels
(`mla/tpu_mosaic.py`, contiguous and paged) for TPU v5e / v6e on a machine without a TPU: libtpu's compile-only
client (`jax.experimental.topologies`) runs the whole XLA TPU compilation, Mosaic included, which rejects what a
Pallas lowering alone lets through (unaligned accesses, layouts). Nothing runs: compiled means the kernel is a TPU
program, not that it is fast.

    pip install --no-deps --target /tmp/libtpu 'libtpu==0.0.42.*'     # jax[tpu]==0.10.2's libtpu, kept apart
    PYTHONPATH=/tmp/libtpu python scripts/compile_tpu_kernels.py          # Ling-3.1-flash shapes and the test sizes
    PYTHONPATH=/tmp/libtpu python scripts/compile_tpu_kernels.py --quick --chips v5e

libtpu stays out of the project's environment: where it is importable, jax tries to start a TPU backend.
Prints a table and exits 1 if anything failed. Columns: the compile time (or the error), and the kernel's VLIW
bundles as libtpu scheduled them (from its LLO dump): the kernel's whole static code, which is one grid step's
body (the K loop is unrolled) plus the pipeline's prologue, so about the cycles a grid step takes where no DMA
waits. A static count, not a timing: compare it with the HBM time of the step's weight tile (at 8 rows and the
default 256-row tiles: 1 MB of FP8 for the 8192 x 4096 linear, 512 KB of MXFP4 for a 1280 x 4096 expert) or
cache block (576 bf16 values a slot: 288 KB for 256 slots).
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time

# The topology is given below; these only keep libtpu from looking for a TPU VM's metadata.
for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost")):
    os.environ.setdefault(name, value)
# libtpu reads its flags once, when it starts: the schedules of the final bundles go to DUMP_DIR (~1 MB a kernel).
DUMP_DIR = tempfile.mkdtemp(prefix="tpu_bundles_")
DUMP_FLAGS = f"--xla_jf_dump_to={DUMP_DIR} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles"
os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {DUMP_FLAGS}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ling_jax.quantized import BlockFP8Weight, MXFP4Weight  # noqa: E402
from pallas_kernels.fp8.tpu_mosaic import weight_only_linear_tpu  # noqa: E402
from pallas_kernels.mla.tpu_mosaic import mla_decode_paged_tpu, mla_decode_tpu  # noqa: E402
from pallas_kernels.mla.tuned import DecodeTpuTiles  # noqa: E402
from pallas_kernels.moe.tpu_mosaic import grouped_matmul_tpu  # noqa: E402

TOPOLOGIES = {"v5e": ("v5e:1x1", "v5litepod-1"), "v6e": ("v6e:1x1", "v6e-1")}


def abstract(sharding):
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def expert_stacks(s, num_groups: int, out_dim: int, in_dim: int) -> dict:
    """Abstract expert stacks of every stored form the grouped kernel takes."""
    row_blocks, col_blocks, groups32 = -(-out_dim // 128), -(-in_dim // 128), -(-in_dim // 32)
    return {
        "fp8 128x128": BlockFP8Weight(
            s((num_groups, out_dim, in_dim), jnp.float8_e4m3fn),
            s((num_groups, row_blocks, col_blocks), jnp.float32),
            (128, 128),
        ),
        "fp8 1x32": BlockFP8Weight(
            s((num_groups, out_dim, in_dim), jnp.float8_e4m3fn),
            s((num_groups, out_dim, groups32), jnp.float32),
            (1, 32),
        ),
        "mxfp4 e8m0": MXFP4Weight(
            s((num_groups, out_dim, in_dim // 2), jnp.uint8), s((num_groups, out_dim, groups32), jnp.float8_e8m0fnu)
        ),
        "mxfp4 fp32 scales": MXFP4Weight(
            s((num_groups, out_dim, in_dim // 2), jnp.uint8), s((num_groups, out_dim, groups32), jnp.float32)
        ),
        "dense bf16": s((num_groups, out_dim, in_dim), jnp.bfloat16),
    }


def cases(s, quick: bool):
    """(kernel, shape, function, abstract args): the test sizes (odd, every path), then Ling-3.1-flash's
    projection (8192 x 4096) and experts (gate / up 1280 x 4096, down 4096 x 1280; 16 of the 512) at decode and
    prefill rows."""
    linear = functools.partial(weight_only_linear_tpu, block=(128, 128))
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows in (1, 7, 130):
            name = f"{jnp.dtype(dtype).name}, {rows} rows"
            yield (
                "fp8 linear",
                f"300x200, {name}",
                linear,
                (s((rows, 200), dtype), s((300, 200), jnp.float8_e4m3fn), s((3, 2), jnp.float32)),
            )
            for stack, weight in expert_stacks(s, 4, 300, 200).items():
                yield (
                    f"grouped {stack}",
                    f"4x300x200, {name}",
                    grouped_matmul_tpu,
                    (s((rows, 200), dtype), weight, s((4,), jnp.int32)),
                )
    yield from mla_decode_cases(s, quick)
    if quick:
        return
    for rows in (1, 8, 256):
        yield (
            "fp8 linear",
            f"8192x4096, bf16, {rows} rows",
            linear,
            (s((rows, 4096), jnp.bfloat16), s((8192, 4096), jnp.float8_e4m3fn), s((64, 32), jnp.float32)),
        )
    for out_dim, in_dim in ((1280, 4096), (4096, 1280)):  # gate / up, down
        for stack, weight in expert_stacks(s, 16, out_dim, in_dim).items():
            for rows in (64, 2048):
                args = (s((rows, in_dim), jnp.bfloat16), weight, s((16,), jnp.int32))
                yield f"grouped {stack}", f"16x{out_dim}x{in_dim}, bf16, {rows} rows", grouped_matmul_tpu, args


def mla_decode_cases(s, quick: bool):
    """The absorbed-MLA decode kernels (`mla/tpu_mosaic.py`), contiguous and paged: the test sizes (odd heads,
    lengths off the tile, 1 to 3 pages a block), then ling-serve's decode at B=32 over 8,192 slots (Ling's 32
    and 64 heads, bf16, 64-slot pages at 1, 4 and 8 pages a block)."""
    latent = lambda batch, heads, dtype: (s((batch, heads, 512), dtype), s((batch, heads, 64), dtype))  # noqa: E731

    def paged(batch, heads, context, page_size, dtype):
        pages = context // page_size
        table = (s((batch * pages + 1, page_size, 576), dtype), s((batch, pages), jnp.int32))
        return (*latent(batch, heads, dtype), *table, s((batch,), jnp.int32))

    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        contiguous = (*latent(3, 4, dtype), s((3, 300, 576), dtype), s((3,), jnp.int32))
        yield "mla decode", f"3x4 heads x300, {name}", functools.partial(mla_decode_tpu, scale=0.07), contiguous
        for page_size, block_k in ((16, 16), (16, 48)):
            yield (
                "mla decode paged",
                f"3x5 heads x4 pages of {page_size}, {block_k}-slot blocks, {name}",
                functools.partial(mla_decode_paged_tpu, scale=0.07, tiles=DecodeTpuTiles(block_k, 2)),
                paged(3, 5, 4 * page_size, page_size, dtype),
            )
    if quick:
        return
    for heads in (32, 64):
        shape = f"32x{heads} heads x8192, bf16"
        contiguous = (*latent(32, heads, jnp.bfloat16), s((32, 8192, 576), jnp.bfloat16), s((32,), jnp.int32))
        yield "mla decode", f"{shape}, 256-slot tiles", functools.partial(mla_decode_tpu, scale=0.07), contiguous
        for block_k in (64, 256, 512):
            yield (
                "mla decode paged",
                f"{shape}, {block_k}-slot blocks of 64-slot pages",
                functools.partial(mla_decode_paged_tpu, scale=0.07, tiles=DecodeTpuTiles(block_k, 2)),
                paged(32, heads, 8192, 64, jnp.bfloat16),
            )


def kernel_bundles() -> str:
    """The bundles of the Pallas kernel compiled last (its custom call's schedule analysis), the dump cleared."""
    counts = []
    for path in glob.glob(os.path.join(DUMP_DIR, "*schedule-analysis_final_bundles.txt")):
        with open(path) as schedule:
            text = schedule.read()
        if "tpu_custom_call" in text:
            counts.append(int(re.search(r"total scheduled bundles:\s+(\d+)", text).group(1)))
    for path in glob.glob(os.path.join(DUMP_DIR, "*")):
        os.remove(path)
    return str(max(counts)) if counts else "-"


def compile_kernel(fn, args) -> tuple[str, str]:
    """(compile seconds or the error, the kernel's bundles)."""
    start = time.perf_counter()
    try:
        jax.jit(fn).trace(*args).lower().compile()
    except Exception as error:  # noqa: BLE001 (every failure is a table row)
        kernel_bundles()
        return f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}", "-"
    return f"{time.perf_counter() - start:.1f} s", kernel_bundles()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", choices=sorted(TOPOLOGIES), default=sorted(TOPOLOGIES))
    parser.add_argument("--quick", action="store_true", help="the test sizes only")
    args = parser.parse_args()
    if importlib.util.find_spec("libtpu") is None:
        print(
            "libtpu is not importable: pip install --no-deps --target DIR 'libtpu==0.0.42.*' and run with "
            "PYTHONPATH=DIR (module docstring)",
            file=sys.stderr,
        )
        return 2
    from jax.experimental import topologies

    failed = 0
    print(f"| kernel | shape | chip | compile (jax {jax.__version__}) | bundles |\n|---|---|---|---|---|")
    for chip in args.chips:
        topology, accelerator = TOPOLOGIES[chip]
        os.environ["TPU_ACCELERATOR_TYPE"] = accelerator
        device = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology,
            chip_config_name="default",
            chips_per_host_bounds=(1, 1, 1),
            num_slices=1,
        ).devices[0]
        for kernel, shape, fn, fn_args in cases(abstract(jax.sharding.SingleDeviceSharding(device)), args.quick):
            outcome, bundles = compile_kernel(fn, fn_args)
            failed += outcome.startswith("FAILED")
            print(f"| {kernel} | {shape} | {device.device_kind} | {outcome} | {bundles} |", flush=True)
    shutil.rmtree(DUMP_DIR, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
