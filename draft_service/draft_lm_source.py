"""Drafting with a draft language model (``draft_lm``): chains and trees from a small model of the target's family.

Per session the source keeps the draft model's KV cache over a run of the session's tokens (``_fed``): the
committed tokens, and past them a hypothetical outcome it was last asked about (pre-drafting). Each proposal

1. rolls the cache back to the longest prefix it shares with the context and feeds the rest in one step (the
   last token at least, whose logits are the root's);
2. grows the tree a level at a time (``tree_growth``, as the draft head does): with a small budget (no more
   nodes than the tree's depth) a chain of the model's top choices, one row a step; otherwise each level's
   ``beam`` likeliest nodes expanded together, in one step with a tree mask, into their ``branching`` likeliest
   children;
3. keeps the ``max_nodes`` nodes of highest cumulative probability, each with its draft probability given its
   parent, and drops the tree's entries from the cache.

The verifier's report on each round rolls the cache back to the committed tokens (``observe``): entries of a
hypothetical outcome that did not happen go, those of one that did stay, so a pre-drafted outcome the round
confirmed costs no step to catch up. A long prompt is fed between rounds (``digest``), a chunk at a time, and the
source drafts nothing until it has caught up, so a request never waits for a whole prompt's prefill.

The nodes are the model's top-k choices, or under a seeded sampled session its Gumbel top-k with the target's
keyed noise (coupled drafts, as ``head_proposer`` explains): deterministic drafts either way, each carrying its
q for the tree builder's calibration. The verifier checks them against its own tokens, so output never changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from draft_service.draft_lm import DraftLM
from draft_service.head_proposer import TreeShape, best_subtree
from draft_service.tree_growth import (
    Children,
    Level,
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
from specserve.token_tree import TokenTree

SYNC_FEED_TOKENS = 256
"""Most tokens a proposal feeds the draft model itself; a longer backlog (a long prompt, or rounds the gate had
the source sit out) is fed by ``digest`` between rounds, ``DIGEST_TOKENS`` at a time, and the source drafts
nothing until it has caught up: a request would otherwise wait for a whole prefill of the draft model."""
DIGEST_TOKENS = 256

BYTES_PER_TOKEN = 40
"""A fed token in a Python list: an 8-byte slot and an int object."""


class DraftLMProposer:
    """The draft model as a draft source for one session (one Proposer per session: it holds a cache)."""

    name = "draft_lm"
    wants_features = False
    costly = True  # a model step per level: the source gate weighs it

    def __init__(
        self,
        model: DraftLM,
        prompt_tokens: Sequence[int],
        shape: TreeShape | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> None:
        self._model = model
        self._shape = shape or TreeShape()
        # Sampled with a seed: children ranked under the target's keyed noise (coupled drafts); else by q.
        self._coupled = None if sampling.greedy or sampling.seed is None else sampling
        self._device = model.device
        self._vocab_ids = torch.arange(model.vocab_size, device=self._device)  # logit index -> token id
        self._noise_ids = np.arange(model.vocab_size, dtype=np.int64)
        self._prunes = self._device.type == "cpu"  # see ``tree_growth.placeable``
        self._cache = model.new_cache()
        self._fed: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self._logits: torch.Tensor | None = None  # [vocab]: after the last fed token (None: not kept)
        # The session's committed tokens so far: every context a proposal sees starts with them (the Proposer
        # contract), so only what follows them is compared with what was fed.
        self._committed = len(prompt_tokens)
        self.forgotten = False  # its state was freed to bound the drafter's memory: it drafts no more

    @property
    def num_cached(self) -> int:
        """Positions the cache holds (all of them the context's: a tree's entries go after each proposal)."""
        return self._cache.length

    @property
    def nbytes(self) -> int:
        kept = self._logits.untyped_storage().nbytes() if self._logits is not None else 0
        return self._cache.nbytes + BYTES_PER_TOKEN * len(self._fed) + kept

    def forget(self) -> None:
        """Free the cache: from now on this session drafts with the other sources only.

        Drafting again would mean a prefill of the whole context on the draft model, each time the drafter's
        memory bound frees it again."""
        self.forgotten = True
        self._cache = self._model.new_cache()
        self._fed, self._logits = [], None

    @torch.inference_mode()
    def observe(self, feedback: DraftFeedback) -> None:
        """Roll the cache back to the committed tokens: a fed outcome keeps the part the round confirmed."""
        new = feedback.new_tokens
        if not new:
            return
        keep = self._committed
        for token in new:
            if keep >= len(self._fed) or self._fed[keep] != token:
                break
            keep += 1
        self._rollback(min(keep, len(self._fed)))
        self._committed += len(new)

    def digest(self, tokens: Sequence[int]) -> bool:
        """Feed the next ``DIGEST_TOKENS`` of a backlog longer than ``SYNC_FEED_TOKENS``; False when it is short."""
        if self.forgotten:
            return False
        shared = self._shared(tokens)
        if len(tokens) - shared <= SYNC_FEED_TOKENS:
            return False
        with torch.inference_mode():
            self._rollback(shared)
            self._feed(tokens[shared : shared + DIGEST_TOKENS])
        return True

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        if self.forgotten or max_nodes <= 0 or not tokens:
            return TokenTree()
        shared = self._shared(tokens)
        if len(tokens) - shared > SYNC_FEED_TOKENS:
            return TokenTree()  # a backlog that ``digest`` feeds
        if not (shared == len(tokens) == len(self._fed) and self._logits is not None):
            shared = min(shared, len(tokens) - 1)  # the last token is fed (again) for the root's logits
            self._rollback(shared)
            self._feed(tokens[shared:])
        return self._grow(min(max_nodes, self._shape.max_nodes), first_position=len(tokens))

    def _shared(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``' first tokens the cache holds."""
        shared = min(self._committed, len(self._fed), len(tokens))
        limit = min(len(self._fed), len(tokens))
        while shared < limit and self._fed[shared] == tokens[shared]:
            shared += 1
        return shared

    def _rollback(self, length: int) -> None:
        """Keep the cache's first ``length`` positions."""
        if length < len(self._fed):
            self._cache.crop(length)
            del self._fed[length:]
            self._logits = None

    def _feed(self, tokens: Sequence[int]) -> None:
        """Run ``tokens`` after the fed ones; keeps the last one's logits."""
        if not tokens:
            return
        start = len(self._fed)
        ids = torch.tensor(list(tokens), device=self._device)
        positions = torch.arange(start, start + len(tokens), device=self._device)
        self._logits = self._model.step(ids, positions, self._cache, last_only=True)[0]
        self._fed.extend(tokens)

    def _grow(self, budget: int, first_position: int) -> TokenTree:
        """The tree after the fed context, whose root's children sit at sequence position ``first_position``."""
        assert self._logits is not None
        chain = budget <= self._shape.depth  # a small budget: the likeliest path, one row a step
        depth = min(self._shape.depth, budget)
        beam = 1 if chain else min(self._shape.beam, budget)
        branching = 1 if chain else self._shape.branching
        context = len(self._fed)  # cache entries every tree node sees
        gumbels = self._level_noise(depth, first_position)
        children = (
            greedy_children(self._vocab_ids, branching)
            if gumbels is None
            else self._coupled_children(gumbels, branching)
        )

        def step(features: torch.Tensor, tokens: torch.Tensor, paths: torch.Tensor, level: int) -> StepOut:
            return self._forward_level(tokens, paths, first_position + level - 1, context)

        # The model has no features to pass down the tree: a one-column placeholder rides along.
        placeholder = torch.zeros(1, device=self._device)
        prune = placeable(budget) if self._prunes else None
        levels = grow_levels(placeholder, self._logits, depth, beam, children, step, prune)
        self._cache.crop(context)
        return best_subtree(on_host(levels), budget)

    def _level_noise(self, depth: int, first_position: int) -> torch.Tensor | None:
        """Coupled drafts: the target's keyed noise at each level's position, [depth, vocab] (None: greedy)."""
        if self._coupled is None or self._coupled.seed is None:
            return None
        noise = PositionNoise(self._coupled.seed, first_position)
        return torch.stack([noise.gumbel(level, self._noise_ids) for level in range(depth)]).to(self._device)

    def _coupled_children(self, gumbels: torch.Tensor, branching: int) -> Children:
        """Each frontier node's Gumbel top-k under q (the session's temperature, top-k and top-p) with the level's
        keyed noise; the child of rank r carries the r-th largest q (``head_proposer``'s coupled drafts)."""
        sampling = self._coupled
        assert sampling is not None

        def children(logits: torch.Tensor, frontier: torch.Tensor, cumulative: torch.Tensor, level: int) -> Level:
            shaped = torch.log(target_probs(logits, sampling))
            top = torch.topk(shaped.double() + gumbels[level - 1], branching, dim=-1)
            log_q = torch.topk(shaped, branching, dim=-1).values.double()
            log_q = log_q.masked_fill(top.values == float("-inf"), float("-inf"))  # never a token q has no mass for
            return level_of(self._vocab_ids[top.indices], frontier, cumulative, log_q)

        return children

    def _forward_level(self, tokens: torch.Tensor, paths: torch.Tensor, position: int, context: int) -> StepOut:
        """One level's nodes in one step, each over the context, its ancestors and itself; their entries stay in
        the cache (the tree's, dropped after it)."""
        rows, entries = paths.shape
        allowed = torch.ones(rows, context + entries + rows, dtype=torch.bool, device=self._device)
        allowed[:, context : context + entries] = paths
        allowed[:, context + entries :] = torch.eye(rows, dtype=torch.bool, device=self._device)
        positions = torch.full((rows,), position, dtype=torch.long, device=self._device)
        logits = self._model.step(tokens, positions, self._cache, allowed)
        return torch.zeros(rows, 1, device=self._device), logits
