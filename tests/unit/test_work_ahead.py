"""Work ahead runs on a thread of its own, and a session's queued work is dropped when its report arrives.

Under a structured-output constraint the coordinator verifies its own fitting of the drafter's tree (forced
tokens hung under the drafter's nodes) and tells the drafter: pre-drafts are then keyed by paths that end in
forced tokens, which the drafter's own tree never spells, and they hit.

Synchronised on events, never on sleeps: a thread that is blocked stays blocked until the test lets it go.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import pytest

from coordinator.grpc_clients import GrpcDrafter, GrpcDraftStream
from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.tree_builder import VerifyCost
from draft_service.work_ahead import WorkAhead
from specserve.drain import Drain
from specserve.results import DraftFeedback, VerifiedTree
from specserve.token_tree import ROOT, TokenTree
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specserve.wire import verified_tree_from_proto
from tests.unit.test_drain import Stream, drafter_server, first_refusal, propose, start

GUARD_S = 30  # a guard only: each wait ends on an event long before


def hold(busy: threading.Event, release: threading.Event) -> None:
    busy.set()
    release.wait(GUARD_S)


def test_queued_work_is_dropped_and_the_step_in_hand_is_waited_for() -> None:
    async def scenario() -> None:
        ahead = WorkAhead()
        running, release = threading.Event(), threading.Event()
        ran: list[str] = []

        def in_hand() -> None:
            running.set()
            release.wait(GUARD_S)
            ran.append("in hand")

        first = ahead.submit(in_hand)
        queued = ahead.submit(lambda: ran.append("queued"))
        await asyncio.to_thread(running.wait, GUARD_S)
        assert await ahead.stop(queued, threading.Event()) is True, "queued behind another: dropped"
        stopping = asyncio.ensure_future(ahead.stop(first, threading.Event()))
        await asyncio.sleep(0)
        assert not stopping.done(), "a step in hand is finished before the answer"
        release.set()
        async with asyncio.timeout(GUARD_S):
            assert await stopping is False
        assert ran == ["in hand"]
        ahead.close()

    asyncio.run(scenario())


def test_work_ahead_has_its_own_thread() -> None:
    ahead = WorkAhead()
    names: list[str] = []
    for _ in range(3):
        ahead.submit(lambda: names.append(threading.current_thread().name)).result(GUARD_S)
    assert len(set(names)) == 1 and names[0].startswith("work-ahead")
    ahead.close()


def test_a_report_is_answered_while_the_work_ahead_thread_is_busy_with_another_session() -> None:
    """With work ahead on asyncio's default executor, or waited for in its queue, the answer would wait."""

    async def scenario() -> None:
        drafter = Drafter(lambda *_: InMemoryNgramPool(), predraft_outcomes=2)
        ahead = WorkAhead()
        server, address = await drafter_server(Drain(), drafter=drafter, work_ahead=ahead)
        busy, release = threading.Event(), threading.Event()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stream = Stream(drafter_pb2_grpc.DrafterServiceStub(channel))
                async with asyncio.timeout(GUARD_S):
                    # Another session's step holds the work-ahead thread: this session's work queues behind it.
                    ahead.submit(lambda: hold(busy, release))
                    await asyncio.to_thread(busy.wait, GUARD_S)
                    await stream.send(start("s"))
                    await stream.send(propose([4, 5, 1, 2, 3]))
                    await stream.call.read()
                    await stream.send(propose([4, 5]))
                    reply = await stream.call.read()
                assert reply.draft_ns > 0
                assert drafter.predraft_counts.dropped == 1
                release.set()
                await stream.close()
        finally:
            release.set()
            await server.stop(0)
            ahead.close()

    asyncio.run(scenario())


# Prompt lookup drafts what followed "1 2" earlier in the prompt: 3, then 4, 5, 6, 7.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
# The coordinator's fitting of the drafter's one-node tree (3): the grammar forces 4 and 5 under it.
FITTED = VerifiedTree(TokenTree((3, 4, 5), (ROOT, 0, 1)), (False, True, True))
# The verifier accepts 3 and the forced 4, 5 (certain), and adds its bonus token 6.
REPORT = DraftFeedback((3, 4, 5, 6), accepted_node_indices=(0,))


