"""Plain rounds sent ahead (``Generation._send_ahead``): the verifier steps a session back to back, and what is
committed never changes, whatever ends the request or fails under it (tiny random model, the in-process engine)."""

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Sequence

import pytest

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator import rounds
from coordinator.drafting_gate import DraftingGate
from coordinator.ports import VerifierInfo, VerifierPort
from coordinator.rounds import FinishReason, Generation, GenerationRequest, GenerationStats, RoundPolicy, TextChunk
from coordinator.speculation import Speculation, SpeculationMode
from coordinator.verifier_router import StickyVerifierRouter
from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool
from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifiedTree, VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from specserve.verify_call import SessionPrefill, VerifyCall
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_greedy, run_generation
from tests.unit.test_rounds import MODEL, VOCAB, MortalReplica
from tests.unit.test_sparse_features import OneStream, WishingStream

OFF = Speculation(SpeculationMode.OFF)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class InFlight:
    """A verifier port over the in-process engine (or ``replica``, one over it), recording what each Verify says
    the session holds and the most calls in flight at once."""

    def __init__(self, keeps_order: bool = True, replica: MortalReplica | None = None) -> None:
        self.engine = Verifier(MODEL, "fp") if replica is None else replica.engine
        self._inner = InProcessVerifier(self.engine) if replica is None else replica
        self._keeps_order = keeps_order
        self.counts: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0

    @property
    def keeps_order(self) -> bool:
        return self._keeps_order

    async def info(self) -> VerifierInfo:
        return await self._inner.info()

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        return await self._inner.prefill(call)

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self.counts.append(call.num_committed)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._inner.verify(call)
        finally:
            self.in_flight -= 1

    async def release(self, session_id: str) -> None:
        await self._inner.release(session_id)


def plain(
    verifier: VerifierPort,
    max_new_tokens: int = 40,
    *,
    eos: int = -1,
    stop: tuple[str, ...] = (),
    sampling: SamplingParams = SamplingParams(),
    ahead: bool = True,
) -> Generation:
    """A request with speculation off: every round is plain, so each can go ahead of the previous one's answer."""
    return Generation(
        GenerationRequest(PROMPT, max_new_tokens, sampling, stop, OFF),
        verifier,
        None,
        CharTokenizer(),
        frozenset({eos}),
        "fp",
        RoundPolicy(max_draft_tokens=6, verify_ahead=ahead),
    )


def drafting(
    verifier: VerifierPort, drafter: object, max_new_tokens: int, prompt: list[int] = PROMPT, gate: bool = False
) -> GenerationStats:
    """Run a request with speculation on (``gate``: the drafting gate too); its tokens must be plain decoding's."""
    generation = Generation(
        GenerationRequest(prompt, max_new_tokens),
        verifier,
        drafter,  # type: ignore[arg-type]
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=4, gate_drafting=gate),
    )
    tokens, _, stats = run_generation(generation)
    assert tokens == plain_greedy(MODEL, prompt, max_new_tokens)
    return stats


def test_plain_rounds_go_one_ahead_and_commit_what_plain_decoding_does() -> None:
    verifier = InFlight()
    tokens, _, stats = run_generation(plain(verifier, 40))
    assert tokens == plain_greedy(MODEL, PROMPT, 40)
    assert verifier.most_in_flight == 2  # each round's Verify was sent while the previous one's was out
    # One call per round, each on the session the previous one left, none past the request's length.
    assert verifier.counts == list(range(len(PROMPT), len(PROMPT) + 40))
    assert stats.num_rounds == 40
    assert (stats.num_rounds_sent_ahead, stats.num_ahead_withdrawn) == (39, 0)  # all but the first; none past the end
    assert verifier.engine.num_active_sessions == 0


@pytest.mark.parametrize("ahead, keeps_order", [(False, True), (True, False)])
def test_without_the_policy_or_an_ordered_port_rounds_take_turns(ahead: bool, keeps_order: bool) -> None:
    verifier = InFlight(keeps_order)
    tokens, _, _ = run_generation(plain(verifier, 20, ahead=ahead))
    assert tokens == plain_greedy(MODEL, PROMPT, 20)
    assert verifier.most_in_flight == 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_no_call_goes_past_the_requests_length(max_new_tokens: int) -> None:
    verifier = InFlight()
    tokens, _, stats = run_generation(plain(verifier, max_new_tokens))
    assert tokens == plain_greedy(MODEL, PROMPT, max_new_tokens)
    assert verifier.counts == list(range(len(PROMPT), len(PROMPT) + max_new_tokens))
    assert stats.finish_reason is FinishReason.LENGTH


