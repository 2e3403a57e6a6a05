"""fp32 weights that are llama.cpp blocks in disguise, and the kernel that reads them as blocks.

The default target comes as a GGUF file whose layers are Q4_1 blocks and
whose embedding (tied to the LM head) is Q8_0 blocks. transformers
de-quantizes them to fp32 on loading, so an fp32 step reads 4 bytes a weight
where the file held 0.625 (Q4_1) or 1.0625 (Q8_0), and a bf16 step, 2 bytes
of values rounded to bf16. This module finds the blocks again in the fp32
weights and proves it: per block of 32 input values, the fp16 scale (and
minimum) and small integers whose de-quantized values equal every fp32
weight bit for bit (``q4_1_blocks``, ``q8_0_blocks``; None where any weight
differs). ``specserve/kernels/block_gemm.cpp`` then computes ``x @ W.T``
from the blocks (``BlockWeight``: outputs in tiles of one vector register,
each tile's block parameters widened to fp32): each weight rebuilt exactly
in fp32, multiplied by fp32 inputs, summed in fp32. So these are the fp32
model's products, from 6/32 (Q4_1) or 9/32 (Q8_0) of its bytes; only the
order of the sums differs from another fp32 kernel. Each output is computed
alike whatever the number of rows (batch invariance by construction;
``packed_linear`` checks it at start-up like every packed product).

At a few rows a product is bound by the bytes it reads, so the blocks beat
oneDNN's fp32 and bf16 products there; as rows grow it becomes bound by the
multiply-adds, and bf16's products (two multiply-adds an instruction) become
cheaper from about a dozen rows, and oneDNN's fp32 ones past about 128 rows
(a prefill), so steps past the largest bucket run those (``packed_linear``;
figures: docs/benchmarks.md, "The block kernel").

The kernel is compiled for the CPU it runs on (``-march=native``) the first
time it is needed and kept under the cache directory (about 20 s once, then
a load); where no compiler is at hand, ``block_kernels()`` returns None and
the products run on ``packed_linear``'s other kernels.

A weight's blocks are found once a process (``packed_linear.weight_blocks``
hands them to the products it packs; a fused product's are its parts' joined,
``Blocks.joined``) and kept in the start-up cache under the hash of the
weight's bytes (``kept_blocks``), so a later start reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from specserve.hardware import DtypeChoice, choose_dtype
from specserve.model_loading import ModelSource, default_cache_root
from specserve.startup_cache import TensorStore, tensor_digest

log = logging.getLogger(__name__)

BLOCK = 32  # values per block along the input dimension, both formats
BlockFormat = Literal["Q4_1", "Q8_0"]
BLOCK_GEMM_ENV = "SPECSERVE_BLOCK_GEMM"  # "off": never use the block kernel (benchmarks compare with it)
_SOURCE = Path(__file__).with_name("kernels") / "block_gemm.cpp"
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")


def cpu_flags() -> str:
    """The flags line of /proc/cpuinfo (what the kernel is built for), or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@cache
def block_kernels() -> ModuleType | None:
    """The compiled block kernel, or None (disabled by ``SPECSERVE_BLOCK_GEMM=off``, not x86, no compiler)."""
    if os.environ.get(BLOCK_GEMM_ENV, "") == "off":
        return None
    flags = cpu_flags().split()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= set(flags):
        return None
    try:
        return build_kernels(_SOURCE, flags)
    except Exception as exc:  # no source, no writable cache, no compiler, a failed build: the others still serve
        log.warning("the block-weight kernel did not build (%s); products run on the other kernels", exc)
        return None


def kernel_source_digest() -> str:
    """A hash of the block kernel's source and compiler flags: with the CPU and torch, what its arithmetic
    depends on (results computed with it and kept name it; "unknown" where the source does not read)."""
    try:
        source = _SOURCE.read_bytes()
    except OSError:
        return "unknown"
    return hashlib.sha256(source + " ".join(_CFLAGS).encode()).hexdigest()[:16]


