"""The whole step compiled by inductor: the engine's step on a CPU with ``--compile inductor`` (opt-in).

The prepacked eager step (``packed_linear``) reads the weights at near the
GEMM kernels' speed, yet for a small model on few cores much of a one-token
step is not products: some 25 small operations a layer (norms, rotary,
SwiGLU, residuals, attention's reshapes and copies), each dispatched from
Python, and per-segment attention. Compiling those in pieces does not pay:
a compiled function's guards and wrapper cost about as much as the eager
glue it replaces. Compiling the *whole* step, 30 layers in one graph, pays
the call once: the glue fuses into a few C++ loops and the products become
oneDNN calls on weights inductor prepacks once ("freezing"), which makes a
step cheaper where the verifier owns its cores (see docs/benchmarks.md, "An
AMX Xeon: one OpenMP team, and the step compiled whole", and "Smaller
figures behind rules in the code").

The compiled step is ``static_steps``' static shape (rows padded to a
bucket, attention over one gathered window with an additive mask), run
uncaptured: the same forward as every other step (``llama_forward``), its
products ``torch.nn.Linear`` modules over the model's own weights so that
inductor sees them as parameters to freeze. Shapes are dynamic (one graph
for every row bucket and window), and the one-row bucket is left out: a
one-token step runs as two rows, so that dynamo never specialises a graph
for size one (two graphs, rounding apart) and plain decoding shares the
kernels of every tree. The graph is compiled at start-up, on the engine thread
(``prepare_graph``; one to two minutes on 2 cores, at every start: inductor's FX graph
cache refuses the graph, "mkldnn tensors unpickleable", since the weights it
prepacks are oneDNN tensors; products left to the prepacked eager kernels as
a custom op make the graph cacheable but the step slower than the prepacked
one, which is why they are not); inductor's kernel cache lives
under ``~/.cache/specserve/inductor`` (``TORCHINDUCTOR_CACHE_DIR``
overrides). Its many small parallel regions need the OpenMP workers awake:
run it with ``--dedicated-cores`` (``target_service.engine_threads``), without
which it is slower than the prepacked step.

Steps beyond the largest bucket or window run the ragged eager step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as shape_config
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default_cache_dir

from target_service.kv_arena import KVArena
from target_service.llama_forward import LlamaForward
from target_service.static_steps import MIN_WINDOW, ROW_BUCKETS, StaticSteps, _Buffers, attend_window

# Every bucket but one row: a one-token step runs as two (see the module's docstring).
INDUCTOR_ROW_BUCKETS: tuple[int, ...] = tuple(b for b in ROW_BUCKETS if b > 1)
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "specserve" / "inductor"


def use_cache_dir() -> None:
    """Point inductor's cache at ours unless the environment named one (torch may have filled in its own
    default, under /tmp, by the time this runs)."""
    current = os.environ.get(CACHE_ENV)
    if current is None or os.path.abspath(current) == os.path.abspath(torch_default_cache_dir()):
        os.environ[CACHE_ENV] = str(default_cache_dir())


def _as_module(product: Any) -> nn.Linear:
    """A ``PackedLinear`` left unpacked as an ``nn.Linear`` over the same tensors (no copy)."""
    weight, bias = product.weight, product.bias
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


class _Step(nn.Module):
    """The forward over static buffers, as one module: what ``torch.compile`` compiles."""

    def __init__(self, forward: LlamaForward) -> None:
        super().__init__()
        self.products = nn.ModuleList()
        for block in forward.blocks:
            for name in ("qkv", "o", "gate_up", "down"):
                linear = _as_module(getattr(block, name))
                setattr(block, name, linear)
                self.products.append(linear)
        self.llama = forward

    def forward(
        self,
        arena: KVArena,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        window: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
            return attend_window(arena, slots, window, mask, layer, q, k, v, scaling)

        return self.llama(attend, ids, positions)


class InductorSteps(StaticSteps):
    """``StaticSteps`` whose step runs as one inductor-compiled graph (CPU), compiled by ``prepare``."""

    def __init__(self, model: Any, group: int) -> None:
        # Unpacked: inductor packs the weights it freezes. (Its fused QKV and gate-up weights are copies, beside
        # the prepacked eager step's for longer steps: about three times the model's weights in all.)
        forward = LlamaForward(model, "none", ())
        super().__init__(forward, INDUCTOR_ROW_BUCKETS, capture=False, group=group)
        use_cache_dir()
        self._step = _Step(forward).eval()
        self._compiled = torch.compile(self._step, dynamic=True)

    def prepare_graph(self, arena: KVArena) -> None:
        """Compile the step now (a blank step on the scratch slot), not in a request's round."""
        self.prepare(arena, (MIN_WINDOW,), max_rows=INDUCTOR_ROW_BUCKETS[0])

    def _run(self, buffers: _Buffers, arena: KVArena, bucket: int, window: int) -> torch.Tensor:
        mask = buffers.grouped[window][: self._group * bucket]
        # Freezing (weights as constants, prepacked) is read when the graph compiles, which is inside a call;
        # so is duck shaping, off so that no row or window count is unified with a model dimension of equal
        # size (a 64-slot window with a 64-wide head) and compiled as that constant.
        with inductor_config.patch(freezing=True), shape_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return self._compiled(
                arena,
                buffers.ids[:bucket],
                buffers.positions[:bucket],
                buffers.slots[:bucket],
                buffers.windows[window],
                mask,
            )
