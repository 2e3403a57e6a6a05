"""Growing a draft head's dynamic tree a level at a time, as tensor operations on the head's device (EAGLE-2).

Each level takes every frontier node's ``branching`` likeliest children at once, their paths' cumulative log
probabilities, the next frontier as the ``beam`` likeliest of them, and one head step over that frontier with
its tree mask. Nothing reads a value on the host until the tree is done (``on_host``): on a GPU the whole
loop is a fixed sequence of kernels, which ``head_graphs`` captures in a CUDA graph. How a level's head step
reaches its keys and values (a session's growing cache, or fixed slots) is the caller's ``LevelStep``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from specserve.token_tree import ROOT


@dataclass(frozen=True)
class Level:
    """One depth's nodes on the head's device, [n] each, in the order their parents were expanded."""

    tokens: torch.Tensor  # target token ids
    parents: torch.Tensor  # index of each node's parent among all the tree's nodes (ROOT: the root's)
    log_q: torch.Tensor  # log of the draft probability given the parent (-inf: no draft, q had no mass)
    cumulative: torch.Tensor  # log of the path's draft probability


@dataclass
class Node:
    """A drafted node on the host."""

    token: int
    parent: int
    q: float  # draft probability given the parent
    log_prob: float  # cumulative: log of the path's draft probability
    depth: int


StepOut = tuple[torch.Tensor, torch.Tensor]
"""A head step's predicted features [n, hidden] and draft logits [n, vocab]."""

LevelStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], StepOut]
"""One level's head step: (each node's parent's predicted feature [n, hidden], the nodes' tokens [n], the tree's
earlier entries on each node's path [n, entries], the level) -> (predicted features [n, hidden], draft logits
[n, vocab]); the nodes' keys and values become the tree's next ``n`` entries."""

Children = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Level]
"""A level's children: (frontier logits [f, vocab], frontier node indices [f], their cumulative log
probabilities [f], the level) -> the children, ``branching`` per frontier node, parent by parent."""

Prune = Callable[[list[Level], torch.Tensor], torch.Tensor]
"""Which of the chosen frontier nodes (indices into the last level) to expand; an empty result ends the tree."""


def greedy_children(draft_vocab: torch.Tensor, branching: int) -> Children:
    """Each frontier node's top-``branching`` children under its draft distribution q."""

    def children(logits: torch.Tensor, frontier: torch.Tensor, cumulative: torch.Tensor, level: int) -> Level:
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), branching, dim=-1)
        return level_of(draft_vocab[top.indices], frontier, cumulative, top.values.double())

    return children


def level_of(tokens: torch.Tensor, frontier: torch.Tensor, cumulative: torch.Tensor, log_q: torch.Tensor) -> Level:
    """The level of children ``tokens`` [f, branching] with their log q, under ``frontier`` [f]."""
    count = tokens.numel()
    branching = tokens.shape[1]
    return Level(
        tokens=tokens.reshape(count),
        # Not repeat_interleave: with a count it reads its output size on the host, a GPU synchronisation.
        parents=frontier[:, None].expand(-1, branching).reshape(count),
        log_q=log_q.reshape(count),
        cumulative=(cumulative[:, None] + log_q).reshape(count),
    )


def frontier_sizes(depth: int, beam: int, branching: int) -> list[int]:
    """Nodes each head step runs on: levels 1 to depth - 1 (the last level is never expanded)."""
    sizes: list[int] = []
    frontier = 1
    for _ in range(depth - 1):
        frontier = min(beam, frontier * branching)
        sizes.append(frontier)
    return sizes


def grow_levels(
    feature: torch.Tensor,  # [hidden]: the root's predicted feature
    logits: torch.Tensor,  # [vocab]: the root's draft logits
    depth: int,
    beam: int,
    children: Children,
    step: LevelStep,
    prune: Prune | None = None,
) -> list[Level]:
    """The tree's levels, 1 to ``depth``; each frontier the ``beam`` likeliest nodes of its level (``prune``
    may drop some, and ending it early ends the tree)."""
    features, frontier_logits = feature[None], logits[None]
    device = feature.device
    frontier = torch.full((1,), ROOT, dtype=torch.long, device=device)
    cumulative = torch.zeros(1, dtype=torch.float64, device=device)
    # [f, entries]: the tree's entries (frontier nodes of earlier levels) on each frontier node's path.
    paths = torch.zeros(1, 0, dtype=torch.bool, device=device)
    levels: list[Level] = []
    first = 0  # index of the level's first node among all nodes
    for level in range(1, depth + 1):
        grown = children(frontier_logits, frontier, cumulative, level)
        levels.append(grown)
        if level == depth:
            break
        chosen = torch.topk(grown.cumulative, min(beam, grown.tokens.shape[0])).indices
        if prune is not None:
            chosen = prune(levels, chosen)
            if not len(chosen):
                break
        branching = grown.tokens.shape[0] // frontier.shape[0]
        rows = torch.div(chosen, branching, rounding_mode="floor")  # each chosen node's parent row
        features, frontier_logits = step(features[rows], grown.tokens[chosen], paths[rows], level)
        frontier, cumulative = first + chosen, grown.cumulative[chosen]
        paths = torch.cat([paths[rows], torch.eye(len(chosen), dtype=torch.bool, device=device)], dim=1)
        first += grown.tokens.shape[0]
    return levels


def placeable(budget: int) -> Prune:
    """Keep the chosen nodes whose children could still be among the ``budget`` most probable.

    A child's path is no more probable than its parent's, and at equal probability the deeper node ranks
    after (``head_proposer``'s best subtree): a parent no more probable than the ``budget``-th best node has
    no child that makes the cut, so expanding it (a head forward, when it is the whole frontier) changes no
    tree. It reads a value on the host, so only a CPU head, where that costs nothing, prunes; a GPU's rows
    are nearly free and its loop stays one fixed sequence of kernels.
    """

    def prune(levels: list[Level], chosen: torch.Tensor) -> torch.Tensor:
        every = torch.cat([level.cumulative for level in levels])
        kth = torch.topk(every, budget).values[-1] if len(every) >= budget else float("-inf")
        return chosen[levels[-1].cumulative[chosen] > kth]

    return prune


def on_host(levels: list[Level]) -> list[Node]:
    """The levels' nodes as host values: the round's one transfer from the head's device."""
    columns = [torch.cat([getattr(level, column.name).double() for level in levels]) for column in fields(Level)]
    tokens, parents, log_q, cumulative = torch.stack(columns).cpu().tolist()
    depths = [depth for depth, level in enumerate(levels, start=1) for _ in range(len(level.tokens))]
    return [
        Node(int(token), int(parent), max(math.exp(lq), 1e-12), cum, depth)
        for token, parent, lq, cum, depth in zip(tokens, parents, log_q, cumulative, depths, strict=True)
    ]
