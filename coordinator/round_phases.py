"""Where a round's time goes, phase by phase, as the coordinator sees it.

A round is timed from the moment the round loop starts it to the moment its tokens are committed, and
that time is cut into phases that add up to it:

- ``drafter``: the drafter's own time answering the proposal (``DraftReply.draft_ns``, its time in Draft);
- ``draft_transport``: the rest of the wait for the tree: the hop to the drafter and back, its queue and
  event loop (the coordinator's protobuf work is ``protobuf``);
- ``tree_and_masks``: checking the drafter's tree and, with a constraint, fitting it to the grammar and
  computing each row's token mask;
- ``protobuf``: encoding the Verify and Draft requests and decoding their answers, in the coordinator;
- ``verifier_queue``: the Verify call's wait in the verifier's queue for an engine step (``queue_ns``);
- ``verifier_step``: the rest of the verifier's own time for the call, from its first step to its answer
  (the forward it shared, acceptance);
- ``verify_transport``: the rest of the Verify call: the hop there and back, the verifier's server;
- ``loop``: everything else: the coordinator's event loop and bookkeeping (commit, detokenization, stop
  strings, features kept for the drafter), re-prefills and failed attempts.

The round loop reads each phase from a clock it is given, so tests drive it with a fake one. The protobuf
work happens inside the gRPC clients; they add it to the round in progress through ``protobuf()``, which
finds the round by a context variable (the clients run in the round loop's own task). Work the round
starts beside its critical path (telling a pre-drafting drafter the verified tree) is not timed: it
would count twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

PHASES = (
    "drafter",
    "draft_transport",
    "tree_and_masks",
    "protobuf",
    "verifier_queue",
    "verifier_step",
    "verify_transport",
    "loop",
)

Clock = Callable[[], int]
"""Nanoseconds from an arbitrary origin (``time.perf_counter_ns``)."""

_CODEC: ContextVar[list[int] | None] = ContextVar("round_protobuf_ns", default=None)


@contextmanager
def protobuf(clock: Clock = time.perf_counter_ns) -> Iterator[None]:
    """Count the block as the current round's protobuf work (nothing outside a round)."""
    counter = _CODEC.get()
    if counter is None:
        yield
        return
    started = clock()
    try:
        yield
    finally:
        counter[0] += clock() - started


class RoundPhases:
    """One round's phases, in nanoseconds; created when the round starts, ``end()`` when it is committed."""

    def __init__(self, clock: Clock = time.perf_counter_ns) -> None:
        self._clock = clock
        self._started = clock()
        self.ns = dict.fromkeys(PHASES, 0)
        self._codec = [0]
        _CODEC.set(self._codec)

    @property
    def protobuf_ns(self) -> int:
        """Protobuf work so far in this round (read before and after a call to attribute it)."""
        return self._codec[0]

    def now(self) -> int:
        return self._clock()

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """Count the block's time as ``phase``."""
        started = self._clock()
        try:
            yield
        finally:
            self.ns[phase] += self._clock() - started

    def drafted(self, waited_ns: int, drafter_ns: int, protobuf_ns: int) -> None:
        """The wait for a tree: ``drafter_ns`` of it the drafter's own, ``protobuf_ns`` ours."""
        drafter = min(max(0, drafter_ns), waited_ns)
        self.ns["drafter"] += drafter
        self.ns["draft_transport"] += max(0, waited_ns - drafter - protobuf_ns)

    def verified(self, call_ns: int, protobuf_ns: int, verify_ns: int, queue_ns: int) -> None:
        """A Verify call that took ``call_ns``: the verifier's ``verify_ns`` (``queue_ns`` of it queued)."""
        inside = min(max(0, verify_ns), max(0, call_ns - protobuf_ns))
        queue = min(max(0, queue_ns), inside)
        self.ns["verifier_queue"] += queue
        self.ns["verifier_step"] += inside - queue
        self.ns["verify_transport"] += max(0, call_ns - protobuf_ns - inside)

    def end(self) -> tuple[int, ...]:
        """The round is committed: every phase in ``PHASES`` order, ``loop`` the time no other phase took."""
        total = self._clock() - self._started
        self.ns["protobuf"] = self._codec[0]
        self.ns["loop"] = max(0, total - sum(ns for phase, ns in self.ns.items() if phase != "loop"))
        if _CODEC.get() is self._codec:
            _CODEC.set(None)
        return tuple(self.ns[phase] for phase in PHASES)


def phase_totals(rounds: Sequence[Sequence[int]]) -> dict[str, int]:
    """Each phase's nanoseconds summed over ``rounds`` (each in ``PHASES`` order)."""
    return {phase: sum(r[i] for r in rounds) for i, phase in enumerate(PHASES)}


def mean_ms_per_round(totals_ns: Mapping[str, float], rounds: int) -> dict[str, float]:
    """Each phase's mean milliseconds per round from its total over ``rounds`` (0 rounds: zeros)."""
    return {phase: (totals_ns.get(phase, 0) / rounds / 1e6 if rounds else 0.0) for phase in PHASES}
