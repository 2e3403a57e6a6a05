"""bench.speculation_ceiling on made-up cost curves: expected tokens, the best round, the acceptance a target needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.speculation_ceiling import acceptance_needed, ceiling, committed, curve_of, main, markdown

FLAT = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}  # rows cost nothing extra: the longest chain always wins
STEEP = {1: 1.0, 2: 1.5, 4: 3.0}  # every row costs as much as plain decoding's step or more


def test_a_round_commits_its_accepted_prefix_and_the_verifiers_own_token() -> None:
    assert committed(0.0, 4) == 1.0  # nothing accepted: the verifier's token alone
    assert committed(1.0, 4) == 4.0  # every draft accepted
    assert committed(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)


def test_the_ceiling_takes_the_round_that_earns_most_for_its_cost() -> None:
    assert ceiling(FLAT, 0.9).tokens == 8 and ceiling(FLAT, 0.9).speedup == pytest.approx(committed(0.9, 8))
    assert ceiling(STEEP, 0.5).tokens == 1 and ceiling(STEEP, 0.5).speedup == 1.0  # drafting never pays here
    curve = {1: 1.0, 2: 1.17, 4: 1.72, 8: 2.99}
    assert ceiling(curve, 0.8).tokens == 4 and ceiling(curve, 0.8).speedup == pytest.approx(2.952 / 1.72)


def test_the_acceptance_a_target_needs_is_the_least_that_reaches_it() -> None:
    needed = acceptance_needed({1: 1.0, 2: 1.2}, 1.5)
    assert needed is not None and needed.tokens == 2
    assert needed.alpha == pytest.approx(0.8, abs=1e-3)  # (1 + alpha) / 1.2 = 1.5
    assert ceiling({1: 1.0, 2: 1.2}, needed.alpha - 0.01).speedup < 1.5 <= needed.speedup
    assert acceptance_needed(STEEP, 1.5) is None  # even a drafter never wrong: 2 tokens for 1.5 steps, 1.33x


def test_the_report_section_names_each_target_reached_or_out_of_reach() -> None:
    text = "\n".join(markdown(STEEP, alphas=(0.5, 1.0), targets=(1.25, 2.0)))
    assert "| 1.00 | 2 | 2.00 | 1.33x |" in text  # ties go to the smaller round
    assert "1.25x plain decoding needs alpha >= " in text
    assert "2.00x plain decoding: out of reach on this curve" in text


def test_the_command_reads_verify_cost_reports_and_refuses_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "verify_cost.json"
    report.write_text(json.dumps({"rows": [{"tokens": 1, "ratio": 1.0}, {"tokens": 2, "ratio": 1.2}]}))
    assert curve_of(json.loads(report.read_text())) == {1: 1.0, 2: 1.2}
    assert main([str(report)]) == 0
    assert "c(2)/c(1) 1.20" in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(SystemExit):
        main([str(other)])
    assert "not a bench.verify_cost report" in capsys.readouterr().err
