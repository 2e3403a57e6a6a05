"""What the three servers share at start-up: their common settings, the parsing of a config, and logging."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from specserve.auth.config import ServerSecurity, security_from_args
from specserve.drain import DEFAULT_GRACE_S
from specserve.settings import add_settings, setting, values_from

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


@dataclass(frozen=True)
class ServiceConfig:
    """The settings every server has, declared once (``specserve.settings``); each tier's config extends it.

    The gRPC port's default differs by tier: each tier declares it again with ``grpc_port``.
    """

    host: str = setting(LOOPBACK, "interface to listen on (gRPC, HTTP and /metrics)", env="SPECSERVE_HOST")
    port: int = setting(0, "gRPC port", env="SPECSERVE_PORT", shown="the service's (below)")
    metrics_port: int = setting(
        0, "port of the Prometheus /metrics endpoint on --host (0: disabled)", env="SPECSERVE_METRICS_PORT"
    )
    shutdown_grace_s: float = setting(
        DEFAULT_GRACE_S,
        "on SIGTERM the server drains: health NOT_SERVING at once, new work refused with UNAVAILABLE, in-flight "
        "work (coordinator: its streams; verifier: the sessions it holds; drafter: its Draft streams) goes on "
        "this long at most, then it stops; a second signal stops at once. Keep it below the pod's "
        "terminationGracePeriodSeconds",
        env="SPECSERVE_SHUTDOWN_GRACE_S",
    )
    max_health_watches: int = setting(
        DEFAULT_MAX_HEALTH_WATCHES,
        "open grpc.health.v1 Watch streams served at once (health needs no credentials, so it is bounded); more "
        "get RESOURCE_EXHAUSTED. Check is never capped",
        env="SPECSERVE_MAX_HEALTH_WATCHES",
    )
    security: ServerSecurity = field(default_factory=ServerSecurity)  # from ProcessSettings' security flags


def grpc_port(default: int) -> Any:
    """The ``port`` field of a tier's config: ``ServiceConfig.port``'s flag and variable, the tier's default."""
    return setting(default, "gRPC port", env="SPECSERVE_PORT")


@dataclass(frozen=True)
class ProcessSettings:
    """Flags every server takes that are not config fields: the log level, and the security flags that
    ``specserve.auth.config.security_from_args`` turns into ``ServiceConfig.security``."""

    log_level: str = setting("INFO", "log level (DEBUG, INFO, WARNING, ERROR)", env="SPECSERVE_LOG_LEVEL")
    tls_cert: str | None = setting(
        None, "PEM certificate (chain): serve TLS", env="SPECSERVE_TLS_CERT", shown="plaintext", group="security"
    )
    tls_key: str | None = setting(None, "PEM private key of --tls-cert", env="SPECSERVE_TLS_KEY", group="security")
    tls_client_ca: str | None = setting(
        None,
        "PEM CA bundle: require client certificates it signed (mTLS)",
        env="SPECSERVE_TLS_CLIENT_CA",
        group="security",
    )
    internal_token_file: str | None = setting(
        None,
        "verifier, drafter: the token callers must send; coordinator: the token it sends to them",
        env="SPECSERVE_INTERNAL_TOKEN_FILE",
        group="security",
    )
    insecure: bool = setting(
        False,
        "allow a --host other than loopback without authentication",
        env="SPECSERVE_INSECURE",
        group="security",
    )


Config = TypeVar("Config", bound=ServiceConfig)


def parse_service_config(
    cls: type[Config],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    refine: Callable[[Config], Config] | None = None,
) -> tuple[Config, str]:
    """The config (and log level) of a server's command line and environment, from the declarations alone.

    ``refine`` checks what no single setting can (settings that exclude each other, a device this process can
    use) and may normalise values; its ValueError, like a setting's, ends the program with the usage line.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_settings(parser, cls)
    add_settings(parser, ProcessSettings)
    args = parser.parse_args(argv)
    try:
        config = cls(**values_from(cls, args), security=security_from_args(args))
        values_from(ProcessSettings, args)  # the log level and security flags, checked like the config's
        if refine is not None:
            config = refine(config)
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.log_level


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
