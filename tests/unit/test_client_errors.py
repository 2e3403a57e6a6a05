"""What clients read when a worker fails: a short cause, never an internal address, a peer's own words or a
library's text; those go to the error's ``detail``, which only the log gets."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from coordinator.grpc_clients import GrpcDrafter, GrpcDraftStream, GrpcVerifier
from coordinator.verifier_router import StickyVerifierRouter
from specserve.drain import DRAINING_METADATA
from specserve.errors import DrafterFailed, ReplicaUnreachable, SpecserveError, Unavailable
from specserve.results import DraftFeedback, PrefillResult
from specserve.sampling import SamplingParams
from specserve.verify_call import SessionPrefill

ADDRESS = "10.1.2.3:50051"
PEER_TEXT = "Socket closed; debug_error_string = {grpc_status:14}"


def rpc_error(code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=PEER_TEXT)


def assert_public(error: SpecserveError, address: str = ADDRESS) -> None:
    message = str(error)
    host = address.rsplit(":", 1)[0]
    assert message and host not in message, message
    assert "debug_error_string" not in message and "Socket closed" not in message, message
    assert address in error.detail  # the operator's story, for the log


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


@pytest.mark.parametrize(
    ("code", "trailing"),
    [
        (grpc.StatusCode.UNAVAILABLE, ()),
        (grpc.StatusCode.UNAVAILABLE, tuple(DRAINING_METADATA)),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ()),
        (grpc.StatusCode.INVALID_ARGUMENT, ()),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ()),
        (grpc.StatusCode.NOT_FOUND, ()),
        (grpc.StatusCode.FAILED_PRECONDITION, ()),
        (grpc.StatusCode.UNAUTHENTICATED, ()),
        (grpc.StatusCode.INTERNAL, ()),
    ],
)
def test_a_verifier_refusal_tells_the_client_the_cause_and_the_log_the_rest(
    code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...]
) -> None:
    async def translated() -> SpecserveError:
        async with grpc.aio.insecure_channel(ADDRESS) as channel:
            return GrpcVerifier(channel, ADDRESS, 1.0)._translate(rpc_error(code, trailing))

    error = asyncio.run(translated())
    assert_public(error)
    assert PEER_TEXT in error.detail


def test_an_unreachable_verifier_and_drafter_give_no_address_or_grpc_text() -> None:
    """Real channels to a port nothing listens on: grpc's own message names the address; the client's not."""
    address = free_address()

    async def failures() -> list[SpecserveError]:
        caught: list[SpecserveError] = []
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(ReplicaUnreachable) as unreachable:
                await GrpcVerifier(channel, address, 5.0).info()
            caught.append(unreachable.value)
            with pytest.raises(DrafterFailed) as failed:
                await GrpcDrafter(channel, address).open("s", [1], "fp", SamplingParams())
            caught.append(failed.value)
        return caught

    for error in asyncio.run(failures()):
        assert_public(error, address)


class GoneCall:
    """A Draft stream call whose drafter went away: writes fail as grpc's do, reads give ``read``."""

    def __init__(self, read: object) -> None:
        self._read = read

    async def write(self, request: object) -> None:
        raise rpc_error(grpc.StatusCode.UNAVAILABLE)

    async def read(self) -> object:
        if isinstance(self._read, BaseException):
            raise self._read
        return self._read

    def done(self) -> bool:
        return True  # ended, as a real call is once its writes fail

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # not a draining drafter's refusal


class SilentWrites(GoneCall):
    async def write(self, request: object) -> None:
        return None


@pytest.mark.parametrize("read", [rpc_error(grpc.StatusCode.UNAVAILABLE), grpc.aio.EOF], ids=["reset", "eof"])
def test_a_lost_drafter_stream_is_a_short_cause_with_the_address_in_the_detail(read: object) -> None:
    async def failures() -> list[DrafterFailed]:
        caught = []
        with pytest.raises(DrafterFailed) as on_write:
            await GrpcDraftStream(GoneCall(read), ADDRESS, wants_features=False).start("s", [1], "fp")  # type: ignore[arg-type]
        caught.append(on_write.value)
        with pytest.raises(DrafterFailed) as on_read:
            await GrpcDraftStream(SilentWrites(read), ADDRESS, wants_features=False).propose(DraftFeedback(()), 4)  # type: ignore[arg-type]
        caught.append(on_read.value)
        return caught

    for failure in asyncio.run(failures()):
        assert ADDRESS not in str(failure) and "debug_error_string" not in str(failure)
        assert ADDRESS in failure.detail


class DeadReplica:
    def __init__(self, address: str) -> None:
        self.address = address

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        raise ReplicaUnreachable("a verifier replica is unreachable", detail=f"verifier at {self.address}: refused")


def test_when_every_verifier_replica_is_down_the_client_is_not_told_their_addresses() -> None:
    addresses = [ADDRESS, "10.1.2.4:50051"]
    router = StickyVerifierRouter(lambda: addresses, DeadReplica)  # type: ignore[arg-type]

    async def prefill_until_none_is_left() -> Unavailable:
        for _ in addresses:
            try:
                await router.prefill(SessionPrefill("s", (1, 2), SamplingParams()))
            except Unavailable as exc:
                last = exc
        return last

    error = asyncio.run(prefill_until_none_is_left())
    assert "10.1.2" not in str(error), str(error)
    assert ADDRESS in error.detail and "10.1.2.4:50051" in error.detail
