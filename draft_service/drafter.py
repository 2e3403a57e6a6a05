"""Per-session drafting: keep the committed tokens, learn from each round, propose merged trees."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from draft_service.proposers import (
    PoolProposer,
    PromptLookupProposer,
    Proposer,
    SuccessorTable,
    TokenRecyclingProposer,
)
from draft_service.tree_builder import EMPTY, AcceptanceStats, DraftTree, TreeBuilder, VerifyCost, learn_from_commit
from specserve.draft_feedback import DraftFeedback
from specserve.ngram_pool import NgramPool
from specserve.token_tree import TokenTree

ALL_SOURCES = (PromptLookupProposer.name, PoolProposer.name, TokenRecyclingProposer.name)


class DraftSession:
    """One generation session as the drafter sees it."""

    def __init__(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        pool: NgramPool,
        proposers: Sequence[Proposer],
        builder: TreeBuilder,
        successors: SuccessorTable,
    ) -> None:
        self.session_id = session_id
        self.tokens = list(prompt_tokens)
        self._num_prompt_tokens = len(self.tokens)
        self._pool = pool
        self._proposers = proposers
        self._builder = builder
        self._successors = successors
        self._last: DraftTree = EMPTY

    def propose(self, feedback: DraftFeedback, max_nodes: int) -> tuple[TokenTree, int]:
        """Learn from the last round, then propose a tree of at most ``max_nodes``; returns (tree, ns)."""
        start = time.perf_counter_ns()
        self._learn(feedback)
        if max_nodes <= 0:
            self._pool.flush()
            self._last = EMPTY
            return TokenTree(), time.perf_counter_ns() - start
        proposals = [(proposer.name, proposer.propose(self.tokens, max_nodes)) for proposer in self._proposers]
        self._last = self._builder.build(proposals, max_nodes)
        return self._last.tree, time.perf_counter_ns() - start

    def _learn(self, feedback: DraftFeedback) -> None:
        if feedback.new_tokens:
            learn_from_commit(self._builder.stats, self._last, feedback.new_tokens)
            previous = len(self.tokens)
            self.tokens.extend(feedback.new_tokens)
            # Only generated output teaches the shared pool; a window's key may reach into the prompt.
            self._pool.record(self.tokens, start=max(previous, self._num_prompt_tokens))
        for token, successors in feedback.successors:
            self._successors.update(token, successors)


class Drafter:
    """Opens draft sessions; owns what sessions share (pools, successor tables, acceptance statistics)."""

    def __init__(
        self,
        pool_for: Callable[[str], NgramPool],
        prompt_lookup: PromptLookupProposer | None = None,
        sources: Sequence[str] = ALL_SOURCES,
        cost: VerifyCost | None = None,
    ) -> None:
        unknown = set(sources) - set(ALL_SOURCES)
        if unknown:
            raise ValueError(f"unknown draft sources {sorted(unknown)}; choose from {', '.join(ALL_SOURCES)}")
        self._pool_for = pool_for
        self._prompt_lookup = prompt_lookup or PromptLookupProposer()
        self.sources = tuple(sources)
        self._cost = cost or VerifyCost()
        self._stats: dict[str, AcceptanceStats] = {}
        self._successors: dict[str, SuccessorTable] = {}

    def open_session(self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str) -> DraftSession:
        pool = self._pool_for(vocab_fingerprint)
        successors = self._successors.setdefault(vocab_fingerprint, SuccessorTable())
        available: dict[str, Proposer] = {
            PromptLookupProposer.name: self._prompt_lookup,
            PoolProposer.name: PoolProposer(pool),
            TokenRecyclingProposer.name: TokenRecyclingProposer(successors),
        }
        shared = self._stats.setdefault(vocab_fingerprint, AcceptanceStats())
        builder = TreeBuilder(AcceptanceStats(parent=shared), self._cost)
        proposers = [available[name] for name in self.sources]
        return DraftSession(session_id, prompt_tokens, pool, proposers, builder, successors)
