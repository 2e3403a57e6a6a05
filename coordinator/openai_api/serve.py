"""uvicorn inside the coordinator's own asyncio loop, next to the gRPC server.

The coordinator owns signals and shutdown (``specserve.drain``): uvicorn installs no signal handlers here, and
stops only when told, after the drain, so a running stream finishes while new requests get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from specserve.auth.tls import ServerTLS

log = logging.getLogger(__name__)

FINAL_GRACE_S = 1
"""What open connections get to finish once the drain is over (uvicorn wants whole seconds)."""


class HttpStartError(RuntimeError):
    """The HTTP API cannot listen where it was told to; the message says where and why."""


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to its host (the coordinator's drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:  # a name: the first address it resolves to
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    except OSError as exc:
        raise HttpStartError(f"the HTTP API cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


class HttpServer:
    """The HTTP API listening on ``host:port`` (TLS, and client certificates, as the gRPC port has them)."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, tls: ServerTLS | None = None, limit_concurrency: int | None = None
    ) -> None:
        """``limit_concurrency``: connections and requests at once; beyond it uvicorn answers 503 (None: no limit)."""
        tls = tls or ServerTLS()
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            loop="none",
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,  # the coordinator's logging; its request log line replaces uvicorn's access log
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=FINAL_GRACE_S,
            limit_concurrency=limit_concurrency,
            ssl_certfile=tls.cert,
            ssl_keyfile=tls.key,
            ssl_ca_certs=tls.client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.mutual else ssl.CERT_NONE,
        )
        self.limit_concurrency = limit_concurrency
        self._server = _Server(self._config)
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.host = host
        self.scheme = "https" if tls.enabled else "http"

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS picked, for port 0)."""
        assert self._socket is not None, "not started"
        port: int = self._socket.getsockname()[1]
        return port

    async def start(self) -> None:
        """Listen and serve in the background; HttpStartError when it cannot."""
        self._socket = _listen(self.host, self._config.port)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="http-api")
        while not self._server.started:
            if self._task.done():
                exc = self._task.exception()
                self._socket.close()
                raise HttpStartError(f"the HTTP API on {self.host}:{self._config.port} did not start: {exc}")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", self.scheme, self.host, self.port)

    async def stop(self, now: bool = False) -> None:
        """Stop listening, give open connections ``FINAL_GRACE_S`` (none when ``now``), then end."""
        if self._task is None:
            return
        self._server.should_exit = True
        self._server.force_exit = now
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
