"""Lookahead decoding's Jacobi rows: n-gram guesses computed on a verify step's spare rows.

Lookahead decoding (Fu et al., 2024) runs Jacobi iteration beside the
verification: a 2-D window of ``levels`` (N - 1) rows of ``width`` (W) guessed
tokens after the last committed token. Level j, column i is a guess for the
position ``anchor + 1 + i + j``, ``anchor`` being the position of the token the
window was laid out after. Each step the target scores the window's rows; the
outputs of the last level (one position further) become the next level, the
oldest level goes, and every column then spells a Jacobi trajectory: the N
tokens (level 0 .. level N-2, output) at N consecutive positions, an n-gram the
target itself produced along a guessed context. Those n-grams go to the
drafters' pools, where they are drafted and verified like any other guess.

Here the window's rows ride in the verifier's step after the session's tree,
in the tree's segment, attached to the pending token (the last committed one):

- row (j, i) sees the cached context, the pending token, level 0's columns
  0..i and column i of levels 1..j: exactly the positions anchor .. its own, a
  causal chain along its trajectory;
- no tree row sees a lookahead row, and no lookahead row sees a tree row, so
  the tree's logits, hence acceptance, are what they are without the window;
- only the last level's rows are scored (their argmax is the next level): the
  head is the priciest product of a row, and the lower levels' rows are there
  only as keys and values for the rows above them;
- nothing they write is kept: the session's cache keeps the accepted path.

The window lives in the verifier's session and follows its commits: when the
pending token has moved k positions on, every level drops its first k columns
(guesses for positions now committed or passed) and takes k new columns at its
end (copies of its last guess: Jacobi iteration converges from any guess, so a
fresh column costs a few steps before its n-grams mean something). A session
prefilled again (evicted, moved, new) starts a new window. While the window is
filling (fewer than N - 1 levels) it yields no n-grams.

Greedy argmax is the Jacobi update whatever the session samples with: the
n-grams are guesses, and acceptance judges drafts from them with the session's
own rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from target_service.cost_curve import CostCurve

# Extra rows are "nearly free" when the step with them costs at most this much more than without (the
# measured curve at the rows the steps run as). Lookahead n-grams are guesses with no acceptance estimate
# behind them, so ``auto`` spends only rows the curve prices as noise.
NEARLY_FREE = 1.05

LOOKAHEAD_CHOICES = ("auto", "on", "off")
MAX_WINDOW = 64
MAX_NGRAM = 8


def check_settings(mode: str, width: int, ngram: int) -> None:
    """ValueError naming the setting that is out of range."""
    if mode not in LOOKAHEAD_CHOICES:
        raise ValueError(f"lookahead must be one of {', '.join(LOOKAHEAD_CHOICES)}, not {mode!r}")
    if not 1 <= width <= MAX_WINDOW:
        raise ValueError(f"the lookahead window must be 1-{MAX_WINDOW} columns, not {width}")
    if not 2 <= ngram <= MAX_NGRAM:
        raise ValueError(f"lookahead n-grams must be 2-{MAX_NGRAM} tokens, not {ngram}")


@dataclass
class LookaheadWindow:
    """One session's Jacobi window: ``levels`` [j][i], oldest level first, laid out after position ``anchor``."""

    width: int
    num_levels: int  # N - 1: the levels of a full window
    anchor: int = -1  # -1: not laid out yet
    levels: list[list[int]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Rows the window takes in a step now (fewer while it fills)."""
        return self.width * max(1, len(self.levels))

    @property
    def full_rows(self) -> int:
        return self.width * self.num_levels

    def follow(self, committed: Sequence[int]) -> None:
        """Lay the window out after the session's pending token ``committed[-1]``, shifted by what was committed."""
        pending = len(committed) - 1
        shift = pending - self.anchor
        if self.anchor < 0 or shift < 0 or shift >= self.width or not self.levels:
            self._start(committed)
            return
        if shift:
            self.levels = [level[shift:] + [level[-1]] * shift for level in self.levels]
            self.anchor = pending

    def _start(self, committed: Sequence[int]) -> None:
        """Level 0 from the context's last tokens, repeated to the width: a guess as good as any to start from."""
        recent = list(committed[-self.width :])
        self.levels = [(recent * (self.width // len(recent) + 1))[: self.width]]
        self.anchor = len(committed) - 1

    def tokens(self) -> list[int]:
        """The window's row tokens, level by level."""
        return [token for level in self.levels for token in level]

    def offsets(self) -> torch.Tensor:
        """[rows] each row's position after the anchor: 1 + column + level."""
        columns = torch.arange(self.width)
        return torch.cat([1 + columns + j for j in range(len(self.levels))])

    def scored_rows(self) -> range:
        """The rows (of the window's) whose argmax is the next level: the last level's."""
        last = (len(self.levels) - 1) * self.width
        return range(last, last + self.width)

    def advance(self, outputs: Sequence[int]) -> list[tuple[int, ...]]:
        """Take the last level's argmax ``outputs``; the n-grams of the columns when the window was full."""
        ngrams: list[tuple[int, ...]] = []
        if len(self.levels) == self.num_levels:
            ngrams = [(*(level[i] for level in self.levels), outputs[i]) for i in range(self.width)]
            self.levels = self.levels[1:]
            self.anchor += 1  # level j + 1 becomes level j: each guess one position nearer its anchor
        self.levels.append(list(outputs))
        return list(dict.fromkeys(ngrams))


def window_mask(num_levels: int, width: int) -> torch.Tensor:
    """[rows, rows] bool over the window's own rows: (j, i) sees level 0's columns <= i and column i of levels <= j."""
    rows = num_levels * width
    allowed = torch.zeros(rows, rows, dtype=torch.bool)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    eye = torch.eye(width, dtype=torch.bool)
    for j in range(num_levels):
        allowed[j * width : (j + 1) * width, :width] = causal
        for above in range(1, j + 1):
            allowed[j * width : (j + 1) * width, above * width : (above + 1) * width] = eye
    return allowed


def with_window(tree_allowed: torch.Tensor | None, cached: int, tree_rows: int, window: torch.Tensor) -> torch.Tensor:
    """The segment's mask [tree_rows + w, cached + tree_rows + w]: the tree's rows as ``tree_allowed`` says (None:
    the pending token alone, which sees the context and itself) and blind to the window; the window's rows see the
    context, the pending token and their own window as ``window`` [w, w] says, never a tree node."""
    w = window.shape[0]
    allowed = torch.zeros(tree_rows + w, cached + tree_rows + w, dtype=torch.bool)
    if tree_allowed is None:
        allowed[0, : cached + 1] = True
    else:
        allowed[:tree_rows, : cached + tree_rows] = tree_allowed.cpu()
    allowed[tree_rows:, : cached + 1] = True
    allowed[tree_rows:, cached + tree_rows :] = window
    return allowed


def nearly_free(curve: CostCurve, rows: int, extra: int) -> bool:
    """Whether a step of ``rows`` rows costs at most ``NEARLY_FREE`` times more with ``extra`` rows on, by the
    measured curve (an unmeasured one, a single point, says nothing is free: ``auto`` stays off)."""
    if len(curve.tokens) < 2:
        return False
    return curve.forward_s(rows + extra) <= NEARLY_FREE * curve.forward_s(max(1, rows))
