"""The round loop in one process (tiny random model): lossless whatever the drafter does."""

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Sequence

import pytest

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator import deadlines
from coordinator.deadlines import deadline_scope
from coordinator.ports import DraftStream
from coordinator.rounds import FinishReason, Generation, GenerationRequest, RoundPolicy
from coordinator.speculation import Speculation, SpeculationMode
from coordinator.verifier_router import StickyVerifierRouter
from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool
from specserve.errors import DeadlineExceeded, DrafterFailed, ReplicaUnreachable
from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from specserve.verify_call import SessionPrefill, VerifyCall
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_greedy, run_generation, tiny_llama

VOCAB = 16  # small, so the random model repeats itself and lookups hit
MODEL = tiny_llama(vocab_size=VOCAB)


def drafter() -> InProcessDrafter:
    pool = InMemoryNgramPool()
    return InProcessDrafter(Drafter(lambda fingerprint, namespace: pool))


run = run_generation


def generation(request: GenerationRequest, verifier: object = None, draft: object = None, eos: int = -1) -> Generation:
    return Generation(
        request,
        verifier or InProcessVerifier(Verifier(MODEL, "fp")),  # type: ignore[arg-type]
        draft if draft is not None else drafter(),  # type: ignore[arg-type]
        CharTokenizer(),
        frozenset({eos}),
        "fp",
        RoundPolicy(max_draft_tokens=6),
    )


def test_greedy_output_is_token_identical_to_plain_decoding() -> None:
    rng = random.Random(0)
    draft_tokens = 0
    for _ in range(25):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        tokens, text, stats = run(generation(GenerationRequest(prompt, 48)))
        assert tokens == plain_greedy(MODEL, prompt, 48)
        assert text == CharTokenizer().decode(tokens)
        assert stats.num_generated_tokens == 48
        assert stats.num_rounds == 48 - stats.num_accepted_tokens
        draft_tokens += stats.num_draft_tokens
    assert draft_tokens > 0  # the drafter did propose: identity is not vacuous


class FailingAfter:
    """A draft stream that works for ``rounds`` proposals, then fails like a killed drafter."""

    def __init__(self, inner: DraftStream, rounds: int) -> None:
        self._inner = inner
        self._rounds = rounds
        self.wants_features = inner.wants_features

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        if self._rounds == 0:
            raise DrafterFailed("drafter at 127.0.0.1:1 failed: UNAVAILABLE: connection reset")
        self._rounds -= 1
        return await self._inner.propose(feedback, max_nodes)

    async def close(self) -> None:
        await self._inner.close()


class FlakyDrafter:
    def __init__(self, rounds: int) -> None:
        self._inner = drafter()
        self._rounds = rounds

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> DraftStream:
        return FailingAfter(await self._inner.open(session_id, prompt_tokens, vocab_fingerprint), self._rounds)


def test_drafter_failing_mid_request_keeps_the_output_identical() -> None:
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    tokens, _, stats = run(generation(GenerationRequest(prompt, 40), draft=FlakyDrafter(rounds=3)))
    assert tokens == plain_greedy(MODEL, prompt, 40)
    assert "connection reset" in stats.drafter_error
    assert stats.num_rounds_without_drafter > 0


def test_a_request_that_got_no_drafter_tree_says_why() -> None:
    """The first round asks the drafter it opened; a drafter that fails there leaves no tree and its reason
    (what the bench's pinned smoke test relies on when a busy machine makes the drafter miss its deadline)."""
    tokens, _, stats = run(generation(GenerationRequest([1, 2, 3, 1, 2, 3], 8), draft=FlakyDrafter(rounds=0)))
    assert tokens == plain_greedy(MODEL, [1, 2, 3, 1, 2, 3], 8)
    assert stats.num_drafter_trees == 0 and stats.num_draft_tokens == 0
    assert stats.num_rounds_without_drafter == stats.num_rounds > 0
    assert stats.drafter_error


def test_without_a_drafter_every_round_is_plain_decoding() -> None:
    prompt = [4, 5, 6]
    g = generation(GenerationRequest(prompt, 10))
    g.drafter = None
    tokens, _, stats = run(g)
    assert tokens == plain_greedy(MODEL, prompt, 10)
    assert (stats.num_rounds, stats.num_rounds_without_drafter, stats.num_draft_tokens) == (10, 10, 0)


