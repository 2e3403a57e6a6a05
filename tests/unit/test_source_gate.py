"""A session's costly draft sources (the draft head) run while their accepted drafts pay for their time."""

from __future__ import annotations

from collections.abc import Sequence

from draft_service.drafter import DraftSession
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.proposers import _Stateless
from draft_service.source_gate import GateCounts, GateHistory, SourceGate
from draft_service.tree_builder import AcceptanceStats, TreeBuilder, VerifyCost
from specserve.results import DraftFeedback, DraftReply
from specserve.token_tree import TokenTree

RIGHT, WRONG, BONUS = 5, 9, 7


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Source(_Stateless):
    """A draft source that proposes one token, taking ``seconds`` of the fake clock to do it; ``costly``: it
    drafts from the target's features, as the draft head does (what the gate weighs)."""

    def __init__(self, name: str, token: int | None, seconds: float, clock: FakeClock, costly: bool) -> None:
        self.name, self.wants_features = name, costly
        self._token, self._seconds, self._clock = token, seconds, clock
        self.calls = 0

        self.backlog = 0  # feeding steps it has put off (a long prompt's features), for ``digest``
        self.digested = 0

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        self.calls += 1
        self._clock.now += self._seconds
        return TokenTree.chain([self._token]) if self._token is not None else TokenTree()

    def digest(self, tokens: Sequence[int]) -> bool:
        if not self.backlog:
            return False
        self.backlog -= 1
        self.digested += 1
        return True


def session_with(
    clock: FakeClock, *sources: Source, counts: GateCounts | None = None, history: GateHistory | None = None
) -> DraftSession:
    builder = TreeBuilder(AcceptanceStats(), VerifyCost({0: 1.0, 8: 1.0}))  # flat: every node is worth keeping
    gate = SourceGate(clock, counts, history)
    return DraftSession("s", [1, 2, 3], InMemoryNgramPool(), sources, builder, gate=gate)


def play(session: DraftSession, clock: FakeClock, rounds: int, verify_s: float) -> list[DraftReply]:
    """``rounds`` rounds against a verifier that takes ``verify_s`` and accepts RIGHT wherever it was drafted."""
    replies: list[DraftReply] = []
    feedback = DraftFeedback()
    for _ in range(rounds):
        reply = session.propose(feedback, max_nodes=2)
        replies.append(reply)
        clock.now += verify_s
        right = [i for i, token in enumerate(reply.tree.token_ids) if token == RIGHT]
        accepted = tuple(right[:1])
        feedback = DraftFeedback(new_tokens=(RIGHT, BONUS) if accepted else (RIGHT,), accepted_node_indices=accepted)
    return replies


def test_a_slow_source_whose_drafts_are_never_taken_sits_out_after_warming_up_and_is_probed() -> None:
    clock = FakeClock()
    cheap = Source("cheap", RIGHT, 0.0001, clock, costly=False)
    head = Source("draft_model", WRONG, 0.010, clock, costly=True)
    counts = GateCounts()
    session = session_with(clock, cheap, head, counts=counts)
    warm, quiet = SourceGate.WARM_ROUNDS, SourceGate.PROBE_AFTER
    replies = play(session, clock, warm + quiet + 1, verify_s=0.005)
    assert cheap.calls == len(replies), "the cheap source drafts every round"
    assert head.calls == warm + 1, "warming up, then quiet, then one probe"
    ran = [r.probe_ns > 0 for r in replies]
    assert ran == [True] * warm + [False] * quiet + [True], "its time is reported as probing, and only then"
    assert all(r.probe_ns <= r.draft_ns for r in replies)
    assert all(RIGHT in r.tree.token_ids for r in replies), "the trees keep the cheap source's draft"
    assert (counts.ran, counts.skipped) == (warm + 1, quiet)
    # The probe found nothing either: the next one waits twice as long.
    more = play(session, clock, 2 * quiet + 1, verify_s=0.005)
    assert [r.probe_ns > 0 for r in more] == [False] * (2 * quiet) + [True]


