"""Draft sources. Every source implements the one Proposer protocol.

Each source sees the session's committed tokens (prompt and generated) and
returns a tree of at most ``max_nodes`` nodes (an empty tree: nothing to
offer). The tree builder merges the sources' trees. After every round a
source observes the verifier's report (``DraftFeedback``): what it learns
from it (successor tables, the target's features) is its own state.

``propose`` may be asked about a context that extends the committed tokens
by a hypothetical outcome of the round being verified (pre-drafting): a
source must not assume that every token it is shown was committed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from draft_service.ngram_pool import NgramPool
from specserve.results import DraftFeedback
from specserve.token_tree import TokenTree


class Proposer(Protocol):
    name: str
    # The source drafts from the target's hidden features: the coordinator must forward them.
    wants_features: bool
    # The source runs a model of its own each round (the draft head, a draft model): the source gate weighs
    # whether it earns the time a round waits for it (those that want features are weighed alike).
    costly: bool

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree: ...

    def observe(self, feedback: DraftFeedback) -> None:
        """Learn from the verifier's report on the last round (called before the next ``propose``)."""
        ...

    def digest(self, tokens: Sequence[int]) -> bool:
        """Do one bounded step of learning put off from ``observe`` (a long prompt's features); False if none.

        The drafter calls it between rounds, while the verifier works, so a
        big report never holds up a proposal.
        """
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of this session's own state in this source (0 for state that sessions share)."""
        ...

    def forget(self) -> None:
        """Free this session's own state to bound the drafter's memory; the source may draft less after it."""
        ...


class _Stateless:
    """For sources that learn nothing from the verifier's reports."""

    wants_features = False
    costly = False

    def observe(self, feedback: DraftFeedback) -> None:
        return None

    def digest(self, tokens: Sequence[int]) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return 0

    def forget(self) -> None:
        return None


def suffix_matches(tokens: np.ndarray, min_ngram: int, max_ngram: int) -> tuple[np.ndarray, int]:
    """(continuation starts, n) of every earlier occurrence of the longest matching suffix n-gram.

    Tries n from ``max_ngram`` down to ``min_ngram``; starts are most recent
    first. Returns an empty array when nothing matches.
    """
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start before the suffix itself and end before the last token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            return hits[::-1] + n, n
    return np.empty(0, dtype=np.int64), 0


def _budgeted(paths: list[list[int]], max_nodes: int) -> TokenTree:
    """The trie of ``paths`` cut to ``max_nodes`` nodes, earlier paths first."""
    tree = TokenTree.from_paths(paths)
    if len(tree) <= max_nodes:
        return tree
    return TokenTree(tree.token_ids[:max_nodes], tree.parents[:max_nodes])


class PromptLookupProposer(_Stateless):
    """Prompt lookup decoding: continuations of earlier matches of the context's suffix.

    Up to ``max_candidates`` distinct continuations, most recent match first,
    merged into one tree.
    """

    name = "prompt_lookup"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, max_candidates: int = 3, max_depth: int = 8) -> None:
        self._min_ngram = min_ngram
        self._max_ngram = max_ngram
        self._max_candidates = max_candidates
        self._max_depth = max_depth

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        if max_nodes <= 0 or len(tokens) < self._min_ngram + 1:
            return TokenTree()
        array = np.asarray(tokens, dtype=np.int64)
        starts, _ = suffix_matches(array, self._min_ngram, self._max_ngram)
        paths: list[list[int]] = []
        for start in starts.tolist():
            path = array[start : start + self._max_depth].tolist()
            if path and path not in paths:
                paths.append(path)
            if len(paths) == self._max_candidates:
                break
        return _budgeted(paths, max_nodes)


class PoolProposer(_Stateless):
    """Continuations of the context's last tokens in an n-gram pool, most frequent first.

    The pool learns from every session's commits (the draft session records
    them, whether or not it reads the pool), not from this source.
    """

    name = "ngram_pool"

    def __init__(self, pool: NgramPool) -> None:
        self._pool = pool

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        key_len = self._pool.shape.key_len
        if max_nodes <= 0 or len(tokens) < key_len:
            return TokenTree()
        continuations = self._pool.lookup(tokens[len(tokens) - key_len :])
        return _budgeted([list(c) for c in continuations], max_nodes)


SUCCESSOR_ENTRY_BYTES = 160
"""A successor table's entry, its successors aside: the ordered dict's slot and link, the token, an empty tuple."""

SUCCESSOR_BYTES = 40
"""One successor in an entry's tuple: its 8-byte slot and an int object (32 bytes for ids past 256)."""


class SuccessorTable:
    """Token Recycling's adjacency: for a token, the target's latest top-k next tokens after it.

    Filled from what the verifier returns for every position it scored
    (accepted or not), so candidates the target considered are recycled as
    drafts. Bounded: least recently updated tokens are forgotten first, and
    its bytes (``nbytes``, estimated) count in the drafter's memory bound.
    """

    def __init__(self, max_tokens: int = 65_536) -> None:
        self._max_tokens = max_tokens
        self._next: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._next)

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold (estimated: ``SUCCESSOR_ENTRY_BYTES`` + ``SUCCESSOR_BYTES`` per successor)."""
        return self._nbytes

    def update(self, token: int, successors: Sequence[int]) -> None:
        if self._max_tokens <= 0:
            return
        old = self._next.pop(token, None)
        if old is not None:
            self._nbytes -= _entry_bytes(old)
        entry = tuple(successors)
        self._next[token] = entry
        self._nbytes += _entry_bytes(entry)
        if len(self._next) > self._max_tokens:
            self._nbytes -= _entry_bytes(self._next.popitem(last=False)[1])

    def clear(self) -> None:
        self._next.clear()
        self._nbytes = 0

    def retire(self) -> None:
        """Empty the table and take no more entries (sessions that still hold it draft without it)."""
        self.clear()
        self._max_tokens = 0

    def get(self, token: int) -> tuple[int, ...]:
        return self._next.get(token, ())


def _entry_bytes(successors: tuple[int, ...]) -> int:
    return SUCCESSOR_ENTRY_BYTES + SUCCESSOR_BYTES * len(successors)


class TokenRecyclingProposer:
    """Expand a tree from the last token through the successor table, breadth first.

    ``widths[d]`` children per node at depth d + 1 (a static shape as in Token
    Recycling, kept small for CPU verification; the tree builder prunes it).
    """

    name = "token_recycling"
    wants_features = False
    costly = False

    def __init__(self, table: SuccessorTable, widths: Sequence[int] = (3, 2, 1, 1, 1, 1)) -> None:
        self._table = table
        self._widths = tuple(widths)

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        if max_nodes <= 0 or not tokens:
            return TokenTree()
        token_ids: list[int] = []
        parents: list[int] = []
        frontier = [(-1, tokens[-1])]
        for width in self._widths:
            next_frontier = []
            for parent, token in frontier:
                for successor in self._table.get(token)[:width]:
                    if len(token_ids) == max_nodes:
                        return TokenTree(tuple(token_ids), tuple(parents))
                    next_frontier.append((len(token_ids), successor))
                    token_ids.append(successor)
                    parents.append(parent)
            frontier = next_frontier
        return TokenTree(tuple(token_ids), tuple(parents))

    def observe(self, feedback: DraftFeedback) -> None:
        for token, successors in feedback.successors:
            self._table.update(token, successors)

    def digest(self, tokens: Sequence[int]) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return 0  # the successor table is the namespace's, counted once (draft_service.namespace_state)

    def forget(self) -> None:
        return None
