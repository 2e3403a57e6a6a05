"""One record per (mode, prompt): what was produced, how fast, and whether it equals the baseline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .modes import Outcome


@dataclass
class Record:
    mode: str
    category: str
    question_id: int
    prompt_tokens: int
    tokens: int  # output tokens, EOS excluded
    committed: int  # tokens the target committed: the output plus the EOS token when it ended there
    eos: bool
    wall_s: float
    rounds: int  # target forwards that committed tokens
    tau: float  # committed / rounds
    draft_tokens: int | None
    accepted_tokens: int | None
    draft_s: float | None
    verify_s: float | None
    coordination_s: float | None  # wall minus draft and verify: round loop, (de)tokenization, network
    identical: bool | None  # output token-identical to baseline; None without a baseline
    first_diff: int | None  # first output position that differs from the baseline
    baseline_token: int | None  # the baseline's token there (None: the baseline ended before it)
    mode_token: int | None  # this mode's token there (None: this mode ended before it)
    logit_gap: float | None  # the target's top-1 minus top-2 logit there, on the baseline's prefix
    note: str
    token_ids: list[int]
    drafter_trees: int | None = None  # rounds whose tree came from the drafter
    predraft_hits: int | None = None  # of those, trees drafted ahead while the verifier worked
    predraft_hidden_s: float | None = None  # drafting time of those trees, hidden behind verification
    # The rounds' time by phase (coordinator.round_phases), summed over the rounds; None: not observable.
    round_phase_s: dict[str, float] | None = None
    rounds_plain_by_cost: int | None = None  # rounds run plain because drafted rounds did not pay end to end


@dataclass(frozen=True)
class Divergence:
    position: int
    baseline_token: int | None
    mode_token: int | None


def first_divergence(
    baseline: Sequence[int], baseline_eos: bool, other: Sequence[int], other_eos: bool, eos_id: int
) -> Divergence | None:
    """Where two outputs first differ, counting an EOS ending as a token; None when identical."""
    a = [*baseline, eos_id] if baseline_eos else list(baseline)
    b = [*other, eos_id] if other_eos else list(other)
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return Divergence(i, x, y)
    if len(a) == len(b):
        return None
    # One stopped at the length limit where the other went on (cannot happen under the same limit).
    i = min(len(a), len(b))
    return Divergence(i, a[i] if i < len(a) else None, b[i] if i < len(b) else None)


def make_record(
    mode: str,
    category: str,
    question_id: int,
    prompt_tokens: int,
    outcome: Outcome,
    baseline: Outcome | None,
    eos_id: int,
    gap_at: Callable[[int], float | None],
) -> Record:
    """A record; ``gap_at(position)`` gives the target's top-2 logit gap on the baseline prefix of that length
    (None where it means nothing: under sampling outputs differ by design)."""
    committed = len(outcome.tokens) + int(outcome.eos)
    wall_s = outcome.wall_ns / 1e9
    draft_s = None if outcome.draft_ns is None else outcome.draft_ns / 1e9
    verify_s = None if outcome.verify_ns is None else outcome.verify_ns / 1e9
    coordination_s = None if draft_s is None or verify_s is None else max(0.0, wall_s - draft_s - verify_s)
    identical: bool | None = None
    divergence: Divergence | None = None
    if baseline is not None:
        divergence = first_divergence(baseline.tokens, baseline.eos, outcome.tokens, outcome.eos, eos_id)
        identical = divergence is None
    return Record(
        mode=mode,
        category=category,
        question_id=question_id,
        prompt_tokens=prompt_tokens,
        tokens=len(outcome.tokens),
        committed=committed,
        eos=outcome.eos,
        wall_s=wall_s,
        rounds=outcome.rounds,
        tau=committed / outcome.rounds if outcome.rounds else 0.0,
        draft_tokens=outcome.draft_tokens,
        accepted_tokens=outcome.accepted_tokens,
        draft_s=draft_s,
        verify_s=verify_s,
        coordination_s=coordination_s,
        identical=identical,
        first_diff=None if divergence is None else divergence.position,
        baseline_token=None if divergence is None else divergence.baseline_token,
        mode_token=None if divergence is None else divergence.mode_token,
        logit_gap=None if divergence is None else gap_at(divergence.position),
        note=outcome.note,
        token_ids=list(outcome.tokens),
        drafter_trees=outcome.drafter_trees,
        predraft_hits=outcome.predraft_hits,
        predraft_hidden_s=None if outcome.predraft_hidden_ns is None else outcome.predraft_hidden_ns / 1e9,
        round_phase_s=None
        if outcome.round_phase_ns is None
        else {phase: ns / 1e9 for phase, ns in outcome.round_phase_ns.items()},
        rounds_plain_by_cost=outcome.rounds_plain_by_cost,
    )
