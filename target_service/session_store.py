"""A bounded map of sessions: least-recently-used eviction plus an idle TTL."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Generic, TypeVar

T = TypeVar("T")


class SessionStore(Generic[T]):
    """Holds at most ``max_sessions`` values; idle ones expire after ``ttl_s``.

    ``on_evict(key, value)`` is called for every value dropped by the limit,
    the TTL or ``evict`` (not for ``pop``), so the owner can free what it
    holds. Not thread-safe: the verifier's engine thread owns it.
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, T], None] | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._max_sessions = max_sessions
        self._ttl_s = ttl_s
        self._clock = clock
        self._on_evict = on_evict
        self._entries: OrderedDict[str, tuple[float, T]] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, value: T, protected: Collection[str] = ()) -> None:
        """Store ``value``, evicting the least recently used beyond the limit, never a ``protected`` key.

        When every other entry is protected the store holds one more than its limit until the next put.
        """
        self.expire()
        old = self._entries.pop(key, None)
        if old is not None and old[1] is not value:
            self._dropped(key, old[1])
        while len(self._entries) >= self._max_sessions:
            victim = next((k for k in self._entries if k not in protected), None)
            if victim is None:
                break
            self._dropped(victim, self._entries.pop(victim)[1])
        self._entries[key] = (self._clock(), value)

    def get(self, key: str) -> T | None:
        """The value, marked as just used; None if absent or expired."""
        self.expire()
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._entries[key] = (self._clock(), entry[1])
        return entry[1]

    def peek(self, key: str) -> T | None:
        """The value without marking it used."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def pop(self, key: str) -> T | None:
        """Remove and return the value; the caller frees what it holds."""
        entry = self._entries.pop(key, None)
        return None if entry is None else entry[1]

    def evict(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._dropped(key, entry[1])

    def least_recent(self, idle_s: float, eligible: Callable[[str, T], bool]) -> str | None:
        """The least recently used key idle for at least ``idle_s`` that ``eligible`` accepts, or None."""
        deadline = self._clock() - idle_s
        for key, (last_used, value) in self._entries.items():
            if last_used > deadline:
                return None
            if eligible(key, value):
                return key
        return None

    def expire(self) -> None:
        deadline = self._clock() - self._ttl_s
        while self._entries:
            key, (last_used, value) = next(iter(self._entries.items()))
            if last_used > deadline:
                break
            del self._entries[key]
            self._dropped(key, value)

    def _dropped(self, key: str, value: T) -> None:
        self.num_evicted += 1
        if self._on_evict is not None:
            self._on_evict(key, value)
