"""``--head-matmul auto``: the head's products on whichever kernel drafts faster on this CPU, timed at start-up.

The head's products run on its float weights prepacked for the CPU's GEMM kernel (oneDNN, MKL for fp32 on
Intel), on int8 copies of them, or (an fp32 head, where the block kernel builds) on Q8_0 blocks. Which is
faster depends on the CPU and the torch build, not on the model, and the CPU's features do not tell: AMX's
bf16 tiles, the likely winner on paper, lost to int8 (see docs/benchmarks.md, "`--head-matmul auto` times the
head's kernels"). So the drafter times a draft's typical pair of steps each way when it loads the head and
keeps the fastest, preferring the float weights unless another is faster by ``INT8_MARGIN``: int8 and Q8_0
drafts are a little different and can cost acceptance (never exactness: the verifier checks every draft).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from draft_service.head_layer import HeadCache
from draft_service.head_types import HeadOutput, HeadWeights
from specserve.packed_linear import Packing

INT8_MARGIN = 0.10
"""int8 or Q8_0 blocks are kept only where a draft step takes at most 90% of the float products' time."""

ROUNDS = 3
"""Each kernel is timed this many times, in turn with the other (a passing slowdown hits both); best kept."""

CONTEXT = 32  # cached positions the timed steps attend to
BEAM = 4  # rows of the timed tree level (TreeShape's default beam)


class TimedHead(HeadWeights, Protocol):
    """What the timing reads of a draft head (``draft_head.DraftHead`` is one): it steps it, packed each way."""

    def step(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache,
        allowed: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> HeadOutput: ...

    def pack_for(self, packing: Packing) -> None: ...


Timer = Callable[[TimedHead], float]


def time_draft_step(head: TimedHead, repeats: int = 8, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of a draft's typical pair of head steps: one row fed (its last logits only), then a
    tree level of ``BEAM`` rows with all their logits, over ``CONTEXT`` cached positions."""
    hidden = head.config.hidden_size
    dtype = head.draft_lm_head.dtype
    generator = torch.Generator().manual_seed(0)

    def rows(start: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = torch.randn(count, hidden, generator=generator).to(dtype)
        tokens = torch.randint(int(head.draft_vocab.numel()), (count,), generator=generator)
        return features, head.draft_vocab[tokens], torch.arange(start, start + count)

    cache = HeadCache()
    fed, level = rows(CONTEXT, 1), rows(CONTEXT + 1, BEAM)
    seconds = []
    with torch.no_grad():
        head.step(*rows(0, CONTEXT), cache, last_logits_only=True)
        for _ in range(repeats + 1):  # the first pair warms the kernels up: not counted
            start = clock()
            head.step(*fed, cache, last_logits_only=True)
            head.step(*level, cache)
            seconds.append(clock() - start)
            cache.crop(CONTEXT)
    return statistics.median(seconds[1:])


def time_kernels(
    head: TimedHead, candidates: Sequence[Packing], timer: Timer = time_draft_step
) -> dict[Packing, float]:
    """Each candidate's best draft-step time over ``ROUNDS`` turns; the head is left packed for the last one."""
    best: dict[Packing, float] = {}
    for _ in range(ROUNDS):
        for packing in candidates:
            head.pack_for(packing)
            seconds = timer(head)
            best[packing] = min(seconds, best.get(packing, seconds))
    return best


def faster_kernel(seconds: dict[Packing, float], default: Packing, margin: float = INT8_MARGIN) -> Packing:
    """``default`` unless another kernel (int8, Q8_0 blocks: rounded weights) was timed at most ``1 - margin``
    of its time; of those, the fastest."""
    if default not in seconds:
        return default
    rivals = [k for k, s in seconds.items() if k != default and s <= (1 - margin) * seconds[default]]
    return min(rivals, key=lambda k: seconds[k], default=default)
