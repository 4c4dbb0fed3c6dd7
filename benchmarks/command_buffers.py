"""Which parts of generate.py's decode programs XLA runs as command buffers (CUDA graphs), and what keeps the rest out.

A multi-step decode program is a `while` loop; with `ling_jax.xla_flags` XLA can record the whole loop, its
`lax.cond`s included, as one command buffer, but only when every instruction of the loop's body (and of the
conds' branches) can be a command. One that cannot leaves the `while` to the host: each iteration's predicate is
copied to the host and the body's command buffers relaunched, hundreds of microseconds between steps on an H100
(docs/benchmarks/generation.md). This reads a compiled GPU program's HLO text (`compiled.as_text()`, after XLA's
command-buffer scheduling outlined its runs of commands into `command_buffer` computations) and reports each
`while` and `conditional`: inside a command buffer or not, and for one that is not, the instructions of its called
computations that run outside any command buffer (the reason, or the ones it contains).

    python -m benchmarks.command_buffers --preset ling-3.0-flash --layers 2 --batch 1 --mtp 1

compiles the decode group (DECODE_READ_GROUP steps) for several sampling mixes, generally traced (every optional
step behind its cond) and specialised (`SamplingArrays.from_params(specialise=True)`), and the speculative group,
and prints a report for each. On a CPU nothing is a command buffer; the report then lists every loop.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import pathlib
import re
import sys

from ling_jax import xla_flags

if __name__ == "__main__":
    xla_flags.set_gpu_flags()

import jax.numpy as jnp  # noqa: E402

from benchmarks.trace import hlo_computations  # noqa: E402

COMMAND_BUFFER = "command_buffer"  # the name prefix XLA gives an outlined command buffer's computation
_CALLED = re.compile(r"(?:to_apply|body|condition|calls|branch_computations|true_computation|false_computation)=")
_COMPUTATION_REF = re.compile(r"%(?P<name>[\w.\-]+)")
_OPCODE = re.compile(r"(?:^|\s)(?P<opcode>[a-z][\w\-]*)\(")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "opt-barrier"}


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """One `while` or `conditional` of a compiled program: captured (inside a command buffer) or, if not, the
    instructions of its called computations that run outside command buffers (`outside`: 'name: opcode[ target]')."""

    name: str
    opcode: str
    captured: bool
    outside: tuple[str, ...]


def _called(rest: str) -> list[str]:
    """The computations an instruction calls (its body, condition, branches, to_apply, fused computation)."""
    names = []
    for match in _CALLED.finditer(rest):
        tail = rest[match.end() :]
        listed = tail[1 : tail.index("}")] if tail.startswith("{") else tail.split(",", 1)[0].split(" ", 1)[0]
        names += [ref["name"] for ref in _COMPUTATION_REF.finditer(listed)]
    return names


def _describe(name: str, rest: str) -> str:
    opcode = _OPCODE.search(rest)
    target = _CUSTOM_CALL_TARGET.search(rest)
    return f"{name}: {opcode['opcode'] if opcode else '?'}" + (f" {target['target']}" if target else "")


def control_flow(hlo_text: str) -> list[ControlFlow]:
    """Every `while` and `conditional` of a compiled program's HLO text, in text order (module docstring)."""
    computations = hlo_computations(hlo_text)
    parents: dict[str, set[str]] = collections.defaultdict(set)  # computation -> the computations that call it
    for computation, instructions in computations.items():
        for _, rest in instructions:
            for called in _called(rest):
                parents[called].add(computation)

    @functools.cache
    def in_command_buffer(computation: str) -> bool:
        if computation.startswith(COMMAND_BUFFER):
            return True
        callers = parents.get(computation, set())
        return bool(callers) and all(in_command_buffer(caller) for caller in callers)

    def outside(computation: str, seen: set[str]) -> list[str]:
        if computation in seen or computation not in computations or in_command_buffer(computation):
            return []
        seen.add(computation)
        found = []
        for name, rest in computations[computation]:
            opcode = _OPCODE.search(rest)
            opcode = opcode["opcode"] if opcode else ""
            called = _called(rest)
            if opcode in _BOOKKEEPING or (opcode == "call" and all(c.startswith(COMMAND_BUFFER) for c in called)):
                continue
            if opcode in ("while", "conditional"):
                for inner in called:
                    found += outside(inner, seen)
            else:
                found.append(_describe(name, rest))
        return found

    flows = []
    for computation, instructions in computations.items():
        for name, rest in instructions:
            opcode = _OPCODE.search(rest)
            if opcode is None or opcode["opcode"] not in ("while", "conditional"):
                continue
            captured = in_command_buffer(computation)
            missing = () if captured else tuple(dict.fromkeys(m for c in _called(rest) for m in outside(c, set())))
            flows.append(ControlFlow(name, opcode["opcode"], captured, missing))
    return flows


