"""Start-up helpers shared by the services' main.py: flags, logging, threads."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from specserve.drain import DEFAULT_GRACE_S


def env(name: str, default: str) -> str:
    """A flag default from the environment (read when main() runs, never at import)."""
    return os.environ.get(name, default)


def add_common_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default=env("SPECSERVE_HOST", "127.0.0.1"), help="interface to listen on")
    parser.add_argument("--port", type=int, default=int(env("SPECSERVE_PORT", str(default_port))), help="gRPC port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("SPECSERVE_METRICS_PORT", "0")),
        help="port of the Prometheus /metrics endpoint (0: disabled)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=float(env("SPECSERVE_SHUTDOWN_GRACE_S", str(DEFAULT_GRACE_S))),
        help="on SIGTERM: how long in-flight work may go on while new work is refused (a second signal stops "
        "at once); keep it below the pod's terminationGracePeriodSeconds",
    )
    parser.add_argument("--log-level", default=env("SPECSERVE_LOG_LEVEL", "INFO"))


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
