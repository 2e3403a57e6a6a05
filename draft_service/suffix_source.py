"""The suffix source (SuffixDecoding): frequency-scored trees from every earlier occurrence of the context's end.

A session's committed tokens (prompt and output) are indexed by their ``KEY_LEN``-grams as they are committed.
To draft after a context, the source finds every earlier place where the context's last tokens occurred,
keeps those that match the longest (up to ``MAX_MATCH`` tokens), and counts what followed them in a trie:
a node's count is how many of those places went on with its path. That is the subtree a suffix tree over
the text would hold under the matched suffix, and the tree it drafts is that subtree's most frequent part:
the ``max_nodes`` nodes with the highest count, each carrying count / parent's count as its draft
probability, so the tree builder calibrates them like the draft head's. Paths seen in under ``MIN_SHARE``
of the places are not drafted.

The tenant's recent outputs come from the shared n-gram pool (Redis or in memory): its continuations of
the context's last ``key_len`` tokens join the count when the session's own text matches no longer than
that, each as one more place. The longest match wins; the pool only fills in where the session knows as
little.

How deep to draft follows how well matches have predicted in this session: a match of m tokens drafts at
most ``depth_factor * m`` deep (SuffixDecoding's rule), and ``depth_factor`` moves between
``MIN_FACTOR`` and ``MAX_FACTOR`` with the share of the last drafted path that the committed text
confirmed. Repetitive text (a code edit, an agent's tool output quoted back) earns deep chains; a match
that keeps failing drafts one or two tokens.

Drafts are guesses the verifier checks: none of this changes output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from draft_service.ngram_pool import NgramPool
from specserve.results import DraftFeedback
from specserve.token_tree import ROOT, TokenTree

KEY_LEN = 2
"""Tokens a match has at least: the index's key."""
MAX_MATCH = 32
"""Longest match looked for: past it, a longer shared past predicts no better."""
MAX_OCCURRENCES = 64
"""Most recent places counted for one draft: a common key (``", "``) would otherwise cost a scan of the text."""
MAX_DEPTH = 16
"""Deepest draft: the budget's cost curve cuts trees long before on a CPU."""
MIN_SHARE = 0.1
"""A path followed at fewer than this share of the places is noise, not a draft."""
MIN_FACTOR, MAX_FACTOR = 0.5, 4.0
"""Bounds of ``depth_factor``: how deep to draft per matched token."""
FACTOR_DECAY = 0.7
"""Weight of the old ``depth_factor`` against each round's evidence."""
BYTES_PER_TOKEN = 120
"""A committed token's share of the index: its list slot and int, and its key's dict entry and position."""


