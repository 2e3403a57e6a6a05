"""gRPC plumbing shared by the three servers: health, graceful shutdown, options (errors: ``specserve.rpc_errors``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from specserve.drain import Drain
from specserve.errors import SpecserveError
from specserve.health import HealthServicer
from specserve.health import add_health as add_health  # the servers register health through here

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def status_code(error: SpecserveError) -> grpc.StatusCode:
    return grpc.StatusCode[error.status]


def mark_serving(servicer: HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


POLL_S = 0.1
"""How often a draining server checks whether its in-flight work is done."""
FINAL_GRACE_S = 1.0
"""What a drained server gives the calls still open (a last reply, a health check) when it stops."""


def refused_while_draining(what: str) -> Callable[[F], F]:
    """Decorate a streaming (async generator) handler of a servicer that has a ``drain`` (specserve.drain.Drain).

    While draining, a new call is refused with UNAVAILABLE ("this replica is shutting down ... retry"); an
    accepted call counts as in flight until its stream ends, and the server waits for it before stopping.
    """

    def decorate(method: F) -> F:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            drain: Drain = self.drain
            try:
                drain.refuse_new(what)
            except SpecserveError as exc:
                await context.abort(status_code(exc), str(exc), trailing_metadata=exc.metadata)
            with drain.in_flight():
                async with contextlib.aclosing(method(self, request, context)) as stream:
                    async for item in stream:
                        yield item

        return wrapper  # type: ignore[return-value]

    return decorate


def mark_draining(servicer: HealthServicer) -> None:
    """Every service name NOT_SERVING from now on (later ``set`` calls are ignored)."""
    servicer.enter_graceful_shutdown()


async def serve_until_signal(server: grpc.aio.Server, drain: Drain | None = None) -> None:
    """Run an asyncio server until SIGINT or SIGTERM, drain it (see specserve.drain), then stop it.

    A second signal stops at once.
    """
    drain = drain or Drain()
    signalled = asyncio.Event()

    def on_signal() -> None:
        drain.signal()
        signalled.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    await signalled.wait()
    log.info("draining: %d in flight, up to %.0f s", drain.outstanding, drain.grace_s)
    while not drain.done():
        await asyncio.sleep(POLL_S)
    _log_stop(drain)
    await server.stop(grace=0 if drain.forced else FINAL_GRACE_S)


def drain_on_signals(drain: Drain) -> None:
    """Route SIGINT and SIGTERM to ``drain.signal`` (sync servers; call from the main thread)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: drain.signal())


def stop_when_drained(server: grpc.Server, drain: Drain) -> None:
    """Block until a signal has begun the drain and it is done (``drain_on_signals``), then stop ``server``."""
    while not drain.draining:
        time.sleep(0.5)
    log.info("draining: %d in flight, up to %.0f s", drain.outstanding, drain.grace_s)
    while not drain.done():
        time.sleep(POLL_S)
    _log_stop(drain)
    server.stop(grace=0 if drain.forced else FINAL_GRACE_S).wait()


def _log_stop(drain: Drain) -> None:
    if drain.forced:
        log.info("stopping now (second signal), %d in flight", drain.outstanding)
    elif drain.outstanding:
        log.warning("stopping: the %.0f s grace ran out with %d in flight", drain.grace_s, drain.outstanding)
    else:
        log.info("stopping: drained")


KEEPALIVE_TIME_MS = 30_000
"""How often a client channel pings a connection that has calls in flight, to notice a dead peer."""


def server_options() -> list[tuple[str, Any]]:
    """Options for every server: accept the keepalive pings that ``channel_options`` clients send.

    By default a gRPC server refuses pings more often than every 5 minutes while no data flows, and after two
    such pings closes the connection (GOAWAY "too_many_pings"), failing its calls: a Draft stream waiting out a
    long prefill, or a Prefill queued on a busy verifier, died after 2 minutes of silence.
    """
    return [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2)]


def reconnect_options(probe_interval_s: float) -> list[tuple[str, Any]]:
    """Channel options that keep gRPC's reconnect backoff within half of ``probe_interval_s``.

    By default a channel whose peer went away waits 1 s, then 1.6 times longer after each failed attempt, up to
    120 s, and gives each attempt at least 20 s: a drafter restarted after a while down was reconnected only tens
    of seconds later, and until then every probe of the circuit breaker failed at once. With attempts at least
    twice per probe interval (``--drafter-backoff-ms``), a probe finds a restarted drafter connected. A server
    that is not yet listening is the same case (``local_cluster.wait_serving``).
    """
    bound_ms = max(100, round(probe_interval_s * 1000 / 2))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(1000, bound_ms)),
        ("grpc.max_reconnect_backoff_ms", bound_ms),
        ("grpc.min_reconnect_backoff_ms", bound_ms),  # the least time an attempt is given to connect
    ]


def channel_options() -> list[tuple[str, Any]]:
    """Options for client channels: round-robin over all addresses of dns:/// targets.

    Answers may be large: the verifier's Prefill answer carries the prompt's features when asked (2 bytes per
    value: 9 MiB for a whole 8,192-token SmolLM2 context). Requests stay under the servers' default 4 MiB: the
    coordinator sends features to a drafter in FeatureChunks of ``coordinator.grpc_clients.FEATURE_CHUNK_BYTES``.
    """
    return [
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ]
