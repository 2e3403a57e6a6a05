"""The throughput guard: speculation stays on only while it measurably wins, judged at run time.

The budget policy (``budget_policy``) prices a round by a model; the guard checks the model by
serving one arm ("model" or "off") and probing the other now and then, comparing the same
sessions' committed tokens per second in both (``ThroughputGuard``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


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
    judged must not hold drafting off (docs/benchmarks.md, "The throughput
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
    the next request, which then runs without drafts (docs/benchmarks.md, "The
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
