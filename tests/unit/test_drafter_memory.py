"""The drafter's memory is bounded in bytes, and a silent Draft stream is closed with its state freed."""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np
import pytest
import torch

from draft_service.draft_head import DraftHead, DraftHeadConfig
from draft_service.drafter import BYTES_PER_TOKEN, Drafter, DraftSession
from draft_service.head_proposer import HeadProposer
from draft_service.namespace_state import NAMESPACE, NAMESPACE_BYTES
from draft_service.ngram_pool import ByteBudget, InMemoryNgramPool, PoolShape
from draft_service.pools import PoolRegistry
from draft_service.server import idle_limited
from draft_service.session_memory import SESSION, SessionMemory
from draft_service.tree_builder import VerifyCost
from specserve.drain import Drain
from specserve.errors import DeadlineExceeded
from specserve.results import DraftFeedback
from specserve.v1 import drafter_pb2_grpc
from tests.conftest import tiny_llama
from tests.unit.test_drain import Stream, drafter_server, propose, start

TARGET = tiny_llama(vocab_size=48, seed=5, context=512)
HIDDEN = 64
PROMPT = list(range(1, 41)) * 3  # 120 tokens
FREE = VerifyCost({0: 1.0, 64: 1.0})  # every node pays: the tree builder keeps what the sources propose


def test_the_bytes_estimated_per_pool_key_bound_what_python_holds() -> None:
    shape = PoolShape()
    pool = InMemoryNgramPool(shape, max_keys=10**6)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(1000):  # every key full: max_continuations distinct continuations of fresh ids
            key = [1000 + k, 20_000 + k, 30_000 + k]
            for c in range(shape.max_continuations):
                pool.record([*key, *(40_000 + 40 * k + 8 * c + j for j in range(shape.continuation_len))])
        measured = (tracemalloc.get_traced_memory()[0] - before) / len(pool)
    finally:
        tracemalloc.stop()
    assert measured <= shape.bytes_per_key <= 1.5 * measured
    assert pool.nbytes == len(pool) * shape.bytes_per_key


def test_pools_sharing_a_byte_budget_stay_within_it_evicting_their_least_recent_keys() -> None:
    shape = PoolShape(key_len=2, continuation_len=2)
    budget = ByteBudget(50 * shape.bytes_per_key)
    first, second = InMemoryNgramPool(shape, budget=budget), InMemoryNgramPool(shape, budget=budget)
    first.record(list(range(100, 140)))  # 37 keys
    second.record(list(range(200, 240)))  # 37 more: over the budget, the second pool evicts its oldest
    assert budget.used == (len(first) + len(second)) * shape.bytes_per_key <= budget.max_bytes
    assert len(first) == 37 and len(second) == 13
    assert second.lookup([236, 237]) == [(238, 239)], "the newest keys stay"
    assert second.lookup([200, 201]) == [], "the oldest went"
    registry = PoolRegistry(shape, None, 0.05, max_keys=10**6, max_bytes=10 * shape.bytes_per_key)
    registry("a").record(list(range(100)))
    registry("b").record(list(range(100)))
    assert registry.nbytes <= 10 * shape.bytes_per_key


def tiny_head() -> DraftHead:
    config = DraftHeadConfig.for_target(TARGET.config, draft_vocab_size=40, intermediate_size=96)
    embedding = TARGET.get_input_embeddings().weight.detach()
    lm_head = TARGET.get_output_embeddings().weight.detach()
    return DraftHead(config, embedding, lm_head, torch.arange(40)).eval()


def warm(session: DraftSession, rounds: int = 2) -> None:
    """A prompt's features, then rounds of generated tokens with theirs, as the coordinator reports them."""
    rng = np.random.default_rng(len(session.session_id))
    features = rng.standard_normal((len(session.tokens) - 1, HIDDEN)).astype(np.float16)
    session.propose(DraftFeedback((), (), features), max_nodes=8)
    for r in range(rounds):
        new = (7 + r, 9 + r)
        session.propose(DraftFeedback(new, (), rng.standard_normal((2, HIDDEN)).astype(np.float16)), max_nodes=8)


def head_of(session: DraftSession) -> HeadProposer:
    return next(p for p in session._proposers if isinstance(p, HeadProposer))


