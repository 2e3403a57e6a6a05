"""How much a verify of n tokens costs next to plain decoding: ``python -m bench.verify_cost``.

c(n) is the time of one ``Verifier.verify`` that scores n tokens on top of a
512-token context: the pending token plus a chain of n - 1 draft nodes (n = 1
is plain decoding). Speculation pays only where tau exceeds c(n)/c(1) for the
tree size it sends, so this curve sizes the drafts.

Each n has its own session, prefilled once; the repetitions are interleaved
over the sizes so that drift and the context's slow growth (each verify
commits at least its bonus token) hit every n alike.

The batched curve is what the engine does under load: B sessions each verify
k draft nodes (a branching tree, binary-heap layout) in ONE engine step, B *
(k + 1) tokens in one forward. The B calls are submitted while the engine is
paused and timed from its release to the last answer; every answer's
``batch_sessions`` must be B (steps where it is not are counted and reported).
The ratio is to one session with k = 0, so B sessions at ratio r cost r / B
of plain decoding per session.

Every curve is measured in each of ``--dtypes`` (default float32 and
bfloat16), one output pair per dtype. By default it measures the packaged
target on this machine's CPU. ``--shape`` builds a randomly initialised model
of a Llama shape instead (random weights are fine for cost curves), e.g.
``--shape llama-3.1-8b --dtypes bfloat16 --device cuda``; ``--num-layers``
truncates it for a quick check on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specserve.block_weights import choose_model_dtype
from specserve.hardware import choose_dtype
from specserve.model_loading import DEFAULT_MODEL, resolve_model
from specserve.results import VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.engine_threads import serve_on_this_thread
from target_service.kv_arena import bytes_per_token
from target_service.model_runner import COMPILE_CHOICES, WEIGHTS_CHOICES
from target_service.verifier import Verifier

from . import machine, speculation_ceiling

SIZES = (1, 2, 4, 8, 16, 32, 64)
DTYPES = ("float32", "bfloat16")
BATCH_SIZES = (1, 2, 4, 8, 16)  # sessions verifying in one engine step
BATCH_DRAFT_NODES = (0, 1, 3, 7)  # draft nodes per session in that step
# Slots a prefill reserves beyond its prompt (target_service.verifier.PREFILL_HEADROOM_TOKENS), for sizing the cache.
PREFILL_HEADROOM_TOKENS = 64

# Published configurations (attention and MLP widths are what cost depends on; RoPE scaling is not modelled).
SHAPES: dict[str, dict[str, Any]] = {
    # The packaged target's own shape: its cost on a machine where its weights cannot travel (a lent GPU).
    "smollm2-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
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
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the packaged target or a model path (without --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a randomly initialised model of this shape instead")
    parser.add_argument("--num-layers", type=int, default=0, help="keep only this many layers of --shape (0: all)")
    parser.add_argument(
        "--dtypes",
        "--dtype",
        default=",".join(DTYPES),
        help="comma-separated, from float32, bfloat16, float16; every curve is measured in each",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--context", type=int, default=512, help="context tokens in the cache before each verify")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tokens scored per verify")
    parser.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="sessions verifying together in one engine step ('' skips the batched curve)",
    )
    parser.add_argument(
        "--batch-draft-nodes",
        default=",".join(map(str, BATCH_DRAFT_NODES)),
        help="draft nodes per session in a batched step",
    )
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per size (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size first")
    parser.add_argument(
        "--torch-threads", type=int, default=len(os.sched_getaffinity(0)), help="default: the CPUs available"
    )
    parser.add_argument(
        "--dedicated-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as the verifier's --dedicated-cores: this thread runs torch on one thread, the engine's on all",
    )
    parser.add_argument(
        "--compile",
        default="auto,off",
        help="comma-separated engine steps to measure, as the verifier's flag: auto (prepacked products at row "
        "buckets) and off (eager F.linear); each gets its own files (names end in _compile-auto / _compile-off)",
    )
    parser.add_argument(
        "--weights",
        default="dtype",
        help="comma-separated, as the verifier's flag: dtype (the model's weights) and int8 (int8 copies of the "
        "layers' weights; measured with --compile auto only, files ending in _weights-int8)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out"))
    args = parser.parse_args(argv)
    args.sizes = _ints(args.sizes)
    if not args.sizes or args.sizes[0] < 1:
        parser.error("--sizes must be positive integers")
    args.batch_sizes, args.batch_draft_nodes = _ints(args.batch_sizes), _ints(args.batch_draft_nodes)
    if args.batch_sizes and (args.batch_sizes[0] < 1 or not args.batch_draft_nodes or args.batch_draft_nodes[0] < 0):
        parser.error("--batch-sizes must be positive and --batch-draft-nodes non-negative integers")
    args.dtypes = list(dict.fromkeys(d.strip() for d in args.dtypes.split(",") if d.strip()))
    args.compile = list(dict.fromkeys(c.strip() for c in args.compile.split(",") if c.strip()))
    if not args.compile or any(c not in COMPILE_CHOICES for c in args.compile):
        parser.error(f"--compile takes a comma-separated list from {', '.join(COMPILE_CHOICES)}")
    args.weights = list(dict.fromkeys(w.strip() for w in args.weights.split(",") if w.strip()))
    if not args.weights or any(w not in WEIGHTS_CHOICES for w in args.weights):
        parser.error(f"--weights takes a comma-separated list from {', '.join(WEIGHTS_CHOICES)}")
    unknown = [d for d in args.dtypes if d not in ("float32", "bfloat16", "float16")]
    if unknown or not args.dtypes:
        parser.error(f"unknown dtypes {unknown}: choose from float32, bfloat16, float16")
    if args.shape is None and args.num_layers:
        parser.error("--num-layers applies to --shape models only")
    return args


def _ints(text: str) -> list[int]:
    return sorted({int(s) for s in text.split(",") if s.strip()})


def random_model(shape: str, num_layers: int, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    values = dict(SHAPES[shape])
    if num_layers:
        values["num_hidden_layers"] = num_layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**values), dtype=dtype)
    return model.eval()


def model_to_measure(args: argparse.Namespace, dtype: str) -> tuple[Any, str]:
    """The model to measure in ``dtype`` and its label (the output file stem, before device and dtype)."""
    if args.shape:
        layers = f"-{args.num_layers}layers" if args.num_layers else ""
        return random_model(args.shape, args.num_layers, getattr(torch, dtype), args.device), f"{args.shape}{layers}"
    from specserve.model_loading import load_model

    from .target import target_source

    return load_model(target_source(args.model), device=args.device, dtype=dtype), Path(args.model).name


DRAFT_SHAPES = ("chain", "tree")


def draft_tree(shape: str, tokens: list[int]) -> TokenTree:
    """A chain, or a branching tree of the same size (binary-heap layout: node i's parent is (i - 1) // 2)."""
    if shape == "chain":
        return TokenTree.chain(tokens)
    return TokenTree(tuple(tokens), tuple(-1 if i == 0 else (i - 1) // 2 for i in range(len(tokens))))


def forms_verifier(model_args: Sequence[str], sizes: Sequence[int], verifies: int, threads: int) -> Verifier:
    """A float32 verifier (``--compile auto``) for ``verifies_in_turn``: room for up to three forms' sessions of
    every size, each verifying ``verifies`` times. ``model_args``: this module's flags naming the model (or
    shape) and the context."""
    sizes_flag = ",".join(map(str, sizes))
    args = parse_args(
        [*model_args, "--dtypes", "float32", "--sizes", sizes_flag, "--batch-sizes", "", "--reps", str(verifies)]
    )
    # build_verifier's room: two sessions a size (this module's chain and tree), and a batch of len(sizes) more.
    args.batch_sizes, args.batch_draft_nodes = [len(sizes)], [max(sizes) - 1]
    args.engine_threads = threads
    model, label = model_to_measure(args, "float32")
    return build_verifier(model, label, args, "auto")


@dataclass
class FormRuns:
    seconds: dict[str, dict[int, list[float]]]  # form -> size -> each timed verify's seconds
    committed: dict[str, dict[int, list[int]]]  # form -> size -> every verify's committed tokens, in order


def verifies_in_turn(
    verifier: Verifier,
    forms: Mapping[str, Callable[[], None]],
    sizes: Sequence[int],
    context: int,
    reps: int,
    warmup: int,
    seed: int = 0,
) -> FormRuns:
    """Whole verifies of every size in each form, the forms taking turns verify by verify (their order flipping
    each repetition), so that the machine's drift hits them alike.

    Each form verifies on sessions of its own over the same random ``context`` tokens, the same random branching
    trees; ``forms[name]()`` puts the engine in that form before each of its verifies. The first ``warmup``
    repetitions are not timed. Forms that compute alike commit the same tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, verifier.vocab_size, (context + 1,), generator=generator).tolist()
    names = list(forms)
    cached: dict[tuple[str, int], int] = {}
    for name in names:
        for n in sizes:
            verifier.prefill(f"{name}{n}", prompt, SamplingParams())
            cached[(name, n)] = len(prompt)
    runs = FormRuns({name: {n: [] for n in sizes} for name in names}, {name: {n: [] for n in sizes} for name in names})
    for rep in range(warmup + reps):
        for n in sizes:
            tree = draft_tree("tree", torch.randint(0, verifier.vocab_size, (n - 1,), generator=generator).tolist())
            for name in names if rep % 2 else names[::-1]:
                forms[name]()
                start = time.perf_counter()
                result = verifier.verify(f"{name}{n}", cached[(name, n)], tree)
                elapsed = time.perf_counter() - start
                cached[(name, n)] += len(result.committed)
                runs.committed[name][n] += result.committed
                if rep >= warmup:
                    runs.seconds[name][n].append(elapsed)
    return runs


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


@dataclass
class BatchedTimes:
    """Seconds per engine step for each (sessions B, draft nodes k), and how far the contexts grew."""

    times: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # Timed steps whose answers did not all say batch_sessions == B (they did not share one forward).
    unshared: dict[tuple[int, int], int] = field(default_factory=dict)
    batch_sessions_seen: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    longest_context: int = 0


def prefill_together(verifier: Verifier, sessions: Sequence[str], prompt: list[int]) -> dict[str, int]:
    """Prefill every session with ``prompt`` (batched by the engine); committed tokens per session."""
    futures = [verifier.submit_prefill(session, prompt, SamplingParams()) for session in sessions]
    for future in futures:
        future.result()
    return {session: len(prompt) for session in sessions}


def verify_together(
    verifier: Verifier, committed: dict[str, int], trees: dict[str, TokenTree]
) -> tuple[float, list[VerifyResult]]:
    """Submit one verify per session while the engine is paused, release it, wait for all: (seconds, results).

    The engine takes everything queued into its next step, so the calls share one forward (the results'
    ``batch_sessions`` says whether they did). The clock runs from the release to the last answer.
    """
    with verifier.paused():
        futures = [verifier.submit_verify(session, committed[session], tree) for session, tree in trees.items()]
        if verifier.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
    results = [future.result() for future in futures]  # each ends with .tolist(): synchronized
    return time.perf_counter() - start, results


def measure_batched(
    verifier: Verifier,
    context: int,
    batch_sizes: Sequence[int],
    draft_nodes: Sequence[int],
    reps: int,
    warmup: int,
) -> BatchedTimes:
    """Time B sessions each verifying k draft nodes in one step, for every (B, k).

    ``max(batch_sizes)`` sessions are prefilled once with the same context; each
    step takes the B sessions whose contexts grew least (every verify commits
    at least its bonus token), so all cases run on contexts alike. Cases are
    interleaved within every repetition in a rotating order, as in ``measure``.
    """
    generator = torch.Generator().manual_seed(1)
    vocab = verifier.vocab_size
    prompt = torch.randint(0, vocab, (context + 1,), generator=generator).tolist()
    committed = prefill_together(verifier, [f"batch{i}" for i in range(max(batch_sizes))], prompt)
    cases = [(b, k) for b in batch_sizes for k in draft_nodes]
    result = BatchedTimes(
        times={case: [] for case in cases},
        unshared=dict.fromkeys(cases, 0),
        batch_sessions_seen={case: [] for case in cases},
    )
    for rep in range(warmup + reps):
        for b, k in [*cases[rep % len(cases) :], *cases[: rep % len(cases)]]:
            chosen = sorted(committed, key=lambda session: (committed[session], session))[:b]
            trees = {
                session: draft_tree("tree", torch.randint(0, vocab, (k,), generator=generator).tolist())
                for session in chosen
            }
            result.longest_context = max(result.longest_context, *(committed[s] - 1 for s in chosen))
            elapsed, answers = verify_together(verifier, committed, trees)
            for session, answer in zip(chosen, answers, strict=True):
                committed[session] += len(answer.committed)
            if rep >= warmup:
                result.times[(b, k)].append(elapsed)
                shared = {answer.batch_sessions for answer in answers}
                result.batch_sessions_seen[(b, k)].extend(sorted(shared))
                result.unshared[(b, k)] += shared != {b}
    return result


def summarize_batched(batched: BatchedTimes) -> list[dict[str, Any]]:
    """One row per (B, k): median step time, its spread, and the ratio to one session with k = 0."""
    base_case = (min(b for b, _ in batched.times), min(k for _, k in batched.times))
    base = statistics.median(batched.times[base_case])
    rows = []
    for (b, k), samples in sorted(batched.times.items()):
        deciles = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else [samples[0]] * 9
        median = statistics.median(samples)
        rows.append(
            {
                "sessions": b,
                "draft_nodes": k,
                "tokens": b * (k + 1),
                "median_ms": median * 1000,
                "p10_ms": deciles[0] * 1000,
                "p90_ms": deciles[-1] * 1000,
                "ratio": median / base,
                "ms_per_session": median * 1000 / b,
                "unshared_steps": batched.unshared[(b, k)],
                "batch_sessions_seen": sorted(set(batched.batch_sessions_seen[(b, k)])),
            }
        )
    return rows


def kv_cache_bytes(model: Any, sessions: int, tokens_per_session: int) -> int:
    """Room for ``sessions`` of ``tokens_per_session`` each (plus a prefill's headroom), twice over: regions
    grow by doubling. The engine evicts idle sessions when its cache is short; a measurement must never lose one.
    """
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    dtype = next(model.parameters()).dtype
    per_token = bytes_per_token(int(config.num_hidden_layers), kv_heads, head_dim, dtype)
    return 2 * sessions * (tokens_per_session + PREFILL_HEADROOM_TOKENS) * per_token


def build_verifier(model: Any, label: str, args: argparse.Namespace, compile: str, weights: str = "dtype") -> Verifier:
    """An engine whose limits hold every measured case: the cost of n tokens is measured, not the policy."""
    biggest_tree = max([*args.sizes, *(k + 1 for k in args.batch_draft_nodes)])
    batch = max(args.batch_sizes, default=0)
    batch_tokens = max(args.batch_draft_nodes, default=0) + 1
    steps = args.warmup + args.reps
    # A verify commits at most the tokens it scores. Single-session cases: one session per shape and size,
    # one verify per repetition; batched: `batch` sessions, each in at most every case of every repetition.
    singles = 2 * len(args.sizes)
    single_tokens = args.context + 1 + steps * max(args.sizes)
    batched_tokens = args.context + 1 + steps * len(args.batch_sizes) * len(args.batch_draft_nodes) * batch_tokens
    memory = kv_cache_bytes(model, singles, single_tokens) + kv_cache_bytes(model, batch, batched_tokens)
    return Verifier(
        model,
        f"cost-{label}",
        max_sessions=singles + batch,
        session_ttl_s=24 * 3600.0,
        max_tree_nodes=biggest_tree,
        max_tree_depth=biggest_tree,
        kv_cache_bytes=memory,
        max_batch_tokens=max(256, biggest_tree + 1, batch * batch_tokens),
        max_batch_sessions=max(64, batch),
        compile=compile,
        weights=weights,
        engine_threads=args.engine_threads,
    )


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


DEDICATED_NOTE = "The engine thread alone runs torch on every thread (`--dedicated-cores`). "


def markdown(label: str, meta: dict[str, Any], rows: list[dict[str, float]], batched: list[dict[str, Any]]) -> str:
    settings, m = meta["settings"], meta["machine"]
    where = m["cuda"] if settings["device"].startswith("cuda") else f"{m['cpu_model']}, {m['torch_threads']} threads"
    lines = [
        f"# Verifier cost: {label}",
        "",
        f"{settings['dtype']} on {settings['device']} ({where}, load average {m['load_average_at_start']}; "
        f"`--dtype auto` picks {settings['auto_dtype']} here: {settings['auto_dtype_reason']}), "
        f"torch {m['torch_version']}; "
        f"{settings['context']}-token context (grows by one per repetition, up to {settings['max_context']}); "
        f"median of {settings['reps']} after {settings['warmup']} warm-up repetitions; {meta['measured_at']}. "
        f"CPU flags: {', '.join(m.get('cpu_flags', [])) or 'not recorded'}. "
        f"{DEDICATED_NOTE if settings.get('dedicated_cores') else ''}"
        f"Engine step: {settings.get('step_form', 'not recorded')} (`--compile {settings.get('compile', '?')}`, "
        f"`--weights {settings.get('weights', 'dtype')}`).",
        "",
        "## One session",
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
    lines += ["", *speculation_ceiling.markdown({int(r["tokens"]): r["ratio"] for r in rows})]
    if batched:
        lines += ["", *batched_markdown(settings, batched)]
    return "\n".join(lines) + "\n"


def batched_markdown(settings: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The batched curve: a matrix of ratios, then every figure per (B, k)."""
    sessions = sorted({r["sessions"] for r in rows})
    nodes = sorted({r["draft_nodes"] for r in rows})
    cell = {(r["sessions"], r["draft_nodes"]): r for r in rows}
    unshared = sum(r["unshared_steps"] for r in rows)
    lines = [
        "## Batched: B sessions in one engine step",
        "",
        "One engine step in which B sessions each verify k draft nodes (a branching tree, binary-heap layout): "
        f"B * (k + 1) tokens in one forward, each session on its own {settings['context']}-token context (up to "
        f"{settings['batched_max_context']}). Time from releasing the engine to the last answer; the ratio is "
        "to one session with k = 0 (plain decoding), so per session a step costs ratio / B of that.",
        "",
        "All steps shared one forward (every answer's `batch_sessions` was B)."
        if not unshared
        else f"**{unshared} timed steps did not share one forward** (an answer's `batch_sessions` was not B): "
        "see the last column.",
        "",
        "Step time / one session's plain decoding step:",
        "",
        "| B | " + " | ".join(f"k = {k}" for k in nodes) + " |",
        "|---|" + "---|" * len(nodes),
    ]
    for b in sessions:
        lines.append(f"| {b} | " + " | ".join(f"{cell[(b, k)]['ratio']:.2f}" for k in nodes) + " |")
    lines += [
        "",
        "| B | k | Tokens | step ms (median) | p10 ms | p90 ms | ratio | ms per session | steps not shared "
        "(batch_sessions seen) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seen = ", ".join(map(str, r["batch_sessions_seen"]))
        lines.append(
            f"| {r['sessions']} | {r['draft_nodes']} | {r['tokens']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} "
            f"| {r['p90_ms']:.2f} | {r['ratio']:.2f} | {r['ms_per_session']:.2f} | {r['unshared_steps']} ({seen}) |"
        )
    return lines


def measure_step(
    args: argparse.Namespace, model: Any, label: str, dtype: str, compile: str, weights: str = "dtype"
) -> tuple[str, dict[str, Any], str]:
    """Both curves of ``model`` (in ``dtype``) with the engine step ``compile`` on ``weights``: (file stem, JSON
    document, Markdown)."""
    verifier = build_verifier(model, label, args, compile, weights)
    try:
        by_shape, longest = measure(verifier, args.context, args.sizes, args.reps, args.warmup)
        batched = (
            measure_batched(verifier, args.context, args.batch_sizes, args.batch_draft_nodes, args.reps, args.warmup)
            if args.batch_sizes
            else None
        )
    finally:
        verifier.close()
    step_form = verifier.step_form
    times, tree_times = by_shape["chain"], by_shape["tree"]
    rows = summarize(times)
    tree_base = statistics.median(times[min(times)])  # both shapes relative to plain decoding
    for row, n in zip(rows, sorted(tree_times), strict=True):
        row["tree_median_ms"] = statistics.median(tree_times[n]) * 1000
        row["tree_ratio"] = statistics.median(tree_times[n]) / tree_base
    batched_rows = summarize_batched(batched) if batched else []
    auto = (
        choose_dtype("auto", args.device)
        if args.shape
        else choose_model_dtype("auto", args.device, resolve_model(args.model))
    )
    stem = f"{label}_{args.device.replace(':', '')}_{dtype}_compile-{compile}"
    stem += "" if weights == "dtype" else f"_weights-{weights}"
    meta = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {
            "model": args.shape or args.model,
            "random_weights": bool(args.shape),
            "num_layers": int(model.config.num_hidden_layers),
            "dtype": dtype,
            "auto_dtype": auto.dtype,
            "auto_dtype_reason": auto.reason,
            "device": args.device,
            "context": args.context,
            "max_context": longest,
            "batched_max_context": batched.longest_context if batched else None,
            "batch_sizes": args.batch_sizes,
            "batch_draft_nodes": args.batch_draft_nodes,
            "reps": args.reps,
            "warmup": args.warmup,
            "compile": compile,
            "weights": weights,
            "step_form": step_form,
            "dedicated_cores": args.dedicated_cores,
        },
        "machine": machine.describe(),
    }
    document = {
        "meta": meta,
        "rows": rows,
        "samples_s": {str(n): t for n, t in times.items()},
        "tree_samples_s": {str(n): t for n, t in tree_times.items()},
        "batched_rows": batched_rows,
        "batched_samples_s": {f"{b},{k}": t for (b, k), t in batched.times.items()} if batched else {},
    }
    return stem, document, markdown(stem, meta, rows, batched_rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.torch_threads)
    # As the verifier serves with --dedicated-cores: its engine thread computes on the threads, this one on one.
    args.engine_threads = serve_on_this_thread() if args.dedicated_cores else 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes:
        model, label = model_to_measure(args, dtype)  # once per dtype: every step form measures the same weights
        for compile, weights in itertools.product(args.compile, args.weights):
            if weights != "dtype" and (compile != "auto" or args.device != "cpu"):
                continue  # int8 weights run on the CPU's packed kernels only
            stem, document, text = measure_step(args, model, label, dtype, compile, weights)
            (args.out_dir / f"verify_cost_{stem}.json").write_text(json.dumps(document, indent=1) + "\n")
            (args.out_dir / f"verify_cost_{stem}.md").write_text(text)
            print(text, flush=True)
            gc.collect()  # the step's verifier and its packed weights
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
