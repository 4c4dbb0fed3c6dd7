"""`ling-serve` (and `python -m ling_jax.serving`): load a model, compile its programs, serve the OpenAI API.

Every flag is checked, and the checkpoint's config and tokenizer read, before the weights load; a mistake is
one `error: ...` line on stderr and exit status 2. The server is ready once it prints "ling-serve: ready";
SIGTERM (or Ctrl-C) stops it gracefully: it takes no new connections, the requests in flight finish, and the
process exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from ling_jax.checkpoints.hf import load_hf_checkpoint
from ling_jax.checkpoints.orbax import load_checkpoint
from ling_jax.generation import cli_checks, cli_runtime, flags
from ling_jax.generation.flags import DEMO_DIR
from ling_jax.generation.generator import MIN_CHUNK
from ling_jax.policy import ExecutionPolicy
from ling_jax.serving.api import Service, create_app
from ling_jax.serving.engine import PAGE_SIZE, Engine, prefix_block_bytes
from ling_jax.serving.media import LOCAL_MEDIA_FLAG, MediaReader
from ling_jax.serving.metrics import Metrics
from ling_jax.serving.ops import DEFAULT_MAX_REQUEST_BYTES
from ling_jax.serving.prefix_cache import PrefixCache
from ling_jax.serving.scheduler import Scheduler
from ling_jax.sharding import ShardingError

EXIT_USAGE = 2
API_KEY_ENV = "LING_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ling-serve",
        description="An OpenAI-compatible HTTP server (continuous batching) for a Ling checkpoint.",
        epilog="example:\n  ling-serve --port 8000\n  curl http://127.0.0.1:8000/v1/models",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = flags.add_model_flags(parser, default=DEMO_DIR)
    model.add_argument(
        "--served-model-name", metavar="NAME", help="the model id clients ask for (default: --model's directory name)"
    )
    flags.add_execution_flags(parser, prefill_chunk=512, kernel_backend=False, mesh_shorthands=False)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
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
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--max-context", args.max_context, 2),
        ("--prefill-chunk", args.prefill_chunk, MIN_CHUNK),
        ("--page-size", args.page_size, 1),
        ("--max-queue", args.max_queue, 0),
        ("--mtp", args.mtp, 0),
        ("--port", args.port, 0),
        ("--max-request-bytes", args.max_request_bytes, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.prefill_budget is not None and args.prefill_budget < args.prefill_chunk:
        raise ValueError(
            f"--prefill-budget must be >= --prefill-chunk ({args.prefill_chunk}), got {args.prefill_budget}"
        )
    cli_checks.check_mtp(args.mtp)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if not args.prefix_cache_gb >= 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0 (0 = off), got {args.prefix_cache_gb}")
    if args.prefix_cache_gb and args.prefill_chunk % args.page_size:
        raise ValueError(
            f"--page-size {args.page_size} must divide --prefill-chunk {args.prefill_chunk} with the prefix cache"
        )


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $LING_API_KEY, else None (no key needed)."""
    return (args.api_key or os.environ.get(API_KEY_ENV, "")).strip() or None


def prepare(args: argparse.Namespace) -> Service:
    """Check everything, load the model, compile its programs: the service, ready to start."""
    _check_flags(args)
    mesh = flags.build_mesh(args)
    source = cli_checks.checkpoint_source(args.model, "--model", byte_tokenizer=False)
    config = source.text_config
    local_dir = args.allowed_local_media_path
    if source.vl_config is None and local_dir is not None:
        raise ValueError(f"{LOCAL_MEDIA_FLAG}: --model {args.model} is a text model (it takes no images)")
    if source.vl_config is not None and args.mtp:
        raise ValueError(f"--mtp: --model {args.model} is a VL checkpoint, whose MTP layer is not wired up")
    media = None if source.vl_config is None else MediaReader.for_checkpoint(args.model, source.vl_config, local_dir)
    if args.max_context > config.max_position_embeddings:
        raise ValueError(
            f"--max-context {args.max_context} exceeds the model's context of {config.max_position_embeddings} tokens"
        )
    if args.mtp and not config.num_nextn_predict_layers:
        raise ValueError(
            f"--mtp {args.mtp} needs a model with an MTP layer; {args.model} has none (num_nextn_predict_layers = 0)"
        )
    dtype = flags.dtype_of(args)
    prefix_cache_bytes = int(args.prefix_cache_gb * 2**30)
    block_bytes = prefix_block_bytes(config, args.prefill_chunk, dtype, args.mtp)
    if 0 < prefix_cache_bytes < block_bytes:
        raise ValueError(
            f"--prefix-cache-gb {args.prefix_cache_gb} cannot hold one prefix block: a block of --prefill-chunk "
            f"{args.prefill_chunk} tokens takes {block_bytes / 2**20:,.1f} MiB for this model (its KDA states, MLA "
            f"pages{' and MTP entries' if args.mtp else ''}); give at least {block_bytes / 2**30:.3f}"
        )
    progress = sys.stderr.isatty()
    policy = ExecutionPolicy(fp8_matmul=args.fp8_matmul)
    if source.orbax:
        model = load_checkpoint(
            args.model, mesh=mesh, dtype=dtype, weights=args.weights, progress=progress, policy=policy
        )
    else:
        model = load_hf_checkpoint(args.model, dtype=dtype, weights=args.weights, progress=progress, policy=policy)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_context=args.max_context,
        prefill_chunk=args.prefill_chunk,
        mesh=mesh,
        prefill_budget=args.prefill_budget,
        page_size=args.page_size,
        prefix_cache_bytes=prefix_cache_bytes,
        mtp=args.mtp,
    )
    prefix_cache = PrefixCache(engine.pages, args.prefill_chunk, prefix_cache_bytes) if prefix_cache_bytes else None
    engine.warm_up()
    scheduler = Scheduler(
        engine,
        source.tokenizer,
        eos_ids=source.tokenizer.eos_ids,
        max_queue=args.max_queue,
        metrics=Metrics(),
        prefix_cache=prefix_cache,
    )
    name = args.served_model_name or args.model.resolve().name
    return Service(
        scheduler,
        source.tokenizer,
        name,
        args.max_context,
        api_key=api_key(args),
        max_request_bytes=args.max_request_bytes,
        media=media,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli_runtime.enable_compile_cache(args.no_compile_cache)
    try:
        service = prepare(args)
    except (ValueError, OSError, ShardingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning", access_log=False)
    )
    # uvicorn re-raises the signal that stopped it once it has shut down; a handler that does nothing makes
    # that a no-op, so a graceful stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    service.scheduler.start()
    print(f"ling-serve: ready: {service.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    server.run()
    service.scheduler.stop()
    return 0 if service.scheduler.error is None else 1


def script_main() -> int:
    """The `ling-serve` console script."""
    return main()
