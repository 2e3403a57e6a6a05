"""Linear products with weights prepacked once for the CPU's GEMM kernels.

On a CPU a verify step reads every weight once, so its cost should hardly
grow from 1 to 8 rows. ``F.linear`` does not behave so: it repacks the weight
into the GEMM kernel's blocked layout on every call, and for fp32 at 3-32 rows
that repacking costs more than the product (measured on an AVX512 Xeon over
SmolLM2-135M's layers: 4 rows 41 ms against 23 ms prepacked, 16 rows 105 ms
against 31 ms). Prepacking once at start-up is what inductor's "freezing" does
for a compiled graph; here it is explicit, so it costs no compile time and no
graph cache.

- **fp32 on an x86 CPU with MKL**: ``torch.ops.mkl._mkl_linear`` with a weight
  packed by ``cblas_sgemm_pack`` for one row count; called with any other
  count it falls back to an unpacked product, so the engine runs steps at a
  few static row counts (buckets). One pack serves every bucket where MKL's
  packed layout does not depend on the row count: checked once per weight
  shape at start-up (``one_pack_serves``: the shared pack must give exactly
  the bits of a pack made for each bucket), else each bucket keeps its own
  pack (one more copy of the weights per bucket). MKL's packed kernel
  computes each row alike at every row count from 2 up (bit for bit on the
  Xeons measured so far; ``tests/unit/test_step_invariance.py`` checks the
  machine it runs on), while one row takes a GEMV path that rounds
  differently: one row runs as two. Not every CPU is so kind: on an AMD EPYC
  with AVX512 (Zen 4) a 2-row product rounds unlike 4 rows and up, so the
  buckets a step may run at are checked once per weight shape at start-up
  (``row_invariant_buckets``) and the odd ones dropped (there, 1-3 rows run
  as 4).
- **bf16 or fp16 on a CPU**: oneDNN's packed linear
  (``torch.ops.mkldnn._linear_pointwise``), one pack for every row count.
- **anything else** (GPUs, CPUs without MKL, ``--compile off``): ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

Packing = Literal["mkl", "onednn", "none"]

# Row counts a step is padded up to; a step with more rows runs unpadded.
DEFAULT_BUCKETS: tuple[int, ...] = (2, 4, 8, 16, 32)


def available_packing(dtype: torch.dtype, device: torch.device) -> Packing:
    """The packed kernel this dtype and device have, or "none"."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "none"
    if dtype == torch.float32:
        return "mkl" if torch.backends.mkl.is_available() else "none"
    if dtype in (torch.bfloat16, torch.float16):
        return "onednn"
    return "none"


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``rows``; ``rows`` itself beyond the largest."""
    for bucket in buckets:
        if rows <= bucket:
            return bucket
    return rows


@cache
def one_pack_serves(out_features: int, in_features: int, buckets: tuple[int, ...]) -> bool:
    """Whether one MKL pack made for the largest bucket computes every bucket exactly as its own pack does.

    The packed layout is a function of the shape, the row count, the CPU and MKL, not of the values, so
    random weights of the same shape decide it; a different layout would give wrong numbers, not rounding.
    """
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(max(buckets), in_features, generator=generator)
    with torch.inference_mode():
        shared = torch.ops.mkl._mkl_reorder_linear_weight(weight, max(buckets))
        for rows in buckets:
            own = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            expected = torch.ops.mkl._mkl_linear(x[:rows], own, weight, None, rows)
            if not torch.equal(torch.ops.mkl._mkl_linear(x[:rows], shared, weight, None, rows), expected):
                return False
    return True


@cache
def row_invariant_buckets(out_features: int, in_features: int, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets at which MKL's packed product computes each row exactly as the largest bucket does.

    A row's bits must not depend on how many rows share its step (a token scored in a tree must get the
    logits it gets in a plain step); a bucket whose kernel rounds otherwise is dropped, and its rows run
    padded to the next bucket. Like ``one_pack_serves``, random weights of the shape decide it.
    """
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator)
    most = max(buckets)
    x = torch.randn(most, in_features, generator=generator)
    with torch.inference_mode():
        reference = torch.ops.mkl._mkl_linear(
            x, torch.ops.mkl._mkl_reorder_linear_weight(weight, most), weight, None, most
        )
        kept = []
        for rows in sorted(buckets):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            if torch.equal(torch.ops.mkl._mkl_linear(x[:rows], packed, weight, None, rows), reference[:rows]):
                kept.append(rows)
    return tuple(kept)


class PackedLinear:
    """``y = x @ W.T + b`` with ``W`` prepacked for ``packing``; ``x`` is [rows, in]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packing: Packing, buckets: Sequence[int]
    ) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packing = packing
        self.buckets = tuple(sorted(buckets))
        self._mkl: dict[int, torch.Tensor] = {}
        self._onednn: torch.Tensor | None = None
        with torch.inference_mode():
            if packing == "mkl" and self.buckets:
                # The MKL pack must stay where it was made (its layout depends on its alignment): never copy it.
                out_features, in_features = self.weight.shape
                if one_pack_serves(out_features, in_features, self.buckets):
                    shared = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, max(self.buckets))
                    self._mkl = dict.fromkeys(self.buckets, shared)
                else:
                    self._mkl = {n: torch.ops.mkl._mkl_reorder_linear_weight(self.weight, n) for n in self.buckets}
            elif packing == "onednn":
                hint = self.buckets[len(self.buckets) // 2] if self.buckets else 8
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, hint)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packing == "mkl":
            bucket = bucket_for(rows, self.buckets)
            packed = self._mkl.get(bucket)
            if packed is None:  # beyond the largest bucket
                return F.linear(x, self.weight, self.bias)
            padded = F.pad(x, (0, 0, 0, bucket - rows)) if bucket != rows else x
            return torch.ops.mkl._mkl_linear(padded, packed, self.weight, self.bias, bucket)[:rows]
        if self._onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
