"""n-gram pools: continuations seen after each short token key, with counts.

A pool maps a key (the ``key_len`` tokens before a position) to the
continuations (the next ``continuation_len`` tokens) observed after it, each
with a count, keeping the most frequent few per key. Every drafter records
the committed output of its sessions and looks up continuations to draft.

``InMemoryNgramPool`` is the embedded default; ``RedisNgramPool`` (in
``draft_service.redis_pool``) shares one pool between all drafter pods with the
same semantics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PoolShape:
    key_len: int = 3
    continuation_len: int = 8
    max_continuations: int = 4  # kept per key, most frequent first

    @property
    def bytes_per_key(self) -> int:
        """A bound on what one key of an in-memory pool costs: its tuple, its dict, full continuations.

        CPython sizes: a tuple of n token ids is 40 + 8n bytes plus 32 per id object, a small dict 232, the
        ordered map's entry about 100. 2,052 bytes at the defaults (tracemalloc measures 1,873 for full keys).
        """

        def ids(n: int) -> int:
            return 40 + 8 * n + 32 * n

        return 100 + 232 + ids(self.key_len) + self.max_continuations * (ids(self.continuation_len) + 32)

    def windows(self, tokens: Sequence[int], start: int = 0) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(key, continuation) pairs of ``tokens`` whose continuation ends at or after ``start``.

        Only full windows count, so recording a growing sequence with the
        previous length as ``start`` records each window exactly once.
        """
        span = self.key_len + self.continuation_len
        first = max(0, start - span + 1)
        for i in range(first, len(tokens) - span + 1):
            yield tuple(tokens[i : i + self.key_len]), tuple(tokens[i + self.key_len : i + span])


def encode_tokens(tokens: Sequence[int]) -> str:
    """The storage form of a key or continuation: comma-separated ids.

    Both pools order equal counts by this string (as a Redis sorted set does),
    so they rank and evict continuations identically.
    """
    return ",".join(map(str, tokens))


def in_vocab(tokens: Sequence[int], vocab_size: int) -> bool:
    """Every id is in [0, ``vocab_size``) (``vocab_size`` 0: unknown, any id a wire int32 can carry)."""
    limit = vocab_size if vocab_size > 0 else 2**31
    return all(0 <= t < limit for t in tokens)


def decode_tokens(text: str) -> tuple[int, ...]:
    """Inverse of encode_tokens; raises ValueError on anything else."""
    return tuple(int(part) for part in text.split(","))


class NgramPool(Protocol):
    shape: PoolShape

    def record(self, tokens: Sequence[int], start: int = 0) -> None:
        """Count the windows of ``tokens`` that end at or after index ``start``."""
        ...

    def lookup(self, key: Sequence[int]) -> list[tuple[int, ...]]:
        """Continuations after ``key``, most frequent first (empty if unknown)."""
        ...

    def flush(self) -> None:
        """Write out recorded windows that a pool may hold back to batch them with its next lookup."""
        ...

    def limit_vocab(self, vocab_size: int) -> None:
        """From now on lookups skip continuations with ids outside [0, ``vocab_size``) (0: no limit)."""
        ...


class ByteBudget:
    """Bytes that several holders share (the in-memory pools of one drafter): each evicts its own when over."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0

    @property
    def over(self) -> bool:
        return self.used > self.max_bytes


class InMemoryNgramPool:
    """A pool in this process; least recently used keys are evicted beyond ``max_keys`` or the byte ``budget``.

    Bytes are counted as ``shape.bytes_per_key`` per key (a bound); pools sharing a budget each evict their
    own keys when the total is over it.
    """

    def __init__(
        self, shape: PoolShape = PoolShape(), max_keys: int = 200_000, budget: ByteBudget | None = None
    ) -> None:
        self.shape = shape
        self._max_keys = max_keys
        self._budget = budget or ByteBudget(max_keys * shape.bytes_per_key)
        self._counts: OrderedDict[tuple[int, ...], dict[tuple[int, ...], int]] = OrderedDict()
        self._vocab_size = 0
        self._retired = False

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def nbytes(self) -> int:
        """Bytes this pool's keys hold (estimated: ``shape.bytes_per_key`` each)."""
        return len(self._counts) * self.shape.bytes_per_key

    def record(self, tokens: Sequence[int], start: int = 0) -> None:
        if self._retired:
            return
        for key, continuation in self.shape.windows(tokens, start):
            counts = self._counts.pop(key, None)
            if counts is None:
                counts = {}
                self._budget.used += self.shape.bytes_per_key
            counts[continuation] = counts.get(continuation, 0) + 1
            if len(counts) > self.shape.max_continuations:
                del counts[min(counts, key=lambda c: (counts[c], encode_tokens(c)))]
            self._counts[key] = counts
            while self._counts and (len(self._counts) > self._max_keys or self._budget.over):
                self._counts.popitem(last=False)
                self._budget.used -= self.shape.bytes_per_key

    def flush(self) -> None:
        return None

    def clear(self) -> None:
        """Forget everything (a purge of the pool's namespace), giving its bytes back to the shared budget."""
        self._budget.used -= len(self._counts) * self.shape.bytes_per_key
        self._counts.clear()

    def retire(self) -> None:
        """Clear and record nothing more: its owner dropped it, and sessions that still hold it must not fill the
        shared budget with keys nobody accounts for once they end."""
        self.clear()
        self._retired = True

    def limit_vocab(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    def lookup(self, key: Sequence[int]) -> list[tuple[int, ...]]:
        counts = self._counts.get(tuple(key))
        if not counts:
            return []
        ranked = sorted(counts, key=lambda c: (counts[c], encode_tokens(c)), reverse=True)
        return [c for c in ranked if in_vocab(c, self._vocab_size)]


class FallbackPool:
    """A shared pool backed by a local one: every window is recorded in both.

    Lookups prefer the shared pool and fall back to the local one when the
    shared pool is down or knows nothing, so losing Redis only loses what
    other drafters taught.
    """

    def __init__(self, shared: NgramPool, local: NgramPool) -> None:
        self.shape = shared.shape
        self._shared = shared
        self._local = local

    def record(self, tokens: Sequence[int], start: int = 0) -> None:
        self._shared.record(tokens, start)
        self._local.record(tokens, start)

    def lookup(self, key: Sequence[int]) -> list[tuple[int, ...]]:
        return self._shared.lookup(key) or self._local.lookup(key)

    def flush(self) -> None:
        self._shared.flush()

    def limit_vocab(self, vocab_size: int) -> None:
        self._shared.limit_vocab(vocab_size)
        self._local.limit_vocab(vocab_size)
