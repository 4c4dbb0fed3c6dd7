"""Which `while` loops and `lax.cond`s of generate.py's decode programs hold custom calls that an XLA command buffer
(CUDA graph) cannot record, the reason a loop runs from the host.

A multi-step decode program is a `while` loop; with `ling_jax.xla_flags` XLA records the whole loop, its
`lax.cond`s included, as one command buffer, but only when every thunk of the loop's body (and of the conds'
branches) can be a command. One that cannot leaves the `while` to the host: each iteration's predicate is copied
to the host and the body relaunched, 450-620 us between steps of Ling-3.0-flash's first 24 layers on an H100
(docs/benchmarks/generation.md). XLA forms command buffers from the compiled thunks, after the HLO, so the HLO text
(`compiled.as_text()`) does not show them; it does show the custom calls, and the ones outside COMMAND_CUSTOM_CALLS
(the Pallas kernels' Triton calls, cuBLAS and cuDNN) are what keeps a loop out: on 2026-12-05 the one-row sorts of
the sampling filters and the logprobs' top-k (`xla.gpu.ext.cub_sort_pairs`, XLA's CUB sort for a single row;
a sort of two rows or more stays an XLA kernel). This reports each `while` and `conditional` with those calls.

    python -m benchmarks.command_buffers --preset ling-3.0-flash --layers 2 --batch 1 --mtp 1

compiles the decode group (DECODE_READ_GROUP steps) for several sampling mixes, generally traced (every optional
step behind its cond) and specialised (`SamplingArrays.from_params(specialise=True)`), and the speculative group,
and prints a report for each (on any backend; the custom calls are the backend's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import sys

from ling_jax import xla_flags

if __name__ == "__main__":
    xla_flags.set_gpu_flags()

import jax.numpy as jnp  # noqa: E402

from benchmarks.common import filled_cache, first_layers, run_header  # noqa: E402
from benchmarks.trace import hlo_computations, opcode  # noqa: E402
from ling_jax.generation.end_tokens import end_bitmask  # noqa: E402
from ling_jax.generation.generator import (  # noqa: E402
    DECODE_READ_GROUP,
    DecodeState,
    Drafts,
    _decode_group,
    _speculative_group,
    cache_length,
)
from ling_jax.generation.random_init import random_model  # noqa: E402
from ling_jax.generation.sampling import SamplingArrays, SamplingParams  # noqa: E402
from ling_jax.generation.static_model import split_model  # noqa: E402
from ling_jax.presets import PRESETS, preset  # noqa: E402

# custom-call targets a command buffer records (XLA's Triton calls carry the Pallas GPU kernels)
COMMAND_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "__cublas$gemm", "__cublas$lt$matmul", "__cudnn$")
_CALLED = re.compile(r"(?:to_apply|body|condition|calls|branch_computations|true_computation|false_computation)=")
_COMPUTATION_REF = re.compile(r"%(?P<name>[\w.\-]+)")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """One `while` or `conditional` of a compiled program and the custom calls under it (its called computations,
    nested ones included) that no command buffer records: 'instruction: target'."""

    name: str
    opcode: str
    blocking: tuple[str, ...]


def _called(rest: str) -> list[str]:
    """The computations an instruction calls (its body, condition, branches, to_apply, fused computation)."""
    names = []
    for match in _CALLED.finditer(rest):
        tail = rest[match.end() :]
        listed = tail[1 : tail.index("}")] if tail.startswith("{") else tail.split(",", 1)[0].split(" ", 1)[0]
        names += [ref["name"] for ref in _COMPUTATION_REF.finditer(listed)]
    return names


def control_flow(hlo_text: str) -> list[ControlFlow]:
    """Every `while` and `conditional` of a compiled program's HLO text, in text order (module docstring)."""
    computations = hlo_computations(hlo_text)

    @functools.cache
    def blocking(computation: str) -> tuple[str, ...]:
        found = []
        for name, rest in computations.get(computation, ()):
            target = _CUSTOM_CALL_TARGET.search(rest)
            if target and not target["target"].startswith(COMMAND_CUSTOM_CALLS):
                found.append(f"{name}: {target['target']}")
            for called in _called(rest):
                found += blocking(called)
        return tuple(dict.fromkeys(found))

    flows = []
    for instructions in computations.values():
        for name, rest in instructions:
            kind = opcode(rest)
            if kind in ("while", "conditional"):
                inner = tuple(dict.fromkeys(b for c in _called(rest) for b in blocking(c)))
                flows.append(ControlFlow(name, kind, inner))
    return flows


def report(hlo_text: str) -> str:
    """One line per `while` / `conditional` (`control_flow`): 'recordable' or the custom calls that are not."""
    lines = []
    for flow in control_flow(hlo_text):
        verdict = "recordable" if not flow.blocking else "holds " + ", ".join(flow.blocking)
        lines.append(f"  {flow.opcode} {flow.name}: {verdict}")
    return "\n".join(lines) or "  no while or conditional"


def _programs(model, batch: int, num_drafts: int):
    """(label, lowered program) of the decode and speculative groups for several sampling mixes."""

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
