"""Drafting with the draft head on a tiny random target: features, dynamic trees, losslessness."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, RoundPolicy
from draft_service.draft_head import DraftHead, in_serving_dtype
from draft_service.drafter import Drafter, PredraftCounts
from draft_service.head_proposer import FeatureLog, HeadProposer, TreeShape
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.training.distill_data import distil_batch
from draft_service.training.settings import TrainSettings
from draft_service.training.train import train
from draft_service.tree_builder import AcceptanceStats, TreeBuilder, VerifyCost, credit_label
from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.results import DraftFeedback
from specserve.sampling import SamplingParams
from specserve.token_tree import ROOT, TokenTree
from specserve.v1 import common_pb2
from specserve.wire import features_from_proto, features_to_proto
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_decode, run_generation, tiny_llama

VOCAB = 48
TARGET = tiny_llama(vocab_size=VOCAB, seed=3, context=256)
FREE = VerifyCost({0: 1.0, 64: 1.0})  # every node pays: the builder keeps whatever the head proposes


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> DraftHead:
    """A head distilled from the tiny target (a few seconds): it drafts better than chance."""
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (6,), generator=generator).tolist() for _ in range(32)]
    data = distil_batch(TARGET, prompts, 40, frozenset(), 0)
    settings = TrainSettings(
        draft_vocab_size=40, intermediate_size=96, window=48, batch_size=4, learning_rate=3e-3, ce_weight=1.0, epochs=8
    )
    embedding = TARGET.get_input_embeddings().weight.detach()
    lm_head = TARGET.get_output_embeddings().weight.detach()
    trained, _ = train(data, embedding, lm_head, TARGET.config, tmp_path_factory.mktemp("head"), settings, False)
    return trained


def test_verifier_features_are_the_targets_hidden_states_at_committed_positions() -> None:
    verifier = Verifier(TARGET, "fp")
    prompt = [3, 1, 4, 1, 5]
    prefill = verifier.prefill("s", prompt, SamplingParams(), return_features=True)
    assert prefill.features is not None and prefill.features.shape == (4, 64)
    result = verifier.verify("s", 5, TokenTree.chain([9, 2, 6]), return_features=True)
    assert result.features is not None and result.features.shape == (len(result.committed), 64)
    committed = prompt + result.committed
    with torch.inference_mode():
        hidden = TARGET(input_ids=torch.tensor([committed]), output_hidden_states=True).hidden_states[-1][0]
    expected = torch.cat([hidden[:4], hidden[4 : 4 + len(result.committed)]]).numpy()
    got = np.concatenate([prefill.features, result.features]).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
    assert verifier.verify("s", len(committed), TokenTree()).features is None  # not asked for


def test_features_round_trip_on_the_wire_and_malformed_ones_are_refused() -> None:
    rows = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float16)
    message = features_to_proto(rows)
    assert message is not None
    back = features_from_proto(message)
    assert back is not None and np.array_equal(back, rows)
    assert features_from_proto(common_pb2.HiddenFeatures()) is None
    with pytest.raises(ValueError, match="carry 10 bytes"):
        features_from_proto(common_pb2.HiddenFeatures(num_positions=3, hidden_size=8, float16_data=b"0" * 10))


def feed(proposer: HeadProposer, tokens: list[int]) -> None:
    """Give the proposer the target's features of all positions but the last, as the coordinator would."""
    with torch.inference_mode():
        hidden = TARGET(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    known = proposer.features.count
    proposer.observe(DraftFeedback(features=hidden[known : len(tokens) - 1].numpy().astype(np.float16)))


def test_dynamic_trees_are_valid_ranked_and_carry_node_probabilities(head: DraftHead) -> None:
    proposer = HeadProposer(head, TreeShape(depth=3, branching=3, beam=2, max_nodes=8))
    tokens = [5, 6, 7, 8, 9, 10]
    assert len(proposer.propose(tokens, 8)) == 0  # no features yet
    feed(proposer, tokens)
    tree = proposer.propose(tokens, 8)
    tree.validate(VOCAB, max_nodes=8)
    assert 0 < len(tree) <= 8 and not tree.sampled
    depths = tree.depths()
    assert depths == sorted(depths) and max(depths) >= 2
    assert len(tree.node_probs) == len(tree)
    cumulative: list[float] = []
    for node, parent in enumerate(tree.parents):  # path probabilities shrink along every path
        cumulative.append(tree.node_probs[node] * (1.0 if parent == ROOT else cumulative[parent]))
        assert parent == ROOT or cumulative[node] <= cumulative[parent]
    # The cache holds only committed positions afterwards: proposing again gives the same tree.
    assert proposer.propose(tokens, 8) == tree


def test_levels_that_cannot_place_a_node_are_not_run_and_the_trees_stay_the_same(
    head: DraftHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A level is expanded only by frontier nodes more probable than the ``budget``-th best node so far: any
    child of the others ranks after it, so the trees are the ones a full expansion gives (a GPU head's, which
    does not prune), with fewer forwards."""
    generator = torch.Generator().manual_seed(5)
    contexts = [torch.randint(1, VOCAB, (8,), generator=generator).tolist() for _ in range(6)]
    full_level = HeadProposer._forward_level
    count = [0]

    def counting(self: HeadProposer, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        count[0] += 1
        return full_level(self, *args)

    monkeypatch.setattr(HeadProposer, "_forward_level", counting)
    trees: dict[bool, list[TokenTree]] = {}
    forwards: dict[bool, int] = {}
    for prune in (True, False):
        count[0] = 0
        trees[prune] = []
        for tokens in contexts:
            for budget in (2, 4, 8, 24):
                proposer = HeadProposer(head, TreeShape(depth=4, branching=4, beam=4, max_nodes=24))
                proposer._prunes = prune
                feed(proposer, tokens)
                trees[prune].append(proposer.propose(tokens, budget))
        forwards[prune] = count[0]
    assert trees[True] == trees[False]
    assert forwards[True] < forwards[False]


def test_level_forward_with_tree_mask_equals_sequential_drafting(head: DraftHead) -> None:
    """A depth-2 node's q, from the batched level forward, equals feeding its path one step at a time."""
    proposer = HeadProposer(head, TreeShape(depth=2, branching=3, beam=3, max_nodes=12))
    tokens = [11, 12, 13, 14, 15, 16, 17]
    feed(proposer, tokens)
    tree = proposer.propose(tokens, 12)
    features = torch.from_numpy(np.concatenate([proposer.features.since(0)]).astype(np.float32))[None]
    draft_index = {token: i for i, token in enumerate(head.draft_vocab.tolist())}
    depth_two = [n for n, p in enumerate(tree.parents) if p != ROOT]
    assert len({tree.parents[n] for n in depth_two}) > 1  # several parents expanded in one forward
    with torch.inference_mode():
        for node in depth_two:
            parent = tree.parents[node]
            cache = DynamicCache()
            context = head(features, torch.tensor([tokens[1:]]), past_key_values=cache)
            first_q = torch.softmax(context.logits[0, -1], dim=-1)
            assert float(first_q[draft_index[tree.token_ids[parent]]]) == pytest.approx(
                tree.node_probs[parent], rel=1e-4
            )
            step = head(context.features[:, -1:], torch.tensor([[tree.token_ids[parent]]]), past_key_values=cache)
            q = torch.softmax(step.logits[0, -1], dim=-1)
            assert float(q[draft_index[tree.token_ids[node]]]) == pytest.approx(tree.node_probs[node], rel=1e-3)


def test_a_context_past_the_known_features_is_fed_on_the_heads_own_features(head: DraftHead) -> None:
    """Pre-drafting: tokens without target features are fed with the head's predicted ones, then dropped."""
    shape = TreeShape(depth=2, branching=3, beam=2, max_nodes=6)
    proposer = HeadProposer(head, shape)
    tokens = [21, 22, 23, 24, 25, 26]
    feed(proposer, tokens)
    plain = proposer.propose(tokens, 6)
    ahead = proposer.propose([*tokens, 7, 9], 6)  # an outcome of the round under verification
    # The same tree, grown by hand: feed the committed pairs, then (predicted feature, token) one at a time.
    with torch.inference_mode():
        cache = DynamicCache()
        features = torch.from_numpy(proposer.features.since(0).astype(np.float32))[None]
        out = head(features, torch.tensor([tokens[1:]]), past_key_values=cache)
        for position, token in enumerate((7, 9), start=len(tokens) - 1):
            out = head(
                out.features[:, -1:],
                torch.tensor([[token]]),
                position_ids=torch.tensor([[position]]),
                past_key_values=cache,
            )
        q = torch.softmax(out.logits[0, -1], dim=-1)
    first = [i for i, parent in enumerate(ahead.parents) if parent == ROOT]
    draft_index = {token: i for i, token in enumerate(head.draft_vocab.tolist())}
    for node in first:
        assert float(q[draft_index[ahead.token_ids[node]]]) == pytest.approx(ahead.node_probs[node], rel=1e-3)
    assert proposer.propose([*tokens, 7, 9], 6) == ahead  # the speculative prefix is reused, not refed wrongly
    assert proposer.propose(tokens, 6) == plain  # the committed context is untouched
    # When the target's real features come, the speculative entries go: the same as a fresh proposer.
    committed = [*tokens, 7, 9]
    feed(proposer, committed)
    fresh = HeadProposer(head, shape)
    feed(fresh, committed)
    tree, expected = proposer.propose(committed, 6), fresh.propose(committed, 6)
    assert tree.token_ids == expected.token_ids and tree.parents == expected.parents
    assert tree.node_probs == pytest.approx(expected.node_probs, rel=1e-4)  # (float rounding of other shapes)


def test_a_long_backlog_is_digested_in_steps_and_drafts_as_if_fed_at_once(
    head: DraftHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    import draft_service.head_proposer as module

    monkeypatch.setattr(module, "SYNC_FEED_ROWS", 8)
    monkeypatch.setattr(module, "DIGEST_ROWS", 5)
    shape = TreeShape(depth=2, branching=3, beam=2, max_nodes=6)
    tokens = [(7 * i) % (VOCAB - 1) + 1 for i in range(30)]
    proposer = HeadProposer(head, shape)
    feed(proposer, tokens)  # 29 rows at once: more than a proposal feeds itself
    assert len(proposer.propose(tokens, 6)) == 0  # nothing yet: no proposal waits for the backlog
    steps = 0
    while proposer.digest(tokens):
        steps += 1
    assert steps == 5  # 29 rows, 5 per step, until at most 8 are left for the proposal
    tree = proposer.propose(tokens, 6)
    monkeypatch.setattr(module, "SYNC_FEED_ROWS", 64)
    at_once = HeadProposer(head, shape)
    feed(at_once, tokens)
    expected = at_once.propose(tokens, 6)
    assert tree.token_ids == expected.token_ids and tree.parents == expected.parents
    assert tree.node_probs == pytest.approx(expected.node_probs, rel=1e-4)


def test_the_builder_calibrates_nodes_that_carry_q() -> None:
    assert credit_label("draft_model", 0.73) == "draft_model@q7"
    assert credit_label("draft_model", 1.0) == "draft_model@q9"
    assert credit_label("prompt_lookup", None) == "prompt_lookup"
    tree = TokenTree((4, 5), (ROOT, ROOT), node_probs=(0.9, 0.05))
    built = TreeBuilder(AcceptanceStats(), FREE).build([("draft_model", tree)], 4)
    assert built.sources == (frozenset({"draft_model@q9"}), frozenset({"draft_model@q0"}))
    assert built.scores[0] == pytest.approx(0.9) and built.scores[1] == pytest.approx(0.05)
    # An expensive verifier drops the unlikely draft: the gate is the learnt estimate against the cost.
    costly = TreeBuilder(AcceptanceStats(), VerifyCost({0: 1.0, 1: 1.5, 2: 1.6}))
    assert costly.build([("draft_model", tree)], 4).tree.token_ids == (4,)


SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=7)


def root_q(head: DraftHead, proposer: HeadProposer, tokens: list[int]) -> torch.Tensor:
    """The head's draft logits for the token after ``tokens`` (all positions fed with the target's features)."""
    features = torch.from_numpy(proposer.features.since(0).astype(np.float32))[None]
    with torch.inference_mode():
        return head(features, torch.tensor([tokens[1:]])).logits[0, -1]


def test_coupled_children_are_the_heads_gumbel_top_k_under_the_targets_noise(head: DraftHead) -> None:
    """At temperature > 0 the root's children, in order, are the Gumbel top-k of the head's tempered q with the
    noise the target samples position len(tokens) with; each carries the q of its rank."""
    tokens = [5, 6, 7, 8, 9, 10]
    shape = TreeShape(depth=1, branching=3, beam=1, max_nodes=3)
    for seed in range(5):
        sampling = SamplingParams(temperature=0.8, top_k=20, seed=seed)
        proposer = HeadProposer(head, shape, sampling)
        feed(proposer, tokens)
        tree = proposer.propose(tokens, 3)
        log_q = torch.log(target_probs(root_q(head, proposer, tokens)[None], sampling)[0])
        g = PositionNoise(seed, len(tokens)).gumbel(0, head.draft_vocab.numpy())
        expected = head.draft_vocab[torch.topk(log_q.double() + g, 3).indices].tolist()
        assert list(tree.token_ids) == expected and tree.parents == (ROOT, ROOT, ROOT)
        assert tree.node_probs == pytest.approx(torch.topk(log_q, 3).values.exp().tolist(), rel=1e-5)
    greedy = HeadProposer(head, shape, SamplingParams(temperature=0.8))  # no seed: nothing to couple with
    feed(greedy, tokens)
    top = torch.topk(root_q(head, greedy, tokens), 3).indices
    assert list(greedy.propose(tokens, 3).token_ids) == head.draft_vocab[top].tolist()


def test_the_coupled_first_child_is_the_targets_token_as_often_as_the_tv_bound_says(head: DraftHead) -> None:
    """Over contexts and seeds, the head's first coupled child equals the target's keyed sample at least as
    often as the mean of (1 - TV(p, q)) / (1 + TV(p, q)) (within 4 sigma), far more than an independent draw."""
    generator = torch.Generator().manual_seed(5)
    ids = head.draft_vocab.numpy()
    matches = independent = trials = 0
    bounds: list[float] = []
    for _ in range(12):
        tokens = torch.randint(1, VOCAB, (8,), generator=generator).tolist()
        proposer = HeadProposer(head, TreeShape(depth=1, branching=1, beam=1, max_nodes=1), SAMPLED)
        feed(proposer, tokens)
        with torch.inference_mode():
            p = target_probs(TARGET(input_ids=torch.tensor([tokens])).logits[0, -1:], SAMPLED)[0].double()
        q = torch.zeros_like(p)
        q[head.draft_vocab] = target_probs(root_q(head, proposer, tokens)[None], SAMPLED)[0].double()
        tv = float((p - q).abs().sum() / 2)
        for seed in range(150):
            target = PositionNoise(seed, len(tokens)).sample(p, 0)
            draft = int(torch.argmax(q[head.draft_vocab].log() + PositionNoise(seed, len(tokens)).gumbel(0, ids)))
            matches += int(head.draft_vocab[draft]) == target
            other = int(torch.argmax(q[head.draft_vocab].log() + PositionNoise(seed + 1000, 0).gumbel(0, ids)))
            independent += int(head.draft_vocab[other]) == target
            bounds.append((1 - tv) / (1 + tv))
            trials += 1
        assert proposer.propose(tokens, 1).token_ids == (
            int(
                head.draft_vocab[torch.argmax(q[head.draft_vocab].log() + PositionNoise(7, len(tokens)).gumbel(0, ids))]
            ),
        )
    bound = float(np.mean(bounds))
    assert matches / trials > bound - 4 * (bound * (1 - bound) / trials) ** 0.5
    assert matches > 4 * independent  # 653 of 1,800 against 38 (bound 0.34) when written


def generate(
    head: DraftHead,
    request: GenerationRequest,
    fingerprint: str = "fp",
    predraft_outcomes: int = 0,
    sources: tuple[str, ...] = ("draft_model",),
    coupled_sampling: bool = True,
) -> tuple[list[int], GenerationStats, PredraftCounts]:
    """Tokens and stats of ``request``, and the drafter's own pre-drafting totals (its metrics)."""
    head.target_fingerprint = fingerprint
    pool = InMemoryNgramPool()
    drafter = Drafter(
        lambda *_: pool,
        sources=sources,
        cost=FREE,
        draft_head=head,
        predraft_outcomes=predraft_outcomes,
        coupled_sampling=coupled_sampling,
    )
    generation = Generation(
        request,
        InProcessVerifier(Verifier(TARGET, "fp")),
        InProcessDrafter(drafter, predraft=predraft_outcomes > 0),
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=8),
    )
    tokens, _, stats = run_generation(generation)
    return tokens, stats, drafter.predraft_counts


@pytest.mark.parametrize(("sampling", "coupled"), [(SamplingParams(), True), (SAMPLED, True), (SAMPLED, False)])
def test_generation_with_the_draft_head_is_plain_decoding(
    head: DraftHead, sampling: SamplingParams, coupled: bool
) -> None:
    prompt = [2, 7, 1, 8, 2, 8]
    tokens, stats, _ = generate(head, GenerationRequest(prompt, 40, sampling), coupled_sampling=coupled)
    assert tokens == plain_decode(TARGET, prompt, 40, sampling)
    assert not stats.drafter_error
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert stats.num_rounds < 40


def test_coupled_drafts_are_accepted_more_often_than_the_heads_top_k_when_sampling(head: DraftHead) -> None:
    """The same sampled requests, the same output, more tokens a round with coupled drafts."""
    accepted = {True: 0, False: 0}
    for seed in range(4):
        request = GenerationRequest([2, 7, 1, 8, 2, 8], 40, SamplingParams(temperature=1.0, seed=seed))
        outputs = []
        for coupled in (True, False):
            tokens, stats, _ = generate(head, request, coupled_sampling=coupled)
            outputs.append(tokens)
            accepted[coupled] += stats.num_accepted_tokens
        assert outputs[0] == outputs[1]
    assert accepted[True] > 3 * accepted[False], accepted  # 92 against 7 when written


def test_concurrent_sampled_sessions_with_coupled_drafts_share_steps_and_each_is_plain_decoding(
    head: DraftHead,
) -> None:
    """Four seeded sessions (two temperatures, one with top-p) drafted by one drafter and verified in shared
    engine steps: each is exactly its own plain seeded decoding."""
    head.target_fingerprint = "fp"
    pool = InMemoryNgramPool()
    drafter = InProcessDrafter(Drafter(lambda *_: pool, sources=("draft_model",), cost=FREE, draft_head=head))
    verifier = Verifier(TARGET, "fp")
    requests = [
        GenerationRequest([2, 7, 1, 8], 32, SamplingParams(temperature=0.7, seed=1)),
        GenerationRequest([3, 1, 4, 1, 5], 32, SamplingParams(temperature=1.0, seed=2)),
        GenerationRequest([9, 2, 6], 32, SamplingParams(temperature=0.7, top_p=0.9, seed=3)),
        GenerationRequest([5, 3, 5], 32, SamplingParams(temperature=1.0, top_k=10, seed=4)),
    ]
    finished: list[GenerationStats] = []

    async def run(request: GenerationRequest) -> list[int]:
        generation = Generation(
            request, InProcessVerifier(verifier), drafter, CharTokenizer(), frozenset({-1}), "fp", RoundPolicy(8)
        )
        tokens: list[int] = []
        async for event in generation.stream():
            if isinstance(event, GenerationStats):
                finished.append(event)
            else:
                tokens.extend(event.token_ids)
        return tokens

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(run(r) for r in requests)))

    outputs = asyncio.run(together())
    steps = verifier.stats().num_steps
    verifier.close()
    for request, output in zip(requests, outputs, strict=True):
        assert output == plain_decode(TARGET, request.prompt_ids, 32, request.sampling)
    assert sum(stats.num_accepted_tokens for stats in finished) > 0  # coupled drafts were accepted
    assert steps < sum(stats.num_rounds for stats in finished) + len(requests)  # prefills and rounds shared steps


