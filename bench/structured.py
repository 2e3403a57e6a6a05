"""Structured output with speculation (issue #33): validity, speed and tau through the three processes.

30 extraction and function-argument prompts, each with its own JSON schema (flat objects, nested arrays, enums,
numbers, free strings), greedy, in three modes over gRPC, taking turns prompt by prompt: constrained speculative,
constrained plain (speculation off: the baseline), unconstrained speculative (the same prompts, no schema). For
each: outputs that validate with ``jsonschema`` (those cut by max tokens counted apart), tokens/s, tau, the share
of tokens the grammar forced, and the mask time per round.

Three rates. tok/s over each request's whole time; generation tok/s over that time less the verifier's prefill
of the prompt (``Stats.prefill_s``); decode tok/s from the request's first chunk on, on the client. The prefill
is the same work for a prompt whatever follows it, and a constrained answer (a short JSON object) is a few times
shorter than the free text the same prompt gets unconstrained, so the whole-time rate charges the constrained
modes several times more prefill per token; generation tok/s compares what the modes do after it. Decode tok/s
also leaves out each request's first round, which under a constraint commits the most (the grammar's opening
tokens, ``{"name": "``, come with it). The JSON also keeps each mode's drafting and verifying time and its
pre-draft hits (trees the drafter had ready when the round began).

    make bench-structured                                            # the full run: 30 prompts
    make bench-structured BENCH_STRUCTURED_ARGS="--prompts 2 --max-new-tokens 64 --out-dir /tmp/structured"
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from bench import machine
from client import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.local_cluster import LocalCluster, free_port

MODES = ("constrained speculative", "constrained plain", "unconstrained speculative")
RATES = (
    ("tok/s", "tokens_per_s"),
    ("generation tok/s", "generation_tokens_per_s"),
    ("decode tok/s", "decode_tokens_per_s"),
)
_STR = {"type": "string", "maxLength": 40}
_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person",
        {"type": "object", "properties": {"name": _STR, "age": {"type": "integer"}}, "required": ["name", "age"]},
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {"title": _STR, "author": _STR, "year": {"type": "integer"}},
            "required": ["title", "author", "year"],
        },
    ),
    (
        "a product review",
        {
            "type": "object",
            "properties": {
                "product": _STR,
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
            },
            "required": ["product", "rating", "sentiment"],
        },
    ),
    (
        "a weather report",
        {
            "type": "object",
            "properties": {
                "city": _STR,
                "temperature_c": {"type": "number"},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            },
            "required": ["city", "temperature_c", "conditions"],
        },
    ),
    (
        "a shopping list",
        {
            "type": "object",
            "properties": {"items": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}},
            "required": ["items"],
        },
    ),
    (
        "a function call to get_weather",
        {
            "type": "object",
            "properties": {
                "location": _STR,
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["location", "unit", "days"],
        },
    ),
    (
        "a function call to send_email",
        {
            "type": "object",
            "properties": {"to": _STR, "subject": _STR, "urgent": {"type": "boolean"}},
            "required": ["to", "subject", "urgent"],
        },
    ),
    (
        "an order with line items",
        {
            "type": "object",
            "properties": {
                "order_id": _STR,
                "lines": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"sku": _STR, "qty": {"type": "integer"}},
                        "required": ["sku", "qty"],
                    },
                },
            },
            "required": ["order_id", "lines"],
        },
    ),
    (
        "a calendar event",
        {
            "type": "object",
            "properties": {
                "title": _STR,
                "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "attendees": {"type": "array", "items": _STR, "maxItems": 3},
            },
            "required": ["title", "day", "hour", "attendees"],
        },
    ),
    (
        "a city",
        {
            "type": "object",
            "properties": {
                "name": _STR,
                "country": _STR,
                "population_millions": {"type": "number"},
                "is_capital": {"type": "boolean"},
            },
            "required": ["name", "country", "population_millions", "is_capital"],
        },
    ),
]
_SUBJECTS = [
    "Alice Smith is a 34 year old engineer from Lyon who ordered two keyboards (KB-1) on Monday at 9.",
    "The Hobbit by J. R. R. Tolkien came out in 1937; readers call it a wonderful, five-star book.",
    "In Oslo it is -3 degrees and snowing; Bob wants the 3 day forecast in celsius and to email the team.",
]


def prompts(count: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` (prompt, schema) pairs: each schema with each subject, 30 in all."""
    out = []
    for subject in _SUBJECTS:
        for what, schema in _SCHEMAS:
            schema = {**schema, "additionalProperties": False}
            out.append((f"{subject}\nExtract {what} from the text above as JSON.", schema))
    return out[:count]


@dataclass(frozen=True)
class Timing:
    """One request's client-side times: to its first chunk (the prefill and first round), and from there on."""

    first_chunk_s: float
    after_first_s: float
    first_chunk_tokens: int


