"""The verifier's KV cache: preallocated memory, one contiguous region per session.

Every layer owns two tensors (keys, values) of shape [kv_heads, capacity,
head_dim], allocated once at start-up and sized in bytes. A session holds a
region of token slots in them: its cached tokens sit at
``region.start .. region.start + region.length``, so attention reads a plain
slice (no gather, no per-round reallocation) and new keys and values are
written in place. Accepting a tree path moves only the accepted entries.

Regions carry headroom and grow by doubling: in place when the slots after
them are free, else by moving to a larger free range (copied once, amortised
over the tokens that filled it). When the free memory is fragmented, live
regions are compacted to the front. Deciding whom to evict when memory runs
out is the engine's business, not the arena's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

# Regions are whole numbers of blocks, so free ranges stay few and reusable.
BLOCK_TOKENS = 16


@dataclass
class Region:
    """A session's slots: ``length`` tokens cached from ``start``, room for ``capacity``."""

    start: int
    capacity: int
    length: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.capacity


def _round_up(tokens: int) -> int:
    return max(BLOCK_TOKENS, -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one token needs: keys and values in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVArena:
    """Preallocated keys and values for all sessions; not thread-safe (the engine thread owns it)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scratch_tokens: int = 0,
    ) -> None:
        """``scratch_tokens`` slots past the capacity belong to no region: a static-shape step writes its
        padding rows' keys and values there (``static_steps``). An arena with scratch slots starts zeroed,
        since such a step may read a scratch slot before anything was written to it."""
        capacity_tokens = capacity_tokens // BLOCK_TOKENS * BLOCK_TOKENS
        if capacity_tokens < BLOCK_TOKENS:
            raise ValueError(f"a KV cache needs room for at least {BLOCK_TOKENS} tokens")
        shape = (num_kv_heads, capacity_tokens + scratch_tokens, head_dim)
        # torch.empty: pages are committed when first written, not at start-up.
        make = torch.zeros if scratch_tokens else torch.empty
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity_tokens = capacity_tokens
        self.scratch_slot: int | None = capacity_tokens if scratch_tokens else None
        self.bytes_per_token = bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)]  # (start, size), sorted, coalesced
        self._regions: list[Region] = []  # live regions (for compaction)
        self.num_moves = 0
        self.num_compactions = 0

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    @property
    def free_tokens(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live regions (headroom included)."""
        return (self.capacity_tokens - self.free_tokens) * self.bytes_per_token

    # ---- allocation ----

    def allocate(self, tokens: int) -> Region | None:
        """A region with room for ``tokens``; None when the arena cannot hold it."""
        size = _round_up(tokens)
        start = self._take(size)
        if start is None and self.free_tokens >= size:
            self._compact()
            start = self._take(size)
        if start is None:
            return None
        region = Region(start, size)
        self._regions.append(region)
        return region

    def free(self, region: Region) -> None:
        self._regions.remove(region)
        self._give(region.start, region.capacity)
        region.capacity = 0
        region.length = 0

    def reserve(self, region: Region, tokens: int, limit: int) -> bool:
        """Make room for ``tokens`` in ``region``; False when the arena cannot, even compacted.

        Grows to double the capacity (at most ``limit``, at least ``tokens``),
        so a session that keeps growing is moved O(log n) times, not once per
        round; falls back to the bare need when memory is short.
        """
        if tokens <= region.capacity:
            return True
        for want in dict.fromkeys((_round_up(max(tokens, min(2 * region.capacity, limit))), _round_up(tokens))):
            if self._grow_in_place(region, want):
                return True
            start = self._take(want)
            if start is not None:
                self._copy(region.start, start, region.length)
                self._give(region.start, region.capacity)
                region.start, region.capacity = start, want
                self.num_moves += 1
                return True
            if self.free_tokens + region.capacity >= want:
                # Fragmented: compact with this region last, so the free tail follows it.
                self._compact(last=region)
                grown = self._grow_in_place(region, want)
                assert grown, "compaction leaves the free tail right after the last region"
                return True
        return False

    def _grow_in_place(self, region: Region, size: int) -> bool:
        extra = size - region.capacity
        i = bisect.bisect_left(self._free, (region.stop, 0))
        if i < len(self._free) and self._free[i][0] == region.stop and self._free[i][1] >= extra:
            start, free = self._free[i]
            if free == extra:
                del self._free[i]
            else:
                self._free[i] = (start + extra, free - extra)
            region.capacity = size
            return True
        return False

    def _compact(self, last: Region | None = None) -> None:
        """Slide live regions to the front (``last`` after all others), leaving one free range at the end."""
        self.num_compactions += 1
        saved: list[torch.Tensor] = []
        if last is not None:  # others may slide over its slots: keep a copy
            saved = [t[:, last.start : last.start + last.length].clone() for t in (*self.keys, *self.values)]
        cursor = 0
        for region in sorted((r for r in self._regions if r is not last), key=lambda r: r.start):
            if region.start != cursor:
                self._copy(region.start, cursor, region.length)
                region.start = cursor
            cursor += region.capacity
        if last is not None:
            for tensor, kept in zip((*self.keys, *self.values), saved, strict=True):
                tensor[:, cursor : cursor + last.length] = kept
            last.start = cursor
            cursor += last.capacity
        self._free = [(cursor, self.capacity_tokens - cursor)] if cursor < self.capacity_tokens else []

    def copy_prefix(self, source: Region, target: Region, length: int) -> None:
        """Start ``target`` with the first ``length`` cached tokens of ``source`` (another region)."""
        assert source is not target and length <= min(source.length, target.capacity)
        for tensor in (*self.keys, *self.values):
            tensor[:, target.start : target.start + length] = tensor[:, source.start : source.start + length]
        target.length = length

    def _copy(self, src: int, dst: int, length: int) -> None:
        if length == 0 or src == dst:
            return
        for tensor in (*self.keys, *self.values):
            tensor[:, dst : dst + length] = tensor[:, src : src + length].clone()

    def _take(self, size: int) -> int | None:
        for i, (start, free) in enumerate(self._free):  # first fit
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return start
        return None

    def _give(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, size))
        # Coalesce with the neighbours.
        if i + 1 < len(self._free) and start + size == self._free[i + 1][0]:
            self._free[i] = (start, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            prev_start, prev_size = self._free[i - 1]
            self._free[i - 1] = (prev_start, prev_size + self._free[i][1])
            del self._free[i]

    # ---- reading and writing (per layer, on the engine's hot path) ----

    def write(self, layer: int, region: Region, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` [kv_heads, n, head_dim] at ``offset`` .. offset + n of ``region``."""
        at = region.start + offset
        n = keys.shape[1]
        self.keys[layer][:, at : at + n] = keys
        self.values[layer][:, at : at + n] = values

    def read(self, layer: int, region: Region, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``length`` cached keys and values of ``region``: [kv_heads, length, head_dim]."""
        return (
            self.keys[layer][:, region.start : region.start + length],
            self.values[layer][:, region.start : region.start + length],
        )

    def keep(self, region: Region, offset: int, sources: list[int]) -> None:
        """Move the entries at ``offset + s`` (for s in ``sources``, increasing) to ``offset, offset + 1, ...``.

        Used to keep an accepted tree path: only the accepted entries move.
        """
        moves = [(offset + s, offset + i) for i, s in enumerate(sources) if s != i]
        if moves:
            src = torch.tensor([region.start + s for s, _ in moves], device=self.keys[0].device)
            dst = torch.tensor([region.start + d for _, d in moves], device=self.keys[0].device)
            for tensor in (*self.keys, *self.values):
                tensor.index_copy_(1, dst, tensor.index_select(1, src))
        region.length = offset + len(sources)