@pytest.mark.parametrize("head_matmul", ["linear", "packed"])
def test_a_bf16_head_drafts_and_the_output_stays_plain_decoding(head: DraftHead, head_matmul: str) -> None:
    """The drafter runs its head in bf16 where the CPU does so natively (--head-dtype auto): fp32 features in.

    Its products on F.linear and, where this CPU has a packed bf16 kernel, on prepacked weights.
    """
    half, choice = in_serving_dtype(copy.deepcopy(head), "bfloat16", head_matmul)
    assert half.draft_lm_head.dtype == torch.bfloat16 and choice.reason == "requested"
    assert (half.packing == "none") == (head_matmul == "linear" or "F.linear" in half.products)
    prompt = [2, 7, 1, 8, 2, 8]
    tokens, stats, _ = generate(half, GenerationRequest(prompt, 40))
    assert tokens == plain_decode(TARGET, prompt, 40, SamplingParams())
    assert not stats.drafter_error
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_the_packed_fp32_head_drafts_the_f_linear_heads_trees(head: DraftHead) -> None:
    """Prepacked products round unlike F.linear only in the last bits: the same trees, q within rounding."""
    packed, _ = in_serving_dtype(copy.deepcopy(head), "float32", "packed")
    plain, _ = in_serving_dtype(copy.deepcopy(head), "float32", "linear")
    assert plain.packing == "none"
    shape = TreeShape(depth=3, branching=3, beam=4, max_nodes=16)
    for tokens in ([5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17], [2, 7, 1, 8, 2, 8, 1, 8]):
        trees = []
        for drafter in (plain, packed):
            proposer = HeadProposer(drafter, shape)
            feed(proposer, tokens)
            trees.append(proposer.propose(tokens, 16))
        want, got = trees
        assert len(want) > 0 and got.token_ids == want.token_ids and got.parents == want.parents
        np.testing.assert_allclose(got.node_probs, want.node_probs, rtol=1e-4, atol=1e-6)


