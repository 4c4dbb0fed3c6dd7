"""Compile every Pallas Triton kernel of a full-size model's GPU programs for Hopper (sm_90) on a machine without a
GPU: the programs are traced on abstract weights (nothing allocated) with the GPU kernels, lowered for CUDA against
an abstract H200, and each distinct kernel in them (its Triton IR, warps and stages) goes through Triton's own
compiler to a cubin. That rejects what a Pallas lowering alone lets through (a layout Triton cannot build, a dot
too small for the tensor cores, more shared memory than an SM has), and tells each kernel's registers and spills.
It is Triton's pipeline, not the copy inside XLA that compiles the kernels on the GPU, so a kernel compiled here can
still fail there, only more rarely. Nothing runs: compiled means a GPU program, not a correct or fast one.

    python scripts/compile_gpu_kernels.py                    # Ling-3.0-flash's programs
    python scripts/compile_gpu_kernels.py --preset ling-3.1-flash --programs decode --batches 64

Triton comes with the test extra (`pip install -e ".[test]"`: triton==3.6.0, the device image's version; on its
own, `pip install triton==3.6.0`); jax does not use it. Programs: "decode" (one token a row, batch 1 and 8 or
--batches, over an 8192-slot cache), "verify" (a speculative round of one draft at batch 1, for a preset with an
MTP layer) and "prefill" (one 8192-token chunk into an 8192-slot cache); block-FP8 weights as the checkpoint stores
them. The Mosaic GPU kernels (absorbed-MLA decode on Hopper, W8A8 linear) compile inside XLA only and are listed as
not compiled here. Prints a table a kernel (the programs it is in, warps / stages, shared memory against the SM's
227 KiB, registers a thread, spilled bytes: local memory, a cost, not a failure; compile seconds) and exits 1 if
any kernel failed to compile or takes more shared memory than an SM has.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ling_jax import ExecutionPolicy, preset  # noqa: E402
from ling_jax.cache import LingCache  # noqa: E402
from ling_jax.generation.end_tokens import end_bitmask  # noqa: E402
from ling_jax.generation.generator import DecodeState, Drafts, speculative_round  # noqa: E402
from ling_jax.generation.memory_plan import abstract_model  # noqa: E402
from ling_jax.generation.sampling import SamplingArrays, SamplingParams  # noqa: E402
from ling_jax.generation.static_model import split_model  # noqa: E402
from pallas_kernels.compat import lower_for_cuda  # noqa: E402

SHARED_LIMIT = 232_448  # bytes of shared memory one block may take on an H100 / H200 (227 KiB)
CONTEXT = 8192
PROGRAMS = ("decode", "verify", "prefill")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One distinct Triton kernel of a lowered program: its name, Triton IR and launch options."""

    name: str
    ir: str
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return hashlib.sha1(f"{self.ir}{self.num_warps}{self.num_stages}".encode()).hexdigest()[:12]


def custom_calls(lowered: jax.stages.Lowered) -> tuple[list[Kernel], collections.Counter]:
    """(the Triton kernels of `lowered`, one entry a call; {call target: calls} of its other GPU kernels' calls)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    kernels, others = [], collections.Counter()

    def option(config, key: str) -> int:
        return int(str(config[key]).split(":")[0]) if key in config else 0

    def walk(operation) -> None:
        for region in operation.regions:
            for block in region:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        target = ir.StringAttr(inner.attributes["call_target_name"]).value
                        if "triton" not in target:
                            others[target] += 1
                        else:
                            config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                            with _new_ir_context():
                                text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
                            name = ir.StringAttr(config["name"]).value
                            kernels.append(
                                Kernel(name, text, option(config, "num_warps"), option(config, "num_stages"))
                            )
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return kernels, others


def traced_programs(config, programs: tuple[str, ...], batches: tuple[int, ...] = (1, 8)):
    """(label, traced program) of each asked program of `config`'s model with stored block-FP8 weights, abstract:
    the decode step at each of `batches`."""
    policy = ExecutionPolicy(kernel_backend="pallas_gpu")
    model = abstract_model(config, weights="stored", dtype=jnp.bfloat16, policy=policy)
    graphdef, state = nnx.split(model)

    def forward(state, ids_BT, cache):
        out = nnx.merge(graphdef, state)(ids_BT, cache=cache)
        return out.logits, out.cache

    def cache(batch: int):
        return jax.eval_shape(lambda: model.init_cache(batch, CONTEXT))

    if "decode" in programs:
        for batch in batches:
            ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
            yield f"decode b{batch}", jax.jit(forward).trace(state, ids, cache(batch))
    if "prefill" in programs:
        ids = jax.ShapeDtypeStruct((1, CONTEXT), jnp.int32)
        yield f"prefill {CONTEXT}", jax.jit(forward).trace(state, ids, cache(1))
    if "verify" in programs and config.num_nextn_predict_layers:
        yield "verify b1 (mtp 1)", speculative_round_traced(model, config, batch=1, drafts=1)


def speculative_round_traced(model, config, *, batch: int, drafts: int) -> jax.stages.Traced:
    """One greedy speculative round of `drafts` drafts (generate.py's), traced on the abstract model."""
    static, leaves = split_model(model)

    def state():
        return DecodeState.create(
            LingCache.create(config, batch, CONTEXT, jnp.bfloat16),
            jnp.zeros((batch, config.vocab_size), bool),
            Drafts.create(config, batch, CONTEXT, jnp.bfloat16),
        )

    def inputs():
        arrays = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * batch)
        capacity_B = jnp.full((batch,), CONTEXT - drafts - 1, jnp.int32)
        return arrays, jnp.ones((batch,), bool), capacity_B, jnp.asarray(end_bitmask([()] * batch, config.vocab_size))

    def round_(leaves, state, inputs):
        return speculative_round(static.merge(leaves), drafts, state, *inputs)

    return jax.jit(round_).trace(leaves, jax.eval_shape(state), jax.eval_shape(inputs))


