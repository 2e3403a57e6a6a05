"""gRPC edge of the coordinator: the public GenerationService."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.admission import AdmissionController
from coordinator.deadlines import deadline_scope
from coordinator.metrics import CoordinatorMetrics
from coordinator.prompts import (
    ChatTurn,
    PromptEncoder,
    PromptLimits,
    PromptTooLong,
    build_request,
    check_chat_count,
    check_input,
    context_error,
)
from coordinator.rounds import FinishReason, Generation, GenerationRequest, GenerationStats, TextChunk
from specserve.errors import Unavailable
from specserve.sampling import SamplingParams
from specserve.tenancy import current_tenant
from specserve.v1 import generation_pb2, generation_pb2_grpc

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: generation_pb2.FINISH_REASON_EOS,
}


def stats_to_proto(stats: GenerationStats) -> generation_pb2.GenerationStats:
    return generation_pb2.GenerationStats(
        finish_reason=_FINISH_REASONS[stats.finish_reason],
        num_prompt_tokens=stats.num_prompt_tokens,
        num_generated_tokens=stats.num_generated_tokens,
        num_rounds=stats.num_rounds,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_rounds_without_drafter=stats.num_rounds_without_drafter,
        num_reprefills=stats.num_reprefills,
        total_ns=stats.total_ns,
        draft_ns=stats.draft_ns,
        verify_ns=stats.verify_ns,
        coordination_ns=stats.coordination_ns,
        drafter_error=stats.drafter_error,
        num_drafter_trees=stats.num_drafter_trees,
        num_predraft_hits=stats.num_predraft_hits,
        predraft_hidden_ns=stats.predraft_hidden_ns,
        queue_ns=stats.queue_ns,
    )


@dataclass(frozen=True)
class GenerationBackend:
    """What the servicer needs once the coordinator has connected to its workers."""

    tokenizer: Any
    limits: PromptLimits
    new_generation: Callable[[GenerationRequest], Generation]
    encoder: PromptEncoder = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder", PromptEncoder(self.tokenizer))


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Validates a request, runs its Generation and streams the events.

    Until ``attach`` (tokenizer loaded, verifier connected) calls are UNAVAILABLE. Each stream holds an
    admission slot while it runs, and the client's deadline bounds it (``coordinator.deadlines``).
    """

    def __init__(
        self,
        backend: GenerationBackend | None = None,
        metrics: CoordinatorMetrics | None = None,
        admission: AdmissionController | None = None,
    ) -> None:
        self._backend = backend
        self._metrics = metrics
        self._admission = admission or AdmissionController(observer=metrics)
        if metrics is not None:
            metrics.track_admission(self._admission)

    def attach(self, backend: GenerationBackend) -> None:
        self._backend = backend

    async def _request(self, backend: GenerationBackend, request: generation_pb2.GenerateRequest) -> GenerationRequest:
        """The request checked against the limits first (cheap), then tokenized off the event loop."""
        limits = backend.limits
        if request.HasField("chat"):  # counted before 100k messages become 100k objects on the event loop
            check_chat_count(len(request.chat.messages), limits)
        chat = [ChatTurn(m.role, m.content) for m in request.chat.messages] if request.HasField("chat") else None
        sampling = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p or 1.0,
            top_k=request.top_k,
            seed=request.seed if request.HasField("seed") else None,
        )
        check_input(request.prompt, chat, request.max_new_tokens, sampling, request.stop, limits)
        stop = list(request.stop)  # counted first: a 5 MB request holds millions of empty strings
        try:
            prompt_ids = await backend.encoder.encode(
                request.prompt, chat, limits.max_session_tokens - request.max_new_tokens
            )
        except PromptTooLong as exc:
            raise context_error(exc.num_tokens, request.max_new_tokens, limits, exc.at_least) from exc
        return build_request(prompt_ids, request.max_new_tokens, sampling, stop, limits)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        backend = self._backend
        if backend is None:
            raise Unavailable("the coordinator is still connecting to its verifier; retry shortly")
        generation = backend.new_generation(await self._request(backend, request))
        with deadline_scope(context.time_remaining()):
            async with self._admission.slot(current_tenant()) as slot:
                generation.stats.queue_ns = round(slot.queue_s * 1e9)
                async for event in generation.stream():
                    if isinstance(event, TextChunk):
                        delta = generation_pb2.TextDelta(text=event.text, token_ids=event.token_ids)
                        yield generation_pb2.GenerateResponse(delta=delta)
                    else:
                        if self._metrics is not None:
                            self._metrics.observe(event)
                        yield generation_pb2.GenerateResponse(stats=stats_to_proto(event))
