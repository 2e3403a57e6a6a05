"""Token trees: the unit of work between drafters and the verifier.

A tree is flat: node ``i`` has token ``token_ids[i]`` and parent ``parents[i]``;
parent ``-1`` means "child of the last committed token". Parents come before
their children, so one forward scan visits every node after its ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROOT = -1


class InvalidTreeError(ValueError):
    """A tree violates the wire contract; the message names the problem."""


@dataclass(frozen=True)
class DraftDistribution:
    """A sparse draft distribution q at one node, from which some of its children were sampled.

    ``parent`` is the node (-1: the last committed token) whose children were
    drawn from q without replacement, in sibling order; q is zero outside
    ``token_ids``. Children not drawn from q are deterministic drafts
    (n-gram), for which q is one-hot.
    """

    parent: int
    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class TokenTree:
    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    # Per node: drawn from its parent's DraftDistribution (True) or deterministic. Empty: all deterministic.
    sampled: tuple[bool, ...] = ()
    distributions: tuple[DraftDistribution, ...] = ()
    # Per node: a draft model's probability of the node given its parent, for ranking drafts inside the
    # drafter (the tree builder). Not part of the wire format; empty: unknown.
    node_probs: tuple[float, ...] = ()

    @staticmethod
    def chain(token_ids: Sequence[int]) -> TokenTree:
        """The tree in which every node is the child of the previous one."""
        return TokenTree(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    def __len__(self) -> int:
        return len(self.token_ids)

    @staticmethod
    def from_paths(paths: Sequence[Sequence[int]]) -> TokenTree:
        """The trie of ``paths``: shared prefixes become shared nodes, first-seen order kept."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            node = ROOT
            for token in path:
                child = index.get((node, token))
                if child is None:
                    child = index[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child
        return TokenTree(tuple(tokens), tuple(parents))

    def is_sampled(self, node: int) -> bool:
        return bool(self.sampled) and self.sampled[node]

    def children(self) -> dict[int, list[int]]:
        """Children of each node (ROOT included) in index order."""
        children: dict[int, list[int]] = {ROOT: []}
        for i, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(i)
            children.setdefault(i, [])
        return children

    def distribution_at(self, node: int) -> DraftDistribution | None:
        return next((d for d in self.distributions if d.parent == node), None)

    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node; children of the last committed token have depth 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return depths

    def find(self, path: Sequence[int]) -> int | None:
        """The node that ``path`` (tokens from the root) reaches; ROOT for the empty path, None where this tree
        does not spell it."""
        node = ROOT
        children = self.children()
        for token in path:
            found = next((c for c in children[node] if self.token_ids[c] == token), None)
            if found is None:
                return None
            node = found
        return node

    def node_at(self, path: Sequence[int]) -> int:
        """The node that ``path`` reaches in this tree, which spells it."""
        node = self.find(path)
        assert node is not None, f"the tree does not spell {list(path)}"
        return node

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` inclusive."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def within_vocab(self, vocab_size: int) -> TokenTree:
        """This tree without nodes whose token lies outside [0, ``vocab_size``), nor their descendants.

        A sampled node goes too when its parent's draft distribution names an
        id outside the vocabulary (that distribution is dropped). Node
        probabilities follow their nodes. ``vocab_size`` 0: unknown, the tree
        as it is. Expects a well-formed tree otherwise (parents before children).
        """
        if vocab_size <= 0:
            return self
        bad_dists = {d.parent for d in self.distributions if any(not 0 <= t < vocab_size for t in d.token_ids)}
        if not bad_dists and all(0 <= t < vocab_size for t in self.token_ids):
            return self
        index: dict[int, int] = {ROOT: ROOT}  # old node -> new node
        keep: list[int] = []
        for i, (token, parent) in enumerate(zip(self.token_ids, self.parents, strict=True)):
            if not 0 <= token < vocab_size or parent not in index:
                continue
            if self.is_sampled(i) and parent in bad_dists:
                continue
            index[i] = len(keep)
            keep.append(i)
        return TokenTree(
            tuple(self.token_ids[i] for i in keep),
            tuple(index[self.parents[i]] for i in keep),
            tuple(self.sampled[i] for i in keep) if self.sampled else (),
            tuple(
                DraftDistribution(index[d.parent], d.token_ids, d.probs)
                for d in self.distributions
                if d.parent in index and d.parent not in bad_dists
            ),
            tuple(self.node_probs[i] for i in keep) if self.node_probs else (),
        )

    def validate(self, vocab_size: int, max_nodes: int, max_depth: int | None = None) -> None:
        """Raise InvalidTreeError naming the first problem found.

        "Parents before children" also rules out cycles: every edge points to
        a smaller index.
        """
        if len(self.token_ids) != len(self.parents):
            raise InvalidTreeError(
                f"tree has {len(self.token_ids)} token_ids but {len(self.parents)} parents; "
                "they must have the same length"
            )
        if len(self) > max_nodes:
            raise InvalidTreeError(f"tree has {len(self)} nodes; this verifier accepts at most {max_nodes}")
        for i, (token, parent) in enumerate(zip(self.token_ids, self.parents, strict=True)):
            if not 0 <= token < vocab_size:
                raise InvalidTreeError(f"node {i} has token id {token}, outside the vocabulary [0, {vocab_size})")
            if parent < ROOT or parent >= len(self):
                raise InvalidTreeError(f"node {i} has parent {parent}, out of range [-1, {len(self)})")
            if parent >= i:
                raise InvalidTreeError(
                    f"node {i} has parent {parent}: parents must come before their children "
                    "(this also rules out cycles)"
                )
        self._validate_distributions(vocab_size)
        if self.node_probs and (len(self.node_probs) != len(self) or any(not 0.0 < q <= 1.0 for q in self.node_probs)):
            raise InvalidTreeError("node_probs must hold one probability in (0, 1] per node")
        if max_depth is not None and self.token_ids and max(self.depths()) > max_depth:
            raise InvalidTreeError(f"tree is {max(self.depths())} deep; this verifier accepts at most {max_depth}")

    def _validate_distributions(self, vocab_size: int) -> None:
        if self.sampled and len(self.sampled) != len(self):
            raise InvalidTreeError(f"tree has {len(self)} nodes but {len(self.sampled)} sampled flags")
        seen: set[int] = set()
        for dist in self.distributions:
            where = f"draft distribution at node {dist.parent}"
            if not ROOT <= dist.parent < len(self):
                raise InvalidTreeError(f"{where}: parent out of range [-1, {len(self)})")
            if dist.parent in seen:
                raise InvalidTreeError(f"{where}: more than one distribution for the same node")
            seen.add(dist.parent)
            if len(dist.token_ids) != len(dist.probs) or not dist.token_ids:
                raise InvalidTreeError(f"{where}: needs as many probs as token_ids, and at least one")
            if len(set(dist.token_ids)) != len(dist.token_ids):
                raise InvalidTreeError(f"{where}: repeated token ids")
            if any(not 0 <= t < vocab_size for t in dist.token_ids):
                raise InvalidTreeError(f"{where}: token id outside the vocabulary [0, {vocab_size})")
            if any(not p > 0 for p in dist.probs) or abs(sum(dist.probs) - 1.0) > 1e-3:
                raise InvalidTreeError(f"{where}: probs must be positive and sum to 1 (got {sum(dist.probs):.4f})")
        sampled_pairs: set[tuple[int, int]] = set()
        for i in range(len(self)):
            if not self.is_sampled(i):
                continue
            pair = (self.parents[i], self.token_ids[i])
            if pair in sampled_pairs:
                raise InvalidTreeError(f"node {i} repeats a sampled sibling's token: sample without replacement")
            sampled_pairs.add(pair)
            at_parent = self.distribution_at(self.parents[i])
            if at_parent is None or self.token_ids[i] not in at_parent.token_ids:
                raise InvalidTreeError(
                    f"node {i} is marked sampled but its token is not in a draft distribution at its parent"
                )
