"""``--head-matmul auto``: the faster of the packed and int8 products, timed on an injected clock or timer."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from draft_service.draft_head import DraftHead
from draft_service.head_products import WeightPack, auto_candidates
from draft_service.head_timing import INT8_MARGIN, ROUNDS, faster_kernel, time_draft_step
from specserve.block_weights import block_kernels, quantize_q8_0
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
        ({"onednn": 1.0, "int8": 0.8, "blocks": 0.6}, "blocks"),  # of those faster by the margin, the fastest
        ({"onednn": 1.0, "int8": 0.8, "blocks": 0.95}, "int8"),
        ({"onednn": 1.0, "int8": 1.2, "blocks": 0.95}, "onednn"),
        ({}, "onednn"),  # nothing timed
    ],
)
def test_another_kernel_is_chosen_only_where_it_is_faster_by_the_margin(
    seconds: dict[Packing, float], chosen: str
) -> None:
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
def test_auto_times_the_kernels_in_turn_keeps_each_ones_best_and_packs_the_fastest(int8_s: float, chosen: str) -> None:
    head = new_head().eval()
    candidates = auto_candidates(torch.float32, CPU)
    assert candidates[:2] == (PACKED, "int8") and candidates[2:] in ((), ("blocks",))
    # A slow first turn for the packed kernel (the host was busy): its best time counts. Q8_0 blocks (where the
    # kernel builds) are slower than both here.
    timer = KernelTimer({PACKED: [3.0, 1.0, 1.0], "int8": [int8_s + 0.2, int8_s, int8_s + 0.1], "blocks": [2.0] * 3})
    head.pack_products("auto", timer=timer)
    assert timer.asked == list(candidates) * ROUNDS
    assert head.kernel_seconds == {PACKED: 1.0, "int8": int8_s} | ({"blocks": 2.0} if "blocks" in candidates else {})
    assert head.packing == chosen and head.head_matmul == "auto"
    assert ("int8 copies" in head.products) == (chosen == "int8")
    assert "chosen by --head-matmul auto" in head.products and f"int8 {int8_s * 1e3:.2f} ms" in head.products
    features, tokens = torch.randn(1, 3, 64), torch.tensor([[2, 4, 6]])
    with torch.inference_mode():
        assert head(features, tokens).logits.shape == (1, 3, 16)  # it serves with the kernel it kept


def test_explicit_choices_time_nothing() -> None:
    head = new_head().eval()
    for choice in ("packed", "int8", "linear", "blocks"):
        head.pack_products(choice, timer=KernelTimer({}))  # a timer asked anything would raise
        assert head.kernel_seconds == {} and "chosen by" not in head.products
    assert auto_candidates(torch.float32, torch.device("meta")) == ("none",)  # off the CPU: no int8 to time


def test_a_draft_step_is_timed_as_the_median_pair_after_a_warm_up() -> None:
    head = new_head().eval()
    head.pack_products("packed")
    # Pairs of clock readings: a warm-up pair of 50 s (not counted), then 3, 1 and 2 seconds.
    readings = itertools.chain.from_iterable((t, t + d) for t, d in [(0, 50), (100, 3), (200, 1), (300, 2)])
    assert time_draft_step(head, repeats=3, clock=lambda: float(next(readings))) == 2.0


@pytest.mark.skipif(block_kernels() is None, reason="no block kernel here")
def test_q8_0_blocks_serve_the_head_its_draft_logits_rows_exactly() -> None:
    """--head-matmul blocks: the head's own weights rounded to Q8_0, the draft logits' rows (a GGUF head's Q8_0
    blocks) read as they are; a weight whose rows are not whole blocks runs on the float kernel."""
    head = new_head().eval()
    head.draft_lm_head.copy_(quantize_q8_0(head.draft_lm_head))  # as the packaged target's head rows are
    features, tokens = torch.randn(1, 3, 64), torch.tensor([[2, 4, 6]])
    with torch.inference_mode():
        exact = head(features, tokens)
        head.pack_products("blocks")
        assert head.packing == "blocks" and "Q8_0 blocks" in head.products
        served = head(features, tokens)
    assert head.logits_pack is not None and head.logits_pack.product.block_format == "Q8_0"
    torch.testing.assert_close(served.features, exact.features, atol=0.05, rtol=0.05)  # 8-bit weights
    logits = head.logits_pack.product(exact.features[0])
    torch.testing.assert_close(logits, F.linear(exact.features[0], head.draft_lm_head), atol=1e-5, rtol=1e-5)
    odd = WeightPack(torch.randn(8, 40), None, "blocks")  # 40 inputs: no whole blocks
    assert odd.product.block_format is None and odd.product.packing == PACKED
