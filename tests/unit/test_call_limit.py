"""The call limit (specserve.call_limit): past it a client hears our RESOURCE_EXHAUSTED / 429, never the libraries'
"Concurrent RPC limit exceeded!" or uvicorn's plain 503; health is never counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import main as coordinator_main
from coordinator.config import (
    CALL_HEADROOM,
    grpc_call_backstop,
    http_connection_backstop,
    max_concurrent_calls,
)
from coordinator.metrics import CoordinatorMetrics
from coordinator.openai_api.app import create_app
from coordinator.openai_api.serve import HttpServer
from specserve.call_limit import CALL_LIMIT_MESSAGE, AioCallLimitInterceptor, CallLimit
from specserve.errors import ResourceExhausted
from specserve.rpc import add_health, mark_serving
from specserve.rpc_errors import AioErrorInterceptor
from specserve.v1 import generation_pb2, generation_pb2_grpc
from tests.unit.test_openai_api import FakeFrontend


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until the server's own state says ``predicate`` (the timeout only ends a hang)."""
    async with asyncio.timeout(30):
        while not predicate():
            await asyncio.sleep(0.001)


def test_a_call_past_the_limit_is_refused_with_retry_after_and_counted() -> None:
    refused: list[int] = []
    limit = CallLimit(2, "coordinator", retry_after_s=lambda: 1.5, on_refused=lambda: refused.append(1))
    with limit.held(), limit.held():
        assert limit.in_flight == 2
        with pytest.raises(ResourceExhausted) as error, limit.held():
            pass
        assert limit.in_flight == 2, "a refused call is not counted"
    assert limit.in_flight == 0 and refused == [1]
    assert str(error.value) == CALL_LIMIT_MESSAGE.format(server="coordinator", limit=2, retry_ms=1500)
    assert error.value.metadata == (("retry-after-ms", "1500"),)


def test_the_library_caps_sit_above_the_call_limit() -> None:
    config, _ = coordinator_main.parse_config(
        ["--max-concurrent-streams", "4", "--max-queued-streams", "10", "--max-health-watches", "8"]
    )
    assert max_concurrent_calls(config) == 4 + 10 + CALL_HEADROOM
    assert grpc_call_backstop(config) == max_concurrent_calls(config) + 8 + CALL_HEADROOM
    assert http_connection_backstop(config) == 2 * max_concurrent_calls(config)


class HeldGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """Generate answers one chunk, then waits for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.started += 1
        yield generation_pb2.GenerateResponse()
        await self.release.wait()


def test_grpc_answers_in_our_words_before_its_own_cap_and_health_stays_open() -> None:
    metrics = CoordinatorMetrics()

    async def scenario() -> None:
        limit = CallLimit(
            2, "coordinator", retry_after_s=lambda: 0.25, on_refused=lambda: metrics.rejected("call_limit")
        )
        servicer = HeldGeneration()
        server = grpc.aio.server(
            interceptors=[AioErrorInterceptor(), AioCallLimitInterceptor(limit)], maximum_concurrent_rpcs=4
        )
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        mark_serving(add_health(server, []), [])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, asyncio.timeout(30):
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                held = [stub.Generate(generation_pb2.GenerateRequest()) for _ in range(2)]
                for call in held:
                    await call.read()
                assert limit.in_flight == 2
                for _ in range(3):  # more than gRPC's own cap leaves: it would say "Concurrent RPC limit exceeded!"
                    refused = stub.Generate(generation_pb2.GenerateRequest())
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await refused.read()
                    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert error.value.details() == CALL_LIMIT_MESSAGE.format(
                        server="coordinator", limit=2, retry_ms=250
                    )
                    assert ("retry-after-ms", "250") in tuple(error.value.trailing_metadata() or ())
                health = health_pb2_grpc.HealthStub(channel)
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == (
                    health_pb2.HealthCheckResponse.SERVING
                )
                assert servicer.started == 2
                servicer.release.set()
                for call in held:
                    assert await call.code() == grpc.StatusCode.OK
                await until(lambda: limit.in_flight == 0)
                servicer.release.clear()
                again = stub.Generate(generation_pb2.GenerateRequest())
                await again.read()
                assert servicer.started == 3
                servicer.release.set()
                assert await again.code() == grpc.StatusCode.OK
        finally:
            await server.stop(grace=0)

    asyncio.run(scenario())
    value = metrics.registry.get_sample_value("specserve_admission_rejections_total", {"reason": "call_limit"})
    assert value == 3


def test_http_answers_our_429_json_before_uvicorns_503_and_health_stays_open() -> None:
    async def scenario() -> None:
        hold = asyncio.Event()
        frontend = FakeFrontend(hold=hold)
        limit = CallLimit(1, "coordinator's HTTP API", retry_after_s=lambda: 2.5)
        server = HttpServer(create_app(frontend, call_limit=limit), "127.0.0.1", 0, limit_concurrency=10)
        await server.start()
        try:
            base = f"http://127.0.0.1:{server.port}"
            async with httpx.AsyncClient() as client, asyncio.timeout(30):
                first = asyncio.create_task(
                    client.post(f"{base}/v1/completions", json={"model": "smollm2", "prompt": "a"})
                )
                await until(lambda: bool(frontend.calls))
                second = await client.post(f"{base}/v1/completions", json={"model": "smollm2", "prompt": "b"})
                assert second.status_code == 429 and len(frontend.calls) == 1
                assert second.json()["error"] == {
                    "message": CALL_LIMIT_MESSAGE.format(server="coordinator's HTTP API", limit=1, retry_ms=2500),
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "rate_limit_exceeded",
                }
                assert second.headers["retry-after"] == "3" and second.headers["retry-after-ms"] == "2500"
                assert second.headers["x-request-id"]
                assert (await client.get(f"{base}/health")).status_code == 200
                hold.set()
                assert (await first).status_code == 200
                await until(lambda: limit.in_flight == 0)
        finally:
            hold.set()
            await server.stop()

    asyncio.run(scenario())
