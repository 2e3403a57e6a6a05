"""The edge core both APIs share: request ids, defaults, speculation control, metrics hooks, the request log."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from coordinator import request_log
from coordinator.admission import AdmissionController
from coordinator.frontend import CallInfo, EdgeRequest, GenerationBackend, GenerationFrontend, request_id
from coordinator.prompts import ChatTurn, PromptLimits
from coordinator.rounds import FinishReason, GenerationRequest, GenerationStats, TextChunk
from coordinator.speculation import Speculation, SpeculationMode
from specserve.errors import InvalidArgument, Unavailable
from specserve.tenancy import Tenant


class ScriptedGeneration:
    """Streams the given chunks, then stats as a real Generation would report them."""

    def __init__(self, request: GenerationRequest, chunks: list[str]) -> None:
        self.request = request
        self.stats = GenerationStats(num_prompt_tokens=len(request.prompt_ids), speculation=request.speculation.mode)
        self._chunks = chunks
        self.closed = False  # a real Generation releases its verifier session when its stream closes

    async def stream(self) -> AsyncIterator[TextChunk | GenerationStats]:
        try:
            for text in self._chunks:
                await asyncio.sleep(0)  # a real stream yields to the loop between chunks
                yield TextChunk(text, [1])
            self.stats.num_generated_tokens = len(self._chunks)
            self.stats.finish_reason = FinishReason.EOS
            yield self.stats
        finally:
            self.closed = True


class RecordingMetrics:
    def __init__(self) -> None:
        self.events: list[str] = []

    def observe_first_token(self, seconds: float) -> None:
        assert seconds > 0
        self.events.append("first")

    def observe_inter_token(self, seconds: float) -> None:
        assert seconds > 0
        self.events.append("inter")

    def observe_finished(self, stats: GenerationStats, e2e_seconds: float) -> None:
        self.events.append(f"finished:{stats.finish_reason.value}")

    def observe_request_error(self, code: str) -> None:
        self.events.append(f"error:{code}")

    def admitted(self, queue_s: float) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass


def tokenizer(text: str, **_: object) -> dict[str, list[int]]:
    return {"input_ids": list(range(len(text)))}  # one token per character


LIMITS = PromptLimits(max_new_tokens=100, max_session_tokens=64)
CALL = CallInfo("req-1", "grpc", Tenant("acme"))


def frontend(
    chunks: list[str],
    metrics: RecordingMetrics | None = None,
    tokenize: Callable[..., dict[str, list[int]]] = tokenizer,
) -> tuple[GenerationFrontend, list[Any]]:
    made: list[Any] = []

    def new_generation(request: GenerationRequest) -> Any:
        made.append(ScriptedGeneration(request, chunks))
        return made[-1]

    backend = GenerationBackend(tokenize, LIMITS, new_generation)
    return GenerationFrontend("smollm2", AdmissionController(), metrics, backend), made


def collect(front: GenerationFrontend, request: EdgeRequest, call: CallInfo = CALL) -> list[Any]:
    async def run() -> list[Any]:
        return [event async for event in front.generate(request, call)]

    return asyncio.run(run())


@pytest.fixture
def log_lines() -> Any:
    stream = io.StringIO()
    request_log.configure(stream)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    request_log.configure()


def test_a_sane_client_request_id_is_kept_and_anything_else_replaced() -> None:
    assert request_id("abc-123_XYZ") == "abc-123_XYZ"
    for bad in (None, "", "has space", "x" * 129, "naïve", "line\nbreak"):
        fresh = request_id(bad)
        assert fresh != bad and len(fresh) == 32 and int(fresh, 16) >= 0


def test_chunks_then_stats_with_latency_hooks_and_one_json_log_line(log_lines: Any) -> None:
    metrics = RecordingMetrics()
    front, _ = frontend(["a", "b", "c"], metrics)
    events = collect(front, EdgeRequest(prompt="hello", max_new_tokens=8))
    assert [e.text for e in events[:-1]] == ["a", "b", "c"]
    assert isinstance(events[-1], GenerationStats)
    assert metrics.events == ["first", "inter", "inter", "finished:eos"]
    (line,) = log_lines()
    assert line["request_id"] == "req-1" and line["tenant"] == "acme" and line["api"] == "grpc"
    assert (line["status"], line["finish_reason"], line["prompt_tokens"], line["completion_tokens"]) == (
        "OK",
        "eos",
        5,
        3,
    )
    assert 0 < line["first_token_s"] <= line["total_s"]
    assert "hello" not in json.dumps(line)  # text is never logged


def test_a_refused_request_is_logged_and_counted_with_its_status(log_lines: Any) -> None:
    metrics = RecordingMetrics()
    front, made = frontend(["a"], metrics)
    with pytest.raises(InvalidArgument, match="role"):
        collect(front, EdgeRequest(chat=(ChatTurn("wizard", "hi"),), max_new_tokens=8))
    assert made == []  # refused before any generation started
    assert metrics.events == ["error:INVALID_ARGUMENT"]
    (line,) = log_lines()
    assert line["status"] == "INVALID_ARGUMENT" and "wizard" in line["error"]


def test_unattached_frontend_is_unavailable() -> None:
    front = GenerationFrontend("smollm2", AdmissionController())
    assert not front.ready
    with pytest.raises(Unavailable, match="retry"):
        collect(front, EdgeRequest(prompt="hi", max_new_tokens=1))


def test_no_max_new_tokens_means_as_many_as_fit() -> None:
    front, made = frontend(["a"])
    collect(front, EdgeRequest(prompt="x" * 10))
    assert made[0].request.max_new_tokens == 64 - 10  # the context left, below the server's limit of 100
    front, made = frontend(["a"])
    collect(front, EdgeRequest(prompt="x" * 10, max_new_tokens=5))
    assert made[0].request.max_new_tokens == 5


def test_zero_max_new_tokens_is_refused_not_taken_as_unset() -> None:
    front, _ = frontend(["a"])
    with pytest.raises(InvalidArgument, match="max_new_tokens must be between 1 and 100"):
        collect(front, EdgeRequest(prompt="hi", max_new_tokens=0))


def test_speculation_reaches_the_generation() -> None:
    front, made = frontend(["a"])
    off = Speculation(SpeculationMode.OFF)
    events = collect(front, EdgeRequest(prompt="hi", max_new_tokens=3, speculation=off))
    assert made[0].request.speculation == off
    assert events[-1].speculation is SpeculationMode.OFF


def test_speculation_settings_are_checked() -> None:
    assert Speculation.parse("off") == Speculation(SpeculationMode.OFF)
    assert Speculation.parse("auto", 4).draft_limit(16) == 4
    assert Speculation.parse("auto", 40).draft_limit(16) == 16
    assert Speculation().draft_limit(16) == 16
    assert Speculation(SpeculationMode.OFF).draft_limit(16) == 0
    with pytest.raises(InvalidArgument, match="'auto', 'off'"):
        Speculation.parse("fast")
    with pytest.raises(InvalidArgument, match=r"0 .* or more"):
        Speculation(max_draft_tokens=-1)
    with pytest.raises(InvalidArgument, match="speculation is off"):
        Speculation(SpeculationMode.OFF, 3)


def test_a_stream_closed_from_another_context_ends_cleanly(log_lines: Any) -> None:
    """gRPC leaves a finished stream to asyncio's finalizer, which closes it in a task of its own context."""

    async def run(stop_after: int) -> None:
        front, made = frontend(["a", "b"])
        stream = front.generate(EdgeRequest(prompt="hi", max_new_tokens=4), CALL)
        for _ in range(stop_after):
            await anext(stream)
        await asyncio.create_task(stream.aclose(), context=contextvars.Context())
        assert made[0].closed  # at once: the generation's session is released with the stream

    asyncio.run(run(stop_after=3))  # both chunks and the stats: complete
    asyncio.run(run(stop_after=1))  # one chunk: the client went away
    complete, abandoned = log_lines()
    assert (complete["status"], complete["finish_reason"]) == ("OK", "eos")
    assert (abandoned["status"], abandoned["finish_reason"], abandoned["prompt_tokens"]) == ("CANCELLED", "", 2)


