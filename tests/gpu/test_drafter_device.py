"""The draft head on a GPU (``draft_service --device cuda``): ``make test-gpu``, skipped where no CUDA device is.

The head, its per-session cache and the tree's growth live on the device; the tree comes to the host once a
round. Its trees are the CPU head's (up to near-ties: cuBLAS and the CPU's kernels round differently), and
greedy speculation with them is plain decoding. ``SPECSERVE_TEST_DEVICE=cpu`` runs the same checks on the CPU.
Run with ``--noconftest``: the device machine has no generated protos.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

from draft_service.draft_head import DraftHead, DraftHeadConfig, in_serving_dtype
from draft_service.head_graphs import TreeGraphs
from draft_service.head_proposer import HeadProposer, TreeShape
from specserve.results import DraftFeedback
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.verifier import Verifier
from tests.unit.test_llama_forward import build

DEVICE = torch.device(os.environ.get("SPECSERVE_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)"
)
SHAPE = TreeShape(depth=4, branching=3, beam=3, max_nodes=16)


def random_head(model: torch.nn.Module, seed: int = 1) -> DraftHead:
    """An untrained head over ``model``'s embedding and LM head: its drafts are poor, its trees well formed."""
    torch.manual_seed(seed)
    config = DraftHeadConfig.for_target(model.config, draft_vocab_size=48, intermediate_size=96)
    embedding = model.get_input_embeddings().weight.detach().float().cpu()
    lm_head = model.get_output_embeddings().weight.detach().float().cpu()
    return DraftHead(config, embedding, lm_head, torch.arange(48)).eval()


def test_the_head_on_the_device_drafts_the_cpu_heads_trees() -> None:
    model = build("llama")
    head = random_head(model)
    on_cpu, _ = in_serving_dtype(copy.deepcopy(head), "float32", "linear", "cpu")
    on_device, choice = in_serving_dtype(copy.deepcopy(head), "float32", "linear", DEVICE)
    assert choice.dtype == "float32" and on_device.draft_lm_head.device.type == DEVICE.type
    rng = random.Random(0)
    same = 0
    for _ in range(12):
        tokens = [rng.randrange(96) for _ in range(rng.randrange(4, 30))]
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        trees = []
        for served in (on_cpu, on_device):
            proposer = HeadProposer(served, SHAPE)
            proposer.observe(DraftFeedback(features=hidden[:-1].numpy().astype("float16")))
            trees.append(proposer.propose(tokens, 16))
        trees[1].validate(96, max_nodes=16)
        assert len(trees[1]) == len(trees[0]) > 0
        same += trees[0].token_ids == trees[1].token_ids and trees[0].parents == trees[1].parents
    assert same >= 10, f"only {same} of 12 trees agree with the CPU head's"


def test_captured_tree_growth_drafts_the_eager_trees_and_replays_without_capturing_again() -> None:
    """On a GPU greedy trees grow in CUDA graphs (one per tree shape and context bucket): the same trees as
    growing them eagerly over the session's cache, and a second pass over the same shapes only replays."""
    model = build("llama")
    head, _ = in_serving_dtype(random_head(model), "float32", "auto", DEVICE)
    graphs = TreeGraphs(head)
    rng = random.Random(1)
    contexts = [[rng.randrange(96) for _ in range(rng.randrange(4, 60))] for _ in range(8)]
    features = []
    for tokens in contexts:
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        features.append(hidden[:-1].numpy().astype("float16"))
    captures = 0
    for attempt in range(2):
        same = 0
        for tokens, rows in zip(contexts, features, strict=True):
            trees = []
            for with_graphs in (None, graphs):
                proposer = HeadProposer(head, SHAPE, graphs=with_graphs)
                proposer.observe(DraftFeedback(features=rows))
                trees.append(proposer.propose(tokens, 16))
            same += trees[0].token_ids == trees[1].token_ids and trees[0].parents == trees[1].parents
        assert same >= 7, f"only {same} of 8 captured trees are the eager ones"
        assert not graphs.capture_error
        if attempt == 0:
            captures = graphs.num_captures
            assert captures > 0 or DEVICE.type == "cpu"
    assert graphs.num_captures == captures, "a tree shape seen before was captured again"


def test_greedy_speculation_with_the_device_head_is_plain_decoding() -> None:
    """fp32, the target and the head on the device: the head's trees from the verifier's own features."""
    model = build("llama").to(DEVICE)
    head, _ = in_serving_dtype(random_head(model), "float32", "auto", DEVICE)
    graphs = TreeGraphs(head)  # captured on a GPU
    verifier = Verifier(model, "fp", kv_cache_bytes=64 * 2**20)
    try:
        for seed in range(3):
            rng = random.Random(seed)
            prompt = [rng.randrange(96) for _ in range(rng.randrange(2, 30))]
            outputs = []
            for speculate in (False, True):
                session = f"{seed}-{speculate}"
                prefill = verifier.prefill(session, prompt, SamplingParams(), return_features=speculate)
                proposer = HeadProposer(head, SHAPE, graphs=graphs)
                proposer.observe(DraftFeedback(features=prefill.features))
                committed = list(prompt)
                while len(committed) < len(prompt) + 32:
                    tree = proposer.propose(committed, 16) if speculate else TokenTree()
                    result = verifier.verify(session, len(committed), tree, return_features=speculate)
                    committed += result.committed
                    proposer.observe(DraftFeedback(features=result.features))
                verifier.release(session)
                outputs.append(committed[len(prompt) : len(prompt) + 32])
            assert outputs[1] == outputs[0], f"seed {seed}: speculation changed the output"
    finally:
        verifier.close()
