"""Keyed draws: a fixed function of (seed, position), uniform, and an exact inverse-CDF sampler."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from specserve.keyed_noise import PositionNoise, mix, sample_with_uniform


def test_draws_are_a_function_of_seed_and_position_only() -> None:
    a, b = PositionNoise(7, 100), PositionNoise(7, 98)
    assert a.uniform(0) == b.uniform(2)  # the same absolute position
    assert a.uniform(0) != a.uniform(1)
    assert PositionNoise(8, 100).uniform(0) != a.uniform(0)
    assert mix(1, 2, 0) != mix(1, 2, 1)  # streams differ


def test_uniforms_are_uniform_across_positions_and_seeds() -> None:
    by_position = [PositionNoise(3, 0).uniform(i) for i in range(20_000)]
    by_seed = [PositionNoise(seed, 5).uniform(0) for seed in range(20_000)]
    for draws in (by_position, by_seed):
        assert min(draws) >= 0.0 and max(draws) < 1.0
        assert kstest(draws, "uniform").pvalue > 0.001


@pytest.mark.parametrize(("u", "token"), [(0.0, 1), (0.2499, 1), (0.25, 3), (0.9999, 3), (1.0 - 2.0**-53, 3)])
def test_inverse_cdf_skips_tokens_without_mass(u: float, token: int) -> None:
    p = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    assert sample_with_uniform(p, u) == token


def test_keyed_samples_follow_the_distribution() -> None:
    p = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    noise = PositionNoise(11, 0)
    n = 40_000
    counts = np.bincount([noise.sample(p, i) for i in range(n)], minlength=5)
    assert counts[1] == 0
    keep = p.numpy() > 0
    assert chisquare(counts[keep], p.numpy()[keep] * n).pvalue > 0.001


def test_an_empty_distribution_is_an_error() -> None:
    with pytest.raises(ValueError, match="no mass"):
        sample_with_uniform(torch.zeros(4), 0.5)


def test_rejection_generators_are_keyed_too() -> None:
    noise = PositionNoise(5, 10)
    first = torch.rand(3, generator=noise.generator(2))
    again = torch.rand(3, generator=PositionNoise(5, 12).generator(0))
    other = torch.rand(3, generator=noise.generator(3))
    assert torch.equal(first, again) and not torch.equal(first, other)
