"""The chart's OpenAI-compatible HTTP API (coordinator.http): flag, container port, Service, NetworkPolicy, NOTES.

Renders with `helm template` like tests/deploy/test_helm_chart.py, whose helpers and checks it reuses.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy.test_helm_chart import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    Obj,
    container_of,
    flag_values,
    helm,  # noqa: F401  (the session fixture)
    ingress_sources,
    iter_problems,
    named,
    policies_by_tier,
    render,
    render_notes,
    run_helm,
)


def http_ports(objs: list[Obj]) -> tuple[dict[str, int], dict[str, Obj]]:
    """The coordinator container's ports by name, and its public Service's ports by name."""
    container = {p["name"]: p["containerPort"] for p in container_of(objs, "coordinator")["ports"]}
    service = {p["name"]: p for p in named(objs, "Service", f"{RELEASE}-coordinator")["spec"]["ports"]}
    return container, service


@pytest.mark.parametrize("value_set", ["default", "production"])
def test_the_http_api_is_served_published_and_admitted_like_grpc(helm: str, value_set: str) -> None:  # noqa: F811
    objs = render(helm, values_files=VALUE_SETS[value_set])
    assert flag_values(container_of(objs, "coordinator")["args"])["http-port"] == "8000"
    container, service = http_ports(objs)
    assert container["http"] == 8000
    assert service["http"]["port"] == 8000 and service["http"]["targetPort"] == "http"
    # The production example serves TLS on every port, the HTTP API included (--tls-cert applies to both).
    assert service["http"]["appProtocol"] == ("https" if value_set == "production" else "http")
    coordinator = policies_by_tier(objs)["coordinator"]
    assert ingress_sources(coordinator, 8000) == ingress_sources(coordinator, 50051)
    assert ingress_sources(coordinator, 8000) is not None  # restricted to coordinatorFrom, not open to all
    assert list(iter_problems(objs)) == []


def test_a_custom_port_moves_everything(helm: str) -> None:  # noqa: F811
    objs = render(helm, set_values=["coordinator.http.port=9000"])
    container, service = http_ports(objs)
    assert container["http"] == 9000 and service["http"]["port"] == 9000
    assert flag_values(container_of(objs, "coordinator")["args"])["http-port"] == "9000"
    coordinator = policies_by_tier(objs)["coordinator"]
    assert ingress_sources(coordinator, 9000) == [{}] and ingress_sources(coordinator, 8000) == []
    for obj in objs:
        if obj["kind"] in ("Deployment", "Service", "NetworkPolicy"):
            kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)
    assert list(iter_problems(objs)) == []


def test_disabled_means_no_port_anywhere(helm: str) -> None:  # noqa: F811
    objs = render(helm, set_values=["coordinator.http.enabled=false"])
    assert flag_values(container_of(objs, "coordinator")["args"])["http-port"] == "0"  # the server's off switch
    container, service = http_ports(objs)
    assert "http" not in container and "http" not in service
    rules = policies_by_tier(objs)["coordinator"]["spec"]["ingress"]
    assert {p["port"] for r in rules for p in r["ports"]} == {50051, 9090}
    assert list(iter_problems(objs)) == []


def test_the_schema_refuses_a_bad_http_port(helm: str) -> None:  # noqa: F811
    for bad in ("coordinator.http.port=0", "coordinator.http.port=70000", "coordinator.http.enabled=maybe"):
        result = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", bad)
        assert result.returncode != 0 and "values don't meet the specifications" in result.stderr, bad


@pytest.mark.parametrize("enabled", [True, False])
def test_notes_show_the_openai_endpoint(helm: str, tmp_path: Path, enabled: bool) -> None:  # noqa: F811
    values = tmp_path / "values.yaml"
    values.write_text(f"coordinator:\n  http:\n    enabled: {str(enabled).lower()}\n")
    notes = render_notes(helm, tmp_path, [values])
    assert (f"port-forward svc/{RELEASE}-coordinator 8000:8000" in notes) == enabled
    assert ("curl -N http://localhost:8000/v1/chat/completions" in notes) == enabled
    assert ('-H "Authorization: Bearer $SPECSERVE_API_KEY"' in notes) == enabled  # auth is on by default


def test_the_served_model_name_is_passed_only_when_set(helm: str) -> None:  # noqa: F811
    args = flag_values(container_of(render(helm), "coordinator")["args"])
    assert "served-model-name" not in args  # the coordinator's --model names it
    objs = render(helm, set_values=["coordinator.http.servedModelName=smollm2-instruct"])
    assert flag_values(container_of(objs, "coordinator")["args"])["served-model-name"] == "smollm2-instruct"
