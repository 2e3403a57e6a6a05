"""The LM head's product, in whichever of two equal forms is faster for few rows on this machine.

Used by the verifier's engine for the target's head and by the drafter for the draft head's reduced one.

A verify forward scores the pending token and a handful of tree nodes: 2-16 rows against a head of
about 50k vocabulary rows. On an AVX2-only AMD EPYC (fp32, the MKL that torch 2.13 ships) ``F.linear(x, W)``
at 2-8 rows costs 2-3x what one row costs, while the same product written ``(W @ x.T).T`` costs about
what one row does (SmolLM2's head: 10-11 ms against 26-31 ms at 2-4 rows): the two forms reach
different BLAS kernels. Which form wins depends on the CPU and the library, so the engine times both on
its own head at start-up and keeps, for each row count (rounded up to a power of two), the faster one.

Both forms take the same dot products over the same weights; only the summation order inside a dot
product may differ in the last bits, as it already does between one batch size and another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_COUNTS = (2, 4, 8, 16)
"""Row counts timed at start-up. One row always uses ``F.linear``, so plain decoding computes its logits
exactly as before; more than 16 rows too (a full GEMM is what it is built for)."""
MARGIN = 0.9
"""The transposed form is kept only where it takes at most this fraction of ``F.linear``'s time."""
FORMS = ("auto", "linear")
"""``--lm-head-matmul`` choices: measure and choose per row count, or always ``F.linear``."""

Timings = Mapping[tuple[str, int], float]  # (form, rows) -> seconds


def rounded_rows(rows: int) -> int:
    """The timed row count that stands for ``rows``: the next power of two (0 for one row or above the largest)."""
    if rows <= 1:
        return 0
    for count in ROW_COUNTS:
        if rows <= count:
            return count
    return 0


def head_product(
    x: torch.Tensor, weight: torch.Tensor, transposed_rows: frozenset[int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for x of [..., hidden], as ``(W @ x.T).T`` where its row count is in
    ``transposed_rows``; other row counts get exactly ``F.linear``'s result, bias included."""
    flat = x.reshape(-1, x.shape[-1])
    if rounded_rows(flat.shape[0]) not in transposed_rows:
        return F.linear(x, weight, bias)
    out = (weight @ flat.T).T.contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


@dataclass(frozen=True)
class HeadMatmul:
    """``logits = x @ weight.T`` for x of [rows, hidden], by the form chosen for ``rows``."""

    weight: torch.Tensor  # [vocab, hidden]
    transposed_rows: frozenset[int] = frozenset()  # row counts (of ROW_COUNTS) that use (W @ x.T).T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return head_product(x, self.weight, self.transposed_rows)

    @classmethod
    def choose(cls, weight: torch.Tensor, timings: Timings) -> HeadMatmul:
        """The form per row count from measured ``timings`` of both forms at each of ``ROW_COUNTS``."""
        return cls(weight, faster_rows(timings))

    @classmethod
    def measured(
        cls, weight: torch.Tensor, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
    ) -> HeadMatmul:
        """Time both forms on ``weight`` (best of ``repeats`` after a warm-up) and choose; GPUs keep F.linear."""
        if weight.device.type != "cpu":
            return cls(weight)
        return cls.choose(weight, time_forms([weight], repeats, clock))

    def describe(self) -> str:
        """For logs and cache keys: which row counts use the transposed form."""
        return describe_rows(self.transposed_rows)


def faster_rows(timings: Timings) -> frozenset[int]:
    """The row counts where the transposed form took at most ``MARGIN`` of ``F.linear``'s time."""
    return frozenset(rows for rows in ROW_COUNTS if timings[("transposed", rows)] <= MARGIN * timings[("linear", rows)])


def time_forms(
    weights: Sequence[torch.Tensor], repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> dict[tuple[str, int], float]:
    """Seconds to multiply by every one of ``weights`` in turn, in each form at each of ``ROW_COUNTS``.

    Best of ``repeats`` after a warm-up. Timing the weights one after another, as a forward uses them, keeps
    the measurement honest for small layers: one small weight timed on its own stays in the CPU's cache,
    which a forward that streams hundreds of megabytes of layers never sees.
    """
    generator = torch.Generator().manual_seed(0)
    timings: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for rows in ROW_COUNTS:
            inputs = {
                width: torch.randn(rows, width, generator=generator, dtype=weights[0].dtype)
                for width in {w.shape[1] for w in weights}
            }
            for name, transposed in (("linear", frozenset[int]()), ("transposed", frozenset(ROW_COUNTS))):
                _multiply_all(inputs, weights, transposed)
                best = float("inf")
                for _ in range(repeats):
                    start = clock()
                    _multiply_all(inputs, weights, transposed)
                    best = min(best, clock() - start)
                timings[(name, rows)] = best
    return timings


def _multiply_all(
    inputs: Mapping[int, torch.Tensor], weights: Sequence[torch.Tensor], transposed: frozenset[int]
) -> None:
    for w in weights:
        head_product(inputs[w.shape[1]], w, transposed)


def describe_rows(transposed_rows: frozenset[int]) -> str:
    """For logs and cache keys: which row counts use the transposed form."""
    if not transposed_rows:
        return "F.linear at every row count"
    rows = ",".join(str(r) for r in sorted(transposed_rows))
    return f"(W @ x.T).T at {rows} rows (rounded up), F.linear otherwise"


def head_matmul(weight: torch.Tensor, form: str) -> HeadMatmul:
    """``form`` 'auto': measured on this machine; 'linear': always ``F.linear``."""
    if form not in FORMS:
        raise ValueError(f"lm head matmul form {form!r}: choose one of {', '.join(FORMS)}")
    return HeadMatmul.measured(weight) if form == "auto" else HeadMatmul(weight)
