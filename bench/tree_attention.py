"""A verify's tree rows attending in the block kernel or through SDPA: ``python -m bench.tree_attention``.

Over the GGUF blocks in fp32, a step's verifies attend in one kernel call a
layer (``block_weights.attend_rows``), and a step whose segments all attend
there runs each layer as one kernel call (``LlamaForward.kernel_step``). Three
forms on one verifier in one process, alternating verify by verify (each form
on its own session, same context length), so the machine's drift hits them
alike:

- ``one call``: as served;
- ``layers``: the kernel's attention, the layers dispatched op by op from
  Python (``ModelRunner.one_call_layers`` off);
- ``sdpa``: ``ragged_attention.KERNEL_MAX_ROWS`` at 1: only plain decoding's
  one-row segments attend in the kernel, trees through SDPA per segment, and
  such steps run layer by layer (the form before both).

c(n) at n = 1 (sdpa and one call alike there: the control), 2, 4, 8, 16 and 32
rows (the pending token and a branching tree of n - 1 nodes), and the ratios.
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

import target_service.ragged_attention as ragged_attention
from specserve.sampling import SamplingParams
from target_service.engine_threads import serve_on_this_thread

from . import machine
from .verify_cost import DEFAULT_MODEL, SHAPES, build_verifier, draft_tree, model_to_measure
from .verify_cost import parse_args as verify_cost_args

# Each form: (the most rows a segment may attend in the kernel, whether layers may run as one kernel call).
FORMS = {"one call": (ragged_attention.KERNEL_MAX_ROWS, True), "layers": (ragged_attention.KERNEL_MAX_ROWS, False)}
FORMS["sdpa"] = (1, True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.tree_attention", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a randomly initialised model of this shape instead")
    parser.add_argument("--num-layers", type=int, default=0)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--sizes", default="1,2,4,8,16,32")
    parser.add_argument("--reps", type=int, default=40, help="timed verifies per form and size (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/tree-attention"))
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[int, list[float]]], str]:
    """Seconds of each timed verify per form and size, and the step's description."""
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    shape_args = ["--shape", args.shape, "--num-layers", str(args.num_layers)] if args.shape else []
    reps = str(2 * (args.reps + args.warmup))  # sizes the verifier's sessions for every verify of both forms
    model_args = ["--model", args.model, *shape_args, "--dtypes", "float32", "--context", str(args.context)]
    cost_args = verify_cost_args(
        [*model_args, "--sizes", ",".join(map(str, sizes)), "--batch-sizes", "", "--reps", reps]
    )
    # build_verifier makes room for two sessions a size (verify_cost's chain and tree) and its batched ones:
    # the third form's sessions take the room of a batch of len(sizes) sessions.
    cost_args.batch_sizes, cost_args.batch_draft_nodes = [len(sizes)], [max(sizes) - 1]
    cost_args.engine_threads = serve_on_this_thread()
    model, label = model_to_measure(cost_args, "float32")
    verifier = build_verifier(model, label, cost_args, "auto")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, verifier.vocab_size, (args.context + 1,), generator=generator).tolist()
    runner = verifier.model_runner
    committed: dict[tuple[str, int], int] = {}
    for form in FORMS:
        for n in sizes:
            verifier.prefill(f"{form}{n}", prompt, SamplingParams())
            committed[(form, n)] = len(prompt)
    times: dict[str, dict[int, list[float]]] = {form: {n: [] for n in sizes} for form in FORMS}
    try:
        for rep in range(args.warmup + args.reps):
            for n in sizes:
                for form in list(FORMS) if rep % 2 else list(FORMS)[::-1]:
                    ragged_attention.KERNEL_MAX_ROWS, runner.one_call_layers = FORMS[form]
                    tokens = torch.randint(0, verifier.vocab_size, (n - 1,), generator=generator).tolist()
                    start = time.perf_counter()
                    result = verifier.verify(f"{form}{n}", committed[(form, n)], draft_tree("tree", tokens))
                    elapsed = time.perf_counter() - start
                    committed[(form, n)] += len(result.committed)
                    if rep >= args.warmup:
                        times[form][n].append(elapsed)
    finally:
        ragged_attention.KERNEL_MAX_ROWS, runner.one_call_layers = FORMS["one call"]
    return times, verifier.step_form


def report(
    args: argparse.Namespace, times: dict[str, dict[int, list[float]]], step: str, steal: float | None = None
) -> tuple[dict, str]:
    meta: dict[str, Any] = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": args.shape or Path(args.model).name,
        "context": args.context,
        "reps": args.reps,
        "step": step,
        "machine": machine.describe() | {"cpu_steal": steal},
    }
    rows = []
    for n in sorted(times["one call"]):
        one, layers, sdpa = (statistics.median(times[form][n]) * 1e3 for form in FORMS)
        rows.append({"n": n, "one_call_ms": one, "layers_ms": layers, "sdpa_ms": sdpa})
    m = meta["machine"]
    lines = [
        f"# Tree rows' attention and one-call layers against SDPA per segment ({meta['model']}, fp32)",
        "",
        f"{meta['measured_at']}, {m['cpu_model']} ({', '.join(m['cpu_flags'])}), {m['cpus_available']} CPUs, "
        f"torch {m['torch_version']}, commit {m['git_commit']}; {args.context}-token context, a branching tree "
        f"of n - 1 nodes; median of {args.reps} verifies per form, the forms alternating verify by verify. "
        f"Step: {step}.{machine.strain(m)}",
        "",
        "| n | one call c(n) ms | layers c(n) ms | SDPA c(n) ms | SDPA / layers | layers / one call | SDPA / one call "
        "|",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['n']} | {r['one_call_ms']:.2f} | {r['layers_ms']:.2f} | {r['sdpa_ms']:.2f} | "
        f"{r['sdpa_ms'] / r['layers_ms']:.2f} | {r['layers_ms'] / r['one_call_ms']:.2f} | "
        f"{r['sdpa_ms'] / r['one_call_ms']:.2f} |"
        for r in rows
    ]
    return {"meta": meta, "rows": rows}, "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = machine.cpu_times()
    times, step = measure(args)
    document, text = report(args, times, step, machine.steal_since(start))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"tree_attention_{document['meta']['model']}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(document, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