@dataclass
class _Trie:
    """Continuation counts: node 0 is the root (the context's end)."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [ROOT])
    depths: list[int] = field(default_factory=lambda: [0])
    counts: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def add(self, path: Sequence[int]) -> None:
        node = 0
        self.counts[0] += 1
        for token in path:
            child = self.children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.children[node][token] = child
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.counts.append(0)
                self.children.append({})
            self.counts[child] += 1
            node = child


class SuffixProposer:
    """The suffix source for one session (it holds the index of the session's text)."""

    name = "suffix"
    wants_features = False
    costly = False

    def __init__(self, prompt_tokens: Sequence[int], pool: NgramPool | None = None) -> None:
        self._text: list[int] = list(prompt_tokens)  # the committed tokens
        self._index: dict[tuple[int, ...], list[int]] = {}  # key -> positions right after each occurrence
        self._indexed = 0  # tokens of ``_text`` whose key is in the index
        self._pool = pool
        self.depth_factor = 1.0
        self._last_path: list[int] = []  # the likeliest path of the last draft, for ``observe`` to judge
        self.forgotten = False

    @property
    def nbytes(self) -> int:
        return BYTES_PER_TOKEN * len(self._text)

    def forget(self) -> None:
        """Free the index; the session drafts without this source from now on."""
        self.forgotten = True
        self._text, self._index, self._indexed = [], {}, 0

    def observe(self, feedback: DraftFeedback) -> None:
        """Index the newly committed tokens, and move ``depth_factor`` by how much of the last draft's likeliest
        path they confirmed."""
        if self.forgotten:
            return
        new = feedback.new_tokens
        if self._last_path and new:
            confirmed = 0
            for drafted, committed in zip(self._last_path, new, strict=False):
                if drafted != committed:
                    break
                confirmed += 1
            # All of it confirmed: the matches run longer than drafted; none: shorter.
            evidence = MIN_FACTOR + (MAX_FACTOR - MIN_FACTOR) * confirmed / len(self._last_path)
            factor = FACTOR_DECAY * self.depth_factor + (1 - FACTOR_DECAY) * evidence
            self.depth_factor = min(MAX_FACTOR, max(MIN_FACTOR, factor))
        self._last_path = []
        self._text.extend(new)

    def digest(self, tokens: Sequence[int]) -> bool:
        return False

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        if self.forgotten or max_nodes <= 0 or len(tokens) < KEY_LEN:
            return TokenTree()
        self._index_text()
        places, matched = self._places(tokens)
        continuations = [self._text[place : place + MAX_DEPTH] for place in places]
        if self._pool is not None and matched <= self._pool.shape.key_len:
            key_len = self._pool.shape.key_len
            if len(tokens) >= key_len:
                pooled = self._pool.lookup(tokens[len(tokens) - key_len :])
                continuations += [list(c) for c in pooled]
                matched = max(matched, key_len if pooled else 0)
        continuations = [c for c in continuations if c]
        if not continuations:
            return TokenTree()
        depth = max(1, min(MAX_DEPTH, math.ceil(self.depth_factor * matched)))
        trie = _Trie()
        for continuation in continuations:
            trie.add(continuation[:depth])
        tree, path = _most_frequent(trie, max_nodes)
        if len(tokens) == len(self._text):  # drafted after the committed text, not ahead of an outcome
            self._last_path = path
        return tree

    def _index_text(self) -> None:
        """Put the keys of the tokens committed since the last proposal in the index."""
        text, index = self._text, self._index
        for end in range(max(self._indexed, KEY_LEN), len(text)):
            index.setdefault(tuple(text[end - KEY_LEN : end]), []).append(end)
        self._indexed = max(self._indexed, len(text))

    def _places(self, context: Sequence[int]) -> tuple[list[int], int]:
        """The positions right after the longest earlier matches of the context's end (most recent first, at
        most ``MAX_OCCURRENCES``), and the match's length; ([], 0) when its last ``KEY_LEN`` tokens never
        occurred with something after them."""
        text = self._text
        hits = self._index.get(tuple(context[len(context) - KEY_LEN :]), [])
        best: list[int] = []
        longest = 0
        for place in reversed(hits[-4 * MAX_OCCURRENCES :]):
            if place >= len(text):
                continue  # the context's own end: nothing follows it yet
            length = KEY_LEN
            limit = min(MAX_MATCH, place, len(context))
            while length < limit and text[place - length - 1] == context[-length - 1]:
                length += 1
            if length > longest:
                best, longest = [place], length
            elif length == longest and len(best) < MAX_OCCURRENCES:
                best.append(place)
        return best, longest


def _most_frequent(trie: _Trie, max_nodes: int) -> tuple[TokenTree, list[int]]:
    """The ``max_nodes`` most frequent nodes of ``trie`` above ``MIN_SHARE`` (closed under parents: a child is
    never more frequent than its parent), parents first, with count / parent's count as q; and the tokens of
    its likeliest path."""
    floor = MIN_SHARE * trie.counts[0]
    ranked = sorted(
        (node for node in range(1, len(trie.tokens)) if trie.counts[node] >= floor),
        key=lambda node: (-trie.counts[node], trie.depths[node], node),
    )[:max_nodes]
    kept = set(ranked)
    order = sorted((n for n in ranked if trie.parents[n] == 0 or trie.parents[n] in kept), key=trie.depths.__getitem__)
    position = {node: i for i, node in enumerate(order)}
    parents = tuple(ROOT if trie.parents[n] == 0 else position[trie.parents[n]] for n in order)
    probs = tuple(trie.counts[n] / trie.counts[trie.parents[n]] for n in order)
    tree = TokenTree(tuple(trie.tokens[n] for n in order), parents, node_probs=probs)
    return tree, _likeliest_path(trie, set(order))


def _likeliest_path(trie: _Trie, kept: set[int]) -> list[int]:
    """Tokens of the path that takes the most frequent kept child at each step."""
    path: list[int] = []
    node = 0
    while True:
        options = [child for child in trie.children[node].values() if child in kept]
        if not options:
            return path
        node = max(options, key=lambda child: (trie.counts[child], -child))
        path.append(trie.tokens[node])
