"""Drafting with the draft head: dynamic token trees from the target's features (EAGLE-2).

Per session the proposer keeps the head's KV cache over the committed
positions whose target feature it has (the coordinator forwards them after
every Verify; the newest committed token's feature is not known yet, which is
what the head predicts). Each proposal

1. feeds the new (f_t, x_{t+1}) pairs, whose last output predicts the next
   token: the root's children;
1b. when the context runs past the known features (pre-drafting for a
   hypothetical outcome of the round being verified, or a report that came
   without features), feeds the remaining tokens on the head's own predicted
   features, one position at a time, as it does inside a tree. These
   speculative entries stay in the cache while later proposals share their
   prefix, and go as soon as the target's real features arrive;
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

**Coupled drafts** (sampled sessions with a seed): the target's token at
position t is argmax_i log p_t(i) + G(seed, t, i) (``keyed_noise``), so a
node's children are ranked by the same perturbed score under the head's
distribution q at the session's temperature, top-k and top-p: the first
child is the head's own Gumbel-max sample with the target's noise, which is
the target's token with probability at least (1 - TV) / (1 + TV), and the
next ones are the following Gumbel top-k candidates (a sample without
replacement from q). Every node at one depth shares that depth's position,
so one noise vector serves a whole level. A child of rank r carries the r-th
largest q as its probability, as a greedy child of rank r does: that is its
chance under greedy decoding, and as the temperature falls the perturbed
ranking becomes the greedy one. The drafts stay deterministic guesses: the
verifier checks them against its own keyed sample, so output never changes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draft_service.draft_head import DraftHead, truncate_cache
from draft_service.head_layer import HeadCache
from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.results import DraftFeedback
from specserve.sampling import GREEDY, SamplingParams
from specserve.token_tree import ROOT, TokenTree
from specserve.tree_masks import ancestor_matrix


class FeatureLog:
    """The target's features at a session's committed positions, in order, as they arrive."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes held, counting whole arrays that kept rows are views of."""
        return sum((chunk.base if isinstance(chunk.base, np.ndarray) else chunk).nbytes for chunk in self._chunks)

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


