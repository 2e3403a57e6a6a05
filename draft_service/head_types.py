"""What the draft head's serving pieces share: its shape, a step's output, and the head they read.

``draft_head.DraftHead`` builds its serving layer (``head_layer.HeadStep``) and times its kernels
(``head_timing``), and both read the head back. So that imports run one way (``draft_head`` over
``head_layer`` and ``head_timing``, both over this module), they read it through ``HeadWeights``, a protocol
``DraftHead`` satisfies, instead of importing ``draft_head``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers import LlamaConfig

from draft_service.head_products import WeightPack
from specserve.packed_linear import Packing


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    draft_vocab_size: int

    @classmethod
    def for_target(cls, target_config: Any, draft_vocab_size: int, intermediate_size: int = 0) -> DraftHeadConfig:
        """A head shaped like one layer of ``target_config`` (intermediate size overridable)."""
        rope = getattr(target_config, "rope_theta", None)
        if rope is None:  # newer transformers keep it in rope_parameters
            rope = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=int(target_config.hidden_size),
            intermediate_size=intermediate_size or int(target_config.intermediate_size),
            num_attention_heads=int(target_config.num_attention_heads),
            num_key_value_heads=int(getattr(target_config, "num_key_value_heads", target_config.num_attention_heads)),
            rope_theta=float(rope),
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 2048)),
            draft_vocab_size=draft_vocab_size,
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=1,  # the body never embeds tokens itself: it gets inputs_embeds
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=None,
            eos_token_id=None,
        )


@dataclass(frozen=True)
class HeadOutput:
    features: torch.Tensor  # [batch, n, hidden]: predicted f_{t+1}
    logits: torch.Tensor  # [batch, n, draft_vocab]: draft logits for x_{t+2}
    past_key_values: Any


class ServingHead(Protocol):
    """What the drafter drives of a draft head: our own (``draft_head.DraftHead``) or a published EAGLE-3 one
    (``eagle3_head.Eagle3Head``). ``step`` takes the target's feature rows or the head's own predicted ones
    and returns the features to feed back deeper; the proposer and the tree growth never look inside."""

    target_fingerprint: str  # the vocabulary it drafts for ("": any)

    @property
    def config(self) -> DraftHeadConfig: ...

    @property
    def head_dim(self) -> int:
        """Its attention's head size (the KV buffers' last dimension)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs it reads, concatenated per row (``target_service.layer_features``);
        empty: the target's final hidden state."""

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[draft_vocab]: the target id of each draft logit."""

    @property
    def draft_lm_head(self) -> torch.Tensor:
        """[draft_vocab, hidden]: its dtype and device are the head's."""

    @property
    def products(self) -> str:
        """What runs its products, for logs."""

    def step(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        allowed: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> HeadOutput: ...

    def step_in_slots(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        first_slot: int,
        allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class HeadWeights(Protocol):
    """What ``head_layer.HeadStep`` reads of a draft head: its shape, weights and how its products are packed."""

    @property
    def config(self) -> DraftHeadConfig: ...

    @property
    def body(self) -> Any:
        """transformers' ``LlamaModel`` of one layer: the decoder layer's, final norm's and rotary's weights."""

    @property
    def fc(self) -> nn.Module: ...

    @property
    def embedding(self) -> torch.Tensor: ...

    @property
    def draft_lm_head(self) -> torch.Tensor: ...

    @property
    def draft_vocab(self) -> torch.Tensor: ...

    @property
    def packing(self) -> Packing: ...

    @property
    def logits_pack(self) -> WeightPack | None: ...
