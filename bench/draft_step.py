"""The draft head's step with its products by ``F.linear`` against the forms chosen at start-up, side by side.

A dynamic-tree round runs the head over 1 row (the newest committed token) and then over the beam's
rows (4 by default) at each level. This times both row counts on a cached context, alternating
``F.linear`` everywhere with the chosen forms of the logits and of the head's linears (``--head-matmul``)
round by round, in the serving dtype, and reports medians and their ratio.

    python -m bench.draft_step [--context 300] [--rounds 3] [--reps 30] [--out-dir bench/out/draft-step]
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
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, truncate_cache

from . import machine
from .run import DEFAULT_MODEL, draft_head, fp32_model, load_target, quiet_libraries

ROWS = (1, 4)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.draft_step", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target whose draft head ships with the drafter")
    parser.add_argument("--context", type=int, default=300, help="tokens in the head's cache before each step")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two forms")
    parser.add_argument("--reps", type=int, default=30, help="timed steps per form, row count and round")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/draft-step"))
    args = parser.parse_args(argv)
    if min(args.context, args.rounds, args.reps) < 1:
        parser.error("--context, --rounds and --reps must be at least 1")
    return args


def time_steps(head: DraftHead, context: int, rounds: int, reps: int) -> dict[str, dict[int, list[float]]]:
    """Median ms of one step per (form, rows), one entry per round; forms alternate within each round."""
    hidden = head.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    chosen = (head.transposed_rows, head.layer_matmul.transposed_rows)
    forms = {"F.linear": (frozenset[int](), frozenset[int]()), "chosen": chosen}
    times: dict[str, dict[int, list[float]]] = {name: {rows: [] for rows in ROWS} for name in forms}
    with torch.inference_mode():
        cache = DynamicCache()
        dtype = head.draft_lm_head.dtype
        head(
            torch.randn(1, context, hidden, generator=generator).to(dtype),
            torch.randint(0, int(head.draft_vocab.max()), (1, context), generator=generator),
            position_ids=torch.arange(context)[None],
            past_key_values=cache,
            last_logits_only=True,
        )

        def step(rows: int) -> None:
            features = torch.randn(1, rows, hidden, generator=generator).to(dtype)
            tokens = torch.randint(0, int(head.draft_vocab.max()), (1, rows), generator=generator)
            head(features, tokens, position_ids=torch.full((1, rows), context), past_key_values=cache)
            truncate_cache(cache, context)

        for _ in range(rounds):
            for name, (logits_rows, layer_rows) in forms.items():
                head.transposed_rows, head.layer_matmul.transposed_rows = logits_rows, layer_rows
                for rows in ROWS:
                    for _ in range(3):
                        step(rows)
                    samples = []
                    for _ in range(reps):
                        start = time.perf_counter()
                        step(rows)
                        samples.append(time.perf_counter() - start)
                    times[name][rows].append(statistics.median(samples) * 1000)
    head.transposed_rows, head.layer_matmul.transposed_rows = chosen
    return times


def markdown(meta: dict[str, Any], times: dict[str, dict[int, list[float]]]) -> str:
    m = meta["machine"]
    lines = [
        "# Draft head step: F.linear against the chosen product forms",
        "",
        f"{meta['measured_at']}; {m['cpu_model']}, {m['torch_threads']} threads (native bf16: "
        f"{', '.join(m.get('cpu_bf16_flags') or []) or 'no'}), torch {m['torch_version']}; head in "
        f"{meta['dtype']}, {meta['context']}-token cached context; chosen forms: logits {meta['chosen']}; "
        f"linears {meta.get('chosen_layers', 'F.linear at every row count')}. "
        f"Median of {meta['reps']} steps per round, {meta['rounds']} rounds with the forms alternating.",
        "",
        "| rows | F.linear ms (per round) | chosen ms (per round) | chosen / F.linear (median of rounds) |",
        "|---|---|---|---|",
    ]
    for rows in ROWS:
        base, new = times["F.linear"][rows], times["chosen"][rows]
        ratio = statistics.median(new) / statistics.median(base)
        lines.append(
            f"| {rows} | {', '.join(f'{t:.2f}' for t in base)} | {', '.join(f'{t:.2f}' for t in new)} | {ratio:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    target = load_target(args.model, "float32")
    head = draft_head(target, fp32_model(target))
    times = time_steps(head, args.context, args.rounds, args.reps)
    meta = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "dtype": str(head.draft_lm_head.dtype).removeprefix("torch."),
        "context": args.context,
        "rounds": args.rounds,
        "reps": args.reps,
        "chosen": head.logits_form,
        "chosen_layers": head.layers_form,
        "machine": machine.describe(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(meta, times)
    (args.out_dir / "draft_step.json").write_text(json.dumps({"meta": meta, "times_ms": times}, indent=1) + "\n")
    (args.out_dir / "draft_step.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
