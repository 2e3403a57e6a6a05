"""The engine's own forward for the Llama family.

transformers loads the config, the weights and the tokenizer; this module
takes the weights over into a compact model of its own:

- **fused projections**: one QKV product and one gate-up product a layer (4
  products a layer instead of 7), their weights concatenated once at start-up
  from the checkpoint's separate tensors (vLLM's ``llama.py`` does the same);
- **prepacked weights** (``specserve.packed_linear``): each product's weight is packed
  once for the CPU's GEMM kernel, so a step of 2-8 rows costs about what one
  row does;
- **plain tensor code**: RMSNorm, rotary embedding, SiLU-gated MLP, row by row
  alike, so a row's result does not depend on which other rows share its step;
- **attention over the KV arena**, passed in: each session's rows attend over
  their own cached context with their own mask (``ragged_attention`` per
  segment, or ``static_steps`` over one gathered window for CUDA graphs).

The families it drives differ only in small ways: Qwen2 has biases on Q, K
and V; Qwen3 normalises each head's queries and keys before the rotary
embedding; Llama 3 scales its rotary frequencies (already folded into the
``inv_freq`` transformers computed). Rotary types whose frequencies change
with the sequence length ("dynamic", "longrope") are refused, and so are
sliding-window layers (this forward attends over the whole context).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.block_weights import fused_ops_fit, layer_step, rms_norm_rows, rotary_rows
from specserve.llama_ops import apply_rotary, rms_norm, rotary_tables
from specserve.packed_linear import PackedLinear, Packing
from target_service.layer_features import LayerCapture

# Attention for one layer: (layer, q [T, heads, d], k and v [T, kv_heads, d], scaling) -> [T, heads, d]; it also
# stores k and v in the KV cache. ``ragged_attention.attend_segments`` (bound to a plan) or a static step's.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

# Decoder-only families this forward reproduces: the Llama family and its close relatives.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the engine drives."""


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions the forward needs, read once from a transformers config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def of(cls, config: Any) -> LlamaShape:
        heads = int(config.num_attention_heads)
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            rms_norm_eps=float(config.rms_norm_eps),
            max_positions=int(getattr(config, "max_position_embeddings", 2048)),
        )


def check_supported(config: Any) -> None:
    """Raise UnsupportedModelError unless this forward reproduces the model."""
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the verifier engine drives {sorted(SUPPORTED_MODEL_TYPES)} models; this one is {model_type!r}"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise UnsupportedModelError("sliding-window attention layers are not supported")


class Block:
    """One decoder layer's weights: projections fused, then packed."""

    def __init__(self, layer: Any, packing: Packing, buckets: Sequence[int]) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise UnsupportedModelError("biases on some of Q, K and V but not all")
        if attn.o_proj.bias is not None or mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
            raise UnsupportedModelError("biases on the output or MLP projections")
        qkv_bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.qkv = PackedLinear(torch.cat([p.weight.detach() for p in projections]), qkv_bias, packing, buckets)
        self.o = PackedLinear(attn.o_proj.weight, None, packing, buckets)
        gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
        self.gate_up = PackedLinear(gate_up, None, packing, buckets)
        self.down = PackedLinear(mlp.down_proj.weight, None, packing, buckets)
        self.intermediate = int(mlp.down_proj.weight.shape[1])
        products = (self.qkv, self.o, self.gate_up, self.down)
        self.block_formats = frozenset(p.block_format for p in products if p.block_format)
        self.attn_norm = layer.input_layernorm.weight.detach()
        self.mlp_norm = layer.post_attention_layernorm.weight.detach()
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norms = None
        if q_norm is not None and k_norm is not None:  # Qwen3
            self.qk_norms = (q_norm.weight.detach(), k_norm.weight.detach())


def _kernel_layer(block: Block) -> tuple[list[torch.Tensor], list[int]] | None:
    """A layer's norms and packed block products as ``block_weights.layer_step`` takes them; None where the layer
    has biases, per-head norms, or a product not on blocks."""
    products = (block.qkv, block.o, block.gate_up, block.down)
    weights = [p.blocks for p in products]
    if block.qk_norms is not None or any(p.bias is not None for p in products) or None in weights:
        return None
    packed, shapes = zip(*(w.kernel_args() for w in weights if w is not None), strict=True)
    return [block.attn_norm, *packed, block.mlp_norm], [n for shape in shapes for n in shape]


class LlamaForward:
    """A step: ids and positions of T rows in, final hidden states [T, hidden] (before the norm) out."""

    def __init__(self, model: Any, packing: Packing, buckets: Sequence[int]) -> None:
        config = model.config
        check_supported(config)
        inner = model.model
        rotary = inner.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise UnsupportedModelError(f"rotary type {rope_type!r} changes with the sequence length")
        self.shape = LlamaShape.of(config)
        self.packing = packing
        self.embed = inner.embed_tokens.weight.detach()
        self.blocks = [Block(layer, packing, buckets) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.scaling = self.shape.head_dim**-0.5
        # Over block products the step's other operations are most of it: fp32 norms and rotary embeddings in
        # one call each, from the block kernel's module (eight and four dispatches eager).
        fused = packing == "blocks" and fused_ops_fit(self.shape.hidden_size, self.shape.head_dim)
        self.fused = fused  # the step's norms, rotary embeddings (and its caller's attention) from the kernel
        self.norm_rows: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = (
            rms_norm_rows if fused else rms_norm
        )
        self.rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
            rotary_rows if fused else apply_rotary
        )
        # Each layer's products as the kernel's ``layer_step`` takes them, where a whole layer can run as one call
        # (block products without biases, no per-head norms): ``kernel_step``.
        self.kernel_layers: list[tuple[list[torch.Tensor], list[int]]] | None = None
        layers = [_kernel_layer(b) for b in self.blocks] if fused else []
        if fused and None not in layers:
            self.kernel_layers = [layer for layer in layers if layer is not None]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

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

    def __call__(
        self, attend: Attend, input_ids: torch.Tensor, positions: torch.Tensor, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """Rows ``attend`` gives no segment (padding) are computed and never read back; ``capture`` keeps the
        named layers' inputs (``layer_features``)."""
        s = self.shape
        rows = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos, sin = rotary_tables(positions, self.inv_freq, self.rope_scaling, x.dtype)
        q_heads = s.num_heads
        for index, block in enumerate(self.blocks):
            if capture is not None:
                capture.offer(index, x)
            qkv = block.qkv(self.norm_rows(x, block.attn_norm, s.rms_norm_eps))
            qk = qkv[:, : s.q_size + s.kv_size].view(rows, s.num_heads + s.num_kv_heads, s.head_dim)
            v = qkv[:, s.q_size + s.kv_size :].view(rows, s.num_kv_heads, s.head_dim)
            if block.qk_norms is not None:
                q_norm, k_norm = block.qk_norms
                q = rms_norm(qk[:, :q_heads], q_norm, s.rms_norm_eps)
                qk = torch.cat((q, rms_norm(qk[:, q_heads:], k_norm, s.rms_norm_eps)), dim=1)
            qk = self.rotary(qk, cos, sin)
            attended = attend(index, qk[:, :q_heads], qk[:, q_heads:], v, self.scaling)
            x = x + block.o(attended.reshape(rows, s.q_size))
            gate, up = block.gate_up(self.norm_rows(x, block.mlp_norm, s.rms_norm_eps)).split(
                block.intermediate, dim=-1
            )
            x = x + block.down(F.silu(gate) * up)
        return x
