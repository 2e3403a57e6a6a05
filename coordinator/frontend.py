"""The coordinator's edge core, shared by the gRPC API and the OpenAI-compatible HTTP API.

Both edges turn their request into an ``EdgeRequest`` and stream what ``GenerationFrontend.generate`` yields:
the checks, the admission slot, the client's deadline, the latency metrics and the request's one log line
happen here once, whatever the transport. Failures are ``specserve.errors`` exceptions; each edge maps them to
its own status codes. The checks here word their refusals in the gRPC API's field names; an edge with names of
its own checks its parameters first (``limits``) and gives the frontend its names (``ParamNames``) for what
only tokenizing or compiling finds.

Admission comes before work: the cheap limits are checked first, then a slot is taken, and only then is the
prompt tokenized (off the event loop, in a bounded queue). A request the coordinator has no room for is refused
before it costs a tokenizer's seconds; the HTTP API takes the slot (``admit``) before it even reads the body.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from coordinator.admission import AdmissionController, Slot
from coordinator.constraints.compiler import GrammarCompiler
from coordinator.constraints.spec import Constraint
from coordinator.deadlines import deadline_scope
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
from coordinator.request_log import RequestRecord
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, TextChunk
from coordinator.speculation import Speculation
from specserve.errors import InvalidArgument, SpecserveError, Unavailable
from specserve.sampling import SamplingParams
from specserve.tenancy import Tenant, tenant_scope

_SANE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def request_id(client_value: str | None) -> str:
    """The client's request id when it is sane (1-128 printable ASCII characters, no spaces), else a new one.

    Honouring the caller's id lets one id follow a request through a gateway, the coordinator's log and back.
    """
    if client_value and _SANE_REQUEST_ID.fullmatch(client_value):
        return client_value
    return secrets.token_hex(16)


@dataclass(frozen=True)
class ParamNames:
    """What an edge calls the parts of a request that the refusals after tokenizing are about.

    A prompt past the context, a constraint that does not compile or cannot complete within the tokens allowed:
    only the frontend finds these, so it words them with the caller's names and sets the error's ``param``. An
    edge without them (gRPC) gets the domain's words, which are its own field names.
    """

    max_new_tokens: str  # the token limit ("max_tokens" or "max_completion_tokens" over HTTP)
    text: str  # the prompt or the chat ("prompt", "messages")
    constraint: str  # the constraint's text ("response_format.json_schema.schema", "structured_outputs.regex")


@dataclass(frozen=True)
class EdgeRequest:
    """A generation request as either API states it, before tokenization."""

    prompt: str | None = None  # exactly one of prompt and chat
    chat: tuple[ChatTurn, ...] | None = None
    max_new_tokens: int | None = None  # None: as many as fit (the server's limit, or the context left)
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    speculation: Speculation = Speculation()
    constraint: Constraint | None = None  # structured output
    names: ParamNames | None = None  # None: refusals name the gRPC API's fields


@dataclass(frozen=True)
class CallInfo:
    """Who asks, through which API, and for how long the answer is worth waiting."""

    request_id: str
    api: str  # "grpc", "openai.chat", "openai.completions"
    tenant: Tenant
    time_remaining_s: float | None = None  # the client's deadline; None: none
    arrived: float = field(default_factory=time.monotonic, compare=False)  # when the edge got the call (time.monotonic)


@dataclass(frozen=True)
class GenerationBackend:
    """What the frontend needs once the coordinator has connected to its workers."""

    tokenizer: Any
    limits: PromptLimits
    new_generation: Callable[[GenerationRequest], Generation]
    max_tokenize_queue: int = 16  # prompts waiting for a tokenizer worker; more: RESOURCE_EXHAUSTED
    constraints: GrammarCompiler | None = None  # None: structured output is refused
    encoder: PromptEncoder = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder", PromptEncoder(self.tokenizer, max_waiting=self.max_tokenize_queue))


class FrontendMetrics(Protocol):
    """What the frontend reports per request (coordinator.metrics.CoordinatorMetrics)."""

    def observe_first_token(self, seconds: float) -> None: ...

    def observe_inter_token(self, seconds: float) -> None: ...

    def observe_finished(self, stats: GenerationStats, e2e_seconds: float) -> None: ...

    def observe_request_error(self, code: str) -> None: ...


class GenerationFrontend:
    """Checks a request, runs its Generation in an admission slot and streams TextChunks, then the stats.

    Until ``attach`` (tokenizer loaded, verifier connected) every request is UNAVAILABLE.
    """

    def __init__(
        self,
        served_model: str,
        admission: AdmissionController,
        metrics: FrontendMetrics | None = None,
        backend: GenerationBackend | None = None,
    ) -> None:
        self.served_model = served_model
        self._admission = admission
        self._metrics = metrics
        self._backend = backend

    def attach(self, backend: GenerationBackend) -> None:
        self._backend = backend

    @property
    def ready(self) -> bool:
        return self._backend is not None

    @property
    def limits(self) -> PromptLimits | None:
        """The limits requests are checked against (None until ``attach``): an edge states them in its own names."""
        return None if self._backend is None else self._backend.limits

    def _ready(self) -> GenerationBackend:
        if self._backend is None:
            raise Unavailable("the coordinator is still connecting to its verifier; retry shortly")
        return self._backend

    async def admit(self, call: CallInfo) -> Slot:
        """The call's admission slot, taken before its request is read (the HTTP API: before the body).

        The caller passes it to ``generate``, which releases it, or releases it itself when the request fails
        before that. A refusal is logged and counted here, as ``generate`` does its own.
        """
        try:
            self._ready()
            with tenant_scope(call.tenant), deadline_scope(call.time_remaining_s):
                return await self._admission.acquire(call.tenant)
        except SpecserveError as exc:
            record = RequestRecord(call.request_id, call.api, call.tenant.name)
            self._failed(record, exc.status, str(exc))
            record.total_s = time.monotonic() - call.arrived
            record.log()
            raise

    async def generate(
        self, request: EdgeRequest, call: CallInfo, slot: Slot | None = None
    ) -> AsyncIterator[TextChunk | GenerationStats]:
        """Stream the request's chunks, then its stats; raises ``SpecserveError`` before or during the stream.

        ``slot``: one ``admit`` took for this call (it is released here, however the stream ends); None: the
        request takes its own once the cheap checks pass, before tokenizing.
        """
        record = RequestRecord(call.request_id, call.api, call.tenant.name)
        started = call.arrived
        last_chunk: float | None = None
        generation: Generation | None = None
        try:
            backend = self._ready()
            with tenant_scope(call.tenant), deadline_scope(call.time_remaining_s):
                asked = self._check(backend.limits, request)
                if slot is None:
                    slot = await self._admission.acquire(call.tenant)
                generation = backend.new_generation(await self._tokenized(backend, request, asked))
                generation.stats.queue_ns = round(slot.queue_s * 1e9)
                record.prompt_tokens = generation.stats.num_prompt_tokens
                # aclosing: a client that hangs up mid-stream has its session released now, not by the finalizer.
                async with aclosing(generation.stream()) as events:
                    async for event in events:
                        now = time.monotonic()
                        if isinstance(event, TextChunk):
                            self._streamed(record, now - (started if last_chunk is None else last_chunk), last_chunk)
                            last_chunk = now
                        else:  # the stats: logged before the client can see them, so a log reader finds the line
                            record.finished(event, now - started)
                            record.log()
                            if self._metrics is not None:
                                self._metrics.observe_finished(event, now - started)
                        yield event
        except SpecserveError as exc:
            self._failed(record, exc.status, str(exc))
            record.error_detail = exc.detail
            if generation is not None:  # why drafting stopped, if it did, belongs in the same line
                record.drafter_error = generation.stats.drafter_error_logged
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if not record.finish_reason:  # after the stats the client has everything, whenever it hangs up
                self._failed(record, "CANCELLED", "the client went away")
            raise
        except Exception as exc:
            self._failed(record, "INTERNAL", type(exc).__name__)
            raise
        finally:
            if slot is not None:
                slot.release()
            if not record.finish_reason:  # it ended without stats: log how
                record.total_s = time.monotonic() - started
                record.log()

    def _streamed(self, record: RequestRecord, gap_s: float, last_chunk: float | None) -> None:
        """A chunk went out ``gap_s`` after the request arrived (the first) or after the previous chunk."""
        if last_chunk is None:
            record.first_token_s = gap_s
            if self._metrics is not None:
                self._metrics.observe_first_token(gap_s)
        elif self._metrics is not None:
            self._metrics.observe_inter_token(gap_s)

    def _failed(self, record: RequestRecord, code: str, message: str) -> None:
        record.status, record.error = code, message
        if self._metrics is not None:
            self._metrics.observe_request_error(code)

    @staticmethod
    def _check(limits: PromptLimits, request: EdgeRequest) -> int:
        """The limits that need no tokenizer (cheap: a bad request never waits for a slot); the tokens asked for."""
        if request.chat is not None:  # counted before 100k messages become 100k objects on the event loop
            check_chat_count(len(request.chat), limits)
        # "As many as fit" (None) is checked as one token now and resolved once the prompt's length is known.
        asked = 1 if request.max_new_tokens is None else request.max_new_tokens
        check_input(request.prompt, request.chat, asked, request.sampling, request.stop, limits)
        return asked

    @staticmethod
    async def _tokenized(backend: GenerationBackend, request: EdgeRequest, asked: int) -> GenerationRequest:
        """The request with its prompt tokenized off the event loop (in the slot: the costly part)."""
        limits = backend.limits
        try:
            prompt_ids = await backend.encoder.encode(request.prompt, request.chat, limits.max_session_tokens - asked)
        except PromptTooLong as exc:
            raise _too_long(request, exc, asked, limits) from exc
        max_new_tokens = request.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = min(limits.max_new_tokens, limits.max_session_tokens - len(prompt_ids))
        built = build_request(prompt_ids, max_new_tokens, request.sampling, request.stop, limits, request.speculation)
        if request.constraint is None:
            return built
        names = request.names
        if backend.constraints is None:
            raise InvalidArgument(
                "this coordinator does not serve structured output", param=names.constraint if names else None
            )
        try:
            grammar = await backend.constraints.compile(request.constraint)
        except InvalidArgument as exc:
            if names is None:
                raise
            raise _renamed(exc, request.constraint, names) from exc
        try:
            backend.constraints.check_room(grammar, built.max_new_tokens)
        except InvalidArgument as exc:
            if names is None:
                raise
            raise _too_few_tokens(request, names, built, grammar.min_tokens, limits) from exc
        return replace(built, constraint=grammar)


def _too_long(request: EdgeRequest, exc: PromptTooLong, asked: int, limits: PromptLimits) -> InvalidArgument:
    """A prompt that leaves no room in the context for the tokens asked for, in the edge's names."""
    names = request.names
    if names is None:
        return context_error(exc.num_tokens, asked, limits, exc.at_least)
    tokens = f"{'at least ' if exc.at_least else ''}{exc.num_tokens} tokens"
    context = f"the model's context of {limits.max_session_tokens} tokens"
    if request.max_new_tokens is None:  # the caller asked for as many as fit: not even one does
        message = f"{names.text} has {tokens}, which leaves no room for output in {context}: send less text"
    else:
        message = (
            f"{names.text} has {tokens}; with {names.max_new_tokens}={asked} that exceeds {context}: "
            f"send less text or a smaller {names.max_new_tokens}"
        )
    return InvalidArgument(message, param=names.text)


