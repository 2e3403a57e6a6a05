"""The verifier's end of a VerifyStream over fake engine futures: answers in completion order, cancel
messages and a stream that goes away take calls out of the queue, refusals are answers, half-close drains."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc

from specserve.drain import DRAINING_METADATA
from specserve.errors import NotFound, Unavailable
from specserve.results import VerifyResult
from specserve.v1 import verifier_pb2
from target_service.verify_stream import answer_stream

Request = verifier_pb2.VerifyStreamRequest


class FakeContext:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


class Coordinator:
    """Writes messages onto the stream from the test; ``close`` half-closes it."""

    def __init__(self) -> None:
        self._messages: queue.SimpleQueue[Request | None] = queue.SimpleQueue()

    def requests(self) -> Iterator[Request]:
        while (message := self._messages.get()) is not None:
            yield message

    def verify(self, call_id: int, session: str) -> None:
        verify = verifier_pb2.VerifyRequest(session_id=session)
        self._messages.put(Request(call_id=call_id, verify=verify, tenant="acme"))

    def cancel(self, call_id: int) -> None:
        self._messages.put(Request(call_id=call_id, cancel=verifier_pb2.VerifyCancel()))

    def close(self) -> None:
        self._messages.put(None)


class Engine:
    """Hands out a future per call, for the test to complete; refuses sessions named ``refused``."""

    def __init__(self) -> None:
        self.started: dict[str, Future[VerifyResult]] = {}
        self.tenants: list[str] = []
        self._lock = threading.Condition()

    def start(self, request: verifier_pb2.VerifyRequest, tenant: str) -> Future[VerifyResult]:
        if request.session_id == "refused":
            raise NotFound("no session refused")
        future: Future[VerifyResult] = Future()
        with self._lock:
            self.started[request.session_id] = future
            self.tenants.append(tenant)
            self._lock.notify_all()
        return future

    def wait_started(self, session: str) -> Future[VerifyResult]:
        with self._lock:
            self._lock.wait_for(lambda: session in self.started)
            return self.started[session]


def result(bonus: int) -> VerifyResult:
    return VerifyResult([], [], bonus, 0)


def test_answers_leave_in_the_order_the_engine_finishes_the_calls() -> None:
    coordinator, engine = Coordinator(), Engine()
    answers = answer_stream(coordinator.requests(), FakeContext(), engine.start)
    coordinator.verify(1, "a")
    coordinator.verify(2, "b")
    engine.wait_started("b").set_result(result(20))
    second = next(answers)
    assert (second.call_id, second.verify.bonus_token_id) == (2, 20)
    engine.wait_started("a").set_result(result(10))
    assert next(answers).call_id == 1
    assert engine.tenants == ["acme", "acme"]
    coordinator.close()
    assert list(answers) == []


def test_a_refused_call_is_answered_with_its_status_and_the_stream_goes_on() -> None:
    coordinator, engine = Coordinator(), Engine()
    answers = answer_stream(coordinator.requests(), FakeContext(), engine.start)
    coordinator.verify(1, "refused")
    refused = next(answers)
    assert refused.call_id == 1 and refused.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert refused.error.message == "no session refused" and not refused.error.draining
    coordinator.verify(2, "b")
    engine.wait_started("b").set_exception(Unavailable("shutting down", metadata=DRAINING_METADATA))
    draining = next(answers)
    assert draining.error.code == grpc.StatusCode.UNAVAILABLE.value[0] and draining.error.draining


def test_an_unexpected_failure_is_internal_without_its_text() -> None:
    coordinator, engine = Coordinator(), Engine()
    answers = answer_stream(coordinator.requests(), FakeContext(), engine.start)
    coordinator.verify(1, "a")
    engine.wait_started("a").set_exception(RuntimeError("secret internals at 10.0.0.7"))
    failed = next(answers)
    assert failed.error.code == grpc.StatusCode.INTERNAL.value[0] and "10.0.0.7" not in failed.error.message


def test_a_cancel_message_takes_a_queued_call_out_and_it_gets_no_answer() -> None:
    coordinator, engine = Coordinator(), Engine()
    answers = answer_stream(coordinator.requests(), FakeContext(), engine.start)
    coordinator.verify(1, "a")
    coordinator.verify(2, "b")
    queued = engine.wait_started("a")
    cancelled = threading.Event()
    queued.add_done_callback(lambda _: cancelled.set())
    coordinator.cancel(1)
    assert cancelled.wait(timeout=30) and queued.cancelled()
    engine.wait_started("b").set_result(result(2))
    coordinator.close()
    assert [answer.call_id for answer in answers] == [2]


def test_half_close_answers_the_calls_in_flight_then_ends() -> None:
    coordinator, engine = Coordinator(), Engine()
    answers = answer_stream(coordinator.requests(), FakeContext(), engine.start)
    coordinator.verify(1, "a")
    running = engine.wait_started("a")
    coordinator.close()
    running.set_result(result(1))
    assert [answer.call_id for answer in answers] == [1]


def test_a_stream_that_goes_away_takes_its_queued_calls_out_of_the_queue() -> None:
    coordinator, engine, context = Coordinator(), Engine(), FakeContext()
    answers = answer_stream(coordinator.requests(), context, engine.start)
    coordinator.verify(1, "a")
    coordinator.verify(2, "b")
    first, second = engine.wait_started("a"), engine.wait_started("b")
    context.end()  # gRPC's callback when the RPC terminates
    assert first.cancelled() and second.cancelled()
    coordinator.close()
    assert list(answers) == []
