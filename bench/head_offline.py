"""The draft head's offline figures on Spec-Bench's own answers: ``python -m bench.head_offline`` (``make bench-head``).

The model card's held-out figures come from prompts of the training mix. This
runs the same measures (``held_out_figures``: top-1 agreement, greedy chains,
the drafter's dynamic tree walked along the answer as if the verifier took
every node) on the target's greedy answers to Spec-Bench prompts, per task.

Beside a Spec-Bench run's head-alone τ (``--serving``) it splits the gap
between the model card and serving in two: what the change of prompts costs
(held-out against here) and what serving loses (here against the run): the
drafter's tree builder cutting trees to what pays for their verification, the
verifier's draft budget, a head that starts each request cold.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import machine
from bench.dataset import TASKS, expand_categories, load_questions, select
from bench.target import draft_head, load_target, quiet_libraries
from coordinator.rounds import RoundPolicy
from draft_service.draft_head import DraftHead
from draft_service.head_proposer import TreeShape
from draft_service.training.distill_data import distil_batch, encode_chat, pad_id
from draft_service.training.evaluate import held_out_figures, tree_acceptance

HEAD_MODE = "inproc:draft_model"
SERVING_TREE_NODES = RoundPolicy.max_draft_tokens  # the coordinator's default cap on draft tokens a round


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.head_offline", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=13, help="prompts distilled per batch")
    parser.add_argument("--positions", type=int, default=400, help="answer positions sampled for chains and trees")
    parser.add_argument(
        "--serving", type=Path, help="a bench.run spec_bench.json with an inproc:draft_model run, to compare with"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/head_offline"))
    args = parser.parse_args(argv)
    for flag in ("prompts_per_category", "max_new_tokens", "batch_size", "positions"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.serving is not None and not args.serving.is_file():
        parser.error(f"--serving {args.serving}: no such file (a bench.run spec_bench.json)")
    return args


def task_of(category: str) -> str:
    return next(task for task, members in TASKS.items() if category in members)


def figures_by_task(
    head: DraftHead, sequences_by_task: dict[str, list[dict[str, Any]]], positions: int = 400
) -> dict[str, dict[str, Any]]:
    """``held_out_figures`` per task and over all, plus the tree at the serving cap on draft tokens."""
    every = [s for sequences in sequences_by_task.values() for s in sequences]
    groups = {"overall": every, **sequences_by_task}
    figures = {}
    for name, sequences in groups.items():
        record = held_out_figures(head, sequences, positions)
        capped = tree_acceptance(head, sequences, positions, TreeShape(max_nodes=SERVING_TREE_NODES))
        record["tree_at_serving_cap"] = {"max_nodes": capped.max_nodes, "acceptance_length": capped.acceptance_length}
        figures[name] = record
    return figures


def serving_tau(path: Path) -> dict[str, float]:
    """Head-alone τ per task (and overall) from a bench.run report; empty when it has no such mode."""
    report = json.loads(path.read_text(encoding="utf-8"))
    return {s["group"]: s["tau"] for s in report["summaries"] if s["mode"] == HEAD_MODE}


def render(report: dict[str, Any]) -> str:
    figures: dict[str, dict[str, Any]] = report["figures"]
    served: dict[str, float] = report.get("serving_tau", {})
    settings, host = report["settings"], report["machine"]
    lines = [
        "# The draft head on Spec-Bench's own answers (offline)",
        "",
        f"Target {settings['model']} (float32), head in {settings['head_dtype']}, greedy answers of at most "
        f"{settings['max_new_tokens']} tokens to "
        f"{settings['prompts']} prompts ({settings['prompts_per_category']} per category), distilled in "
        f"{report['distill_s']:.0f} s; chains and trees from {settings['positions']} sampled answer positions per "
        f"group. Machine: {host['cpu_model']}, {host['cpus_available']} CPUs, torch {host['torch_version']}. "
        f"Run {report['started_at']}, commit {host['git_commit']}{' (dirty)' if host['git_dirty'] else ''}.",
        "",
        "Tree: the drafter's dynamic tree (`HeadProposer`) walked along the target's answer, plus the bonus "
        "token, as if the verifier took every node: what serving would reach if no node were cut.",
        "",
        "| Task | Answer positions | Top-1 | Chain τ | Tree τ (24 nodes) | Tree τ (16 nodes) | Served τ |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        tau = served.get(name)
        lines.append(
            f"| {name} | {f['answer_positions']} | {f['top1_agreement']:.3f} | {f['chain']['estimated_tau']:.2f} | "
            f"{f['tree']['acceptance_length']:.2f} | {f['tree_at_serving_cap']['acceptance_length']:.2f} | "
            f"{'n/a' if tau is None else f'{tau:.2f}'} |"
        )
    if served:
        lines += ["", f"Served τ: `{HEAD_MODE}` in {report['serving_report']}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    target = load_target(args.model)
    head = draft_head(target, target.model)
    questions = select(load_questions(), expand_categories(list(TASKS)), args.prompts_per_category)
    prompts = [encode_chat(target.tokenizer, q.text) for q in questions]
    pad = pad_id(target.tokenizer, target.eos_ids)
    start = time.perf_counter()
    sequences = []
    for i in range(0, len(prompts), args.batch_size):
        batch = prompts[i : i + args.batch_size]
        sequences += distil_batch(target.model, batch, args.max_new_tokens, target.eos_ids, pad)
    distill_s = time.perf_counter() - start
    by_task: dict[str, list[dict[str, Any]]] = {}
    for question, sequence in zip(questions, sequences, strict=True):
        by_task.setdefault(task_of(question.category), []).append(sequence)
    report: dict[str, Any] = {
        "started_at": started_at,
        "settings": {
            "model": args.model,
            "prompts": len(prompts),
            "prompts_per_category": args.prompts_per_category,
            "max_new_tokens": args.max_new_tokens,
            "positions": args.positions,
            "head_dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
        },
        "machine": machine.describe(),
        "distill_s": distill_s,
        "figures": figures_by_task(head, by_task, args.positions),
    }
    if args.serving is not None:
        report["serving_report"] = str(args.serving)
        report["serving_tau"] = serving_tau(args.serving)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "head_offline.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    markdown = render(report)
    (args.out_dir / "head_offline.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
