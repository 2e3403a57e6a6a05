"""The suffix source: frequency-scored trees from earlier occurrences, depth that follows its hits, losslessness."""

from __future__ import annotations

import pytest

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.rounds import Generation, GenerationRequest, RoundPolicy
from draft_service import suffix_source
from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool, PoolShape
from draft_service.suffix_source import SuffixProposer
from draft_service.tree_builder import VerifyCost
from specserve.results import DraftFeedback
from specserve.sampling import SamplingParams
from specserve.token_tree import ROOT
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_decode, run_generation, tiny_llama


def test_a_repeated_passage_is_drafted_as_the_chain_that_followed_it() -> None:
    text = [5, 1, 2, 3, 4, 6, 7, 8, 9, 5, 1, 2]
    tree = SuffixProposer(text).propose(text, 8)
    # [5, 1, 2] matched: three tokens deep at first (depth_factor 1).
    assert tree.token_ids == (3, 4, 6) and tree.parents == (ROOT, 0, 1)
    assert tree.node_probs == (1.0, 1.0, 1.0)


def test_places_that_went_on_differently_branch_with_their_shares() -> None:
    # After [1, 2]: 3 twice, 4 once (each matched by two tokens only: 8 and 9 precede them apart).
    text = [8, 1, 2, 3, 5, 9, 1, 2, 3, 6, 7, 1, 2, 4, 5, 0, 1, 2]
    tree = SuffixProposer(text).propose(text, 8)
    assert tree.token_ids[:2] == (3, 4) and tree.parents[:2] == (ROOT, ROOT)
    assert tree.node_probs[:2] == pytest.approx((2 / 3, 1 / 3))
    after_three = {tree.token_ids[n]: tree.node_probs[n] for n, p in enumerate(tree.parents) if p == 0}
    assert after_three == pytest.approx({5: 0.5, 6: 0.5})


def test_the_longest_match_wins_over_more_frequent_shorter_ones() -> None:
    # [7, 1, 2] went on with 9 once; [1, 2] alone went on with 3 three times.
    text = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 7, 1, 2, 9, 0, 7, 1, 2]
    assert SuffixProposer(text).propose(text, 3).token_ids[0] == 9


def test_rare_paths_are_not_drafted() -> None:
    # Eleven places went on with 3, one with 4: 4 is under MIN_SHARE.
    text = [t for _ in range(11) for t in (1, 2, 3, 0)] + [1, 2, 4, 0, 1, 2]
    tree = SuffixProposer(text).propose(text, 8)
    assert 4 not in tree.token_ids and tree.token_ids[0] == 3


def test_committed_tokens_are_indexed_and_a_context_ahead_of_them_drafts_from_them() -> None:
    proposer = SuffixProposer([4, 5, 6])
    assert len(proposer.propose([4, 5, 6], 4)) == 0  # nothing occurred before
    proposer.observe(DraftFeedback((7, 4, 5)))
    assert proposer.propose([4, 5, 6, 7, 4, 5], 2).token_ids == (6, 7)
    # Pre-drafting: a hypothetical outcome [6] after the committed text matches [5, 6] where it occurred.
    assert proposer.propose([4, 5, 6, 7, 4, 5, 6], 2).token_ids == (7, 4)


def test_the_tenants_pool_joins_only_where_the_session_matches_no_longer_than_its_key() -> None:
    pool = InMemoryNgramPool(PoolShape(key_len=2, continuation_len=3))
    pool.record([1, 2, 8, 8, 8])
    alone = SuffixProposer([6, 1, 2], pool)
    assert alone.propose([6, 1, 2], 4).token_ids == (8, 8)  # the session knows nothing after [1, 2]
    both = SuffixProposer([0, 1, 2, 3, 6, 1, 2], pool)  # a two-token match of its own: both count
    assert set(both.propose([0, 1, 2, 3, 6, 1, 2], 4).token_ids[:2]) == {3, 8}
    longer = SuffixProposer([6, 1, 2, 3, 0, 6, 1, 2], pool)  # a three-token match of its own: it wins
    assert longer.propose([6, 1, 2, 3, 0, 6, 1, 2], 4).token_ids[0] == 3
    assert 8 not in longer.propose([6, 1, 2, 3, 0, 6, 1, 2], 4).token_ids


def test_drafting_depth_follows_how_much_of_the_last_draft_was_confirmed() -> None:
    passage = list(range(10, 40))
    proposer = SuffixProposer([*passage, 0, *passage[:2]])
    committed = [*passage, 0, *passage[:2]]
    shallow = len(proposer.propose(committed, 32))
    assert shallow == 2  # a two-token match drafts two deep at first
    for _ in range(4):  # every draft confirmed by what is committed next
        tree = proposer.propose(committed, 32)
        proposer.observe(DraftFeedback(tree.token_ids))
        committed += tree.token_ids
    assert proposer.depth_factor > 2.5
    assert len(proposer.propose(committed, 32)) > shallow
    before = proposer.depth_factor
    for _ in range(3):  # now nothing it drafts is confirmed
        tree = proposer.propose(committed, 32)
        wrong = tuple(t + 100 for t in tree.token_ids)
        proposer.observe(DraftFeedback(wrong))
        committed += wrong
    assert proposer.depth_factor < before


def test_a_forgotten_index_drafts_nothing_and_holds_nothing() -> None:
    text = [1, 2, 3, 1, 2]
    proposer = SuffixProposer(text)
    assert proposer.nbytes > 0 and len(proposer.propose(text, 4)) > 0
    proposer.forget()
    assert proposer.nbytes == 0 and len(proposer.propose(text, 4)) == 0


def test_occurrences_counted_are_bounded() -> None:
    text = [1, 2, 3] * 500 + [1, 2]
    tree = SuffixProposer(text).propose(text, 4)
    assert tree.token_ids == (3, 1, 2, 3)  # every place agrees; the scan stopped at the bound


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_generation_with_the_suffix_source_is_plain_decoding(
    sampling: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repetitive prompt so the source drafts: output equals plain decoding, drafts were offered."""
    monkeypatch.setattr(suffix_source, "MAX_OCCURRENCES", 4)
    target = tiny_llama(vocab_size=48, seed=3, context=256)
    prompt = [3, 9, 4, 7, 5] * 6
    pool = InMemoryNgramPool()
    drafter = Drafter(lambda *_: pool, sources=("suffix",), cost=VerifyCost({0: 1.0, 64: 1.0}))
    generation = Generation(
        GenerationRequest(prompt, 40, sampling),
        InProcessVerifier(Verifier(target, "fp")),
        InProcessDrafter(drafter),
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=8),
    )
    tokens, _, stats = run_generation(generation)
    assert tokens == plain_decode(target, prompt, 40, sampling)
    assert not stats.drafter_error and stats.num_draft_tokens > 0