class CountingDrafter:
    """The in-process drafter, counting the draft sessions opened on it."""

    def __init__(self) -> None:
        self._inner = drafter()
        self.opened = 0

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> DraftStream:
        self.opened += 1
        return await self._inner.open(session_id, prompt_tokens, vocab_fingerprint)


def test_speculation_off_decodes_plainly_without_opening_the_drafter() -> None:
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    counting = CountingDrafter()
    off = GenerationRequest(prompt, 30, speculation=Speculation(SpeculationMode.OFF))
    tokens, _, stats = run(generation(off, draft=counting))
    assert tokens == plain_greedy(MODEL, prompt, 30)
    assert counting.opened == 0
    assert (stats.num_rounds, stats.num_drafts, stats.num_draft_tokens) == (30, 0, 0)
    assert (stats.speculation, stats.max_draft_tokens, stats.drafter_error) == (SpeculationMode.OFF, 0, "")
    assert stats.num_rounds_without_drafter == 0  # no drafter was missing: none was wanted


class TreeSizeRecorder(InProcessVerifier):
    """Records the size of every tree it verifies."""

    def __init__(self) -> None:
        super().__init__(Verifier(MODEL, "fp"))
        self.tree_sizes: list[int] = []

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self.tree_sizes.append(len(call.tree))
        return await super().verify(call)


@pytest.mark.parametrize("cap", [3, 4])  # below 3 nodes the drafter finds no tree worth its cost on this model
def test_a_cap_bounds_the_draft_tokens_of_every_round(cap: int) -> None:
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    recorder = TreeSizeRecorder()
    capped = GenerationRequest(prompt, 30, speculation=Speculation(max_draft_tokens=cap))
    tokens, _, stats = run(generation(capped, verifier=recorder))
    assert tokens == plain_greedy(MODEL, prompt, 30)
    assert stats.max_draft_tokens == cap
    assert stats.num_drafts > 0
    assert max(recorder.tree_sizes) <= cap
    assert stats.num_drafts == sum(size > 0 for size in recorder.tree_sizes)
    assert len(stats.num_accepted_tokens_per_pos) <= cap


class DraftWaitRecorder(InProcessVerifier):
    """Records each verify's tree size and the drafting time the round loop sent with it."""

    def __init__(self) -> None:
        super().__init__(Verifier(MODEL, "fp"))
        self.calls: list[tuple[int, int]] = []

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self.calls.append((len(call.tree), call.draft_ns))
        return await super().verify(call)


def test_a_drafted_round_tells_the_verifier_how_long_its_tree_took() -> None:
    recorder = DraftWaitRecorder()
    tokens, _, stats = run(generation(GenerationRequest([1, 2, 3, 1, 2, 3, 1, 2], 30), verifier=recorder))
    assert tokens == plain_greedy(MODEL, [1, 2, 3, 1, 2, 3, 1, 2], 30)
    drafted = [wait for size, wait in recorder.calls if size]
    assert drafted and all(wait > 0 for wait in drafted)  # every tree comes with its drafting time
    assert all(wait == 0 for size, wait in recorder.calls if not size)  # a round without a tree sends none
    assert sum(drafted) <= stats.draft_ns  # the same clock as the request's own drafting time


class ProbingStream:
    """A draft stream whose every other tree says all its drafting was a probe of a source (``probe_ns``)."""

    def __init__(self, inner: DraftStream) -> None:
        self._inner = inner
        self.wants_features = inner.wants_features
        self.probed: list[bool] = []  # per tree sent, whether its reply said probe

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        reply = await self._inner.propose(feedback, max_nodes)
        probe = len(self.probed) % 2 == 0
        if len(reply.tree):
            self.probed.append(probe)
        return dataclasses.replace(reply, probe_ns=10**12 if probe else 0)

    async def close(self) -> None:
        await self._inner.close()


class ProbingDrafter:
    def __init__(self) -> None:
        self._inner = drafter()
        self.streams: list[ProbingStream] = []

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> DraftStream:
        self.streams.append(ProbingStream(await self._inner.open(session_id, prompt_tokens, vocab_fingerprint)))
        return self.streams[-1]


def test_the_wait_sent_for_the_draft_budget_leaves_out_the_drafters_probes() -> None:
    recorder, probing = DraftWaitRecorder(), ProbingDrafter()
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    tokens, _, stats = run(generation(GenerationRequest(prompt, 30), verifier=recorder, draft=probing))
    assert tokens == plain_greedy(MODEL, prompt, 30)
    sent = [wait for size, wait in recorder.calls if size]
    probed = probing.streams[0].probed
    assert len(sent) == len(probed) >= 2
    assert all((wait == 0) == probe for wait, probe in zip(sent, probed, strict=True))
    assert stats.draft_ns >= sum(sent) and stats.draft_ns > 0, "the request's own drafting time keeps the probes"


