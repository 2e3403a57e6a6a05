"""The health-checked drafter: latency-following timeouts, a circuit breaker, background probes."""

import asyncio
from collections.abc import Sequence

import pytest

from coordinator.drafter_health import DRAINING_RETRIES, DraftLatency, HealthCheckedDrafter
from specserve.errors import DrafterDraining, DrafterFailed, DrafterSkipped
from specserve.results import DraftFeedback, DraftReply
from specserve.token_tree import TokenTree
from tests.virtual_clock import clock, run_virtual


def test_timeout_is_the_ceiling_until_measured_then_follows_the_p99_within_bounds() -> None:
    latency = DraftLatency(ceiling_s=1.0, floor_s=0.05, factor=4.0, min_samples=8)
    assert latency.timeout_s == 1.0
    for _ in range(100):
        latency.observe(0.02)
    assert latency.timeout_s == pytest.approx(0.08)
    latency.observe(0.1)
    latency.observe(0.1)  # 2 of 102: above the p99's rank
    assert latency.timeout_s == pytest.approx(0.4)
    for _ in range(128):
        latency.observe(0.001)
    assert latency.timeout_s == 0.05  # the floor
    for _ in range(10):
        latency.observe(5.0)
    assert latency.timeout_s == 1.0  # the ceiling


class FakeStream:
    wants_features = False
    takes_verified_trees = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, drafter: "FakeDrafter", draining: bool = False) -> None:
        self._drafter = drafter
        self._draining = draining  # refused by a drafter shutting down (it refuses new streams at their first read)

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        if self._draining:
            raise DrafterDraining("the drafter is shutting down")
        self._drafter.proposals += 1
        if self._drafter.mode == "stall":
            await asyncio.sleep(3600)
        if self._drafter.mode == "fail":
            raise DrafterFailed("connection reset")
        return DraftReply(TokenTree.chain([1]) if max_nodes else TokenTree())

    async def close(self) -> None:
        return None


class FakeDrafter:
    def __init__(self) -> None:
        self.mode = "ok"
        self.opens = 0
        self.proposals = 0
        self.draining_opens = 0  # this many next opens land on a draining drafter
        self.refused_opens = 0  # this many next opens are refused at once by a draining drafter (a pool's refusal)

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> FakeStream:
        self.opens += 1
        if self.mode == "fail":
            raise DrafterFailed("connection refused")
        if self.refused_opens > 0:
            self.refused_opens -= 1
            raise DrafterDraining("the drafter is shutting down")
        draining = self.draining_opens > 0
        self.draining_opens -= draining
        return FakeStream(self, draining)


def wrapped(inner: FakeDrafter, **kwargs: float) -> HealthCheckedDrafter:
    """The drafter on the loop's clock: under ``run_virtual``, every timeout and backoff is exact and instant."""
    options = {"ceiling_s": 0.2, "floor_s": 0.01, "backoff_s": 0.3, "max_backoff_s": 1.0, **kwargs}
    return HealthCheckedDrafter(inner, "fake", clock=clock, **options)  # type: ignore[arg-type]


async def until(moment: float) -> None:
    await asyncio.sleep(moment - clock())


async def one_request(drafter: HealthCheckedDrafter, session: str) -> str:
    """Open and propose once, as a request's first round does; returns what happened."""
    try:
        stream = await drafter.open(session, [1, 2], "fp")
        await stream.propose(DraftFeedback(()), 4)
        await stream.close()
        return "ok"
    except DrafterSkipped:
        return "skipped"
    except DrafterFailed as exc:
        return f"failed: {exc}"


def test_a_stalled_drafter_costs_one_timeout_then_is_skipped_until_a_probe_finds_it_healthy() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner)
        assert await one_request(drafter, "a") == "ok"
        inner.mode = "stall"
        stalled = clock()
        assert (await one_request(drafter, "b")).startswith("failed: no answer within 200 ms")
        assert clock() - stalled == pytest.approx(0.2)  # the ceiling: too few round trips measured yet
        skipping = clock()
        assert [await one_request(drafter, s) for s in "cde"] == ["skipped"] * 3
        assert clock() == skipping  # skipped requests never wait
        assert drafter.circuit_open
        # Open from 0.2 s for 0.3 s; the probe at 0.5 s stalls and times out at 0.7 s, which opens the circuit for
        # 0.6 s more: the next probe is at 1.3 s.
        await until(stalled + 0.8)
        assert drafter.circuit_open and drafter.failures_in_a_row == 2
        inner.mode = "ok"
        await until(stalled + 1.29)
        assert drafter.circuit_open
        await until(stalled + 1.31)
        assert not drafter.circuit_open
        assert await one_request(drafter, "f") == "ok"
        assert drafter.failures_in_a_row == 0  # a session with a tree and no failure resets the doubling
        await drafter.aclose()

    run_virtual(scenario())


