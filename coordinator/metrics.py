"""Prometheus metrics of the coordinator: vLLM's names with the ``specserve_`` prefix where vLLM has one.

The coordinator sees every request whole, so the request-level figures live
here: latency histograms (TTFT, inter-token, end to end, queue), request and
token counters, and vLLM's spec-decode counters (``num_drafts``,
``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``),
which give the acceptance rate and the mean acceptance length:

    rate(specserve_spec_decode_num_accepted_tokens_total[5m])
      / rate(specserve_spec_decode_num_draft_tokens_total[5m])          acceptance rate
    1 + rate(specserve_spec_decode_num_accepted_tokens_total[5m])
      / rate(specserve_spec_decode_num_drafts_total[5m])                tokens per drafted round
    rate(specserve_generation_tokens_total[5m]) / rate(specserve_rounds_total[5m])
                                                                        tau: tokens per target forward

Each of these carries ``decoding``: "greedy" (temperature 0) or "sampled", since acceptance differs between
them (a sampled request's drafts are accepted only when they hold the target's own random draw); sum over it
for the whole. The per-position counter's ``position`` is the draft depth.

Structured output: forced tokens (``spec_decode_num_forced_tokens``, a part of the accepted tokens), finished
constrained requests by kind and completeness, each round's mask time, and the grammar compiler's compile
time, cache hits and refusals, a token limit below the constraint's shortest output among them (the compiler
reports them through ``CompileObserver``).

Owned by the instance (its own registry), not module globals.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from coordinator.admission import AdmissionController
from coordinator.constraints.refusals import REFUSAL_REASONS
from coordinator.constraints.spec import ConstraintKind
from coordinator.metrics_http import serve_metrics
from coordinator.round_phases import PHASES
from coordinator.rounds import FinishReason, GenerationStats

DECODING_KINDS = ("greedy", "sampled")

# Time to first token: tens of milliseconds on a GPU, seconds for a long prompt on a CPU or behind a queue.
TTFT_BUCKETS_S = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
# Gap between streamed chunks: one round, a few ms on a GPU to a few hundred ms on a CPU.
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0,
    600.0,
)  # fmt: skip
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Discovery (k8s:// targets): an endpoint change reaches the router within milliseconds; a first session waits
# for the next request.
DISCOVERY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Structured output: a grammar compiles in about a millisecond (a large schema in tens; the limit is 5 s); one
# round's masks take tens of microseconds a row, a millisecond or more for a deep tree or a cold lexer.
COMPILE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MASK_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip
CONSTRAINT_KINDS = tuple(kind.value for kind in ConstraintKind)

# One phase of one round (coordinator.round_phases): tens of microseconds of bookkeeping or protobuf to a verifier
# step of hundreds of milliseconds on a CPU.
ROUND_PHASE_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

# Admission's refusals (coordinator.admission), so their series exist at zero before the first one.
# "call_limit": a call past the server's --max-concurrent-streams + --max-queued-streams + 32 (specserve.call_limit).
REJECTION_REASONS = ("queue_full", "tenant_queue_full", "queue_timeout", "deadline", "call_limit")


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        # Requests
        self.request_success = Counter(
            "specserve_request_success",
            "Requests that finished, by finish reason (length, stop, eos)",
            ["finished_reason"],
            registry=r,
        )
        for finish in FinishReason:
            self.request_success.labels(finish.value)
        self.request_errors = Counter(
            "specserve_request_errors",
            "Requests that ended with an error, by gRPC status name (HTTP errors map to the same names)",
            ["code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens", "Prompt tokens of finished requests (after the chat template)", registry=r
        )
        self.generation_tokens = Counter(
            "specserve_generation_tokens",
            "Tokens generated and streamed to clients, by decoding (greedy or sampled)",
            ["decoding"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "specserve_time_to_first_token_seconds",
            "From a request's arrival (queue time included) to its first streamed chunk",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "specserve_inter_token_latency_seconds",
            "Gap between successive streamed chunks of a request; a chunk holds every token of one round, "
            "so with speculation a gap may cover several tokens",
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "specserve_e2e_request_latency_seconds",
            "From a request's arrival to its last chunk and stats, for requests that finished",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "specserve_request_queue_time_seconds",
            "Time an admitted request waited for a generation slot",
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        self.num_requests_running = Gauge(
            "specserve_num_requests_running", "Requests holding a generation slot", registry=r
        )
        self.num_requests_waiting = Gauge(
            "specserve_num_requests_waiting", "Requests queued for a generation slot", registry=r
        )
        self.admission_rejections = Counter(
            "specserve_admission_rejections",
            "Requests refused by admission, by reason: " + ", ".join(REJECTION_REASONS),
            ["reason"],
            registry=r,
        )
        for reason in REJECTION_REASONS:
            self.admission_rejections.labels(reason)

        # Speculative decoding (vLLM's spec_decode_* counters) and rounds
        decoding = ["decoding"]
        self.rounds = Counter(
            "specserve_rounds", "Verifier forwards of a request after its prefill, drafted or not", decoding, registry=r
        )
        self.num_drafts = Counter(
            "specserve_spec_decode_num_drafts", "Rounds whose tree held at least one draft token", decoding, registry=r
        )
        self.num_draft_tokens = Counter(
            "specserve_spec_decode_num_draft_tokens", "Draft tokens sent to the verifier", decoding, registry=r
        )
        self.num_accepted_tokens = Counter(
            "specserve_spec_decode_num_accepted_tokens", "Draft tokens the verifier accepted", decoding, registry=r
        )
        self.num_accepted_tokens_per_pos = Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose accepted path reached draft position `position` + 1 (0: the first draft token)",
            ["decoding", "position"],
            registry=r,
        )
        for kind in DECODING_KINDS:  # both series exist from the start
            for counter in (
                self.generation_tokens,
                self.rounds,
                self.num_drafts,
                self.num_draft_tokens,
                self.num_accepted_tokens,
            ):
                counter.labels(kind)
        self.reprefills = Counter(
            "specserve_reprefills", "Verifier sessions rebuilt from the committed tokens after loss", registry=r
        )

        # Where a round's time goes (coordinator.round_phases), and the rounds run plain because drafting did not pay
        self.round_phase_seconds = Histogram(
            "specserve_round_phase_seconds",
            "Time of one round in one phase, one observation per round and phase: " + ", ".join(PHASES) + " (the "
            "phases add up to the round's time)",
            ["phase"],
            buckets=ROUND_PHASE_BUCKETS_S,
            registry=r,
        )
        for phase in PHASES:
            self.round_phase_seconds.labels(phase)
        self.rounds_plain_by_cost = Counter(
            "specserve_rounds_plain_by_cost",
            "Rounds run plain because the session's drafted rounds did not commit more tokens per second than its "
            "plain rounds end to end, or to time a plain round (--gate-drafting)",
            registry=r,
        )
        self.rounds_sent_ahead = Counter(
            "specserve_rounds_sent_ahead",
            "Plain rounds whose Verify went before the previous round's answer came back (--verify-ahead)",
            registry=r,
        )
        self.verify_ahead_withdrawn = Counter(
            "specserve_verify_ahead_withdrawn",
            "Verify calls sent ahead and withdrawn: the request ended at EOS or a stop string, or a round failed",
            registry=r,
        )

        # Structured output (coordinator.constraints)
        self.num_forced_tokens = Counter(
            "specserve_spec_decode_num_forced_tokens",
            "Accepted draft tokens that were the only token the constraint allowed (certain drafts, free to "
            "draft); a part of num_accepted_tokens",
            decoding,
            registry=r,
        )
        self.constrained_requests = Counter(
            "specserve_constrained_requests",
            "Finished requests with a constraint, by kind (json_schema, regex, lark_grammar, choice) and whether "
            'the output completed it (complete="false": cut by max tokens or a stop string, not guaranteed valid)',
            ["kind", "complete"],
            registry=r,
        )
        self.constraint_mask_seconds = Histogram(
            "specserve_constraint_mask_seconds",
            "Time computing one round's token masks (every row of its tree) on the coordinator",
            buckets=MASK_BUCKETS_S,
            registry=r,
        )
        self.grammar_compile_seconds = Histogram(
            "specserve_grammar_compile_seconds",
            "Time building a constraint's grammar and matcher, on a cache miss, by kind",
            ["kind"],
            buckets=COMPILE_BUCKETS_S,
            registry=r,
        )
        self.grammar_cache_queries = Counter(
            "specserve_grammar_cache_queries", "Compiled-grammar cache lookups, one per constrained request", registry=r
        )
        self.grammar_cache_hits = Counter(
            "specserve_grammar_cache_hits", "Of those, the grammar was already compiled", registry=r
        )
        self.grammar_compile_failures = Counter(
            "specserve_grammar_compile_failures",
            "Constraints refused before generation (INVALID_ARGUMENT), by kind and reason (too_few_tokens: the "
            "request's token limit is below the constraint's shortest output): " + ", ".join(REFUSAL_REASONS),
            ["kind", "reason"],
            registry=r,
        )
        for kind in DECODING_KINDS:
            self.num_forced_tokens.labels(kind)
        for constraint in CONSTRAINT_KINDS:
            self.grammar_compile_seconds.labels(constraint)
            for complete in ("true", "false"):
                self.constrained_requests.labels(constraint, complete)

        # The drafter: pre-drafting and failures
        self.drafter_trees = Counter(
            "specserve_drafter_trees", "Rounds whose tree the drafter was asked for and gave", registry=r
        )
        self.predraft_hits = Counter(
            "specserve_predraft_hits",
            "Of those, trees the drafter had ready: drafted while the verifier checked the previous round",
            registry=r,
        )
        self.predraft_hidden_seconds = Counter(
            "specserve_predraft_hidden_seconds",
            "Drafting time of pre-drafted trees, hidden behind verification",
            registry=r,
        )
        self.feature_rounds = Counter(
            "specserve_feature_rounds",
            "Rounds whose Verify asked for the target's features, for a drafter's draft head (none where the "
            "round has no draft budget)",
            registry=r,
        )
        self.drafter_drops = Counter(
            "specserve_drafter_drops", "Requests that lost their drafter and finished without it", registry=r
        )
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

        # Discovery of the other tiers through the Kubernetes API (coordinator.discovery, k8s:// targets)
        self.discovery_replicas_gauge = Gauge(
            "specserve_discovery_replicas",
            "Endpoints a k8s:// watch knows, by tier and condition (ready, serving: terminating but still serving, "
            "terminating, not_ready)",
            ["tier", "condition"],
            registry=r,
        )
        self.discovery_watch_restarts = Counter(
            "specserve_discovery_watch_restarts",
            "EndpointSlice watches started again, by tier and reason (closed by the server, expired: 410 Gone "
            "and a relist, error: API server unreachable or failing, retried with backoff)",
            ["tier", "reason"],
            registry=r,
        )
        self.discovery_apply_seconds = Histogram(
            "specserve_discovery_apply_seconds",
            "Time from an EndpointSlice event reaching the coordinator to its router routing by the new set",
            ["tier"],
            buckets=DISCOVERY_BUCKETS_S,
            registry=r,
        )
        self.discovery_first_session_seconds = Histogram(
            "specserve_discovery_first_session_seconds",
            "Time from the event that made an endpoint ready to the first new session routed to it",
            ["tier"],
            buckets=DISCOVERY_BUCKETS_S,
            registry=r,
        )

    def serve(self, port: int, host: str, token: str | None = None) -> None:
        """/metrics on ``host`` (the gRPC server's interface, never all of them unless it is 0.0.0.0); with
        ``token`` (--metrics-token-file), only for callers that send it as a bearer token."""
        serve_metrics(self.registry, port, host, token)

    # ---- admission (coordinator.admission.AdmissionObserver) ----

    def track_admission(self, admission: AdmissionController) -> None:
        """Read the running and waiting gauges from ``admission`` at each scrape."""
        self.num_requests_running.set_function(lambda: admission.running)
        self.num_requests_waiting.set_function(lambda: admission.queued)

    def admitted(self, queue_s: float) -> None:
        self.request_queue_time.observe(queue_s)

    def rejected(self, reason: str) -> None:
        self.admission_rejections.labels(reason).inc()

    # ---- requests (coordinator.frontend.FrontendMetrics) ----

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def observe_request_error(self, code: str) -> None:
        """A request ended with ``code``, a gRPC status name such as "INVALID_ARGUMENT" or "CANCELLED"."""
        self.request_errors.labels(code).inc()

    def observe_finished(self, stats: GenerationStats, e2e_seconds: float) -> None:
        self.e2e_request_latency.observe(e2e_seconds)
        self.request_success.labels(stats.finish_reason.value).inc()
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        kind = "sampled" if stats.sampled else "greedy"
        self.generation_tokens.labels(kind).inc(stats.num_generated_tokens)
        self.rounds.labels(kind).inc(stats.num_rounds)
        self.num_drafts.labels(kind).inc(stats.num_drafts)
        self.num_draft_tokens.labels(kind).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(kind).inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            if count:
                self.num_accepted_tokens_per_pos.labels(kind, str(position)).inc(count)
        self.reprefills.inc(stats.num_reprefills)
        for times in stats.round_phase_ns:
            for phase, ns in zip(PHASES, times, strict=True):
                self.round_phase_seconds.labels(phase).observe(ns / 1e9)
        self.rounds_plain_by_cost.inc(stats.num_rounds_plain_by_cost)
        self.rounds_sent_ahead.inc(stats.num_rounds_sent_ahead)
        self.verify_ahead_withdrawn.inc(stats.num_ahead_withdrawn)
        if stats.constrained:
            self.num_forced_tokens.labels(kind).inc(stats.num_forced_tokens)
            complete = "true" if stats.constraint_complete else "false"
            self.constrained_requests.labels(stats.constraint_kind, complete).inc()
            for mask_ns in stats.mask_ns_per_round:
                self.constraint_mask_seconds.observe(mask_ns / 1e9)
        self.drafter_trees.inc(stats.num_drafter_trees)
        self.predraft_hits.inc(stats.num_predraft_hits)
        self.predraft_hidden_seconds.inc(stats.predraft_hidden_ns / 1e9)
        self.feature_rounds.inc(stats.num_feature_rounds)
        if stats.drafter_error.startswith("drafter dropped"):
            self.drafter_drops.inc()
        elif stats.drafter_error.startswith("drafter skipped"):
            self.drafter_skips.inc()

    # ---- grammar compilation (coordinator.constraints.compiler.CompileObserver) ----

    def grammar_cache_lookup(self, hit: bool) -> None:
        self.grammar_cache_queries.inc()
        if hit:
            self.grammar_cache_hits.inc()

    def grammar_compiled(self, kind: str, seconds: float) -> None:
        self.grammar_compile_seconds.labels(kind).observe(seconds)

    def grammar_refused(self, kind: str, reason: str) -> None:
        self.grammar_compile_failures.labels(kind, reason).inc()

    # ---- the drafter's health check (coordinator.drafter_health) ----

    def drafter_failed(self, reason: str) -> None:
        self.drafter_failures.inc()

    # ---- discovery (coordinator.discovery.DiscoveryObserver) ----

    def discovery_replicas(self, tier: str, counts: Mapping[str, int]) -> None:
        for condition, count in counts.items():
            self.discovery_replicas_gauge.labels(tier, condition).set(count)

    def discovery_watch_restarted(self, tier: str, reason: str) -> None:
        self.discovery_watch_restarts.labels(tier, reason).inc()

    def discovery_acted(self, tier: str, seconds: float) -> None:
        self.discovery_apply_seconds.labels(tier).observe(seconds)

    def discovery_first_session(self, tier: str, seconds: float) -> None:
        self.discovery_first_session_seconds.labels(tier).observe(seconds)
