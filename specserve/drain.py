"""Graceful shutdown of a server: stop taking new work, finish what is in flight, then stop.

On the first SIGTERM or SIGINT a server *drains*: its health service reports
NOT_SERVING at once (so load balancers and the coordinator's router stop
sending to it), new work is refused with UNAVAILABLE ("this replica is
shutting down; retry"), and what is in flight goes on until it is done or the
grace period (``--shutdown-grace-s``) runs out. A second signal stops at once.

What counts as "new work" and "in flight" is the tier's: a coordinator's new
Generate streams vs. the ones it is streaming; a drafter's new Draft streams;
a verifier's Prefill of a session it does not hold vs. the sessions it holds,
whose Verify/Release/re-Prefill calls in-flight coordinator streams still need.

This module is the state machine only (no grpc): ``specserve.rpc`` wires it to
servers and signals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from specserve.errors import Unavailable

DRAINING_METADATA = (("specserve-draining", "1"),)
"""Trailing metadata of a refusal by a draining server."""

DEFAULT_GRACE_S = 30.0


class Drain:
    """One server's shutdown state, shared by its handlers (any thread) and its signal handling.

    ``outstanding`` counts the calls in ``in_flight`` plus what ``busy`` reports
    (the verifier: the sessions it holds). The drain is over (``done``) when
    nothing is outstanding, the grace has run out, or a second signal came.
    """

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if grace_s < 0:
            raise ValueError(f"the shutdown grace must be >= 0 s, got {grace_s}")
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._busy: Callable[[], int] = lambda: 0
        self._on_begin: list[Callable[[], None]] = []
        self._began_at: float | None = None
        self._now = False

    @property
    def draining(self) -> bool:
        return self._began_at is not None

    @property
    def forced(self) -> bool:
        """A second signal came: stop without waiting."""
        return self._now

    def on_begin(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the drain begins (e.g. health to NOT_SERVING)."""
        self._on_begin.append(callback)

    def count_busy(self, busy: Callable[[], int]) -> None:
        """Also wait for what ``busy`` counts (called from the waiting thread; must be cheap and thread-safe)."""
        self._busy = busy

    def signal(self) -> None:
        """A shutdown signal: the first begins the drain, any later one ends it at once."""
        if self.draining:
            self._now = True
        else:
            self.begin()

    def begin(self) -> None:
        with self._lock:
            if self._began_at is not None:
                return
            self._began_at = self._clock()
        for callback in self._on_begin:
            callback()

    def refuse_new(self, what: str = "new requests") -> None:
        """Raise Unavailable while draining: ``what`` is not taken any more.

        The refusal carries ``DRAINING_METADATA``, so a caller can tell a replica that is shutting down (its
        work in hand goes on) from one that cannot be reached (its work is lost).
        """
        if self.draining:
            raise Unavailable(
                f"this replica is shutting down and takes no {what}; retry (another replica serves it)",
                metadata=DRAINING_METADATA,
            )

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a call as outstanding while the block runs."""
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    @property
    def outstanding(self) -> int:
        return self._active + self._busy()

    @property
    def seconds_left(self) -> float:
        """Of the grace (the full grace before the drain begins)."""
        if self._began_at is None:
            return self.grace_s
        return max(0.0, self._began_at + self.grace_s - self._clock())

    def done(self) -> bool:
        """Draining, and nothing outstanding, the grace over, or a second signal."""
        if not self.draining:
            return False
        return self._now or self.seconds_left <= 0 or self.outstanding == 0
