"""The capped registry behind the drafter's namespace state and its n-gram pools (draft_service.capped_registry)."""

from __future__ import annotations

import pytest

from draft_service.capped_registry import CappedRegistry


def test_made_once_most_recent_kept_least_recent_evicted() -> None:
    made: list[str] = []
    evicted: list[tuple[str, str]] = []

    def make(key: str) -> str:
        made.append(key)
        return key.upper()

    registry: CappedRegistry[str, str] = CappedRegistry(2, make, lambda k, v: evicted.append((k, v)))
    assert registry.get("a") == "A" and registry.get("b") == "B"
    assert registry.get("a") == "A" and made == ["a", "b"], "made once"
    registry.get("c")  # "b" is now the least recently used
    assert evicted == [("b", "B")] and list(registry) == ["a", "c"] and len(registry) == 2
    assert "b" not in registry and "a" in registry


def test_pop_while_walking_hands_the_value_to_the_caller() -> None:
    evicted: list[str] = []
    registry: CappedRegistry[tuple[str, str], str] = CappedRegistry(
        8, lambda key: "/".join(key), lambda k, v: evicted.append(v)
    )
    for key in (("v1", "acme"), ("v2", "acme"), ("v1", "beta")):
        registry.get(key)
    popped = [registry.pop(key) for key in registry if key[1] == "acme"]
    assert popped == ["v1/acme", "v2/acme"] and list(registry) == [("v1", "beta")] and evicted == []


def test_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="at least one"):
        CappedRegistry(0, str, lambda k, v: None)
