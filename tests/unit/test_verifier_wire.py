"""The verifier over gRPC (target_service.server <-> coordinator.grpc_clients): successors and VerifierInfo."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from coordinator.grpc_clients import GrpcVerifier
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from specserve.v1 import verifier_pb2_grpc
from specserve.verify_call import SessionPrefill, VerifyCall
from target_service.metrics import VerifierMetrics
from target_service.server import VerifierServicer
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

VOCAB = 32
PROMPT = [1, 2, 3, 4]
TREE = TokenTree([5, 6, 7], [-1, 0, 0])


@pytest.mark.parametrize("stream", [True, False], ids=["verify-stream", "unary-verify"])
def test_successors_cross_the_wire_one_row_per_scored_position(stream: bool) -> None:
    verifier = Verifier(tiny_llama(vocab_size=VOCAB, context=128), "fp")
    verifier.prefill("local", PROMPT, SamplingParams())
    local = verifier.verify("local", len(PROMPT), TREE, num_successors=3)
    assert len(local.successors) == 1 + len(TREE) and all(len(row) == 3 for row in local.successors)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(VerifierServicer(VerifierMetrics(), verifier), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def over_grpc() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            remote = GrpcVerifier(channel, f"127.0.0.1:{port}", timeout_s=30, stream=stream)
            info = await remote.info()
            assert info.vocab_size == VOCAB and info.vocab_fingerprint == "fp"
            await remote.prefill(SessionPrefill("remote", tuple(PROMPT), SamplingParams()))
            result = await remote.verify(VerifyCall("remote", len(PROMPT), TREE, num_successors=3))
            assert result.successors == local.successors
            assert result.committed == local.committed
            await remote.prefill(SessionPrefill("none", tuple(PROMPT), SamplingParams()))
            assert (await remote.verify(VerifyCall("none", len(PROMPT), TREE))).successors == []

    try:
        asyncio.run(over_grpc())
    finally:
        server.stop(None)
        verifier.close()
