"""One forward of the target model over a packed, ragged batch.

transformers loads the model; the engine's own forward (``llama_forward``)
runs it, so that:

- many sessions' tokens share every matmul (one sequence of T rows);
- a step runs at a few static row counts (``packed_linear.DEFAULT_BUCKETS``,
  padded up), each with the weights prepacked for the CPU's GEMM kernel, so
  a verify of 2-8 rows costs about what one row does, and a row's result is
  the same bits whichever bucket it runs in (batch invariance: a token is
  scored alike in a plain step and inside a tree);
- the final norm and LM head run in fp32 whatever the layers run in, and only
  for the rows whose scores decide something: bf16 rounding in the head would
  manufacture argmax ties;
- hidden states are returned only for the rows a draft head asked for.

``compile="off"`` runs the same forward with ``F.linear`` and no padding: the
eager baseline the benchmarks compare with, and the path for GPUs until the
engine has CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from target_service.kv_arena import KVArena, bytes_per_token
from target_service.llama_forward import SUPPORTED_MODEL_TYPES, LlamaForward, UnsupportedModelError, rms_norm
from target_service.packed_linear import DEFAULT_BUCKETS, PackedLinear, Packing, available_packing, bucket_for
from target_service.ragged_attention import StepPlan

COMPILE_CHOICES = ("auto", "off")

__all__ = ["COMPILE_CHOICES", "SUPPORTED_MODEL_TYPES", "ModelRunner", "StepOutput", "UnsupportedModelError"]


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [len(score_rows), vocab] float32
    features: torch.Tensor  # [len(feature_rows), hidden] float32, after the final norm


class ModelRunner:
    """Runs the engine's forward over a StepPlan; ``compile`` is "auto" (prepacked buckets) or "off"."""

    def __init__(self, model: Any, compile: str = "auto", buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {COMPILE_CHOICES}, not {compile!r}")
        weight = model.lm_head.weight.detach()
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        packing: Packing = available_packing(self.dtype, self.device) if compile == "auto" else "none"
        # Buckets matter only where a pack serves one row count; elsewhere a step runs at its own size.
        self.buckets: tuple[int, ...] = tuple(sorted(buckets)) if packing == "mkl" else ()
        self._forward = LlamaForward(model, packing, self.buckets)
        shape = self._forward.shape
        # An fp32 head (upcasting bf16 is exact), packed like the layers when fp32 packing exists here.
        head_packing = available_packing(torch.float32, self.device) if compile == "auto" else "none"
        self._head = PackedLinear(weight.float(), None, head_packing, buckets)
        self._norm = self._forward.norm.float()
        self._eps = shape.rms_norm_eps
        self.packing = packing
        self.vocab_size = shape.vocab_size
        self.hidden_size = shape.hidden_size
        self.num_layers = shape.num_layers
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.max_positions = shape.max_positions

    def describe(self) -> str:
        """The step's form, for logs and benchmark reports."""
        if self.packing == "mkl":
            return f"MKL-prepacked fp32 products, rows padded to {list(self.buckets)}"
        if self.packing == "onednn":
            return f"oneDNN-prepacked {str(self.dtype).removeprefix('torch.')} products, fp32 head MKL-prepacked"
        return "eager F.linear products (--compile off or no packed kernel here)"

    @property
    def kv_bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def new_arena(self, capacity_tokens: int) -> KVArena:
        return KVArena(self.num_layers, self.num_kv_heads, self.head_dim, capacity_tokens, self.dtype, self.device)

    def padded_rows(self, rows: int) -> int:
        """The rows a step of ``rows`` tokens runs as."""
        return bucket_for(rows, self.buckets)

    @torch.inference_mode()
    def forward(
        self,
        plan: StepPlan,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        score_rows: torch.Tensor,
        feature_rows: torch.Tensor,
    ) -> StepOutput:
        """Run ``input_ids`` [T] at ``positions`` [T]; writes their keys and values into the plan's arena.

        Returns fp32 logits at ``score_rows`` and normed hidden states at ``feature_rows`` (row indices into T).
        """
        rows = input_ids.shape[0]
        padding = self.padded_rows(rows) - rows
        if padding:  # padding rows belong to no segment: attention gives them zeros and nothing reads them
            input_ids = F.pad(input_ids, (0, padding))
            positions = F.pad(positions, (0, padding))
        hidden = self._forward(plan, input_ids, positions)
        wanted = torch.cat([score_rows, feature_rows])
        normed = rms_norm(hidden.index_select(0, wanted).float(), self._norm, self._eps)
        scored = normed[: score_rows.numel()]
        logits = self._head(scored) if scored.numel() else scored.new_zeros(0, self.vocab_size)
        return StepOutput(logits, normed[score_rows.numel() :])
