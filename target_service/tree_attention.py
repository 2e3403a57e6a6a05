"""Tensor plumbing for verifying a token tree in one forward pass.

The forward input is the pending token (the last committed one, not yet in
the KV cache) followed by the tree's nodes. Each input attends to the whole
cache, to the pending token, and to its own ancestors in the tree (itself
included); positions are depth-based, so every root-to-leaf path sees exactly
the positions plain decoding of that path would.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specserve.token_tree import TokenTree
from specserve.tree_masks import additive_mask, ancestor_matrix


def tree_inputs(
    tree: TokenTree, pending_token: int, num_cached: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, n+1], position_ids [1, n+1], additive attention mask [1, 1, n+1, num_cached+n+1])."""
    n = len(tree)
    parents = torch.tensor(tree.parents, dtype=torch.long, device=device)
    depths = torch.tensor(tree.depths(), dtype=torch.long, device=device)
    max_depth = int(depths.max()) if n else 0
    input_ids = torch.tensor([[pending_token, *tree.token_ids]], device=device)
    positions = num_cached + torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths])
    allowed = torch.ones(n + 1, num_cached + n + 1, dtype=torch.bool, device=device)
    allowed[:, num_cached + 1 :] = False
    if n:
        allowed[1:, num_cached + 1 :] = ancestor_matrix(parents, max_depth)
    return input_ids, positions[None], additive_mask(allowed, dtype)


def keep_path(cache: DynamicCache, num_cached: int, path: list[int]) -> None:
    """Cut the cache to the committed context: cached tokens, the pending token, then ``path``'s nodes.

    The accepted nodes' keys and values are moved into place (they were
    computed with the right positions and ancestors), so nothing is recomputed
    and rejected branches leave no trace.
    """
    keep = torch.tensor([*range(num_cached + 1), *(num_cached + 1 + node for node in path)])
    layer: Any
    for layer in cache.layers:
        keep_here = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, keep_here)
        layer.values = layer.values.index_select(-2, keep_here)
