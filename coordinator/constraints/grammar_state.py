"""One request's grammar state, and each round's tree fitted to it.

The matcher always stands at the committed tokens. ``fit`` walks the
drafter's tree depth-first from there, consuming each node's token on the way
down and rolling it back on the way up, so every row gets the mask of its own
path and the walk leaves the matcher where it found it. Along the way:

- a deterministic node whose token its parent's row forbids is dropped with
  its subtree: the target can never pick it, so dropping it changes no
  outcome and saves its verify row;
- a forbidden *sampled* node is kept as a leaf (its subtree dropped):
  recursive rejection sampling tries it (never accepting it, since the masked
  p gives it no mass) and that try updates the residual its later siblings
  see, so removing it would change the distribution of the result;
- where a row allows exactly one token, that token is the node's only child
  (the drafter's node when it drafted it, a new node when not), marked forced:
  the masked distribution has one member, so it is accepted under greedy and
  sampling alike. Chains of forced tokens (keys, punctuation, closing
  brackets) grow as deep as the caps allow.

``commit`` then advances the matcher by exactly the committed tokens, so a
rejected path leaves no trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance
import numpy as np

from specserve.errors import Unavailable
from specserve.token_masks import TokenMasks, row_bytes
from specserve.token_tree import ROOT, DraftDistribution, TokenTree

NO_ORIGIN = -1  # a node the grammar added, not the drafter


@dataclass(frozen=True)
class FittedTree:
    """A round's tree after the grammar: what to verify, its masks, and where each node came from."""

    tree: TokenTree
    masks: TokenMasks
    origin: tuple[int, ...]  # per node: its index in the drafter's tree, or NO_ORIGIN
    forced: tuple[bool, ...]  # per node: the only token its parent's row allows (a certain draft)

    @property
    def num_drafted(self) -> int:
        return sum(o != NO_ORIGIN for o in self.origin)

    def drafter_path(self, accepted_nodes: list[int]) -> tuple[int, ...]:
        """The accepted nodes in the drafter's own indices, up to the first node the drafter did not draft."""
        path: list[int] = []
        for node in accepted_nodes:
            if self.origin[node] == NO_ORIGIN:
                break
            path.append(self.origin[node])
        return tuple(path)