def test_a_source_whose_accepted_drafts_pay_for_its_time_runs_every_round_and_is_not_a_probe() -> None:
    clock = FakeClock()
    head = Source("draft_model", RIGHT, 0.002, clock, costly=True)
    session = session_with(clock, head)
    # Alone it commits 2 tokens a 7 ms round (286/s); its drafts add 1 token per 2 ms of its time (500/s).
    replies = play(session, clock, 20, verify_s=0.005)
    assert head.calls == 20
    assert [r.probe_ns > 0 for r in replies] == [True] * SourceGate.WARM_ROUNDS + [False] * (
        20 - SourceGate.WARM_ROUNDS
    )


def test_the_same_source_at_five_times_the_cost_stops_paying() -> None:
    clock = FakeClock()
    head = Source("draft_model", RIGHT, 0.010, clock, costly=True)
    session = session_with(clock, head)
    # 1 token per 10 ms of its time (100/s) against rounds of 2 tokens in 15 ms (133/s): plain rounds do better.
    play(session, clock, 20, verify_s=0.005)
    assert head.calls < 20


def test_the_gate_weighs_gain_per_second_against_the_sessions_rate() -> None:
    clock = FakeClock()
    gate = SourceGate(clock)
    assert gate.opens() and gate.probing, "nothing known: it runs, to find out"
    for _ in range(SourceGate.WARM_ROUNDS):
        gate.ran(0.004)
        gate.replied()
        clock.now += 0.010
        gate.committed(3, gain=1)  # 3 tokens a 10 ms round: 300/s; its 1 token per 4 ms: 250/s
        gate.opens()
    assert not gate.pays()
    gate.committed(3, gain=3)  # drafting 3 of them makes it worth it
    gate.committed(3, gain=3)
    assert gate.pays()
    assert gate.opens() and not gate.probing


def test_after_sitting_out_a_run_counts_its_gain_not_its_catch_up_time() -> None:
    clock = FakeClock()
    gate = SourceGate(clock)
    gate.ran(0.040)  # its first run feeds the prompt's features: not timed
    gate.ran(0.002)
    gate.sat_out()
    gate.ran(0.050)  # the head first feeds the features it missed: not what a round of it usually costs
    gate.committed(2, gain=1)
    clock.now += 0.010
    gate.replied()
    clock.now += 0.010
    gate.committed(2, gain=1)
    assert gate.pays(), "priced at 2 ms, not 40 or 50"


def test_rounds_where_the_costly_source_has_nothing_yet_are_not_judged() -> None:
    """The head offers nothing until it has fed a long prompt's features: those rounds are no evidence."""
    clock = FakeClock()
    head = Source("draft_model", None, 0.010, clock, costly=True)  # nothing to offer, for now
    session = session_with(clock, head)
    play(session, clock, 10, verify_s=0.005)
    assert head.calls == 10, "still warming up: it runs every round until it has drafted WARM_ROUNDS trees"
    head._token = RIGHT  # caught up: its drafts are taken, at 10 ms each against 5 ms rounds
    play(session, clock, SourceGate.WARM_ROUNDS, verify_s=0.005)
    assert head.calls == 10 + SourceGate.WARM_ROUNDS
    head._token = None  # a probe that finds it with nothing does not use up the probe
    replies = play(session, clock, SourceGate.PROBE_AFTER + 3, verify_s=0.005)
    assert head.calls == 10 + SourceGate.WARM_ROUNDS + 3, "quiet, then a probe with nothing, retried each round"
    assert [r.probe_ns > 0 for r in replies][-3:] == [True, True, True]


def sessions_of_a_head_that_never_pays(clock: FakeClock, history: GateHistory, sessions: int) -> list[Source]:
    """``sessions`` sessions, one after another, each with a cheap source whose drafts land and a slow head whose
    drafts never do, played past their warm-up; returns their heads."""
    heads = []
    for _ in range(sessions):
        cheap = Source("cheap", RIGHT, 0.0001, clock, costly=False)
        head = Source("draft_model", WRONG, 0.010, clock, costly=True)
        play(session_with(clock, cheap, head, history=history), clock, SourceGate.WARM_ROUNDS + 2, verify_s=0.005)
        heads.append(head)
    return heads


