"""Who a request is for: the tenant an API key maps to, carried through the request's context.

The coordinator's auth interceptor resolves the caller's key to a ``Tenant`` and runs the handler inside
``tenant_scope``; admission control, the n-gram pool namespace and the internal calls read ``current_tenant()``.
With auth off (``make run`` on loopback) every request belongs to ``ANONYMOUS``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

TENANT_METADATA_KEY = "x-specserve-tenant"
"""Metadata the coordinator sets on its calls to the verifier and drafters: the tenant the work is for."""


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrent_streams: int = 0  # streams running at once; 0: the coordinator's per-tenant default
    share_ngram_pool: bool = False  # draft from (and teach) the pool shared by every sharing tenant

    @property
    def pool_namespace(self) -> str:
        """The n-gram pool this tenant's traffic reads and writes: its own unless it opted into sharing."""
        return "shared" if self.share_ngram_pool else f"tenant:{self.name}"


ANONYMOUS = Tenant("default")

_current: ContextVar[Tenant] = ContextVar("specserve_tenant", default=ANONYMOUS)


def current_tenant() -> Tenant:
    return _current.get()


@contextmanager
def tenant_scope(tenant: Tenant) -> Iterator[Tenant]:
    """Run the block as ``tenant``'s. Inside a streaming handler the scope may end in another context: a
    stream the client abandoned is closed by asyncio's finalizer task, where there is nothing to restore."""
    token = _current.set(tenant)
    try:
        yield tenant
    finally:
        with contextlib.suppress(ValueError):  # "created in a different Context": see the docstring
            _current.reset(token)
