"""bench.head_offline on a tiny random target and an untrained head: the figures per task and their report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import head_offline
from draft_service.draft_head import DraftHead, DraftHeadConfig
from draft_service.training.distill_data import distil_batch
from tests.conftest import tiny_llama

VOCAB = 48
TARGET = tiny_llama(vocab_size=VOCAB, seed=5, context=256)
EMBEDDING = TARGET.get_input_embeddings().weight.detach()
LM_HEAD = TARGET.get_output_embeddings().weight.detach()


def test_figures_per_task_and_overall_from_the_same_answers() -> None:
    config = DraftHeadConfig.for_target(TARGET.config, VOCAB, intermediate_size=96)
    head = DraftHead(config, EMBEDDING, LM_HEAD, torch.arange(VOCAB))
    by_task = {
        "mt_bench": distil_batch(TARGET, [[1, 2, 3, 4], [7, 8]], 12, frozenset({VOCAB - 1}), 0),
        "rag": distil_batch(TARGET, [[5, 6, 7, 8, 9, 10]], 12, frozenset({VOCAB - 1}), 0),
    }
    figures = head_offline.figures_by_task(head.eval(), by_task, positions=30)
    assert list(figures) == ["overall", "mt_bench", "rag"]
    answers = {task: sum(len(s["tokens"]) - s["prompt_length"] for s in seqs) for task, seqs in by_task.items()}
    assert figures["overall"]["answer_positions"] == sum(answers.values()) > 0
    for task, answer_positions in answers.items():
        assert figures[task]["answer_positions"] == answer_positions
    for record in figures.values():
        assert 0.0 <= record["top1_agreement"] <= 1.0
        assert record["tree_at_serving_cap"]["max_nodes"] == head_offline.SERVING_TREE_NODES
        # A 24-node tree holds the 16-node one: it accepts at least as much (the record rounds to 3 places).
        capped = record["tree_at_serving_cap"]["acceptance_length"]
        assert record["tree"]["acceptance_length"] >= round(capped, 3) >= 1.0


def test_the_report_sets_served_tau_beside_each_task(tmp_path: Path) -> None:
    run = tmp_path / "spec_bench.json"
    summaries = [
        {"mode": "baseline", "group": "overall", "tau": 1.0},
        {"mode": head_offline.HEAD_MODE, "group": "overall", "tau": 1.14},
        {"mode": head_offline.HEAD_MODE, "group": "rag", "tau": 1.13},
    ]
    run.write_text(json.dumps({"summaries": summaries}))
    assert head_offline.serving_tau(run) == {"overall": 1.14, "rag": 1.13}
    record = {
        "answer_positions": 10,
        "top1_agreement": 0.3,
        "chain": {"estimated_tau": 1.4},
        "tree": {"acceptance_length": 1.9},
        "tree_at_serving_cap": {"acceptance_length": 1.8},
    }
    report = {
        "figures": {"overall": record, "qa": record},
        "serving_tau": head_offline.serving_tau(run),
        "serving_report": str(run),
        "settings": {
            "model": "m",
            "prompts": 2,
            "prompts_per_category": 1,
            "max_new_tokens": 8,
            "positions": 5,
            "head_dtype": "float32",
        },
        "machine": {"cpu_model": "cpu", "cpus_available": 2, "torch_version": "t", "git_commit": "c", "git_dirty": 0},
        "distill_s": 1.0,
        "started_at": "now",
    }
    text = head_offline.render(report)
    assert "| overall | 10 | 0.300 | 1.40 | 1.90 | 1.80 | 1.14 |" in text
    assert "| qa | 10 | 0.300 | 1.40 | 1.90 | 1.80 | n/a |" in text


def test_arguments_that_cannot_run_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        head_offline.parse_args(["--positions", "0"])
    assert "--positions must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        head_offline.parse_args(["--serving", "/nonexistent/spec_bench.json"])
    assert "no such file" in capsys.readouterr().err
