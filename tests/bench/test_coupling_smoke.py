"""bench.coupling on one prompt and a few tokens: the report's rates are rates of what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import coupling

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_coupling_report_holds_rates_between_zero_and_one(tmp_path: Path, packaged_model: None) -> None:
    args = ["--temperatures", "1.0", "--categories", "writing", "--max-new-tokens", "8", "--out-dir", str(tmp_path)]
    assert coupling.main(args) == 0
    (row,) = json.loads((tmp_path / "coupling.json").read_text())["summary"]
    assert 1 <= row["positions"] <= 8
    for name in ("coupled", "top1", "independent"):  # means of 0/1 matches over the positions
        assert row[name] * row["positions"] == pytest.approx(round(row[name] * row["positions"]))
    assert 0.0 < row["bound"] <= 1.0 and 0.0 <= row["tv"] < 1.0
    assert "| 1 |" in (tmp_path / "coupling.md").read_text()
