"""The LM head on fp16-stored weights: the fp32 products of the fp32 head, from half the bytes.

A bf16 model's head weights are held exactly by fp16 once scaled by a power of two; FBGEMM's kernel widens
them to fp32 and multiplies fp32 inputs in fp32. So the head computes what the fp32 head computes, up to the
order of its sums, and a row's bits must not depend on how many rows share the product (batch invariance,
which greedy identity through trees rests on).
"""

from __future__ import annotations

import re

import pytest
import torch

from specserve.packed_linear import (
    ONEDNN_ROWS,
    PackedLinear,
    fp16_scale,
    fp32_head,
    has_fp16_weight_products,
    invariant_rows,
)
from target_service.model_runner import ModelRunner
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not has_fp16_weight_products(), reason="no FBGEMM in this torch build")


def bf16_weight(rows: int = 300, cols: int = 64, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    """A bf16 head's weights, as a model's init makes them (normal, std 0.02), widened to fp32 exactly."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * std).bfloat16().float()


def test_bf16_values_fit_fp16_once_scaled_and_fp32_values_do_not() -> None:
    weight = bf16_weight()
    scale = fp16_scale(weight)
    assert scale is not None
    scaled = weight * 2.0**scale
    assert torch.equal(scaled.half().float(), scaled)
    assert 2.0**14 < float(scaled.abs().max()) <= 2.0**15, "the largest value lands at the top of fp16's range"
    assert fp16_scale(torch.randn(300, 64)) is None, "fp32's 24 bits do not fit fp16's 11"
    assert fp16_scale(torch.tensor([[1.0, float("inf")]])) is None
    assert fp16_scale(torch.zeros(4, 4)) == 0


def test_the_head_packing_is_fp16_only_where_exact() -> None:
    assert fp32_head(bf16_weight()).packing == "fp16"
    assert fp32_head(torch.randn(300, 64)).packing != "fp16"
    assert fp32_head(bf16_weight().to("meta")).packing == "none"


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("std", [0.02, 2e-6, 3e4])  # within fp16's range, below it, above it: scaled to fit
def test_the_fp16_product_is_the_fp32_product(rows: int, std: float) -> None:
    weight, bias = bf16_weight(std=std), torch.randn(300) * std
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    exact = (x.double() @ weight.double().T + bias.double()).float()
    fp32 = torch.nn.functional.linear(x, weight, bias)
    original = weight.clone()
    head = PackedLinear(weight, bias, "fp16", invariant_rows("fp16", torch.float32, {(300, 64)}))
    assert torch.equal(weight, original), "packing changed the model's weights (FBGEMM saturates in place)"
    got = head(x)
    assert got.dtype == torch.float32
    # Both round only their sums: each as close to the exact products as the other, far inside bf16's rounding.
    fp32_error = float((fp32 - exact).abs().max())
    assert float((got - exact).abs().max()) <= max(4 * fp32_error, 1e-6 * std)
    assert head.weight.numel() == 0, "no float copy is kept beside the packs"


def test_inexact_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly"):
        PackedLinear(torch.randn(8, 8), None, "fp16", (1,))


def test_a_row_gets_the_same_bits_at_every_row_count() -> None:
    """FBGEMM's fp16 product computes a row alike at every row count on AVX512 CPUs; on a 2-core AVX2-only
    EPYC it rounds 1, 2, 7, 14 and 31 rows otherwise (its AVX2 kernel tiles rows differently). The start-up
    check keeps the counts that agree and pads a step to the next of them, so every count gives the same
    bits either way."""
    weight = bf16_weight(1000, 576)
    buckets = invariant_rows("fp16", torch.float32, {(1000, 576)})
    assert buckets and set(buckets) <= set(ONEDNN_ROWS) and max(buckets) == max(ONEDNN_ROWS)
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert buckets == ONEDNN_ROWS, f"FBGEMM's fp16 product rounds a row by its row count here: kept {buckets}"
    head = PackedLinear(weight, None, "fp16", buckets)
    x = torch.randn(max(ONEDNN_ROWS), 576, generator=torch.Generator().manual_seed(3))
    alone = head(x[:1])
    for rows in ONEDNN_ROWS:
        assert torch.equal(head(x[:rows])[:1], alone), f"row 0 alone and among {rows} rows differ (kept {buckets})"


def test_a_bf16_model_reads_its_head_in_fp16_and_an_fp32_model_in_fp32() -> None:
    model = tiny_llama(vocab_size=64, seed=5, layers=2)
    fp32 = ModelRunner(model, "auto")
    assert fp32.head_packing != "fp16"
    bf16 = ModelRunner(model.to(torch.bfloat16), "auto")
    assert bf16.head_packing == "fp16"
    # Rows 1-32 where every count is row-invariant (AVX512); the kept counts elsewhere (AVX2: not 1, 2, 7 ...).
    assert re.search(r"fp32 head FBGEMM fp16-weight at rows (1-32|\[[0-9, ]+\]), oneDNN beyond", bf16.describe())
    assert ModelRunner(model, "off").head_packing == "none"


def test_steps_past_the_largest_bucket_run_the_fp32_kernel() -> None:
    """FBGEMM's cost outgrows oneDNN's fp32 product's past 32 rows, where bit equality is not promised."""
    weight = bf16_weight(1000, 576)
    head = PackedLinear(weight, None, "fp16", ONEDNN_ROWS)
    x = torch.randn(max(ONEDNN_ROWS) + 8, 576, generator=torch.Generator().manual_seed(4))
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    fp32 = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert torch.equal(head(x), fp32), "a step past the largest bucket ran FBGEMM"
    scale = fp16_scale(weight)
    assert scale is not None
    fp16_pack = torch.ops.quantized.linear_prepack_fp16(weight * 2.0**scale, None)
    fp16 = torch.ops.quantized.linear_dynamic_fp16(x[:32].contiguous(), fp16_pack) * 2.0**-scale
    assert torch.equal(head(x[:32]), fp16), "a step within the buckets ran another kernel than FBGEMM"
