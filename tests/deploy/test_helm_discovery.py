"""How the chart lets the coordinator find the other tiers (`coordinator.discovery`).

`kubernetes` (the default, and the production example): k8s:// targets, a ServiceAccount of the coordinator's
own bound to a namespaced Role that may only get/list/watch EndpointSlices, the API token mounted in the
coordinator's pod alone, and an egress policy that lets the coordinator reach the API server, DNS and the two
tiers. `dns` (the variants): the headless Services' names, no RBAC and no token anywhere.

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

WATCHING = {"default": "specserve", "production": "specserve"}  # value set -> release prefix


def test_kubernetes_discovery_watches_the_services_endpoint_slices(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    for value_set, release in WATCHING.items():
        objs = rendered[value_set]
        flags = flag_values(container_of(objs, "coordinator", release=release)["args"])
        namespace = named(objs, "Deployment", f"{release}-coordinator")["metadata"]["namespace"]
        for tier in ("drafter", "verifier"):
            service = named(objs, "Service", f"{release}-{tier}")
            port = service["spec"]["ports"][0]["port"]
            assert flags[tier] == f"k8s://{namespace}/{release}-{tier}:{port}", (value_set, tier)
            assert not service["spec"].get("publishNotReadyAddresses"), tier
        assert flags["self-service"] == f"{namespace}/{release}-coordinator"  # where it finds its own zone


def test_the_role_allows_reading_endpoint_slices_and_nothing_else(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    for value_set, release in WATCHING.items():
        objs = rendered[value_set]
        assert not of_kind(objs, "ClusterRole", "ClusterRoleBinding"), value_set
        [role] = of_kind(objs, "Role")
        assert role["rules"] == [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
        ]
        [binding] = of_kind(objs, "RoleBinding")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ref_name(role)}
        coordinator = pod_template(named(objs, "Deployment", f"{release}-coordinator"))["spec"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": coordinator["serviceAccountName"], "namespace": role_ns(role)}
        ]
        # The token is mounted where it is used: the coordinator's pod, whose account no other tier shares.
        assert coordinator["automountServiceAccountToken"] is True
        for tier in ("drafter", "verifier"):
            spec = pod_template(named(objs, "Deployment", f"{release}-{tier}"))["spec"]
            assert spec["automountServiceAccountToken"] is False, tier
            assert spec["serviceAccountName"] != coordinator["serviceAccountName"], tier
        for account in of_kind(objs, "ServiceAccount"):
            assert account["automountServiceAccountToken"] is False, ref(account)


def test_the_coordinator_may_reach_the_api_server_dns_and_its_tiers_only(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    objs = rendered["default"]
    policy = named(objs, "NetworkPolicy", "specserve-coordinator-egress")
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "coordinator"
    rules = policy["spec"]["egress"]
    api, dns, *tiers = rules
    assert "to" not in api and [p["port"] for p in api["ports"]] == [443, 6443]  # any address: set apiServer.to
    assert sorted((p["port"], p["protocol"]) for p in dns["ports"]) == [(53, "TCP"), (53, "UDP")]
    reached = {
        rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: rule["ports"][0]["port"]
        for rule in tiers
    }
    assert reached == {"drafter": 50052, "verifier": 50053}


def test_dns_discovery_needs_no_kubernetes_api(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    """`discovery: dns`: no RBAC, no egress policy and no mounted API token."""
    objs = rendered["variants"]
    flags = flag_values(container_of(objs, "coordinator", release="llm")["args"])
    assert flags["verifier"].startswith("dns:///") and flags["drafter"].startswith("dns:///")
    assert "self-service" not in flags
    assert not of_kind(objs, "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    assert not [p for p in of_kind(objs, "NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]
    workloads = of_kind(objs, "Deployment", "StatefulSet")
    assert len(workloads) >= len(TIERS)
    for workload in workloads:
        assert pod_template(workload)["spec"]["automountServiceAccountToken"] is False, ref(workload)


def ref_name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def role_ns(obj: Obj) -> str:
    return str(obj["metadata"]["namespace"])
