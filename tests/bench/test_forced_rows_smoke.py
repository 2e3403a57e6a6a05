"""The forced-rows benchmark end to end on the packaged target: 2 repetitions of each case. Checks the report's
shape and that each case ran its repetitions, never how fast anything is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import forced_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_every_case_is_timed_and_reported(tmp_path: Path, packaged_model: None) -> None:
    forced_rows.main(["--repetitions", "2", "--out-dir", str(tmp_path)])
    document = json.loads((tmp_path / "forced_rows.json").read_text())
    assert set(document["seconds"]) == set(forced_rows.CASES)
    assert all(len(values) == 2 and min(values) > 0 for values in document["seconds"].values())
    assert document["meta"]["dtype"] == "float32" and document["meta"]["machine"]["cpu_model"]
    report = (tmp_path / "forced_rows.md").read_text()
    assert all(f"| {name} |" in report for name in forced_rows.CASES)
    assert "| 1 row, many allowed |" in report and " | 1.00 |" in report
