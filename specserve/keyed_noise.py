"""Random draws keyed by (seed, sequence position, token id), so a seed fixes the tokens whatever was drafted.

A stateful generator shared by a request's rounds makes its output depend on
how many draws each round took, and that depends on the drafts: on the
drafter tier's pools, which every request's traffic changes. The same seed
would then give different text from one call to the next. Keyed draws remove
that dependence.

The token at position t is the target's **Gumbel-max** sample from its
distribution p_t: argmax over the vocabulary of log p_t(i) + G(seed, t, i),
where G is a standard Gumbel draw keyed by the seed, the position and the
token id (``gumbel``). That is an exact sample from p_t (the Gumbel-max
trick), drawn with noise that exists before p_t does, so

- verifying a deterministic draft (n-gram pools, token recycling, top-k
  model trees) asks only "is the draft the target's own sample?", the same
  question greedy verification asks of the argmax, and the output is
  token-identical to plain decoding with the same seed;
- a drafter that knows the seed can sample **with the same noise**: its
  token argmax_i log q(i) + G(seed, t, i) equals the target's with
  probability at least (1 - TV(p, q)) / (1 + TV(p, q)) (Daliri, Musco and
  Suresh 2024, "Drafter-Invariant Speculative Decoding"), where an
  independent draw matches only with probability sum_i p(i) q(i). The
  target still draws its own token from its own distribution, so the output
  stays exactly distributed as p and the same with any drafter.

Each position's noise decides only the token committed there, and nothing
that shaped the context (earlier positions' noise, the committed tokens)
depends on it: the output is exactly distributed as p.

The noise is float64 from 53 random bits, strictly inside (0, 1) before the
logarithms: a float32 uniform (24 bits) would cut the Gumbel tail at about
16.6 and the rarest tokens would never be drawn. The hash is computed in
unsigned 64-bit arithmetic (numpy ``uint64``: shifts are logical, products
wrap), never in torch's signed int64, whose right shift is arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Independent streams of draws at one position.
SAMPLE_STREAM = 0  # the Gumbel noise of the target's own sample (and of coupled drafts)
REJECTION_STREAM = 1  # the generator seed for rejection sampling against sampled drafts


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer with good avalanche."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def mix(seed: int, position: int, stream: int) -> int:
    """A 64-bit value that is a fixed function of its arguments and looks independent across them."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)


def token_uniforms(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """float64 uniforms strictly inside (0, 1), one per token id, keyed by (seed, position, token id).

    Token i takes output i + 1 of a SplitMix64 generator seeded with ``mix(seed, position)``: its state
    advances by the golden-ratio increment, and the output is the mixed state (SplitMix64's own stream,
    which passes BigCrush). The top 53 bits, plus half a unit, give a uniform that is never 0 or 1.
    """
    state = np.uint64(mix(seed, position, SAMPLE_STREAM))
    ids = np.asarray(token_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = state + (ids + np.uint64(1)) * np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX2)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def gumbel(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """Standard Gumbel draws (float64), one per token id, keyed by (seed, position, token id)."""
    return -np.log(-np.log(token_uniforms(seed, position, token_ids)))


def gumbel_max(log_p: torch.Tensor, noise: torch.Tensor) -> int:
    """argmax of log_p + noise over tokens with mass; ValueError when no token has any."""
    scores = log_p.double() + noise
    token = int(torch.argmax(scores))
    if scores[token] == float("-inf"):
        raise ValueError("cannot sample from a distribution with no mass")
    return token


@dataclass(frozen=True)
class PositionNoise:
    """The draws of one request: ``seed`` and the sequence position of the first token to be sampled."""

    seed: int
    first_position: int

    def gumbel(self, offset: int, token_ids: np.ndarray) -> torch.Tensor:
        """Gumbel noise (float64) of ``token_ids`` at position first_position + offset."""
        return torch.from_numpy(gumbel(self.seed, self.first_position + offset, token_ids))

    def sample(self, p: torch.Tensor, offset: int) -> int:
        """The target's own token at position first_position + offset, given its distribution ``p`` [vocab].

        Only tokens with mass compete (the noise of the others is never drawn: top-k or top-p leave a few),
        and since each token's noise depends on its id alone, that is the argmax over the whole vocabulary.
        """
        support = torch.nonzero(p).flatten()
        if support.numel() == 0:
            raise ValueError("cannot sample from a distribution with no mass")
        log_p = torch.log(p[support].double())
        return int(support[gumbel_max(log_p, self.gumbel(offset, support.numpy()))])

    def generator(self, offset: int) -> torch.Generator:
        """A generator for the draws rejection sampling makes at position first_position + offset."""
        seed = mix(self.seed, self.first_position + offset, REJECTION_STREAM) & ((1 << 63) - 1)
        return torch.Generator().manual_seed(seed)
