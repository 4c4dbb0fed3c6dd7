"""Compiling the engine's programs before their first call: several at once, some after the server is ready.

A program is compiled from the shapes, dtypes and shardings of its arguments (`compile_program`:
`jit(f).trace(*specs).lower().compile()`), which fills the jitted function's own cache: the first call with
arguments like these runs it without tracing or compiling again. XLA compiles with the GIL released, so worker
threads overlap one program's tracing (Python) with others' compilations, and compilations with each other.

`ProgramCompiler` runs such compilations on daemon threads (a server stopped meanwhile does not wait for them) and
hands back a `Future` per program; `Engine.warm_up` waits for the programs every request needs and leaves the
others compiling in the background, running around them until they are done (`Engine.prefill`, `Engine.decode`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np


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


class ProgramCompiler:
    """Worker threads (daemons, `workers` of them: default one per CPU core) compiling jitted programs in the
    order they are submitted, until `close`; `on_done()` after each one, from its worker."""

    def __init__(self, on_done: Callable[[], None] = lambda: None, workers: int | None = None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_done = on_done
        self._workers = workers or os.cpu_count() or 1
        for index in range(self._workers):
            threading.Thread(target=self._work, name=f"ling-compile-{index}", daemon=True).start()

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
                future.set_result(compile_program(fn, args))
            except Exception as e:  # handed to the waiter; a background program's failure leaves it routed around
                future.set_exception(e)
            self._on_done()
