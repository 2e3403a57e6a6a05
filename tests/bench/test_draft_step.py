"""bench.draft_step's measurement on a tiny random head: both forms timed at every row count, every round."""

from __future__ import annotations

import torch

from bench.draft_step import ROWS, markdown, time_steps
from draft_service.draft_head import DraftHead, DraftHeadConfig
from tests.conftest import tiny_llama


def test_both_forms_are_timed_alternately_and_the_chosen_form_is_restored() -> None:
    target = tiny_llama(vocab_size=48, seed=3, context=256)
    config = DraftHeadConfig.for_target(target.config, 16, intermediate_size=96)
    head = DraftHead(
        config,
        target.get_input_embeddings().weight.detach(),
        target.get_output_embeddings().weight.detach(),
        torch.arange(16),
    ).eval()
    head.choose_logits_form("linear")  # the head's linears become FormedLinear, as in serving
    head.transposed_rows = frozenset({4})
    head.layer_matmul.transposed_rows = frozenset({2, 4})
    times = time_steps(head, context=20, rounds=2, reps=2)
    assert head.transposed_rows == frozenset({4}) and head.layer_matmul.transposed_rows == frozenset({2, 4})
    assert set(times) == {"F.linear", "chosen"}
    assert all(len(times[form][rows]) == 2 and min(times[form][rows]) > 0 for form in times for rows in ROWS)
    meta = {
        "measured_at": "now",
        "dtype": "float32",
        "context": 20,
        "rounds": 2,
        "reps": 2,
        "chosen": "x",
        "machine": {"cpu_model": "cpu", "torch_threads": 2, "torch_version": "t"},
    }
    report = markdown(meta, times)
    assert "| 4 |" in report and "chosen / F.linear" in report
