"""Prompt lookup and pool proposers on literal arrays (in the style of vLLM's n-gram tests)."""

import numpy as np
import pytest

from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool, PoolShape
from draft_service.proposers import PoolProposer, PromptLookupProposer, suffix_matches
from draft_service.tree_builder import AcceptanceStats, VerifyCost
from specserve.results import DraftFeedback
from specserve.sampling import SamplingParams


@pytest.mark.parametrize(
    ("tokens", "starts", "n"),
    [
        ([1, 2, 3, 4, 1, 2, 3], [3], 3),  # suffix 1,2,3 seen at 0; continuation starts at 3
        ([1, 2, 3, 4, 5], [], 0),  # no repeat
        ([1, 2, 9, 1, 2, 8, 1, 2], [5, 2], 2),  # every match of the longest n, most recent first
        ([7, 7], [], 0),  # too short for min_ngram=2
        ([5, 6, 5, 6, 5, 6], [4], 4),  # overlapping match of max_ngram
    ],
)
def test_suffix_matches(tokens: list[int], starts: list[int], n: int) -> None:
    found, length = suffix_matches(np.array(tokens), min_ngram=2, max_ngram=4)
    assert (found.tolist(), length) == (starts, n)


def test_prompt_lookup_proposes_the_continuation_chain() -> None:
    proposer = PromptLookupProposer(min_ngram=2, max_ngram=3, max_depth=3)
    tree = proposer.propose([10, 11, 12, 13, 14, 15, 10, 11], max_nodes=8)
    assert tree.token_ids == (12, 13, 14)
    assert tree.is_chain()


def test_prompt_lookup_merges_several_matches_into_a_tree() -> None:
    # Suffix (1, 2) occurred twice: followed by 3, 4 (older) and by 5, 6 (more recent).
    proposer = PromptLookupProposer(min_ngram=2, max_ngram=2, max_candidates=3, max_depth=2)
    tree = proposer.propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], max_nodes=8)
    assert tree.token_ids == (5, 6, 3, 4)
    assert tree.parents == (-1, 0, -1, 2)
    budget = proposer.propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], max_nodes=3)
    assert budget.token_ids == (5, 6, 3)


def test_prompt_lookup_respects_budget_and_end_of_context() -> None:
    proposer = PromptLookupProposer(min_ngram=2, max_ngram=3, max_candidates=1)
    assert proposer.propose([1, 2, 3, 1, 2], max_nodes=10).token_ids == (3, 1, 2)
    assert len(proposer.propose([1, 2, 3, 1, 2], max_nodes=0)) == 0
    assert len(proposer.propose([1, 2, 3, 4], max_nodes=5)) == 0


def test_pool_proposer_uses_the_most_frequent_continuation() -> None:
    pool = InMemoryNgramPool(PoolShape(key_len=2, continuation_len=3))
    pool.record([1, 2, 3, 4, 5])
    pool.record([1, 2, 7, 7, 7])
    pool.record([9, 1, 2, 3, 4, 5])
    tree = PoolProposer(pool).propose([8, 8, 1, 2], max_nodes=6)
    assert tree.token_ids == (3, 4, 5, 7, 7, 7)
    assert tree.parents == (-1, 0, 1, -1, 3, 4)
    assert PoolProposer(pool).propose([8, 8, 1, 2], max_nodes=2).token_ids == (3, 4)


def test_draft_session_records_only_generated_output_and_falls_back_to_the_pool() -> None:
    pool = InMemoryNgramPool(PoolShape(key_len=2, continuation_len=2))
    drafter = Drafter(lambda *_: pool, cost=VerifyCost({0: 1.0, 64: 1.0}))  # free verification: keep all
    first = drafter.open_session("a", [1, 2, 3, 4, 5], "fp")
    first.propose(DraftFeedback((6, 7)), max_nodes=4)
    # A window counts once it reaches into the output; windows wholly in the prompt do not.
    assert pool.lookup([4, 5]) == [(6, 7)]
    assert pool.lookup([3, 4]) == [(5, 6)]
    assert pool.lookup([1, 2]) == []
    second = drafter.open_session("b", [9, 8, 4, 5], "fp")
    tree = second.propose(DraftFeedback(), max_nodes=4).tree
    assert tree.token_ids[:2] == (6, 7)


def test_sampled_and_greedy_sessions_learn_acceptance_apart() -> None:
    """What greedy sessions taught about a source (accepted every time) is not what a sampled session expects:
    its drafts are accepted only when they hold the target's random draw."""
    pool = InMemoryNgramPool(PoolShape(key_len=2, continuation_len=2))
    drafter = Drafter(lambda *_: pool, sources=("prompt_lookup",), cost=VerifyCost({0: 1.0, 64: 1.0}))
    prompt = [1, 2, 3, 1, 2]
    teacher = drafter.open_session("a", prompt, "fp")
    for _ in range(20):  # prompt lookup proposes 3, 1, 2 after "1 2"; the verifier accepts its first node
        tree = teacher.propose(DraftFeedback(), max_nodes=1).tree
        assert tree.token_ids == (3,)
        teacher.propose(DraftFeedback((3, 1, 2), accepted_node_indices=(0,)), max_nodes=0)
    greedy = drafter.open_session("b", prompt, "fp")
    sampled = drafter.open_session("c", prompt, "fp", sampling=SamplingParams(temperature=0.7, seed=1))
    learnt = greedy._builder.stats.estimate("prompt_lookup", 1)
    fresh = sampled._builder.stats.estimate("prompt_lookup", 1)
    assert learnt > 0.8 and fresh == pytest.approx(AcceptanceStats().prior)
