"""Prometheus metrics of the verifier, named after vLLM's engine metrics where one exists.

Per engine step (fed by ``Verifier.observe_steps``): tokens and sessions in
the forward, and how long each call queued before its first step. Engine
state (sessions, queue, KV cache use) is read from the verifier at each
scrape, so it is never stale. Spec-decode counts (drafts, draft and accepted
tokens) are the coordinator's: it sees every tree and every request, and one
name per concept keeps dashboards from summing the same drafts twice.

Metrics live in a registry owned by the instance, not in module globals, so
tests and several verifiers in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from target_service.verifier import EngineStep, Verifier

# Tokens in one forward: a single decode token up to a long prefill chunk (--max-batch-tokens).
ITERATION_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Sessions in one forward (up to --max-batch-sessions, 64 by default).
ITERATION_SESSIONS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
# Engine queue time: sub-millisecond on an idle GPU, seconds behind long prefills or a full KV cache on a CPU.
QUEUE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# One engine step: about a millisecond for a small model on a GPU, tens to hundreds on a CPU, more for a long prefill.
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineState(Collector):
    """Engine gauges read from the attached verifier at each scrape (nothing before the model has loaded)."""

    def __init__(self) -> None:
        self.verifier: Verifier | None = None

    def collect(self) -> Iterable[Metric]:
        verifier = self.verifier
        if verifier is None:
            return []
        stats = verifier.stats()
        usage = stats.kv_used_bytes / stats.kv_capacity_bytes if stats.kv_capacity_bytes else 0.0
        return [
            GaugeMetricFamily(
                "specserve_verifier_active_sessions", "Sessions holding a KV cache", value=stats.num_sessions
            ),
            GaugeMetricFamily(
                "specserve_verifier_num_requests_waiting",
                "Prefill and Verify calls queued for the engine, not yet in a step",
                value=stats.num_queued,
            ),
            GaugeMetricFamily(
                "specserve_verifier_kv_cache_usage_perc",
                "Fraction of the preallocated KV cache reserved by sessions (1 means full)",
                value=usage,
            ),
            GaugeMetricFamily(
                "specserve_verifier_kv_cache_capacity_bytes",
                "Bytes preallocated for the KV cache (--kv-cache-gib)",
                value=stats.kv_capacity_bytes,
            ),
            CounterMetricFamily(
                "specserve_verifier_session_evictions",
                "Sessions evicted (idle, TTL, session count or KV cache pressure); each one's next Verify re-prefills",
                value=stats.num_evicted,
            ),
            GaugeMetricFamily(
                "specserve_verifier_kept_caches",
                "Released sessions' KV caches kept for new sessions of the same caller to start from (--kept-prefixes)",
                value=stats.num_kept_caches,
            ),
            CounterMetricFamily(
                "specserve_verifier_prefix_reuses",
                "Sessions whose prompt started with a kept cache's tokens: their keys and values were copied",
                value=stats.num_prefix_reuses,
            ),
            CounterMetricFamily(
                "specserve_verifier_prefix_reused_tokens",
                "Prompt tokens copied from kept caches instead of prefilled (vLLM: prefix cache hits)",
                value=stats.num_reused_tokens,
            ),
        ]


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._engine = _EngineState()
        r.register(self._engine)
        self._in_flight = Gauge(
            "specserve_verifier_inflight_requests", "Prefill and Verify calls in progress or queued", registry=r
        )
        self._iteration_tokens = Histogram(
            "specserve_verifier_iteration_tokens_total",
            "Tokens per engine step: each Verify's pending token and tree nodes plus prefill chunks",
            buckets=ITERATION_TOKENS_BUCKETS,
            registry=r,
        )
        self._iteration_sessions = Histogram(
            "specserve_verifier_iteration_sessions",
            "Sessions per engine step (the batch size): Verify calls plus prefill chunks sharing one forward",
            buckets=ITERATION_SESSIONS_BUCKETS,
            registry=r,
        )
        self._queue_time = Histogram(
            "specserve_verifier_request_queue_time_seconds",
            "Time a call waited for its first engine step, by call (verify, prefill); _count: calls served",
            ["call"],
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        for call in ("verify", "prefill"):
            self._queue_time.labels(call)  # both series exist from the start, at zero
        self._step_time = Histogram(
            "specserve_verifier_engine_step_seconds",
            "Time of one engine step: packing its inputs, the forward, each call's acceptance and answer (a Verify's "
            "verifier_step phase is the part of its call after its queue time)",
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self._lookahead_rows = Counter(
            "specserve_verifier_lookahead_rows",
            "Jacobi lookahead rows run beside the trees (--lookahead); never committed",
            registry=r,
        )
        self._lookahead_ngrams = Counter(
            "specserve_verifier_lookahead_ngrams",
            "n-grams the lookahead rows yielded, returned to the coordinator for the drafters' pools",
            registry=r,
        )

    def serve(self, port: int, host: str) -> None:
        """/metrics on ``host`` (the gRPC server's interface, never all of them unless it is 0.0.0.0)."""
        start_http_server(port, addr=host, registry=self.registry)

    def track(self, verifier: Verifier) -> None:
        """Observe ``verifier``'s engine steps and read its state at each scrape."""
        self._engine.verifier = verifier
        verifier.observe_steps(self.engine_step)

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        self._in_flight.inc()
        try:
            yield
        finally:
            self._in_flight.dec()

    def engine_step(self, step: EngineStep) -> None:
        self._iteration_tokens.observe(step.num_tokens)
        self._iteration_sessions.observe(step.num_sessions)
        self._step_time.observe(step.step_s)
        for call, seconds in step.queued_s:
            self._queue_time.labels(call).observe(seconds)
        if step.lookahead_rows:
            self._lookahead_rows.inc(step.lookahead_rows)
            self._lookahead_ngrams.inc(step.lookahead_ngrams)