def resource_usage(cubin: bytes, cuobjdump: Path) -> tuple[int | None, int | None]:
    """(registers a thread, spilled bytes a thread: local memory) of the kernel in `cubin`, from `cuobjdump`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", file.name], capture_output=True, text=True, check=False
        ).stdout
    registers, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (int(registers[1]) if registers else None), (int(local[1]) if local else None)


def compile_for_hopper(kernel: Kernel, workdir: Path) -> dict:
    """Triton's compile of `kernel` for sm_90: {"shared", "registers", "spilled", "seconds"} or {"error"}."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = workdir / f"{kernel.name}_{kernel.key}.ttir"
    source.write_text(kernel.ir)
    options = {"num_warps": kernel.num_warps or 4, "num_stages": kernel.num_stages or 1}
    start = time.perf_counter()
    try:
        compiled = triton.compile(str(source), target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as error:  # noqa: BLE001 (every failure is a table row)
        lines = [line for line in str(error).splitlines() if line.strip()]
        return {"error": f"{type(error).__name__}: {(lines or [''])[0][:200]}"}
    seconds = time.perf_counter() - start
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    registers, spilled = resource_usage(compiled.asm["cubin"], cuobjdump)
    return {"shared": compiled.metadata.shared, "registers": registers, "spilled": spilled, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ling-3.0-flash", help="the model (default ling-3.0-flash)")
    parser.add_argument(
        "--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)} (default: all)"
    )
    parser.add_argument("--batches", default="1,8", help="the decode step's batch sizes, comma-separated (default 1,8)")
    args = parser.parse_args(argv)
    programs = tuple(args.programs.split(","))
    batches = tuple(int(batch) for batch in args.batches.split(","))
    if unknown := set(programs) - set(PROGRAMS):
        parser.error(f"--programs: unknown {', '.join(sorted(unknown))}; known: {', '.join(PROGRAMS)}")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit(
            "compile_gpu_kernels.py: Triton is not importable: pip install -e '.[test]' (or pip install triton==3.6.0)"
        )
    config = preset(args.preset)
    kernels, found_in, calls, others = {}, collections.defaultdict(list), collections.Counter(), collections.Counter()
    for label, traced in traced_programs(config, programs, batches):
        start = time.perf_counter()
        found, not_triton = custom_calls(lower_for_cuda(traced))
        others.update(not_triton)
        for kernel in found:
            kernels.setdefault(kernel.key, kernel)
            calls[kernel.key] += 1
            if label not in found_in[kernel.key]:
                found_in[kernel.key].append(label)
        distinct = len({kernel.key for kernel in found})
        print(
            f"{label}: {len(found)} Triton calls, {distinct} distinct, lowered in {time.perf_counter() - start:.1f} s"
        )
    failed = 0
    print(
        f"\n{args.preset}: {len(kernels)} distinct Triton kernels, compiled for sm_90 by Triton {triton.__version__}\n"
        "\n| kernel | programs (call sites) | warps / stages | shared KiB | registers | spilled B | compile |\n"
        "|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as workdir:
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "cache"))
        for key, kernel in sorted(kernels.items(), key=lambda item: item[1].name):
            result = compile_for_hopper(kernel, Path(workdir))
            where = f"{', '.join(found_in[key])} ({calls[key]})"
            launch = f"{kernel.num_warps} / {kernel.num_stages}"
            if "error" in result:
                failed += 1
                print(f"| {kernel.name} | {where} | {launch} | FAILED {result['error']} | | | |")
                continue
            over = result["shared"] > SHARED_LIMIT
            failed += over
            print(
                f"| {kernel.name} | {where} | {launch} | {result['shared'] / 1024:.1f}{' OVER' * over} | "
                f"{result['registers']} | {result['spilled']} | {result['seconds']:.1f} s |"
            )
    if others:
        print("\nNot compiled here (XLA compiles them on the GPU):", ", ".join(f"{t} ({n})" for t, n in others.items()))
    print(f"\n{len(kernels) - failed} of {len(kernels)} compiled within the limits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
