"""A drafted tree with the sources credited for each node and its acceptance estimates, and the surgery that
pre-drafting and structured output do on it.

Every operation keeps each node's sources and score with the node and returns a well-formed tree (parents
before children), so the session learns from a cut, re-rooted or grafted draft as from a fresh one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.results import VerifiedTree
from specserve.token_tree import ROOT, TokenTree


@dataclass(frozen=True)
class DraftTree:
    """A tree to verify, with the sources credited for each node."""

    tree: TokenTree
    sources: tuple[frozenset[str], ...]
    scores: tuple[float, ...]

    @property
    def expected_tokens(self) -> float:
        return 1.0 + sum(self.scores)

    def cut(self, max_nodes: int) -> DraftTree:
        """The first ``max_nodes`` nodes (parents precede children, so any prefix is a tree)."""
        if len(self.tree) <= max_nodes:
            return self
        tree = TokenTree(self.tree.token_ids[:max_nodes], self.tree.parents[:max_nodes])
        return DraftTree(tree, self.sources[:max_nodes], self.scores[:max_nodes])

    def subtree(self, path: Sequence[int]) -> DraftTree | None:
        """The subtree under the node ``path`` (tokens from the root) reaches, rooted there, its scores made
        relative to that node's; None when this tree does not spell ``path``."""
        node = self.tree.find(path)
        if node is None:
            return None
        anchor = 1.0 if node == ROOT else self.scores[node]
        new_index = {node: ROOT}
        kept: list[int] = []
        for child in range(node + 1, len(self.tree)):  # parents precede children: one pass finds the descendants
            if self.tree.parents[child] in new_index:
                new_index[child] = len(kept)
                kept.append(child)
        tree = TokenTree(
            tuple(self.tree.token_ids[c] for c in kept), tuple(new_index[self.tree.parents[c]] for c in kept)
        )
        scores = tuple(self.scores[c] / anchor if anchor > 0 else 0.0 for c in kept)
        return DraftTree(tree, tuple(self.sources[c] for c in kept), scores)

    def grafted_under(self, prefix: Sequence[int]) -> DraftTree:
        """``prefix`` as a chain from the root (certain nodes, credited to no source) with this tree under its
        end."""
        if not prefix:
            return self
        k = len(prefix)
        parents = (*range(-1, k - 1), *(k - 1 if p == ROOT else p + k for p in self.tree.parents))
        tree = TokenTree((*prefix, *self.tree.token_ids), parents)
        return DraftTree(tree, (*(frozenset[str]() for _ in prefix), *self.sources), (*(1.0,) * k, *self.scores))

    def estimates_for(self, verified: VerifiedTree) -> DraftTree:
        """``verified`` (the tree verified in this one's place) with an acceptance estimate per node, to rank its
        outcomes by.

        A forced node is certain once its parent is accepted: its parent's score. A node of ours keeps our
        estimate of it given its parent (its score over its parent's). Nodes are matched to ours by their path's
        tokens.
        """
        pairs = zip(self.tree.parents, self.tree.token_ids, strict=True)
        index = {pair: node for node, pair in enumerate(pairs)}  # (our parent, token) -> our node
        ours: list[int | None] = []  # per verified node: our node, or None
        scores: list[float] = []
        for node, (token, parent) in enumerate(zip(verified.tree.token_ids, verified.tree.parents, strict=True)):
            anchor = ROOT if parent == ROOT else ours[parent]
            mine = index.get((anchor, token)) if anchor is not None else None
            ours.append(mine)
            above = 1.0 if parent == ROOT else scores[parent]
            if verified.is_forced(node):
                scores.append(above)
            elif mine is not None and anchor is not None:
                own_above = 1.0 if anchor == ROOT else self.scores[anchor]
                scores.append(above * self.scores[mine] / own_above if own_above > 0 else 0.0)
            else:
                scores.append(0.0)
        return DraftTree(verified.tree, tuple(frozenset[str]() for _ in scores), tuple(scores))


EMPTY = DraftTree(TokenTree(), (), ())
