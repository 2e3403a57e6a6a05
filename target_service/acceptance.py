"""Acceptance rules: which path of a draft tree the target keeps, and its bonus token.

Pure functions over the target's scores at every tree position. Row 0 holds
the target's prediction after the last committed token; row i + 1 its
prediction after tree node i (given that node's ancestors).

Both rules are lossless:
- greedy: walk down from the root, each step taking the first child whose
  token is the target's argmax; the bonus is the argmax where the walk stops.
  This commits exactly what greedy decoding would.
- sampling, at a node whose children are all deterministic (n-gram pools,
  token recycling, top-k expansions): the target draws its own token from p
  with the position's keyed uniform (``keyed_noise``) and the walk follows
  the child holding it, exactly as greedy follows the argmax; the bonus is
  that draw where the walk stops. This is the one-hot-q case of speculative
  sampling with the same acceptance probability (a deterministic child x is
  kept with probability p(x)), and it commits what plain decoding with the
  same seed commits, whatever was drafted.
- sampling, at a node with children sampled from a draft distribution q:
  recursive rejection sampling over the children (SpecInfer's multi-step
  speculative sampling). With residual r = p, each child x is tried in order
  with its draft distribution q_x: accepted with probability
  min(1, r(x) / q_x(x)); on rejection r becomes the normalised
  max(r - q_x, 0). Deterministic siblings have one-hot q; sampled children
  use q with the earlier sampled siblings removed (sampling without
  replacement). Every step is a standard speculative sampling step targeting
  r, so the committed token is distributed exactly as p (Leviathan et al.
  2023; Chen et al. 2023; Miao et al. 2024). When no child is accepted the
  bonus token is drawn from r. The draws come from a generator keyed by the
  position, so the result is reproducible for the same seed and drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.keyed_noise import PositionNoise
from specserve.token_tree import ROOT, TokenTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root first
    bonus_token: int  # the target's own token after them

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def accept_greedy(tree: TokenTree, target_argmax: Sequence[int]) -> Acceptance:
    """Longest path whose every token is the target's argmax at its parent; ties go to the lower index."""
    _check_rows(tree, len(target_argmax))
    children = tree.children()
    path: list[int] = []
    node = ROOT
    while True:
        want = target_argmax[node + 1]
        nxt = next((c for c in children[node] if tree.token_ids[c] == want), None)
        if nxt is None:
            return Acceptance(path, int(want))
        path.append(nxt)
        node = nxt


def accept_sampled(tree: TokenTree, p: torch.Tensor, noise: PositionNoise) -> Acceptance:
    """Lossless sampled acceptance down the tree; p: [len(tree) + 1, vocab] target probabilities.

    ``noise`` supplies the draws for each depth: offset d is the position of
    the token that row (node at depth d - 1) + 1 predicts.
    """
    _check_rows(tree, p.shape[0])
    children = tree.children()
    path: list[int] = []
    node = ROOT
    while True:
        kids = children[node]
        row = p[node + 1].double()
        if any(tree.is_sampled(child) for child in kids):
            generator = noise.generator(len(path))
            accepted, residual = _try_children(tree, node, kids, row, generator)
            if accepted is None:
                return Acceptance(path, int(torch.multinomial(residual, 1, generator=generator)))
        else:
            token = noise.sample(row, len(path))
            accepted = next((child for child in kids if tree.token_ids[child] == token), None)
            if accepted is None:
                return Acceptance(path, token)
        path.append(accepted)
        node = accepted


def _try_children(
    tree: TokenTree, node: int, children: list[int], residual: torch.Tensor, generator: torch.Generator
) -> tuple[int | None, torch.Tensor]:
    """Try ``node``'s children in order; returns (accepted child or None, residual for the bonus)."""
    dist = tree.distribution_at(node)
    q_left: torch.Tensor | None = None
    if dist is not None:
        q_left = torch.zeros_like(residual)
        q_left[list(dist.token_ids)] = torch.tensor(dist.probs, dtype=residual.dtype)
    for child in children:
        token = tree.token_ids[child]
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if tree.is_sampled(child) and q_left is not None:
            q = q_left / q_left.sum()
            if u * float(q[token]) < float(residual[token]):
                return child, residual
            rest = torch.clamp(residual - q, min=0.0)
            q_left[token] = 0.0
        else:
            if u < float(residual[token]):
                return child, residual
            rest = residual.clone()
            rest[token] = 0.0
        total = float(rest.sum())
        if total <= 0.0:
            # A rejection with r == q happens only through rounding; r is then the right answer.
            return None, residual
        residual = rest / total
    return None, residual


def _check_rows(tree: TokenTree, rows: int) -> None:
    if rows != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} target rows for a tree of {len(tree)} nodes, got {rows}")
