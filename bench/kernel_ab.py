"""The block kernel against an earlier revision's, in one process: ``python -m bench.kernel_ab --base REV``.

Builds ``specserve/kernels/block_gemm.cpp`` as it was at ``--base`` (``git
show``) beside the current build, with the same flags, and times both in
turn, rep by rep, so that the machine's drift (2x from one minute to the next
on a shared 2-core VM) hits them alike:

- ``attention``: ``attend_rows`` for one segment of n rows (a chain: row i sees
  rows 0..i) over a ``--context``-token region, on one arena per layer
  (``--layers`` of them, SmolLM2's 9 query and 3 key-value heads of 64), as a
  step reads them: each layer's keys and values come from memory, not from
  the cache a lone call would leave them in;
- ``products``: the layers' four Q4_1 products (fused QKV, O, gate-up, down)
  at n rows, one copy of the weights per layer, then the LM head's Q8_0 one;
- ``verify``: whole verifies of the packaged model (``--model``), a tree of n - 1
  draft nodes over ``--contexts`` cached tokens, each build on its own session,
  the builds alternating verify by verify (the engine reaches the kernel
  through ``block_weights.block_kernels``, swapped between verifies; the LM
  head's products keep the current build, bound when the model was packed).

Both builds must give the same bits on the same inputs (the report says
whether they did; they are checked before timing). For the whole step, run
``bench.verify_cost`` on each revision in turn. Writes kernel_ab.md and .json
to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import specserve.block_weights as block_weights
from specserve.block_weights import (
    BlockWeight,
    block_kernels,
    build_kernels,
    cpu_flags,
    find_blocks,
    quantize_q4_1,
    quantize_q8_0,
)
from specserve.model_loading import default_cache_root
from target_service.engine_threads import serve_on_this_thread

from . import machine
from .gemm_kernels import products
from .verify_cost import DEFAULT_MODEL, SHAPES, forms_verifier, verifies_in_turn

SOURCE = "specserve/kernels/block_gemm.cpp"
PARTS = ("attention", "products", "verify")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.kernel_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernel is the baseline")
    parser.add_argument("--parts", default="attention,products", help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the verify part's model")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--contexts", default="128,512,1024", help="cached tokens before the rows (attention)")
    parser.add_argument("--layers", type=int, default=30, help="arenas and weight copies cycled through")
    parser.add_argument("--reps", type=int, default=30, help="timed passes over the layers per build (median)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/kernel-ab"))
    return parser.parse_args(argv)


def base_kernels(revision: str, current: ModuleType) -> ModuleType:
    """The kernel's source at ``revision``, built as the current one is (cached like it, by source and flags);
    ``current`` itself where the source has not changed since."""
    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], capture_output=True, text=True, check=True).stdout
    if text == Path(SOURCE).read_text():
        return current
    source = default_cache_root() / "kernels" / "base-sources" / revision.replace("/", "_") / "block_gemm.cpp"
    source.parent.mkdir(parents=True, exist_ok=True)
    if not source.exists() or source.read_text() != text:
        source.write_text(text)
    return build_kernels(source, cpu_flags().split())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def in_turn(runs: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds of each run, the runs taking turns (the order flipped every rep), after one untimed pass."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):
        for name in list(runs) if rep % 2 else list(runs)[::-1]:
            start = time.perf_counter()
            runs[name]()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def attention_case(
    builds: dict[str, ModuleType], shape: dict[str, Any], rows: int, context: int, layers: int, reps: int
) -> dict[str, Any]:
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim, slots = shape["head_dim"], context + rows
    g = torch.Generator().manual_seed(rows * 7919 + context)
    arenas = [(torch.randn(kv_heads, slots, dim, generator=g), torch.randn(kv_heads, slots, dim, generator=g))]
    arenas += [(torch.randn(kv_heads, slots, dim), torch.randn(kv_heads, slots, dim)) for _ in range(layers - 1)]
    q, k, v = (torch.randn(rows, n, dim, generator=g) for n in (heads, kv_heads, kv_heads))
    table = torch.tensor([[0, rows, 0, context]], dtype=torch.int64)
    allowed = torch.tril(torch.ones(rows, rows, dtype=torch.bool)).flatten()
    outs = {name: torch.zeros(rows, heads, dim) for name in builds}

    def step(name: str) -> Callable[[], None]:
        def attend() -> None:
            for keys, values in arenas:
                builds[name].attend_rows(q, k, v, keys, values, table, allowed, dim**-0.5, outs[name])

        return attend

    for name in builds:
        step(name)()
    identical = same_bits(outs["base"], outs["current"])
    seconds = in_turn({name: step(name) for name in builds}, reps)
    return {"part": "attention", "rows": rows, "context": context, "identical": identical} | ms(seconds)


def products_case(
    builds: dict[str, ModuleType], shape: dict[str, Any], rows: int, layers: int, reps: int
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rows)
    # Per layer its four products in Q4_1, then the head in Q8_0, as the packaged model's: (kernel entry point,
    # packed blocks, padded out, in); every build reads the same layout.
    weights: list[tuple[str, torch.Tensor, int, int]] = []
    head = products(shape).pop("head (fp32)")
    shapes = [(quantize_q4_1, *dims) for dims in products(shape).values() if dims != head] * layers
    for quantize, out, inputs in [*shapes, (quantize_q8_0, *head)]:
        blocks = find_blocks(quantize(torch.randn(out, inputs, generator=g)))
        assert blocks is not None
        tiles, (code, _, padded, in_features) = BlockWeight(blocks).kernel_args()
        weights.append(("q4_1_linear" if code == 0 else "q8_0_linear", tiles, padded, in_features))
    xs = {n: torch.randn(rows, n, generator=g) for n in {w[3] for w in weights}}
    results: dict[str, list[torch.Tensor]] = {}

    def step(name: str) -> Callable[[], None]:
        def multiply() -> None:
            kernel = builds[name]
            results[name] = [getattr(kernel, entry)(xs[i], tiles, p, i) for entry, tiles, p, i in weights]

        return multiply

    for name in builds:
        step(name)()
    identical = all(same_bits(a, b) for a, b in zip(results["base"], results["current"], strict=True))
    seconds = in_turn({name: step(name) for name in builds}, reps)
    return {"part": "products", "rows": rows, "context": None, "identical": identical} | ms(seconds)


def verify_cases(
    builds: dict[str, ModuleType], model_name: str, sizes: list[int], context: int, reps: int, threads: int
) -> list[dict[str, Any]]:
    """Whole verifies with each build, alternating verify by verify: median seconds per build and size."""
    verifier = forms_verifier(["--model", model_name, "--context", str(context)], sizes, reps + 1, threads)
    current = block_weights.block_kernels

    def using(kernel: ModuleType) -> Callable[[], None]:
        def use() -> None:
            block_weights.block_kernels = lambda: kernel  # type: ignore[assignment]

        return use

    try:
        # The first verifies of each session warm it up. Both builds' sessions verify the same trees on the same
        # context: their commits must agree.
        runs = verifies_in_turn(
            verifier, {name: using(k) for name, k in builds.items()}, sizes, context, reps, 1, context
        )
    finally:
        block_weights.block_kernels = current
        verifier.close()
    return [
        {
            "part": "verify",
            "rows": n,
            "context": context,
            "identical": runs.committed["base"][n] == runs.committed["current"][n],
        }
        | ms({name: statistics.median(runs.seconds[name][n]) for name in builds})
        for n in sizes
    ]


def ms(seconds: dict[str, float]) -> dict[str, float]:
    return {"base_ms": seconds["base"] * 1e3, "current_ms": seconds["current"] * 1e3}


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    m = meta["machine"]
    lines = [
        f"# The block kernel against {meta['base']}'s ({meta['shape']} shapes, fp32)",
        "",
        f"{meta['measured_at']}, {m['cpu_model']} ({', '.join(m['cpu_flags'])}), {m['cpus_available']} CPUs, "
        f"{m['torch_threads']} threads, torch {m['torch_version']}, commit {m['git_commit']}"
        f"{' (dirty)' if m['git_dirty'] else ''}; both builds in one process, in turn, median of {meta['reps']} "
        f"passes over {meta['layers']} layers' arenas or weights (attention, products) or of {meta['reps']} verifies "
        f"(verify: same bits = the same tokens committed).{machine.strain(m)}",
        "",
        "| part | rows | context | base ms | current ms | current / base | same bits |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['part']} | {r['rows']} | {r['context'] if r['context'] is not None else ''} | {r['base_ms']:.2f} | "
        f"{r['current_ms']:.2f} | {r['current_ms'] / r['base_ms']:.2f} | {'yes' if r['identical'] else 'NO'} |"
        for r in results
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    current = block_kernels()
    if current is None:
        raise SystemExit("the block kernel does not build here (x86 with AVX2 and FMA, a compiler)")
    builds = {"base": base_kernels(args.base, current), "current": current}
    shape = SHAPES["smollm2-135m"]
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    parts = [p for p in args.parts.split(",") if p.strip()]
    start = machine.cpu_times()
    meta: dict[str, Any] = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "base": args.base,
        "shape": "smollm2-135m",
        "layers": args.layers,
        "reps": args.reps,
        "machine": machine.describe(),
    }
    results = []
    threads = 0
    with torch.inference_mode():
        for part in parts:
            if part == "attention":
                for context in [int(c) for c in args.contexts.split(",") if c.strip()]:
                    for n in rows:
                        results.append(attention_case(builds, shape, n, context, args.layers, args.reps))
            elif part == "products":
                results += [products_case(builds, shape, n, args.layers, args.reps) for n in rows]
            elif part == "verify":
                # The verifier's engine thread computes on the threads this one hands over (taken once).
                threads = threads or serve_on_this_thread()
                for context in [int(c) for c in args.contexts.split(",") if c.strip()]:
                    results += verify_cases(builds, args.model, rows, context, args.reps, threads)
            else:
                raise SystemExit(f"--parts: unknown part {part!r} (from {', '.join(PARTS)})")
    meta["machine"]["cpu_steal"] = machine.steal_since(start)
    text = markdown(meta, results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kernel_ab.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (args.out_dir / "kernel_ab.md").write_text(text)
    print(text, flush=True)
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
