"""What a forced row saves: one verifier step under token masks, with rows that allow one token or many.

Structured output: a row whose mask allows one token needs no logits (greedy and sampling can only pick that
token), so it skips the LM head. This times ``Verifier.verify`` on the real target at a 512-token context for
a 1-row step (plain decoding) whose mask allows many tokens or one, and a 6-row chain with none, half or all of
its rows forced. The cases take turns, so a change in the machine's speed reaches each alike; medians.

    python -m bench.forced_rows                                          # 50 repetitions of each case
    python -m bench.forced_rows --repetitions 3 --out-dir /tmp/forced    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine
from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks, row_bytes
from specserve.token_tree import TokenTree
from target_service.main import build_verifier, parse_config
from target_service.verifier import Verifier

CONTEXT = 512
FORCED_TOKEN = 240  # the chain's own token, so a forced chain is accepted whole
WARM_UP = 3
CHAIN = TokenTree.chain([FORCED_TOKEN] * 5)
# name: (tree, the rows whose mask allows FORCED_TOKEN alone; the others allow the first half of the vocabulary)
CASES: dict[str, tuple[TokenTree, tuple[int, ...]]] = {
    "1 row, many allowed": (TokenTree(), ()),
    "1 row, one allowed": (TokenTree(), (0,)),
    "6 rows, none forced": (CHAIN, ()),
    "6 rows, 3 forced": (CHAIN, (0, 2, 4)),
    "6 rows, all forced": (CHAIN, (0, 1, 2, 3, 4, 5)),
}


def masks(vocab_size: int, rows: int, forced: tuple[int, ...]) -> TokenMasks:
    bits = np.zeros((rows, row_bytes(vocab_size)), dtype=np.uint8)
    bits[:, : vocab_size // 16] = 0xFF
    for row in forced:
        bits[row] = 0
        bits[row, FORCED_TOKEN >> 3] = 1 << (FORCED_TOKEN & 7)
    return TokenMasks(bits)


def measure(verifier: Verifier, repetitions: int) -> dict[str, list[float]]:
    """Seconds of each case's verify calls, the cases in turn; the first WARM_UP rounds are dropped."""
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, CONTEXT)]
    verifier.prefill("forced-rows", prompt, SamplingParams())
    committed = len(prompt)
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    for repetition in range(WARM_UP + repetitions):
        for name, (tree, forced) in CASES.items():
            row_masks = masks(verifier.vocab_size, len(tree) + 1, forced)
            started = time.perf_counter()
            result = verifier.verify("forced-rows", committed, tree, token_masks=row_masks)
            if repetition >= WARM_UP:
                seconds[name].append(time.perf_counter() - started)
            committed += len(result.committed)
    verifier.release("forced-rows")
    return seconds


def report(seconds: dict[str, list[float]], meta: dict[str, Any]) -> str:
    host = meta["machine"]
    lines = [
        "# A verifier step with forced rows (token masks that allow one token)",
        "",
        f"{host['cpu_model']}, {host['cpus_available']} CPUs available, flags {', '.join(host['cpu_flags'])}; "
        f"torch {host['torch_version']}, {host['torch_threads']} threads; SmolLM2-135M in {meta['dtype']}; "
        f"{CONTEXT}-token context; median of {meta['repetitions']} (cases in turn); {meta['date']}. "
        "Made by `python -m bench.forced_rows`.",
        "",
        "| case | median ms | p10 ms | p90 ms | x its unforced case |",
        "|---|---|---|---|---|",
    ]
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, values in seconds.items():
        base = medians["1 row, many allowed" if name.startswith("1 row") else "6 rows, none forced"]
        p10, p90 = np.percentile(values, [10, 90])
        lines.append(
            f"| {name} | {medians[name] * 1e3:.1f} | {p10 * 1e3:.1f} | {p90 * 1e3:.1f} | {medians[name] / base:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=50)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/forced-rows"))
    args = parser.parse_args(argv)
    config, _ = parse_config(["--dtype", args.dtype, "--no-profile-cost", "--no-throughput-guard"])
    verifier = build_verifier(config)
    meta = {
        "machine": machine.describe(),
        "dtype": verifier.dtype,
        "repetitions": args.repetitions,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        seconds = measure(verifier, args.repetitions)
    finally:
        verifier.close()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "forced_rows.json").write_text(json.dumps({"meta": meta, "seconds": seconds}, indent=1) + "\n")
    text = report(seconds, meta)
    (args.out_dir / "forced_rows.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
