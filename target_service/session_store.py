"""A bounded map of sessions: least-recently-used eviction plus an idle TTL."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SessionStore(Generic[T]):
    """Holds at most ``max_sessions`` values; idle ones expire after ``ttl_s``.

    Not thread-safe: the verifier calls it under its own lock.
    """

    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._max_sessions = max_sessions
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, T]] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, value: T) -> None:
        self.expire()
        self._entries.pop(key, None)
        while len(self._entries) >= self._max_sessions:
            self._entries.popitem(last=False)
            self.num_evicted += 1
        self._entries[key] = (self._clock(), value)

    def get(self, key: str) -> T | None:
        """The value, marked as just used; None if absent or expired."""
        self.expire()
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._entries[key] = (self._clock(), entry[1])
        return entry[1]

    def pop(self, key: str) -> T | None:
        entry = self._entries.pop(key, None)
        return None if entry is None else entry[1]

    def expire(self) -> None:
        deadline = self._clock() - self._ttl_s
        while self._entries:
            key, (last_used, _) = next(iter(self._entries.items()))
            if last_used > deadline:
                break
            del self._entries[key]
            self.num_evicted += 1
