"""The verifier's end of a VerifyStream: many Verify calls over one stream, answered as the engine finishes them.

A reader thread takes the coordinator's messages off the stream and starts each call (``start``: the unary
Verify's checks, ownership and in-flight accounting); this handler's thread writes each answer as its call
completes, so a short call is not held behind a long one. A cancel message takes a call still queued out of
the queue, and the stream ending does so for every call it carries, as a unary caller that goes away does:
the engine never computes a round nobody waits for. When the coordinator half-closes the stream, the calls in
flight are answered and then the stream ends.

A call that fails gets the status a unary Verify would have ended with, as a message on the stream: one bad
call never ends the stream, which the other sessions' calls share.
"""

from __future__ import annotations

import functools
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future

import grpc

from specserve.drain import DRAINING_METADATA
from specserve.errors import SpecserveError
from specserve.results import VerifyResult
from specserve.v1 import verifier_pb2
from specserve.wire import verify_result_to_proto

log = logging.getLogger(__name__)

Start = Callable[[verifier_pb2.VerifyRequest, str], "Future[VerifyResult]"]
"""Starts one call (its request and the tenant it acts for); raises SpecserveError when it is refused at once."""

_Outcome = tuple[int, "Future[VerifyResult] | BaseException"]


def error_message(call_id: int, exc: BaseException) -> verifier_pb2.VerifyStreamResponse:
    """The answer to a call that failed with ``exc``: its status, as a unary Verify would end with it.

    A domain error keeps its status and message (the message is for the coordinator's log; the coordinator
    words what its clients read); anything else is INTERNAL with a reference to the logged traceback.
    """
    if isinstance(exc, SpecserveError):
        try:
            code = grpc.StatusCode[exc.status]
        except KeyError:
            code = grpc.StatusCode.INTERNAL
        draining = any(pair in DRAINING_METADATA for pair in exc.metadata)
        error = verifier_pb2.VerifyStreamError(code=code.value[0], message=str(exc), draining=draining)
    else:
        ref = secrets.token_hex(4)
        log.error("internal error %s in a VerifyStream call", ref, exc_info=exc)
        error = verifier_pb2.VerifyStreamError(
            code=grpc.StatusCode.INTERNAL.value[0], message=f"internal error {ref}; the server logged it"
        )
    return verifier_pb2.VerifyStreamResponse(call_id=call_id, error=error)


def answer_stream(
    requests: Iterator[verifier_pb2.VerifyStreamRequest], context: grpc.ServicerContext, start: Start
) -> Iterator[verifier_pb2.VerifyStreamResponse]:
    """Answer every call that ``requests`` carries, in the order they finish (reading starts at once)."""
    outbox: queue.SimpleQueue[_Outcome | None] = queue.SimpleQueue()  # None: the coordinator stopped writing
    running: dict[int, Future[VerifyResult]] = {}
    lock = threading.Lock()

    def finished(call_id: int, future: Future[VerifyResult]) -> None:
        outbox.put((call_id, future))

    def read() -> None:
        try:
            for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "verify":
                    try:
                        future = start(message.verify, message.tenant)
                    except Exception as exc:  # refused before it reached the engine
                        outbox.put((message.call_id, exc))
                        continue
                    with lock:
                        running[message.call_id] = future
                    future.add_done_callback(functools.partial(finished, message.call_id))
                elif kind == "cancel":
                    with lock:
                        cancelled = running.get(message.call_id)
                    if cancelled is not None:
                        cancelled.cancel()  # a call the engine already runs completes; its answer is dropped
        except Exception as exc:  # the stream broke: the context's callback takes its calls out of the queue
            log.debug("VerifyStream reader ended: %s", exc)
        finally:
            outbox.put(None)

    def cancel_all() -> None:
        with lock:
            calls = list(running.values())
        for future in calls:
            future.cancel()

    def answers() -> Iterator[verifier_pb2.VerifyStreamResponse]:
        reading = True
        while True:
            with lock:
                if not reading and not running:
                    return
            item = outbox.get()
            if item is None:
                reading = False
                continue
            call_id, outcome = item
            if isinstance(outcome, BaseException):
                yield error_message(call_id, outcome)
                continue
            with lock:
                running.pop(call_id, None)
            if outcome.cancelled():
                continue
            try:
                result = outcome.result()
            except CancelledError:
                continue
            except Exception as exc:
                yield error_message(call_id, exc)
                continue
            yield verifier_pb2.VerifyStreamResponse(call_id=call_id, verify=verify_result_to_proto(result))

    context.add_callback(cancel_all)
    threading.Thread(target=read, name="verify-stream-reader", daemon=True).start()
    return answers()
