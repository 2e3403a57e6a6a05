"""Whether a session's costly draft sources (the draft head, a draft model) earn the time a round waits for them.

The n-gram sources draft in microseconds; the draft head drafts from forwards of its own, several a round,
and the round waits for them (unless the tree was pre-drafted on an idle core). Where its drafts add fewer
tokens per second of its time than the session commits per second of a round, every round that runs it
commits less per second than one that does not. Worse, the verifier sizes each session's trees from what
its drafted rounds wait for (``VerifyRequest.draft_micros``, ``DraftBudget``): a slow head there keeps every
source's trees small, the cheap sources' too (docs/benchmarks.md, "The draft head's gate").

So per session a ``SourceGate`` weighs the costly sources each round: they run while the tokens only they
drafted that the verifier accepted, per second of their drafting, are at least the tokens the session
commits per second of a round (a round's tokens over the time from one reply to the next plus its drafting).
Before that is known they run (``WARM_ROUNDS``); while they do not pay, they run again after
``PROBE_AFTER`` rounds, then twice as many up to ``PROBE_AFTER_MAX``, so that a session whose text turns
predictable gets them back. Those runs are exploration, not what the session's rounds wait for: the reply
says how long they took (``DraftReply.probe_ns``) and the coordinator leaves it out of the wait the draft
budget counts. Drafts never change output: this only moves time between drafting and verifying.

A session alone needs its warm-up to judge the sources, and the first of those runs feeds the whole prompt's
features, in the background while the verifier computes (on shared cores, taking its CPU). Where the head has
not paid for a drafter's earlier sessions that warm-up buys nothing but that cost (docs/benchmarks.md, "The draft
head's record"). So every session's figures also feed the drafter's ``GateHistory``, and a new session of a
drafter whose record says the sources do not pay starts with its warm-up done, judged on the record's figures
until its own come in, and feeds them no features until they next run (a probe). Every
``GateHistory.RECHECK_EVERY``-th new session warms up all the same, so the record follows a change (another
traffic mix, a quieter verifier).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class GateCounts:
    """Every session's gate decisions since the drafter started (read by metrics)."""

    ran: int = 0  # drafted rounds whose tree the costly sources drafted
    skipped: int = 0  # drafted rounds they sat out because they did not pay
    warm_ups_skipped: int = 0  # sessions that started judged, on the drafter's record (GateHistory)


class Smoothed:
    """An exponentially weighted mean, None until its first value."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self._decay * self.value + (1 - self._decay) * x


class GateFigures:
    """What a gate weighs, smoothed: tokens a round commits, a round's seconds (reply to reply, drafting
    included), the costly sources' accepted nodes that only they drafted per run, and their drafting seconds
    per timed run."""

    def __init__(self, decay: float) -> None:
        self.tokens = Smoothed(decay)
        self.round_s = Smoothed(decay)
        self.gain = Smoothed(decay)
        self.cost_s = Smoothed(decay)

    def round(self, seconds: float, tokens: int) -> None:
        self.round_s.add(seconds)
        self.tokens.add(tokens)

    def _values(self) -> tuple[float | None, ...]:
        return self.gain.value, self.cost_s.value, self.tokens.value, self.round_s.value

    def pays(self, fallback: GateFigures | None = None) -> bool | None:
        """Whether their accepted drafts per second of drafting are at least the tokens a round commits per
        second of it; ``fallback``'s figure stands in for each this one lacks; None while any is unknown."""
        values = self._values()
        if fallback is not None:
            values = tuple(v if v is not None else f for v, f in zip(values, fallback._values(), strict=True))
        gain, cost_s, tokens, round_s = values
        if gain is None or cost_s is None or tokens is None or not round_s:
            return None
        return gain * round_s >= tokens * cost_s  # gain / cost >= tokens / round_s, without dividing by zero


class GateHistory:
    """A drafter's record of its costly sources over all its sessions: each new session's priors (see the module).

    The same figures as a session's gate, fed by every session's rounds and smoothed more slowly.
    """

    DECAY = 0.95
    MIN_TIMED_RUNS = 8  # timed runs (about two sessions' warm-ups) before the record is trusted
    RECHECK_EVERY = 8  # every this many new sessions one warms up whatever the record says

    def __init__(self) -> None:
        self.figures = GateFigures(self.DECAY)
        self.timed_runs = 0
        self._sessions = 0

    def timed(self, seconds: float) -> None:
        self.figures.cost_s.add(seconds)
        self.timed_runs += 1

    def pays(self) -> bool | None:
        """The record's verdict; None while it knows too little."""
        return self.figures.pays() if self.timed_runs >= self.MIN_TIMED_RUNS else None

    def skips_warm_up(self) -> bool:
        """For a new session: whether it starts judged, the record saying the sources do not pay here."""
        self._sessions += 1
        return self.pays() is False and self._sessions % self.RECHECK_EVERY != 0


