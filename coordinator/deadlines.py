"""The client's deadline, carried through one request so every internal call of it respects it.

The gRPC edge opens a ``deadline_scope`` with the time the client has left; the round loop and the verifier
and drafter clients ask ``bounded(timeout)`` for the timeout of each call: their configured timeout, or less
when the client's deadline comes first. Once the deadline has passed, ``bounded`` raises DeadlineExceeded,
so the request ends with that status instead of starting work nobody waits for.

A context variable rather than an argument: the deadline must reach the verifier and drafter clients through
the round loop and the ports, whose signatures are shared with the in-process adapters, and it belongs to
the request the way the tenant (``specserve.tenancy``) does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from specserve.errors import DeadlineExceeded

clock: Callable[[], float] = time.monotonic
"""What deadlines are kept on: a monotonic clock, so that setting the wall clock moves no deadline (a test puts
a clock of its own here, to pass a deadline exactly when it means to)."""

_deadline: ContextVar[float | None] = ContextVar("specserve_deadline", default=None)  # on ``clock``


@contextmanager
def deadline_scope(time_remaining_s: float | None) -> Iterator[None]:
    """Run the block under a deadline ``time_remaining_s`` from now (None: no deadline)."""
    deadline = None if time_remaining_s is None else clock() + time_remaining_s
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        # A stream the client abandoned is closed by asyncio's finalizer in another context: nothing to restore.
        with contextlib.suppress(ValueError):
            _deadline.reset(token)


def remaining_s() -> float | None:
    """Seconds left before the request's deadline (negative once passed); None without a deadline."""
    deadline = _deadline.get()
    return None if deadline is None else deadline - clock()


def expired() -> bool:
    left = remaining_s()
    return left is not None and left <= 0


def check() -> None:
    """Raise DeadlineExceeded once the request's deadline has passed."""
    if expired():
        raise DeadlineExceeded("the request's deadline passed before it finished: give it a longer deadline")


def bounded(timeout_s: float) -> float:
    """The timeout for one internal call: ``timeout_s``, or less when the deadline comes first."""
    check()
    left = remaining_s()
    return timeout_s if left is None else min(timeout_s, left)
