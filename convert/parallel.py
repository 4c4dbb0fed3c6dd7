"""Run a function over many work items on a thread pool with a bounded number of items in flight, so
memory holds a few slices at a time however many slices there are. numpy, XLA and tensorstore release the
GIL, so threads overlap reads, dequantisation and writes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def _collect(pending: dict[Future, Item], on_done: Callable[[Item, Result], None], when: str) -> None:
    done, _ = wait(pending, return_when=when)
    for future in done:
        on_done(pending.pop(future), future.result())


def run_bounded(
    items: Iterable[Item], work: Callable[[Item], Result], workers: int, on_done: Callable[[Item, Result], None]
) -> None:
    """work(item) on `workers` threads, on_done(item, result) on this thread as they finish. The first
    exception cancels what has not started and is re-raised."""
    with ThreadPoolExecutor(workers) as pool:
        pending: dict[Future, Item] = {}
        try:
            for item in items:
                if len(pending) >= 2 * workers:
                    _collect(pending, on_done, FIRST_COMPLETED)
                pending[pool.submit(work, item)] = item
            while pending:
                _collect(pending, on_done, ALL_COMPLETED)
        finally:
            for future in pending:
                future.cancel()
