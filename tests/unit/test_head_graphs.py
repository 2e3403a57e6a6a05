"""Tree growth in fixed slots (``head_graphs``), run eagerly on the CPU: the trees the session's cache grows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.draft_head import DraftHead, DraftHeadConfig
from draft_service.head_graphs import MIN_SLOTS, TreeGraphs, context_slots
from draft_service.head_proposer import HeadProposer, TreeShape
from draft_service.tree_growth import frontier_sizes
from specserve.results import DraftFeedback
from tests.conftest import tiny_llama

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, seed=4, context=1024)


@pytest.fixture(scope="module")
def head() -> DraftHead:
    """An untrained head: its trees are poor guesses, but well formed and sensitive to every input."""
    torch.manual_seed(6)
    config = DraftHeadConfig.for_target(TARGET.config, draft_vocab_size=48, intermediate_size=96)
    embedding = TARGET.get_input_embeddings().weight.detach()
    lm_head = TARGET.get_output_embeddings().weight.detach()
    built = DraftHead(config, embedding, lm_head, torch.arange(48)).eval()
    with torch.no_grad():  # sharper draft distributions than the initialisation's: fewer near-ties
        for parameter in built.parameters():
            parameter.mul_(3.0)
    return built


def fed(head: DraftHead, tokens: list[int], shape: TreeShape, graphs: TreeGraphs | None) -> HeadProposer:
    proposer = HeadProposer(head, shape, graphs=graphs)
    with torch.inference_mode():
        hidden = TARGET(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    proposer.observe(DraftFeedback(features=hidden[:-1].numpy().astype(np.float16)))
    while proposer.digest(tokens):  # a long context's features are fed between rounds
        pass
    return proposer


def test_context_buckets_double_from_the_smallest() -> None:
    assert [context_slots(n) for n in (0, 1, MIN_SLOTS, MIN_SLOTS + 1, 3 * MIN_SLOTS)] == [256, 256, 256, 512, 1024]
    assert frontier_sizes(4, 4, 4) == [4, 4, 4] and frontier_sizes(3, 8, 2) == [2, 4] and frontier_sizes(1, 4, 4) == []


def test_trees_grown_in_fixed_slots_are_the_ones_grown_over_the_sessions_cache(head: DraftHead) -> None:
    graphs = TreeGraphs(head, capture=False)
    rng = np.random.default_rng(0)
    shapes = (TreeShape(depth=4, branching=4, beam=4, max_nodes=24), TreeShape(depth=3, branching=2, beam=3))
    same = total = 0
    for length in (5, 40, 300):  # the last past the first bucket of slots
        tokens = rng.integers(1, VOCAB, length).tolist()
        for shape in shapes:
            for budget in (2, 8, 24):
                eager = fed(head, tokens, shape, None).propose(tokens, budget)
                slotted_proposer = fed(head, tokens, shape, graphs)
                slotted = slotted_proposer.propose(tokens, budget)
                assert slotted_proposer._cache.get_seq_length() == length - 1  # read, never written
                assert len(slotted) == len(eager)
                total += 1
                if slotted.token_ids == eager.token_ids and slotted.parents == eager.parents:
                    same += 1
                    assert slotted.node_probs == pytest.approx(eager.node_probs, rel=1e-4)
    assert same >= total - 1, f"{total - same} of {total} trees differ"  # at most a float near-tie
    assert graphs.num_captures == 0 and len(graphs._spaces) == 4 * 2  # 4 (depth, beam, branching) x 2 buckets


def test_a_context_ahead_of_the_features_grows_in_slots_too(head: DraftHead) -> None:
    """Pre-drafting: the speculative entries in the session's cache are copied into the slots like the rest."""
    tokens = list(range(3, 23))
    shape = TreeShape(depth=3, branching=3, beam=2, max_nodes=10)
    ahead = [*tokens, 30, 31]
    eager = fed(head, tokens, shape, None).propose(ahead, 10)
    slotted = fed(head, tokens, shape, TreeGraphs(head, capture=False)).propose(ahead, 10)
    assert slotted.token_ids == eager.token_ids and slotted.parents == eager.parents
