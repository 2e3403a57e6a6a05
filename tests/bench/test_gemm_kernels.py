"""bench.gemm_kernels' int8 weight-only column computes the product it names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.gemm_kernels import kernels
from specserve.packed_linear import has_fp16_weight_products, quantize_int8


def test_int8_weight_round_trips_within_half_a_step_per_channel() -> None:
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    quantized, scales = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (48,)
    assert int(quantized.abs().max()) == 127  # each channel's largest weight maps to the end of the range
    restored = quantized.float() * scales.float()[:, None]
    # bf16 scales move a value by at most 2^-8 of itself on top of the rounding step's half
    bound = scales.float()[:, None] * 0.5 + weight.abs() * 2**-8
    assert torch.all((restored - weight).abs() <= bound + 1e-7)


def test_every_kernel_computes_the_same_product() -> None:
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(96, 64, generator=generator) for _ in range(2)]
    x = torch.randn(4, 64, generator=generator)
    expected = F.linear(x, weights[-1])
    with torch.inference_mode():
        runs = kernels(weights, rows=4, int8=True)
        assert "int8 weight-only" in runs
        for name, run in runs.items():
            got = run(x)
            # int8 weights and bf16 activations: about 1% of the output's scale; the fp32 kernels: rounding only
            tolerance = 0.05 * expected.abs().max() if name == "int8 weight-only" else 1e-4
            assert torch.allclose(got, expected, atol=float(tolerance)), name


def test_the_head_kernels_include_fp16_stored_weights_and_compute_the_same_product() -> None:
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(96, 64, generator=generator).bfloat16().float()]  # a bf16 model's head
    x = torch.randn(4, 64, generator=generator)
    expected = F.linear(x, weights[-1])
    with torch.inference_mode():
        runs = kernels(weights, rows=4, fp16=True)
        if has_fp16_weight_products():
            assert "FBGEMM fp16-weight" in runs
        for name, run in runs.items():
            assert torch.allclose(run(x), expected, atol=1e-4), name


def test_the_block_column_computes_the_product_over_the_weights_rounded_to_blocks() -> None:
    from specserve.block_weights import block_kernels, quantize_q4_1

    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(96, 64, generator=generator)]
    x = torch.randn(4, 64, generator=generator)
    with torch.inference_mode():
        runs = kernels(weights, rows=4, blocks="Q4_1")
        if block_kernels() is None:
            assert "GGUF-block Q4_1" not in runs
            return
        got = runs["GGUF-block Q4_1"](x)
        assert torch.allclose(got, F.linear(x, quantize_q4_1(weights[-1])), atol=1e-4)
        assert not torch.allclose(got, F.linear(x, weights[-1]), atol=1e-4), "it times the rounded weights"
