"""Each tier's metrics: what is observed lands in the series named in docs/metrics.md's table.

Admission's series (running, waiting, queue time, rejections) are checked in test_admission.py.
"""

from __future__ import annotations

import pytest

from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds import FinishReason, GenerationStats
from draft_service.config import DrafterConfig
from draft_service.drafter import NGRAM_SOURCES
from draft_service.main import build_drafter
from draft_service.metrics import DrafterMetrics
from draft_service.namespace_state import NAMESPACE_BYTES
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.metrics import VerifierMetrics
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

GREEDY = SamplingParams()


def test_finished_requests_count_under_vllm_spec_decode_names() -> None:
    metrics = CoordinatorMetrics()
    stats = GenerationStats(
        num_prompt_tokens=9,
        num_generated_tokens=12,
        num_rounds=5,
        num_drafts=4,
        num_draft_tokens=20,
        num_accepted_tokens=7,
        num_accepted_tokens_per_pos=[4, 2, 1],
        num_reprefills=1,
        num_drafter_trees=4,
        num_predraft_hits=3,
        predraft_hidden_ns=250_000_000,
        num_feature_rounds=2,
    )
    stats.finish_reason = FinishReason.EOS
    stats.drafter_error = "drafter dropped: no answer within 1000 ms"
    metrics.observe_finished(stats, e2e_seconds=1.5)
    metrics.observe_finished(GenerationStats(num_generated_tokens=3, num_rounds=3), e2e_seconds=0.2)
    sampled = GenerationStats(num_generated_tokens=6, num_rounds=4, num_drafts=2, num_draft_tokens=8, sampled=True)
    sampled.num_accepted_tokens, sampled.num_accepted_tokens_per_pos = 2, [2]
    metrics.observe_finished(sampled, e2e_seconds=0.3)
    value = metrics.registry.get_sample_value
    for name, greedy, by_sampling in (
        ("specserve_generation_tokens_total", 15, 6),
        ("specserve_rounds_total", 8, 4),
        ("specserve_spec_decode_num_drafts_total", 4, 2),
        ("specserve_spec_decode_num_draft_tokens_total", 20, 8),
        ("specserve_spec_decode_num_accepted_tokens_total", 7, 2),
    ):
        assert value(name, {"decoding": "greedy"}) == greedy, name
        assert value(name, {"decoding": "sampled"}) == by_sampling, name
    assert value("specserve_request_success_total", {"finished_reason": "eos"}) == 1
    assert value("specserve_request_success_total", {"finished_reason": "length"}) == 2
    assert value("specserve_request_success_total", {"finished_reason": "stop"}) == 0  # exists before the first
    assert value("specserve_prompt_tokens_total") == 9
    per_pos = "specserve_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, {"decoding": "greedy", "position": str(i)}) for i in range(4)] == [4, 2, 1, None]
    assert [value(per_pos, {"decoding": "sampled", "position": str(i)}) for i in range(2)] == [2, None]
    assert value("specserve_reprefills_total") == 1
    assert value("specserve_drafter_trees_total") == 4
    assert value("specserve_predraft_hits_total") == 3
    assert value("specserve_predraft_hidden_seconds_total") == pytest.approx(0.25)
    assert value("specserve_feature_rounds_total") == 2
    assert value("specserve_drafter_drops_total") == 1
    assert value("specserve_drafter_skips_total") == 0
    assert value("specserve_e2e_request_latency_seconds_count") == 3
    assert value("specserve_e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value("specserve_e2e_request_latency_seconds_bucket", {"le": "1.0"}) == 2


def test_constrained_requests_count_forced_tokens_kinds_and_mask_time_per_round() -> None:
    metrics = CoordinatorMetrics()
    json_request = GenerationStats(num_generated_tokens=10, num_rounds=4, num_accepted_tokens=6)
    json_request.constrained, json_request.constraint_kind, json_request.constraint_complete = True, "json_schema", True
    json_request.num_forced_tokens = 5
    json_request.mask_ns_per_round = [20_000, 40_000, 300_000, 3_000_000]
    cut = GenerationStats(num_generated_tokens=4, num_rounds=4, sampled=True, constrained=True)
    cut.constraint_kind, cut.num_forced_tokens, cut.mask_ns_per_round = "regex", 1, [20_000] * 4
    for stats in (json_request, cut, GenerationStats(num_generated_tokens=3, num_rounds=3)):
        metrics.observe_finished(stats, e2e_seconds=0.5)
    value = metrics.registry.get_sample_value
    forced = "specserve_spec_decode_num_forced_tokens_total"
    assert (value(forced, {"decoding": "greedy"}), value(forced, {"decoding": "sampled"})) == (5, 1)
    requests = "specserve_constrained_requests_total"
    assert value(requests, {"kind": "json_schema", "complete": "true"}) == 1
    assert value(requests, {"kind": "regex", "complete": "false"}) == 1  # cut short: not guaranteed valid
    for kind in ("json_schema", "regex", "lark_grammar", "choice"):  # every series exists from the start
        assert value(requests, {"kind": kind, "complete": "false"}) is not None
    mask = "specserve_constraint_mask_seconds"
    assert value(f"{mask}_count") == 8  # one per constrained round; the free-text request has none
    assert value(f"{mask}_sum") == pytest.approx(3.44e-3)
    assert (value(f"{mask}_bucket", {"le": "2.5e-05"}), value(f"{mask}_bucket", {"le": "0.001"})) == (5, 7)


def test_grammar_compiles_cache_hits_and_refusals() -> None:
    metrics = CoordinatorMetrics()
    for hit in (False, True, True):
        metrics.grammar_cache_lookup(hit)
    metrics.grammar_compiled("json_schema", 0.0008)
    metrics.grammar_refused("regex", "regex_syntax")
    value = metrics.registry.get_sample_value
    assert (value("specserve_grammar_cache_queries_total"), value("specserve_grammar_cache_hits_total")) == (3, 2)
    compile_s = "specserve_grammar_compile_seconds"
    assert value(f"{compile_s}_bucket", {"kind": "json_schema", "le": "0.001"}) == 1
    assert value(f"{compile_s}_count", {"kind": "choice"}) == 0
    failures = "specserve_grammar_compile_failures_total"
    assert value(failures, {"kind": "regex", "reason": "regex_syntax"}) == 1


def test_latencies_and_errors_land_in_their_buckets() -> None:
    metrics = CoordinatorMetrics()
    metrics.observe_first_token(0.03)
    for gap in (0.004, 0.004, 0.2):
        metrics.observe_inter_token(gap)
    metrics.observe_request_error("INVALID_ARGUMENT")
    metrics.observe_request_error("INVALID_ARGUMENT")
    metrics.observe_request_error("CANCELLED")
    metrics.drafter_failed("timeout")
    value = metrics.registry.get_sample_value
    ttft = "specserve_time_to_first_token_seconds_bucket"
    assert (value(ttft, {"le": "0.02"}), value(ttft, {"le": "0.04"})) == (0, 1)
    itl = "specserve_inter_token_latency_seconds_bucket"
    assert (value(itl, {"le": "0.0025"}), value(itl, {"le": "0.005"}), value(itl, {"le": "0.2"})) == (0, 2, 3)
    assert value("specserve_inter_token_latency_seconds_count") == 3
    assert value("specserve_request_errors_total", {"code": "INVALID_ARGUMENT"}) == 2
    assert value("specserve_request_errors_total", {"code": "CANCELLED"}) == 1
    assert value("specserve_drafter_failures_total") == 1


class FakeClock:
    """Nanoseconds that move only when the test moves them: the verifier's times are then exact, whatever the load."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += round(seconds * 1e9)


def test_a_call_queued_behind_its_own_sessions_call_waits_from_when_that_one_ended() -> None:
    # A round sent ahead (the coordinator's ``_send_ahead``) cannot run before the round it follows: the verifier
    # queue time it reports, and the metric, is its wait for the engine after that, not the previous round's step.
    clock = FakeClock()
    verifier = Verifier(tiny_llama(vocab_size=48, seed=3), "fp", max_tree_nodes=8, kv_cache_bytes=2**20, clock=clock)
    metrics = VerifierMetrics()
    metrics.track(verifier)
    try:
        verifier.prefill("a", [1, 2, 3, 4, 5], GREEDY)
        assert verifier.wait_idle()
        with verifier.paused():
            first = verifier.submit_verify("a", 5, TokenTree())
            ahead = verifier.submit_verify("a", 6, TokenTree())  # on the session the first one leaves
            clock.advance(0.03)
        assert first.result(timeout=30).queue_ns == 30_000_000
        assert ahead.result(timeout=30).queue_ns == 0  # runnable when the first one's step ended, and run at once
        assert verifier.wait_idle()
        queue = "specserve_verifier_request_queue_time_seconds"
        assert metrics.registry.get_sample_value(f"{queue}_sum", {"call": "verify"}) == 0.03
    finally:
        verifier.close()


def test_verifier_observes_every_engine_step_once() -> None:
    clock = FakeClock()
    verifier = Verifier(tiny_llama(vocab_size=48, seed=3), "fp", max_tree_nodes=8, kv_cache_bytes=2**20, clock=clock)
    metrics = VerifierMetrics()
    value = metrics.registry.get_sample_value
    assert value("specserve_verifier_kv_cache_usage_perc") is None  # no engine yet: the model is loading
    metrics.track(verifier)
    try:
        verifier.prefill("a", [1, 2, 3, 4, 5], GREEDY)  # a step of 4 tokens (the last one stays pending)
        verifier.prefill("b", [1, 2, 3], GREEDY)  # a step of 2
        assert verifier.wait_idle()  # the second step has read its end time: the clock may move now
        with verifier.paused():
            first = verifier.submit_verify("a", 5, TokenTree.chain([6, 7, 8]))  # pending token + 3 nodes
            second = verifier.submit_verify("b", 3, TokenTree())  # pending token alone
            clock.advance(0.03)  # both wait for the engine exactly this long
        assert (first.result(timeout=30).queue_ns, second.result(timeout=30).queue_ns) == (30_000_000, 30_000_000)
        assert verifier.wait_idle()  # the step's observers (the metrics) run after it has answered its calls
        assert value("specserve_verifier_iteration_tokens_total_count") == 3
        assert value("specserve_verifier_iteration_tokens_total_sum") == 4 + 2 + 5
        assert value("specserve_verifier_iteration_sessions_sum") == 1 + 1 + 2
        assert value("specserve_verifier_iteration_sessions_bucket", {"le": "1.0"}) == 2
        queue = "specserve_verifier_request_queue_time_seconds"
        assert value(f"{queue}_count", {"call": "prefill"}) == 2
        assert value(f"{queue}_count", {"call": "verify"}) == 2
        assert value(f"{queue}_sum", {"call": "prefill"}) == 0  # each prefill's step began as it was queued
        assert value(f"{queue}_sum", {"call": "verify"}) == 0.03 + 0.03
        assert value(f"{queue}_bucket", {"call": "verify", "le": "0.025"}) == 0
        assert value(f"{queue}_bucket", {"call": "verify", "le": "0.05"}) == 2
        step = "specserve_verifier_engine_step_seconds"
        assert value(f"{step}_count") == 3
        assert value(f"{step}_sum") == 0  # the clock stood still inside every step
        stats = verifier.stats()
        assert value("specserve_verifier_kv_cache_usage_perc") == stats.kv_used_bytes / stats.kv_capacity_bytes > 0
        assert value("specserve_verifier_kv_cache_capacity_bytes") == stats.kv_capacity_bytes
        assert value("specserve_verifier_active_sessions") == 2
        assert value("specserve_verifier_num_requests_waiting") == 0
        verifier.release("a")
        assert value("specserve_verifier_active_sessions") == 1
        assert value("specserve_verifier_session_evictions_total") == 0
    finally:
        verifier.close()


def test_verifier_in_flight_gauge() -> None:
    metrics = VerifierMetrics()
    value = metrics.registry.get_sample_value
    with metrics.in_flight():
        assert value("specserve_verifier_inflight_requests") == 1
    assert value("specserve_verifier_inflight_requests") == 0


def test_drafter_exports_its_pre_drafting_totals_and_memory() -> None:
    drafter, pools = build_drafter(DrafterConfig(sources=NGRAM_SOURCES))
    metrics = DrafterMetrics(drafter.memory, pools, drafter.predraft_counts, drafter.gate_counts)
    value = metrics.registry.get_sample_value
    drafter.predraft_counts.drafted += 5
    drafter.predraft_counts.used += 2
    drafter.predraft_counts.dropped += 1
    drafter.gate_counts.ran += 4
    drafter.gate_counts.skipped += 9
    drafter.gate_counts.warm_ups_skipped += 3
    drafter.open_session("s", [1, 2, 3], "fp")
    assert value("specserve_drafter_predrafts_total") == 5
    assert value("specserve_drafter_predraft_hits_total") == 2
    assert value("specserve_drafter_work_ahead_dropped_total") == 1
    assert value("specserve_drafter_draft_head_rounds_total") == 4
    assert value("specserve_drafter_draft_head_skips_total") == 9
    assert value("specserve_drafter_draft_head_warm_ups_skipped_total") == 3
    assert value("specserve_drafter_open_sessions") == 1
    assert (value("specserve_drafter_memory_bytes", {"kind": "sessions"}) or 0) > 0
    assert value("specserve_drafter_memory_bytes", {"kind": "namespaces"}) == NAMESPACE_BYTES
    assert value("specserve_drafter_namespaces") == 1
    assert value("specserve_drafter_sessions_forgotten_total") == 0
    assert value("specserve_drafter_namespaces_forgotten_total") == 0
