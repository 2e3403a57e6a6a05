"""Merging the draft sources' trees into the one tree a round verifies.

Every source proposes a tree. The builder merges them into a trie (shared
prefixes become one node, credited to every source that proposed it), scores
each node by the estimated probability that the verifier accepts it, and
keeps the nodes that pay for their verification cost.

Scores: a node's acceptance probability is estimated per source and per
depth from the verifier's past decisions (``AcceptanceStats``, learnt online
for the session); a node's score is the product of these estimates along its
path, i.e. the estimated probability that the whole path is accepted. The
expected tokens committed by a tree is then 1 + the sum of its nodes' scores.
A source that gives its draft probability q for a node (the draft model)
gets it calibrated: the node is credited to ``source@q<bucket>`` (tenths of
q), whose estimate starts from q itself and learns how often such nodes are
really accepted. An uncertain draft thus scores low and is left out when it
does not pay for its verification: entropy gating with a learnt threshold.

Size: verifying n nodes costs c(n) target-forward units (``VerifyCost``: the
session's verifier's measured curve, else ``CPU_VERIFY_COST``), so the builder keeps the n
best-scoring nodes that maximise (1 + sum of scores) / c(n). On a CPU, where
c(n) grows quickly, that is often a short chain, and sometimes nothing. A
source the drafter has not seen verified yet is tried first (``EXPLORE_TRIES``):
its prior alone would keep it out for good.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from draft_service.draft_tree import EMPTY, DraftTree
from specserve.token_tree import ROOT, TokenTree

# c(n)/c(0): forward time of the pending token plus n nodes, relative to plain
# decoding, for the packaged SmolLM2-135M at a 512-token context on a CPU
# (`make bench-verify-cost`; chains and trees of n nodes cost the same), kept
# monotone. Only a fallback: a session sizes its trees by its own verifier's
# measured curve, which it sends, because curves differ by machine several-fold
# (see docs/benchmarks.md, "The engine's step").
CPU_VERIFY_COST: dict[int, float] = {0: 1.0, 1: 1.6, 3: 1.6, 7: 1.64, 15: 1.72, 31: 2.2, 63: 3.3}


@dataclass(frozen=True)
class VerifyCost:
    """Relative verify cost by tree size, linearly interpolated between measured points.

    The default is the CPU curve above; a verifier that measured its own sends it with each session
    (``from_points``), so trees are cut at what verification costs where they are verified: a GPU's
    nearly flat curve keeps trees that a CPU's would cut.
    """

    points: dict[int, float] = field(default_factory=lambda: dict(CPU_VERIFY_COST))

    @classmethod
    def from_points(cls, points: Sequence[tuple[int, float]]) -> VerifyCost:
        """A curve from (nodes, relative cost) points; ValueError, saying what is wrong, on a curve unfit to use."""
        curve = dict(points)
        if len(curve) != len(points):
            raise ValueError("verify_cost names a tree size twice")
        if len(curve) < 2 or 0 not in curve:
            raise ValueError("verify_cost needs the cost at 0 nodes and at least one larger tree")
        if any(n < 0 for n in curve):
            raise ValueError("verify_cost has a negative tree size")
        if not all(math.isfinite(c) and c > 0 for c in curve.values()):
            raise ValueError("verify_cost has a cost that is not a positive number")
        return cls(curve)

    def __call__(self, nodes: int) -> float:
        sizes = sorted(self.points)
        if nodes <= sizes[0]:
            return self.points[sizes[0]]
        if nodes >= sizes[-1]:
            last, before = sizes[-1], sizes[-2]
            slope = (self.points[last] - self.points[before]) / (last - before)
            return self.points[last] + slope * (nodes - last)
        right = bisect.bisect_left(sizes, nodes)
        lo, hi = sizes[right - 1], sizes[right]
        weight = (nodes - lo) / (hi - lo)
        return self.points[lo] + weight * (self.points[hi] - self.points[lo])


@dataclass
class AcceptanceStats:
    """P(a node at this depth is accepted | its parent was), per source, learnt online.

    A Beta prior keeps a fresh session from trusting or distrusting a source
    too soon: its mean is the ``parent`` statistics' estimate (the drafter's
    experience over all sessions) or ``prior``, worth ``prior_weight``
    observations. Updates go to the parent too.
    """

    parent: AcceptanceStats | None = None
    prior: float = 0.3
    prior_weight: float = 4.0
    max_depth: int = 16
    _counts: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def estimate(self, source: str, depth: int, prior: float | None = None) -> float:
        """Beta-mean estimate; ``prior`` (when given) replaces the default prior at the root of the chain."""
        depth = min(depth, self.max_depth)
        accepted, reached = self._counts.get((source, depth), (0.0, 0.0))
        if self.parent is not None:
            mean = self.parent.estimate(source, depth, prior)
        else:
            mean = self.prior if prior is None else prior
        return (accepted + mean * self.prior_weight) / (reached + self.prior_weight)

    def experience(self, source: str, depth: int = 1) -> float:
        """How many of ``source``'s nodes at ``depth`` the widest statistics (the root parent's) saw verified."""
        root = self
        while root.parent is not None:
            root = root.parent
        return root._counts.get((source, min(depth, self.max_depth)), (0.0, 0.0))[1]

    @property
    def num_counts(self) -> int:
        """(source, depth) pairs counted here (not in ``parent``)."""
        return len(self._counts)

    def clear(self) -> None:
        """Forget what was learnt here (estimates fall back on ``parent`` or the prior)."""
        self._counts.clear()

    def update(self, source: str, depth: int, accepted: bool) -> None:
        depth = min(depth, self.max_depth)
        counts = self._counts.setdefault((source, depth), [0.0, 0.0])
        counts[0] += accepted
        counts[1] += 1
        if self.parent is not None:
            self.parent.update(source, depth, accepted)


@dataclass
class _TrieNode:
    token: int
    parent: int
    depth: int
    sources: dict[str, float | None]  # credited label -> its prior (a draft probability) or None
    score: float = 0.0


CONFIDENCE_BUCKETS = 10
# Tries of an unproven source: its best chain is drafted, when nothing else would be, until this many of its
# first nodes were verified by this drafter. At the default prior a source's nodes seldom pay on a CPU
# (1 + 0.3 < c(1) = 1.6), so without a try it would never be verified and its estimate never learnt.
EXPLORE_TRIES = 4


def credit_label(source: str, q: float | None) -> str:
    """The label a node's acceptance is learnt under: the source, or the source and q's bucket."""
    if q is None:
        return source
    return f"{source}@q{min(CONFIDENCE_BUCKETS - 1, int(q * CONFIDENCE_BUCKETS))}"


def source_names(labels: Iterable[str]) -> frozenset[str]:
    """The sources behind credit labels (``credit_label``: a source's name, or its name and a bucket of q)."""
    return frozenset(label.split("@", 1)[0] for label in labels)


class TreeBuilder:
    def __init__(self, stats: AcceptanceStats, cost: VerifyCost) -> None:
        self.stats = stats
        self.cost = cost

    def build(self, proposals: Sequence[tuple[str, TokenTree]], max_nodes: int) -> DraftTree:
        nodes = self._scored(proposals)
        if not nodes or max_nodes <= 0:
            return EMPTY
        # Scores shrink along every path, so a best-first prefix is closed under "parent of".
        ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:max_nodes]
        keep = ranked[: self._best_size([nodes[i].score for i in ranked])] or self._exploration(nodes, max_nodes)
        return self._emit(nodes, keep)

    def _exploration(self, nodes: list[_TrieNode], max_nodes: int) -> list[int]:
        """The best chain of a source this drafter has not tried ``EXPLORE_TRIES`` times yet, else nothing.

        Only sources without a draft probability: one with q starts from q, so its confident nodes draft anyway.
        """
        roots = [i for i, node in enumerate(nodes) if node.parent == ROOT]
        for first in sorted(roots, key=lambda i: (-nodes[i].score, i)):
            untried = [
                label
                for label, q in nodes[first].sources.items()
                if q is None and self.stats.experience(label) < EXPLORE_TRIES
            ]
            if not untried:
                continue
            chain = [first]
            while len(chain) < max_nodes:
                children = [i for i, n in enumerate(nodes) if n.parent == chain[-1] and untried[0] in n.sources]
                if not children:
                    break
                chain.append(max(children, key=lambda i: nodes[i].score))
            return chain
        return []

    def first_tokens(self, proposals: Sequence[tuple[str, TokenTree]]) -> list[int]:
        """The tokens the sources propose right after the context, likeliest first (no size cut)."""
        nodes = [node for node in self._scored(proposals) if node.parent == ROOT]
        return [node.token for node in sorted(nodes, key=lambda node: -node.score)]

    def _scored(self, proposals: Sequence[tuple[str, TokenTree]]) -> list[_TrieNode]:
        nodes = self._merge(proposals)
        for node in nodes:  # parents come before children
            parent_score = 1.0 if node.parent == ROOT else nodes[node.parent].score
            estimates = (self.stats.estimate(label, node.depth, q) for label, q in node.sources.items())
            node.score = parent_score * max(estimates)
        return nodes

    def _best_size(self, ranked_scores: list[float]) -> int:
        best_size, best_rate, expected = 0, 1.0 / self.cost(0), 1.0
        for size, score in enumerate(ranked_scores, start=1):
            expected += score
            rate = expected / self.cost(size)
            if rate > best_rate:
                best_size, best_rate = size, rate
        return best_size

    @staticmethod
    def _merge(proposals: Sequence[tuple[str, TokenTree]]) -> list[_TrieNode]:
        nodes: list[_TrieNode] = []
        index: dict[tuple[int, int], int] = {}
        for source, tree in proposals:
            mapped: list[int] = []
            probs: tuple[float | None, ...] = tree.node_probs or (None,) * len(tree)
            for token, parent, q in zip(tree.token_ids, tree.parents, probs, strict=True):
                trie_parent = ROOT if parent == ROOT else mapped[parent]
                key = (trie_parent, token)
                if key not in index:
                    depth = 1 if trie_parent == ROOT else nodes[trie_parent].depth + 1
                    index[key] = len(nodes)
                    nodes.append(_TrieNode(token, trie_parent, depth, {}))
                nodes[index[key]].sources[credit_label(source, q)] = q
                mapped.append(index[key])
        return nodes

    @staticmethod
    def _emit(nodes: list[_TrieNode], keep: list[int]) -> DraftTree:
        # Shallow first, best sibling first: parents precede children and the
        # verifier tries the likelier sibling first.
        order = sorted(keep, key=lambda i: (nodes[i].depth, -nodes[i].score, i))
        position = {trie_index: k for k, trie_index in enumerate(order)}
        tree = TokenTree(
            tuple(nodes[i].token for i in order),
            tuple(ROOT if nodes[i].parent == ROOT else position[nodes[i].parent] for i in order),
        )
        return DraftTree(
            tree,
            tuple(frozenset(nodes[i].sources) for i in order),
            tuple(nodes[i].score for i in order),
        )