class GrammarState:
    """A matcher at the request's committed tokens; masks per path, tree fitting, commits."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._row_bytes = row_bytes(vocab_size)
        self._all_allowed = np.full(self._row_bytes, 0xFF, dtype=np.uint8)
        self.mask_ns = 0  # time computing masks, for the stats

    @property
    def complete(self) -> bool:
        """The committed text satisfies the constraint (it may stop here)."""
        return bool(self._matcher.is_accepting())

    def row(self) -> np.ndarray:
        """The mask after the committed tokens and whatever the walk has consumed on top (uint8 packed bits)."""
        started = time.perf_counter_ns()
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)[: self._row_bytes]
        self.mask_ns += time.perf_counter_ns() - started
        if self._matcher.is_error():
            raise Unavailable("structured output failed", detail=f"grammar matcher: {self._matcher.get_error()}")
        return bits

    def commit(self, tokens: list[int]) -> None:
        """Advance by the committed tokens; they must be ones the masks allowed."""
        if tokens and not self._matcher.consume_tokens(tokens):
            # The verifier returned a token its masks forbid: one that ignores token_masks (an old version).
            raise Unavailable(
                "the verifier does not apply structured-output masks",
                detail=f"grammar matcher refused committed tokens {tokens}: {self._matcher.get_error()}",
            )

    def fit(self, drafted: TokenTree, max_nodes: int, max_depth: int) -> FittedTree:
        """``drafted`` pruned and extended by the grammar, at most ``max_nodes`` nodes ``max_depth`` deep."""
        walk = _Walk(self, drafted, max_nodes, max_depth)
        walk.visit(ROOT, ROOT, walk.first_row, 0)
        return walk.result()

    def forced_next(self, at_most: int) -> tuple[int, ...]:
        """The tokens the grammar forces right after the committed ones, in order, at most ``at_most``: each
        the only token its row allows. An EOS ends the chain unconsumed (generation would stop there)."""
        chain: list[int] = []
        try:
            while len(chain) < at_most:
                token = single_token(self.row())
                if token is None or token in self.eos_token_ids:
                    break
                self._consume(token)
                chain.append(token)
        finally:
            if chain:
                self._matcher.rollback(len(chain))
        return tuple(chain)

    def few_allowed(self, fitted: FittedTree, at_most: int) -> dict[int, tuple[int, ...]]:
        """Node (ROOT: the committed tokens) -> the tokens its row allows, for the rows that allow at most
        ``at_most`` (and at least one): whatever the target picks after a path that ends there is one of them."""
        bits = fitted.masks.bits
        # A row that allows at most k tokens has at most k non-zero bytes: most rows are ruled out on those.
        candidates = np.flatnonzero(np.count_nonzero(bits, axis=1) <= at_most)
        few: dict[int, tuple[int, ...]] = {}
        for row in candidates[np.bitwise_count(bits[candidates]).sum(axis=1) <= at_most]:
            allowed = tuple(
                8 * int(byte) + bit
                for byte in np.flatnonzero(bits[row])
                for bit in range(8)
                if bits[row, byte] >> bit & 1 and 8 * int(byte) + bit < self.vocab_size
            )
            if allowed:
                few[int(row) - 1] = allowed  # row 0: ROOT; row n + 1: node n
        return few

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise Unavailable("structured output failed", detail=f"grammar matcher: {self._matcher.get_error()}")

    def _rollback(self) -> None:
        self._matcher.rollback(1)


def _subtree_sizes(tree: TokenTree) -> list[int]:
    sizes = [1] * len(tree)
    for node in range(len(tree) - 1, -1, -1):  # children come after their parents
        if tree.parents[node] != ROOT:
            sizes[tree.parents[node]] += sizes[node]
    return sizes


def single_token(row: np.ndarray) -> int | None:
    """The only token a packed row allows, or None when it allows several (or none)."""
    nonzero = np.flatnonzero(row)
    if nonzero.size != 1:
        return None
    byte = int(nonzero[0])
    value = int(row[byte])
    if value & (value - 1):
        return None
    return byte * 8 + value.bit_length() - 1


def allows(row: np.ndarray, token: int) -> bool:
    return bool(row[token >> 3] >> (token & 7) & 1)


class _Walk:
    """One depth-first pass over the drafter's tree, building the fitted tree in preorder (parents first)."""

    def __init__(self, state: GrammarState, drafted: TokenTree, max_nodes: int, max_depth: int) -> None:
        self.state = state
        self.drafted = drafted
        self.children = drafted.children()
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        # Drafter nodes not yet kept or dropped: room is kept for them before grammar-only nodes take it.
        self.sizes = _subtree_sizes(drafted)
        self.unseen = len(drafted)
        self.first_row = state.row()
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.sampled: list[bool] = []
        self.origin: list[int] = []
        self.forced: list[bool] = []
        self.rows: list[np.ndarray] = [self.first_row]
        self.new_index: dict[int, int] = {ROOT: ROOT}  # drafter node -> fitted node

    def visit(self, node: int, source: int | None, row: np.ndarray, depth: int) -> None:
        """Add the children of fitted ``node`` (the drafter's ``source``, None for a grammar-only node)."""
        kids = self.children.get(source, []) if source is not None else []
        if depth >= self.max_depth:
            self._skip(kids)
            return
        only = single_token(row)
        if only is not None:
            match = next((k for k in kids if self.drafted.token_ids[k] == only), None)
            self._skip([k for k in kids if k != match])
            if match is not None or self._room(grammar_only=True):
                self._descend(node, only, match, depth, forced=True)
            return
        for kid in kids:
            token = self.drafted.token_ids[kid]
            if allows(row, token):
                self._descend(node, token, kid, depth, forced=False)
            elif self.drafted.is_sampled(kid) and self._room():
                self._skip(self.children[kid])
                self._add(node, token, kid, forced=False, sampled=True)
                self.rows.append(self.state._all_allowed)  # never read: the node is never accepted
            else:
                self._skip([kid])

    def _skip(self, kids: list[int]) -> None:
        """Drop these drafter nodes with their subtrees."""
        self.unseen -= sum(self.sizes[k] for k in kids)

    def _descend(self, parent: int, token: int, source: int | None, depth: int, forced: bool) -> None:
        if not self._room():
            self._skip([source] if source is not None else [])
            return
        # A forced node is a certain draft: deterministic even when the drafter sampled it (the masked p is
        # one-hot, so rejection sampling's outcome is that token whatever q was).
        sampled = not forced and source is not None and self.drafted.is_sampled(source)
        index = self._add(parent, token, source, forced, sampled)
        if token in self.state.eos_token_ids:
            # Generation ends at an EOS: its row is never read, and llguidance's matcher is not rolled back
            # across an EOS reliably, so it is not consumed.
            self.rows.append(self.state._all_allowed)
            self._skip(self.children.get(source, []) if source is not None else [])
            return
        self.state._consume(token)
        try:
            row = self.state.row()
            self.rows.append(row)
            self.visit(index, source, row, depth + 1)
        finally:
            self.state._rollback()

    def _room(self, grammar_only: bool = False) -> bool:
        reserved = self.unseen if grammar_only else 0
        return len(self.tokens) + reserved < self.max_nodes

    def _add(self, parent: int, token: int, source: int | None, forced: bool, sampled: bool) -> int:
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.sampled.append(sampled)
        self.origin.append(NO_ORIGIN if source is None else source)
        self.forced.append(forced)
        if source is not None:
            self.new_index[source] = index
            self.unseen -= 1
        return index

    def result(self) -> FittedTree:
        # Draft distributions follow their nodes, for the nodes that still have sampled children.
        with_sampled = {self.parents[i] for i, s in enumerate(self.sampled) if s}
        distributions = tuple(
            DraftDistribution(self.new_index[d.parent], d.token_ids, d.probs)
            for d in self.drafted.distributions
            if d.parent in self.new_index and self.new_index[d.parent] in with_sampled
        )
        tree = TokenTree(
            tuple(self.tokens),
            tuple(self.parents),
            tuple(self.sampled) if any(self.sampled) else (),
            distributions,
        )
        return FittedTree(tree, TokenMasks(np.stack(self.rows)), tuple(self.origin), tuple(self.forced))