def test_a_cap_above_the_servers_limit_is_the_servers_limit() -> None:
    capped = GenerationRequest([1, 2, 3], 4, speculation=Speculation(max_draft_tokens=100))
    _, _, stats = run(generation(capped))
    assert stats.max_draft_tokens == 6  # RoundPolicy(max_draft_tokens=6)


def test_auto_reports_the_servers_limit_and_acceptance_by_position() -> None:
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    _, _, stats = run(generation(GenerationRequest(prompt, 40)))
    per_pos = stats.num_accepted_tokens_per_pos
    assert (stats.speculation, stats.max_draft_tokens) == (SpeculationMode.AUTO, 6)
    assert sum(per_pos) == stats.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # reaching depth 2 means having reached depth 1
    assert per_pos[0] <= stats.num_drafts <= stats.num_rounds


class ForgetfulVerifier(InProcessVerifier):
    """Loses the session every few verifies, as eviction or a restart would."""

    def __init__(self, verifier: Verifier, every: int) -> None:
        super().__init__(verifier)
        self._verifier_ref = verifier
        self._every = every
        self._calls = 0

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self._calls += 1
        if self._calls % self._every == 0:
            self._verifier_ref.release(call.session_id)
        return await super().verify(call)


def test_lost_verifier_session_is_rebuilt_without_losing_or_repeating_tokens() -> None:
    prompt = [7, 8, 9, 7, 8]
    verifier = ForgetfulVerifier(Verifier(MODEL, "fp"), every=3)
    tokens, _, stats = run(generation(GenerationRequest(prompt, 40), verifier=verifier))
    assert tokens == plain_greedy(MODEL, prompt, 40)
    assert stats.num_reprefills >= 3


class TimedVerifier(ForgetfulVerifier):
    """Reports 1,000 ns for every prefill and 10 ns for every verify (a verifier's own clock, injected)."""

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        result = await super().prefill(call)
        return dataclasses.replace(result, prefill_ns=1_000)

    async def verify(self, call: VerifyCall) -> VerifyResult:
        result = await super().verify(call)
        return dataclasses.replace(result, verify_ns=10)


def test_prefill_time_is_reported_apart_within_the_verifiers_time_reprefills_included() -> None:
    verifier = TimedVerifier(Verifier(MODEL, "fp"), every=4)
    _, _, stats = run(generation(GenerationRequest([7, 8, 9, 7, 8], 30), verifier=verifier))
    prefills = 1 + stats.num_reprefills
    assert stats.num_reprefills >= 2
    assert stats.prefill_ns == 1_000 * prefills
    assert stats.verify_ns == stats.prefill_ns + 10 * stats.num_rounds


class MortalReplica(InProcessVerifier):
    """A verifier replica that dies after ``verifies`` Verify calls: every later call fails as on a killed pod."""

    def __init__(self, verifies: int) -> None:
        self.engine = Verifier(MODEL, "fp")
        super().__init__(self.engine)
        self._verifies = verifies

    def _check_alive(self) -> None:
        if self._verifies < 0:
            raise ReplicaUnreachable("verifier at a:1 is unreachable: Connection reset by peer")

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        self._check_alive()
        return await super().prefill(call)

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self._verifies -= 1
        self._check_alive()
        return await super().verify(call)


@pytest.mark.parametrize("dies_after", [0, 4])  # while verifying the first round, or mid-stream
def test_a_dying_verifier_replica_moves_the_session_without_changing_the_output(dies_after: int) -> None:
    replicas = {"a:1": MortalReplica(dies_after), "b:1": MortalReplica(10**6)}
    router = StickyVerifierRouter(lambda: list(replicas), replicas.__getitem__)  # "a:1" gets the first session
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens, _, stats = run(generation(GenerationRequest(prompt, 40), verifier=router))
    assert tokens == plain_greedy(MODEL, prompt, 40)
    assert stats.num_reprefills == 1
    assert replicas["b:1"].engine.num_active_sessions == 0  # released where it moved to


