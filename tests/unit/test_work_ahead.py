"""Work ahead runs on a thread of its own, and a session's queued work is dropped when its report arrives.

Synchronised on events, never on sleeps: a thread that is blocked stays blocked until the test lets it go.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.work_ahead import WorkAhead
from specserve.drain import Drain
from specserve.v1 import drafter_pb2_grpc
from tests.unit.test_drain import Stream, drafter_server, propose, start

GUARD_S = 30  # a guard only: each wait ends on an event long before


def hold(busy: threading.Event, release: threading.Event) -> None:
    busy.set()
    release.wait(GUARD_S)


def test_queued_work_is_dropped_and_the_step_in_hand_is_waited_for() -> None:
    async def scenario() -> None:
        ahead = WorkAhead()
        running, release = threading.Event(), threading.Event()
        ran: list[str] = []

        def in_hand() -> None:
            running.set()
            release.wait(GUARD_S)
            ran.append("in hand")

        first = ahead.submit(in_hand)
        queued = ahead.submit(lambda: ran.append("queued"))
        await asyncio.to_thread(running.wait, GUARD_S)
        assert await ahead.stop(queued, threading.Event()) is True, "queued behind another: dropped"
        stopping = asyncio.ensure_future(ahead.stop(first, threading.Event()))
        await asyncio.sleep(0)
        assert not stopping.done(), "a step in hand is finished before the answer"
        release.set()
        async with asyncio.timeout(GUARD_S):
            assert await stopping is False
        assert ran == ["in hand"]
        ahead.close()

    asyncio.run(scenario())


def test_work_ahead_has_its_own_thread() -> None:
    ahead = WorkAhead()
    names: list[str] = []
    for _ in range(3):
        ahead.submit(lambda: names.append(threading.current_thread().name)).result(GUARD_S)
    assert len(set(names)) == 1 and names[0].startswith("work-ahead")
    ahead.close()


def test_a_report_is_answered_while_the_work_ahead_thread_is_busy_with_another_session() -> None:
    """With work ahead on asyncio's default executor, or waited for in its queue, the answer would wait."""

    async def scenario() -> None:
        drafter = Drafter(lambda *_: InMemoryNgramPool(), predraft_outcomes=2)
        ahead = WorkAhead()
        server, address = await drafter_server(Drain(), drafter=drafter, work_ahead=ahead)
        busy, release = threading.Event(), threading.Event()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stream = Stream(drafter_pb2_grpc.DrafterServiceStub(channel))
                async with asyncio.timeout(GUARD_S):
                    # Another session's step holds the work-ahead thread: this session's work queues behind it.
                    ahead.submit(lambda: hold(busy, release))
                    await asyncio.to_thread(busy.wait, GUARD_S)
                    await stream.send(start("s"))
                    await stream.send(propose([4, 5, 1, 2, 3]))
                    await stream.call.read()
                    await stream.send(propose([4, 5]))
                    reply = await stream.call.read()
                assert reply.draft_ns > 0
                assert drafter.predraft_counts.dropped == 1
                release.set()
                await stream.close()
        finally:
            release.set()
            await server.stop(0)
            ahead.close()

    asyncio.run(scenario())
