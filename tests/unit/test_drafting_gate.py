"""Never slower than off: a session drafts only while its drafted rounds pay end to end, as the coordinator sees."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.drafting_gate import DraftingGate
from coordinator.ports import DraftStream
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, RoundPolicy
from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool
from specserve.results import DraftFeedback, DraftReply, VerifyResult
from specserve.verify_call import VerifyCall
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_greedy, run_generation, tiny_llama

VOCAB = 16
MODEL = tiny_llama(vocab_size=VOCAB)
MS = 1_000_000  # nanoseconds


def judge(gate: DraftingGate, rounds: int, drafted: tuple[int, float], plain: tuple[int, float]) -> list[bool]:
    """Run ``rounds`` rounds as the gate says: drafted ones commit and take ``drafted``, plain ones ``plain``."""
    asked: list[bool] = []
    for _ in range(rounds):
        drafts = gate.drafts()
        asked.append(drafts)
        gate.observe(drafts, *(drafted if drafts else plain))
    return asked


def test_drafted_rounds_that_do_not_pay_end_to_end_go_plain_after_a_few_rounds() -> None:
    gate = DraftingGate()
    # Two tokens a drafted round in 30 ms (67 tok/s) against one a plain round in 12 ms (83 tok/s).
    asked = judge(gate, 10, drafted=(2, 0.030), plain=(1, 0.012))
    assert not gate.drafting
    first_plain = asked.index(False)
    assert first_plain <= DraftingGate.WARM_UP + 1  # the first round is not judged
    assert not any(asked[first_plain:])  # plain from then on, until a probe falls due


def test_drafted_rounds_that_pay_keep_drafting_with_a_plain_round_now_and_then() -> None:
    gate = DraftingGate()
    # Two tokens a drafted round in 20 ms (100 tok/s) against one a plain round in 12 ms (83 tok/s).
    asked = judge(gate, 300, drafted=(2, 0.020), plain=(1, 0.012))
    assert gate.drafting
    plain = asked.count(False)
    assert DraftingGate.PLAIN_SAMPLES <= plain <= DraftingGate.PLAIN_SAMPLES + 300 // DraftingGate.REFRESH_AFTER


def test_a_session_that_went_plain_probes_ever_less_often_while_probes_lose() -> None:
    gate = DraftingGate()
    asked = judge(gate, 600, drafted=(2, 0.030), plain=(1, 0.012))
    starts = [i for i in range(1, len(asked)) if asked[i] and not asked[i - 1]]
    assert len(starts) >= 3  # probes happen
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # each losing probe doubles the wait for the next
    assert max(gaps) <= DraftingGate.PROBE_AFTER_MAX + DraftingGate.PROBE_ROUNDS


def test_a_probe_that_wins_brings_drafting_back() -> None:
    gate = DraftingGate()
    judge(gate, 20, drafted=(1, 0.030), plain=(1, 0.012))
    assert not gate.drafting
    # The text turned repetitive: drafted rounds now commit five tokens in 30 ms.
    asked = judge(gate, DraftingGate.PROBE_AFTER + 8, drafted=(5, 0.030), plain=(1, 0.012))
    assert gate.drafting and all(asked[-4:])


# ---- the round loop with the gate: fake costs on an injected clock, the real model and acceptance ----


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


class CostedVerifier:
    """The in-process verifier, each Verify costing ``plain_ms`` (no tree) or ``drafted_ms`` on ``clock``: of it
    1 ms queued and 1 ms in transport, the rest the verifier's step. It charges a call when it returns, which
    models rounds in lockstep: no Verify is sent ahead to it."""

    keeps_order = False

    def __init__(self, clock: Clock, plain_ms: int, drafted_ms: int) -> None:
        self._inner = InProcessVerifier(Verifier(MODEL, "fp"))
        self._clock = clock
        self._plain_ms, self._drafted_ms = plain_ms, drafted_ms

    async def verify(self, call: VerifyCall) -> VerifyResult:
        result = await self._inner.verify(call)
        took = (self._drafted_ms if call.tree.token_ids else self._plain_ms) * MS
        self._clock.ns += took
        return dataclasses.replace(result, verify_ns=took - 1 * MS, queue_ns=1 * MS)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CostedStream:
    """A draft stream whose proposals take ``draft_ms`` on ``clock``, ``draft_ms - 1`` of it the drafter's own."""

    def __init__(self, inner: DraftStream, clock: Clock, draft_ms: int) -> None:
        self._inner, self._clock, self._draft_ms = inner, clock, draft_ms
        self.trees_asked = 0

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        reply = await self._inner.propose(feedback, max_nodes)
        if max_nodes > 0:
            self.trees_asked += 1
            self._clock.ns += self._draft_ms * MS
            return dataclasses.replace(reply, draft_ns=(self._draft_ms - 1) * MS, probe_ns=0)
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CostedDrafter:
    def __init__(self, clock: Clock, draft_ms: int) -> None:
        pool = InMemoryNgramPool()
        self._inner = InProcessDrafter(Drafter(lambda fingerprint, namespace: pool))
        self._clock, self._draft_ms = clock, draft_ms
        self.streams: list[CostedStream] = []

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: object = None
    ) -> DraftStream:
        inner = await self._inner.open(session_id, prompt_tokens, vocab_fingerprint)
        stream = CostedStream(inner, self._clock, self._draft_ms)
        self.streams.append(stream)
        return stream


PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]


def run_costed(
    plain_ms: int, drafted_ms: int, draft_ms: int, tokens: int = 60, gate: bool = True
) -> tuple[list[int], GenerationStats, CostedDrafter, Generation]:
    clock = Clock()
    drafter = CostedDrafter(clock, draft_ms)
    generation = Generation(
        GenerationRequest(PROMPT, tokens),
        CostedVerifier(clock, plain_ms, drafted_ms),
        drafter,
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=2, gate_drafting=gate),
        clock=clock,
    )
    out, _, stats = run_generation(generation)
    return out, stats, drafter, generation


def test_a_session_whose_drafted_rounds_do_not_pay_runs_plain_rounds_and_probes() -> None:
    # A drafted round: 10 ms drafting and a 40 ms verify for at most 3 tokens (60 tok/s); a plain one 10 ms.
    tokens, stats, drafter, _ = run_costed(plain_ms=10, drafted_ms=40, draft_ms=10, tokens=120)
    assert tokens == plain_greedy(MODEL, PROMPT, 120)  # lossless whatever the gate decides
    asked = drafter.streams[0].trees_asked
    assert stats.num_rounds_plain_by_cost > stats.num_rounds // 2
    assert DraftingGate.WARM_UP < asked < stats.num_rounds // 3  # the warm-up and the probes, no more


def test_a_session_whose_drafted_rounds_pay_keeps_drafting() -> None:
    # A drafted round with a tree: 1 ms drafting and a 12 ms verify; a plain one 20 ms. While the drafter's pools
    # are cold its rounds bring no tree (21 ms for one token) and the session may go plain: its probe returns.
    tokens, stats, drafter, _ = run_costed(plain_ms=20, drafted_ms=12, draft_ms=1, tokens=160)
    assert tokens == plain_greedy(MODEL, PROMPT, 160)
    most = DraftingGate.PLAIN_SAMPLES + DraftingGate.PROBE_AFTER + stats.num_rounds // DraftingGate.REFRESH_AFTER
    assert stats.num_rounds_plain_by_cost <= most
    assert drafter.streams[0].trees_asked >= stats.num_rounds - most
    assert sum(times[0] + times[1] > 0 for times in stats.round_phase_ns[-8:]) >= 4  # still drafting at the end


def test_without_the_gate_the_verifiers_budget_alone_decides() -> None:
    _, stats, _, _ = run_costed(plain_ms=10, drafted_ms=40, draft_ms=10, gate=False)
    assert stats.num_rounds_plain_by_cost == 0


def test_each_round_is_cut_into_phases_that_add_up_to_it() -> None:
    _, stats, _, _ = run_costed(plain_ms=10, drafted_ms=40, draft_ms=10, tokens=30)
    totals = stats.phase_ns
    assert len(stats.round_phase_ns) == stats.num_rounds
    asked, trees = stats.num_drafter_trees, stats.num_drafts
    assert asked and trees
    assert totals["drafter"] == asked * 9 * MS and totals["draft_transport"] == asked * 1 * MS
    assert totals["verifier_queue"] == totals["verify_transport"] == stats.num_rounds * 1 * MS
    assert totals["verifier_step"] == trees * 38 * MS + (stats.num_rounds - trees) * 8 * MS
    assert totals["protobuf"] == 0 and totals["tree_and_masks"] == 0 and totals["loop"] == 0  # the clock stood
    for times in stats.round_phase_ns:
        assert sum(times) in (10 * MS, 20 * MS, 50 * MS)  # plain, a drafter with no tree, drafted
