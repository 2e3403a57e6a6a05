"""TLS from certificate files, and the rule that only loopback servers may run without authentication."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


class ExposureError(ValueError):
    """A server would be reachable from the network without authentication; the message says what to pass."""


@dataclass(frozen=True)
class ServerTLS:
    """``--tls-cert``/``--tls-key`` (PEM files), and ``--tls-client-ca`` to require client certificates (mTLS)."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: pass both (or neither, for plaintext)")
        if self.client_ca and not self.cert:
            raise ValueError("--tls-client-ca (mTLS) needs the server's own --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        assert self.cert and self.key
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: ServerTLS) -> int:
    """Listen on ``address``, with TLS when configured."""
    if tls.enabled:
        return server.add_secure_port(address, tls.credentials())
    return server.add_insecure_port(address)


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks a server (``ca``: PEM roots; None: the system's) and proves itself (mTLS cert/key)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate and its key go together: pass both or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


def aio_channel(target: str, tls: ClientTLS | None, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """An asyncio channel to ``target``: TLS when ``tls`` is set, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


def is_loopback(host: str) -> bool:
    """``host`` (a --host value) only accepts connections from this machine."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(service: str, host: str, authenticated: bool, insecure: bool, how: str, tls: bool) -> None:
    """Refuse to listen beyond loopback without authentication (unless ``insecure``); warn about plaintext.

    ``how``: the flags that turn authentication on, for the message.
    """
    if is_loopback(host):
        return
    if not authenticated:
        if not insecure:
            raise ExposureError(
                f"{service}: --host {host} is reachable from the network, but authentication is off: pass {how}, "
                "or --insecure (SPECSERVE_INSECURE=1) to serve anyone who can connect"
            )
        log.warning("%s: serving %s WITHOUT authentication (--insecure): anyone may call it", service, host)
    if not tls:
        log.warning(
            "%s: TLS is off on %s: keys, tokens and text cross the network in plaintext (pass --tls-cert/--tls-key)",
            service,
            host,
        )
