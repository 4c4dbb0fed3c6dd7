"""Joining a multi-process JAX job (`generate.py --distributed`, `ling-convert --distributed`) and checking, before
any weight is read, that every process was given the same work and none has failed.

`join` calls `jax.distributed.initialize` with what the flags give (`add_arguments`); what they leave out is
auto-detected (TPU pods, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS). A process that cannot join within the timeout
(a process count or coordinator address that disagrees with the others', a process that never started) prints one
`error:` line and exits with status 2; jax alone would abort the process with a C++ stack trace at the same point.

`agreement` wraps the checks that come before the weights: each process publishes its job (the flags that must be
equal everywhere) and its error, if any, in the coordination service's key-value store and reads every other
process's. A process that failed re-raises its own error; every other one raises `DistributedError` naming the
failed process and its error; jobs that differ raise it on every process, naming the flag. Nobody goes on to the
collectives (or Orbax's barriers) that a missing process would leave hanging. CPU devices (tests) exchange data
with gloo, jax's default `jax_cpu_collectives_implementation`.

jax and orbax are imported on first use: ling-convert parses its flags, and takes Ctrl-C, before importing them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping

DEFAULT_TIMEOUT_S = 300  # jax's own initialization timeout
EXIT_USAGE = 2
_JAX_MARGIN_S = 10  # jax's own timeout comes after ours, so our message is the one printed
_JOINING_FLAGS = ("coordinator", "num_processes", "process_id")
_PER_PROCESS = ("coordinator", "process_id", "distributed_timeout")  # may differ (a host name for an address)


class DistributedError(ValueError):
    """The processes of a job disagree, or one of them failed before the weights were read."""


def add_arguments(parser: argparse.ArgumentParser, distributed_help: str) -> None:
    """A "multi-process" group: --distributed (`distributed_help`) and the flags that say how to join."""
    group = parser.add_argument_group("multi-process")
    group.add_argument("--distributed", action="store_true", help=distributed_help)
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's address, the same on every process (default: auto-detected on TPU pods, SLURM and "
        "Open MPI, else $JAX_COORDINATOR_ADDRESS)",
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job (default: detected)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (default: detected)")
    group.add_argument(
        "--distributed-timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="seconds to wait for the other processes to join, and to finish their checks before the weights "
        f"are read (default {DEFAULT_TIMEOUT_S})",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse the joining flags without --distributed, and a timeout below a second."""
    given = [f"--{name.replace('_', '-')}" for name in _JOINING_FLAGS if getattr(args, name) is not None]
    if given and not args.distributed:
        raise DistributedError(f"{', '.join(given)}: only with --distributed")
    if args.distributed_timeout < 1:
        raise DistributedError(f"--distributed-timeout must be >= 1, got {args.distributed_timeout}")


def join(args: argparse.Namespace, prefix: str = "", heartbeat_timeout_s: int | None = None) -> None:
    """`jax.distributed.initialize` with the flags' values (checked by `check_arguments`); see the module docstring
    for a process that cannot join. `prefix` starts the error line (`ling-convert: `). heartbeat_timeout_s: how
    long jax's coordination service waits for a silent process before it ends the job (default: jax's, 100 s)."""
    timeout_s = args.distributed_timeout
    where = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or "the detected coordinator"
    who = "this process" if args.process_id is None else f"process {args.process_id}"
    size = "" if args.num_processes is None else f" of {args.num_processes} processes"

    def give_up() -> None:  # jax's connect blocks without a way out but its own abort
        print(
            f"{prefix}error: {who} could not join the job{size} at {where} within --distributed-timeout "
            f"{timeout_s} s: every process must be started with the same --coordinator and --num-processes, "
            "and a distinct --process-id",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_USAGE)

    import jax

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=timeout_s + _JAX_MARGIN_S,
            **({} if heartbeat_timeout_s is None else {"heartbeat_timeout_seconds": heartbeat_timeout_s}),
        )
    except (ValueError, TypeError, RuntimeError) as e:  # values jax refuses, or could not detect
        undetected = args.coordinator is None and "JAX_COORDINATOR_ADDRESS" not in os.environ
        hint = (
            " (no --coordinator given and none detected: outside a TPU pod, SLURM or Open MPI job give --coordinator "
            "HOST:PORT, --num-processes N and --process-id I)"
            if undetected
            else ""
        )
        raise DistributedError(f"--distributed: {e}{hint}") from e
    finally:
        watchdog.cancel()


def job_of(args: argparse.Namespace, **extra: object) -> dict[str, object]:
    """What must be the same on every process: every flag but the per-process ones, and `extra`."""
    flags = {name: value for name, value in vars(args).items() if name not in _PER_PROCESS}
    return {**flags, **extra}


@contextlib.contextmanager
def agreement(stage: str, job: Mapping[str, object], timeout_s: float) -> Iterator[dict[str, object]]:
    """Run the body (the checks before the weights), then compare its outcome with every other process's (see the
    module docstring). The body may add entries to the job it is given (e.g. a digest of the encoded prompts)."""
    job = dict(job)
    try:
        yield job
    except Exception as e:
        _exchange(stage, job, str(e) or type(e).__name__, timeout_s)
        raise
    _exchange(stage, job, None, timeout_s)


def _exchange(stage: str, job: dict[str, object], error: str | None, timeout_s: float) -> None:
    import jax
    import orbax.checkpoint as ocp

    client = ocp.multihost.get_jax_distributed_client()
    me = jax.process_index()
    record = {"job": json.loads(json.dumps(job, default=str)), "error": error}
    client.key_value_set(f"ling-jax/{stage}/{me}", json.dumps(record))
    deadline = time.monotonic() + timeout_s
    records = {}
    for other in range(jax.process_count()):
        wait_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            records[other] = json.loads(client.blocking_key_value_get(f"ling-jax/{stage}/{other}", wait_ms))
        except jax.errors.JaxRuntimeError as e:  # DEADLINE_EXCEEDED
            raise DistributedError(
                f"process {other} did not finish its checks within --distributed-timeout {timeout_s} s "
                f"(it failed before them, or is slow or stuck): {str(e).splitlines()[0]}"
            ) from e
    problem = None if error is not None else disagreement(me, records)
    if problem is not None:
        raise DistributedError(problem)


def disagreement(me: int, records: Mapping[int, Mapping]) -> str | None:
    """What stops process `me`, given every process's record ({"job": ..., "error": ...}), or None: another
    process's error first, else the first job entry that differs from `me`'s."""
    for other, theirs in records.items():
        if theirs["error"] is not None:
            return f"process {other} failed, so every process stops: {theirs['error']}"
    mine = records[me]["job"]
    for other, theirs in records.items():
        for name in sorted(set(mine) | set(theirs["job"])):
            if mine.get(name) != theirs["job"].get(name):
                return (
                    f"the processes were given different work: {name} is {theirs['job'].get(name)!r} on process "
                    f"{other} and {mine.get(name)!r} on process {me}; every process must run the same command on "
                    "the same files"
                )
    return None
