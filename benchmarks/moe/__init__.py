"""The MoE benchmarks, one command: `python -m benchmarks.moe [--format ...] [--fp8-matmul ...] [--path ...]
[--devices N] [--grouped-matmul-sweep]` picks the measurement (`shared.selection_parser`), which takes the rest
of the flags (`--help` lists both):

- bf16 experts (default): one MoE layer, fused vs unfused vs dense one-hot, and a tile sweep (`layer`);
  `--path rows`: the row-by-row decode kernels against the grouped path, and the expert selection (`rows`);
- `--format fp8 mxfp4`: the routed experts stored block FP8 / MXFP4 beside bf16, prefill and decode rows (`quantized`;
  `--path grouped` / `rows`: one of the two);
- `--fp8-matmul w8a8`: the routed experts in FP8 x FP8 against bf16 and the FP8 peak (`w8a8`);
- `--devices N`: expert parallelism over N devices (`expert_parallel`);
- `--grouped-matmul-sweep`: the unfused path's grouped matmul at decode sizes (`grouped_matmul`).

Every call into `ling_jax.moe` and `pallas_kernels.moe` they make is in `calls` (the expert-parallel stages in
`expert_parallel.stage_functions`). docs/benchmarks/moe.md maps the former commands to these.
"""

from __future__ import annotations

from benchmarks.moe import expert_parallel, grouped_matmul, layer, quantized, rows, w8a8
from benchmarks.moe.shared import selection_parser


def main(argv: list[str] | None = None) -> int:
    parser = selection_parser(add_help=False)  # --help: the chosen measurement's, which lists these flags too
    args, _ = parser.parse_known_args(argv)
    formats = set(args.format)
    if args.devices > 1:
        bench, allowed = expert_parallel, formats == {"bf16"} and args.path is None
    elif args.grouped_matmul_sweep:
        bench, allowed = grouped_matmul, formats == {"bf16"} and args.path is None
    elif args.fp8_matmul == "w8a8":
        bench, allowed = w8a8, formats <= {"bf16", "fp8"} and args.path is None
    elif formats != {"bf16"}:
        bench, allowed = quantized, True
    else:
        bench, allowed = (rows if args.path == "rows" else layer), True
    if not allowed:
        parser.error(f"{bench.__name__} measures bf16 (W8A8: FP8) experts on its own path; drop --format / --path")
    return bench.main(argv)
