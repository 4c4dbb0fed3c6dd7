"""`ling-serve` (and `python -m ling_jax.serving`): load a model, compile its programs, serve the OpenAI API.

Every flag is checked, the checkpoint's config and tokenizer read, and the port bound, before the weights load; a
mistake is one `error: ...` line on stderr and exit status 2. The server listens from the start: while the model
loads and compiles, /health answers 503 {"status": "loading"} and every other route 503 in OpenAI's error schema.
Each phase prints a line on stderr (loading, each warm-up program compiled), and "ling-serve: ready" comes once the
model is compiled and the socket accepts. --preset NAME serves random weights of a preset in the stored format,
initialised on the devices (benchmarks only: its output is noise). SIGTERM (or Ctrl-C) stops it gracefully: it
takes no new connections, the requests in flight finish, and the process exits with status 0 (while loading: at
once, status 0). --distributed: every process of a `jax.distributed` job runs the same command; process 0 serves
HTTP and every other process makes process 0's engine calls (`replicated`, docs/multihost.md).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import jax
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ling_jax import distributed, xla_flags
from ling_jax.generation import cli_checks, cli_runtime, flags
from ling_jax.generation.cli import load_model
from ling_jax.generation.cli_checks import ModelSource
from ling_jax.generation.flags import DEMO_DIR
from ling_jax.generation.generator import MIN_CHUNK
from ling_jax.policy import ExecutionPolicy
from ling_jax.serving.api import Service, create_app
from ling_jax.serving.engine import DECODE_STEPS, PAGE_SIZE, Engine, prefix_block_bytes
from ling_jax.serving.media import LOCAL_MEDIA_FLAG, MediaReader
from ling_jax.serving.metrics import Metrics
from ling_jax.serving.ops import DEFAULT_MAX_REQUEST_BYTES
from ling_jax.serving.prefix_cache import PrefixCache
from ling_jax.serving.programs import ProgramStore
from ling_jax.serving.replicated import (
    FollowerEngine,
    LeaderEngine,
    ProcessGone,
    Publisher,
    Subscriber,
    Watch,
    follow,
    report_compiles,
)
from ling_jax.serving.scheduler import Scheduler
from ling_jax.serving.schemas import APIError
from ling_jax.sharding import ShardingError

EXIT_USAGE = 2
EXIT_FAILURE = 1
MAX_PORT = 65535
BACKLOG = 2048  # uvicorn's default
HEARTBEAT_MARGIN_S = 30  # --distributed: jax's heartbeat timeout past ours (`Watch`), so our error line comes first
GONE_GRACE_S = 2.0  # --distributed: how long /health answers 503 once a process is gone, before the front end exits
READY_POLL_S = 0.01
PROGRAM_STORE = "ling-serve-programs"  # `program_store`'s folder inside the compilation cache's
API_KEY_ENV = "LING_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(
        prog="ling-serve",
        description="An OpenAI-compatible HTTP server (continuous batching) for a Ling checkpoint.",
        epilog="examples:\n  ling-serve --port 8000\n  curl http://127.0.0.1:8000/v1/models\n"
        "  ling-serve --preset ling-3.0-flash --max-batch 32   # random weights, for benchmarks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = flags.add_model_flags(parser, default=DEMO_DIR, presets=True)
    model.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients ask for (default: --model's directory name, or the --preset's name)",
    )
    flags.add_execution_flags(parser, prefill_chunk=512, kernel_backend=False, mesh_shorthands=False)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed on the `listening` line)"
    )
    parser.add_argument(
        "--max-batch", type=int, default=16, metavar="N", help="slots: requests decoded together (default 16)"
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=2048,
        metavar="N",
        help="prompt + completion tokens per request (default 2048)",
    )
    parser.add_argument(
        "--prefill-budget",
        type=int,
        metavar="N",
        help="prompt tokens per prefill step (default: --prefill-chunk): up to N / C requests' chunks of C "
        "tokens are prefilled together",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=DECODE_STEPS,
        metavar="N",
        help=f"decode steps (with --mtp, speculative rounds) per program while no request waits for admission or "
        f"prefill (default {DECODE_STEPS}): fewer host round trips, up to N - 1 steps' delay before a new request "
        "is admitted",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=PAGE_SIZE,
        metavar="N",
        help=f"MLA cache slots per page (default {PAGE_SIZE}); with the prefix cache it must divide --prefill-chunk",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests waiting for a slot before new ones get 503 (default 256)",
    )
    parser.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="prefix cache size in GiB (default 0: off): a request resumes from the cached KDA states and shares "
        "the MLA pages of its longest cached prompt prefix (in prefill chunks)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on every route but /health (default: ${API_KEY_ENV} if set, "
        "else none; the variable keeps the key out of the process list)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES}: 16 MiB)",
    )
    parser.add_argument(
        LOCAL_MEDIA_FLAG,
        type=Path,
        metavar="DIR",
        help="a VL checkpoint's chat requests may name image files under DIR (file:// URLs or paths; default: "
        "none, only data: URLs; nothing is ever fetched from the network)",
    )
    distributed.add_arguments(
        parser,
        "multi-process (TPU pod, several GPU hosts): every process runs the same command; process 0 serves HTTP "
        "and schedules, every other process runs the same programs on its shards (docs/multihost.md). "
        "--distributed-timeout also bounds how long a silent process is waited for while serving",
    )
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    flags.check_at_least(
        (
            ("--max-batch", args.max_batch, 1),
            ("--max-context", args.max_context, 2),
            ("--prefill-chunk", args.prefill_chunk, MIN_CHUNK),
            ("--page-size", args.page_size, 1),
            ("--max-queue", args.max_queue, 0),
            ("--mtp", args.mtp, 0),
            ("--decode-steps", args.decode_steps, 1),
            ("--max-request-bytes", args.max_request_bytes, 1),
            ("--prefix-cache-gb", args.prefix_cache_gb, 0),
        )
    )
    if args.prefill_budget is not None and args.prefill_budget < args.prefill_chunk:
        raise ValueError(
            f"--prefill-budget must be >= --prefill-chunk ({args.prefill_chunk}), got {args.prefill_budget}"
        )
    cli_checks.check_mtp(args.mtp)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if args.prefix_cache_gb == math.inf:
        raise ValueError(f"--prefix-cache-gb must be >= 0 and finite (0 = off), got {args.prefix_cache_gb}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty (it is the model id clients ask for)")
    if args.prefix_cache_gb and args.prefill_chunk % args.page_size:
        raise ValueError(
            f"--page-size {args.page_size} must divide --prefill-chunk {args.prefill_chunk} with the prefix cache"
        )


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $LING_API_KEY, else None (no key needed)."""
    return (args.api_key or os.environ.get(API_KEY_ENV, "")).strip() or None


