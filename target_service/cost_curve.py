"""The verifier's cost curve: what one forward costs by the tokens it scores, measured at start-up.

A step of L sessions scoring T tokens in all, each over C cached tokens, costs about
c(T) + L * s + T * (C - C0) * r: ``c`` is the measured forward by tokens scored (piecewise linear
in the timed sizes), ``s`` the extra time per session sharing the forward, and ``r`` what attention
adds per row and per cached token beyond the context ``C0`` the sizes were timed over. The budget
policy (``budget_policy``) sizes trees with it and drafters cut their trees with its ratios.

Timings are the least of several sweeps over all the sizes in turn, each size timed again while it
stays far above linear growth from the one before: another process taking the cores for a moment
then slows one timing, not the whole curve.
"""

from __future__ import annotations

import bisect
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward by tokens scored, plus seconds per session sharing it and per cached token.

    The sizes are timed over ``context`` cached tokens. Attention makes every scored row cost more over a
    longer context, about linearly in the cached tokens it reads: ``per_row_context_s`` is that slope, per
    row and per cached token beyond ``context``. A tree over a long prompt costs more than the curve at
    ``context`` says, and each of its rows more than a plain step's one row does.
    """

    tokens: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]
    per_session_s: float = 0.0
    context: int = 0  # cached tokens under each timed size
    per_row_context_s: float = 0.0  # extra seconds a row costs per cached token beyond ``context`` (0: not measured)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a cost curve needs one time per measured size")

    def forward_s(self, tokens: int) -> float:
        """Piecewise-linear in the measured points; extrapolated with the last slope beyond them."""
        xs, ys = self.tokens, self.seconds
        if tokens <= xs[0] or len(xs) == 1:
            return ys[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def step_s(self, sessions: int, tokens: int, context: int = 0) -> float:
        """A step of ``sessions`` scoring ``tokens`` in all, each over ``context`` cached tokens (0: the curve's)."""
        longer = max(0, context - self.context)  # a shorter context costs a little less: not modelled, a margin
        return self.forward_s(tokens) + sessions * self.per_session_s + tokens * longer * self.per_row_context_s

    def plausible(self) -> bool:
        """No size costs more than ``STALL_FACTOR`` times linear growth from the one before (a stalled timing)."""
        pairs = zip(self.tokens, self.seconds, self.tokens[1:], self.seconds[1:], strict=False)
        return all(s1 <= STALL_FACTOR * s0 * n1 / n0 for n0, s0, n1, s1 in pairs)

    def to_json(self) -> str:
        fields = ("tokens", "seconds", "per_session_s", "context", "per_row_context_s")
        return json.dumps({name: getattr(self, name) for name in fields})

    @classmethod
    def from_json(cls, text: str) -> CostCurve:
        """Parse what ``to_json`` wrote; ValueError on anything else."""
        try:
            data = json.loads(text)
            return cls(
                tuple(map(int, data["tokens"])),
                tuple(map(float, data["seconds"])),
                float(data["per_session_s"]),
                int(data["context"]),
                float(data["per_row_context_s"]),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a cost curve: {exc}") from exc

    def ratios(self) -> dict[int, float]:
        """c(n) / c(first) for every measured n (for logs and VerifierInfo)."""
        return {n: s / self.seconds[0] for n, s in zip(self.tokens, self.seconds, strict=True)}

    def verify_cost(self) -> dict[int, float]:
        """Relative cost by draft nodes (tokens scored minus the pending one), as drafters cut trees with it.

        Empty when this is no measurement (one point, as ``flat_curve``): a drafter then keeps its own curve.
        """
        if len(self.tokens) < 2 or self.tokens[0] != 1:
            return {}
        return {n - 1: ratio for n, ratio in self.ratios().items()}


def flat_curve() -> CostCurve:
    """Extra rows cost nothing: budgets are bounded by the tree limits alone (used before profiling)."""
    return CostCurve((1,), (1.0,))


def flattened(curve: CostCurve) -> CostCurve:
    """``curve`` with every measured size costing what its first does: extra draft nodes free, as on a GPU.

    For a small model on a GPU the curve is nearly flat over tree sizes, so
    trees are bounded by the tree limits; a benchmark uses this on a CPU to see
    the acceptance that such trees reach (at the CPU's throughput cost).
    """
    return CostCurve(curve.tokens, (curve.seconds[0],) * len(curve.tokens), curve.per_session_s)


# A size costing more than this times linear growth from the size before it was measured while something
# else held the cores (rows cost at most linearly). It is timed again, up to STALL_RETRIES times, keeping the
# least time.
STALL_FACTOR = 1.5
STALL_RETRIES = 3


def fastest_in_turn(
    points: Sequence[T], run: Callable[[T], None], repeats: int, clock: Callable[[], float]
) -> dict[T, float]:
    """Each point's least time over ``repeats`` sweeps of all the points in turn (no warm-up: the caller's)."""
    best = dict.fromkeys(points, float("inf"))
    for _ in range(repeats):
        for point in points:
            start = clock()
            run(point)
            best[point] = min(best[point], clock() - start)
    return best


def measure_curve(
    run: Callable[[int, int], None],
    sizes: Sequence[int],
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> CostCurve:
    """Time ``run(sessions, tokens)``: one session with each of ``sizes`` tokens, then 8 one-token sessions.

    Each point is the minimum of ``repeats`` runs after a warm-up run. The sizes are swept ``repeats`` times
    in turn rather than each timed ``repeats`` times in a row: a process that takes the cores for a few
    seconds (``make run`` starts the drafter and the coordinator beside the verifier) then slows one sweep,
    not every timing of the one-token step, which would make every ratio to it look cheap.
    A point still far above linear growth from the one before is timed again (``STALL_FACTOR``);
    ``CostCurve.plausible`` says whether one still is.
    """

    def timed_once(sessions: int, tokens: int) -> float:
        start = clock()
        run(sessions, tokens)
        return clock() - start

    def timed(sessions: int, tokens: int) -> float:
        run(sessions, tokens)
        return min(timed_once(sessions, tokens) for _ in range(repeats))

    ordered = sorted(set(sizes))
    for n in ordered:  # warm-up
        run(1, n)
    best = fastest_in_turn(ordered, lambda n: run(1, n), repeats, clock)
    seconds: list[float] = []
    for i, n in enumerate(ordered):
        took = best[n]
        for _ in range(STALL_RETRIES):
            if not seconds or took <= STALL_FACTOR * seconds[-1] * n / ordered[i - 1]:
                break
            took = min(took, timed(1, n))
        seconds.append(took)
    # More tokens never cost less: a dip is noise (another process took the cores for a moment).
    seconds = list(itertools.accumulate(seconds, max))
    curve = CostCurve(tuple(ordered), tuple(seconds))
    many = 8
    per_session = max(0.0, (timed(many, many) - curve.forward_s(many)) / (many - 1))
    return CostCurve(curve.tokens, curve.seconds, per_session)


def measure_context_cost(
    run: Callable[[int, int], None],
    sizes: Sequence[int],
    contexts: tuple[int, int],
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds a scored row costs per cached token: ``run(tokens, context)`` timed at two contexts.

    Each size is timed over the short and the long context in turn (the minimum of ``repeats`` sweeps after
    a warm-up, as ``measure_curve``), and the differences are fitted as ``rows * slope * (long - short)``
    by least squares through zero, which weighs the larger sizes (the trees the budget prices) most. Never
    negative: a longer context costs no less.
    """
    short, long = contexts
    if long <= short:
        raise ValueError(f"the second context must be the longer, not {contexts}")
    ordered = sorted(set(sizes))
    for n in ordered:  # warm-up
        run(n, long)
    points = [(n, c) for n in ordered for c in contexts]
    best = fastest_in_turn(points, lambda point: run(*point), repeats, clock)
    extra = {n: best[n, long] - best[n, short] for n in ordered}
    slope = sum(n * extra[n] for n in ordered) / sum(n * n for n in ordered) / (long - short)
    return max(0.0, slope)
