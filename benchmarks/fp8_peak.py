"""The matrix peaks of this GPU, measured in one run: bf16 and FP8 (e4m3) GEMMs at M = N = K = 8192.

    python -m benchmarks.fp8_peak [--size 8192] [--iters 20]
    python -m benchmarks.fp8_peak --quick    # 256^3, 2 calls (smoke test; on a CPU the jax rows only)

Rows, each TFLOP/s from the median of `iters` timed calls (2 M N K flops per call):
- jax bf16: `jnp.dot` of bf16 operands, fp32 accumulation (the baseline every FP8 figure is read against);
- jax fp8: `jax.lax.dot_general` of e4m3 operands with `preferred_element_type=float32` (XLA's FP8 GEMM);
- torch bf16 / torch fp8 per-tensor / torch fp8 row-wise: `torch.matmul` and `torch._scaled_mm` with one scale
  per tensor or per row / column, where the device's torch has them (a row that cannot run says why).
The FP8 rows are the ceilings issue 25's W8A8 kernels are measured against (">= 55% of the measured FP8 peak").
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import median_seconds, run_header  # noqa: E402


def jax_rows(size: int, iters: int) -> dict[str, float]:
    a_MK = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b_KN = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    fp8 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32))
    a16, b16 = a_MK.astype(jnp.bfloat16), b_KN.astype(jnp.bfloat16)
    a8, b8 = a_MK.astype(jnp.float8_e4m3fn), b_KN.astype(jnp.float8_e4m3fn)
    return {
        "jax bf16": median_seconds(bf16, a16, b16, iters=iters),
        "jax fp8": median_seconds(fp8, a8, b8, iters=iters),
    }


def torch_rows(size: int, iters: int) -> dict[str, float | str]:
    try:
        import torch
    except ImportError as e:
        return {"torch": f"not run: {e}"}
    if not torch.cuda.is_available():
        return {"torch": "not run: no CUDA device for torch"}
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")

    def timed(call) -> float:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        samples = []
        for _ in range(iters):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        return statistics.median(samples)

    a16, b16 = a.bfloat16(), b.bfloat16()
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    rows: dict[str, float | str] = {"torch bf16": timed(lambda: a16 @ b16)}
    for name, scale_a, scale_b in (
        ("torch fp8 per-tensor", one, one),
        ("torch fp8 row-wise", torch.ones(size, 1, device="cuda"), torch.ones(1, size, device="cuda")),
    ):
        try:
            product = lambda sa=scale_a, sb=scale_b: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)
            rows[name] = timed(product)
        except (RuntimeError, TypeError) as e:
            rows[name] = f"not run: {str(e).splitlines()[0][:120]}"
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="size 256, 2 calls")
    args = parser.parse_args(argv)
    size, iters = (256, 2) if args.quick else (args.size, args.iters)
    flops = 2 * size**3
    print(run_header("fp8_peak"))
    print(f"# M = N = K = {size}, median of {iters}")
    rows = {**jax_rows(size, iters), **torch_rows(size, iters)}
    for name, seconds in rows.items():
        if isinstance(seconds, str):
            print(f"{name:24s} {seconds}")
        else:
            print(f"{name:24s} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:7.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
