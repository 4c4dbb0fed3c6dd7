"""`ling-serve --distributed`: one front end (process 0) and every other process of the job in step with it.

Process 0 runs the HTTP front end, the scheduler, the tokenizer and the page pool; every process holds its shards
of the weights and of the slot batch, and runs the same jitted programs. The unit of replication is the `Engine`
call: process 0's engine (`LeaderEngine`) publishes each call that runs a program or changes the slots' state
(prefill, first token, decode, fork, snapshot, restore, prompt logprobs, release) as a command before running it,
and each other process (`FollowerEngine`, in `follow`) reads the commands in order and makes the same call with
the same arguments. What process 0 decides on the host (which pages a slot gets, the prefix cache's tree and
evictions) travels as its outcome: a slot's page-table row and capacity (`assign`). The prefix cache's snapshots
are device arrays every process holds its shards of: they are numbered, and a follower drops its copy once
process 0's is gone (the cache evicted it). Process 0's warm-up is published like any other calls, so the
followers compile the same programs in the same order (it runs every one, `Engine.warm_up`), then a `warmed_up`
command, after which every process reports each compilation on stderr (`report_compiles`); the tokens a program
gives are gathered onto every device (`_Replica`), for process 0's scheduler to read.

Commands go through the `jax.distributed` coordination service's key-value store (`ling-serve/command/<n>`, an
`.npz` of small int / float arrays and a JSON header; no pickles): it takes any size (a grammar's bitmask, a
prompt) without compiling anything, and an idle follower waits on it without holding a collective open. Process
0 deletes the commands far behind (the programs' collectives keep every process within a few of it).

Liveness: each follower sets `ling-serve/alive/<i>` every `HEARTBEAT_S`; process 0's `Watch` declares a follower
gone once its beat is older than the timeout (`--distributed-timeout`), and a follower gives up once process 0's
coordination service stops answering.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax import monitoring

from ling_jax.generation.generator import NewTokens
from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import Engine, Snapshot
from ling_jax.serving.pages import PagePool
from ling_jax.serving.programs import COMPILER_THREAD

COMMANDS = "ling-serve/command/"
ALIVE = "ling-serve/alive/"
KEPT_COMMANDS = 256  # process 0 deletes command n - KEPT_COMMANDS when it publishes command n
HEARTBEAT_S = 1.0
WAIT_MS = 1000  # a follower's wait for the next command, between checks that process 0 is still there
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event: an XLA compilation


def _client():
    from orbax.checkpoint import multihost

    return multihost.get_jax_distributed_client()


def encode(op: str, **fields) -> bytes:
    """A command: its op and fields (numpy arrays, or JSON values: ints, floats, strings, lists, None)."""
    arrays = {name: value for name, value in fields.items() if isinstance(value, np.ndarray)}
    header = {name: value for name, value in fields.items() if name not in arrays}
    buffer = io.BytesIO()
    np.savez(buffer, _header=np.frombuffer(json.dumps({"op": op, **header}).encode(), np.uint8), **arrays)
    return buffer.getvalue()


def decode(data: bytes) -> tuple[str, dict]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        fields = json.loads(npz["_header"].tobytes())
        fields.update({name: npz[name] for name in npz.files if name != "_header"})
    return fields.pop("op"), fields


def params_of(fields: dict) -> SamplingParams:
    """The `SamplingParams` of `dataclasses.asdict`'s fields after a JSON round trip (lists for tuples)."""
    bias = tuple((int(token), float(value)) for token, value in fields["logit_bias"])
    return SamplingParams(**{**fields, "logit_bias": bias, "end_ids": tuple(fields["end_ids"])})


def report_compile(event: str, duration_s: float, **fields) -> None:
    """A jax.monitoring listener: an XLA compilation as one line on stderr, `ling-serve: process I compiled jit(NAME)
    while serving (S s)`, but one of the warm-up's in `ProgramCompiler`'s threads (compiling on after `ready`,
    its own progress lines)."""
    if event == BACKEND_COMPILE and not threading.current_thread().name.startswith(COMPILER_THREAD):
        line = f"process {jax.process_index()} compiled {fields.get('fun_name', '?')} while serving"
        print(f"ling-serve: {line} ({duration_s:.1f} s)", file=sys.stderr, flush=True)


