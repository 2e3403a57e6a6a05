"""Which packed GEMM the verifier's products should run on here: ``python -m bench.gemm_kernels``.

Times every product of a model shape (the fused QKV, O, gate-up and down
projections of each layer, and the fp32 LM head) at 1-16 rows on each CPU
kernel the engine can use: ``F.linear`` (eager), MKL's packed fp32 product
(a pack per row count) and oneDNN's packed product (one pack, hint 8), and,
for the layer products, torch's int8 weight-only product
(``torch._weight_int8pack_mm``: per-channel int8 weights, activations rounded
to bf16, its fast path; the verifier's ``--weights int8`` kernel, ``packed_linear.int8_product``),
and, for the head, FBGEMM's fp32 product over fp16-stored weights (the
verifier's head for a bf16 model, ``packed_linear``'s "fp16"; the head's
weights are drawn bf16-valued here, as a bf16 model's are, for every kernel),
and, in fp32, the block kernel over the same weights rounded to llama.cpp's
blocks (``block_weights``: Q4_1 for the layers, Q8_0 for the head, as the
packaged GGUF model's are; timings do not depend on the values). A
layer product is timed over one copy of the weight per layer, as in a real
step, so the weights come from memory and not from the cache. It also lists
the row counts at which each packed kernel computes a row alike whatever the
count (``packed_linear.row_invariant_rows``), which is what the engine may
run a step at. Writes gemm_kernels.md and .json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specserve.block_weights import block_kernels, quantize_q4_1, quantize_q8_0
from specserve.packed_linear import (
    ONEDNN_HINT,
    PackedLinear,
    Packing,
    candidate_rows,
    has_fp16_weight_products,
    int8_product,
    quantize_int8,
    row_invariant_rows,
)

from .machine import describe
from .verify_cost import SHAPES

ROWS = (1, 2, 4, 8, 16, 32)


def products(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each product's weight (out, in) for a Llama-family shape."""
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * shape["intermediate_size"], hidden),
        "down": (hidden, shape["intermediate_size"]),
        "head (fp32)": (shape["vocab_size"], hidden),
    }


def median_ms(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    run(x)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def kernels(
    weights: list[torch.Tensor], rows: int, int8: bool = False, fp16: bool = False, blocks: str | None = None
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Per kernel, a product over each of ``weights`` in turn, at ``rows`` rows (with ``int8``: also int8 weights;
    with ``fp16``: also fp16-stored ones, which the weights must allow; with ``blocks`` "Q4_1" or "Q8_0": also
    the block kernel over the weights rounded to those blocks)."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    out["F.linear"] = lambda x: [F.linear(x, w) for w in weights][-1]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_HINT) for w in weights]
    out["oneDNN packed"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn][
        -1
    ]
    if weights[0].dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        out["MKL packed"] = lambda x: [
            torch.ops.mkl._mkl_linear(x, p, w, None, rows) for p, w in zip(mkl, weights, strict=True)
        ][-1]
    if int8:
        quantized = [quantize_int8(w) for w in weights]
        out["int8 weight-only"] = lambda x: [int8_product(x, q, s) for q, s in quantized][-1]
    if fp16 and has_fp16_weight_products():
        halves = [PackedLinear(w, None, "fp16", candidate_rows("fp16")) for w in weights]
        out["FBGEMM fp16-weight"] = lambda x: [h(x) for h in halves][-1]
    if blocks and weights[0].dtype == torch.float32 and block_kernels() is not None:
        rounded = quantize_q4_1 if blocks == "Q4_1" else quantize_q8_0
        packed = [PackedLinear(rounded(w), None, "blocks", candidate_rows("blocks")) for w in weights]
        out[f"GGUF-block {blocks}"] = lambda x: [p(x) for p in packed][-1]
    return out


def measure(shape: dict[str, Any], dtype: torch.dtype, reps: int, head: bool) -> list[dict[str, Any]]:
    """Timings and row invariance of each layer product in ``dtype`` and, with ``head``, of the fp32 head."""
    layers = shape["num_hidden_layers"]
    results = []
    for name, (out_features, in_features) in products(shape).items():
        is_head = name.startswith("head")
        if is_head and not head:
            continue
        kind = torch.float32 if is_head else dtype
        copies = 1 if is_head else layers
        weights = [torch.randn(out_features, in_features).to(kind) for _ in range(copies)]
        if is_head:  # a bf16 model's head, widened: what the verifier's fp16-weight head takes
            weights = [w.bfloat16().float() for w in weights]
        for rows in ROWS:
            x = torch.randn(rows, in_features).to(kind)
            block_format = "Q8_0" if is_head else "Q4_1"
            for kernel, run in kernels(weights, rows, int8=not is_head, fp16=is_head, blocks=block_format).items():
                ms = median_ms(run, x, reps) / copies
                results.append({"product": name, "dtype": str(kind)[6:], "rows": rows, "kernel": kernel, "ms": ms})
        packings: tuple[Packing, ...] = ("onednn", "mkl", "blocks") if kind == torch.float32 else ("onednn",)
        for packing in packings + (("fp16",) if is_head else ()):
            if packing == "mkl" and not torch.backends.mkl.is_available():
                continue
            if packing == "fp16" and not has_fp16_weight_products():
                continue
            if packing == "blocks" and block_kernels() is None:
                continue
            candidates = candidate_rows(packing)
            kept = row_invariant_rows(packing, kind, out_features, in_features, candidates)
            dropped = sorted(set(candidates) - set(kept))
            results.append({"product": name, "dtype": str(kind)[6:], "kernel": packing, "not_row_invariant": dropped})
    return results


def markdown(machine: dict[str, Any], shape_name: str, results: list[dict[str, Any]]) -> str:
    lines = [
        f"# Packed GEMM kernels for {shape_name}'s products",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpus_available']} CPUs, flags {', '.join(machine['cpu_flags'])};"
        f" torch {machine['torch_version']}, {machine['torch_threads']} threads;"
        f" load average at start {machine['load_average_at_start']}.",
        "Milliseconds per product (median; a layer product over one weight copy per layer, so from memory).",
        "",
    ]
    timed = [r for r in results if "ms" in r]
    for dtype in dict.fromkeys(r["dtype"] for r in timed):
        for product in dict.fromkeys(r["product"] for r in timed if r["dtype"] == dtype):
            rows = [r for r in timed if r["dtype"] == dtype and r["product"] == product]
            names = list(dict.fromkeys(r["kernel"] for r in rows))
            lines += [f"## {product}, {dtype}", "", "| rows | " + " | ".join(names) + " |"]
            lines.append("|---" * (len(names) + 1) + "|")
            for count in ROWS:
                cells = [f"{r['ms']:.3f}" for name in names for r in rows if r["rows"] == count and r["kernel"] == name]
                lines.append(f"| {count} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["## Row counts that round a row unlike the largest count (the engine pads past them)", ""]
    lines += ["| product | dtype | kernel | counts |", "|---|---|---|---|"]
    for r in results:
        if "not_row_invariant" in r:
            lines.append(f"| {r['product']} | {r['dtype']} | {r['kernel']} | {r['not_row_invariant'] or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gemm_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/gemm-kernels"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    machine = describe()
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        for index, dtype in enumerate(args.dtypes.split(",")):
            results += measure(SHAPES[args.shape], getattr(torch, dtype), args.reps, head=index == 0)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = markdown(machine, args.shape, results)
    (args.out_dir / "gemm_kernels.md").write_text(report)
    (args.out_dir / "gemm_kernels.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
