"""Sparse features: the verifier returns the target's features only for the rounds the drafter wants them for.

Rounds that ask the drafter for no tree (no draft budget) ask for none, nor do rounds after a reply that wanted
none (the head's state freed), so they cost what plain decoding costs; the head restarts at the first position
that has features again. An older drafter, which does not say what it wants, gets every position's. Features
only steer drafts: the output is plain decoding's whatever is asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from transformers import DynamicCache

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.grpc_clients import GrpcDrafter, GrpcDraftStream
from coordinator.ports import DraftStream
from coordinator.rounds import Generation, GenerationRequest, RoundPolicy
from draft_service.draft_head import DraftHead, DraftHeadConfig
from draft_service.drafter import Drafter
from draft_service.head_proposer import UNFED_PAST_DEPTH, FeatureLog, HeadProposer, TreeShape
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.source_gate import GateHistory
from specserve.drain import Drain
from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifiedTree, VerifyResult
from specserve.token_tree import ROOT, TokenTree
from specserve.v1 import drafter_pb2, drafter_pb2_grpc
from specserve.verify_call import SessionPrefill, VerifyCall
from specserve.wire import draft_reply_from_proto, draft_reply_to_proto
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_greedy, run_generation, tiny_llama
from tests.unit.test_drain import Stream, drafter_server, propose

VOCAB = 48
HIDDEN = 64
MODEL = tiny_llama(vocab_size=VOCAB, seed=7, context=256)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GUARD_S = 30  # a guard only: every wait ends on an answer long before


# ---- the coordinator asks for features only where the drafter wants them ----


class RecordingVerifier(InProcessVerifier):
    """Records whether each call asked for features; Verify k's draft budget is ``budgets[k]`` (then unsaid)."""

    def __init__(self, budgets: Sequence[int | None] = ()) -> None:
        super().__init__(Verifier(MODEL, "fp"))
        self._budgets = list(budgets)
        self.prefill_asked: list[bool] = []
        self.verify_asked: list[bool] = []

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        self.prefill_asked.append(call.return_features)
        return await super().prefill(call)

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self.verify_asked.append(call.return_features)
        result = await super().verify(call)
        budget = self._budgets.pop(0) if self._budgets else None
        return dataclasses.replace(result, draft_budget_nodes=budget)


class WishingStream:
    """A head drafter's stream: empty trees, each reply wanting the round's features as ``wishes`` says (then
    not); records every report. ``sparse``: it says what it wants (else an older drafter, whose wishes go
    unread)."""

    wants_features = True
    takes_verified_trees = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, sparse: bool, wishes: Sequence[bool]) -> None:
        self.sparse_features = sparse
        self._wishes = list(wishes)
        self.reports: list[DraftFeedback] = []

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        self.reports.append(feedback)
        return DraftReply(TokenTree(), wants_features=self._wishes.pop(0) if self._wishes else False)

    async def verifying(self, verified: VerifiedTree) -> None:
        return None

    async def close(self) -> None:
        return None

    @property
    def rows(self) -> list[int | None]:
        """Feature rows per report (None: none)."""
        return [None if r.features is None else r.features.shape[0] for r in self.reports]


class OneStream:
    def __init__(self, stream: DraftStream) -> None:
        self.stream = stream

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> DraftStream:
        return self.stream


def generate(stream: WishingStream, verifier: RecordingVerifier, max_new_tokens: int) -> Any:
    generation = Generation(
        GenerationRequest(PROMPT, max_new_tokens),
        verifier,
        OneStream(stream),
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        # Rounds take turns, so Verify k's budget bounds round k + 1 exactly (sent ahead, a plain round's next
        # one is plain too and a budget that returns waits a round: tests/unit/test_verify_ahead.py).
        RoundPolicy(max_draft_tokens=6, verify_ahead=False),
    )
    tokens, _, stats = run_generation(generation)
    assert tokens == plain_greedy(MODEL, PROMPT, max_new_tokens), "features only steer drafts"
    assert not stats.drafter_error, "a round that asked for no features is no fault of the drafter's"
    return stats


def test_a_sparse_drafter_gets_the_features_of_the_rounds_it_wants_them_for_only() -> None:
    wishes = [True, False, True, True, False, False, True]
    stream, verifier = WishingStream(sparse=True, wishes=wishes), RecordingVerifier()
    stats = generate(stream, verifier, len(wishes) + 1)  # one round a token: the trees are empty
    assert verifier.prefill_asked == [True], "the prompt's always come: a head that drafts needs its context"
    assert verifier.verify_asked == [*wishes, False], "the last round (one token left) asks the drafter for no tree"
    assert stats.num_feature_rounds == sum(wishes)
    # Each report carries the round before it's one row where that round asked; the final report none (the last
    # round asked for none: a gap after the rows queued before it).
    assert stream.rows == [len(PROMPT) - 1, *(1 if wish else None for wish in wishes[:-1]), None]