ALL_THREE = ("prompt_lookup", "token_recycling", "draft_model")


@pytest.mark.parametrize(
    ("sampling", "sources"),
    [
        (SamplingParams(), ("draft_model",)),
        (SamplingParams(), ALL_THREE),
        # The tiny head rarely guesses a bonus token sampled from a flat distribution: a peaked one (low
        # temperature, top-k 3) gives the pre-drafted path a few hits (4 of 23 trees when written).
        (SamplingParams(temperature=0.3, top_k=3, seed=11), ALL_THREE),
    ],
)
def test_predrafted_and_fresh_trees_both_keep_plain_decoding(
    head: DraftHead, sampling: SamplingParams, sources: tuple[str, ...]
) -> None:
    prompt = [2, 7, 1, 8, 2, 8]
    tokens, stats, counts = generate(
        head, GenerationRequest(prompt, 48, sampling), predraft_outcomes=3, sources=sources
    )
    assert tokens == plain_decode(TARGET, prompt, 48, sampling)
    assert not stats.drafter_error
    # Both paths ran: trees drafted ahead for the outcome that happened, and trees drafted afresh after a miss.
    assert 0 < stats.num_predraft_hits < stats.num_drafter_trees
    assert stats.predraft_hidden_ns > 0
    # The drafter counts the same hits (specserve_drafter_predraft_hits_total), and the trees it drafted ahead.
    assert counts.used == stats.num_predraft_hits < counts.drafted


