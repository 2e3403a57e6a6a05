"""Admission control: global and per-tenant limits, FIFO order, refusals with retry-after-ms, deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from coordinator import deadlines
from coordinator.admission import AdmissionController, AdmissionLimits
from coordinator.metrics import CoordinatorMetrics
from specserve.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from specserve.tenancy import Tenant

A, B = Tenant("a"), Tenant("b")


class Streams:
    """Streams that each hold a slot until told to finish; records the order they started in."""

    def __init__(self, admission: AdmissionController) -> None:
        self.admission = admission
        self.started: list[str] = []
        self.queue_s: dict[str, float] = {}
        self._finish: dict[str, asyncio.Event] = {}

    def open(self, name: str, tenant: Tenant) -> asyncio.Task[None]:
        self._finish[name] = asyncio.Event()

        async def run() -> None:
            async with self.admission.slot(tenant) as slot:
                self.started.append(name)
                self.queue_s[name] = slot.queue_s
                await self._finish[name].wait()

        return asyncio.get_running_loop().create_task(run())

    def finish(self, name: str) -> None:
        self._finish[name].set()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def test_at_most_max_running_streams_run_and_the_queue_is_fifo() -> None:
    async def test() -> None:
        now = [100.0]  # the admission clock, moved by the test alone
        admission = AdmissionController(AdmissionLimits(max_running=2, max_queued=10), clock=lambda: now[0])
        streams = Streams(admission)
        tasks = [streams.open(f"s{i}", A if i % 2 else B) for i in range(5)]
        await settle()
        assert streams.started == ["s0", "s1"]
        assert (admission.running, admission.queued) == (2, 3)
        streams.finish("s1")
        await settle()
        assert streams.started == ["s0", "s1", "s2"]
        streams.finish("s0")
        now[0] += 0.01
        streams.finish("s2")
        await settle()
        assert streams.started == ["s0", "s1", "s2", "s3", "s4"]
        assert streams.queue_s["s0"] == 0.0 and streams.queue_s["s4"] == pytest.approx(0.01)
        for name in ("s3", "s4"):
            streams.finish(name)
        await asyncio.gather(*tasks)
        assert (admission.running, admission.queued) == (0, 0)

    run(test)


def test_a_saturating_tenant_does_not_starve_another() -> None:
    async def test() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=3, max_queued=10, tenant_max_running=2))
        streams = Streams(admission)
        tasks = [streams.open(f"a{i}", A) for i in range(4)]  # a0, a1 run; a2, a3 wait (a's queue share is full)
        await settle()
        with pytest.raises(ResourceExhausted, match="tenant 'a'"):
            async with admission.slot(A):
                pass
        tasks.append(streams.open("b0", B))  # a global slot is free and b is under its limit: b goes first
        await settle()
        assert streams.started == ["a0", "a1", "b0"]
        tasks.append(streams.open("b1", B))  # queued behind a2 and a3
        await settle()
        streams.finish("b0")  # the oldest waiter whose tenant is under its limit is b1, not a2
        await settle()
        assert streams.started == ["a0", "a1", "b0", "b1"]
        streams.finish("a0")
        await settle()
        assert streams.started[-1] == "a2"
        for name in ("a1", "a2", "a3", "b1"):
            streams.finish(name)
            await settle()
        await asyncio.gather(*tasks)
        assert streams.started[-1] == "a3"

    run(test)


def test_a_tenants_own_limit_overrides_the_default() -> None:
    admission = AdmissionController(AdmissionLimits(tenant_max_running=2))
    assert admission.tenant_limit(Tenant("x", max_concurrent_streams=5)) == 5
    assert admission.tenant_limit(Tenant("y")) == 2
    assert AdmissionController().tenant_limit(Tenant("z")) == 0


def test_beyond_the_queue_is_resource_exhausted_with_retry_after() -> None:
    async def test() -> None:
        metrics = CoordinatorMetrics()
        admission = AdmissionController(AdmissionLimits(max_running=1, max_queued=1), metrics)
        metrics.track_admission(admission)
        streams = Streams(admission)
        tasks = [streams.open("s0", A), streams.open("s1", A)]
        await settle()
        with pytest.raises(ResourceExhausted, match="--max-queued-streams") as refused:
            async with admission.slot(B):
                pass
        metadata = dict(refused.value.metadata)
        assert int(metadata["retry-after-ms"]) > 0
        assert f"retry after {metadata['retry-after-ms']} ms" in str(refused.value)
        value = metrics.registry.get_sample_value
        assert value("specserve_admission_rejections_total", {"reason": "queue_full"}) == 1
        assert (value("specserve_num_requests_running"), value("specserve_num_requests_waiting")) == (1, 1)
        streams.finish("s0")
        streams.finish("s1")
        await asyncio.gather(*tasks)
        assert value("specserve_request_queue_time_seconds_count") == 2

    run(test)


def test_retry_after_follows_recent_stream_durations() -> None:
    async def test() -> None:
        now = [100.0]  # the admission clock, moved by the test alone
        admission = AdmissionController(AdmissionLimits(max_running=1, max_queued=0), clock=lambda: now[0])
        for held_s in (0.1, 0.15, 0.2):
            async with admission.slot(A):
                now[0] += held_s
        async with admission.slot(A):
            with pytest.raises(ResourceExhausted) as refused:
                async with admission.slot(B):
                    pass
        assert dict(refused.value.metadata)["retry-after-ms"] == "150"  # one stream ahead, at the mean duration

    run(test)


def test_queue_timeout_is_resource_exhausted() -> None:
    async def test() -> None:
        metrics = CoordinatorMetrics()
        admission = AdmissionController(AdmissionLimits(max_running=1, queue_timeout_s=0.05), metrics)
        async with admission.slot(A):
            with pytest.raises(ResourceExhausted, match="--queue-timeout-s") as refused:
                async with admission.slot(B):
                    pass
            assert "retry-after-ms" in dict(refused.value.metadata)
            assert admission.queued == 0
        assert admission.running == 0
        assert (
            metrics.registry.get_sample_value("specserve_admission_rejections_total", {"reason": "queue_timeout"}) == 1
        )

    run(test)


def test_slots_are_released_when_a_stream_is_cancelled_or_fails() -> None:
    async def test() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=1))
        streams = Streams(admission)
        running = streams.open("running", A)
        waiting = streams.open("waiting", B)
        await settle()
        waiting.cancel()  # the client gives up while queued
        await settle()
        assert (admission.running, admission.queued) == (1, 0)
        running.cancel()  # the client cancels mid-stream
        await settle()
        assert admission.running == 0
        with pytest.raises(RuntimeError):
            async with admission.slot(A):
                raise RuntimeError("the verifier failed")
        assert admission.running == 0
        async with admission.slot(A):  # nothing was left behind
            assert admission.running == 1

    run(test)


def test_a_stream_cancelled_in_the_tick_its_slot_is_granted_gives_the_slot_back() -> None:
    """The slot frees and the queued client hangs up in the same loop tick: it must not start.

    (On Python 3.11 ``asyncio.wait_for`` returned the grant and dropped the cancellation, CPython gh-86296.)
    """

    async def test() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=1))
        streams = Streams(admission)
        go = asyncio.Event()

        async def first() -> None:
            async with admission.slot(A):
                await go.wait()
            waiting.cancel()  # the slot was granted to `waiting` as the block ended, in this same tick

        running = asyncio.get_running_loop().create_task(first())
        await settle()
        waiting = streams.open("waiting", B)
        await settle()
        assert (admission.running, admission.queued) == (1, 1)
        go.set()
        await settle()
        assert running.done() and waiting.cancelled()
        assert streams.started == []
        assert (admission.running, admission.queued) == (0, 0)

    run(test)


def test_the_deadline_bounds_the_wait_in_the_queue() -> None:
    async def test() -> None:
        metrics = CoordinatorMetrics()
        admission = AdmissionController(AdmissionLimits(max_running=1, queue_timeout_s=30), metrics)
        async with admission.slot(A):
            with deadlines.deadline_scope(0.05), pytest.raises(DeadlineExceeded, match="deadline"):
                async with admission.slot(B):
                    pass
            assert admission.queued == 0
        with deadlines.deadline_scope(0.0), pytest.raises(DeadlineExceeded):
            async with admission.slot(B):
                pass
        assert admission.running == 0
        assert metrics.registry.get_sample_value("specserve_admission_rejections_total", {"reason": "deadline"}) == 1

    run(test)


def test_bounded_timeouts_follow_the_deadline() -> None:
    assert deadlines.bounded(5.0) == 5.0
    with deadlines.deadline_scope(1.0):
        assert 0.5 < deadlines.bounded(5.0) <= 1.0
        assert deadlines.bounded(0.2) == 0.2
    with deadlines.deadline_scope(-1.0), pytest.raises(DeadlineExceeded):
        deadlines.bounded(5.0)


def test_draining_refuses_new_and_queued_streams_and_lets_running_ones_finish() -> None:
    async def test() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=1))
        streams = Streams(admission)
        running = streams.open("running", A)
        queued = streams.open("queued", B)
        await settle()
        admission.drain()
        with pytest.raises(Unavailable, match="shutting down"):
            await queued
        with pytest.raises(Unavailable, match="shutting down"):
            async with admission.slot(B):
                pass
        assert (admission.running, admission.queued) == (1, 0)
        streams.finish("running")
        await running
        assert admission.running == 0

    run(test)
