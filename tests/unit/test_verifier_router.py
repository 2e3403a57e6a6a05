"""Session affinity over verifier replicas (fake replicas recording their calls)."""

import asyncio

import pytest

from coordinator.ports import VerifierInfo
from coordinator.prefix_homes import PrefixHomes, block_keys
from coordinator.verifier_router import StickyVerifierRouter, replica_resolver
from specserve.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ReplicaDraining,
    ReplicaUnreachable,
    SessionMoved,
    Unavailable,
)
from specserve.results import PrefillResult, VerifyResult
from specserve.sampling import SamplingParams
from specserve.verify_call import SessionPrefill, VerifyCall


class FakeReplica:
    def __init__(self, address: str) -> None:
        self.address = address
        self.calls: list[tuple[str, str]] = []
        self.failure: Exception | None = None  # raised by every call while set
        self.prefill_failure: Exception | None = None  # raised by prefills only (a draining replica)

    def _fail(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def info(self) -> VerifierInfo:
        return VerifierInfo(self.address, "fp", 10, 8, 4, 100, True)

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        self._fail()
        if self.prefill_failure is not None:
            raise self.prefill_failure
        self.calls.append(("prefill", call.session_id))
        return PrefillResult(0)

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self._fail()
        self.calls.append(("verify", call.session_id))
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
        await router.prefill(SessionPrefill(name, (1,), SamplingParams()))
        for _ in range(3):
            await router.verify(VerifyCall(name, 1))

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
    asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    first = next(a for a, r in replicas.items() if r.calls)
    addresses.remove(first)
    clock.now = 10.0
    asyncio.run(router.verify(VerifyCall("s", 1)))
    other = addresses[0]
    assert replicas[other].calls == [("verify", "s")]  # NOT_FOUND there makes the round loop re-prefill
    assert router.replicas == [other]


def test_no_replica_is_unavailable_and_dns_errors_keep_known_replicas() -> None:
    router = StickyVerifierRouter(lambda: [], FakeReplica)
    with pytest.raises(Unavailable, match="no verifier replica"):
        asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))

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


def dead(address: str) -> ReplicaUnreachable:
    return ReplicaUnreachable(f"verifier at {address} is unreachable: Connection refused")


def test_a_failed_replica_moves_the_session_and_is_skipped_until_its_backoff_ends() -> None:
    clock = Clock()
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(
        lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)), 1000.0, clock, down_s=5.0
    )
    asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    first = next(a for a, r in replicas.items() if r.calls)
    other = next(a for a in replicas if a != first)
    replicas[first].failure = dead(first)
    with pytest.raises(SessionMoved, match="unreachable"):
        asyncio.run(router.verify(VerifyCall("s", 1)))
    # The round loop prefills the session again: on the other replica, where every later call goes.
    asyncio.run(router.prefill(SessionPrefill("s", (1, 2), SamplingParams())))
    asyncio.run(router.verify(VerifyCall("s", 2)))
    assert replicas[other].calls == [("prefill", "s"), ("verify", "s")]
    # New sessions avoid the failed replica while it is down, even though it has fewer sessions...
    asyncio.run(router.prefill(SessionPrefill("t", (1,), SamplingParams())))
    assert ("prefill", "t") in replicas[other].calls
    # ...and after the backoff the next one probes it again.
    replicas[first].failure = None
    clock.now = 6.0
    asyncio.run(router.prefill(SessionPrefill("u", (1,), SamplingParams())))
    assert ("prefill", "u") in replicas[first].calls


def test_sessions_of_a_replica_that_failed_under_another_session_move_too() -> None:
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)))
    for name in ("s", "t", "u"):
        asyncio.run(router.prefill(SessionPrefill(name, (1,), SamplingParams())))
    shared = next(a for a, r in replicas.items() if len(r.calls) == 2)
    replicas[shared].failure = dead(shared)
    victims = [sid for _, sid in replicas[shared].calls]
    with pytest.raises(SessionMoved):
        asyncio.run(router.verify(VerifyCall(victims[0], 1)))
    with pytest.raises(SessionMoved, match="down"):  # not even tried: its replica is down
        asyncio.run(router.verify(VerifyCall(victims[1], 1)))
    assert len(replicas[shared].calls) == 2


def test_with_no_replica_left_calls_are_unavailable() -> None:
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)))
    asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    for address, replica in replicas.items():
        replica.failure = dead(address)
    with pytest.raises(SessionMoved):
        asyncio.run(router.verify(VerifyCall("s", 1)))
    with pytest.raises(Unavailable, match="every verifier replica") as failed:
        asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    assert not isinstance(failed.value, SessionMoved)  # the round loop does not retry this one
    with pytest.raises(Unavailable, match="every verifier replica"):
        asyncio.run(router.prefill(SessionPrefill("t", (1,), SamplingParams())))