def lookup_drafter() -> Drafter:
    """Prompt lookup alone, verification free (every node kept), two outcomes pre-drafted per tree."""
    return Drafter(
        lambda *_: InMemoryNgramPool(),
        sources=("prompt_lookup",),
        cost=VerifyCost({0: 1.0, 64: 1.0}),
        predraft_outcomes=2,
    )


def work_all_ahead(session: object) -> None:
    while session.work_ahead():  # type: ignore[attr-defined]
        pass


@pytest.mark.parametrize("told", [False, True])
def test_a_path_that_ends_in_forced_tokens_is_predrafted_once_the_drafter_is_told_the_verified_tree(
    told: bool,
) -> None:
    drafter = lookup_drafter()
    session = drafter.open_session("s", PROMPT, "fp")
    assert session.propose(DraftFeedback(), max_nodes=1).tree.token_ids == (3,)
    work_all_ahead(session)  # from its own tree: 3 accepted, bonus 4 guessed
    if told:
        session.verified(FITTED)
        work_all_ahead(session)  # from the verified tree: 3 and the forced 4, 5 accepted, bonus 6 guessed
    reply = session.propose(REPORT, max_nodes=1)
    # Before: the pre-draft for "3, then 4" missed a round that ended in the forced 4, 5.
    assert reply.predrafted is told
    assert drafter.predraft_counts.used == int(told)
    assert reply.tree.token_ids == (7,)  # the same tree either way: what is drafted does not change


def test_a_session_told_verified_trees_waits_for_each_before_predrafting() -> None:
    drafter = lookup_drafter()
    session = drafter.open_session("s", PROMPT, "fp")
    session.propose(DraftFeedback(), max_nodes=1)
    session.verified(FITTED)
    work_all_ahead(session)
    drafted = drafter.predraft_counts.drafted
    session.propose(REPORT, max_nodes=1)
    assert not session.work_ahead(), "no pre-draft from its own tree: the verified one is on its way"
    assert drafter.predraft_counts.drafted == drafted
    session.verified(VerifiedTree(TokenTree((7, 8), (ROOT, 0)), (False, True)))
    work_all_ahead(session)
    assert drafter.predraft_counts.drafted > drafted


def test_where_the_grammar_allows_few_tokens_after_the_path_the_bonus_is_guessed_among_them() -> None:
    """Prompt lookup guesses 6 after "3 4 5". Told the grammar allows only 11 there (a forced token the tree's
    caps cut off), the drafter pre-drafts for 11; told it allows 6 or 11, for both (the path ends in a forced
    token, so it is as likely as its drafted part and only the bonus is in doubt)."""
    only = VerifiedTree(FITTED.tree, FITTED.forced, {2: (11,)})
    either = VerifiedTree(FITTED.tree, FITTED.forced, {2: (6, 11)})
    for verified, keys in ((FITTED, {(3, 4, 5, 6)}), (only, {(3, 4, 5, 11)}), (either, {(3, 4, 5, 6), (3, 4, 5, 11)})):
        drafter = lookup_drafter()
        session = drafter.open_session("s", PROMPT, "fp")
        session.propose(DraftFeedback(), max_nodes=1)
        session.verified(verified)
        work_all_ahead(session)
        assert set(session._predrafts) == keys
        reply = session.propose(DraftFeedback((3, 4, 5, 11), accepted_node_indices=(0,)), max_nodes=1)
        assert reply.predrafted is ((3, 4, 5, 11) in keys)


