"""Offline checks of the Helm chart in deploy/helm/specserve.

No cluster is needed: the chart is linted (`helm lint --strict`), rendered
(`helm template`) for the default values, the production and accelerator
examples and a set of variants, every rendered object is validated against the
Kubernetes OpenAPI schemas in strict mode (kubernetes-validate), and the objects
are checked for the mistakes a schema cannot see: autoscalers aimed at missing
Deployments, selectors that match no pod, ports that are not declared, CPU
autoscaling without CPU requests, tiers no NetworkPolicy covers, root
containers, and the trust boundaries of issue #12 (API keys, internal token,
TLS and mTLS flags, drain deadlines inside the termination grace period).

Each check is a function from rendered objects to a list of problems, and the
last tests break a copy of the chart on purpose to prove the checks fail.

helm comes from `make helm-tools` (deploy/tools/fetch-helm.sh); without a helm
binary the tests skip, except under CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.ci import missing_tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "specserve"
FIXTURES = Path(__file__).parent / "fixtures"
RELEASE = "specserve"
NAMESPACE = "specserve"
# Oldest supported and newest bundled schema of kubernetes-validate 1.37.0.
KUBE_VERSIONS = ("1.33.0", "1.37.0")
RENDER_KUBE_VERSION = KUBE_VERSIONS[0]
# Operator CRDs have no schema in kubernetes-validate; their structure is checked below.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("cert-manager.io/v1", "Certificate"),
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}

VALUE_SETS: dict[str, list[Path]] = {
    "default": [],
    "production": [CHART / "examples" / "values-production.yaml"],
    "gpu": [CHART / "examples" / "values-gpu.yaml"],
    "variants": [FIXTURES / "values-variants.yaml"],
    "draft-model": [CHART / "examples" / "values-draft-model.yaml"],
    "eagle3-head": [CHART / "examples" / "values-eagle3-head.yaml"],
}
# Objects the values refer to but the chart does not create (made by the platform team).
EXTERNAL_NAMES: dict[str, set[str]] = {
    "default": set(),
    "production": {
        "registry-credentials",
        "specserve-models",
        "specserve-redis-auth",
        "prod-specserve-api-keys",
        "prod-specserve-internal-token",
        "prod-specserve-metrics-token",
    },
    "gpu": set(),
    "variants": {"specserve-runtime", "draft-models", "hf-token", "specserve-redis-url", "llm-tls"},
    "draft-model": {"specserve-models"},
    "eagle3-head": {"specserve-models"},
}

Obj = dict[str, Any]
TIERS = ("coordinator", "drafter", "verifier")
SECRETS_DIR = "/etc/specserve"


# --------------------------------------------------------------------- helm --


def find_helm() -> str | None:
    """$HELM, then the repo's .tools/bin/helm (make helm-tools), then PATH."""
    for candidate in (os.environ.get("HELM"), str(REPO / ".tools" / "bin" / "helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("helm")


def require_helm() -> str:
    """The helm binary; without one, the tests skip (or fail under CI: ``tests.ci.missing_tool``)."""
    path = find_helm()
    if path is None:
        missing_tool("no helm binary: run `make helm-tools` (deploy/tools/fetch-helm.sh) or set HELM")
    return path


@pytest.fixture(scope="session")
def helm() -> str:
    return require_helm()


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60, check=False)


def value_args(values_files: Iterable[Path] = (), set_values: Iterable[str] = ()) -> list[str]:
    args = [arg for f in values_files for arg in ("-f", str(f))]
    return args + [arg for s in set_values for arg in ("--set", s)]


def render(
    helm: str, chart: Path = CHART, values_files: Iterable[Path] = (), set_values: Iterable[str] = ()
) -> list[Obj]:
    """`helm template` the chart and parse every non-empty document."""
    result = run_helm(
        helm,
        "template",
        RELEASE,
        str(chart),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        RENDER_KUBE_VERSION,
        *value_args(values_files, set_values),
    )
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, list[Obj]]:
    return {name: render(helm, values_files=files) for name, files in VALUE_SETS.items()}


# ------------------------------------------------------------ object access --


def of_kind(objs: Iterable[Obj], *kinds: str) -> list[Obj]:
    return [o for o in objs if o["kind"] in kinds]


