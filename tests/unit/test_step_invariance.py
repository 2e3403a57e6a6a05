"""Batch invariance: a row's result is the same bits however many rows share its step (fp32, prepacked).

Greedy speculation is token-identical to plain decoding only if a token
scored inside a tree gets exactly the logits it gets in a plain one-token
step. The engine pads every step to a row bucket and runs it on MKL's packed
GEMM, which computes each row alike at every row count from 2 up; these tests
check that on the machine they run on, for every bucket.
"""

from __future__ import annotations

import pytest
import torch

from target_service.model_runner import ModelRunner
from target_service.packed_linear import DEFAULT_BUCKETS, available_packing
from target_service.ragged_attention import Segment, StepPlan
from tests.conftest import tiny_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    available_packing(torch.float32, CPU) != "mkl", reason="no MKL packed GEMM in this torch build"
)
CONTEXT = 40


class Bench:
    """One session under test (a pending token and a 2-node chain) beside filler sessions, on one arena."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.arena = runner.new_arena(4096)
        self.regions = []
        for seed in range(40):
            region = self.arena.allocate(CONTEXT + 48)
            assert region is not None
            prompt = torch.randint(0, 64, (CONTEXT,), generator=torch.Generator().manual_seed(seed))
            empty = torch.zeros(0, dtype=torch.long)
            plan = StepPlan(self.arena, [Segment.chunk(region, 0, slice(0, CONTEXT), CPU)])
            runner.forward(plan, prompt, torch.arange(CONTEXT), empty, empty)
            region.length = CONTEXT
            self.regions.append(region)

    def step(self, own_rows: int, filler_rows: int) -> torch.Tensor:
        """The logits of the session under test's ``own_rows`` rows in a step with ``filler_rows`` more."""
        plan = StepPlan(self.arena)
        ids: list[int] = []
        positions: list[int] = []
        sessions = [own_rows] + [1] * min(filler_rows, 20) + ([filler_rows - 20] if filler_rows > 20 else [])
        for region, n in zip(self.regions, sessions, strict=False):
            start = len(ids)
            ids += [(7 * len(ids) + 3) % 64 for _ in range(n)]
            positions += list(range(CONTEXT, CONTEXT + n))
            plan.segments.append(Segment.chunk(region, CONTEXT, slice(start, start + n), CPU))
        rows = torch.arange(len(ids))
        logits = self.runner.forward(plan, torch.tensor(ids), torch.tensor(positions), rows, rows[:0]).logits
        return logits[:own_rows]


@pytest.fixture(scope="module")
def bench() -> Bench:
    torch.manual_seed(0)
    return Bench(ModelRunner(tiny_llama(vocab_size=64, seed=5, layers=2), "auto"))


@pytest.mark.parametrize("own_rows", [1, 3])
def test_rows_get_the_same_bits_in_every_bucket(bench: Bench, own_rows: int) -> None:
    alone = bench.step(own_rows, 0)
    for bucket in DEFAULT_BUCKETS:
        for total in sorted({max(own_rows, bucket - 1), bucket}):
            shared = bench.step(own_rows, total - own_rows)
            assert torch.equal(shared, alone), (
                f"{own_rows} rows alone and in a {total}-row step differ by {(shared - alone).abs().max():.3g}"
            )


def test_rows_beyond_the_largest_bucket_stay_within_rounding(bench: Bench) -> None:
    """Past the largest bucket a step runs unpadded on F.linear: equal to rounding, bit equality not promised."""
    alone = bench.step(1, 0)
    torch.testing.assert_close(bench.step(1, max(DEFAULT_BUCKETS) + 7), alone, atol=1e-5, rtol=1e-5)
