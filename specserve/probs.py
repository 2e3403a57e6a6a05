"""The target distribution p that sampling parameters define over a model's logits (torch).

The verifier accepts against it and a drafter that samples with the same keyed noise drafts from the same
transform of its own logits.
"""

from __future__ import annotations

import torch

from specserve.sampling import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p: the distribution the target samples from, for each row of logits.

    logits: [n, vocab] -> probs: [n, vocab] (float32). Temperature first, then
    top-k, then top-p over what is left, as Hugging Face's warpers do.
    """
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most
        # likely token is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)
