"""Attention masks for token trees, shared by the verifier and the draft head.

Both run a model over tree nodes on top of a KV cache, where each node may
attend to the cached context and to its own ancestors only.
"""

from __future__ import annotations

import torch


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when j is i or an ancestor of i.

    One vectorised step per tree level: follow every node's parent pointer at
    once, ``max_depth`` times.
    """
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    ancestors = torch.eye(n, dtype=torch.bool, device=parents.device)
    current = parents.clone()
    for _ in range(max_depth - 1):
        alive = current >= 0
        ancestors[rows[alive], current[alive]] = True
        current = torch.where(alive, parents[current.clamp(min=0)], current)
    return ancestors


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[q, kv] bool (True: may attend) -> the model's additive mask [1, 1, q, kv] in ``dtype``."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
