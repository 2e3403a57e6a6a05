"""The coordinator's credentials towards its workers, and who a worker's caller is.

On every internal call the coordinator sends ``authorization: Bearer <internal token>`` (when configured) and
``x-specserve-tenant: <tenant>`` (the tenant of the request it serves, from ``current_tenant()``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.tenancy import TENANT_METADATA_KEY, current_tenant

Metadata = tuple[tuple[str, str], ...]


def read_token(path: str, flag: str = "--internal-token-file") -> str:
    """The token in ``path`` (surrounding whitespace dropped); ValueError (naming ``flag``) when empty or
    unreadable."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc}") from exc
    if not token:
        raise ValueError(f"{flag} {path} is empty: put a random token in it (`openssl rand -hex 32`)")
    return token


@dataclass(frozen=True)
class InternalCredentials:
    """What the coordinator presents to the verifier and drafters."""

    token: str | None = None

    def metadata(self) -> Metadata:
        """Metadata for one internal call made now: the token, and the tenant the work is for."""
        tenant = (TENANT_METADATA_KEY, current_tenant().name)
        if self.token is None:
            return (tenant,)
        return (("authorization", f"Bearer {self.token}"), tenant)


ANONYMOUS_METADATA = InternalCredentials().metadata
"""No internal token: only the tenant (for workers on loopback without authentication, and tests)."""


def session_owner(metadata: Sequence[tuple[str, Any]] | None, peer_identities: Iterable[bytes] | None) -> str:
    """Who owns a verifier session a call creates or touches: the caller (its client certificate's identity
    under mTLS, else any holder of the internal token) and the tenant it acts for."""
    tenant = ""
    for key, value in metadata or ():
        if key == TENANT_METADATA_KEY:
            tenant = value.decode() if isinstance(value, bytes) else str(value)
    caller = b",".join(sorted(peer_identities or ())).decode(errors="replace")
    return f"{caller}/{tenant}"
