"""Sampling parameters (no torch: the coordinator reads them too; the distribution they define is in ``probs``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks its tokens; the defaults are greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed: their own, else a fresh one (greedy decoding needs none)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=fresh_seed())

    def validate(self) -> None:
        """ValueError naming the field when a value is not one the sampler handles safely.

        NaN, infinities and subnormal floats are refused outright (a NaN temperature is not ``<= 0``, so it used
        to reach the sampler and leave a distribution with no mass). Temperature is 0 (greedy) or within
        [MIN_TEMPERATURE, MAX_TEMPERATURE]; see those for why.
        """
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            _check_float(name, value)
        if self.temperature != 0.0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, "
                f"got {self.temperature:g}"
            )
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 or 1 disables it), got {self.top_p:g}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be between 0 (disabled) and {MAX_TOP_K}, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an unsigned 64-bit integer, got {self.seed}")


GREEDY = SamplingParams()
"""Greedy decoding: the default everywhere a session's sampling is not given."""

MIN_TEMPERATURE = 1e-3
"""Least non-zero temperature: logits / temperature must stay finite in float32.

Dividing by t multiplies a logit by 1/t; at t >= 1e-3 that is at most 1000x, so any logit below 3.4e35 in
magnitude (a model's are below 1e4) stays finite, and the softmax (which subtracts the row maximum) never sees
inf - inf = NaN. A subnormal temperature (1e-40) made 1/t overflow to inf and the distribution NaN. Below 1e-3
sampling is indistinguishable from greedy anyway: ask for temperature 0.
"""

MAX_TEMPERATURE = 100.0
"""Most temperature: beyond it the distribution is uniform noise for any model, and the bound keeps the
accepted range one a person can read in an error message."""

MAX_TOP_K = 1 << 20
"""Most top_k: more than any vocabulary (a larger k than the vocabulary disables top-k, as 0 does)."""

_FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


def _check_float(name: str, value: float) -> None:
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value != 0.0 and abs(value) < _FLOAT32_MIN_NORMAL:
        raise ValueError(f"{name} must not be a subnormal float, got {value:g}: use 0 or a normal number")


def fresh_seed() -> int:
    """A seed for a request that did not give one."""
    return int.from_bytes(os.urandom(8), "little")
