"""The drafter's connection age limit: clients reconnect (and so resolve DNS again), open streams finish."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from draft_service.config import DrafterConfig
from draft_service.main import drafter_server_options, parse_config
from specserve.rpc import channel_options
from specserve.v1 import drafter_pb2, drafter_pb2_grpc


class PeerEcho(drafter_pb2_grpc.DrafterServiceServicer):
    """DrafterInfo names the caller's connection (its address and port); Draft answers each request."""

    async def DrafterInfo(
        self, request: drafter_pb2.DrafterInfoRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterInfoResponse:
        return drafter_pb2.DrafterInfoResponse(sources=[context.peer()])

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        async for _ in request_iterator:
            yield drafter_pb2.DraftResponse(draft_ns=1)


def test_old_connections_are_replaced_while_open_streams_finish() -> None:
    config = DrafterConfig(max_connection_age_s=0.3)
    assert ("grpc.max_connection_age_ms", 300) in drafter_server_options(config)

    async def scenario() -> None:
        server = grpc.aio.server(options=drafter_server_options(config))
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(PeerEcho(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                stub = drafter_pb2_grpc.DrafterServiceStub(channel)

                async def peer() -> str:
                    return (await stub.DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=5)).sources[0]

                propose = drafter_pb2.DraftRequest(propose=drafter_pb2.ProposeTree(max_nodes=1))
                stream = stub.Draft()
                await stream.write(propose)
                assert (await stream.read()).draft_ns == 1
                first = await peer()
                # gRPC's own timer (0.3 s plus up to 10% jitter, then a GOAWAY) ends the connection: wait for the
                # new one to show, however long a busy machine takes; the guard only turns a hang into a failure.
                async with asyncio.timeout(30):
                    while (second := await peer()) == first:
                        await asyncio.sleep(0.05)
                assert second != first  # a new connection: the moment a client resolves its target again
                await stream.write(propose)  # the stream opened on the old connection still works
                assert (await stream.read()).draft_ns == 1
                await stream.done_writing()
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_the_age_limit_is_a_flag() -> None:
    config, _ = parse_config(["--max-connection-age-s", "120"])
    assert drafter_server_options(config)[-1] == ("grpc.max_connection_age_ms", 120_000)