def test_a_drafter_whose_head_has_not_paid_starts_new_sessions_with_it_sitting_out() -> None:
    clock = FakeClock()
    history = GateHistory()
    # Each warm-up times all its runs but the first (which feeds the prompt's features): 3 sessions give 9.
    earlier = sessions_of_a_head_that_never_pays(clock, history, 3)
    assert [head.calls for head in earlier] == [SourceGate.WARM_ROUNDS] * 3, "each warmed up: the record was short"
    assert history.pays() is False
    counts = GateCounts()
    cheap = Source("cheap", RIGHT, 0.0001, clock, costly=False)
    head = Source("draft_model", WRONG, 0.010, clock, costly=True)
    head.backlog = 5  # a long prompt's features to feed ahead
    session = session_with(clock, cheap, head, counts=counts, history=history)
    assert not session.work_ahead(predraft=False), "sitting out, it feeds nothing ahead"
    replies = play(session, clock, SourceGate.PROBE_AFTER + 1, verify_s=0.005)
    assert head.calls == 1, "no warm-up: quiet from the first round, then its first probe"
    assert [r.probe_ns > 0 for r in replies] == [False] * SourceGate.PROBE_AFTER + [True]
    assert counts.warm_ups_skipped == 1 and counts.skipped == SourceGate.PROBE_AFTER
    assert session.work_ahead(predraft=False) and head.digested == 1, "after running, it catches up ahead"


def test_every_eighth_new_session_warms_the_head_up_whatever_the_record_says() -> None:
    clock = FakeClock()
    history = GateHistory()
    heads = sessions_of_a_head_that_never_pays(clock, history, GateHistory.RECHECK_EVERY + 1)
    warmed = [i + 1 for i, head in enumerate(heads) if head.calls == SourceGate.WARM_ROUNDS]
    assert warmed == [1, 2, 3, GateHistory.RECHECK_EVERY], "until the record knows enough, then the recheck"


def test_a_head_that_paid_for_earlier_sessions_warms_up_in_new_ones_as_before() -> None:
    clock = FakeClock()
    history = GateHistory()
    for _ in range(3):
        head = Source("draft_model", RIGHT, 0.002, clock, costly=True)
        play(session_with(clock, head, history=history), clock, SourceGate.WARM_ROUNDS + 2, verify_s=0.005)
    assert history.pays() is True
    counts = GateCounts()
    head = Source("draft_model", RIGHT, 0.002, clock, costly=True)
    replies = play(session_with(clock, head, counts=counts, history=history), clock, 6, verify_s=0.005)
    assert head.calls == 6 and counts.warm_ups_skipped == 0
    assert [r.probe_ns > 0 for r in replies] == [True] * SourceGate.WARM_ROUNDS + [False] * 2


def test_a_gate_judges_on_the_record_until_its_session_has_figures_of_its_own() -> None:
    clock = FakeClock()
    history = GateHistory()
    # The record: 1 token per 10 ms of drafting against 3 tokens a 10 ms round.
    history.figures.gain.add(1.0)
    history.figures.cost_s.add(0.010)
    history.figures.round(0.010, 3)
    gate = SourceGate(clock, history=history)
    assert not gate.pays(), "on the record's figures"
    gate.committed(3, gain=9)  # this session's own gain: 9 tokens per 10 ms of the record's cost: it pays
    assert gate.pays()
    assert SourceGate(clock).pays(), "nothing known anywhere: run them, to find out"


class CalibratedSource(Source):
    """A source whose nodes carry their draft probability, as the draft head's and a draft model's do: the tree
    builder credits them as ``name@q<bucket>``."""

    def propose(self, tokens: Sequence[int], max_nodes: int) -> TokenTree:
        tree = super().propose(tokens, max_nodes)
        return TokenTree(tree.token_ids, tree.parents, node_probs=(0.9,) * len(tree))


def test_accepted_drafts_of_a_source_whose_nodes_carry_q_count_as_its_gain() -> None:
    """The gate reads the sources behind a node's credit labels, so calibrated nodes are the source's too."""
    clock = FakeClock()
    head = CalibratedSource("draft_model", RIGHT, 0.002, clock, costly=True)
    session = session_with(clock, head)
    play(session, clock, 20, verify_s=0.005)
    assert head.calls == 20
