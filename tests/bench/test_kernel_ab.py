"""bench.kernel_ab's smoke run: both parts at each size, the bits compared, a report a person can read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kernel_ab import in_turn, main
from specserve.block_weights import block_kernels


def test_runs_take_turns_and_each_gets_its_own_median() -> None:
    order: list[str] = []
    medians = in_turn({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, reps=3)
    assert order == ["b", "a", "a", "b", "b", "a", "a", "b"]  # one untimed pass, then the order flips each rep
    assert set(medians) == {"a", "b"} and all(seconds >= 0 for seconds in medians.values())


@pytest.mark.skipif(block_kernels() is None, reason="the block kernel does not build here")
def test_a_small_run_compares_both_builds_part_by_part(tmp_path: Path) -> None:
    # HEAD's kernel: the current build itself in a clean checkout, a second build where the source has changed
    argv = ["--base", "HEAD", "--rows", "1,3", "--contexts", "20", "--layers", "2", "--reps", "2"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0, "both builds give the same bits"
    document = json.loads((tmp_path / "kernel_ab.json").read_text())
    cases = [(r["part"], r["rows"], r["context"]) for r in document["results"]]
    assert cases == [("attention", 1, 20), ("attention", 3, 20), ("products", 1, None), ("products", 3, None)]
    assert all(r["identical"] and r["base_ms"] > 0 and r["current_ms"] > 0 for r in document["results"])
    text = (tmp_path / "kernel_ab.md").read_text()
    assert "| attention | 3 | 20 |" in text and "against HEAD's" in text
    assert document["meta"]["machine"]["cpu_model"] in text


@pytest.mark.skipif(block_kernels() is None, reason="the block kernel does not build here")
def test_whole_verifies_of_the_packaged_model_alternate_builds_and_commit_the_same_tokens(tmp_path: Path) -> None:
    argv = ["--base", "HEAD", "--parts", "verify", "--rows", "1,3", "--contexts", "16", "--reps", "2"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "kernel_ab.json").read_text())["results"]
    assert [(r["part"], r["rows"], r["context"]) for r in results] == [("verify", 1, 16), ("verify", 3, 16)]
    assert all(r["identical"] and r["base_ms"] > 0 and r["current_ms"] > 0 for r in results)
