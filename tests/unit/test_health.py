"""grpc.health.v1 on both server kinds: Check, Watch following status changes, and the cap on open watches."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from specserve.health import HealthServicer, WatchLimit, track_watches, watches_full
from specserve.rpc import add_health, mark_draining, mark_serving

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REQUEST = health_pb2.HealthCheckRequest(service="")


def open_watches(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("specserve_health_watches")


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the server until ``condition`` holds (synchronised on state; the timeout only bounds a hang)."""
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.001)


def test_the_asyncio_servicer_caps_watches_and_holds_no_thread() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        health = add_health(server, ["svc"], max_watches=8)
        registry = CollectorRegistry()
        track_watches(registry, health)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                assert (await stub.Check(REQUEST)).status == NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
                watches = [stub.Watch(REQUEST) for _ in range(8)]
                assert [(await w.read()).status for w in watches] == [NOT_SERVING] * 8
                assert open_watches(registry) == 8
                # More open watches than the event loop's default executor has threads: none of them holds one.
                async with asyncio.timeout(30):
                    assert await asyncio.to_thread(threading.get_ident) > 0
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Watch(REQUEST).read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert refused.value.details() == watches_full(8)
                assert (await stub.Check(REQUEST)).status == NOT_SERVING, "Check is never capped"
                mark_serving(health, ["svc"])
                assert [(await w.read()).status for w in watches] == [SERVING] * 8
                watches.pop().cancel()
                await until(lambda: health.watches.open == 7)
                again = stub.Watch(REQUEST)
                assert (await again.read()).status == SERVING
                mark_draining(health)
                assert (await again.read()).status == NOT_SERVING
                health.set("", SERVING)  # ignored once draining
                assert (await stub.Check(REQUEST)).status == NOT_SERVING
                for watch in [*watches, again]:
                    watch.cancel()
                await until(lambda: health.watches.open == 0)
                assert open_watches(registry) == 0
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_the_sync_servicer_caps_watches() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health: HealthServicer = add_health(server, ["svc"], max_watches=3)
    registry = CollectorRegistry()
    track_watches(registry, health)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # More watches than the pool has threads: in non-blocking mode a watch holds none.
            watches = [stub.Watch(REQUEST, timeout=30) for _ in range(3)]
            assert [next(w).status for w in watches] == [NOT_SERVING] * 3
            assert open_watches(registry) == 3
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Watch(REQUEST, timeout=30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert refused.value.details() == watches_full(3)  # type: ignore[attr-defined]
            assert stub.Check(REQUEST, timeout=30).status == NOT_SERVING
            mark_serving(health, ["svc"])
            assert [next(w).status for w in watches] == [SERVING] * 3
            closed = threading.Event()
            watches[0].add_done_callback(lambda _: closed.set())
            watches[0].cancel()
            assert closed.wait(30)
            asyncio.run(until(lambda: health.watches.open == 2))
            assert next(stub.Watch(REQUEST, timeout=30)).status == SERVING
    finally:
        # Bounded: stop(None) waits for the shutdown with no limit, and once (under make test's two workers) it
        # never returned; a shutdown that hangs now fails this test instead of stalling the suite.
        assert server.stop(0).wait(30), "the server did not shut down within 30 s"


def test_the_limit_counts_and_refuses_past_it() -> None:
    limit = WatchLimit(1)
    assert limit.try_open() and not limit.try_open() and limit.open == 1
    limit.close()
    assert limit.open == 0 and limit.try_open()
    assert not WatchLimit(0).try_open(), "0: Watch off, Check still served"
    with pytest.raises(ValueError, match="--max-health-watches"):
        WatchLimit(-1)
