"""The chart ships the Grafana dashboard for the sidecar, and its ServiceMonitor scrapes what the dashboard plots.

The chart is rendered offline (`helm template`, helpers from test_helm_chart.py); no cluster is needed.
"""

from __future__ import annotations

import json

import pytest

from tests.deploy.test_helm_chart import CHART, NAMESPACE, TIERS, Obj, of_kind, render, require_helm, selector_matches

DASHBOARD_FILE = CHART / "dashboards" / "specserve.json"


@pytest.fixture(scope="module")
def helm() -> str:
    return require_helm()


def dashboard_maps(objs: list[Obj]) -> list[Obj]:
    return [o for o in of_kind(objs, "ConfigMap") if "specserve.json" in (o.get("data") or {})]


def test_the_dashboard_configmap_holds_the_chart_file_with_the_sidecar_label(helm: str) -> None:
    objs = render(helm, set_values=["metrics.grafanaDashboard.enabled=true"])
    (configmap,) = dashboard_maps(objs)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert json.loads(configmap["data"]["specserve.json"]) == json.loads(DASHBOARD_FILE.read_text())


def test_the_sidecar_label_namespace_and_folder_are_configurable(helm: str) -> None:
    objs = render(
        helm,
        set_values=[
            "metrics.grafanaDashboard.enabled=true",
            "metrics.grafanaDashboard.label=grafana.example.com/dashboard",
            "metrics.grafanaDashboard.labelValue=specserve",
            "metrics.grafanaDashboard.namespace=monitoring",
            "metrics.grafanaDashboard.annotations.grafana_folder=LLM",
        ],
    )
    (configmap,) = dashboard_maps(objs)
    metadata = configmap["metadata"]
    assert metadata["labels"]["grafana.example.com/dashboard"] == "specserve"
    assert "grafana_dashboard" not in metadata["labels"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["annotations"] == {"grafana_folder": "LLM"}


def test_no_dashboard_unless_enabled(helm: str) -> None:
    assert dashboard_maps(render(helm)) == []
    assert dashboard_maps(render(helm, set_values=["metrics.serviceMonitor.enabled=true"])) == []


def test_the_service_monitor_scrapes_the_metrics_port_of_all_three_tiers(helm: str) -> None:
    objs = render(helm, set_values=["metrics.serviceMonitor.enabled=true", "metrics.grafanaDashboard.enabled=true"])
    (monitor,) = of_kind(objs, "ServiceMonitor")
    scraped = [
        s for s in of_kind(objs, "Service") if selector_matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped) == sorted(TIERS)
    (endpoint,) = monitor["spec"]["endpoints"]
    for service in scraped:
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}, service["metadata"]["name"]