def check(args: argparse.Namespace) -> tuple[ModelSource, jax.sharding.Mesh | None, MediaReader | None]:
    """Every flag, the checkpoint's config and tokenizer (or the preset's), the mesh, a VL model's image reader:
    nothing is loaded."""
    _check_flags(args)
    mesh = flags.build_mesh(args)
    if args.distributed and (mesh is None or mesh.devices.size != jax.device_count()):
        raise ValueError(
            f"--distributed: --mesh must span the {jax.device_count()} devices of every process "
            f"(got {flags.mesh_flags(args) or 'none: one device'})"
        )
    if args.preset is not None:
        source = cli_checks.preset_source(args.preset)
    else:
        source = cli_checks.checkpoint_source(args.model, "--model", byte_tokenizer=None)
    config = source.text_config
    local_dir = args.allowed_local_media_path
    if source.vl_config is None and local_dir is not None:
        raise ValueError(f"{LOCAL_MEDIA_FLAG}: --model {args.model} is a text model (it takes no images)")
    if source.vl_config is not None and args.distributed:
        raise ValueError(f"--distributed: --model {args.model} is a VL checkpoint, served by one process only")
    if source.vl_config is not None and args.mtp:
        raise ValueError(f"--mtp: --model {args.model} is a VL checkpoint, whose MTP layer is not wired up")
    media = None if source.vl_config is None else MediaReader.for_checkpoint(args.model, source.vl_config, local_dir)
    if args.max_context > config.max_position_embeddings:
        raise ValueError(
            f"--max-context {args.max_context} exceeds the model's context of {config.max_position_embeddings} tokens"
        )
    if args.mtp and not config.num_nextn_predict_layers:
        raise ValueError(
            f"--mtp {args.mtp} needs a model with an MTP layer; {source.name} has none (num_nextn_predict_layers = 0)"
        )
    if not args.no_memory_check:  # every slot's cache at --max-context: the prefix cache is not counted
        cli_checks.check_memory(
            source,
            {} if mesh is None else dict(mesh.shape),
            args.weights,
            flags.dtype_of(args),
            batch=args.max_batch,
            context=args.max_context,
            mtp=bool(args.mtp),
            devices=jax.device_count(),
        )
    block_bytes = prefix_block_bytes(config, args.prefill_chunk, flags.dtype_of(args), args.mtp)
    if 0 < _prefix_cache_bytes(args) < block_bytes:
        raise ValueError(
            f"--prefix-cache-gb {args.prefix_cache_gb} cannot hold one prefix block: a block of --prefill-chunk "
            f"{args.prefill_chunk} tokens takes {block_bytes / 2**20:,.1f} MiB for this model (its KDA states, MLA "
            f"pages{' and MTP entries' if args.mtp else ''}); give at least {block_bytes / 2**30:.3f}"
        )
    return source, mesh, media


