"""A draft language model: a small model of the target's family, run by the drafter with a KV cache per session.

transformers loads the config, weights and tokenizer; the layers are ``specserve.llama_decoder``'s, the ones the
verifier's engine runs (the tiers share only ``specserve/``): the same fused QKV and gate-up products on weights
packed once (``specserve.packed_linear``, the block kernel where the weights are a GGUF file's llama.cpp blocks),
the same RMSNorm and rotary embedding, the same families (Llama, Mistral, Qwen2 with its Q, K and V biases, Qwen3
with its per-head query and key norms). The final norm and LM head run in fp32, as the verifier's do.

Attention reads a per-session cache (``DraftLMCache``: one in-place buffer per layer, as the draft head's) with
a mask, so one step can run a tree level's nodes, each over the context, its ancestors and itself. Its numerics
matter only to acceptance: every draft is a guess the verifier checks, so a draft model never changes output.

The drafter serves a draft model only when it shares the target's tokenizer (``load_draft_lm`` compares their
vocabulary fingerprints): token ids cross between them unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from draft_service.head_layer import HeadCache
from specserve.block_weights import serial_kernels
from specserve.llama_decoder import LayerBlocks, LlamaDecoder, UnsupportedModelError, check_supported, find_layer_blocks
from specserve.llama_ops import rms_norm
from specserve.model_loading import (
    ModelNotFoundError,
    default_cache_root,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)
from specserve.packed_linear import PackedLinear, Packing, available_packing, candidate_rows, fp32_head


class DraftLMError(ValueError):
    """A draft model the drafter cannot serve: missing, unreadable, of another family, or of another tokenizer."""


class DraftLMCache:
    """One session's keys and values, a ``HeadCache`` per layer; ``crop`` rolls every layer back at once."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [HeadCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].get_seq_length()

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (the buffers stay: the dropped positions are written over next)."""
        for layer in self.layers:
            layer.crop(length)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class DraftLM:
    """A small causal LM's weights, shared by every session; ``step`` runs rows of one session over its cache."""

    def __init__(self, model: Any, name: str = "", fingerprint: str = "") -> None:
        self.name = name  # where it was loaded from, for messages
        self.fingerprint = fingerprint  # its tokenizer's vocabulary (``vocab_fingerprint``); empty: unchecked
        head = model.get_output_embeddings().weight.detach()
        self.device: torch.device = head.device
        self.dtype: torch.dtype = head.dtype
        self.vocab_size = int(head.shape[0])
        try:
            check_supported(model)  # before ``_packing`` reads the layers' weights
            self.packing, blocks = _packing(model, self.dtype, self.device)
            self._decoder = LlamaDecoder(model, self.packing, candidate_rows(self.packing), blocks)
        except UnsupportedModelError as exc:
            raise DraftLMError(f"the drafter cannot run this draft model: {exc}") from exc
        self._norm = self._decoder.norm.float()
        head_packing = fp32_head(head)  # a GGUF model's Q8_0 head on the block kernel, as the verifier's
        self._head = PackedLinear(
            head.float(), None, head_packing.packing, candidate_rows(head_packing.packing), head_packing.blocks
        )
        # A CPU attends in fp32 (PyTorch's CPU SDPA is slow in bf16 for a few query rows): the cache holds fp32.
        self._attention_dtype = torch.float32 if self.device.type == "cpu" else self.dtype

    @property
    def num_layers(self) -> int:
        return len(self._decoder.blocks)

    def new_cache(self) -> DraftLMCache:
        return DraftLMCache(self.num_layers)

    def describe(self) -> str:
        """For the start-up log: what runs where."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.num_layers} layers on {self.device} in {dtype}, products {self.packing}"

    def _kernels(self) -> contextlib.AbstractContextManager[None]:
        # On the block kernel the drafter's thread runs the loops itself: no OpenMP team beside the verifier's.
        return serial_kernels() if self.packing == "blocks" else contextlib.nullcontext()

    def step(
        self,
        tokens: torch.Tensor,  # [n] token ids
        positions: torch.Tensor,  # [n] their sequence positions
        cache: DraftLMCache,
        allowed: torch.Tensor | None = None,  # [n, cached + n] True where a row may attend; None: causal
        last_only: bool = False,
    ) -> torch.Tensor:
        """The rows' next-token logits [n, vocab] (fp32; ``last_only``: the last row's, [1, vocab]); their keys
        and values stay in ``cache`` after what it held."""
        with self._kernels():
            return self._step(tokens, positions, cache, allowed, last_only)

    def _step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftLMCache,
        allowed: torch.Tensor | None,
        last_only: bool,
    ) -> torch.Tensor:
        rows = tokens.shape[0]
        cached = cache.length
        if allowed is None and rows > 1:
            allowed = torch.ones(rows, cached + rows, dtype=torch.bool, device=self.device)
            allowed[:, cached:] = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril()
        dtype, layer_dtype = self._attention_dtype, self._decoder.dtype

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
            """Appends the layer's keys and values to the session's cache, then attends over all of it."""
            keys, values = cache.layers[index].append(k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype))
            return self._attend(q.to(dtype), keys, values, allowed, scaling).to(layer_dtype)

        x = self._decoder(attend, tokens, positions)
        scored = x[-1:] if last_only else x
        return self._head(rms_norm(scored.float(), self._norm, self._decoder.shape.rms_norm_eps))

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """The rows' queries [n, heads, d] over ``keys``/``values`` [kv_heads, m, d] -> [n, heads * d].

        Two batched products per layer, each key-value head with its group of query heads (head h reads
        key-value head h // group, as transformers' ``repeat_kv``). A draft step has a few query rows: there
        PyTorch's CPU SDPA costs many times the products themselves.
        """
        shape = self._decoder.shape
        rows, kv_heads, head_dim = q.shape[0], shape.num_kv_heads, shape.head_dim
        group = shape.num_heads // kv_heads
        grouped = q.view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        grouped = grouped.reshape(kv_heads, group * rows, head_dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)) * scaling  # [kv_heads, group * rows, m]
        if allowed is not None:
            mask = allowed.repeat(group, 1)  # rows in (group, row) order, as ``grouped``'s
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [kv_heads, group * rows, d]
        out = out.view(kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
        return out.reshape(rows, shape.q_size)


def _packing(model: Any, dtype: torch.dtype, device: torch.device) -> tuple[Packing, list[LayerBlocks] | None]:
    """The block kernel for an fp32 model whose layers are a GGUF file's llama.cpp blocks (a sixth of the bytes
    read), with the layers' blocks; else the packed kernel this dtype and device have (F.linear where none)."""
    blocks = find_layer_blocks(model) if dtype == torch.float32 else None
    if blocks is not None:
        return "blocks", blocks
    return available_packing(dtype, device), None


