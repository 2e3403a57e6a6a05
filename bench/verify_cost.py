"""How much a verify of n tokens costs next to plain decoding: ``python -m bench.verify_cost``.

c(n) is the time of one ``Verifier.verify`` that scores n tokens on top of a
512-token context: the pending token plus a chain of n - 1 draft nodes (n = 1
is plain decoding). Speculation pays only where tau exceeds c(n)/c(1) for the
tree size it sends, so this curve sizes the drafts.

Each n has its own session, prefilled once; the repetitions are interleaved
over the sizes so that drift and the context's slow growth (each verify
commits at least its bonus token) hit every n alike.

By default it measures the packaged target on this machine's CPU. ``--shape``
builds a randomly initialised model of a Llama shape instead (random weights
are fine for cost curves), e.g. ``--shape llama-3.1-8b --dtype bfloat16
--device cuda``; ``--num-layers`` truncates it for a quick check on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.verifier import Verifier

from . import machine

SIZES = (1, 2, 4, 8, 16, 32, 64)

# Published configurations (attention and MLP widths are what cost depends on; RoPE scaling is not modelled).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    "llama-3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.verify_cost", description="verifier forward cost c(n)/c(1)")
    parser.add_argument("--model", default="smollm2", help="the packaged target or a model path (without --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a randomly initialised model of this shape instead")
    parser.add_argument("--num-layers", type=int, default=0, help="keep only this many layers of --shape (0: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--context", type=int, default=512, help="context tokens in the cache before each verify")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tokens scored per verify")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per size (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size first")
    parser.add_argument(
        "--torch-threads", type=int, default=len(os.sched_getaffinity(0)), help="default: the CPUs available"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not args.sizes or args.sizes[0] < 1:
        parser.error("--sizes must be positive integers")
    if args.shape is None and args.num_layers:
        parser.error("--num-layers applies to --shape models only")
    return args


def random_model(shape: str, num_layers: int, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    values = dict(SHAPES[shape])
    if num_layers:
        values["num_hidden_layers"] = num_layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**values), dtype=dtype)
    return model.eval()


def load_target(args: argparse.Namespace) -> tuple[Any, str]:
    """The model to measure and its label (also the output file stem)."""
    dtype = getattr(torch, args.dtype)
    if args.shape:
        layers = f"-{args.num_layers}layers" if args.num_layers else ""
        return random_model(args.shape, args.num_layers, dtype, args.device), f"{args.shape}{layers}"
    from specserve.model_loading import default_cache_root, load_model, materialize, resolve_model

    source = materialize(resolve_model(args.model), default_cache_root())
    return load_model(source, device=args.device, dtype=args.dtype), Path(args.model).name


DRAFT_SHAPES = ("chain", "tree")


def draft_tree(shape: str, tokens: list[int]) -> TokenTree:
    """A chain, or a branching tree of the same size (binary-heap layout: node i's parent is (i - 1) // 2)."""
    if shape == "chain":
        return TokenTree.chain(tokens)
    return TokenTree(tuple(tokens), tuple(-1 if i == 0 else (i - 1) // 2 for i in range(len(tokens))))


def measure(
    verifier: Verifier, context: int, sizes: Sequence[int], reps: int, warmup: int
) -> tuple[dict[str, dict[int, list[float]]], int]:
    """Seconds of each timed verify per shape and size, and the longest context any verify ran on.

    Shapes and sizes are interleaved within every repetition (in a rotating
    order), so drift of the machine hits all of them alike.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = verifier.vocab_size
    # The context plus the pending token: the cache then holds exactly `context` tokens.
    prompt = torch.randint(0, vocab, (context + 1,), generator=generator).tolist()
    cases = [(shape, n) for n in sizes for shape in DRAFT_SHAPES]
    committed: dict[tuple[str, int], int] = {}
    for shape, n in cases:
        verifier.prefill(f"{shape}{n}", prompt, SamplingParams())
        committed[(shape, n)] = len(prompt)
    cuda = verifier.device.type == "cuda"
    times: dict[str, dict[int, list[float]]] = {shape: {n: [] for n in sizes} for shape in DRAFT_SHAPES}
    longest = 0
    for rep in range(warmup + reps):
        order = [*cases[rep % len(cases) :], *cases[: rep % len(cases)]]
        for shape, n in order:
            # Random drafts are rejected (almost surely): one bonus token is committed per verify.
            tree = draft_tree(shape, torch.randint(0, vocab, (n - 1,), generator=generator).tolist())
            longest = max(
                longest, committed[(shape, n)] - 1
            )  # the cache holds all committed tokens but the pending one
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = verifier.verify(f"{shape}{n}", committed[(shape, n)], tree)  # ends with .tolist(): synchronized
            elapsed = time.perf_counter() - start
            committed[(shape, n)] += len(result.committed)
            if rep >= warmup:
                times[shape][n].append(elapsed)
    return times, longest


def summarize(times: dict[int, list[float]]) -> list[dict[str, float]]:
    base = statistics.median(times[min(times)])
    rows = []
    for n, samples in sorted(times.items()):
        deciles = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else [samples[0]] * 9
        median = statistics.median(samples)
        rows.append(
            {
                "tokens": n,
                "tree_nodes": n - 1,
                "median_ms": median * 1000,
                "p10_ms": deciles[0] * 1000,
                "p90_ms": deciles[-1] * 1000,
                "ratio": median / base,
            }
        )
    return rows


def markdown(label: str, meta: dict[str, Any], rows: list[dict[str, float]]) -> str:
    settings, m = meta["settings"], meta["machine"]
    where = m["cuda"] if settings["device"].startswith("cuda") else f"{m['cpu_model']}, {m['torch_threads']} threads"
    lines = [
        f"# Verifier cost: {label}",
        "",
        f"{settings['dtype']} on {settings['device']} ({where}, load average {m['load_average_at_start']}), "
        f"torch {m['torch_version']}; "
        f"{settings['context']}-token context (grows by one per repetition, up to {settings['max_context']}); "
        f"median of {settings['reps']} after {settings['warmup']} warm-up repetitions; {meta['measured_at']}.",
        "",
        "c(n): one `Verifier.verify` scoring n tokens: the pending token and n - 1 draft nodes, as a chain "
        "or as a branching tree of the same size (binary-heap layout), tree attention mask included; "
        "n = 1 is plain decoding. Both ratios are relative to the chain's c(1).",
        "",
        "| n | Draft nodes | chain c(n) ms (median) | p10 ms | p90 ms | chain c(n)/c(1) "
        "| tree c(n) ms | tree c(n)/c(1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['tree_nodes']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} "
            f"| {r['ratio']:.2f} | {r['tree_median_ms']:.2f} | {r['tree_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.torch_threads)
    model, label = load_target(args)
    # Limits wide enough for a chain of every size: the cost of n tokens is what is measured, not the policy.
    verifier = Verifier(model, f"cost-{label}", max_tree_nodes=max(args.sizes), max_tree_depth=max(args.sizes))
    by_shape, longest = measure(verifier, args.context, args.sizes, args.reps, args.warmup)
    times, tree_times = by_shape["chain"], by_shape["tree"]
    rows = summarize(times)
    tree_base = statistics.median(times[min(times)])  # both shapes relative to plain decoding
    for row, n in zip(rows, sorted(tree_times), strict=True):
        row["tree_median_ms"] = statistics.median(tree_times[n]) * 1000
        row["tree_ratio"] = statistics.median(tree_times[n]) / tree_base
    label = f"{label}_{args.device.replace(':', '')}_{args.dtype}"
    meta = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {
            "model": args.shape or args.model,
            "random_weights": bool(args.shape),
            "num_layers": int(model.config.num_hidden_layers),
            "dtype": args.dtype,
            "device": args.device,
            "context": args.context,
            "max_context": longest,
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "machine": machine.describe(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "meta": meta,
        "rows": rows,
        "samples_s": {str(n): t for n, t in times.items()},
        "tree_samples_s": {str(n): t for n, t in tree_times.items()},
    }
    (args.out_dir / f"verify_cost_{label}.json").write_text(json.dumps(document, indent=1) + "\n")
    text = markdown(label, meta, rows)
    (args.out_dir / f"verify_cost_{label}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
