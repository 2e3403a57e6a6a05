"""Steps of static shape, captured as CUDA graphs: the engine's step on a GPU.

On a GPU a small model's step is launch-bound: 30 layers of ~20 kernels, each
dispatched from Python, cost more than the arithmetic (vLLM's and gpt-fast's
lesson). A CUDA graph replays the whole forward as one launch, but it needs
every shape and every address fixed, while the engine's step is ragged: any
number of sessions, each with its own context length, region in the KV arena
and mask (``ragged_attention``). So the captured step takes the ragged part as
*tensors* of fixed size:

- **rows** are padded to a bucket (1, 2, 4 ... 256): ids, positions and the
  arena slot each row's key and value go to (padding rows write to the
  arena's scratch slot, which no region holds);
- **attention** runs over a *window*: the slots of every segment's context and
  new rows, gathered from the arena into one sequence (padded to a power of
  two, then of 4096, with the scratch slot), with an additive mask [rows, window] that lets
  each row see its own session's context and the tree nodes on its path. One
  attention call covers every session; a row never sees another session's
  slots (the mask is -inf there, and every gathered value is finite, so the
  masked terms are exact zeros).

A graph is captured per (row bucket, window bucket) and replayed after: the
buffers are filled for the step, then the graph runs. ``prepare`` captures
every row bucket at every window up to ``STARTUP_WINDOW`` before the first
request (the verifier calls it at start-up): captured on first use instead, a
shape cost a decoding round two eager forwards and a capture, about 0.1 s on
an H200, and a speculating session meets many shapes (a tree's row bucket
changes from round to round), so on Spec-Bench it spent a third of its time
capturing. Longer windows are captured on first use (the step's own buffers,
so the warm-up runs compute the step itself). Graphs are bound to the arena
they were captured on (its tensors' addresses) and die with it.

The gathered window costs a copy of the context per layer and attention over
every session's context for every row: cheap next to the weights at the
window sizes a GPU step sees, and bounded by ``max_window`` (a step with a
longer window runs the ragged eager step instead). Without CUDA
(``capture=False``) the same static step runs uncaptured: that is how the
tests check it on a CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from specserve.packed_linear import bucket_for
from target_service.kv_arena import KVArena
from target_service.llama_forward import Attend
from target_service.ragged_attention import Segment, StepPlan

ROW_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WINDOW = 64
WINDOW_STEP = 4096
MAX_WINDOW = 32768
# Windows up to this are captured at start-up (``StaticSteps.prepare``): 7 windows, 63 graphs at 9 row buckets.
STARTUP_WINDOW = WINDOW_STEP

# The forward a static step runs: (attend, input_ids [T], positions [T]) -> hidden [T, hidden].
Forward = Callable[[Attend, torch.Tensor, torch.Tensor], torch.Tensor]


def window_bucket(tokens: int) -> int:
    """The window a step of ``tokens`` context slots (all segments together) runs with.

    Powers of two up to ``WINDOW_STEP``, then multiples of it: a long window wastes at most one step's
    worth of gathered slots, at the price of a few more graphs.
    """
    window = MIN_WINDOW
    while window < min(tokens, WINDOW_STEP):
        window *= 2
    return window if tokens <= window else -(-tokens // WINDOW_STEP) * WINDOW_STEP


def windows_up_to(tokens: int) -> tuple[int, ...]:
    """Every window bucket a step over at most ``tokens`` context slots may run with."""
    windows = [MIN_WINDOW]
    while windows[-1] < tokens:
        windows.append(window_bucket(windows[-1] + 1))
    return tuple(windows)


def segment_window(seg: Segment) -> int:
    """Slots of the window a segment takes: its cached context and its new rows."""
    return seg.num_cached + seg.num_new


@dataclass
class _Buffers:
    """One arena's static inputs, shared by every graph captured on it (views of the largest bucket)."""

    ids: torch.Tensor  # [max rows]
    positions: torch.Tensor  # [max rows]
    slots: torch.Tensor  # [max rows]: where each row's key and value are written
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [window] arena slots gathered
    biases: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [max rows, window] additive mask
    # window -> the mask repeated for each query head sharing a key head: [group * max rows, window]
    grouped: dict[int, torch.Tensor] = field(default_factory=dict)
    graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)


