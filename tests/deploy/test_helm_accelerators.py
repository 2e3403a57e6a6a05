"""Each tier on its own accelerators: GPU requests, nodeSelector, tolerations, affinity, runtimeClassName and the
servers' `--device`, per tier (issue 55), and the example that puts drafters on small GPUs and the verifier on a
large one (examples/values-gpu.yaml).

Renders with `helm template` like tests/deploy/test_helm_chart.py, whose helpers and fixtures it reuses; that file's
VALUE_SETS also lints the example, validates it against the Kubernetes schemas and runs every object check on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy.test_helm_chart import (
    CHART,
    RELEASE,
    TIERS,
    WORKLOAD_KINDS,
    Obj,
    all_containers,
    container_of,
    flag_values,
    helm,  # noqa: F401  (the session fixture)
    named,
    of_kind,
    pod_template,
    render,
    rendered,  # noqa: F401  (the session fixture)
    run_helm,
)

GPU = "nvidia.com/gpu"
EXAMPLE = CHART / "examples" / "values-gpu.yaml"
PLACEMENT = ("nodeSelector", "tolerations", "affinity", "runtimeClassName")


def pod_spec(objs: list[Obj], tier: str) -> Obj:
    spec: Obj = pod_template(named(objs, "Deployment", f"{RELEASE}-{tier}"))["spec"]
    return spec


def gpu_requests(container: Obj) -> tuple[object, object]:
    resources = container.get("resources") or {}
    return (resources.get("requests") or {}).get(GPU), (resources.get("limits") or {}).get(GPU)


def test_the_gpu_example_puts_drafters_and_the_verifier_on_their_own_gpus(
    rendered: dict[str, list[Obj]],  # noqa: F811
) -> None:
    objs = rendered["gpu"]
    example = yaml.safe_load(EXAMPLE.read_text())
    for tier in ("drafter", "verifier"):
        spec, values = pod_spec(objs, tier), example[tier]
        container = container_of(objs, tier)
        assert gpu_requests(container) == (1, 1), tier
        assert container["image"].endswith("-cuda"), tier
        assert flag_values(container["args"])["device"] == "cuda", tier
        for key in PLACEMENT:
            assert spec[key] == values[key], (tier, key)
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], tier
        assert spec["runtimeClassName"] == "nvidia", tier
    assert pod_spec(objs, "drafter")["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert pod_spec(objs, "verifier")["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert flag_values(container_of(objs, "verifier")["args"])["dtype"] == "bfloat16"
    # The coordinator and Redis stay off the GPU pools.
    for kind, name in (("Deployment", f"{RELEASE}-coordinator"), ("StatefulSet", f"{RELEASE}-redis")):
        spec = pod_template(named(objs, kind, name))["spec"]
        assert not any(key in spec for key in PLACEMENT), name
        assert all(gpu_requests(c) == (None, None) for c in all_containers(spec)), name


def test_defaults_request_no_gpu_and_run_on_the_cpu(rendered: dict[str, list[Obj]]) -> None:  # noqa: F811
    objs = rendered["default"]
    for workload in of_kind(objs, *WORKLOAD_KINDS):
        spec = pod_template(workload)["spec"]
        assert all(gpu_requests(c) == (None, None) for c in all_containers(spec)), workload["metadata"]["name"]
        assert not any(key in spec for key in PLACEMENT), workload["metadata"]["name"]
    for tier in ("drafter", "verifier"):
        container = container_of(objs, tier)
        assert flag_values(container["args"])["device"] == "cpu", tier
        assert not container["image"].endswith("-cuda"), tier


def test_each_tier_gets_its_own_placement(helm: str, tmp_path: Path) -> None:  # noqa: F811
    def zone_affinity(tier: str) -> Obj:
        term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": [f"{tier}-zone"]}]}
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}

    values = {
        tier: {
            "nodeSelector": {"pool": tier},
            "tolerations": [{"key": "pool", "operator": "Equal", "value": tier, "effect": "NoSchedule"}],
            "affinity": zone_affinity(tier),
            "runtimeClassName": f"{tier}-runtime",
        }
        for tier in TIERS
    }
    values["verifier"]["gpu"] = {"enabled": True, "count": 2}
    values["verifier"]["device"] = "cuda:1"
    values["drafter"]["gpu"] = {"enabled": True, "resourceName": "nvidia.com/gpu.shared"}
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    objs = render(helm, values_files=[file])
    for tier in TIERS:
        spec = pod_spec(objs, tier)
        assert {key: spec[key] for key in PLACEMENT} == {key: values[tier][key] for key in PLACEMENT}, tier
    verifier, drafter = container_of(objs, "verifier"), container_of(objs, "drafter")
    assert gpu_requests(verifier) == (2, 2)
    assert flag_values(verifier["args"])["device"] == "cuda:1"
    # A renamed shared resource (the device plugin's time-slicing or MPS) is requested by its own name.
    assert drafter["resources"]["limits"]["nvidia.com/gpu.shared"] == 1
    assert gpu_requests(drafter) == (None, None)
    assert flag_values(drafter["args"])["device"] == "cuda"
    assert gpu_requests(container_of(objs, "coordinator")) == (None, None)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("drafter.device=cuda", "drafter.device=cuda needs drafter.gpu.enabled"),
        ("verifier.device=cuda:0", "verifier.device=cuda:0 needs verifier.gpu.enabled"),
        ("verifier.gpu.enabled=true,verifier.device=cpu", "verifier.device=cpu leaves the GPUs"),
        ("drafter.gpu.enabled=true,drafter.device=cuda:1", "drafter.device=cuda:1 is not among the 1 GPU(s)"),
        ("drafter.device=gpu", "drafter.device: Does not match pattern"),
        ("verifier.device=cuda:x", "verifier.device: Does not match pattern"),
    ],
)
def test_a_device_without_its_gpus_is_refused(helm: str, setting: str, message: str) -> None:  # noqa: F811
    result = run_helm(helm, "template", RELEASE, str(CHART), "--set", setting)
    assert result.returncode != 0
    assert message in result.stderr
