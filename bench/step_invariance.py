"""Does a row's result depend on how many rows share its step? ``python -m bench.step_invariance``.

Greedy speculation is token-identical to plain decoding only if a token
scored inside a tree gets exactly the logits it gets in a one-token step
(batch invariance). This runs one session's rows alone, then inside steps of
more rows (the others belong to other sessions, as under load), and reports
the largest difference of its fp32 logits from the alone run, per step form:
0 is bit-identical. It also sets a session's pending row alone against the same
row with n - 1 draft nodes in its own segment (a chain): the products see the
same rows either way, but attention sees n query rows instead of one.
``tests/unit/test_step_invariance.py`` asserts the first for the CPU's
prepacked step; this reports both wherever it runs, a GPU included.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from target_service.kv_arena import Region
from target_service.model_runner import COMPILE_CHOICES, ModelRunner
from target_service.ragged_attention import Segment, StepPlan

from . import machine
from .verify_cost import SHAPES, random_model

CONTEXT = 40
FILLER_SESSIONS = 20  # one row each; rows past them go to one more session
TOTALS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256)


class RowProbe:
    """One session under test beside filler sessions on one arena, each with ``CONTEXT`` cached tokens."""

    def __init__(self, runner: ModelRunner, vocab: int, most_rows: int = 256) -> None:
        self.runner = runner
        device = runner.device
        room = CONTEXT + most_rows + 16
        self.arena = runner.new_arena((room + 16) * (FILLER_SESSIONS + 2))  # + 16: regions are whole blocks
        self.regions: list[Region] = []
        empty = torch.zeros(0, dtype=torch.long, device=device)
        for seed in range(FILLER_SESSIONS + 2):
            region = self.arena.allocate(room)
            assert region is not None
            prompt = torch.randint(0, vocab, (CONTEXT,), generator=torch.Generator().manual_seed(seed)).to(device)
            plan = StepPlan(self.arena, [Segment.chunk(region, 0, slice(0, CONTEXT), device)])
            runner.forward(plan, prompt, torch.arange(CONTEXT, device=device), empty, empty)
            region.length = CONTEXT
            self.regions.append(region)
        self.vocab = vocab
        self.form = ""  # what a caller names the step form under test

    def step(self, own_rows: int, filler_rows: int, after: int = 0) -> torch.Tensor:
        """The fp32 logits of the session under test's ``own_rows`` rows in a step with ``filler_rows`` more.

        Its rows are the tokens ``after`` .. ``after + own_rows`` of one fixed continuation of its context, on
        top of the ones before them (already in its cache: written by an earlier step of this probe).
        """
        device = self.runner.device
        plan = StepPlan(self.arena)
        ids: list[int] = []
        positions: list[int] = []
        rest = filler_rows - FILLER_SESSIONS
        sessions = [own_rows] + [1] * min(filler_rows, FILLER_SESSIONS) + ([rest] if rest > 0 else [])
        for index, (region, n) in enumerate(zip(self.regions, sessions, strict=False)):
            start = len(ids)
            skip = after if index == 0 else 0
            ids += [(7 * (start + skip + i) + 3) % self.vocab for i in range(n)]
            positions += list(range(CONTEXT + skip, CONTEXT + skip + n))
            plan.segments.append(Segment.chunk(region, CONTEXT + skip, slice(start, start + n), device))
        rows = torch.arange(len(ids), device=device)
        ids_t, pos_t = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
        return self.runner.forward(plan, ids_t, pos_t, rows, rows[:0]).logits[:own_rows]

    def differences(self, own_rows: int, totals: Sequence[int]) -> dict[int, float]:
        """Largest |logit difference| from the alone step, for each total row count of a shared step."""
        alone = self.step(own_rows, 0)
        return {
            total: float((self.step(own_rows, total - own_rows) - alone).abs().max())
            for total in totals
            if total >= own_rows
        }

    def chain_differences(self, sizes: Sequence[int]) -> dict[int, float]:
        """Largest |logit difference| of the pending row alone from the same row ahead of n - 1 chain nodes."""
        alone = self.step(1, 0)[0]
        return {n: float((self.step(n, 0)[0] - alone).abs().max()) for n in sizes}


CHAIN_SIZES = (2, 3, 4, 5, 8, 9, 16, 17, 32)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.step_invariance", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="random weights of this shape")
    parser.add_argument("--num-layers", type=int, default=4, help="layers kept (rounding grows with depth alike)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", default="auto,off")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/step-invariance"))
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.compile = [c for c in args.compile.split(",") if c]
    if any(c not in COMPILE_CHOICES for c in args.compile):
        parser.error(f"--compile takes a comma-separated list from {', '.join(COMPILE_CHOICES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cases: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        model = random_model(args.shape, args.num_layers, getattr(torch, dtype), args.device)
        for compile in args.compile:
            runner = ModelRunner(model, compile)
            probe = RowProbe(runner, int(model.config.vocab_size))
            with torch.inference_mode():
                for own in (1, 3):
                    diffs = probe.differences(own, TOTALS)
                    cases.append(
                        {"dtype": dtype, "compile": compile, "step_form": runner.describe(), "own_rows": own}
                        | {"max_abs_diff": {str(t): d for t, d in diffs.items()}}
                    )
                    worst = max(diffs.values())
                    print(f"{dtype} compile={compile} own={own}: worst {worst:.3g} {diffs}", flush=True)
                chain = probe.chain_differences(CHAIN_SIZES)
                cases.append(
                    {"dtype": dtype, "compile": compile, "step_form": runner.describe(), "own_rows": "chain"}
                    | {"max_abs_diff": {str(n): d for n, d in chain.items()}}
                )
                print(f"{dtype} compile={compile} chain: {chain}", flush=True)
    where = f"{args.shape} ({args.num_layers} layers, random weights) on {args.device}"
    meta: dict[str, Any] = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": where,
        "machine": machine.describe(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"step_invariance_{args.shape}_{args.device.replace(':', '')}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
    m = meta["machine"]
    hardware = m["cuda"] if args.device.startswith("cuda") else f"{m['cpu_model']} ({', '.join(m['cpu_flags'])})"
    lines = [
        f"# Batch invariance: {where}",
        "",
        f"Measured {meta['measured_at']} on {hardware}, torch {m['torch_version']}. Largest |fp32 logit "
        "difference| of a session's rows alone and inside a step of T rows (0: bit-identical).",
        "",
        "| dtype | compile | own rows | " + " | ".join(f"T={t}" for t in TOTALS) + " |",
        "|---|---|---|" + "---|" * len(TOTALS),
    ]
    for case in (c for c in cases if c["own_rows"] != "chain"):
        cells = [f"{case['max_abs_diff'].get(str(t), float('nan')):.2g}" for t in TOTALS]
        lines.append(f"| {case['dtype']} | {case['compile']} | {case['own_rows']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "A session's pending row alone against the same row with n - 1 draft nodes (a chain) in its own segment:",
        "",
        "| dtype | compile | " + " | ".join(f"n={n}" for n in CHAIN_SIZES) + " |",
        "|---|---|" + "---|" * len(CHAIN_SIZES),
    ]
    for case in (c for c in cases if c["own_rows"] == "chain"):
        cells = [f"{case['max_abs_diff'][str(n)]:.2g}" for n in CHAIN_SIZES]
        lines.append(f"| {case['dtype']} | {case['compile']} | " + " | ".join(cells) + " |")
    lines += ["", "Step forms: " + "; ".join(sorted({f"{c['compile']}: {c['step_form']}" for c in cases}))]
    (args.out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