def attend_window(
    arena: KVArena,
    slots: torch.Tensor,
    window: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """q [T, heads, d], k and v [T, kv_heads, d] -> [T, heads, d], over the gathered window; shapes only.

    Grouped-query attention without copying keys per query head: the ``heads / kv_heads`` query heads that
    share a key head are stacked as rows of that key head (transformers' ``repeat_kv`` order: query head h
    uses key head h // group), with ``mask`` [group * T, window] repeated to match (once a step, by
    ``StaticSteps``, not once a layer). An arena kept in another dtype than the model's (fp32 on a CPU, as
    ``ragged_attention`` keeps it) attends in the arena's dtype.
    """
    keys, values = arena.keys[layer], arena.values[layer]
    keys.index_copy_(1, slots, k.transpose(0, 1).to(keys.dtype))
    values.index_copy_(1, slots, v.transpose(0, 1).to(values.dtype))
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped = q.reshape(rows, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * rows, dim)
    attended = F.scaled_dot_product_attention(
        grouped[None].to(keys.dtype),
        keys.index_select(1, window)[None],
        values.index_select(1, window)[None],
        attn_mask=mask[None, None],
        scale=scaling,
    )
    return attended[0].view(kv_heads, group, rows, dim).permute(2, 0, 1, 3).reshape(rows, heads, dim).to(q.dtype)


class StaticSteps:
    """Runs steps of up to ``max(row_buckets)`` rows at static shapes; CUDA graphs where ``capture``."""

    def __init__(
        self,
        forward: Forward,
        row_buckets: Sequence[int] = ROW_BUCKETS,
        max_window: int = MAX_WINDOW,
        capture: bool = True,
        group: int = 1,
    ) -> None:
        """``group``: query heads per key head (grouped-query attention)."""
        self._forward = forward
        self._group = group
        self.row_buckets = tuple(sorted(row_buckets))
        self.max_window = max_window
        self.capture = capture
        self._per_arena: weakref.WeakKeyDictionary[KVArena, _Buffers] = weakref.WeakKeyDictionary()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_captures = 0

    def covers(self, plan: StepPlan, rows: int) -> bool:
        """Whether a step of ``rows`` rows over ``plan`` runs here (else: the ragged eager step)."""
        if plan.arena.scratch_slot is None or rows > self.row_buckets[-1]:
            return False
        return window_bucket(sum(segment_window(seg) for seg in plan.segments)) <= self.max_window

    def __call__(self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [bucket rows, hidden]; rows past ``input_ids``' are padding. Valid until the next call."""
        arena = plan.arena
        rows = input_ids.shape[0]
        bucket = bucket_for(rows, self.row_buckets)
        window = window_bucket(sum(segment_window(seg) for seg in plan.segments))
        buffers = self._buffers(arena)
        self._fill(buffers, plan, input_ids, positions, bucket, window)
        return self._run(buffers, arena, bucket, window)

    def _buffers(self, arena: KVArena) -> _Buffers:
        buffers = self._per_arena.get(arena)
        if buffers is None:
            device, most = arena.keys[0].device, self.row_buckets[-1]
            buffers = _Buffers(
                ids=torch.zeros(most, dtype=torch.long, device=device),
                positions=torch.zeros(most, dtype=torch.long, device=device),
                slots=torch.zeros(most, dtype=torch.long, device=device),
            )
            self._per_arena[arena] = buffers
        return buffers

    def _fill(
        self,
        buffers: _Buffers,
        plan: StepPlan,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        bucket: int,
        window: int,
    ) -> None:
        """Write this step's rows, slots, window and mask into the static buffers."""
        arena = plan.arena
        scratch = arena.scratch_slot
        assert scratch is not None
        device = arena.keys[0].device
        self._window_buffers(buffers, arena, window)
        rows = input_ids.shape[0]
        buffers.ids[:rows].copy_(input_ids)
        buffers.ids[rows:bucket].zero_()
        buffers.positions[:rows].copy_(positions)
        buffers.positions[rows:bucket].zero_()
        slots = torch.full((bucket,), scratch, dtype=torch.long)
        gathered = torch.full((window,), scratch, dtype=torch.long)
        bias = buffers.biases[window][:bucket]
        bias.fill_(float("-inf"))
        bias[rows:, 0] = 0.0  # padding rows attend to one slot, so their softmax stays finite
        at = 0
        for seg in plan.segments:
            start, cached, n = seg.region.start, seg.num_cached, seg.num_new
            slots[seg.rows] = torch.arange(start + cached, start + cached + n)
            gathered[at : at + cached + n] = torch.arange(start, start + cached + n)
            block = bias[seg.rows, at : at + cached + n]
            if seg.mask is not None:
                block.masked_fill_(seg.mask, 0.0)
            elif seg.causal:
                block.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=device).tril(), 0.0)
            else:
                block.fill_(0.0)
            at += cached + n
        buffers.slots[:bucket].copy_(slots)
        buffers.windows[window].copy_(gathered)
        self._group_mask(buffers, bucket, window)

    def _window_buffers(self, buffers: _Buffers, arena: KVArena, window: int) -> None:
        """Allocate the gathered slots and masks of ``window`` once per arena."""
        if window in buffers.windows:
            return
        device, dtype, most = arena.keys[0].device, arena.keys[0].dtype, self.row_buckets[-1]
        buffers.windows[window] = torch.zeros(window, dtype=torch.long, device=device)
        buffers.biases[window] = torch.zeros(most, window, dtype=dtype, device=device)
        buffers.grouped[window] = (
            torch.zeros(self._group * most, window, dtype=dtype, device=device)
            if self._group > 1
            else buffers.biases[window]
        )

    def _group_mask(self, buffers: _Buffers, bucket: int, window: int) -> None:
        """The mask repeated for each query head of a group, as the attention call reads it."""
        if self._group > 1:
            bias = buffers.biases[window][:bucket]
            grouped = buffers.grouped[window][: self._group * bucket].view(self._group, bucket, window)
            grouped.copy_(bias[None].expand(self._group, bucket, window))

    def prepare(self, arena: KVArena, windows: Sequence[int], max_rows: int | None = None) -> int:
        """Run (and where ``capture``, capture) a step of every row bucket up to ``max_rows`` at each of
        ``windows`` on ``arena``, so that no request pays for it; returns the steps that were new.

        The steps are blank: every row reads and writes the arena's scratch slot alone (ids and positions 0),
        so no session's keys or values are touched. A later step only refills the buffers before replaying.
        """
        scratch = arena.scratch_slot
        if scratch is None:
            raise ValueError("static steps need an arena with a scratch slot")
        buckets = [b for b in self.row_buckets if max_rows is None or b <= bucket_for(max_rows, self.row_buckets)]
        buffers = self._buffers(arena)
        new = 0
        for window in windows:
            if window > self.max_window:
                continue
            self._window_buffers(buffers, arena, window)
            buffers.windows[window].fill_(scratch)
            for bucket in buckets:
                if self.capture and (bucket, window) in buffers.graphs:
                    continue
                buffers.ids[:bucket].zero_()
                buffers.positions[:bucket].zero_()
                buffers.slots[:bucket].fill_(scratch)
                bias = buffers.biases[window][:bucket]
                bias.fill_(float("-inf"))
                bias[:, 0] = 0.0
                self._group_mask(buffers, bucket, window)
                self._run(buffers, arena, bucket, window)
                new += 1
        return new

    def _run(self, buffers: _Buffers, arena: KVArena, bucket: int, window: int) -> torch.Tensor:
        """The step of shape (``bucket``, ``window``) over the filled buffers: replayed, captured or eager."""
        mask = buffers.grouped[window][: self._group * bucket]
        attend = partial(attend_window, arena, buffers.slots[:bucket], buffers.windows[window], mask)
        ids, pos = buffers.ids[:bucket], buffers.positions[:bucket]
        if not self.capture:
            return self._forward(attend, ids, pos)
        captured = buffers.graphs.get((bucket, window))
        if captured is None:
            captured = self._capture(attend, ids, pos)
            buffers.graphs[(bucket, window)] = captured
            return captured[1]  # the capture's warm-up ran this very step
        graph, hidden = captured
        graph.replay()
        return hidden

    def _capture(
        self, attend: Attend, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (as CUDA graph capture requires), then capture the step."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(attend, ids, positions)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self._forward(attend, ids, positions)
        graph.replay()
        self.num_captures += 1
        return graph, hidden
