"""Static-shape steps' bookkeeping: window buckets and which steps they take (the forward is checked in
``test_llama_forward.py`` uncaptured, and in ``tests/gpu`` as CUDA graphs)."""

from __future__ import annotations

import torch

from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan
from target_service.static_steps import MAX_WINDOW, WINDOW_STEP, window_bucket, windows_up_to
from tests.conftest import tiny_llama
from tests.unit.test_llama_forward import PROMPTS, TREES, build, expected_rows, tree_step

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


def test_windows_up_to_a_context_are_every_bucket_a_step_may_take() -> None:
    assert windows_up_to(1) == (64,)
    assert windows_up_to(100) == (64, 128)
    assert windows_up_to(WINDOW_STEP) == (64, 128, 256, 512, 1024, 2048, WINDOW_STEP)
    assert windows_up_to(WINDOW_STEP + 1) == (*windows_up_to(WINDOW_STEP), 2 * WINDOW_STEP)
    for tokens in range(1, 3 * WINDOW_STEP, 89):
        assert window_bucket(tokens) in windows_up_to(tokens)


def test_prepared_steps_touch_only_the_scratch_slot_and_leave_later_steps_exact() -> None:
    """``prepare`` runs every (rows, window) shape ahead of requests (captured on a GPU, uncaptured here): its
    blank rows write the scratch slot alone, so a session's cached keys and values survive it, and a step
    after it computes what a step without it does."""
    model = build("llama")
    runner = ModelRunner(model, "off", static=True)
    assert runner._static is not None
    arena = runner.new_arena(1024)
    for tensor in (*arena.keys, *arena.values):
        tensor[:, :1024].fill_(7.0)
    windows = (64, 128)
    shapes = runner._static.prepare(arena, windows, max_rows=5)
    assert shapes == len(windows) * 4  # row buckets 1, 2, 4 and 8 (the one 5 rows take)
    for tensor in (*arena.keys, *arena.values):
        assert torch.all(tensor[:, :1024] == 7.0), "a prepared step wrote outside the scratch slot"
        assert torch.any(tensor[:, 1024] != 7.0)
    logits = tree_step(runner, PROMPTS, TREES, arena)
    torch.testing.assert_close(logits, expected_rows(model).float(), atol=1e-5, rtol=1e-5)
    assert runner.prepare_steps(arena, 8, 128) == 0, "without CUDA graphs there is nothing to capture ahead"