def report(hlo_text: str, limit: int = 12) -> str:
    """One line per `while` / `conditional` (`control_flow`), with up to `limit` of the instructions outside."""
    lines = []
    for flow in control_flow(hlo_text):
        state = "in a command buffer" if flow.captured else "on the host"
        lines.append(f"  {flow.opcode} {flow.name}: {state}")
        lines += [f"      outside: {item}" for item in flow.outside[:limit]]
        if len(flow.outside) > limit:
            lines.append(f"      ... {len(flow.outside) - limit} more")
    return "\n".join(lines) or "  no while or conditional"


def _programs(model, batch: int, num_drafts: int):
    """(label, lowered program) of the decode and speculative groups for several sampling mixes."""
    from benchmarks.common import filled_cache
    from ling_jax.generation.end_tokens import end_bitmask
    from ling_jax.generation.generator import (
        DECODE_READ_GROUP,
        DecodeState,
        Drafts,
        _decode_group,
        _speculative_group,
        cache_length,
    )
    from ling_jax.generation.sampling import SamplingArrays, SamplingParams
    from ling_jax.generation.static_model import split_model

    config = model.config
    static, leaves = split_model(model)
    context, extra = 256, 64
    mixes = {
        "greedy": SamplingParams(temperature=0.0),
        "sampled": SamplingParams(temperature=0.7),
        "top-p": SamplingParams(temperature=0.7, top_p=0.9),
        "logprobs": SamplingParams(temperature=0.0, logprobs=5),
        "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.1),
    }
    seen_BV = jnp.zeros((batch, config.vocab_size), bool)
    plain = DecodeState.create(filled_cache(model, batch, context, extra), seen_BV)
    general = SamplingArrays.from_params([mixes["greedy"]] * batch)
    yield "decode group, general", _decode_group.lower(static, DECODE_READ_GROUP, leaves, plain, general)
    for label, params in mixes.items():
        arrays = SamplingArrays.from_params([params] * batch, specialise=True)
        program = _decode_group.lower(static, DECODE_READ_GROUP, leaves, plain, arrays)
        yield f"decode group, specialised for {label}", program
    if num_drafts:
        cache = filled_cache(model, batch, context, extra)
        drafts = Drafts.create(config, batch, cache_length(context, extra, mtp=0), model.dtype)
        state = DecodeState.create(cache, seen_BV, drafts)
        no_end_BW = jnp.asarray(end_bitmask([()] * batch, config.vocab_size))
        active_B, capacity_B = jnp.ones((batch,), bool), cache.lengths + extra
        program = _speculative_group.lower(
            static, num_drafts, DECODE_READ_GROUP, leaves, state, general, active_B, capacity_B, no_end_BW
        )
        yield "speculative group, general", program


def main(argv=None) -> int:
    from benchmarks.common import first_layers, run_header
    from ling_jax.generation.random_init import random_model
    from ling_jax.presets import PRESETS, preset

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=2, help="the preset's first N decoder layers (default 2)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mtp", type=int, default=1, help="drafts of the speculative group (0: none)")
    parser.add_argument("--hlo-dir", type=pathlib.Path, help="also write each program's compiled HLO text here")
    args = parser.parse_args(argv)
    try:
        config = first_layers(preset(args.preset), args.layers)
    except ValueError as error:
        parser.error(str(error))
    print(run_header("command_buffers"), flush=True)
    model = random_model(config, dtype=jnp.bfloat16)
    for index, (label, lowered) in enumerate(_programs(model, args.batch, args.mtp)):
        text = lowered.compile().as_text()
        if args.hlo_dir:
            args.hlo_dir.mkdir(parents=True, exist_ok=True)
            (args.hlo_dir / f"program_{index}.hlo.txt").write_text(text)
        print(f"{label}:\n{report(text)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
