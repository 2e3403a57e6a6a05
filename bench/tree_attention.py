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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import target_service.ragged_attention as ragged_attention
from target_service.engine_threads import serve_on_this_thread

from . import machine
from .verify_cost import DEFAULT_MODEL, SHAPES, forms_verifier, verifies_in_turn

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
    model_args = ["--model", args.model, *shape_args, "--context", str(args.context)]
    verifier = forms_verifier(model_args, sizes, args.warmup + args.reps, serve_on_this_thread())
    runner = verifier.model_runner

    def form(name: str) -> Callable[[], None]:
        def use() -> None:
            ragged_attention.KERNEL_MAX_ROWS, runner.one_call_layers = FORMS[name]

        return use

    try:
        runs = verifies_in_turn(
            verifier, {name: form(name) for name in FORMS}, sizes, args.context, args.reps, args.warmup
        )
    finally:
        ragged_attention.KERNEL_MAX_ROWS, runner.one_call_layers = FORMS["one call"]
    return runs.seconds, verifier.step_form


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
