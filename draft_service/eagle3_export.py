"""Our draft head written in the published EAGLE-3 layout (``eagle3_head``): a checkpoint vLLM, SGLang or this
drafter load as an EAGLE-3 head.

    python -m draft_service.eagle3_export --head draft_service/weights/smollm2-draft-head.pt --out DIR

What carries over exactly, bit for bit in the dtype written (fp32 by default): the draft vocabulary (``d2t``
and ``t2d``), the draft logits' weight (the target's LM head rows of that vocabulary, ``lm_head``), the
decoder layer's output projection, post-attention norm and MLP, the final norm, and the layer's shape and
rotary settings. A unit test holds these to our head's.

What cannot carry over, because the two heads are different functions (so an exported head drafts other,
usually worse, tokens than ours, until it is trained in its own form):

- **Inputs.** Ours reads the target's final hidden state after its norm; EAGLE-3's ``fc`` reads the inputs of
  three decoder layers, before any norm, and no layer's input is the normed final state.
- **Where the token enters.** Ours fuses features and token first, x = fc([f; e]), and its attention reads
  RMSNorm(x) with x as the residual; EAGLE-3 normalises the token and the features apart, its attention reads
  [norm(e); norm(g)] and its residual is g alone. RMSNorm of a sum is not a function of the parts' norms.
- **Deeper steps.** Ours feeds its predicted (normed) feature back through ``fc``; EAGLE-3 feeds its layer's
  pre-norm output back past ``fc``.

So the rest is a linearisation, a starting point for training rather than a copy: ``fc`` maps the high layer
with our fc's feature half and the low and mid layers with zeros; the attention's feature half is our
projections with our input norm's weight as ``hidden_norm``, and its token half our projections times our
fc's token half, with a unit ``input_layernorm``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draft_service.config import DEFAULT_DRAFT_HEAD
from draft_service.draft_head import DraftHead, DraftHeadError, load_draft_head
from draft_service.eagle3_head import CONFIG_FILE
from specserve.model_loading import (
    default_cache_root,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)


def default_layers(target_layers: int) -> list[int]:
    """vLLM's and SGLang's default low, mid and high layers for a target of ``target_layers`` layers."""
    return [2, target_layers // 2, target_layers - 3]


def eagle3_config(head: DraftHead, target_layers: int, vocab_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the exported head: a Llama config of one layer with the EAGLE-3 fields."""
    c = head.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": head.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": default_layers(target_layers),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def eagle3_weights(head: DraftHead, vocab_size: int) -> dict[str, torch.Tensor]:
    """The exported weights under their published names (the module docstring says which are exact)."""
    layer: Any = head.body.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    hidden = head.config.hidden_size
    fc = head.fc.weight.detach()
    feature_half, token_half = fc[:, :hidden], fc[:, hidden:]  # x = fc([f; e])
    draft_vocab = head.draft_vocab.cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_vocab] = True
    weights = {
        "fc.weight": torch.cat([torch.zeros(hidden, 2 * hidden), feature_half.cpu()], dim=1),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": layer.input_layernorm.weight.detach(),
        "midlayer.self_attn.o_proj.weight": attn.o_proj.weight.detach(),
        "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach(),
        "midlayer.mlp.gate_proj.weight": mlp.gate_proj.weight.detach(),
        "midlayer.mlp.up_proj.weight": mlp.up_proj.weight.detach(),
        "midlayer.mlp.down_proj.weight": mlp.down_proj.weight.detach(),
        "norm.weight": head.body.norm.weight.detach(),
        "lm_head.weight": head.draft_lm_head.detach(),
        "d2t": draft_vocab - torch.arange(draft_vocab.numel()),
        "t2d": t2d,
    }
    for name in ("q", "k", "v"):
        projection = getattr(attn, f"{name}_proj").weight.detach()
        scaled = projection * layer.input_layernorm.weight.detach()  # our input norm's weight, folded in
        weights[f"midlayer.self_attn.{name}_proj.weight"] = torch.cat([scaled @ token_half, projection], dim=1)
    return weights


def export_eagle3(head: DraftHead, out: Path, target_layers: int, vocab_size: int, dtype: torch.dtype) -> Path:
    """Write ``head`` to the directory ``out`` in the EAGLE-3 layout (config.json, model.safetensors)."""
    weights = {
        name: (t.to(dtype) if t.is_floating_point() else t).cpu().contiguous()
        for name, t in eagle3_weights(head, vocab_size).items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    config = eagle3_config(head, target_layers, vocab_size, dtype)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draft_service.eagle3_export", description=__doc__.split("\n")[0])
    parser.add_argument("--head", type=Path, default=DEFAULT_DRAFT_HEAD, help="our head's weight file")
    parser.add_argument("--model", default="smollm2", help="the target the head was trained for")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write the EAGLE-3 head to")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args(argv)
    source = materialize(resolve_model(args.model), default_cache_root())
    target = load_model(source)
    try:
        head, _ = load_draft_head(
            args.head,
            target_fingerprint=vocab_fingerprint(load_tokenizer(source)),
            embedding=target.get_input_embeddings().weight.detach(),
            lm_head=target.get_output_embeddings().weight.detach(),
        )
    except DraftHeadError as exc:
        print(f"eagle3_export: {exc}", file=sys.stderr)
        return 1
    vocab_size = int(target.get_input_embeddings().weight.shape[0])
    out = export_eagle3(head, args.out, int(target.config.num_hidden_layers), vocab_size, getattr(torch, args.dtype))
    print(f"wrote the EAGLE-3 layout of {args.head} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
