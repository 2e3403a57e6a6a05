"""The coordinator's end of a VerifyStream: one stream per verifier connection, shared by every session's rounds.

A unary Verify pays for a new HTTP/2 stream each round (headers, metadata, its own completion); one long-lived
stream carries every session's calls instead, each message tagged with a call id. A reader task takes the
verifier's answers off the stream as the engine finishes them, in any order, and resolves the waiting call's
future by its id.

Each call keeps a unary call's guarantees:
- its deadline: a call past it fails with DEADLINE_EXCEEDED, and a cancel message takes it out of the
  verifier's queue (so does a caller that goes away);
- failover: when the stream dies (the verifier's process is killed, the connection resets), every call waiting
  on it fails with UNAVAILABLE, exactly as its own unary call would have, so the router moves the sessions
  to another replica; the next call opens a new stream;
- older verifiers: a verifier without VerifyStream ends it with UNIMPLEMENTED, which fails the waiting calls
  with ``StreamUnsupported``; the caller then sends them, and every later call, as unary Verify calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable

import grpc

from specserve.drain import DRAINING_METADATA
from specserve.v1 import verifier_pb2

log = logging.getLogger(__name__)

OpenStream = Callable[[], grpc.aio.StreamStreamCall]
"""Opens a new VerifyStream call (with the caller's credentials as its metadata)."""

EndedCode = Callable[[grpc.aio.StreamStreamCall], Awaitable[grpc.StatusCode]]
"""An ended call's status code (``grpc_clients.peer_code``: the peer's own where a failed write hid it)."""


async def own_code(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
    return await call.code()


PASSED_THROUGH = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""Statuses that end a stream for a reason every call on it shares (its credentials, its messages, the
server's call limit): its calls fail with that status, as their unary calls would. Any other end of a stream is
its death, and its calls fail with UNAVAILABLE."""

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamCallFailed(Exception):
    """A call on the stream ended with ``code``: the verifier's status for it, or the dead stream's UNAVAILABLE.

    ``details`` is the verifier's own text (for the log, never for clients); ``draining``: the verifier is
    shutting down and refused the call as new work.
    """

    def __init__(self, code: grpc.StatusCode, details: str, draining: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.draining = draining


class StreamUnsupported(Exception):
    """The verifier does not implement VerifyStream: send the call (and later ones) as a unary Verify."""


class _Stream:
    """One VerifyStream call and the calls waiting on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall, ended_code: EndedCode) -> None:
        self.call = call
        self._ended_code = ended_code
        self.pending: dict[int, asyncio.Future[verifier_pb2.VerifyResponse]] = {}
        self.ended = False
        self._write_lock = asyncio.Lock()  # gRPC takes one message at a time on a call
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def write(self, message: verifier_pb2.VerifyStreamRequest) -> None:
        """Send ``message``; a stream that cannot take it is ended (its reader then fails the waiting calls)."""
        try:
            async with self._write_lock:
                await self.call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("VerifyStream write failed: %s", exc)
            self.call.cancel()

    async def _read(self) -> None:
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    break
                future = self.pending.pop(message.call_id, None)
                if future is None or future.done():
                    continue  # a call that gave up (deadline, cancelled): its answer is dropped
                if message.WhichOneof("outcome") == "verify":
                    future.set_result(message.verify)
                else:
                    error = message.error
                    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
                    future.set_exception(StreamCallFailed(code, error.message, error.draining))
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            self._end(StreamCallFailed(grpc.StatusCode.UNAVAILABLE, "the VerifyStream was closed"))
            raise
        self._end(await self._failure())

    async def _failure(self) -> Exception:
        """What the calls waiting on the ended stream fail with."""
        code = await self._ended_code(self.call)
        details = await self.call.details() or ""
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return StreamUnsupported(details)
        if code in PASSED_THROUGH:
            return StreamCallFailed(code, details)
        trailing = await self.call.trailing_metadata() or ()
        draining = code == grpc.StatusCode.UNAVAILABLE and any((k, v) in DRAINING_METADATA for k, v in trailing)
        return StreamCallFailed(
            grpc.StatusCode.UNAVAILABLE, f"the VerifyStream ended ({code.name}: {details})", draining
        )

    def _end(self, failure: Exception) -> None:
        """Fail every waiting call with ``failure``; new calls go to a new stream."""
        self.ended = True
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(failure)

    def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()


class VerifyStreamMux:
    """Verify calls of many sessions over one VerifyStream, opened when first needed and again after it died."""

    def __init__(self, open_stream: OpenStream, ended_code: EndedCode = own_code) -> None:
        self._open_stream = open_stream
        self._ended_code = ended_code
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self._cancels: set[asyncio.Task[None]] = set()

    def _current(self) -> _Stream:
        if self._stream is None or self._stream.ended:
            self._stream = _Stream(self._open_stream(), self._ended_code)
        return self._stream

    async def verify(
        self, request: verifier_pb2.VerifyRequest, tenant: str, timeout_s: float | None
    ) -> verifier_pb2.VerifyResponse:
        """The verifier's answer to ``request``; StreamCallFailed (or StreamUnsupported) when there is none.

        ``timeout_s``: the call's own deadline (None: none); past it the call is withdrawn and fails with
        DEADLINE_EXCEEDED.
        """
        stream = self._current()
        call_id = next(self._ids)
        answer: asyncio.Future[verifier_pb2.VerifyResponse] = asyncio.get_running_loop().create_future()
        stream.pending[call_id] = answer
        try:
            async with asyncio.timeout(timeout_s):
                await stream.write(verifier_pb2.VerifyStreamRequest(call_id=call_id, verify=request, tenant=tenant))
                return await answer
        except TimeoutError as exc:
            self._withdraw(stream, call_id)
            raise StreamCallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded on the VerifyStream") from exc
        except asyncio.CancelledError:
            self._withdraw(stream, call_id)
            raise

    def _withdraw(self, stream: _Stream, call_id: int) -> None:
        """Forget ``call_id`` and tell the verifier, so a call still queued there leaves the queue."""
        if stream.pending.pop(call_id, None) is None or stream.ended:
            return  # answered meanwhile, or the stream is gone with the verifier's copy of it
        cancel = verifier_pb2.VerifyStreamRequest(call_id=call_id, cancel=verifier_pb2.VerifyCancel())
        task = asyncio.get_running_loop().create_task(stream.write(cancel))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    def close(self) -> None:
        """End the stream (its waiting calls fail with UNAVAILABLE)."""
        if self._stream is not None:
            with contextlib.suppress(RuntimeError):
                self._stream.close()
            self._stream = None
