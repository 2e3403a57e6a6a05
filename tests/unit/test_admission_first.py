"""Admission before work: no prompt is tokenized without a slot, and the tokenizer's queue is bounded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from coordinator.admission import AdmissionController, AdmissionLimits, estimate_retry_after_s
from coordinator.config import CoordinatorConfig, tokenize_queue
from coordinator.frontend import CallInfo, EdgeRequest, GenerationBackend, GenerationFrontend
from coordinator.prompts import PromptEncoder, PromptLimits
from coordinator.rounds import GenerationRequest, GenerationStats, TextChunk
from specserve.errors import InvalidArgument, ResourceExhausted
from specserve.tenancy import Tenant

LIMITS = PromptLimits(max_new_tokens=100, max_session_tokens=64)
ACME, OTHER = Tenant("acme"), Tenant("other")


class CountingTokenizer:
    """One token per character; counts its calls and, when ``gate`` is given, waits on it in each."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls = 0
        self.gate = gate

    def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "the test never opened the gate"
        return {"input_ids": list(range(len(text)))}


class OneChunk:
    def __init__(self, request: GenerationRequest) -> None:
        self.stats = GenerationStats(num_prompt_tokens=len(request.prompt_ids))

    async def stream(self) -> AsyncIterator[TextChunk | GenerationStats]:
        yield TextChunk("a", [1])
        yield self.stats


def front(admission: AdmissionController, tokenizer: Callable[..., Any]) -> GenerationFrontend:
    return GenerationFrontend("m", admission, backend=GenerationBackend(tokenizer, LIMITS, OneChunk))  # type: ignore[arg-type]


async def run(frontend: GenerationFrontend, tenant: Tenant = ACME) -> list[Any]:
    call = CallInfo("req", "grpc", tenant)
    return [event async for event in frontend.generate(EdgeRequest(prompt="hello", max_new_tokens=4), call)]


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (state, not time)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_a_request_with_no_room_is_refused_before_its_prompt_is_tokenized() -> None:
    async def scenario() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=1, max_queued=0))
        tokenizer = CountingTokenizer()
        held = await admission.acquire(OTHER)
        with pytest.raises(ResourceExhausted, match="--max-queued-streams"):
            await run(front(admission, tokenizer))
        assert tokenizer.calls == 0
        held.release()
        assert isinstance((await run(front(admission, tokenizer)))[-1], GenerationStats)
        assert tokenizer.calls == 1 and admission.running == 0

    asyncio.run(scenario())


def test_a_queued_request_is_tokenized_only_once_it_holds_a_slot() -> None:
    async def scenario() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=1, max_queued=1))
        tokenizer = CountingTokenizer()
        held = await admission.acquire(OTHER)
        waiting = asyncio.create_task(run(front(admission, tokenizer)))
        await until(lambda: admission.queued == 1)
        assert tokenizer.calls == 0
        held.release()
        await waiting
        assert tokenizer.calls == 1 and admission.running == 0

    asyncio.run(scenario())


def test_a_slot_from_admit_is_used_and_given_back_even_when_the_request_is_refused() -> None:
    async def scenario() -> None:
        admission = AdmissionController(AdmissionLimits(max_running=1, max_queued=0))
        frontend = front(admission, CountingTokenizer())
        call = CallInfo("req", "openai.chat", ACME)
        slot = await frontend.admit(call)
        assert admission.running == 1
        events = [e async for e in frontend.generate(EdgeRequest(prompt="hi", max_new_tokens=4), call, slot)]
        assert isinstance(events[-1], GenerationStats) and admission.running == 0
        slot = await frontend.admit(call)  # one slot: the request does not take a second
        with pytest.raises(InvalidArgument, match="max_new_tokens"):
            [e async for e in frontend.generate(EdgeRequest(prompt="hi", max_new_tokens=0), call, slot)]
        assert admission.running == 0
        held = await admission.acquire(OTHER)
        with pytest.raises(ResourceExhausted):  # admit itself refuses when there is no room
            await frontend.admit(call)
        held.release()

    asyncio.run(scenario())


def test_the_tokenizer_queue_is_bounded_and_says_when_to_retry() -> None:
    async def scenario() -> None:
        gate = threading.Event()
        encoder = PromptEncoder(CountingTokenizer(gate), max_workers=1, max_waiting=1)
        try:
            working = asyncio.create_task(encoder.encode("one", None, 64))
            queued = asyncio.create_task(encoder.encode("two", None, 64))
            await until(lambda: encoder.pending == 2)
            with pytest.raises(ResourceExhausted) as refused:
                await encoder.encode("three", None, 64)
            message = str(refused.value)
            assert "1 more are waiting" in message and "--max-tokenize-queue" in message
            assert "retry after 1000 ms" in message  # nothing measured yet: the default estimate
            assert refused.value.metadata == (("retry-after-ms", "1000"),)
        finally:
            gate.set()
        assert await working == [0, 1, 2] and await queued == [0, 1, 2]
        assert encoder.pending == 0
        assert await encoder.encode("four", None, 64) == [0, 1, 2, 3]  # room again

    asyncio.run(scenario())


def test_the_retry_estimate_is_the_time_to_get_through_the_queue() -> None:
    assert estimate_retry_after_s([], ahead=18, workers=2) == 1.0  # nothing measured yet
    assert estimate_retry_after_s([1.0, 3.0], ahead=6, workers=2) == 6.0  # 6 prompts of 2 s on 2 workers
    assert estimate_retry_after_s([0.001], ahead=3, workers=2) == 0.1
    assert estimate_retry_after_s([30.0], ahead=18, workers=2) == 60.0


def test_the_encoder_measures_each_prompt_in_its_worker() -> None:
    ticks = iter([10.0, 12.0])  # the one prompt took 2 s
    encoder = PromptEncoder(CountingTokenizer(), max_workers=2, max_waiting=4, clock=lambda: next(ticks))
    assert asyncio.run(encoder.encode("x", None, 64)) == [0]
    assert next(ticks, None) is None  # read once as it started and once as it ended


def test_by_default_every_admitted_stream_may_wait_for_the_tokenizer() -> None:
    """A burst as large as the slots is admitted whole: 64 streams at once were refused past 16 waiting."""
    config = CoordinatorConfig()
    assert tokenize_queue(config) == config.max_concurrent_streams
    assert tokenize_queue(CoordinatorConfig(max_concurrent_streams=8)) == 8
    assert tokenize_queue(CoordinatorConfig(max_tokenize_queue=3)) == 3  # an operator's cap stands
