"""Lookahead decoding's Jacobi rows on the verifier's spare rows: lossless, masked off the tree, n-grams to pools.

Tiny random models in fp32 as the other verifier tests: with lookahead forced on, greedy and seeded sampled output
equals plain decoding; the rows' mask keeps them and the tree apart; their n-grams are the target's own text,
travel the wire (and are absent from older peers' messages) and reach the drafter's session and tenant pools.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis
import torch

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.rounds import Generation, GenerationRequest
from draft_service.drafter import Drafter
from draft_service.lookahead_source import LOOKAHEAD_POOL_SHAPE
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.pools import PoolRegistry
from draft_service.tree_builder import VerifyCost
from specserve.results import DraftFeedback, VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from specserve.v1 import drafter_pb2, verifier_pb2
from specserve.wire import feedback_from_proto, feedback_to_proto, verify_result_from_proto, verify_result_to_proto
from target_service.cost_curve import CostCurve
from target_service.engine_calls import StepWork, VerifyCall
from target_service.lookahead import LookaheadWindow, nearly_free, window_mask, with_window
from target_service.metrics import VerifierMetrics
from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan
from target_service.session_cache import Session
from target_service.step_inputs import pack, tree_mask, verify_rows
from target_service.verifier import EngineStep, Verifier
from tests.conftest import CharTokenizer, plain_decode, plain_greedy, run_together, tiny_llama
from tests.redis_server import RedisServer, free_port

VOCAB = 48
MODEL = tiny_llama(vocab_size=VOCAB, seed=3, context=512)
SAMPLED = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=11)
STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.17, 1.6, 2.99, 5.5, 10.0, 19.0))  # a 2-core CPU's shape
FREE = VerifyCost({0: 1.0, 64: 1.0})  # every node pays: the tree builder keeps what the sources propose
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.01, 1.02, 1.03, 1.04))  # rows nearly free


def random_tree_around(truth: list[int], rng: random.Random, size: int) -> TokenTree:
    """``truth`` as one chain from the root, with random branches hung anywhere (nodes after their parents)."""
    tokens, parents = list(truth), [i - 1 for i in range(len(truth))]
    while len(tokens) < size:
        parents.append(rng.randrange(-1, len(tokens)))
        tokens.append(rng.randrange(VOCAB))
    return TokenTree(tuple(tokens), tuple(parents))


def paths_of(tree: TokenTree) -> set[tuple[int, ...]]:
    """Every root-to-node path of ``tree``."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.token_ids, tree.parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return set(paths)


# ---- the mask ----