def test_a_replica_dying_before_the_first_prefill_moves_it() -> None:
    replicas = {"a:1": MortalReplica(-1), "b:1": MortalReplica(10**6)}
    router = StickyVerifierRouter(lambda: list(replicas), replicas.__getitem__)
    prompt = [2, 7, 1, 8]
    tokens, _, stats = run(generation(GenerationRequest(prompt, 12), verifier=router))
    assert tokens == plain_greedy(MODEL, prompt, 12)
    assert stats.num_reprefills == 1


class ManualClock:
    """The deadlines' clock (``coordinator.deadlines.clock``), moved by the test alone."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def deadline_clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock()
    monkeypatch.setattr(deadlines, "clock", clock)
    return clock


class SlowVerifier(InProcessVerifier):
    """Each Verify takes ``VERIFY_S`` on the deadlines' clock: a deadline passes after a set number of rounds,
    however fast the machine runs them."""

    VERIFY_S = 10.0

    def __init__(self, engine: Verifier, clock: ManualClock) -> None:
        super().__init__(engine)
        self._clock = clock

    async def verify(self, call: VerifyCall) -> VerifyResult:
        self._clock.now += self.VERIFY_S
        return await super().verify(call)


def test_the_deadline_ends_the_request_and_releases_its_session(deadline_clock: ManualClock) -> None:
    engine = Verifier(MODEL, "fp")
    g = generation(GenerationRequest([1, 2, 3], 200), verifier=SlowVerifier(engine, deadline_clock))

    async def consume() -> int:
        streamed = 0
        with deadline_scope(3.5 * SlowVerifier.VERIFY_S):  # passed during the fourth Verify
            async for _ in g.stream():
                streamed += 1
        return streamed

    with pytest.raises(DeadlineExceeded, match="deadline"):
        asyncio.run(consume())
    assert 0 < g.stats.num_rounds <= 4
    assert engine.num_active_sessions == 0


class SlowReleaseVerifier(SlowVerifier):
    """Its Release is on the wire until the test lets it go (``on_the_wire``), and the test cancels the request
    meanwhile."""

    def __init__(self, engine: Verifier, clock: ManualClock) -> None:
        super().__init__(engine, clock)
        self.releasing = asyncio.Event()
        self.on_the_wire = asyncio.Event()

    async def release(self, session_id: str) -> None:
        self.releasing.set()
        await self.on_the_wire.wait()
        await super().release(session_id)


def test_a_cancel_that_lands_while_the_session_is_released_still_releases_it(deadline_clock: ManualClock) -> None:
    """gRPC cancels the handler as the client's deadline passes, the instant the loop's own deadline fires."""
    engine = Verifier(MODEL, "fp")

    async def scenario() -> bool:
        verifier = SlowReleaseVerifier(engine, deadline_clock)
        g = generation(GenerationRequest([1, 2, 3], 200), verifier=verifier)

        async def consume() -> None:
            with deadline_scope(2.5 * SlowVerifier.VERIFY_S):
                async for _ in g.stream():
                    pass

        task = asyncio.ensure_future(consume())
        await verifier.releasing.wait()
        task.cancel()  # lands while the Release is on the wire: a release not shielded from it is cut here
        verifier.on_the_wire.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with asyncio.timeout(30):  # the release goes on without the request; the guard only ends a hang
            while engine.num_active_sessions:
                await asyncio.sleep(0.01)
        return task.cancelled()

    assert asyncio.run(scenario())
    assert engine.num_active_sessions == 0


class HeldReply:
    """A draft stream whose ``hold``-th proposal is computed, then held until the test lets it go."""

    def __init__(self, inner: DraftStream, hold: int) -> None:
        self._inner = inner
        self._hold = hold
        self.wants_features = inner.wants_features
        self.proposals = 0
        self.held = asyncio.Event()
        self.release: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        reply = await self._inner.propose(feedback, max_nodes)
        self.proposals += 1
        if self.proposals == self._hold:
            self.held.set()
            await self.release
        return reply

    async def close(self) -> None:
        await self._inner.close()


class HoldingDrafter:
    def __init__(self, hold: int) -> None:
        self._inner = drafter()
        self._hold = hold
        self.stream: HeldReply | None = None

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> DraftStream:
        self.stream = HeldReply(await self._inner.open(session_id, prompt_tokens, vocab_fingerprint), self._hold)
        return self.stream


def test_a_cancel_that_lands_with_the_drafters_reply_ends_the_generation() -> None:
    """The client hangs up in the same loop tick as the drafter's reply arrives: the generation still ends.

    (On Python 3.11 ``asyncio.wait_for`` returned the reply and dropped the cancellation, CPython gh-86296:
    the generation ran on to its last token for a client that had gone.)
    """
    engine = Verifier(MODEL, "fp")

    async def scenario() -> tuple[bool, int]:
        holding = HoldingDrafter(hold=3)
        g = generation(GenerationRequest([1, 2, 3], 200), verifier=InProcessVerifier(engine), draft=holding)

        async def consume() -> None:
            async for _ in g.stream():
                pass

        task = asyncio.ensure_future(consume())
        while holding.stream is None or not holding.stream.held.is_set():
            await asyncio.sleep(0.001)
        holding.stream.release.set_result(None)  # the reply is ready...
        task.cancel()  # ...and the client goes away in the same tick
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.cancelled(), g.stats.num_rounds

    cancelled, rounds = asyncio.run(scenario())
    assert cancelled
    assert rounds == 2  # the third round's reply was never verified
    assert engine.num_active_sessions == 0


def test_eos_ends_the_generation_and_is_not_streamed() -> None:
    prompt = [1, 2, 3]
    reference = plain_greedy(MODEL, prompt, 30)
    eos = reference[10]
    tokens, _, stats = run(generation(GenerationRequest(prompt, 30), eos=eos))
    assert tokens == reference[: reference.index(eos)]
    assert stats.finish_reason is FinishReason.EOS


def test_stop_string_cuts_text_before_it() -> None:
    prompt = [1, 2, 3]
    reference_text = CharTokenizer().decode(plain_greedy(MODEL, prompt, 30))
    stop = reference_text[12:14]
    _, text, stats = run(generation(GenerationRequest(prompt, 30, stop=(stop,))))
    assert text == reference_text[: reference_text.index(stop)]
    assert stats.finish_reason is FinishReason.STOP


def test_sampling_runs_through_the_loop_reproducibly() -> None:
    prompt = [1, 2, 3, 1, 2, 3]
    request = GenerationRequest(prompt, 30, SamplingParams(temperature=0.8, top_k=8, seed=7))
    first, _, _ = run(generation(request))
    second, _, _ = run(generation(request))
    assert first == second
    assert len(first) == 30


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_exactly_max_new_tokens(max_new_tokens: int) -> None:
    tokens, _, stats = run(generation(GenerationRequest([1, 2, 1, 2, 1, 2], max_new_tokens)))
    assert len(tokens) == max_new_tokens
    assert stats.finish_reason is FinishReason.LENGTH


class OracleStream:
    """Drafts the true continuation (so the verifier accepts past any cut) and records every report."""

    wants_features = False
    takes_verified_trees = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        self._sequence = [*prompt, *continuation]
        self._committed = len(prompt)
        self.reported: list[int] = []

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        self.reported += feedback.new_tokens
        self._committed += len(feedback.new_tokens)
        return DraftReply(TokenTree.chain(self._sequence[self._committed : self._committed + max_nodes]))

    async def close(self) -> None:
        return None


class OracleDrafter:
    def __init__(self, stream: OracleStream) -> None:
        self.stream = stream

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> OracleStream:
        return self.stream


@pytest.mark.parametrize("cut", ["eos", "stop", "length"])
def test_tokens_past_the_cut_are_never_committed_nor_reported(cut: str) -> None:
    prompt = [1, 2, 3]
    reference = plain_greedy(MODEL, prompt, 30)
    oracle = OracleStream(prompt, reference)
    eos, stop, max_new = -1, (), 30
    if cut == "eos":
        eos = reference[9]
        expected = reference[: reference.index(eos) + 1]  # the EOS token is committed (not streamed)
    elif cut == "stop":
        text = CharTokenizer().decode(reference)
        stop = (text[9:11],)
        expected = reference[: text.index(stop[0]) + 2]  # up to the token that completes the stop string
    else:
        max_new = 9
        expected = reference[:9]
    g = generation(GenerationRequest(prompt, max_new, stop=stop), draft=OracleDrafter(oracle), eos=eos)
    g.policy = RoundPolicy(max_draft_tokens=16)  # whole-tree acceptance runs well past the cut
    _, _, stats = run(g)
    if cut != "length":  # (a tree never reaches past the length: the round loop sizes it to what is left)
        assert stats.num_accepted_tokens + stats.num_rounds > len(expected)  # the verifier did return more
    assert oracle.reported == expected
    assert g._committed == prompt + expected
