"""A K loop for the Triton kernels whose next step's loads are in flight while the current step computes.

Triton's software pipeliner stages through shared memory only the loads that feed a dot; a kernel whose loads go
straight to registers (the decode gemv's FMA products, the MoE row kernels) otherwise waits for each step's loads
before it computes, and issues the next step's only after. `fori_loop` with prefetch carries the loaded tiles:
step s + 1's loads are issued before step s's products, so one step's memory latency hides behind another's
arithmetic. Nothing is loaded twice or past the range: the last step's products run after the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def fori_loop(first, last, load: Callable, compute: Callable, acc, *, prefetch: bool):
    """compute(step, load(step), acc) -> acc over the steps [first, last) in order (last > first when prefetch:
    step `first` is loaded before the loop). prefetch: step + 1's load is issued before step's compute; else each
    step loads and computes in turn. load returns a pytree of arrays (the step's tiles)."""
    if not prefetch:
        return jax.lax.fori_loop(first, last, lambda step, a: compute(step, load(step), a), acc)

    def body(step, carry):
        acc, loaded = carry
        upcoming = load(step + 1)
        return compute(step, loaded, acc), upcoming

    acc, loaded = jax.lax.fori_loop(first, last - 1, body, (acc, load(first)))
    return compute(last - 1, loaded, acc)
