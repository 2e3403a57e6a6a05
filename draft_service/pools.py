"""One n-gram pool per vocabulary fingerprint: in Redis when configured, else in memory."""

from __future__ import annotations

import redis

from specserve.ngram_pool import ByteBudget, FallbackPool, InMemoryNgramPool, NgramPool, PoolShape
from specserve.redis_pool import RedisNgramPool


class PoolRegistry:
    """Callable mapping a vocabulary fingerprint to its pool.

    Pools of different vocabularies never mix: token ids only mean something
    under one tokenizer.
    """

    def __init__(
        self,
        shape: PoolShape,
        redis_url: str | None,
        redis_timeout_s: float,
        max_keys: int,
        max_bytes: int | None = None,
    ) -> None:
        self._shape = shape
        self._max_keys = max_keys
        # One allowance for all in-memory pools (one per vocabulary, or per tenant namespace).
        self._budget = ByteBudget(max_keys * shape.bytes_per_key if max_bytes is None else max_bytes)
        self._client = (
            redis.Redis.from_url(redis_url, socket_timeout=redis_timeout_s, socket_connect_timeout=redis_timeout_s)
            if redis_url
            else None
        )
        self._pools: dict[str, NgramPool] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the in-memory pools hold (estimated; Redis holds the shared pool outside this process)."""
        return self._budget.used

    @property
    def backend(self) -> str:
        return "redis" if self._client is not None else "memory"

    def __call__(self, fingerprint: str) -> NgramPool:
        pool = self._pools.get(fingerprint)
        if pool is None:
            pool = InMemoryNgramPool(self._shape, self._max_keys, self._budget)
            if self._client is not None:
                pool = FallbackPool(RedisNgramPool(self._client, fingerprint or "any", self._shape), pool)
            self._pools[fingerprint] = pool
        return pool
