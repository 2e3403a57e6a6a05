"""How often the head's drafts are what the target says, on held-out distillation data.

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
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, truncate_cache


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
        features = seq["features"].float()
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
def draft_step_ms(head: DraftHead, context: int = 256, repeats: int = 30) -> float:
    """Median time of one draft step (one token) on top of ``context`` cached positions."""
    hidden = head.config.hidden_size
    cache = DynamicCache()
    head(torch.randn(1, context, hidden), torch.zeros(1, context, dtype=torch.long), past_key_values=cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        head(torch.randn(1, 1, hidden), torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
        times.append((time.perf_counter() - start) * 1000)
        truncate_cache(cache, context)
    return sorted(times)[len(times) // 2]