def test_streams_in_flight_give_up_when_another_session_trips_the_circuit() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner, ceiling_s=0.3)
        streams = [await drafter.open(s, [1], "fp") for s in "abcd"]
        inner.mode = "stall"
        started = clock()
        results = await asyncio.gather(*(s.propose(DraftFeedback(()), 4) for s in streams), return_exceptions=True)
        assert all(isinstance(r, DrafterFailed) for r in results)
        assert sum(isinstance(r, DrafterSkipped) for r in results) == 3  # one timed out; the others gave up with it
        assert clock() - started == pytest.approx(0.3)  # one timeout in all
        await drafter.aclose()

    run_virtual(scenario())


def test_a_failing_drafter_backs_off_doubling_and_misbehaviour_counts() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner, backoff_s=0.1, max_backoff_s=0.4)
        inner.mode = "fail"
        assert (await one_request(drafter, "a")).startswith("failed: connection refused")
        assert await one_request(drafter, "b") == "skipped"
        assert inner.opens == 1
        await asyncio.sleep(0.45)  # probes at 0.1 and 0.3 fail; the next is at 0.7
        assert drafter.failures_in_a_row == 3 and inner.opens == 3
        inner.mode = "ok"
        await asyncio.sleep(0.2)
        assert drafter.circuit_open and inner.opens == 3  # 0.65 s: the 0.4 s backoff is not over
        await asyncio.sleep(0.1)
        assert not drafter.circuit_open and inner.opens == 4
        stream = await drafter.open("c", [1], "fp")
        drafter.misbehaved("c", "sent a bad tree: node 0 has token id 99999")
        assert drafter.circuit_open
        assert "sent a bad tree" in drafter.skip_reason()
        assert await one_request(drafter, "d") == "skipped"
        await stream.close()
        assert drafter.failures_in_a_row > 0  # a misbehaving session does not reset the doubling
        await drafter.aclose()

    run_virtual(scenario())


def test_a_draining_drafters_refusal_opens_the_session_again_and_trips_no_circuit() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner)
        inner.draining_opens = 2  # on a round-robin tier: two drafters shutting down, then a serving one
        assert await one_request(drafter, "a") == "ok"
        assert inner.opens == 3 and inner.proposals == 1
        assert not drafter.circuit_open and drafter.failures_in_a_row == 0
        # Every drafter draining: the request goes on without one, and later requests are not skipped.
        inner.draining_opens = DRAINING_RETRIES + 1
        assert await one_request(drafter, "b") == "failed: the drafter is shutting down"
        assert not drafter.circuit_open and drafter.failures_in_a_row == 0
        assert await one_request(drafter, "c") == "ok"
        await drafter.aclose()

    run_virtual(scenario())


def test_a_drafter_draining_after_answering_is_not_asked_to_open_the_session_elsewhere() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner)
        stream = await drafter.open("a", [1], "fp")
        await stream.propose(DraftFeedback(()), 4)
        stream._inner._draining = True  # type: ignore[attr-defined]  # its state is there: no reopening
        with pytest.raises(DrafterDraining):
            await stream.propose(DraftFeedback((1,)), 4)
        assert inner.opens == 1 and not drafter.circuit_open
        await drafter.aclose()

    run_virtual(scenario())


def test_a_probe_passes_a_draining_drafter_by() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner, backoff_s=0.3)
        inner.mode = "fail"
        failed = clock()
        assert (await one_request(drafter, "a")).startswith("failed: connection refused")
        inner.mode, inner.draining_opens = "ok", 1
        await until(failed + 0.31)  # the probe: refused once by a draining drafter, then answered by another
        assert not drafter.circuit_open
        await drafter.aclose()

    run_virtual(scenario())


def test_a_refusal_at_the_open_is_passed_by_as_one_at_the_first_read_is() -> None:
    async def scenario() -> None:
        inner = FakeDrafter()
        drafter = wrapped(inner, backoff_s=0.3)
        inner.refused_opens = 1
        assert await one_request(drafter, "a") == "ok"  # a request's session opens again
        assert inner.opens == 2 and not drafter.circuit_open
        inner.mode = "fail"
        failed = clock()
        assert (await one_request(drafter, "b")).startswith("failed: connection refused")
        inner.mode, inner.refused_opens = "ok", 1
        await until(failed + 0.31)  # the probe: refused at its open by a draining drafter, then answered
        assert not drafter.circuit_open and inner.refused_opens == 0
        await drafter.aclose()

    run_virtual(scenario())
