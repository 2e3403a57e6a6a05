"""The draft head's products on the verifier's prepacked GEMM kernels (``specserve.packed_linear``).

A draft step runs the head over one row (the newest committed token) and then over a beam's few rows per
level: products of 1-16 rows against small weights, where ``F.linear`` repacks the weight into its GEMM
kernel's layout on every call. ``--head-matmul packed`` packs the fc, the decoder layer's linears and the
draft logits' weight once, when the head is put in its serving dtype, for the kernel ``available_packing``
names for that dtype on this CPU (oneDNN, or MKL for fp32 on Intel); ``int8`` packs int8 copies of them;
``auto`` (the default) times both and keeps the faster (``head_timing``); ``linear``, and a dtype or device
without a packed kernel, keep ``F.linear``.

Each packed product runs at the row counts where its kernel computes a row alike whatever the count
(``row_invariant_rows``), padding other counts up, so a draft does not depend on how many rows shared its
step. Packs are for inference only: a product whose weight changed since it was packed (loaded, trained,
moved to another dtype or device), or that needs gradients, runs ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.block_weights import BLOCK, Blocks, block_kernels, find_blocks, quantize_q8_0
from specserve.packed_linear import PackedLinear, Packing, available_packing, invariant_rows, kernel_name

HEAD_MATMUL_CHOICES = ("auto", "packed", "linear", "int8", "blocks")
"""``--head-matmul``: auto, the fastest of the candidates timed at start-up (``head_timing``); packed, where this
dtype and device have a packed kernel, else F.linear; F.linear; int8 copies of the weights on a CPU
(``packed_linear``'s int8 kernel: a quarter of fp32's bytes, which pays at a draft step's few rows; a draft's
numerics cost acceptance at most, never exactness; see docs/benchmarks.md, "Smaller figures behind rules in the
code"); or, for an fp32 head on a CPU where the block kernel
builds, the weights as llama.cpp Q8_0 blocks read by it (``block_weights``): the draft logits' rows are the
packaged target's Q8_0 head exactly, the head's own weights are rounded to 8 bits a value with an fp16 scale
per 32 (finer than int8's per row)."""


def head_packing(dtype: torch.dtype, device: torch.device, choice: str) -> Packing:
    """The packed kernel the head's products use for ``choice`` (``--head-matmul``); "none": F.linear. For
    "auto", the kernel it uses untimed: the packed one."""
    if choice not in HEAD_MATMUL_CHOICES:
        raise ValueError(f"--head-matmul must be one of {', '.join(HEAD_MATMUL_CHOICES)}, not {choice!r}")
    if choice == "int8":
        return "int8" if device.type == "cpu" else "none"
    if choice == "blocks":
        return "blocks" if blocks_serve(dtype, device) else available_packing(dtype, device)
    return available_packing(dtype, device) if choice in ("auto", "packed") else "none"


def blocks_serve(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the head's products can run on the block kernel here: fp32 on a CPU where it builds."""
    return dtype == torch.float32 and device.type == "cpu" and block_kernels() is not None


def auto_candidates(dtype: torch.dtype, device: torch.device) -> tuple[Packing, ...]:
    """The kernels ``--head-matmul auto`` times, the default first: int8 on a CPU, Q8_0 blocks where they serve."""
    default = available_packing(dtype, device)
    if device.type != "cpu":
        return (default,)
    return (default, "int8", "blocks") if blocks_serve(dtype, device) else (default, "int8")


def q8_0_weight(weight: torch.Tensor) -> tuple[torch.Tensor, Blocks | None] | None:
    """``weight`` as fp32 values that Q8_0 blocks hold: itself, with the blocks found, where they already do (the
    draft logits' rows of a GGUF head), else rounded to them (their blocks found where packed); None where its
    rows are not whole blocks."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    found = find_blocks(weight)
    return (weight, found) if found is not None else (quantize_q8_0(weight), None)


class WeightPack:
    """``weight`` (and ``bias``) prepacked for ``packing``; it serves only the tensors it was made from."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packing: Packing) -> None:
        out_features, in_features = weight.shape
        packed, blocks = weight, None
        if packing == "blocks":  # a weight that cannot be blocks runs on the dtype's packed kernel
            as_blocks = q8_0_weight(weight)
            if as_blocks is None:
                packing = available_packing(weight.dtype, weight.device)
            else:
                packed, blocks = as_blocks
        rows = invariant_rows(packing, weight.dtype, {(out_features, in_features)})
        self.product = PackedLinear(packed, bias, packing, rows, blocks)
        self._made_from = _identity(weight, bias)

    def serves(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``weight`` and ``bias`` are still the tensors packed: same storage, dtype and in-place version."""
        return _identity(weight, bias) == self._made_from

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        # A copied module has copies of its weights, which this pack does not serve (and MKL's must not move).
        return None


def _identity(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...]:
    tensors = (weight,) if bias is None else (weight, bias)
    return tuple((t.data_ptr(), t.dtype, t.device, tuple(t.shape), t._version) for t in tensors)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: WeightPack | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x of [..., in]: on ``pack`` where it serves these weights, else ``F.linear``."""
    differentiated = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if pack is None or differentiated or not pack.serves(weight, bias):  # the packed kernels have no backward
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [batch * n, in]
    return pack.product(rows).reshape(*x.shape[:-1], pack.product.out_features)


class PackableLinear(nn.Linear):
    """An ``nn.Linear`` over another's parameters (same objects, same names) whose product may run on a pack."""

    pack: WeightPack | None = None

    @classmethod
    def over(cls, linear: nn.Linear) -> PackableLinear:
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        module.weight = linear.weight
        module.bias = linear.bias
        return module.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight, self.bias, self.pack)


def pack_linears(root: nn.Module, packing: Packing) -> None:
    """Every ``nn.Linear`` under ``root`` runs as a ``PackableLinear``, packed for ``packing`` ("none": unpacked)."""
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                child = PackableLinear.over(child)
                setattr(parent, name, child)
            if isinstance(child, PackableLinear):
                child.pack = pack_of(child.weight, child.bias, packing)


def pack_of(weight: torch.Tensor, bias: torch.Tensor | None, packing: Packing) -> WeightPack | None:
    """A pack of ``weight`` for ``packing``; None for "none"."""
    if packing == "none":
        return None
    with torch.no_grad():
        return WeightPack(weight.detach(), None if bias is None else bias.detach(), packing)


def describe(packing: Packing, choice: str, dtype: torch.dtype) -> str:
    """For logs and reports: what runs the head's products."""
    name = str(dtype).removeprefix("torch.")
    if packing == "none":
        why = "--head-matmul linear" if choice == "linear" else f"no packed kernel for {name} here"
        return f"F.linear ({why})"
    if packing == "int8":
        return (
            f"int8 copies of the weights (bf16 activations, {name} between) for the fc, the layer's linears and "
            "the draft logits"
        )
    if packing == "blocks":
        return (
            "Q8_0 blocks on the block kernel for the fc, the layer's linears (rounded to 8 bits) and the draft "
            "logits (the target head's blocks where it has them)"
        )
    kernel = kernel_name(packing, "F.linear")
    return f"{kernel} on {name} weights prepacked for the fc, the layer's linears and the draft logits"


def describe_timings(seconds: dict[Packing, float], dtype: torch.dtype) -> str:
    """For logs and reports: what ``--head-matmul auto`` timed (empty when it timed nothing)."""
    if not seconds:
        return ""
    name = str(dtype).removeprefix("torch.")

    def label(packing: Packing) -> str:  # int8 is int8 whatever the head's dtype
        kernel = kernel_name(packing, "F.linear")
        return kernel if packing == "int8" else f"{kernel} {name}"

    timed = ", ".join(f"{label(packing)} {s * 1e3:.2f} ms" for packing, s in seconds.items())
    return f"; chosen by --head-matmul auto, a draft step timed at start-up: {timed}"
