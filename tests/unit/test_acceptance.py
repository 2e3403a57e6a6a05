"""Acceptance rules on literal trees and score rows."""

import pytest
import torch

from specserve.keyed_noise import PositionNoise
from specserve.token_tree import DraftDistribution, TokenTree
from target_service.acceptance import accept_greedy, accept_sampled

#        root
#       /    \
#     5(0)   6(1)
#     /  \      \
#   7(2) 8(3)   9(4)
TREE = TokenTree((5, 6, 7, 8, 9), (-1, -1, 0, 0, 1))


@pytest.mark.parametrize(
    ("argmax", "path", "bonus"),
    [
        # rows: root, node0..node4
        ([5, 8, 0, 0, 0, 0], [0, 3], 0),  # root->5, 5->8, 8 predicts 0
        ([6, 0, 9, 0, 0, 3], [1, 4], 3),
        ([4, 0, 0, 0, 0, 0], [], 4),  # nothing accepted: bonus is the root argmax
        ([5, 1, 0, 0, 0, 0], [0], 1),
    ],
)
def test_greedy_walks_the_argmax_path(argmax: list[int], path: list[int], bonus: int) -> None:
    result = accept_greedy(TREE, argmax)
    assert (result.path, result.bonus_token) == (path, bonus)


def test_greedy_ties_between_equal_siblings_go_to_the_lower_index() -> None:
    tree = TokenTree((5, 5, 7), (-1, -1, 1))
    assert accept_greedy(tree, [5, 0, 7, 2]).path == [0]


def test_greedy_on_a_chain() -> None:
    chain = TokenTree.chain([1, 2, 3])
    assert accept_greedy(chain, [1, 2, 9, 4]).path == [0, 1]
    assert accept_greedy(chain, [1, 2, 3, 4]).bonus_token == 4


def test_rows_must_match_the_tree() -> None:
    with pytest.raises(ValueError, match="need 6 target rows"):
        accept_greedy(TREE, [1, 2])


def test_sampled_rejects_impossible_tokens_and_never_resamples_them() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for seed in range(200):
        result = accept_sampled(TokenTree.chain([0]), p, PositionNoise(seed, 0))
        assert result.path == []
        assert result.bonus_token in (1, 2)


def test_sampled_rejected_siblings_are_excluded_from_the_bonus() -> None:
    # Two deterministic root children 0 and 1 where p(0) = p(1) = 0: only 2 can come out.
    p = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    tree = TokenTree((0, 1), (-1, -1))
    result = accept_sampled(tree, p, PositionNoise(0, 0))
    assert (result.path, result.bonus_token) == ([], 2)


def test_sampled_accepts_certain_tokens() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    result = accept_sampled(TokenTree.chain([1, 2]), p, PositionNoise(0, 0))
    assert (result.path, result.bonus_token) == ([0, 1], 0)


def test_sampled_child_with_q_equal_to_p_is_always_accepted() -> None:
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    q = DraftDistribution(-1, (0, 1), (0.25, 0.75))
    for seed, token in enumerate((0, 1, 0, 1)):
        tree = TokenTree((token,), (-1,), (True,), (q,))
        assert accept_sampled(tree, p, PositionNoise(seed, 7)).path == [0]
