import pytest

from specserve.token_tree import InvalidTreeError, TokenTree


def test_chain_links_each_node_to_the_previous_one() -> None:
    tree = TokenTree.chain([5, 6, 7])
    assert tree.parents == (-1, 0, 1)
    assert tree.is_chain()
    assert tree.depths() == [1, 2, 3]
    assert tree.path_to(2) == [0, 1, 2]


def test_branching_tree_is_not_a_chain() -> None:
    tree = TokenTree((5, 6, 7), (-1, -1, 0))
    assert not tree.is_chain()
    assert tree.depths() == [1, 1, 2]
    assert tree.path_to(2) == [0, 2]


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (TokenTree((1, 2), (-1,)), "same length"),
        (TokenTree((1, 99), (-1, 0)), "outside the vocabulary"),
        (TokenTree((1, -3), (-1, 0)), "outside the vocabulary"),
        (TokenTree((1, 2), (-1, 5)), "out of range"),
        (TokenTree((1, 2), (-1, -2)), "out of range"),
        (TokenTree((1, 2), (1, -1)), "parents must come before"),
        (TokenTree((1, 2), (-1, 1)), "parents must come before"),
        (TokenTree((1,) * 5, (-1, 0, 1, 2, 3)), "at most 4"),
    ],
)
def test_validate_names_the_problem(tree: TokenTree, message: str) -> None:
    with pytest.raises(InvalidTreeError, match=message):
        tree.validate(vocab_size=10, max_nodes=4)


def test_validate_limits_depth() -> None:
    with pytest.raises(InvalidTreeError, match="3 deep"):
        TokenTree.chain([1, 2, 3]).validate(vocab_size=10, max_nodes=8, max_depth=2)
    TokenTree((1, 2, 3), (-1, -1, 0)).validate(vocab_size=10, max_nodes=8, max_depth=2)


def test_empty_tree_is_valid() -> None:
    TokenTree().validate(vocab_size=10, max_nodes=4)
    assert TokenTree().is_chain()
