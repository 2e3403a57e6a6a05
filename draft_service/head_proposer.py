"""Drafting with the draft head: dynamic token trees from the target's features (EAGLE-2).

Per session the proposer keeps the head's KV cache over the committed
positions whose target feature it has (the coordinator forwards them after
every Verify; the newest committed token's feature is not known yet, which is
what the head predicts). Each proposal

1. feeds the new (f_t, x_{t+1}) pairs, whose last output predicts the next
   token: the root's children;
2. grows the tree level by level (EAGLE-2's dynamic trees): the ``beam`` nodes
   of the deepest level with the highest cumulative draft probability are
   expanded together, in one forward with a tree attention mask, into their
   ``branching`` most likely children;
3. keeps the ``max_nodes`` nodes of highest cumulative probability (a
   closed set: a child's cumulative probability never exceeds its parent's)
   and returns them with each node's draft probability given its parent.

The nodes are the head's top-k choices, not samples, so they are
deterministic drafts for the verifier (``sampled`` false); their probabilities
(``TokenTree.node_probs``) let the tree builder weigh each node by its
calibrated confidence.
Speculative entries are cut from the cache after each proposal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, truncate_cache
from specserve.token_tree import ROOT, TokenTree
from specserve.tree_masks import additive_mask, ancestor_matrix


class FeatureLog:
    """The target's features at a session's committed positions, in order, as they arrive."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.count = 0

    def extend(self, features: np.ndarray) -> None:
        if features.shape[0]:
            self._chunks.append(features)
            self.count += features.shape[0]

    def since(self, start: int) -> np.ndarray:
        """Rows from ``start`` on (chunks before it are dropped: they are never read again)."""
        rows = np.concatenate(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        first = self.count - rows.shape[0]
        self._chunks = [rows[start - first :]] if start < self.count else []
        return rows[start - first :]


@dataclass(frozen=True)
class TreeShape:
    depth: int = 4  # levels of the dynamic tree
    branching: int = 4  # children kept per expanded node
    beam: int = 4  # nodes expanded per level
    max_nodes: int = 24  # nodes offered to the tree builder at most


@dataclass
class _Node:
    token: int
    parent: int
    q: float  # draft probability given the parent
    log_prob: float  # cumulative: log of the path's draft probability
    depth: int


class HeadProposer:
    """The draft head as a draft source for one session (one Proposer per session: it holds a cache)."""

    name = "draft_model"

    def __init__(self, head: DraftHead, features: FeatureLog, shape: TreeShape = TreeShape()) -> None:
        self._head = head
        self._features = features
        self._shape = shape
        self._cache = DynamicCache()
        self._fed = 0  # committed positions fed to the head
        self._last_feature: torch.Tensor | None = None  # head output at the last fed position [hidden]
        self._last_logits: torch.Tensor | None = None  # draft logits for the token after the last committed one

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        known = self._features.count
        if max_nodes <= 0 or known == 0 or known != len(tokens) - 1:
            return TokenTree()  # no features yet, or they lag the tokens (a dropped report)
        self._feed(tokens, known)
        assert self._last_feature is not None and self._last_logits is not None
        return self._grow(min(max_nodes, self._shape.max_nodes))

    def _feed(self, tokens: Sequence[int], known: int) -> None:
        if known == self._fed:
            return
        features = torch.from_numpy(self._features.since(self._fed).astype(np.float32))[None]
        next_tokens = torch.tensor([list(tokens[self._fed + 1 : known + 1])])
        positions = torch.arange(self._fed, known)[None]
        out = self._head(features, next_tokens, position_ids=positions, past_key_values=self._cache)
        self._fed = known
        self._last_feature = out.features[0, -1]
        self._last_logits = out.logits[0, -1]

    def _grow(self, budget: int) -> TokenTree:
        assert self._last_feature is not None and self._last_logits is not None
        # The best ``budget`` nodes are closed under parents (a path's probability only falls), so they lie
        # within ``budget`` levels and among each level's ``budget`` likeliest nodes: a small budget (the
        # verifier's, under load) grows a small tree and runs fewer head forwards, losing nothing.
        depth = min(self._shape.depth, budget)
        beam = min(self._shape.beam, budget)
        nodes: list[_Node] = []
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {ROOT: (self._last_feature, self._last_logits)}
        frontier = [ROOT]
        speculative: list[int] = []  # node index of each speculative cache entry, in cache order
        for level in range(1, depth + 1):
            children: list[int] = []
            for parent in frontier:
                children += self._expand(parent, outputs[parent][1], nodes, level)
            if level == depth or not children:
                break
            frontier = sorted(children, key=lambda i: -nodes[i].log_prob)[:beam]
            self._forward_level(frontier, nodes, outputs, speculative)
        truncate_cache(self._cache, self._fed)
        return _best_subtree(nodes, budget)

    def _expand(
        self,
        parent: int,
        logits: torch.Tensor,
        nodes: list[_Node],
        depth: int,
    ) -> list[int]:
        log_q = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(log_q, self._shape.branching)
        base = 0.0 if parent == ROOT else nodes[parent].log_prob
        tokens = self._head.draft_vocab[top.indices].tolist()
        first = len(nodes)
        for token, log_p in zip(tokens, top.values.tolist(), strict=True):
            nodes.append(_Node(token, parent, max(math.exp(log_p), 1e-12), base + log_p, depth))
        return list(range(first, len(nodes)))

    def _forward_level(
        self,
        level: list[int],
        nodes: list[_Node],
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
        speculative: list[int],
    ) -> None:
        """Run the head on ``level``'s nodes at once; each sees the context and its own ancestors."""
        features = torch.stack([outputs[nodes[i].parent][0] for i in level])[None]
        tokens = torch.tensor([[nodes[i].token for i in level]])
        positions = torch.tensor([[self._fed + nodes[i].depth - 1 for i in level]])
        cached = self._fed + len(speculative)
        allowed = torch.zeros(len(level), cached + len(level), dtype=torch.bool)
        allowed[:, : self._fed] = True
        if speculative:  # earlier levels' entries: each row sees its own ancestors among them
            parents = torch.tensor([node.parent for node in nodes])
            ancestors = ancestor_matrix(parents, max(node.depth for node in nodes))
            allowed[:, self._fed : cached] = ancestors[level][:, speculative]
        allowed[:, cached:] = torch.eye(len(level), dtype=torch.bool)
        mask = additive_mask(allowed, features.dtype)
        out = self._head(features, tokens, position_ids=positions, past_key_values=self._cache, attention_mask=mask)
        for row, node in enumerate(level):
            outputs[node] = (out.features[0, row], out.logits[0, row])
        speculative.extend(level)


def _best_subtree(nodes: list[_Node], budget: int) -> TokenTree:
    """The ``budget`` most probable nodes, parents before children, with their probabilities."""
    ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].log_prob, nodes[i].depth, i))[:budget]
    order: list[int] = []
    position: dict[int, int] = {}
    # Shallow first; a node whose parent did not make the cut (float ties only) is left out.
    for i in sorted(ranked, key=lambda i: (nodes[i].depth, -nodes[i].log_prob, i)):
        if nodes[i].parent == ROOT or nodes[i].parent in position:
            position[i] = len(order)
            order.append(i)
    parents = tuple(ROOT if nodes[i].parent == ROOT else position[nodes[i].parent] for i in order)
    return TokenTree(tuple(nodes[i].token for i in order), parents, node_probs=tuple(nodes[i].q for i in order))
