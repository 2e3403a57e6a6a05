"""Keyed Gumbel noise: a fixed function of (seed, position, token), uniform into the tails, an exact sampler,
and the coupling that makes a drafter with the same noise agree with the target."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.keyed_noise import (
    _GOLDEN,
    _MASK64,
    SAMPLE_STREAM,
    PositionNoise,
    _splitmix64,
    gumbel,
    mix,
    token_uniforms,
)
from specserve.probs import target_probs
from specserve.sampling import SamplingParams

VOCAB = np.arange(64)


def test_draws_are_a_function_of_seed_position_and_token_only() -> None:
    a, b = PositionNoise(7, 100), PositionNoise(7, 98)
    assert torch.equal(a.gumbel(0, VOCAB), b.gumbel(2, VOCAB))  # the same absolute position
    assert torch.equal(a.gumbel(0, VOCAB)[[5, 9]], a.gumbel(0, np.array([5, 9])))  # any subset of the vocabulary
    assert not torch.equal(a.gumbel(0, VOCAB), a.gumbel(1, VOCAB))
    assert not torch.equal(PositionNoise(8, 100).gumbel(0, VOCAB), a.gumbel(0, VOCAB))
    assert len(set(a.gumbel(0, VOCAB).tolist())) == len(VOCAB)  # tokens differ
    assert mix(1, 2, 0) != mix(1, 2, 1)  # streams differ


def test_the_vectorised_hash_is_splitmix64_in_unsigned_arithmetic() -> None:
    """Token i gets SplitMix64's output i + 1 from the position's state, bit for bit (ids past 2^31 included:
    a signed shift or a float detour would differ there)."""
    seed, position = 0xFEDCBA9876543210, 12345
    state = mix(seed, position, SAMPLE_STREAM)
    ids = np.array([0, 1, 2, 1000, 49151, 2**31 + 7, 2**40 + 3])
    expected = [((_splitmix64((state + int(i) * _GOLDEN) & _MASK64) >> 11) + 0.5) * 2.0**-53 for i in ids]
    assert token_uniforms(seed, position, ids).tolist() == expected


def test_uniforms_are_uniform_and_strictly_inside_the_unit_interval() -> None:
    u = np.concatenate([token_uniforms(3, position, np.arange(10_000)) for position in range(100)])
    assert u.min() > 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=1000, range=(0.0, 1.0))[0]
    assert chisquare(counts).pvalue > 0.001
    by_seed = np.array([token_uniforms(seed, 5, np.array([0]))[0] for seed in range(20_000)])
    assert chisquare(np.histogram(by_seed, bins=50, range=(0.0, 1.0))[0]).pvalue > 0.001


def test_the_noise_reaches_the_tails_float64_predicts() -> None:
    """10^7 draws: the far tails hold what float64 predicts (Poisson counts within 5 sigma), and the uniforms
    are not on a float32 grid (a 24-bit uniform cuts the Gumbel tail at about 16.6)."""
    n_positions, vocab = 200, 50_000
    u = np.concatenate([token_uniforms(11, position, np.arange(vocab)) for position in range(n_positions)])
    n = u.size
    assert not np.all(u * 2.0**24 == np.floor(u * 2.0**24))
    assert np.mean(u * 2.0**24 != np.floor(u * 2.0**24)) > 0.99
    g = -np.log(-np.log(u))
    for count, expected in (
        (np.sum(u < 1e-5), n * 1e-5),  # the smallest Gumbel draws: G < -log(-log(1e-5)) = -2.44
        (np.sum(1.0 - u < 1e-5), n * 1e-5),
        (np.sum(g > 11.5), n * -np.expm1(-np.exp(-11.5))),  # the largest
    ):
        assert abs(count - expected) < 5 * expected**0.5, (count, expected)


def test_gumbel_max_samples_follow_the_distribution_and_never_draw_a_token_without_mass() -> None:
    p = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    noise = PositionNoise(11, 0)
    n = 40_000
    counts = np.bincount([noise.sample(p, i) for i in range(n)], minlength=5)
    assert counts[1] == 0
    keep = p.numpy() > 0
    assert chisquare(counts[keep], p.numpy()[keep] * n).pvalue > 0.001


@pytest.mark.parametrize("params", [SamplingParams(0.7, top_k=3), SamplingParams(1.0, top_p=0.8)])
def test_gumbel_max_after_top_k_and_top_p_draws_the_truncated_distribution(params: SamplingParams) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    p = target_probs(logits, params)[0]
    noise = PositionNoise(2, 0)
    n = 30_000
    counts = np.bincount([noise.sample(p, i) for i in range(n)], minlength=p.numel())
    kept = p.double().numpy()
    keep = kept > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep], kept[keep] / kept[keep].sum() * n).pvalue > 0.001


def test_an_empty_distribution_is_an_error() -> None:
    with pytest.raises(ValueError, match="no mass"):
        PositionNoise(1, 0).sample(torch.zeros(4), 0)


def test_rejection_generators_are_keyed_too() -> None:
    noise = PositionNoise(5, 10)
    first = torch.rand(3, generator=noise.generator(2))
    again = torch.rand(3, generator=PositionNoise(5, 12).generator(0))
    other = torch.rand(3, generator=noise.generator(3))
    assert torch.equal(first, again) and not torch.equal(first, other)


def _pair_at_tv(tv: float) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q over 8 tokens with total variation ``tv``: q moves ``tv`` of p's mass onto other tokens."""
    p = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05], dtype=torch.float64)
    q = p.clone()
    q[0] -= tv
    q[5:] += tv / 3
    return p, q


@pytest.mark.parametrize("tv", [0.05, 0.15, 0.25])
def test_a_drafter_with_the_same_noise_matches_at_least_as_often_as_the_bound(tv: float) -> None:
    """argmax(log q + G) = argmax(log p + G) with probability >= (1 - TV) / (1 + TV) (Daliri et al. 2024);
    a drafter sampling with noise of its own matches only with probability sum p q."""
    p, q = _pair_at_tv(tv)
    assert float((p - q).abs().sum() / 2) == pytest.approx(tv)
    trials = 20_000
    ids = np.arange(p.numel())
    coupled = independent = 0
    for position in range(trials):
        noise = PositionNoise(99, position)
        g = noise.gumbel(0, ids)
        target = int(torch.argmax(p.log() + g))
        coupled += int(torch.argmax(q.log() + g)) == target
        independent += int(torch.argmax(q.log() + PositionNoise(100, position).gumbel(0, ids))) == target
    bound = (1 - tv) / (1 + tv)
    sigma = (bound * (1 - bound) / trials) ** 0.5
    assert coupled / trials > bound - 4 * sigma
    overlap = float((p * q).sum())
    assert abs(independent / trials - overlap) < 4 * (overlap * (1 - overlap) / trials) ** 0.5
    assert coupled / trials > overlap + 0.3


def test_noise_over_a_real_vocabulary_is_finite_float64() -> None:
    g = gumbel(1, 2, np.arange(49_152))
    assert g.dtype == np.float64 and g.shape == (49_152,) and np.isfinite(g).all()
