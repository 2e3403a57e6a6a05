"""Losslessness of speculative sampling, measured as in the literature.

With a tiny random target (vocabulary 8) we draw many first-two-token
continuations through tree verification and compare their empirical joint
distribution with the target's exact one, p(x1) p(x2 | x1): total-variation
distance and a chi-square test. Trees have several branches; drafts are
either deterministic (one-hot q, as n-gram sources give) or sampled without
replacement from a draft model's sparse distribution q (as the model drafter
gives). A draft that is fresh each trial is what the guarantee is about, so
every trial builds a new tree. Deterministic trees go through the keyed
inverse-CDF rule, sampled ones through recursive rejection sampling; both
must give p.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.sampling import SamplingParams
from specserve.token_tree import DraftDistribution, TokenTree
from target_service.acceptance import accept_sampled
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

VOCAB = 8
PROMPT = [1, 2, 3]
SAMPLING = SamplingParams(temperature=1.0, top_k=6)
FULL_TRIALS = 200_000  # make test-slow; make test draws a fifth of them with a tolerance sqrt(5) as wide
TARGET = tiny_llama(vocab_size=VOCAB, seed=1)
DRAFT = tiny_llama(vocab_size=VOCAB, seed=2)  # a different model: q differs from p


@torch.inference_mode()
def probs_table(model: torch.nn.Module, params: SamplingParams, depth: int) -> dict[tuple[int, ...], torch.Tensor]:
    """Distribution after PROMPT + every suffix of length < depth."""
    table = {}
    for length in range(depth):
        for suffix in itertools.product(range(VOCAB), repeat=length):
            logits = model(input_ids=torch.tensor([PROMPT + list(suffix)])).logits[0, -1:]
            table[suffix] = target_probs(logits, params)[0].double()
    return table


P = probs_table(TARGET, SAMPLING, depth=3)
Q = probs_table(DRAFT, SamplingParams(temperature=1.0, top_k=4), depth=2)  # sparse: 4 tokens


# q as the drafter sends it (support, probabilities) and as float32 weights for drawing: built once, not per trial.
Q_SPARSE = {
    context: (tuple(support), tuple(float(q[t]) for t in support))
    for context, q in Q.items()
    for support in [torch.nonzero(q).flatten().tolist()]
}


def exact_joint() -> np.ndarray:
    return np.array([[float(P[()][a] * P[(a,)][b]) for b in range(VOCAB)] for a in range(VOCAB)])


def deterministic_tree(rng: random.Random) -> TokenTree:
    """Three root branches with two children each; tokens fixed per trial but arbitrary."""
    roots = rng.sample(range(VOCAB), 3)
    tokens, parents = list(roots), [-1, -1, -1]
    for i in range(3):
        for token in rng.sample(range(VOCAB), 2):
            tokens.append(token)
            parents.append(i)
    return TokenTree(tuple(tokens), tuple(parents))


def draw_without_replacement(
    support: tuple[int, ...], probs: tuple[float, ...], k: int, rng: random.Random
) -> list[int]:
    """k tokens drawn one after another from q, each in proportion to the mass not yet drawn (as a drafter samples)."""
    left = dict(zip(support, probs, strict=True))
    picks = []
    for _ in range(k):
        u = rng.random() * sum(left.values())
        tokens = list(left)
        cumulative = itertools.accumulate(left.values())
        pick = next((token for token, mass in zip(tokens, cumulative, strict=True) if u < mass), tokens[-1])
        picks.append(pick)
        del left[pick]
    return picks


def sampled_tree(rng: random.Random) -> TokenTree:
    """Root children sampled from q without replacement, then two sampled children each, plus one n-gram node."""
    tokens: list[int] = []
    parents: list[int] = []
    sampled: list[bool] = []
    dists: list[DraftDistribution] = []

    def draw(parent: int, context: tuple[int, ...], k: int) -> list[int]:
        support, probs = Q_SPARSE[context]
        dists.append(DraftDistribution(parent, support, probs))
        picks = draw_without_replacement(support, probs, k, rng)
        nodes = []
        for token in picks:
            nodes.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            sampled.append(True)
        return nodes

    for node in draw(-1, (), 3):
        draw(node, (tokens[node],), 2)
    # A deterministic sibling among sampled ones (the merged-sources case).
    tokens.append(rng.randrange(VOCAB))
    parents.append(-1)
    sampled.append(False)
    return TokenTree(tuple(tokens), tuple(parents), tuple(sampled), tuple(dists))


def rows_for(tree: TokenTree) -> torch.Tensor:
    """p at the root and after each node's path: the rows the verifier's forward would give."""
    contexts: list[tuple[int, ...]] = [()]
    for node, parent in enumerate(tree.parents):
        contexts.append((*contexts[parent + 1], tree.token_ids[node]))
    return torch.stack([P[context] for context in contexts])


def empirical_joint(make_tree: object, seed: int, trials: int) -> tuple[np.ndarray, int]:
    """Each trial is a request of its own seed; the draft trees come from an unrelated generator."""
    rng = random.Random(seed)
    counts = np.zeros((VOCAB, VOCAB))
    tokens = 0
    for trial in range(trials):
        tree = make_tree(rng)  # type: ignore[operator]
        tree.validate(VOCAB, max_nodes=64)
        noise = PositionNoise(seed * FULL_TRIALS + trial, first_position=len(PROMPT))
        result = accept_sampled(tree, rows_for(tree), noise)
        committed = [tree.token_ids[n] for n in result.path] + [result.bonus_token]
        tokens += len(committed)
        if len(committed) == 1:  # the next round draws x2 at the next position, as plain decoding would
            committed.append(noise.sample(P[(committed[0],)], 1))
        counts[committed[0], committed[1]] += 1
    return counts, tokens


@pytest.mark.parametrize(
    "trials", [pytest.param(FULL_TRIALS // 5, id="40k"), pytest.param(FULL_TRIALS, id="200k", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(("make_tree", "label"), [(deterministic_tree, "one-hot q"), (sampled_tree, "model q")])
def test_speculative_sampling_matches_the_target_distribution(make_tree: object, label: str, trials: int) -> None:
    counts, tokens = empirical_joint(make_tree, 1234, trials)
    expected = exact_joint() * trials
    tv = 0.5 * np.abs(counts / trials - expected / trials).sum()
    keep = expected.flatten() > 0
    assert counts.flatten()[~keep].sum() == 0, "a token with zero target probability was produced"
    observed, wanted = counts.flatten()[keep], expected.flatten()[keep]
    statistic, p_value = chisquare(observed, wanted * observed.sum() / wanted.sum())
    print(f"{label}: {tokens} tokens committed in {trials} trials, TV {tv:.4f}, chi2 {statistic:.1f}, p {p_value:.3f}")
    assert tokens >= trials
    assert tv < 0.01 * (FULL_TRIALS / trials) ** 0.5  # sampling noise in TV shrinks as 1/sqrt(trials)
    assert p_value > 0.001


def test_a_wrong_acceptance_rule_is_detected() -> None:
    """The check has teeth: always accepting the first draft token is far from p."""
    rng = random.Random(0)
    counts = np.zeros((VOCAB, VOCAB))
    n = 20_000
    for _ in range(n):
        tree = deterministic_tree(rng)
        x1 = tree.token_ids[0]
        x2 = rng.choices(range(VOCAB), weights=P[(x1,)].tolist())[0]
        counts[x1, x2] += 1
    tv = 0.5 * np.abs(counts / n - exact_joint()).sum()
    assert tv > 0.05


def test_tree_rows_of_the_verifier_match_the_probability_table() -> None:
    """The rows used above are the verifier's own tree-forward rows."""
    verifier = Verifier(TARGET, "fp")
    verifier.prefill("s", PROMPT, SAMPLING)
    tree = deterministic_tree(random.Random(5))
    rows = target_probs(verifier.score("s", tree), SAMPLING).double()
    torch.testing.assert_close(rows, rows_for(tree), rtol=1e-4, atol=1e-5)