def test_over_budget_the_least_recently_used_sessions_forget_their_head_state_and_keep_drafting() -> None:
    drafter = Drafter(
        lambda *_: InMemoryNgramPool(), sources=("prompt_lookup", "draft_model"), cost=FREE, draft_head=tiny_head()
    )
    one, two = drafter.open_session("one", PROMPT, ""), drafter.open_session("two", PROMPT, "")
    warm(one)
    assert head_of(one).nbytes > len(PROMPT) * HIDDEN, "the head's KV cache over the context is counted"
    warm(two)
    three = drafter.open_session("three", PROMPT, "")
    # Room for what the first two hold and half as much again: not for a third session drafting with its head.
    drafter.memory.max_bytes = int(1.5 * drafter.memory.bytes_in_use)
    one.propose(DraftFeedback((), ()), max_nodes=8)  # the first session was used last: the second is the LRU
    assert drafter.memory.num_forgotten == 0
    warm(three)
    assert head_of(two).forgotten and not head_of(one).forgotten and not head_of(three).forgotten
    assert drafter.memory.bytes_in_use <= drafter.memory.max_bytes
    assert drafter.memory.num_forgotten == 1
    assert head_of(two).nbytes == 0

    # The forgotten session goes on: prompt lookup still drafts, the head offers nothing and keeps no features.
    reply = two.propose(DraftFeedback((1, 2), (), np.ones((2, HIDDEN), np.float16)), max_nodes=8)
    assert len(reply.tree) > 0 and head_of(two).nbytes == 0
    assert head_of(two).propose(two.tokens, 8).token_ids == ()
    assert head_of(one).propose(one.tokens, 8).token_ids != (), "the others still draft with their head"

    for session in (one, two, three):
        session.close()
    assert drafter.memory.bytes_of(SESSION) == 0 and drafter.memory.count(SESSION) == 0
    three.work_ahead()  # a step of work ahead that ends after its stream does not count the session again
    assert drafter.memory.count(SESSION) == 0


def test_a_session_alone_over_the_budget_forgets_its_own_head_state() -> None:
    drafter = Drafter(
        lambda *_: InMemoryNgramPool(),
        sources=("prompt_lookup", "draft_model"),
        draft_head=tiny_head(),
        memory=SessionMemory(max_bytes=1),
    )
    session = drafter.open_session("big", PROMPT, "")
    warm(session)
    assert head_of(session).forgotten
    # Its tokens (what a session needs to draft at all) and its namespace's state, emptied.
    assert drafter.memory.bytes_of(SESSION) == session.nbytes == BYTES_PER_TOKEN * len(session.tokens)
    assert drafter.memory.bytes_of(NAMESPACE) == NAMESPACE_BYTES


class ManualIdleTimer:
    """The server's idle timer under the test's control: a wait for the next message times out when ``expire`` says.

    Under a real timer, "a message every 0.25 s is never idle for 0.5 s" holds only while the machine keeps up.
    """

    def __init__(self) -> None:
        self.waits: list[float] = []  # the timeout of every wait for a message the server began, in order
        self._current: asyncio.Timeout | None = None

    @contextlib.asynccontextmanager
    async def __call__(self, seconds: float) -> AsyncIterator[None]:
        self.waits.append(seconds)
        async with asyncio.timeout(None) as self._current:
            yield

    def expire(self) -> None:
        """The wait in progress times out now (RuntimeError when none is)."""
        assert self._current is not None
        self._current.reschedule(asyncio.get_running_loop().time())


async def wait_for(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_silent_draft_stream_is_closed_with_deadline_exceeded_and_its_state_freed() -> None:
    async def scenario() -> None:
        drafter = Drafter(lambda *_: InMemoryNgramPool())
        timer = ManualIdleTimer()
        server, address = await drafter_server(Drain(), drafter=drafter, stream_idle_timeout_s=0.5, idle_timer=timer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = drafter_pb2_grpc.DrafterServiceStub(channel)
                stream = Stream(stub)
                await stream.send(start("idle"))
                for _ in range(4):
                    await stream.send(propose([4, 5]))
                    await stream.call.read()
                # Every message starts a new wait, of the configured length: the start, four proposes, and now the
                # wait for a sixth message.
                await wait_for(lambda: len(timer.waits) == 6)
                assert timer.waits == [0.5] * 6
                assert drafter.memory.count(SESSION) == 1
                timer.expire()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async with asyncio.timeout(30):
                        await stream.call.read()
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "no message on this Draft stream for 0.5 s" in (caught.value.details() or "")
                assert drafter.memory.count(SESSION) == 0 and drafter.memory.bytes_of(SESSION) == 0
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_the_idle_limit_times_out_on_the_loop_clock_by_default() -> None:
    async def silent() -> AsyncIterator[int]:
        await asyncio.Event().wait()
        yield 0

    async def scenario() -> None:
        with pytest.raises(DeadlineExceeded, match=r"no message on this Draft stream for 0\.01 s"):
            async with asyncio.timeout(30):  # a guard only: the limit fires after 0.01 s
                await anext(idle_limited(silent(), 0.01))

    asyncio.run(scenario())
