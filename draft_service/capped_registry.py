"""A map of state kept per key the callers choose, capped: beyond ``capacity`` the least recently used goes.

The drafter keeps state per (vocabulary fingerprint, pool namespace), and both come from callers, so neither its
namespace state (``Drafter``) nor its n-gram pools (``PoolRegistry``) may grow with every key anyone sends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class CappedRegistry(Generic[K, V]):
    """Values by key, made on first use by ``make``, at most ``capacity`` of them.

    ``get`` makes the key the most recent; one past ``capacity`` evicts the least recent, handed to ``on_evict``
    (to free what it holds). Not thread-safe: the drafter serves sessions under one lock.
    """

    def __init__(self, capacity: int, make: Callable[[K], V], on_evict: Callable[[K, V], None]) -> None:
        if capacity < 1:
            raise ValueError(f"a capped registry keeps at least one entry, got {capacity}")
        self.capacity = capacity
        self._make = make
        self._on_evict = on_evict
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first

    def get(self, key: K) -> V:
        """The value of ``key`` (made now if absent), made the most recent; may evict the least recent."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            return value
        value = self._make(key)
        self._entries[key] = value
        while len(self._entries) > self.capacity:
            oldest, evicted = self._entries.popitem(last=False)
            self._on_evict(oldest, evicted)
        return value

    def pop(self, key: K) -> V:
        """Remove ``key`` and return its value (``on_evict`` is not called: the caller frees it)."""
        return self._entries.pop(key)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first, from a copy: ``pop`` while walking them is safe."""
        return iter(list(self._entries))
