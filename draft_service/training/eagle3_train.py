"""Training a draft head natively in the EAGLE-3 layout (``python -m draft_service.training --format eagle3``).

The head trained is ``eagle3_head.Eagle3Head`` itself, with gradients on (``Eagle3Head.trainable``), and its
forward is the one the drafter serves (``Eagle3Head.unrolled_step``: the same projection, attention and MLP as
``step``), so the weights written are read back by ``load_eagle3_head`` into the function that was trained.
Shapes follow the published heads: hidden size, heads and rotary settings of one target layer, ``fc`` over the
target's low, mid and high layer inputs (the rule ``eagle3_head`` reads with no ids: vLLM's and SGLang's
default, written into the config so no reader has to guess), the target's input embedding shared and frozen,
a draft vocabulary of the target's most frequent greedy tokens (``d2t``/``t2d``), its LM head started from the
target's rows for those tokens.

Data: distillation shards whose features are those layers' inputs concatenated (``DistillSettings.layers``);
labels: the target's greedy token. Loss: cross-entropy over the draft vocabulary only (EAGLE-3 dropped
EAGLE's feature regression: its fused input is not a feature it could predict), averaged over the draft steps
of the training-time test: step k > 1 at position s reads the head's own pre-norm output of step k - 1 at
s - 1, attending as ``train.unroll_mask`` says, which is how the drafter chains it. ``--unroll-steps 1`` is
teacher forcing. Checkpoints and resumption as ``train.train``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draft_service.eagle3_head import CONFIG_FILE, Eagle3Config, Eagle3Head
from draft_service.training.loop import optimise, read_checkpoint
from draft_service.training.settings import TrainReport, TrainSettings
from draft_service.training.train import (
    IGNORE,
    build_draft_vocab,
    label_index_for,
    unroll_mask,
    windows,
)

WEIGHT_FILE = "model.safetensors"
ROTARY_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def feature_layers(target_config: Any) -> tuple[int, ...]:
    """The target layers a new head reads: (2, L // 2, L - 3) for L decoder layers, the default vLLM, SGLang and
    ``eagle3_head`` read; ValueError for a target too shallow to have three such layers."""
    count = int(target_config.num_hidden_layers)
    layers = (2, count // 2, count - 3)
    if count < 4:
        raise ValueError(f"an EAGLE-3 head reads layers {layers}: a target of {count} decoder layers has no such")
    return layers


def head_config(
    target_config: Any, draft_vocab_size: int, intermediate_size: int, layers: Sequence[int]
) -> dict[str, Any]:
    """``config.json`` of a head for ``target_config``: a Llama config of one of its layers, with the EAGLE-3
    fields (its layer ids written out)."""
    target = target_config.to_dict()
    hidden, heads = int(target["hidden_size"]), int(target["num_attention_heads"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": intermediate_size or int(target["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target.get("num_key_value_heads") or heads),
        "head_dim": int(target.get("head_dim") or hidden // heads),
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(target["vocab_size"]),
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(layers),
        **{name: target[name] for name in ROTARY_FIELDS if target.get(name) is not None},
    }


def initial_weights(
    config: Eagle3Config, lm_head: torch.Tensor, draft_vocab: torch.Tensor, seed: int
) -> dict[str, torch.Tensor]:
    """A fresh head's weights under their published names: projections N(0, 1 / fan-in) (variance-preserving),
    unit norms, and the target's LM head rows of the draft vocabulary as the draft LM head."""
    generator = torch.Generator().manual_seed(seed)

    def projection(rows: int, fan_in: int) -> torch.Tensor:
        return torch.randn(rows, fan_in, generator=generator) * fan_in**-0.5

    weights = {
        name: (torch.ones(shape) if len(shape) == 1 else projection(*shape)) for name, shape in config.shapes().items()
    }
    weights["lm_head.weight"] = lm_head[draft_vocab].detach().float().clone()
    return weights


def new_head(
    target_config: Any,
    embedding: torch.Tensor,  # [vocab, hidden]: the target's input embedding
    lm_head: torch.Tensor,  # [vocab, hidden]: the target's LM head
    draft_vocab: torch.Tensor,  # [draft_vocab]: target ids
    intermediate_size: int,
    seed: int = 0,
) -> tuple[Eagle3Head, dict[str, Any]]:
    """A trainable head for ``target_config`` and its ``config.json``."""
    layers = feature_layers(target_config)
    raw = head_config(target_config, int(draft_vocab.numel()), intermediate_size, layers)
    config = Eagle3Config.parse(raw, Path(CONFIG_FILE))
    weights = initial_weights(config, lm_head, draft_vocab, seed)
    head = Eagle3Head(config, weights, embedding.detach().float(), draft_vocab, layers)
    return head.trainable(), raw


def published_weights(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """``head``'s weights under the published names (``Eagle3Config.shapes``), ``d2t`` and ``t2d`` with them."""
    c = head.eagle
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    q_proj, k_proj, v_proj = head.qkv.detach().split([q, kv, kv])
    gate, up = head.gate_up.detach().split(c.intermediate_size)
    draft_vocab = head.draft_vocab.detach().cpu()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[draft_vocab] = True
    weights = {
        "fc.weight": head.fc.detach(),
        "midlayer.input_layernorm.weight": head.embed_norm.detach(),
        "midlayer.hidden_norm.weight": head.hidden_norm.detach(),
        "midlayer.self_attn.q_proj.weight": q_proj,
        "midlayer.self_attn.k_proj.weight": k_proj,
        "midlayer.self_attn.v_proj.weight": v_proj,
        "midlayer.self_attn.o_proj.weight": head.o.detach(),
        "midlayer.post_attention_layernorm.weight": head.mlp_norm.detach(),
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": head.down.detach(),
        "norm.weight": head.norm.detach(),
        "lm_head.weight": head.draft_lm_head.detach(),
        "d2t": draft_vocab - torch.arange(draft_vocab.numel()),
        "t2d": t2d,
    }
    if head.fc_bias is not None:
        weights["fc.bias"] = head.fc_bias.detach()
    return weights


def save_eagle3(head: Eagle3Head, config: dict[str, Any], out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``head`` as a checkpoint directory ``out`` (config.json, model.safetensors), floats in ``dtype``;
    the weight file is written under another name first and renamed, so a reader never sees half of one."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        name: (t.to(dtype) if t.is_floating_point() else t).cpu().contiguous()
        for name, t in published_weights(head).items()
    }
    partial = out / (WEIGHT_FILE + ".tmp")
    save_file(weights, str(partial))
    partial.replace(out / WEIGHT_FILE)
    written = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG_FILE).write_text(json.dumps(written, indent=2) + "\n")
    return out


def unrolled_logits(
    head: Eagle3Head, features: torch.Tensor, next_tokens: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Draft logits [m, draft_vocab] at every position of one window for draft steps 1..``steps``.

    Step 1 reads the target's layers (causal attention); step k > 1 at position s reads step k - 1's output
    at s - 1 (zeros at s = 0, never scored) with the same next token, attending over every earlier step's
    keys as ``unroll_mask`` says: the head's k-th chained draft from the true context up to s - k + 1.
    """
    m, device = features.shape[0], features.device
    positions = torch.arange(m, device=device)
    causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    outputs, logits, cache = head.unrolled_step(features, next_tokens, positions, None, causal)
    result = [logits]
    for step in range(2, steps + 1):
        own = torch.cat([torch.zeros_like(outputs[:1]), outputs[:-1]])
        allowed = unroll_mask(m, step).to(device)
        outputs, logits, cache = head.unrolled_step(own, next_tokens, positions, cache, allowed)
        result.append(logits)
    return result


def batch_losses(
    head: Eagle3Head,
    sequences: Sequence[dict[str, Any]],
    spans: Sequence[tuple[int, int]],
    settings: TrainSettings,
    label_index: torch.Tensor,
    device: torch.device,
) -> dict[str, Any]:
    """Cross-entropy over the windows ``spans``, averaged over positions and then draft steps; each step's
    token accuracy."""
    steps = settings.unroll_steps
    summed: list[torch.Tensor] = [torch.zeros((), device=device) for _ in range(steps)]
    counted, right = [0] * steps, [0] * steps
    for index, start in spans:
        seq = sequences[index]
        end = min(int(seq["tokens"].shape[0]), start + settings.window + 1)
        features = seq["features"][start : end - 1].to(device, torch.float32)
        next_tokens = seq["tokens"][start + 1 : end].to(device, torch.long)
        labels = label_index[seq["argmax"][start + 1 : end].long()].to(device)
        for step, logits in enumerate(unrolled_logits(head, features, next_tokens, steps)):
            scored = labels[step:]
            known = scored != IGNORE
            summed[step] = summed[step] + F.cross_entropy(
                logits[step:].float(), scored, ignore_index=IGNORE, reduction="sum"
            )
            counted[step] += int(known.sum())
            right[step] += int((logits[step:].argmax(-1)[known] == scored[known]).sum())
    per_step = [total / max(1, count) for total, count in zip(summed, counted, strict=True)]
    return {
        "loss": torch.stack(per_step).mean(),
        "accuracy_by_step": [r / max(1, c) for r, c in zip(right, counted, strict=True)],
    }


def train_eagle3(
    sequences: Sequence[dict[str, Any]],
    embedding: torch.Tensor,
    lm_head: torch.Tensor,
    target_config: Any,
    out_dir: Path,
    settings: TrainSettings,
    device: str = "cpu",
    progress: bool | None = None,
) -> tuple[Eagle3Head, dict[str, Any], TrainReport]:
    """Train (or continue training) an EAGLE-3 head on ``device``; (head on the CPU in fp32, its config.json,
    report). The checkpoint lives in ``out_dir``; ``settings.init_from`` is not supported here."""
    if settings.init_from:
        raise ValueError("--init-from starts from one of our head files; it cannot seed an EAGLE-3 head")
    vocab_size = int(embedding.shape[0])
    torch.manual_seed(settings.seed)
    checkpoint = read_checkpoint(out_dir, settings)
    if checkpoint is not None:
        draft_vocab = checkpoint["draft_vocab"]
    else:
        draft_vocab = build_draft_vocab(sequences, settings.draft_vocab_size, vocab_size)
    head, config = new_head(target_config, embedding, lm_head, draft_vocab, settings.intermediate_size, settings.seed)
    where = torch.device(device)
    head = head.to(where)
    head.inv_freq = head.inv_freq.to(where)
    label_index = label_index_for(draft_vocab, vocab_size)

    def batch_loss(chosen: Sequence[tuple[int, int]]) -> dict[str, Any]:
        return batch_losses(head, sequences, chosen, settings, label_index, where)

    spans = windows(sequences, settings.window)
    result = optimise(
        head, batch_loss, spans, settings, out_dir, checkpoint, draft_vocab, where, progress, desc="train eagle3"
    )
    head = head.to("cpu").eval()
    head.inv_freq = head.inv_freq.to("cpu")
    last = result.last
    by_step = list(last["accuracy_by_step"])
    report = TrainReport(
        steps=result.steps,
        epochs_done=result.steps / result.steps_per_epoch,
        minutes=result.minutes,
        final_loss=float(last["loss"].detach()),
        final_feature_loss=0.0,  # no feature loss in EAGLE-3
        final_token_accuracy=by_step[0] if by_step else math.nan,
        final_accuracy_by_step=by_step,
        resumed_from_step=result.resumed_from,
    )
    return head, config, report


@torch.inference_mode()
def top1_agreement(head: Eagle3Head, sequences: Sequence[dict[str, Any]]) -> float:
    """Fraction of answer positions where the head's first draft, teacher-forced, is the target's greedy token."""
    agree = total = 0
    for seq in sequences:
        start, n = int(seq["prompt_length"]) - 1, int(seq["tokens"].shape[0])
        if n - 1 <= start:
            continue
        features = seq["features"][: n - 1].float()
        logits = unrolled_logits(head, features, seq["tokens"][1:].long(), 1)[0]
        drafts = head.draft_vocab[logits.argmax(dim=-1)]
        agree += int((drafts[start:] == seq["argmax"][start + 1 :].long()).sum())
        total += n - 1 - start
    return agree / max(1, total)
