"""What the tiers hand each other: the verifier's results, the coordinator's feedback to a drafter, the drafter's reply.

Plain dataclasses over numpy: no torch here, so the coordinator loads none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from specserve.token_tree import ROOT, TokenTree


@dataclass(frozen=True)
class VerifyResult:
    """What one Verify commits: the accepted path and the bonus token."""

    accepted_tokens: list[int]
    accepted_nodes: list[int]  # tree indices of the accepted path, root first
    bonus_token: int
    verify_ns: int
    # The target's likeliest next tokens at each scored position (pending token, then nodes), best first, when
    # successors were asked for (Token Recycling); else empty.
    successors: list[list[int]] = field(default_factory=list)
    # With features asked for: the target's last hidden state (float16 [len(committed), hidden]) at each
    # committed position whose token it had as input: the pending token, then the accepted nodes.
    features: np.ndarray | None = None
    # Most draft nodes worth sending next round at the verifier's load (None: the verifier did not say).
    draft_budget_nodes: int | None = None
    batch_sessions: int = 1  # sessions that shared the forward
    queue_ns: int = 0  # time waiting for the engine
    # With lookahead asked for: the n-grams the step's Jacobi lookahead rows yielded (guesses, never committed).
    lookahead_ngrams: tuple[tuple[int, ...], ...] = ()

    @property
    def committed(self) -> list[int]:
        return [*self.accepted_tokens, self.bonus_token]


@dataclass(frozen=True)
class PrefillResult:
    prefill_ns: int
    # With features asked for: float16 [len(tokens) - 1 - cached_tokens, hidden], the last hidden state at each
    # position cached after the copied ones.
    features: np.ndarray | None = None
    cached_tokens: int = 0  # leading tokens copied from a kept cache (``target_service.kept_prefixes``), not computed


@dataclass(frozen=True)
class DraftFeedback:
    """What the coordinator tells a drafter about the last round before asking for the next tree."""

    new_tokens: tuple[int, ...] = ()  # committed since the last request
    # The target's top next tokens at each position it scored last round, keyed by
    # that position's token (Token Recycling's raw material).
    successors: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # The target's hidden features (float16 [m, hidden]) at the last m positions before the newest committed
    # token, for feature-level draft models; None when the coordinator does not forward them. Fewer rows than
    # positions that became known since the last request: the ones before them have no feature (sparse
    # features: rounds the drafter wanted none for).
    features: np.ndarray | None = None
    # Indices into the previous tree of the nodes the verifier accepted, root to leaf (empty: none, or no tree).
    accepted_node_indices: tuple[int, ...] = ()
    # Tokens a constraint forces right after the committed ones: the next tree starts with them as a chain and
    # the drafter drafts after them (structured output; empty otherwise).
    forced_prefix: tuple[int, ...] = ()
    # The session position of ``features``' first row, counted by the drafter's session (the wire carries the
    # rows alone, a suffix); None: right after the rows reported before.
    features_start: int | None = None
    # The n-grams the verifier's lookahead rows yielded last round (guesses for the lookahead pools).
    lookahead_ngrams: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class DraftReply:
    """A drafter's answer to one proposal request."""

    tree: TokenTree
    draft_ns: int = 0  # time the drafter spent on this request
    # The tree was drafted ahead, while the verifier checked the last round, for the outcome that happened.
    predrafted: bool = False
    predraft_ns: int = 0  # drafting time of a predrafted tree: time hidden behind verification
    # Of draft_ns, the time of sources run only to judge them (draft_service.source_gate): not a wait to budget for.
    probe_ns: int = 0
    # The drafter wants the target's features of the round this tree is verified in (its feature-level sources
    # keep their state); read only where it takes features sparsely (``DraftStream.sparse_features``).
    wants_features: bool = False


@dataclass(frozen=True)
class VerifiedTree:
    """The tree the verifier checks for a drafter's last proposal, when it is not the drafter's own.

    Under a structured-output constraint the coordinator prunes the drafter's tree to what the grammar allows and
    adds the tokens the grammar forces; the drafter pre-drafts for this tree's outcomes instead of its own.
    """

    tree: TokenTree  # token_ids and parents only
    forced: tuple[bool, ...] = ()  # per node: the only token the grammar allows there (empty: none forced)
    # Node (ROOT: the last committed token) -> every token the grammar allows right after it, where those are few:
    # the bonus token after an accepted path that ends there is one of them.
    allowed_next: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.forced and len(self.forced) != len(self.tree):
            raise ValueError(f"{len(self.forced)} forced flags for a tree of {len(self.tree)} nodes")
        for node, tokens in self.allowed_next.items():
            if not ROOT <= node < len(self.tree):
                raise ValueError(f"allowed tokens after node {node}, out of range [-1, {len(self.tree)})")
            if not tokens:
                raise ValueError(f"no allowed token after node {node}: a grammar always allows one")

    def is_forced(self, node: int) -> bool:
        return bool(self.forced) and self.forced[node]
