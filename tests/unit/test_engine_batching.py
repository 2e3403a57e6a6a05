"""The verifier engine on tiny random models: batching, chunked prefill, memory, cancellation (fp32)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest
import torch

from bench.inproc import InProcessVerifier
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, RoundPolicy
from specserve.errors import FailedPrecondition, NotFound, ResourceExhausted
from specserve.results import VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.budget_policy import SessionAcceptance
from target_service.cost_curve import CostCurve
from target_service.verifier import PREFILL_HEADROOM_TOKENS, EngineStep, Verifier
from tests.conftest import CharTokenizer, plain_greedy, run_together, tiny_llama

VOCAB = 48
MODEL = tiny_llama(vocab_size=VOCAB, seed=3, context=512)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=7)


def random_tree(rng: random.Random, size: int) -> TokenTree:
    parents = [rng.randrange(-1, i) for i in range(size)]
    return TokenTree(tuple(rng.randrange(VOCAB) for _ in range(size)), tuple(parents))


def sessions_for(rng: random.Random, count: int) -> list[tuple[list[int], TokenTree, SamplingParams]]:
    """Prompts of different lengths, trees of different shapes, greedy and sampled."""
    out = []
    for i in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))]
        sampling = SAMPLED if i % 3 == 2 else SamplingParams()
        out.append((prompt, random_tree(rng, rng.randrange(0, 12)), sampling))
    return out


def verify_alone(prompt: list[int], tree: TokenTree, sampling: SamplingParams) -> tuple[VerifyResult, torch.Tensor]:
    verifier = Verifier(MODEL, "fp")
    try:
        verifier.prefill("s", prompt, sampling)
        logits = verifier.score("s", tree)
        return verifier.verify("s", len(prompt), tree, num_successors=3, return_features=True), logits
    finally:
        verifier.close()


def test_sessions_verified_in_one_batch_get_what_each_gets_alone() -> None:
    cases = sessions_for(random.Random(0), 7)
    verifier = Verifier(MODEL, "fp")
    for i, (prompt, _, sampling) in enumerate(cases):
        verifier.prefill(f"s{i}", prompt, sampling)
    with verifier.paused():
        scores = [verifier.submit_score(f"s{i}", tree) for i, (_, tree, _) in enumerate(cases)]
    with verifier.paused():
        futures = [
            verifier.submit_verify(f"s{i}", len(prompt), tree, num_successors=3, return_features=True)
            for i, (prompt, tree, _) in enumerate(cases)
        ]
    results = [f.result(timeout=30) for f in futures]
    verifier.close()
    assert {r.batch_sessions for r in results} == {len(cases)}  # one forward served them all
    for (prompt, tree, sampling), result, score in zip(cases, results, scores, strict=True):
        alone, alone_logits = verify_alone(prompt, tree, sampling)
        assert (result.accepted_nodes, result.bonus_token) == (alone.accepted_nodes, alone.bonus_token)
        assert result.successors == alone.successors
        torch.testing.assert_close(score.result(), alone_logits, rtol=1e-5, atol=1e-5)
        assert result.features is not None and alone.features is not None
        assert abs(result.features.astype(float) - alone.features.astype(float)).max() < 1e-2


def test_a_bad_call_in_a_batch_fails_alone() -> None:
    verifier = Verifier(MODEL, "fp")
    prompt = [1, 2, 3, 4, 5]
    expected = plain_greedy(MODEL, prompt, 4)
    verifier.prefill("good", prompt, SamplingParams())
    verifier.prefill("stale", prompt, SamplingParams())
    with verifier.paused():
        good = verifier.submit_verify("good", 5, TokenTree.chain(expected[:3]))
        stale = verifier.submit_verify("stale", 9, TokenTree())
        unknown = verifier.submit_verify("nobody", 5, TokenTree())
    assert good.result(timeout=30).committed == expected
    with pytest.raises(FailedPrecondition):
        stale.result(timeout=30)
    with pytest.raises(NotFound):
        unknown.result(timeout=30)
    # The stale session is untouched and still usable.
    assert verifier.verify("stale", 5, TokenTree()).committed == expected[:1]
    verifier.close()


@pytest.mark.parametrize("return_features", [False, True])
def test_chunked_prefill_equals_one_shot_prefill(return_features: bool) -> None:
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(150)]
    probe = TokenTree((1, 2, 3, 4), (-1, 0, -1, 2))
    chunked = Verifier(MODEL, "fp", max_tree_nodes=8, max_batch_tokens=17)  # 150 tokens in 9 chunks
    one_shot = Verifier(MODEL, "fp", max_batch_tokens=512)
    a = chunked.prefill("s", prompt, SamplingParams(), return_features)
    b = one_shot.prefill("s", prompt, SamplingParams(), return_features)
    assert chunked.stats().num_steps >= 9 and one_shot.stats().num_steps == 1
    torch.testing.assert_close(chunked.score("s", probe), one_shot.score("s", probe), rtol=1e-5, atol=1e-5)
    if return_features:
        assert a.features is not None and b.features is not None and a.features.shape == (149, 64)
        assert abs(a.features.astype(float) - b.features.astype(float)).max() < 1e-2
    chunked.close()
    one_shot.close()


def test_running_streams_advance_while_a_long_prompt_is_prefilled() -> None:
    """A long prefill takes a chunk per step; a Verify submitted with it is answered in the first step."""
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8, max_batch_tokens=32)
    verifier.prefill("running", [1, 2, 3], SamplingParams())
    with verifier.paused():
        long_prompt = verifier.submit_prefill("new", [5] * 300, SamplingParams())
        step = verifier.submit_verify("running", 3, TokenTree.chain([4, 5]))
    step.result(timeout=30)
    assert not long_prompt.done()  # the verify came back while the prompt was still being prefilled
    long_prompt.result(timeout=30)
    assert verifier.stats().num_steps >= 300 // 32
    verifier.close()


def test_cache_is_accounted_in_bytes() -> None:
    verifier = Verifier(MODEL, "fp", kv_cache_bytes=2**20)
    config = MODEL.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (64 // 4) * 4  # keys + values, fp32
    stats = verifier.stats()
    assert stats.kv_capacity_bytes == (2**20 // per_token) // 16 * 16 * per_token
    assert stats.kv_used_bytes == 0
    verifier.prefill("s", list(range(40)), SamplingParams())
    reserved = -(-(39 + PREFILL_HEADROOM_TOKENS) // 16) * 16
    assert verifier.stats().kv_used_bytes == reserved * per_token
    verifier.release("s")
    assert verifier.stats().kv_used_bytes == 0
    verifier.close()


def plain_together(
    verifier: Verifier, prompts: list[list[int]], max_new_tokens: int, ahead: bool = True
) -> list[tuple[list[int], str, GenerationStats]]:
    """Generations of ``prompts`` with no drafter, at once on the in-process engine (``ahead``: rounds sent ahead)."""
    port, policy = InProcessVerifier(verifier), RoundPolicy(verify_ahead=ahead)
    tokenizer = CharTokenizer()
    request = [GenerationRequest(p, max_new_tokens) for p in prompts]
    return run_together([Generation(r, port, None, tokenizer, frozenset(), "fp", policy) for r in request])


def test_memory_pressure_evicts_idle_sessions_and_the_round_loop_loses_nothing() -> None:
    """A cache for about two sessions, three generations: evictions are re-prefilled transparently. Rounds take
    turns, so each session is idle between them."""
    per_token = 2 * 2 * 2 * 16 * 4
    verifier = Verifier(MODEL, "fp", kv_cache_bytes=per_token * 160, evict_idle_s=0.0, max_tree_nodes=4)
    prompts = [[7, 1, 3], [9, 9, 2, 4], [5, 6]]

    results = plain_together(verifier, prompts, 60, ahead=False)
    for prompt, (output, _, _) in zip(prompts, results, strict=True):
        assert output == plain_greedy(MODEL, prompt, 60)
    reprefills = [stats.num_reprefills for _, _, stats in results]
    assert sum(reprefills) > 0  # memory really ran out
    assert verifier.stats().num_sessions == 0 and verifier.stats().kv_used_bytes == 0
    verifier.close()


def test_sessions_that_always_have_a_call_queued_still_make_room_for_each_other() -> None:
    """Two plain generations whose rounds are sent ahead, so neither is ever idle, each outgrowing its share of a
    cache for 160 tokens: the one that must grow evicts the other, whose call is queued but not in the step; that
    one is prefilled again once there is room. Waiting instead, both would wait at their next block for ever (up
    to the admission timeout, then RESOURCE_EXHAUSTED)."""
    per_token = 2 * 2 * 2 * 16 * 4
    verifier = Verifier(MODEL, "fp", kv_cache_bytes=per_token * 160, evict_idle_s=60.0, admission_timeout_s=10.0)
    prompts = [[7, 1, 3], [9, 9, 2]]

    results = [(tokens, stats.num_reprefills) for tokens, _, stats in plain_together(verifier, prompts, 100)]
    for prompt, (output, _) in zip(prompts, results, strict=True):
        assert output == plain_greedy(MODEL, prompt, 100)
    assert sum(reprefills for _, reprefills in results) > 0  # memory really ran out while both were busy
    assert verifier.stats().num_sessions == 0 and verifier.stats().kv_used_bytes == 0
    verifier.close()


def test_a_prefill_that_finds_no_memory_waits_then_is_resource_exhausted() -> None:
    per_token = 2 * 2 * 2 * 16 * 4
    verifier = Verifier(MODEL, "fp", kv_cache_bytes=per_token * 128, evict_idle_s=60.0, admission_timeout_s=0.3)
    verifier.prefill("holder", [1] * 60, SamplingParams())
    with pytest.raises(ResourceExhausted, match="kv-cache-gib"):
        verifier.prefill("late", [2] * 60, SamplingParams())
    verifier.release("holder")
    verifier.prefill("late", [2] * 60, SamplingParams())  # room again
    verifier.close()


def test_a_prompt_larger_than_the_whole_cache_is_refused_at_once() -> None:
    verifier = Verifier(MODEL, "fp", kv_cache_bytes=2 * 2 * 2 * 16 * 4 * 64)
    with pytest.raises(ResourceExhausted, match="more than the verifier's"):
        verifier.prefill("s", [1] * 200, SamplingParams())
    verifier.close()


def test_a_call_cancelled_while_queued_leaves_the_queue_and_holds_no_cache() -> None:
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8, max_batch_tokens=16)
    futures: list[Future[object]] = []
    with verifier.paused():
        futures.append(verifier.submit_prefill("gone", [3] * 100, SamplingParams()))  # type: ignore[arg-type]
        assert futures[0].cancel()
    assert verifier.wait_idle()
    assert verifier.stats().num_sessions == 0 and verifier.stats().kv_used_bytes == 0
    # Cancelled half-way through a chunked prefill (31 steps), by the engine's own step observer after its third
    # step (no polling, no race with the prefill's end): the partial session is freed too.
    partial: list[Future[object]] = []
    cancelled: list[bool] = []

    def cancel_after_the_third_step(_: EngineStep) -> None:
        if not cancelled and verifier.stats().num_steps >= 3:
            cancelled.append(partial[0].cancel())

    verifier.observe_steps(cancel_after_the_third_step)
    with verifier.paused():  # the future is in hand before the first step
        partial.append(verifier.submit_prefill("half", [3] * 500, SamplingParams()))  # type: ignore[arg-type]
    assert verifier.wait_idle()
    assert cancelled == [True]
    assert verifier.stats().num_sessions == 0 and verifier.stats().kv_used_bytes == 0
    verifier.close()


def test_verify_reports_a_draft_budget_and_the_batch() -> None:
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8)
    verifier.prefill("s", [1, 2], SamplingParams())
    result = verifier.verify("s", 2, TokenTree.chain([3]))
    assert result.draft_budget_nodes is not None and 0 <= result.draft_budget_nodes <= 8
    assert result.batch_sessions == 1 and result.queue_ns >= 0
    verifier.close()


def test_a_session_with_no_draft_budget_is_offered_a_probe_after_a_quiet_stretch() -> None:
    never_pays = CostCurve((1, 1000), (1.0, 1000.0))  # every row costs a full forward
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8, cost_curve=never_pays, throughput_guard=False)
    verifier.prefill("s", [1, 2], SamplingParams())
    budgets = []
    for round_ in range(SessionAcceptance.PROBE_AFTER):
        result = verifier.verify("s", 2 + round_, TokenTree.chain([]))
        budgets.append(result.draft_budget_nodes)
    assert budgets == [0] * (SessionAcceptance.PROBE_AFTER - 1) + [SessionAcceptance.PROBE_NODES]
    # The probe's tree, whatever it earns, answers the probe: the next budget is the cost model's again.
    result = verifier.verify("s", 2 + len(budgets), TokenTree.chain([3, 4]))
    assert result.draft_budget_nodes == 0
    verifier.close()


def test_a_session_whose_drafts_take_longer_than_they_save_is_told_to_stop_drafting() -> None:
    rows_free = CostCurve((1, 64), (1.0, 1.0))  # in seconds: a tree costs what one token does
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8, cost_curve=rows_free, throughput_guard=False)
    for session in ("quick", "slow"):
        verifier.prefill(session, [1, 2], SamplingParams())
    quick = verifier.verify("quick", 2, TokenTree.chain([3]), draft_ns=1_000_000)  # a millisecond's draft
    slow = verifier.verify("slow", 2, TokenTree.chain([3]), draft_ns=10_000_000_000)  # ten steps' worth
    assert quick.draft_budget_nodes is not None and quick.draft_budget_nodes > 0  # rows free, drafts cheap
    assert slow.draft_budget_nodes == 0  # no tree saves ten steps: plain decoding commits more
    verifier.close()


def test_a_session_over_a_long_context_is_given_a_smaller_tree() -> None:
    """The budget prices a session's rows over its own cached tokens (``CostCurve.per_row_context_s``)."""
    # Rows free over 16 cached tokens; each row costs a short step's worth more per 100 cached tokens.
    curve = CostCurve((1, 64), (1.0, 1.0), context=16, per_row_context_s=0.01)
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8, cost_curve=curve, throughput_guard=False)
    verifier.prefill("short", [1, 2], SamplingParams())
    verifier.prefill("long", [1 + i % 40 for i in range(400)], SamplingParams())
    short = verifier.verify("short", 2, TokenTree.chain([3]))
    long = verifier.verify("long", 400, TokenTree.chain([3]))
    assert short.draft_budget_nodes is not None and short.draft_budget_nodes > 0  # rows free: a tree pays
    assert long.draft_budget_nodes == 0  # 400 tokens: a row costs 4 steps more, no tree pays for it
    verifier.close()


