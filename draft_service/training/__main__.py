"""``make train-draft``: distil the target into a draft head, train it, evaluate it, write the weights.

    python -m draft_service.training [--prompts N] [--max-minutes M] ...

Stages, each resumable: (1) the target answers the training prompts greedily
and its features are stored in shards under --data-dir; (2) the head trains
with a checkpoint in --data-dir; (3) the head is evaluated on held-out
prompts, and the weights (bfloat16) and a metrics file are written next to
--out. A GPU is used when one is present.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from coordinator.prompts import eos_token_ids
from draft_service.draft_head import truncate_cache
from draft_service.training.distill_data import DistillSettings, generate_shards, load_shards
from draft_service.training.evaluate import chain_acceptance, draft_step_ms
from draft_service.training.prompts import training_prompts
from draft_service.training.train import TrainSettings, train
from specserve.model_loading import (
    default_cache_root,
    load_generation_config,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)

DEFAULT_OUT = Path("draft_service/weights/smollm2-draft-head.pt")
BENCH_QUESTIONS = Path("bench/data/spec_bench.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draft_service.training", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=768, help="training prompts (5%% more are held out)")
    parser.add_argument("--max-new-tokens", type=int, default=DistillSettings.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=DistillSettings.batch_size, help="distillation batch")
    parser.add_argument("--max-minutes", type=float, default=TrainSettings.max_minutes, help="training budget")
    parser.add_argument("--epochs", type=int, default=TrainSettings.epochs)
    parser.add_argument("--draft-vocab", type=int, default=TrainSettings.draft_vocab_size)
    parser.add_argument("--intermediate-size", type=int, default=1024, help="the head's MLP width")
    parser.add_argument("--data-dir", type=Path, default=default_cache_root() / "draft-training")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--exclude", type=Path, default=BENCH_QUESTIONS, help="questions never trained on")
    parser.add_argument("--torch-threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    return parser.parse_args(argv)


def excluded_questions(path: Path) -> list[str]:
    """Every turn of every benchmark question."""
    if not path.exists():
        raise SystemExit(f"error: {path} (the benchmark questions to exclude) is missing")
    turns: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            turns += json.loads(line)["turns"]
    return turns


@torch.inference_mode()
def target_step_ms(model: Any, context: int = 256, repeats: int = 15) -> float:
    """Median time of one target forward of one token on top of ``context`` cached tokens."""
    cache = DynamicCache()
    model(input_ids=torch.arange(context)[None] + 100, past_key_values=cache, use_cache=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        times.append((time.perf_counter() - start) * 1000)
        truncate_cache(cache, context)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    source = materialize(resolve_model(args.model), default_cache_root())
    tokenizer = load_tokenizer(source)
    model = load_model(source, device=device)
    eos = eos_token_ids(tokenizer, load_generation_config(source))
    fingerprint = vocab_fingerprint(tokenizer)
    held_out = max(1, args.prompts // 20)
    prompts = training_prompts(args.prompts + held_out, excluded_questions(args.exclude))
    distill = DistillSettings(args.max_new_tokens, args.batch_size)
    data_dir = args.data_dir / f"{fingerprint}-{args.max_new_tokens}"
    # Held-out prompts come last, in shards of their own.
    train_paths = generate_shards(
        model, tokenizer, prompts[: args.prompts], eos, data_dir / "train", distill, args.progress
    )
    eval_paths = generate_shards(
        model, tokenizer, prompts[args.prompts :], eos, data_dir / "eval", distill, args.progress
    )
    distill_minutes = (time.monotonic() - started) / 60
    model = model.to("cpu")
    sequences = load_shards(train_paths)
    settings = TrainSettings(
        draft_vocab_size=args.draft_vocab,
        intermediate_size=args.intermediate_size,
        epochs=args.epochs,
        max_minutes=args.max_minutes,
    )
    embedding = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    head, report = train(sequences, embedding, lm_head, model.config, data_dir / "head", settings, args.progress)
    evaluation = chain_acceptance(head, load_shards(eval_paths))
    draft_ms, target_ms = draft_step_ms(head), target_step_ms(model)
    metrics = {
        "target": args.model,
        "target_fingerprint": fingerprint,
        "data": {
            "train_prompts": args.prompts,
            "held_out_prompts": held_out,
            "train_tokens": sum(int(s["tokens"].shape[0]) for s in sequences),
            "response_tokens": sum(int(s["tokens"].shape[0]) - int(s["prompt_length"]) for s in sequences),
            "max_new_tokens": args.max_new_tokens,
            "distill_minutes": round(distill_minutes, 1),
        },
        "training": {**asdict(settings), **asdict(report)},
        "held_out_chain": {**asdict(evaluation), "estimated_tau": evaluation.estimated_tau},
        "cost": {
            "draft_step_ms": round(draft_ms, 2),
            "target_step_ms": round(target_ms, 2),
            "ratio": round(draft_ms / target_ms, 3),
        },
        "total_minutes": round((time.monotonic() - started) / 60, 1),
    }
    head.save(args.out, target_fingerprint=fingerprint, metadata=metrics)
    args.out.with_suffix(".json").write_text(json.dumps(metrics, indent=1) + "\n")
    size_mb = args.out.stat().st_size / 2**20
    print(json.dumps(metrics, indent=1))
    print(f"wrote {args.out} ({size_mb:.1f} MB) and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
