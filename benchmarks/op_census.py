#!/usr/bin/env python3
"""What one plain decode step and one MTP speculative round launch, counted in their compiled CPU programs (no
device needed): every fusion, custom-call and unfused op of the XLA program (while bodies times their known trip
count, a conditional at its smallest branch: the greedy path without logprobs), grouped by the model's named
scopes; and the CPU time of each, on a model of the demo checkpoint's shape (random weights).

    python -m benchmarks.op_census --mtp 1 --mtp 2          # the demo shape, batch 1
    python -m benchmarks.op_census --mtp 1 --batch 8 --no-time

On the demo a step is launch overhead (tiny matrices), so the ratio of a round's ops to a step's is the ratio of
their times a GPU sees: a round pays for itself when it costs fewer steps than the tokens it emits on average.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import jaxprs_in_params

from benchmarks.kernel_census import kernel_census
from ling_jax import ExecutionPolicy, LingConfig
from ling_jax.cache import LingCache
from ling_jax.generation.end_tokens import end_bitmask
from ling_jax.generation.flags import DEMO_DIR
from ling_jax.generation.generator import DecodeState, Drafts, decode_step, speculative_round
from ling_jax.generation.sampling import SamplingArrays, SamplingParams
from ling_jax.generation.static_model import split_model
from ling_jax.model import LingForCausalLM

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier"}
SCOPES = ("mtp", "decoder_layer", "lm_head", "embed", "final_norm")  # op_name parts that say which part of the model
SYNCS = "conditionals and loop trips"  # on a GPU each reads its predicate on the host (outside command buffers)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*?([a-z][\w\-]*)\((.*)$")


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text; "ENTRY" names the entry too."""
    computations, name = {}, None
    for line in hlo_text.splitlines():
        if name is None:
            found = _COMPUTATION.match(line)
            if found:
                name = found.group(1)
                computations[name] = []
                if line.startswith("ENTRY"):
                    computations["ENTRY"] = computations[name]
        elif line == "}":
            name = None
        else:
            computations[name].append(line)
    return computations


def _scope(lines: list[str]) -> str | None:
    """The first of SCOPES in the op names of `lines`; "sampling and bookkeeping" for named ops out of them; None for
    no op name (XLA's rewrites drop some)."""
    paths = [found.group(1) for found in (re.search(r'op_name="(jit[^"]*)"', line) for line in lines) if found]
    if not paths:
        return None
    return next((scope for path in paths for scope in SCOPES if scope in path), "sampling and bookkeeping")


def hlo_op_census(hlo_text: str) -> collections.Counter:
    """{scope: launches} of a compiled program's HLO text (`compiled.as_text()`): fusions, custom-calls and other
    unfused ops count one each where they run (parameters, tuples and constants none); a while body counts its known
    trip count times (once without one), a conditional its smallest branch; the scope is the first of SCOPES in the
    op's name ("sampling and bookkeeping" for none)."""
    computations = _computations(hlo_text)

    def census(name: str) -> collections.Counter:
        counts, scopes = collections.Counter(), {}
        for line in computations[name]:
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            opcode, rest = found.groups()
            fused = re.search(r"calls=%?([\w.\-]+)", rest) if opcode == "fusion" else None
            scope = _scope([line]) or (_scope(computations[fused.group(1)]) if fused else None)
            result = line.split("=")[0].split()[-1].lstrip("%")
            if opcode in FREE:
                scopes[result] = scope
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
            scope = scope or next((scopes[o] for o in operands if scopes.get(o)), None) or "sampling and bookkeeping"
            scopes[result] = scope
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                body, condition = re.search(r"body=%?([\w.\-]+)", rest), re.search(r"condition=%?([\w.\-]+)", rest)
                for _ in range(int(trips.group(1)) if trips else 1):
                    counts += census(body.group(1)) + census(condition.group(1))
                    counts[SYNCS] += 1
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = (
                    [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                    if branches
                    else [re.search(rf"{kind}_computation=%?([\w.\-]+)", rest).group(1) for kind in ("true", "false")]
                )
                counts += min((census(branch) for branch in names), key=launches)
                counts[SYNCS] += 1
            elif opcode == "call":
                counts += census(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1))
            else:
                counts[scope] += 1
        return counts

    return census("ENTRY")


def launches(counts: collections.Counter) -> int:
    """The ops of an `hlo_op_census`, less its SYNCS count."""
    return counts.total() - counts[SYNCS]


def demo_config() -> LingConfig:
    return LingConfig.from_pretrained(DEMO_DIR)


