"""The engine's own forward for the Llama family: ``specserve.llama_decoder``'s layers, with the verifier's fast
paths.

The layers (fused QKV and gate-up products on prepacked weights, RMSNorm, rotary embedding, SiLU-gated MLP, the
families it drives and those it refuses) are ``specserve.llama_decoder``'s, which the drafter's draft model runs
too. What this module adds is the verifier's alone:

- **fused fp32 operations** over block products (``specserve.block_weights``): each RMSNorm and rotary
  embedding of a step in one call of the block kernel's module, not several eager dispatches;
- **a layer as one kernel call** (``kernel_step``) where every segment attends in the kernel and no layer has
  biases or per-head norms;
- **attention over the KV arena**, passed in: each session's rows attend over their own cached context with
  their own mask (``ragged_attention`` per segment, or ``static_steps`` over one gathered window for CUDA
  graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from specserve.block_weights import fused_ops_fit, layer_step, rms_norm_rows, rotary_rows
from specserve.llama_decoder import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from specserve.llama_decoder import Attend as Attend
from specserve.llama_decoder import DecoderBlock, LayerBlocks, LlamaDecoder
from specserve.llama_decoder import LlamaShape as LlamaShape
from specserve.llama_decoder import UnsupportedModelError as UnsupportedModelError
from specserve.llama_ops import rotary_tables
from specserve.packed_linear import Packing
from target_service.layer_features import LayerCapture


def _kernel_layer(block: DecoderBlock) -> tuple[list[torch.Tensor], list[int]] | None:
    """A layer's norms and packed block products as ``block_weights.layer_step`` takes them; None where the layer
    has biases, per-head norms, or a product not on blocks."""
    products = (block.qkv, block.o, block.gate_up, block.down)
    weights = [p.blocks for p in products]
    if block.qk_norms is not None or any(p.bias is not None for p in products) or None in weights:
        return None
    packed, shapes = zip(*(w.kernel_args() for w in weights if w is not None), strict=True)
    return [block.attn_norm, *packed, block.mlp_norm], [n for shape in shapes for n in shape]


class LlamaForward(LlamaDecoder):
    """A step: ids and positions of T rows in, final hidden states [T, hidden] (before the norm) out; ``__call__``
    is ``LlamaDecoder``'s, run with the block kernel's norms and rotary embeddings where they fit."""

    def __init__(
        self, model: Any, packing: Packing, buckets: Sequence[int], blocks: Sequence[LayerBlocks] | None = None
    ) -> None:
        super().__init__(model, packing, buckets, blocks)
        self.packing = packing
        # Over block products the step's other operations are most of it: fp32 norms and rotary embeddings in
        # one call each, from the block kernel's module (eight and four dispatches eager).
        fused = packing == "blocks" and fused_ops_fit(self.shape.hidden_size, self.shape.head_dim)
        self.fused = fused  # the step's norms, rotary embeddings (and its caller's attention) from the kernel
        if fused:
            self.norm_rows = rms_norm_rows
            self.rotary = rotary_rows
        # Each layer's products as the kernel's ``layer_step`` takes them, where a whole layer can run as one call
        # (block products without biases, no per-head norms): ``kernel_step``.
        self.kernel_layers: list[tuple[list[torch.Tensor], list[int]]] | None = None
        layers = [_kernel_layer(b) for b in self.blocks] if fused else []
        if fused and None not in layers:
            self.kernel_layers = [layer for layer in layers if layer is not None]

    def kernel_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        table: torch.Tensor,
        allowed: torch.Tensor,
        capture: LayerCapture | None = None,
    ) -> torch.Tensor:
        """``__call__`` where every segment attends in the kernel (``ragged_attention.StepPlan.kernel_rows``: its
        ``table`` and ``allowed``) and the rows fit the block products' buckets: each layer one call of the
        kernel's module (``block_weights.layer_step``), the same operations in the same order, so the same bits.
        ``keys`` and ``values``: the arena's, per layer; ``capture`` keeps the named layers' inputs."""
        assert self.kernel_layers is not None, "the layers do not run as one kernel call each"
        s = self.shape
        x = F.embedding(input_ids, self.embed)
        cos, sin = rotary_tables(positions, self.inv_freq, self.rope_scaling, x.dtype)
        heads = (s.num_heads, s.num_kv_heads, s.head_dim)
        for index, (weights, shapes) in enumerate(self.kernel_layers):
            if capture is not None:
                capture.offer(index, x)
            x = layer_step(
                x, weights, shapes, s.rms_norm_eps, cos, sin, keys[index], values[index], table, allowed,
                self.scaling, heads,
            )  # fmt: skip
        return x
