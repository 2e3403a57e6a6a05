"""Which draft head a benchmark ran with, named in its report.

Two runs with different weights at the same path otherwise read alike: the
report names the file, the first 16 hex digits of its SHA-256, and the held-out
figures its sidecar JSON carries (``make train-draft`` writes them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_service.main import parse_config

from .machine import portable_path


def draft_head_path(drafter_args: Sequence[str] = ()) -> Path:
    """The head a drafter started with ``drafter_args`` (and this process's environment) loads.

    Read by the drafter's own flag parsing, so its precedence holds: the last ``--draft-head-path``,
    else ``$SPECSERVE_DRAFT_HEAD``, else the weights that ship with it.
    """
    return Path(parse_config(list(drafter_args))[0].draft_head_path)


def describe_draft_head(path: Path) -> dict[str, Any]:
    """Path, SHA-256 prefix and held-out figures of the head at ``path``; ``missing`` when there is no file."""
    if not path.is_file():
        return {"path": portable_path(path), "missing": True}
    digest = hashlib.sha256()
    with path.open("rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    description: dict[str, Any] = {"path": portable_path(path), "sha256": digest.hexdigest()[:16]}
    try:
        held_out = json.loads(path.with_suffix(".json").read_text()).get("held_out") or {}
    except (OSError, ValueError, AttributeError):
        held_out = {}
    if isinstance(held_out, dict):
        if "top1_agreement" in held_out:
            description["held_out_top1"] = held_out["top1_agreement"]
        tree = held_out.get("tree")
        if isinstance(tree, dict) and "acceptance_length" in tree:
            description["held_out_tree_acceptance"] = tree["acceptance_length"]
    return description


def head_line(description: dict[str, Any] | None) -> str:
    """One sentence for a markdown report ('' when the run used no head)."""
    if not description:
        return ""
    if description.get("missing"):
        return f"Draft head: `{description['path']}` (no such file). "
    figures = ""
    if "held_out_top1" in description:
        figures = f"; held-out top-1 {description['held_out_top1']}"
        if "held_out_tree_acceptance" in description:
            figures += f", tree acceptance {description['held_out_tree_acceptance']}"
    products = f" Its products in process: {description['products']}." if description.get("products") else ""
    return f"Draft head: `{description['path']}` (sha256 {description['sha256']}{figures}).{products} "
