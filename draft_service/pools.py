"""One n-gram pool per (vocabulary fingerprint, pool namespace): in Redis when configured, else in memory.

The namespace is the tenant's (``Tenant.pool_namespace``): ``tenant:<name>``, or ``shared`` for the tenants
that opted into sharing. Pools of different namespaces never mix: a pool's continuations are other requests'
output, so a shared pool would let one tenant draft from (and probe for) another's text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from draft_service.capped_registry import CappedRegistry
from draft_service.lookahead_source import LOOKAHEAD_POOL_SHAPE
from draft_service.ngram_pool import ByteBudget, FallbackPool, InMemoryNgramPool, NgramPool, PoolShape
from draft_service.redis_pool import RedisNgramPool, purge_namespace
from specserve.tenancy import ANONYMOUS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PurgeCounts:
    """What purging one namespace removed."""

    memory_pools: int = 0
    memory_keys: int = 0
    redis_keys: int = 0


@dataclass(frozen=True)
class _Pools:
    """One (vocabulary, namespace)'s pool as sessions use it, and its in-memory part (the pool itself without Redis);
    and the same pair for the lookahead n-grams (``draft_service.lookahead_source``), whose shape is their own."""

    pool: NgramPool
    local: InMemoryNgramPool
    lookahead: NgramPool
    lookahead_local: InMemoryNgramPool


DEFAULT_MAX_POOLS = 1024
"""Most (vocabulary, namespace) pools a registry keeps (see ``PoolRegistry``)."""


class PoolRegistry:
    """Callable mapping (vocabulary fingerprint, namespace) to its pool.

    Pools of different vocabularies never mix either: token ids only mean something under one tokenizer.
    The keys are what callers send, so at most ``max_pools`` are kept: beyond it the least recently asked for is
    dropped, its in-memory keys freed (Redis keeps its own, bounded by TTL); sessions still open on it go on
    without a local pool.
    """

    def __init__(
        self,
        shape: PoolShape,
        redis_url: str | None,
        redis_timeout_s: float,
        max_keys: int,
        max_bytes: int | None = None,
        max_pools: int = DEFAULT_MAX_POOLS,
    ) -> None:
        if max_pools < 1:
            raise ValueError(f"the drafter must keep at least one n-gram pool, got {max_pools}")
        self._max_pools = max_pools
        self._shape = shape
        self._max_keys = max_keys
        # One allowance for all in-memory pools (one per vocabulary, or per tenant namespace).
        self._budget = ByteBudget(max_keys * shape.bytes_per_key if max_bytes is None else max_bytes)
        self._client = (
            redis.Redis.from_url(redis_url, socket_timeout=redis_timeout_s, socket_connect_timeout=redis_timeout_s)
            if redis_url
            else None
        )
        self._pools: CappedRegistry[tuple[str, str], _Pools] = CappedRegistry(max_pools, self._new_pools, self._evicted)

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def nbytes(self) -> int:
        """Bytes the in-memory pools hold (estimated; Redis holds the shared pool outside this process)."""
        return self._budget.used

    @property
    def backend(self) -> str:
        return "redis" if self._client is not None else "memory"

    def __call__(self, fingerprint: str, namespace: str = "") -> NgramPool:
        return self._pools.get((fingerprint, namespace or ANONYMOUS.pool_namespace)).pool

    def lookahead(self, fingerprint: str, namespace: str = "") -> NgramPool:
        """The namespace's pool of the verifier's lookahead n-grams: kept, bounded, shared and purged as the other."""
        return self._pools.get((fingerprint, namespace or ANONYMOUS.pool_namespace)).lookahead

    def _new_pools(self, key: tuple[str, str]) -> _Pools:
        local = InMemoryNgramPool(self._shape, self._max_keys, self._budget)
        lookahead = InMemoryNgramPool(LOOKAHEAD_POOL_SHAPE, self._max_keys, self._budget)
        if self._client is None:
            return _Pools(local, local, lookahead, lookahead)
        shared = RedisNgramPool(self._client, redis_namespace(*key), self._shape)
        # Its own key prefix under the namespace's, so that one SCAN of the namespace still finds (purges) it.
        guesses = RedisNgramPool(self._client, f"{redis_namespace(*key)}:lookahead", LOOKAHEAD_POOL_SHAPE)
        return _Pools(FallbackPool(shared, local), local, FallbackPool(guesses, lookahead), lookahead)

    def _evicted(self, key: tuple[str, str], pools: _Pools) -> None:
        pools.local.retire()
        pools.lookahead_local.retire()
        log.info("dropped the in-memory n-gram pool of %s (more than %d pools)", key, self._max_pools)

    def purge_memory(self, namespace: str) -> PurgeCounts:
        """Forget ``namespace``'s in-memory pools, emptied (sessions still open keep no old text).

        Not thread-safe: call it where sessions are served (the drafter's drafting lock).
        """
        keys = [key for key in self._pools if key[1] == namespace]
        memory_keys = 0
        for key in keys:
            pools = self._pools.pop(key)
            for local in (pools.local, pools.lookahead_local):
                memory_keys += len(local)
                local.retire()  # sessions still open on it record nothing more into the shared budget
        return PurgeCounts(memory_pools=len(keys), memory_keys=memory_keys)

    def purge_shared(self, namespace: str) -> int:
        """Delete ``namespace``'s Redis keys (SCAN + DEL in batches); how many. Sessions of the namespace still
        open may write a few windows back afterwards."""
        return purge_namespace(self._client, namespace) if self._client is not None else 0


def redis_namespace(fingerprint: str, namespace: str) -> str:
    """The Redis key prefix part of one pool: namespace first, so one SCAN pattern finds a tenant's keys."""
    return f"{namespace}:{fingerprint or 'any'}"
