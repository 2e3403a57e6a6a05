"""The coordinator's /metrics endpoint: open by default, behind a bearer token with --metrics-token-file."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from coordinator import main as coordinator_main
from coordinator.metrics_http import METRICS_TOKEN_MISSING, METRICS_TOKEN_WRONG, serve_metrics
from specserve.auth.internal import read_token

TOKEN = "0123456789abcdef"


def scrape(port: int, authorization: str | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("specserve_probe", "A sample", registry=registry).inc()
    return registry


@pytest.fixture
def guarded(registry: CollectorRegistry) -> Iterator[int]:
    server = serve_metrics(registry, 0, "127.0.0.1", TOKEN)
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_metrics_are_open_without_a_token(registry: CollectorRegistry) -> None:
    server = serve_metrics(registry, 0, "127.0.0.1")
    try:
        status, body, _ = scrape(server.server_port)
        assert status == 200 and "specserve_probe_total 1.0" in body
    finally:
        server.shutdown()
        server.server_close()


def test_a_token_is_required_when_configured(guarded: int) -> None:
    status, body, headers = scrape(guarded)
    assert status == 401 and body.strip() == METRICS_TOKEN_MISSING and "specserve_probe" not in body
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = scrape(guarded, "Bearer not-the-token")
    assert status == 401 and body.strip() == METRICS_TOKEN_WRONG
    assert scrape(guarded, f"Basic {TOKEN}")[0] == 401
    status, body, _ = scrape(guarded, f"Bearer {TOKEN}")
    assert status == 200 and "specserve_probe_total 1.0" in body


def test_the_flag_and_its_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert coordinator_main.parse_config([])[0].metrics_token_file is None
    assert coordinator_main.parse_config(["--metrics-token-file", "t"])[0].metrics_token_file == "t"
    monkeypatch.setenv("SPECSERVE_METRICS_TOKEN_FILE", "/etc/metrics/token")
    assert coordinator_main.parse_config([])[0].metrics_token_file == "/etc/metrics/token"
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    assert read_token(str(tmp_path / "token"), "--metrics-token-file") == TOKEN
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--metrics-token-file .* is empty"):
        read_token(str(tmp_path / "empty"), "--metrics-token-file")
