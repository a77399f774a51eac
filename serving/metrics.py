"""Prometheus metrics of the server (``prometheus_client``), one registry per application.

Gauges read from the engine at each scrape: requests running and waiting, KV blocks in use and in all, the
prefix-cache hit rate (prompt tokens taken from the cache over prompt tokens received), whether ahead-of-time
compiled steps are still being compiled (``zoo_compiling``). Histograms, in seconds, each
clock started when the request arrived (the server's first middleware): time to first token, queue time (until the
engine accepted the request), end-to-end latency; and the inter-token latency. Counters: prompt and generated tokens.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 5 ms to 60 s (CPU decoding of tiny and small models).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The metrics of one server; ``bind(front)`` once the engine's front (``AsyncEngine`` or ``ProcessEngine``)
    exists: its ``stats()`` are read at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("zoo_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("zoo_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.blocks_used = Gauge("zoo_kv_blocks_in_use", "KV cache blocks referenced by a sequence", registry=r)
        self.blocks_total = Gauge("zoo_kv_blocks_total", "KV cache blocks in the cache", registry=r)
        self.prefix_hit_rate = Gauge("zoo_prefix_cache_hit_rate",
                                     "Prompt tokens taken from the prefix cache / prompt tokens received", registry=r)
        self.compiling = Gauge("zoo_compiling", "1 while the engine's ahead-of-time compiled steps are being "
                               "compiled (zoo serve --compile-aot; those steps run eagerly until then)", registry=r)
        self.ttft = Histogram("zoo_time_to_first_token_seconds",
                              "Time from the request's arrival to its first token", buckets=_BUCKETS, registry=r)
        self.queue_time = Histogram("zoo_request_queue_time_seconds",
                                    "Time from the request's arrival until the engine accepted it (tokenized, "
                                    "checked, and taken between two engine steps)", buckets=_BUCKETS, registry=r)
        self.e2e = Histogram("zoo_e2e_request_latency_seconds", "Time from the request's arrival to its last token",
                             buckets=_BUCKETS, registry=r)
        self.itl = Histogram("zoo_inter_token_latency_seconds", "Time between a request's successive tokens",
                             buckets=_BUCKETS, registry=r)
        self.prompt_tokens = Counter("zoo_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("zoo_generation_tokens", "Tokens generated", registry=r)
        self.engine: Any = None
        self.received_tokens = 0

    def bind(self, engine: Any) -> None:
        """Read the gauges from ``engine`` at each scrape.

        Args:
            engine: the engine's front (``AsyncEngine`` or ``ProcessEngine``).
        """
        self.engine = engine

    def observe_tokens(self, count: int, since_start: float, since_last: float, first: bool) -> None:
        """A delta of ``count`` tokens arrived: the first one's latency is time-to-first-token, later ones'
        inter-token latency (a delta of several tokens counts the wait once, spread over its tokens).

        Args:
            count: the delta's tokens.
            since_start: seconds since the request arrived.
            since_last: seconds since the request's previous delta.
            first: whether this is the request's first delta.
        """
        self.generation_tokens.inc(count)
        if first:  # tokens after the first in the same delta came with it
            self.ttft.observe(since_start)
            gaps = [0.0] * (count - 1)
        else:
            gaps = [since_last / count] * count
        for gap in gaps:
            self.itl.observe(gap)

    def received(self, prompt_tokens: int) -> None:
        """Count a request's prompt tokens.

        Args:
            prompt_tokens: its prompt's length in tokens.
        """
        self.prompt_tokens.inc(prompt_tokens)
        self.received_tokens += prompt_tokens

    def render(self) -> tuple[bytes, str]:
        """The exposition text (gauges refreshed from the engine first) and its content type.

        Returns:
            ``(body, content type)`` for the ``/metrics`` response.
        """
        if self.engine is not None:
            stats = self.engine.stats()
            self.running.set(stats["running"])
            self.waiting.set(stats["waiting"])
            self.blocks_total.set(stats["blocks_total"])
            self.blocks_used.set(stats["blocks_used"])
            self.compiling.set(stats["compiling"])
            received = self.received_tokens
            self.prefix_hit_rate.set(stats["prefix_hits"] / received if received else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
