"""The load benchmark end to end: levels 1 and 2, 8 new tokens each, against the three real processes.

Starts the services (with Redis when one answers) and the packaged target.
Checks that the harness's numbers are consistent and every stream matches
plain greedy decoding, never how fast anything is.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEVELS = (1, 2)
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory, smoke_redis_url: str, packaged_model: None) -> Path:
    out = tmp_path_factory.mktemp("bench-load")
    started = time.monotonic()
    code = load.main(
        [
            "--levels",
            ",".join(map(str, LEVELS)),
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
            "--redis-url",
            smoke_redis_url,  # a private redis-server (tests/bench/conftest.py)
            # fp32: greedy output is token-identical to plain decoding (bf16 only up to its noise floor).
            # No cost-curve profile at start-up: it takes minutes on 2 busy cores and sizes draft
            # budgets, which change speed only, never the output this test checks.
            "--verifier-arg=--dtype float32 --no-profile-cost",
            "--out-dir",
            str(out),
        ]
    )
    print(f"bench.load took {time.monotonic() - started:.1f} s")
    assert code == 0, "the harness stopped early; see its stderr"
    return out


@pytest.fixture(scope="module")
def result(out_dir: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((out_dir / "bench_load.json").read_text())
    return document


def test_both_levels_ran_without_errors(result: dict[str, Any]) -> None:
    assert result["meta"]["complete"] and not result["meta"]["error"]
    assert [level["n"] for level in result["levels"]] == list(LEVELS)
    for level, summary in zip(result["levels"], result["summaries"], strict=True):
        assert len(level["streams"]) == summary["streams"] == summary["completed"] == level["n"]
        assert summary["errors"] == {}
        assert all(stream["error"] is None for stream in level["streams"])


def test_every_stream_is_identical_to_plain_greedy_decoding(result: dict[str, Any]) -> None:
    for level, summary in zip(result["levels"], result["summaries"], strict=True):
        assert summary["identical"] == summary["compared"] == level["n"]
        for stream in level["streams"]:
            assert stream["identical"] is True, stream
            assert stream["stats_prompt_tokens"] == stream["prompt_tokens"]


def test_every_level_takes_fresh_prompts(result: dict[str, Any]) -> None:
    ids = [qid for level in result["levels"] for qid in level["question_ids"]]
    assert len(ids) == len(set(ids)) == sum(LEVELS) == result["meta"]["settings"]["prompts"]


def test_figures_add_up(result: dict[str, Any]) -> None:
    for level, summary in zip(result["levels"], result["summaries"], strict=True):
        streams = level["streams"]
        assert summary["tokens"] == sum(len(s["token_ids"]) for s in streams)
        assert summary["aggregate_tokens_per_s"] == pytest.approx(summary["tokens"] / level["wall_s"])
        for s in streams:
            assert len(s["token_ids"]) == s["generated_tokens"] <= MAX_NEW_TOKENS
            assert 0 < s["ttft_s"] <= s["latency_s"] <= level["wall_s"]
            assert s["rounds"] >= 1
        committed = sum(len(s["token_ids"]) + (s["finish_reason"] == "eos") for s in streams)
        assert summary["tau"] == pytest.approx(committed / sum(s["rounds"] for s in streams))
        assert summary["latency_p50_s"] <= summary["latency_p95_s"]
        assert level["verifier"]["polls"] >= 1 and summary["sessions_left"] == 0
    assert result["summaries"][0]["x_of_n1"] == pytest.approx(1.0)


def test_report_and_settings(result: dict[str, Any], out_dir: Path) -> None:
    settings, machine = result["meta"]["settings"], result["meta"]["machine"]
    assert settings["levels"] == list(LEVELS) and settings["max_new_tokens"] == MAX_NEW_TOKENS
    assert settings["verifier_command_args"][-3:] == ["--dtype", "float32", "--no-profile-cost"]
    assert result["meta"]["dtype"].startswith("float32")
    assert machine["cpu_model"] and machine["git_commit"]
    assert [t["reached"] for t in result["targets"]] == [None, None, None]  # levels 16 and 64 not run
    report = (out_dir / "bench_load.md").read_text()
    assert "| N | streams | tokens | aggregate tok/s |" in report and "## Targets" in report
    assert "not measured" in report