class RecordingWorkAhead(WorkAhead):
    """Work ahead that lets a test on the server's event loop wait for the n-th piece of work to end."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[Future[None]] = []
        self._changed = asyncio.Event()

    def submit(self, work: Callable[[], None]) -> Future[None]:
        future = super().submit(work)
        self.submitted.append(future)
        self._changed.set()
        return future

    async def finished(self, count: int) -> None:
        while len(self.submitted) < count:
            self._changed.clear()
            await self._changed.wait()
        await asyncio.wrap_future(self.submitted[count - 1])


def test_over_grpc_the_coordinator_tells_the_drafter_the_verified_tree_and_its_predraft_hits() -> None:
    async def scenario() -> None:
        drafter, ahead = lookup_drafter(), RecordingWorkAhead()
        server, address = await drafter_server(Drain(), drafter=drafter, work_ahead=ahead)
        try:
            async with grpc.aio.insecure_channel(address) as channel, asyncio.timeout(GUARD_S):
                assert (await GrpcDrafter(channel, address).info()).takes_verified_trees
                stream = await GrpcDrafter(channel, address).open("s", PROMPT, "fp")
                assert (await stream.propose(DraftFeedback(), 1)).tree.token_ids == (3,)
                await stream.verifying(FITTED)
                await ahead.finished(2)  # the work after the reply, then the work after the verified tree
                reply = await stream.propose(REPORT, 1)
                assert reply.predrafted and reply.predraft_ns > 0
                await stream.close()
        finally:
            await server.stop(0)
            ahead.close()

    asyncio.run(scenario())


def test_a_drafter_that_does_not_predraft_says_so_and_its_stream_sends_no_verified_tree() -> None:
    async def scenario() -> None:
        drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=("prompt_lookup",), predraft_outcomes=0)
        server, address = await drafter_server(Drain(), drafter=drafter)
        try:
            async with grpc.aio.insecure_channel(address) as channel, asyncio.timeout(GUARD_S):
                assert not (await GrpcDrafter(channel, address).info()).takes_verified_trees
                stream = await GrpcDrafter(channel, address).open("s", PROMPT, "fp")
                assert not stream.takes_verified_trees
                await stream.close()
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_a_malformed_verified_tree_is_invalid_argument() -> None:
    tree = common_pb2.TokenTree(token_ids=[4, 5], parents=[1, ROOT])  # a child before its parent
    verified = drafter_pb2.DraftRequest(verified=drafter_pb2.VerifiedTree(tree=tree))
    refused = asyncio.run(first_refusal(propose([]), verified))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "verified: node 0 has parent 1" in (refused.details() or "")


class RecordingCall:
    def __init__(self) -> None:
        self.written: list[drafter_pb2.DraftRequest] = []

    async def write(self, request: drafter_pb2.DraftRequest) -> None:
        self.written.append(request)


@pytest.mark.parametrize(
    ("allowed", "problem"),
    [
        ([drafter_pb2.AllowedNext(node=1, token_ids=[7])], "allowed tokens after node 1, out of range [-1, 1)"),
        ([drafter_pb2.AllowedNext(node=0, token_ids=[1 << 20])], "outside the vocabulary"),
        ([drafter_pb2.AllowedNext(node=0, token_ids=[7])] * 2, "lists a node twice"),
    ],
)
def test_bad_allowed_tokens_are_refused(allowed: list[drafter_pb2.AllowedNext], problem: str) -> None:
    message = drafter_pb2.VerifiedTree(tree=common_pb2.TokenTree(token_ids=[4], parents=[ROOT]), allowed_next=allowed)
    with pytest.raises(ValueError, match=re.escape(problem)):
        verified_tree_from_proto(message, vocab_size=49152)


@pytest.mark.parametrize("takes", [False, True])
def test_a_drafter_that_does_not_take_verified_trees_is_not_sent_them(takes: bool) -> None:
    """A drafter from before them would refuse the message and end the stream (rolling upgrades)."""
    call = RecordingCall()
    stream = GrpcDraftStream(call, "drafter:1", wants_features=False, takes_verified_trees=takes)  # type: ignore[arg-type]
    asyncio.run(stream.verifying(VerifiedTree(FITTED.tree, FITTED.forced, {ROOT: (3, 9), 2: (6, 11)})))
    assert [r.verified.forced for r in call.written] == ([[False, True, True]] if takes else [])
    if takes:
        (sent,) = call.written
        assert verified_tree_from_proto(sent.verified, 16).allowed_next == {ROOT: (3, 9), 2: (6, 11)}
