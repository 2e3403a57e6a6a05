"""bench.structured's pieces without a cluster: 30 prompts with valid schemas, and the report from fake stats."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from bench import structured
from bench.structured import ModeResult, Timing, prompts, write_report
from client import Stats


def _stats(tokens: int, rounds: int, forced: int, finish: str = "eos", prefill_s: float = 0.2) -> Stats:
    return Stats(
        finish,
        10,
        tokens,
        rounds,
        0,
        0,
        0,
        0,
        1.0,
        0.0,
        0.5,
        0.1,
        "",
        num_forced_tokens=forced,
        mask_s=0.001,
        prefill_s=prefill_s,
    )


def test_thirty_prompts_with_valid_distinct_schemas() -> None:
    items = prompts(30)
    assert len(items) == 30 and len({p for p, _ in items}) == 30
    for _, schema in items:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_report_counts_validity_and_speed(tmp_path: Path) -> None:
    schema = prompts(1)[0][1]
    spec, plain, free = (
        ModeResult("constrained speculative"),
        ModeResult("constrained plain"),
        ModeResult("unconstrained speculative"),
    )
    spec.add('{"name": "Al", "age": 3}', _stats(12, 4, 6), schema, 1_000_000, Timing(0.5, 0.5, 4))
    spec.add('{"name": "A', _stats(5, 2, 2, finish="length"), schema, 0, Timing(0.5, 0.5, 3))
    plain.add('{"name": 3}', _stats(10, 10, 0), schema, 0, Timing(0.4, 0.6, 1))
    free.add("text", _stats(24, 8, 0, prefill_s=0.5), None, 0)
    for r in (spec, plain, free):
        r.finish()
    assert (spec.valid, spec.cut_by_length, plain.invalid) == (1, 1, 1)
    assert spec.forced_share == 8 / 17 and spec.tau == 17 / 6
    assert spec.mask_share == 0.001 / 2.0 and spec.ms_per_round == 2.0 / 6 * 1e3
    # After the first chunks: (12 - 4) + (5 - 3) tokens in 1 s, against plain's 9 in 0.6 s.
    assert (spec.decode_tokens_per_s, plain.decode_tokens_per_s) == (10.0, 15.0)
    # Less the prefill: 17 tokens in 2 - 0.4 s, against plain's 10 in 1 - 0.2 s and the free text's 24 in 1 - 0.5 s.
    assert spec.generation_tokens_per_s == 17 / 1.6 and free.generation_tokens_per_s == 48.0
    write_report([spec, plain, free], tmp_path, {"machine_line": "m", "prompts": 2, "max_new_tokens": 8, "date": "d"})
    table = (tmp_path / "structured.md").read_text()
    row = "| constrained speculative | 1/2 | 1 | 0 | 17 | 8.5 | 0.85 | 10.6 | 0.85 | 10.0 | 0.67 | 2.83 | 47% |"
    assert row in table
    assert "tok/s 0.35x, generation tok/s 0.22x, decode tok/s -." in table  # the free text had no client timing


def test_modes_take_turns_prompt_by_prompt_each_going_first_as_often(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, ModeResult]] = []

    def run_mode(address: str, mode: str, items: list, max_new_tokens: int, result: ModeResult) -> ModeResult:
        (item,) = items
        calls.append((item[0], mode, result))
        return result

    monkeypatch.setattr(structured, "run_mode", run_mode)
    items = prompts(6)
    results = structured.interleaved("addr", items, 8)
    assert [r.mode for r in results] == list(structured.MODES)
    assert [prompt for prompt, _, _ in calls] == [prompt for prompt, _ in items for _ in structured.MODES]
    firsts = [calls[i][1] for i in range(0, len(calls), len(structured.MODES))]
    assert sorted(firsts) == sorted(structured.MODES * 2)
    assert all(result is results[structured.MODES.index(mode)] for _, mode, result in calls)
