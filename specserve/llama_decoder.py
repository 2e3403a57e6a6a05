"""The Llama family's decoder layers, as both tiers run them: the verifier's forward and the drafter's draft model.

transformers loads the config, the weights and the tokenizer; ``LlamaDecoder`` takes the decoder layers'
weights over and runs them:

- **fused projections**: one QKV product and one gate-up product a layer (4 products a layer instead of 7),
  their weights concatenated once at start-up from the checkpoint's separate tensors (vLLM's ``llama.py`` does
  the same);
- **prepacked weights** (``specserve.packed_linear``): each product's weight is packed once for the kernel the
  caller chose, at the row counts it chose;
- **plain tensor code**: RMSNorm, rotary embedding, SiLU-gated MLP (``specserve.llama_ops``), row by row alike,
  so a row's result does not depend on which other rows share its step;
- **attention passed in** (``Attend``): the one part the tiers do differently. The verifier attends over its
  KV arena per session segment or over a static step's window; the drafter over one session's own cache.

The families it drives differ only in small ways: Qwen2 has biases on Q, K and V; Qwen3 normalises each head's
queries and keys before the rotary embedding; Llama 3 scales its rotary frequencies (already folded into the
``inv_freq`` transformers computed). Rotary types whose frequencies change with the sequence length ("dynamic",
"longrope") are refused, and so are sliding-window layers (this forward attends over the whole context).

One module for both tiers: a draft model is a small model of the target's family, and running the verifier's
own layer math is what lets a model drafting for itself have its drafts accepted. What only one tier does stays
in it: the verifier's fused fp32 norms and rotary embeddings and its layer as one kernel call
(``target_service.llama_forward``), the drafter's cache and LM head (``draft_service.draft_lm``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from specserve.block_weights import Blocks
from specserve.llama_ops import apply_rotary, rms_norm, rotary_tables
from specserve.packed_linear import PackedLinear, Packing, weight_blocks

# Attention for one layer: (layer, q [T, heads, d], k and v [T, kv_heads, d], scaling) -> [T, heads, d] or
# [T, heads * d]; it also stores k and v in the caller's KV cache.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# RMSNorm of rows: (x, weight, eps) -> x normed (``llama_ops.rms_norm`` or a fused kernel's equal).
NormRows = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# The rotary embedding: (x [T, heads, d], cos, signed sin) -> x rotated (``llama_ops.apply_rotary`` or an equal).
Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Decoder-only families this forward reproduces: the Llama family and its close relatives.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedModelError(ValueError):
    """The model's architecture is not one ``LlamaDecoder`` reproduces."""


class LayerTap(Protocol):
    """Keeps some decoder layers' inputs (the verifier's ``layer_features.LayerCapture``)."""

    def offer(self, index: int, x: torch.Tensor) -> None: ...


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


def check_supported(model: Any) -> None:
    """Raise UnsupportedModelError unless ``LlamaDecoder`` reproduces the transformers ``model``: one of the
    families, no sliding-window layers, rotary frequencies fixed whatever the sequence length (they are computed
    once, from ``inv_freq``)."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{sorted(SUPPORTED_MODEL_TYPES)} models are supported; this one is {model_type!r}")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise UnsupportedModelError("sliding-window attention layers are not supported")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rotary type {rope_type!r} changes with the sequence length")


def layer_weights(layer: Any) -> tuple[torch.Tensor, ...]:
    """A decoder layer's seven product weights: Q, K, V, O, gate, up and down, in that order."""
    attn, mlp = layer.self_attn, layer.mlp
    modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return tuple(module.weight.detach() for module in modules)


# A layer's product weights as llama.cpp blocks, in ``layer_weights``' order.
LayerBlocks = tuple[Blocks, ...]


