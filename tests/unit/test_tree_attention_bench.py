"""bench.tree_attention's smoke run: the three forms measured at each size, a report a person can read."""

from __future__ import annotations

import json
from pathlib import Path

from bench.tree_attention import main


def test_a_small_run_reports_every_form_at_each_size(tmp_path: Path) -> None:
    argv = ["--shape", "smollm2-135m", "--num-layers", "1", "--context", "16", "--sizes", "1,3"]
    assert main([*argv, "--reps", "2", "--warmup", "1", "--out-dir", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "tree_attention_smollm2-135m.json").read_text())
    assert [row["n"] for row in document["rows"]] == [1, 3]
    assert all(row["one_call_ms"] > 0 and row["layers_ms"] > 0 and row["sdpa_ms"] > 0 for row in document["rows"])
    text = (tmp_path / "tree_attention_smollm2-135m.md").read_text()
    assert "| 3 |" in text and document["meta"]["step"] in text
