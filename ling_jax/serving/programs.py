"""Compiling the engine's programs before their first call: several at once, some after the server is ready.

A program is compiled from the shapes, dtypes and shardings of its arguments (`compile_program`:
`jit(f).trace(*specs).lower().compile()`), which fills the jitted function's own cache: the first call with
arguments like these runs it without tracing or compiling again. XLA compiles with the GIL released, so worker
threads overlap one program's tracing (Python) with others' compilations, and compilations with each other.

`ProgramCompiler` runs such compilations on daemon threads (a server stopped meanwhile does not wait for them) and
hands back a `Future` per program; `Engine.warm_up` waits for the programs every request needs and leaves the
others compiling in the background, running around them until they are done (`Engine.prefill`, `Engine.decode`).

With a `ProgramStore` (ling-serve's, beside the persistent compilation cache), each compiled program is also kept
as a serialised executable; a later start loads it (`StoredProgram`) instead of tracing and lowering the program
again to find it in the compilation cache, and the engine calls it directly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import platform
import queue
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax import monitoring
from jax.experimental import serialize_executable

import ling_jax
import pallas_kernels


def spec(x):
    """What a jitted program is keyed on for an argument: an array's shape, dtype and, for a jax.Array committed to
    its devices, sharding (an uncommitted array or a numpy one has none); anything else (a static argument) as
    is."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def compile_program(fn, args: tuple) -> jax.stages.Compiled:
    """Compile the jitted `fn` for arguments like `args` (arrays or their specs): its next call with such arguments
    runs at once."""
    return fn.trace(*jax.tree.map(spec, args)).lower().compile()


def usable(future: Future | None) -> bool:
    """Whether a program (its compilation's future; None: not compiled ahead) can run without a compile here: not
    compiled ahead (it compiles at its first call, as any jitted function), or compiled without error."""
    return future is None or (future.done() and future.exception() is None)


CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
COMPILER_THREAD = "ling-compile"  # the name of `ProgramCompiler`'s worker threads (and a number)
_cache_hits = threading.local()  # this thread's compilations read from jax's persistent cache


