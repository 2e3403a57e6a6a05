"""The start-up steps the three servers share: health, the drain's effect on it, the port, the internal token.

Each server builds its own gRPC server, servicers and drain (what counts as in-flight work is its own), then
calls ``listen``; signals and the drain's end are ``specserve.rpc``'s (``serve_until_signal`` for the asyncio
servers, ``drain_on_signals`` and ``stop_when_drained`` for the verifier's threaded one). One place, so that the
servers cannot differ in what their health reports while draining or in how they listen.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from specserve.auth.tls import ExposureError, add_port
from specserve.drain import Drain
from specserve.health import HealthServicer
from specserve.rpc import add_health, mark_draining
from specserve.service_main import ServiceConfig


class Listening(NamedTuple):
    """What ``listen`` set up: the health servicer (mark it SERVING once ready) and the address listened on."""

    health: HealthServicer
    address: str


def listen(server: grpc.Server | grpc.aio.Server, config: ServiceConfig, service_name: str, drain: Drain) -> Listening:
    """grpc.health.v1 for ``service_name`` (NOT_SERVING until marked ready; Watch streams capped by
    --max-health-watches), every service NOT_SERVING once ``drain`` begins, and --host:--port with the
    config's TLS. Call before the server starts."""
    health = add_health(server, [service_name], config.max_health_watches)
    drain.on_begin(lambda: mark_draining(health))
    address = f"{config.host}:{config.port}"
    add_port(server, address, config.security.tls)
    return Listening(health, address)


def internal_token(config: ServiceConfig, service: str) -> str | None:
    """The token a worker's (verifier's, drafter's) callers must send, None for none, after the exposure rule:
    beyond loopback a worker needs the token or mTLS (or --insecure). SystemExit saying what to pass otherwise,
    before anything is loaded."""
    try:
        config.security.check_internal_exposure(service, config.host)
        return config.security.internal_token()
    except (ExposureError, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