SYNC_FEED_ROWS = 256
"""Most new feature rows a proposal feeds the head itself; a longer backlog (a long prompt) is fed by
``digest`` in steps of ``DIGEST_ROWS`` between rounds, and the head drafts nothing until it has caught up.
Feeding 6,000 prompt positions at once takes the head over a second on 2 CPU cores: a request would wait
that long for its first tree, or lose the drafter to the draft timeout."""
DIGEST_ROWS = 512


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
    wants_features = True

    def __init__(self, head: DraftHead, shape: TreeShape = TreeShape(), sampling: SamplingParams = GREEDY) -> None:
        self._head = head
        # Sampled with a seed: children ranked under the target's keyed noise (coupled drafts); else by q.
        self._coupled = None if sampling.greedy or sampling.seed is None else sampling
        self._draft_ids = head.draft_vocab.cpu().numpy()  # the target's id of each draft logit: the noise's keys
        self._dtype = head.draft_lm_head.dtype  # the target's features arrive in fp32
        self.features = FeatureLog()  # the target's features at the committed positions, as reported
        self._shape = shape
        self._cache = HeadCache()
        self._fed = 0  # committed positions fed to the head with the target's own features
        # Head outputs (feature [hidden], draft logits) at the last position fed with a real feature, then at
        # each speculative one: the last entry predicts the token after the context.
        self._outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._speculative: list[int] = []  # tokens fed on the head's own features, in cache order after _fed
        self.forgotten = False  # its state was freed to bound the drafter's memory: it drafts no more

    @property
    def nbytes(self) -> int:
        """The head's KV cache, the features not fed yet, the outputs kept."""
        cached = self._cache.nbytes  # its buffers' storage, positions cropped included
        kept = sum(f.untyped_storage().nbytes() + logits.untyped_storage().nbytes() for f, logits in self._outputs)
        return cached + kept + self.features.nbytes

    def forget(self) -> None:
        """Free the cache and features: from now on this session drafts with the other sources only.

        The head cannot catch up later: the features of the positions it forgot never come again (the
        coordinator sends each committed position's once), and drafting from a cache that misses them would
        only waste the verifier's time on poor trees.
        """
        self.forgotten = True
        self._cache = HeadCache()
        self.features = FeatureLog()
        self._outputs = []
        self._speculative = []

    def observe(self, feedback: DraftFeedback) -> None:
        if feedback.features is not None and not self.forgotten:
            self.features.extend(feedback.features)

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        known = self.features.count
        if (
            self.forgotten
            or max_nodes <= 0
            or known == 0
            or known > len(tokens) - 1
            or known - self._fed > SYNC_FEED_ROWS
        ):
            # No features yet, more than tokens (a confused report), or a backlog that ``digest`` feeds.
            return TokenTree()
        self._feed(tokens, known)
        self._feed_speculative(tokens[known + 1 :])
        return self._grow(min(max_nodes, self._shape.max_nodes), first_position=len(tokens))

    @torch.inference_mode()
    def digest(self, tokens: Sequence[int]) -> bool:
        """Feed the next ``DIGEST_ROWS`` of a long backlog of features; False when the backlog is short."""
        known = self.features.count
        if self.forgotten or known - self._fed <= SYNC_FEED_ROWS or known > len(tokens) - 1:
            return False
        self._feed(tokens, min(known, self._fed + DIGEST_ROWS))
        return True

    def _feed(self, tokens: Sequence[int], upto: int) -> None:
        """Feed the target's features of positions [_fed, upto) with the tokens that follow them."""
        if upto == self._fed:
            return
        truncate_cache(self._cache, self._fed)  # speculative entries go: real features follow the committed ones
        rows = self.features.since(self._fed)[: upto - self._fed]
        features = torch.from_numpy(rows.astype(np.float32)).to(self._dtype)
        next_tokens = torch.tensor(list(tokens[self._fed + 1 : upto + 1]))
        positions = torch.arange(self._fed, upto)
        out = self._head.step(features, next_tokens, positions, self._cache, last_logits_only=True)
        self._fed = upto
        # Copies: views would keep the whole forward's outputs (every fed position's) alive.
        self._outputs = [(out.features[0, -1].clone(), out.logits[0, -1].clone())]
        self._speculative = []

    def _feed_speculative(self, tokens: Sequence[int]) -> None:
        """Extend the context by ``tokens`` on the head's own features (reusing a shared speculative prefix)."""
        shared = 0
        while shared < min(len(tokens), len(self._speculative)) and tokens[shared] == self._speculative[shared]:
            shared += 1
        truncate_cache(self._cache, self._fed + shared)
        del self._speculative[shared:], self._outputs[shared + 1 :]
        for token in tokens[shared:]:
            # The feature predicted at the previous position stands in for the target's (EAGLE's self-feeding).
            feature = self._outputs[-1][0][None]
            position = torch.tensor([self._fed + len(self._speculative)])
            out = self._head.step(feature, torch.tensor([token]), position, self._cache)
            self._outputs.append((out.features[0, -1], out.logits[0, -1]))
            self._speculative.append(token)

    def _grow(self, budget: int, first_position: int) -> TokenTree:
        """The tree after the context; its root's children are at sequence position ``first_position``."""
        # The best ``budget`` nodes are closed under parents (a path's probability only falls), so they lie
        # within ``budget`` levels and among each level's ``budget`` likeliest nodes: a small budget (the
        # verifier's, under load) grows a small tree and runs fewer head forwards, losing nothing.
        depth = min(self._shape.depth, budget)
        beam = min(self._shape.beam, budget)
        context = self._fed + len(self._speculative)  # cache entries every tree node sees
        nodes: list[_Node] = []
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {ROOT: self._outputs[-1]}
        frontier = [ROOT]
        tree_entries: list[int] = []  # node index of each tree node's cache entry, in cache order
        seed = None if self._coupled is None else self._coupled.seed
        noise = None if seed is None else PositionNoise(seed, first_position)
        for level in range(1, depth + 1):
            children: list[int] = []
            # One noise vector a level: every node at depth `level` sits at the same sequence position.
            gumbel = None if noise is None else noise.gumbel(level - 1, self._draft_ids)
            for parent in frontier:
                children += self._expand(parent, outputs[parent][1], nodes, level, gumbel)
            if level == depth or not children:
                break
            frontier = _can_place(nodes, sorted(children, key=lambda i: -nodes[i].log_prob)[:beam], budget)
            if not frontier:
                break  # no child of theirs could be among the best ``budget``: the forward would be wasted
            self._forward_level(frontier, nodes, outputs, tree_entries, context)
        truncate_cache(self._cache, context)
        return _best_subtree(nodes, budget)

    def _expand(
        self,
        parent: int,
        logits: torch.Tensor,
        nodes: list[_Node],
        depth: int,
        gumbel: torch.Tensor | None = None,
    ) -> list[int]:
        """Add ``parent``'s children: q's top-k, or with ``gumbel`` (coupled) the Gumbel top-k under q."""
        if gumbel is None:
            log_q = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(log_q, self._shape.branching)
            chosen, log_probs = top.indices, top.values.tolist()
        else:
            assert self._coupled is not None
            # q as the target's own p is shaped: the session's temperature, top-k and top-p.
            log_q = torch.log(target_probs(logits[None], self._coupled)[0])
            top = torch.topk(log_q.double() + gumbel.to(log_q.device), self._shape.branching)
            chosen = top.indices[top.values > float("-inf")]  # never a token q has no mass for
            log_probs = torch.topk(log_q, chosen.numel()).values.tolist()  # rank r: the r-th largest q
        base = 0.0 if parent == ROOT else nodes[parent].log_prob
        tokens = self._head.draft_vocab[chosen].tolist()
        first = len(nodes)
        for token, log_p in zip(tokens, log_probs, strict=True):
            nodes.append(_Node(token, parent, max(math.exp(log_p), 1e-12), base + log_p, depth))
        return list(range(first, len(nodes)))

    def _forward_level(
        self,
        level: list[int],
        nodes: list[_Node],
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
        tree_entries: list[int],
        context: int,
    ) -> None:
        """Run the head on ``level``'s nodes at once; each sees the ``context`` entries and its own ancestors."""
        features = torch.stack([outputs[nodes[i].parent][0] for i in level])
        tokens = torch.tensor([nodes[i].token for i in level])
        positions = torch.tensor([context + nodes[i].depth - 1 for i in level])
        cached = context + len(tree_entries)
        allowed = torch.zeros(len(level), cached + len(level), dtype=torch.bool)
        allowed[:, :context] = True
        if tree_entries:  # earlier levels' entries: each row sees its own ancestors among them
            parents = torch.tensor([node.parent for node in nodes])
            ancestors = ancestor_matrix(parents, max(node.depth for node in nodes))
            allowed[:, context:cached] = ancestors[level][:, tree_entries]
        allowed[:, cached:] = torch.eye(len(level), dtype=torch.bool)
        out = self._head.step(features, tokens, positions, self._cache, allowed)
        for row, node in enumerate(level):
            outputs[node] = (out.features[0, row], out.logits[0, row])
        tree_entries.extend(level)


def _can_place(nodes: list[_Node], frontier: list[int], budget: int) -> list[int]:
    """The frontier nodes whose children could still be among the ``budget`` most probable nodes.

    A child's path is no more probable than its parent's, and at equal probability the deeper node ranks
    after (``_best_subtree``): a parent no more probable than the ``budget``-th best node has no child that
    makes the cut, so expanding it (a head forward, when it is the whole frontier) changes no tree.
    """
    if len(nodes) < budget:
        return frontier
    kth = heapq.nlargest(budget, (node.log_prob for node in nodes))[-1]
    return [i for i in frontier if nodes[i].log_prob > kth]


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