def test_the_start_up_profile_measures_what_a_cached_token_adds_to_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile times rows over its short and its long context (clamped to the sessions' limit) and keeps the
    slope it fits in the curve the budgets use."""
    timed: list[tuple[int, int]] = []

    def measure(run, sizes, contexts, repeats):  # type: ignore[no-untyped-def]
        for tokens in sizes:
            for context in contexts:
                run(tokens, context)  # a real step over each context
                timed.append((tokens, context))
        return 2.5e-6

    monkeypatch.setattr("target_service.verifier.measure_context_cost", measure)
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8)  # the tiny model holds 512 tokens a session
    curve = verifier.profile_cost(sizes=(1, 2, 4, 8), repeats=1)
    assert timed == [(n, c) for n in (1, 2, 4, 8) for c in (128, 512 - 8)]
    assert (curve.context, curve.per_row_context_s) == (128, 2.5e-6) and verifier.cost_curve == curve
    verifier.close()


def test_the_start_up_profile_times_on_the_engine_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The curve prices the engine's steps, so its timings run where the steps run: on the engine thread (its
    OpenMP team and torch threads), not on the thread that asked for the profile."""
    threads: list[str] = []

    def measure(run, sizes, repeats):  # type: ignore[no-untyped-def]
        run(1, 1)
        threads.append(threading.current_thread().name)
        return CostCurve((1, 2), (1e-3, 2e-3))

    monkeypatch.setattr("target_service.verifier.measure_curve", measure)
    monkeypatch.setattr("target_service.verifier.measure_context_cost", lambda *args: 0.0)
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8)
    curve = verifier.profile_cost(sizes=(1, 2), repeats=1)
    assert threads == ["verifier-engine"] and verifier.cost_curve == curve
    verifier.close()


def test_work_on_the_engine_thread_raises_in_its_caller_and_the_engine_goes_on() -> None:
    verifier = Verifier(MODEL, "fp", max_tree_nodes=8)

    def broken() -> None:
        raise RuntimeError("profiling failed")

    with pytest.raises(RuntimeError, match="profiling failed"):
        verifier._on_engine_thread(broken)
    verifier.prefill("s", [1, 2, 3], SamplingParams())  # still serving
    assert verifier.verify("s", 3, TokenTree()).committed
    verifier.close()
