"""How fast this machine distils and trains, for sizing a run (docs/draft-head.md scales it to an 8B target).

    python -m draft_service.training.throughput --target tiny|smollm2 [--device D] [--seconds S]

Distils random prompts with ``distil_batch`` for both formats (the EAGLE-3 one keeps three layers' inputs),
then trains each head for ``--seconds`` (``train_eagle3`` teacher-forced and with 3 draft steps, ``train``
teacher-forced; window 384, batch 8) and prints the rates as JSON. The rates are the machine's at that moment:
on a shared machine they move with its load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_service.training.distill_data import distil_batch
from draft_service.training.eagle3_train import feature_layers, train_eagle3
from draft_service.training.settings import TrainSettings
from draft_service.training.train import train
from specserve.model_loading import default_cache_root, load_model, materialize, resolve_model


def tiny_target() -> Any:
    """A random 6-layer Llama of hidden size 64 (the unit tests' shape)."""
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draft_service.training.throughput", description=__doc__)
    parser.add_argument("--target", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=20.0, help="training time per head")
    args = parser.parse_args(argv)
    if args.target == "tiny":
        model = tiny_target().to(args.device)
        rows, new, prompt_length, draft_vocab, width = 64, 64, 32, 32, 96
    else:
        model = load_model(materialize(resolve_model("smollm2"), default_cache_root()), device=args.device)
        rows, new, prompt_length, draft_vocab, width = 16, 32, 64, 8192, 0
    config = model.config
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, config.vocab_size - 10, (prompt_length,), generator=generator).tolist() for _ in range(rows)
    ]
    figures: dict[str, Any] = {"target": args.target, "params": sum(p.numel() for p in model.parameters())}
    data: dict[str, list[dict[str, Any]]] = {}
    for name, layers in (("eagle3", feature_layers(config)), ("specserve", ())):
        started = time.perf_counter()
        data[name] = distil_batch(model, prompts, new, frozenset(), 0, layers=layers)
        seconds = time.perf_counter() - started
        answer = sum(int(row["tokens"].shape[0]) - int(row["prompt_length"]) + 1 for row in data[name])
        figures[f"distil_{name}_answer_tok_s"] = round(answer / seconds, 1)
    embedding = model.get_input_embeddings().weight.detach().float().cpu()
    lm_head = model.get_output_embeddings().weight.detach().float().cpu()
    positions = 8 * (prompt_length + new)  # a batch: 8 windows, each a whole (short) sequence
    for unroll in (1, 3):
        settings = TrainSettings(
            draft_vocab_size=draft_vocab,
            intermediate_size=width,
            epochs=10**6,
            unroll_steps=unroll,
            max_minutes=args.seconds / 60,
            checkpoint_every=10**9,
        )
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            head, _, report = train_eagle3(
                data["eagle3"], embedding, lm_head, config, Path(scratch), settings, args.device, progress=False
            )
            rate = report.steps / (time.perf_counter() - started)
        figures[f"train_eagle3_unroll{unroll}_steps_s"] = round(rate, 3)
        figures[f"train_eagle3_unroll{unroll}_positions_s"] = round(rate * positions, 1)
        figures["eagle3_head_params"] = sum(p.numel() for p in head.parameters())
    settings = TrainSettings(
        draft_vocab_size=draft_vocab,
        intermediate_size=width or 1024,
        epochs=10**6,
        max_minutes=args.seconds / 60,
        checkpoint_every=10**9,
    )
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        _, report = train(data["specserve"], embedding, lm_head, config, Path(scratch), settings, False, args.device)
        figures["train_specserve_unroll1_steps_s"] = round(report.steps / (time.perf_counter() - started), 3)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
