"""bench.sampling end to end, small: one prompt, 12 tokens, T = 0 and 0.7, both drafters (two clusters).

Checks that the report holds what was measured (every output equal with speculation on and off, rows for
each drafter and temperature, ratios computed from the records), never how fast anything is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sampling

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_sampling_benchmark_reports_every_drafter_and_temperature(
    tmp_path: Path, smoke_redis_url: str, packaged_model: None
) -> None:
    code = sampling.main(
        [
            "--temperatures",
            "0,0.7",
            "--categories",
            "writing",
            "--max-new-tokens",
            "12",
            # Two test workers share the cores: a proposal may wait past the 1 s default, and a dropped drafter
            # would leave a row with nothing drafted. The harness's bookkeeping is what is checked here.
            "--draft-timeout-ms",
            "20000",
            "--redis-url",
            smoke_redis_url,  # a private redis-server (tests/bench/conftest.py)
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "sampling.json").read_text())
    rows = {(row["drafter"], row["temperature"]): row for row in report["summary"]}
    assert set(rows) == {(d, t) for d in ("coupled", "uncoupled") for t in (0.0, 0.7)}
    records = report["records"]
    assert len(records) == 2 * 2 * 2  # drafters x temperatures x (speculation on, off)
    for row in rows.values():
        assert row["prompts"] == 1 and row["same_text"] == 1 and row["drafter_errors"] == 0
        ours = [r for r in records if (r["drafter"], r["temperature"]) == (row["drafter"], row["temperature"])]
        on = next(r for r in ours if r["speculation"] == "auto")
        off = next(r for r in ours if r["speculation"] == "off")
        assert row["speedup"] == pytest.approx(
            (len(on["tokens"]) / on["wall_s"]) / (len(off["tokens"]) / off["wall_s"])
        )
        assert row["tau"] == pytest.approx(len(on["tokens"]) / on["rounds"])
    assert "| 0.7 | coupled |" in (tmp_path / "sampling.md").read_text()
