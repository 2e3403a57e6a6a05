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

A drafted round also waits for its tree: the coordinator sends how long its
drafter took (``draft_micros``), and each session's budget counts that time,
smoothed over its recent drafted rounds, as a cost of every k > 0. A session
is served in rounds, each one draft and one verify, so for one stream the
round costs their sum (and on two shared cores drafting also takes the
verifier's CPU); with L sessions the engine steps for the others while one
drafts, so a draft counts 1/L of its time (measured under load, counting it
whole turned drafting off at N = 16 and cost 16% of the aggregate rate).
Where drafting costs more than the tree saves (a draft head of four steps on
a 2-core CPU: 12.6 ms a round beside a 29.6 ms verify and a plain token's
18.2 ms, tau 1.91), the budget goes to 0 and the session
decodes plainly, and its probe rounds measure the drafter again.

alpha is learnt for the whole engine and for each session (``SessionAcceptance``,
starting from the engine's): drafts pay on some requests (a summary copies
its document, n-gram drafts land) and not on others, so each session's
budget follows its own acceptance. A session whose drafts stopped paying
drifts back towards the engine's rate while it drafts nothing, and so tries
again now and then. The engine's rate learns only from trees, so where it too
says "no drafts" (a long context on a CPU, where every extra row costs) no
session would ever draft again: a session with no tree for ``PROBE_AFTER``
rounds gets a small probe budget instead of none, and its answer revises both
rates. A probe that lands nothing doubles the wait for the next (up to
``PROBE_AFTER_MAX``): a request whose drafts never land pays for few probes.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward by tokens scored, plus seconds per session sharing it and per cached token.

    The sizes are timed over ``context`` cached tokens. Attention makes every scored row cost more over a
    longer context, about linearly in the cached tokens it reads: ``per_row_context_s`` is that slope, per
    row and per cached token beyond ``context``. A tree over a long prompt costs more than the curve at
    ``context`` says (on a 2-core AVX2 EPYC a verify of 8 tokens took 30 ms over 128 cached tokens and 52 ms
    over 1024, a plain step 13 and 17 ms: each extra row twice as dear).
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
# else held the cores (seen: c(16) 45x c(8) for every repeat while another process was installing packages;
# rows cost at most linearly). It is timed again, up to STALL_RETRIES times, keeping the least time.
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
    not every timing of the one-token step, which would make every ratio to it look cheap (seen on a 2-core
    EPYC: c(2)/c(1) 1.00 and c(8)/c(1) 1.17 at a start beside the others, 1.11 and 1.46 on a quiet machine).
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


class DraftBudget:
    """The draft-node budget per session for a batch of a given size; learns the acceptance rate."""

    # Each verified tree weighs this much less than the next: the estimate follows the last few hundred.
    DECAY = 0.99
    CACHE_LIMIT = 4096  # budgets kept by (sessions, alpha, drafting time to 0.5 ms, context to CONTEXT_STEP)
    CONTEXT_STEP = 64  # cached tokens: contexts are priced in steps of this

    def __init__(self, curve: CostCurve, max_nodes: int, prior_accepted: float = 3.0, prior_tried: float = 5.0) -> None:
        self.curve = curve
        self.max_nodes = max_nodes
        self._accepted = prior_accepted
        self._tried = prior_tried
        self._cache: dict[tuple[int, float, float, int], int] = {}

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

    def expected_accepted(self, nodes: int, alpha: float | None = None) -> float:
        a = self.alpha if alpha is None else min(0.98, alpha)
        return a * (1 - a**nodes) / (1 - a)

    def nodes_for(self, sessions: int, alpha: float | None = None, draft_s: float = 0.0, context: int = 0) -> int:
        """The k in [0, max_nodes] that maximises tokens committed per second with ``sessions`` sharing steps.

        ``alpha``: the session's own acceptance rate (default: the engine's). ``draft_s``: what a drafted round
        waits for its tree (0: nothing known), for every k > 0 added to the step's cost divided by ``sessions``:
        alone, a session's draft leaves the engine idle; among others, the engine steps for them meanwhile.
        ``context``: the session's cached tokens, taken as every session's (0: the curve's own context).
        """
        sessions = max(1, sessions)
        draft = round(max(0.0, draft_s) * 2000) / 2000  # to 0.5 ms: the cache's key
        context = context // self.CONTEXT_STEP * self.CONTEXT_STEP
        key = (sessions, round(self.alpha if alpha is None else alpha, 2), draft, context)
        if key not in self._cache:
            if len(self._cache) >= self.CACHE_LIMIT:  # sessions' rates and drafting times vary: keep it bounded
                self._cache.clear()
            best_k, best_rate = 0, 0.0
            for k in range(self.max_nodes + 1):
                cost = self.curve.step_s(sessions, sessions * (1 + k), context) + (draft / sessions if k else 0.0)
                rate = sessions * (1 + self.expected_accepted(k, key[1])) / cost
                if rate > best_rate * 1.0001:  # ties go to the smaller tree
                    best_k, best_rate = k, rate
            self._cache[key] = best_k
        return self._cache[key]


class SessionAcceptance:
    """One session's acceptance rate: its own recent trees, on a prior worth ``prior_tries`` at the engine's."""

    DECAY = 0.9  # a request's drafts change character within tens of rounds
    PRIOR_TRIES = 2.0
    PROBE_AFTER = 16  # rounds without a tree before a zero budget becomes a probe: at most ~1 round in 17 pays it
    PROBE_AFTER_MAX = 128  # each probe that lands nothing doubles the wait for the next, up to this
    PROBE_NODES = 4

    DRAFT_DECAY = 0.8  # weight of the drafting time known before each new drafted round's

    def __init__(self) -> None:
        self._accepted = 0.0
        self._tried = 0.0
        self._rounds_without_tree = 0
        self._probe_after = self.PROBE_AFTER  # quiet rounds before the next probe
        self._probing = False  # the last budget sent was a probe
        self.draft_s = 0.0  # what a drafted round waits for its tree, smoothed (0: no drafted round yet)

    def alpha(self, engine_alpha: float) -> float:
        return (self._accepted + self.PRIOR_TRIES * engine_alpha) / (self._tried + self.PRIOR_TRIES)

    def observe_draft(self, seconds: float) -> None:
        """A drafted round's wait for its tree (from the coordinator); rounds without a drafter send none."""
        if seconds <= 0:
            return
        decay = self.DRAFT_DECAY if self.draft_s else 0.0  # the first drafted round is taken as it is
        self.draft_s = decay * self.draft_s + (1 - decay) * seconds

    def observe(self, tree_depth: int, num_accepted: int) -> None:
        """One verified round: a tree (depth > 0) teaches the rate; an empty one lets it drift to the prior."""
        self._accepted *= self.DECAY
        self._tried *= self.DECAY
        if tree_depth > 0:
            self._accepted += num_accepted
            self._tried += num_accepted + (1 if num_accepted < tree_depth else 0)
            self._rounds_without_tree = 0
            if num_accepted:
                self._probe_after = self.PROBE_AFTER
            elif self._probing:  # a probe that landed nothing: the next comes after twice the quiet stretch
                self._probe_after = min(2 * self._probe_after, self.PROBE_AFTER_MAX)
        else:
            self._rounds_without_tree += 1

    def budget(self, nodes: int, max_nodes: int) -> int:
        """The budget to send: the cost model's ``nodes``, or a probe after a quiet stretch without a tree.

        The stretch is ``PROBE_AFTER`` rounds, doubled by each probe that lands nothing (up to
        ``PROBE_AFTER_MAX``: a request whose drafts never land, a translation say, pays for a probe about once
        in 129 rounds) and back to ``PROBE_AFTER`` once drafts land. The probe repeats each round until a tree
        comes back (a drafter with nothing to propose sends none, at no cost).
        """
        self._probing = nodes == 0 and self._rounds_without_tree >= self._probe_after
        return min(self.PROBE_NODES, max_nodes) if self._probing else nodes


class ThroughputGuard:
    """Keeps speculation on only while it measurably wins: an A/B check of the cost model at run time.

    The cost curve sees the verifier's forward passes, and the budget the wait
    for each round's tree. It misses what a round costs elsewhere: the cores
    drafting takes (on drafters that share hardware with the verifier, as on
    one machine, every drafted round takes cores from the verifier), and the
    rounds' round trips. So the engine keeps serving one
    arm ("model": the curve's budget, or "off": no drafts) and every
    ``exploit_s`` probes the other for ``probe_s``; the probe's arm takes over
    when it wins by ``margin``. Each phase's first ``settle_s`` is not
    measured: budgets reach the drafters one round late.

    A probe costs: while it serves the arm that loses, every session runs
    slower. Each probe that does not switch (the arm held, or too few paired
    tokens to judge) doubles the exploit stretch before the next, up to
    ``max_exploit_s``; a switch resets it. A guard that keeps confirming its
    arm thus probes 3 s in 67 rather than 3 in 11. What it confirmed held at
    the load it was judged at: when the sessions a step serves (smoothed)
    grow or shrink ``LOAD_CHANGE`` times from that, a fresh exploit stretch at
    the first pace begins, so the next probe comes ``exploit_s`` after the
    change, judged on sessions at the new load: probes that can never be
    judged must not hold drafting off (bench/README.md, "The throughput
    guard's probes").

    The comparison is paired: only sessions that committed tokens both in the
    probe and in the exploit arm's stretch just before it count, each at its
    own tokens per second. How much a request's drafts pay depends on its
    text far more than on the arm, so comparing different requests (one that
    ended with the exploit stretch, another that began with the probe) would
    measure the requests, not the arms: with no session in both, the arm is
    kept.

    Traffic that comes and goes (one request at a time, with pauses between):
    the stretches count the engine's busy time only, not the pauses longer
    than ``IDLE_GAP_S`` between its steps, so the next request after a pause
    does not open with a probe that fell due while nothing ran; a probe starts
    only once a session in the step has ``min_tokens`` in the stretch's last
    ``probe_s`` (one it can be judged on), and ends as soon as none of those
    sessions is left: otherwise a probe that fell due while nothing ran opens
    the next request, which then runs without drafts (bench/README.md, "The
    guard's probes on a quiet engine").
    """

    IDLE_GAP_S = 0.5  # between two steps longer than this, the engine had no work: the stretch's clock stops

    LOAD_SMOOTHING = 0.1  # weight of each step's session count in the running load
    LOAD_CHANGE = 2.0  # a load this many times the last verdict's (or a fraction as small) resets the backoff

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        exploit_s: float = 8.0,
        probe_s: float = 3.0,
        settle_s: float = 0.5,
        margin: float = 0.05,
        min_tokens: int = 64,
        max_exploit_s: float = 64.0,
    ) -> None:
        if not 0 < exploit_s <= max_exploit_s:
            raise ValueError(f"the exploit stretch must be in (0, max_exploit_s], not {exploit_s}")
        self._clock = clock
        self._base_exploit_s = exploit_s
        self._max_exploit_s = max_exploit_s
        self._exploit_s = exploit_s  # the stretch before the next probe: doubled by each probe that does not switch
        self._load = 0.0  # sessions a step, smoothed (0: no step seen yet)
        self._load_at_verdict = 0.0
        self._probe_s = probe_s
        self._settle_s = settle_s
        self._margin = margin
        self._min_tokens = min_tokens
        self.speculate = True  # the exploit arm: True for the cost model's budget, False for none
        self.num_switches = 0
        self.num_unpaired = 0  # probes with too few tokens from sessions in both stretches to judge
        self._probing = False
        self._phase_start = clock()
        self._last_step_end: float | None = None  # None: no step yet (the time since start-up is idle)
        self._window = _Window()
        self._before = _Window()  # the exploit arm's last stretch, to compare the probe with
        self._before_sessions: frozenset[str] = frozenset()  # its sessions, the probe's only judges
        self._judges_seen = 0.0  # when a step last served one of them (during a probe)

    @property
    def arm_now(self) -> bool:
        """Whether budgets come from the cost model right now (probes included)."""
        return self.speculate != self._probing

    def observe(self, committed: Mapping[str, int], step_s: float = 0.0) -> None:
        """One engine step that took ``step_s``: the tokens it committed for each session it verified."""
        now = self._clock()
        idle = now - step_s - (self._last_step_end if self._last_step_end is not None else self._phase_start)
        if idle > self.IDLE_GAP_S:
            self._phase_start += idle  # no work meanwhile (or yet): it does not count
        self._last_step_end = now
        if committed:
            step_load = float(len(committed))
            self._load = step_load if not self._load else self._load + self.LOAD_SMOOTHING * (step_load - self._load)
        if not self._probing and self._exploit_s > self._base_exploit_s and self._load_changed():
            self._exploit_s, self._phase_start, self._window = self._base_exploit_s, now, _Window()
        elapsed = now - self._phase_start
        if elapsed >= self._settle_s and committed:
            self._window.add(now, committed)
        if not self._probing and elapsed >= self._exploit_s:
            before = self._window.tail(now, self._probe_s)
            rates = before.rates()
            if sum(rates[s].tokens for s in committed if s in rates) >= self._min_tokens:  # it can be judged
                self._before, self._window = before, _Window()
                self._before_sessions = frozenset(rates)
                self._probing, self._phase_start, self._judges_seen = True, now, now
        elif self._probing and (elapsed >= self._probe_s or self._judges_gone(now, committed)):
            if self._probe_wins():
                self.speculate = not self.speculate
                self.num_switches += 1
                self._exploit_s = self._base_exploit_s
            else:
                self._exploit_s = min(2 * self._exploit_s, self._max_exploit_s)
            self._load_at_verdict = self._load
            self._probing, self._phase_start, self._window = False, now, _Window()

    def _judges_gone(self, now: float, committed: Mapping[str, int]) -> bool:
        """No step has served a session the probe can be judged on for ``IDLE_GAP_S``: they have ended."""
        if committed.keys() & self._before_sessions:
            self._judges_seen = now
        return now - self._judges_seen > self.IDLE_GAP_S

    def _load_changed(self) -> bool:
        """Whether the load grew or shrank ``LOAD_CHANGE`` times since the last probe's verdict."""
        low, high = sorted((self._load, self._load_at_verdict))
        return low > 0 and high >= self.LOAD_CHANGE * low

    def _probe_wins(self) -> bool:
        probe, before = self._window.rates(), self._before.rates()
        paired = probe.keys() & before.keys()
        if min(sum(probe[s].tokens for s in paired), sum(before[s].tokens for s in paired)) < self._min_tokens:
            self.num_unpaired += 1
            return False
        probe_rate = sum(probe[s].per_s for s in paired)
        before_rate = sum(before[s].per_s for s in paired)
        wins = probe_rate > before_rate * (1 + self._margin)
        if wins:
            log.info(
                "throughput guard: drafting %s (%d sessions in both stretches: %.1f tok/s without drafts, %.1f with)",
                "off" if self.speculate else "on",
                len(paired),
                probe_rate if self.speculate else before_rate,
                before_rate if self.speculate else probe_rate,
            )
        return wins


@dataclass(frozen=True)
class _SessionRate:
    tokens: int  # committed after the session's first step in the stretch
    per_s: float


class _Window:
    """Each session's committed tokens per second over a stretch of engine steps."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, Mapping[str, int]]] = []  # (time, tokens committed per session)

    def add(self, now: float, committed: Mapping[str, int]) -> None:
        self.steps.append((now, committed))

    def tail(self, now: float, seconds: float) -> _Window:
        kept = _Window()
        kept.steps = [step for step in self.steps if step[0] >= now - seconds]
        return kept

    def rates(self) -> dict[str, _SessionRate]:
        """Sessions seen in two steps or more: tokens committed after their first step, over the time since it."""
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        tokens: dict[str, int] = {}
        for now, committed in self.steps:
            for session, count in committed.items():
                if session in first:
                    last[session] = now
                    tokens[session] += count
                else:
                    first[session], tokens[session] = now, 0
        return {
            session: _SessionRate(tokens[session], tokens[session] / (last[session] - first[session]))
            for session in last
            if last[session] > first[session]
        }
