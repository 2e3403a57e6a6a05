"""Draft budgets from the engine's cost curve: trees shrink as load grows, and switch off at saturation."""

from __future__ import annotations

import pytest

from target_service.budget_policy import DraftBudget, SessionAcceptance
from target_service.cost_curve import CostCurve, flat_curve, measure_context_cost, measure_curve
from target_service.throughput_guard import ThroughputGuard

# Shaped like the fp32 curve measured on a 2-core Xeon (c(n)/c(1)).
CPU_FP32 = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.15, 1.55, 1.84, 2.09, 2.45, 3.55, 6.5), 0.02)
LINEAR = CostCurve((1, 1000), (1.0, 1000.0))  # every row costs a full forward: speculation never pays


def test_curve_interpolates_and_extrapolates() -> None:
    assert CPU_FP32.forward_s(1) == 1.0
    assert CPU_FP32.forward_s(3) == (1.15 + 1.55) / 2
    assert CPU_FP32.forward_s(256) > CPU_FP32.forward_s(128)
    assert CPU_FP32.step_s(4, 16) == CPU_FP32.forward_s(16) + 4 * 0.02
    assert CostCurve.from_json(CPU_FP32.to_json()) == CPU_FP32


def test_budget_shrinks_with_load_and_switches_off_at_saturation() -> None:
    budget = DraftBudget(CPU_FP32, max_nodes=64)
    by_load = [budget.nodes_for(sessions) for sessions in (1, 4, 16, 64, 128)]
    assert by_load[0] > 0 and by_load[-1] == 0
    assert max(by_load[2:]) < max(by_load[:2])  # not strictly monotone: the measured curve has kinks


def test_no_speculation_when_every_row_costs_a_forward_and_all_of_it_when_rows_are_free() -> None:
    assert DraftBudget(LINEAR, max_nodes=32).nodes_for(1) == 0
    assert DraftBudget(flat_curve(), max_nodes=8, prior_accepted=9, prior_tried=10).nodes_for(64) == 8


def test_acceptance_is_learnt_and_moves_the_budget() -> None:
    budget = DraftBudget(CPU_FP32, max_nodes=64)
    before = budget.nodes_for(4)
    for _ in range(200):
        budget.observe(tree_depth=8, num_accepted=8)  # everything accepted
    assert budget.alpha > 0.9 and budget.nodes_for(4) > before
    for _ in range(2000):
        budget.observe(tree_depth=8, num_accepted=0)  # nothing accepted
    assert budget.alpha < 0.1 and budget.nodes_for(4) == 0


def test_each_session_drafts_by_its_own_acceptance_and_retries_after_a_while() -> None:
    budget = DraftBudget(CPU_FP32, max_nodes=64)
    engine = budget.alpha
    copying, guessing = SessionAcceptance(), SessionAcceptance()
    assert copying.alpha(engine) == engine  # a new session starts from the engine's rate
    for _ in range(20):
        copying.observe(tree_depth=8, num_accepted=8)  # a summary copying its document: drafts land
        guessing.observe(tree_depth=8, num_accepted=0)
    assert (
        budget.nodes_for(1, copying.alpha(engine)) > budget.nodes_for(1) > budget.nodes_for(1, guessing.alpha(engine))
    )
    assert budget.nodes_for(1, guessing.alpha(engine)) == 0
    for _ in range(60):  # rounds without drafts: the rate drifts back to the engine's, and drafting is tried again
        guessing.observe(tree_depth=0, num_accepted=0)
    assert guessing.alpha(engine) == pytest.approx(engine, abs=0.01)


def test_a_session_the_cost_model_stopped_probes_again_and_resumes_when_its_drafts_land() -> None:
    budget = DraftBudget(CPU_FP32, max_nodes=64)
    for _ in range(2000):
        budget.observe(tree_depth=8, num_accepted=0)  # the engine's rate says drafts never land
    session = SessionAcceptance()
    sent = []
    for _ in range(20):  # rounds with no tree (the drafter sends none while its budget is 0), each answered
        session.observe(tree_depth=0, num_accepted=0)
        sent.append(session.budget(budget.nodes_for(1, session.alpha(budget.alpha)), max_nodes=64))
    after = SessionAcceptance.PROBE_AFTER
    assert sent[: after - 1] == [0] * (after - 1)  # drifting back to the engine's rate alone never drafts again
    assert sent[after - 1 :] == [SessionAcceptance.PROBE_NODES] * (20 - after + 1)
    assert session.budget(0, max_nodes=2) == 2  # never beyond the verifier's tree limit
    for _ in range(3):  # the probes land
        budget.observe(tree_depth=4, num_accepted=4)
        session.observe(tree_depth=4, num_accepted=4)
    assert budget.nodes_for(1, session.alpha(budget.alpha)) > SessionAcceptance.PROBE_NODES
    session.observe(tree_depth=0, num_accepted=0)
    assert session.budget(0, max_nodes=64) == 0  # a tree came back: no probe until the next quiet stretch


