"""The surgery pre-drafting and structured output do on a drafted tree (``draft_service.draft_tree``)."""

from __future__ import annotations

import pytest

from draft_service.draft_tree import EMPTY, DraftTree
from specserve.results import VerifiedTree
from specserve.token_tree import ROOT, TokenTree

A, B = frozenset({"a"}), frozenset({"b"})


def draft() -> DraftTree:
    """10 -> (11 -> 13, 12): scores are path acceptance estimates, so a child's never exceeds its parent's."""
    tree = TokenTree((10, 11, 12, 13), (ROOT, 0, 0, 1))
    return DraftTree(tree, (A, A, B, A), (0.8, 0.6, 0.1, 0.3))


def test_a_tree_finds_the_node_a_path_of_tokens_reaches() -> None:
    tree = draft().tree
    assert tree.find([]) == ROOT and tree.find([10, 11, 13]) == 3 and tree.find([10, 12]) == 2
    assert tree.find([11]) is None and tree.find([10, 13]) is None
    assert tree.node_at([10, 11]) == 1
    with pytest.raises(AssertionError, match="does not spell"):
        tree.node_at([12])


def test_a_cut_keeps_the_first_nodes_with_their_sources_and_scores() -> None:
    cut = draft().cut(2)
    assert cut.tree == TokenTree((10, 11), (ROOT, 0)) and cut.sources == (A, A) and cut.scores == (0.8, 0.6)
    assert draft().cut(4) == draft()


def test_a_subtree_is_rooted_at_the_path_s_node_with_scores_relative_to_it() -> None:
    under = draft().subtree([10])
    assert under is not None
    assert under.tree == TokenTree((11, 12, 13), (ROOT, ROOT, 0)) and under.sources == (A, B, A)
    assert under.scores == pytest.approx((0.75, 0.125, 0.375))
    assert draft().subtree([]) == draft()
    assert draft().subtree([12]) is None


def test_a_graft_hangs_the_tree_under_a_certain_chain() -> None:
    grafted = draft().grafted_under([5, 6])
    assert grafted.tree == TokenTree((5, 6, 10, 11, 12, 13), (ROOT, 0, 1, 2, 2, 3))
    assert grafted.sources == (frozenset(), frozenset(), A, A, B, A)
    assert grafted.scores == (1.0, 1.0, 0.8, 0.6, 0.1, 0.3)
    assert draft().grafted_under([]) == draft()
    assert EMPTY.grafted_under([5]) == DraftTree(TokenTree.chain([5]), (frozenset(),), (1.0,))
    assert grafted.subtree([5, 6]) == draft()  # re-rooting undoes a graft


def test_a_verified_tree_gets_our_estimates_given_the_parent_and_forced_nodes_their_parent_s() -> None:
    # The coordinator kept 10 -> 11, dropped 12, forced 20 under 11 and added 30 at the root, which we never drafted.
    verified = VerifiedTree(TokenTree((10, 30, 11, 20), (ROOT, ROOT, 0, 2)), forced=(False, False, False, True))
    scored = draft().estimates_for(verified)
    assert scored.tree == verified.tree and scored.sources == (frozenset(),) * 4
    assert scored.scores == pytest.approx((0.8, 0.0, 0.6, 0.6))