def build_kernels(source: Path, flags: Sequence[str]) -> ModuleType:
    """``source`` compiled as the block kernel is, for a CPU with ``flags``; raises where it does not build.

    ``bench.kernel_ab`` builds an earlier revision's kernel this way beside the current one.
    """
    from torch.utils import cpp_extension  # imports setuptools: only where the kernel is wanted

    cflags = list(_CFLAGS)
    # A build for another CPU, torch, source or flags must not be reused: all four name the build. So does the
    # source's path: ninja's build file names it, and two checkouts sharing a build would rebuild in turn.
    named = [source.read_text(), " ".join(sorted(flags)), torch.__version__, " ".join(cflags), str(source)]
    key = hashlib.sha256("\n".join(named).encode()).hexdigest()[:16]
    build = default_cache_root() / "kernels" / f"block_gemm-{key}"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"specserve_block_gemm_{key}",
        sources=[str(source)],
        extra_cflags=cflags,
        # at::parallel_for is inline OpenMP: without -fopenmp it runs on one thread. The libgomp it links is
        # the one torch loaded already (same soname), so both share one thread pool.
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def gguf_block_layers(source: ModelSource) -> bool:
    """Whether ``source`` is a GGUF file whose 2-D weights are all Q4_1 or Q8_0 blocks, and the kernel builds here.

    Reads only the file's tensor table; whether the loaded fp32 weights are those blocks exactly is checked
    again where they are packed (``packed_linear.weight_blocks``).
    """
    if source.gguf_file is None:
        return False
    import gguf  # the reader memory-maps the file: its tensor table costs milliseconds

    reader = gguf.GGUFReader(str(source.directory / source.gguf_file))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    block_types = {gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0}
    return bool(matrices) and all(t.tensor_type in block_types for t in matrices) and block_kernels() is not None


def choose_model_dtype(requested: str, device: str, source: ModelSource) -> DtypeChoice:
    """``--dtype`` for this model: ``hardware.choose_dtype``, told whether its layers are blocks read here."""
    blocks = requested == "auto" and device == "cpu" and gguf_block_layers(source)
    return choose_dtype(requested, device, block_weights=blocks)


