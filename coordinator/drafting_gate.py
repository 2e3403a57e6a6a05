"""Per session: draft only while drafted rounds commit more tokens per second than plain rounds, end to end.

The verifier sizes each session's tree by its cost model (``target_service.budget_policy``): its own
step, and the wait for the tree the coordinator reports. It cannot see what else a drafted round costs:
the hops to the drafter and back, the larger messages, the coordinator's tree and mask work, the
features forwarded to a draft head, and, where the three processes share a few cores, the cores the
drafter takes from the verifier. The coordinator sees all of it as the time a round takes. So each
session keeps the committed tokens and the time of its recent drafted rounds and of its recent plain
rounds, and drafts only while the drafted rounds' tokens per second beat the plain rounds'.

- A session starts drafting (the verifier's budget decides how much); after ``WARM_UP`` drafted
  rounds it runs ``PLAIN_SAMPLES`` plain rounds to learn what a plain round costs it, then judges.
- While drafting pays, one plain round every ``REFRESH_AFTER`` drafted rounds keeps that cost current
  (the context grows, the load changes).
- Once drafting does not pay, the session runs plain rounds, which cost what plain decoding costs: the
  drafter is not asked, no features are fetched for it. After ``PROBE_AFTER`` plain rounds it probes
  with ``PROBE_ROUNDS`` drafted rounds; a probe that does not win doubles the wait for the next (up to
  ``PROBE_AFTER_MAX``), one that wins brings drafting back and the first pace.

Rounds where the verifier's budget left no room for drafts are plain rounds and count as such; rounds
that asked the drafter count as drafted, whether it had a tree or not (the wait was paid). A session's
first round is not judged: it carries one-off work (the drafter's first look at the prompt). Nothing
here changes what is committed: plain and drafted rounds commit the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Rounds:
    """Recent rounds of one kind: their committed tokens and their seconds, each sum exponentially decayed.

    Tokens per second is the ratio of the sums, so a long round weighs what it costs, as in a stream.
    """

    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.count += 1

    def fade(self, keep: float) -> None:
        """What is known weighs ``keep`` of what it did: it is old, the next rounds are to decide."""
        self.tokens *= keep
        self.seconds *= keep

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftingGate:
    """One session's verdict on drafting, from its own rounds' committed tokens per second."""

    DECAY = 0.9  # weight of what was known before each new round of the same kind: about the last ten count
    WARM_UP = 3  # drafted rounds before the first plain round is measured
    PLAIN_SAMPLES = 2  # plain rounds measured before the first verdict
    REFRESH_AFTER = 64  # drafted rounds between two plain rounds while drafting pays
    PROBE_AFTER = 16  # plain rounds before a probe while drafting does not pay
    PROBE_AFTER_MAX = 128  # each probe that does not win doubles the wait, up to this
    PROBE_ROUNDS = 4  # drafted rounds a probe runs before it is judged
    STALE = 0.25  # weight left, when a probe starts, to the drafted rounds before the plain stretch

    def __init__(self) -> None:
        self._drafted = _Rounds()
        self._plain = _Rounds()
        self.drafting = True  # the verdict: drafted rounds pay (or nothing is known yet)
        self._rounds = 0  # rounds seen, the first included
        self._plain_in_a_row = 0
        self._drafted_in_a_row = 0
        self._probe_after = self.PROBE_AFTER

    def drafts(self) -> bool:
        """Whether the next round may ask the drafter for a tree (the verifier's budget still sizes it)."""
        if self.drafting:
            measuring = self._drafted.count >= self.WARM_UP and self._plain.count < self.PLAIN_SAMPLES
            refreshing = self._drafted_in_a_row >= self.REFRESH_AFTER
            return not (measuring or refreshing)
        probing = 0 < self._drafted_in_a_row < self.PROBE_ROUNDS
        return probing or self._plain_in_a_row >= self._probe_after

    def stays_plain(self) -> bool:
        """Whether the round after the current one is plain too, if the current one is plain: drafting does not
        pay and one more plain round does not yet make a probe due. (A plain round never changes the verdict.)"""
        return not self.drafting and self._plain_in_a_row + 1 < self._probe_after

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A round that asked the drafter (``drafted``) or not, committed ``tokens`` and took ``seconds``."""
        self._rounds += 1
        if drafted:
            self._drafted_in_a_row += 1
            self._plain_in_a_row = 0
        else:
            self._plain_in_a_row += 1
            self._drafted_in_a_row = 0
        if self._rounds == 1 or seconds <= 0:
            return
        if drafted and not self.drafting and self._drafted_in_a_row == 1:  # a probe starts
            self._drafted.fade(self.STALE)
        (self._drafted if drafted else self._plain).add(tokens, seconds, self.DECAY)
        if self._plain.count < self.PLAIN_SAMPLES or self._drafted.count < self.WARM_UP:
            return
        if self.drafting:
            self.drafting = self._drafted.per_s > self._plain.per_s
        elif drafted and self._drafted_in_a_row >= self.PROBE_ROUNDS:  # a probe's verdict
            self.drafting = self._drafted.per_s > self._plain.per_s
            self._probe_after = self.PROBE_AFTER if self.drafting else min(2 * self._probe_after, self.PROBE_AFTER_MAX)
