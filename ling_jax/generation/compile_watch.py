"""Seeing JAX compile: the seconds spent tracing, lowering and compiling, and hooks at each phase's start and
end, from `jax.monitoring` events (the same events jax's `jax_log_compiles` logs).

An XLA compile here includes a load from the persistent compilation cache (a hit is a short "compile").
Listeners see only the thread that registered them, so a generation in another thread is not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from jax import monitoring

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = frozenset({TRACE_EVENT, LOWER_EVENT, BACKEND_COMPILE_EVENT})
CACHE_LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"  # inside a backend compile: a cache read
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # ... that found the program (none after a miss)


class CompileClock:
    """Context manager: `seconds` is the time this thread spent tracing, lowering and compiling jitted
    programs while it was entered (it keeps counting across re-entries)."""

    def __init__(self):
        self.seconds = 0.0
        self._thread = threading.get_ident()

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS and threading.get_ident() == self._thread:
            self.seconds += duration

    def __enter__(self) -> CompileClock:
        self._thread = threading.get_ident()
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._on_duration)


class CompileHooks:
    """Context manager calling `on_start()` when one of `events` (default: an XLA compile, or a persistent-cache
    load) begins in this thread, and `on_end(seconds)` when it ends."""

    def __init__(
        self,
        on_start: Callable[[], None],
        on_end: Callable[[float], None],
        events: frozenset[str] = frozenset({BACKEND_COMPILE_EVENT}),
    ):
        self._on_start, self._on_end, self._events = on_start, on_end, events
        self._thread = threading.get_ident()

    def _scalar(self, event: str, _value: float, **_) -> None:  # jax records each phase's start time
        if event in self._events and threading.get_ident() == self._thread:
            self._on_start()

    def _duration(self, event: str, duration: float, **_) -> None:
        if event in self._events and threading.get_ident() == self._thread:
            self._on_end(duration)

    def __enter__(self) -> CompileHooks:
        self._thread = threading.get_ident()
        monitoring.register_scalar_listener(self._scalar)
        monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_scalar_listener(self._scalar)
        monitoring.unregister_event_duration_listener(self._duration)
