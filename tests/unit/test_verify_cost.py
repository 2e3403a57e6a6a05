"""The verifier's measured cost curve reaches the drafter's tree builder: VerifierInfo, then each StartSession."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
import pytest

from bench.inproc import InProcessDrafter, verifier_info
from coordinator.grpc_clients import GrpcDrafter, GrpcVerifier
from draft_service.drafter import Drafter, DraftSession
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.tree_builder import CPU_VERIFY_COST, VerifyCost
from specserve.drain import Drain
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from target_service.budget_policy import DraftBudget
from target_service.cost_curve import CostCurve, flat_curve, flattened
from target_service.metrics import VerifierMetrics
from target_service.server import VerifierServicer
from target_service.verifier import Verifier
from tests.conftest import tiny_llama
from tests.unit.test_drain import drafter_server

# A nearly flat curve, as a GPU measures it: 1 to 128 tokens scored cost 1.0 to 1.3 forwards.
MEASURED = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (0.010, 0.0101, 0.0101, 0.0102, 0.0104, 0.0108, 0.0115, 0.013))


def test_a_measured_curve_gives_the_cost_by_draft_nodes_and_an_unmeasured_one_none() -> None:
    cost = MEASURED.verify_cost()
    assert sorted(cost) == [0, 1, 3, 7, 15, 31, 63, 127]  # tokens scored minus the pending one
    assert cost[0] == 1.0 and cost[127] == pytest.approx(1.3)
    assert flat_curve().verify_cost() == {}


def test_a_flattened_curve_prices_every_measured_size_as_one_token_so_trees_fill_the_limit() -> None:
    steep = CostCurve((1, 4, 8, 16), (0.020, 0.021, 0.024, 0.030), per_session_s=0.001)
    flat = flattened(steep)
    assert flat.tokens == steep.tokens and flat.per_session_s == steep.per_session_s
    assert set(flat.verify_cost().values()) == {1.0} and sorted(flat.verify_cost()) == [0, 3, 7, 15]
    assert DraftBudget(steep, 16).nodes_for(1) < 16 == DraftBudget(flat, 16).nodes_for(1)


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ([(0, 1.0)], "at least one larger tree"),
        ([(1, 1.2), (4, 1.5)], "the cost at 0 nodes"),
        ([(0, 1.0), (0, 1.1), (3, 1.5)], "names a tree size twice"),
        ([(0, 1.0), (-1, 1.1)], "negative tree size"),
        ([(0, 1.0), (3, float("nan"))], "not a positive number"),
        ([(0, 1.0), (3, 0.0)], "not a positive number"),
    ],
)
def test_a_curve_unfit_to_cut_trees_with_is_refused_saying_why(points: list[tuple[int, float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VerifyCost.from_points(points)


def test_the_verifier_sends_its_measured_curve_in_verifier_info() -> None:
    verifier = Verifier(tiny_llama(vocab_size=32, context=64), "fp", cost_curve=MEASURED)
    assert verifier_info(verifier).verify_cost == tuple(sorted(MEASURED.verify_cost().items()))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(VerifierServicer(VerifierMetrics(), verifier), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def info() -> tuple[tuple[int, float], ...]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return (await GrpcVerifier(channel, f"127.0.0.1:{port}", timeout_s=30).info()).verify_cost

    try:
        assert asyncio.run(info()) == verifier_info(verifier).verify_cost
    finally:
        server.stop(None)
        verifier.close()


class RecordingDrafter(Drafter):
    """An n-gram drafter that records the verify cost each session was opened with."""

    def __init__(self) -> None:
        super().__init__(lambda fingerprint, namespace: InMemoryNgramPool())
        self.opened_with: list[VerifyCost | None] = []

    def open_session(self, *args: Any, **kwargs: Any) -> DraftSession:
        session = super().open_session(*args, **kwargs)
        self.opened_with.append(args[5] if len(args) > 5 else kwargs.get("verify_cost"))
        return session


def test_each_draft_session_is_cut_at_the_verifiers_cost_over_grpc_and_in_process() -> None:
    points = tuple(sorted(MEASURED.verify_cost().items()))
    drafter = RecordingDrafter()

    async def over_grpc() -> None:
        server, address = await drafter_server(Drain(), drafter)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                for opened, cost in enumerate((points, ()), start=1):  # a measured curve, then none
                    stream = await GrpcDrafter(channel, address, 32, verify_cost=cost).open("s", [1, 2, 3], "fp")
                    async with asyncio.timeout(10):  # the start message is read, then the stream may close
                        while len(drafter.opened_with) < opened:
                            await asyncio.sleep(0.01)
                    await stream.close()
        finally:
            await server.stop(None)

    asyncio.run(over_grpc())
    assert drafter.opened_with[0] == VerifyCost(dict(points))
    assert drafter.opened_with[1] is None  # the builder falls back to the drafter's own curve
    assert VerifyCost().points == CPU_VERIFY_COST

    asyncio.run(InProcessDrafter(drafter, verify_cost=points).open("p", [1, 2, 3], "fp"))
    assert drafter.opened_with[2] == VerifyCost(dict(points))


def start_with_cost(points: Sequence[tuple[int, float]]) -> drafter_pb2.DraftRequest:
    cost = [common_pb2.CostPoint(nodes=n, relative_cost=c) for n, c in points]
    return drafter_pb2.DraftRequest(
        start=drafter_pb2.StartSession(
            session_id="bad", prompt_token_ids=[1, 2], vocab_fingerprint="fp", verify_cost=cost
        )
    )


def test_a_malformed_cost_curve_is_an_invalid_argument_that_says_what_is_wrong() -> None:
    async def scenario() -> grpc.aio.AioRpcError:
        server, address = await drafter_server(Drain())
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = drafter_pb2_grpc.DrafterServiceStub(channel).Draft(iter([start_with_cost([(0, 1.0)])]))
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in call:
                        pass
                return error.value
        finally:
            await server.stop(None)

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "start.verify_cost" in (error.details() or "") and "at least one larger tree" in (error.details() or "")
