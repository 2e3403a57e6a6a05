"""Batch invariance: a row's result is the same bits however many rows share its step (fp32, prepacked).

Greedy speculation is token-identical to plain decoding only if a token
scored inside a tree gets exactly the logits it gets in a plain one-token
step. The engine pads every step to a row bucket and runs it on MKL's packed
GEMM, keeping only the buckets at which it computes each row alike on this
CPU (``packed_linear.row_invariant_buckets``); these tests check the result on
the machine they run on, for every bucket.
"""

from __future__ import annotations

import pytest
import torch

from bench.step_invariance import RowProbe
from target_service.model_runner import ModelRunner
from target_service.packed_linear import DEFAULT_BUCKETS, available_packing
from tests.conftest import tiny_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    available_packing(torch.float32, CPU) != "mkl", reason="no MKL packed GEMM in this torch build"
)


@pytest.fixture(scope="module")
def bench() -> RowProbe:
    torch.manual_seed(0)
    return RowProbe(ModelRunner(tiny_llama(vocab_size=64, seed=5, layers=2), "auto"), vocab=64)


@pytest.mark.parametrize("own_rows", [1, 3])
def test_rows_get_the_same_bits_in_every_bucket(bench: RowProbe, own_rows: int) -> None:
    alone = bench.step(own_rows, 0)
    for bucket in DEFAULT_BUCKETS:
        for total in sorted({max(own_rows, bucket - 1), bucket}):
            shared = bench.step(own_rows, total - own_rows)
            assert torch.equal(shared, alone), (
                f"{own_rows} rows alone and in a {total}-row step differ by {(shared - alone).abs().max():.3g}"
            )


def test_rows_beyond_the_largest_bucket_stay_within_rounding(bench: RowProbe) -> None:
    """Past the largest bucket a step runs unpadded on F.linear: equal to rounding, bit equality not promised."""
    alone = bench.step(1, 0)
    torch.testing.assert_close(bench.step(1, max(DEFAULT_BUCKETS) + 7), alone, atol=1e-5, rtol=1e-5)
