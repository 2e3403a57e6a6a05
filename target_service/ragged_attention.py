"""Attention over a ragged batch: many sessions' new tokens packed into one forward.

The engine packs every session's new tokens (a prefill chunk, or the pending
token plus its tree nodes) into one sequence of T rows, so the model's
matmuls run once for all of them. Attention is the only place where the
sessions must not mix: this module gives each session's rows its own
attention over its own cached context in the KV arena, with its own mask.

The engine's forward (``llama_forward``) computes q, k and v (rotary
embedding applied) and calls ``attend_segments`` bound to the step's plan,
which writes k and v into the arena in place and attends per segment. On a
GPU, steps run as CUDA graphs attend differently (``static_steps``).

Batch invariance: the products are row-invariant on a CPU (``packed_linear``).
Over the GGUF blocks in fp32 (``block_weights.attend_rows``) a verify's rows
attend in one call a layer, each row over the keys it may see in slot order,
whatever the other rows: a draft node's row has the bits plain decoding of its
path would have, so fp32 speculation is plain decoding by construction (in
steps of up to the block products' 32 rows; wider ones run oneDNN's products).

SDPA (bf16, other packings, prefill chunks) is not row-invariant: PyTorch's
CPU SDPA rounds 1, 2-3 and 4+ query rows apart, and its last key block (blocks
of 512) changes with the key count, so a row's attention alone and inside a
tree differs in the last bits (~1e-7 in fp32). Padding each segment's queries
to a multiple of 4 rows and its keys (zeros, masked out) to a multiple of 512
makes every row bit-identical (probed on contexts of 5-1500 tokens and trees of
1-65 rows), but it cost 45% of a one-token fp32 step at a 512-token context on
a 2-core AVX2 EPYC (62 -> 90 ms: the padded keys double the attention there,
plus the copies), so it is not done. In fp32 the difference is far below any
logit gap; in bf16, and with int8 weights whose products round their inputs to
bf16, it is what lets speculative output leave plain decoding at near-ties
(``bench.numerics``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from target_service.kv_arena import KVArena, Region

# (q, k, v, the layer's arena keys and values, the kernel's segments as (first row, rows, region start, cached),
# their masks over their new rows flattened, scaling, out): writes those rows' keys and values into the arena
# and their attention into ``out`` (``block_weights.attend_rows``).
KernelRows = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
        torch.Tensor,
    ],
    None,
]

# The most rows a segment may have to attend in the kernel: a verify's tree. Its rows score their keys one by
# one; SDPA's blocked form is faster for a long prefill chunk's many rows.
KERNEL_MAX_ROWS = 64


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
    # The kernel's (first row, rows, region start, cached) table, their masks, and the other segments: once a step
    _split: tuple[torch.Tensor, torch.Tensor, list[Segment]] | None = field(default=None, repr=False, compare=False)

    def kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor, list[Segment]]:
        """The segments ``block_weights.attend_rows`` takes, as an int64 [n, 4] table of (first row, rows, region
        start, cached tokens) and their masks over their own new rows (bool, flattened in order); and the others.

        It takes plain decoding's one-row segments and any masked segment of at most ``KERNEL_MAX_ROWS`` rows
        (a verify's tree) that sees every cached token; a causal chunk over nothing cached stays with SDPA.
        """
        if self._split is None:
            table: list[list[int]] = []
            masks: list[torch.Tensor] = []
            others: list[Segment] = []
            for s in self.segments:
                n, cached = s.num_new, s.num_cached
                if s.mask is None and n == 1 and not s.causal:
                    masks.append(torch.ones(1, dtype=torch.bool))
                elif s.mask is not None and n <= KERNEL_MAX_ROWS and bool(s.mask[:, :cached].all()):
                    masks.append(s.mask[:, cached:].reshape(-1).cpu())
                else:
                    others.append(s)
                    continue
                table.append([s.rows.start, n, s.region.start, cached])
            allowed = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
            self._split = (torch.tensor(table, dtype=torch.int64).reshape(-1, 4), allowed, others)
        return self._split


def causal_mask(num_cached: int, num_new: int, device: torch.device) -> torch.Tensor | None:
    """Mask for ``num_new`` consecutive tokens after ``num_cached`` cached ones; None when SDPA needs none."""
    if num_new == 1:
        return None
    allowed = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=device)
    allowed[:, num_cached:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    return allowed


def attend_segments(
    plan: StepPlan,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    kernel_rows: KernelRows | None = None,
) -> torch.Tensor:
    """q [T, heads, d], k and v [T, kv_heads, d] -> [T, heads, d]; rows in no segment (padding) get 0.

    Each segment's keys and values are written into the arena, then its rows
    attend over the segment's cached context and themselves, with its mask.
    ``kernel_rows`` (fp32 on a CPU, ``block_weights.attend_rows``) does that in one call for every segment
    ``StepPlan.kernel_rows`` gives it (the verifies'), instead of SDPA's per segment.
    """
    out = q.new_zeros(q.shape)
    segments = plan.segments
    if kernel_rows is not None:
        table, allowed, segments = plan.kernel_rows()
        if table.numel():
            kernel_rows(q, k, v, plan.arena.keys[layer], plan.arena.values[layer], table, allowed, scaling, out)
    gqa = q.shape[1] != k.shape[1]
    # PyTorch's CPU SDPA is several times slower in bf16 than in fp32 for short queries (see
    # docs/benchmarks.md, "Smaller figures behind rules in the code"): on CPU the attention itself runs in
    # fp32, which is also more exact. The engine keeps a bf16 model's cache in fp32 there
    # (``ModelRunner.kv_dtype``), so only the query converts.
    upcast = q.device.type == "cpu" and q.dtype != torch.float32
    for seg in segments:
        plan.arena.write(layer, seg.region, seg.num_cached, k[seg.rows].transpose(0, 1), v[seg.rows].transpose(0, 1))
        keys, values = plan.arena.read(layer, seg.region, seg.num_cached + seg.num_new)
        query, key, value = q[seg.rows].transpose(0, 1)[None], keys[None], values[None]
        if upcast:
            query, key, value = query.float(), key.float(), value.float()
        attended = F.scaled_dot_product_attention(
            query, key, value, attn_mask=seg.mask, is_causal=seg.causal, scale=scaling, enable_gqa=gqa
        )
        out[seg.rows] = attended[0].transpose(0, 1).to(out.dtype)
    return out
