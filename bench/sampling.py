"""Speculation when sampling: ``python -m bench.sampling`` (``make bench-sampling``).

Spec-Bench chat prompts at several temperatures (seeded), each generated with
speculation on and with speculation off through the same three processes,
interleaved prompt by prompt, so the ratio is taken within one run on one
verifier. The drafter runs twice, one cluster after the other: with coupled
drafts (its draft head drafts with the target's keyed Gumbel noise, the
default) and without (``--no-coupled-sampling``: the head's top-k, as under
greedy decoding): the before and after of coupling, side by side.

Reported per (drafter, temperature): tokens/s with and without speculation
and their ratio, tau (tokens per target forward), and how many outputs equal
the same request with speculation off (every one must, in fp32: a seed fixes
the text whatever was drafted). Writes ``sampling.json`` and ``sampling.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from client.sdk import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.model_loading import (
    DEFAULT_MODEL,
    default_cache_root,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)

from . import machine
from .cluster import DEFAULT_REDIS_URL, choose_pool, clear_pool, start_cluster
from .dataset import CATEGORIES, Question, load_questions, select

DRAFTERS = {"coupled": ("--coupled-sampling",), "uncoupled": ("--no-coupled-sampling",)}


@dataclass(frozen=True)
class Record:
    drafter: str
    temperature: float
    question_id: int
    speculation: str  # "auto" or "off"
    tokens: list[int]
    wall_s: float
    rounds: int
    accepted_tokens: int
    drafter_error: str


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.sampling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated; 0 is greedy")
    parser.add_argument("--prompts-per-category", type=int, default=1)
    parser.add_argument(
        "--categories",
        default="writing,roleplay,reasoning,coding,extraction,humanities",
        help=f"comma-separated, from {', '.join(CATEGORIES)}",
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0, help="seed offset: a request's seed is this + question id")
    parser.add_argument("--drafters", default="coupled,uncoupled", help=f"from {', '.join(DRAFTERS)}")
    parser.add_argument("--dtype", default="float32", help="the verifier's dtype (identity is claimed in fp32)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--torch-threads", type=int, default=0, help="the verifier's (0: the CPUs available)")
    parser.add_argument(
        "--draft-timeout-ms",
        type=int,
        default=0,
        help="the coordinator waits this long for a tree whatever the drafter's latency (its --draft-timeout-ms "
        "and --draft-timeout-floor-ms; 0: its defaults); a test on a loaded machine raises it",
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/sampling"))
    args = parser.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.drafters = [d for d in args.drafters.split(",") if d]
    unknown = set(args.drafters) - set(DRAFTERS)
    if unknown:
        parser.error(f"unknown drafters {sorted(unknown)}")
    return args


def generate(client: SpecserveClient, question: Question, params: GenerationParams) -> tuple[list[int], Stats, float]:
    tokens: list[int] = []
    stats: Stats | None = None
    start = time.perf_counter()
    for event in client.generate_chat([("user", question.text)], params):
        if isinstance(event, TextChunk):
            tokens.extend(event.token_ids)
        else:
            stats = event
    if stats is None:
        raise RuntimeError("the coordinator ended the stream without stats")
    return tokens, stats, time.perf_counter() - start


def fixed_draft_timeout(ms: int) -> list[str]:
    """Coordinator arguments that make its draft timeout ``ms`` whatever the drafter's latency (none for 0)."""
    return ["--draft-timeout-ms", str(ms), "--draft-timeout-floor-ms", str(ms)] if ms else []


