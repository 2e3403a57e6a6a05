"""Random draws keyed by (seed, sequence position), so a seed fixes the tokens whatever was drafted.

A stateful generator shared by a request's rounds makes its output depend on
how many draws each round took, and that depends on the drafts: on the
drafter tier's pools, which every request's traffic changes. The same seed
would then give different text from one call to the next. Keyed draws remove
that dependence. The token at position t is the target's sample from its
distribution p_t by inverse CDF with the uniform u(seed, t). Verifying a
deterministic draft (n-gram pools, token recycling, top-k model trees) then
asks only "is the draft the target's own sample?", the same question greedy
verification asks of the argmax, so the output is token-identical to plain
decoding with the same seed. It is exactly distributed as p: each position's
uniform is used once, for the token committed there, and nothing that shaped
the context or the draft has seen it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# Independent streams of draws at one position.
SAMPLE_STREAM = 0  # the inverse-CDF uniform for deterministic drafts and plain decoding
REJECTION_STREAM = 1  # the generator seed for rejection sampling against sampled drafts


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer with good avalanche."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(seed: int, position: int, stream: int) -> int:
    """A 64-bit value that is a fixed function of its arguments and looks independent across them."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)


def fresh_seed() -> int:
    """A seed for a request that did not give one."""
    return int.from_bytes(os.urandom(8), "little")


def sample_with_uniform(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token from probabilities ``p`` [vocab] with ``u`` in [0, 1).

    Never returns a token of probability zero: the CDF is flat there, and the
    first index whose CDF exceeds u * total always has positive mass.
    """
    cdf = p.double().cumsum(0)
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no mass")
    index = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True))
    if index >= p.shape[0]:  # u * total rounded up to total: the last token with mass
        index = int(torch.nonzero(p).flatten()[-1])
    return index


@dataclass(frozen=True)
class PositionNoise:
    """The draws of one request: ``seed`` and the sequence position of the first token to be sampled."""

    seed: int
    first_position: int

    def uniform(self, offset: int) -> float:
        """The uniform in [0, 1) for position first_position + offset (53 random bits)."""
        return (mix(self.seed, self.first_position + offset, SAMPLE_STREAM) >> 11) * 2.0**-53

    def sample(self, p: torch.Tensor, offset: int) -> int:
        """The target's own token at position first_position + offset, given its distribution ``p``."""
        return sample_with_uniform(p, self.uniform(offset))

    def generator(self, offset: int) -> torch.Generator:
        """A generator for the draws rejection sampling makes at position first_position + offset."""
        seed = mix(self.seed, self.first_position + offset, REJECTION_STREAM) & ((1 << 63) - 1)
        return torch.Generator().manual_seed(seed)
