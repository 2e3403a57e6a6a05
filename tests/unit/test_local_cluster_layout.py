"""How ``LocalCluster`` starts its drafter: pre-drafting off where it shares the verifier's CPUs."""

from __future__ import annotations

import pytest

from specserve.local_cluster import PREDRAFT_ENV, LocalCluster


def drafter_args(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The drafter's command-line arguments as ``start_drafter`` would spawn it (nothing is started)."""
    spawned: dict[str, list[str]] = {}

    def spawn(name: str, module: str, args: list[str]) -> None:
        spawned[name] = args

    monkeypatch.setattr(cluster, "_spawn", spawn)
    cluster.start_drafter()
    return spawned["drafter"]


def predraft_flag(args: list[str]) -> str | None:
    """The last --predraft-outcomes value (argparse keeps the last), None when absent."""
    values = [args[i + 1] for i, arg in enumerate(args) if arg == "--predraft-outcomes"]
    return values[-1] if values else None


@pytest.fixture(autouse=True)
def no_predraft_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREDRAFT_ENV, raising=False)


def test_a_drafter_on_the_verifiers_cpus_starts_without_pre_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert predraft_flag(drafter_args(LocalCluster(), monkeypatch)) == "0"
    overlapping = LocalCluster(cpus={"verifier": frozenset({0, 1}), "drafter": frozenset({1})})
    assert overlapping.drafter_shares_verifier_cpus
    assert predraft_flag(drafter_args(overlapping, monkeypatch)) == "0"


def test_a_drafter_pinned_apart_from_the_verifier_keeps_its_own_default(monkeypatch: pytest.MonkeyPatch) -> None:
    apart = LocalCluster(cpus={"verifier": frozenset({0}), "drafter": frozenset({1})})
    assert not apart.drafter_shares_verifier_cpus
    assert predraft_flag(drafter_args(apart, monkeypatch)) is None


def test_the_callers_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = LocalCluster(extra_drafter_args=["--predraft-outcomes", "2"])
    assert predraft_flag(drafter_args(cluster, monkeypatch)) == "2"
    monkeypatch.setenv(PREDRAFT_ENV, "3")  # the drafter reads it: the cluster adds no flag over it
    assert predraft_flag(drafter_args(LocalCluster(), monkeypatch)) is None
