"""A cap on the calls a server serves at once, answered in our words before the library's own cap is reached.

gRPC's ``maximum_concurrent_rpcs`` refuses a call past it with RESOURCE_EXHAUSTED "Concurrent RPC limit
exceeded!", and uvicorn's ``limit_concurrency`` with a plain-text 503 "Service Unavailable": library text, and no
hint of when to come back. ``CallLimit`` counts the calls a server is serving and refuses one past its limit with
our own RESOURCE_EXHAUSTED (HTTP: a 429 JSON error), with ``retry-after-ms``. The libraries' caps stay, set above
this one, as a backstop that bounds memory even if a flood outruns the count (they refuse before a request is
read; this count sees a call once its request has arrived).

Health (grpc.health.v1, the HTTP ``/health``) is never counted: a probe must answer while the server is busy, and
Watch streams have their own cap (``specserve.rpc.AioHealthServicer``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from specserve.auth.interceptors import HEALTH_PREFIX
from specserve.errors import ResourceExhausted

CALL_LIMIT_MESSAGE = (
    "the {server} is serving its limit of {limit} calls at once; retry after {retry_ms} ms "
    "(or send fewer requests at once)"
)


class CallLimit:
    """At most ``limit`` calls held at once; the next one gets ``ResourceExhausted`` with ``retry-after-ms``.

    ``retry_after_s`` estimates when a call is likely to end (the coordinator passes admission's estimate);
    ``on_refused`` counts refusals. Used from one event loop: the count needs no lock.
    """

    def __init__(
        self,
        limit: int,
        server: str,
        retry_after_s: Callable[[], float] = lambda: 1.0,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.limit = limit
        self.server = server
        self.in_flight = 0
        self._retry_after_s = retry_after_s
        self._on_refused = on_refused

    def refusal(self) -> ResourceExhausted:
        retry_ms = max(1, round(self._retry_after_s() * 1000))
        message = CALL_LIMIT_MESSAGE.format(server=self.server, limit=self.limit, retry_ms=retry_ms)
        return ResourceExhausted(message, metadata=(("retry-after-ms", str(retry_ms)),))

    def enter(self) -> None:
        """Count one call; ``ResourceExhausted`` (and nothing counted) when at the limit. Pair with ``leave``."""
        if self.in_flight >= self.limit:
            self._on_refused()
            raise self.refusal()
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``enter`` for the block, ``leave`` after it."""
        self.enter()
        try:
            yield
        finally:
            self.leave()


def _limited(handler: grpc.RpcMethodHandler, limit: CallLimit) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior run inside ``limit.held()``; a sync behavior is left as it is."""

    def wrap_unary(behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with limit.held():
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result

        return call

    def wrap_streaming(behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with limit.held():
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:  # a coroutine that writes with context.write (or aborts)
                    await result

        return stream

    def is_async(behavior: Callable[..., Any]) -> bool:
        return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)

    for kind, wrap in (
        ("unary_unary", wrap_unary),
        ("stream_unary", wrap_unary),
        ("unary_stream", wrap_streaming),
        ("stream_stream", wrap_streaming),
    ):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(**{kind: wrap(behavior)}) if is_async(behavior) else handler
    return handler


class AioCallLimitInterceptor(grpc.aio.ServerInterceptor):
    """``CallLimit`` on an asyncio gRPC server, for every method but health.

    Install it inside ``specserve.rpc_errors.AioErrorInterceptor``, which turns the refusal into its status and
    trailing metadata.
    """

    def __init__(self, limit: CallLimit) -> None:
        self.limit = limit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        return _limited(handler, self.limit)
