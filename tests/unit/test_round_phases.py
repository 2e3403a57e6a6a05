"""Where a round's time goes: the phases add up to the round, and each tier's histogram gets its part."""

from __future__ import annotations

import asyncio

from coordinator import round_phases
from coordinator.metrics import CoordinatorMetrics
from coordinator.round_phases import PHASES, RoundPhases, mean_ms_per_round, phase_totals
from coordinator.rounds import GenerationStats
from draft_service.config import DrafterConfig
from draft_service.drafter import NGRAM_SOURCES
from draft_service.main import build_drafter
from draft_service.metrics import DrafterMetrics
from target_service.metrics import VerifierMetrics
from target_service.verifier import EngineStep

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_a_rounds_phases_add_up_to_its_time_and_the_rest_is_the_loop() -> None:
    clock = Clock()
    phases = RoundPhases(clock)
    clock.ns += 1 * MS  # bookkeeping before the drafter is asked
    with round_phases.protobuf(clock):
        clock.ns += 2 * MS  # encoding the proposal
    clock.ns += 5 * MS  # the rest of the wait for the tree
    phases.drafted(waited_ns=7 * MS, drafter_ns=4 * MS, protobuf_ns=2 * MS)
    with phases.span("tree_and_masks"):
        clock.ns += 3 * MS
    before = phases.protobuf_ns
    with round_phases.protobuf(clock):
        clock.ns += 1 * MS  # encoding the Verify
    clock.ns += 20 * MS
    phases.verified(call_ns=21 * MS, protobuf_ns=phases.protobuf_ns - before, verify_ns=18 * MS, queue_ns=5 * MS)
    clock.ns += 2 * MS  # commit and detokenize
    times = dict(zip(PHASES, phases.end(), strict=True))
    assert times == {
        "drafter": 4 * MS,
        "draft_transport": 1 * MS,
        "tree_and_masks": 3 * MS,
        "protobuf": 3 * MS,
        "verifier_queue": 5 * MS,
        "verifier_step": 13 * MS,
        "verify_transport": 2 * MS,
        "loop": 3 * MS,
    }
    assert sum(times.values()) == clock.ns


def test_protobuf_work_outside_a_round_counts_nowhere() -> None:
    clock = Clock()
    phases = RoundPhases(clock)
    phases.end()
    with round_phases.protobuf(clock):  # e.g. the final report to the drafter, after the last round
        clock.ns += 5 * MS
    assert phases.protobuf_ns == 0


def test_each_task_counts_its_own_rounds_protobuf() -> None:
    """Sessions share the event loop: a round sees only its own task's protobuf work."""
    clock = Clock()

    async def round_of(ms: int) -> int:
        phases = RoundPhases(clock)
        for _ in range(3):
            with round_phases.protobuf(clock):
                clock.ns += ms * MS
            await asyncio.sleep(0)  # the other session runs
        return phases.end()[PHASES.index("protobuf")]

    async def both() -> list[int]:
        return list(await asyncio.gather(round_of(1), round_of(10)))

    assert asyncio.run(both()) == [3 * MS, 30 * MS]


def test_totals_and_means_per_round() -> None:
    rounds = [tuple(range(len(PHASES))), tuple(2 * i for i in range(len(PHASES)))]
    totals = phase_totals(rounds)
    assert totals["drafter"] == 0 and totals["loop"] == 3 * (len(PHASES) - 1)
    means = mean_ms_per_round({"verifier_step": 30 * MS}, 3)
    assert means["verifier_step"] == 10.0 and means["drafter"] == 0.0
    assert mean_ms_per_round({"loop": 1}, 0)["loop"] == 0.0


def test_the_coordinator_observes_every_round_in_each_phases_histogram() -> None:
    metrics = CoordinatorMetrics()
    value = metrics.registry.get_sample_value
    stats = GenerationStats(round_phase_ns=[(1 * MS,) * len(PHASES), (3 * MS,) * len(PHASES)])
    stats.num_rounds_plain_by_cost = 5
    stats.num_rounds_sent_ahead, stats.num_ahead_withdrawn = 7, 1
    metrics.observe_finished(stats, 1.0)
    for phase in PHASES:
        assert value("specserve_round_phase_seconds_count", {"phase": phase}) == 2
        assert value("specserve_round_phase_seconds_sum", {"phase": phase}) == 0.004
    assert value("specserve_rounds_plain_by_cost_total") == 5
    assert (value("specserve_rounds_sent_ahead_total"), value("specserve_verify_ahead_withdrawn_total")) == (7, 1)


def test_the_verifier_observes_each_engine_steps_time() -> None:
    metrics = VerifierMetrics()
    metrics.engine_step(EngineStep(2, 9, step_s=0.02))
    metrics.engine_step(EngineStep(1, 1, step_s=0.01))
    value = metrics.registry.get_sample_value
    assert value("specserve_verifier_engine_step_seconds_count") == 2
    assert value("specserve_verifier_engine_step_seconds_sum") == 0.03


def test_the_drafter_observes_each_proposals_time_in_draft() -> None:
    drafter, pools = build_drafter(DrafterConfig(sources=NGRAM_SOURCES))
    metrics = DrafterMetrics(drafter.memory, pools, drafter.predraft_counts, drafter.gate_counts)
    metrics.observe_propose(0.004)
    value = metrics.registry.get_sample_value
    assert value("specserve_drafter_propose_seconds_count") == 1
    assert value("specserve_drafter_propose_seconds_sum") == 0.004