def test_rounds_without_a_draft_budget_ask_for_no_features_and_drop_the_rows_queued_before_them() -> None:
    stream = WishingStream(sparse=True, wishes=[True] * 8)
    verifier = RecordingVerifier(budgets=[8, 0, 0])  # Verify k's budget bounds round k + 1: rounds 3 and 4 get none
    stats = generate(stream, verifier, 7)
    assert stats.num_rounds_budget_off == 2
    assert verifier.prefill_asked == [True]
    assert verifier.verify_asked == [True, True, False, False, True, True, False]
    assert stats.num_feature_rounds == 4
    # Round 2's row waited for a report that rounds 3 and 4 did not send, and went at their gap.
    assert [len(r.new_tokens) for r in stream.reports] == [0, 1, 3, 1, 2]
    assert stream.rows == [len(PROMPT) - 1, 1, None, 1, None]


def test_an_older_drafter_gets_every_positions_features_in_every_round() -> None:
    stream = WishingStream(sparse=False, wishes=[False] * 8)  # it says nothing: its wishes go unread
    verifier = RecordingVerifier(budgets=[8, 0, 0])
    stats = generate(stream, verifier, 7)
    assert verifier.prefill_asked == [True] and verifier.verify_asked == [True] * 7
    assert stats.num_feature_rounds == 7
    assert stream.rows == [len(PROMPT) - 1, 1, 3, 1, 2], "one row per position since the report before"


# ---- on the wire ----


class RecordingCall:
    """A Draft stream's client end that records what is written; nothing is ever read from it here."""

    def __init__(self) -> None:
        self.written: list[drafter_pb2.DraftRequest] = []

    async def write(self, request: drafter_pb2.DraftRequest) -> None:
        self.written.append(request)

    async def read(self) -> drafter_pb2.DraftResponse:
        raise AssertionError("the start gets no answer: opening never waits for the drafter")


@pytest.mark.parametrize("wants_features", [True, False])
def test_a_stream_is_sparse_where_the_drafter_takes_features_and_its_start_waits_for_nothing(
    wants_features: bool,
) -> None:
    call = RecordingCall()
    stream = GrpcDraftStream(call, "test", wants_features, sparse_features=True)  # type: ignore[arg-type]
    asyncio.run(stream.start("s", PROMPT, "fp"))
    assert [request.WhichOneof("action") for request in call.written] == ["start"]
    # A drafter that drafts from no features has nothing to say: its stream goes on as before.
    assert stream.sparse_features == wants_features


def test_the_reply_says_whether_it_wants_the_rounds_features_on_the_wire() -> None:
    for wants in (False, True):
        reply = DraftReply(TokenTree.chain([4, 2]), draft_ns=5, wants_features=wants)
        assert draft_reply_from_proto(draft_reply_to_proto(reply)) == reply


def tiny_head(seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    config = DraftHeadConfig.for_target(MODEL.config, draft_vocab_size=40, intermediate_size=96)
    embedding = MODEL.get_input_embeddings().weight.detach()
    lm_head = MODEL.get_output_embeddings().weight.detach()
    return DraftHead(config, embedding, lm_head, torch.arange(40)).eval()


def head_drafter(history: GateHistory | None = None) -> Drafter:
    head = tiny_head()
    head.target_fingerprint = "fp"
    drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=("prompt_lookup", "draft_model"), draft_head=head)
    if history is not None:
        drafter.gate_history = history
    return drafter