@pytest.mark.parametrize(("levels", "width"), [(1, 4), (3, 5), (4, 2)])
def test_no_tree_row_sees_a_lookahead_row_and_no_lookahead_row_sees_a_tree_node(levels: int, width: int) -> None:
    cached = 7
    parents = (-1, 0, 0, 1, -1)
    depths = torch.tensor([0, 1, 2, 2, 3, 1])
    tree = tree_mask(parents, depths, cached)
    n = len(parents) + 1
    mask = with_window(tree, cached, n, window_mask(levels, width))
    rows = levels * width
    assert mask.shape == (n + rows, cached + n + rows)
    assert not mask[:n, cached + n :].any()  # tree rows: blind to every lookahead row
    torch.testing.assert_close(mask[:n, : cached + n], tree)  # and otherwise as before
    assert mask[n:, : cached + 1].all()  # lookahead rows: the whole context and the pending token
    assert not mask[n:, cached + 1 : cached + n].any()  # never a tree node
    # Row (j, i) sees level 0's columns <= i and column i of levels 1..j: its own causal chain of positions.
    window = mask[n:, cached + n :]
    for j in range(levels):
        for i in range(width):
            seen = {(r // width, r % width) for r in torch.nonzero(window[j * width + i]).flatten().tolist()}
            assert seen == {(0, c) for c in range(i + 1)} | {(level, i) for level in range(1, j + 1)}


def test_a_plain_round_gets_a_mask_once_it_carries_a_window() -> None:
    mask = with_window(None, 3, 1, window_mask(2, 3))
    assert mask[0].tolist() == [True] * 4 + [False] * 6  # the pending token sees the context and itself only
    assert mask[1:, :4].all()


def test_tree_rows_score_the_same_with_a_window_beside_them() -> None:
    """The step's tree logits, which acceptance reads (greedy and sampled alike), do not depend on the window."""
    runner = ModelRunner(MODEL)
    arena = runner.new_arena(512)
    region = arena.allocate(128)
    assert region is not None
    prompt = [random.Random(2).randrange(VOCAB) for _ in range(20)]
    empty = torch.zeros(0, dtype=torch.long)
    plan = StepPlan(arena, [Segment.chunk(region, 0, slice(0, len(prompt) - 1), runner.device)])
    runner.forward(plan, torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), empty, empty)
    region.length = len(prompt) - 1
    session = Session(list(prompt), region, SAMPLED, seed=11)
    tree = random_tree_around([5, 6, 7], random.Random(3), 9)
    scored = []
    for window in (None, LookaheadWindow(6, 3, levels=[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])):
        if window is not None:
            window.anchor = len(prompt) - 1
        work = StepWork([(VerifyCall("s", tree=tree, lookahead=True, window=window), session)])
        inputs = pack(work, arena, runner.device)
        out = runner.forward(inputs.plan, inputs.input_ids, inputs.positions, inputs.score_rows, inputs.feature_rows)
        scored.append(next(verify_rows(work, out))[2])
        assert out.logits.shape[0] == len(tree) + 1 + (window.width if window is not None else 0)
    torch.testing.assert_close(scored[1], scored[0], rtol=1e-6, atol=1e-6)


# ---- the window ----


def test_the_window_follows_commits_and_yields_n_grams_once_full() -> None:
    window = LookaheadWindow(width=4, num_levels=2)
    window.follow([9, 8, 7, 6, 5])
    assert window.anchor == 4 and window.levels == [[8, 7, 6, 5]]
    assert window.advance([1, 2, 3, 4]) == []  # filling: a second level, no n-gram yet
    assert window.levels == [[8, 7, 6, 5], [1, 2, 3, 4]] and window.anchor == 4
    assert window.advance([11, 12, 13, 14]) == [(8, 1, 11), (7, 2, 12), (6, 3, 13), (5, 4, 14)]
    assert window.levels == [[1, 2, 3, 4], [11, 12, 13, 14]] and window.anchor == 5  # the oldest level went
    window.follow([0] * 8)  # three tokens committed: the pending token is at 7, two columns behind it go
    assert window.anchor == 7 and window.levels == [[3, 4, 4, 4], [13, 14, 14, 14]]
    window.follow([0] * 20)  # further than the window reaches: a new one
    assert window.anchor == 19 and len(window.levels) == 1


# ---- the verifier, lookahead forced on ----


def test_greedy_rounds_with_lookahead_commit_what_plain_greedy_would_for_sessions_batched_together() -> None:
    rng = random.Random(0)
    verifier = Verifier(MODEL, "fp", lookahead="on", lookahead_window=5, lookahead_ngram=4, max_batch_tokens=512)
    steps: list[EngineStep] = []
    verifier.observe_steps(steps.append)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    references = [plain_greedy(MODEL, prompt, 60) for prompt in prompts]
    committed: list[list[int]] = [[] for _ in prompts]
    ngrams: list[tuple[int, ...]] = []
    for i, prompt in enumerate(prompts):
        verifier.prefill(f"s{i}", prompt, SamplingParams())
    while min(len(c) for c in committed) < 40:
        with verifier.paused():  # every session's round in one step
            futures = []
            for i, prompt in enumerate(prompts):
                truth = references[i][len(committed[i]) : len(committed[i]) + rng.randrange(4)]
                tree = random_tree_around(truth, rng, len(truth) + rng.randrange(6))
                futures.append(verifier.submit_verify(f"s{i}", len(prompt) + len(committed[i]), tree, lookahead=True))
        results: list[VerifyResult] = [future.result(timeout=60) for future in futures]
        assert {result.batch_sessions for result in results} == {len(prompts)}
        for i, result in enumerate(results):
            committed[i] += result.committed
            assert committed[i] == references[i][: len(committed[i])]
            ngrams += result.lookahead_ngrams
    verifier.close()
    assert sum(step.lookahead_rows for step in steps) > 0
    assert sum(step.lookahead_ngrams for step in steps) == len(ngrams) > 0
    assert {len(ngram) for ngram in ngrams} == {4}
    # They are Jacobi trajectories of the target itself: most are its greedy text.
    grams = {tuple((p + r)[i : i + 4]) for p, r in zip(prompts, references, strict=True) for i in range(len(p) + 57)}
    assert sum(ngram in grams for ngram in ngrams) > len(ngrams) // 2


def test_seeded_sampling_with_lookahead_commits_what_plain_seeded_decoding_would() -> None:
    """Keyed draws per position: the sampled output with lookahead rows is plain seeded decoding's, token for token
    (so distributed exactly as the target's; the rows acceptance reads are unchanged, test above)."""
    rng = random.Random(4)
    prompt = [3, 1, 4, 1, 5]
    reference = plain_decode(MODEL, prompt, 50, SAMPLED)
    verifier = Verifier(MODEL, "fp", lookahead="on", lookahead_window=4, lookahead_ngram=3)
    verifier.prefill("s", prompt, SAMPLED)
    committed: list[int] = []
    produced = 0
    while len(committed) < 40:
        truth = reference[len(committed) : len(committed) + rng.randrange(3)]
        tree = random_tree_around(truth, rng, len(truth) + rng.randrange(5))
        result = verifier.verify("s", len(prompt) + len(committed), tree, lookahead=True)
        committed += result.committed
        produced += len(result.lookahead_ngrams)
        assert committed == reference[: len(committed)]
    verifier.close()
    assert produced > 0


def test_a_session_that_does_not_ask_gets_no_rows_and_off_runs_none() -> None:
    for mode, ask, expect in (("on", False, False), ("off", True, False), ("on", True, True)):
        verifier = Verifier(MODEL, "fp", lookahead=mode, lookahead_window=3, lookahead_ngram=2)
        steps: list[EngineStep] = []
        verifier.observe_steps(steps.append)
        verifier.prefill("s", [1, 2, 3], SamplingParams())
        n = 3
        for _ in range(3):
            n += len(verifier.verify("s", n, TokenTree(), lookahead=ask).committed)
        verifier.close()
        assert (sum(step.lookahead_rows for step in steps) > 0) is expect, mode


def test_auto_is_off_on_a_steep_cost_curve_and_on_on_a_flat_one() -> None:
    assert not nearly_free(STEEP, 1, 8)
    assert nearly_free(FLAT, 1, 8)
    assert not nearly_free(CostCurve((1,), (1.0,)), 1, 8)  # not measured: nothing is known to be free
    for curve, expect in ((STEEP, False), (FLAT, True)):
        verifier = Verifier(MODEL, "fp", lookahead="auto", lookahead_window=4, lookahead_ngram=2)
        verifier.use_cost_curve(curve)
        steps: list[EngineStep] = []
        verifier.observe_steps(steps.append)
        verifier.prefill("s", [1, 2, 3], SamplingParams())
        n = 3
        for _ in range(3):
            n += len(verifier.verify("s", n, TokenTree(), lookahead=True).committed)
        verifier.close()
        assert (sum(step.lookahead_rows for step in steps) > 0) is expect


def test_rows_stay_within_the_step_budget_and_the_context() -> None:
    # A step of 7 tokens holds the pending token and a 4-node tree, not the window's first 3 rows beside them.
    verifier = Verifier(
        MODEL, "fp", lookahead="on", lookahead_window=3, lookahead_ngram=3, max_batch_tokens=7, max_tree_nodes=4
    )
    steps: list[EngineStep] = []
    verifier.observe_steps(steps.append)
    verifier.prefill("s", [1, 2, 3], SamplingParams())
    verifier.verify("s", 3, TokenTree.chain([1, 2, 3, 4]), lookahead=True)
    assert steps[-1].lookahead_rows == 0
    verifier.close()
    short = Verifier(MODEL, "fp", lookahead="on", lookahead_window=8, lookahead_ngram=4, max_session_tokens=12)
    short.prefill("s", [1, 2, 3], SamplingParams())
    assert short.verify("s", 3, TokenTree(), lookahead=True).lookahead_ngrams == ()  # 3 + 8 + 3 > 12
    short.close()


def test_the_metrics_count_rows_and_n_grams() -> None:
    metrics = VerifierMetrics()
    metrics.engine_step(EngineStep(1, 30, lookahead_rows=24, lookahead_ngrams=5))
    metrics.engine_step(EngineStep(1, 6))
    assert metrics.registry.get_sample_value("specserve_verifier_lookahead_rows_total") == 24
    assert metrics.registry.get_sample_value("specserve_verifier_lookahead_ngrams_total") == 5


# ---- the wire ----


def test_n_grams_travel_the_wire_and_older_peers_messages_have_none() -> None:
    result = VerifyResult([], [], 5, 10, lookahead_ngrams=((1, 2, 3), (4, 5, 6)))
    assert verify_result_from_proto(verify_result_to_proto(result), 0).lookahead_ngrams == ((1, 2, 3), (4, 5, 6))
    assert verify_result_from_proto(verifier_pb2.VerifyResponse(bonus_token_id=5), 0).lookahead_ngrams == ()
    feedback = DraftFeedback((7,), lookahead_ngrams=((1, 2),))
    assert feedback_from_proto(feedback_to_proto(feedback, 4, None), None).lookahead_ngrams == ((1, 2),)
    assert feedback_from_proto(drafter_pb2.ProposeTree(new_token_ids=[7]), None).lookahead_ngrams == ()
    # A malformed field is a hint dropped, not a failed round: whole n-grams only.
    odd = verifier_pb2.VerifyResponse()
    odd.lookahead_ngrams.size = 3
    odd.lookahead_ngrams.token_ids.extend([1, 2, 3, 4])
    assert verify_result_from_proto(odd, 0).lookahead_ngrams == ((1, 2, 3),)
    assert not verifier_pb2.VerifyRequest().lookahead  # an older coordinator asks for no rows


# ---- the drafter ----


def test_n_grams_reach_the_session_and_the_tenant_pool() -> None:
    pool = InMemoryNgramPool()
    lookahead = InMemoryNgramPool(LOOKAHEAD_POOL_SHAPE)
    drafter = Drafter(lambda *_: pool, sources=("lookahead",), cost=FREE, lookahead_pool_for=lambda *_: lookahead)
    session = drafter.open_session("a", [1, 2, 3], "fp", vocab_size=VOCAB)
    assert session.propose(DraftFeedback(), 8).tree == TokenTree()  # nothing heard yet
    reply = session.propose(DraftFeedback((9,), lookahead_ngrams=((9, 4, 5, 6), (9, 4, 7, 8), (2, 1, 1, 1))), 8)
    assert paths_of(reply.tree) >= {(4, 7, 8), (4, 5, 6)}
    assert lookahead.lookup([9]) and lookahead.lookup([2]) == [(1, 1, 1)]
    # Another session of the tenant drafts from the pool once it hears n-grams of its own.
    other = drafter.open_session("b", [5], "fp", vocab_size=VOCAB)
    reply = other.propose(DraftFeedback((2,), lookahead_ngrams=((3, 3, 3, 3),)), 8)
    assert (1, 1, 1) in paths_of(reply.tree)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_n_grams_reach_redis_per_tenant_and_a_purge_removes_them(redis_server: RedisServer) -> None:
    registry = PoolRegistry(InMemoryNgramPool().shape, redis_server.url, 0.5, 1000)
    a = registry.lookahead("fp", "tenant:a")
    a.record((9, 4, 5, 6))
    assert a.lookup([9]) == [(4, 5, 6)]  # the write went with the lookup
    fresh = PoolRegistry(InMemoryNgramPool().shape, redis_server.url, 0.5, 1000)  # another drafter: Redis only
    assert fresh.lookahead("fp", "tenant:a").lookup([9]) == [(4, 5, 6)]
    assert fresh.lookahead("fp", "tenant:b").lookup([9]) == []  # tenants never mix
    assert fresh("fp", "tenant:a").lookup([9, 4, 5]) == []  # nor the two pools' keys
    assert registry.purge_shared("tenant:a") >= 1
    assert fresh.lookahead("fp", "tenant:a").lookup([9]) == []
    redis.Redis.from_url(redis_server.url).flushall()


def test_redis_down_degrades_lookahead_drafting_and_fails_nothing() -> None:
    registry = PoolRegistry(InMemoryNgramPool().shape, f"redis://127.0.0.1:{free_port()}/0", 0.05, 1000)
    drafter = Drafter(registry, sources=("lookahead",), cost=FREE, lookahead_pool_for=registry.lookahead)
    session = drafter.open_session("a", [1, 2, 3], "fp", vocab_size=VOCAB)
    reply = session.propose(DraftFeedback((9,), lookahead_ngrams=((9, 4, 5, 6),)), 8)
    assert (4, 5, 6) in paths_of(reply.tree)  # the session's own, and the local pool behind Redis


# ---- the round loop in one process ----


def test_generations_with_lookahead_through_the_round_loop_are_plain_greedy() -> None:
    verifier = Verifier(MODEL, "fp", lookahead="on", lookahead_window=6, lookahead_ngram=4, max_tree_nodes=16)
    pool = InMemoryNgramPool()
    lookahead = InMemoryNgramPool(LOOKAHEAD_POOL_SHAPE)
    drafter = Drafter(
        lambda *_: pool, sources=("suffix", "lookahead"), cost=FREE, lookahead_pool_for=lambda *_: lookahead
    )
    prompts = [[7, 1, 3, 9], [2, 2, 5, 8, 1, 4], [11, 30, 4]]

    generations = [
        Generation(
            GenerationRequest(prompt, max_new_tokens=48),
            InProcessVerifier(verifier),
            InProcessDrafter(drafter, vocab_size=VOCAB),
            CharTokenizer(),
            frozenset(),
            "fp",
        )
        for prompt in prompts
    ]
    outputs = [tokens for tokens, _, _ in run_together(generations)]
    verifier.close()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == plain_greedy(MODEL, prompt, 48)
    assert len(lookahead) > 0  # the verifier's n-grams reached the tenant's pool through the coordinator
