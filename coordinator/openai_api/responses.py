"""One generation as one HTTP response: a JSON body, or server-sent events ending with ``data: [DONE]``.

The status is decided by the generation's first event: a request refused before anything was generated (a bad
prompt, a full queue, a verifier that cannot be reached) gets its own status and OpenAI error body, never a 200
stream with an error inside. Once a stream has begun, a failure is one last ``data: {"error": ...}`` event and
then ``data: [DONE]``.

The generation runs in a task of its own while this response watches the connection: when the client goes away
(``http.disconnect``), the task is cancelled, which stops the round loop and releases the verifier session,
exactly as a cancelled gRPC stream does. (Starlette's StreamingResponse would notice a disconnect only at its
next write, and cancel through an anyio scope in which the session's release could not await.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from coordinator.openai_api.errors import ApiError, as_api_error
from coordinator.openai_api.schemas import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    Completion,
    CompletionChoice,
)
from coordinator.openai_api.translate import finish_reason, speculation_stats, usage
from coordinator.rounds import GenerationStats, TextChunk

log = logging.getLogger(__name__)

Event = TextChunk | GenerationStats
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx and friends: pass each event on at once
]
JSON_HEADERS = [(b"content-type", b"application/json")]


def sse(payload: bytes) -> bytes:
    """One server-sent event carrying ``payload`` (a JSON document: one line, no blank lines inside)."""
    return b"data: " + payload + b"\n\n"


class Renderer(ABC):
    """The OpenAI objects of one request (chat or text completion), streamed or whole."""

    def __init__(self, response_id: str, model: str, created: int, include_usage: bool) -> None:
        self.id = response_id
        self.model = model
        self.created = created
        self.include_usage = include_usage

    def dump(self, chunk: BaseModel) -> bytes:
        """A stream chunk: ``usage`` only when asked for (then null until the last), ``speculation`` only when set."""
        exclude = set()
        if not self.include_usage:
            exclude.add("usage")
        if getattr(chunk, "speculation", None) is None:
            exclude.add("speculation")
        return chunk.model_dump_json(exclude=exclude).encode()

    def opening(self) -> list[BaseModel]:
        """Chunks before the first text."""
        return []

    @abstractmethod
    def delta(self, text: str) -> BaseModel: ...

    @abstractmethod
    def closing(self, stats: GenerationStats) -> list[BaseModel]:
        """The chunk with the finish_reason, then (with include_usage) the usage chunk; the last carries the stats."""

    @abstractmethod
    def whole(self, text: str, stats: GenerationStats) -> BaseModel: ...


class ChatRenderer(Renderer):
    def _chunk(self, choices: list[ChatChunkChoice], **fields: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **fields)

    def opening(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta={"role": "assistant", "content": ""})])]

    def delta(self, text: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta={"content": text})])

    def closing(self, stats: GenerationStats) -> list[BaseModel]:
        finish = ChatChunkChoice(delta={}, finish_reason=finish_reason(stats))
        if not self.include_usage:
            return [self._chunk([finish], speculation=speculation_stats(stats))]
        return [self._chunk([finish]), self._chunk([], usage=usage(stats), speculation=speculation_stats(stats))]

    def whole(self, text: str, stats: GenerationStats) -> BaseModel:
        choice = ChatCompletionChoice(message=ChatCompletionMessage(content=text), finish_reason=finish_reason(stats))
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage(stats),
            speculation=speculation_stats(stats),
        )


class CompletionRenderer(Renderer):
    def _chunk(self, choices: list[CompletionChoice], **fields: Any) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, **fields)

    def delta(self, text: str) -> BaseModel:
        return self._chunk([CompletionChoice(text=text)])

    def closing(self, stats: GenerationStats) -> list[BaseModel]:
        finish = CompletionChoice(text="", finish_reason=finish_reason(stats))
        if not self.include_usage:
            return [self._chunk([finish], speculation=speculation_stats(stats))]
        return [self._chunk([finish]), self._chunk([], usage=usage(stats), speculation=speculation_stats(stats))]

    def whole(self, text: str, stats: GenerationStats) -> BaseModel:
        return self._chunk(
            [CompletionChoice(text=text, finish_reason=finish_reason(stats))],
            usage=usage(stats),
            speculation=speculation_stats(stats),
        )


async def send_error(send: Send, error: ApiError) -> None:
    """A whole error response (before anything else was sent)."""
    headers = [*JSON_HEADERS, *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.json(), "more_body": False})


class _Incomplete(Exception):
    """The generation ended without its stats (a bug in the frontend)."""


async def _disconnected(receive: Receive) -> None:
    """Return when the client has gone away (the request body has been read by now)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class GenerationResponse(Response):
    """Runs ``events`` (the frontend's stream for one request) and answers with what ``renderer`` makes of them."""

    def __init__(
        self,
        events: AsyncIterator[Event],
        renderer: Renderer,
        stream: bool,
        in_flight: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_close`` runs once the response has ended, however: the generation's admission slot is released
        there even when the client went away before ``events`` began (a generator never started has no
        ``finally`` to run)."""
        super().__init__(status_code=200)
        self._events = events
        self._renderer = renderer
        self._stream = stream
        self._in_flight = in_flight
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._respond(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client went away (or the server is stopping): stop generating
                log.debug("%s: the client went away; cancelling the generation", self._renderer.id)
                work.cancel()
            await asyncio.wait((work, gone))
            self._on_close()
        if not work.cancelled() and (exc := work.exception()) is not None:
            log.error("%s: the response failed while sending", self._renderer.id, exc_info=exc)

    async def _respond(self, send: Send) -> None:
        with self._in_flight():
            events = self._events
            try:
                first = await anext(events)
            except StopAsyncIteration:
                await send_error(send, as_api_error(_Incomplete("the generation ended before it began")))
                return
            except Exception as exc:
                await send_error(send, as_api_error(exc, self._renderer.id))
                return
            try:
                if self._stream:
                    await self._send_stream(send, first, events)
                else:
                    await self._send_whole(send, first, events)
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:  # a no-op once the stream has ended; else GeneratorExit into it
                    await aclose()

    async def _send_stream(self, send: Send, first: Event, events: AsyncIterator[Event]) -> None:
        renderer = self._renderer
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        for chunk in renderer.opening():
            await write(sse(renderer.dump(chunk)))
        finished = False
        try:
            async for event in _chain(first, events):
                if isinstance(event, TextChunk):
                    if event.text:
                        await write(sse(renderer.dump(renderer.delta(event.text))))
                else:
                    finished = True
                    for chunk in renderer.closing(event):
                        await write(sse(renderer.dump(chunk)))
            if not finished:
                raise _Incomplete("the generation ended without its stats")
        except Exception as exc:  # after the 200 went out: one error event, then [DONE]
            await write(as_api_error(exc, renderer.id).event())
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _send_whole(self, send: Send, first: Event, events: AsyncIterator[Event]) -> None:
        texts: list[str] = []
        stats: GenerationStats | None = None
        try:
            async for event in _chain(first, events):
                if isinstance(event, TextChunk):
                    texts.append(event.text)
                else:
                    stats = event
            if stats is None:
                raise _Incomplete("the generation ended without its stats")
        except Exception as exc:
            await send_error(send, as_api_error(exc, self._renderer.id))
            return
        body = self._renderer.whole("".join(texts), stats).model_dump_json(exclude_none=False).encode()
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _chain(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event
