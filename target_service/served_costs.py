"""The cost curve corrected by the steps the engine serves.

The start-up profile (``Verifier.profile_cost``) times the engine's forward by tokens scored in a few seconds,
often while the drafter and the coordinator are starting on the same cores. Another process's work slows each
of a step's thousands of parallel regions by about the same time whatever the rows, so a profile timed then is
too flat: extra rows look nearly free, the budget prices trees far below what they cost, and drafted rounds
lose (docs/benchmarks.md, "The cost curve, timed where steps run"). A curve kept on disk keeps that error
for every later start.

So the verifier also learns from what it serves. For each of the curve's sizes it keeps how its one-session
steps of that size took against what the curve said (a ratio, exponentially weighted), and once a size has
``MIN_STEPS`` of them it prices that size at the curve's time times the ratio: plain rounds correct c(1), drafted
rounds the sizes trees use. A size not served yet takes the ratio interpolated between its served neighbours (or
the nearest one's), so the curve's shape between them is the profile's. The time is the whole step's, packing
and acceptance included: what a round waits for, and what the budget weighs against the tokens it commits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from target_service.cost_curve import CostCurve


@dataclass
class ServedCosts:
    """``measured`` corrected by served one-session steps; ``observe`` says when the correction moved."""

    measured: CostCurve
    DECAY = 0.9  # weight of what was known before each new step of a size: about the last ten count
    MIN_STEPS = 8  # steps of a size before its correction is used
    TOLERANCE = 0.05  # a size's correction moving less than this keeps the curve in use (budgets stay cached)
    # A step this far off the curve either way is clipped before it counts: a pause of the process, not a cost.
    CLIP = 4.0
    _ratio: dict[int, float] = field(default_factory=dict)  # by index into measured.tokens
    _steps: dict[int, int] = field(default_factory=dict)
    _used: dict[int, float] = field(default_factory=dict)  # the ratios of the curve last returned

    def observe(self, tokens: int, context: int, seconds: float) -> CostCurve | None:
        """One served step of one session scoring ``tokens`` over ``context`` cached tokens in ``seconds``; the
        corrected curve when a size's correction moved by more than ``TOLERANCE``, else None."""
        index = bisect.bisect_left(self.measured.tokens, tokens)
        if len(self.measured.tokens) < 2 or index == len(self.measured.tokens) or seconds <= 0:
            return None  # no measurement (``flat_curve``), or beyond the measured sizes: the curve stands
        predicted = self.measured.step_s(1, tokens, context)
        if predicted <= 0:
            return None
        ratio = min(self.CLIP, max(1 / self.CLIP, seconds / predicted))
        steps = self._steps.get(index, 0) + 1
        self._steps[index] = steps
        known = self._ratio.get(index)
        self._ratio[index] = ratio if known is None else self.DECAY * known + (1 - self.DECAY) * ratio
        if steps < self.MIN_STEPS:
            return None
        used = self._used.get(index)
        if used is not None and abs(self._ratio[index] / used - 1) <= self.TOLERANCE:
            return None
        return self.curve()

    def curve(self) -> CostCurve:
        """The measured curve with each size's correction (interpolated where a size has too few steps), never
        costing less for more tokens; the slope per cached token stays the profile's."""
        served = sorted(i for i, steps in self._steps.items() if steps >= self.MIN_STEPS)
        if not served:
            return self.measured
        ratios = [self._interpolated(i, served) for i in range(len(self.measured.tokens))]
        self._used = {i: self._ratio[i] for i in served}
        seconds: list[float] = []
        for measured, ratio in zip(self.measured.seconds, ratios, strict=True):
            seconds.append(max(measured * ratio, seconds[-1] if seconds else 0.0))
        return replace(self.measured, seconds=tuple(seconds))  # the slope per cached token stays the profile's

    def _interpolated(self, index: int, served: list[int]) -> float:
        at = bisect.bisect_left(served, index)
        if at < len(served) and served[at] == index:
            return self._ratio[index]
        if at == 0:
            return self._ratio[served[0]]
        if at == len(served):
            return self._ratio[served[-1]]
        low, high = served[at - 1], served[at]
        weight = (index - low) / (high - low)
        return (1 - weight) * self._ratio[low] + weight * self._ratio[high]
