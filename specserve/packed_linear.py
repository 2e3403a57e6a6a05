"""Linear products with weights prepacked once for the CPU's GEMM kernels.

On a CPU a verify step reads every weight once, so its cost should hardly
grow from 1 to 8 rows. ``F.linear`` does not behave so: it repacks the weight
into the GEMM kernel's blocked layout on every call, and for fp32 at 3-32 rows
that repacking costs more than the product (this module's figures, each
kernel's below included, are in docs/benchmarks.md, "Smaller figures behind
rules in the code"). Prepacking once at start-up is what inductor's "freezing" does
for a compiled graph; here it is explicit, so it costs no compile time and no
graph cache.

Packed kernels, chosen per dtype and CPU (``available_packing``), and int8 on request:

- **oneDNN** (``torch.ops.mkldnn._linear_pointwise``): bf16 and fp16 where
  the CPU converts them natively (AVX512BW/VL/DQ or AVX-NE-CONVERT; an
  AVX2-only CPU runs them on ``F.linear``), and fp32 except on Intel's. One
  pack serves every row count. On AMD
  CPUs it is the fast fp32 one: MKL's kernels are Intel's own and do not
  take AMD's fast paths (several times slower at 1-16 rows).
- **MKL** (``torch.ops.mkl._mkl_linear``, a weight packed by
  ``cblas_sgemm_pack`` for one row count): fp32 on Intel CPUs, where it is
  the fast one measured; called with another row count it falls back to an
  unpacked product, so steps run padded to a few row counts (``MKL_BUCKETS``),
  one pack serving all where MKL's layout does not depend on the row count
  (``one_pack_serves``), else a pack per bucket.
- **int8** (``--weights int8``, opt-in): torch's weight-only int8 product
  (``torch._weight_int8pack_mm``) over weights quantized once, symmetric per
  output channel, with bf16 scales; the activations are rounded to bf16 for
  the product, its fast path on x86 (with fp32 activations the kernel is
  about 10x slower). It reads a quarter of fp32's bytes, which pays at 1-4
  rows, but its cost grows with the rows faster than fp32's, to about the same
  at 8 and more at 16. The weights
  are then other weights: what the model computes changes, as it does in
  bf16, and rounding the inputs to bf16 turns last-bit differences
  elsewhere in a step (CPU attention rounds a query row by how many share
  its call) into bf16-sized ones. Measured, speculative output then leaves
  plain int8 decoding far more often than plain decoding leaves itself (19
  of 20 Spec-Bench prompts against 6, ``bench.numerics --weights int8``):
  greedy identity does not hold, not even in bf16's sense.
- **fp16** (fp32 products over weights stored in fp16, FBGEMM's
  ``linear_dynamic_fp16``): for a weight every value of which fp16 holds
  exactly once scaled by a power of two (``fp16_scale``: a bf16 model's LM
  head), chosen by ``fp32_head``. The kernel widens each
  weight to fp32 and multiplies fp32 inputs in fp32, so the products are the
  fp32 products; only the order of the sums differs, as it does between any
  two kernels. It reads half the bytes, which pays up to about 16 rows; every
  row count from 1 to 64 gives a row the same bits. Its cost grows with the
  rows faster than oneDNN's fp32 product's, which is faster from about 32 rows,
  so steps past the largest bucket run that one, on a
  second pack of the fp32 weights (no fp32 copy is kept beside the packs:
  together they hold 0.75x the bytes of the fp32 head's copy and pack).
- **blocks** (fp32 products over weights stored as llama.cpp's Q4_1 or Q8_0
  blocks, ``specserve.block_weights``): for an fp32 weight every value of
  which such blocks hold exactly (a model de-quantized from a GGUF file:
  the default target's are), chosen by ``weight_blocks``. The kernel
  rebuilds each weight exactly in fp32 and multiplies fp32 inputs in fp32:
  the fp32 model's products from 6/32 (Q4_1) or 9/32 (Q8_0) of its bytes.
  Every row count gives a row the same bits by construction. Past about 128
  rows (a prompt's prefill) oneDNN's fp32 product is faster, so steps past
  the largest bucket run it, on a second pack, as with fp16.
- **none** (GPUs, CPUs without oneDNN, ``--compile off``): ``F.linear``.

``SPECSERVE_FP32_GEMM=mkl|onednn`` overrides the fp32 choice (benchmarks
compare the two with it).

Batch invariance: a row's bits must not depend on how many rows share its
step (a token scored inside a tree must get the logits it gets in a plain
one-token step). Neither kernel promises it: MKL takes a GEMV path for one
row and on some CPUs its 2-row product rounds unlike 4 rows, and oneDNN's
fp32 one-row product of SmolLM2's down projection rounds unlike two rows.
So the row counts a product may run at are checked once per weight shape at
start-up (``row_invariant_rows``: random weights of the shape, each count
against the largest) and a step with another count runs padded to the next
kept one. Past the largest (32 rows), bit equality is not promised. The
probe's results are kept in the start-up cache (``kept_invariant_rows``,
``specserve.startup_cache``), keyed by all they depend on, so a later start on
the same machine reads them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Sequence
from functools import cache
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from specserve.block_weights import (
    BLOCKS_KIND,
    BlockFormat,
    Blocks,
    BlockWeight,
    block_kernels,
    find_blocks,
    kept_blocks,
    kernel_source_digest,
    quantize_q4_1,
)
from specserve.hardware import cpu_flags, cpu_model, cpu_vendor
from specserve.startup_cache import result_store, tensor_store

log = logging.getLogger(__name__)

Packing = Literal["mkl", "onednn", "int8", "fp16", "blocks", "none"]


def kernel_name(packing: Packing, unpacked: str) -> str:
    """For logs and reports: the kernel a packing runs on; ``unpacked`` where it packs nothing."""
    names = {"mkl": "MKL", "onednn": "oneDNN", "int8": "int8", "fp16": "FBGEMM fp16-weight", "blocks": "GGUF-block"}
    return names.get(packing, unpacked)


# Row counts MKL's packed product runs at (each needs a pack made for it); a step with more rows runs unpadded.
MKL_BUCKETS: tuple[int, ...] = (2, 4, 8, 16, 32)
# oneDNN's pack serves any row count: every count up to the largest is a candidate.
ONEDNN_ROWS: tuple[int, ...] = tuple(range(1, 33))
# The row count oneDNN's blocked layout is made for; 8 measured fastest from 1 to 16 rows (1 was slower at 4+).
ONEDNN_HINT = 8
FP32_GEMM_ENV = "SPECSERVE_FP32_GEMM"
ROW_INVARIANCE_KIND = "row-invariance"  # the start-up cache's folder of probe results (``kept_invariant_rows``)


def available_packing(dtype: torch.dtype, device: torch.device) -> Packing:
    """The packed kernel this dtype and device have, or "none"."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "none"
    if dtype == torch.float32:
        chosen = os.environ.get(FP32_GEMM_ENV, "")
        if chosen not in ("", "mkl", "onednn"):
            raise ValueError(f"{FP32_GEMM_ENV} must be mkl or onednn, not {chosen!r}")
        mkl = torch.backends.mkl.is_available()
        if chosen == "mkl" or (not chosen and mkl and cpu_vendor() == "GenuineIntel"):
            return "mkl" if mkl else "onednn"
        return "onednn"
    if dtype == torch.bfloat16:
        # oneDNN packs bf16 only where the CPU converts it natively (AVX512BW/VL/DQ or AVX-NE-CONVERT):
        # an AVX2-only EPYC raises at the first pack
        return "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "none"
    if dtype == torch.float16:
        return "onednn" if torch.ops.mkldnn._is_mkldnn_fp16_supported() else "none"
    return "none"


