"""Prometheus metrics of the coordinator, named after vLLM's spec-decode metrics.

Owned by the instance (its own registry), not module globals.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from coordinator.admission import AdmissionController
from coordinator.rounds import GenerationStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specserve_requests", "Finished generations by finish reason", ["finish_reason"], registry=r
        )
        self.generated_tokens = Counter("specserve_generated_tokens", "Tokens streamed to clients", registry=r)
        self.rounds = Counter("specserve_rounds", "Target forward passes after prefill", registry=r)
        self.num_draft_tokens = Counter("specserve_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("specserve_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.reprefills = Counter("specserve_reprefills", "Verifier sessions rebuilt after loss", registry=r)
        self.drafter_drops = Counter("specserve_drafter_drops", "Requests that lost their drafter", registry=r)
        self.drafter_skips = Counter(
            "specserve_drafter_skips", "Requests that did not use the drafter: its circuit was open", registry=r
        )
        self.drafter_failures = Counter(
            "specserve_drafter_failures",
            "Drafter failures: errors, timeouts, bad trees, failed probes (each opens its circuit)",
            registry=r,
        )
        self.drafter_circuit = Gauge(
            "specserve_drafter_circuit_open", "1 while requests skip the drafter after a failure", registry=r
        )

        self.queue_seconds = Histogram(
            "specserve_queue_seconds", "Time admitted streams waited for a slot", buckets=QUEUE_BUCKETS_S, registry=r
        )
        self.running_streams = Gauge("specserve_running_streams", "Streams holding a slot", registry=r)
        self.queued_streams = Gauge("specserve_queued_streams", "Streams waiting for a slot", registry=r)
        self.rejected_streams = Counter(
            "specserve_rejected_streams",
            "Streams refused by admission: queue_full, tenant_queue_full, queue_timeout, deadline",
            ["reason"],
            registry=r,
        )

        self.first_token_seconds = Histogram(
            "specserve_time_to_first_token_seconds",
            "From a request's arrival to its first streamed text",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.inter_token_seconds = Histogram(
            "specserve_inter_token_latency_seconds",
            "Gap between successive streamed chunks of a request (a chunk may hold several tokens)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "specserve_e2e_request_latency_seconds",
            "From a request's arrival to its end",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.request_errors = Counter(
            "specserve_request_errors", "Requests that ended with an error, by gRPC status name", ["code"], registry=r
        )

    def track_admission(self, admission: AdmissionController) -> None:
        """Read the running and queued gauges from ``admission`` at each scrape."""
        self.running_streams.set_function(lambda: admission.running)
        self.queued_streams.set_function(lambda: admission.queued)

    def admitted(self, queue_s: float) -> None:
        self.queue_seconds.observe(queue_s)

    def rejected(self, reason: str) -> None:
        self.rejected_streams.labels(reason).inc()

    def serve(self, port: int, host: str) -> None:
        """/metrics on ``host`` (the gRPC server's interface, never all of them unless it is 0.0.0.0)."""
        start_http_server(port, addr=host, registry=self.registry)

    def observe_first_token(self, seconds: float) -> None:
        self.first_token_seconds.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_seconds.observe(seconds)

    def observe_request_error(self, code: str) -> None:
        self.request_errors.labels(code).inc()

    def observe_finished(self, stats: GenerationStats, e2e_seconds: float) -> None:
        self.e2e_seconds.observe(e2e_seconds)
        self.requests.labels(stats.finish_reason.value).inc()
        self.generated_tokens.inc(stats.num_generated_tokens)
        self.rounds.inc(stats.num_rounds)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        self.reprefills.inc(stats.num_reprefills)
        if stats.drafter_error.startswith("drafter dropped"):
            self.drafter_drops.inc()
        elif stats.drafter_error.startswith("drafter skipped"):
            self.drafter_skips.inc()

    def drafter_failed(self, reason: str) -> None:
        self.drafter_failures.inc()