def is_accepted_path(tree: TokenTree, accepted: Sequence[int], committed: Sequence[int]) -> bool:
    """Whether ``accepted`` (node indices) is a root-to-node path of ``tree`` spelling ``committed``'s start."""
    if len(accepted) > len(committed):
        return False
    parent = ROOT
    for node, token in zip(accepted, committed, strict=False):
        if not 0 <= node < len(tree) or tree.parents[node] != parent or tree.token_ids[node] != token:
            return False
        parent = node
    return True


def learn_from_acceptance(stats: AcceptanceStats, last: DraftTree, accepted: Sequence[int]) -> None:
    """Credit each node of the last tree whose parent was accepted: accepted if the verifier took it.

    ``accepted`` are the verifier's own node indices, root to leaf (checked
    with ``is_accepted_path`` by the caller).
    """
    children = last.tree.children()
    depths = last.tree.depths()
    path = [ROOT, *accepted]
    for step, node in enumerate(path):
        taken = path[step + 1] if step + 1 < len(path) else None
        for child in children[node]:
            for source in last.sources[child]:
                stats.update(source, depths[child], child == taken)


def likely_outcomes(last: DraftTree, count: int, certain: Sequence[bool] = ()) -> list[tuple[int, ...]]:
    """The accepted paths (as tokens) of ``last`` that the verifier most likely returns, likeliest first.

    The path to node n is the whole acceptance when n is accepted and none of
    its children is: probability ~ score(n) - the sum of its children's
    scores (scores estimate path acceptance). The draft's own most probable
    path, accepted whole, always comes first. An empty tree has one outcome:
    nothing accepted. ``certain``: per node, whether it is accepted whenever
    its parent is (a token a grammar forces); no path ends at its parent.
    """
    tree, scores = last.tree, last.scores
    children = tree.children()

    def score(node: int) -> float:
        return 1.0 if node == ROOT else scores[node]

    def ends_here(node: int) -> bool:
        return not (certain and any(certain[c] for c in children[node]))

    best = ROOT
    while children[best]:
        best = max(children[best], key=score)
    alone = {node: score(node) - sum(score(c) for c in children[node]) for node in children if ends_here(node)}
    ranked = [best, *sorted((n for n in alone if n != best), key=lambda n: (-alone[n], n))][:count]
    paths = []
    for node in ranked:
        path: list[int] = []
        while node != ROOT:
            path.append(tree.token_ids[node])
            node = tree.parents[node]
        paths.append(tuple(reversed(path)))
    return paths