def fp16_scale(weight: torch.Tensor) -> int | None:
    """A power of two ``s`` such that fp16 holds every value of ``weight * 2**s`` exactly, or None.

    A bf16 value has fp16's precision and fp32's range; scaled so that the largest lands near the top of
    fp16's range, every value down to about 2**-32 of it fits too (a model's weights all do, or are zero).
    Scaling by a power of two changes no product's or sum's bits but the exponent's, so dividing the
    result by it again gives the unscaled products exactly.
    """
    with torch.inference_mode():
        largest = float(weight.detach().abs().max()) if weight.numel() else 0.0
        if not math.isfinite(largest):
            return None
        scale = 15 - math.ceil(math.log2(largest)) if largest > 0 else 0
        scaled = weight.detach().float() * 2.0**scale
        return scale if torch.equal(scaled.half().float(), scaled) else None


def has_fp16_weight_products() -> bool:
    """Whether this torch build has FBGEMM, whose product the "fp16" packing runs on."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def weight_blocks(weights: Sequence[torch.Tensor]) -> list[Blocks] | None:
    """Each of ``weights`` as llama.cpp blocks, where fp32 products over all of them can run on the block kernel:
    fp32 weights on a CPU, each of them blocks exactly (``block_weights.find_blocks``), and the kernel built
    here; else None. The blocks found are what ``PackedLinear`` packs (``blocks=``): found once a weight."""
    if not weights or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return None
    store = tensor_store(BLOCKS_KIND)  # blocks an earlier start found in these very weights (``kept_blocks``)
    found: list[Blocks] = []
    for weight in weights:  # the weights first: random ones (a test's tiny model) fail at once, before any build
        blocks = kept_blocks(weight, store)
        if blocks is None:
            return None
        found.append(blocks)
    if store is not None and store.written:
        log.info("found the llama.cpp blocks of %d weights (kept in %s)", store.written, store.folder)
    return found if block_kernels() is not None else None


class HeadPacking(NamedTuple):
    """The kernel for an LM head's fp32 product and, where it is "blocks", the head's blocks."""

    packing: Packing
    blocks: Blocks | None = None


def fp32_head(weight: torch.Tensor) -> HeadPacking:
    """The kernel for an fp32 product over ``weight`` (an LM head): llama.cpp blocks where they hold the fp32
    weights exactly (a sixth to a quarter of the bytes, ``weight_blocks``); else fp16-stored weights where
    fp16 holds them exactly (scaled, ``fp16_scale``) and FBGEMM is here (half the bytes, the same products);
    else the fp32 packing of ``available_packing``."""
    found = weight_blocks([weight.float()])
    if found is not None:
        return HeadPacking("blocks", found[0])
    if weight.device.type == "cpu" and has_fp16_weight_products() and fp16_scale(weight) is not None:
        return HeadPacking("fp16")
    return HeadPacking(available_packing(torch.float32, weight.device))


def candidate_rows(packing: Packing) -> tuple[int, ...]:
    """The row counts a product packed so may run at, before the invariance check."""
    return {
        "mkl": MKL_BUCKETS,
        "onednn": ONEDNN_ROWS,
        "int8": ONEDNN_ROWS,
        "fp16": ONEDNN_ROWS,
        "blocks": ONEDNN_ROWS,
    }.get(packing, ())


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
def row_invariant_rows(
    packing: Packing, dtype: torch.dtype, out_features: int, in_features: int, candidates: tuple[int, ...]
) -> tuple[int, ...]:
    """The candidate row counts at which the packed product computes each row exactly as the largest does.

    A count whose kernel rounds otherwise is dropped, and its steps run padded to the next kept count. The
    layout and reduction order depend on the shape, the row count, the dtype, the CPU and the library, not
    on the values, so random weights of the shape decide it.
    """
    if packing == "none" or not candidates:
        return candidates
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    most = max(candidates)
    x = torch.randn(most, in_features, generator=generator).to(dtype)
    with torch.inference_mode():
        if packing == "mkl":

            def product(rows: int) -> torch.Tensor:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                return torch.ops.mkl._mkl_linear(x[:rows], packed, weight, None, rows)

        elif packing == "int8":
            quantized, scales = quantize_int8(weight)

            def product(rows: int) -> torch.Tensor:
                return int8_product(x[:rows].clone(), quantized, scales)

        elif packing == "fp16":
            fp16_pack = torch.ops.quantized.linear_prepack_fp16(weight.half().float(), None)  # now exact

            def product(rows: int) -> torch.Tensor:
                return torch.ops.quantized.linear_dynamic_fp16(x[:rows].clone(), fp16_pack)

        elif packing == "blocks":
            blocks = PackedLinear(quantize_q4_1(weight), None, "blocks", ())

            def product(rows: int) -> torch.Tensor:
                return blocks(x[:rows].clone())

        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_HINT)

            def product(rows: int) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x[:rows].clone(), packed, None, "none", [], "")

        reference = product(most)
        return tuple(rows for rows in sorted(candidates) if torch.equal(product(rows), reference[:rows]))


def invariant_rows(packing: Packing, dtype: torch.dtype, products: set[tuple[int, int]]) -> tuple[int, ...]:
    """The row counts at which every product of these weight shapes (out, in) computes each row alike here.

    Empty for an unpacked product (it runs at its own size); the largest candidate where none is kept.
    """
    candidates = candidate_rows(packing)
    if not candidates:
        return ()
    kept = set(candidates)
    for out_features, in_features in sorted(products):
        kept &= set(kept_invariant_rows(packing, dtype, out_features, in_features, candidates))
    return tuple(sorted(kept)) or candidates[-1:]


# Bump when ``row_invariant_rows`` changes what it probes (its weights, inputs, products or comparison): the
# results kept by earlier versions are then not read.
PROBE_VERSION = 1
# Environment variables that steer which code paths oneDNN, MKL and ATen take, so which rows come out alike.
_KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "MKL_NUM_THREADS",
)


@cache
def _kernel_libraries() -> dict[str, str]:
    """This process's CPU and the libraries its products run on (fixed for the process's life)."""
    config = torch.__config__.show()  # the MKL and oneDNN versions, ATen's build settings
    return {
        "cpu": cpu_model(),
        "cpu_flags": " ".join(sorted(cpu_flags())),
        "torch": torch.__version__,
        "torch_build": hashlib.sha256(config.encode()).hexdigest()[:16],
        "block_kernel": kernel_source_digest(),
    }


def probe_key(
    packing: Packing, dtype: torch.dtype, out_features: int, in_features: int, candidates: tuple[int, ...]
) -> dict[str, Any]:
    """Everything ``row_invariant_rows``' result depends on: its arguments, the probe, the CPU, the libraries (and
    the block kernel's source), how they are steered, and the threads a product runs on here."""
    return {
        "probe": PROBE_VERSION,
        "packing": packing,
        "dtype": str(dtype),
        "shape": [out_features, in_features],
        "candidates": list(candidates),
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "fp32_matmul": torch.get_float32_matmul_precision(),
        "env": {name: os.environ[name] for name in _KERNEL_ENV if name in os.environ},
        **_kernel_libraries(),
    }


