"""The command-line flags the commands share, each defined once: `ling-generate` and `ling-serve` add the model and
execution groups, the scripts the --mesh flag; and the parsing of the flags that need it (the mesh, the dtype).

A refusal is a ValueError naming the flag; the commands print it as one `error: ...` line, exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp

from ling_jax.checkpoints.hf import STORED, WEIGHTS
from ling_jax.checkpoints.orbax import LAYOUT_FILE
from ling_jax.generation import cli_runtime
from ling_jax.generation.cli_checks import MAX_MTP
from ling_jax.generation.generator import LEAST_DEFAULT_CHUNK, MIN_CHUNK, PREFILL_TOKENS, default_prefill_chunk
from ling_jax.policy import FP8Matmul, KernelBackend
from ling_jax.presets import PRESETS
from ling_jax.sharding import ShardingError, make_mesh, parse_mesh

DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "ling-demo"
DTYPES = ("bfloat16", "float32")


class CommandParser(argparse.ArgumentParser):
    """The commands' parser: a usage error is one line naming the flag, exit status 2, like every other refusal
    (argparse prints its whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def check_at_least(bounds: Iterable[tuple[str, float, float]]) -> None:
    """Refuse the first (flag, value, least allowed) whose value is below its bound (NaN too), naming the flag."""
    for flag, value, least in bounds:
        if not value >= least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_model_flags(parser: argparse.ArgumentParser, *, default: Path | None, presets: bool = False):
    """The "model" group: --model (with `presets`, or --preset instead), --dtype, --weights. default: --model's
    (None: the command picks the demo checkpoint itself). -> the group, for a command's own model flags."""
    group = parser.add_argument_group("model")
    source = group.add_mutually_exclusive_group() if presets else group
    source.add_argument(
        "--model",
        metavar="PATH",
        type=Path,
        default=default,
        help="HF-format checkpoint directory (config.json + *.safetensors) or ling-convert Orbax "
        f"directory ({LAYOUT_FILE}); default: the demo checkpoint in ling_jax/assets/ling-demo",
    )
    if presets:
        source.add_argument(
            "--preset",
            metavar="NAME",
            choices=sorted(PRESETS),
            help=f"a RANDOMLY initialised model of this preset ({', '.join(sorted(PRESETS))}) instead "
            "of a checkpoint: its output is noise; text is tokenised as bytes",
        )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        help="parameter and activation dtype (default: float32 on CPU, bfloat16 on GPU / TPU)",
    )
    group.add_argument(
        "--weights",
        choices=WEIGHTS,
        default=STORED,
        help="stored (default): FP8 / MXFP4 weights stay quantised on the device; bf16: dequantise them at load",
    )
    return group


def add_mesh_flag(group, *, default: str | None = None, default_means: str = "one device") -> None:
    """--mesh AXES; default_means: what the command does without it, for the help."""
    group.add_argument(
        "--mesh",
        metavar="AXES",
        default=default,
        help="device mesh, e.g. 'tensor=2,expert=4' (axes: data, fsdp, tensor, expert); the sizes multiply to the "
        f"devices it spans (default: {default_means})",
    )


