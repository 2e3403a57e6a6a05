"""An EAGLE-style draft head: one decoder layer that predicts the target's next hidden feature.

The target's last hidden state f_t (after its final norm) at position t is
what its LM head turns into the token x_{t+1}. The head reads f_t together
with the embedding of x_{t+1} and predicts f_{t+1}; the target's own LM head
rows, restricted to a reduced draft vocabulary (the most frequent tokens of
the training data, as EAGLE-3 and FR-Spec do), turn that prediction into
draft logits for x_{t+2}. Drafting deeper feeds the predicted feature back in
(Li et al. 2024, "EAGLE"). The verifier still checks against the full
vocabulary, so a reduced draft vocabulary costs acceptance, never exactness.

Only the head's own weights are stored (``save``): the embedding and LM head
rows come from the target at load time, which the fingerprint check ties to
the vocabulary the head was trained on.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaModel

from draft_service.head_layer import HeadCache, HeadStep
from draft_service.head_products import (
    WeightPack,
    auto_candidates,
    describe,
    describe_timings,
    head_packing,
    pack_linears,
    pack_of,
    product,
)
from draft_service.head_timing import Timer, faster_kernel, time_draft_step, time_kernels
from draft_service.head_types import DraftHeadConfig, HeadOutput
from specserve.hardware import DtypeChoice, choose_dtype
from specserve.packed_linear import Packing

FORMAT_VERSION = 1


class DraftHeadError(ValueError):
    """A weight file that cannot serve this target: missing, corrupt, or trained for another one."""


class DraftHead(nn.Module):
    """fc(concat(f_t, embed(x_{t+1}))) -> one Llama decoder layer -> f^_{t+1} -> reduced LM head."""

    embedding: torch.Tensor
    draft_lm_head: torch.Tensor
    draft_vocab: torch.Tensor
    feature_layers: tuple[int, ...] = ()  # it reads the target's final hidden state (``head_types.ServingHead``)

    def __init__(
        self,
        config: DraftHeadConfig,
        embedding: torch.Tensor,  # [vocab, hidden]: the target's input embedding (frozen)
        lm_head: torch.Tensor,  # [vocab, hidden]: the target's LM head (frozen)
        draft_vocab: torch.Tensor,  # [draft_vocab]: target token id of each draft logit
    ) -> None:
        super().__init__()
        if draft_vocab.numel() != config.draft_vocab_size:
            raise DraftHeadError(f"{draft_vocab.numel()} draft vocabulary ids for a head of {config.draft_vocab_size}")
        if embedding.shape[1] != config.hidden_size or lm_head.shape[1] != config.hidden_size:
            raise DraftHeadError(
                f"the target's hidden size is {embedding.shape[1]}, the head was built for {config.hidden_size}"
            )
        if int(draft_vocab.max()) >= lm_head.shape[0]:
            raise DraftHeadError(f"draft vocabulary id {int(draft_vocab.max())} is outside the target's vocabulary")
        self.config = config
        self.target_fingerprint = ""  # the vocabulary it was trained for (set when loaded from a file)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.body = LlamaModel(config.llama_config())
        del self.body.embed_tokens  # unused: saves a parameter nobody trains
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("draft_lm_head", lm_head.detach()[draft_vocab].clone(), persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        # The products' packed kernel (``pack_products``); none while training: every product is F.linear.
        self.packing: Packing = "none"
        self.head_matmul = "linear"  # --head-matmul of the last pack_products
        self.kernel_seconds: dict[Packing, float] = {}  # with --head-matmul auto: a draft step's time per kernel
        self._logits_pack: WeightPack | None = None
        self._step: HeadStep | None = None  # the serving layer: built by ``pack_products``, again if weights change

    def forward(
        self,
        features: torch.Tensor,  # [batch, n, hidden]: f_t
        next_tokens: torch.Tensor,  # [batch, n]: x_{t+1}
        position_ids: torch.Tensor | None = None,  # [batch, n]
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        last_logits_only: bool = False,  # logits of the last position only (feeding a context: [batch, 1, vocab])
    ) -> HeadOutput:
        embedded = self.embedding[next_tokens].to(features.dtype)
        hidden = self.fc(torch.cat([features, embedded], dim=-1))
        out = self.body(
            inputs_embeds=hidden,
            position_ids=position_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            use_cache=past_key_values is not None,
        )
        predicted = out.last_hidden_state
        scored = predicted[:, -1:] if last_logits_only else predicted
        return HeadOutput(predicted, product(scored, self.draft_lm_head, None, self._logits_pack), out.past_key_values)

    def step(
        self,
        features: torch.Tensor,  # [n, hidden]: f_t
        next_tokens: torch.Tensor,  # [n]: x_{t+1}
        positions: torch.Tensor,  # [n]
        cache: HeadCache,
        allowed: torch.Tensor | None = None,  # [n, cached + n] bool, True: may attend; None: causal
        last_logits_only: bool = False,
    ) -> HeadOutput:
        """What ``forward`` computes for one session's rows, on the serving path (``head_layer.HeadStep``:
        fused, prepacked products and an in-place cache); outputs carry a batch dimension of 1. Inputs may come
        from the host: they are moved to the head's device (a no-op where they are there already)."""
        if self._step is None or not self._step.serves(self):
            self._step = self._new_step()
        device = self.draft_lm_head.device
        features, next_tokens, positions = (t.to(device) for t in (features, next_tokens, positions))
        allowed = None if allowed is None else allowed.to(device)
        predicted, logits = self._step(features, next_tokens, positions, cache, allowed, last_logits_only)
        return HeadOutput(predicted[None], logits[None], cache)

    def step_in_slots(
        self,
        features: torch.Tensor,  # [n, hidden]: f_t
        next_tokens: torch.Tensor,  # [n]: x_{t+1}
        positions: torch.Tensor,  # [n]
        keys: torch.Tensor,  # [kv_heads, slots, head_dim]
        values: torch.Tensor,  # [kv_heads, slots, head_dim]
        first_slot: int,  # where the rows' keys and values go
        allowed: torch.Tensor,  # [n, slots] bool: the slots each row attends to
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` over fixed key and value buffers (``head_layer.HeadStep.in_slots``), on the head's device:
        (f^_{t+1} [n, hidden], draft logits [n, vocab])."""
        if self._step is None or not self._step.serves(self):
            self._step = self._new_step()
        return self._step.in_slots(features, next_tokens, positions, keys, values, first_slot, allowed)

    @property
    def head_dim(self) -> int:
        """Its attention's head size."""
        attention: Any = self.body.layers[0].self_attn
        return int(attention.head_dim)

    @property
    def logits_pack(self) -> WeightPack | None:
        """The draft logits' packed weight (``pack_products``); None: F.linear."""
        return self._logits_pack

    def pack_products(self, head_matmul: str = "auto", timer: Timer = time_draft_step) -> None:
        """Run the fc, the layer's linears and the draft logits on weights packed now, in the head's current
        dtype, as ``head_matmul`` says: "packed", the float weights prepacked for this CPU's GEMM kernel where
        one exists (else F.linear); "int8", int8 copies; "linear", F.linear; "auto", whichever of "packed" and
        "int8" ``timer`` finds faster for a draft step (``head_timing``; int8 only by a margin).

        Called on a head ready to serve: its ``nn.Linear``s become ``PackableLinear``s over the same parameters.
        """
        weight = self.draft_lm_head
        self.head_matmul = head_matmul
        self.kernel_seconds = {}
        if head_matmul == "auto":
            candidates = auto_candidates(weight.dtype, weight.device)
            if len(candidates) > 1:
                self.kernel_seconds = time_kernels(self, candidates, timer)
            packing = faster_kernel(self.kernel_seconds, candidates[0])
        else:
            packing = head_packing(weight.dtype, weight.device, head_matmul)
        self.pack_for(packing)

    def pack_for(self, packing: Packing) -> None:
        """Pack the products for ``packing`` ("none": F.linear), and build the serving step over them."""
        self.packing = packing
        pack_linears(self, packing)
        self._logits_pack = pack_of(self.draft_lm_head, None, packing)
        self._step = self._new_step()  # fused and packed now, not in a request's first draft

    def _new_step(self) -> HeadStep:
        with torch.inference_mode(False):  # its packs check their weights' versions: inference tensors have none
            return HeadStep(self)

    @property
    def products(self) -> str:
        """What runs the head's products, for logs and reports."""
        described = describe(self.packing, self.head_matmul, self.draft_lm_head.dtype)
        return described + describe_timings(self.kernel_seconds, self.draft_lm_head.dtype)

    def save(self, path: Path, *, target_fingerprint: str, metadata: dict[str, Any] | None = None) -> None:
        """Weights in bfloat16 with the config, draft vocabulary and target fingerprint."""
        path.parent.mkdir(parents=True, exist_ok=True)
        # The target's embedding and LM head are non-persistent buffers: only the head's own weights are stored.
        state = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in self.state_dict().items()}
        payload = {
            "format_version": FORMAT_VERSION,
            "config": asdict(self.config),
            "target_fingerprint": target_fingerprint,
            "draft_vocab": self.draft_vocab.to(torch.int32).cpu(),
            "state": state,
            "metadata": metadata or {},
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)


def require_weights(path: Path) -> None:
    """Fail early, before any model is loaded, when there is no weight file at ``path``."""
    if not path.is_file():
        raise DraftHeadError(f"no draft head weights at {path}: run `make train-draft` or pass another file")


def load_draft_head(
    path: Path, *, target_fingerprint: str, embedding: torch.Tensor, lm_head: torch.Tensor
) -> tuple[DraftHead, dict[str, Any]]:
    """The head stored at ``path`` over this target's embedding and LM head; its metadata.

    Raises DraftHeadError naming the problem when the file is missing, not a
    draft head, trained for another vocabulary, or shaped for another target.
    """
    payload = read_weights(path)
    if payload["target_fingerprint"] != target_fingerprint:
        raise DraftHeadError(
            f"{path} was trained for the target vocabulary {payload['target_fingerprint']}, "
            f"this target's is {target_fingerprint}: train a head for this target (`make train-draft`)"
        )
    config = DraftHeadConfig(**payload["config"])
    head = DraftHead(config, embedding, lm_head, payload["draft_vocab"].long())
    head.target_fingerprint = target_fingerprint
    load_state(head, payload, path)
    return head.eval(), dict(payload.get("metadata", {}))


def read_weights(path: Path) -> dict[str, Any]:
    """The stored payload of the head file at ``path`` (``DraftHead.save``); DraftHeadError when unusable."""
    require_weights(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a corrupt file
        raise DraftHeadError(f"{path} is not a readable draft head file: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise DraftHeadError(f"{path} is not a draft head file of format version {FORMAT_VERSION}")
    return payload


def load_state(head: DraftHead, payload: dict[str, Any], path: Path) -> None:
    """Put the stored weights (bf16 on disk) into ``head`` in fp32; DraftHeadError when the shapes differ."""
    state = {name: t.float() if t.is_floating_point() else t for name, t in payload["state"].items()}
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise DraftHeadError(f"{path} does not fit this head's shape: {exc}") from exc


def in_serving_dtype(
    head: DraftHead, requested: str = "auto", head_matmul: str = "auto", device: str | torch.device = "cpu"
) -> tuple[DraftHead, DtypeChoice]:
    """``head`` on ``device`` (``--device``) in the dtype the drafter computes in (``--head-dtype``; auto: bf16 on
    a GPU or where the CPU runs it natively), its products packed in that dtype as ``head_matmul`` says
    (``--head-matmul``; auto: the faster kernel here; a GPU's products are F.linear).

    Loaded heads are fp32 (``load_draft_head``); the benchmarks call this too, so they draft as the service does.
    """
    choice = choose_dtype(requested, str(device))
    head = head.to(device=device, dtype=getattr(torch, choice.dtype))
    head.pack_products(head_matmul)
    return head, choice


def truncate_cache(cache: Any, length: int) -> None:
    """Drop a KV cache's entries beyond the first ``length`` (transformers' crop takes a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
