"""What the coordinator tells a drafter about the last round before asking for the next tree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.token_tree import TokenTree


@dataclass(frozen=True)
class DraftFeedback:
    new_tokens: tuple[int, ...] = ()  # committed since the last request
    # The target's top next tokens at each position it scored last round, keyed by
    # that position's token (Token Recycling's raw material).
    successors: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # The target's hidden features (float16 [m, hidden]) at the positions that became known since the last
    # request, for feature-level draft models; None when the coordinator does not forward them.
    features: np.ndarray | None = None
    # Indices into the previous tree of the nodes the verifier accepted, root to leaf (empty: none, or no tree).
    accepted_node_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class DraftReply:
    """A drafter's answer to one proposal request."""

    tree: TokenTree
    draft_ns: int = 0  # time the drafter spent on this request
    # The tree was drafted ahead, while the verifier checked the last round, for the outcome that happened.
    predrafted: bool = False
    predraft_ns: int = 0  # drafting time of a predrafted tree: time hidden behind verification
