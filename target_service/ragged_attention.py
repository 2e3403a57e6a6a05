"""Attention over a ragged batch: many sessions' new tokens packed into one forward.

The engine packs every session's new tokens (a prefill chunk, or the pending
token plus its tree nodes) into one sequence of T rows, so the model's
matmuls run once for all of them. Attention is the only place where the
sessions must not mix: this module gives each session's rows its own
attention over its own cached context in the KV arena, with its own mask.

It is installed as a transformers attention implementation, so the model
definitions stay transformers' own: their attention layers compute q, k and v
(rotary embedding applied) and call ``ragged_attention``, which writes k and v
into the arena in place and attends per segment. Called without a step plan
(plain ``model.generate`` on the same model object) it is ordinary SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from target_service.kv_arena import KVArena, Region

ATTENTION_NAME = "specserve_ragged"


@dataclass
class Segment:
    """One session's rows in a step: inputs ``rows`` on top of ``num_cached`` cached tokens."""

    region: Region
    num_cached: int
    rows: slice
    # [n, num_cached + n] bool, True where a row may attend; None: every cached token and itself (one row)
    # or, with ``causal``, plain causal attention over new rows with nothing cached (SDPA's fast path).
    mask: torch.Tensor | None = None
    causal: bool = False

    @classmethod
    def chunk(cls, region: Region, num_cached: int, rows: slice, device: torch.device) -> Segment:
        """A run of consecutive tokens (a prefill chunk): causal over what is cached and the chunk."""
        num_new = rows.stop - rows.start
        if num_cached == 0 and num_new > 1:
            return cls(region, num_cached, rows, causal=True)
        return cls(region, num_cached, rows, causal_mask(num_cached, num_new, device))

    @property
    def num_new(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class StepPlan:
    """What one forward covers: the arena and every session's segment, in row order."""

    arena: KVArena
    segments: list[Segment] = field(default_factory=list)


def causal_mask(num_cached: int, num_new: int, device: torch.device) -> torch.Tensor | None:
    """Mask for ``num_new`` consecutive tokens after ``num_cached`` cached ones; None when SDPA needs none."""
    if num_new == 1:
        return None
    allowed = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=device)
    allowed[:, num_cached:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    return allowed


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] -> output [1, T, heads, d]."""
    plan: StepPlan | None = kwargs.pop("specserve_step", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, d]
    gqa = query.shape[1] != key.shape[1]
    # PyTorch's CPU SDPA is slow in bf16 for short queries (4-6x fp32 at one query row over 500 keys,
    # measured on AVX512-BF16): on CPU the attention itself runs in fp32, which is also more exact.
    upcast = query.device.type == "cpu" and query.dtype != torch.float32
    for seg in plan.segments:
        plan.arena.write(layer, seg.region, seg.num_cached, key[0, :, seg.rows], value[0, :, seg.rows])
        keys, values = plan.arena.read(layer, seg.region, seg.num_cached + seg.num_new)
        q, k, v = query[:, :, seg.rows], keys[None], values[None]
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=seg.mask,
            is_causal=seg.causal,
            scale=scaling,
            enable_gqa=gqa,
        )
        out[seg.rows] = attended[0].transpose(0, 1)
    return out[None], None


def install(model: Any) -> None:
    """Route the model's attention through ``ragged_attention`` (registered once per process)."""
    AttentionInterface.register(ATTENTION_NAME, ragged_attention)
    model.set_attn_implementation(ATTENTION_NAME)