def _programs(config: LingConfig, batch: int, mtp: int, context: int, policy: ExecutionPolicy | None = None):
    """(jitted program, its arguments) of one plain step (mtp = 0) or one speculative round of `mtp` drafts, greedy,
    every row running, on a randomly initialised model of `config` with a cache of `context` slots; the sampler's
    and the round's inputs are arguments, as in the generator's programs (not constants XLA would fold conditionals
    of). float32: a CPU program of bfloat16 weights converts every weight on each call."""
    model = LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32, policy=policy)
    static, leaves = split_model(model)
    drafts = Drafts.create(config, batch, context, jnp.float32) if mtp else None
    state = DecodeState.create(
        LingCache.create(config, batch, context, jnp.float32),
        jnp.zeros((batch, config.vocab_size), bool),
        drafts,
    )
    arrays = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * batch)
    if not mtp:
        step = jax.jit(lambda leaves, state, arrays: decode_step(static.merge(leaves), state, arrays), donate_argnums=1)
        return step, (leaves, state, arrays)
    running_B = jnp.ones((batch,), bool)
    capacity_B = jnp.full((batch,), context - mtp - 1, jnp.int32)
    end_bits_BW = jnp.asarray(end_bitmask([()] * batch, config.vocab_size))

    def round_(leaves, state, inputs):
        return speculative_round(static.merge(leaves), mtp, state, *inputs)

    return jax.jit(round_, donate_argnums=1), (leaves, state, (arrays, running_B, capacity_B, end_bits_BW))


def op_census(config: LingConfig, *, batch: int = 1, mtp: int = 0, context: int = 256) -> collections.Counter:
    """`hlo_op_census` of one plain step (mtp = 0) or one speculative round of `mtp` drafts on the CPU."""
    program, args = _programs(config, batch, mtp, context)
    return hlo_op_census(program.lower(*args).compile().as_text())


def gpu_path_census(config: LingConfig, *, batch: int = 1, mtp: int = 0, context: int = 256) -> collections.Counter:
    """What the GPU path of one plain step (mtp = 0) or one speculative round runs, from its jaxpr (traced with the
    GPU kernels in interpret mode, nothing compiled): {kernel name: pallas_calls} (`kernel_census`) and {"loop in
    SCOPE": jnp loops} for the scans and while loops outside the kernels (each trip a host round trip, and its body's
    ops more launches)."""
    program, args = _programs(config, batch, mtp, context, ExecutionPolicy(kernel_backend="interpret_gpu"))
    jaxpr = jax.make_jaxpr(program)(*args)
    counts = collections.Counter({name: n for name, n in kernel_census(jaxpr).items() if " -> " not in name})

    def loops(jaxpr) -> None:
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            if eqn.primitive.name in ("scan", "while"):
                named = f'op_name="jit/{eqn.source_info.name_stack}"'
                counts[f"loop in {_scope([named])}"] += 1
            elif eqn.primitive.name != "pallas_call":
                for inner in jaxprs_in_params(eqn.params):
                    loops(inner)

    loops(jaxpr)
    return counts


def seconds_per_call(config: LingConfig, *, batch: int = 1, mtp: int = 0, context: int = 256, calls: int = 50):
    """The median CPU time of one plain step (mtp = 0) or one speculative round, compiled, over `calls` calls, each
    from the state the one before left (`context` must hold their tokens)."""
    program, (leaves, state, inputs) = _programs(config, batch, mtp, context)
    _, state = jax.block_until_ready(program(leaves, state, inputs))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        _, state = jax.block_until_ready(program(leaves, state, inputs))
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtp", type=int, action="append", default=[], help="draft tokens a round (repeatable)")
    parser.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    parser.add_argument("--no-time", action="store_true", help="count only; do not time the programs on the CPU")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if any(m < 1 for m in args.mtp):
        parser.error(f"--mtp must be >= 1, got {min(args.mtp)}")
    config = demo_config()
    programs = [0, *args.mtp]
    counts = {m: op_census(config, batch=args.batch, mtp=m) for m in programs}
    times = {} if args.no_time else {m: seconds_per_call(config, batch=args.batch, mtp=m) for m in programs}
    names = ["plain step"] + [f"--mtp {m} round" for m in args.mtp]
    print(f"demo shape, batch {args.batch}: ops a program (CPU HLO; conditionals at their smallest branch)\n")
    print("| scope | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    scopes = sorted({scope for c in counts.values() for scope in c} - {SYNCS})
    for scope in [*scopes, "total", SYNCS]:
        row = [launches(counts[m]) if scope == "total" else counts[m][scope] for m in programs]
        print(f"| {scope} | " + " | ".join(str(n) for n in row) + " |")
    ratio = [f"{launches(counts[m]) / launches(counts[0]):.2f}" for m in programs]
    print("| total / plain step | " + " | ".join(ratio) + " |")
    kernels = {m: gpu_path_census(config, batch=args.batch, mtp=m) for m in programs}
    print("\nthe GPU path: kernels (pallas_calls) and jnp loops a program\n")
    print("| kernel | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for name in sorted({name for c in kernels.values() for name in c}):
        print(f"| {name} | " + " | ".join(str(kernels[m][name]) for m in programs) + " |")
    if times:
        print("\n| CPU ms | " + " | ".join(f"{times[m] * 1e3:.2f}" for m in programs) + " |")
        print("| CPU time / plain step | " + " | ".join(f"{times[m] / times[0]:.2f}" for m in programs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
