"""The most speculative decoding can earn on a measured cost curve: ``python -m bench.speculation_ceiling FILE...``.

A verify that scores n tokens costs c(n); plain decoding costs c(1). A round
sends a chain of n - 1 draft tokens; say each is accepted with probability
``alpha`` once its parent was. The round then commits the accepted prefix and
the verifier's own token, (1 - alpha^n) / (1 - alpha) tokens on average, and
costs c(n)/c(1) plain steps. With drafting free and nothing else in the round,
speculation runs at that quotient of plain decoding's speed; the best n gives
the ceiling for that acceptance on this machine. ``alpha`` = 1 (a drafter that
is never wrong: n tokens for c(n)) bounds every drafter and every tree shape,
since no round commits more tokens than it scores. A tree does better than a
chain of its size at the same ``alpha`` only by raising the chance that some
node at each depth is taken, so read ``alpha`` as that per-depth chance.

The acceptance a target needs is the least ``alpha`` at which some measured n
reaches it (``acceptance_needed``). ``bench.verify_cost`` adds these tables
to its report; this command computes them from reports already written.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TARGETS = (1.25, 1.5, 2.0)  # speed-ups over plain decoding; #30 asks 1.8x (three processes) and 2.0x (one)


@dataclass(frozen=True)
class Ceiling:
    alpha: float  # the chance each draft token is accepted after its parent
    tokens: int  # n: the tokens scored by the best round (the pending token and n - 1 drafts)
    committed: float  # tokens a round commits on average at that n
    speedup: float  # committed / (c(n)/c(1)): the speed over plain decoding


def committed(alpha: float, tokens: int) -> float:
    """Expected tokens a round of ``tokens`` scored commits: the accepted drafts and the verifier's own token."""
    if alpha >= 1.0:
        return float(tokens)
    return (1.0 - alpha**tokens) / (1.0 - alpha)


def ceiling(ratios: Mapping[int, float], alpha: float) -> Ceiling:
    """The best chain length on the curve ``ratios`` (n -> c(n)/c(1)) at acceptance ``alpha``."""
    if not ratios:
        raise ValueError("an empty cost curve")
    best = max(ratios, key=lambda n: committed(alpha, n) / ratios[n])
    return Ceiling(alpha, best, committed(alpha, best), committed(alpha, best) / ratios[best])


def acceptance_needed(ratios: Mapping[int, float], target: float, tolerance: float = 1e-4) -> Ceiling | None:
    """The least acceptance at which some round on the curve reaches ``target`` x plain decoding (with that
    round), or None where even a drafter that is never wrong does not."""
    if ceiling(ratios, 1.0).speedup < target:
        return None
    low, high = 0.0, 1.0  # the ceiling grows with alpha: committed(alpha, n) does for every n
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if ceiling(ratios, middle).speedup >= target else (middle, high)
    return ceiling(ratios, high)


def markdown(
    ratios: Mapping[int, float], alphas: Sequence[float] = ALPHAS, targets: Sequence[float] = TARGETS
) -> list[str]:
    """The section ``bench.verify_cost`` adds to its report: the ceiling by acceptance, and what each target needs."""
    lines = [
        "## What speculation can earn on this curve",
        "",
        "A chain of n - 1 drafts, each accepted with probability alpha after its parent, commits "
        "(1 - alpha^n) / (1 - alpha) tokens a round for c(n)/c(1) plain steps; drafting free, the best measured n "
        "(`python -m bench.speculation_ceiling`). alpha = 1 (a drafter never wrong) bounds every drafter and tree.",
        "",
        "| alpha | best n | tokens a round | x plain decoding |",
        "|---|---|---|---|",
    ]
    for alpha in alphas:
        c = ceiling(ratios, alpha)
        lines.append(f"| {alpha:.2f} | {c.tokens} | {c.committed:.2f} | {c.speedup:.2f}x |")
    lines.append("")
    for target in targets:
        needed = acceptance_needed(ratios, target)
        lines.append(
            f"- {target:.2f}x plain decoding: out of reach on this curve, even with every draft accepted"
            if needed is None
            else f"- {target:.2f}x plain decoding needs alpha >= {needed.alpha:.3f} (at n = {needed.tokens})"
        )
    return lines


def curve_of(report: Mapping[str, object]) -> dict[int, float]:
    """The chain curve (n -> c(n)/c(1)) of a ``bench.verify_cost`` JSON report."""
    rows = report.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("not a bench.verify_cost report: it has no rows")
    return {int(row["tokens"]): float(row["ratio"]) for row in rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.speculation_ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="bench.verify_cost JSON reports")
    args = parser.parse_args(argv)
    for path in args.reports:
        try:
            ratios = curve_of(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"{path}: {exc}")
        c1 = ", ".join(f"c({n})/c(1) {r:.2f}" for n, r in sorted(ratios.items()))
        print("\n".join([f"# {path}", "", c1, "", *markdown(ratios), ""]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