def test_eos_ends_the_request_and_the_call_sent_past_it_is_withdrawn() -> None:
    reference = plain_greedy(MODEL, PROMPT, 30)
    eos = reference[12]
    verifier = InFlight()
    tokens, _, stats = run_generation(plain(verifier, 30, eos=eos))
    assert tokens == reference[: reference.index(eos)]
    assert stats.finish_reason is FinishReason.EOS
    assert max(verifier.counts) == len(PROMPT) + reference.index(eos) + 1  # one call past EOS was sent...
    assert stats.num_ahead_withdrawn == 1
    assert verifier.engine.num_active_sessions == 0  # ...and nothing of it outlives the request


def test_a_stop_string_cuts_the_text_with_calls_sent_ahead() -> None:
    reference = CharTokenizer().decode(plain_greedy(MODEL, PROMPT, 30))
    stop = reference[10:12]
    verifier = InFlight()
    _, text, stats = run_generation(plain(verifier, 30, stop=(stop,)))
    assert text == reference[: reference.index(stop)]
    assert stats.finish_reason is FinishReason.STOP
    assert verifier.engine.num_active_sessions == 0


def test_seeded_sampling_gives_the_same_text_ahead_and_in_turn() -> None:
    sampling = SamplingParams(temperature=0.9, top_k=8, seed=11)
    ahead, _, _ = run_generation(plain(InFlight(), 40, sampling=sampling))
    in_turn, _, _ = run_generation(plain(InFlight(), 40, sampling=sampling, ahead=False))
    assert ahead == in_turn


class Forgetful(InFlight):
    """Loses the session as every ``every``-th Verify starts, while the call before it may still be out."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self._every = every

    async def verify(self, call: VerifyCall) -> VerifyResult:
        if len(self.counts) % self._every == self._every - 1:
            self.engine.release(call.session_id)
        return await super().verify(call)


def test_a_lost_session_is_rebuilt_without_losing_or_repeating_a_token() -> None:
    verifier = Forgetful(every=5)
    tokens, _, stats = run_generation(plain(verifier, 40))
    assert tokens == plain_greedy(MODEL, PROMPT, 40)
    assert stats.num_reprefills >= 4
    assert verifier.engine.num_active_sessions == 0


@pytest.mark.parametrize("dies_after", [0, 1, 7])
def test_a_replica_dying_under_calls_sent_ahead_moves_the_session_unchanged(dies_after: int) -> None:
    replicas = {"a:1": InFlight(replica=MortalReplica(dies_after)), "b:1": InFlight(replica=MortalReplica(10**6))}
    router = StickyVerifierRouter(lambda: list(replicas), replicas.__getitem__)  # "a:1" gets the first session
    assert router.keeps_order
    tokens, _, stats = run_generation(plain(router, 30))
    assert tokens == plain_greedy(MODEL, PROMPT, 30)
    assert stats.num_reprefills >= 1
    assert replicas["b:1"].most_in_flight == 2  # where it moved to, rounds go ahead again
    assert replicas["b:1"].engine.num_active_sessions == 0


def test_a_client_that_hangs_up_leaves_no_session_and_no_call_behind() -> None:
    verifier = InFlight()

    async def scenario() -> int:
        chunks = 0
        async with contextlib.aclosing(plain(verifier, 60).stream()) as events:
            async for event in events:
                chunks += isinstance(event, TextChunk)
                if chunks == 5:
                    break
        return chunks

    assert asyncio.run(scenario()) == 5
    assert verifier.in_flight == 0
    assert verifier.engine.num_active_sessions == 0


class PlainStretchGate(DraftingGate):
    """A gate whose session has found that drafting does not pay: a long plain stretch, then a probe."""

    PROBE_AFTER = 12

    def __init__(self) -> None:
        super().__init__()
        self.drafting = False


def test_a_gated_sessions_plain_stretch_goes_ahead_and_its_probe_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds, "DraftingGate", PlainStretchGate)
    pool = InMemoryNgramPool()
    verifier = InFlight()
    prompt = [1, 2, 3, 4] * 4
    stats = drafting(verifier, InProcessDrafter(Drafter(lambda fingerprint, namespace: pool)), 40, prompt, gate=True)
    assert verifier.most_in_flight == 2
    assert stats.num_drafter_trees >= 1  # the probe asked the drafter, after the stretch
    assert verifier.engine.num_active_sessions == 0


class EveryOtherTree:
    """A draft stream whose trees are empty and one token long in turn: a probe's round that asked for a tree and
    got none is plain, and the probe's next round drafts."""

    wants_features = False
    sparse_features = False
    takes_verified_trees = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.asked = 0

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        if max_nodes == 0:
            return DraftReply(TokenTree())
        self.asked += 1
        return DraftReply(TokenTree.chain([self.asked % VOCAB]) if self.asked % 2 == 0 else TokenTree())

    async def verifying(self, verified: VerifiedTree) -> None:
        pass

    async def close(self) -> None:
        pass