def _prefix_cache_bytes(args: argparse.Namespace) -> int:
    return int(args.prefix_cache_gb * 2**30)


def load_engine(
    args: argparse.Namespace, source: ModelSource, mesh: jax.sharding.Mesh | None, engine_class=Engine
) -> Engine:
    """Load the model into an `engine_class` (`Engine`, or with --distributed process 0's `LeaderEngine` and the
    others' `FollowerEngine`). Each phase says so on stderr, flushed (a pipe too)."""
    _say(f"{'initialising random weights' if source.path is None else 'loading'}: {source.name}")
    start = time.perf_counter()
    policy = ExecutionPolicy(fp8_matmul=args.fp8_matmul)
    model = load_model(source, flags.dtype_of(args), mesh, policy, args.weights, verbose=True)
    _say(f"loaded in {time.perf_counter() - start:.1f} s")
    return engine_class(
        model,
        max_batch=args.max_batch,
        max_context=args.max_context,
        prefill_chunk=args.prefill_chunk,
        mesh=mesh,
        prefill_budget=args.prefill_budget,
        page_size=args.page_size,
        prefix_cache_bytes=_prefix_cache_bytes(args),
        mtp=args.mtp,
        decode_steps=args.decode_steps,
    )


def program_store(args: argparse.Namespace) -> ProgramStore | None:
    """Where ling-serve keeps its prefill and decode programs as serialised executables: `PROGRAM_STORE` inside
    the persistent compilation cache's directory (none where that cache is off, or with --distributed)."""
    directory = jax.config.jax_compilation_cache_dir
    if args.no_compile_cache or cli_runtime.cache_disabled_by_env() or args.distributed or not directory:
        return None
    return ProgramStore(Path(directory) / PROGRAM_STORE)


def prepare(
    args: argparse.Namespace, source: ModelSource, mesh: jax.sharding.Mesh | None, media: MediaReader | None = None
) -> Service:
    """Load the model, compile its programs: the service, ready to start (with --distributed, process 0's: its
    engine publishes every call to the other processes, `replicated`)."""
    engine_class = functools.partial(LeaderEngine, send=Publisher()) if args.distributed else Engine
    start = time.perf_counter()
    engine = load_engine(args, source, mesh, engine_class)
    metrics = Metrics()
    metrics.startup_seconds.labels("load").set(time.perf_counter() - start)
    prefix_cache_bytes = _prefix_cache_bytes(args)
    prefix_cache = PrefixCache(engine.pages, args.prefill_chunk, prefix_cache_bytes) if prefix_cache_bytes else None
    start = time.perf_counter()
    engine.warm_up(
        lambda done, total: _say(f"warm-up: compiled {done} of {total} programs ({time.perf_counter() - start:.1f} s)"),
        # ready once every request can run, the rest compiling on (rarer prefill rows, small batches, decode_steps);
        # with --distributed every process runs the same programs: all compiled first
        background=not args.distributed,
        store=program_store(args),
    )
    report_compiles()  # from here on: every program a request can use is compiled, or compiling in the background
    metrics.startup_seconds.labels("warm_up").set(time.perf_counter() - start)
    metrics.background_programs.set_function(engine.background_programs)
    scheduler = Scheduler(
        engine,
        source.tokenizer,
        eos_ids=source.tokenizer.eos_ids,
        max_queue=args.max_queue,
        metrics=metrics,
        prefix_cache=prefix_cache,
    )
    name = args.served_model_name or (args.preset if source.path is None else args.model.resolve().name)
    return Service(
        scheduler,
        source.tokenizer,
        name,
        args.max_context,
        api_key=api_key(args),
        max_request_bytes=args.max_request_bytes,
        media=media,
    )


_SAYING = threading.Lock()  # whole lines: the warm-up's workers print theirs while the server starts


