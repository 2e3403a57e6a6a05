"""``--head-matmul auto``: the faster of the packed and int8 products, timed on an injected clock or timer."""

from __future__ import annotations

import itertools

import pytest
import torch

from draft_service.draft_head import DraftHead
from draft_service.head_products import auto_candidates
from draft_service.head_timing import INT8_MARGIN, ROUNDS, faster_kernel, time_draft_step
from specserve.packed_linear import Packing, available_packing
from tests.unit.test_draft_head import new_head

CPU = torch.device("cpu")
PACKED = available_packing(torch.float32, CPU)


@pytest.mark.parametrize(
    ("seconds", "chosen"),
    [
        ({"onednn": 1.0, "int8": 0.8}, "int8"),
        ({"onednn": 1.0, "int8": 1 - INT8_MARGIN}, "int8"),
        ({"onednn": 1.0, "int8": 0.95}, "onednn"),  # faster, but not by the margin: drafts stay on float weights
        ({"onednn": 1.0, "int8": 1.3}, "onednn"),
        ({}, "onednn"),  # nothing timed
    ],
)
def test_int8_is_chosen_only_where_it_is_faster_by_the_margin(seconds: dict[Packing, float], chosen: str) -> None:
    assert faster_kernel(seconds, "onednn") == chosen


class KernelTimer:
    """Says each kernel's draft step takes ``seconds[kernel]``; records the order it was asked in."""

    def __init__(self, seconds: dict[Packing, list[float]]) -> None:
        self._seconds = {kernel: iter(times) for kernel, times in seconds.items()}
        self.asked: list[Packing] = []

    def __call__(self, head: DraftHead) -> float:
        self.asked.append(head.packing)
        return next(self._seconds[head.packing])


@pytest.mark.parametrize(("int8_s", "chosen"), [(0.5, "int8"), (0.97, PACKED)])
def test_auto_times_both_kernels_in_turn_keeps_each_ones_best_and_packs_the_faster(int8_s: float, chosen: str) -> None:
    head = new_head().eval()
    # A slow first turn for the packed kernel (the host was busy): its best time counts.
    timer = KernelTimer({PACKED: [3.0, 1.0, 1.0], "int8": [int8_s + 0.2, int8_s, int8_s + 0.1]})
    head.pack_products("auto", timer=timer)
    assert timer.asked == [PACKED, "int8"] * ROUNDS
    assert head.kernel_seconds == {PACKED: 1.0, "int8": int8_s}
    assert head.packing == chosen and head.head_matmul == "auto"
    assert ("int8 copies" in head.products) == (chosen == "int8")
    assert "chosen by --head-matmul auto" in head.products and f"int8 {int8_s * 1e3:.2f} ms" in head.products
    features, tokens = torch.randn(1, 3, 64), torch.tensor([[2, 4, 6]])
    with torch.inference_mode():
        assert head(features, tokens).logits.shape == (1, 3, 16)  # it serves with the kernel it kept


def test_explicit_choices_time_nothing() -> None:
    head = new_head().eval()
    for choice in ("packed", "int8", "linear"):
        head.pack_products(choice, timer=KernelTimer({}))  # a timer asked anything would raise
        assert head.kernel_seconds == {} and "chosen by" not in head.products
    assert auto_candidates(torch.float32, torch.device("meta")) == ("none",)  # off the CPU: no int8 to time


def test_a_draft_step_is_timed_as_the_median_pair_after_a_warm_up() -> None:
    head = new_head().eval()
    head.pack_products("packed")
    # Pairs of clock readings: a warm-up pair of 50 s (not counted), then 3, 1 and 2 seconds.
    readings = itertools.chain.from_iterable((t, t + d) for t, d in [(0, 50), (100, 3), (200, 1), (300, 2)])
    assert time_draft_step(head, repeats=3, clock=lambda: float(next(readings))) == 2.0