def draft_dtype(device: str) -> str:
    """fp32 on a CPU (where a GGUF draft model's blocks are read exactly, by the block kernel), bf16 on a GPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def load_draft_lm(spec: str, target_fingerprint: str, target_name: str, device: str = "cpu") -> DraftLM:
    """The draft model at ``spec`` (a Hugging Face directory or a ``.gguf`` file) on ``device``.

    Raises DraftLMError, saying what to do, for a path that holds no model, a checkpoint that does not load,
    a family the step does not run, or a tokenizer other than the target's (``target_fingerprint``, of the
    target ``target_name``): drafts are token ids, which mean the same text only under the same vocabulary.
    """
    try:
        source = materialize(resolve_model(spec), default_cache_root())
    except ModelNotFoundError as exc:
        raise DraftLMError(f"--draft-model {spec!r}: {exc}") from exc
    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError) as exc:
        raise DraftLMError(f"--draft-model {spec!r}: its tokenizer does not load ({exc})") from exc
    fingerprint = vocab_fingerprint(tokenizer)
    if target_fingerprint and fingerprint != target_fingerprint:
        raise DraftLMError(
            f"the draft model {spec!r} has another tokenizer than the target {target_name!r} (vocabulary "
            f"fingerprints {fingerprint} and {target_fingerprint}): drafts are token ids, so the two must share "
            "one tokenizer. Point --draft-model at a small model of the target's own family (e.g. Qwen2.5-0.5B "
            "for Qwen2.5-7B), or --target-model at the target the verifier serves, or leave --draft-model unset"
        )
    try:
        model = load_model(source, device, draft_dtype(device))
    except Exception as exc:  # a checkpoint fails in its reader's own terms (safetensors, pickle, GGUF)
        raise DraftLMError(f"--draft-model {spec!r}: its weights do not load ({exc})") from exc
    return DraftLM(model, spec, fingerprint)