@functools.cache
def report_compiles() -> None:
    """From now on (the warm-up done), each XLA compilation in this process is reported (`report_compile`): the
    warm-up compiled every program a request can use but the prompt logprobs' (compiled at their first request),
    and a compilation holds every request up (in a job, every process)."""
    monitoring.register_event_duration_secs_listener(report_compile)


class _HiddenRows:
    """A leader's prefill output: the hidden states [P, D], and which rows the scheduler hands `first_token`."""

    def __init__(self, hidden_PD: jax.Array):
        self.hidden_PD = hidden_PD

    def __getitem__(self, rows: slice) -> _HiddenRow:
        return _HiddenRow(self.hidden_PD[rows], rows.start)


@dataclasses.dataclass(frozen=True)
class _HiddenRow:
    hidden_1D: jax.Array
    row: int


@functools.partial(jax.jit, static_argnames="replicated")
def _replicate(tree, replicated: jax.sharding.NamedSharding):
    return jax.lax.with_sharding_constraint(tree, replicated)


class _Replica(Engine):
    """An engine of the job: the tokens its programs give are replicated on every device (the scheduler reads
    them on process 0; every process runs the gather)."""

    def first_token(self, slot, hidden_1D, params, bitmask_W=None, end_ids=()) -> NewTokens:
        return self._everywhere(super().first_token(slot, hidden_1D, params, bitmask_W, end_ids))

    def decode(self, active_B, rows=None, bitmasks=None, steps=1) -> NewTokens:
        new = self._everywhere(super().decode(active_B, rows, bitmasks, steps))
        for part in jax.tree.leaves(new):
            part.copy_to_host_async()
        return new

    def _everywhere(self, new: NewTokens) -> NewTokens:
        return _replicate(new, jax.sharding.NamedSharding(self.mesh, jax.P()))


class LeaderEngine(_Replica):
    """Process 0's engine: each call is published (`send`) before it runs here."""

    def __init__(self, *args, send: Callable[..., None], **kwargs):
        super().__init__(*args, **kwargs)
        self.send = send
        self._snapshots: dict[int, weakref.ref] = {}  # number -> the snapshot's first array, while it lives
        self._numbers = itertools.count()

    def warm_up(self, on_program=lambda done, total: None, **kwargs) -> None:
        """The engine's warm-up (every call published), then the other processes report their compilations from
        there on (`report_compiles`; this one: ling-serve's `prepare`)."""
        super().warm_up(on_program, **kwargs)
        self.send("warmed_up")

    def assign(self, slot: int, shared: list[int], tokens: int) -> None:
        super().assign(slot, shared, tokens)
        self.send("assign", slot=slot, row=self.page_table_BN[slot], tokens=tokens)

    def prefill(self, slots, chunks, fresh, media=None) -> _HiddenRows:
        if media is not None:
            raise ValueError("--distributed: a VL prompt's images are served by one process only")
        ids = np.stack([ids for ids, _ in chunks])
        mask = np.stack([mask for _, mask in chunks])
        self.send("prefill", slots=list(slots), ids=ids, mask=mask, fresh=[bool(f) for f in fresh])
        return _HiddenRows(super().prefill(slots, chunks, fresh))

    def first_token(self, slot, hidden, params, bitmask_W=None, end_ids=()):
        row = hidden.row if isinstance(hidden, _HiddenRow) else None
        fields = {} if bitmask_W is None else {"bitmask_W": np.asarray(bitmask_W)}
        params_fields = dataclasses.asdict(params)
        self.send("first_token", slot=slot, row=row, params=params_fields, end_ids=sorted(end_ids), **fields)
        hidden_1D = hidden.hidden_1D if isinstance(hidden, _HiddenRow) else hidden.hidden_PD
        return super().first_token(slot, hidden_1D, params, bitmask_W, end_ids)

    def snapshot(self, slot: int, start: int) -> Snapshot:
        gone = [number for number, first in self._snapshots.items() if first() is None]
        if gone:
            self.send("forget", numbers=gone)
            for number in gone:
                del self._snapshots[number]
        number = next(self._numbers)
        self.send("snapshot", slot=slot, start=start, number=number)
        snapshot = super().snapshot(slot, start)
        self._snapshots[number] = weakref.ref(jax.tree.leaves(snapshot)[0])
        return snapshot

    def restore(self, slot: int, path: list[Snapshot], prefix: list[int]) -> None:
        numbers = {id(first()): number for number, first in self._snapshots.items()}
        path_numbers = [numbers[id(jax.tree.leaves(snapshot)[0])] for snapshot in path]
        self.send("restore", slot=slot, numbers=path_numbers, prefix=list(prefix))
        super().restore(slot, path, prefix)

    def fork(self, parent: int, child: int, prompt_length: int, tokens: int) -> None:
        self.send("fork", parent=parent, child=child, prompt_length=prompt_length, tokens=tokens)
        super().fork(parent, child, prompt_length, tokens)

    def prompt_logprobs(self, prompt: list[int]):
        self.send("prompt_logprobs", prompt=list(prompt))
        return super().prompt_logprobs(prompt)

    def release(self, slot: int) -> None:
        self.send("release", slot=slot)
        super().release(slot)

    def decode(self, active_B, rows=None, bitmasks=None, steps=1):
        fields = {}
        if bitmasks:
            fields = {"bitmask_slots": list(bitmasks), "bitmasks": np.stack(list(bitmasks.values()))}
        self.send("decode", active_B=np.asarray(active_B), rows=rows, steps=steps, **fields)
        return super().decode(active_B, rows, bitmasks, steps)

    def stop(self) -> None:
        """The followers return from `follow`."""
        self.send("stop")


