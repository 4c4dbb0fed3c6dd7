"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re

import numpy as np

from pallas_kernels.compat import (
    fast_cpu_compile_flags,
    lower_for_cuda,  # noqa: F401  (re-exported: the tests import it from here)
)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository's root directory
# XLA:CPU's faster-compiling emitters for the tests' subprocesses (pallas_kernels/compat.py, docs/testing.md)
SUBPROCESS_XLA_FLAGS = " ".join(fast_cpu_compile_flags())
# A CLI subprocess's XLA_FLAGS: one device, as a user's CPU run has
ONE_DEVICE_XLA_FLAGS = SUBPROCESS_XLA_FLAGS
# the same emitters for one jitted function in process (`jax.jit(..., compiler_options=FAST_COMPILE_OPTIONS)`)
FAST_COMPILE_OPTIONS = {
    name: {"false": False, "true": True}.get(value, value)
    for name, value in (flag.removeprefix("--").split("=") for flag in fast_cpu_compile_flags())
}


def run_wide_directory(tmp_path_factory, name: str) -> pathlib.Path:
    """A directory shared by every pytest-xdist worker of the run (their base temp directories' parent; the base
    temp directory itself without xdist): what one worker writes there, another reads."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / name
    directory.mkdir(exist_ok=True)
    return directory


def rel_error(ours, ref) -> float:
    """||ours - ref|| / ||ref|| in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def l2(x):
    """FLA's l2 normalisation (eps inside the sqrt), in numpy."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def train_byte_bpe(path, sentences, vocab_size: int, special_tokens) -> None:
    """Train a small byte-level BPE on `sentences` and save it as a real tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(sentences, trainer)
    backend.save(str(path))


def _triton_calls(lowered):
    """(operand element counts, Triton IR text) of each Triton kernel call in a module lowered for CUDA."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call" and "triton" in str(
                        inner.attributes["call_target_name"]
                    ):
                        sizes = [int(np.prod(ir.RankedTensorType(v.type).shape)) for v in inner.operands]
                        config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        with _new_ir_context():
                            text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
                        calls.append((sizes, text))
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return calls


def int32_offsets_into_large_operands(lowered) -> list[str]:
    """The pointer arithmetic (`tt.addptr` lines) that indexes a kernel operand of more than 2^31 elements with
    int32 offsets, in every Triton kernel of `lowered`: each a wrong address past 2^31 elements."""
    bad = []
    for sizes, text in _triton_calls(lowered):
        large = {f"%arg{i}" for i, size in enumerate(sizes) if size > 2**31}
        derived = {m[1] for m in re.finditer(r"(%\w+) = tt\.splat (%\w+)", text) if m[2] in large} | large
        for line in text.splitlines():
            match = re.search(r"tt\.addptr (%\w+), %\w+ : .*, (tensor<[^>]*xi32>|i32)$", line.strip())
            if match and match[1] in derived:
                bad.append(line.strip())
    return bad


@contextlib.contextmanager
def fp8_values_paired():
    """The MoE kernels take every block-FP8 value stack as uint16 pairs, as one of more than 2^31 elements goes
    where `compat.widen_triton_offsets` cannot apply; jax's caches are cleared on entry and exit, so no trace
    made with the other form is reused."""
    import jax

    from pallas_kernels.moe.gpu_triton import weight_tiles

    jax.clear_caches()
    weight_tiles.FORCE_PAIRS = True
    try:
        yield
    finally:
        weight_tiles.FORCE_PAIRS = False
        jax.clear_caches()


def gpu_test(what: str):
    """Decorator for a test that needs a GPU: marked `gpu` and, elsewhere, skipped with the reason."""
    import jax
    import pytest

    skip = pytest.mark.skipif(
        jax.default_backend() != "gpu", reason=f"{what} needs a GPU; it runs on the device machine (pytest -m gpu)"
    )
    return lambda test: pytest.mark.gpu(skip(test))


@contextlib.contextmanager
def serve_in_thread(app, timeout_s: float = 30.0):
    """Run the ASGI `app` on uvicorn (a thread, a free port of 127.0.0.1); yields its base URL, then stops it."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