def _fp16_exact(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (``torch.equal`` takes -0.0 for 0.0, which the kernel would not rebuild)."""
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@dataclass(frozen=True)
class Blocks:
    """A weight [out, in] found to be llama.cpp blocks: per output and block of 32 inputs, fp32 ``scale``
    (and ``low``, Q4_1's minimum) [out, in / 32] and the integers ``q`` [out, in / 32, 32]."""

    block_format: BlockFormat
    scale: torch.Tensor
    low: torch.Tensor | None
    q: torch.Tensor

    @staticmethod
    def joined(parts: Sequence[Blocks]) -> Blocks | None:
        """The blocks of the weights of ``parts`` concatenated along the outputs (a fused QKV or gate-up weight),
        or None where the parts are not all of one format.

        Equal to ``find_blocks`` of the concatenated weight: every quantity it derives is a block's own, and a
        step it takes for some blocks leaves the blocks already rebuilt as they were. So a weight's blocks are
        found once and the fused product is packed from them.
        """
        if not parts or any(p.block_format != parts[0].block_format for p in parts):
            return None
        if len(parts) == 1:
            return parts[0]
        lows = [p.low for p in parts if p.low is not None]
        return Blocks(
            parts[0].block_format,
            torch.cat([p.scale for p in parts]),
            torch.cat(lows) if lows else None,
            torch.cat([p.q for p in parts]),
        )

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [out, in] these blocks hold."""
        out, blocks = self.scale.shape
        return int(out), int(blocks) * BLOCK

    def packed(self, lanes: int) -> torch.Tensor:
        """The kernel's layout: outputs in tiles of ``lanes`` (padded with zero weights), per tile and block the
        tile's scales (and minimums), then its integers input by input (Q4_1: a byte per output for each pair
        of inputs, the even one in the low nibble). uint8 [tiles, in / 32, bytes per tile's block]."""
        out, blocks = self.scale.shape
        tiles = -(-out // lanes)
        pad = tiles * lanes - out

        def tiled(values: torch.Tensor) -> torch.Tensor:  # [out, blocks, ...] -> [tiles, blocks, ..., lanes]
            values = torch.nn.functional.pad(values, (0, 0) * (values.dim() - 1) + (0, pad)) if pad else values
            grouped = values.reshape(tiles, lanes, *values.shape[1:])
            return grouped.permute(0, 2, *range(3, grouped.dim()), 1).contiguous()

        parts = [tiled(self.scale.unsqueeze(-1)).view(torch.uint8).reshape(tiles, blocks, -1)]
        if self.low is not None:
            parts.append(tiled(self.low.unsqueeze(-1)).view(torch.uint8).reshape(tiles, blocks, -1))
        if self.block_format == "Q4_1":
            pairs = self.q.reshape(out, blocks, BLOCK // 2, 2)
            parts.append(tiled(pairs[..., 0] | (pairs[..., 1] << 4)).reshape(tiles, blocks, -1))
        else:
            parts.append(tiled(self.q).view(torch.uint8).reshape(tiles, blocks, -1))
        return torch.cat(parts, dim=-1).contiguous()


def _steps(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values / scale`` rounded to integers per block, 0 where the block's scale is 0."""
    return torch.where(scale > 0, values / torch.where(scale > 0, scale, 1.0), 0.0).round()


def _q4_1_integers(blocks: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each value's integer for these per-block ``scale`` and ``low``, and per block [..., 1] whether every
    value is rebuilt bit for bit (``scale * q + low``)."""
    q = _steps(blocks - low, scale).clamp(0, 15)
    rebuilt = (scale * q + low).view(torch.int32) == blocks.view(torch.int32)
    return q, rebuilt.all(dim=-1, keepdim=True)


def q4_1_blocks(weight: torch.Tensor) -> Blocks | None:
    """``weight`` [out, in] as Q4_1 blocks if every value is ``d * q + m`` exactly, else None.

    Per block ``m`` is its smallest value (q = 0) and ``d`` one fifteenth of its span (the largest has
    q = 15), both fp16, as llama.cpp quantizes; the blocks are then rebuilt and compared with the weights.
    """
    w = weight.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK or not w.numel():
        return None
    with torch.inference_mode():
        blocks = w.reshape(w.shape[0], -1, BLOCK)
        low = blocks.amin(dim=-1, keepdim=True)
        if not _fp16_exact(low):
            return None
        scale = ((blocks.amax(dim=-1, keepdim=True) - low) / 15).half()
        q, exact = _q4_1_integers(blocks, low, scale.float())
        for direction in (float("inf"), float("-inf")):
            if bool(exact.all()):
                break
            # The largest value was rounded once (d * 15 + m): where m dwarfs d, the span over 15 can round to
            # d's fp16 neighbour. Try the neighbours where the first guess does not rebuild the block.
            neighbour = torch.nextafter(scale, torch.full_like(scale, direction))
            q_n, exact_n = _q4_1_integers(blocks, low, neighbour.float())
            better = ~exact & exact_n
            scale, q, exact = torch.where(better, neighbour, scale), torch.where(better, q_n, q), exact | exact_n
        if not bool(exact.all()):
            return None
        return Blocks("Q4_1", scale.float().squeeze(-1), low.squeeze(-1), q.to(torch.uint8))


def q8_0_blocks(weight: torch.Tensor) -> Blocks | None:
    """``weight`` [out, in] as Q8_0 blocks if every value is ``d * q`` exactly, else None.

    Per block ``d`` is its largest magnitude over 127 (fp16), as llama.cpp quantizes; the blocks are then
    rebuilt and compared with the weights.
    """
    w = weight.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK or not w.numel():
        return None
    with torch.inference_mode():
        blocks = w.reshape(w.shape[0], -1, BLOCK)
        scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127).half().float()
        q = _steps(blocks, scale)
        if q.abs().max() > 127 or not _same_bits(scale * q + 0.0, blocks):  # + 0.0: d * 0 is +0, never -0
            return None
        return Blocks("Q8_0", scale.squeeze(-1), None, q.to(torch.int8))


def find_blocks(weight: torch.Tensor) -> Blocks | None:
    """The fewest-bytes llama.cpp block format that holds ``weight`` exactly, with its blocks; else None."""
    return q4_1_blocks(weight) or q8_0_blocks(weight)


BLOCKS_KIND = "gguf-blocks"  # the start-up cache's folder of blocks found (``kept_blocks``)
# Bump when ``find_blocks`` changes what it finds for a weight: blocks kept by earlier versions are then not read.
BLOCKS_VERSION = 1
# Weights of fewer values are found every time: finding their blocks costs about what reading a record does.
KEPT_MIN_VALUES = 1 << 16


def kept_blocks(weight: torch.Tensor, store: TensorStore | None) -> Blocks | None:
    """``find_blocks``, its blocks kept in ``store`` (``specserve.startup_cache``) under the hash of the weight's
    own bytes: a start that loads the same weights reads the blocks an earlier one found (what it would find
    again: ``find_blocks`` depends on nothing else). Weights that are not blocks are found so every time."""
    w = weight.detach()
    kept_here = w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and not w.shape[1] % BLOCK
    if store is None or not kept_here or w.numel() < KEPT_MIN_VALUES:
        return find_blocks(w)
    key = blocks_key(w)
    kept = store.get(key)
    blocks = _blocks_of_record(*kept, tuple(w.shape)) if kept is not None else None
    if blocks is not None:
        return blocks
    if kept is not None:
        log.warning("start-up cache record %s holds no blocks of its weight: found again", store.path(key))
    found = find_blocks(w)
    if found is not None:
        low = {} if found.low is None else {"low": found.low}
        store.put(key, {"scale": found.scale, "q": found.q, **low}, {"format": found.block_format})
    return found


def blocks_key(weight: torch.Tensor) -> dict[str, Any]:
    """What ``find_blocks``' result for ``weight`` depends on: its bytes and shape, and the code finding them."""
    return {
        "blocks": BLOCKS_VERSION,
        "torch": torch.__version__,
        "shape": list(weight.shape),
        "sha256": tensor_digest(weight),
    }


def _blocks_of_record(
    tensors: dict[str, torch.Tensor], fields: dict[str, str], shape: tuple[int, ...]
) -> Blocks | None:
    """The blocks a record holds, where they are blocks of a weight of ``shape`` [out, in] in the layout
    ``find_blocks`` gives (fp32 scales and minimums [out, in / 32], integers [out, in / 32, 32]); else None."""
    block_format = fields.get("format")
    per_block = (shape[0], shape[1] // BLOCK)
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"scale": (torch.float32, per_block)}
    if block_format == "Q4_1":
        layout |= {"low": (torch.float32, per_block), "q": (torch.uint8, (*per_block, BLOCK))}
    elif block_format == "Q8_0":
        layout |= {"q": (torch.int8, (*per_block, BLOCK))}
    else:
        return None
    if set(tensors) != set(layout) or any((t.dtype, tuple(t.shape)) != layout[n] for n, t in tensors.items()):
        return None
    return Blocks("Q4_1" if block_format == "Q4_1" else "Q8_0", tensors["scale"], tensors.get("low"), tensors["q"])


class BlockWeight:
    """A weight [out, in] packed for the block kernel: ``x @ W.T`` in fp32 from its blocks."""

    def __init__(self, blocks: Blocks) -> None:
        kernels = block_kernels()
        if kernels is None:
            raise RuntimeError("block products need the compiled kernel (block_kernels)")
        self.block_format = blocks.block_format
        self.out_features, block_count = blocks.scale.shape
        self.in_features = block_count * BLOCK
        self._lanes = int(kernels.lanes())
        self._padded_out = -(-self.out_features // self._lanes) * self._lanes
        self._packed = blocks.packed(self._lanes)
        self._product = kernels.q4_1_linear if blocks.block_format == "Q4_1" else kernels.q8_0_linear

    def kernel_args(self) -> tuple[torch.Tensor, list[int]]:
        """The packed tiles and (format, out, padded out, in): what the kernel's ``layer_step`` takes a product as."""
        code = 0 if self.block_format == "Q4_1" else 1
        return self._packed, [code, self.out_features, self._padded_out, self.in_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x.float(), self._packed, self._padded_out, self.in_features)
        return y if self._padded_out == self.out_features else y[:, : self.out_features].contiguous()


@contextlib.contextmanager
def serial_kernels() -> Iterator[None]:
    """Within it, this thread runs the block kernel's loops itself, with no OpenMP team: for a thread that is not
    the engine's (the draft head's), whose own team would slow the engine's (see the kernel's ``for_range``)."""
    kernels = block_kernels()
    if kernels is None:
        yield
        return
    before = kernels.set_serial(True)
    try:
        yield
    finally:
        kernels.set_serial(before)


def fused_ops_fit(hidden_size: int, head_dim: int) -> bool:
    """Whether ``rms_norm_rows``, ``rotary_rows`` and ``attend_rows`` take this shape on this build: whole vector
    registers, and a head of 2, 4, 8 or 16 of them (the attention keeps a head in registers)."""
    kernels = block_kernels()
    if kernels is None:
        return False
    lanes = int(kernels.lanes())
    return hidden_size % lanes == 0 and head_dim % (2 * lanes) == 0 and head_dim // lanes in (2, 4, 8, 16)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``llama_ops.rms_norm`` of fp32 rows [rows, hidden] in one call of the block kernel's module (the eager
    form is eight dispatches, which on a one-token step over the block products cost more than the math)."""
    kernels = block_kernels()
    assert kernels is not None, "the fused norm needs the compiled kernel (block_kernels)"
    return kernels.rms_norm(x, weight, eps)


def rotary_rows(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``llama_ops.apply_rotary`` of fp32 [rows, heads, head_dim] in one call (four dispatches eager), the same
    bits (the same multiplies and adds, unfused)."""
    kernels = block_kernels()
    assert kernels is not None, "the fused rotary needs the compiled kernel (block_kernels)"
    return kernels.rotary(x, cos, signed_sin)


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
) -> None:
    """Verify segments' attention over a KV arena layer in one call (``ragged_attention.attend_segments``).

    ``table`` int64 [n, 4] holds each segment's (first row, rows, region start, cached tokens), ``allowed``
    their masks over their own new rows ([rows, rows] each, flattened one after another). Writes the new keys
    and values at region start + cached, and each query head's attention over the region's cached tokens and
    the new rows its mask allows into ``out`` [T, heads, d]. fp32; a row's bits depend only on the keys it
    sees, in slot order: a draft node's are plain decoding's of its path.
    """
    kernels = block_kernels()
    assert kernels is not None, "the fused attention needs the compiled kernel (block_kernels)"
    kernels.attend_rows(q, k, v, keys, values, table, allowed, scaling, out)


def layer_step(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    shapes: list[int],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    heads: tuple[int, int, int],
) -> torch.Tensor:
    """One decoder layer in one call of the kernel's module (``llama_forward.LlamaForward.kernel_step``): the
    fused norm, QKV product, rotary embedding, ``attend_rows`` over the layer's arena, O product and residual,
    norm, gate-up product, SiLU gate, down product and residual, in the order the Python layer runs them.
    ``heads``: (query heads, key-value heads, head dim)."""
    kernels = block_kernels()
    assert kernels is not None, "the fused layer needs the compiled kernel (block_kernels)"
    return kernels.layer_step(x, weights, shapes, eps, cos, sin, keys, values, table, allowed, scaling, *heads)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weights that are Q4_1 blocks: ``weight`` quantized as llama.cpp does and de-quantized (tests, checks)."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    low = blocks.amin(dim=-1, keepdim=True).half().float()
    scale = ((blocks.amax(dim=-1, keepdim=True) - low) / 15).half().float()
    q, _ = _q4_1_integers(blocks, low, scale)
    # The smallest value must come back as m itself, the largest with q = 15: a block llama.cpp would write.
    return (scale * q + low).reshape(weight.shape) + 0.0  # -0.0 as +0.0, as d * 0 + m gives


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weights that are Q8_0 blocks: ``weight`` quantized as llama.cpp does and de-quantized (tests, checks)."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    q = _steps(blocks, scale).clamp(-127, 127)
    return (scale * q).reshape(weight.shape) + 0.0  # -0.0 as +0.0, as d * 0 gives