class SourceGate:
    """One session's decision, round by round, to run its costly draft sources (see the module)."""

    DECAY = 0.8  # weight of what was known before each new round's figure
    WARM_ROUNDS = 4  # drafted rounds that run the sources before they are judged
    PROBE_AFTER = 8  # rounds without them before they run again
    PROBE_AFTER_MAX = 64  # each probe that does not pay doubles the wait for the next, up to this

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        counts: GateCounts | None = None,
        history: GateHistory | None = None,
    ) -> None:
        self.clock = clock  # also times the costly sources (DraftSession)
        self.counts = counts if counts is not None else GateCounts()
        self._history = history if history is not None else GateHistory()  # the drafter's (default: its own)
        # Gain per round they ran; cost per round they ran the round before too (see ``ran``).
        self._figures = GateFigures(self.DECAY)
        self._runs = 0
        self._quiet = 0  # rounds since they last ran, while they do not pay
        self._probe_after = self.PROBE_AFTER
        self._replied_at: float | None = None
        self._ran_last = False  # they ran for the last round's tree
        self.probing = False  # the last ``opens`` ran them only to judge them (warming up, or a probe)
        # They sit out until they next run: their work ahead (feeding a prompt's features) waits for that too.
        self.sitting_out = False
        if self._history.skips_warm_up():
            self._runs = self.WARM_ROUNDS
            self.sitting_out = True
            self.counts.warm_ups_skipped += 1

    def committed(self, tokens: int, gain: int | None) -> None:
        """The verifier's report on the last round: ``tokens`` committed, ``gain`` of them drafted only by the
        costly sources (None: they did not draft that tree). Also closes the round's time."""
        now = self.clock()
        for figures in (self._figures, self._history.figures):
            if self._replied_at is not None:
                figures.round(now - self._replied_at, tokens)
            if gain is not None:
                figures.gain.add(gain)

    def opens(self) -> bool:
        """Whether the costly sources draft this round's tree (call once per drafted round)."""
        self.probing = self._runs < self.WARM_ROUNDS or not self.pays()
        if not self.probing:
            self._quiet, self._probe_after = 0, self.PROBE_AFTER
        elif self._runs >= self.WARM_ROUNDS:
            self._quiet += 1
            if self._quiet <= self._probe_after:
                self.counts.skipped += 1
                self.sitting_out = True
                return False
            self._quiet, self._probe_after = 0, min(2 * self._probe_after, self.PROBE_AFTER_MAX)
        self.counts.ran += 1
        self.sitting_out = False
        return True

    def ran(self, seconds: float) -> None:
        """They drafted this round's tree in ``seconds``. Only a run that follows a run of theirs is timed: the
        first, and one after rounds without them, begins by catching up on the features they missed (a whole
        prompt's at first), which is not what a round of theirs costs; it informs only their gain."""
        if self._ran_last:
            self._figures.cost_s.add(seconds)
            self._history.timed(seconds)
        self._runs += 1
        self._ran_last = True

    def sat_out(self) -> None:
        self._ran_last = False

    def had_nothing(self) -> None:
        """They ran for this round but offered no draft (the head still catching up on a long prompt's
        features): nothing to judge them by, so the round neither counts as a run nor uses up a probe."""
        self._ran_last = False
        self.counts.ran -= 1
        if self._runs >= self.WARM_ROUNDS and not self.pays():  # a probe: the next drafted round probes again
            self._probe_after = max(self.PROBE_AFTER, self._probe_after // 2)  # as before this one doubled it
            self._quiet = self._probe_after

    def replied(self) -> None:
        """The round's tree went out: the next report closes the round."""
        self._replied_at = self.clock()

    def pays(self) -> bool:
        """On the session's own figures, the drafter's record's where the session has none yet; True while
        neither knows (run them, to find out)."""
        verdict = self._figures.pays(self._history.figures)
        return True if verdict is None else verdict