def run_drafter(
    args: argparse.Namespace, drafter: str, questions: Sequence[Question], fingerprint: str, log_dir: Path
) -> list[Record]:
    """Every (temperature, prompt) with speculation on and off through one cluster; the order of the two
    alternates from one prompt to the next, so drift hits both alike."""
    pool = choose_pool(args.redis_url)
    threads = args.torch_threads or len(os.sched_getaffinity(0))
    cluster = start_cluster(
        args.model,
        pool,
        threads,
        log_dir / drafter,
        verifier_args=["--dtype", args.dtype],
        drafter_args=list(DRAFTERS[drafter]),
        coordinator_args=fixed_draft_timeout(args.draft_timeout_ms),
    )
    records: list[Record] = []
    try:
        client = SpecserveClient(cluster.coordinator_address, timeout_s=600.0)
        if pool.redis_url is not None:  # every drafter starts from an empty shared pool
            clear_pool(pool.redis_url, fingerprint)
        warm = GenerationParams(max_new_tokens=4)
        generate(client, questions[0], warm)  # first-request costs (caches, lazy imports) land on no measurement
        turn = 0
        for temperature in args.temperatures:
            for question in questions:
                order = ("auto", "off") if turn % 2 == 0 else ("off", "auto")
                turn += 1
                for speculation in order:
                    params = GenerationParams(
                        max_new_tokens=args.max_new_tokens,
                        temperature=temperature,
                        seed=args.seed + question.question_id,
                        speculation=speculation,
                    )
                    tokens, stats, wall_s = generate(client, question, params)
                    records.append(
                        Record(
                            drafter,
                            temperature,
                            question.question_id,
                            speculation,
                            tokens,
                            wall_s,
                            stats.num_rounds,
                            stats.num_accepted_tokens,
                            stats.drafter_error,
                        )
                    )
        client.close()
    finally:
        cluster.stop()
    return records


def summarize(records: Sequence[Record]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r.drafter, r.temperature) for r in records}, key=lambda k: (k[1], k[0]))
    for drafter, temperature in keys:
        runs = {
            s: {
                r.question_id: r
                for r in records
                if (r.drafter, r.temperature, r.speculation) == (drafter, temperature, s)
            }
            for s in ("auto", "off")
        }
        spec, off = runs["auto"], runs["off"]
        tokens_spec = sum(len(r.tokens) for r in spec.values())
        tokens_off = sum(len(r.tokens) for r in off.values())
        tps_spec = tokens_spec / sum(r.wall_s for r in spec.values())
        tps_off = tokens_off / sum(r.wall_s for r in off.values())
        rows.append(
            {
                "drafter": drafter,
                "temperature": temperature,
                "prompts": len(spec),
                "tok_s_speculative": tps_spec,
                "tok_s_off": tps_off,
                "speedup": tps_spec / tps_off,
                "tau": tokens_spec / max(1, sum(r.rounds for r in spec.values())),
                "accepted_per_round": sum(r.accepted_tokens for r in spec.values())
                / max(1, sum(r.rounds for r in spec.values())),
                "same_text": sum(spec[q].tokens == off[q].tokens for q in spec if q in off),
                "drafter_errors": sum(bool(r.drafter_error) for r in spec.values()),
            }
        )
    return rows


def markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    m = meta["machine"]
    lines = [
        "# Speculation when sampling: coupled drafts against the head's top-k",
        "",
        f"{meta['prompts']} Spec-Bench chat prompts ({', '.join(meta['categories'])}), {meta['max_new_tokens']} new "
        f"tokens, seeded (seed = {meta['seed']} + question id), verifier in {meta['dtype']}; each request with "
        "speculation on and off through the same three processes, interleaved. "
        f"{m['cpu_model']} ({m['cpus_available']} CPUs; flags {', '.join(m['cpu_flags'])}), torch "
        f"{m['torch_version']}, {meta['date']}. Command: `{meta['command']}`.",
        "",
        "| T | drafter | tok/s speculative | tok/s off | speedup | tau | same text as off |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['temperature']:g} | {row['drafter']} | {row['tok_s_speculative']:.1f} | {row['tok_s_off']:.1f} | "
            f"{row['speedup']:.2f}x | {row['tau']:.2f} | {row['same_text']}/{row['prompts']} |"
        )
    lines += [
        "",
        "At T = 0 both drafters draft alike (coupling changes sampled requests only): the two rows differ by "
        "machine noise and by the n-gram pool each cluster learnt.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    categories = [c for c in args.categories.split(",") if c]
    questions = select(load_questions(), categories, args.prompts_per_category)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = vocab_fingerprint(load_tokenizer(materialize(resolve_model(args.model), default_cache_root())))
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="bench-sampling-") as logs:
        for drafter in args.drafters:
            records += run_drafter(args, drafter, questions, fingerprint, Path(logs))
    rows = summarize(records)
    meta = {
        "machine": machine.describe(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "make bench-sampling" + (f' BENCH_SAMPLING_ARGS="{" ".join(argv)}"' if argv else ""),
        "prompts": len(questions),
        "categories": categories,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "dtype": args.dtype,
    }
    (args.out_dir / "sampling.json").write_text(
        json.dumps({"meta": meta, "summary": rows, "records": [asdict(r) for r in records]}, indent=1) + "\n"
    )
    (args.out_dir / "sampling.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
