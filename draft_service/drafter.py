"""Per-session drafting: keep the committed tokens, learn from each round, propose merged trees."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from draft_service.draft_head import DraftHead
from draft_service.head_proposer import FeatureLog, HeadProposer, TreeShape
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

NGRAM_SOURCES = (PromptLookupProposer.name, PoolProposer.name, TokenRecyclingProposer.name)
ALL_SOURCES = (*NGRAM_SOURCES, HeadProposer.name)


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
        features: FeatureLog | None = None,
    ) -> None:
        self.session_id = session_id
        self.tokens = list(prompt_tokens)
        self._num_prompt_tokens = len(self.tokens)
        self._pool = pool
        self._proposers = proposers
        self._builder = builder
        self._successors = successors
        self._last: DraftTree = EMPTY
        self._features = features  # the target's features, when a source drafts from them

    @property
    def wants_features(self) -> bool:
        return self._features is not None

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
        if self._features is not None and feedback.features is not None:
            self._features.extend(feedback.features)


class Drafter:
    """Opens draft sessions; owns what sessions share (pools, successor tables, acceptance statistics)."""

    def __init__(
        self,
        pool_for: Callable[[str], NgramPool],
        prompt_lookup: PromptLookupProposer | None = None,
        sources: Sequence[str] = NGRAM_SOURCES,
        cost: VerifyCost | None = None,
        draft_head: DraftHead | None = None,
        tree_shape: TreeShape | None = None,
    ) -> None:
        unknown = set(sources) - set(ALL_SOURCES)
        if unknown:
            raise ValueError(f"unknown draft sources {sorted(unknown)}; choose from {', '.join(ALL_SOURCES)}")
        if HeadProposer.name in sources and draft_head is None:
            raise ValueError(f"the {HeadProposer.name} source needs a draft head (weights)")
        self._head = draft_head if HeadProposer.name in sources else None
        self._tree_shape = tree_shape or TreeShape()
        self._pool_for = pool_for
        self._prompt_lookup = prompt_lookup or PromptLookupProposer()
        self.sources = tuple(sources)
        self._cost = cost or VerifyCost()
        self._stats: dict[str, AcceptanceStats] = {}
        self._successors: dict[str, SuccessorTable] = {}

    @property
    def wants_features(self) -> bool:
        """The draft head drafts from the target's features: the coordinator must forward them."""
        return self._head is not None

    @property
    def vocab_fingerprint(self) -> str:
        """The vocabulary the draft head needs; empty when only n-gram sources draft (any vocabulary)."""
        return self._head.target_fingerprint if self._head is not None else ""

    def open_session(self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str) -> DraftSession:
        """A session for a target of ``vocab_fingerprint``; ValueError when the draft head cannot serve it."""
        if self._head is not None and self._head.target_fingerprint not in ("", vocab_fingerprint):
            raise ValueError(
                f"this drafter's draft head was trained for the vocabulary {self._head.target_fingerprint}, "
                f"the session's target has {vocab_fingerprint}: start the drafter with a head for that target"
            )
        pool = self._pool_for(vocab_fingerprint)
        successors = self._successors.setdefault(vocab_fingerprint, SuccessorTable())
        features = FeatureLog() if self._head is not None else None
        available: dict[str, Proposer] = {
            PromptLookupProposer.name: self._prompt_lookup,
            PoolProposer.name: PoolProposer(pool),
            TokenRecyclingProposer.name: TokenRecyclingProposer(successors),
        }
        if self._head is not None and features is not None:
            available[HeadProposer.name] = HeadProposer(self._head, features, self._tree_shape)
        shared = self._stats.setdefault(vocab_fingerprint, AcceptanceStats())
        builder = TreeBuilder(AcceptanceStats(parent=shared), self._cost)
        proposers = [available[name] for name in self.sources]
        return DraftSession(session_id, prompt_tokens, pool, proposers, builder, successors, features)
