"""The security settings every server shares (``--tls-*``, ``--internal-token-file``, ``--insecure``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from specserve.auth.internal import read_token
from specserve.auth.tls import ServerTLS, check_exposure


@dataclass(frozen=True)
class ServerSecurity:
    tls: ServerTLS = field(default_factory=ServerTLS)
    # verifier/drafter: the token callers must present; coordinator: the token it sends to them.
    internal_token_file: str | None = None
    insecure: bool = False  # allow a non-loopback --host without authentication

    def internal_token(self) -> str | None:
        return read_token(self.internal_token_file) if self.internal_token_file else None

    def check_internal_exposure(self, service: str, host: str) -> None:
        """A worker (verifier, drafter) beyond loopback needs the internal token or mTLS (or --insecure)."""
        check_exposure(
            service,
            host,
            authenticated=bool(self.internal_token_file or self.tls.client_ca),
            insecure=self.insecure,
            how="--internal-token-file and/or --tls-client-ca (mTLS) so that only the coordinator can call it",
            tls=self.tls.enabled,
        )


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """The security flags (``specserve.service_main.ProcessSettings``) as the config's ``security``; ValueError on
    a contradiction."""
    tls = ServerTLS(args.tls_cert or None, args.tls_key or None, args.tls_client_ca or None)
    return ServerSecurity(tls, args.internal_token_file or None, bool(args.insecure))
