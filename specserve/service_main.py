"""Start-up helpers shared by the services' main.py: flags, logging, threads."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Protocol

LOOPBACK = "127.0.0.1"
"""Where every server listens by default (and `make run` serves): this machine only."""
COORDINATOR_PORT = 50051
DRAFTER_PORT = 50052
VERIFIER_PORT = 50053
HTTP_PORT = 8000  # the coordinator's OpenAI-compatible HTTP API
"""The services' default ports: their config dataclasses, the coordinator's default targets and the local cluster."""
DEFAULT_MAX_HEALTH_WATCHES = 64
"""Open ``Health/Watch`` streams a server serves at once (``--max-health-watches``; ``specserve.health``). Here,
not there, so that a config dataclass imports no gRPC package (the engine alone runs without them)."""


class ServerDefaults(Protocol):
    """What ``add_common_flags`` reads from a service's config dataclass (an instance with its defaults)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def metrics_port(self) -> int: ...

    @property
    def shutdown_grace_s(self) -> float: ...

    @property
    def max_health_watches(self) -> int: ...


def env(name: str, default: str) -> str:
    """A flag default from the environment (read when main() runs, never at import)."""
    return os.environ.get(name, default)


def add_common_flags(parser: argparse.ArgumentParser, defaults: ServerDefaults) -> None:
    """--host, --port, --metrics-port, --shutdown-grace-s, --max-health-watches, --log-level and the security
    flags; their defaults come from ``defaults`` (the service's config dataclass), or from the environment."""
    parser.add_argument("--host", default=env("SPECSERVE_HOST", defaults.host), help="interface to listen on")
    parser.add_argument("--port", type=int, default=int(env("SPECSERVE_PORT", str(defaults.port))), help="gRPC port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("SPECSERVE_METRICS_PORT", str(defaults.metrics_port))),
        help="port of the Prometheus /metrics endpoint (0: disabled)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=float(env("SPECSERVE_SHUTDOWN_GRACE_S", str(defaults.shutdown_grace_s))),
        help="on SIGTERM: how long in-flight work may go on while new work is refused (a second signal stops "
        "at once); keep it below the pod's terminationGracePeriodSeconds",
    )
    parser.add_argument(
        "--max-health-watches",
        type=int,
        default=int(env("SPECSERVE_MAX_HEALTH_WATCHES", str(defaults.max_health_watches))),
        help="open grpc.health.v1 Watch streams served at once (health needs no credentials, so it is bounded); "
        "more get RESOURCE_EXHAUSTED. Check is never capped",
    )
    parser.add_argument("--log-level", default=env("SPECSERVE_LOG_LEVEL", "INFO"))
    add_security_flags(parser)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """TLS, mTLS, the internal token and --insecure (read with ``specserve.auth.config.security_from_args``)."""
    tls = parser.add_argument_group("security")
    tls.add_argument("--tls-cert", default=env("SPECSERVE_TLS_CERT", ""), help="PEM certificate (chain): serve TLS")
    tls.add_argument("--tls-key", default=env("SPECSERVE_TLS_KEY", ""), help="PEM private key of --tls-cert")
    tls.add_argument(
        "--tls-client-ca",
        default=env("SPECSERVE_TLS_CLIENT_CA", ""),
        help="PEM CA bundle: require client certificates it signed (mTLS)",
    )
    tls.add_argument(
        "--internal-token-file",
        default=env("SPECSERVE_INTERNAL_TOKEN_FILE", ""),
        help="verifier/drafter: the token callers must send; coordinator: the token it sends to them",
    )
    tls.add_argument(
        "--insecure",
        action="store_true",
        default=env("SPECSERVE_INSECURE", "") in ("1", "true", "yes"),
        help="allow a --host other than loopback without authentication",
    )


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    # transformers' progress bars and advisory warnings are noise in service logs.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
