"""Skips that must not hide missing checks in CI."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def on_ci() -> bool:
    """CI=true (set by most CI systems, and by .ci/run)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_tool(message: str) -> NoReturn:
    """A skip on a workstation; a failure under CI, where `make test` installs every tool the tests use first."""
    if on_ci():
        pytest.fail(f"{message} (CI is set: `make test` provides this tool, so its checks must run)")
    pytest.skip(message)
