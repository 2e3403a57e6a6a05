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

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from draft_service.draft_head import DraftHead, truncate_cache
from draft_service.head_layer import HeadCache
from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.results import DraftFeedback
from specserve.sampling import GREEDY, SamplingParams
from specserve.token_tree import ROOT, TokenTree


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
        self._device = head.draft_lm_head.device  # where its cache and the tree's growth live
        self._prunes = self._device.type == "cpu"  # see ``_placeable``
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
        """The tree after the context; its root's children are at sequence position ``first_position``.

        Each level is a few tensor operations on the head's device over the whole frontier at once: every
        frontier node's top-k children, their cumulative log probabilities, the next frontier as the likeliest
        of them, and one head step over it with its tree mask. The nodes come to the host once, at the end.
        """
        # The best ``budget`` nodes are closed under parents (a path's probability only falls), so they lie
        # within ``budget`` levels and among each level's ``budget`` likeliest nodes: a small budget (the
        # verifier's, under load) grows a small tree and runs fewer head forwards, losing nothing.
        depth = min(self._shape.depth, budget)
        beam = min(self._shape.beam, budget)
        context = self._fed + len(self._speculative)  # cache entries every tree node sees
        features, logits = (t[None] for t in self._outputs[-1])  # [f, hidden], [f, vocab]: the frontier's outputs
        frontier = torch.full((1,), ROOT, dtype=torch.long, device=self._device)  # its nodes' indices
        cumulative = torch.zeros(1, dtype=torch.float64, device=self._device)  # their paths' log probabilities
        # [f, entries]: the tree's cache entries (frontier nodes of earlier levels) on each frontier node's path.
        paths = torch.zeros(1, 0, dtype=torch.bool, device=self._device)
        levels: list[_Level] = []
        gumbels = self._level_noise(depth, first_position)
        for level in range(1, depth + 1):
            children = self._children(logits, frontier, cumulative, None if gumbels is None else gumbels[level - 1])
            first = sum(len(done.tokens) for done in levels)
            levels.append(children)
            if level == depth:
                break
            chosen = torch.topk(children.cumulative, min(beam, len(children.tokens))).indices
            if self._prunes:
                chosen = _placeable(levels, chosen, budget)
                if not len(chosen):
                    break  # no child of theirs could be among the best ``budget``: the forward would be wasted
            rows = torch.div(chosen, self._shape.branching, rounding_mode="floor")  # each chosen node's parent row
            features, logits = self._forward_level(
                features[rows], children.tokens[chosen], paths[rows], context + level - 1, context
            )
            frontier, cumulative = first + chosen, children.cumulative[chosen]
            paths = torch.cat([paths[rows], torch.eye(len(chosen), dtype=torch.bool, device=self._device)], dim=1)
        truncate_cache(self._cache, context)
        return _best_subtree(_on_host(levels), budget)

    def _level_noise(self, depth: int, first_position: int) -> torch.Tensor | None:
        """Coupled drafts: the target's keyed noise at each level's position, [depth, vocab] on the head's device
        in one copy (None: greedy drafts). One vector a level: every node at one depth sits at one position."""
        if self._coupled is None or self._coupled.seed is None:
            return None
        noise = PositionNoise(self._coupled.seed, first_position)
        return torch.stack([noise.gumbel(level, self._draft_ids) for level in range(depth)]).to(self._device)

    def _children(
        self,
        logits: torch.Tensor,  # [f, vocab]: the frontier nodes' draft logits
        frontier: torch.Tensor,  # [f]: their node indices (ROOT for the root)
        cumulative: torch.Tensor,  # [f]: their paths' log probabilities
        gumbel: torch.Tensor | None = None,  # [vocab]: the level's keyed noise (coupled drafts)
    ) -> _Level:
        """Every frontier node's ``branching`` children, parent by parent: q's top-k, or with ``gumbel``
        (coupled) the Gumbel top-k under q, each carrying the q of its rank."""
        if gumbel is None:
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), self._shape.branching, dim=-1)
            chosen, log_q = top.indices, top.values.double()
        else:
            assert self._coupled is not None
            # q as the target's own p is shaped: the session's temperature, top-k and top-p.
            shaped = torch.log(target_probs(logits, self._coupled))
            top = torch.topk(shaped.double() + gumbel, self._shape.branching, dim=-1)
            chosen = top.indices
            log_q = torch.topk(shaped, self._shape.branching, dim=-1).values.double()  # rank r: the r-th largest q
            log_q = log_q.masked_fill(top.values == float("-inf"), float("-inf"))  # never a token q has no mass for
        count = chosen.numel()
        return _Level(
            tokens=self._head.draft_vocab[chosen].reshape(count),
            parents=frontier.repeat_interleave(self._shape.branching),
            log_q=log_q.reshape(count),
            cumulative=(cumulative[:, None] + log_q).reshape(count),
        )

    def _forward_level(
        self,
        features: torch.Tensor,  # [n, hidden]: each node's parent's predicted feature
        tokens: torch.Tensor,  # [n]: the nodes' tokens
        paths: torch.Tensor,  # [n, entries]: the tree's cache entries on each node's path (its ancestors')
        position: int,  # the nodes' sequence position (one depth: one position)
        context: int,  # cache entries every node sees
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head on one level's nodes at once; each sees the context, its ancestors and itself. Returns
        their predicted features [n, hidden] and draft logits [n, vocab]; their entries stay in the cache."""
        rows, entries = paths.shape
        allowed = torch.ones(rows, context + entries + rows, dtype=torch.bool, device=self._device)
        allowed[:, context : context + entries] = paths
        allowed[:, context + entries :] = torch.eye(rows, dtype=torch.bool, device=self._device)
        positions = torch.full((rows,), position, dtype=torch.long, device=self._device)
        out = self._head.step(features, tokens, positions, self._cache, allowed)
        return out.features[0], out.logits[0]


@dataclass(frozen=True)
class _Level:
    """One depth's nodes on the head's device, [n] each, in the order their parents were expanded."""

    tokens: torch.Tensor  # target token ids
    parents: torch.Tensor  # index of each node's parent among all the tree's nodes (ROOT: the root's)
    log_q: torch.Tensor  # log of the draft probability given the parent (-inf: no draft, q had no mass)
    cumulative: torch.Tensor  # log of the path's draft probability


def _on_host(levels: list[_Level]) -> list[_Node]:
    """The levels' nodes as host values: the round's one transfer from the head's device."""
    columns = [torch.cat([getattr(level, column.name).double() for level in levels]) for column in fields(_Level)]
    tokens, parents, log_q, cumulative = torch.stack(columns).cpu().tolist()
    depths = [depth for depth, level in enumerate(levels, start=1) for _ in range(len(level.tokens))]
    return [
        _Node(int(token), int(parent), max(math.exp(lq), 1e-12), cum, depth)
        for token, parent, lq, cum, depth in zip(tokens, parents, log_q, cumulative, depths, strict=True)
    ]


def _placeable(levels: list[_Level], chosen: torch.Tensor, budget: int) -> torch.Tensor:
    """The chosen nodes of the last level whose children could still be among the ``budget`` most probable.

    A child's path is no more probable than its parent's, and at equal probability the deeper node ranks
    after (``_best_subtree``): a parent no more probable than the ``budget``-th best node has no child that
    makes the cut, so expanding it (a head forward, when it is the whole frontier) changes no tree. It reads a
    value on the host, so only a CPU head, where that costs nothing, prunes; a GPU's rows are nearly free.
    """
    every = torch.cat([level.cumulative for level in levels])
    kth = torch.topk(every, budget).values[-1] if len(every) >= budget else float("-inf")
    return chosen[levels[-1].cumulative[chosen] > kth]


def _best_subtree(nodes: list[_Node], budget: int) -> TokenTree:
    """The ``budget`` most probable nodes, parents before children, with their probabilities."""
    drafts = (i for i in range(len(nodes)) if nodes[i].log_prob > float("-inf"))
    ranked = sorted(drafts, key=lambda i: (-nodes[i].log_prob, nodes[i].depth, i))[:budget]
    order: list[int] = []
    position: dict[int, int] = {}
    # Shallow first; a node whose parent did not make the cut (float ties only) is left out.
    for i in sorted(ranked, key=lambda i: (nodes[i].depth, -nodes[i].log_prob, i)):
        if nodes[i].parent == ROOT or nodes[i].parent in position:
            position[i] = len(order)
            order.append(i)
    parents = tuple(ROOT if nodes[i].parent == ROOT else position[nodes[i].parent] for i in order)
    return TokenTree(tuple(nodes[i].token for i in order), parents, node_probs=tuple(nodes[i].q for i in order))
