"""One forward of the target model over a packed, ragged batch.

transformers loads the model; the engine's own forward (``llama_forward``)
runs it, so that:

- many sessions' tokens share every matmul (one sequence of T rows);
- the weights are prepacked for the CPU's GEMM kernel (``specserve.packed_linear``), so
  a verify of 2-8 rows costs about what one row does, and a step runs only at
  row counts where each row's result is the same bits whatever the count
  (checked at start-up; others are padded up), so a token is scored alike in
  a plain step and inside a tree (batch invariance);
- the final norm and LM head run in fp32 whatever the layers run in, and only
  for the rows whose scores decide something: bf16 rounding in the head would
  manufacture argmax ties. A bf16 model's head reads its weights stored in
  fp16, which holds them exactly (``packed_linear``, "fp16"): the same fp32
  products from half the bytes, the head's fp32 weights having been about a
  third of the bytes a bf16 step reads;
- an fp32 model whose weights are llama.cpp blocks exactly (a GGUF model's:
  the default target's Q4_1 layers and Q8_0 head) runs its products on the
  block kernel (``specserve.block_weights``): the fp32 model's products from
  a sixth of its bytes, every row count computing a row alike;
- hidden states are returned only for the rows a draft head asked for.

On a GPU, ``compile="auto"`` runs steps of up to 256 rows as CUDA graphs
(``static_steps``: rows padded to buckets, attention over one gathered window
with a mask), captured per shape on first use.

``compile="off"`` runs the same forward with ``F.linear``, no padding and
per-segment attention: the eager baseline the benchmarks compare with.

``compile="inductor"`` (CPU, opt-in) runs steps of 2-256 rows as one graph
compiled by inductor with its weights frozen (``inductor_steps``), compiled
at start-up; longer steps run the prepacked eager step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from specserve.block_weights import attend_rows
from specserve.llama_decoder import LayerBlocks, find_layer_blocks
from specserve.packed_linear import (
    HeadPacking,
    PackedLinear,
    Packing,
    available_packing,
    bucket_for,
    fp32_head,
    invariant_rows,
    kernel_name,
)
from target_service.inductor_steps import InductorSteps
from target_service.kv_arena import BLOCK_TOKENS, KVArena, bytes_per_token
from target_service.layer_features import LayerCapture
from target_service.llama_forward import (
    SUPPORTED_MODEL_TYPES,
    LlamaForward,
    LlamaShape,
    UnsupportedModelError,
)
from target_service.ragged_attention import KERNEL_MAX_ROWS, StepPlan, attend_segments
from target_service.static_steps import STARTUP_WINDOW, StaticSteps, windows_up_to

COMPILE_CHOICES = ("auto", "off", "inductor")
# --weights: the layers' products read the model's weights in its dtype, or int8 copies of them (opt-in).
WEIGHTS_CHOICES = ("dtype", "int8")

__all__ = [
    "COMPILE_CHOICES",
    "SUPPORTED_MODEL_TYPES",
    "WEIGHTS_CHOICES",
    "ModelRunner",
    "StepOutput",
    "UnsupportedModelError",
]


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [len(score_rows), vocab] float32
    features: torch.Tensor  # [len(feature_rows), hidden] float32, after the final norm
    # [len(layer_rows), len(layers), hidden] float32: the named layers' inputs (``layer_features``); None: none named
    layer_features: torch.Tensor | None = None
    layer_union: tuple[int, ...] = ()  # the layers of ``layer_features``, in order


def _row_counts(rows: tuple[int, ...]) -> str:
    """``(2, 3, ..., 32)`` as "2-32", a gappy set as its list."""
    if len(rows) > 2 and list(rows) == list(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}-{rows[-1]}"
    return str(list(rows))


class ModelRunner:
    """Runs the engine's forward over a StepPlan; ``compile`` is "auto" (prepacked buckets, CUDA graphs) or "off".

    ``static`` forces static-shape steps on (True) or off (False); by default they run where CUDA graphs
    can capture them. Off a GPU they run uncaptured, which is how the tests check them on a CPU.

    ``weights="int8"`` runs the layers' products on int8 copies of their weights (``packed_linear``'s int8
    kernel; CPU, ``compile="auto"`` only); the head stays fp32.
    """

    def __init__(
        self,
        model: Any,
        compile: str = "auto",
        static: bool | None = None,
        weights: str = "dtype",
    ) -> None:
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {COMPILE_CHOICES}, not {compile!r}")
        if weights not in WEIGHTS_CHOICES:
            raise ValueError(f"weights must be one of {WEIGHTS_CHOICES}, not {weights!r}")
        weight = model.lm_head.weight.detach()
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        packing: Packing = available_packing(self.dtype, self.device) if compile != "off" else "none"
        inductor = compile == "inductor"
        if inductor and (self.device.type != "cpu" or static is not None):
            raise ValueError("--compile inductor compiles the CPU's step: it runs on a CPU, with no static flag")
        layer_blocks: list[LayerBlocks] | None = None  # the layers' weights as blocks, where "blocks" packs them
        if weights == "int8":
            if compile != "auto" or self.device.type != "cpu" or static:
                raise ValueError("int8 weights run on the CPU's packed kernels: --compile auto on a CPU")
            packing = "int8"
        elif packing != "none" and self.dtype == torch.float32:
            layer_blocks = find_layer_blocks(model)
            if layer_blocks is not None:
                # fp32 weights that are llama.cpp blocks (a GGUF model's): the fp32 products from a sixth of the bytes
                packing = "blocks"
        # An fp32 head (upcasting bf16 is exact): on weights stored in fp16 where fp16 holds them exactly (a bf16
        # model's do: half the bytes, the same fp32 products), else packed like the layers where fp32 packs here.
        head = fp32_head(weight) if compile != "off" else HeadPacking("none")
        head_packing = head.packing
        shape = LlamaShape.of(model.config)
        layer_products = {
            (shape.q_size + 2 * shape.kv_size, shape.hidden_size),
            (shape.hidden_size, shape.q_size),
            (2 * shape.intermediate_size, shape.hidden_size),
            (shape.hidden_size, shape.intermediate_size),
        }
        # The row counts a step and the head may run at: those whose rows come out alike in every product.
        self.buckets: tuple[int, ...] = invariant_rows(packing, self.dtype, layer_products)
        head_buckets = invariant_rows(head_packing, torch.float32, {(shape.vocab_size, shape.hidden_size)})
        self._forward = LlamaForward(model, packing, self.buckets, layer_blocks)
        self._head = PackedLinear(weight.float(), None, head_packing, head_buckets, head.blocks)
        self.head_packing = head_packing
        self._norm = self._forward.norm.float()
        self._eps = shape.rms_norm_eps
        self.packing = packing
        self.vocab_size = shape.vocab_size
        self.hidden_size = shape.hidden_size
        self.num_layers = shape.num_layers
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.max_positions = shape.max_positions
        cuda = self.device.type == "cuda"
        if static is None:
            static = compile == "auto" and cuda
        group = shape.num_heads // shape.num_kv_heads
        self._static: StaticSteps | None = None
        if inductor:
            self._static = InductorSteps(model, group)
        elif static:
            self._static = StaticSteps(self._forward, capture=cuda, group=group)
        # Ragged steps on a CPU attend in fp32 (``ragged_attention``): a bf16 model's keys and values are kept
        # in fp32 there, so that no layer of any step converts the whole context again (a sizeable share of a
        # bf16 step: see docs/benchmarks.md, "Smaller figures behind rules in the code"). Exact: a bf16 value
        # is stored unchanged in fp32. The cache holds half the tokens per byte.
        self.kv_dtype: torch.dtype = (
            torch.float32 if self.device.type == "cpu" and (inductor or not static) else self.dtype
        )
        # Over block products, a step's verifies (plain decoding's one-row segments and trees) attend in one call
        # a layer, not SDPA's per session (``block_weights.attend_rows``), each row as plain decoding would.
        fused_attention = self._forward.fused and self.kv_dtype == torch.float32 and self.dtype == torch.float32
        self._kernel_rows = attend_rows if fused_attention else None
        # Whether a step whose segments all attend in the kernel runs each layer as one kernel call
        # (``_kernel_step``); benchmarks turn it off to measure the layers one dispatch at a time.
        self.one_call_layers = True

    def describe(self) -> str:
        """The step's form, for logs and benchmark reports."""
        kernel = kernel_name(self.packing, "eager")
        head_kernel = kernel_name(self.head_packing, "eager")
        if self._head.block_format:
            head_kernel += f" {self._head.block_format}"
        head = f"fp32 head {head_kernel} at rows {_row_counts(self._head.buckets)}"
        if self._head.runs_wide_rows_on_onednn:
            head += ", oneDNN beyond"
        if isinstance(self._static, InductorSteps):
            return (
                f"one inductor-compiled graph (weights frozen) at rows padded to {list(self._static.row_buckets)}, "
                f"attention over one gathered window of at most {self._static.max_window} slots; beyond, "
                f"{kernel}-prepacked eager; {head}"
            )
        if self._static is not None:
            how = "CUDA graphs" if self._static.capture else "uncaptured static steps"
            return (
                f"{how} per (rows, window) bucket, rows padded to {list(self._static.row_buckets)}, attention over "
                f"one gathered window of at most {self._static.max_window} slots; eager beyond"
            )
        if self.packing == "none":
            eager = "eager F.linear products (--compile off or no packed kernel here)"
            return eager if self.head_packing == "none" else f"{eager}; {head}"
        if self.packing == "int8":
            return (
                f"int8 weight-only products (bf16 activations, {str(self.dtype).removeprefix('torch.')} between "
                f"them) at rows {_row_counts(self.buckets)}, {head}"
            )
        dtype = str(self.dtype).removeprefix("torch.")
        if self.packing == "blocks":
            formats = "/".join(sorted({f for b in self._forward.blocks for f in b.block_formats}))
            fused = "; norms and rotary embeddings in one call each" if self._forward.fused else ""
            fused += ", verifies' attention (trees too) in one call a layer" if self._kernel_rows is not None else ""
            if self._kernel_rows is not None and self._forward.kernel_layers is not None:
                fused += "; a step whose segments all attend there runs each layer as one kernel call"
            return (
                f"{kernel} ({formats}) {dtype} products at rows {_row_counts(self.buckets)}, oneDNN beyond; {head}"
                f"{fused}"
            )
        return f"{kernel}-prepacked {dtype} products at rows {_row_counts(self.buckets)}, {head}"

    @property
    def captures_steps(self) -> bool:
        """Whether steps run as CUDA graphs (captured per shape)."""
        return self._static is not None and self._static.capture

    @property
    def compiles_steps(self) -> bool:
        """Whether steps run as an inductor-compiled graph (compiled by ``prepare_steps``)."""
        return isinstance(self._static, InductorSteps)

    def prepare_steps(self, arena: KVArena, max_rows: int, max_context: int) -> int:
        """Capture every step shape of up to ``max_rows`` rows and ``max_context`` context slots (at most
        ``STARTUP_WINDOW``) on ``arena`` now, not in a request's round (``StaticSteps.prepare``); returns the
        shapes captured (0 without graphs)."""
        if isinstance(self._static, InductorSteps):
            with torch.inference_mode():
                self._static.prepare_graph(arena)
            return 1
        if self._static is None or not self._static.capture:
            return 0
        with torch.inference_mode():
            return self._static.prepare(arena, windows_up_to(min(max_context, STARTUP_WINDOW)), max_rows)

    @property
    def kv_bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    def new_arena(self, capacity_tokens: int) -> KVArena:
        scratch = BLOCK_TOKENS if self._static is not None else 0  # where static steps' padding rows write
        return KVArena(
            self.num_layers, self.num_kv_heads, self.head_dim, capacity_tokens, self.kv_dtype, self.device, scratch
        )

    @property
    def max_invariant_segment_rows(self) -> int:
        """The most rows one segment may have and still attend each row alike whatever shares its segment: the
        attention kernel's limit where verifies attend there (fp32 over blocks), else no limit of ours (SDPA
        and the static steps' window round rows alike or not at any count)."""
        return KERNEL_MAX_ROWS if self._kernel_rows is not None else 2**31 - 1

    def padded_rows(self, rows: int) -> int:
        """The rows a step of ``rows`` tokens runs as."""
        return bucket_for(rows, self.buckets)

    def _kernel_step(
        self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor, capture: LayerCapture | None = None
    ) -> torch.Tensor | None:
        """The step as one kernel call a layer (``LlamaForward.kernel_step``) where it can run so: block products
        at up to their largest bucket, and every segment attending in the kernel. None: run it layer by layer."""
        if self._kernel_rows is None or self._forward.kernel_layers is None or not self.one_call_layers:
            return None
        if not self.buckets or input_ids.shape[0] > self.buckets[-1]:
            return None
        table, allowed, others = plan.kernel_rows()
        if others:
            return None
        arena = plan.arena
        return self._forward.kernel_step(input_ids, positions, arena.keys, arena.values, table, allowed, capture)

    @torch.inference_mode()
    def forward(
        self,
        plan: StepPlan,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        score_rows: torch.Tensor,
        feature_rows: torch.Tensor,
        layer_rows: torch.Tensor | None = None,
        layers: tuple[int, ...] = (),
    ) -> StepOutput:
        """Run ``input_ids`` [T] at ``positions`` [T]; writes their keys and values into the plan's arena.

        Returns fp32 logits at ``score_rows`` and normed hidden states at ``feature_rows`` (row indices into T),
        and with ``layers`` the inputs of those decoder layers at ``layer_rows``. A step that keeps layers runs
        the eager layers (static steps and graphs return the last hidden state only): the same products at the
        same row buckets as any eager step.
        """
        rows = input_ids.shape[0]
        capture = LayerCapture(layers, layer_rows) if layers and layer_rows is not None else None
        if capture is None and self._static is not None and self._static.covers(plan, rows):
            hidden = self._static(plan, input_ids, positions)
        else:
            padding = self.padded_rows(rows) - rows
            if padding:  # padding rows belong to no segment: attention gives them zeros and nothing reads them
                input_ids = F.pad(input_ids, (0, padding))
                positions = F.pad(positions, (0, padding))
            one_call_layers = self._kernel_step(plan, input_ids, positions, capture)
            if one_call_layers is not None:
                hidden = one_call_layers
            else:
                attend = partial(attend_segments, plan, kernel_rows=self._kernel_rows)
                hidden = self._forward(attend, input_ids, positions, capture)
        wanted = torch.cat([score_rows, feature_rows])
        normed = self._forward.norm_rows(hidden.index_select(0, wanted).float(), self._norm, self._eps)
        scored = normed[: score_rows.numel()]
        logits = self._head(scored) if scored.numel() else scored.new_zeros(0, self.vocab_size)
        if capture is None:
            return StepOutput(logits, normed[score_rows.numel() :])
        return StepOutput(logits, normed[score_rows.numel() :], capture.stacked(), capture.layers)
