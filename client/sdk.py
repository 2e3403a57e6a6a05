"""Typed sync and asyncio clients over the GenerationService stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class GenerationParams:
    """Decoding parameters; the defaults are greedy decoding of up to 128 tokens."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    # "auto": the server drafts as much as pays; "off": plain decoding (same output, no drafting).
    speculation: str = "auto"
    max_draft_tokens: int = 0  # cap on draft tokens per round under "auto"; 0: the server's limit
    # Structured output, at most one: a JSON Schema (as JSON text), a regular expression, a Lark grammar, or
    # a choice among fixed strings. The output then matches it (unless max_new_tokens cuts it short).
    json_schema: str | None = None
    regex: str | None = None
    lark_grammar: str | None = None
    choice: Sequence[str] | None = None


@dataclass(frozen=True)
class TextChunk:
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Stats:
    finish_reason: str  # "length", "stop" or "eos"
    num_prompt_tokens: int
    num_generated_tokens: int
    num_rounds: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_rounds_without_drafter: int
    num_reprefills: int
    total_s: float
    draft_s: float
    verify_s: float
    coordination_s: float
    drafter_error: str
    num_drafter_trees: int = 0  # rounds whose tree came from the drafter
    num_predraft_hits: int = 0  # of those, trees drafted ahead while the verifier worked
    predraft_hidden_s: float = 0.0  # their drafting time, hidden behind verification
    queue_s: float = 0.0  # time waiting for a stream slot on the coordinator (not in total_s)
    speculation: str = "auto"  # what the request ran with: "auto" or "off"
    max_draft_tokens: int = 0  # its cap on draft tokens per round (0 when off)
    num_drafts: int = 0  # rounds whose tree held at least one draft token
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # entry i: rounds whose accepted path reached depth i + 1
    request_id: str = ""  # the id the coordinator logged the request under
    num_forced_tokens: int = 0  # accepted draft tokens the constraint alone allowed
    constraint_complete: bool = False  # with a constraint: the output completed it
    mask_s: float = 0.0  # computing the constraint's token masks on the coordinator
    prefill_s: float = 0.0  # of verify_s: the verifier prefilling the prompt (total_s - prefill_s: generating)
    # The rounds' time by phase (drafter, draft_transport, ... loop), summed over the request's rounds.
    round_phase_s: dict[str, float] = field(default_factory=dict)
    num_rounds_plain_by_cost: int = 0  # rounds run plain because drafted rounds did not pay end to end
    # Of the prompt, tokens the verifier did not prefill: copied from an earlier request of the same caller whose
    # tokens they repeat (the conversation's previous turn).
    num_cached_prompt_tokens: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward."""
        return self.num_generated_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def summary(self) -> str:
        line = (
            f"{self.num_generated_tokens} tokens, {self.num_rounds} rounds, tau {self.tau:.2f}, "
            f"{self.tokens_per_s:.1f} tokens/s | draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s "
            f"coordination {self.coordination_s:.2f}s | finish: {self.finish_reason}"
        )
        if self.queue_s:
            line += f" | queued {self.queue_s:.2f}s"
        if self.speculation == "off":
            line += " | speculation off"
        if self.drafter_error:
            line += f" | {self.drafter_error}"
        return line


def _finish_name(value: int) -> str:
    name: str = generation_pb2.FinishReason.Name(value)
    return name.removeprefix("FINISH_REASON_").lower()


def stats_from_proto(s: generation_pb2.GenerationStats) -> Stats:
    return Stats(
        finish_reason=_finish_name(s.finish_reason),
        num_prompt_tokens=s.num_prompt_tokens,
        num_generated_tokens=s.num_generated_tokens,
        num_rounds=s.num_rounds,
        num_draft_tokens=s.num_draft_tokens,
        num_accepted_tokens=s.num_accepted_tokens,
        num_rounds_without_drafter=s.num_rounds_without_drafter,
        num_reprefills=s.num_reprefills,
        total_s=s.total_ns / 1e9,
        draft_s=s.draft_ns / 1e9,
        verify_s=s.verify_ns / 1e9,
        coordination_s=s.coordination_ns / 1e9,
        drafter_error=s.drafter_error,
        num_drafter_trees=s.num_drafter_trees,
        num_predraft_hits=s.num_predraft_hits,
        predraft_hidden_s=s.predraft_hidden_ns / 1e9,
        queue_s=s.queue_ns / 1e9,
        speculation="off" if s.speculation_mode == generation_pb2.SPECULATION_MODE_OFF else "auto",
        max_draft_tokens=s.max_draft_tokens,
        num_drafts=s.num_drafts,
        num_accepted_tokens_per_pos=tuple(s.num_accepted_tokens_per_pos),
        request_id=s.request_id,
        num_forced_tokens=s.num_forced_tokens,
        constraint_complete=s.constraint_complete,
        mask_s=s.mask_ns / 1e9,
        prefill_s=s.prefill_ns / 1e9,
        round_phase_s={phase: ns / 1e9 for phase, ns in s.round_phase_ns.items()},
        num_rounds_plain_by_cost=s.num_rounds_plain_by_cost,
        num_cached_prompt_tokens=s.num_cached_prompt_tokens,
    )


_SPECULATION_MODES = {"auto": generation_pb2.SPECULATION_MODE_AUTO, "off": generation_pb2.SPECULATION_MODE_OFF}


def build_request(
    prompt: str | None, chat: Sequence[tuple[str, str]] | None, params: GenerationParams
) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=list(params.stop),
        speculation=generation_pb2.SpeculationControl(
            mode=_speculation_mode(params.speculation), max_draft_tokens=params.max_draft_tokens
        ),
    )
    constraint = _constraint(params)
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    if chat is not None:
        request.chat.messages.extend(generation_pb2.ChatMessage(role=r, content=c) for r, c in chat)
    else:
        request.prompt = prompt or ""
    return request


def _constraint(params: GenerationParams) -> generation_pb2.Constraint | None:
    constraints = []
    if params.json_schema is not None:
        constraints.append(generation_pb2.Constraint(json_schema=params.json_schema))
    if params.regex is not None:
        constraints.append(generation_pb2.Constraint(regex=params.regex))
    if params.lark_grammar is not None:
        constraints.append(generation_pb2.Constraint(lark_grammar=params.lark_grammar))
    if params.choice is not None:
        constraints.append(generation_pb2.Constraint(choice=generation_pb2.ChoiceConstraint(choices=params.choice)))
    if len(constraints) > 1:
        raise ValueError("give at most one of json_schema, regex, lark_grammar, choice")
    return constraints[0] if constraints else None


def _speculation_mode(name: str) -> generation_pb2.SpeculationMode:
    try:
        return _SPECULATION_MODES[name]
    except KeyError:
        raise ValueError(f"speculation must be 'auto' or 'off', got {name!r}") from None


def _event(response: generation_pb2.GenerateResponse) -> TextChunk | Stats:
    if response.WhichOneof("event") == "stats":
        return stats_from_proto(response.stats)
    return TextChunk(response.delta.text, list(response.delta.token_ids))


def channel_credentials(tls: bool = False, tls_ca: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials checking the server against ``tls_ca`` (a PEM file) or the system's roots; None: plaintext."""
    if not tls and tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes() if tls_ca else None)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class SpecserveClient:
    """Blocking client. Iterating a generate call yields TextChunks, then one Stats.

    ``api_key``: sent as ``authorization: Bearer <key>``; ``tls=True`` (system roots) or ``tls_ca`` (a PEM
    file of roots) connects over TLS. Errors surface as grpc.RpcError with the server's status and message.
    """

    def __init__(
        self,
        target: str = "localhost:50051",
        timeout_s: float | None = 300.0,
        *,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
    ) -> None:
        credentials = channel_credentials(tls, tls_ca)
        self._channel = (
            grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = auth_metadata(api_key)

    def __enter__(self) -> SpecserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str, params: GenerationParams = GenerationParams()) -> Iterator[TextChunk | Stats]:
        """Continue raw text (no chat template)."""
        return self._stream(build_request(prompt, None, params))

    def generate_chat(
        self, messages: Sequence[tuple[str, str]], params: GenerationParams = GenerationParams()
    ) -> Iterator[TextChunk | Stats]:
        """Answer chat turns given as (role, content), formatted with the model's chat template."""
        return self._stream(build_request(None, messages, params))

    def _stream(self, request: generation_pb2.GenerateRequest) -> Iterator[TextChunk | Stats]:
        for response in self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata):
            yield _event(response)


class AsyncSpecserveClient:
    """asyncio client with the same methods (and credentials) as SpecserveClient, as async iterators."""

    def __init__(
        self,
        target: str = "localhost:50051",
        timeout_s: float | None = 300.0,
        *,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
    ) -> None:
        credentials = channel_credentials(tls, tls_ca)
        self._channel = (
            grpc.aio.insecure_channel(target) if credentials is None else grpc.aio.secure_channel(target, credentials)
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = auth_metadata(api_key)

    async def __aenter__(self) -> AsyncSpecserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate(self, prompt: str, params: GenerationParams = GenerationParams()) -> AsyncIterator[TextChunk | Stats]:
        return self._stream(build_request(prompt, None, params))

    def generate_chat(
        self, messages: Sequence[tuple[str, str]], params: GenerationParams = GenerationParams()
    ) -> AsyncIterator[TextChunk | Stats]:
        return self._stream(build_request(None, messages, params))

    async def _stream(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[TextChunk | Stats]:
        async for response in self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata):
            yield _event(response)
