"""Per mode, per category (and MT-Bench, Spec-Bench overall, and each repetitive workload) summaries of the records.

Ratios are ratios of sums (total tokens over total time, total committed
tokens over total rounds), so long prompts weigh what they cost; the median
of per-prompt speedups is reported next to the ratio of total times.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .dataset import CATEGORIES, TASKS, WORKLOAD_CATEGORIES, WORKLOADS
from .records import Record

OVERALL = "overall"


@dataclass(frozen=True)
class Summary:
    mode: str
    group: str  # a category, "mt_bench", "overall" (Spec-Bench's) or a workload ("code_edit", "agent_loop")
    prompts: int
    tokens: int
    committed: int
    rounds: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None  # baseline's total time / this mode's, on the same prompts
    median_speedup: float | None  # median over prompts of baseline time / this mode's time
    tau: float  # committed tokens per target forward
    draft_tokens: int | None
    accepted_tokens: int | None
    acceptance_rate: float | None  # accepted / proposed draft tokens
    ms_per_round: float
    draft_ms_per_round: float | None
    verify_ms_per_round: float | None
    coordination_ms_per_round: float | None
    identical: int  # prompts whose output equals the baseline's token for token
    compared: int  # prompts compared with the baseline
    predraft_hit_rate: float | None = None  # drafter trees that were drafted ahead / all drafter trees
    hidden_draft_ms_per_round: float | None = None  # drafting time hidden behind verification, per round


def groups_of(categories: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(group, its categories): each category, MT-Bench when any of its categories ran, Spec-Bench's overall when
    any of its categories ran, and each repetitive workload that ran under its own name.

    A workload's overall is kept apart from Spec-Bench's: text that repeats the prompt lifts acceptance far above
    Spec-Bench's, and one average over both would say neither.
    """
    present = [c for c in (*CATEGORIES, *WORKLOAD_CATEGORIES) if c in categories]
    groups = [(c, [c]) for c in present]
    mt_bench = [c for c in TASKS["mt_bench"] if c in present]
    if mt_bench:
        groups.append(("mt_bench", mt_bench))
    spec_bench = [c for c in present if c in CATEGORIES]
    if spec_bench:
        groups.append((OVERALL, spec_bench))
    for workload, members in WORKLOADS.items():
        ran = [c for c in members if c in present]
        if ran:
            groups.append((workload, ran))
    return groups


def _sum_or_none(values: Sequence[float | int | None]) -> float | None:
    if any(v is None for v in values):
        return None
    return float(sum(v for v in values if v is not None))


def _per_round_ms(total_s: float | None, rounds: int) -> float | None:
    return None if total_s is None or not rounds else total_s * 1000 / rounds


def summarize(mode: str, group: str, records: Sequence[Record], baseline: dict[tuple[str, int], Record]) -> Summary:
    """Summary of ``records`` (one mode, one group); ``baseline`` maps (category, question_id) to its record."""
    tokens = sum(r.tokens for r in records)
    committed = sum(r.committed for r in records)
    rounds = sum(r.rounds for r in records)
    wall_s = sum(r.wall_s for r in records)
    paired = [(baseline[(r.category, r.question_id)], r) for r in records if (r.category, r.question_id) in baseline]
    speedup = median_speedup = None
    if paired and len(paired) == len(records):
        speedup = sum(b.wall_s for b, _ in paired) / sum(r.wall_s for _, r in paired)
        median_speedup = statistics.median(b.wall_s / r.wall_s for b, r in paired)
    draft_tokens = _sum_or_none([r.draft_tokens for r in records])
    accepted_tokens = _sum_or_none([r.accepted_tokens for r in records])
    return Summary(
        mode=mode,
        group=group,
        prompts=len(records),
        tokens=tokens,
        committed=committed,
        rounds=rounds,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s else 0.0,
        speedup=speedup,
        median_speedup=median_speedup,
        tau=committed / rounds if rounds else 0.0,
        draft_tokens=None if draft_tokens is None else int(draft_tokens),
        accepted_tokens=None if accepted_tokens is None else int(accepted_tokens),
        acceptance_rate=accepted_tokens / draft_tokens if draft_tokens and accepted_tokens is not None else None,
        ms_per_round=wall_s * 1000 / rounds if rounds else 0.0,
        draft_ms_per_round=_per_round_ms(_sum_or_none([r.draft_s for r in records]), rounds),
        verify_ms_per_round=_per_round_ms(_sum_or_none([r.verify_s for r in records]), rounds),
        coordination_ms_per_round=_per_round_ms(_sum_or_none([r.coordination_s for r in records]), rounds),
        identical=sum(1 for r in records if r.identical),
        compared=sum(1 for r in records if r.identical is not None),
        predraft_hit_rate=_ratio(
            _sum_or_none([r.predraft_hits for r in records]), _sum_or_none([r.drafter_trees for r in records])
        ),
        hidden_draft_ms_per_round=_per_round_ms(_sum_or_none([r.predraft_hidden_s for r in records]), rounds),
    )


def _ratio(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else part / whole


def summarize_all(records: Sequence[Record], modes: Sequence[str]) -> list[Summary]:
    """Summaries for every mode and group, modes in the given order."""
    baseline = {(r.category, r.question_id): r for r in records if r.mode == "baseline"}
    categories = sorted({r.category for r in records})
    summaries = []
    for mode in modes:
        mine = [r for r in records if r.mode == mode]
        for group, members in groups_of(categories):
            selected = [r for r in mine if r.category in members]
            if selected:
                summaries.append(summarize(mode, group, selected, baseline))
    return summaries
