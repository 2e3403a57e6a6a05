"""Checks on a drafter's tree before it reaches the verifier.

A drafter is trusted to be fast, never to be right: a tree with an id outside
the vocabulary, more nodes than asked for, a bad parent or a branch the
verifier cannot score would make the verifier refuse the whole Verify and
fail the request. The round loop checks every tree against the verifier's
limits first and treats a bad one as a drafter failure (the round goes on
with an empty tree).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.ports import VerifierInfo
from specserve.token_tree import InvalidTreeError, TokenTree


@dataclass(frozen=True)
class TreeLimits:
    """What the verifier accepts in one tree (from its VerifierInfo)."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_nodes: int
    max_depth: int
    supports_branching: bool = True

    @staticmethod
    def of(info: VerifierInfo) -> TreeLimits:
        return TreeLimits(info.vocab_size, info.max_tree_nodes, info.max_tree_depth, info.supports_branching)


def tree_problem(tree: TokenTree, limits: TreeLimits, max_nodes: int) -> str | None:
    """What is wrong with ``tree`` for a round that asked for at most ``max_nodes`` nodes; None when nothing is.

    Checks ids against the vocabulary, the node count against the round's
    request and the verifier's limit, the depth, parents (-1 or an earlier
    node), branching (only when the verifier supports it), sampled flags, draft
    distributions and node probabilities.
    """
    try:
        tree.validate(limits.vocab_size, min(max_nodes, limits.max_nodes), limits.max_depth or None)
    except InvalidTreeError as exc:
        return str(exc)
    if not limits.supports_branching and not tree.is_chain():
        return "tree branches; this verifier accepts chains only"
    return None
