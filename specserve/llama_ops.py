"""The Llama family's small per-row operations, shared by the verifier's forward and the draft head's layer.

Both compute as transformers does (so a test can hold them to transformers' own modules), with two
shortcuts that change no bit in fp32: the rotary embedding's ``rotate_half(x) * sin`` is
``x.roll(d/2) * (sin with its first half negated)``, and RMSNorm runs torch's fused kernel on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in fp32, scaled in the input's dtype.

    On a GPU, torch's fused kernel instead: one kernel where this is seven, which is what a captured step's
    time goes to. Its fp32 result is the same math; in bf16 it scales before rounding (one rounding where
    transformers has two), alike for every step of the engine.
    """
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [T, 1, head_dim] for ``positions`` [T], computed as transformers does (fp32,
    then ``dtype``), for ``apply_rotary``.

    Negating a factor is exact in floating point, and folding the sign into sin saves a slice, a negation
    and a concatenation per use.
    """
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(dtype)
    sin = (emb.sin() * scaling).to(dtype)
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :], signed_sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by ``rotary_tables``' cos and sin: transformers' ``x * cos +
    rotate_half(x) * sin``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
