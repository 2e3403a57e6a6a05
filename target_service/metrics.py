"""Prometheus metrics of the verifier (names follow vLLM's spec-decode metrics).

Metrics live in a registry owned by the instance, not in module globals, so
tests and several verifiers in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from target_service.verifier import EngineStats


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._active_sessions = Gauge(
            "specserve_verifier_active_sessions", "Sessions holding a KV cache", registry=self.registry
        )
        self._in_flight = Gauge(
            "specserve_verifier_inflight_requests", "Prefill/Verify calls in progress or queued", registry=self.registry
        )
        self._num_drafts = Counter("specserve_verifier_num_drafts", "Trees verified", registry=self.registry)
        self._num_draft_tokens = Counter(
            "specserve_verifier_num_draft_tokens", "Draft tokens verified", registry=self.registry
        )
        self._num_accepted_tokens = Counter(
            "specserve_verifier_num_accepted_tokens", "Draft tokens accepted", registry=self.registry
        )

        self._kv_used = Gauge(
            "specserve_verifier_kv_cache_used_bytes", "KV cache bytes reserved by sessions", registry=self.registry
        )
        self._kv_capacity = Gauge(
            "specserve_verifier_kv_cache_capacity_bytes", "Preallocated KV cache bytes", registry=self.registry
        )
        self._queued = Gauge(
            "specserve_verifier_queued_requests", "Calls waiting for the engine", registry=self.registry
        )
        self._batch_sessions = Histogram(
            "specserve_verifier_batch_sessions",
            "Sessions sharing the forward of each Verify",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        self._queue_seconds = Histogram(
            "specserve_verifier_queue_seconds",
            "Time a Verify waited for the engine",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )

    def serve(self, port: int, host: str) -> None:
        """/metrics on ``host`` (the gRPC server's interface, never all of them unless it is 0.0.0.0)."""
        start_http_server(port, addr=host, registry=self.registry)

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        self._in_flight.inc()
        try:
            yield
        finally:
            self._in_flight.dec()

    def sessions(self, count: int) -> None:
        self._active_sessions.set(count)

    def verified(self, num_draft: int, num_accepted: int) -> None:
        self._num_drafts.inc()
        self._num_draft_tokens.inc(num_draft)
        self._num_accepted_tokens.inc(num_accepted)

    def engine(self, stats: EngineStats, batch_sessions: int, queue_ns: int) -> None:
        self._kv_used.set(stats.kv_used_bytes)
        self._kv_capacity.set(stats.kv_capacity_bytes)
        self._queued.set(stats.num_queued)
        self._batch_sessions.observe(batch_sessions)
        self._queue_seconds.observe(queue_ns / 1e9)
