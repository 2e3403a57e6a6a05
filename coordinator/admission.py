"""Admission control: how many generations run at once, who waits, who is turned away.

Each generation holds a slot for its whole stream. At most ``max_running`` slots are held at once, and at
most ``tenant_max_running`` by one tenant (the tenant's own ``max_concurrent_streams`` when set, else the
coordinator's default; 0: no per-tenant limit). A request that finds no slot waits in a bounded FIFO queue;
a tenant may not hold more queue entries than its own running limit, so one tenant cannot fill the queue.
When a slot frees, the oldest waiter whose tenant is under its limit takes it, so a tenant that saturates
its own limit does not hold back the others behind it.

A request is refused with RESOURCE_EXHAUSTED (trailing metadata ``retry-after-ms``) when the queue, or its
tenant's share of it, is full, or when it waited ``queue_timeout_s`` without a slot; with DEADLINE_EXCEEDED
when the client's deadline passes first. ``retry-after-ms`` is estimated from how long recent streams held
their slots: the time for as many slots to free as there are waiters ahead.

Pure asyncio: the gRPC edge opens ``slot()`` around the stream, and the slot is released however the
stream ends (finished, failed, cancelled by the client).

Shutdown: ``drain()`` refuses new and queued streams with UNAVAILABLE (a client retries them on another
coordinator) while the running ones go on; the server's ``specserve.drain.Drain`` waits for ``running`` to
reach 0.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from coordinator import deadlines
from specserve.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from specserve.tenancy import Tenant

DEFAULT_RETRY_AFTER_S = 1.0  # before any stream has finished, there is nothing to estimate from
MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 60.0


def estimate_retry_after_s(recent_s: Sequence[float], ahead: int, workers: int) -> float:
    """When a refused call may be served: ``ahead`` calls at the mean of the ``recent_s`` durations, ``workers``
    at a time, within [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]; DEFAULT_RETRY_AFTER_S before any was measured.

    Stream slots (``AdmissionController``) and the tokenizer's queue (``prompts.PromptEncoder``) both answer so.
    """
    if not recent_s:
        return DEFAULT_RETRY_AFTER_S
    estimate = sum(recent_s) / len(recent_s) * ahead / max(1, workers)
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))


@dataclass(frozen=True)
class AdmissionLimits:
    # One verifier runs up to 64 sessions in an engine step (its --max-batch-sessions); more streams than that
    # only queue inside it, where no client can see why. Its --max-sessions (256) bounds the queue.
    max_running: int = 64
    max_queued: int = 256
    queue_timeout_s: float = 30.0
    tenant_max_running: int = 0  # per-tenant default when the tenant sets none; 0: only the global limit


class AdmissionObserver(Protocol):
    """Hears what admission decides (the coordinator's metrics implement it)."""

    def admitted(self, queue_s: float) -> None: ...

    def rejected(self, reason: str) -> None: ...


@dataclass
class _Waiter:
    tenant: str
    limit: int
    granted: asyncio.Future[None]
    enqueued: float


@dataclass
class Slot:
    """A held stream slot; ``queue_s`` is how long the request waited for it. ``release`` gives it back (once)."""

    queue_s: float = 0.0
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


@dataclass
class AdmissionController:
    limits: AdmissionLimits = AdmissionLimits()
    observer: AdmissionObserver | None = None
    clock: Callable[[], float] = time.monotonic
    _running: dict[str, int] = field(default_factory=dict)  # tenant name -> slots held
    _queue: deque[_Waiter] = field(default_factory=deque)
    _held_s: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # recent streams' slot times
    _draining: bool = False

    @property
    def running(self) -> int:
        return sum(self._running.values())

    @property
    def queued(self) -> int:
        return len(self._queue)

    def tenant_limit(self, tenant: Tenant) -> int:
        return tenant.max_concurrent_streams or self.limits.tenant_max_running

    @asynccontextmanager
    async def slot(self, tenant: Tenant) -> AsyncIterator[Slot]:
        """Hold a stream slot for the block; waits in the queue, or raises ResourceExhausted/DeadlineExceeded."""
        slot = await self.acquire(tenant)
        try:
            yield slot
        finally:
            slot.release()

    async def acquire(self, tenant: Tenant) -> Slot:
        """A stream slot the caller must ``release`` however the stream ends (an HTTP response outlives the handler
        that took it); waits in the queue, or raises ResourceExhausted/DeadlineExceeded."""
        queue_s = await self._acquire(tenant)
        started = self.clock()

        def release() -> None:
            self._held_s.append(self.clock() - started)
            self._release(tenant.name)

        return Slot(queue_s, release)

    def drain(self) -> None:
        """Refuse new streams and the queued ones from now on; running streams go on to their end."""
        self._draining = True
        for waiter in self._queue:
            waiter.granted.set_exception(self._shutting_down())
        self._queue.clear()

    @staticmethod
    def _shutting_down() -> Unavailable:
        return Unavailable("the coordinator is shutting down: retry, another replica will take the request")

    def _may_run(self, tenant: str, limit: int) -> bool:
        return self.running < self.limits.max_running and (limit <= 0 or self._running.get(tenant, 0) < limit)

    def _take(self, tenant: str) -> None:
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def _release(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._dispatch()

    def _dispatch(self) -> None:
        """Give free slots to the oldest waiters whose tenants are under their limits."""
        for waiter in list(self._queue):
            if self.running >= self.limits.max_running:
                return
            if self._may_run(waiter.tenant, waiter.limit):
                self._queue.remove(waiter)
                self._take(waiter.tenant)
                waiter.granted.set_result(None)

    async def _acquire(self, tenant: Tenant) -> float:
        """Take a slot for ``tenant``; returns the seconds spent waiting for it."""
        deadlines.check()
        if self._draining:
            raise self._shutting_down()
        limit = self.tenant_limit(tenant)
        if self._may_run(tenant.name, limit):
            self._take(tenant.name)
            self._admitted(0.0)
            return 0.0
        if limit > 0 and sum(w.tenant == tenant.name for w in self._queue) >= limit:
            raise self._refuse(
                "tenant_queue_full",
                f"tenant {tenant.name!r} already has {limit} streams waiting for a slot, as many as its limit "
                f"of {limit} concurrent streams (max_concurrent_streams, or --tenant-max-concurrent-streams)",
            )
        if len(self._queue) >= self.limits.max_queued:
            raise self._refuse(
                "queue_full",
                f"the coordinator is at its limit: {self.limits.max_running} streams running and "
                f"{self.limits.max_queued} waiting (--max-concurrent-streams, --max-queued-streams)",
            )
        timeout_s = self.limits.queue_timeout_s
        wait_s = deadlines.bounded(timeout_s)
        deadline_first = wait_s < timeout_s
        waiter = _Waiter(tenant.name, limit, asyncio.get_running_loop().create_future(), self.clock())
        self._queue.append(waiter)
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(waiter.granted)
        except TimeoutError:
            if not waiter.granted.done():
                self._leave(waiter)
                raise self._timed_out(waiter, timeout_s, deadline_first) from None
        except BaseException:  # the client went away while waiting, or the coordinator is shutting down
            granted = waiter.granted
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self._release(tenant.name)  # granted in the same instant: give it back
            elif waiter in self._queue:
                self._leave(waiter)
            raise
        waited = self.clock() - waiter.enqueued
        self._admitted(waited)
        return waited

    def _leave(self, waiter: _Waiter) -> None:
        waiter.granted.cancel()
        self._queue.remove(waiter)

    def _timed_out(self, waiter: _Waiter, timeout_s: float, deadline_first: bool) -> Exception:
        if deadline_first:
            self._rejected("deadline")
            return DeadlineExceeded(
                f"the request's deadline passed after {self.clock() - waiter.enqueued:.1f} s waiting for a "
                "stream slot: the coordinator is busy; retry later or with a longer deadline"
            )
        return self._refuse(
            "queue_timeout",
            f"no stream slot freed within {timeout_s:g} s (--queue-timeout-s): the coordinator is overloaded",
        )

    def retry_after_s(self) -> float:
        """When a refused request may find a slot: the time for the waiters ahead of it to start."""
        return estimate_retry_after_s(self._held_s, self.queued + 1, self.limits.max_running)

    def _refuse(self, reason: str, why: str) -> ResourceExhausted:
        self._rejected(reason)
        retry_ms = round(self.retry_after_s() * 1000)
        return ResourceExhausted(f"{why}; retry after {retry_ms} ms", metadata=(("retry-after-ms", str(retry_ms)),))

    def _admitted(self, queue_s: float) -> None:
        if self.observer is not None:
            self.observer.admitted(queue_s)

    def _rejected(self, reason: str) -> None:
        if self.observer is not None:
            self.observer.rejected(reason)
