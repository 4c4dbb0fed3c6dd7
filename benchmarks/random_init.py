"""Random initialisation of a preset (`ling_jax.generation.random_init`, what `generate.py --preset`, `ling-serve
--preset` and the benchmarks use): how many programs it compiles and how long lowering, compiling and running them
take.

    python -m benchmarks.random_init --preset ling-3.0-flash --compile-only   # full size: nothing executed
    python -m benchmarks.random_init --preset tiny                            # end to end, on the device

--compile-only lowers and compiles every program without running one (a full-size model's weights need not fit)
and counts them; without it `random_model` runs end to end and prints its phases (bytes, programs, seconds lowering
and compiling). The persistent compilation cache is used when JAX_COMPILATION_CACHE_DIR is set (a second run then
reads the programs instead of compiling them).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from ling_jax.checkpoints.hf import STORED, WEIGHTS
from ling_jax.generation.memory_plan import abstract_model
from ling_jax.generation.random_init import compile_programs, init_programs, random_model
from ling_jax.presets import preset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ling-3.0-flash")
    parser.add_argument("--weights", choices=WEIGHTS, default=STORED)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-only", action="store_true", help="lower and compile the programs, run none")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    if not args.compile_only:
        start = time.perf_counter()
        model = random_model(config, weights=args.weights, seed=args.seed, progress=True)  # prints its phases
        jax.block_until_ready(jax.tree.leaves(model))
        print(f"random_model ({args.preset}, {args.weights}) {time.perf_counter() - start:.1f} s end to end")
        return 0
    start = time.perf_counter()
    abstract = abstract_model(config, weights=args.weights, dtype=jnp.bfloat16)
    programs = init_programs(config, abstract, dtype=jnp.bfloat16, seed=args.seed)
    lowered = time.perf_counter()
    compile_programs([program.lowered for program in programs])
    compiled = time.perf_counter()
    calls = sum(len(program.calls) for program in programs)
    print(f"{args.preset} ({args.weights}): {len(programs)} programs for {calls} parameter groups")
    print(f"trace + lower {lowered - start:6.1f} s")
    print(f"compile       {compiled - lowered:6.1f} s (side by side, {jax.device_count()} device(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
