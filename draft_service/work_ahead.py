"""Work ahead (digesting a long prompt, pre-drafting) on a thread of its own, apart from proposals.

Steps of work ahead for many sessions wait in one queue served by one thread,
so they never take the threads that proposals run on (asyncio's default
executor), and only one runs at a time (they take the drafting lock anyway).
When a session's report arrives, its work still queued is dropped rather than
waited for behind other sessions' work; a step already running is finished
first (it holds the drafting lock, and the session's state is mid-change).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor


class WorkAhead:
    def __init__(self, executor: Executor | None = None) -> None:
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="work-ahead")

    def submit(self, work: Callable[[], None]) -> Future[None]:
        """Queue ``work`` (which returns once its ``stop`` event is set, step by step)."""
        return self._executor.submit(work)

    async def stop(self, work: Future[None], stop: threading.Event) -> bool:
        """The session's report is here: drop ``work`` if still queued (True), else wait for its step in hand."""
        stop.set()
        if work.cancel():
            return True
        await asyncio.wrap_future(work)
        return False

    def close(self) -> None:
        """Drop what is queued; a step running finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