@dataclass
class ModeResult:
    mode: str
    outputs: int = 0
    valid: int = 0
    cut_by_length: int = 0
    invalid: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    forced: int = 0
    mask_ns: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0  # the verifier's, summed: the same work per prompt in every mode
    drafter_trees: int = 0
    predraft_hits: int = 0
    first_chunk_s: float = 0.0  # client side, summed: prefill and the first round of each request
    after_first_s: float = 0.0  # client side, summed: from each request's first chunk to its stats
    after_first_tokens: int = 0
    tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0  # over the requests' time less their prefill
    decode_tokens_per_s: float = 0.0  # after the first chunk: the prefill's fixed cost left out
    tau: float = 0.0
    forced_share: float = 0.0
    ms_per_round: float = 0.0
    mask_ms_per_round: float = 0.0
    mask_share: float = 0.0  # of the requests' time, computing masks
    texts: list[str] = field(default_factory=list)

    def add(
        self, text: str, stats: Stats, schema: dict[str, Any] | None, mask_ns: int, timing: Timing | None = None
    ) -> None:
        self.outputs += 1
        self.tokens += stats.num_generated_tokens
        self.seconds += stats.total_s
        self.rounds += stats.num_rounds
        self.forced += stats.num_forced_tokens
        self.mask_ns += mask_ns
        self.draft_tokens += stats.num_draft_tokens
        self.accepted += stats.num_accepted_tokens
        self.draft_s += stats.draft_s
        self.verify_s += stats.verify_s
        self.prefill_s += stats.prefill_s
        self.drafter_trees += stats.num_drafter_trees
        self.predraft_hits += stats.num_predraft_hits
        if timing is not None:
            self.first_chunk_s += timing.first_chunk_s
            self.after_first_s += timing.after_first_s
            self.after_first_tokens += stats.num_generated_tokens - timing.first_chunk_tokens
        self.texts.append(text)
        if schema is None:
            return
        if stats.finish_reason == "length":
            self.cut_by_length += 1
            return
        try:
            jsonschema.validate(json.loads(text), schema)
            self.valid += 1
        except (ValueError, jsonschema.ValidationError):
            self.invalid += 1

    def finish(self) -> None:
        self.tokens_per_s = self.tokens / self.seconds if self.seconds else 0.0
        generating = self.seconds - self.prefill_s
        self.generation_tokens_per_s = self.tokens / generating if generating > 0 else 0.0
        self.decode_tokens_per_s = self.after_first_tokens / self.after_first_s if self.after_first_s else 0.0
        self.tau = self.tokens / self.rounds if self.rounds else 0.0
        self.forced_share = self.forced / self.tokens if self.tokens else 0.0
        self.ms_per_round = self.seconds / self.rounds * 1e3 if self.rounds else 0.0
        self.mask_ms_per_round = self.mask_ns / self.rounds / 1e6 if self.rounds else 0.0
        self.mask_share = self.mask_ns / 1e9 / self.seconds if self.seconds else 0.0


def run_mode(
    address: str,
    mode: str,
    items: list[tuple[str, dict[str, Any]]],
    max_new_tokens: int,
    result: ModeResult | None = None,
) -> ModeResult:
    """Run ``items`` in ``mode``, one request at a time, adding to ``result`` (a new one when None)."""
    result = result if result is not None else ModeResult(mode)
    constrained = mode != "unconstrained speculative"
    with SpecserveClient(address, timeout_s=600) as client:
        for prompt, schema in items:
            params = GenerationParams(
                max_new_tokens=max_new_tokens,
                json_schema=json.dumps(schema) if constrained else None,
                speculation="off" if mode == "constrained plain" else "auto",
            )
            started = time.perf_counter()
            first: tuple[float, int] | None = None
            events: list[TextChunk | Stats] = []
            for event in client.generate_chat([("user", prompt)], params):
                if first is None and isinstance(event, TextChunk):
                    first = (time.perf_counter(), len(event.token_ids))
                events.append(event)
            ended = time.perf_counter()
            stats = events[-1]
            assert isinstance(stats, Stats)
            text = "".join(e.text for e in events if isinstance(e, TextChunk))
            at, first_tokens = first if first is not None else (ended, 0)
            timing = Timing(at - started, ended - at, first_tokens)
            result.add(text, stats, schema if constrained else None, round(stats.mask_s * 1e9), timing)
    result.finish()
    return result


