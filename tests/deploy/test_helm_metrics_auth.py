"""metrics.auth: the coordinator's /metrics behind a bearer token, the Secret holding it, the ServiceMonitor sending it.

Renders with `helm template` like tests/deploy/test_helm_chart.py, whose helpers and checks it reuses.
"""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest

from tests.deploy.test_helm_chart import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    SECRETS_DIR,
    Obj,
    container_of,
    flag_values,
    helm,  # noqa: F401  (the session fixture)
    iter_problems,
    named,
    of_kind,
    render,
    run_helm,
    secret_mount_dir,
)

MONITOR = ["metrics.serviceMonitor.enabled=true"]


def endpoint(objs: list[Obj]) -> Obj:
    (monitor,) = of_kind(objs, "ServiceMonitor")
    (only,) = monitor["spec"]["endpoints"]
    return only


def test_off_by_default(helm: str) -> None:  # noqa: F811
    objs = render(helm, set_values=MONITOR)
    assert "metrics-token-file" not in flag_values(container_of(objs, "coordinator")["args"])
    assert [s for s in of_kind(objs, "Secret") if "metrics-token" in s["metadata"]["name"]] == []
    assert "authorization" not in endpoint(objs)


def test_the_token_reaches_the_coordinator_and_the_service_monitor(helm: str) -> None:  # noqa: F811
    objs = render(helm, set_values=[*MONITOR, "metrics.auth.enabled=true"])
    token_file = flag_values(container_of(objs, "coordinator")["args"])["metrics-token-file"]
    name = f"{RELEASE}-metrics-token"
    assert secret_mount_dir(objs, "coordinator", token_file) == (name, f"{SECRETS_DIR}/metrics-token")
    secret = named(objs, "Secret", name)
    assert token_file.rsplit("/", 1)[1] == "metrics-token"
    assert len(base64.b64decode(secret["data"]["metrics-token"])) == 48
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert endpoint(objs)["authorization"] == {"type": "Bearer", "credentials": {"name": name, "key": "metrics-token"}}
    for tier in ("drafter", "verifier"):
        assert "metrics-token-file" not in flag_values(container_of(objs, tier)["args"]), tier
    for obj in objs:
        if obj["kind"] in ("Deployment", "Secret"):
            kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)
    assert list(iter_problems(objs)) == []


def test_an_existing_secret_is_used_as_it_is(helm: str) -> None:  # noqa: F811
    objs = render(
        helm,
        set_values=[
            *MONITOR,
            "metrics.auth.enabled=true",
            "metrics.auth.existingSecret=scrape-token",
            "metrics.auth.existingSecretKey=token",
        ],
    )
    token_file = flag_values(container_of(objs, "coordinator")["args"])["metrics-token-file"]
    assert token_file == f"{SECRETS_DIR}/metrics-token/token"
    assert secret_mount_dir(objs, "coordinator", token_file)[0] == "scrape-token"
    assert [s for s in of_kind(objs, "Secret") if "metrics-token" in s["metadata"]["name"]] == []
    assert endpoint(objs)["authorization"]["credentials"] == {"name": "scrape-token", "key": "token"}


@pytest.mark.parametrize(
    "bad", ["metrics.auth.enabled=maybe", "metrics.auth.token=x", "metrics.auth.existingSecretKey=a/b"]
)
def test_the_schema_refuses_bad_values(helm: str, bad: str) -> None:  # noqa: F811
    result = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", bad)
    assert result.returncode != 0 and "values don't meet the specifications" in result.stderr, bad
