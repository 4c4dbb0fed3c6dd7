"""The server's Prometheus metrics, in a registry of their own (GET /metrics renders it)."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RATE_WINDOW_S = 10.0  # tokens/s is measured over this many seconds
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("ling_serve_queue_depth", "requests waiting for a slot", registry=r)
        self.running_batch = Gauge("ling_serve_running_batch", "slots holding a request", registry=r)
        self.generated_tokens = Counter("ling_serve_generated_tokens", "tokens sampled", registry=r)
        self.prompt_tokens = Counter("ling_serve_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.tokens_per_s = Gauge(
            "ling_serve_tokens_per_second", f"tokens sampled per second over the last {RATE_WINDOW_S:.0f} s", registry=r
        )
        self.ttft = Histogram(
            "ling_serve_time_to_first_token_seconds",
            "from the request's arrival to its first token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "ling_serve_time_per_output_token_seconds",
            "a request's time after its first token per later token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.steps = Counter("ling_serve_steps", "scheduler steps that ran a program", registry=r)
        self.prefill_steps = Counter(
            "ling_serve_prefill_steps", "prefill steps (a chunk of each prompt of a group)", registry=r
        )
        self.prefill_tokens = Counter(
            "ling_serve_prefill_tokens", "tokens of the chunks prefill steps ran, their padding included", registry=r
        )
        self.requests = Counter("ling_serve_requests", "finished requests", ["finish_reason"], registry=r)
        self.prefix_hits = Counter("ling_serve_prefix_cache_hits", "requests resumed from a cached prefix", registry=r)
        self.prefix_hit_tokens = Counter(
            "ling_serve_prefix_cache_hit_tokens", "prompt tokens not prefilled thanks to the prefix cache", registry=r
        )
        self.mtp_drafted = Counter("ling_serve_mtp_draft_tokens", "MTP draft tokens verified", registry=r)
        self.mtp_accepted = Counter("ling_serve_mtp_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.prefix_bytes = Gauge("ling_serve_prefix_cache_bytes", "bytes held by the prefix cache", registry=r)
        self.startup_seconds = Gauge(
            "ling_serve_startup_seconds",
            "seconds of each start-up phase: load (reading or initialising the weights), warm_up (compiling the "
            "programs every request needs), ready (from ling-serve's start, after its imports, to ready)",
            ["phase"],
            registry=r,
        )
        self.background_programs = Gauge(
            "ling_serve_background_programs", "programs still compiling in the background after ready", registry=r
        )
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

        self.tokens_per_s.set_function(self._tokens_per_s)

    def count_tokens(self, count: int) -> None:
        self.generated_tokens.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def _tokens_per_s(self) -> float:
        with self._lock:
            while self._recent and self._recent[0][0] < time.monotonic() - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(c for _, c in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