class FailingGeneration(ScriptedGeneration):
    """Drops its drafter with a detail only operators may read, then loses its verifier for good."""

    async def stream(self) -> AsyncIterator[TextChunk | GenerationStats]:
        self.stats.drafter_error = "drafter dropped: connection lost"
        self.stats.drafter_error_detail = "drafter at 10.0.0.7:50052: RPC already finished"
        yield TextChunk("a", [1])
        raise Unavailable("a verifier replica is unreachable", detail="verifier at 10.0.0.9:50051: Connection reset")


def test_the_log_line_holds_the_details_the_client_is_not_told(log_lines: Any) -> None:
    front = GenerationFrontend(
        "smollm2",
        AdmissionController(),
        None,
        GenerationBackend(tokenizer, LIMITS, lambda request: FailingGeneration(request, [])),
    )
    with pytest.raises(Unavailable) as failed:
        collect(front, EdgeRequest(prompt="hello", max_new_tokens=8))
    assert str(failed.value) == "a verifier replica is unreachable"  # what the edge sends the client
    (line,) = log_lines()
    assert line["error"] == "a verifier replica is unreachable"
    assert line["error_detail"] == "verifier at 10.0.0.9:50051: Connection reset"
    assert line["drafter_error"] == "drafter at 10.0.0.7:50052: RPC already finished"