def interleaved(address: str, items: list[tuple[str, dict[str, Any]]], max_new_tokens: int) -> list[ModeResult]:
    """Each prompt in every mode before the next prompt, the order rotating so that each mode goes first as
    often as the others: a host that slows down for a while (a shared machine) slows every mode alike, where
    running the modes one after the other charged it to whichever ran then."""
    results = {mode: ModeResult(mode) for mode in MODES}
    for index, item in enumerate(items):
        turn = index % len(MODES)
        for mode in (*MODES[turn:], *MODES[:turn]):
            run_mode(address, mode, [item], max_new_tokens, results[mode])
    return [results[mode] for mode in MODES]


def write_report(results: list[ModeResult], out_dir: Path, meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "structured.json").write_text(json.dumps({**meta, "modes": [asdict(r) for r in results]}, indent=2))
    base = next(r for r in results if r.mode == "constrained plain")

    def x(r: ModeResult, rate: str, against: ModeResult = base) -> str:
        ours, theirs = getattr(r, rate), getattr(against, rate)
        return f"{ours / theirs:.2f}" if theirs else "-"

    lines = [
        "# Structured output: constrained speculative vs constrained plain vs unconstrained speculative",
        "",
        f"{meta['machine_line']}; {meta['prompts']} prompts, greedy, max {meta['max_new_tokens']} new tokens; "
        f"{meta['date']}. Made by `bench/structured.py`.",
        "",
        "| mode | valid | cut by length | invalid | tokens | tok/s | x plain | generation tok/s | x plain "
        "| decode tok/s | x plain | tau | forced share | ms/round | mask ms/round | mask share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        valid = f"{r.valid}/{r.outputs}" if r.mode != "unconstrained speculative" else "-"
        lines.append(
            f"| {r.mode} | {valid} | {r.cut_by_length} | {r.invalid} | {r.tokens} | {r.tokens_per_s:.1f} | "
            f"{x(r, 'tokens_per_s')} | {r.generation_tokens_per_s:.1f} | {x(r, 'generation_tokens_per_s')} | "
            f"{r.decode_tokens_per_s:.1f} | {x(r, 'decode_tokens_per_s')} | {r.tau:.2f} | "
            f"{r.forced_share:.0%} | {r.ms_per_round:.0f} | {r.mask_ms_per_round:.2f} | {r.mask_share:.1%} |"
        )
    spec = next(r for r in results if r.mode == "constrained speculative")
    free = next(r for r in results if r.mode == "unconstrained speculative")
    ratios = [(name, x(spec, rate, free)) for name, rate in RATES]
    lines += [
        "",
        "Constrained against unconstrained speculative: "
        + ", ".join(f"{name} {ratio}{'x' if ratio != '-' else ''}" for name, ratio in ratios)
        + ".",
        "",
        "tok/s: generated tokens over the requests' whole time on the coordinator (prefill included); generation "
        "tok/s: over that time less the verifier's prefill of each prompt (the same work in every mode); decode "
        "tok/s: tokens after each request's first chunk over the time from it to the end, on the client (the "
        "prefill and the first round left out); mask share: of the requests' time, computing token masks.",
    ]
    (out_dir / "structured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def machine_line(host: dict[str, Any], verifier_args: Sequence[str], drafter_args: Sequence[str] = ()) -> str:
    """The report's one line on where it ran: CPU, the CPUs this process may use, the load when it started, and
    the services' extra flags."""
    load = host.get("load_average_at_start")
    line = f"{host['cpu_model']}, {host['cpus_available']} CPUs available"
    if load:
        line += f", load {load[0]:.1f} at the start"
    if verifier_args:
        line += f", verifier {' '.join(verifier_args)}"
    if drafter_args:
        line += f", drafter {' '.join(drafter_args)}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/structured"))
    parser.add_argument("--verifier-arg", action="append", default=[], help="extra verifier flag (repeatable)")
    parser.add_argument("--drafter-arg", action="append", default=[], help="extra drafter flag (repeatable)")
    args = parser.parse_args()
    items = prompts(args.prompts)
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=args.out_dir / "tmp" / "logs")
    # The three modes run each prompt in turn: none may start from another's kept cache (bench.cluster).
    cluster.extra_verifier_args = ["--kept-prefixes", "0", *args.verifier_arg]
    cluster.extra_drafter_args = args.drafter_arg
    with cluster:
        # Warm-up (each mode's step sizes, the grammar engine's tokenizer), then the three modes.
        for mode in MODES:
            run_mode(cluster.coordinator_address, mode, items[:1], 16)
        results = interleaved(cluster.coordinator_address, items, args.max_new_tokens)
    host = machine.describe()
    meta = {
        "machine": host,
        "machine_line": machine_line(host, args.verifier_arg, args.drafter_arg),
        "verifier_args": args.verifier_arg,
        "drafter_args": args.drafter_arg,
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "median_output_chars": statistics.median([len(t) for r in results for t in r.texts] or [0]),
    }
    write_report(results, args.out_dir, meta)


if __name__ == "__main__":
    main()
