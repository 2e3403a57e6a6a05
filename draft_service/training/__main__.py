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
from draft_service.config import DEFAULT_DRAFT_HEAD
from draft_service.draft_head import DraftHeadConfig, truncate_cache
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

BENCH_QUESTIONS = Path("bench/data/spec_bench.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draft_service.training", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=720, help="training prompts (5%% more are held out)")
    parser.add_argument("--max-new-tokens", type=int, default=DistillSettings.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=DistillSettings.batch_size, help="distillation batch")
    parser.add_argument("--max-minutes", type=float, default=TrainSettings.max_minutes, help="training budget")
    parser.add_argument("--epochs", type=int, default=TrainSettings.epochs)
    parser.add_argument("--draft-vocab", type=int, default=TrainSettings.draft_vocab_size)
    parser.add_argument("--intermediate-size", type=int, default=1024, help="the head's MLP width")
    parser.add_argument("--data-dir", type=Path, default=default_cache_root() / "draft-training")
    parser.add_argument("--out", type=Path, default=DEFAULT_DRAFT_HEAD)
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


def model_card(m: dict[str, Any], config: DraftHeadConfig, out: Path) -> str:
    data, training, chain, cost = m["data"], m["training"], m["held_out_chain"], m["cost"]
    reached = ", ".join(f"{p:.2f}" for p in chain["accepted_at_depth"])
    return f"""# Draft head for SmolLM2-135M-Instruct

`{out.name}`: an EAGLE-style draft head (one Llama decoder layer over
fc(concat(f_t, embed(x_{{t+1}}))), predicting the target's next last-layer
feature; draft logits from the target's own LM head rows for a reduced
vocabulary of {config.draft_vocab_size} tokens). Hidden size {config.hidden_size},
MLP width {config.intermediate_size}, stored in bfloat16. It reads the target's
embedding and LM head at load time and only serves the target whose vocabulary
fingerprint it records (`{m["target_fingerprint"]}`).

## Data

Self-distillation (Seq-KD): the target's own greedy answers (at most
{data["max_new_tokens"]} new tokens) to {data["train_prompts"]} prompts built from
`draft_service/training/prompts.py` (our task templates x topics; every Spec-Bench
turn is excluded), {data["train_tokens"]} positions in all, {data["response_tokens"]}
of them response tokens. Distillation took {data["distill_minutes"]} min.
{data["held_out_prompts"]} further prompts are held out for evaluation.

## Training

{training["steps"]} steps ({training["epochs_done"]:.2f} epochs) in {training["minutes"]:.1f} min,
AdamW at {training["learning_rate"]}, batch {training["batch_size"]} windows of {training["window"]}
positions, loss = smooth-L1(feature) + {training["ce_weight"]} x cross-entropy(target's greedy
token), feature noise {training["feature_noise"]}. Final training loss {training["final_loss"]:.3f}
(feature {training["final_feature_loss"]:.3f}), depth-1 token accuracy on the last batch
{training["final_token_accuracy"]:.2f}.

## Held-out acceptance (chains from the head alone)

From {chain["positions"]} positions of held-out answers, drafting chains of
{chain["depth"]} tokens from the target's true feature and feeding its own
predictions back: fraction reaching each depth {reached}; mean accepted
{chain["mean_accepted"]:.2f} tokens, so tau ~ {chain["mean_accepted"] + 1:.2f} for
greedy chains of that depth (trees do better; see bench/results for served figures).

## Cost

One draft step {cost["draft_step_ms"]} ms against one target forward of
{cost["target_step_ms"]} ms on the same machine and context (ratio {cost["ratio"]}).

Reproduce: `make train-draft` (total {m["total_minutes"]} min here).
"""


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
    (args.out.parent / "MODEL_CARD.md").write_text(model_card(metrics, head.config, args.out))
    size_mb = args.out.stat().st_size / 2**20
    print(json.dumps(metrics, indent=1))
    print(f"wrote {args.out} ({size_mb:.1f} MB) and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
