"""Each default is defined once: the chart passes a server flag only when its value is set, else the server's
own default rules (numbers the chart needs for itself, such as ports and the KV cache its memory limit is sized
for, are the exception). Renders with `helm template` like tests/deploy/test_helm_chart.py."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import CoordinatorConfig
from tests.deploy.test_helm_chart import (
    Obj,
    container_of,
    flag_values,
    helm,  # noqa: F401  (the session fixture)
    render,
    rendered,  # noqa: F401  (the session fixture)
)


def test_null_values_leave_the_servers_defaults(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    verifier = flag_values(container_of(rendered["default"], "verifier")["args"])
    assert "dtype" not in verifier and "max-batch-tokens" not in verifier
    coordinator = flag_values(container_of(rendered["default"], "coordinator")["args"])
    assert "queue-timeout-s" not in coordinator


def test_set_values_reach_the_flags(helm: str, tmp_path: Path) -> None:  # noqa: F811
    values = tmp_path / "values.yaml"  # a file, since --set would pass 1.5 as a string
    values.write_text(
        "verifier: {dtype: bfloat16, maxBatchTokens: 512, kvCacheGiB: 1.5}\n"
        "coordinator:\n  admission: {queueTimeoutSeconds: 12}\n"
    )
    objs = render(helm, values_files=[values])
    verifier = flag_values(container_of(objs, "verifier")["args"])
    assert (verifier["dtype"], verifier["max-batch-tokens"], verifier["kv-cache-gib"]) == ("bfloat16", "512", "1.5")
    assert flag_values(container_of(objs, "coordinator")["args"])["queue-timeout-s"] == "12"
    unsized = flag_values(container_of(render(helm, set_values=["verifier.kvCacheGiB=null"]), "verifier")["args"])
    assert "kv-cache-gib" not in unsized


def test_the_coordinators_startup_probe_outlasts_its_own_wait_for_the_verifier(
    rendered: dict[str, list[Obj]],  # noqa: F811
) -> None:
    """The chart leaves --startup-timeout-s to the server; its startup probe must give the coordinator that long
    (it reports NOT_SERVING while it waits for the verifier, then exits with the reason)."""
    for name in ("default", "production"):
        probe = container_of(rendered[name], "coordinator")["startupProbe"]
        assert "startup-timeout-s" not in flag_values(container_of(rendered[name], "coordinator")["args"])
        assert probe["periodSeconds"] * probe["failureThreshold"] >= CoordinatorConfig().startup_timeout_s, name