def test_drafting_time_counts_against_drafting_and_can_switch_it_off() -> None:
    # The 2-core AMX Xeon's fp32 curve (ms) and its in-process round: tau 1.91 from 8-node trees, 12.6 ms of
    # drafting a round. Drafting free, the cost model drafts; counted, plain decoding commits more per second.
    curve = CostCurve((1, 2, 4, 8, 16), (15.8, 17.5, 20.5, 29.7, 54.2))
    budget = DraftBudget(curve, max_nodes=32, prior_accepted=0.91, prior_tried=1.91)
    free = budget.nodes_for(1)
    assert free > 0
    assert 0 < budget.nodes_for(1, draft_s=2.0) <= free  # cheap drafts (n-grams): still worth it
    assert budget.nodes_for(1, draft_s=12.6) == 0
    tokens_per_ms = (1 + budget.expected_accepted(free)) / (curve.forward_s(1 + free) + 12.6)
    assert tokens_per_ms < 1 / curve.forward_s(1)  # what the zero budget was chosen over


def test_among_other_sessions_a_draft_counts_a_share_of_its_time() -> None:
    # Steps whose cost is mostly per session (as under load on a CPU): extra rows in a shared step are cheap.
    curve = CostCurve((1, 2, 4, 8, 16, 32), (15.8, 17.5, 20.5, 29.7, 54.2, 103.1), per_session_s=5.0)
    budget = DraftBudget(curve, max_nodes=32, prior_accepted=0.91, prior_tried=1.91)
    assert budget.nodes_for(1, draft_s=12.6) == 0  # alone, the engine waits for the whole draft
    assert budget.nodes_for(8, draft_s=12.6) > 0  # among eight, it steps for the other seven meanwhile
    counted_whole = (1 + budget.expected_accepted(1)) / (curve.step_s(8, 16) + 12.6)
    assert counted_whole < 1 / curve.step_s(8, 8)  # counted whole, the draft would have switched drafting off


def test_a_session_smooths_its_drafting_time_over_drafted_rounds_only() -> None:
    session = SessionAcceptance()
    assert session.draft_s == 0.0  # nothing known: the cost model alone
    session.observe_draft(0.010)
    assert session.draft_s == pytest.approx(0.010)  # the first drafted round is taken as it is
    session.observe_draft(0.0)  # a round without a drafter says nothing about drafting
    assert session.draft_s == pytest.approx(0.010)
    for _ in range(50):
        session.observe_draft(0.002)
    assert session.draft_s == pytest.approx(0.002, rel=0.01)


def test_probes_that_land_nothing_come_ever_less_often_and_a_landing_one_brings_them_back() -> None:
    session = SessionAcceptance()

    def quiet_rounds_before_a_probe() -> int:
        """Rounds with no tree (the cost model's budget 0) until the session is offered a probe."""
        quiet = 0
        while session.budget(0, max_nodes=64) == 0:
            session.observe(tree_depth=0, num_accepted=0)
            quiet += 1
        return quiet

    waits = []
    for _ in range(5):
        waits.append(quiet_rounds_before_a_probe())
        session.observe(tree_depth=4, num_accepted=0)  # the probe's tree: nothing accepted
    first = SessionAcceptance.PROBE_AFTER
    assert waits == [first, 2 * first, 4 * first, SessionAcceptance.PROBE_AFTER_MAX, SessionAcceptance.PROBE_AFTER_MAX]
    waits = [quiet_rounds_before_a_probe()]
    session.observe(tree_depth=4, num_accepted=2)  # this probe lands
    waits.append(quiet_rounds_before_a_probe())
    assert waits == [SessionAcceptance.PROBE_AFTER_MAX, first]
    session.observe(tree_depth=4, num_accepted=0)
    session.budget(3, max_nodes=64)  # the cost model drafts again: its tree is no probe
    session.observe(tree_depth=3, num_accepted=0)
    assert quiet_rounds_before_a_probe() == 2 * first  # only the probe's empty answer doubled the wait


