"""bench.multi_turn's pieces without a cluster: the conversations as turns, and the report from played turns."""

from __future__ import annotations

from pathlib import Path

from bench.dataset import load_agent_loops
from bench.multi_turn import Turn, conversations, markdown, summarize, write_report


def test_each_agent_conversation_opens_with_its_task_and_adds_one_message_a_turn() -> None:
    plays = conversations(load_agent_loops(), max_turns=3)
    assert len(plays) == 14
    for play in plays:
        assert [role for role, _ in play.opening] == ["system", "user"]
        assert 1 <= len(play.followups) <= 2  # every conversation has a tool result after its first answer
        assert all(role == "user" for role, _ in play.followups)  # tool results go as user turns


def turn(index: int, cached: int, prefill_s: float, text: str = "ok") -> Turn:
    return Turn(7, index, 500 + 100 * index, cached, prefill_s, prefill_s + 0.05, prefill_s + 1.0, 16, text)


def test_the_report_compares_the_turns_after_the_first(tmp_path: Path) -> None:
    played = {
        "kept": [turn(0, 0, 2.0), turn(1, 560, 0.2), turn(2, 660, 0.3)],
        "none": [turn(0, 0, 2.0), turn(1, 0, 2.2), turn(2, 0, 2.7, text="other")],
    }
    report = summarize(played)
    kept, none = report.summaries["kept"], report.summaries["none"]
    assert (kept.turns, kept.prompt_tokens, kept.cached_tokens) == (2, 1300, 1220)
    assert none.cached_tokens == 0 and (report.identical, report.compared) == (2, 3)
    assert report.ratio("prefill_s") == (2.2 + 2.7) / (0.2 + 0.3)
    assert report.ratio("median_first_text_s") == ((2.25 + 2.75) / 2) / ((0.25 + 0.35) / 2)
    text = markdown(report)
    assert "1220 (94%)" in text and "prefill 9.80x" in text and "Identical text: 2/3" in text
    json_path, md_path = write_report(report, played, tmp_path)
    assert json_path.exists() and md_path.read_text() == text
