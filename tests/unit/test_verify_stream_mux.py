"""The coordinator's VerifyStream multiplexer over a fake stream call: out-of-order answers, deadlines,
cancellation, a dying stream and its re-opening, and a verifier without the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any

import grpc
import pytest

from coordinator.grpc_clients import GrpcVerifier
from coordinator.verify_stream import StreamCallFailed, StreamUnsupported, VerifyStreamMux
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from specserve.verify_call import VerifyCall

Answer = verifier_pb2.VerifyStreamResponse


class FakeStreamCall:
    """A VerifyStream call whose verifier is the test: it sees what the client writes and answers when told."""

    def __init__(self) -> None:
        self.written: asyncio.Queue[verifier_pb2.VerifyStreamRequest] = asyncio.Queue()
        self._inbox: asyncio.Queue[Answer | grpc.aio.AioRpcError] = asyncio.Queue()
        self._ended: grpc.aio.AioRpcError | None = None

    async def write(self, message: verifier_pb2.VerifyStreamRequest) -> None:
        if self._ended is not None:
            raise self._ended
        await self.written.put(message)

    async def read(self) -> Answer:
        item = await self._inbox.get()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def answer(self, call_id: int, bonus: int) -> None:
        self._inbox.put_nowait(Answer(call_id=call_id, verify=verifier_pb2.VerifyResponse(bonus_token_id=bonus)))

    def refuse(self, call_id: int, code: grpc.StatusCode, message: str, draining: bool = False) -> None:
        error = verifier_pb2.VerifyStreamError(code=code.value[0], message=message, draining=draining)
        self._inbox.put_nowait(Answer(call_id=call_id, error=error))

    def die(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, details: str = "Connection reset") -> None:
        if self._ended is None:
            self._ended = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
            self._inbox.put_nowait(self._ended)

    def cancel(self) -> bool:
        self.die(grpc.StatusCode.CANCELLED, "Locally cancelled")
        return True

    async def code(self) -> grpc.StatusCode:
        assert self._ended is not None
        return self._ended.code()

    async def details(self) -> str:
        assert self._ended is not None
        return self._ended.details() or ""

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()


class Verifier:
    """Opens fake stream calls and keeps every one it opened."""

    def __init__(self) -> None:
        self.calls: list[FakeStreamCall] = []

    def open(self) -> Any:
        self.calls.append(FakeStreamCall())
        return self.calls[-1]


def run(test: Callable[[VerifyStreamMux, Verifier], Awaitable[None]]) -> None:
    verifier = Verifier()

    async def main() -> None:
        mux = VerifyStreamMux(verifier.open)
        try:
            await test(mux, verifier)
        finally:
            mux.close()

    asyncio.run(main())


def request(session: str) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(session_id=session, num_committed_tokens=3)


async def sent(verifier: Verifier, stream: int = 0) -> verifier_pb2.VerifyStreamRequest:
    """The next message the client writes on its ``stream``-th stream (once it has opened it)."""
    while len(verifier.calls) <= stream:
        await asyncio.sleep(0)  # let the calling tasks run up to their first write
    return await verifier.calls[stream].written.get()


def test_answers_reach_their_calls_in_the_order_the_verifier_finishes_them() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        first = asyncio.create_task(mux.verify(request("a"), "t", None))
        second = asyncio.create_task(mux.verify(request("b"), "t", None))
        a, b = await sent(verifier), await sent(verifier)
        assert len(verifier.calls) == 1  # one stream carries both sessions
        assert (a.verify.session_id, b.verify.session_id, a.tenant) == ("a", "b", "t")
        verifier.calls[0].answer(b.call_id, 20)
        assert (await second).bonus_token_id == 20
        assert not first.done()
        verifier.calls[0].answer(a.call_id, 10)
        assert (await first).bonus_token_id == 10

    run(test)


def test_a_refused_call_fails_with_the_verifiers_status_and_the_stream_goes_on() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        refused = asyncio.create_task(mux.verify(request("a"), "t", None))
        call = (await sent(verifier)).call_id
        verifier.calls[0].refuse(call, grpc.StatusCode.NOT_FOUND, "no session a", draining=False)
        with pytest.raises(StreamCallFailed) as failed:
            await refused
        assert (failed.value.code, failed.value.details) == (grpc.StatusCode.NOT_FOUND, "no session a")
        answered = asyncio.create_task(mux.verify(request("b"), "t", None))
        verifier.calls[0].answer((await sent(verifier)).call_id, 7)
        assert (await answered).bonus_token_id == 7
        assert len(verifier.calls) == 1

    run(test)


def test_a_call_past_its_deadline_fails_and_is_withdrawn_from_the_verifier() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        with pytest.raises(StreamCallFailed) as failed:
            await mux.verify(request("a"), "t", 0.05)  # never answered
        assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        verify, cancel = await sent(verifier), await sent(verifier)
        assert cancel.WhichOneof("kind") == "cancel" and cancel.call_id == verify.call_id
        verifier.calls[0].answer(verify.call_id, 1)  # a late answer is dropped; the stream still serves
        later = asyncio.create_task(mux.verify(request("b"), "t", None))
        verifier.calls[0].answer((await sent(verifier)).call_id, 2)
        assert (await later).bonus_token_id == 2

    run(test)


def test_a_cancelled_caller_withdraws_its_call() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        waiting = asyncio.create_task(mux.verify(request("a"), "t", None))
        verify = await sent(verifier)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        cancel = await sent(verifier)
        assert cancel.WhichOneof("kind") == "cancel" and cancel.call_id == verify.call_id

    run(test)


def test_a_dead_stream_fails_every_waiting_call_as_unavailable_and_the_next_call_reopens_it() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        waiting = [asyncio.create_task(mux.verify(request(s), "t", None)) for s in "abc"]
        for _ in waiting:
            await sent(verifier)
        verifier.calls[0].die(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        for task in waiting:
            with pytest.raises(StreamCallFailed) as failed:
                await task
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE and not failed.value.draining
        again = asyncio.create_task(mux.verify(request("a"), "t", None))
        verifier_call = await sent(verifier, 1)
        assert len(verifier.calls) == 2
        verifier.calls[1].answer(verifier_call.call_id, 5)
        assert (await again).bonus_token_id == 5

    run(test)


@pytest.mark.parametrize("ended", [grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_any_other_end_of_the_stream_is_its_death(ended: grpc.StatusCode) -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        waiting = asyncio.create_task(mux.verify(request("a"), "t", None))
        await sent(verifier)
        verifier.calls[0].die(ended, "gone")
        with pytest.raises(StreamCallFailed) as failed:
            await waiting
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE

    run(test)


def test_a_stream_refused_for_its_credentials_fails_its_calls_with_that_status() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        waiting = asyncio.create_task(mux.verify(request("a"), "t", None))
        await sent(verifier)
        verifier.calls[0].die(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        with pytest.raises(StreamCallFailed) as failed:
            await waiting
        assert failed.value.code == grpc.StatusCode.UNAUTHENTICATED

    run(test)


def test_a_verifier_without_the_stream_says_so_to_every_waiting_call() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        waiting = asyncio.create_task(mux.verify(request("a"), "t", None))
        await sent(verifier)
        verifier.calls[0].die(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        with pytest.raises(StreamUnsupported):
            await waiting

    run(test)


def test_a_refusal_while_draining_says_so() -> None:
    async def test(mux: VerifyStreamMux, verifier: Verifier) -> None:
        waiting = asyncio.create_task(mux.verify(request("a"), "t", None))
        call = (await sent(verifier)).call_id
        verifier.calls[0].refuse(call, grpc.StatusCode.UNAVAILABLE, "shutting down", draining=True)
        with pytest.raises(StreamCallFailed) as failed:
            await waiting
        assert failed.value.draining  # what a unary refusal's trailing metadata says

    run(test)


class UnaryOnlyServicer(verifier_pb2_grpc.VerifierServiceServicer):
    """An older verifier: Verify only (VerifyStream answers UNIMPLEMENTED, the generated base's default)."""

    def __init__(self) -> None:
        self.verifies = 0

    def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext) -> verifier_pb2.VerifyResponse:
        self.verifies += 1
        return verifier_pb2.VerifyResponse(bonus_token_id=request.num_committed_tokens)


def test_a_verifier_without_the_stream_gets_unary_calls_for_the_same_answers() -> None:
    servicer = UnaryOnlyServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = GrpcVerifier(channel, f"127.0.0.1:{port}", timeout_s=30, stream=True)
            assert (await client.verify(VerifyCall("s", 4))).bonus_token == 4
            assert (await client.verify(VerifyCall("s", 5))).bonus_token == 5

    try:
        asyncio.run(main())
    finally:
        server.stop(None)
    assert servicer.verifies == 2
