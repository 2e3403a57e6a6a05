"""The lookahead source: n-grams the verifier's Jacobi lookahead rows produced, drafted after their first token.

Where the verifier runs lookahead rows (``target_service.lookahead``), each
Verify returns n-grams of the target's own Jacobi trajectories, and the
coordinator forwards them with the next report (``DraftFeedback.
lookahead_ngrams``). This source keeps them twice, as Lookahead Decoding's
n-gram pool does, keyed by their first token:

- in the session's own table: the trajectories of this very text, the likeliest
  to come true, most recent first;
- in its pool namespace's lookahead pool (``PoolRegistry.lookahead``: in
  memory, and in Redis where configured), so that every session of the tenant
  on any drafter drafts from them. Pools never mix tenants, and Redis being
  down only loses what other drafters taught (``FallbackPool``).

It proposes the continuations after the context's last token: the session's
first, then the pool's, merged into one tree. Until the session has heard of
n-grams it proposes nothing and asks no pool: a verifier that runs no
lookahead rows (``auto`` on a CPU) costs this source nothing, not even a Redis
round trip.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from draft_service.ngram_pool import NgramPool, PoolShape
from specserve.results import DraftFeedback
from specserve.token_tree import TokenTree

LOOKAHEAD_POOL_SHAPE = PoolShape(key_len=1, continuation_len=3, max_continuations=8)
"""The lookahead pools' n-grams: one token of key and three after it (the verifier's default 4-grams; longer ones
are kept as their 4-token windows, shorter ones in the session's table only)."""

ENTRY_BYTES = 200
"""A continuation in the session's table: its tuple of ids, its slot in the ordered map (a bound)."""


class LookaheadProposer:
    """Drafts the verifier's lookahead n-grams after the context's last token."""

    name = "lookahead"
    wants_features = False
    costly = False

    def __init__(
        self,
        pool: NgramPool | None = None,
        max_candidates: int = 8,
        max_keys: int = 4096,
    ) -> None:
        self._pool = pool
        self._max_candidates = max_candidates
        self._max_keys = max_keys
        # first token -> continuations after it, most recently heard last
        self._own: OrderedDict[int, OrderedDict[tuple[int, ...], None]] = OrderedDict()
        self._entries = 0
        self._heard = False

    def observe(self, feedback: DraftFeedback) -> None:
        for ngram in feedback.lookahead_ngrams:
            if len(ngram) < 2:
                continue
            self._heard = True
            self._keep(ngram[0], tuple(ngram[1:]))
            if self._pool is not None:
                self._pool.record(ngram)

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        if max_nodes <= 0 or not tokens or not self._heard:
            return TokenTree()
        key = tokens[-1]
        own = self._own.get(key)
        paths = [list(c) for c in reversed(own)] if own else []
        if self._pool is not None:  # asked even when the session's own fill the tree: the lookup carries the writes
            paths += [list(c) for c in self._pool.lookup([key]) if list(c) not in paths]
        tree = TokenTree.from_paths(paths[: self._max_candidates])
        if len(tree) <= max_nodes:
            return tree
        return TokenTree(tree.token_ids[:max_nodes], tree.parents[:max_nodes])

    def digest(self, tokens: Sequence[int]) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return ENTRY_BYTES * self._entries

    def forget(self) -> None:
        self._own.clear()
        self._entries = 0

    def _keep(self, key: int, continuation: tuple[int, ...]) -> None:
        """Remember ``continuation`` after ``key`` as the newest; the oldest beyond the caps go."""
        continuations = self._own.pop(key, None)
        if continuations is None:
            continuations = OrderedDict()
        elif continuation in continuations:
            del continuations[continuation]
            self._entries -= 1
        continuations[continuation] = None
        self._entries += 1
        if len(continuations) > self._max_candidates:
            continuations.popitem(last=False)
            self._entries -= 1
        self._own[key] = continuations
        while len(self._own) > self._max_keys:
            self._entries -= len(self._own.popitem(last=False)[1])
