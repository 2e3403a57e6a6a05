"""The one error mapper, on a sync and an asyncio in-process server: every failure is a documented status."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from specserve.errors import InvalidArgument, ResourceExhausted
from specserve.local_cluster import free_port
from specserve.rpc_errors import AioErrorInterceptor, ErrorInterceptor
from specserve.v1 import generation_pb2

Request = generation_pb2.GenerateRequest
Response = generation_pb2.GenerateResponse
SERVICE = "test.Fake"
VALID = Request(prompt="hello", max_new_tokens=3).SerializeToString()
# Field 1 (prompt), length 2, bytes that are not UTF-8.
INVALID_UTF8 = b"\x0a\x02\xff\xfe"
CORRUPT = [b"\xff\xff\xff", VALID[:-1], VALID[:4], INVALID_UTF8]


def echo(request: Request) -> Response:
    return Response(delta=generation_pb2.TextDelta(text=request.prompt))


def busy() -> ResourceExhausted:
    return ResourceExhausted("busy: retry in 250 ms", metadata=(("retry-after-ms", "250"),))


class SyncFake:
    def echo(self, request: Request, context: grpc.ServicerContext) -> Response:
        return echo(request)

    def domain(self, request: Request, context: grpc.ServicerContext) -> Response:
        raise busy()

    def bug(self, request: Request, context: grpc.ServicerContext) -> Response:
        raise RuntimeError("secret /etc/path detail")

    def aborts(self, request: Request, context: grpc.ServicerContext) -> Response:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "nope")
        raise AssertionError

    def stream(self, request: Request, context: grpc.ServicerContext) -> Iterator[Response]:
        yield echo(request)
        raise InvalidArgument("second message is bad")

    def bidi(self, requests: Iterator[Request], context: grpc.ServicerContext) -> Iterator[Response]:
        for request in requests:
            yield echo(request)


class AioFake:
    async def echo(self, request: Request, context: grpc.aio.ServicerContext) -> Response:
        return echo(request)

    async def domain(self, request: Request, context: grpc.aio.ServicerContext) -> Response:
        raise busy()

    async def bug(self, request: Request, context: grpc.aio.ServicerContext) -> Response:
        raise RuntimeError("secret /etc/path detail")

    async def aborts(self, request: Request, context: grpc.aio.ServicerContext) -> Response:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "nope")

    async def stream(self, request: Request, context: grpc.aio.ServicerContext) -> AsyncIterator[Response]:
        yield echo(request)
        raise InvalidArgument("second message is bad")

    async def bidi(
        self, requests: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Response]:
        async for request in requests:
            yield echo(request)


def handlers(fake: Any) -> grpc.GenericRpcHandler:
    unary = {name: getattr(fake, name) for name in ("echo", "domain", "bug", "aborts")}
    table: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=Request.FromString, response_serializer=Response.SerializeToString
        )
        for name, behavior in unary.items()
    }
    table["stream"] = grpc.unary_stream_rpc_method_handler(
        fake.stream, request_deserializer=Request.FromString, response_serializer=Response.SerializeToString
    )
    table["bidi"] = grpc.stream_stream_rpc_method_handler(
        fake.bidi, request_deserializer=Request.FromString, response_serializer=Response.SerializeToString
    )
    return grpc.method_handlers_generic_handler(SERVICE, table)


def call_all(address: str) -> dict[str, Any]:
    """Every case against a server; raw bytes go out, so corrupt ones can be sent."""
    outcomes: dict[str, Any] = {}
    with grpc.insecure_channel(address) as channel:

        def unary(name: str, raw: bytes) -> Any:
            method = channel.unary_unary(f"/{SERVICE}/{name}", response_deserializer=Response.FromString)
            try:
                return method(raw, timeout=10)
            except grpc.RpcError as exc:
                return exc

        outcomes["echo"] = unary("echo", VALID)
        outcomes["domain"] = unary("domain", VALID)
        outcomes["bug"] = unary("bug", VALID)
        outcomes["aborts"] = unary("aborts", VALID)
        for i, raw in enumerate(CORRUPT):
            outcomes[f"corrupt{i}"] = unary("echo", raw)
        stream = channel.unary_stream(f"/{SERVICE}/stream", response_deserializer=Response.FromString)
        received: list[Any] = []
        try:
            for response in stream(VALID, timeout=10):
                received.append(response)
        except grpc.RpcError as exc:
            received.append(exc)
        outcomes["stream"] = received
        bidi = channel.stream_stream(f"/{SERVICE}/bidi", response_deserializer=Response.FromString)
        received = []
        try:
            for response in bidi(iter([VALID, INVALID_UTF8, VALID]), timeout=10):
                received.append(response)
        except grpc.RpcError as exc:
            received.append(exc)
        outcomes["bidi"] = received
    return outcomes


def check(outcomes: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    assert outcomes["echo"].delta.text == "hello"
    domain = outcomes["domain"]
    assert domain.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert domain.details() == "busy: retry in 250 ms"
    assert ("retry-after-ms", "250") in tuple(domain.trailing_metadata())
    bug = outcomes["bug"]
    assert bug.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in bug.details() and "RuntimeError" not in bug.details()
    assert bug.details().startswith("internal error ") and bug.details().endswith("the server logged it")
    ref = bug.details().split()[2].rstrip(";")
    assert any(ref in record.getMessage() and record.exc_info for record in caplog.records)
    assert outcomes["aborts"].code() == grpc.StatusCode.PERMISSION_DENIED
    assert outcomes["aborts"].details() == "nope"
    for i in range(len(CORRUPT)):
        corrupt = outcomes[f"corrupt{i}"]
        assert corrupt.code() == grpc.StatusCode.INVALID_ARGUMENT, i
        assert corrupt.details().startswith("the request is not a valid specserve.v1.GenerateRequest")
    first, error = outcomes["stream"]
    assert first.delta.text == "hello"
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "second message is bad")
    first, error = outcomes["bidi"]
    assert first.delta.text == "hello"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid specserve.v1.GenerateRequest" in error.details()


def test_sync_server_maps_every_failure(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="specserve.rpc_errors")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers([handlers(SyncFake())])
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        check(call_all(address), caplog)
    finally:
        server.stop(grace=None)


def test_aio_server_maps_every_failure(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="specserve.rpc_errors")

    async def main() -> dict[str, Any]:
        server = grpc.aio.server(interceptors=[AioErrorInterceptor()])
        server.add_generic_rpc_handlers([handlers(AioFake())])
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        try:
            return await asyncio.to_thread(call_all, address)
        finally:
            await server.stop(grace=None)

    check(asyncio.run(main()), caplog)
