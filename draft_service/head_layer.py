"""The draft head's decoder layer on a compact forward of its own, for serving.

The head trains as a transformers ``LlamaModel`` of one layer, and that is
what ``DraftHead.forward`` runs. Around one small layer, transformers'
machinery (a ``DynamicCache`` that concatenates its whole past on every step,
mask and rotary building, module dispatch) costs about as much as the
products themselves (docs/benchmarks.md, "The draft head on its own layer").
``HeadStep`` runs the same math as the verifier's engine runs its
layers: fused QKV and gate-up products on prepacked weights, the rotary and
RMSNorm of ``specserve.llama_ops``, SDPA over a ``HeadCache`` whose buffers
grow by doubling and are written in place. It reads the head's own
parameters, so it computes what ``DraftHead.forward`` does (a unit test holds
the two together), and drafts stay guesses the verifier checks either way.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from draft_service.head_products import pack_of, product
from draft_service.head_types import HeadWeights
from specserve.block_weights import attend_rows, fused_ops_fit, rms_norm_rows, rotary_rows, serial_kernels
from specserve.llama_ops import apply_rotary, rms_norm, rotary_tables


class HeadCache:
    """One session's keys and values for the head's layer: [kv_heads, capacity, head_dim] buffers, in place.

    ``get_seq_length`` and ``crop`` behave as transformers' ``DynamicCache``'s (``draft_head.truncate_cache``
    serves both); cropping keeps the buffers, so the positions it drops are written over next.
    """

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._length = 0

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (a negative count: drop that many from the end)."""
        keep = self._length + max_length if max_length < 0 else max_length
        self._length = max(0, min(self._length, keep))

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers [kv_heads, capacity, head_dim] (positions past the length unused)."""
        assert self._keys is not None and self._values is not None, "nothing appended yet"
        return self._keys, self._values

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self._keys, self._values) if t is not None)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``keys`` and ``values`` [kv_heads, n, head_dim] after the cached ones; every position's, as views."""
        end = self._length + keys.shape[1]
        if self._keys is None or self._values is None or end > self._keys.shape[1]:
            capacity = max(64, end, 2 * (0 if self._keys is None else self._keys.shape[1]))
            grown_keys = keys.new_empty(keys.shape[0], capacity, keys.shape[2])
            grown_values = values.new_empty(grown_keys.shape)
            if self._keys is not None and self._values is not None:
                grown_keys[:, : self._length] = self._keys[:, : self._length]
                grown_values[:, : self._length] = self._values[:, : self._length]
            self._keys, self._values = grown_keys, grown_values
        self._keys[:, self._length : end] = keys
        self._values[:, self._length : end] = values
        self._length = end
        return self._keys[:, :end], self._values[:, :end]