class EveryOtherTreeDrafter:
    def __init__(self) -> None:
        self.stream = EveryOtherTree()

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> EveryOtherTree:
        return self.stream


def test_a_probe_round_that_got_no_tree_sends_nothing_ahead_of_the_probes_next(monkeypatch: pytest.MonkeyPatch) -> None:
    # A round that asked the drafter counts as drafted, even with an empty tree: the probe goes on, and the round
    # after it asks for a tree again. Sent ahead, a plain Verify would have stepped the session past what that
    # round verifies: its call would then fail and the session be prefilled again.
    monkeypatch.setattr(rounds, "DraftingGate", PlainStretchGate)
    verifier = InFlight()
    drafter = EveryOtherTreeDrafter()
    stats = drafting(verifier, drafter, 60, gate=True)
    assert drafter.stream.asked >= 4  # a whole probe ran
    assert verifier.most_in_flight == 2  # the plain stretches went ahead
    assert stats.num_reprefills == 0


class BudgetOffFor(InFlight):
    """Answers that leave the session no draft budget for its first ``calls`` Verifies, the engine's own after."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self._calls = calls

    async def verify(self, call: VerifyCall) -> VerifyResult:
        result = await super().verify(call)
        return dataclasses.replace(result, draft_budget_nodes=0) if len(self.counts) <= self._calls else result


def test_rounds_the_verifiers_budget_keeps_plain_go_ahead_and_a_budget_that_returns_waits_a_round() -> None:
    verifier = BudgetOffFor(20)
    drafter = EveryOtherTreeDrafter()
    stats = drafting(verifier, drafter, 50)  # no gate: the verifier's budget alone decides
    assert verifier.most_in_flight == 2
    assert stats.num_reprefills == 0
    # The first round asks (no budget is known yet); then none until the budget is back, a round after the answer
    # that brought it (the round sent ahead meanwhile is plain).
    assert drafter.stream.asked >= 2 and stats.num_rounds_budget_off >= 10


def test_rounds_sent_ahead_ask_for_the_features_an_older_drafter_takes_at_every_position() -> None:
    stream = WishingStream(sparse=False, wishes=[])  # an older drafter: every position's features, every round
    verifier = BudgetOffFor(10**6)  # no budget ever: every round after the first is plain, sent ahead
    stats = drafting(verifier, OneStream(stream), 12)
    assert verifier.most_in_flight == 2 and stats.num_feature_rounds == 12 and not stats.drafter_error
    assert stream.rows == [len(PROMPT) - 1, 12], "the final report: a row for each of the 12 positions since"


class FeatureRecorder(BudgetOffFor):
    def __init__(self, calls: int) -> None:
        super().__init__(calls)
        self.asked: list[bool] = []

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self.asked.append(call.return_features)
        return await super().verify(call)


def test_a_round_sent_ahead_asks_a_sparse_drafter_for_no_features_whatever_the_last_reply_wished() -> None:
    stream = WishingStream(sparse=True, wishes=[True] * 20)  # every reply wants its round's features
    verifier = FeatureRecorder(10**6)  # no budget after the first round: the rest is plain, sent ahead
    stats = drafting(verifier, OneStream(stream), 10)
    assert verifier.asked == [True] + [False] * 9  # the first round's reply wished; the rounds after asked none
    assert stats.num_feature_rounds == 1 and not stats.drafter_error


def test_stays_plain_never_promises_a_plain_round_the_gate_would_draft() -> None:
    rng = random.Random(5)
    gate = DraftingGate()
    promised = 0
    for _ in range(3000):
        drafted = gate.drafts()
        if not drafted and gate.stays_plain():
            gate.observe(False, 1, rng.uniform(0.005, 0.02))
            assert not gate.drafts()
            promised += 1
            continue
        # Drafted rounds that mostly do not pay, now and then do: verdicts, probes and refreshes all happen.
        tokens = rng.choice((1, 1, 2, 4)) if drafted else 1
        gate.observe(drafted, tokens, rng.uniform(0.01, 0.04) if drafted else rng.uniform(0.005, 0.02))
    assert promised > 1000  # the gate did go plain, and its promises were tested
