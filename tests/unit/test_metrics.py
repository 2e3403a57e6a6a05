from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds import FinishReason, GenerationStats
from target_service.metrics import VerifierMetrics


def test_coordinator_counts_spec_decode_figures() -> None:
    metrics = CoordinatorMetrics()
    stats = GenerationStats(num_generated_tokens=12, num_rounds=5, num_draft_tokens=20, num_accepted_tokens=7)
    stats.finish_reason = FinishReason.EOS
    stats.drafter_error = "drafter dropped: no answer within 1000 ms"
    metrics.observe_finished(stats, 1.0)
    metrics.observe_finished(GenerationStats(num_generated_tokens=3, num_rounds=3), 1.0)
    value = metrics.registry.get_sample_value
    assert value("specserve_requests_total", {"finish_reason": "eos"}) == 1
    assert value("specserve_requests_total", {"finish_reason": "length"}) == 1
    assert value("specserve_generated_tokens_total") == 15
    assert value("specserve_num_accepted_tokens_total") == 7
    assert value("specserve_drafter_drops_total") == 1


def test_verifier_gauges_track_sessions_and_in_flight_calls() -> None:
    metrics = VerifierMetrics()
    value = metrics.registry.get_sample_value
    with metrics.in_flight():
        assert value("specserve_verifier_inflight_requests") == 1
    assert value("specserve_verifier_inflight_requests") == 0
    metrics.sessions(3)
    metrics.verified(num_draft=8, num_accepted=2)
    assert value("specserve_verifier_active_sessions") == 3
    assert value("specserve_verifier_num_draft_tokens_total") == 8
