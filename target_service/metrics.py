"""Prometheus metrics of the verifier (names follow vLLM's spec-decode metrics).

Metrics live in a registry owned by the instance, not in module globals, so
tests and several verifiers in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


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

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

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