class HeadStep:
    """The head's fc, decoder layer, final norm and draft logits over rows of one session."""

    def __init__(self, head: HeadWeights) -> None:
        layer: Any = head.body.layers[0]  # transformers' LlamaDecoderLayer
        attn, mlp = layer.self_attn, layer.mlp
        self._fused_from = _sources(head)
        self._head = head
        config = head.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = int(attn.head_dim)
        self.eps = config.rms_norm_eps
        self.scaling = float(attn.scaling)
        self.intermediate = config.intermediate_size
        with torch.no_grad():
            self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        self._qkv_pack = pack_of(self.qkv, None, head.packing)
        self._gate_up_pack = pack_of(self.gate_up, None, head.packing)
        self._o, self._down = attn.o_proj, mlp.down_proj
        self._attn_norm, self._mlp_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self._norm = head.body.norm.weight
        rotary = head.body.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float()
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        # On Q8_0 blocks (fp32) the norms, rotary embeddings and attention run in the block kernel's module too,
        # as the verifier's layers do over the target's blocks: one call each instead of a few dispatches.
        self.fused = head.packing == "blocks" and fused_ops_fit(config.hidden_size, self.head_dim)
        self._rms_norm = rms_norm_rows if self.fused else rms_norm
        self._rotary = rotary_rows if self.fused else apply_rotary

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        # A copied head has copies of its weights, which this step's fused ones are not: it builds its own.
        return None

    def serves(self, head: HeadWeights) -> bool:
        """Whether this step was built over ``head``'s current weights and packing."""
        return self._head is head and _sources(head) == self._fused_from

    def __call__(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache,
        allowed: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (f_t [n, hidden], x_{t+1} [n], position [n]) -> (f^_{t+1} [n, hidden], draft logits [n, vocab]).

        ``allowed`` [n, cached + n] (True: may attend) masks the attention; None: every cached position and
        the new rows causally. ``last_logits_only``: logits of the last row only ([1, vocab]).
        """
        # On the block kernel the head's thread, not the engine's, runs its loops itself: no OpenMP team of its own.
        with serial_kernels() if self._head.packing == "blocks" else contextlib.nullcontext():
            return self._step(features, next_tokens, positions, cache, allowed, last_logits_only)

    def _step(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache,
        allowed: torch.Tensor | None,
        last_logits_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, q, k, v = self._project(features, next_tokens, positions)
        rows = x.shape[0]
        cached = cache.get_seq_length()
        keys, values = cache.append(k.transpose(0, 1), v.transpose(0, 1))
        if self.fused and (allowed is None or bool(allowed[:, :cached].all())):
            # One segment of the new rows over every cached position (the kernel writes their keys and values
            # where ``append`` just did) with their mask among themselves: causal unless ``allowed`` says.
            among = torch.ones(rows, rows, dtype=torch.bool).tril() if allowed is None else allowed[:, cached:].cpu()
            table = torch.tensor([[0, rows, 0, cached]], dtype=torch.int64)
            attended = q.new_zeros(q.shape)
            buffers = cache.buffers()
            attend_rows(q, k, v, buffers[0], buffers[1], table, among.reshape(-1), self.scaling, attended)
            attended = attended[None].transpose(1, 2)
        else:
            if allowed is None and rows > 1:
                allowed = torch.ones(rows, keys.shape[1], dtype=torch.bool, device=keys.device)
                allowed[:, -rows:] = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).tril()
            attended = self._attend(q, keys, values, allowed)
        return self._finish(x, attended, last_logits_only)

    def in_slots(
        self,
        features: torch.Tensor,  # [n, hidden]: f_t
        next_tokens: torch.Tensor,  # [n]: x_{t+1}
        positions: torch.Tensor,  # [n]
        keys: torch.Tensor,  # [kv_heads, slots, head_dim]: a fixed buffer
        values: torch.Tensor,  # [kv_heads, slots, head_dim]
        first_slot: int,  # the rows' keys and values go to slots [first_slot, first_slot + n)
        allowed: torch.Tensor,  # [n, slots] bool: which slots each row attends to (its own included)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over fixed buffers: every shape and address is the same from call to call, so a GPU can
        capture it in a CUDA graph (``head_graphs``). Slots that ``allowed`` masks may hold anything."""
        with serial_kernels() if self._head.packing == "blocks" else contextlib.nullcontext():
            x, q, k, v = self._project(features, next_tokens, positions)
            rows = x.shape[0]
            keys[:, first_slot : first_slot + rows] = k.transpose(0, 1)
            values[:, first_slot : first_slot + rows] = v.transpose(0, 1)
            return self._finish(x, self._attend(q, keys, values, allowed), False)

    def _project(
        self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fc over (f_t, embed(x_{t+1})), and the rows' queries, keys and values [n, heads, head_dim],
        rotated to their positions."""
        head = self._head
        rows = features.shape[0]
        embedded = head.embedding[next_tokens].to(features.dtype)
        x = head.fc(torch.cat([features, embedded], dim=-1))
        qkv = product(self._rms_norm(x, self._attn_norm, self.eps), self.qkv, None, self._qkv_pack)
        heads = self.num_heads + 2 * self.num_kv_heads
        cos, sin = rotary_tables(positions, self._inv_freq, self._rope_scaling, x.dtype)
        if self.fused:
            qk = self._rotary(
                qkv[:, : (heads - self.num_kv_heads) * self.head_dim].view(rows, -1, self.head_dim), cos, sin
            )
            q, k = qk.split([self.num_heads, self.num_kv_heads], 1)
            v = qkv[:, (heads - self.num_kv_heads) * self.head_dim :].view(rows, self.num_kv_heads, self.head_dim)
        else:
            split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
            q, k, v = qkv.view(rows, heads, self.head_dim).split(split, 1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return x, q, k, v

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA of the rows' queries [n, heads, head_dim] over ``keys``/``values`` [kv_heads, m, head_dim]:
        [1, heads, n, head_dim]."""
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=allowed, scale=self.scaling, enable_gqa=True
        )

    def _finish(
        self, x: torch.Tensor, attended: torch.Tensor, last_logits_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, MLP, final norm and draft logits after the attention."""
        rows = x.shape[0]
        x = x + self._o(attended[0].transpose(0, 1).reshape(rows, -1))
        normed = self._rms_norm(x, self._mlp_norm, self.eps)
        gate, up = product(normed, self.gate_up, None, self._gate_up_pack).split(self.intermediate, dim=-1)
        x = x + self._down(F.silu(gate) * up)
        predicted = self._rms_norm(x, self._norm, self.eps)
        scored = predicted[-1:] if last_logits_only else predicted
        return predicted, product(scored, self._head.draft_lm_head, None, self._head.logits_pack)


def _sources(head: HeadWeights) -> tuple[Any, ...]:
    """What a ``HeadStep``'s fused weights were made from: the projections' tensors (storage, dtype, in-place
    version) and the packing."""
    layer: Any = head.body.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    weights = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    return (head.packing, *((m.weight.data_ptr(), m.weight.dtype, m.weight._version) for m in weights))
