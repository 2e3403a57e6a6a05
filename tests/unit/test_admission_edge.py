"""The coordinator's gRPC edge with admission: slots around streams, refusals with trailing metadata, queue_ns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.admission import AdmissionController, AdmissionLimits
from coordinator.frontend import GenerationBackend, GenerationFrontend
from coordinator.prompts import PromptLimits
from coordinator.rounds import GenerationRequest, GenerationStats, TextChunk
from coordinator.server import GenerationServicer
from specserve.errors import ResourceExhausted
from specserve.v1 import generation_pb2


class HeldGeneration:
    """Streams one chunk, then waits until the test lets it finish."""

    def __init__(self, finish: asyncio.Event) -> None:
        self.stats = GenerationStats()
        self._finish = finish

    async def stream(self) -> AsyncIterator[TextChunk | GenerationStats]:
        yield TextChunk("a", [1])
        await self._finish.wait()
        yield self.stats


class FakeContext:
    def __init__(self, time_remaining: float | None = None) -> None:
        self._time_remaining = time_remaining

        self.initial_metadata: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> float | None:
        return self._time_remaining

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-request-id", "req-7"),)

    async def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.initial_metadata = metadata


def tokenizer(text: str, **_: object) -> dict[str, list[int]]:
    return {"input_ids": [1, 2, 3]}


def test_the_edge_holds_a_slot_per_stream_and_refuses_with_retry_after() -> None:
    async def test() -> None:
        finish = asyncio.Event()

        def new_generation(request: GenerationRequest) -> Any:
            return HeldGeneration(finish)

        now = [100.0]  # the admission clock, moved by the test alone
        admission = AdmissionController(AdmissionLimits(max_running=1, max_queued=1), clock=lambda: now[0])
        backend = GenerationBackend(tokenizer, PromptLimits(16, 64), new_generation)
        servicer = GenerationServicer(GenerationFrontend("test-model", admission, backend=backend))
        request = generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=4)

        async def call(context: FakeContext) -> list[generation_pb2.GenerateResponse]:
            return [r async for r in servicer.Generate(request, context)]

        first = asyncio.create_task(call(FakeContext()))
        queued = asyncio.create_task(call(FakeContext(time_remaining=30.0)))
        # Tokenizing runs off the loop: wait until the first holds the slot and the second waits for it.
        async with asyncio.timeout(30):
            while (admission.running, admission.queued) != (1, 1):
                await asyncio.sleep(0.01)
        # The edge raises; specserve.rpc_errors turns it into the status and trailing metadata (tested there).
        with pytest.raises(ResourceExhausted) as refused:
            await call(FakeContext())
        metadata = dict(refused.value.metadata)
        assert f"retry after {metadata['retry-after-ms']} ms" in str(refused.value)
        now[0] += 2.5
        finish.set()
        responses = await first
        assert responses[-1].stats.queue_ns == 0
        assert responses[-1].stats.request_id == "req-7"  # the client's id, also in the initial metadata
        responses = await queued
        assert responses[-1].stats.queue_ns == 2_500_000_000  # queued from 100 s until the slot was free at 102.5 s
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(test())
