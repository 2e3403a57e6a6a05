"""How often the head's drafts are what the target says, on held-out distillation data.

Three measures, all on held-out answers (prompts never trained on and not in
Spec-Bench), all against the target's greedy token:

* ``top1_agreement``: at every answer position, teacher-forced, whether the
  head's first draft is the target's next token;
* ``chain_acceptance``: chains of drafts fed back on the head's own features;
* ``tree_acceptance``: the dynamic trees the drafter serves (``HeadProposer``),
  walked along the target's answer: the expected acceptance length of the head
  alone, had the verifier taken every node.

For sampled positions t of held-out responses, the head starts from the
target's true feature f_t and token x_{t+1} (what the drafter has after a
Verify) and drafts a chain of ``depth`` tokens, feeding its own predicted
features back as it will when serving. A draft token counts while it equals
the target's greedy token there; the chain stops at the first miss. The mean
number of accepted tokens plus one (the bonus) estimates tau for chain drafts
of that depth from the head alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, truncate_cache
from draft_service.head_layer import HeadCache
from draft_service.head_proposer import HeadProposer, TreeShape
from draft_service.head_types import ServingHead
from specserve.results import DraftFeedback
from specserve.token_tree import ROOT, TokenTree


@dataclass(frozen=True)
class ChainEvaluation:
    positions: int
    depth: int
    accepted_at_depth: list[float]  # fraction of positions whose chain reached each depth
    mean_accepted: float

    @property
    def estimated_tau(self) -> float:
        return 1.0 + self.mean_accepted


@torch.inference_mode()
def chain_acceptance(
    head: DraftHead, sequences: Sequence[dict[str, Any]], depth: int = 5, positions: int = 400, seed: int = 0
) -> ChainEvaluation:
    rng = random.Random(seed)
    candidates = [
        (i, t)
        for i, seq in enumerate(sequences)
        for t in range(int(seq["prompt_length"]) - 1, int(seq["tokens"].shape[0]) - depth - 1)
    ]
    chosen = rng.sample(candidates, min(positions, len(candidates)))
    reached = [0] * depth
    total = 0
    for index, t in chosen:
        seq = sequences[index]
        features = seq["features"].to(head.draft_lm_head.dtype)  # the head computes in its own dtype
        tokens = seq["tokens"].long()
        argmax = seq["argmax"].long()
        cache = DynamicCache()
        # Context: (f_s, x_{s+1}) for s <= t, as the drafter holds after a Verify.
        out = head(features[None, : t + 1], tokens[None, 1 : t + 2], past_key_values=cache)
        feature, logits = out.features[:, -1:], out.logits[0, -1]
        accepted = 0
        for d in range(depth):
            draft = int(head.draft_vocab[int(logits.argmax())])
            if draft != int(argmax[t + 1 + d]):
                break
            accepted += 1
            reached[d] += 1
            step = head(feature, torch.tensor([[draft]]), past_key_values=cache)
            feature, logits = step.features, step.logits[0, -1]
        total += accepted
    n = max(1, len(chosen))
    return ChainEvaluation(len(chosen), depth, [r / n for r in reached], total / n)


@torch.inference_mode()
def top1_agreement(head: DraftHead, sequences: Sequence[dict[str, Any]]) -> float:
    """Fraction of answer positions where the head's first draft is the target's greedy token."""
    agree = total = 0
    for seq in sequences:
        start, n = int(seq["prompt_length"]) - 1, int(seq["tokens"].shape[0])
        if n - 1 <= start:
            continue
        out = head(seq["features"][None, : n - 1].to(head.draft_lm_head.dtype), seq["tokens"][None, 1:].long())
        drafts = head.draft_vocab[out.logits[0].argmax(dim=-1)]
        agree += int((drafts[start:] == seq["argmax"][start + 1 :].long()).sum())
        total += n - 1 - start
    return agree / max(1, total)


@dataclass(frozen=True)
class TreeEvaluation:
    positions: int
    max_nodes: int
    mean_accepted: float

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward, the bonus token included."""
        return 1.0 + self.mean_accepted


def accepted_length(tree: TokenTree, truth: Sequence[int]) -> int:
    """How many tokens of ``truth`` a path of ``tree`` from the root matches."""
    children: dict[int, dict[int, int]] = {}
    for index, (token, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, index)
    node, depth = ROOT, 0
    while depth < len(truth) and truth[depth] in children.get(node, {}):
        node = children[node][truth[depth]]
        depth += 1
    return depth


@torch.inference_mode()
def tree_acceptance(
    head: ServingHead, sequences: Sequence[dict[str, Any]], positions: int = 400, shape: TreeShape | None = None
) -> TreeEvaluation:
    """The drafter's dynamic trees from sampled answer positions, walked along the target's greedy answer."""
    shape = shape or TreeShape()
    rng = random.Random(0)
    candidates = [
        (i, t)
        for i, seq in enumerate(sequences)
        for t in range(int(seq["prompt_length"]) - 1, int(seq["tokens"].shape[0]) - 2)
    ]
    chosen = sorted(rng.sample(candidates, min(positions, len(candidates))))
    total = 0
    proposer: HeadProposer | None = None
    current = -1
    for index, t in chosen:
        seq = sequences[index]
        if index != current:  # a new session: the drafter sees this sequence's features as they arrive
            proposer, current = HeadProposer(head, shape), index
        assert proposer is not None
        known = proposer.features.end
        features = seq["features"][known : t + 1].numpy().astype(np.float16)
        proposer.observe(DraftFeedback(features=features))
        tokens = seq["tokens"][: t + 2].tolist()
        while proposer.digest(tokens):
            pass
        tree = proposer.propose(tokens, shape.max_nodes)
        total += accepted_length(tree, seq["argmax"][t + 1 :].tolist())
    n = max(1, len(chosen))
    return TreeEvaluation(len(chosen), shape.max_nodes, total / n)


def held_out_figures(head: DraftHead, sequences: Sequence[dict[str, Any]], positions: int = 400) -> dict[str, Any]:
    """Top-1 agreement, chain and dynamic-tree acceptance (from ``positions`` sampled positions) as one record."""
    chain = chain_acceptance(head, sequences, positions=positions)
    tree = tree_acceptance(head, sequences, positions)
    return {
        "answer_positions": sum(int(s["tokens"].shape[0]) - int(s["prompt_length"]) for s in sequences),
        "top1_agreement": round(top1_agreement(head, sequences), 4),
        "chain": {**asdict(chain), "estimated_tau": round(chain.estimated_tau, 3)},
        "tree": {**asdict(tree), "acceptance_length": round(tree.acceptance_length, 3)},
    }


@torch.inference_mode()
def draft_step_ms(head: DraftHead, context: int = 256, repeats: int = 30) -> float:
    """Median time of one draft step (one token) on top of ``context`` cached positions, as the drafter
    serves it (``DraftHead.step``)."""
    hidden, dtype = head.config.hidden_size, head.draft_lm_head.dtype
    cache = HeadCache()
    head.step(
        torch.randn(context, hidden, dtype=dtype), torch.zeros(context, dtype=torch.long), torch.arange(context), cache
    )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        head.step(torch.randn(1, hidden, dtype=dtype), torch.zeros(1, dtype=torch.long), torch.tensor([context]), cache)
        times.append((time.perf_counter() - start) * 1000)
        truncate_cache(cache, context)
    return sorted(times)[len(times) // 2]