def test_over_grpc_a_head_drafter_takes_features_sparsely_and_says_which_it_wants() -> None:
    async def scenario() -> None:
        server, address = await drafter_server(Drain(), drafter=head_drafter())
        try:
            async with grpc.aio.insecure_channel(address) as channel, asyncio.timeout(GUARD_S):
                info = await GrpcDrafter(channel, address).info()
                assert info.wants_features and info.sparse_features
                stream = await GrpcDrafter(channel, address).open("s", PROMPT, "fp")
                assert stream.sparse_features
                reply = await stream.propose(DraftFeedback(), 4)
                assert reply.wants_features
                await stream.close()
                # A stream written by hand: the start gets no answer, the propose one.
                old = Stream(drafter_pb2_grpc.DrafterServiceStub(channel))
                await old.send(
                    drafter_pb2.DraftRequest(
                        start=drafter_pb2.StartSession(
                            session_id="old", prompt_token_ids=PROMPT, vocab_fingerprint="fp"
                        )
                    )
                )
                await old.send(propose([7]))
                await old.close()
                answers = [response async for response in old.call]
                assert len(answers) == 1 and answers[0].draft_ns > 0, "the propose's answer only"
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def sitting_out_history() -> GateHistory:
    """A drafter's record of a head that never paid: new sessions start with it sitting out."""
    history = GateHistory()
    history.figures.gain.add(0.0)
    history.figures.cost_s.add(0.010)
    history.figures.round(0.010, 2)
    history.timed_runs = GateHistory.MIN_TIMED_RUNS
    return history


def test_a_session_wants_features_while_its_head_keeps_its_state_sitting_out_or_not() -> None:
    """A head that sits out (``SourceGate``) still takes every round's features, fed when it next runs: a probe
    from one round's features after a gap drafts from too little context to be judged fairly. Freed, it wants
    none."""
    sitting = head_drafter(sitting_out_history()).open_session("a", PROMPT, "fp")
    assert sitting.wants_features_next and sitting.propose(DraftFeedback(), 4).wants_features
    assert sitting._gate.sitting_out
    warming = head_drafter().open_session("b", PROMPT, "fp")
    assert warming.wants_features_next and warming.propose(DraftFeedback(), 4).wants_features
    warming.forget()  # its head's state freed to bound the drafter's memory: it drafts no more
    assert not warming.wants_features_next and not warming.propose(DraftFeedback(), 4).wants_features


def test_in_one_process_rounds_without_a_budget_ask_no_features_and_drafted_rounds_ask_again() -> None:
    """The tiny target and a random head over the in-process ports: the rounds the verifier's budget keeps plain
    ask for no features, the drafter wants them again once rounds draft, and the output is plain decoding's."""
    budgets = [6, 6, 0, 0, 0, 0]  # Verify k's budget bounds round k + 1: rounds 4 to 7 get none
    verifier = RecordingVerifier(budgets=budgets)
    drafter = head_drafter()
    generation = Generation(
        GenerationRequest(PROMPT, 24),
        verifier,
        InProcessDrafter(drafter, vocab_size=VOCAB),
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=6, verify_ahead=False),  # rounds in turn: the budgets bound rounds exactly
    )
    tokens, _, stats = run_generation(generation)
    assert tokens == plain_greedy(MODEL, PROMPT, 24)
    assert not stats.drafter_error and stats.num_rounds_budget_off == 4
    assert verifier.prefill_asked == [True]
    assert verifier.verify_asked[:7] == [True, True, True, False, False, False, False]
    assert all(verifier.verify_asked[7:-1]), "the head wants them again once rounds draft"
    assert stats.num_feature_rounds == sum(verifier.verify_asked)


# ---- the draft head restarts after a gap ----

SHAPE = TreeShape(depth=2, branching=3, beam=2, max_nodes=8)


