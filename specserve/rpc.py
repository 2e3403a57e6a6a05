"""gRPC plumbing shared by the three servers: health, shutdown, options (errors: ``specserve.rpc_errors``)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specserve.errors import SpecserveError

log = logging.getLogger(__name__)


def status_code(error: SpecserveError) -> grpc.StatusCode:
    return grpc.StatusCode[error.status]


def add_health(server: grpc.Server | grpc.aio.Server, service_names: list[str]) -> health.HealthServicer:
    """Register grpc.health.v1; every service starts NOT_SERVING until marked ready."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def mark_serving(servicer: health.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve_until_signal(server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    """Run an asyncio server until SIGINT or SIGTERM, then stop it gracefully."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("stopping")
    await server.stop(grace=grace_s)


KEEPALIVE_TIME_MS = 30_000
"""How often a client channel pings a connection that has calls in flight, to notice a dead peer."""


def server_options() -> list[tuple[str, Any]]:
    """Options for every server: accept the keepalive pings that ``channel_options`` clients send.

    By default a gRPC server refuses pings more often than every 5 minutes while no data flows, and after two
    such pings closes the connection (GOAWAY "too_many_pings"), failing its calls: a Draft stream waiting out a
    long prefill, or a Prefill queued on a busy verifier, died after 2 minutes of silence.
    """
    return [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2)]


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
