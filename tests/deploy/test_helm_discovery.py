"""How the chart lets the coordinator find the other tiers: the headless Services' DNS names, no Kubernetes API.

Renders with `helm template` like tests/deploy/test_helm_chart.py, whose helpers it reuses.
"""

from __future__ import annotations

from tests.deploy.test_helm_chart import (
    TIERS,
    Obj,
    container_of,
    flag_values,
    helm,  # noqa: F401  (the session fixture)
    named,
    of_kind,
    pod_template,
    ref,
    rendered,  # noqa: F401  (the session fixture)
)


def test_the_coordinator_dials_the_headless_services_by_dns(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    """A headless Service's DNS name lists its ready pods: the coordinator's only view of the replicas."""
    objs = rendered["default"]
    flags = flag_values(container_of(objs, "coordinator")["args"])
    for tier in ("drafter", "verifier"):
        service = named(objs, "Service", f"specserve-{tier}")
        assert service["spec"]["clusterIP"] == "None", tier
        assert not service["spec"].get("publishNotReadyAddresses"), tier
        port = service["spec"]["ports"][0]["port"]
        assert flags[tier] == f"dns:///specserve-{tier}.specserve.svc.cluster.local:{port}", tier


def test_no_tier_talks_to_the_kubernetes_api(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    """No RBAC and no mounted API token in any value set."""
    for name, objs in rendered.items():
        assert not of_kind(objs, "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"), name
        workloads = of_kind(objs, "Deployment", "StatefulSet")
        assert len(workloads) >= len(TIERS), name
        for workload in workloads:
            spec = pod_template(workload)["spec"]
            assert spec["automountServiceAccountToken"] is False, ref(workload)
            env = {e["name"] for c in spec["containers"] for e in c.get("env") or []}
            assert "SPECSERVE_DISCOVERY" not in env, ref(workload)
        for account in of_kind(objs, "ServiceAccount"):
            assert account["automountServiceAccountToken"] is False, ref(account)
