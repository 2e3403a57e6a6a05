"""Merging sources' trees, scoring, cost-aware sizing and online learning."""

from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.proposers import SuccessorTable, TokenRecyclingProposer
from draft_service.tree_builder import (
    EXPLORE_TRIES,
    AcceptanceStats,
    DraftTree,
    TreeBuilder,
    VerifyCost,
    is_accepted_path,
    learn_from_acceptance,
    likely_outcomes,
)
from specserve.token_tree import TokenTree

FREE = VerifyCost({0: 1.0, 64: 1.0})  # verification costs nothing extra: keep every node


def test_shared_prefixes_merge_and_credit_every_source() -> None:
    a = TokenTree.from_paths([[1, 2, 3]])
    b = TokenTree.from_paths([[1, 2, 4], [5]])
    built = TreeBuilder(AcceptanceStats(), FREE).build([("a", a), ("b", b)], max_nodes=16)
    paths = {tuple(built.tree.token_ids[i] for i in built.tree.path_to(n)) for n in range(len(built.tree))}
    assert paths == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (5,)}
    node_12 = next(n for n in range(len(built.tree)) if built.tree.path_to(n) and len(built.tree.path_to(n)) == 2)
    assert built.sources[node_12] == frozenset({"a", "b"})
    built.tree.validate(vocab_size=10, max_nodes=16)


def test_scores_follow_learnt_acceptance_and_order_siblings() -> None:
    stats = AcceptanceStats(prior_weight=1.0)
    for _ in range(50):
        stats.update("good", 1, True)
        stats.update("bad", 1, False)
    built = TreeBuilder(stats, FREE).build([("bad", TokenTree.chain([7])), ("good", TokenTree.chain([8]))], 8)
    assert built.tree.token_ids == (8, 7)  # the likelier sibling first
    assert built.scores[0] > 0.9 > 0.1 > built.scores[1]


def test_budget_keeps_the_best_nodes_and_stays_a_tree() -> None:
    stats = AcceptanceStats(prior=0.5)
    tree = TokenTree.from_paths([[1, 2, 3, 4], [5, 6]])
    built = TreeBuilder(stats, FREE).build([("s", tree)], max_nodes=3)
    assert len(built.tree) == 3
    assert built.tree.token_ids == (1, 5, 2)  # depth-1 nodes (0.5) before depth-2 (0.25)
    built.tree.validate(vocab_size=10, max_nodes=3)


def test_expensive_verification_shrinks_or_empties_the_tree() -> None:
    steep = VerifyCost({0: 1.0, 1: 1.5, 8: 3.0})
    unlikely = AcceptanceStats(prior=0.2, prior_weight=1000)  # tried often enough, and 1 in 5 accepted
    for accepted in [True] + [False] * (EXPLORE_TRIES * 4 - 1):
        unlikely.update("s", 1, accepted)
    built = TreeBuilder(unlikely, steep).build([("s", TokenTree.chain([1, 2, 3]))], 8)
    assert len(built.tree) == 0  # 1.2 tokens for 1.5x the cost: plain decoding is better
    likely = AcceptanceStats(prior=0.99, prior_weight=100)
    built = TreeBuilder(likely, steep).build([("s", TokenTree.chain([1, 2, 3]))], 8)
    assert len(built.tree) == 3


def test_a_source_not_yet_tried_drafts_its_best_chain_until_it_has_been_verified() -> None:
    """At its prior an n-gram source never pays on a CPU, so it is tried EXPLORE_TRIES times, then judged."""
    cpu = VerifyCost({0: 1.0, 1: 1.6, 15: 1.72})
    shared = AcceptanceStats()  # the drafter's experience (prior 0.3: 1.3 tokens for 1.6x the cost)
    proposals = [("pool", TokenTree.from_paths([[1, 2, 3]]))]
    # A source with a draft probability starts from it: an unlikely node is not tried.
    model = [("model", TokenTree((9,), (-1,), node_probs=(0.2,)))]
    assert not TreeBuilder(AcceptanceStats(parent=shared), cpu).build(model, 8).tree.token_ids
    tries = 0
    while (built := TreeBuilder(AcceptanceStats(parent=shared), cpu).build(proposals, 8)).tree.token_ids:
        assert built.tree.token_ids == (1, 2, 3) and tries < EXPLORE_TRIES
        learn_from_acceptance(shared, built, [])  # rejected at once
        tries += 1
    assert tries == EXPLORE_TRIES
    # Accepted tries teach it instead: the source's chain pays and keeps drafting.
    taught = AcceptanceStats()
    for _ in range(EXPLORE_TRIES):
        built = TreeBuilder(AcceptanceStats(parent=taught), cpu).build(proposals, 8)
        learn_from_acceptance(taught, built, [i for i, t in enumerate(built.tree.token_ids) if t in (1, 2, 3)])
    assert {1, 2, 3} <= set(TreeBuilder(taught, cpu).build(proposals, 8).tree.token_ids)


