"""How many draft nodes per session pay at the current load.

The verifier measures its own cost curve at start-up: the time of one forward
scoring T tokens, and the extra time per session sharing it. A step serving
L sessions with k draft nodes each costs about c(L * (1 + k)) + L * s and
commits L * (1 + g(k)) tokens, where g(k) is the expected number of accepted
draft tokens. The budget is the k that maximises committed tokens per second:
on hardware where extra rows are nearly free (a GPU, bf16 on AMX) it is
large, and it shrinks as L grows until, at saturation, k = 0 and speculation
switches off rather than lowering aggregate throughput (the adaptive
verification idea of vLLM's and SGLang's schedulers).

g(k) follows a chain with a per-token acceptance rate alpha learnt from recent
Verify calls (accepted tokens over tokens tried, exponentially weighted):
alpha (1 - alpha^k) / (1 - alpha).
Trees accept at least as much as a chain of the same depth, so the estimate
errs towards smaller trees.
"""

from __future__ import annotations

import bisect
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward by tokens scored, plus seconds per session sharing it."""

    tokens: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]
    per_session_s: float = 0.0

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

    def step_s(self, sessions: int, tokens: int) -> float:
        return self.forward_s(tokens) + sessions * self.per_session_s

    def to_json(self) -> str:
        return json.dumps({"tokens": self.tokens, "seconds": self.seconds, "per_session_s": self.per_session_s})

    @classmethod
    def from_json(cls, text: str) -> CostCurve:
        """Parse what ``to_json`` wrote; ValueError on anything else."""
        try:
            data = json.loads(text)
            return cls(
                tuple(map(int, data["tokens"])), tuple(map(float, data["seconds"])), float(data["per_session_s"])
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a cost curve: {exc}") from exc

    def ratios(self) -> dict[int, float]:
        """c(n) / c(first) for every measured n (for logs and Info)."""
        return {n: s / self.seconds[0] for n, s in zip(self.tokens, self.seconds, strict=True)}


def flat_curve() -> CostCurve:
    """Extra rows cost nothing: budgets are bounded by the tree limits alone (used before profiling)."""
    return CostCurve((1,), (1.0,))


def measure_curve(
    run: Callable[[int, int], None],
    sizes: Sequence[int],
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> CostCurve:
    """Time ``run(sessions, tokens)``: one session with each of ``sizes`` tokens, then 8 one-token sessions.

    Each point is the minimum of ``repeats`` runs after a warm-up run.
    """

    def timed(sessions: int, tokens: int) -> float:
        run(sessions, tokens)
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            run(sessions, tokens)
            best = min(best, clock() - start)
        return best

    ordered = sorted(set(sizes))
    seconds = [timed(1, n) for n in ordered]
    # More tokens never cost less: a dip is noise (another process took the cores for a moment).
    seconds = list(itertools.accumulate(seconds, max))
    curve = CostCurve(tuple(ordered), tuple(seconds))
    many = 8
    per_session = max(0.0, (timed(many, many) - curve.forward_s(many)) / (many - 1))
    return CostCurve(curve.tokens, curve.seconds, per_session)


class DraftBudget:
    """The draft-node budget per session for a batch of a given size; learns the acceptance rate."""

    # Each verified tree weighs this much less than the next: the estimate follows the last few hundred.
    DECAY = 0.99

    def __init__(self, curve: CostCurve, max_nodes: int, prior_accepted: float = 3.0, prior_tried: float = 5.0) -> None:
        self.curve = curve
        self.max_nodes = max_nodes
        self._accepted = prior_accepted
        self._tried = prior_tried
        self._cache: dict[int, int] = {}

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft token on a path is accepted."""
        return min(0.98, self._accepted / self._tried)

    def observe(self, tree_depth: int, num_accepted: int) -> None:
        """One verified tree: ``num_accepted`` tokens kept out of a deepest path of ``tree_depth``."""
        if tree_depth <= 0:
            return
        before = round(self.alpha, 2)
        self._accepted = self.DECAY * self._accepted + num_accepted
        self._tried = self.DECAY * self._tried + num_accepted + (1 if num_accepted < tree_depth else 0)
        if round(self.alpha, 2) != before:
            self._cache.clear()

    def expected_accepted(self, nodes: int) -> float:
        a = self.alpha
        return a * (1 - a**nodes) / (1 - a)

    def nodes_for(self, sessions: int) -> int:
        """The k in [0, max_nodes] that maximises tokens committed per second with ``sessions`` sharing steps."""
        sessions = max(1, sessions)
        if sessions not in self._cache:
            best_k, best_rate = 0, 0.0
            for k in range(self.max_nodes + 1):
                cost = self.curve.step_s(sessions, sessions * (1 + k))
                rate = sessions * (1 + self.expected_accepted(k)) / cost
                if rate > best_rate * 1.0001:  # ties go to the smaller tree
                    best_k, best_rate = k, rate
            self._cache[sessions] = best_k
        return self._cache[sessions]