def test_measure_curve_times_each_size_and_the_per_session_cost() -> None:
    calls: list[tuple[int, int]] = []
    clock_now = [0.0]

    def run(sessions: int, tokens: int) -> None:
        calls.append((sessions, tokens))
        clock_now[0] += 1.0 + tokens * 0.01 + sessions * 0.1

    curve = measure_curve(run, (1, 8), repeats=2, clock=lambda: clock_now[0])
    assert curve.tokens == (1, 8)
    assert abs(curve.seconds[1] - (1.0 + 0.08 + 0.1)) < 1e-9
    assert abs(curve.per_session_s - 0.1) < 1e-9
    assert (8, 8) in calls


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_guard(
    guard: ThroughputGuard,
    clock: FakeClock,
    seconds: float,
    rate: dict[bool, int],
    sessions: tuple[str, ...] = ("a", "b", "c", "d"),
) -> None:
    """Steps of 0.1 s, each committing rate[arm] tokens for every one of ``sessions``."""
    for _ in range(int(seconds * 10)):
        clock.now += 0.1
        guard.observe(dict.fromkeys(sessions, rate[guard.arm_now]))


def test_guard_switches_speculation_off_when_plain_steps_commit_more_and_back_when_it_pays() -> None:
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=8, probe_s=3)
    run_guard(guard, clock, 30, {True: 10, False: 20})  # drafting costs more than it brings
    assert not guard.speculate and guard.num_switches == 1
    run_guard(guard, clock, 30, {True: 30, False: 20})  # now it pays
    assert guard.speculate and guard.num_switches == 2


def test_guard_keeps_the_arm_when_the_probe_does_not_win_clearly() -> None:
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=8, probe_s=3, margin=0.05)
    run_guard(guard, clock, 60, {True: 20, False: 21})  # within the margin: noise
    assert guard.speculate and guard.num_switches == 0
    idle = ThroughputGuard(clock, exploit_s=8, probe_s=3)
    run_guard(idle, clock, 60, {True: 0, False: 1})  # too few tokens to judge
    assert idle.speculate


def test_guard_judges_the_arms_on_the_same_sessions_only() -> None:
    """A request whose drafts were all rejected ends; the next, with drafts that pay, must not be judged by it.
    A probe waits for a session it can be judged on (``min_tokens`` in the stretch's last ``probe_s``)."""
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=8, probe_s=3, min_tokens=64)
    run_guard(guard, clock, 8, {True: 2, False: 2}, sessions=("cold",))  # 58 tokens in its last 3 s: too few
    costly = {True: 10, False: 20}  # on warm, drafting costs half the rate
    run_guard(guard, clock, 0.3, costly, sessions=("warm",))  # 20 tokens after its first step
    assert guard.arm_now and guard.num_unpaired == 0, "no probe before a session it can be judged on"
    run_guard(guard, clock, 0.5, costly, sessions=("warm",))  # 70: enough
    assert not guard.arm_now, "the probe (no drafts) began on warm"
    run_guard(guard, clock, 3.2, costly, sessions=("warm",))  # judged on warm alone: drafting goes off
    assert not guard.speculate and guard.num_switches == 1 and guard.num_unpaired == 0


def run_requests(
    guard: ThroughputGuard, clock: FakeClock, requests: int, steps: int, pause_s: float, rate: dict[bool, int]
) -> tuple[list[tuple[int, int]], list[bool]]:
    """``requests`` one after another, each ``steps`` steps of 0.1 s, after a pause of ``pause_s`` without
    steps; the (request, step) where each probe began, and each request's first arm (True: drafting)."""
    starts, first_arms = [], []
    for request in range(requests):
        clock.now += pause_s
        for step in range(steps):
            probing = guard.arm_now != guard.speculate
            clock.now += 0.1
            guard.observe({f"r{request}": rate[guard.arm_now]}, step_s=0.1)
            if step == 0:
                first_arms.append(guard.arm_now)
            if guard.arm_now != guard.speculate and not probing:
                starts.append((request, step))
    return starts, first_arms


