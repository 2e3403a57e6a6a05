"""The n-gram pool in Redis, shared by every drafter pod.

Keys are ``specserve:{namespace}:ng:{key_len}:{key}``, a sorted set of
continuations scored by count. A Lua script increments the counts, trims each
set to the most frequent continuations and refreshes the TTL, atomically.
Recorded windows wait for the next lookup and travel with it in one pipeline,
so a drafting round costs one Redis round trip. The drafter's namespace is
``{pool namespace}:{vocabulary fingerprint}`` (``draft_service.pools``), so
``purge_namespace`` finds one tenant's keys with one SCAN pattern.

Redis is an accelerator, never a dependency: every failure (down, slow,
restarted, foreign data) degrades to "no continuations" and the pool stops
asking for ``retry_after_s`` before trying again; redis-py reconnects itself.
Nor is it trusted: a member that is not a continuation of the pool's shape
with ids in the target's vocabulary (``vocab_size``) is skipped on lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from draft_service.ngram_pool import PoolShape, decode_tokens, encode_tokens, in_vocab

log = logging.getLogger(__name__)

# KEYS: the n-gram keys; ARGV: cap, ttl_s, then one continuation per key.
_RECORD_SCRIPT = """
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  redis.call('ZINCRBY', key, 1, ARGV[i + 2])
  redis.call('ZREMRANGEBYRANK', key, 0, -(cap + 1))
  redis.call('EXPIRE', key, ttl)
end
return #KEYS
"""


class RedisNgramPool:
    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        shape: PoolShape = PoolShape(),
        ttl_s: int = 7 * 24 * 3600,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int = 0,
    ) -> None:
        self.shape = shape
        self._vocab_size = vocab_size  # 0: unknown (only negative ids are skipped)
        self._client = client
        self._prefix = f"specserve:{namespace}:ng:{shape.key_len}:"
        self._ttl_s = ttl_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._down_until = 0.0
        self._record = client.register_script(_RECORD_SCRIPT)
        self._pending: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def limit_vocab(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    def record(self, tokens: Sequence[int], start: int = 0) -> None:
        """Queue the windows; they are written with the next lookup or flush."""
        self._pending.extend(self.shape.windows(tokens, start))

    def flush(self) -> None:
        if self._pending and self.available:
            pipe = self._client.pipeline(transaction=False)
            self._queue_record(pipe)
            self._guarded(pipe.execute)
        self._pending = []

    def lookup(self, key: Sequence[int]) -> list[tuple[int, ...]]:
        if not self.available:
            self._pending = []
            return []
        pipe = self._client.pipeline(transaction=False)
        has_writes = self._queue_record(pipe)
        # Read past the cap so a few foreign or corrupt members cannot hide the valid ones.
        pipe.zrevrange(self._prefix + encode_tokens(key), 0, 2 * self.shape.max_continuations - 1)
        self._pending = []
        results = self._guarded(pipe.execute)
        if not results:
            return []
        return self._decode(results[1 if has_writes else 0])[: self.shape.max_continuations]

    def _queue_record(self, pipe: Any) -> bool:
        if not self._pending:
            return False
        keys = [self._prefix + encode_tokens(key) for key, _ in self._pending]
        args: list[Any] = [self.shape.max_continuations, self._ttl_s]
        args += [encode_tokens(continuation) for _, continuation in self._pending]
        self._record(keys=keys, args=args, client=pipe)
        return True

    def _decode(self, members: Any) -> list[tuple[int, ...]]:
        """Continuations of the right length with ids in the vocabulary; anything else (foreign or corrupt data,
        ids another model's or nobody's) is skipped."""
        continuations: list[tuple[int, ...]] = []
        if not isinstance(members, list):
            return continuations
        for member in members:
            try:
                continuation = decode_tokens(member.decode())
            except (AttributeError, UnicodeDecodeError, ValueError):
                continue
            if len(continuation) == self.shape.continuation_len and in_vocab(continuation, self._vocab_size):
                continuations.append(continuation)
        return continuations

    def _guarded(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except redis.RedisError as exc:
            if self.available:
                log.warning(
                    "redis n-gram pool unavailable (%s); drafting from local sources for %.0fs",
                    exc,
                    self._retry_after_s,
                )
            self._down_until = self._clock() + self._retry_after_s
            return None


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def purge_namespace(client: redis.Redis, namespace: str, batch: int = 500) -> int:
    """Delete every key of pools whose namespace starts with ``namespace:``; the number deleted.

    SCAN (never KEYS, which blocks Redis for the whole keyspace) and DEL in batches of ``batch``.
    """
    deleted = 0
    pending: list[bytes] = []
    for key in client.scan_iter(match=f"specserve:{_glob_escape(namespace)}:*", count=batch):
        pending.append(key)
        if len(pending) >= batch:
            deleted += int(client.delete(*pending))
            pending = []
    if pending:
        deleted += int(client.delete(*pending))
    return deleted
