"""Server reflection on the coordinator's server: which services it lists, and that it wants the API key."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.grpc_clients import peer_code
from coordinator.main import add_reflection
from specserve.auth.interceptors import ApiKeyInterceptor
from specserve.auth.keys import ApiKeys, key_entry, new_key
from specserve.rpc import add_health
from specserve.v1 import generation_pb2_grpc

KEY = new_key()
SERVICES = {"specserve.v1.GenerationService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


async def reflect(
    channel: grpc.aio.Channel, request: reflection_pb2.ServerReflectionRequest, metadata: tuple[tuple[str, str], ...]
) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([request]), metadata=metadata)
    responses = [response async for response in call]
    assert len(responses) == 1
    return responses[0]


def test_reflection_lists_the_coordinators_services_and_wants_the_api_key(tmp_path: Path) -> None:
    keys_path = tmp_path / "keys.yaml"
    keys_path.write_text(f"keys:\n  {key_entry(KEY, 'acme', 'ci')}\n")

    async def scenario() -> None:
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys(keys_path))])
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            generation_pb2_grpc.GenerationServiceServicer(), server
        )
        add_health(server, [])
        add_reflection(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                list_services = reflection_pb2.ServerReflectionRequest(list_services="")
                refused = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([list_services]))
                with pytest.raises(grpc.aio.AioRpcError):
                    [response async for response in refused]
                # The request, written while the server refuses the call, can end first in gRPC's own INTERNAL
                # ("Failed execute_batch"): the server's status is what the call ends with.
                assert await peer_code(refused) == grpc.StatusCode.UNAUTHENTICATED

                key = (("authorization", f"Bearer {KEY}"),)
                listed = await reflect(channel, list_services, key)
                assert {s.name for s in listed.list_services_response.service} == SERVICES

                symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="specserve.v1.GenerationService")
                files = (await reflect(channel, symbol, key)).file_descriptor_response.file_descriptor_proto
                parsed = [descriptor_pb2.FileDescriptorProto.FromString(data) for data in files]
                generation = next(f for f in parsed if f.name == "specserve/v1/generation.proto")
                methods = {m.name for s in generation.service for m in s.method}
                assert methods == {"Generate"}
        finally:
            await server.stop(None)

    asyncio.run(scenario())
