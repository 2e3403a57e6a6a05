"""Static-shape steps' bookkeeping: window buckets and which steps they take (the forward is checked in
``test_llama_forward.py`` uncaptured, and in ``tests/gpu`` as CUDA graphs)."""

from __future__ import annotations

import torch

from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan
from target_service.static_steps import MAX_WINDOW, WINDOW_STEP, window_bucket
from tests.conftest import tiny_llama

CPU = torch.device("cpu")


def test_windows_are_powers_of_two_then_multiples_of_the_step() -> None:
    assert [window_bucket(t) for t in (1, 64, 65, 300, WINDOW_STEP)] == [64, 64, 128, 512, WINDOW_STEP]
    assert window_bucket(WINDOW_STEP + 1) == 2 * WINDOW_STEP
    assert window_bucket(3 * WINDOW_STEP - 5) == 3 * WINDOW_STEP
    for tokens in range(1, 3 * WINDOW_STEP, 97):
        assert tokens <= window_bucket(tokens) < max(2 * tokens, tokens + WINDOW_STEP, 65)


def test_steps_too_long_or_too_wide_run_the_ragged_step() -> None:
    runner = ModelRunner(tiny_llama(context=MAX_WINDOW * 2), "off", static=True)
    assert runner._static is not None
    arena = runner.new_arena(MAX_WINDOW + 64)
    region = arena.allocate(MAX_WINDOW + 32)
    assert region is not None
    covers = runner._static.covers
    assert covers(StepPlan(arena, [Segment.chunk(region, 100, slice(0, 256), CPU)]), 256)
    assert not covers(StepPlan(arena, [Segment.chunk(region, 100, slice(0, 257), CPU)]), 257)
    assert not covers(StepPlan(arena, [Segment.chunk(region, MAX_WINDOW, slice(0, 1), CPU)]), 1)
    plain = ModelRunner(tiny_llama(), "off").new_arena(64)  # no scratch slot: nowhere for padding rows to write
    assert not covers(StepPlan(plain, [Segment.chunk(region, 0, slice(0, 1), CPU)]), 1)