def _count_cache_hit(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:  # recorded on the thread that compiles
        _cache_hits.count = getattr(_cache_hits, "count", 0) + 1


@functools.cache
def _watch_cache_hits() -> None:
    monitoring.register_event_listener(_count_cache_hit)


@functools.cache
def source_digest() -> str:
    """sha256 over every Python source file of ling_jax and pallas_kernels (path and bytes): a stored program
    built from other code is never loaded."""
    digest = hashlib.sha256()
    for package in (ling_jax, pallas_kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class StoredProgram:
    """A compiled program loaded from a `ProgramStore`: called with the jitted function's arguments (its static
    ones dropped) where their pytree is the one it was compiled for (`accepts`)."""

    def __init__(self, compiled: jax.stages.Compiled, static_argnums: tuple[int, ...]):
        self.compiled = compiled
        self._static = frozenset(static_argnums)

    def _dynamic(self, args: tuple) -> tuple:
        return tuple(arg for index, arg in enumerate(args) if index not in self._static)

    def accepts(self, args: tuple) -> bool:
        """Whether `args` have the pytree the program was compiled for (e.g. not a VL chunk's embeddings)."""
        return jax.tree.structure((self._dynamic(args), {})) == self.compiled.in_tree

    def __call__(self, *args):
        return self.compiled(*self._dynamic(args))


class ProgramStore:
    """Compiled programs as serialised executables (`jax.experimental.serialize_executable`), a file each in
    `directory`, named by the sha256 of everything that makes a program differ: the jitted function's module and
    name, its arguments' pytree, shapes, dtypes and shardings, its static arguments' reprs, the jax and jaxlib
    versions, jax's configuration and $XLA_FLAGS, the backend (platform and version) and its devices, and the source
    of ling_jax and pallas_kernels. Written atomically (a temporary file renamed); a file that does not load is
    compiled again (one line on stderr says so)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path(self, fn, specs: tuple) -> Path | None:
        """The file of the jitted `fn`'s program for arguments `specs` (`spec`); None where a static argument's repr
        names its address (another in every process: such a program is not stored)."""
        leaves = list(map(repr, jax.tree.leaves(specs)))
        if any(" at 0x" in leaf for leaf in leaves):
            return None
        backend = jax.devices()[0].client
        parts = [
            fn.__module__,
            fn.__qualname__,
            str(jax.tree.structure(specs)),
            *leaves,
            jax.__version__,
            jaxlib.__version__,
            repr(sorted(jax.config.values.items())),  # e.g. jax_disable_most_optimizations: other XLA options
            os.environ.get("XLA_FLAGS", ""),
            backend.platform,
            backend.platform_version,
            repr([(device.id, device.device_kind) for device in jax.devices()]),
            platform.machine(),
            sys.version,
            source_digest(),
        ]
        return self.directory / (hashlib.sha256("\0".join(parts).encode()).hexdigest() + ".program")

    def load(self, fn, path: Path) -> StoredProgram | None:
        """The program stored at `path`, or None (not stored, or it does not load: one line on stderr)."""
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            payload, in_tree, out_tree, device_ids = pickle.loads(payload)
            devices = {device.id: device for device in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[devices[index] for index in device_ids]
            )
        except Exception as e:  # a damaged or incompatible file: compiled again
            print(f"ling-serve: stored program {path.name} did not load ({e!r}); compiling it", file=sys.stderr)
            return None
        return StoredProgram(compiled, fn._jit_info.static_argnums)

    def save(self, path: Path, compiled: jax.stages.Compiled) -> None:
        """Store `compiled` at `path` (a temporary file renamed into place: a reader never sees half a file)."""
        devices = compiled.runtime_executable().local_devices()  # the ones it runs on, not every device
        payload = pickle.dumps((*serialize_executable.serialize(compiled), [device.id for device in devices]))
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as file:
            file.write(payload)
        os.replace(file.name, path)


class ProgramCompiler:
    """Worker threads (daemons, `workers` of them: default one per CPU core) compiling jitted programs in the
    order they are submitted, until `close`; `on_done()` after each one, from its worker. With a `store`, a
    program stored there is loaded instead (a `StoredProgram`), and one compiled here is stored."""

    def __init__(
        self, on_done: Callable[[], None] = lambda: None, workers: int | None = None, store: ProgramStore | None = None
    ):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_done = on_done
        self._store = store
        self._workers = workers or os.cpu_count() or 1
        for index in range(self._workers):
            threading.Thread(target=self._work, name=f"{COMPILER_THREAD}-{index}", daemon=True).start()

    def submit(self, fn, args: tuple) -> Future:
        """Compile the jitted `fn` for `args` (`compile_program`); the Future gives the compiled program."""
        future: Future = Future()
        self._jobs.put((future, fn, jax.tree.map(spec, args)))
        return future

    def close(self) -> None:
        """No more programs: each worker ends once the ones submitted are taken."""
        for _ in range(self._workers):
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._program(fn, args))
            except Exception as e:  # handed to the waiter; a background program's failure leaves it routed around
                future.set_exception(e)
            self._on_done()

    def _program(self, fn, specs: tuple) -> jax.stages.Compiled | StoredProgram:
        if self._store is None:
            return compile_program(fn, specs)
        path = self._store.path(fn, specs)
        if path is None:
            return compile_program(fn, specs)
        if (stored := self._store.load(fn, path)) is not None:
            return stored
        _watch_cache_hits()
        hits = getattr(_cache_hits, "count", 0)
        compiled = compile_program(fn, specs)
        if getattr(_cache_hits, "count", 0) > hits:
            # read from jax's persistent cache: XLA:CPU serialises such an executable without its kernels (loaded
            # again, it fails with "Function ... not found"), so only a program compiled here is stored
            return compiled
        try:
            self._store.save(path, compiled)
        except Exception as e:  # not serialisable (or the disk is full): this program compiles on every start
            print(f"ling-serve: {fn.__qualname__} not stored ({e!r})", file=sys.stderr)
        return compiled
