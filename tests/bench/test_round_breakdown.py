"""The round breakdown's table: mean ms per round per phase, per mode, from a run's records."""

from __future__ import annotations

from dataclasses import replace

from bench import round_breakdown
from bench.records import Record
from coordinator.round_phases import PHASES

BASE = Record(
    mode="baseline",
    category="writing",
    question_id=1,
    prompt_tokens=10,
    tokens=20,
    committed=20,
    eos=False,
    wall_s=0.4,
    rounds=20,
    tau=1.0,
    draft_tokens=0,
    accepted_tokens=0,
    draft_s=0.0,
    verify_s=0.38,
    coordination_s=0.02,
    identical=None,
    first_diff=None,
    baseline_token=None,
    mode_token=None,
    logit_gap=None,
    note="",
    token_ids=[],
)


def spread(total_s: float) -> dict[str, float]:
    """``total_s`` spread evenly over the phases."""
    return dict.fromkeys(PHASES, total_s / len(PHASES))


def test_each_mode_gets_its_mean_per_round_and_plain_modes_their_wall_time_alone() -> None:
    records = [
        BASE,
        replace(BASE, question_id=2, wall_s=0.2),
        replace(BASE, mode="distributed", rounds=10, wall_s=0.5, round_phase_s=spread(0.4), rounds_plain_by_cost=3),
        replace(BASE, mode="distributed", question_id=2, rounds=10, round_phase_s=spread(0.4), rounds_plain_by_cost=1),
    ]
    rows = {row.mode: row for row in round_breakdown.breakdown(records, ["baseline", "distributed", "inproc"])}
    assert set(rows) == {"baseline", "distributed"}  # a mode without records has no row
    assert rows["baseline"].phase_ms is None and abs(rows["baseline"].wall_ms_per_round - 15.0) < 1e-9
    distributed = rows["distributed"]
    assert distributed.rounds == 20 and distributed.plain_by_cost == 4 and distributed.tau == 2.0
    assert distributed.phase_ms is not None
    assert abs(sum(distributed.phase_ms.values()) - 40.0) < 1e-9  # 0.8 s of phases over 20 rounds
    assert abs(distributed.phase_ms["verifier_step"] - 40.0 / len(PHASES)) < 1e-9


def test_the_report_section_lists_every_phase_as_a_column() -> None:
    records = [BASE, replace(BASE, mode="inproc", round_phase_s=spread(0.2), rounds_plain_by_cost=0)]
    lines = round_breakdown.section(records, ["baseline", "inproc"])
    header = next(line for line in lines if line.startswith("| Mode"))
    assert all(f" {phase} " in header for phase in PHASES)
    inproc = next(line for line in lines if line.startswith("| `inproc`"))
    assert "| 10.00 |" in inproc  # phases ms / round: 0.2 s over 20 rounds
    assert round_breakdown.section([], ["baseline"]) == []
