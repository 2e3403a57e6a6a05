"""The engine's step as CUDA graphs, on a GPU: ``make test-gpu`` (skipped where no CUDA device is present).

The same checks the CPU runs on the uncaptured static step (``tests/unit/test_llama_forward.py``), here
captured and replayed: logits against transformers, and greedy speculation token-identical to plain
decoding through the same engine. Run with ``--noconftest``: the device machine has no generated protos.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.model_runner import ModelRunner
from target_service.static_steps import STARTUP_WINDOW, windows_up_to
from target_service.verifier import Verifier
from tests.unit.test_llama_forward import FAMILIES, PROMPTS, TREES, build, expected_rows, tree_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_captured_step_equals_transformers(family: str) -> None:
    """Three rounds on one arena: the first captures each shape, the later ones replay with other regions."""
    model = build(family)
    expected = expected_rows(model).float()
    runner = ModelRunner(model.to(CUDA), "auto")
    assert runner._static is not None and runner._static.capture
    arena = runner.new_arena(1024)
    for _ in range(3):
        logits = tree_step(runner, PROMPTS, TREES, arena).cpu()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    captures = runner._static.num_captures
    tree_step(runner, PROMPTS, TREES, arena)
    assert runner._static.num_captures == captures, "a step of a shape seen before was captured again"


def greedy_through(verifier: Verifier, prompt: list[int], new_tokens: int, drafts: Drafts | None = None) -> list[int]:
    """Greedy decoding through ``verifier``: plain (empty drafts) or with the drafts ``drafts`` makes."""
    session = "speculative" if drafts else "plain"
    verifier.prefill(session, prompt, SamplingParams())
    committed: list[int] = []
    while len(committed) < new_tokens:
        tree = drafts(len(committed)) if drafts else TokenTree.chain([])
        committed += verifier.verify(session, len(prompt) + len(committed), tree).committed
    verifier.release(session)
    return committed[:new_tokens]


class Drafts:
    """Chains that start with 0-4 correct tokens (from the plain output) and go on with 0-5 random ones."""

    def __init__(self, truth: list[int], vocab: int, seed: int) -> None:
        self.truth, self.vocab, self.rng = truth, vocab, random.Random(seed)

    def __call__(self, done: int) -> TokenTree:
        right = self.truth[done : done + self.rng.randrange(0, 5)]
        return TokenTree.chain(right + [self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(0, 6))])


def test_greedy_speculation_through_graphs_equals_plain_decoding() -> None:
    """fp32: token-identical, captured steps of every row bucket replayed many times over."""
    model = build("llama").to(CUDA)
    verifier = Verifier(model, "fp", kv_cache_bytes=64 * 2**20)
    try:
        for seed in range(6):
            rng = random.Random(seed)
            prompt = [rng.randrange(96) for _ in range(rng.randrange(2, 40))]
            plain = greedy_through(verifier, prompt, 48)
            speculative = greedy_through(verifier, prompt, 48, Drafts(plain, 96, seed))
            assert speculative == plain, f"seed {seed}: speculation changed the output"
        assert "CUDA graphs" in verifier.step_form
    finally:
        verifier.close()


def test_the_start_up_cost_profile_runs_on_captured_steps() -> None:
    """``profile_cost`` (run at every verifier start) steps a scratch arena of its own: captured there too,
    and the sessions' arena still decodes as before afterwards (fp32: speculation equals plain decoding)."""
    model = build("llama").to(CUDA)
    verifier = Verifier(model, "fp", kv_cache_bytes=64 * 2**20)
    try:
        curve = verifier.profile_cost(sizes=(1, 2, 4, 8, 16), repeats=3)
        assert curve.tokens == (1, 2, 4, 8, 16)
        assert all(s > 0 for s in curve.seconds) and curve.per_session_s >= 0
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        assert greedy_through(verifier, prompt, 8) == greedy_through(verifier, prompt, 8, Drafts([], 96, 0))
    finally:
        verifier.close()


def test_every_step_shape_is_captured_at_start_up() -> None:
    """No request pays for a capture: the verifier captures every row bucket at every window its sessions can
    reach before it serves, and speculative decoding (trees of changing sizes) then only replays."""
    model = build("llama").to(CUDA)
    verifier = Verifier(model, "fp", kv_cache_bytes=64 * 2**20)
    try:
        static = verifier._runner._static
        assert static is not None
        windows = windows_up_to(min(STARTUP_WINDOW, verifier.limits.max_session_tokens))
        assert static.num_captures == len(windows) * len(static.row_buckets)
        prompt = [2, 7, 1, 8, 2, 8, 1, 8]
        plain = greedy_through(verifier, prompt, 40)
        assert greedy_through(verifier, prompt, 40, Drafts(plain, 96, 1)) == plain
        assert static.num_captures == len(windows) * len(static.row_buckets), "a request's step was captured"
    finally:
        verifier.close()
