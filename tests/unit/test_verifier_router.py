"""Session affinity over verifier replicas (fake replicas recording their calls)."""

import asyncio
from collections.abc import Sequence

import pytest

from coordinator.ports import VerifierInfo
from coordinator.verifier_router import StickyVerifierRouter, replica_resolver
from specserve.acceptance import PrefillResult, VerifyResult
from specserve.errors import Unavailable
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree


class FakeReplica:
    def __init__(self, address: str) -> None:
        self.address = address
        self.calls: list[tuple[str, str]] = []

    async def info(self) -> VerifierInfo:
        return VerifierInfo(self.address, "fp", 10, 8, 4, 100, True)

    async def prefill(
        self, session_id: str, token_ids: Sequence[int], sampling: SamplingParams, return_features: bool = False
    ) -> PrefillResult:
        self.calls.append(("prefill", session_id))
        return PrefillResult(0)

    async def verify(
        self, session_id: str, num_committed: int, tree: TokenTree, top_k: int = 0, return_features: bool = False
    ) -> VerifyResult:
        self.calls.append(("verify", session_id))
        return VerifyResult([], [], 1, 0)

    async def release(self, session_id: str) -> None:
        self.calls.append(("release", session_id))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_stick_to_one_replica_and_spread_by_load() -> None:
    replicas: dict[str, FakeReplica] = {}
    addresses = ["10.0.0.1:50053", "10.0.0.2:50053"]

    def connect(address: str) -> FakeReplica:
        return replicas.setdefault(address, FakeReplica(address))

    router = StickyVerifierRouter(lambda: addresses, connect)

    async def session(name: str) -> None:
        await router.prefill(name, [1], SamplingParams())
        for _ in range(3):
            await router.verify(name, 1, TokenTree())

    asyncio.run(session("a"))
    asyncio.run(session("b"))
    for replica in replicas.values():
        assert len({session_id for _, session_id in replica.calls}) == 1  # one session each, every call there
        assert len(replica.calls) == 4
    asyncio.run(router.release("a"))
    assert ("release", "a") in next(r for r in replicas.values() if ("prefill", "a") in r.calls).calls


def test_a_vanished_replica_moves_its_sessions() -> None:
    clock = Clock()
    addresses = ["a:1", "b:1"]
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(lambda: addresses, lambda a: replicas.setdefault(a, FakeReplica(a)), 5.0, clock)
    asyncio.run(router.prefill("s", [1], SamplingParams()))
    first = next(a for a, r in replicas.items() if r.calls)
    addresses.remove(first)
    clock.now = 10.0
    asyncio.run(router.verify("s", 1, TokenTree()))
    other = addresses[0]
    assert replicas[other].calls == [("verify", "s")]  # NOT_FOUND there makes the round loop re-prefill
    assert router.replicas == [other]


def test_no_replica_is_unavailable_and_dns_errors_keep_known_replicas() -> None:
    router = StickyVerifierRouter(lambda: [], FakeReplica)
    with pytest.raises(Unavailable, match="no verifier replica"):
        asyncio.run(router.prefill("s", [1], SamplingParams()))

    clock = Clock()
    calls = {"n": 0}

    def flaky() -> list[str]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError("temporary failure in name resolution")
        return ["a:1"]

    router = StickyVerifierRouter(flaky, FakeReplica, 1.0, clock)
    assert router.replicas == ["a:1"]
    clock.now = 5.0
    assert router.replicas == ["a:1"]


def test_resolvers() -> None:
    assert replica_resolver("h1:1, h2:2")() == ["h1:1", "h2:2"]
    assert replica_resolver("dns:///localhost:50053")() in (["127.0.0.1:50053"], ["127.0.0.1:50053", "[::1]:50053"])