def features_of(tokens: list[int]) -> np.ndarray:
    """The target's features at every position of ``tokens``, as the verifier returns them (float16)."""
    with torch.inference_mode():
        hidden = MODEL(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    return hidden.numpy().astype(np.float16)


TOKENS = [(5 * i) % (VOCAB - 1) + 1 for i in range(20)]
FEATURES = features_of(TOKENS)


def test_a_feature_log_holds_one_run_and_starts_a_new_one_after_a_gap() -> None:
    log = FeatureLog()
    rows = np.arange(20, dtype=np.float16).reshape(10, 2)
    assert not log.extend(rows[:3], start=0) and not log.extend(rows[3:5])  # continues: positions 3 and 4
    assert not log.extend(rows[5:6], start=5)
    assert (log.start, log.end, log.count) == (0, 6, 6)
    assert log.since(4).tolist() == rows[4:6].tolist()
    assert log.extend(rows[8:10], start=8), "positions 6 and 7 have no feature: a new run"
    assert (log.start, log.end, log.count) == (8, 10, 2)
    assert log.since(8).tolist() == rows[8:10].tolist()
    assert log.extend(rows[2:3], start=2) and (log.start, log.end) == (2, 3), "a run that goes back starts anew"


class StepPositions:
    """Records the positions of every head step (the head's rotary embedding reads them)."""

    def __init__(self, head: DraftHead, monkeypatch: pytest.MonkeyPatch) -> None:
        self.positions: list[int] = []
        step = head.step

        def recording(
            features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *args: Any, **kw: Any
        ) -> Any:
            self.positions.extend(positions.tolist())
            return step(features, tokens, positions, *args, **kw)

        monkeypatch.setattr(head, "step", recording)


def test_features_after_a_gap_restart_the_head_at_their_own_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    head = tiny_head()
    proposer = HeadProposer(head, SHAPE)
    proposer.observe(DraftFeedback(features=FEATURES[:8], features_start=0))
    assert len(proposer.propose(TOKENS[:9], 8)) > 0
    # Positions 8 to 13 came without features (rounds that asked none); then positions 14 to 18 with theirs.
    proposer.observe(DraftFeedback(features=FEATURES[14:19], features_start=14))
    assert (proposer.features.start, proposer.features.end) == (14, 19)
    steps = StepPositions(head, monkeypatch)
    tree = proposer.propose(TOKENS, 8)
    assert len(tree) > 0
    # The run's positions, then the tree's first level (a depth-2 tree: one level forward).
    assert steps.positions[:5] == [14, 15, 16, 17, 18] and set(steps.positions[5:]) == {19}
    assert proposer._cache.get_seq_length() == 5, "nothing from before the gap stays in the cache"
    # What a head that only ever saw this run drafts, and what the head gives by hand at those positions.
    fresh = HeadProposer(head, SHAPE)
    fresh.observe(DraftFeedback(features=FEATURES[14:19], features_start=14))
    assert fresh.propose(TOKENS, 8) == tree
    draft_index = {token: i for i, token in enumerate(head.draft_vocab.tolist())}
    with torch.inference_mode():
        cache = DynamicCache()
        context = head(
            torch.from_numpy(FEATURES[14:19].astype(np.float32))[None],
            torch.tensor([TOKENS[15:20]]),
            position_ids=torch.arange(14, 19)[None],
            past_key_values=cache,
        )
        q = torch.softmax(context.logits[0, -1], dim=-1)
        for node in (n for n, parent in enumerate(tree.parents) if parent == ROOT):
            assert float(q[draft_index[tree.token_ids[node]]]) == pytest.approx(tree.node_probs[node], rel=1e-4)
        node = next(n for n, parent in enumerate(tree.parents) if parent != ROOT)
        step = head(
            context.features[:, -1:],
            torch.tensor([[tree.token_ids[tree.parents[node]]]]),
            position_ids=torch.tensor([[19]]),
            past_key_values=cache,
        )
        q = torch.softmax(step.logits[0, -1], dim=-1)
    assert float(q[draft_index[tree.token_ids[node]]]) == pytest.approx(tree.node_probs[node], rel=1e-3)


def test_a_long_run_without_features_offers_no_tree_and_runs_no_head_step(monkeypatch: pytest.MonkeyPatch) -> None:
    head = tiny_head()
    proposer = HeadProposer(head, SHAPE)
    proposer.observe(DraftFeedback(features=FEATURES[:8], features_start=0))  # positions 0 to 7: tokens 0 to 8
    longest = 9 + SHAPE.depth + UNFED_PAST_DEPTH  # a pre-draft's outcome, forced tokens, a round without features
    assert len(proposer.propose(TOKENS[:longest], 8)) > 0
    steps = StepPositions(head, monkeypatch)
    assert len(proposer.propose(TOKENS[: longest + 1], 8)) == 0, "it waits for the target's features"
    assert steps.positions == []
    proposer.observe(DraftFeedback(features=FEATURES[8:longest], features_start=8))  # they come: it drafts again
    assert len(proposer.propose(TOKENS[: longest + 1], 8)) > 0


def test_the_session_places_each_reports_rows_before_its_newest_token() -> None:
    session = head_drafter().open_session("s", PROMPT, "fp")
    (head,) = (p for p in session._proposers if isinstance(p, HeadProposer))
    prompt_rows = features_of(PROMPT)[:-1]
    session.propose(DraftFeedback((), (), prompt_rows), 0)
    assert (head.features.start, head.features.end) == (0, len(PROMPT) - 1)
    session.propose(DraftFeedback((7, 8, 9), (), prompt_rows[:1]), 0)  # the last round's one row: a gap before it
    assert (head.features.start, head.features.end) == (len(PROMPT) + 1, len(PROMPT) + 2)
    session.propose(DraftFeedback((10, 11), (), prompt_rows[:2]), 0)  # continues the run
    assert (head.features.start, head.features.end) == (len(PROMPT) + 1, len(PROMPT) + 4)
