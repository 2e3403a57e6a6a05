"""The cost curve corrected by served steps (``target_service.served_costs``): a profile timed while other
processes started is too flat, and the engine's own steps put each size's price right."""

from __future__ import annotations

import pytest

from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.cost_curve import CostCurve, flat_curve
from target_service.served_costs import ServedCosts
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

FLAT_PROFILE = CostCurve((1, 2, 4, 8, 16), (0.020, 0.020, 0.020, 0.021, 0.030))  # a busy start: rows look free


def served(costs: ServedCosts, tokens: int, seconds: float, steps: int) -> CostCurve | None:
    corrected = None
    for _ in range(steps):
        corrected = costs.observe(tokens, 0, seconds) or corrected
    return corrected


def test_plain_and_drafted_steps_reprice_their_sizes_and_the_sizes_between() -> None:
    costs = ServedCosts(FLAT_PROFILE)
    assert served(costs, 1, 0.015, ServedCosts.MIN_STEPS - 1) is None  # too few to judge
    plain = served(costs, 1, 0.015, 1)
    assert plain is not None and plain.seconds[0] == pytest.approx(0.015)
    assert plain.seconds[1:] == pytest.approx((0.015, 0.015, 0.01575, 0.0225))  # c(1)'s ratio, no other known
    drafted = served(costs, 8, 0.025, ServedCosts.MIN_STEPS)
    assert drafted is not None
    c1, c2, c4, c8, c16 = drafted.seconds
    assert (c1, c8) == pytest.approx((0.015, 0.025))
    # Between two served sizes the ratio is interpolated by position: 0.75 at 1, 25 / 21 at 8.
    assert c2 == pytest.approx(0.020 * (0.75 + (25 / 21 - 0.75) / 3))
    assert c4 == pytest.approx(0.020 * (0.75 + 2 * (25 / 21 - 0.75) / 3))
    assert c16 == pytest.approx(0.030 * 25 / 21)  # beyond the last served size: its ratio
    assert c8 / c1 > 1.6 > FLAT_PROFILE.seconds[3] / FLAT_PROFILE.seconds[0]


def test_a_correction_within_tolerance_keeps_the_curve_in_use() -> None:
    costs = ServedCosts(FLAT_PROFILE)
    assert served(costs, 1, 0.015, ServedCosts.MIN_STEPS) is not None
    assert served(costs, 1, 0.0152, 20) is None  # 1% off what is in use: budgets keep their cache
    assert served(costs, 1, 0.030, 20) is not None  # the engine slowed (load, a longer context): repriced


def test_an_outlier_step_counts_clipped_and_sizes_beyond_the_curve_are_left_alone() -> None:
    costs = ServedCosts(FLAT_PROFILE)
    served(costs, 1, 0.015, ServedCosts.MIN_STEPS)
    after = costs.observe(1, 0, 100.0)  # a pause of the process, not a cost
    assert after is not None and after.seconds[0] < 0.020 * ServedCosts.CLIP
    assert served(costs, 32, 1.0, 50) is None


def test_no_measurement_is_never_corrected() -> None:
    assert served(ServedCosts(flat_curve()), 1, 0.015, 50) is None


def test_the_verifier_prices_trees_by_what_its_steps_took() -> None:
    verifier = Verifier(tiny_llama(vocab_size=48, seed=3, context=512), "fp", max_tree_nodes=8)
    verifier.use_cost_curve(CostCurve((1, 2, 4, 8), (1.0, 1.0, 1.0, 1.0)))  # a second a step: far off
    verifier.prefill("s", [1, 2, 3], SamplingParams())
    committed = 3
    for _ in range(ServedCosts.MIN_STEPS):
        committed += len(verifier.verify("s", committed, TokenTree()).committed)
    assert verifier.cost_curve.seconds[0] < 1.0  # the tiny model's plain steps took milliseconds
    verifier.close()
