"""Where a round's time goes, per mode: mean milliseconds per round in each phase (``coordinator.round_phases``).

The round loop times each round's phases (the drafter's own time, the hop to it, tree and mask work,
protobuf, the verifier's queue and step, the hop to the verifier, the coordinator's loop) and a request's
stats carry their sums; ``bench.run`` prints this table per mode and writes it into ``spec_bench.md``.
Plain-decoding modes have no round loop: their row shows the wall time per round alone. ``python -m
bench.round_breakdown spec_bench.json`` prints it again from a run's records.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.round_phases import PHASES, mean_ms_per_round

from .records import Record


@dataclass(frozen=True)
class ModeBreakdown:
    mode: str
    rounds: int
    tau: float  # tokens committed per round
    wall_ms_per_round: float  # the requests' wall time (prefill and streaming included) over their rounds
    phase_ms: dict[str, float] | None  # mean per round by phase; None: the mode has no round loop
    plain_by_cost: int | None  # rounds run plain because drafted rounds did not pay end to end


def breakdown(records: Sequence[Record], modes: Sequence[str]) -> list[ModeBreakdown]:
    """One row per mode of ``modes`` that has records."""
    rows: list[ModeBreakdown] = []
    for mode in modes:
        mine = [r for r in records if r.mode == mode]
        rounds = sum(r.rounds for r in mine)
        if not mine or not rounds:
            continue
        timed = [r.round_phase_s for r in mine if r.round_phase_s is not None]
        phase_ms = None
        if len(timed) == len(mine):
            totals = {phase: sum(t.get(phase, 0.0) for t in timed) * 1e9 for phase in PHASES}
            phase_ms = mean_ms_per_round(totals, rounds)
        plain = [r.rounds_plain_by_cost for r in mine if r.rounds_plain_by_cost is not None]
        rows.append(
            ModeBreakdown(
                mode,
                rounds,
                sum(r.committed for r in mine) / rounds,
                sum(r.wall_s for r in mine) * 1e3 / rounds,
                phase_ms,
                sum(plain) if len(plain) == len(mine) else None,
            )
        )
    return rows


def table(records: Sequence[Record], modes: Sequence[str]) -> list[str]:
    """The breakdown as a markdown table (empty when no mode has records)."""
    rows = breakdown(records, modes)
    if not rows:
        return []
    header = ["Mode", "rounds", "τ", "wall ms / round", "phases ms / round", *PHASES, "plain by cost"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        phases = row.phase_ms
        cells = [
            f"`{row.mode}`",
            str(row.rounds),
            f"{row.tau:.2f}",
            f"{row.wall_ms_per_round:.2f}",
            "-" if phases is None else f"{sum(phases.values()):.2f}",
            *("-" if phases is None else f"{phases[phase]:.2f}" for phase in PHASES),
            "-" if row.plain_by_cost is None else str(row.plain_by_cost),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def section(records: Sequence[Record], modes: Sequence[str]) -> list[str]:
    """The report's section: a heading, how to read it, the table."""
    lines = table(records, modes)
    if not lines:
        return []
    return [
        "## Where a round's time goes (mean ms per round)",
        "",
        "Each phase is summed over the requests' rounds and divided by their rounds; the phases add up to the "
        "rounds' own time (`phases ms / round`), the wall time adds the prefill and streaming. `drafter`: the "
        "drafter's time answering; `draft_transport`: the rest of the wait for the tree; `verifier_queue` and "
        "`verifier_step`: the verifier's own time for the Verify call; `verify_transport`: the rest of the call; "
        "`loop`: the coordinator's event loop and bookkeeping. `plain by cost`: rounds run plain because the "
        "session's drafted rounds did not pay end to end (docs/benchmarks.md).",
        "",
        *lines,
        "",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv) or ["bench/out/spec_bench.json"]
    for name in paths:
        document = json.loads(Path(name).read_text())
        records = [Record(**r) for r in document["records"]]
        modes = document["meta"]["settings"]["modes"]
        print("\n".join(table(records, modes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