class _Process0Pages(PagePool):
    """A follower's page pool: process 0's pool holds the pages (their rows come with `assign`), none are counted
    here."""

    def share(self, pages: Iterable[int]) -> None:
        pass

    def release(self, pages: Iterable[int]) -> None:
        pass


class FollowerEngine(_Replica):
    """Another process's engine: `follow` makes process 0's calls on it; its page table is process 0's."""

    def __init__(self, *args, receive: Callable[[], tuple[str, dict]], **kwargs):
        super().__init__(*args, **kwargs)
        self.pages = _Process0Pages(self.pages.num_pages, self.pages.page_size, self.pages.page_bytes)
        self.receive = receive
        self._hidden_PD: jax.Array | None = None
        self._snapshots: dict[int, Snapshot] = {}

    def assign(self, slot: int, shared: list[int], tokens: int) -> None:
        """The row process 0 gave the slot: the next command (process 0 publishes it as it assigns)."""
        op, fields = self.receive()
        if op != "assign" or fields["slot"] != slot:
            raise RuntimeError(f"out of step with process 0: expected the pages of slot {slot}, got {op}")
        self._assigned(fields)

    def _assigned(self, fields: dict) -> None:
        self.page_table_BN[fields["slot"]] = fields["row"]
        self.capacity_B[fields["slot"]] = fields["tokens"]
        self._table_changed = True

    def run(self, op: str, fields: dict) -> bool:
        """Make one of process 0's calls; False once it says stop."""
        if op == "stop":
            return False
        if op == "assign":
            self._assigned(fields)
        elif op == "warmed_up":
            report_compiles()
        elif op == "prefill":
            chunks = list(zip(fields["ids"], fields["mask"]))
            self._hidden_PD = self.prefill(fields["slots"], chunks, fields["fresh"])
        elif op == "first_token":
            row = fields["row"]
            hidden_1D = self._hidden_PD if row is None else self._hidden_PD[row : row + 1]
            params = params_of(fields["params"])
            self.first_token(fields["slot"], hidden_1D, params, fields.get("bitmask_W"), fields["end_ids"])
        elif op == "snapshot":
            self._snapshots[fields["number"]] = self.snapshot(fields["slot"], fields["start"])
        elif op == "forget":
            for number in fields["numbers"]:
                del self._snapshots[number]
        elif op == "restore":
            self.restore(fields["slot"], [self._snapshots[n] for n in fields["numbers"]], fields["prefix"])
        elif op == "fork":
            self.fork(fields["parent"], fields["child"], fields["prompt_length"], fields["tokens"])
        elif op == "prompt_logprobs":
            self.prompt_logprobs(fields["prompt"])
        elif op == "release":
            self.release(fields["slot"])
        elif op == "decode":
            bitmasks = dict(zip(fields.get("bitmask_slots", ()), fields.get("bitmasks", ())))
            self.decode(fields["active_B"], fields["rows"], bitmasks, fields["steps"])
        else:
            raise RuntimeError(f"out of step with process 0: unknown command {op!r}")
        return True


