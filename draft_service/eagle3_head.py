"""A published EAGLE-3 draft head, read in its published layout and served as the draft_model source.

EAGLE-3 (Li et al. 2025) drafts from three of the target's layers, not its last hidden state alone. Its
checkpoint directory (what vLLM and SGLang load) holds ``config.json`` (a Llama config of one layer, plus
``draft_vocab_size``, optionally ``target_hidden_size``, ``norm_before_residual`` and the layer ids) and the
weights (``model.safetensors`` or ``pytorch_model.bin``):

- ``fc`` [hidden, 3 * target_hidden]: fuses the target's low, mid and high layer states g of position t;
- ``midlayer``: one decoder layer whose attention reads [norm(embed(x_{t+1})); hidden_norm(g)], 2 * hidden
  wide (``input_layernorm`` and ``hidden_norm``), with g (or, with ``norm_before_residual``, hidden_norm(g))
  as the residual; then the usual post-attention norm and SiLU MLP;
- ``norm`` and ``lm_head`` [draft_vocab, hidden]: draft logits over a reduced vocabulary; ``d2t``
  [draft_vocab] is each draft id's offset to its target id (target = draft + d2t[draft]), ``t2d`` [vocab]
  marks the target ids in the draft vocabulary;
- ``embed_tokens`` only in some checkpoints; the others share the target's input embedding.

Drafting deeper feeds the layer's output before ``norm`` back in place of g (its width is ``hidden``, so a
row is told apart from the target's 3 * target_hidden rows by its width, as SGLang does). The layers are the
ids the config names (``eagle_aux_hidden_state_layer_ids``, top level or in ``eagle_config``), read as vLLM
reads them: id k is the residual stream entering the target's decoder layer k; without ids, vLLM's and
SGLang's default (2, L // 2, L - 3) for a target of L layers. The verifier returns those layers' states
concatenated per row (``target_service.layer_features``).

The head answers the same calls as ``draft_head.DraftHead`` (``head_types.ServingHead``), so the proposer
grows its trees the same way. Its drafts are guesses the verifier checks like any other: a head trained for
another target costs acceptance, never exactness; shapes that cannot fit this target are refused at load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draft_service.draft_head import DraftHeadError
from draft_service.head_layer import HeadCache
from draft_service.head_types import DraftHeadConfig, HeadOutput
from specserve.hardware import DtypeChoice, choose_dtype
from specserve.llama_ops import apply_rotary, rms_norm, rotary_tables

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class Eagle3Config:
    """What the head's ``config.json`` says, in the names this module uses."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    norm_before_residual: bool
    layer_ids: tuple[int, ...]  # the config's aux layer ids; empty: the default for the target's depth
    rotary: LlamaConfig  # what the rotary embedding is built from (rope theta and scaling)

    @classmethod
    def parse(cls, raw: Mapping[str, Any], path: Path) -> Eagle3Config:
        """The config at ``path`` (its dict ``raw``); DraftHeadError naming the field that is missing or unusable.

        The speculators layout nests the layer's config in ``transformer_layer_config``: its fields are read
        from there, the EAGLE-3 ones from the top level.
        """
        layer = {**raw, **raw.get("transformer_layer_config", {})}
        eagle = raw.get("eagle_config") or {}
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise DraftHeadError(f"{path}: {layer['num_hidden_layers']} decoder layers; an EAGLE-3 head here has one")
        if not eagle.get("use_aux_hidden_state", True):
            raise DraftHeadError(f"{path}: use_aux_hidden_state is false (an EAGLE-1/2 head), not an EAGLE-3 head")
        if layer.get("attention_bias") or layer.get("mlp_bias"):
            raise DraftHeadError(f"{path}: biases in the decoder layer are not supported")
        if layer.get("hidden_act", "silu") != "silu":
            raise DraftHeadError(f"{path}: hidden_act {layer['hidden_act']!r}; only silu is supported")
        try:
            hidden = int(layer["hidden_size"])
            heads = int(layer["num_attention_heads"])
            vocab = int(layer["vocab_size"])
            ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or ()
            rotary_fields = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
            rotary = LlamaConfig(
                hidden_size=hidden,
                num_attention_heads=heads,
                head_dim=int(layer.get("head_dim") or hidden // heads),
                **{name: layer[name] for name in rotary_fields if layer.get(name) is not None},
            )
            return cls(
                hidden_size=hidden,
                target_hidden_size=int(raw.get("target_hidden_size") or hidden),
                intermediate_size=int(layer["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
                head_dim=int(layer.get("head_dim") or hidden // heads),
                rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                vocab_size=vocab,
                draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                layer_ids=tuple(int(i) for i in ids),
                rotary=rotary,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DraftHeadError(f"{path}: not an EAGLE-3 head config ({type(exc).__name__}: {exc})") from exc

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs the head reads, low to high: the config's ids, or vLLM's and SGLang's
        default for a target of ``target_layers`` decoder layers."""
        if self.layer_ids:
            return self.layer_ids
        return (2, target_layers // 2, target_layers - 3)

    def as_head_config(self) -> DraftHeadConfig:
        """The shape the drafter's shared pieces read (``head_graphs``' buffers)."""
        theta = float((self.rotary.rope_parameters or {}).get("rope_theta") or 10000.0)
        return DraftHeadConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            rope_theta=theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=int(self.rotary.max_position_embeddings),
            draft_vocab_size=self.draft_vocab_size,
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight's shape in the published layout (``embed_tokens`` is optional)."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "fc.weight": (h, 3 * self.target_hidden_size),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (inter, h),
            "midlayer.mlp.up_proj.weight": (inter, h),
            "midlayer.mlp.down_proj.weight": (h, inter),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }


class Eagle3Head(nn.Module):
    """fc(low, mid, high) -> one decoder layer over [embed; features] -> norm -> draft logits (EAGLE-3)."""

    draft_vocab: torch.Tensor
    draft_lm_head: torch.Tensor
    embedding: torch.Tensor

    def __init__(
        self,
        config: Eagle3Config,
        weights: Mapping[str, torch.Tensor],  # the published names (``Eagle3Config.shapes``), checked
        embedding: torch.Tensor,  # [vocab, hidden]: the head's own or the target's input embedding
        draft_vocab: torch.Tensor,  # [draft_vocab]: the target id of each draft logit
        feature_layers: tuple[int, ...],
    ) -> None:
        super().__init__()
        self.eagle = config
        self.config = config.as_head_config()
        self.head_dim = config.head_dim
        self.feature_layers = feature_layers
        self.target_fingerprint = ""
        self.products = "F.linear"
        self.fc = nn.Parameter(weights["fc.weight"].detach().clone(), requires_grad=False)
        fc_bias = weights.get("fc.bias")
        self.fc_bias = None if fc_bias is None else nn.Parameter(fc_bias.detach().clone(), requires_grad=False)
        attn = "midlayer.self_attn."
        qkv = torch.cat([weights[f"{attn}{p}_proj.weight"] for p in "qkv"])
        self.qkv = nn.Parameter(qkv, requires_grad=False)
        self.o = nn.Parameter(weights[f"{attn}o_proj.weight"].detach().clone(), requires_grad=False)
        mlp = "midlayer.mlp."
        gate_up = torch.cat([weights[f"{mlp}gate_proj.weight"], weights[f"{mlp}up_proj.weight"]])
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(weights[f"{mlp}down_proj.weight"].detach().clone(), requires_grad=False)
        norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        self.embed_norm, self.hidden_norm, self.mlp_norm = (
            nn.Parameter(weights[f"midlayer.{n}.weight"].detach().clone(), requires_grad=False) for n in norms
        )
        self.norm = nn.Parameter(weights["norm.weight"].detach().clone(), requires_grad=False)
        self.register_buffer("draft_lm_head", weights["lm_head.weight"].detach().clone(), persistent=False)
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        rotary = LlamaRotaryEmbedding(config=config.rotary)
        # Not a buffer: the frequencies stay fp32 whatever dtype the head computes in (as transformers keeps them).
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.scaling = config.head_dim**-0.5

    def step(
        self,
        features: torch.Tensor,  # [n, 3 * target_hidden]: the target's layers; or [n, hidden]: the head's own
        next_tokens: torch.Tensor,  # [n]: x_{t+1}
        positions: torch.Tensor,  # [n]
        cache: HeadCache,
        allowed: torch.Tensor | None = None,  # [n, cached + n] bool, True: may attend; None: causal
        last_logits_only: bool = False,
    ) -> HeadOutput:
        """Rows of one session: (pre-norm output [1, n, hidden], draft logits [1, n, draft_vocab]); the rows'
        keys and values join ``cache``."""
        device = self.draft_lm_head.device
        features, next_tokens, positions = (t.to(device) for t in (features, next_tokens, positions))
        allowed = None if allowed is None else allowed.to(device)
        residual, q, k, v = self._project(features, next_tokens, positions)
        rows = q.shape[0]
        keys, values = cache.append(k.transpose(0, 1), v.transpose(0, 1))
        if allowed is None and rows > 1:
            allowed = torch.ones(rows, keys.shape[1], dtype=torch.bool, device=device)
            allowed[:, -rows:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        predicted, logits = self._finish(residual, self._attend(q, keys, values, allowed), last_logits_only)
        return HeadOutput(predicted[None], logits[None], cache)

    def step_in_slots(
        self,
        features: torch.Tensor,  # [n, hidden]: the parents' outputs
        next_tokens: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        keys: torch.Tensor,  # [kv_heads, slots, head_dim]: a fixed buffer
        values: torch.Tensor,  # [kv_heads, slots, head_dim]
        first_slot: int,  # the rows' keys and values go to slots [first_slot, first_slot + n)
        allowed: torch.Tensor,  # [n, slots] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` over fixed buffers (``head_graphs``): (outputs [n, hidden], draft logits [n, vocab])."""
        residual, q, k, v = self._project(features, next_tokens, positions)
        rows = q.shape[0]
        keys[:, first_slot : first_slot + rows] = k.transpose(0, 1)
        values[:, first_slot : first_slot + rows] = v.transpose(0, 1)
        return self._finish(residual, self._attend(q, keys, values, allowed), False)

    def unrolled_step(
        self,
        features: torch.Tensor,  # [n, 3 * target_hidden] or [n, hidden], as ``step``
        next_tokens: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        earlier: tuple[torch.Tensor, torch.Tensor] | None,  # keys and values [kv_heads, m, head_dim] before these
        allowed: torch.Tensor,  # [n, m + n] bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``step`` out of place, for training: (outputs [n, hidden], draft logits [n, draft_vocab], keys and
        values with these rows').

        The same projection, attention and MLP as ``step``, so what ``--format eagle3`` trains is what the
        drafter serves; the keys are concatenated rather than written into a cache because autograd cannot
        differentiate through a buffer that a later draft step of the training-time test writes over.
        """
        residual, q, k, v = self._project(features, next_tokens, positions)
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        if earlier is not None:
            keys, values = torch.cat([earlier[0], keys], dim=1), torch.cat([earlier[1], values], dim=1)
        outputs, logits = self._finish(residual, self._attend(q, keys, values, allowed), False)
        return outputs, logits, (keys, values)

    def trainable(self) -> Eagle3Head:
        """This head with gradients on every weight its checkpoint holds, the draft LM head included; the
        shared input embedding stays frozen (EAGLE-3 trains with the target's)."""
        lm_head = self._buffers.pop("draft_lm_head")
        assert lm_head is not None
        self.draft_lm_head = nn.Parameter(lm_head.clone())
        for parameter in self.parameters():
            parameter.requires_grad_(True)
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g: the target's concatenated layers [n, 3 * target_hidden] through ``fc``; the head's own outputs
        [n, hidden] as they are."""
        if features.shape[-1] == self.fc.shape[1]:
            return F.linear(features, self.fc, self.fc_bias)
        if features.shape[-1] != self.eagle.hidden_size:
            raise ValueError(
                f"feature rows of width {features.shape[-1]}: this EAGLE-3 head reads the target's "
                f"{len(self.feature_layers)} layers ({self.fc.shape[1]} wide) or its own outputs "
                f"({self.eagle.hidden_size})"
            )
        return features

    def _project(
        self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual [n, hidden] and the rows' queries, keys and values [n, heads, head_dim], rotated."""
        eps = self.eagle.rms_norm_eps
        g = self.fuse(features.to(self.fc.dtype))
        embedded = rms_norm(self.embedding[next_tokens].to(g.dtype), self.embed_norm, eps)
        normed = rms_norm(g, self.hidden_norm, eps)
        residual = normed if self.eagle.norm_before_residual else g
        qkv = F.linear(torch.cat([embedded, normed], dim=-1), self.qkv)
        rows, heads, kv_heads = g.shape[0], self.eagle.num_attention_heads, self.eagle.num_key_value_heads
        q, k, v = qkv.view(rows, heads + 2 * kv_heads, self.head_dim).split([heads, kv_heads, kv_heads], 1)
        cos, sin = rotary_tables(positions, self.inv_freq, self.rope_scaling, g.dtype)
        return residual, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA of the rows' queries [n, heads, head_dim] over [kv_heads, m, head_dim]: [n, heads * head_dim]."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=allowed, scale=self.scaling, enable_gqa=True
        )
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)

    def _finish(
        self, residual: torch.Tensor, attended: torch.Tensor, last_logits_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, MLP and draft logits: (pre-norm output, logits over the draft vocabulary)."""
        eps = self.eagle.rms_norm_eps
        x = residual + F.linear(attended, self.o)
        gate, up = F.linear(rms_norm(x, self.mlp_norm, eps), self.gate_up).split(self.eagle.intermediate_size, -1)
        x = x + F.linear(F.silu(gate) * up, self.down)
        scored = x[-1:] if last_logits_only else x
        return x, F.linear(rms_norm(scored, self.norm, eps), self.draft_lm_head)


def is_eagle3_dir(path: Path) -> bool:
    """Whether ``path`` is a checkpoint directory (a config.json in it), not one of our head files."""
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_checkpoint(path: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """The config and weights (published names, ``model.``/``layers.0.`` spellings folded) of the directory
    ``path``; DraftHeadError naming the file when one is missing or unreadable."""
    if not path.is_dir():
        raise DraftHeadError(f"no EAGLE-3 head directory at {path}")
    config_file = path / CONFIG_FILE
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError as exc:
        raise DraftHeadError(f"{path} has no {CONFIG_FILE}: not an EAGLE-3 head directory") from exc
    except (OSError, ValueError) as exc:
        raise DraftHeadError(f"{config_file} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise DraftHeadError(f"{config_file} is not a JSON object")
    config = Eagle3Config.parse(raw, config_file)
    weight_file = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if weight_file is None:
        raise DraftHeadError(f"{path} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")
    try:
        if weight_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(weight_file))
        else:
            state = torch.load(weight_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors and torch raise many types for a corrupt file
        raise DraftHeadError(f"{weight_file} is not a readable weight file: {exc}") from exc
    if not isinstance(state, dict):
        raise DraftHeadError(f"{weight_file} is not a state dict")
    return config, {_published_name(name): tensor for name, tensor in state.items()}


def _published_name(name: str) -> str:
    """The published spelling of a weight name: no ``model.`` prefix, the layer as ``midlayer``."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def draft_vocabulary(config: Eagle3Config, weights: Mapping[str, torch.Tensor], where: Path) -> torch.Tensor:
    """The target id of each draft logit (draft id + d2t), checked against ``t2d`` where the file has one."""
    d2t = weights.get("d2t")
    if d2t is None:
        if config.draft_vocab_size != config.vocab_size:
            raise DraftHeadError(f"{where}: a draft vocabulary of {config.draft_vocab_size} needs a d2t map")
        return torch.arange(config.vocab_size)
    if d2t.dim() != 1 or d2t.numel() != config.draft_vocab_size or d2t.is_floating_point():
        raise DraftHeadError(
            f"{where}: d2t is {tuple(d2t.shape)} {d2t.dtype}, expected ({config.draft_vocab_size},) integer offsets"
        )
    targets = torch.arange(config.draft_vocab_size) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= config.vocab_size:
        raise DraftHeadError(f"{where}: d2t maps draft ids outside the vocabulary of {config.vocab_size}")
    if targets.unique().numel() != targets.numel():
        raise DraftHeadError(f"{where}: d2t maps two draft ids to one target id")
    t2d = weights.get("t2d")
    if t2d is not None and not _marks_exactly(t2d, targets, config.vocab_size):
        raise DraftHeadError(f"{where}: t2d does not mark exactly the target ids d2t maps to")
    return targets


def _marks_exactly(t2d: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> bool:
    """Whether ``t2d`` [vocab] is true at ``targets`` and nowhere else."""
    if tuple(t2d.shape) != (vocab_size,):
        return False
    marked = t2d.bool()
    return bool(marked[targets].all()) and int(marked.sum()) == targets.numel()


def check_weights(config: Eagle3Config, weights: Mapping[str, torch.Tensor], where: Path) -> None:
    """DraftHeadError naming every weight that is missing or misshapen (a head for another shape)."""
    problems = []
    for name, shape in config.shapes().items():
        tensor = weights.get(name)
        if tensor is None:
            problems.append(f"{name} missing")
        elif tuple(tensor.shape) != shape:
            problems.append(f"{name} is {tuple(tensor.shape)}, expected {shape}")
    bias = weights.get("fc.bias")
    if bias is not None and tuple(bias.shape) != (config.hidden_size,):
        problems.append(f"fc.bias is {tuple(bias.shape)}, expected ({config.hidden_size},)")
    embed = weights.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        expected = (config.vocab_size, config.hidden_size)
        problems.append(f"embed_tokens.weight is {tuple(embed.shape)}, expected {expected}")
    if problems:
        raise DraftHeadError(f"{where}: " + "; ".join(problems))


def load_eagle3_head(
    path: Path,
    *,
    target_fingerprint: str,
    embedding: torch.Tensor,  # [vocab, hidden]: the target's input embedding
    target_layers: int,  # the target's decoder layers
) -> Eagle3Head:
    """The EAGLE-3 head in the directory ``path`` for this target, in fp32.

    Raises DraftHeadError naming the file and the mismatch: no config or weights, a weight of the wrong shape,
    a vocabulary or hidden size that is not the target's, layer ids outside the target, a d2t/t2d that do not
    describe one draft vocabulary.
    """
    config, weights = read_checkpoint(path)
    where = path / CONFIG_FILE
    vocab, hidden = embedding.shape
    if config.vocab_size != vocab:
        raise DraftHeadError(f"{where}: vocab_size {config.vocab_size}, the target's vocabulary has {vocab} tokens")
    if config.target_hidden_size != hidden:
        raise DraftHeadError(
            f"{where}: made for a target of hidden size {config.target_hidden_size}, this target's is {hidden}"
        )
    if config.hidden_size == 3 * config.target_hidden_size:
        raise DraftHeadError(f"{where}: a head as wide as its fused input cannot tell its own outputs from them")
    layers = config.feature_layers(target_layers)
    if len(layers) != 3 or not all(0 <= layer < target_layers for layer in layers):
        raise DraftHeadError(
            f"{where}: feature layers {list(layers)} are not three of this target's {target_layers} decoder layers"
        )
    check_weights(config, weights, path)
    own = weights.get("embed_tokens.weight")
    if own is None and config.hidden_size != hidden:
        raise DraftHeadError(f"{path}: no embed_tokens, and the head's hidden size is not the target's to share it")
    draft_vocab = draft_vocabulary(config, weights, path)
    floats = {name: t.float() for name, t in weights.items() if t.is_floating_point()}
    table = (own if own is not None else embedding).float()
    head = Eagle3Head(config, floats, table, draft_vocab, layers)
    head.target_fingerprint = target_fingerprint
    return head.eval()


def eagle3_in_serving_dtype(
    head: Eagle3Head, requested: str = "auto", device: str | torch.device = "cpu"
) -> tuple[Eagle3Head, DtypeChoice]:
    """``head`` on ``device`` in the dtype the drafter computes in (``--head-dtype``), as ``in_serving_dtype``
    does for our own head; its products stay F.linear (no packed kernels for this layout yet)."""
    choice = choose_dtype(requested, str(device))
    head = head.to(device=device, dtype=getattr(torch, choice.dtype))
    head.inv_freq = head.inv_freq.to(device)
    return head, choice
