"""llguidance against xgrammar on this CPU, at SmolLM2's vocabulary (issue #33's choice of grammar engine).

For each library: tokenizer set-up time, compile time of a mid-size JSON schema
(cold, caches off), mask time per token while walking a valid document token by
token, and the cost of the two ways a tree verifier keeps grammar state per path
(rollback after trying a path, and forking a matcher per branch).

    .venv/bin/python -m bench.grammar_libs --out-dir bench/results/structured

xgrammar is not a dependency (it pulls in torch, triton and a TVM runtime);
install it apart to measure it, e.g. ``pip install --no-deps --target /tmp/xgr
xgrammar apache-tvm-ffi`` and run with ``--xgrammar-path /tmp/xgr``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A mid-size schema: nested objects, an array of objects, enums, numbers, free strings, a pattern.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "express": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "express", "notes"],
    "additionalProperties": False,
}

DOCUMENT: dict[str, Any] = {
    "order_id": "ABC-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [
        {"sku": "KB-001", "quantity": 2, "unit_price": 49.5},
        {"sku": "MS-042", "quantity": 1, "unit_price": 19.99},
    ],
    "express": True,
    "notes": None,
}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _summary_us(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {
        "mean_us": round(statistics.fmean(us), 1),
        "p50_us": round(us[len(us) // 2], 1),
        "p90_us": round(us[int(len(us) * 0.9)], 1),
        "max_us": round(us[-1], 1),
    }


def measure_llguidance(hf_tokenizer: Any, tokens: list[int], repeats: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    ll_tok, tok_s = _timed(lambda: llguidance.hf.from_tokenizer(hf_tokenizer))
    # As the service compiles schemas: no free whitespace, json.dumps' separators (more tokens forced).
    options: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compiles = []
    for _ in range(repeats):
        grammar, s1 = _timed(lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options))
        matcher, s2 = _timed(lambda: llguidance.LLMatcher(ll_tok, grammar, log_level=0))  # noqa: B023
        compiles.append(s1 + s2)
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, ll_tok.vocab_size)
    mask_times: list[float] = []
    ff_times: list[float] = []
    forced = 0
    for token in tokens:
        _, s = _timed(lambda: fill_next_token_bitmask(matcher, mask, 0))
        mask_times.append(s)
        allowed = int(np.unpackbits(mask.view(np.uint8), bitorder="little").sum())
        _, s = _timed(matcher.compute_ff_tokens)
        ff_times.append(s)
        forced += allowed == 1
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
    rollback_times = []
    for _ in range(repeats):
        _, s = _timed(lambda: matcher.rollback(8))
        rollback_times.append(s)
        matcher.consume_tokens(tokens[-8:])
    fork_times = [_timed(matcher.deep_copy)[1] for _ in range(repeats)]
    return {
        "library": f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else ''}".strip(),
        "vocab_size": ll_tok.vocab_size,
        "tokenizer_setup_ms": round(tok_s * 1e3, 1),
        "compile_ms_median": round(statistics.median(compiles) * 1e3, 2),
        "compile_ms_first": round(compiles[0] * 1e3, 2),
        "mask_per_token": _summary_us(mask_times),
        "forced_ff_tokens_per_step": _summary_us(ff_times),
        "steps_with_one_allowed_token": forced,
        "rollback_8_tokens": _summary_us(rollback_times),
        "fork_deep_copy": _summary_us(fork_times),
        "rollback": "LLMatcher.rollback(n) (bounded by the parser's history), deep_copy() forks",
    }


def measure_xgrammar(hf_tokenizer: Any, tokens: list[int], repeats: int) -> dict[str, Any]:
    import xgrammar as xgr

    info, tok_s = _timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer)))
    compiles = []
    compiled = None
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled, s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))  # noqa: B023
        compiles.append(s)
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    mask_times: list[float] = []
    forced = 0
    for token in tokens:
        _, s = _timed(lambda: matcher.fill_next_token_bitmask(mask))
        mask_times.append(s)
        forced += int(sum(bin(int(v) & 0xFFFFFFFF).count("1") for v in mask[0].tolist())) == 1
        assert matcher.accept_token(token)
    rollback_times = []
    for _ in range(repeats):
        _, s = _timed(lambda: matcher.rollback(8))
        rollback_times.append(s)
        for t in tokens[-8:]:
            matcher.accept_token(t)
    fork = getattr(matcher, "fork", None)
    fork_times = [_timed(fork)[1] for _ in range(repeats)] if fork else []
    return {
        "library": "xgrammar " + _version("xgrammar"),
        "vocab_size": info.vocab_size,
        "tokenizer_setup_ms": round(tok_s * 1e3, 1),
        "compile_ms_median": round(statistics.median(compiles) * 1e3, 2),
        "compile_ms_first": round(compiles[0] * 1e3, 2),
        "mask_per_token": _summary_us(mask_times),
        "steps_with_one_allowed_token": forced,
        "rollback_8_tokens": _summary_us(rollback_times),
        "fork": _summary_us(fork_times) if fork_times else "no fork(); one matcher per branch means recompiling",
        "rollback": "GrammarMatcher.rollback(n) up to max_rollback_tokens",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/structured"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xgrammar-path", default="", help="a folder holding xgrammar (it is no dependency)")
    args = parser.parse_args()

    from specserve.model_loading import default_cache_root, load_tokenizer, materialize, resolve_model

    hf_tokenizer = load_tokenizer(materialize(resolve_model("smollm2"), default_cache_root()))
    tokens = hf_tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, shared 2-core CPU (other jobs running)",
        "document_tokens": len(tokens),
        "schema": SCHEMA,
        "libraries": [measure_llguidance(hf_tokenizer, tokens, args.repeats)],
    }
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    try:
        results["libraries"].append(measure_xgrammar(hf_tokenizer, tokens, args.repeats))
    except ImportError as exc:
        results["libraries"].append({"library": "xgrammar", "error": f"not importable: {exc}"})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "grammar_libs.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["libraries"], indent=2))


if __name__ == "__main__":
    main()