class Publisher:
    """Process 0's side of the command stream."""

    def __init__(self):
        self.client = _client()
        self.sent = 0

    def __call__(self, op: str, **fields) -> None:
        self.client.key_value_set_bytes(f"{COMMANDS}{self.sent}", encode(op, **fields))
        if self.sent >= KEPT_COMMANDS:
            self.client.key_value_delete(f"{COMMANDS}{self.sent - KEPT_COMMANDS}")
        self.sent += 1


class Subscriber:
    """A follower's side: the next command, waiting as long as process 0 is there."""

    def __init__(self):
        self.client = _client()
        self.received = 0

    def __call__(self) -> tuple[str, dict]:
        key = f"{COMMANDS}{self.received}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, WAIT_MS)
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):  # the coordination service (process 0) is gone
                    raise ProcessGone(f"process 0 (the front end) is gone: {str(e).splitlines()[0]}") from e
        self.received += 1
        return decode(data)


class ProcessGone(RuntimeError):
    """Another process of the job failed or left."""


def follow(engine: FollowerEngine) -> None:
    """Make process 0's engine calls until it says stop, beating meanwhile (`Watch` on process 0 reads it)."""
    stopped = threading.Event()
    beat = threading.Thread(target=_beat, args=(_client(), jax.process_index(), stopped), daemon=True)
    beat.start()
    try:
        while engine.run(*engine.receive()):
            pass
    finally:
        stopped.set()


def _beat(client, me: int, stopped: threading.Event) -> None:
    beats = 0
    while not stopped.wait(HEARTBEAT_S):
        beats += 1
        try:
            client.key_value_set(f"{ALIVE}{me}", str(beats), allow_overwrite=True)
        except jax.errors.JaxRuntimeError:  # process 0 is gone: `Subscriber` says so
            return


class Watch(threading.Thread):
    """Process 0's watch over the followers' beats: `on_gone(message)` once one is older than `timeout_s` (or
    never came, `timeout_s` after the watch started)."""

    def __init__(self, timeout_s: float, on_gone: Callable[[str], None]):
        super().__init__(name="ling-serve-watch", daemon=True)
        self.client, self.timeout_s, self.on_gone = _client(), timeout_s, on_gone
        self.stopped = threading.Event()

    def run(self) -> None:
        followers = range(1, jax.process_count())
        last = {i: (None, time.monotonic()) for i in followers}
        while not self.stopped.wait(HEARTBEAT_S):
            now = time.monotonic()
            for i in followers:
                beat = self._beat_of(i)
                if beat != last[i][0]:
                    last[i] = (beat, now)
                elif now - last[i][1] > self.timeout_s:
                    self.on_gone(
                        f"process {i} stopped answering for --distributed-timeout {self.timeout_s:g} s (it failed "
                        "or left), so every process stops"
                    )
                    return

    def _beat_of(self, i: int) -> str | None:
        try:
            return self.client.key_value_try_get(f"{ALIVE}{i}")
        except jax.errors.JaxRuntimeError:  # NOT_FOUND: no beat yet
            return None
