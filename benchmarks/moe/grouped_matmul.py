"""Tile sweep of the Pallas grouped matmul (`pallas_kernels.moe` grouped_matmul, variant gpu_triton) at MoE shapes.

    python -m benchmarks.moe --grouped-matmul-sweep                    # rows 8, 64, 512; Ling-3.1-flash shapes
    python -m benchmarks.moe --grouped-matmul-sweep --rows 8 --quick   # fewer tile candidates

Rows are routed to random experts (E = 512, as in decode: rows = tokens x top-8). For the gate/up shape
(N = moe_intermediate 1024, K = hidden 4096) and the down shape (N = 4096, K = 1024) it times every
candidate (block_m, block_n, block_k, num_warps, num_stages) and prints the default's time, the best
candidate and the bandwidth over the weight bytes the call must read (the distinct experts hit x N x K x 2),
the figure that matters at decode sizes, where the kernel is a stream of expert weights.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_seconds, rel_error
from benchmarks.moe import calls
from benchmarks.moe.shared import selection_parser

SHAPES = {"gate/up": (1024, 4096), "down": (4096, 1024)}  # (N, K)


def routed_group_sizes(rows: int, num_experts: int, seed: int) -> np.ndarray:
    """Group sizes of `rows` rows sent to random experts (top-k picks are distinct within a token, which
    does not matter for the kernel)."""
    experts = np.random.default_rng(seed).integers(num_experts, size=rows)
    return np.bincount(experts, minlength=num_experts).astype(np.int32)


def candidates(quick: bool):
    """Launch settings to try; block_m is 16, the smallest Triton dot, since decode groups hold a few rows."""
    block_n = (32, 64) if quick else (16, 32, 64, 128)
    block_k = (128, 256) if quick else (128, 256, 512)
    stages = (3,) if quick else (3, 4)
    return itertools.product((16,), block_n, block_k, (4,), stages)


def sweep(rows: int, n_dim: int, k_dim: int, num_experts: int, quick: bool, iters: int):
    """-> (default seconds, sorted [(seconds, tiles)], weight bytes) for one problem."""
    sizes = routed_group_sizes(rows, num_experts, seed=rows)
    lhs = jax.random.normal(jax.random.key(0), (rows, k_dim), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (num_experts, n_dim, k_dim), jnp.bfloat16)
    sizes_dev = jnp.asarray(sizes)
    expected = calls.grouped_matmul_reference(lhs, rhs, sizes_dev)

    def timed(**tiles):
        fn = calls.grouped_matmul_tiles(**tiles)
        error = rel_error(fn(lhs, rhs, sizes_dev), expected)
        if not error < 1e-2:
            raise SystemExit(f"tiles {tiles}: rel. error {error:.2e} against the reference")
        return median_seconds(fn, lhs, rhs, sizes_dev, iters=iters)

    tiling = median_seconds(jax.jit(lambda s: calls.row_tiles(s, rows, 16)), sizes_dev, iters=iters)
    print(f"  row tiling alone (jnp, before the kernel): {tiling * 1e6:.1f} us")
    results = []
    for tiles in candidates(quick):
        try:
            seconds = timed(**dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), tiles)))
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile (shared memory) is skipped
            print(f"  skip {tiles}: {type(error).__name__}: {str(error)[:120]}")
            continue
        results.append((seconds, tiles))
    return timed(), sorted(results), int((sizes > 0).sum()) * n_dim * k_dim * 2


def main(argv=None) -> int:
    parser = selection_parser(__doc__)
    parser.add_argument("--rows", default="8,64,512", help="comma-separated row counts (tokens x top-k)")
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="fewer candidates")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    for rows, (shape_name, (n_dim, k_dim)) in itertools.product(map(int, args.rows.split(",")), SHAPES.items()):
        default, results, weight_bytes = sweep(rows, n_dim, k_dim, args.experts, args.quick, args.iters)
        print(
            f"rows {rows:6d} {shape_name:8s} N {n_dim} K {k_dim}: {weight_bytes / 1e6:.1f} MB of expert weights; "
            f"default tiles {default * 1e6:.1f} us ({weight_bytes / default / 1e12:.2f} TB/s)"
        )
        for seconds, tiles in results[:5]:
            print(f"    {tiles}: {seconds * 1e6:.1f} us ({weight_bytes / seconds / 1e12:.2f} TB/s)")
    return 0
