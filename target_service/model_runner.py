"""One forward of the target model over a packed, ragged batch.

The model definition is transformers' (its embedding, decoder layers,
rotary embedding and final norm); the loop over layers, the attention over
the KV arena (``ragged_attention``) and the output head are ours, so that:

- many sessions' tokens share every matmul (one sequence of T rows);
- the layers' and the LM head's products take the faster of two equal forms for few rows
  (``specserve.layer_matmul``, ``specserve.head_matmul``);
- the final norm and LM head run in fp32 whatever the layers run in, and only
  for the rows whose scores decide something: bf16 rounding in the head would
  manufacture argmax ties;
- hidden states are returned only for the rows a draft head asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specserve.head_matmul import HeadMatmul, head_matmul
from specserve.layer_matmul import LayerMatmul, install_layer_matmul
from target_service.kv_arena import KVArena, bytes_per_token
from target_service.ragged_attention import StepPlan, install

# Decoder-only families whose layers take (hidden, position_embeddings, **kwargs) and call the
# configured attention implementation: the Llama family and its close relatives.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [len(score_rows), vocab] float32
    features: torch.Tensor  # [len(feature_rows), hidden] float32, after the final norm


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the engine drives."""


class ModelRunner:
    """Drives a transformers causal LM layer by layer over a StepPlan."""

    def __init__(self, model: Any, lm_head_matmul: str = "auto", layers_matmul: str = "auto") -> None:
        config = model.config
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"the verifier engine drives {sorted(SUPPORTED_MODEL_TYPES)} models; this one is {model_type!r}"
            )
        self._model = model
        self._inner = model.model
        install(model)
        weight = model.lm_head.weight.detach()
        # An fp32 copy of the head only when the layers are not fp32 already (upcasting bf16 is exact).
        self._head = head_matmul(weight if weight.dtype == torch.float32 else weight.float(), lm_head_matmul)
        self._layers = install_layer_matmul(self._inner.layers, layers_matmul)
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.max_positions = int(getattr(config, "max_position_embeddings", 2048))

    @property
    def head_matmul(self) -> HeadMatmul:
        """The LM head's product, in the form chosen for each row count."""
        return self._head

    @property
    def layers_matmul(self) -> LayerMatmul:
        """The decoder layers' linear products, in the form chosen for each row count."""
        return self._layers

    @property
    def kv_bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def new_arena(self, capacity_tokens: int) -> KVArena:
        return KVArena(self.num_layers, self.num_kv_heads, self.head_dim, capacity_tokens, self.dtype, self.device)

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
        hidden = self._inner.embed_tokens(input_ids[None])
        position_ids = positions[None]
        rotary = self._inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in self._inner.layers:
            hidden = layer(hidden, position_embeddings=rotary, position_ids=position_ids, specserve_step=plan)
        rows = hidden[0]
        wanted = torch.cat([score_rows, feature_rows])
        # RMSNorm computes in fp32 and multiplies by its weight; on fp32 input the result stays fp32.
        normed = self._inner.norm(rows.index_select(0, wanted).float())
        scored = normed[: score_rows.numel()]
        logits = self._head(scored) if scored.numel() else scored.new_zeros(0, self.vocab_size)
        return StepOutput(logits, normed[score_rows.numel() :])