def find_layer_blocks(model: Any) -> list[LayerBlocks] | None:
    """Every decoder layer's product weights as llama.cpp blocks, where all of them run on the block kernel
    (``packed_linear.weight_blocks``); else None. ``LlamaDecoder`` packs its products from them."""
    layers = [layer_weights(layer) for layer in model.model.layers]
    found = weight_blocks([weight for weights in layers for weight in weights])
    if found is None:
        return None
    each = iter(found)
    return [tuple(next(each) for _ in weights) for weights in layers]


def _blocks_of(blocks: LayerBlocks | None, *indices: int) -> Blocks | None:
    """The blocks of the product over these of the layer's weights, concatenated (``Blocks.joined``)."""
    return None if blocks is None else Blocks.joined([blocks[i] for i in indices])


class DecoderBlock:
    """One decoder layer's weights: projections fused, then packed.

    Its products are attributes a caller may replace (the verifier's inductor step swaps in ``nn.Linear``s over
    the same tensors), so it is a plain class, not a frozen dataclass.

    ``blocks``: for "blocks" packing, the layer's weights' blocks where the caller found them already
    (``find_layer_blocks``); else each product finds its own.
    """

    def __init__(self, layer: Any, packing: Packing, buckets: Sequence[int], blocks: LayerBlocks | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise UnsupportedModelError("biases on some of Q, K and V but not all")
        if attn.o_proj.bias is not None or mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
            raise UnsupportedModelError("biases on the output or MLP projections")
        qkv_bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        qkv = torch.cat([p.weight.detach() for p in projections])
        self.qkv = PackedLinear(qkv, qkv_bias, packing, buckets, _blocks_of(blocks, 0, 1, 2))
        self.o = PackedLinear(attn.o_proj.weight, None, packing, buckets, _blocks_of(blocks, 3))
        gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
        self.gate_up = PackedLinear(gate_up, None, packing, buckets, _blocks_of(blocks, 4, 5))
        self.down = PackedLinear(mlp.down_proj.weight, None, packing, buckets, _blocks_of(blocks, 6))
        self.intermediate = int(mlp.down_proj.weight.shape[1])
        products = (self.qkv, self.o, self.gate_up, self.down)
        self.block_formats = frozenset(p.block_format for p in products if p.block_format)
        self.attn_norm = layer.input_layernorm.weight.detach()
        self.mlp_norm = layer.post_attention_layernorm.weight.detach()
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
        if q_norm is not None and k_norm is not None:  # Qwen3
            self.qk_norms = (q_norm.weight.detach(), k_norm.weight.detach())


class LlamaDecoder:
    """A step: ids and positions of T rows in, final hidden states [T, hidden] (before the final norm) out.

    ``norm_rows`` and ``rotary`` are ``llama_ops``' eager operations; a caller with kernels that compute the
    same (the verifier over block products) sets its own. Per-head query and key norms stay eager: they are not
    over whole rows.
    """

    def __init__(
        self, model: Any, packing: Packing, buckets: Sequence[int], blocks: Sequence[LayerBlocks] | None = None
    ) -> None:
        """``blocks``: each layer's ``find_layer_blocks``, where the caller found them to choose "blocks"."""
        check_supported(model)
        inner = model.model
        rotary = inner.rotary_emb
        self.shape = LlamaShape.of(model.config)
        self.embed = inner.embed_tokens.weight.detach()
        found = blocks if blocks is not None else [None] * len(inner.layers)
        self.blocks = [DecoderBlock(layer, packing, buckets, b) for layer, b in zip(inner.layers, found, strict=True)]
        self.norm = inner.norm.weight.detach()
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.scaling = self.shape.head_dim**-0.5
        self.norm_rows: NormRows = rms_norm
        self.rotary: Rotary = apply_rotary

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def __call__(
        self, attend: Attend, input_ids: torch.Tensor, positions: torch.Tensor, capture: LayerTap | None = None
    ) -> torch.Tensor:
        """Rows ``attend`` attends for no one (padding) are computed and never read back; ``capture`` keeps the
        named layers' inputs.

        Queries and keys come out of the QKV product as one tensor and are normed per head and rotated as one:
        each operation is row- and element-wise, so a head's values are those it would have alone.
        """
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