def test_pauses_do_not_count_and_a_probe_ends_with_the_request_it_is_judged_on() -> None:
    """Requests of 2 s (20 steps) one at a time, 10 s apart. On the wall clock the first probe would fall due in
    the first pause and take the second request's start, which has no stretch before it to be judged against.
    Counting busy time it falls due 7 s in, half-way through the fourth request, is judged on it (drafting
    pays: kept), and ends with it: the fifth request opens with drafts."""
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=7, probe_s=3, min_tokens=64)
    starts, first_arms = run_requests(guard, clock, 6, 20, 10.0, {True: 30, False: 20})
    assert starts == [(3, 9)]
    assert all(first_arms)
    assert guard.speculate and guard.num_switches == 0 and guard.num_unpaired == 0


def probe_starts(
    guard: ThroughputGuard, clock: FakeClock, seconds: float, rate: dict[bool, int], sessions: str = "abcd"
) -> list[float]:
    """When each probe began, over ``seconds`` of steps of 1/8 s (exact in floats), each committing
    rate[arm] tokens for every one of ``sessions``."""
    starts = []
    for _ in range(int(seconds * 8)):
        probing = guard.arm_now != guard.speculate
        clock.now += 0.125
        guard.observe(dict.fromkeys(sessions, rate[guard.arm_now]))
        if guard.arm_now != guard.speculate and not probing:
            starts.append(clock.now)
    return starts


def test_probes_that_confirm_the_arm_come_ever_less_often_and_a_switch_brings_them_back() -> None:
    """A probe serves the arm that loses: while probes keep confirming the arm, each doubles the wait for the
    next, up to ``max_exploit_s``; once a probe switches, the guard probes at its first pace again."""
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=8, probe_s=3, max_exploit_s=32)
    # Drafting pays: every probe (no drafts) loses. Waits of 8, 16, 32, 32 s, each followed by a 3 s probe.
    assert probe_starts(guard, clock, 105, {True: 30, False: 20}) == [8, 27, 62, 97]
    assert guard.speculate and guard.num_switches == 0
    # Now drafting costs: the probe due 32 s after the last switches drafting off; the next comes 8 s after it.
    assert probe_starts(guard, clock, 45, {True: 10, False: 20}) == [132, 143]
    assert not guard.speculate and guard.num_switches == 1
    with pytest.raises(ValueError, match="exploit"):
        ThroughputGuard(clock, exploit_s=80, max_exploit_s=64)


def test_a_change_of_load_brings_the_first_pace_back() -> None:
    """Probes confirmed drafting for one session; sixteen arrive, and at that load drafting costs: the next
    probe comes 8 s after they did, not at the end of the backed-off wait, and switches drafting off."""
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=8, probe_s=3, max_exploit_s=64)
    assert probe_starts(guard, clock, 40, {True: 30, False: 20}, sessions="a") == [8, 27]  # then a 32 s wait
    sixteen = "abcdefghijklmnop"
    assert probe_starts(guard, clock, 12, {True: 10, False: 20}, sessions=sixteen) == [48.125]
    assert not guard.speculate and guard.num_switches == 1
    # Small swings of load (here 12 to 16 sessions) do not reset the wait a confirming probe doubled.
    steady = ThroughputGuard(clock, exploit_s=8, probe_s=3, max_exploit_s=64)
    assert probe_starts(steady, clock, 40, {True: 30, False: 20}, sessions=sixteen[:12]) == [60, 79]
    assert probe_starts(steady, clock, 40, {True: 30, False: 20}, sessions=sixteen) == [114]  # 32 s after 82


def test_a_size_timed_while_the_cores_were_taken_is_timed_again() -> None:
    """A stall (every repeat of one size far above linear growth) is retried; a curve still stalled is flagged."""
    clock_now = [0.0]
    stalls = {16: 3 * 4}  # 16 tokens: every run (a warm-up and 3 repeats) of its first 3 timings stalls

    def run(sessions: int, tokens: int) -> None:
        stalled = sessions == 1 and stalls.get(tokens, 0) > 0
        if stalled:
            stalls[tokens] -= 1
        clock_now[0] += 40.0 if stalled else 1.0 + tokens * 0.01

    curve = measure_curve(run, (1, 8, 16, 32), repeats=3, clock=lambda: clock_now[0])
    assert abs(curve.forward_s(16) - 1.16) < 1e-9 and curve.plausible()
    stuck = CostCurve((1, 8, 16), (1.0, 1.1, 40.0))
    assert not stuck.plausible() and CPU_FP32.plausible()