HOLD_BOUND_S = 30.0  # a failure bound, never a pass condition: how long the held prompt waits for the test


class HeldTokenizer:
    """One token per character, counting its calls; the prompt ``held`` stays in the tokenizer until ``release``.

    ``released`` says how the held prompt left: True when the test let it go, False when it gave up waiting
    (the test could not run: whatever tokenized it blocked the event loop the test runs on).
    """

    def __init__(self, held: str) -> None:
        self.held = held
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: bool | None = None
        self.calls = 0

    def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
        self.calls += 1
        if text == self.held:
            self.entered.set()
            self.released = self.release.wait(timeout=HOLD_BOUND_S)
        return tokenizer(text)


def test_a_prompt_in_the_tokenizer_holds_up_no_other_stream() -> None:
    """Tokenizing runs in a worker thread, so the event loop serves other requests meanwhile (a 4 MB prompt
    takes the tokenizer seconds). Proved by order, not by timing: the held prompt leaves the tokenizer only
    when the test lets it, and the test lets it only after another request has streamed to its end."""
    held = HeldTokenizer("x" * 40)
    front, made = frontend(["a", "b"], tokenize=held)

    async def run() -> tuple[list[Any], list[Any]]:
        slow = asyncio.create_task(consume(front.generate(EdgeRequest(prompt=held.held, max_new_tokens=4), CALL)))
        try:
            assert await asyncio.to_thread(held.entered.wait, HOLD_BOUND_S), "the held prompt never reached a worker"
            other = await consume(front.generate(EdgeRequest(prompt="hi", max_new_tokens=4), CALL))
        finally:
            held.release.set()
        return other, await slow

    other, slow = asyncio.run(run())
    assert held.released is True  # let go by the test, which ran while the prompt was in the tokenizer
    assert [len(g.request.prompt_ids) for g in made] == [2, 40]  # the other request's generation came first
    for events in (other, slow):
        assert [e.text for e in events[:-1]] == ["a", "b"] and isinstance(events[-1], GenerationStats)


async def consume(stream: AsyncIterator[TextChunk | GenerationStats]) -> list[Any]:
    return [event async for event in stream]


def test_a_chat_over_the_message_limit_is_refused_on_its_count_alone() -> None:
    """The count is checked before anything that reads the messages (roles, sizes, the template, the tokenizer)
    and before the request waits for a slot: a 100,000-message chat costs the event loop nothing but its length.
    Every message here has a bad role, so a check that read one would refuse with another message."""
    held, decisions = HeldTokenizer(""), AdmissionDecisions()
    made: list[Any] = []
    backend = GenerationBackend(held, LIMITS, made.append)
    front = GenerationFrontend("smollm2", AdmissionController(observer=decisions), None, backend)
    chat = (ChatTurn("wizard", "hi"),) * (LIMITS.max_chat_messages + 1)
    with pytest.raises(InvalidArgument, match=f"^the chat has {len(chat)} messages; at most 1024 are allowed"):
        collect(front, EdgeRequest(chat=chat, max_new_tokens=8))
    assert (held.calls, decisions.seen, made) == (0, [], [])


class AdmissionDecisions:
    """What admission decided, in order: a request refused before it asked for a slot leaves nothing here."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def admitted(self, queue_s: float) -> None:
        self.seen.append("admitted")

    def rejected(self, reason: str) -> None:
        self.seen.append(f"rejected:{reason}")
