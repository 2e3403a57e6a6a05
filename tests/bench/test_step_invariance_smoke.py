"""bench.step_invariance end to end on a one-layer random model: both reports written, a table a person can read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_invariance import CHAIN_SIZES, TOTALS, main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_small_run_reports_every_row_count_and_chain(tmp_path: Path) -> None:
    argv = ["--num-layers", "1", "--dtypes", "float32", "--compile", "off", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    document = json.loads((tmp_path / "step_invariance_smollm2-135m_cpu.json").read_text())
    alone = [case for case in document["cases"] if case["own_rows"] == 1]
    assert len(alone) == 1 and alone[0]["max_abs_diff"]["1"] == 0.0, "a row against itself differs by nothing"
    assert set(alone[0]["max_abs_diff"]) == {str(t) for t in TOTALS}
    chain = [case for case in document["cases"] if case["own_rows"] == "chain"]
    assert len(chain) == 1 and set(chain[0]["max_abs_diff"]) == {str(n) for n in CHAIN_SIZES}
    text = (tmp_path / "step_invariance_smollm2-135m_cpu.md").read_text()
    assert "| float32 | off | 1 |" in text and document["meta"]["machine"]["cpu_model"] in text