def _renamed(exc: InvalidArgument, constraint: Constraint, names: ParamNames) -> InvalidArgument:
    """A constraint's refusal with the edge's name for it: the refusals start with the kind's own name."""
    message = str(exc)
    kind = constraint.kind.value
    if message.startswith(f"{kind} "):
        message = names.constraint + message[len(kind) :]
    return InvalidArgument(message, detail=exc.detail, param=names.constraint)


def _too_few_tokens(
    request: EdgeRequest, names: ParamNames, built: GenerationRequest, needed: int, limits: PromptLimits
) -> InvalidArgument:
    """``check_room``'s refusal in the edge's names: the token limit is below the constraint's shortest output."""
    room = built.max_new_tokens
    completes = f"any output that completes this {names.constraint} takes at least {needed} tokens"
    if request.max_new_tokens is not None:
        return InvalidArgument(
            f"{names.max_new_tokens} is {room}, but {completes}; raise {names.max_new_tokens}",
            param=names.max_new_tokens,
        )
    left = limits.max_session_tokens - len(built.prompt_ids)
    return InvalidArgument(
        f"at most {room} tokens of output fit (this server's limit is {limits.max_new_tokens}; the prompt leaves "
        f"{left} of the model's context), but {completes}",
        param=names.constraint,
    )
