"""Each config default is defined once: in the service's config dataclass, which its flags, the round loop's
policy and the local cluster follow. A flag whose default is typed again in main.py fails here when the
dataclass changes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest

from coordinator import main as coordinator_main
from coordinator.config import (
    CALL_HEADROOM,
    CoordinatorConfig,
    admission_limits,
    grpc_call_backstop,
    max_concurrent_calls,
    round_policy,
)
from coordinator.ports import VerifierInfo
from coordinator.rounds import RoundPolicy
from draft_service import main as drafter_main
from draft_service.config import DrafterConfig
from specserve.local_cluster import LocalCluster
from specserve.service_main import DEFAULT_MAX_HEALTH_WATCHES
from target_service import main as verifier_main
from target_service.config import VerifierConfig

SERVICES: list[tuple[Callable[[list[str] | None], tuple[Any, str]], type]] = [
    (coordinator_main.parse_config, CoordinatorConfig),
    (drafter_main.parse_config, DrafterConfig),
    (verifier_main.parse_config, VerifierConfig),
]


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags' environment fallbacks stay out of it: an empty command line on a bare machine."""
    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("parse", "config_class"), SERVICES, ids=lambda x: getattr(x, "__name__", ""))
def test_an_empty_command_line_gives_the_dataclass_defaults(
    parse: Callable[[list[str] | None], tuple[Any, str]], config_class: type
) -> None:
    parsed, _ = parse([])
    defaults = config_class()
    differing = {f.name: (getattr(parsed, f.name), getattr(defaults, f.name)) for f in fields(config_class)}
    assert {name: pair for name, pair in differing.items() if pair[0] != pair[1]} == {}


@pytest.mark.parametrize(("parse", "config_class"), SERVICES, ids=lambda x: getattr(x, "__name__", ""))
def test_the_environment_fallbacks_still_work(
    parse: Callable[[list[str] | None], tuple[Any, str]], config_class: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_PORT", "4242")
    monkeypatch.setenv("SPECSERVE_METRICS_PORT", "4343")
    monkeypatch.setenv("SPECSERVE_SHUTDOWN_GRACE_S", "7.5")
    parsed, _ = parse([])
    assert (parsed.port, parsed.metrics_port, parsed.shutdown_grace_s) == (4242, 4343, 7.5)


@pytest.mark.parametrize(("parse", "config_class"), SERVICES, ids=lambda x: getattr(x, "__name__", ""))
def test_every_flag_default_is_the_dataclass_default(
    parse: Callable[[list[str] | None], tuple[Any, str]], config_class: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each flag of a dataclass field defaults to the field's value ("" for None), read off the parser itself."""
    parsers: list[argparse.ArgumentParser] = []
    parse_args = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parsers.append(self)
        return parse_args(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    parse([])
    (parser,) = parsers
    defaults = config_class()
    names = {f.name for f in fields(config_class)}
    checked = 0
    for action in parser._actions:
        if action.dest not in names:
            continue
        expected = getattr(defaults, action.dest)
        if isinstance(expected, tuple):  # --sources: comma-separated on the command line
            expected = ",".join(expected)
        assert action.default == ("" if expected is None else expected), (config_class.__name__, action.dest)
        checked += 1
    assert checked >= len(names) - 1  # every field but `security` (built from several flags) has a flag


def test_the_round_loop_and_the_coordinator_share_their_defaults() -> None:
    roomy = VerifierInfo("m", "fp", 100, max_tree_nodes=1024, max_tree_depth=64, max_session_tokens=8192,
                         supports_branching=True)  # fmt: skip
    policy = round_policy(CoordinatorConfig(), roomy)
    bare = RoundPolicy()
    assert (policy.max_draft_tokens, policy.num_successors, policy.draft_timeout_s) == (
        bare.max_draft_tokens,
        bare.num_successors,
        bare.draft_timeout_s,
    )


def test_the_local_cluster_listens_where_the_services_do_by_default() -> None:
    cluster = LocalCluster()
    coordinator = CoordinatorConfig()
    assert cluster.coordinator_port == coordinator.port
    assert cluster.drafter_address == coordinator.drafter == f"127.0.0.1:{DrafterConfig().port}"
    assert cluster.verifier_address == coordinator.verifier == f"127.0.0.1:{VerifierConfig().port}"
    assert cluster.model == coordinator.model == VerifierConfig().model == DrafterConfig().target_model


def test_the_servers_take_every_slot_queue_place_and_some_headroom_and_grpc_room_for_health_watches() -> None:
    flags = ["--max-concurrent-streams", "4", "--max-queued-streams", "10", "--max-health-watches", "3"]
    config, _ = coordinator_main.parse_config(flags)
    assert max_concurrent_calls(config) == 4 + 10 + CALL_HEADROOM
    assert grpc_call_backstop(config) == max_concurrent_calls(config) + 3 + CALL_HEADROOM
    defaults = CoordinatorConfig()
    assert grpc_call_backstop(defaults) == 64 + 256 + DEFAULT_MAX_HEALTH_WATCHES + 2 * CALL_HEADROOM


def test_one_tenant_gets_half_the_slots_by_default_when_callers_authenticate() -> None:
    keys = ["--api-keys-file", "keys.yaml", "--max-concurrent-streams", "4"]
    assert admission_limits(coordinator_main.parse_config(keys)[0]).tenant_max_running == 2
    assert (
        admission_limits(coordinator_main.parse_config([*keys, "--max-concurrent-streams", "1"])[0]).tenant_max_running
        == 1
    )
    opted_out = coordinator_main.parse_config([*keys, "--tenant-max-concurrent-streams", "0"])[0]
    assert admission_limits(opted_out).tenant_max_running == 0
    assert (
        admission_limits(
            coordinator_main.parse_config([*keys, "--tenant-max-concurrent-streams", "3"])[0]
        ).tenant_max_running
        == 3
    )
    # Without keys every caller is the one anonymous tenant: a share would only halve the coordinator.
    assert admission_limits(coordinator_main.parse_config(["--max-concurrent-streams", "4"])[0]).tenant_max_running == 0


def test_the_drafter_takes_its_device_from_the_flag_or_the_environment_and_refuses_what_it_cannot_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert drafter_main.parse_config(["--device", "cpu"])[0].device == "cpu"
    monkeypatch.setenv("SPECSERVE_DRAFTER_DEVICE", "cpu")
    assert drafter_main.parse_config([])[0].device == "cpu"
    monkeypatch.setattr(drafter_main.torch.cuda, "is_available", lambda: False)
    for device, says in (("cuda", "sees no CUDA device; pass --device cpu"), ("gpu0", "pass cpu, cuda or cuda:N")):
        with pytest.raises(SystemExit):
            drafter_main.parse_config(["--device", device])
        assert says in capsys.readouterr().err
    monkeypatch.setattr(drafter_main.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(drafter_main.torch.cuda, "device_count", lambda: 2)
    assert drafter_main.parse_config(["--device", "cuda:1"])[0].device == "cuda:1"
    with pytest.raises(SystemExit):
        drafter_main.parse_config(["--device", "cuda:2"])
    assert "cuda:0 to cuda:1" in capsys.readouterr().err
