"""gRPC edge of the coordinator: the public GenerationService, a thin adapter over the GenerationFrontend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from coordinator.constraints.spec import Constraint, ConstraintKind
from coordinator.frontend import CallInfo, EdgeRequest, GenerationFrontend, request_id
from coordinator.prompts import ChatTurn
from coordinator.rounds import FinishReason, GenerationStats, TextChunk
from coordinator.speculation import Speculation, SpeculationMode
from specserve.errors import InvalidArgument
from specserve.sampling import SamplingParams
from specserve.tenancy import current_tenant
from specserve.v1 import generation_pb2, generation_pb2_grpc

REQUEST_ID_KEY = "x-request-id"
"""Metadata naming the request: the client may set it, and the coordinator returns it (initial metadata)."""

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: generation_pb2.FINISH_REASON_EOS,
}
_SPECULATION_MODES = {
    SpeculationMode.AUTO: generation_pb2.SPECULATION_MODE_AUTO,
    SpeculationMode.OFF: generation_pb2.SPECULATION_MODE_OFF,
}


def stats_to_proto(stats: GenerationStats, request_id: str = "") -> generation_pb2.GenerationStats:
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
        speculation_mode=_SPECULATION_MODES[stats.speculation],
        max_draft_tokens=stats.max_draft_tokens,
        num_drafts=stats.num_drafts,
        num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos,
        request_id=request_id,
        num_forced_tokens=stats.num_forced_tokens,
        constraint_complete=stats.constraint_complete,
        mask_ns=stats.mask_ns,
        prefill_ns=stats.prefill_ns,
        round_phase_ns=stats.phase_ns,
        num_rounds_plain_by_cost=stats.num_rounds_plain_by_cost,
        num_cached_prompt_tokens=stats.num_cached_prompt_tokens,
    )


def speculation_from_proto(control: generation_pb2.SpeculationControl) -> Speculation:
    mode = SpeculationMode.OFF if control.mode == generation_pb2.SPECULATION_MODE_OFF else SpeculationMode.AUTO
    return Speculation(mode, control.max_draft_tokens)


def edge_request(request: generation_pb2.GenerateRequest) -> EdgeRequest:
    """The proto request as the frontend takes it (a 100k-message chat is refused there before it is copied)."""
    chat = tuple(ChatTurn(m.role, m.content) for m in request.chat.messages) if request.HasField("chat") else None
    return EdgeRequest(
        prompt=None if request.HasField("chat") else request.prompt,
        chat=chat,
        max_new_tokens=request.max_new_tokens,  # required on this API: 0 is refused
        sampling=SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p or 1.0,
            top_k=request.top_k,
            seed=request.seed if request.HasField("seed") else None,
        ),
        stop=tuple(request.stop),
        speculation=speculation_from_proto(request.speculation),
        constraint=constraint_from_proto(request.constraint) if request.HasField("constraint") else None,
    )


def constraint_from_proto(message: generation_pb2.Constraint) -> Constraint:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("constraint is set but holds none of json_schema, regex, lark_grammar, choice")
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(message.choice.choices))
    return Constraint(ConstraintKind(kind), getattr(message, kind))


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else None
    return None


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Generate: proto in, the frontend's stream out; the request id goes back in initial metadata."""

    def __init__(self, frontend: GenerationFrontend) -> None:
        self._frontend = frontend

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rid = request_id(metadata_value(context.invocation_metadata(), REQUEST_ID_KEY))
        await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
        call = CallInfo(rid, "grpc", current_tenant(), context.time_remaining())
        async for event in self._frontend.generate(edge_request(request), call):
            if isinstance(event, TextChunk):
                delta = generation_pb2.TextDelta(text=event.text, token_ids=event.token_ids)
                yield generation_pb2.GenerateResponse(delta=delta)
            else:
                yield generation_pb2.GenerateResponse(stats=stats_to_proto(event, rid))
