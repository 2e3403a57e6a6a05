"""The draft head's step with its products by ``F.linear`` against prepacked weights, side by side.

A dynamic-tree round runs the head over 1 row (the newest committed token) and then over the beam's
rows (4 by default) at each level. This times both row counts on a cached context, alternating
``--head-matmul linear`` (``F.linear`` everywhere) with ``auto`` (the fc, the layer's linears and the draft
logits on weights prepacked for the CPU's GEMM kernel) step by step, in each dtype asked for, and reports
medians per round, each round's ratio and the median ratio.

    python -m bench.draft_step [--dtypes float32,bfloat16] [--context 300] [--rounds 3] [--reps 30]
        [--out-dir bench/out/draft-step]
"""

from __future__ import annotations

import argparse
import copy
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

from draft_service.draft_head import DraftHead, DraftHeadError, in_serving_dtype, truncate_cache
from specserve.model_loading import DEFAULT_MODEL

from . import machine
from .target import Target, load_head, load_target, quiet_libraries

ROWS = (1, 4)
ARMS = {"F.linear": "linear", "packed": "auto"}  # arm -> --head-matmul


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.draft_step", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target whose draft head ships with the drafter")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the head's compute dtypes, each timed apart")
    parser.add_argument("--context", type=int, default=300, help="tokens in the head's cache before each step")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two arms")
    parser.add_argument("--reps", type=int, default=30, help="timed steps per arm, row count and round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every CPU this process may use)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/draft-step"))
    args = parser.parse_args(argv)
    if min(args.context, args.rounds, args.reps) < 1:
        parser.error("--context, --rounds and --reps must be at least 1")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtypes or not set(args.dtypes) <= {"float32", "bfloat16"}:
        parser.error("--dtypes: a comma-separated list of float32, bfloat16")
    return args


def time_steps(head: DraftHead, context: int, rounds: int, reps: int) -> dict[str, dict[int, list[float]]]:
    """Median ms of one step per (arm, rows), one entry per round.

    Each arm is a copy of ``head`` with its own cache, packed for its ``--head-matmul``; their steps
    interleave one by one (which goes first alternates), so a shared machine's load falls on both alike.
    ``head`` itself is left as it came.
    """
    hidden = head.config.hidden_size
    dtype = head.draft_lm_head.dtype
    generator = torch.Generator().manual_seed(0)
    heads = {arm: copy.deepcopy(head) for arm in ARMS}
    caches = {arm: DynamicCache() for arm in ARMS}
    times: dict[str, dict[int, list[float]]] = {arm: {rows: [] for rows in ROWS} for arm in ARMS}
    features = torch.randn(1, context, hidden, generator=generator).to(dtype)
    tokens = torch.randint(0, int(head.draft_vocab.max()), (1, context), generator=generator)
    with torch.inference_mode():
        for arm, choice in ARMS.items():
            heads[arm].pack_products(choice)
            heads[arm](features, tokens, position_ids=torch.arange(context)[None], past_key_values=caches[arm])

        def step(arm: str, rows: int) -> float:
            features = torch.randn(1, rows, hidden, generator=generator).to(dtype)
            tokens = torch.randint(0, int(head.draft_vocab.max()), (1, rows), generator=generator)
            positions = torch.full((1, rows), context)
            start = time.perf_counter()
            heads[arm](features, tokens, position_ids=positions, past_key_values=caches[arm])
            elapsed = time.perf_counter() - start
            truncate_cache(caches[arm], context)
            return elapsed

        for _ in range(rounds):
            for rows in ROWS:
                samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
                for rep in range(3 + reps):
                    order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
                    for arm in order:
                        elapsed = step(arm, rows)
                        if rep >= 3:  # three warm-up steps each
                            samples[arm].append(elapsed)
                for arm in ARMS:
                    times[arm][rows].append(statistics.median(samples[arm]) * 1000)
    return times


def markdown(meta: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    """``runs``: per dtype, ``products`` (what the packed arm ran) and ``times_ms`` (``time_steps``)."""
    m = meta["machine"]
    lines = [
        "# Draft head step: F.linear against prepacked weights",
        "",
        f"{meta['measured_at']}; {m['cpu_model']}, {m['torch_threads']} threads (native bf16: "
        f"{', '.join(m.get('cpu_bf16_flags') or []) or 'no'}), torch {m['torch_version']}; "
        f"{meta['context']}-token cached context. Median of {meta['reps']} steps per arm and round, "
        f"{meta['rounds']} rounds; the arms' steps interleave one by one (`--head-matmul linear` and `auto`, "
        "each a copy of the head with its own cache).",
    ]
    for dtype, run in runs.items():
        times = run["times_ms"]
        lines += [
            "",
            f"## {dtype}",
            "",
            f"Packed arm: {run['products']}.",
            "",
            "| rows | F.linear ms (per round) | packed ms (per round) | packed / F.linear (per round) | median |",
            "|---|---|---|---|---|",
        ]
        for rows in ROWS:
            base, new = times["F.linear"][rows], times["packed"][rows]
            ratios = [n / b for n, b in zip(new, base, strict=True)]  # the arms of one round share its load
            lines.append(
                f"| {rows} | {', '.join(f'{t:.2f}' for t in base)} | {', '.join(f'{t:.2f}' for t in new)} "
                f"| {', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} |"
            )
    return "\n".join(lines) + "\n"


def fp32_head(target: Target) -> DraftHead:
    """The drafter's default head over the float32 target, as loaded (fp32, unpacked)."""
    try:
        return load_head(target.fp32_model(), target.fingerprint, serving=False)
    except DraftHeadError as exc:
        raise SystemExit(f"error: no draft head to time: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    loaded = fp32_head(load_target(args.model, "float32"))
    runs: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes:
        head, _ = in_serving_dtype(copy.deepcopy(loaded), dtype, "auto")
        times = time_steps(head, args.context, args.rounds, args.reps)
        runs[dtype] = {"products": head.products, "times_ms": times}
    meta = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "context": args.context,
        "rounds": args.rounds,
        "reps": args.reps,
        "machine": machine.describe(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(meta, runs)
    (args.out_dir / "draft_step.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    (args.out_dir / "draft_step.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
