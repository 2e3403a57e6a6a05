"""Drafting with the draft head: dynamic token trees from the target's features (EAGLE-2).

Per session the proposer keeps the head's KV cache over the committed
positions whose target feature it has (the coordinator forwards them after
each Verify the drafter wanted them for; the newest committed token's feature
is not known yet, which is what the head predicts). Each proposal

1. feeds the new (f_t, x_{t+1}) pairs, whose last output predicts the next
   token: the root's children;
1b. when the context runs past the known features (pre-drafting for a
   hypothetical outcome of the round being verified, or a report that came
   without features), feeds the remaining tokens on the head's own predicted
   features, one position at a time, as it does inside a tree (a few only:
   ``UNFED_PAST_DEPTH``). These speculative entries stay in the cache while
   later proposals share their prefix, and go as soon as the target's real
   features arrive; features that do not continue the ones before (rounds
   that asked for none) restart the head at their first position;
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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draft_service.draft_head import truncate_cache
from draft_service.head_graphs import TreeGraphs
from draft_service.head_layer import HeadCache
from draft_service.head_types import ServingHead
from draft_service.tree_growth import (
    Children,
    Level,
    Node,
    StepOut,
    greedy_children,
    grow_levels,
    level_of,
    on_host,
    placeable,
)
from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.results import DraftFeedback
from specserve.sampling import GREEDY, SamplingParams
from specserve.token_tree import ROOT, TokenTree


class FeatureLog:
    """The target's features at a run of a session's committed positions, [start, end), as they arrive.

    The coordinator asks for features only for the rounds the drafter wants them for (sparse features), so
    reports may skip positions: rows that do not continue the run start a new one, and the old run's rows go.
    """

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.start = 0  # the position of the run's first row
        self.end = 0  # the position after its last row

    @property
    def count(self) -> int:
        """Rows in the run (those ``since`` dropped included)."""
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Bytes held, counting whole arrays that kept rows are views of."""
        return sum((chunk.base if isinstance(chunk.base, np.ndarray) else chunk).nbytes for chunk in self._chunks)

    def extend(self, features: np.ndarray, start: int | None = None) -> bool:
        """Add the rows of positions [start, start + len(features)) (``start`` None: right after the run's);
        returns whether they begin a new run, which they do wherever they do not continue this one."""
        if not features.shape[0]:
            return False
        restarted = False
        if start is not None and start != self.end:
            self._chunks, self.start, self.end, restarted = [], start, start, True
        self._chunks.append(features)
        self.end += features.shape[0]
        return restarted

    def since(self, start: int) -> np.ndarray:
        """Rows from position ``start`` on (chunks before it are dropped: they are never read again)."""
        rows = np.concatenate(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        first = self.end - rows.shape[0]
        self._chunks = [rows[start - first :]] if start < self.end else []
        return rows[start - first :]


SYNC_FEED_ROWS = 256
"""Most new feature rows a proposal feeds the head itself; a longer backlog (a long prompt) is fed by
``digest`` in steps of ``DIGEST_ROWS`` between rounds, and the head drafts nothing until it has caught up.
Feeding 6,000 prompt positions at once takes the head over a second on 2 CPU cores: a request would wait
that long for its first tree, or lose the drafter to the draft timeout."""
DIGEST_ROWS = 512

UNFED_PAST_DEPTH = 4
"""A proposal steps the head through at most its tree's depth plus this many tokens past the known features, on
its own predicted features (one head step a token); past that it offers no tree and waits for the target's.

Pre-drafting asks about an outcome of the tree being verified: its accepted path (as deep as the head's tree
where the head's chain is taken) and the bonus token; a constraint's forced tokens, or a round whose features
were not asked for, add a few. A longer run means whole rounds came without features (the head sat them out,
or they had no draft budget): stepping through it would cost more head steps than the tree, on features guessed
further and further from the target's."""


@dataclass(frozen=True)
class TreeShape:
    depth: int = 4  # levels of the dynamic tree
    branching: int = 4  # children kept per expanded node
    beam: int = 4  # nodes expanded per level
    max_nodes: int = 24  # nodes offered to the tree builder at most


class HeadProposer:
    """The draft head as a draft source for one session (one Proposer per session: it holds a cache)."""

    name = "draft_model"
    wants_features = True
    costly = True

    def __init__(
        self,
        head: ServingHead,
        shape: TreeShape = TreeShape(),
        sampling: SamplingParams = GREEDY,
        graphs: TreeGraphs | None = None,
    ) -> None:
        self._head = head
        # Sampled with a seed: children ranked under the target's keyed noise (coupled drafts); else by q.
        self._coupled = None if sampling.greedy or sampling.seed is None else sampling
        self._draft_ids = head.draft_vocab.cpu().numpy()  # the target's id of each draft logit: the noise's keys
        self._dtype = head.draft_lm_head.dtype  # the target's features arrive in fp32
        self.features = FeatureLog()  # the target's features at the committed positions, as reported
        self._shape = shape
        self._device = head.draft_lm_head.device  # where its cache and the tree's growth live
        self._prunes = self._device.type == "cpu"  # see ``tree_growth.placeable``
        self._greedy = greedy_children(head.draft_vocab, shape.branching)
        self._graphs = graphs  # a GPU head's captured tree growth (None: grown over the session's cache)
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
        """Keep the report's features; rows that do not continue the log (the positions between have no feature:
        rounds the drafter wanted none for) restart the head there: nothing cached may read across the gap.
        Positions stay the session's own, which the head's rotary embedding reads."""
        features, start = feedback.features, feedback.features_start
        if features is None or self.forgotten or (start is not None and start < 0):
            return  # nothing, or more rows than positions (a confused report)
        if self.features.extend(features, start):
            truncate_cache(self._cache, 0)
            self._fed = 0
            self._outputs, self._speculative = [], []

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        known = self.features.end
        if (
            self.forgotten
            or max_nodes <= 0
            or not self.features.count
            or known > len(tokens) - 1
            or known - self._fed_end > SYNC_FEED_ROWS
            or len(tokens) - 1 - known > self._shape.depth + UNFED_PAST_DEPTH
        ):
            # No features yet, more than tokens (a confused report), a backlog that ``digest`` feeds, or a context
            # that ran too far past them.
            return TokenTree()
        self._feed(tokens, known)
        self._feed_speculative(tokens[known + 1 :])
        return self._grow(min(max_nodes, self._shape.max_nodes), first_position=len(tokens))

    @torch.inference_mode()
    def digest(self, tokens: Sequence[int]) -> bool:
        """Feed the next ``DIGEST_ROWS`` of a long backlog of features; False when the backlog is short."""
        known = self.features.end
        if self.forgotten or known - self._fed_end <= SYNC_FEED_ROWS or known > len(tokens) - 1:
            return False
        self._feed(tokens, min(known, self._fed_end + DIGEST_ROWS))
        return True

    @property
    def _fed_end(self) -> int:
        """The position after the last one fed with the target's feature (the cache's entries start at the log's
        run: ``_fed`` counts them)."""
        return self.features.start + self._fed

    def _feed(self, tokens: Sequence[int], upto: int) -> None:
        """Feed the target's features of positions [_fed_end, upto) with the tokens that follow them."""
        first = self._fed_end
        if upto == first:
            return
        truncate_cache(self._cache, self._fed)  # speculative entries go: real features follow the committed ones
        rows = self.features.since(first)[: upto - first]
        features = torch.from_numpy(rows.astype(np.float32)).to(self._dtype)
        next_tokens = torch.tensor(list(tokens[first + 1 : upto + 1]))
        positions = torch.arange(first, upto)
        out = self._head.step(features, next_tokens, positions, self._cache, last_logits_only=True)
        self._fed = upto - self.features.start
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
            position = torch.tensor([self._fed_end + len(self._speculative)])
            out = self._head.step(feature, torch.tensor([token]), position, self._cache)
            self._outputs.append((out.features[0, -1], out.logits[0, -1]))
            self._speculative.append(token)

    def _grow(self, budget: int, first_position: int) -> TokenTree:
        """The tree after the context; its root's children are at sequence position ``first_position``.

        Grown a level at a time on the head's device (``tree_growth``); the nodes come to the host once. A GPU
        head's greedy trees grow in fixed slots captured as a CUDA graph (``head_graphs``), the rest over the
        session's cache, whose tree entries are dropped afterwards.
        """
        # The best ``budget`` nodes are closed under parents (a path's probability only falls), so they lie
        # within ``budget`` levels and among each level's ``budget`` likeliest nodes: a small budget (the
        # verifier's, under load) grows a small tree and runs fewer head forwards, losing nothing.
        depth = min(self._shape.depth, budget)
        beam = min(self._shape.beam, budget)
        context = self._fed + len(self._speculative)  # cache entries every tree node sees
        position = self.features.start + context  # where level 1 is fed: the root's own position, plus one
        feature, logits = self._outputs[-1]
        gumbels = self._level_noise(depth, first_position)
        if gumbels is None and self._graphs is not None:
            levels = self._graphs.grow(
                self._cache, context, position, feature, logits, depth, beam, self._shape.branching
            )
        else:
            children = self._greedy if gumbels is None else self._coupled_children(gumbels)

            def step(features: torch.Tensor, tokens: torch.Tensor, paths: torch.Tensor, level: int) -> StepOut:
                return self._forward_level(features, tokens, paths, position + level - 1, context)

            prune = placeable(budget) if self._prunes else None
            levels = grow_levels(feature, logits, depth, beam, children, step, prune)
            truncate_cache(self._cache, context)
        return best_subtree(on_host(levels), budget)

    def _level_noise(self, depth: int, first_position: int) -> torch.Tensor | None:
        """Coupled drafts: the target's keyed noise at each level's position, [depth, vocab] on the head's device
        in one copy (None: greedy drafts). One vector a level: every node at one depth sits at one position."""
        if self._coupled is None or self._coupled.seed is None:
            return None
        noise = PositionNoise(self._coupled.seed, first_position)
        return torch.stack([noise.gumbel(level, self._draft_ids) for level in range(depth)]).to(self._device)

    def _coupled_children(self, gumbels: torch.Tensor) -> Children:
        """Each frontier node's Gumbel top-k under q with the level's keyed noise, each carrying the q of its
        rank; q shaped as the target's own p is: the session's temperature, top-k and top-p."""
        sampling = self._coupled
        assert sampling is not None
        branching = self._shape.branching

        def children(logits: torch.Tensor, frontier: torch.Tensor, cumulative: torch.Tensor, level: int) -> Level:
            shaped = torch.log(target_probs(logits, sampling))
            top = torch.topk(shaped.double() + gumbels[level - 1], branching, dim=-1)
            log_q = torch.topk(shaped, branching, dim=-1).values.double()  # rank r: the r-th largest q
            log_q = log_q.masked_fill(top.values == float("-inf"), float("-inf"))  # never a token q has no mass for
            return level_of(self._head.draft_vocab[top.indices], frontier, cumulative, log_q)

        return children

    def _forward_level(
        self,
        features: torch.Tensor,  # [n, hidden]: each node's parent's predicted feature
        tokens: torch.Tensor,  # [n]: the nodes' tokens
        paths: torch.Tensor,  # [n, entries]: the tree's cache entries on each node's path (its ancestors')
        position: int,  # the nodes' sequence position (one depth: one position)
        context: int,  # cache entries every node sees
    ) -> StepOut:
        """Run the head on one level's nodes at once; each sees the context, its ancestors and itself. Returns
        their predicted features [n, hidden] and draft logits [n, vocab]; their entries stay in the cache."""
        rows, entries = paths.shape
        allowed = torch.ones(rows, context + entries + rows, dtype=torch.bool, device=self._device)
        allowed[:, context : context + entries] = paths
        allowed[:, context + entries :] = torch.eye(rows, dtype=torch.bool, device=self._device)
        positions = torch.full((rows,), position, dtype=torch.long, device=self._device)
        out = self._head.step(features, tokens, positions, self._cache, allowed)
        return out.features[0], out.logits[0]


def best_subtree(nodes: list[Node], budget: int) -> TokenTree:
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
