"""bench.draft_step's measurement on a tiny random head: every arm timed at every row count, every round."""

from __future__ import annotations

import torch

from bench.draft_step import ARMS, ROWS, markdown, time_steps
from draft_service.draft_head import DraftHead, DraftHeadConfig
from tests.conftest import tiny_llama


def test_every_arm_is_timed_interleaved_and_the_head_is_left_as_it_came() -> None:
    target = tiny_llama(vocab_size=48, seed=3, context=256)
    config = DraftHeadConfig.for_target(target.config, 16, intermediate_size=96)
    head = DraftHead(
        config,
        target.get_input_embeddings().weight.detach(),
        target.get_output_embeddings().weight.detach(),
        torch.arange(16),
    ).eval()
    head.pack_products("linear")  # as served with --head-matmul linear: the bench times copies
    times = time_steps(head, context=20, rounds=2, reps=2)
    assert head.head_matmul == "linear" and head.packing == "none"
    assert set(times) == set(ARMS) == {"F.linear", "packed", "served"}
    assert all(len(times[arm][rows]) == 2 and min(times[arm][rows]) > 0 for arm in times for rows in ROWS)
    meta = {
        "measured_at": "now",
        "context": 20,
        "rounds": 2,
        "reps": 2,
        "machine": {"cpu_model": "cpu", "torch_threads": 2, "torch_version": "t"},
    }
    report = markdown(meta, {"float32": {"products": head.products, "times_ms": times}})
    assert "## float32" in report and "| 4 |" in report
    assert "packed / F.linear (per round)" in report and "served / packed (per round)" in report
