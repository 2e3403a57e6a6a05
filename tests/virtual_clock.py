"""An asyncio event loop on virtual time: whenever it would wait for a timer, the clock jumps to the timer instead.

Timeouts, sleeps and backoffs then take no real time, and the time they measure (``loop.time()``) is exactly the
time they were set for, however busy the machine. Only for scenarios that wait on timers and in-loop events: a
thread or a subprocess the loop waits for gets no virtual time to run in (socket I/O still wakes the loop).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, clock: VirtualClockLoop) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer set: wait for I/O as a real loop does
            return super().select(None)
        self._clock.advance(timeout)  # the loop would sleep until its next timer: be there now
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh ``VirtualClockLoop``."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)


def clock() -> float:
    """The running loop's time: a clock to inject into the code under test, so it reads the virtual time."""
    return asyncio.get_running_loop().time()
