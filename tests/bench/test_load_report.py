"""bench.load_report on made-up levels: summaries, the issue's targets and the report (no processes)."""

from __future__ import annotations

from typing import Any

from bench.load import parse_levels, requested_dtype, resolve_dtypes
from bench.load_report import LevelResult, StreamResult, check_targets, markdown, summarize_all


def stream(latency_s: float, tokens: int = 10, error: str | None = None, eos: bool = False) -> StreamResult:
    done = error is None
    return StreamResult(
        question_id=1,
        category="writing",
        prompt_tokens=5,
        token_ids=[7] * tokens,
        finish_reason=("eos" if eos else "length") if done else None,
        latency_s=latency_s,
        ttft_s=latency_s / 4,
        generated_tokens=tokens if done else 0,
        rounds=5 if done else 0,
        stats_prompt_tokens=5 if done else None,
        error=error,
    )


def levels(n16_latency_s: float, n64_error: str | None = None) -> list[LevelResult]:
    return [
        LevelResult(1, 1.0, [stream(1.0)]),
        LevelResult(16, 2.0, [stream(n16_latency_s) for _ in range(16)]),
        LevelResult(64, 10.0, [stream(9.0) for _ in range(63)] + [stream(10.0, 3, error=n64_error)]),
    ]


def test_summaries_count_tokens_errors_and_tau() -> None:
    measured = levels(2.0, n64_error="DEADLINE_EXCEEDED")
    measured[0].streams[0] = stream(1.0, tokens=9, eos=True)
    one, sixteen, sixty_four = summarize_all(measured)
    assert one.tokens == 9 and one.tau == 2.0 and one.x_of_n1 == 1.0  # 9 tokens + EOS over 5 rounds
    assert sixteen.aggregate_tokens_per_s == 80.0 and sixteen.x_of_n1 == 80.0 / 9.0
    assert sixty_four.completed == 63 and sixty_four.errors == {"DEADLINE_EXCEEDED": 1}
    assert sixty_four.tokens == 63 * 10 + 3  # a failed stream's partial output counts towards throughput
    assert sixty_four.latency_p95_s == 9.0  # over completed streams only
    assert one.identical is None and one.compared == 0


def test_targets_report_reached_or_not_with_figures() -> None:
    reached = check_targets(summarize_all(levels(2.0)))
    assert [t.reached for t in reached] == [True, True, True]
    assert "8.00x" in reached[0].detail and "2.00x" in reached[1].detail
    missed = check_targets(summarize_all(levels(3.5, n64_error="UNAVAILABLE")))
    assert [t.reached for t in missed] == [True, False, False]
    assert "UNAVAILABLE 1" in missed[2].detail
    assert [t.reached for t in check_targets(summarize_all(levels(2.0)[:1]))] == [None, None, None]


def test_markdown_has_the_table_and_the_targets() -> None:
    meta: dict[str, Any] = {
        "started_at": "now",
        "duration_s": 1.0,
        "dtype": "float32",
        "settings": {
            "model": "m",
            "model_source": "s",
            "reference": "plain",
            "levels": [1, 16, 64],
            "max_new_tokens": 10,
            "stream_timeout_s": 900.0,
            "prompts": 81,
            "pool": "in-memory",
            "pool_emptied_before_measuring": False,
            "verifier_command_args": ["--torch-threads", "2"],
        },
        "machine": {
            "cpu_model": "cpu",
            "cpus_available": 2,
            "logical_cpus": 2,
            "memory_gib": 1.0,
            "torch_version": "t",
            "transformers_version": "x",
            "git_commit": "abc",
        },
    }
    measured = levels(2.0)
    report = markdown(meta, summarize_all(measured), measured)
    assert "\n| 1 | 1/1 | 10 | 10.0 | 1.00 |" in report and "\n| 64 | 64/64 |" in report
    assert "**reached**: aggregate throughput at N=16 >= 5x N=1" in report
    assert "- Drafter: `defaults`. Draft head: not recorded." in report
    meta["settings"]["drafter_command_args"] = ["--draft-head-path", "v4.pt"]
    meta["settings"]["draft_head"] = {"path": "v4.pt", "sha256": "0123456789abcdef"}
    report = markdown(meta, summarize_all(measured), measured)
    assert "- Drafter: `--draft-head-path v4.pt`. Draft head: `v4.pt` (sha256 0123456789abcdef). " in report


def test_flags_parse() -> None:
    assert parse_levels("1, 4,16") == [1, 4, 16]
    assert requested_dtype(["--torch-threads", "2", "--dtype", "bfloat16"]) == "bfloat16"
    assert requested_dtype(["--dtype=float16"]) == "float16" and requested_dtype([]) is None
    assert resolve_dtypes("", ["--dtype", "bfloat16"], "auto")[1] == "bfloat16"
    assert resolve_dtypes("float32", ["--dtype", "bfloat16"], "auto") == ("float32", "float32")
    assert resolve_dtypes("", [], "auto")[1] == "float32"
