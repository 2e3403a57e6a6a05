"""Released sessions' caches, kept so that a new session starting with the same tokens copies them.

An agent loop or a chat sends each turn as a new request whose prompt is the
conversation so far: the previous turn's prompt and answer, then a little
more. Without this the verifier computes the keys and values of the whole
conversation again at every turn, and the prefill, not the decoding, sets the
pace (on a CPU a few thousand tokens take seconds). So a released session's
region is kept with the tokens it caches, and a new session of the same
caller whose prompt starts with at least ``MIN_TOKENS`` of them copies their
keys and values (a memory copy) and prefills only the rest.

- Only the same caller's: a cache holds its prompt, and reusing it would
  show another tenant's text in the timing.
- What is kept is the first thing to go: memory a live session needs evicts
  kept caches before any session (oldest first); at most ``max_entries`` are
  kept, none longer than ``ttl_s``.
- A kept cache holds no features: a prefill that asks for them gets those of
  the rows it computes (the drafter's head starts there).
- The copied keys and values are the ones the old session's forwards computed,
  in forwards of other sizes than a fresh prefill's: the same numerics as the
  rows a session caches after verifying a tree (docs/numerics.md).

The engine thread owns it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

from target_service.kv_arena import KVArena, Region

MIN_TOKENS = 32
"""Shorter shared prefixes are prefilled: a copy saves little there, and a short one is usually a chat template."""


@dataclass
class KeptCache:
    owner: str
    tokens: np.ndarray  # int64: the tokens whose keys and values the region holds, in order
    region: Region
    kept_at: float


class KeptPrefixes:
    """Kept caches by age; ``take`` lends the best match for a new session, ``give_back`` returns it."""

    def __init__(
        self, arena: KVArena, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._arena = arena
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._clock = clock
        self._kept: OrderedDict[int, KeptCache] = OrderedDict()  # oldest first
        self._ids = count()
        self._slots = 0  # kept.region.capacity summed over the store (regions keep their size while kept)
        self.num_reused = 0  # sessions that started from a kept cache
        self.num_reused_tokens = 0  # the tokens they did not prefill

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def num_slots(self) -> int:
        """The arena's token slots the kept caches hold (free on demand); safe to read from any thread."""
        return self._slots

    def keep(self, owner: str, tokens: Sequence[int], region: Region) -> None:
        """Keep ``region``, which caches ``tokens``; freed at once where it is too short to be worth it."""
        if self._max_entries <= 0 or region.length < MIN_TOKENS:
            self._arena.free(region)
            return
        cached = np.asarray(tokens[: region.length], dtype=np.int64)
        self._kept[next(self._ids)] = KeptCache(owner, cached, region, self._clock())
        self._slots += region.capacity
        while len(self._kept) > self._max_entries:
            self.evict_oldest()

    def take(self, owner: str, tokens: Sequence[int]) -> tuple[KeptCache, int] | None:
        """The kept cache of ``owner`` that shares the longest prefix with ``tokens`` (at least ``MIN_TOKENS``),
        and that length; it is out of the store (so nothing evicts it) until ``give_back``.

        Never the last two tokens: the last is pending (a session never caches it), and the one before is left
        for the prefill to compute, so that every prefill runs in an engine step (its queue time, the step's
        metrics) as any other does.
        """
        if not self._kept or len(tokens) - 2 < MIN_TOKENS:
            return None
        wanted = np.asarray(tokens[:-2], dtype=np.int64)
        best: tuple[int, int] | None = None
        for key, kept in self._kept.items():
            if kept.owner != owner:
                continue
            n = min(len(kept.tokens), len(wanted))
            differs = np.flatnonzero(kept.tokens[:n] != wanted[:n])
            shared = int(differs[0]) if differs.size else n
            if shared >= MIN_TOKENS and (best is None or shared > best[1]):
                best = (key, shared)
        if best is None:
            return None
        kept = self._kept.pop(best[0])
        self._slots -= kept.region.capacity
        return kept, best[1]

    def give_back(self, kept: KeptCache) -> None:
        """Return a cache ``take`` lent, as the most recent (it has just been useful)."""
        kept.kept_at = self._clock()
        self._kept[next(self._ids)] = kept
        self._slots += kept.region.capacity

    def copy_into(self, kept: KeptCache, region: Region, length: int) -> None:
        """Start ``region`` (a new session's, empty) with the first ``length`` cached tokens of ``kept``."""
        self._arena.copy_prefix(kept.region, region, length)
        self.num_reused += 1
        self.num_reused_tokens += length

    def evict_oldest(self) -> bool:
        """Free the oldest kept cache; False when none is kept."""
        if not self._kept:
            return False
        _, kept = self._kept.popitem(last=False)
        self._slots -= kept.region.capacity
        self._arena.free(kept.region)
        return True

    def expire(self) -> None:
        """Free the caches kept longer than the TTL."""
        cutoff = self._clock() - self._ttl_s
        while self._kept and next(iter(self._kept.values())).kept_at < cutoff:
            self.evict_oldest()
