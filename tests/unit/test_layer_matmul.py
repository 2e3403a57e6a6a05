"""The decoder layers' products: the same numbers in either form, chosen per row count, over the same parameters."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from transformers import LlamaModel

from specserve.head_matmul import ROW_COUNTS, time_forms
from specserve.layer_matmul import FormedLinear, LayerMatmul, install_layer_matmul
from tests.conftest import tiny_llama

EVERY_SMALL_COUNT = frozenset(ROW_COUNTS)


def tiny_body() -> LlamaModel:
    body: LlamaModel = tiny_llama(vocab_size=97, context=64).model
    return body


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17])
def test_a_formed_linear_computes_what_nn_linear_does(bias: bool, rows: int) -> None:
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48, generator=torch.Generator().manual_seed(rows))
    formed = FormedLinear(linear, LayerMatmul(EVERY_SMALL_COUNT))
    with torch.no_grad():
        expected, got = linear(x), formed(x)
    assert got.shape == expected.shape and got.is_contiguous()
    if rows == 1 or rows > max(ROW_COUNTS):
        assert torch.equal(got, expected)  # plain decoding and large batches: nn.Linear's own product
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_installing_keeps_the_parameters_and_the_outputs() -> None:
    model = tiny_body()
    before = {name: p for name, p in model.named_parameters()}
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        one_row = model(ids[:, :1]).last_hidden_state
    forms = install_layer_matmul(model.layers, "linear")
    assert forms.transposed_rows == frozenset()
    formed = [m for m in model.modules() if isinstance(m, FormedLinear)]
    assert len(formed) == 2 * 7 and not any(type(m) is nn.Linear for m in model.modules())
    # The same tensors under the same names: state dicts, checkpoints and .to() see no difference.
    assert {name: p for name, p in model.named_parameters()} == before
    forms.transposed_rows = EVERY_SMALL_COUNT  # shared: every FormedLinear follows it
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
        assert torch.equal(model(ids[:, :1]).last_hidden_state, one_row)


def test_a_model_holds_one_choice_that_installing_again_makes_anew() -> None:
    model = tiny_body()
    first = install_layer_matmul(model.layers, "linear")
    first.transposed_rows = EVERY_SMALL_COUNT
    formed = [m for m in model.modules() if isinstance(m, FormedLinear)]
    # A second verifier over the same model: the same shared choice, made again, over the same modules.
    second = install_layer_matmul(model.layers, "linear")
    assert second is first and first.transposed_rows == frozenset()
    assert [m for m in model.modules() if isinstance(m, FormedLinear)] == formed
    assert all(m.forms is first for m in formed)


def test_auto_times_the_layers_here_and_unknown_forms_are_refused() -> None:
    model = tiny_body()
    forms = install_layer_matmul(model.layers, "auto")
    assert forms.transposed_rows <= EVERY_SMALL_COUNT
    assert forms.describe().endswith("F.linear otherwise") or forms.describe() == "F.linear at every row count"
    with pytest.raises(ValueError, match="choose one of auto, linear"):
        install_layer_matmul(model.layers, "fast")


def test_the_timing_runs_every_weight_in_each_form_at_each_row_count() -> None:
    weights = [torch.randn(32, 16), torch.randn(16, 32), torch.randn(8, 16)]
    ticks = itertools.count()
    timings = time_forms(weights, repeats=2, clock=lambda: float(next(ticks)))
    assert set(timings) == {(form, rows) for form in ("linear", "transposed") for rows in ROW_COUNTS}
    # 2 clock reads per repeat, 2 repeats, 2 forms, each row count; inputs of both widths were made.
    assert next(ticks) == 2 * 2 * 2 * len(ROW_COUNTS)