def kept_invariant_rows(
    packing: Packing, dtype: torch.dtype, out_features: int, in_features: int, candidates: tuple[int, ...]
) -> tuple[int, ...]:
    """``row_invariant_rows``, kept in the start-up cache (``specserve.startup_cache``) under ``probe_key``: a
    start on the same machine, libraries and threads reads what an earlier one probed."""
    store = result_store(ROW_INVARIANCE_KIND)
    if store is None or packing == "none" or not candidates:
        return row_invariant_rows(packing, dtype, out_features, in_features, candidates)
    key = probe_key(packing, dtype, out_features, in_features, candidates)
    kept = store.get(key)
    if kept is not None and _valid_rows(kept, candidates):
        return tuple(kept)
    if kept is not None:
        log.warning("start-up cache record %s holds no valid row counts: probed again", store.path(key))
    rows = row_invariant_rows(packing, dtype, out_features, in_features, candidates)
    shape = [out_features, in_features]
    log.info("probed the row counts of %s %s products of %s (kept in %s)", packing, dtype, shape, store.path(key))
    store.put(key, list(rows))
    return rows


def _valid_rows(rows: Any, candidates: tuple[int, ...]) -> bool:
    """Whether ``rows`` can be a probe's result: sorted distinct candidates, the largest among them."""
    return (
        isinstance(rows, list)
        and all(isinstance(n, int) and n in candidates for n in rows)
        and rows == sorted(set(rows))
        and max(candidates) in rows
    )


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as symmetric per-output-channel int8 values and their bf16 scales (w ~ q * scale)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(torch.bfloat16)
    quantized = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scales.contiguous()


