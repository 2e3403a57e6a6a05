"""A GPU head's tree growth in fixed slots, captured as CUDA graphs: one replay a round, not a launch a kernel.

Growing a tree runs a few hundred small kernels (a head step a level, top-k and bookkeeping around it); on a
GPU launching them costs more than running them. A CUDA graph replays a recorded sequence of kernels with one
launch, but only over the same shapes and addresses each time, while a session's cache grows and every
session has its own. So a ``Workspace`` holds fixed buffers for one tree shape (depth, beam, branching) and
one bucket of context lengths: before each tree the session's cached keys and values are copied into its
first slots (a copy of at most a few MiB, one kernel), the tree's own entries go to fixed slots after the
bucket, and a mask built on the device from the context's length hides the unused slots. Every level's shape
is then static (``tree_growth``: no pruning, no host reads), the graph is recorded the first time the
workspace serves, and each later tree is one replay and one transfer of its nodes.

Greedy trees only: a sampled session's coupled drafts shape q with its own temperature, top-k and top-p,
and grow eagerly over its cache. Where capture fails (a driver or kernel that cannot be recorded) the
workspace runs the same steps eagerly; drafts are guesses the verifier checks, so this changes speed, never
output. On a CPU the workspace runs eagerly too: the tests check it grows the trees the session's cache does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from draft_service.head_layer import HeadCache
from draft_service.tree_growth import Level, StepOut, frontier_sizes, greedy_children, grow_levels

if TYPE_CHECKING:
    from draft_service.head_types import ServingHead

log = logging.getLogger(__name__)

MIN_SLOTS = 256
"""The smallest bucket of context slots; buckets double from it, so a session meets a new one rarely."""


def context_slots(context: int) -> int:
    """The bucket a context of ``context`` cached positions grows its trees in."""
    slots = MIN_SLOTS
    while slots < context:
        slots *= 2
    return slots


class Workspace:
    """Fixed buffers for trees of one shape over contexts of at most ``slots`` positions, and their graph."""

    def __init__(self, head: ServingHead, depth: int, beam: int, branching: int, slots: int) -> None:
        self.device = head.draft_lm_head.device
        dtype = head.draft_lm_head.dtype
        self._head, self._depth, self._beam, self._slots = head, depth, beam, slots
        self._total = slots + sum(frontier_sizes(depth, beam, branching))  # context slots, then the tree's
        kv = (head.config.num_key_value_heads, self._total, head.head_dim)
        self.keys = torch.zeros(kv, dtype=dtype, device=self.device)
        self.values = torch.zeros(kv, dtype=dtype, device=self.device)
        self.feature = torch.zeros(head.config.hidden_size, dtype=dtype, device=self.device)
        self.logits = torch.zeros(head.config.draft_vocab_size, dtype=dtype, device=self.device)
        self.context = torch.zeros((), dtype=torch.long, device=self.device)  # cached positions in use
        self.position = torch.zeros((), dtype=torch.long, device=self.device)  # the head position of level 1
        self._slot_index = torch.arange(slots, device=self.device)
        self._children = greedy_children(head.draft_vocab, branching)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._levels: list[Level] = []  # the graph's outputs, rewritten by each replay

    def load(self, cache: HeadCache, context: int, position: int, feature: torch.Tensor, logits: torch.Tensor) -> None:
        """Put a session's state in the fixed buffers: its first ``context`` cached keys and values, the root's
        outputs, and the positions."""
        if context:
            keys, values = cache.buffers()
            self.keys[:, :context].copy_(keys[:, :context])
            self.values[:, :context].copy_(values[:, :context])
        self.feature.copy_(feature)
        self.logits.copy_(logits)
        self.context.fill_(context)
        self.position.fill_(position)

    def grow(self) -> list[Level]:
        """The tree's levels from what ``load`` put in: a replay where a graph is recorded, else eagerly."""
        if self.graph is None:
            return self._body()
        self.graph.replay()
        return self._levels

    def capture(self) -> None:
        """Record ``grow``'s kernels in a CUDA graph (after two eager runs: kernel choice and workspaces first)."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._levels = self._body()
        self.graph = graph

    def _body(self) -> list[Level]:
        return grow_levels(self.feature, self.logits, self._depth, self._beam, self._children, self._step)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, paths: torch.Tensor, level: int) -> StepOut:
        """A level's head step: the nodes see the context's slots in use, their ancestors' slots and their own."""
        rows, entries = paths.shape
        first = self._slots + entries
        allowed = torch.zeros(rows, self._total, dtype=torch.bool, device=self.device)
        allowed[:, : self._slots] = self._slot_index < self.context
        allowed[:, self._slots : first] = paths
        allowed[:, first : first + rows] = torch.eye(rows, dtype=torch.bool, device=self.device)
        positions = (self.position + (level - 1)).expand(rows)
        return self._head.step_in_slots(features, tokens, positions, self.keys, self.values, first, allowed)


class TreeGraphs:
    """One head's workspaces, by tree shape and context bucket, shared by its sessions (drafting holds one lock,
    so one tree grows at a time)."""

    def __init__(self, head: ServingHead, capture: bool | None = None) -> None:
        self._head = head
        self._capture = head.draft_lm_head.device.type == "cuda" if capture is None else capture
        self._spaces: dict[tuple[int, int, int, int], Workspace] = {}
        self.num_captures = 0
        self.capture_error = ""  # why capture was given up: trees grow eagerly in the workspaces since

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        # A copied head has copies of its weights, which these workspaces' steps do not read.
        return None

    def grow(
        self,
        cache: HeadCache,
        context: int,  # the session's cached positions every node sees
        position: int,  # the head position level 1 is fed at (the last cached position's, plus one)
        feature: torch.Tensor,  # [hidden]: the root's predicted feature
        logits: torch.Tensor,  # [vocab]: the root's draft logits
        depth: int,
        beam: int,
        branching: int,
    ) -> list[Level]:
        """The greedy tree's levels after a session's context; its cache is read, never written."""
        key = (depth, beam, branching, context_slots(context))
        space = self._spaces.get(key)
        if space is None:
            space = self._spaces[key] = Workspace(self._head, depth, beam, branching, key[3])
        space.load(cache, context, position, feature, logits)
        if self._capture and space.graph is None:
            try:
                space.capture()
                self.num_captures += 1
            except RuntimeError as exc:  # a kernel or driver that cannot be recorded: grow eagerly from now on
                self._capture = False
                self.capture_error = str(exc)
                log.warning("draft trees grow without CUDA graphs: capture failed: %s", exc)
        return space.grow()