def _say(line: str) -> None:
    with _SAYING:
        print(f"ling-serve: {line}", file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (port 0: one the system picks), or a ValueError naming the flag."""
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"--port must be in 0..{MAX_PORT}, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror})") from e
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is in use (another server?); pick another --port") from e
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from e


class Loading:
    """The ASGI app served from the start: until `app` is set, /health answers 503 {"status": "loading"} and
    every other route 503 in OpenAI's error schema (as vLLM and SGLang do while they load); then `app` serves."""

    def __init__(self):
        self.app: FastAPI | None = None

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return None
        if scope["path"] == "/health":
            response = JSONResponse({"status": "loading"}, status_code=503)
        else:
            response = APIError(503, "the model is loading; retry once /health answers 200", code="loading").response()
        response.headers["Retry-After"] = "5"
        return await response(scope, receive, send)


class _Loader(threading.Thread):
    """The loading thread: load, compile, start the scheduler and hand the gate the app; `ready` once the server
    accepts. A failure stops the server: `status` is then its exit status (a user error: its one `error:` line,
    status 2); `service` is the service once loaded."""

    def __init__(self, args, checked: tuple, gate: Loading, server: uvicorn.Server, url: str, started: float):
        super().__init__(name="ling-serve-load", daemon=True)
        self.args, self.checked, self.gate, self.server, self.url = args, checked, gate, server, url
        self.started = started  # the process's start (`time.perf_counter`): ready's phase counts from it
        self.service: Service | None = None
        self.status: int | None = None

    def run(self) -> None:
        try:
            service = prepare(self.args, *self.checked)
        except (ValueError, OSError, ShardingError) as e:
            self._fail(EXIT_USAGE, f"error: {e}")
            return
        except Exception:
            self._fail(EXIT_FAILURE, traceback.format_exc().rstrip())
            return
        service.scheduler.start()
        self.service = service
        if self.args.distributed:
            Watch(self.args.distributed_timeout, self._gone).start()
        self.gate.app = create_app(service)
        while not (self.server.started or self.server.should_exit):
            time.sleep(READY_POLL_S)
        if self.server.started:
            service.scheduler.metrics.startup_seconds.labels("ready").set(time.perf_counter() - self.started)
            _say(f"ready: {service.model_name} on {self.url}/v1")

    def _gone(self, message: str) -> None:
        """--distributed: another process failed or left (`Watch`): /health answers 503 for GONE_GRACE_S, then
        the front end exits with status 1."""
        self.service.scheduler.error = ProcessGone(message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        time.sleep(GONE_GRACE_S)
        self.status = EXIT_FAILURE
        self.server.should_exit = True

    def _fail(self, status: int, message: str) -> None:
        cli_runtime.silence_stray_errors()
        print(message, file=sys.stderr, flush=True)
        self.status = status
        self.server.should_exit = True


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    xla_flags.set_gpu_flags()
    cli_runtime.enable_compile_cache(args.no_compile_cache)
    try:
        distributed.check_arguments(args)
        if args.distributed:  # jax's heartbeat outlasts the followers' (`Watch`), whose error line comes first
            distributed.join(args, heartbeat_timeout_s=args.distributed_timeout + HEARTBEAT_MARGIN_S)
        leads = jax.process_index() == 0
        checks = contextlib.nullcontext()
        if args.distributed:
            checks = distributed.agreement("serve", distributed.job_of(args), args.distributed_timeout)
        with checks:
            checked = check(args)
            sock = listen(args.host, args.port) if leads else None
    except (ValueError, OSError, ShardingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not leads:
        return _follow(args, checked)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    gate = Loading()
    server = uvicorn.Server(uvicorn.Config(gate, log_level="warning", access_log=False, lifespan="off"))
    # uvicorn re-raises the signal that stopped it once it has shut down; a handler that does nothing makes
    # that a no-op, so a graceful stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    loader = _Loader(args, checked, gate, server, url, started)
    _say(f"listening on {url} (/health answers 503 until the model is loaded and compiled)")
    loader.start()
    server.run(sockets=[sock])
    if loader.service is not None and isinstance(loader.service.scheduler.error, ProcessGone):
        _exit_now(EXIT_FAILURE)  # the scheduler may wait in a collective with the process that is gone
    if loader.service is not None:
        loader.service.scheduler.stop()
        if args.distributed:
            loader.service.scheduler.engine.stop()
    if loader.status is not None:  # set before the loader stopped the server
        return loader.status
    if loader.is_alive():  # stopped while loading: an XLA compilation cannot be interrupted, nor waited for
        _say("stopped while loading")
        _exit_now(0)
    status = 0 if loader.service.scheduler.error is None else EXIT_FAILURE
    if loader.service.scheduler.engine.compiling():  # nor can the ones still running in the background
        _exit_now(status)
    return status


def _follow(args: argparse.Namespace, checked: tuple) -> int:
    """--distributed, a process other than 0: load its shards, then make process 0's engine calls until it stops."""
    source, mesh, _ = checked
    try:
        follow(load_engine(args, source, mesh, functools.partial(FollowerEngine, receive=Subscriber())))
    except (ValueError, OSError, ShardingError) as e:  # what process 0 names too: it loads the same
        print(f"error: {e}", file=sys.stderr, flush=True)
        _exit_now(EXIT_USAGE)  # jax's shutdown would wait for process 0
    except ProcessGone as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _exit_now(EXIT_FAILURE)
    return 0


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def script_main() -> int:
    """The `ling-serve` console script."""
    return main()
