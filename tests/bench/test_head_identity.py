"""Reports name the draft head they ran with: which file, by hash, with its held-out figures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bench.head_identity import describe_draft_head, draft_head_path, head_line
from bench.machine import portable_path
from bench.run import uses_head
from draft_service.config import DrafterConfig


def test_the_path_follows_the_drafters_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSERVE_DRAFT_HEAD", raising=False)
    assert draft_head_path() == Path(DrafterConfig().draft_head_path)
    monkeypatch.setenv("SPECSERVE_DRAFT_HEAD", "/env/head.pt")
    assert draft_head_path() == Path("/env/head.pt")
    assert draft_head_path(["--torch-threads", "2", "--draft-head-path", "/a.pt"]) == Path("/a.pt")
    assert draft_head_path(["--draft-head-path=/a.pt", "--draft-head-path", "/b.pt"]) == Path("/b.pt")


def test_a_head_is_named_by_its_hash_and_held_out_figures(tmp_path: Path) -> None:
    weights = tmp_path / "head.pt"
    weights.write_bytes(b"weights v1")
    weights.with_suffix(".json").write_text(
        json.dumps({"held_out": {"top1_agreement": 0.625, "tree": {"acceptance_length": 3.09}}})
    )
    description = describe_draft_head(weights)
    assert (
        description
        == {
            "path": "head.pt",  # outside the repository and the home directory: the name alone
            "sha256": hashlib.sha256(b"weights v1").hexdigest()[:16],
            "held_out_top1": 0.625,
            "held_out_tree_acceptance": 3.09,
        }
    )
    assert "held-out top-1 0.625, tree acceptance 3.09" in head_line(description)
    weights.write_bytes(b"weights v2")
    assert describe_draft_head(weights)["sha256"] != description["sha256"]


def test_a_head_without_figures_or_file_still_reads(tmp_path: Path) -> None:
    weights = tmp_path / "head.pt"
    weights.write_bytes(b"w")
    weights.with_suffix(".json").write_text("not json")
    assert set(describe_draft_head(weights)) == {"path", "sha256"}
    missing = describe_draft_head(tmp_path / "none.pt")
    assert missing["missing"] and "no such file" in head_line(missing)
    assert head_line(None) == ""


def test_only_modes_that_draft_with_the_head_record_it() -> None:
    assert not uses_head(["baseline", "inproc:prompt_lookup+ngram_pool"])
    assert uses_head(["baseline", "inproc:draft_model"])
    assert uses_head(["inproc"]) and uses_head(["distributed"])


def test_a_result_records_no_absolute_machine_path() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert portable_path(repo / "draft_service" / "weights" / "smollm2-draft-head.pt") == (
        "draft_service/weights/smollm2-draft-head.pt"
    )
    assert portable_path(Path.home() / ".cache" / "specserve" / "model") == "~/.cache/specserve/model"
    assert portable_path("/elsewhere/head.pt") == "head.pt"
