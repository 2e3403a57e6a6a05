"""What the chart passes to each server is what the server declares: every flag in a container's args, and
every literal SPECSERVE_* variable in its env, parses with that tier's own parser (a renamed or removed setting
fails here, not in a pod). Renders with `helm template` like tests/deploy/test_helm_chart.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from coordinator.main import parse_config as coordinator_config
from draft_service.main import parse_config as drafter_config
from target_service.main import parse_config as verifier_config
from tests.deploy.test_helm_chart import (
    VALUE_SETS,
    Obj,
    helm,  # noqa: F401  (the session fixture)
    pod_template,
    rendered,  # noqa: F401  (the session fixture)
)

PARSERS: dict[str, Callable[[list[str] | None], tuple[Any, str]]] = {
    "coordinator": coordinator_config,
    "drafter": drafter_config,
    "verifier": verifier_config,
}


def containers(objs: list[Obj]) -> dict[str, Obj]:
    """The server container of each tier the release runs, by the container's name (the tier's)."""
    found = {}
    for obj in objs:
        if obj["kind"] == "Deployment":
            container = pod_template(obj)["spec"]["containers"][0]
            if container["name"] in PARSERS:
                found[container["name"]] = container
    return found


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_flag_and_variable_the_chart_passes_is_a_declared_setting(
    value_set: str,
    rendered: dict[str, list[Obj]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the gpu values: a GPU node's drafter
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    tiers = containers(rendered[value_set])
    assert "coordinator" in tiers and "verifier" in tiers
    for tier, container in tiers.items():
        with monkeypatch.context() as env:
            for variable in container.get("env") or []:
                if variable["name"].startswith("SPECSERVE_") and "value" in variable:
                    env.setenv(variable["name"], str(variable["value"]))
            args = [str(arg) for arg in container.get("args") or []]
            try:
                PARSERS[tier](args)
            except SystemExit:
                pytest.fail(f"{value_set}: the {tier} refuses the chart's {args}: {capsys.readouterr().err}")