def int8_product(x: torch.Tensor, quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (quantized * scales).T`` in ``x``'s dtype, ``x`` rounded to bf16 for the kernel."""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), quantized, scales).to(x.dtype)


class PackedLinear:
    """``y = x @ W.T + b`` with ``W`` prepacked for ``packing``; ``x`` is [rows, in]."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packing: Packing,
        buckets: Sequence[int],
        blocks: Blocks | None = None,
    ) -> None:
        """``blocks``: for "blocks" packing, the weight's blocks where the caller found them already
        (``weight_blocks``); else they are found here."""
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packing = packing
        self.buckets = tuple(sorted(buckets))
        self._mkl: dict[int, torch.Tensor] = {}
        self._onednn: torch.Tensor | None = None
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fp16: object | None = None  # FBGEMM's packed fp16 weight (a script object), scaled by 2**_scale
        self._scale = 0
        self._blocks: BlockWeight | None = None
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
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, ONEDNN_HINT)
            elif packing == "int8":
                self._int8 = quantize_int8(self.weight)
                self.weight = self._int8[0]  # the float weights are not kept: int8 is what the product reads
            elif packing == "fp16":
                scale = fp16_scale(self.weight)
                if scale is None:
                    raise ValueError("fp16 packing takes only weights that fp16 holds exactly, scaled")
                self._scale = scale
                scaled = self.weight.float() * 2.0**scale  # a copy: FBGEMM's pack saturates its input in place
                self._fp16 = torch.ops.quantized.linear_prepack_fp16(scaled, None)
                if torch.backends.mkldnn.is_available():
                    # Past the largest bucket (bit equality is not promised there) FBGEMM's cost outgrows the
                    # fp32 product's: those steps run oneDNN's, on a pack of the fp32 weights.
                    self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.float(), ONEDNN_HINT)
                self.weight = self.weight.new_empty(self.weight.shape[0], 0)  # the packs hold the weights
            elif packing == "blocks":
                found = blocks if blocks is not None else find_blocks(self.weight)
                if found is not None and found.shape != tuple(self.weight.shape):
                    raise ValueError(f"blocks of a {list(found.shape)} weight given for {list(self.weight.shape)}")
                if found is None or block_kernels() is None:
                    raise ValueError("block packing takes only fp32 weights that llama.cpp blocks hold exactly")
                self._blocks = BlockWeight(found)
                if torch.backends.mkldnn.is_available() and self.buckets:
                    # Past the largest bucket bit equality is not promised: those steps run oneDNN's fp32 product.
                    self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, ONEDNN_HINT)
                self.weight = self.weight.new_empty(self.weight.shape[0], 0)  # the packs hold the weights

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def runs_wide_rows_on_onednn(self) -> bool:
        """fp16-stored or block weights whose steps past the largest bucket run oneDNN's fp32 product."""
        return (self._fp16 is not None or self._blocks is not None) and self._onednn is not None

    @property
    def blocks(self) -> BlockWeight | None:
        """The block kernel's weight, where this product reads llama.cpp blocks (at up to the largest bucket)."""
        return self._blocks

    @property
    def block_format(self) -> BlockFormat | None:
        """The llama.cpp block format the weights are read in ("Q4_1", "Q8_0"), or None."""
        return None if self._blocks is None else self._blocks.block_format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packing == "mkl":
            bucket = bucket_for(rows, self.buckets)
            packed = self._mkl.get(bucket)
            if packed is None:  # beyond the largest bucket
                return F.linear(x, self.weight, self.bias)
            padded = F.pad(x, (0, 0, 0, bucket - rows)) if bucket != rows else x
            return torch.ops.mkl._mkl_linear(padded, packed, self.weight, self.bias, bucket)[:rows]
        narrow = not self.buckets or rows <= self.buckets[-1]
        if self._blocks is not None and (self._onednn is None or narrow):
            # Every row count computes a row alike: no padding. The kernel takes fp32 inputs.
            y = self._blocks(x)
            return y if self.bias is None else y + self.bias
        if self._int8 is None and self._onednn is None and self._fp16 is None:
            return F.linear(x, self.weight, self.bias)
        bucket = bucket_for(rows, self.buckets)  # one pack serves every row count: padded only for invariance
        padded = F.pad(x, (0, 0, 0, bucket - rows)) if bucket != rows else x
        if self._fp16 is not None and (self._onednn is None or narrow):
            y = torch.ops.quantized.linear_dynamic_fp16(padded.contiguous(), self._fp16)[:rows] * 2.0**-self._scale
            return y if self.bias is None else y + self.bias
        if self._int8 is not None:
            y = int8_product(padded, *self._int8)[:rows]
            return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(padded, self._onednn, self.bias, "none", [], "")[:rows]
