"""grpc.health.v1 on every server, with a cap on open ``Watch`` streams.

Health stays open to callers without credentials (orchestrators probe without them), so whatever it serves
must be bounded: a ``Watch`` is a stream that stays open for as long as the caller likes. Past
``--max-health-watches`` open streams a new ``Watch`` gets RESOURCE_EXHAUSTED; ``Check`` is never capped.

Two servicers, one per server kind, with the same synchronous ``set`` / ``enter_graceful_shutdown``:

- ``SyncHealthServicer`` (the verifier's ``grpc.Server``): grpc's own servicer in its non-blocking mode (a
  watch holds no thread), with the cap in front.
- ``AioHealthServicer`` (``grpc.aio.Server``: coordinator, drafter): a watch is a coroutine waiting on an
  event. grpc's synchronous servicer must not serve an asyncio server: there its ``Watch`` is a blocking
  iterator that holds a thread of the event loop's default executor for as long as the stream is open, and a
  few open watches stop every ``asyncio.to_thread`` in the process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge

from specserve.service_main import DEFAULT_MAX_HEALTH_WATCHES

ServingStatus = Any  # health_pb2.HealthCheckResponse.ServingStatus (an int enum)


def watches_full(limit: int) -> str:
    """The refusal of one ``Watch`` too many (no address, nothing of the server's internals)."""
    return (
        f"too many open health watches on this server (at most {limit}): close idle Watch streams, or poll with "
        "Check, and retry"
    )


class WatchLimit:
    """Counts open watches (thread-safe: a sync server opens and closes them on its pool's threads)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"--max-health-watches must be >= 0, got {limit}")
        self.limit = limit
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        """Watches open now (the ``specserve_health_watches`` gauge)."""
        return self._open

    def try_open(self) -> bool:
        with self._lock:
            if self._open >= self.limit:
                return False
            self._open += 1
            return True

    def close(self) -> None:
        with self._lock:
            self._open -= 1


class HealthServicer(Protocol):
    """What the servers' start-up and drain code use of either servicer."""

    watches: WatchLimit

    def set(self, service: str, status: ServingStatus) -> None: ...

    def enter_graceful_shutdown(self) -> None: ...


class SyncHealthServicer(health.HealthServicer):
    """grpc's servicer (non-blocking ``Watch``) for a ``grpc.Server``, capped at ``max_watches`` open watches."""

    def __init__(self, max_watches: int) -> None:
        super().__init__(experimental_non_blocking=True)
        self.watches = WatchLimit(max_watches)

    def Watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.ServicerContext,
        send_response_callback: Callable[[Any], None] | None = None,
    ) -> Any:
        if not self.watches.try_open():
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(watches_full(self.watches.limit))
            if send_response_callback is not None:
                send_response_callback(None)  # non-blocking mode: None ends the call with the status set above
                return None
            return iter(())
        context.add_callback(self.watches.close)
        return super().Watch(request, context, send_response_callback)


class AioHealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for a ``grpc.aio.Server``; ``set`` may be called from any thread."""

    def __init__(self, max_watches: int) -> None:
        self.watches = WatchLimit(max_watches)
        self._lock = threading.Lock()
        self._status: dict[str, ServingStatus] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._shutting_down = False

    def set(self, service: str, status: ServingStatus) -> None:
        with self._lock:
            if self._shutting_down:
                return
            self._status[service] = status
            listeners = list(self._listeners)
        for loop, changed in listeners:
            loop.call_soon_threadsafe(changed.set)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on; later ``set`` calls are ignored."""
        with self._lock:
            services = list(self._status)
        for service in services:
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        with self._lock:
            self._shutting_down = True

    def _current(self, service: str) -> ServingStatus | None:
        with self._lock:
            return self._status.get(service)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._current(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service named {request.service!r} here")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if not self.watches.try_open():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, watches_full(self.watches.limit))
        changed = asyncio.Event()
        listener = (asyncio.get_running_loop(), changed)
        with self._lock:
            self._listeners.add(listener)
        try:
            sent = None
            while True:
                changed.clear()
                status = self._current(request.service)
                if status is None:
                    status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != sent:
                    yield health_pb2.HealthCheckResponse(status=status)
                    sent = status
                await changed.wait()
        finally:
            with self._lock:
                self._listeners.discard(listener)
            self.watches.close()


def add_health(
    server: grpc.Server | grpc.aio.Server, service_names: list[str], max_watches: int = DEFAULT_MAX_HEALTH_WATCHES
) -> HealthServicer:
    """Register grpc.health.v1 (the servicer that suits the server's kind); every service starts NOT_SERVING
    until marked ready."""
    servicer: SyncHealthServicer | AioHealthServicer
    if isinstance(server, grpc.aio.Server):
        servicer = AioHealthServicer(max_watches)
    else:
        servicer = SyncHealthServicer(max_watches)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def track_watches(registry: CollectorRegistry, servicer: HealthServicer) -> None:
    """``specserve_health_watches`` in ``registry``: the servicer's open watches, read at each scrape."""
    Gauge(
        "specserve_health_watches",
        "Open grpc.health.v1 Watch streams; past --max-health-watches a new one gets RESOURCE_EXHAUSTED",
        registry=registry,
    ).set_function(lambda: servicer.watches.open)
