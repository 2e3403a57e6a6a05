"""Prometheus metrics of the drafter: its memory (bounded by --max-memory-mib), pre-drafting, the process.

Owned by the instance (its own registry), not module globals.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from draft_service.drafter import PredraftCounts
from draft_service.namespace_state import NAMESPACE
from draft_service.pools import PoolRegistry
from draft_service.session_memory import SESSION, SessionMemory
from draft_service.source_gate import GateCounts

# One proposal in Draft: tens of microseconds for n-gram sources, milliseconds for a draft head's steps.
PROPOSE_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class _Totals(Collector):
    """Counters kept as running totals by the drafter, read at each scrape."""

    def __init__(self, memory: SessionMemory, predraft: PredraftCounts, gate: GateCounts) -> None:
        self._memory = memory
        self._counts = predraft
        self._gate = gate

    def collect(self) -> Iterable[Metric]:
        return [
            CounterMetricFamily(
                "specserve_drafter_sessions_forgotten",
                "Times a session's draft-head state was freed to stay within the memory bound",
                value=self._memory.forgotten(SESSION),
            ),
            CounterMetricFamily(
                "specserve_drafter_namespaces_forgotten",
                "Times a pool namespace's successor tables and acceptance statistics were freed to stay within the "
                "memory bound",
                value=self._memory.forgotten(NAMESPACE),
            ),
            CounterMetricFamily(
                "specserve_drafter_predrafts",
                "Trees drafted ahead, while the verifier checked the last one, for one of its likely outcomes",
                value=self._counts.drafted,
            ),
            CounterMetricFamily(
                "specserve_drafter_predraft_hits",
                "Pre-drafted trees answered at once because their outcome happened",
                value=self._counts.used,
            ),
            CounterMetricFamily(
                "specserve_drafter_work_ahead_dropped",
                "Sessions' work ahead dropped from its queue unstarted because their next report came first",
                value=self._counts.dropped,
            ),
            CounterMetricFamily(
                "specserve_drafter_draft_head_rounds",
                "Drafted rounds whose tree the draft head drafted (a session's head runs while its accepted drafts "
                "pay for its drafting time, and on probes)",
                value=self._gate.ran,
            ),
            CounterMetricFamily(
                "specserve_drafter_draft_head_skips",
                "Drafted rounds the draft head sat out because its accepted drafts did not pay for its time",
                value=self._gate.skipped,
            ),
            CounterMetricFamily(
                "specserve_drafter_draft_head_warm_ups_skipped",
                "Sessions that started with the draft head sitting out, without warming it up, because it had not "
                "paid for this drafter's earlier sessions (every 8th new session warms it up all the same)",
                value=self._gate.warm_ups_skipped,
            ),
        ]


class DrafterMetrics:
    def __init__(self, memory: SessionMemory, pools: PoolRegistry, predraft: PredraftCounts, gate: GateCounts) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # what the default registry had
            r.register(collector)
        in_use = Gauge(
            "specserve_drafter_memory_bytes",
            "Bytes of drafting state held, estimated: in-memory n-gram pools, per-session state, and the pool "
            "namespaces' successor tables and acceptance statistics",
            ["kind"],
            registry=r,
        )
        in_use.labels("ngram_pools").set_function(lambda: pools.nbytes)
        in_use.labels("sessions").set_function(lambda: memory.bytes_of(SESSION))
        in_use.labels("namespaces").set_function(lambda: memory.bytes_of(NAMESPACE))
        Gauge(
            "specserve_drafter_sessions_memory_limit_bytes",
            "Bound of the per-session and per-namespace state together",
            registry=r,
        ).set_function(lambda: memory.max_bytes)
        Gauge("specserve_drafter_open_sessions", "Draft streams open", registry=r).set_function(
            lambda: memory.count(SESSION)
        )
        Gauge(
            "specserve_drafter_namespaces", "(vocabulary, pool namespace) pairs whose state is held", registry=r
        ).set_function(lambda: memory.count(NAMESPACE))
        r.register(_Totals(memory, predraft, gate))
        self._propose_seconds = Histogram(
            "specserve_drafter_propose_seconds",
            "Time of one proposal in Draft, from its message to its answer: the drafter's part of a round (the "
            "coordinator's drafter phase, plus the wait for the drafting lock)",
            buckets=PROPOSE_BUCKETS_S,
            registry=r,
        )

    def observe_propose(self, seconds: float) -> None:
        self._propose_seconds.observe(seconds)

    def serve(self, port: int, host: str) -> None:
        """/metrics on ``host`` (the gRPC server's interface, never all of them unless it is 0.0.0.0)."""
        start_http_server(port, addr=host, registry=self.registry)
