"""The LM head's product: both forms give the same logits; the faster form is chosen per row count."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from specserve.head_matmul import MARGIN, ROW_COUNTS, HeadMatmul, head_matmul, head_product, rounded_rows


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(1000, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("rows", [2, 3, 5, 8, 13, 16])
def test_both_forms_give_the_same_logits(weight: torch.Tensor, rows: int) -> None:
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    transposed = HeadMatmul(weight, frozenset(ROW_COUNTS))(x)
    assert transposed.is_contiguous() and transposed.shape == (rows, 1000)
    torch.testing.assert_close(transposed, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    # Same argmax row by row: the verifier's greedy decision does not depend on the form.
    assert torch.equal(transposed.argmax(-1), F.linear(x, weight).argmax(-1))


@pytest.mark.parametrize("rows", [1, 17, 40])
def test_one_row_and_many_rows_always_take_f_linear(weight: torch.Tensor, rows: int) -> None:
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    # Bit for bit: plain decoding's logits do not change whatever form the few-row counts use.
    assert torch.equal(HeadMatmul(weight, frozenset(ROW_COUNTS))(x), F.linear(x, weight))


def test_row_counts_round_up_to_the_timed_ones() -> None:
    assert [rounded_rows(r) for r in (1, 2, 3, 4, 5, 9, 16, 17, 300)] == [0, 2, 4, 4, 8, 16, 16, 0, 0]


def test_the_transposed_form_is_chosen_only_where_it_is_clearly_faster(weight: torch.Tensor) -> None:
    timings = {(form, rows): 1.0 for form, rows in itertools.product(("linear", "transposed"), ROW_COUNTS)}
    timings[("transposed", 2)] = 0.4  # 2.5x faster: chosen
    timings[("transposed", 4)] = MARGIN  # exactly at the margin: chosen
    timings[("transposed", 8)] = MARGIN + 0.01  # within noise of F.linear: not chosen
    timings[("transposed", 16)] = 2.0  # slower: not chosen
    chosen = HeadMatmul.choose(weight, timings)
    assert chosen.transposed_rows == frozenset({2, 4})
    assert chosen.describe() == "(W @ x.T).T at 2,4 rows (rounded up), F.linear otherwise"
    assert HeadMatmul(weight).describe() == "F.linear at every row count"


def test_a_measurement_times_both_forms_at_every_row_count(weight: torch.Tensor) -> None:
    ticks = itertools.count()
    chosen = HeadMatmul.measured(weight, repeats=2, clock=lambda: float(next(ticks)))
    # 2 clock reads per repeat, 2 repeats, 2 forms, each row count: every (form, rows) pair was timed.
    assert next(ticks) == 2 * 2 * 2 * len(ROW_COUNTS)
    assert chosen.transposed_rows == frozenset()  # equal times: F.linear stays


def test_linear_is_never_measured_and_unknown_forms_are_refused(weight: torch.Tensor) -> None:
    assert head_matmul(weight, "linear").transposed_rows == frozenset()
    assert head_matmul(weight, "auto").transposed_rows <= frozenset(ROW_COUNTS)
    with pytest.raises(ValueError, match="choose one of auto, linear"):
        head_matmul(weight, "fast")


def test_batched_inputs_keep_their_shape(weight: torch.Tensor) -> None:
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(7))  # the draft head's [batch, n, hidden]
    logits = head_product(x, weight, frozenset({4}))
    assert logits.shape == (1, 4, 1000)
    torch.testing.assert_close(logits, x @ weight.T, rtol=1e-5, atol=1e-5)