@pytest.mark.parametrize("error", [DeadlineExceeded("deadline"), InvalidArgument("bad tree"), Unavailable("INTERNAL")])
def test_errors_that_are_not_a_replica_failure_keep_the_session_in_place(error: Exception) -> None:
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)))
    asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    first = next(a for a, r in replicas.items() if r.calls)
    replicas[first].failure = error
    with pytest.raises(type(error)) as raised:
        asyncio.run(router.verify(VerifyCall("s", 1)))
    assert not isinstance(raised.value, SessionMoved)
    replicas[first].failure = None
    asyncio.run(router.verify(VerifyCall("s", 1)))
    assert replicas[first].calls[-1] == ("verify", "s")


def test_a_draining_replica_keeps_its_sessions_while_new_ones_start_elsewhere() -> None:
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(
        lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)), 1000.0, Clock(), down_s=5.0
    )
    asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    first = next(a for a, r in replicas.items() if r.calls)
    other = next(a for a in replicas if a != first)
    replicas[first].prefill_failure = ReplicaDraining(f"verifier at {first} is shutting down")
    asyncio.run(router.prefill(SessionPrefill("t", (1,), SamplingParams())))  # the least loaded: pinned to `other`
    with pytest.raises(SessionMoved, match="shutting down"):
        asyncio.run(router.prefill(SessionPrefill("u", (1,), SamplingParams())))  # tried `first`, which refused it
    asyncio.run(router.prefill(SessionPrefill("u", (1,), SamplingParams())))
    asyncio.run(router.verify(VerifyCall("s", 1)))
    assert replicas[first].calls == [("prefill", "s"), ("verify", "s")]  # the session it holds stays
    assert replicas[other].calls == [("prefill", "t"), ("prefill", "u")]


def test_with_every_replica_draining_a_new_session_is_refused_with_the_replicas_reason() -> None:
    replica = FakeReplica("a:1")
    replica.prefill_failure = ReplicaDraining("verifier at a:1 is shutting down: retry")
    router = StickyVerifierRouter(lambda: ["a:1"], lambda a: replica, 1000.0, Clock(), down_s=5.0)
    with pytest.raises(Unavailable, match="shutting down") as refused:
        asyncio.run(router.prefill(SessionPrefill("s", (1,), SamplingParams())))
    assert not isinstance(refused.value, SessionMoved)


def test_a_conversations_next_turn_goes_back_to_the_replica_that_prefilled_the_last() -> None:
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)))
    first_turn = tuple(range(130))  # two whole blocks
    unrelated = tuple(range(1000, 1130))

    async def run() -> None:
        await router.prefill(SessionPrefill("turn-1", first_turn, SamplingParams()))  # a:1 (both empty)
        await router.release("turn-1")
        await router.prefill(SessionPrefill("other", unrelated, SamplingParams()))  # a:1 again: least loaded
        # The next turn starts with the first turn's prompt: back to a:1 though b:1 has fewer sessions.
        await router.prefill(SessionPrefill("turn-2", (*first_turn, 7, 8, 9), SamplingParams()))
        await router.prefill(SessionPrefill("new", tuple(range(2000, 2130)), SamplingParams()))  # b:1

    asyncio.run(run())
    assert [s for kind, s in replicas["a:1"].calls if kind == "prefill"] == ["turn-1", "other", "turn-2"]
    assert [s for kind, s in replicas["b:1"].calls if kind == "prefill"] == ["new"]


def test_balance_wins_over_a_known_prefix_past_the_slack() -> None:
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(
        lambda: ["a:1", "b:1"], lambda a: replicas.setdefault(a, FakeReplica(a)), prefix_slack=1
    )
    prompt = tuple(range(64))

    async def run() -> None:
        await router.prefill(SessionPrefill("s0", prompt, SamplingParams()))  # a:1
        await router.prefill(SessionPrefill("s1", prompt, SamplingParams()))  # a:1 (1 more than b:1: in slack)
        await router.prefill(SessionPrefill("s2", prompt, SamplingParams()))  # b:1 (a:1 would be 2 more)

    asyncio.run(run())
    assert [s for kind, s in replicas["a:1"].calls if kind == "prefill"] == ["s0", "s1"]
    assert [s for kind, s in replicas["b:1"].calls if kind == "prefill"] == ["s2"]


def test_prefix_homes_key_whole_blocks_and_forget_a_replica_that_left() -> None:
    homes = PrefixHomes(max_keys=3)
    homes.record(block_keys(tuple(range(63))), "a:1")  # no whole block
    assert len(homes) == 0
    homes.record(block_keys(tuple(range(200))), "a:1")  # three blocks
    homes.record(block_keys(tuple(range(64))), "b:1")  # the first block's home moves
    assert homes.home(block_keys(tuple(range(150))), {"a:1", "b:1"}) == "a:1"  # the longest known prefix wins
    assert homes.home(block_keys(tuple(range(100))), {"a:1", "b:1"}) == "b:1"
    assert homes.home(block_keys(tuple(range(150))), {"b:1"}) == "b:1"  # among those that may take it
    homes.record(block_keys(tuple(range(5000, 5064))), "c:1")  # a fourth key: the least recently used goes
    assert len(homes) == 3 and homes.home(block_keys(tuple(range(150))), {"a:1"}) is None
    homes.forget("b:1")
    assert homes.home(block_keys(tuple(range(100))), {"a:1", "b:1"}) is None