def test_a_head_for_another_vocabulary_is_refused_per_session(head: DraftHead) -> None:
    tokens, stats, _ = generate(head, GenerationRequest([1, 2, 3], 8), fingerprint="other")
    assert tokens == plain_decode(TARGET, [1, 2, 3], 8, SamplingParams())
    assert "trained for the vocabulary other" in stats.drafter_error


def test_the_session_collects_forwarded_features(head: DraftHead) -> None:
    head.target_fingerprint = "fp"
    drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=("draft_model",), draft_head=head)
    assert drafter.wants_features and drafter.vocab_fingerprint == "fp"
    session = drafter.open_session("s", [1, 2, 3], "fp")
    session.propose(DraftFeedback((4,), (), np.zeros((3, 64), dtype=np.float16)), 0)
    session.propose(DraftFeedback((5, 6), (), np.ones((2, 64), dtype=np.float16)), 0)
    assert session.wants_features and session.tokens == [1, 2, 3, 4, 5, 6]
    (proposer,) = session._proposers
    assert isinstance(proposer, HeadProposer)
    log = proposer.features
    assert log.count == 5 == len(session.tokens) - 1
    assert log.since(3).tolist() == [[1.0] * 64] * 2
    assert not Drafter(lambda *_: InMemoryNgramPool()).wants_features


def test_the_draft_model_source_needs_a_head() -> None:
    with pytest.raises(ValueError, match="needs a draft head"):
        Drafter(lambda *_: InMemoryNgramPool(), sources=("draft_model",))


def test_feature_log_hands_out_rows_from_a_position() -> None:
    log = FeatureLog()
    log.extend(np.arange(6, dtype=np.float16).reshape(3, 2))
    log.extend(np.arange(6, 10, dtype=np.float16).reshape(2, 2))
    assert log.count == 5
    assert log.since(2).tolist() == [[4, 5], [6, 7], [8, 9]]
    assert log.since(4).tolist() == [[8, 9]]
