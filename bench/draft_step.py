"""The draft head's step three ways, side by side: transformers' layer with its products by ``F.linear``,
the same layer on prepacked weights, and the layer the drafter serves (``head_layer.HeadStep``).

A dynamic-tree round runs the head over 1 row (the newest committed token) and then over the beam's
rows (4 by default) at each level. This times both row counts on a cached context, alternating the arms
step by step: ``F.linear`` (``DraftHead.forward``, ``--head-matmul linear``), ``packed`` (``forward`` with
the fc, the layer's linears and the draft logits on weights prepacked for the CPU's GEMM kernel,
``--head-matmul auto``: what the drafter served before ``HeadStep``) and ``served`` (``DraftHead.step``:
fused, prepacked products and an in-place cache), in each dtype asked for, and reports medians per round,
each round's ratios and the median ratios.

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
from draft_service.head_layer import HeadCache
from specserve.model_loading import DEFAULT_MODEL

from . import machine
from .target import Target, load_head, load_target, quiet_libraries

ROWS = (1, 4)
ARMS = {"F.linear": "linear", "packed": "packed", "served": "packed"}  # arm -> --head-matmul
SERVED = "served"  # the arm that runs DraftHead.step; the others run DraftHead.forward


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
    caches: dict[str, Any] = {arm: HeadCache() if arm == SERVED else DynamicCache() for arm in ARMS}
    times: dict[str, dict[int, list[float]]] = {arm: {rows: [] for rows in ROWS} for arm in ARMS}
    features = torch.randn(1, context, hidden, generator=generator).to(dtype)
    tokens = torch.randint(0, int(head.draft_vocab.max()), (1, context), generator=generator)

    def run(arm: str, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        if arm == SERVED:
            heads[arm].step(features[0], tokens[0], positions, caches[arm])
        else:
            heads[arm](features, tokens, position_ids=positions[None], past_key_values=caches[arm])

    with torch.inference_mode():
        for arm, choice in ARMS.items():
            heads[arm].pack_products(choice)
            run(arm, features, tokens, torch.arange(context))

        def step(arm: str, rows: int) -> float:
            features = torch.randn(1, rows, hidden, generator=generator).to(dtype)
            tokens = torch.randint(0, int(head.draft_vocab.max()), (1, rows), generator=generator)
            positions = torch.full((rows,), context)
            start = time.perf_counter()
            run(arm, features, tokens, positions)
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
    """``runs``: per dtype, ``products`` (what the packed arms ran) and ``times_ms`` (``time_steps``)."""
    m = meta["machine"]
    lines = [
        "# Draft head step: transformers' layer on F.linear and on prepacked weights, and the served layer",
        "",
        f"{meta['measured_at']}; {m['cpu_model']}, {m['torch_threads']} threads (native bf16: "
        f"{', '.join(m.get('cpu_bf16_flags') or []) or 'no'}), torch {m['torch_version']}; "
        f"{meta['context']}-token cached context. Median of {meta['reps']} steps per arm and round, "
        f"{meta['rounds']} rounds; the arms' steps interleave one by one, each a copy of the head with its own "
        "cache: `F.linear` and `packed` run `DraftHead.forward` (transformers' layer and `DynamicCache`) with "
        "`--head-matmul linear` and `auto`; `served` runs `DraftHead.step` (the drafter's own layer: fused, "
        "prepacked products, an in-place cache).",
    ]
    for dtype, run in runs.items():
        times = run["times_ms"]
        lines += [
            "",
            f"## {dtype}",
            "",
            f"Packed arms: {run['products']}.",
            "",
            "| rows | F.linear ms (per round) | packed ms | served ms | packed / F.linear (per round) | median "
            "| served / packed (per round) | median |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for rows in ROWS:
            base, packed, served = (times[arm][rows] for arm in ("F.linear", "packed", SERVED))
            # The arms of one round share its load: ratios are taken within a round.
            packing = [n / b for n, b in zip(packed, base, strict=True)]
            serving = [n / b for n, b in zip(served, packed, strict=True)]
            lines.append(
                f"| {rows} | {_listed(base)} | {_listed(packed)} | {_listed(served)} | {_listed(packing)} "
                f"| {statistics.median(packing):.2f} | {_listed(serving)} | {statistics.median(serving):.2f} |"
            )
    return "\n".join(lines) + "\n"


def _listed(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


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
        head, _ = in_serving_dtype(copy.deepcopy(loaded), dtype, "packed")
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
