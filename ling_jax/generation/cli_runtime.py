"""What a command-line run needs around the model: stdout that knows whether its line is finished, Ctrl-C that
exits at once and cleanly, the persistent compilation cache, and a notice while XLA compiles.

Ctrl-C: the SIGINT handler only wakes a watcher thread (`signal.set_wakeup_fd`); the thread finishes stdout's
current line, prints one line on stderr and ends the process with `os._exit(130)`. No KeyboardInterrupt unwinds
through the program, so an interrupt during an XLA compilation (which runs with the GIL released, in threads
of its own) neither prints a traceback nor crashes the interpreter's shutdown (a segfault, exit 139, before).
A SIGINT that the parent process ignores (`nohup`, a background job of a script) stays ignored.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import jax
from jax import monitoring

from ling_jax.generation.compile_watch import CACHE_HIT_EVENT, CACHE_LOOKUP_EVENT, CompileHooks

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
NO_CACHE_ENV = "LING_JAX_NO_COMPILE_CACHE"
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"  # jax's: programs compiled faster are not kept
NOTICE_AFTER_S = 1.0  # a compilation this long gets the notice: jax caches those of >= 1 s (its default)
CACHE_READ_ALLOWANCE_S = 4.0  # more, while the persistent cache is being read (a hit is no compilation)

_output_lock = threading.Lock()
_line_open = False  # stdout's last character was not a newline


def write_stdout(text: str) -> None:
    """Write and flush `text` on stdout, remembering whether its last line is unfinished."""
    global _line_open
    if not text:
        return
    with _output_lock:
        sys.stdout.write(text)
        sys.stdout.flush()
        _line_open = not text.endswith("\n")


def handle_interrupts(message: str) -> bool:
    """From now on SIGINT ends the process cleanly: stdout's line finished, `message` on stderr, status 130.
    False (and nothing changed) when SIGINT is ignored or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGINT, lambda *_: None)  # a Python handler, so the C handler writes to the wakeup fd
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd, message), name="sigint-watcher", daemon=True).start()
    return True


def _watch(read_fd: int, message: str) -> None:
    while os.read(read_fd, 1) != bytes([signal.SIGINT]):
        pass
    _output_lock.acquire(timeout=1.0)  # let a write in progress finish, never wait long
    try:
        if _line_open:
            sys.stdout.write("\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed or broken stdout: nothing more to finish
        pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_INTERRUPTED)


def silence_stray_errors() -> None:
    """Before exiting on a load error: reads still in flight when it happened (Orbax's, of a damaged checkpoint)
    report their own errors as they end, after the event loop that awaited them has closed (`RuntimeError: Event
    loop is closed` tracebacks); the one `error:` line is what matters, so they are dropped."""
    sys.unraisablehook = lambda _: None


def compile_cache_dir() -> Path:
    """$XDG_CACHE_HOME/ling-jax/jax_cache, else ~/.cache/ling-jax/jax_cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ling-jax" / "jax_cache"


def cache_disabled_by_env() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip() not in ("", "0")


def enable_compile_cache(disabled: bool) -> Path | None:
    """Turn JAX's persistent compilation cache on in `compile_cache_dir()` (call before anything compiles), for
    every program however quickly it compiles (jax's default keeps only those of >= 1 s: a warm start would
    compile the others again; $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, if set, wins). A directory the user
    configured (JAX_COMPILATION_CACHE_DIR) wins. None when disabled (the flag or $LING_JAX_NO_COMPILE_CACHE) or
    when the directory cannot be made."""
    if disabled or cache_disabled_by_env():
        return None
    if MIN_COMPILE_TIME_ENV not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    directory = compile_cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    return directory


class CompileNotice:
    """Context manager: the first time an XLA compilation runs for NOTICE_AFTER_S, print one line on stderr
    saying so; later ones stay quiet. A program read from the persistent cache is no compilation: while its
    cache lookup has not hit, the notice waits CACHE_READ_ALLOWANCE_S longer (a large program's read takes a
    while), so a warm run stays quiet. The line never lands inside a streamed line of stdout."""

    def __init__(self, cached: bool):
        self.line = (
            "compiling (first run; cached afterwards)"
            if cached
            else "compiling (the compilation cache is off: every run compiles)"
        )
        self.shown = False
        self.quiet = False  # e.g. on a process other than the first of a multi-host run
        self._timer: threading.Timer | None = None
        self._looking_up = False  # this compilation asked the persistent cache, which has not answered with a hit
        self._thread = threading.get_ident()
        self._hooks = CompileHooks(self._started, self._ended)

    def _started(self) -> None:
        if not (self.shown or self.quiet) and self._timer is None:
            self._looking_up = False
            self._arm(NOTICE_AFTER_S)

    def _arm(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._due)
        self._timer.daemon = True
        self._timer.start()

    def _ended(self, _seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cache_event(self, event: str, **_) -> None:
        if threading.get_ident() != self._thread:
            return
        if event == CACHE_LOOKUP_EVENT:
            self._looking_up = True
        elif event == CACHE_HIT_EVENT:
            self._ended(0.0)

    def _due(self) -> None:
        if self._looking_up:  # a read from the cache, or a compilation after a miss: give the read its time
            self._looking_up = False
            self._arm(CACHE_READ_ALLOWANCE_S)
        else:
            self._show()

    def _show(self) -> None:
        if self.shown:
            return
        self.shown = True
        with _output_lock:
            print(("\n" if _line_open else "") + self.line, file=sys.stderr, flush=True)

    def __enter__(self) -> CompileNotice:
        self._thread = threading.get_ident()
        monitoring.register_event_listener(self._cache_event)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ended(0.0)
        self._hooks.__exit__(*exc)
        monitoring.unregister_event_listener(self._cache_event)