def test_verify_cost_interpolates_and_extrapolates() -> None:
    cost = VerifyCost({0: 1.0, 4: 2.0, 8: 2.4})
    assert cost(0) == 1.0
    assert cost(2) == 1.5
    assert abs(cost(6) - 2.2) < 1e-9
    assert abs(cost(12) - 2.8) < 1e-9


def test_learning_credits_reached_nodes_only() -> None:
    stats = AcceptanceStats(prior=0.5, prior_weight=1.0)
    tree = TokenTree.from_paths([[1, 2, 3], [4]])
    last = DraftTree(tree, tuple(frozenset({"s"}) for _ in tree.token_ids), tuple(0.5 for _ in tree.token_ids))
    # Committed 1, 2 then the bonus 9: nodes 0 and 1 accepted, 4 rejected at depth 1, 3 rejected at depth 3.
    assert tree.token_ids == (1, 2, 3, 4)
    assert is_accepted_path(tree, [0, 1], [1, 2, 9])
    learn_from_acceptance(stats, last, [0, 1])
    assert stats.estimate("s", 1) == (1 + 0.5) / (2 + 1)
    assert stats.estimate("s", 2) == (1 + 0.5) / (1 + 1)
    assert stats.estimate("s", 3) == (0 + 0.5) / (1 + 1)


def test_session_statistics_start_from_the_drafter_wide_ones() -> None:
    shared = AcceptanceStats(prior=0.5, prior_weight=1.0)
    for _ in range(9):
        shared.update("s", 1, True)
    session = AcceptanceStats(parent=shared)
    assert session.estimate("s", 1) == shared.estimate("s", 1) == 0.95
    session.update("s", 1, False)
    assert shared.estimate("s", 1) < 0.95


def test_token_recycling_expands_breadth_first_from_the_last_token() -> None:
    table = SuccessorTable()
    table.update(1, [2, 3])
    table.update(2, [4, 5])
    table.update(3, [6])
    tree = TokenRecyclingProposer(table, widths=(2, 1)).propose([9, 1], max_nodes=8)
    assert tree.token_ids == (2, 3, 4, 6)
    assert tree.parents == (-1, -1, 0, 1)
    assert len(TokenRecyclingProposer(table).propose([7], max_nodes=8)) == 0
    assert len(TokenRecyclingProposer(table, widths=(2, 1)).propose([9, 1], max_nodes=3)) == 3


def test_successor_table_is_bounded() -> None:
    table = SuccessorTable(max_tokens=2)
    for token in range(3):
        table.update(token, [token + 1])
    assert len(table) == 2 and table.get(0) == ()


paths = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=5)


@settings(max_examples=200, deadline=None)
@given(proposals=st.lists(paths, min_size=1, max_size=3), budget=st.integers(0, 12), prior=st.floats(0.05, 0.95))
def test_built_trees_are_valid_within_budget_and_only_hold_proposed_paths(
    proposals: list[list[list[int]]], budget: int, prior: float
) -> None:
    sources = [(f"s{i}", TokenTree.from_paths(p)) for i, p in enumerate(proposals)]
    built = TreeBuilder(AcceptanceStats(prior=prior), VerifyCost()).build(sources, budget)
    tree = built.tree
    tree.validate(vocab_size=6, max_nodes=max(budget, 0))
    proposed = {tuple(p[:k]) for group in proposals for p in group for k in range(1, len(p) + 1)}
    seen = set()
    for node in range(len(tree)):
        path = tuple(tree.token_ids[i] for i in tree.path_to(node))
        assert path in proposed
        assert path not in seen  # merged: no duplicate paths
        seen.add(path)
        parent = tree.parents[node]
        assert parent == -1 or built.scores[parent] >= built.scores[node]


def test_accepted_paths_are_checked_against_the_tree_and_the_committed_tokens() -> None:
    tree = TokenTree.from_paths([[1, 2, 3], [4]])
    assert is_accepted_path(tree, [], [7])
    assert is_accepted_path(tree, [3], [4, 8])
    assert not is_accepted_path(tree, [1], [2, 9])  # node 1 is not a child of the root
    assert not is_accepted_path(tree, [0, 1], [1, 5, 9])  # node 1 is token 2, not 5
    assert not is_accepted_path(tree, [0, 9], [1, 2, 9])  # no node 9
    assert not is_accepted_path(tree, [0, 1], [1])  # more nodes than committed tokens


def test_likely_outcomes_put_the_drafts_best_path_first_then_by_probability() -> None:
    # Root children 1 (0.6) and 4 (0.3); 1 -> 2 (0.5) -> 3 (0.1).
    tree = TokenTree.from_paths([[1, 2, 3], [4]])
    last = DraftTree(tree, tuple(frozenset({"s"}) for _ in tree.token_ids), (0.6, 0.5, 0.1, 0.3))
    # Alone: root 1 - 0.9 = 0.1, node 1: 0.6 - 0.5 = 0.1, node 2: 0.5 - 0.1 = 0.4, node 3: 0.1, node 4: 0.3.
    assert likely_outcomes(last, 3) == [(1, 2, 3), (1, 2), (4,)]
    assert likely_outcomes(DraftTree(TokenTree(), (), ()), 3) == [()]
    assert likely_outcomes(last, 0) == []