def test_a_burst_of_contention_slows_one_sweep_not_every_timing_of_one_size() -> None:
    """Another process takes the cores for the first runs of the profile (as at ``make run``, where the
    drafter and the coordinator start beside the verifier): the sizes are swept in turn, so the burst
    cannot inflate every timing of the one-token step and make every ratio to it look cheap."""
    clock_now = [0.0]
    runs = [0]

    def run(sessions: int, tokens: int) -> None:
        runs[0] += 1
        cost = 1.0 + tokens * 0.01 + (sessions - 1) * 0.1
        clock_now[0] += cost * (3.0 if runs[0] <= 6 else 1.0)  # the first six runs at a third of the speed

    curve = measure_curve(run, (1, 8, 16, 32), repeats=3, clock=lambda: clock_now[0])
    assert curve.seconds == pytest.approx((1.01, 1.08, 1.16, 1.32))
    assert curve.ratios()[8] == pytest.approx(1.08 / 1.01)


def test_a_longer_context_prices_every_row_more_and_a_tree_over_it_shrinks() -> None:
    """Attention reads every cached token for every row: over a long prompt a tree costs more than at the
    context the curve was timed at, and the budget drafts less there."""
    per_row_context_s = 0.0008  # c(1) = 1: a row costs 0.8 of a short step more per 1000 cached tokens
    curve = CostCurve(CPU_FP32.tokens, CPU_FP32.seconds, 0.02, context=128, per_row_context_s=per_row_context_s)
    assert curve.step_s(1, 8, context=1128) == pytest.approx(CPU_FP32.step_s(1, 8) + 8 * 1000 * per_row_context_s)
    assert curve.step_s(1, 8, context=64) == CPU_FP32.step_s(1, 8)  # shorter: the curve's price, not less
    assert curve.step_s(1, 8) == CPU_FP32.step_s(1, 8)  # no context given: the curve's own
    assert CostCurve.from_json(curve.to_json()) == curve
    budget = DraftBudget(curve, max_nodes=64, prior_accepted=8, prior_tried=10)
    by_context = [budget.nodes_for(1, context=context) for context in (128, 512, 1024, 4096)]
    assert by_context[0] == DraftBudget(CPU_FP32, max_nodes=64, prior_accepted=8, prior_tried=10).nodes_for(1)
    assert by_context[0] > by_context[1] and by_context == sorted(by_context, reverse=True)


def test_a_cost_curve_written_before_it_had_a_context_is_measured_again() -> None:
    """Cached curves from before the context slope do not parse: the verifier profiles anew rather than
    pricing long contexts as short ones for ever."""
    old = '{"tokens": [1, 8], "seconds": [0.01, 0.02], "per_session_s": 0.001}'
    with pytest.raises(ValueError, match="not a cost curve"):
        CostCurve.from_json(old)


def test_measure_context_cost_fits_the_extra_time_per_row_and_cached_token() -> None:
    clock_now = [0.0]
    runs: list[tuple[int, int]] = []

    def run(tokens: int, context: int) -> None:
        runs.append((tokens, context))
        clock_now[0] += 0.01 + tokens * 0.002 + tokens * context * 3e-6

    slope = measure_context_cost(run, (1, 4, 16), (128, 1024), repeats=2, clock=lambda: clock_now[0])
    assert slope == pytest.approx(3e-6)
    assert {(16, 128), (16, 1024)} <= set(runs)
    assert measure_context_cost(lambda tokens, context: None, (1, 8), (128, 1024), clock=lambda: 0.0) == 0.0
    with pytest.raises(ValueError, match="longer"):
        measure_context_cost(run, (1,), (1024, 128))


def test_guard_judges_rounds_end_to_end_not_by_the_engines_step_alone() -> None:
    """A session's rate is its tokens over the time between its steps: the whole round, drafting and hops too.

    Drafted rounds here take a 20 ms step for 2 tokens (by the step alone, 100 tok/s against a plain step's
    83) but 20 ms more outside the engine (the drafter, the hops): 50 tok/s end to end against plain rounds'
    67. The guard turns drafting off.
    """
    clock = FakeClock()
    guard = ThroughputGuard(clock, exploit_s=8, probe_s=3)
    for _ in range(2000):
        step_s, outside_s, tokens = (0.020, 0.020, 2) if guard.arm_now else (0.012, 0.003, 1)
        clock.now += outside_s + step_s
        guard.observe({"a": tokens}, step_s)
    assert not guard.speculate and guard.num_switches == 1
