"""The coordinator's Prometheus endpoint (``--metrics-port``), optionally behind a bearer token.

With ``--metrics-token-file`` every request must send ``Authorization: Bearer <token>`` (Prometheus:
``authorization: {credentials_file: ...}`` in a scrape config, ``bearerTokenSecret`` in a ServiceMonitor);
anything else gets 401 and no metric. Metrics name tenants' request counts and the service's load, which are
not for everyone who can reach the pod. Without the flag it serves as before (restrict it with the network).
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from specserve.auth.interceptors import bearer

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

METRICS_TOKEN_MISSING = (
    "send the metrics token as `Authorization: Bearer <token>` (the coordinator's --metrics-token-file)"
)
METRICS_TOKEN_WRONG = "the metrics token is wrong: give the scraper the coordinator's --metrics-token-file"


def require_token(app: WsgiApp, token: str) -> WsgiApp:
    """``app`` for callers that send ``token`` as a bearer token (compared in constant time); 401 for others."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION")
        presented = bearer([("authorization", header)] if header else None)
        if presented is not None and hmac.compare_digest(presented.encode(), token.encode()):
            return app(environ, start_response)
        body = (METRICS_TOKEN_MISSING if presented is None else METRICS_TOKEN_WRONG).encode() + b"\n"
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("WWW-Authenticate", 'Bearer realm="specserve-metrics"'),
            ],
        )
        return [body]

    return guarded


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """One line per scrape on stderr would drown the log."""


def serve_metrics(registry: CollectorRegistry, port: int, host: str, token: str | None = None) -> WSGIServer:
    """/metrics of ``registry`` on ``host``:``port`` in a daemon thread; with ``token``, for its holders only."""
    app: WsgiApp = make_wsgi_app(registry)
    if token is not None:
        app = require_token(app, token)

    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(host, port, app, Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