def add_execution_flags(
    parser: argparse.ArgumentParser, *, prefill_chunk: int | None, kernel_backend: bool, mesh_shorthands: bool
):
    """The "execution" group: --prefill-chunk (its default `prefill_chunk`; None: by the prompts,
    `generator.default_prefill_chunk`, for the command to fill in), --kernel-backend (where the command
    picks kernels), --fp8-matmul, --mtp, --mesh (with `mesh_shorthands`, --tp and --ep too), --no-memory-check,
    --no-compile-cache.
    -> the group, for a command's own execution flags."""
    group = parser.add_argument_group("execution")
    group.add_argument(
        "--prefill-chunk",
        type=int,
        default=prefill_chunk,
        metavar="N",
        help=f"prefill long prompts N tokens at a time, N >= {MIN_CHUNK} (default "
        + (
            f"{prefill_chunk})"
            if prefill_chunk is not None
            else f"{PREFILL_TOKENS} tokens a call over the prompts, at least {LEAST_DEFAULT_CHUNK} a prompt: "
            f"{default_prefill_chunk(1)} for one prompt, {default_prefill_chunk(2)} for two, "
            f"{default_prefill_chunk(3)} from three)"
        ),
    )
    if kernel_backend:
        group.add_argument(
            "--kernel-backend",
            choices=[backend.value for backend in KernelBackend],
            default=KernelBackend.AUTO.value,
            help="kernel implementation (default auto: the Pallas kernels on a GPU / TPU, jnp on a CPU)",
        )
    group.add_argument(
        "--fp8-matmul",
        choices=[mode.value for mode in FP8Matmul],
        default=FP8Matmul.AUTO.value,
        help="how block-FP8 weights kept as stored multiply (default auto: the checkpoint's activation scheme by "
        "size: on a GPU, prefill-sized products (256+ rows) in W8A8 (activations quantised per token in 1 x 128 "
        "groups, FP8 x FP8: 1.25x the weight_only prefill on an H200, logits ~3%% from the dequantised model) and "
        "decode-sized ones weight-only; weight_only: the dequantised weights' numerics at every size, batch-invariant "
        "(a request's output never depends on what shares its batch); w8a8: FP8 x FP8 at every size)",
    )
    group.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: the model's MTP layer drafts K tokens per step, verified in "
        "one forward (same output as without; needs an MTP layer; at most "
        f"{MAX_MTP}; default 0 = off)",
    )
    add_mesh_flag(group)
    if mesh_shorthands:
        group.add_argument("--tp", type=int, metavar="N", help="tensor parallelism: shorthand for --mesh tensor=N")
        group.add_argument("--ep", type=int, metavar="N", help="expert parallelism: shorthand for --mesh expert=N")
    group.add_argument(
        "--no-memory-check",
        action="store_true",
        help="skip the check that the parameters and the cache fit the device's memory on the mesh, done "
        "before loading (it refuses with the figures and a --weights or --mesh that would fit)",
    )
    add_compile_cache_flag(group)
    return group


def add_compile_cache_flag(group) -> None:
    """--no-compile-cache (every command that compiles: `cli_runtime.enable_compile_cache` reads it)."""
    group.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not keep compiled programs in the persistent cache (default: on, in "
        f"{cli_runtime.compile_cache_dir()}; also off with {cli_runtime.NO_CACHE_ENV}=1)",
    )


def parse_mesh_flag(text: str) -> dict[str, int]:
    """--mesh AXES as a mesh shape, or a ValueError naming the flag and its value (an axis given twice too)."""
    names = [item.partition("=")[0].strip() for item in text.split(",") if item.strip()]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--mesh {text!r}: each axis at most once, got {', '.join(repeated)} more than once")
    try:
        return parse_mesh(text)
    except ShardingError as e:  # its syntax error names the flag already; the others do not
        raise ValueError(str(e) if str(e).startswith("--mesh ") else f"--mesh {text!r}: {e}") from e


def check_kernel_backend(backend: str) -> None:
    """Refuse --kernel-backend pallas_gpu / pallas_tpu off their platform: it would fail at the first compilation,
    once the weights are loaded."""
    platform = {KernelBackend.PALLAS_GPU: "gpu", KernelBackend.PALLAS_TPU: "tpu"}.get(backend)
    if platform is not None and jax.default_backend() != platform:
        raise ValueError(
            f"--kernel-backend {backend} compiles {platform.upper()} kernels, and JAX runs on {jax.default_backend()} "
            f"here: use auto, reference or interpret_{platform} (the same kernels interpreted, slowly)"
        )


def mesh_flags(args: argparse.Namespace) -> str:
    """The mesh flags given, as typed (for messages)."""
    given = [
        f"--mesh {args.mesh!r}" if args.mesh is not None else "",
        f"--tp {args.tp}" if getattr(args, "tp", None) else "",
        f"--ep {args.ep}" if getattr(args, "ep", None) else "",
    ]
    return " ".join(filter(None, given))


def build_mesh(args: argparse.Namespace) -> jax.sharding.Mesh | None:
    """The mesh --mesh (and --tp / --ep where the command has them) ask for, or None (one device) without them."""
    shorthands = (("--tp", "tensor", getattr(args, "tp", None)), ("--ep", "expert", getattr(args, "ep", None)))
    if args.mesh is None and all(size is None for _, _, size in shorthands):
        return None
    shape = parse_mesh_flag(args.mesh) if args.mesh is not None else {}
    for flag, axis, size in shorthands:
        if size is None:
            continue
        if size < 1:
            raise ValueError(f"{flag} must be >= 1, got {size}")
        if shape.get(axis, size) != size:
            raise ValueError(f"{flag} {size} contradicts --mesh {axis}={shape[axis]}")
        shape[axis] = size
    try:
        return make_mesh(shape)
    except ShardingError as e:
        raise ValueError(f"{mesh_flags(args)}: {e}") from e


def dtype_of(args: argparse.Namespace) -> jnp.dtype:
    """--dtype, or its default: float32 on a CPU, bfloat16 on a GPU / TPU."""
    return jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