def named(objs: Iterable[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def ref(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_template(workload: Obj) -> Obj:
    return workload["spec"]["template"]


def pod_labels(workload: Obj) -> dict[str, str]:
    return pod_template(workload)["metadata"].get("labels") or {}


def all_containers(pod_spec: Obj) -> list[Obj]:
    return [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def selected_workloads(objs: Sequence[Obj], selector: Mapping[str, Any]) -> list[Obj]:
    return [w for w in of_kind(objs, *WORKLOAD_KINDS) if selector_matches(selector, pod_labels(w))]


def declared_ports(containers: Iterable[Obj]) -> set[int | str]:
    """Every containerPort number and name of the containers."""
    ports: set[int | str] = set()
    for container in containers:
        for port in container.get("ports") or []:
            ports.add(port["containerPort"])
            if "name" in port:
                ports.add(port["name"])
    return ports


def container_of(objs: Sequence[Obj], tier: str, release: str = RELEASE) -> Obj:
    """The server container of a tier's Deployment."""
    container: Obj = pod_template(named(objs, "Deployment", f"{release}-{tier}"))["spec"]["containers"][0]
    return container


def flag_values(args: Sequence[str]) -> dict[str, str]:
    """`--name=value` arguments as {name: value}; bare flags map to ""."""
    return {a[2:].partition("=")[0]: a.partition("=")[2] for a in args if a.startswith("--")}


def probe_port(probe: Obj) -> int | str | None:
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            port: int | str = probe[handler]["port"]
            return port
    return None  # exec probes have no port


# ------------------------------------------------------------------- checks --


def check_autoscaler_targets(objs: Sequence[Obj]) -> list[str]:
    """Every HPA / ScaledObject targets an existing Deployment, one autoscaler per
    Deployment, and that Deployment leaves `replicas` to the autoscaler."""
    problems = []
    deployments = {d["metadata"]["name"]: d for d in of_kind(objs, "Deployment")}
    owners: dict[str, str] = {}
    for scaler in of_kind(objs, "HorizontalPodAutoscaler", "ScaledObject"):
        target = scaler["spec"]["scaleTargetRef"]
        name = target["name"]
        if target.get("kind", "Deployment") != "Deployment" or name not in deployments:
            problems.append(f"{ref(scaler)} targets {target.get('kind')}/{name}, which is not a rendered Deployment")
            continue
        if name in owners:
            problems.append(f"{ref(scaler)} and {owners[name]} both scale Deployment/{name}")
        owners[name] = ref(scaler)
        if "replicas" in deployments[name]["spec"]:
            problems.append(f"Deployment/{name} sets replicas although {ref(scaler)} owns the count")
    return problems


def check_selectors(objs: Sequence[Obj]) -> list[str]:
    """Workload selectors match their own pod template; Services and PDBs select some pod."""
    problems = []
    for workload in of_kind(objs, *WORKLOAD_KINDS):
        if not selector_matches(workload["spec"]["selector"], pod_labels(workload)):
            problems.append(f"{ref(workload)} selector does not match its pod template labels")
    for service in of_kind(objs, "Service"):
        selector = {"matchLabels": service["spec"].get("selector") or {}}
        if not selector["matchLabels"] or not selected_workloads(objs, selector):
            problems.append(f"{ref(service)} selector {selector['matchLabels']} selects no pod of the release")
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        if not selected_workloads(objs, pdb["spec"]["selector"]):
            problems.append(f"{ref(pdb)} selects no pod of the release")
    return problems


def check_ports(objs: Sequence[Obj]) -> list[str]:
    """Probes, Service targetPorts, NetworkPolicy ports and ServiceMonitor ports
    all name a port the selected containers declare."""
    problems = []
    for workload in of_kind(objs, *WORKLOAD_KINDS):
        for container in all_containers(pod_template(workload)["spec"]):
            ports = declared_ports([container])
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(probe_name)
                port = probe_port(probe) if probe else None
                if port is not None and port not in ports:
                    problems.append(f"{ref(workload)} {container['name']} {probe_name} port {port} is not declared")
    for service in of_kind(objs, "Service"):
        pods = selected_workloads(objs, {"matchLabels": service["spec"].get("selector") or {}})
        ports = declared_ports(c for w in pods for c in pod_template(w)["spec"]["containers"])
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if target not in ports:
                problems.append(f"{ref(service)} port {port.get('name')} targets {target}, not a container port")
    for policy in of_kind(objs, "NetworkPolicy"):
        pods = selected_workloads(objs, policy["spec"]["podSelector"])
        ports = declared_ports(c for w in pods for c in pod_template(w)["spec"]["containers"])
        for rule in policy["spec"].get("ingress") or []:
            for port in rule.get("ports") or []:
                if port["port"] not in ports:
                    problems.append(f"{ref(policy)} allows port {port['port']}, which its pods do not declare")
    for monitor in of_kind(objs, "ServiceMonitor"):
        services = [
            s
            for s in of_kind(objs, "Service")
            if selector_matches(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        if not services:
            problems.append(f"{ref(monitor)} selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            missing = [ref(s) for s in services if endpoint["port"] not in {p.get("name") for p in s["spec"]["ports"]}]
            if missing:
                problems.append(f"{ref(monitor)} scrapes port {endpoint['port']}, missing on {missing}")
    return problems


def check_cpu_requests(objs: Sequence[Obj]) -> list[str]:
    """Workloads scaled on CPU utilisation request CPU in every container
    (utilisation is measured against the request)."""
    problems = []
    deployments = {d["metadata"]["name"]: d for d in of_kind(objs, "Deployment")}
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        on_cpu = any(
            m["type"] == "Resource"
            and m["resource"]["name"] == "cpu"
            and m["resource"]["target"]["type"] == "Utilization"
            for m in hpa["spec"].get("metrics") or []
        )
        target = deployments.get(hpa["spec"]["scaleTargetRef"]["name"])
        if not on_cpu or target is None:
            continue
        for container in all_containers(pod_template(target)["spec"]):
            if "cpu" not in ((container.get("resources") or {}).get("requests") or {}):
                problems.append(f"{ref(target)} container {container['name']} has no CPU request for {ref(hpa)}")
    return problems


def check_network_policy_coverage(objs: Sequence[Obj]) -> list[str]:
    """Every workload's pods are selected by some NetworkPolicy (and so isolated)."""
    policies = of_kind(objs, "NetworkPolicy")
    return [
        f"{ref(w)} (tier {pod_labels(w).get('app.kubernetes.io/component')}) is not covered by any NetworkPolicy"
        for w in of_kind(objs, *WORKLOAD_KINDS)
        if not any(selector_matches(p["spec"]["podSelector"], pod_labels(w)) for p in policies)
    ]


def check_headless(objs: Sequence[Obj]) -> list[str]:
    """Drafter and verifier Services are headless, so gRPC's DNS resolver sees every pod."""
    problems = []
    for service in of_kind(objs, "Service"):
        tier = service["metadata"]["labels"].get("app.kubernetes.io/component")
        if tier in ("drafter", "verifier") and service["spec"].get("clusterIP") != "None":
            problems.append(f"{ref(service)} ({tier}) must be headless (clusterIP: None)")
    return problems


def check_security(objs: Sequence[Obj]) -> list[str]:
    """Pods run as non-root with RuntimeDefault seccomp; every container has a
    read-only root filesystem, no privilege escalation and drops ALL capabilities."""
    problems = []
    for workload in of_kind(objs, *WORKLOAD_KINDS):
        spec = pod_template(workload)["spec"]
        pod_sc = spec.get("securityContext") or {}
        for container in all_containers(spec):
            sc = container.get("securityContext") or {}
            where = f"{ref(workload)} container {container['name']}"
            if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                problems.append(f"{where} may run as root")
            seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
            if seccomp.get("type") != "RuntimeDefault":
                problems.append(f"{where} has no RuntimeDefault seccomp profile")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where} has a writable root filesystem")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where} allows privilege escalation")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{where} does not drop ALL capabilities")
    return problems


def check_references(objs: Sequence[Obj], external: set[str]) -> list[str]:
    """Secrets, ConfigMaps, ServiceAccounts, PVCs and governing Services that pods
    use are rendered by the chart, or are known to be created outside it."""
    rendered = {(o["kind"], o["metadata"]["name"]) for o in objs}
    # cert-manager writes the Secret a Certificate names.
    rendered |= {("Secret", c["spec"]["secretName"]) for c in of_kind(objs, "Certificate")}

    def missing(kind: str, name: str) -> bool:
        return (kind, name) not in rendered and name not in external

    problems = []
    for workload in of_kind(objs, *WORKLOAD_KINDS):
        spec = pod_template(workload)["spec"]
        wanted = [("ServiceAccount", spec.get("serviceAccountName", "default"))]
        wanted += [("Secret", s["name"]) for s in spec.get("imagePullSecrets") or []]
        for volume in spec.get("volumes") or []:
            if "configMap" in volume:
                wanted.append(("ConfigMap", volume["configMap"]["name"]))
            if "secret" in volume:
                wanted.append(("Secret", volume["secret"]["secretName"]))
            if "persistentVolumeClaim" in volume:
                wanted.append(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
        for container in all_containers(spec):
            for env in container.get("env") or []:
                secret = (env.get("valueFrom") or {}).get("secretKeyRef")
                if secret and not secret.get("optional"):
                    wanted.append(("Secret", secret["name"]))
        if workload["kind"] == "StatefulSet":
            wanted.append(("Service", workload["spec"]["serviceName"]))
        problems += [
            f"{ref(workload)} uses {kind}/{name}, which nothing creates" for kind, name in wanted if missing(kind, name)
        ]
    return problems


def check_secret_mounts(objs: Sequence[Obj]) -> list[str]:
    """Secrets reach the servers as directory volumes, never through subPath:
    the kubelet swaps updated files only into directory mounts, and the
    coordinator reloads its API key file when it changes."""
    problems = []
    for workload in of_kind(objs, "Deployment"):
        spec = pod_template(workload)["spec"]
        secret_volumes = {v["name"] for v in spec.get("volumes") or [] if "secret" in v}
        for container in all_containers(spec):
            for mount in container.get("volumeMounts") or []:
                if mount["name"] in secret_volumes and mount.get("subPath"):
                    problems.append(f"{ref(workload)} mounts Secret volume {mount['name']} with subPath")
    return problems


def check_secret_flags_point_into_mounts(objs: Sequence[Obj]) -> list[str]:
    """Every file flag of a server (API keys, token, certificates) names a file
    under one of its Secret volume mounts."""
    file_flags = {
        "api-keys-file",
        "metrics-token-file",
        "internal-token-file",
        "tls-cert",
        "tls-key",
        "tls-client-ca",
        "internal-tls-ca",
        "internal-tls-cert",
        "internal-tls-key",
    }
    problems = []
    for workload in of_kind(objs, "Deployment"):
        spec = pod_template(workload)["spec"]
        secret_volumes = {v["name"] for v in spec.get("volumes") or [] if "secret" in v}
        container = spec["containers"][0]
        mounts = [m["mountPath"] for m in container.get("volumeMounts") or [] if m["name"] in secret_volumes]
        for flag, path in flag_values(container.get("args") or []).items():
            if flag in file_flags and not any(path.startswith(f"{m}/") for m in mounts):
                problems.append(f"{ref(workload)} --{flag}={path} is not in a mounted Secret")
    return problems


def check_drain_fits_grace(objs: Sequence[Obj]) -> list[str]:
    """preStop sleep + --shutdown-grace-s < terminationGracePeriodSeconds: the
    kubelet counts the preStop hook against the same budget before SIGKILL."""
    problems = []
    for workload in of_kind(objs, "Deployment"):
        spec = pod_template(workload)["spec"]
        container = spec["containers"][0]
        grace = flag_values(container.get("args") or []).get("shutdown-grace-s")
        if grace is None:
            problems.append(f"{ref(workload)} passes no --shutdown-grace-s")
            continue
        pre_stop = (((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
        budget = spec.get("terminationGracePeriodSeconds", 30)
        if not (float(grace) > 0 and float(grace) + pre_stop < budget):
            problems.append(f"{ref(workload)} drains {grace} s after a {pre_stop} s preStop in a {budget} s grace")
    return problems


def check_certificates(objs: Sequence[Obj]) -> list[str]:
    """cert-manager Certificates (no schema offline): an issuer, both TLS usages,
    the Service's cluster DNS name, and a Secret some Deployment mounts."""
    problems = []
    mounted = {
        v["secret"]["secretName"]
        for d in of_kind(objs, "Deployment")
        for v in pod_template(d)["spec"].get("volumes") or []
        if "secret" in v
    }
    for cert in of_kind(objs, "Certificate"):
        spec = cert["spec"]
        tier = cert["metadata"]["labels"]["app.kubernetes.io/component"]
        host = f"{RELEASE}-{tier}.{NAMESPACE}.svc.cluster.local"
        if not spec.get("issuerRef", {}).get("name"):
            problems.append(f"{ref(cert)} has no issuer")
        if not {"server auth", "client auth"} <= set(spec.get("usages") or []):
            problems.append(f"{ref(cert)} lacks the server auth or client auth usage")
        if host not in (spec.get("dnsNames") or []):
            problems.append(f"{ref(cert)} does not name {host}")
        if spec.get("secretName") not in mounted:
            problems.append(f"{ref(cert)} writes Secret {spec.get('secretName')}, which no Deployment mounts")
    return problems


CHECKS: dict[str, Callable[[Sequence[Obj]], list[str]]] = {
    "autoscaler targets": check_autoscaler_targets,
    "selectors": check_selectors,
    "ports": check_ports,
    "cpu requests": check_cpu_requests,
    "network policy coverage": check_network_policy_coverage,
    "headless services": check_headless,
    "security": check_security,
    "secret mounts": check_secret_mounts,
    "secret flags": check_secret_flags_point_into_mounts,
    "drain fits grace": check_drain_fits_grace,
    "certificates": check_certificates,
}


# -------------------------------------------------------------------- tests --


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_strict(helm: str, value_set: str) -> None:
    result = run_helm(
        helm, "lint", "--strict", "--kube-version", RENDER_KUBE_VERSION, str(CHART), *value_args(VALUE_SETS[value_set])
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_objects_match_the_kubernetes_schema(
    rendered: dict[str, list[Obj]], value_set: str, kube_version: str
) -> None:
    errors = []
    for obj in rendered[value_set]:
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
                errors.append(f"{ref(obj)}: no schema for {obj['apiVersion']} in Kubernetes {kube_version}")
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            errors.append(f"{ref(obj)}: {path}: {error.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_objects_pass_check(rendered: dict[str, list[Obj]], value_set: str, check: str) -> None:
    assert CHECKS[check](rendered[value_set]) == []


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_everything_pods_use_exists(rendered: dict[str, list[Obj]], value_set: str) -> None:
    assert check_references(rendered[value_set], EXTERNAL_NAMES[value_set]) == []


def test_every_object_is_namespaced_and_labelled(rendered: dict[str, list[Obj]]) -> None:
    for obj in (o for objs in rendered.values() for o in objs):
        assert obj["metadata"]["namespace"] == NAMESPACE, ref(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, ref(obj)


def test_default_release_has_every_tier(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    tiers = {pod_labels(w)["app.kubernetes.io/component"] for w in of_kind(objs, *WORKLOAD_KINDS)}
    assert tiers == {"coordinator", "drafter", "verifier", "redis"}
    assert {ref(h) for h in of_kind(objs, "HorizontalPodAutoscaler")} == {
        "HorizontalPodAutoscaler/specserve-coordinator",
        "HorizontalPodAutoscaler/specserve-drafter",
    }, "the verifier HPA needs the Prometheus adapter, so it is opt-in"
    assert named(objs, "Service", "specserve-coordinator")["spec"].get("clusterIP") != "None"


def test_production_scales_each_tier_on_its_own_signal(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["production"]
    metrics = {
        hpa["spec"]["scaleTargetRef"]["name"]: hpa["spec"]["metrics"][0]
        for hpa in of_kind(objs, "HorizontalPodAutoscaler")
    }
    assert metrics["specserve-coordinator"]["resource"]["name"] == "cpu"
    assert metrics["specserve-drafter"]["resource"]["name"] == "cpu"
    verifier_metric = metrics["specserve-verifier"]
    assert verifier_metric["type"] == "Pods"
    assert verifier_metric["pods"]["metric"]["name"] == "specserve_verifier_active_sessions"
    assert len(of_kind(objs, "ServiceMonitor")) == 1


def test_the_verifier_gets_its_engine_settings(rendered: dict[str, list[Obj]]) -> None:
    container = pod_template(named(rendered["default"], "Deployment", "specserve-verifier"))["spec"]["containers"][0]
    flags = flag_values(container["args"])
    # The chart sizes the pod's memory for its KV cache; dtype and batch budget are the server's defaults.
    assert "dtype" not in flags and "max-batch-tokens" not in flags
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) > float(flags["kv-cache-gib"])  # the KV cache fits beside the model


def test_production_puts_the_verifier_on_gpus_and_drafters_on_their_pool(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["production"]
    verifier = pod_template(named(objs, "Deployment", "specserve-verifier"))["spec"]
    drafter = pod_template(named(objs, "Deployment", "specserve-drafter"))["spec"]
    container = verifier["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "--device=cuda" in container["args"]
    assert container["image"].endswith(":0.1.0-cuda")
    assert verifier["nodeSelector"] != drafter["nodeSelector"]
    assert "nvidia.com/gpu" not in drafter["containers"][0]["resources"].get("limits", {})


def test_coordinator_watches_the_services_or_dials_them_by_dns(rendered: dict[str, list[Obj]]) -> None:
    """Kubernetes discovery by default (k8s:// targets); `discovery: dns` (the variants) dials the headless names."""
    for value_set, release, expected in (
        ("default", "specserve", "k8s://{namespace}/{release}-{tier}:{port}"),
        ("variants", "llm", "dns:///{release}-{tier}.{namespace}.svc.cluster.local:{port}"),
    ):
        objs = rendered[value_set]
        args = pod_template(named(objs, "Deployment", f"{release}-coordinator"))["spec"]["containers"][0]["args"]
        for tier in ("drafter", "verifier"):
            service = named(objs, "Service", f"{release}-{tier}")
            port = service["spec"]["ports"][0]["port"]
            assert service["spec"]["clusterIP"] == "None"
            target = expected.format(namespace=NAMESPACE, release=release, tier=tier, port=port)
            assert f"--{tier}={target}" in args, value_set


def ingress_sources(policy: Obj, port: int) -> list[dict[str, str]] | None:
    """matchLabels of the pods allowed in on `port` ({} for every pod of a
    selected namespace); None when any source is allowed."""
    sources: list[dict[str, str]] = []
    for rule in policy["spec"].get("ingress") or []:
        if not any(p["port"] == port for p in rule.get("ports") or []):
            continue
        if "from" not in rule:
            return None
        sources += [(peer.get("podSelector") or {}).get("matchLabels") or {} for peer in rule["from"]]
    return sources


def policies_by_tier(objs: Sequence[Obj]) -> dict[str, Obj]:
    """The ingress policy of each tier (the coordinator's egress policy is tests/deploy/test_helm_discovery.py's)."""
    return {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
        for p in of_kind(objs, "NetworkPolicy")
        if "Ingress" in p["spec"]["policyTypes"]
    }


@pytest.mark.parametrize("value_set", ["default", "production"])
def test_only_the_coordinator_reaches_drafters_and_verifier_and_only_clients_reach_redis(
    rendered: dict[str, list[Obj]], value_set: str
) -> None:
    policy = policies_by_tier(rendered[value_set])
    component = "app.kubernetes.io/component"
    for tier, port in (("drafter", 50052), ("verifier", 50053)):
        sources = ingress_sources(policy[tier], port)
        assert sources is not None and [s[component] for s in sources] == ["coordinator"], tier
        rules = policy[tier]["spec"]["ingress"]
        assert {p["port"] for r in rules for p in r["ports"]} == {port, 9090}, "nothing else is open"
    redis_sources = ingress_sources(policy["redis"], 6379)
    assert redis_sources is not None and sorted(s[component] for s in redis_sources) == ["coordinator", "drafter"]


def test_coordinator_sources_default_to_the_namespace_and_are_configurable(
    helm: str, rendered: dict[str, list[Obj]]
) -> None:
    default = policies_by_tier(rendered["default"])["coordinator"]
    assert ingress_sources(default, 50051) == [{}]  # every pod of the release's namespace, no other namespace
    assert all("namespaceSelector" not in peer for r in default["spec"]["ingress"] for peer in r.get("from") or [])
    production = policies_by_tier(rendered["production"])
    peers = [peer for r in production["coordinator"]["spec"]["ingress"] for peer in r.get("from") or []]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}} in peers
    for tier in TIERS:  # Prometheus only, on the metrics port
        rules = [r for r in production[tier]["spec"]["ingress"] if r["ports"][0]["port"] == 9090]
        assert rules[0]["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ], tier
    open_to_all = policies_by_tier(render(helm, set_values=["networkPolicy.coordinatorFrom=null"]))["coordinator"]
    assert ingress_sources(open_to_all, 50051) is None


def test_redis_password_reaches_clients_only_through_the_secret(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    secret = named(objs, "Secret", "specserve-redis")
    assert set(secret["data"]) == {"redis-password"}
    for tier in ("coordinator", "drafter"):
        env = {
            e["name"]: e
            for e in pod_template(named(objs, "Deployment", f"specserve-{tier}"))["spec"]["containers"][0]["env"]
        }
        assert env["SPECSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "specserve-redis"
        assert env["SPECSERVE_REDIS_URL"]["value"].startswith("redis://:$(SPECSERVE_REDIS_PASSWORD)@specserve-redis.")
    redis = named(objs, "StatefulSet", "specserve-redis")
    assert "PASSWORD" not in " ".join(pod_template(redis)["spec"]["containers"][0].get("args") or [])


def test_redis_can_be_left_out(helm: str) -> None:
    objs = render(helm, set_values=["redis.mode=disabled"])
    assert not [o for o in objs if o["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"]
    for deployment in of_kind(objs, "Deployment"):
        names = {e["name"] for c in pod_template(deployment)["spec"]["containers"] for e in c.get("env") or []}
        assert "SPECSERVE_REDIS_URL" not in names, ref(deployment)
    assert check_network_policy_coverage(objs) == []


def test_variants_render_keda_service_account_and_init_container(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["variants"]
    assert not [
        h for h in of_kind(objs, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == "llm-verifier"
    ]
    assert named(objs, "ScaledObject", "llm-verifier")["spec"]["scaleTargetRef"]["name"] == "llm-verifier"
    coordinator = pod_template(named(objs, "Deployment", "llm-coordinator"))["spec"]
    assert [c["name"] for c in coordinator["initContainers"]] == ["fetch-model"]
    drafter = pod_template(named(objs, "Deployment", "llm-drafter"))["spec"]
    assert "@sha256:" in drafter["containers"][0]["image"]
    for tier in TIERS:
        spec = pod_template(named(objs, "Deployment", f"llm-{tier}"))["spec"]
        assert spec["serviceAccountName"] == "specserve-runtime", tier
        assert spec["automountServiceAccountToken"] is False, tier


def test_drafters_mount_their_draft_head_and_draft_model_read_only_from_claims(
    rendered: dict[str, list[Obj]],
) -> None:
    """`drafter.draftHead` and `drafter.draftModel`: the flag names a path under the claim's read-only mount."""
    for value_set, flag, volume, mount in [
        ("eagle3-head", "--draft-head-path", "draft-head", "/draft-head"),
        ("draft-model", "--draft-model", "draft-model", "/draft-model"),
    ]:
        spec = pod_template(named(rendered[value_set], "Deployment", f"{RELEASE}-drafter"))["spec"]
        args = spec["containers"][0]["args"]
        paths = [a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")]
        assert len(paths) == 1 and paths[0].startswith(mount + "/"), (value_set, args)
        claim = next(v["persistentVolumeClaim"] for v in spec["volumes"] if v["name"] == volume)
        assert claim == {"claimName": "specserve-models", "readOnly": True}, value_set
        mounted = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume)
        assert mounted["mountPath"] == mount and mounted["readOnly"] is True, value_set
    default = pod_template(named(rendered["default"], "Deployment", f"{RELEASE}-drafter"))["spec"]
    assert not [a for a in default["containers"][0]["args"] if a.startswith("--draft-head-path=")]
    assert "draft-head" not in {v["name"] for v in default["volumes"]}


# ------------------------------------------------------- trust boundaries --


def secret_mount_dir(objs: Sequence[Obj], tier: str, path: str) -> tuple[str, str]:
    """(Secret name, mount path) of the Secret volume holding the file `path` in a tier's pod."""
    spec = pod_template(named(objs, "Deployment", f"{RELEASE}-{tier}"))["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    for mount in spec["containers"][0]["volumeMounts"]:
        if mount["name"] in secrets and path.startswith(mount["mountPath"] + "/"):
            assert "subPath" not in mount, "a subPath mount never sees Secret updates"
            return secrets[mount["name"]], mount["mountPath"]
    raise AssertionError(f"{path} is in no Secret mount of the {tier}")


def test_default_release_authenticates_every_call(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    flags = {tier: flag_values(container_of(objs, tier)["args"]) for tier in TIERS}
    keys_file = flags["coordinator"]["api-keys-file"]
    assert secret_mount_dir(objs, "coordinator", keys_file) == ("specserve-api-keys", f"{SECRETS_DIR}/api-keys")
    key_file = yaml.safe_load(named(objs, "Secret", "specserve-api-keys")["stringData"][keys_file.rsplit("/", 1)[1]])
    assert key_file == {"tenants": {}, "keys": []}, "nobody gets in until an operator adds a key"
    token = named(objs, "Secret", "specserve-internal-token")
    assert token["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for tier in TIERS:
        assert "insecure" not in flags[tier], tier
        assert secret_mount_dir(objs, tier, flags[tier]["internal-token-file"])[0] == "specserve-internal-token"
        assert not any(f.startswith("tls") or f.startswith("internal-tls") for f in flags[tier]), "TLS is opt-in"
        assert "grpc" in container_of(objs, tier)["readinessProbe"]  # plaintext: the native probe
    assert "api-keys-file" not in flags["drafter"] and "api-keys-file" not in flags["verifier"]
    volumes = pod_template(named(objs, "Deployment", "specserve-coordinator"))["spec"]["volumes"]
    assert {v["secret"]["defaultMode"] for v in volumes if "secret" in v} == {0o440}  # the pod's fsGroup only


def test_api_keys_and_tenants_from_values_fill_the_chart_secret(helm: str) -> None:
    digest = "ab" * 32
    objs = render(
        helm,
        set_values=[
            "auth.apiKeys.tenants.acme.max_concurrent_streams=8",
            f"auth.apiKeys.keys[0].name=acme-ci,auth.apiKeys.keys[0].tenant=acme,auth.apiKeys.keys[0].sha256={digest}",
        ],
    )
    key_file = yaml.safe_load(named(objs, "Secret", "specserve-api-keys")["stringData"]["api-keys.yaml"])
    assert key_file == {
        "tenants": {"acme": {"max_concurrent_streams": 8}},
        "keys": [{"name": "acme-ci", "tenant": "acme", "sha256": digest}],
    }


def test_production_serves_tls_everywhere_with_mtls_inside(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["production"]
    flags = {tier: flag_values(container_of(objs, tier)["args"]) for tier in TIERS}
    certificates = {c["metadata"]["labels"]["app.kubernetes.io/component"]: c for c in of_kind(objs, "Certificate")}
    assert set(certificates) == set(TIERS)
    assert "specserve.internal.example.com" in certificates["coordinator"]["spec"]["dnsNames"]
    for tier in TIERS:
        tls_secret, tls_dir = secret_mount_dir(objs, tier, flags[tier]["tls-cert"])
        assert tls_secret == certificates[tier]["spec"]["secretName"]
        assert flags[tier]["tls-key"] == f"{tls_dir}/tls.key"
        assert "insecure" not in flags[tier]
        assert secret_mount_dir(objs, tier, flags[tier]["internal-token-file"])[0] == "prod-specserve-internal-token"
        probe = container_of(objs, tier)["readinessProbe"]
        assert "grpc" not in probe, "the kubelet's native gRPC probe cannot speak TLS"
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", "specserve.health_probe"]
        assert f"--server-name={RELEASE}-{tier}.{NAMESPACE}.svc.cluster.local" in command
        assert f"--tls-cert={tls_dir}/tls.crt" in command  # mTLS ports demand a client certificate
        service = named(objs, "Service", f"{RELEASE}-{tier}")
        assert service["spec"]["ports"][0]["appProtocol"] == "https"
    for tier in ("drafter", "verifier"):
        assert flags[tier]["tls-client-ca"].endswith("/ca.crt"), "internal tiers require client certificates"
    coordinator = flags["coordinator"]
    assert "tls-client-ca" not in coordinator  # public clients authenticate with API keys
    assert coordinator["internal-tls-ca"].endswith("/ca.crt")
    assert coordinator["internal-tls-cert"] == coordinator["tls-cert"]
    assert coordinator["internal-tls-key"] == coordinator["tls-key"]
    keys_secret, _ = secret_mount_dir(objs, "coordinator", coordinator["api-keys-file"])
    assert keys_secret == "prod-specserve-api-keys"
    metrics_secret, _ = secret_mount_dir(objs, "coordinator", coordinator["metrics-token-file"])
    assert metrics_secret == "prod-specserve-metrics-token"
    assert not of_kind(objs, "Secret"), "production names existing Secrets; the chart creates none"


def test_tls_from_an_existing_secret_per_tier(helm: str) -> None:
    objs = render(
        helm,
        set_values=[
            "tls.enabled=true",
            "tls.existingSecret=shared-tls",
            "tls.verifier.existingSecret=verifier-tls",
            "tls.internalMTLS=false",
            "tls.coordinator.requireClientCert=true",
        ],
    )
    assert not of_kind(objs, "Certificate")
    flags = {tier: flag_values(container_of(objs, tier)["args"]) for tier in TIERS}
    assert secret_mount_dir(objs, "verifier", flags["verifier"]["tls-cert"])[0] == "verifier-tls"
    assert secret_mount_dir(objs, "drafter", flags["drafter"]["tls-cert"])[0] == "shared-tls"
    assert "tls-client-ca" not in flags["verifier"] and "tls-client-ca" not in flags["drafter"]
    assert "internal-tls-cert" not in flags["coordinator"] and "internal-tls-ca" in flags["coordinator"]
    assert "tls-client-ca" in flags["coordinator"]


@pytest.mark.parametrize(("value_set", "expected"), [("default", (50, 20, 50)), ("production", (110, 20, 50))])
def test_drain_deadline_leaves_a_margin_inside_the_grace_period(
    rendered: dict[str, list[Obj]], value_set: str, expected: tuple[int, ...]
) -> None:
    objs = rendered[value_set]
    for tier, grace in zip(TIERS, expected, strict=True):
        spec = pod_template(named(objs, "Deployment", f"{RELEASE}-{tier}"))["spec"]
        assert flag_values(spec["containers"][0]["args"])["shutdown-grace-s"] == str(grace), tier
        assert (
            grace + spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] + 5
            == (spec["terminationGracePeriodSeconds"])
        )


def test_insecure_only_when_asked(helm: str) -> None:
    objs = render(helm, set_values=["insecure=true", "auth.apiKeys.enabled=false", "auth.internalToken.enabled=false"])
    for tier in TIERS:
        assert "--insecure" in container_of(objs, tier)["args"], tier
        assert "internal-token-file" not in flag_values(container_of(objs, tier)["args"])
    assert not of_kind([o for o in objs if o["metadata"]["name"] != "specserve-redis"], "Secret")


def test_admission_limits_and_drafter_bounds(helm: str, rendered: dict[str, list[Obj]]) -> None:
    default = flag_values(container_of(rendered["default"], "coordinator")["args"])
    assert (default["max-concurrent-streams"], default["max-queued-streams"]) == ("32", "64")
    for server_default in ("queue-timeout-s", "tenant-max-concurrent-streams", "max-prompt-bytes"):
        assert server_default not in default
    production = flag_values(container_of(rendered["production"], "coordinator")["args"])
    assert production["tenant-max-concurrent-streams"] == "16"
    assert production["max-prompt-bytes"] == "262144"
    drafter = {name: flag_values(container_of(rendered[name], "drafter")["args"]) for name in ("default", "production")}
    assert drafter["default"]["max-memory-mib"] == "2048"  # half of the 4Gi limit
    assert drafter["production"]["max-memory-mib"] == "3072"  # half of 6Gi
    assert drafter["default"]["stream-idle-timeout-s"] == "120"
    explicit = render(helm, set_values=["drafter.maxMemoryMiB=700", "drafter.resources.limits.memory=1500M"])
    assert flag_values(container_of(explicit, "drafter")["args"])["max-memory-mib"] == "700"
    derived = render(helm, set_values=["drafter.resources.limits.memory=1500M"])
    assert flag_values(container_of(derived, "drafter")["args"])["max-memory-mib"] == "715"  # 1500e6 B / 2 in MiB
    unbounded = render(helm, set_values=["drafter.resources.limits=null"])
    assert "max-memory-mib" not in flag_values(container_of(unbounded, "drafter")["args"])


def test_large_and_fractional_numbers_reach_the_flags_intact(helm: str, tmp_path: Path) -> None:
    # Numbers from a values file reach templates as floats; %v would print 1e+07.
    values = tmp_path / "values.yaml"
    values.write_text(
        "coordinator:\n  admission: {maxQueuedStreams: 10000000, queueTimeoutSeconds: 2.5}\n"
        "  limits: {maxPromptBytes: 4194304}\ndrafter:\n  streamIdleTimeoutSeconds: 0.5\n"
    )
    objs = render(helm, values_files=[values])
    coordinator = flag_values(container_of(objs, "coordinator")["args"])
    assert (coordinator["max-queued-streams"], coordinator["queue-timeout-s"]) == ("10000000", "2.5")
    assert coordinator["max-prompt-bytes"] == "4194304"
    assert flag_values(container_of(objs, "drafter")["args"])["stream-idle-timeout-s"] == "0.5"


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("redis.mode=bogus", "redis.mode"),
        ("coordinator.replicas=3", "replicas"),  # a typo of replicaCount
        ("verifier.model.source=pvc", "verifier.model.path is required"),
        ("metrics.port=50052", "must differ"),
        ("verifier.shutdownGraceSeconds=56", "must stay below terminationGracePeriodSeconds"),
        ("drafter.preStopSleepSeconds=25", "leaves no drain time"),
        ("auth.apiKeys.enabled=false", "set insecure=true"),
        ("auth.internalToken.enabled=false", "set insecure=true"),
        ("auth.apiKeys.existingSecret=keys,auth.apiKeys.tenants.acme.share_ngram_pool=true", "existingSecret"),
        ("tls.enabled=true", "tls.enabled needs a certificate for the"),
        ("tls.enabled=true,tls.certManager.enabled=true", "issuerRef.name is required"),
        ("drafter.draftHead.pvc.claimName=heads", "drafter.draftHead.path is required"),
    ],
)
def test_bad_values_are_refused(helm: str, setting: str, message: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--set", setting)
    assert result.returncode != 0
    assert message in result.stderr


# One render: the schema reports every violation at once.
SCHEMA_VIOLATIONS = {
    "coordinator.admission.maxConcurrentStreams=0": "coordinator.admission.maxConcurrentStreams",
    "coordinator.admission.maxQueuedStreams=-1": "coordinator.admission.maxQueuedStreams",
    "coordinator.admission.queueTimeoutSeconds=0": "coordinator.admission.queueTimeoutSeconds",
    "coordinator.admission.tenantMaxConcurrentStreams=-2": "coordinator.admission.tenantMaxConcurrentStreams",
    "coordinator.limits.maxPromptBytes=-1": "coordinator.limits.maxPromptBytes",
    "drafter.maxMemoryMiB=-512": "drafter.maxMemoryMiB",
    "drafter.streamIdleTimeoutSeconds=-1": "drafter.streamIdleTimeoutSeconds",
    "verifier.shutdownGraceSeconds=0": "verifier.shutdownGraceSeconds",
    "shutdownMarginSeconds=-1": "shutdownMarginSeconds",
    "auth.apiKeys.keys[0].name=ci": "auth.apiKeys.keys.0: sha256 is required",
    "auth.apiKeys.keys[1].name=ci,auth.apiKeys.keys[1].tenant=t,auth.apiKeys.keys[1].sha256=abc": (
        "auth.apiKeys.keys.1.sha256"
    ),
    "auth.apiKeys.tenants.acme.max_concurrent_streams=-1": "auth.apiKeys.tenants.acme.max_concurrent_streams",
    "tls.certManager.privateKey.algorithm=DSA": "tls.certManager.privateKey.algorithm",
    "tls.coordinator.requireClientCert=yes": "tls.coordinator.requireClientCert",
    "insecure=yes": "insecure",
}


def test_schema_rejects_bad_security_and_limit_values(helm: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), *value_args(set_values=SCHEMA_VIOLATIONS))
    assert result.returncode != 0
    missing = [path for path in SCHEMA_VIOLATIONS.values() if path not in result.stderr]
    assert not missing, result.stderr


# ---------------------------------------------- the checks catch breakage --


def broken_chart(tmp_path: Path, file: str, old: str, new: str) -> Path:
    """A copy of the chart with `old` replaced by `new` in one template."""
    chart = tmp_path / "specserve"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / file
    text = template.read_text()
    assert old in text, f"mutation no longer applies to {file}: {old!r}"
    template.write_text(text.replace(old, new))
    return chart


BREAKAGES = {
    "hpa aims at a missing deployment": (
        "_workload.tpl",
        '    kind: Deployment\n    name: {{ include "specserve.tierName" . }}',
        '    kind: Deployment\n    name: {{ include "specserve.tierName" . }}-old',
        check_autoscaler_targets,
        "not a rendered Deployment",
    ),
    "service selector drifts from pod labels": (
        "_workload.tpl",
        '  selector:\n    {{- include "specserve.tierSelectorLabels" . | nindent 4 }}\n  ports:',
        '  selector:\n    {{- include "specserve.tierSelectorLabels" . | nindent 4 }}\n    tier: x\n  ports:',
        check_selectors,
        "selects no pod",
    ),
    "probe on an undeclared port": (
        "_security.tpl",
        "grpc:\n  port: {{ $values.port }}",
        "grpc:\n  port: {{ add $values.port 100 }}",
        check_ports,
        "readinessProbe port",
    ),
    "a secret mounted with subPath": (
        "_security.tpl",
        "  mountPath: {{ $dir }}/api-keys\n",
        "  mountPath: {{ $dir }}/api-keys/api-keys.yaml\n  subPath: api-keys.yaml\n",
        check_secret_mounts,
        "with subPath",
    ),
    "a key file outside the mounted secret": (
        "_security.tpl",
        "- --api-keys-file={{ $dir }}/api-keys/",
        "- --api-keys-file=/etc/api-keys/",
        check_secret_flags_point_into_mounts,
        "--api-keys-file=/etc/api-keys/api-keys.yaml is not in a mounted Secret",
    ),
    "a drain longer than the grace period": (
        "_security.tpl",
        '- --shutdown-grace-s={{ include "specserve.shutdownGrace" . }}',
        "- --shutdown-grace-s={{ .root.Values.coordinator.terminationGracePeriodSeconds }}",
        check_drain_fits_grace,
        "drains 60 s after a 5 s preStop in a 60 s grace",
    ),
    "service targets an undeclared port": (
        "_workload.tpl",
        "      targetPort: grpc",
        "      targetPort: http",
        check_ports,
        "targets http",
    ),
    "a tier without a network policy": (
        "networkpolicies.yaml",
        '"verifier" (list',
        '"verifier-old" (list',
        check_network_policy_coverage,
        "tier verifier",
    ),
    "drafter service is not headless": (
        "drafter/service.yaml",
        '"headless" true',
        '"headless" false',
        check_headless,
        "must be headless",
    ),
    "writable root filesystem in redis": (
        "redis/statefulset.yaml",
        "            {{- toYaml .Values.securityContext | nindent 12 }}",
        "            readOnlyRootFilesystem: false",
        check_security,
        "writable root filesystem",
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_checks_catch_a_broken_template(helm: str, tmp_path: Path, breakage: str) -> None:
    file, old, new, check, expected = BREAKAGES[breakage]
    objs = render(helm, broken_chart(tmp_path, file, old, new))
    problems = check(objs)
    assert any(expected in p for p in problems), problems


def test_checks_catch_a_cpu_hpa_without_cpu_requests(helm: str) -> None:
    objs = render(helm, set_values=["drafter.resources.requests=null"])
    assert any(
        "Deployment/specserve-drafter container drafter has no CPU request" in p for p in check_cpu_requests(objs)
    )


def iter_problems(objs: Sequence[Obj]) -> Iterator[str]:
    for check in CHECKS.values():
        yield from check(objs)


def test_a_broken_chart_fails_the_schema_validation(helm: str, tmp_path: Path) -> None:
    # A misspelt field: Kubernetes defaults targetPort to the port number, which
    # the container does declare, so only strict schema validation notices.
    chart = broken_chart(tmp_path, "_workload.tpl", "      targetPort: grpc\n", "      targetport: grpc\n")
    objs = render(helm, chart)
    service = named(objs, "Service", "specserve-drafter")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBE_VERSIONS[0], strict=True)
    assert list(iter_problems(objs)) == []  # only the schema sees this one


def render_notes(helm: str, tmp_path: Path, values_files: Iterable[Path]) -> str:
    """NOTES.txt as `helm install` prints it. `helm template` skips NOTES, so a
    copy of the chart renders it into a ConfigMap through `tpl`."""
    chart = tmp_path / "specserve"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n  namespace: x\n  labels: {}\n"
        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}\n'
    )
    result = run_helm(
        helm,
        "template",
        RELEASE,
        str(chart),
        "-n",
        NAMESPACE,
        "--show-only",
        "templates/zz-notes.yaml",
        *value_args(values_files),
    )
    assert result.returncode == 0, result.stderr
    notes: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return notes


@pytest.mark.parametrize("value_set", ["default", "production"])
def test_notes_walk_to_a_first_generation(helm: str, tmp_path: Path, value_set: str) -> None:
    notes = render_notes(helm, tmp_path, VALUE_SETS[value_set])
    assert f"kubectl -n {NAMESPACE} port-forward svc/specserve-coordinator 50051:50051" in notes
    assert 'specserve generate --target localhost:50051 "Write a haiku about the sea"' in notes
    assert ("image.registry is still the placeholder" in notes) == (value_set == "default")
    assert ("custom metrics API" in notes) == (value_set == "production")
    assert "python -m specserve.auth new-key --tenant <tenant> --name <name>" in notes
    assert ("It lists no key yet" in notes) == (value_set == "default")
    assert ("kubectl -n specserve create secret generic prod-specserve-api-keys" in notes) == (
        value_set == "production"
    )
    assert ("trust the ca.crt of Secret specserve-coordinator-tls" in notes) == (value_set == "production")


def undocumented_values(values_yaml: str) -> list[str]:
    """Keys of values.yaml with no helm-docs `# --` comment on themselves or an ancestor."""
    missing = []
    documented: list[tuple[int, str, bool]] = []  # (indent, key, documented) of the open ancestors
    comment: list[str] = []
    for line in values_yaml.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        if not stripped or stripped.startswith("- "):
            comment = []
            continue
        indent = len(line) - len(line.lstrip())
        key = stripped.split(":", 1)[0]
        while documented and documented[-1][0] >= indent:
            documented.pop()
        has_doc = any(c.startswith("# --") for c in comment) or any(d for _, _, d in documented)
        if not has_doc and not stripped.endswith(":"):  # a leaf value
            missing.append(".".join([k for _, k, _ in documented] + [key]))
        documented.append((indent, key, any(c.startswith("# --") for c in comment)))
        comment = []
    return missing


def test_every_value_has_a_helm_docs_comment() -> None:
    assert undocumented_values((CHART / "values.yaml").read_text()) == []
    assert undocumented_values("a:\n  # -- documented\n  b: 1\n  c: 2\n") == ["a.c"]
