"""What the drafter keeps per (vocabulary, pool namespace) besides the n-gram pool, within its memory bound.

A namespace's successor table (Token Recycling: about 20 MB when full) and its
acceptance statistics are the tenant's text too, and are shared by its
sessions. They count in the drafter's memory bound (``--max-memory-mib``) as
one entry of ``SessionMemory`` each: when the drafter is over it, the least
recently used entries, sessions' or namespaces', forget what they hold. A
forgotten namespace starts learning afresh; its sessions go on drafting.
"""

from __future__ import annotations

from draft_service.proposers import SuccessorTable
from draft_service.tree_builder import AcceptanceStats

NAMESPACE = "namespace"
"""The kind of a namespace's entry in ``SessionMemory``."""

NAMESPACE_BYTES = 2048
"""A namespace's state when empty: the object, its table and statistics objects, its key."""

STATS_COUNT_BYTES = 128
"""One (source, depth) count of acceptance statistics: its key tuple, a list of two floats, the dict slot."""


class NamespaceState:
    """One (vocabulary, pool namespace)'s successor table and acceptance statistics (greedy and sampled apart).

    A sampled session accepts a draft only when it holds the target's random draw, so its sources are calibrated
    apart from greedy sessions'.
    """

    kind = NAMESPACE

    def __init__(self, fingerprint: str, namespace: str, max_successor_tokens: int = 65_536) -> None:
        self.label = f"pool namespace {namespace} (vocabulary {fingerprint or 'any'})"
        self.successors = SuccessorTable(max_successor_tokens)
        self._stats: dict[bool, AcceptanceStats] = {}

    def stats(self, greedy: bool) -> AcceptanceStats:
        """The statistics the sessions of this namespace share, for greedy or for sampled decoding."""
        return self._stats.setdefault(greedy, AcceptanceStats())

    @property
    def nbytes(self) -> int:
        counts = sum(stats.num_counts for stats in self._stats.values())
        return NAMESPACE_BYTES + self.successors.nbytes + STATS_COUNT_BYTES * counts

    def forget(self) -> int:
        """Empty the table and the statistics (they are learnt again); the bytes freed."""
        before = self.nbytes
        self.successors.clear()
        for stats in self._stats.values():
            stats.clear()
        return before - self.nbytes

    def retire(self) -> None:
        """Forget everything and learn no more successors (the drafter dropped this namespace)."""
        self.forget()
        self.successors.retire()
