"""The draft head's products on prepacked weights: F.linear's numbers within rounding, the same parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draft_service.head_products import PackableLinear, head_packing, pack_of, product
from specserve.packed_linear import available_packing
from tests.unit.test_draft_head import VOCAB, new_head

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    available_packing(torch.float32, CPU) == "none", reason="no packed GEMM in this torch build"
)
# bf16 packs need a CPU that converts bf16 natively (an AVX2-only EPYC has none: its bf16 head runs F.linear)
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(available_packing(torch.bfloat16, CPU) == "none", reason="no bf16 packing here"),
    ),
]


def assert_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to rounding: fp32 sums in another order; bf16 (8 significant bits) one bf16 step apart."""
    tolerance = 1e-5 if want.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 128), (320, 576)])
def test_packed_products_equal_f_linear_within_rounding_at_1_to_16_rows(
    dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    x = torch.randn(2, 8, in_features, generator=generator).to(dtype)  # [batch, n, in], up to 16 rows
    pack = pack_of(weight, None, head_packing(dtype, CPU, "packed"))
    assert pack is not None
    with torch.inference_mode():
        for rows in range(1, 17):
            flat = x.reshape(16, in_features)[:rows]
            got = product(flat[None], weight, None, pack)
            assert got.shape == (1, rows, out_features) and got.dtype == dtype
            assert_rounding_apart(got[0], F.linear(flat, weight))
            # Each row as it comes out alone: a draft does not depend on how many rows shared its step.
            assert torch.equal(got[0, :1], product(flat[:1], weight, None, pack))
        batched = product(x, weight, None, pack)
    assert batched.shape == (2, 8, out_features)
    assert_rounding_apart(batched, F.linear(x, weight))


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packed_head_computes_the_f_linear_heads_features_and_logits(dtype: torch.dtype) -> None:
    plain = new_head().eval().to(dtype)
    packed = copy.deepcopy(plain)
    packed.pack_products("packed")
    assert packed.packing == available_packing(dtype, CPU) and "prepacked" in packed.products
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in (1, 4, 16):
            features = torch.randn(1, rows, 64, generator=generator).to(dtype)
            tokens = torch.randint(VOCAB, (1, rows), generator=generator)
            want, got = plain(features, tokens), packed(features, tokens)
            assert_rounding_apart(got.features, want.features)
            assert_rounding_apart(got.logits, want.logits)


def test_linear_keeps_f_linear_bit_for_bit() -> None:
    head = new_head().eval()
    features, tokens = torch.randn(2, 5, 64), torch.randint(VOCAB, (2, 5))
    with torch.inference_mode():
        before = head(features, tokens)
        head.pack_products("linear")
        after = head(features, tokens)
    assert head.packing == "none" and head.products == "F.linear (--head-matmul linear)"
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 8 and all(isinstance(m, PackableLinear) and m.pack is None for m in linears)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.features, before.features)


def test_packing_keeps_the_parameters_and_a_changed_weight_is_never_served_stale() -> None:
    head = new_head().eval()
    params = dict(head.named_parameters())
    state = {name: t.clone() for name, t in head.state_dict().items()}
    head.pack_products("packed")
    head.pack_products("packed")  # again: packed anew, wrapped once
    assert dict(head.named_parameters()) == params  # the same objects under the same names
    assert head.state_dict().keys() == state.keys()
    assert all(torch.equal(t, state[name]) for name, t in head.state_dict().items())
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 8 and all(type(m) is PackableLinear for m in linears)
    x = torch.randn(3, 128)
    with torch.no_grad():
        head.fc.weight.mul_(2)  # an in-place change (a load, a training step): the pack no longer serves it
        torch.testing.assert_close(head.fc(x), F.linear(x, head.fc.weight), rtol=0, atol=0)
    half = copy.deepcopy(head).to(torch.bfloat16)  # copies and dtype changes drop or outdate the packs
    with torch.inference_mode():
        torch.testing.assert_close(half.fc(x.bfloat16()), F.linear(x.bfloat16(), half.fc.weight), rtol=0, atol=0)


def test_a_packed_head_still_trains_through_f_linear() -> None:
    head = new_head()
    head.pack_products("packed")
    out = head(torch.randn(1, 3, 64), torch.randint(VOCAB, (1, 3)))
    out.logits.sum().backward()
    linears = [m for m in head.modules() if isinstance(m, PackableLinear)]
    assert len(linears) == 8 and all(m.pack is not None and m.weight.grad is not None for m in linears)


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="--head-matmul must be one of auto, packed, linear, int8"):
        head_packing(torch.float32, CPU, "fast")
    assert head_packing(torch.float32, torch.device("meta"), "packed") == "none"


@needs_packing
def test_int8_head_drafts_close_to_the_float_head_and_alike_at_every_row_count() -> None:
    """``--head-matmul int8``: int8 copies of the weights, so near the float head's numbers, not equal."""
    plain = new_head().eval()
    quantized = copy.deepcopy(plain)
    quantized.pack_products("int8")
    assert quantized.packing == "int8" and "int8" in quantized.products
    generator = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        features = torch.randn(1, 8, 64, generator=generator)
        tokens = torch.randint(VOCAB, (1, 8), generator=generator)
        want, got = plain(features, tokens), quantized(features, tokens)
        assert not torch.equal(got.logits, want.logits)
        scale = float(want.logits.abs().max())
        torch.testing.assert_close(got.logits, want.logits, atol=0.1 * scale, rtol=0)
        # each row as it comes out in a one-row step: drafts do not depend on how many rows shared a step
        fc = quantized.fc
        rows = torch.randn(8, 128, generator=generator)
        assert torch.equal(fc(rows)[:1], fc(rows[:1]))


def test_bf16_without_native_support_runs_unpacked() -> None:
    """Where oneDNN cannot pack bf16 (an AVX2-only CPU raised at the first pack), bf16 products run F.linear."""
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (available_packing(torch.bfloat16, CPU) == "onednn") == (native and torch.backends.mkldnn.is_available())
