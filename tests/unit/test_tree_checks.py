"""Drafter trees are checked against the verifier's limits before a Verify; bad ones never reach it."""

import pytest

from bench.inproc import InProcessVerifier
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, RoundPolicy
from coordinator.tree_checks import TreeLimits, tree_problem
from draft_service.ngram_pool import InMemoryNgramPool, PoolShape
from specserve.errors import InvalidArgument
from specserve.results import DraftFeedback, DraftReply, VerifyResult
from specserve.token_tree import DraftDistribution, TokenTree
from specserve.verify_call import VerifyCall
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_greedy, run_generation, tiny_llama

LIMITS = TreeLimits(vocab_size=100, max_nodes=8, max_depth=4, supports_branching=True)
VOCAB = 16
MODEL = tiny_llama(vocab_size=VOCAB)


def test_a_good_tree_passes() -> None:
    assert tree_problem(TokenTree((1, 2, 3), (-1, 0, -1)), LIMITS, 8) is None
    assert tree_problem(TokenTree(), LIMITS, 0) is None


@pytest.mark.parametrize(
    ("tree", "max_nodes", "limits", "message"),
    [
        (TokenTree((1, 100), (-1, 0)), 8, LIMITS, "outside the vocabulary"),
        (TokenTree((1, -1), (-1, 0)), 8, LIMITS, "outside the vocabulary"),
        (TokenTree.chain([1, 2, 3]), 2, LIMITS, "at most 2"),
        (TokenTree.chain([1] * 9), 16, LIMITS, "at most 8"),
        (TokenTree.chain([1] * 5), 8, LIMITS, "5 deep"),
        (TokenTree((1, 2), (-1, 1)), 8, LIMITS, "parents must come before"),
        (TokenTree((1, 2), (-1, -2)), 8, LIMITS, "out of range"),
        (TokenTree((1, 2), (-1,)), 8, LIMITS, "same length"),
        (TokenTree((1, 2), (-1, -1)), 8, TreeLimits(100, 8, 4, supports_branching=False), "chains only"),
        (TokenTree((1,), (-1,), node_probs=(float("nan"),)), 8, LIMITS, "node_probs"),
        (TokenTree((1, 2), (-1, 0), node_probs=(0.5,)), 8, LIMITS, "node_probs"),
        (TokenTree((1,), (-1,), sampled=(True,)), 8, LIMITS, "marked sampled"),
    ],
)
def test_bad_trees_are_named(tree: TokenTree, max_nodes: int, limits: TreeLimits, message: str) -> None:
    problem = tree_problem(tree, limits, max_nodes)
    assert problem is not None and message in problem


def test_within_vocab_drops_bad_nodes_with_their_subtrees() -> None:
    tree = TokenTree((1, 99, 2, 3, 4), (-1, -1, 1, 0, 3), node_probs=(0.9, 0.5, 0.4, 0.3, 0.2))
    kept = tree.within_vocab(50)
    assert kept == TokenTree((1, 3, 4), (-1, 0, 1), node_probs=(0.9, 0.3, 0.2))
    assert tree.within_vocab(0) is tree and tree.within_vocab(100) is tree
    sampled = TokenTree(
        (5, 6, 7),
        (-1, -1, 1),
        sampled=(True, True, False),
        distributions=(DraftDistribution(-1, (5, 6, 77), (0.5, 0.3, 0.2)),),
    )
    assert sampled.within_vocab(50) == TokenTree()
    assert tree_problem(kept, LIMITS, 8) is None


def test_pools_skip_continuations_outside_the_vocabulary() -> None:
    pool = InMemoryNgramPool(PoolShape(key_len=1, continuation_len=2))
    pool.record([1, 2, 3, 1, 2, 40])
    assert sorted(pool.lookup([1])) == [(2, 3), (2, 40)]
    pool.limit_vocab(20)
    assert pool.lookup([1]) == [(2, 3)]


class BadTreeStream:
    """A drafter stream sending whatever tree it was given, each round."""

    wants_features = False
    takes_verified_trees = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, tree: TokenTree) -> None:
        self.tree = tree
        self.closed = False

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        return DraftReply(self.tree if max_nodes else TokenTree())

    async def close(self) -> None:
        self.closed = True


class BadTreeDrafter:
    def __init__(self, tree: TokenTree) -> None:
        self.stream = BadTreeStream(tree)
        self.faults: list[str] = []

    async def open(
        self, session_id: str, prompt_tokens: object, vocab_fingerprint: str, sampling: object = None
    ) -> BadTreeStream:
        return self.stream

    def misbehaved(self, session_id: str, reason: str) -> None:
        self.faults.append(reason)


def run(generation: Generation) -> tuple[list[int], GenerationStats]:
    tokens, _, stats = run_generation(generation)
    return tokens, stats


def generation(drafter: BadTreeDrafter, limits: TreeLimits | None, verifier: object = None) -> Generation:
    return Generation(
        GenerationRequest([1, 2, 3], 12),
        verifier or InProcessVerifier(Verifier(MODEL, "fp")),  # type: ignore[arg-type]
        drafter,  # type: ignore[arg-type]
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=6, tree_limits=limits),
        drafter_monitor=drafter,
    )


def test_a_bad_tree_is_a_drafter_failure_and_the_round_goes_on_without_it() -> None:
    drafter = BadTreeDrafter(TokenTree.chain([3, VOCAB + 5]))
    tokens, stats = run(generation(drafter, TreeLimits(VOCAB, 32, 32)))
    assert tokens == plain_greedy(MODEL, [1, 2, 3], 12)
    assert "sent a bad tree" in stats.drafter_error and "outside the vocabulary" in stats.drafter_error
    assert len(drafter.faults) == 1 and drafter.stream.closed
    assert stats.num_draft_tokens == 0


class RejectingVerifier(InProcessVerifier):
    """Refuses every non-empty tree, as a verifier with stricter limits than it advertised would."""

    def __init__(self) -> None:
        super().__init__(Verifier(MODEL, "fp"))
        self.refused = 0

    async def verify(self, call: VerifyCall) -> VerifyResult:
        if len(call.tree):
            self.refused += 1
            raise InvalidArgument("tree has 2 nodes; this verifier accepts at most 1")
        return await super().verify(call)


def test_a_tree_the_verifier_rejects_is_retried_empty_and_counted_against_the_drafter() -> None:
    drafter = BadTreeDrafter(TokenTree.chain([3, 4]))
    verifier = RejectingVerifier()
    tokens, stats = run(generation(drafter, None, verifier))
    assert tokens == plain_greedy(MODEL, [1, 2, 3], 12)
    assert verifier.refused == 1 and len(drafter.faults) == 1
    assert "the verifier rejected its tree" in stats.drafter_error


def test_invalid_argument_for_an_empty_tree_still_fails_the_request() -> None:
    class Refusing(InProcessVerifier):
        async def verify(self, call: VerifyCall) -> VerifyResult:
            raise InvalidArgument("bad request")

    g = generation(BadTreeDrafter(TokenTree()), None, Refusing(Verifier(MODEL, "fp")))
    with pytest.raises(InvalidArgument):
        run(g)
